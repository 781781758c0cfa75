//! Properties of the one bucket function the eBPF program runs, checked on the host.
//!
//! The generated traffic is drawn relative to the bucket it meets, so the bounds are
//! checked where they can break: rates log-uniform over the whole supported range, an
//! offered load of 0.5–20× the rate, bursts a few packets deep, and start times anywhere
//! in the 36 years a u64 of ticks covers. Each property counts the cases in which the
//! bucket refused packets and asserts that most did (a bound only checked while
//! everything passes proves nothing).

mod support;

use proptest::{prelude::*, test_runner::TestRunner};
use shaper_common::{
    bucket::{
        credit_chunk, shared_burst, use_credit, CreditUse, MAX_RATE_BITS_PER_SEC,
        MIN_RATE_BITS_PER_SEC, TICK_BITS,
    },
    conform, ByteCost,
};
use std::cell::Cell;

const NANOS: u128 = 1_000_000_000;
const CASES: u32 = 1000;
/// The last nanosecond whose tick count fits a u64: 2^60 ns, about 36.5 years of uptime.
const LAST_NANOSECOND: u64 = u64::MAX >> TICK_BITS;
/// Room left at the end of the clock for one case's traffic and its bucket's backlog.
const CASE_SPAN_NS: u64 = 400 * 24 * 3600 * NANOS as u64;

/// A deterministic runner, so a failure (and the refused fraction) reproduces.
fn runner() -> TestRunner {
    support::deterministic_runner(CASES)
}

/// A rate in bit/s, log-uniform over `lowest..=MAX_RATE_BITS_PER_SEC`.
fn log_uniform_rate(lowest: u64) -> impl Strategy<Value = u64> {
    let (low, high) = ((lowest as f64).ln(), (MAX_RATE_BITS_PER_SEC as f64).ln());
    (low..=high).prop_map(move |ln| (ln.exp() as u64).clamp(lowest, MAX_RATE_BITS_PER_SEC))
}

/// Traffic offered to one bucket: how many times the rate (0.5–20, log-uniform), the
/// largest packet, a burst of 1–16 of the largest packets (at least one full frame), and
/// arrivals as (fraction of the mean gap in 0..2, size in 64..=largest, CPU).
#[derive(Debug, Clone)]
struct Offer {
    rate_bits: u64,
    load: f64,
    burst: u64,
    arrivals: Vec<(f64, u64, u64)>,
}

fn offer(lowest_rate: u64, packets: std::ops::Range<usize>) -> impl Strategy<Value = Offer> {
    (
        log_uniform_rate(lowest_rate),
        (0.5f64.ln()..=20f64.ln()).prop_map(f64::exp),
        64u64..=65_536,
        1u64..=16,
    )
        .prop_flat_map(move |(rate_bits, load, largest, depth)| {
            let arrivals =
                prop::collection::vec((0.0f64..2.0, 64u64..=largest, 0u64..8), packets.clone());
            arrivals.prop_map(move |arrivals| Offer {
                rate_bits,
                load,
                burst: (depth * largest).max(1514),
                arrivals,
            })
        })
}

impl Offer {
    /// Arrival times (ns) from `start`: gaps drawn so the offered rate is `load` × rate.
    fn times(&self, start: u64) -> Vec<u64> {
        let mean_size = self.arrivals.iter().map(|a| a.1 as f64).sum::<f64>()
            / self.arrivals.len().max(1) as f64;
        let mean_gap_ns = mean_size * 8e9 / (self.rate_bits as f64 * self.load);
        // Offsets in f64, added to the start in integers: near 2^60 ns an f64 time would
        // only resolve 128 ns.
        let mut offset = 0.0;
        self.arrivals
            .iter()
            .map(|(fraction, _, _)| {
                offset += fraction * mean_gap_ns;
                start + offset as u64
            })
            .collect()
    }
}

/// `bytes` admitted over `elapsed_ns` stay within burst + rate × elapsed (exact integers:
/// bytes × 8e9 ≤ burst × 8e9 + rate_bits × elapsed_ns).
fn within_bound(bytes: u128, elapsed_ns: u64, rate_bits: u64, burst: u64) -> bool {
    bytes * 8 * NANOS <= burst as u128 * 8 * NANOS + rate_bits as u128 * elapsed_ns as u128
}

/// Asserts that at least `wanted` of the cases refused packets.
fn assert_refused_in(what: &str, refused_cases: u32, wanted: f64) {
    let fraction = refused_cases as f64 / CASES as f64;
    println!(
        "{what}: {refused_cases} of {CASES} cases refused packets ({:.1} %)",
        fraction * 100.0
    );
    assert!(
        fraction >= wanted,
        "{what}: only {:.1} % of cases reached the limit (wanted ≥ {:.0} %): the bound was barely checked",
        fraction * 100.0,
        wanted * 100.0
    );
}

/// For any arrival sequence, bytes admitted between the first and the last packet never
/// exceed burst + rate × elapsed (checked after every packet, in exact integers).
#[test]
fn admitted_never_exceeds_burst_plus_rate_times_elapsed() {
    let refused_cases = Cell::new(0u32);
    let strategy = (
        offer(MIN_RATE_BITS_PER_SEC, 1..400),
        0u64..LAST_NANOSECOND - CASE_SPAN_NS,
    );
    runner()
        .run(&strategy, |(offer, start)| {
            let cost = ByteCost::new(offer.rate_bits, offer.burst);
            let (mut tat, mut admitted, mut refused) = (0u64, 0u128, false);
            for (now, &(_, size, _)) in offer.times(start).into_iter().zip(&offer.arrivals) {
                match conform(tat, now, size, &cost) {
                    Some(next) => {
                        tat = next;
                        admitted += size as u128;
                    }
                    None => refused = true,
                }
                prop_assert!(
                    within_bound(admitted, now - start, offer.rate_bits, offer.burst),
                    "admitted {admitted} B after {} ns at {} bit/s, burst {}",
                    now - start,
                    offer.rate_bits,
                    offer.burst
                );
            }
            refused_cases.set(refused_cases.get() + refused as u32);
            Ok(())
        })
        .unwrap();
    assert_refused_in("one bucket", refused_cases.get(), 0.7);
}

/// With per-CPU credit in front of the shared bucket (as the eBPF program runs it for
/// class-scoped buckets), the bytes admitted in *every* window [s, t] of any arrival
/// sequence spread over up to 8 CPUs stay within burst + rate × (t - s).
#[test]
fn credit_keeps_every_window_within_burst_plus_rate() {
    let (refused_cases, credit_cases) = (Cell::new(0u32), Cell::new(0u32));
    let strategy = (
        offer(8_000, 1..300),
        1u64..=8,
        0u64..LAST_NANOSECOND - CASE_SPAN_NS,
    );
    runner()
        .run(&strategy, |(offer, cpus, start)| {
            let (rate_bits, burst) = (offer.rate_bits, offer.burst);
            let chunk = credit_chunk(rate_bits, burst, cpus);
            let cost = ByteCost::new(rate_bits, shared_burst(burst, cpus, chunk));
            let (mut tat, mut credit) = (0u64, vec![0u64; cpus as usize]);
            let (mut sent, mut refused) = (Vec::new(), false);
            for (now, &(_, size, cpu)) in offer.times(start).into_iter().zip(&offer.arrivals) {
                let cpu = (cpu % cpus) as usize;
                let admitted = match use_credit(credit[cpu], size, chunk) {
                    CreditUse::Covered { left } => {
                        credit[cpu] = left;
                        true
                    }
                    CreditUse::Take { first, fallback } => {
                        let taken = [first, fallback].into_iter().find_map(|take| {
                            conform(tat, now, take, &cost).map(|next| (next, take))
                        });
                        match taken {
                            Some((next, take)) => {
                                tat = next;
                                credit[cpu] = credit[cpu] + take - size;
                                true
                            }
                            None => false,
                        }
                    }
                };
                if admitted {
                    sent.push((now, size));
                } else {
                    refused = true;
                }
            }
            for (first, &(window_start, _)) in sent.iter().enumerate() {
                let mut bytes: u128 = 0;
                for &(at, size) in &sent[first..] {
                    bytes += size as u128;
                    prop_assert!(
                        within_bound(bytes, at - window_start, rate_bits, burst),
                        "{bytes} B in {} ns at {rate_bits} bit/s, burst {burst}, {cpus} CPUs, chunk {chunk}",
                        at - window_start
                    );
                }
            }
            refused_cases.set(refused_cases.get() + refused as u32);
            credit_cases.set(credit_cases.get() + (chunk > 0) as u32);
            Ok(())
        })
        .unwrap();
    assert_refused_in("per-CPU credit", refused_cases.get(), 0.7);
    // Both kinds of bucket must be exercised: with credit chunks and per packet.
    let with_credit = credit_cases.get() as f64 / CASES as f64;
    println!(
        "per-CPU credit: {:.1} % of cases had a credit chunk",
        with_credit * 100.0
    );
    assert!(
        (0.2..=0.8).contains(&with_credit),
        "{:.1} % of cases had a credit chunk",
        with_credit * 100.0
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A steady source at 10× the rate is admitted at the rate within 0.1 %, for every
    /// packet that takes at least 62.5 ns (one thousand ticks) at the class rate.
    #[test]
    fn steady_overload_is_admitted_at_the_rate(
        rate_bits in log_uniform_rate(100_000),
        size in 64u64..=65_536,
        start in 0u64..LAST_NANOSECOND - CASE_SPAN_NS,
    ) {
        prop_assume!(size as f64 * 8e9 / rate_bits as f64 >= 62.5);
        let burst = (16 * size).max(1514);
        let cost = ByteCost::new(rate_bits, burst);
        // Long enough that the initial burst is below 0.02 % of what the rate allows.
        let allowed_bytes = burst as f64 * 5000.0;
        let duration_ns = allowed_bytes * 8e9 / rate_bits as f64;
        let packets = (allowed_bytes * 10.0 / size as f64) as u64;
        let gap = duration_ns / packets as f64;
        let mut tat = 0u64;
        let mut admitted = 0u64;
        for index in 0..packets {
            let now = start + (index as f64 * gap) as u64;
            if let Some(next) = conform(tat, now, size, &cost) {
                tat = next;
                admitted += size;
            }
        }
        let expected = rate_bits as f64 / 8.0 * duration_ns / 1e9;
        let error = (admitted as f64 - burst as f64 - expected) / expected;
        prop_assert!(error.abs() < 0.001, "rate {rate_bits} bit/s, size {size}: error {:.5} %", error * 100.0);
    }
}
