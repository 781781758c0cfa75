//! Properties of the one bucket function the eBPF program runs, checked on the host.

use proptest::prelude::*;
use shaper_common::{
    bucket::{credit_chunk, shared_burst, use_credit, CreditUse, MAX_RATE_BITS_PER_SEC},
    conform, ByteCost,
};

const NANOS: u128 = 1_000_000_000;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// For any arrival sequence, bytes admitted between the first and the last packet
    /// never exceed burst + rate × elapsed (checked in exact integer arithmetic).
    #[test]
    fn admitted_never_exceeds_burst_plus_rate_times_elapsed(
        rate_bits in 8u64..=MAX_RATE_BITS_PER_SEC,
        burst in 1514u64..(1 << 30),
        start in 0u64..(1 << 50),
        arrivals in prop::collection::vec((0u64..5_000_000, 1u64..70_000), 1..400),
    ) {
        let cost = ByteCost::new(rate_bits, burst);
        let mut tat = 0u64;
        let mut now = start;
        let mut admitted: u128 = 0;
        for (gap, size) in arrivals {
            now += gap;
            if let Some(next) = conform(tat, now, size, &cost) {
                tat = next;
                admitted += size as u128;
            }
            let elapsed = (now - start) as u128;
            // admitted * 8e9 <= burst * 8e9 + rate_bits * elapsed_ns
            prop_assert!(
                admitted * 8 * NANOS <= burst as u128 * 8 * NANOS + rate_bits as u128 * elapsed,
                "admitted {admitted} B after {elapsed} ns at {rate_bits} bit/s, burst {burst}"
            );
        }
    }

    /// A steady source at 10× the rate is admitted at the rate within 0.1 %, for every
    /// packet that takes at least 62.5 ns (one thousand ticks) at the class rate.
    #[test]
    fn steady_overload_is_admitted_at_the_rate(
        rate_bits in 100_000u64..=MAX_RATE_BITS_PER_SEC,
        size in 64u64..=65_536,
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
        let start = 1u64 << 40;
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

    /// With per-CPU credit in front of the shared bucket (as the eBPF program runs it for
    /// class-scoped buckets), the bytes admitted in *every* window [s, t] of any arrival
    /// sequence spread over any number of CPUs stay within burst + rate × (t - s).
    #[test]
    fn credit_keeps_every_window_within_burst_plus_rate(
        rate_bits in 8_000u64..=MAX_RATE_BITS_PER_SEC,
        burst in 1514u64..(1 << 24),
        cpus in 1u64..=8,
        arrivals in prop::collection::vec((0u64..2_000_000, 1u64..70_000, 0u64..8), 1..300),
    ) {
        let chunk = credit_chunk(rate_bits, burst, cpus);
        let cost = ByteCost::new(rate_bits, shared_burst(burst, cpus, chunk));
        let mut tat = 0u64;
        let mut credit = vec![0u64; cpus as usize];
        let mut now = 1u64 << 40;
        let mut sent: Vec<(u64, u64)> = Vec::new();
        for (gap, size, cpu) in arrivals {
            now += gap;
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
            }
        }
        for (first, &(start, _)) in sent.iter().enumerate() {
            let mut bytes: u128 = 0;
            for &(at, size) in &sent[first..] {
                bytes += size as u128;
                let window = (at - start) as u128;
                prop_assert!(
                    bytes * 8 * NANOS <= burst as u128 * 8 * NANOS + rate_bits as u128 * window,
                    "{bytes} B in {window} ns at {rate_bits} bit/s, burst {burst}, {cpus} CPUs, chunk {chunk}"
                );
            }
        }
    }
}
