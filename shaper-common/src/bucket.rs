//! Token-bucket arithmetic as GCRA (ITU-T I.371 "virtual scheduling").
//!
//! A bucket of rate `r` bytes/s and burst `b` bytes is kept as one 64-bit word, the
//! theoretical arrival time `tat` in nanoseconds. A packet of `n` bytes arriving at `now`
//! conforms when `max(tat, now) + n/r - now <= b/r`, and then `tat` becomes
//! `max(tat, now) + n/r`. This is exactly a token bucket whose fill level is
//! `b - (tat - now) * r` (saturating at `b` once `tat <= now`), but it is one word, so a
//! single compare-and-swap updates it correctly from any number of CPUs at once.
//!
//! Time is counted in ticks of 1/16 ns (`now_ns << TICK_BITS`), so the per-packet
//! rounding is at most 1/16 ns: below 0.1 % for any packet that takes at least 62.5 ns
//! at the class rate (a 1500-byte packet up to 190 Gbit/s; a 64 KiB GSO packet at any
//! supported rate). A u64 of ticks lasts 36 years of uptime.
//!
//! `n/r` is computed without a division: userspace precomputes the ticks per byte as a
//! fixed-point number with [`FRAC_BITS`] fraction bits, rounded up, and the packet path
//! multiplies. Integer and fraction are multiplied separately so nothing overflows for
//! any rate from 8 bit/s to 400 Gbit/s and any charge up to [`MAX_CHARGE_BYTES`].
//! Rounding the ticks per byte and the per-packet product *up*, and the burst tolerance
//! *down*, keeps the bound `admitted <= burst + rate * elapsed` exact.
//!
//! `tat` is absolute `bpf_ktime_get_ns()` time in ticks, and `max(tat, now)` makes any
//! idle time (hours, days) simply refill the bucket to its burst without arithmetic on
//! the idle span itself.

/// Ticks per nanosecond, as a shift: 16 ticks per ns.
pub const TICK_BITS: u32 = 4;
/// Fraction bits of the fixed-point ticks per byte.
pub const FRAC_BITS: u32 = 24;
const FRAC_MASK: u64 = (1 << FRAC_BITS) - 1;
const TICKS_PER_SEC: u128 = 1_000_000_000 << TICK_BITS;
/// Largest charge per packet (16 MiB): far above any GSO packet (512 KiB with BIG TCP).
pub const MAX_CHARGE_BYTES: u64 = 1 << 24;
/// Lowest rate the arithmetic supports: one byte per second.
pub const MIN_RATE_BITS_PER_SEC: u64 = 8;
/// Highest rate the arithmetic is specified for.
pub const MAX_RATE_BITS_PER_SEC: u64 = 400_000_000_000;

/// Ticks per byte as a fixed-point number, and the burst tolerance in ticks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteCost {
    /// Whole ticks per byte.
    pub ticks_per_byte: u64,
    /// Fractional ticks per byte, in units of 2^-FRAC_BITS ticks (rounded up).
    pub ticks_per_byte_frac: u64,
    /// Burst expressed as time: `burst_bytes / rate` in ticks, rounded down.
    pub tolerance_ticks: u64,
}

impl ByteCost {
    /// Precomputes the per-byte cost for `rate_bits_per_sec` (>= 8) and `burst_bytes`.
    /// Userspace only: it divides.
    pub fn new(rate_bits_per_sec: u64, burst_bytes: u64) -> Self {
        let rate_bits = rate_bits_per_sec.max(MIN_RATE_BITS_PER_SEC) as u128;
        // ticks per byte = 8 * TICKS_PER_SEC / rate_bits; in fixed point, rounded up.
        let fixed = ((8 * TICKS_PER_SEC) << FRAC_BITS).div_ceil(rate_bits);
        let tolerance = (burst_bytes as u128 * 8 * TICKS_PER_SEC) / rate_bits;
        Self {
            ticks_per_byte: (fixed >> FRAC_BITS) as u64,
            ticks_per_byte_frac: (fixed as u64) & FRAC_MASK,
            // Capped so `tat` never nears u64::MAX.
            tolerance_ticks: tolerance.min(1 << 62) as u64,
        }
    }

    /// Ticks it takes the bucket to earn `bytes` bytes, rounded up. No division, and no
    /// overflow: bytes are clamped to [`MAX_CHARGE_BYTES`] and whole ticks per byte are
    /// below 2^34 for every rate >= 8 bit/s, so both products stay below 2^58.
    #[inline(always)]
    pub fn ticks_for(&self, bytes: u64) -> u64 {
        let bytes = if bytes > MAX_CHARGE_BYTES {
            MAX_CHARGE_BYTES
        } else {
            bytes
        };
        let whole = bytes * self.ticks_per_byte;
        let frac = (bytes * self.ticks_per_byte_frac + FRAC_MASK) >> FRAC_BITS;
        whole + frac
    }
}

/// Tokens in the bucket at `now_ns`, in bytes: `burst - (tat - now) * rate`, the burst
/// when `tat` is in the past. For metrics (userspace: it divides).
pub fn level_bytes(tat: u64, now_ns: u64, rate_bits_per_sec: u64, burst_bytes: u64) -> u64 {
    let backlog_ticks = tat.saturating_sub(ticks(now_ns)) as u128;
    let owed_bytes = backlog_ticks * rate_bits_per_sec as u128 / (8 * TICKS_PER_SEC);
    burst_bytes.saturating_sub(owed_bytes.min(u64::MAX as u128) as u64)
}

/// Converts `bpf_ktime_get_ns()` nanoseconds to ticks.
#[inline(always)]
pub fn ticks(now_ns: u64) -> u64 {
    now_ns << TICK_BITS
}

/// The one pure bucket function the eBPF program runs: given the bucket word `tat`
/// (ticks), the time `now_ns` and the packet's `bytes`, returns the new `tat` when the
/// packet conforms and `None` when it exceeds the bucket (state unchanged).
#[inline(always)]
pub fn conform(tat: u64, now_ns: u64, bytes: u64, cost: &ByteCost) -> Option<u64> {
    let now = ticks(now_ns);
    let start = if tat > now { tat } else { now };
    let next = start + cost.ticks_for(bytes);
    if next - now <= cost.tolerance_ticks {
        Some(next)
    } else {
        None
    }
}

/// Earliest-departure-time shaping on the same bucket word: a packet leaves at
/// `max(tat, now)` and moves `tat` on by its cost, so departures are spaced by len / rate.
/// Returns the new `tat` and the departure time in nanoseconds, or `None` when the
/// departure would lie more than `horizon_ticks` in the future (the packet is dropped).
#[inline(always)]
pub fn departure(
    tat: u64,
    now_ns: u64,
    bytes: u64,
    cost: &ByteCost,
    horizon_ticks: u64,
) -> Option<(u64, u64)> {
    let now = ticks(now_ns);
    let start = if tat > now { tat } else { now };
    if start - now > horizon_ticks {
        return None;
    }
    Some((start + cost.ticks_for(bytes), start >> TICK_BITS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_is_burst_minus_what_was_taken_plus_what_refilled() {
        // 8000 bit/s = 1000 bytes/s, burst 5000 bytes.
        let c = ByteCost::new(8000, 5000);
        let now = 1_000_000_000;
        assert_eq!(level_bytes(0, now, 8000, 5000), 5000);
        let tat = conform(0, now, 3000, &c).unwrap();
        assert_eq!(level_bytes(tat, now, 8000, 5000), 2000);
        // Half a second refills 500 bytes.
        assert_eq!(level_bytes(tat, now + 500_000_000, 8000, 5000), 2500);
        assert_eq!(level_bytes(tat, now + 10_000_000_000, 8000, 5000), 5000);
    }

    #[test]
    fn fixed_point_matches_exact_division() {
        // 10 Mbit/s = 1.25 MB/s = 800 ns = 12800 ticks per byte exactly.
        let c = ByteCost::new(10_000_000, 125_000);
        assert_eq!(c.ticks_per_byte, 12_800);
        assert_eq!(c.ticks_per_byte_frac, 0);
        assert_eq!(c.tolerance_ticks, 100_000_000 << TICK_BITS);
        assert_eq!(c.ticks_for(1500), 1_200_000 << TICK_BITS);
        // 400 Gbit/s = 0.02 ns per byte: 1500 bytes take 30 ns, rounded up by < 1 tick.
        let fast = ByteCost::new(400_000_000_000, 1 << 20);
        assert_eq!(fast.ticks_per_byte, 0);
        assert_eq!(fast.ticks_for(1500), 30 * 16 + 1);
        // 8 bit/s = 1 byte/s: a 64 KiB packet is 65536 s.
        let slow = ByteCost::new(8, 100_000);
        assert_eq!(slow.ticks_for(65_536), 65_536 * TICKS_PER_SEC as u64);
    }

    #[test]
    fn full_bucket_admits_burst_then_rate() {
        let c = ByteCost::new(8_000_000, 10_000); // 1 MB/s, 1000 ns per byte
        let mut tat = 0;
        let now = 1_000_000_000_000;
        let mut admitted = 0;
        for _ in 0..20 {
            if let Some(t) = conform(tat, now, 1000, &c) {
                tat = t;
                admitted += 1000;
            }
        }
        assert_eq!(admitted, 10_000);
        // One millisecond later exactly 1000 bytes more conform.
        let later = now + 1_000_000;
        assert!(conform(tat, later, 1000, &c).is_some());
        assert!(conform(tat, later, 1001, &c).is_none());
    }

    #[test]
    fn departures_are_spaced_by_len_over_rate_up_to_the_horizon() {
        let c = ByteCost::new(8_000_000, 10_000); // 1000 ns per byte
        let now = 5_000_000_000;
        let horizon = ticks(2_000_000); // 2 ms
        let (tat, first) = departure(0, now, 1000, &c, horizon).unwrap();
        assert_eq!(first, now);
        let (tat, second) = departure(tat, now, 1000, &c, horizon).unwrap();
        assert_eq!(second, now + 1_000_000);
        let (tat, third) = departure(tat, now, 1000, &c, horizon).unwrap();
        assert_eq!(third, now + 2_000_000);
        // The fourth would leave 3 ms from now: beyond the horizon.
        assert!(departure(tat, now, 1000, &c, horizon).is_none());
        // Later, the queue has drained and the packet leaves at once.
        let (_, later) = departure(tat, now + 10_000_000, 1000, &c, horizon).unwrap();
        assert_eq!(later, now + 10_000_000);
    }

    #[test]
    fn hours_of_idle_refill_to_burst_only() {
        let c = ByteCost::new(400_000_000_000, 1 << 20);
        let tat = 5;
        let now = 3600 * 24 * 1_000_000_000;
        // Rounding up the cost may withhold up to one tick's worth of bytes.
        assert!(conform(tat, now, (1 << 20) - 64, &c).is_some());
        assert!(conform(tat, now, (1 << 20) + 64, &c).is_none());
    }
}
