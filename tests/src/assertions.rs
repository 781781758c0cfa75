//! The checks the lab tests share: rates within a tolerance, TCP goodput within its
//! bounds, programs gone from the kernel.

use serde_json::Value;
use std::{thread, time::Duration};

/// Asserts `value` is within `tolerance` (fraction) of `expected`, with a clear message.
pub fn assert_within(what: &str, value: f64, expected: f64, tolerance: f64) {
    let error = (value - expected) / expected;
    println!(
        "{what}: {:.3} Mbit/s, expected {:.3} ±{:.1} % → error {:+.2} %",
        value / 1e6,
        expected / 1e6,
        tolerance * 100.0,
        error * 100.0
    );
    assert!(
        error.abs() <= tolerance,
        "{what}: measured {:.3} Mbit/s, expected {:.3} Mbit/s ±{:.1} % (error {:+.2} %)",
        value / 1e6,
        expected / 1e6,
        tolerance * 100.0,
        error * 100.0
    );
}

/// Asserts that steady-state TCP goodput ([`crate::TcpResult::steady_bps`]), as a fraction of the
/// class rate, lies in `lower..=0.99`. The upper bound is what makes the check bite:
/// goodput is payload, the rate counts every header (a full-size TCP segment carries 1448
/// of its 1514 bytes), so a limiter that did nothing would give many times the rate. A
/// working policer admits at most burst + rate × t in any window t: with the default burst
/// (250 ms at the rate) over the 9 s after the first second of a 10 s run that is at most
/// 0.956 × (1 + 0.25 / 9) = 0.983 of the rate, below 0.99 even when every loss lets the
/// bucket refill.
pub fn assert_goodput_fraction(what: &str, fraction: f64, lower: f64) {
    println!(
        "{what}: goodput {:.1} % of the rate (expected {:.0}–99 %)",
        fraction * 100.0,
        lower * 100.0
    );
    assert!(
        (lower..=0.99).contains(&fraction),
        "{what}: goodput {:.1} % of the rate, outside {:.0}–99 %",
        fraction * 100.0,
        lower * 100.0
    );
}

/// Ids of every BPF program loaded in the kernel.
pub fn loaded_program_ids() -> Vec<u32> {
    aya::programs::loaded_programs()
        .flatten()
        .map(|p| p.id())
        .collect()
}

/// Asserts that none of the programs `ids` is loaded any more. TCX links are not tc
/// filters, so "no filter left" proves nothing under TCX: a detached program is gone
/// from the kernel. It is freed asynchronously (RCU): polled for up to 2 s.
pub fn assert_programs_unloaded(what: &str, ids: &[u32]) {
    assert!(!ids.is_empty(), "{what}: no program ids to check");
    let mut left = ids.to_vec();
    for _ in 0..100 {
        let loaded = loaded_program_ids();
        left.retain(|id| loaded.contains(id));
        if left.is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("{what}: programs {left:?} still loaded 2 s later");
}

/// The program ids of every row of `shaper status --json` output for `dev`.
pub fn status_program_ids(status_json: &str, dev: &str) -> Vec<u32> {
    serde_json::from_str::<Value>(status_json)
        .unwrap_or_default()
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["dev"] == dev)
        .filter_map(|row| row["program_id"].as_u64().map(|id| id as u32))
        .collect()
}
