//! Token-bucket arithmetic as GCRA (ITU-T I.371 "virtual scheduling").
//!
//! A bucket of rate `r` bytes/s and burst `b` bytes is kept as one 64-bit word, the
//! theoretical arrival time `tat` in nanoseconds. A packet of `n` bytes arriving at `now`
//! conforms when `max(tat, now) + n/r - now <= b/r`, and then `tat` becomes
//! `max(tat, now) + n/r`. This is exactly a token bucket whose fill level is
//! `b - (tat - now) * r` (saturating at `b` once `tat <= now`), but it is one word, so a
//! single compare-and-swap updates it correctly from any number of CPUs at once.
//!
//! `n/r` is computed without a division: userspace precomputes the time per byte as a
//! fixed-point number with [`FRAC_BITS`] fraction bits, rounded up, and the packet path
//! multiplies. Integer and fraction are multiplied separately so nothing overflows for
//! any rate from 8 bit/s to 400 Gbit/s and any packet size below 2^31 bytes. Rounding
//! the time per byte and the per-packet product *up* keeps the bound
//! `admitted <= burst + rate * elapsed` exact. At 400 Gbit/s (0.02 ns per byte) the
//! fraction keeps a relative error below 3e-6.
//!
//! `tat` is absolute `bpf_ktime_get_ns()` time: a u64 of nanoseconds lasts 584 years
//! of uptime, and `max(tat, now)` makes any idle time (hours, days) simply refill the
//! bucket to its burst without arithmetic on the idle span itself.

/// Fraction bits of the fixed-point time per byte.
pub const FRAC_BITS: u32 = 24;
const FRAC_MASK: u64 = (1 << FRAC_BITS) - 1;
const NANOS_PER_SEC: u128 = 1_000_000_000;
/// Largest charge per packet (16 MiB): far above any GSO packet (512 KiB with BIG TCP).
pub const MAX_CHARGE_BYTES: u64 = 1 << 24;
/// Lowest rate the arithmetic supports: one byte per second.
pub const MIN_RATE_BITS_PER_SEC: u64 = 8;
/// Highest rate the arithmetic is specified for.
pub const MAX_RATE_BITS_PER_SEC: u64 = 400_000_000_000;

/// Time per byte as a fixed-point number of nanoseconds, and the burst tolerance.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteCost {
    /// Whole nanoseconds per byte.
    pub ns_per_byte: u64,
    /// Fractional nanoseconds per byte, in units of 2^-FRAC_BITS ns (rounded up).
    pub ns_per_byte_frac: u64,
    /// Burst expressed as time: `burst_bytes / rate`, rounded down.
    pub tolerance_ns: u64,
}

impl ByteCost {
    /// Precomputes the per-byte cost for `rate_bits_per_sec` (>= 8) and `burst_bytes`.
    /// Userspace only: it divides.
    pub fn new(rate_bits_per_sec: u64, burst_bytes: u64) -> Self {
        let rate_bits = rate_bits_per_sec.max(MIN_RATE_BITS_PER_SEC) as u128;
        // ns per byte = 8e9 / rate_bits; in fixed point, rounded up.
        let scaled = (8 * NANOS_PER_SEC) << FRAC_BITS;
        let fixed = scaled.div_ceil(rate_bits);
        let tolerance = (burst_bytes as u128 * 8 * NANOS_PER_SEC) / rate_bits;
        Self {
            ns_per_byte: (fixed >> FRAC_BITS) as u64,
            ns_per_byte_frac: (fixed as u64) & FRAC_MASK,
            // Capped so `tat` never nears u64::MAX; 2^62 ns is 146 years.
            tolerance_ns: tolerance.min(1 << 62) as u64,
        }
    }

    /// Time it takes the bucket to earn `bytes` bytes, rounded up. No division, and no
    /// overflow: bytes are clamped to [`MAX_CHARGE_BYTES`] and `ns_per_byte` is below
    /// 2^30 for every rate >= 8 bit/s, so both products stay below 2^54.
    #[inline(always)]
    pub fn nanos_for(&self, bytes: u64) -> u64 {
        let bytes = if bytes > MAX_CHARGE_BYTES { MAX_CHARGE_BYTES } else { bytes };
        let whole = bytes * self.ns_per_byte;
        let frac = (bytes * self.ns_per_byte_frac + FRAC_MASK) >> FRAC_BITS;
        whole + frac
    }
}

/// The one pure bucket function: given the bucket word `tat`, the time `now` and the
/// packet's `cost_ns` (see [`ByteCost::nanos_for`]), returns the new `tat` when the
/// packet conforms and `None` when it exceeds the bucket (state unchanged).
#[inline(always)]
pub fn conform(tat: u64, now: u64, cost_ns: u64, tolerance_ns: u64) -> Option<u64> {
    let start = if tat > now { tat } else { now };
    let next = start.saturating_add(cost_ns);
    if next - now <= tolerance_ns {
        Some(next)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_point_matches_exact_division() {
        // 10 Mbit/s = 1.25 MB/s = 800 ns per byte exactly.
        let c = ByteCost::new(10_000_000, 125_000);
        assert_eq!(c.ns_per_byte, 800);
        assert_eq!(c.ns_per_byte_frac, 0);
        assert_eq!(c.tolerance_ns, 100_000_000);
        assert_eq!(c.nanos_for(1500), 1_200_000);
        // 400 Gbit/s = 0.02 ns per byte: 1500 bytes take 30 ns.
        let fast = ByteCost::new(400_000_000_000, 1 << 20);
        assert_eq!(fast.ns_per_byte, 0);
        // Not representable in binary: rounded up, by less than one nanosecond here.
        assert_eq!(fast.nanos_for(1500), 31);
        assert_eq!(fast.nanos_for(1_000_000), 20_001);
        // 8 bit/s = 1 byte/s: a 64 KiB packet is 65536 s.
        let slow = ByteCost::new(8, 100_000);
        assert_eq!(slow.nanos_for(65_536), 65_536 * NANOS_PER_SEC as u64);
    }

    #[test]
    fn full_bucket_admits_burst_then_rate() {
        let c = ByteCost::new(8_000_000, 10_000); // 1 MB/s, 1000 ns per byte
        let mut tat = 0;
        let now = 1_000_000_000_000;
        let mut admitted = 0;
        for _ in 0..20 {
            if let Some(t) = conform(tat, now, c.nanos_for(1000), c.tolerance_ns) {
                tat = t;
                admitted += 1000;
            }
        }
        assert_eq!(admitted, 10_000);
        // One millisecond later exactly 1000 bytes more conform.
        let later = now + 1_000_000;
        assert!(conform(tat, later, c.nanos_for(1000), c.tolerance_ns).is_some());
        assert!(conform(tat, later, c.nanos_for(1001), c.tolerance_ns).is_none());
    }

    #[test]
    fn hours_of_idle_refill_to_burst_only() {
        let c = ByteCost::new(400_000_000_000, 1 << 20);
        let tat = 5;
        let now = 3600 * 24 * NANOS_PER_SEC as u64;
        // Rounding up the cost may withhold up to one nanosecond's worth of bytes.
        assert!(conform(tat, now, c.nanos_for((1 << 20) - 64), c.tolerance_ns).is_some());
        assert!(conform(tat, now, c.nanos_for((1 << 20) + 64), c.tolerance_ns).is_none());
    }
}
