//! What a new per-key bucket should start with (issue 12): the class's full burst, or a
//! smaller initial credit so that a sender churning keys gets less. Measured on the bucket
//! arithmetic the program runs (`conform`), with a new bucket's word set so it holds
//! `credit` bytes; the lab measures the parent that holds the aggregate
//! (`tests/tests/hierarchy.rs`: 10.05 Mbit/s of 50 offered under a 10 Mbit/s parent).
//!
//! Run with `--nocapture` for the table.

use shaper_common::{
    bucket::{ticks, ByteCost},
    conform,
};

/// `--per flow --rate 5mbit` with the default burst (max(128k, 250 ms at the rate)).
const RATE: u64 = 5_000_000;
const BURST: u64 = 156_250;
/// A full-size datagram on the wire (1400 bytes of payload).
const PACKET: u64 = 1442;
const FRAME: u64 = 1514;

/// A new key's word: `credit` bytes of the burst available (the full burst: "long ago").
fn fresh(now_ns: u64, credit: u64, cost: &ByteCost) -> u64 {
    if credit >= BURST {
        0
    } else {
        ticks(now_ns) + cost.tolerance_ticks - cost.ticks_for(credit)
    }
}

/// Fraction of a churner's bytes that pass: 50 Mbit/s for 5 s, `per_key` datagrams on
/// each new key, back to back.
fn churner_passes(credit: u64, per_key: u64) -> f64 {
    let cost = ByteCost::new(RATE, BURST);
    let gap_ns = PACKET * 8 * 1_000_000_000 / 50_000_000;
    let (mut sent, mut passed, mut tat) = (0u64, 0u64, 0u64);
    for index in 0..(5_000_000_000 / gap_ns) {
        let now = 1_000_000_000 + index * gap_ns;
        if index % per_key == 0 {
            tat = fresh(now, credit, &cost);
        }
        sent += 1;
        if let Some(next) = conform(tat, now, PACKET, &cost) {
            tat = next;
            passed += 1;
        }
    }
    passed as f64 / sent as f64
}

/// Fraction of an honest short flow's `bytes` that pass when they arrive back to back at
/// 1 Gbit/s on a new key (a web response; what is dropped, TCP must resend).
fn short_flow_passes(credit: u64, bytes: u64) -> f64 {
    let cost = ByteCost::new(RATE, BURST);
    let packets = bytes.div_ceil(PACKET);
    let gap_ns = PACKET * 8;
    let mut tat = fresh(1_000_000_000, credit, &cost);
    let mut passed = 0;
    for index in 0..packets {
        if let Some(next) = conform(tat, 1_000_000_000 + index * gap_ns, PACKET, &cost) {
            tat = next;
            passed += 1;
        }
    }
    passed as f64 / packets as f64
}

#[test]
fn a_smaller_initial_credit_cannot_hold_a_churner_and_costs_short_flows() {
    let credits = [
        ("full burst (156 KB)", BURST),
        ("16 KiB", 16_384),
        ("one frame", FRAME),
    ];
    println!(
        "{:22} {:>12} {:>12} {:>12} {:>14} {:>14}",
        "initial credit", "churn k=1", "churn k=4", "churn k=64", "100 KB flow", "1 MB flow"
    );
    let mut rows = Vec::new();
    for (name, credit) in credits {
        let row = (
            churner_passes(credit, 1),
            churner_passes(credit, 4),
            churner_passes(credit, 64),
            short_flow_passes(credit, 100_000),
            short_flow_passes(credit, 1_000_000),
        );
        println!(
            "{name:22} {:>12.3} {:>12.3} {:>12.3} {:>14.3} {:>14.3}",
            row.0, row.1, row.2, row.3, row.4
        );
        rows.push(row);
    }
    let (full, small, frame) = (rows[0], rows[1], rows[2]);
    // One datagram per key passes whatever the credit: only an aggregate (a parent) holds it.
    for row in [full, small, frame] {
        assert_eq!(row.0, 1.0);
    }
    // A smaller credit holds a churner that reuses keys, to about credit / (k packets).
    assert!(small.2 < 0.3 && frame.1 < 0.26, "{small:?} {frame:?}");
    // ... and drops most of an honest 100 KB response the full burst passes whole.
    assert_eq!(full.3, 1.0);
    assert!(small.3 < 0.3 && frame.3 < 0.05, "{small:?} {frame:?}");
}
