//! Properties of the hierarchy walk (`shaper_common::hierarchy`), on random three-level
//! trees under random overload:
//! - every class passes no more than its ceiling allows over any window (cburst + ceil ×
//!   window), plus the bursts of the classes below it, whose guaranteed traffic it
//!   carries in debt (children's rates sum to at most the parent's);
//! - what a class lends (its rate word took the packet) stays within its own rate;
//! - a class whose rate and ceiling words both have room is never refused, whatever its
//!   siblings borrowed;
//! - a refused packet leaves every word as it found it (up to the idle refill).
//!
//! Each case counts refusals and borrowing, and the run asserts most cases saw both (a
//! bound checked only while everything passes proves nothing).

mod support;

use proptest::prelude::*;
use shaper_common::{
    bucket::ticks,
    conform,
    hierarchy::{ModelClass, Outcome, TreeModel},
    ByteCost,
};
use std::cell::Cell;
use std::collections::HashMap;

const CASES: u32 = 400;

/// Tree: 0 is the root; 1 and 2 its children; 3 and 4 children of 1; 5 a per-flow class
/// under 2. Rates in kbit/s as drawn.
#[derive(Debug, Clone)]
struct Case {
    root: u64,
    /// Children's guaranteed shares of the root's rate (they sum to at most 1).
    shares: [f64; 4],
    ceil_fraction: [f64; 5],
    bursts: [u64; 6],
    per_flow_rate: u64,
    /// (gap ns, bytes, class, flow)
    arrivals: Vec<(u64, u64, usize, u8)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1_000u64..200_000,
        [0.05f64..0.5, 0.05f64..0.5, 0.1f64..0.5, 0.1f64..0.5],
        [
            0.3f64..1.0,
            0.3f64..1.0,
            0.3f64..1.0,
            0.3f64..1.0,
            0.3f64..1.0,
        ],
        [
            1514u64..40_000,
            1514u64..40_000,
            1514u64..40_000,
            1514u64..40_000,
            1514u64..40_000,
            1514u64..40_000,
        ],
        0.05f64..0.6,
        prop::collection::vec((0.0f64..2.0, 64u64..1515, 1usize..6, 0u8..40), 500..1500),
    )
        .prop_map(|(root, shares, ceil_fraction, bursts, flow_share, raw)| {
            // Offered about 3x the root's rate, so the tree is overloaded.
            let mean_gap_ns = 1514.0 * 8.0 * 1e9 / (root as f64 * 1000.0) / 3.0;
            Case {
                root,
                shares,
                ceil_fraction,
                bursts,
                per_flow_rate: ((root as f64 * flow_share) as u64).max(8),
                arrivals: raw
                    .into_iter()
                    .map(|(gap, bytes, class, flow)| {
                        ((gap * mean_gap_ns) as u64, bytes, class, flow)
                    })
                    .collect(),
            }
        })
}

fn kbit(rate: u64) -> u64 {
    rate * 1000
}

/// The tree of a case, as (model, rate bit/s, burst bytes, ceil bit/s, cburst bytes) per class.
fn build(case: &Case) -> (TreeModel, Vec<(u64, u64, u64, u64)>) {
    let root = kbit(case.root);
    // 1 and 2 share the root; 3 and 4 share 1.
    let r1 = (root as f64 * case.shares[0]) as u64;
    let r2 = (root as f64 * case.shares[1]) as u64;
    let r3 = (r1 as f64 * case.shares[2]) as u64;
    let r4 = (r1 as f64 * case.shares[3]) as u64;
    let ceil = |parent_ceil: u64, rate: u64, fraction: f64| {
        ((parent_ceil as f64 * fraction) as u64).max(rate)
    };
    let c1 = ceil(root, r1, case.ceil_fraction[0]);
    let c2 = ceil(root, r2, case.ceil_fraction[1]);
    let c3 = ceil(c1, r3, case.ceil_fraction[2]);
    let c4 = ceil(c1, r4, case.ceil_fraction[3]);
    let flows = kbit(case.per_flow_rate);
    let b = case.bursts;
    let settings = vec![
        (root, b[0], root, b[0]),
        (r1, b[1], c1, b[1]),
        (r2, b[2], c2, b[2]),
        (r3, b[3], c3, b[3]),
        (r4, b[4], c4, b[4]),
        (flows, b[5], flows, b[5]),
    ];
    let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2)];
    let mut model = TreeModel::default();
    for (id, &(rate, burst, ceil, cburst)) in settings.iter().enumerate() {
        model.classes[id] = ModelClass {
            parent: parents[id],
            rate: ByteCost::new(rate, burst),
            ceil: ByteCost::new(ceil, cburst),
            per_key: id == 5,
            ..ModelClass::default()
        };
    }
    (model, settings)
}

/// Bytes allowed over `window_ns` at `rate` with `burst` (rounded up a byte).
fn allowance(rate: u64, burst: u64, window_ns: u64) -> u128 {
    burst as u128 + (rate as u128 * window_ns as u128).div_ceil(8 * 1_000_000_000) + 1
}

#[test]
fn hierarchy_bounds_hold_under_overload() {
    let mut runner = support::deterministic_runner(CASES);
    let (refusing, borrowing) = (Cell::new(0u32), Cell::new(0u32));
    runner
        .run(&case(), |case| {
            let (mut model, settings) = build(&case);
            // The classes below each one that can lend (5 is per flow: it only borrows).
            let lenders_below: [&[usize]; 6] = [&[1, 2, 3, 4], &[3, 4], &[], &[], &[], &[]];
            let mut flows: HashMap<u8, u64> = HashMap::new();
            // Per class: (time, bytes) passed through it; and what it lent.
            let mut passed: Vec<Vec<(u64, u64)>> = vec![Vec::new(); 6];
            let mut lent: Vec<Vec<(u64, u64)>> = vec![Vec::new(); 6];
            let mut per_flow: HashMap<u8, Vec<(u64, u64)>> = HashMap::new();
            let (mut now, mut refused, mut borrowed) = (1_000_000_000u64, 0, 0);
            for &(gap, bytes, class, flow) in &case.arrivals {
                now += gap;
                let (path, depth) = model.path(class);
                // A class with room in both its words is never refused.
                let c = model.classes[class];
                let own_room = !c.per_key
                    && conform(c.rate_tat, now, bytes, &c.rate).is_some()
                    && conform(c.ceil_tat, now, bytes, &c.ceil).is_some();
                let before = model.classes;
                let key = flows.entry(flow).or_insert(0);
                let key_before = *key;
                let outcome = model.admit(class, (class == 5).then_some(key), now, bytes);
                match outcome {
                    Outcome::Lent { level } => {
                        if level > 0 {
                            borrowed += 1;
                        }
                        lent[path[level]].push((now, bytes));
                        for &id in &path[..depth] {
                            passed[id].push((now, bytes));
                        }
                        if class == 5 {
                            per_flow.entry(flow).or_default().push((now, bytes));
                        }
                    }
                    Outcome::Refused { .. } => {
                        refused += 1;
                        prop_assert!(!own_room, "class {class} refused with room of its own");
                        let idle = ticks(now);
                        for (id, was) in before.iter().enumerate() {
                            let after = model.classes[id];
                            prop_assert_eq!(after.rate_tat, was.rate_tat, "class {} rate word", id);
                            let refilled = was.ceil_tat < idle && after.ceil_tat == idle;
                            prop_assert!(
                                after.ceil_tat == was.ceil_tat || refilled,
                                "class {} ceil word",
                                id
                            );
                        }
                        if class == 5 {
                            let after = flows[&flow];
                            prop_assert!(
                                after == key_before || (key_before < idle && after == idle),
                                "flow word"
                            );
                        }
                    }
                }
            }
            // Windows starting at every 37th packet through the class, ending at each later one.
            let check = |series: &[(u64, u64)],
                         rate: u64,
                         burst: u64,
                         what: &str|
             -> Result<(), TestCaseError> {
                for start in (0..series.len()).step_by(37) {
                    let mut sum = 0u128;
                    for &(at, bytes) in &series[start..] {
                        sum += bytes as u128;
                        let window = at - series[start].0;
                        prop_assert!(
                            sum <= allowance(rate, burst, window),
                            "{}: {} bytes in {} ns > {} at {} bit/s, burst {}",
                            what,
                            sum,
                            window,
                            allowance(rate, burst, window),
                            rate,
                            burst
                        );
                    }
                }
                Ok(())
            };
            let (flow_rate, flow_burst, _, _) = settings[5];
            for series in per_flow.values() {
                check(series, flow_rate, flow_burst, "a flow of class 5")?;
            }
            for id in 0..5 {
                let (rate, burst, ceil, cburst) = settings[id];
                let carried: u64 = lenders_below[id]
                    .iter()
                    .map(|&below| settings[below].1)
                    .sum();
                check(
                    &passed[id],
                    ceil,
                    cburst + carried,
                    &format!("class {id} ceiling"),
                )?;
                check(&lent[id], rate, burst, &format!("class {id} lent"))?;
            }
            if refused > 0 {
                refusing.set(refusing.get() + 1);
            }
            if borrowed > 0 {
                borrowing.set(borrowing.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    println!(
        "{} of {CASES} cases refused packets, {} borrowed",
        refusing.get(),
        borrowing.get()
    );
    assert!(refusing.get() > CASES * 9 / 10);
    assert!(borrowing.get() > CASES * 9 / 10);
}

/// Two children (rate 3, ceil 10 Mbit/s) of a 10 Mbit/s parent, each offered 20 Mbit/s
/// of 1442-byte packets, B's always just after A's: first come, first served, A would
/// take nearly all the spare. Fair words split it evenly, as htb's round robin does,
/// and for one borrower alone they leave it the whole spare.
#[test]
fn borrowers_split_the_spare_evenly_whatever_the_order_of_their_packets() {
    let split = |offered_by_b: u64| {
        let mut model = TreeModel::default();
        model.classes[0] = ModelClass {
            rate: ByteCost::new(10_000_000, 131_072),
            ceil: ByteCost::new(10_000_000, 131_072),
            ..ModelClass::default()
        };
        for child in [1, 2] {
            model.classes[child] = ModelClass {
                parent: Some(0),
                rate: ByteCost::new(3_000_000, 131_072),
                ceil: ByteCost::new(10_000_000, 131_072),
                ..ModelClass::default()
            };
        }
        let gap = |rate: u64| 1442 * 8 * 1_000_000_000 / rate;
        let (gap_a, gap_b) = (gap(20_000_000), gap(offered_by_b.max(1)));
        let (mut next_a, mut next_b) = (0u64, if offered_by_b == 0 { u64::MAX } else { 1_000 });
        let mut passed = [0u64; 3];
        let (warm, end) = (2_000_000_000, 8_000_000_000);
        while next_a.min(next_b) < end {
            let (class, now) = if next_a <= next_b {
                next_a += gap_a;
                (1, next_a - gap_a)
            } else {
                next_b += gap_b;
                (2, next_b - gap_b)
            };
            if let Outcome::Lent { .. } = model.admit(class, None, now, 1442) {
                if now >= warm {
                    passed[class] += 1442;
                }
            }
        }
        let mbit = |bytes: u64| bytes as f64 * 8.0 / ((end - warm) as f64 / 1e9) / 1e6;
        (mbit(passed[1]), mbit(passed[2]))
    };
    let (a, b) = split(20_000_000);
    println!("A and B at 20 Mbit/s each: {a:.3} / {b:.3} Mbit/s");
    assert!((a + b - 10.0).abs() < 0.3, "{a} + {b}");
    assert!(
        (a - 5.0).abs() < 0.25 && (b - 5.0).abs() < 0.25,
        "{a} / {b}"
    );
    let (alone, _) = split(0);
    println!("A alone: {alone:.3} Mbit/s");
    assert!((alone - 10.0).abs() < 0.3, "{alone}");
}

/// Three levels: a leaf (rate 1, ceil 10) under a middle class (rate 3, ceil 10) under a
/// 10 Mbit/s root, offered 20 Mbit/s alone, borrows through the middle class up to the
/// root's 10: the middle class's share is bounded by its ceiling, not its rate.
#[test]
fn a_lone_leaf_borrows_through_two_levels() {
    let mut model = TreeModel::default();
    let class = |parent, rate, ceil| ModelClass {
        parent,
        rate: ByteCost::new(rate, 131_072),
        ceil: ByteCost::new(ceil, 131_072),
        ..ModelClass::default()
    };
    model.classes[0] = class(None, 10_000_000, 10_000_000);
    model.classes[1] = class(Some(0), 3_000_000, 10_000_000);
    model.classes[2] = class(Some(1), 1_000_000, 10_000_000);
    let gap = 1442 * 8 * 1_000_000_000 / 20_000_000;
    let (warm, end) = (2_000_000_000u64, 8_000_000_000u64);
    let mut passed = 0u64;
    let mut now = 0;
    while now < end {
        if let Outcome::Lent { .. } = model.admit(2, None, now, 1442) {
            if now >= warm {
                passed += 1442;
            }
        }
        now += gap;
    }
    let mbit = passed as f64 * 8.0 / ((end - warm) as f64 / 1e9) / 1e6;
    println!("a lone leaf two levels down: {mbit:.3} Mbit/s");
    assert!((mbit - 10.0).abs() < 0.3, "{mbit}");
}
