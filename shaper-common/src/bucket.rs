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
//! supported rate). A u64 of ticks lasts 36 years of uptime; a stored bucket word keeps
//! its cost version in its top bits, so its ticks last 2^58 ns, 9.1 years (see
//! [`TAT_MASK`]).
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
//!
//! **Rate changes.** `tat - now` is a debt *in time at the bucket's rate*, so a word
//! written at one rate means something else at another: read at a higher rate, a drained
//! bucket would stay blacked out for `(burst/rate)(1 - rate/new_rate)`, read at a lower
//! one it would refill for free. So the top [`VERSION_BITS`] bits of each stored word
//! carry the version of the class's costs it was written in ([`tagged`]); the class keeps
//! the costs of its last [`COST_VERSIONS`] versions, and the first packet that meets a word
//! of an older version converts it ([`rescale`]) in the same compare-and-swap that charges
//! it: no update is lost and no CPU ever reads a half-converted word. The 62 bits left
//! for `tat` last 9 years of uptime.
//!
//! **Per-CPU credit.** When several CPUs send through one class-scoped bucket, the
//! compare-and-swap on its one word moves a cache line between CPUs for every packet;
//! on the lab's router that costs about 5 % of the forwarding rate. So a CPU takes
//! bytes from the shared bucket a chunk at a time ([`credit_chunk`], at most 16 KiB and
//! 1 ms at the rate) into
//! a per-CPU credit and spends it packet by packet without touching the shared word.
//! The bound stays exact: every byte sent was charged to the shared bucket before, and
//! the shared bucket's burst is lowered by what the CPUs can hold ([`shared_burst`]), so
//! over any interval the bytes sent are at most (burst − cpus × chunk) + rate × t from
//! the shared bucket plus at most cpus × chunk of credit taken earlier. A packet the
//! credit cannot cover takes a chunk, or failing that exactly what it lacks, so near the
//! rate the credit never turns a conforming packet away.

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

/// Bits at the top of a stored bucket word that hold its cost version.
pub const VERSION_BITS: u32 = 2;
/// Versions a class remembers the costs of (a word more versions behind than this, that
/// still owes anything, would be misread: four changes within one burst time).
pub const COST_VERSIONS: usize = 1 << VERSION_BITS;
const VERSION_SHIFT: u32 = 64 - VERSION_BITS;
/// The `tat` part of a stored word.
pub const TAT_MASK: u64 = (1 << VERSION_SHIFT) - 1;

/// The cost version a stored word was written in.
#[inline(always)]
pub fn word_version(word: u64) -> u32 {
    (word >> VERSION_SHIFT) as u32
}

/// A word to store: `tat` stamped with `version`.
#[inline(always)]
pub fn tagged(tat: u64, version: u32) -> u64 {
    (tat & TAT_MASK) | (((version as u64) & (COST_VERSIONS as u64 - 1)) << VERSION_SHIFT)
}

/// `tat` (untagged, written under cost `old`) converted to cost `new` as of `at_ns`, the
/// moment of the change: its tokens kept, clipped to the new burst (no blackout after a
/// raise, no free refill after a cut); the bucket then refills at the new rate from
/// `at_ns` on. Divides: runs once per word per change, not per packet. Rounds toward
/// fewer tokens, so a change never admits more than it should.
#[inline(always)]
pub fn rescale(tat: u64, at_ns: u64, old: &ByteCost, new: &ByteCost) -> u64 {
    let at = ticks(at_ns);
    let debt = tat.saturating_sub(at);
    // A full bucket holds exactly its burst (its tolerance is rounded down).
    let tokens = if debt == 0 {
        old.burst_bytes
    } else {
        old.bytes_in(old.tolerance_ticks.saturating_sub(debt))
    };
    let tokens_new = new.ticks_in(tokens);
    let tokens_new = if tokens_new > new.tolerance_ticks {
        new.tolerance_ticks
    } else {
        tokens_new
    };
    at + (new.tolerance_ticks - tokens_new)
}

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
    /// The burst in bytes (what a full bucket holds, for converting it to other costs).
    pub burst_bytes: u64,
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
            burst_bytes,
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

    /// The ticks `bytes` of tokens are worth, rounded *down* (the per-byte cost is stored
    /// rounded up: its excess, under 2^-24 tick per byte, is taken off too), for token
    /// counts up to 2^39 bytes; saturates at 2^63 ticks. No u128: the BPF target has no
    /// 128-bit arithmetic.
    #[inline(always)]
    pub fn ticks_in(&self, bytes: u64) -> u64 {
        const CEILING: u64 = 1 << 63;
        let bytes = if bytes > 1 << 39 { 1 << 39 } else { bytes };
        // `checked_div`, not `/`: a division the compiler cannot prove safe would carry a
        // panic path, which the eBPF verifier refuses.
        let room = CEILING.checked_div(self.ticks_per_byte).unwrap_or(u64::MAX);
        if bytes > room {
            return CEILING;
        }
        let exact_or_more =
            bytes * self.ticks_per_byte + ((bytes * self.ticks_per_byte_frac) >> FRAC_BITS);
        exact_or_more.saturating_sub((bytes >> FRAC_BITS) + 1)
    }

    /// Whole bytes the bucket earns in `ticks`, rounded down, by 64-bit division: the
    /// divisor is the ticks per byte with 16 fraction bits, rounded up (off by less than
    /// 2^-14 of itself at 400 Gbit/s); below about 120 bit/s the whole ticks plus one.
    #[inline(always)]
    pub fn bytes_in(&self, ticks: u64) -> u64 {
        if self.ticks_per_byte >= 1 << 30 {
            return ticks
                .checked_div(self.ticks_per_byte.wrapping_add(1))
                .unwrap_or(0);
        }
        let divisor = (self.ticks_per_byte << 16) + ((self.ticks_per_byte_frac + 0xff) >> 8);
        let (Some(whole), Some(rest)) = (ticks.checked_div(divisor), ticks.checked_rem(divisor))
        else {
            return 0;
        };
        if whole >= 1 << 47 {
            return 1 << 63;
        }
        (whole << 16) + ((rest << 16).checked_div(divisor).unwrap_or(0))
    }
}

/// Largest per-CPU credit chunk.
pub const MAX_CREDIT_CHUNK: u64 = 16 * 1024;
/// Smallest chunk worth having: one full-size Ethernet frame.
const MIN_CREDIT_CHUNK: u64 = 1514;

/// The per-CPU credit chunk for a class bucket of `rate_bits_per_sec` and `burst_bytes` on
/// `cpus` CPUs: a quarter of the burst spread over the CPUs, at most 1 ms at the rate
/// (credit a CPU sits on delays nobody by more than that) and at most
/// [`MAX_CREDIT_CHUNK`]; 0 (charge per packet) when that is less than one full frame, so
/// classes below about 12 Mbit/s, whose packet rates cause no contention, keep the
/// per-packet bucket.
pub fn credit_chunk(rate_bits_per_sec: u64, burst_bytes: u64, cpus: u64) -> u64 {
    let one_milli = rate_bits_per_sec / 8 / 1000;
    let chunk = (burst_bytes / (4 * cpus.max(1)))
        .min(one_milli)
        .min(MAX_CREDIT_CHUNK);
    if chunk < MIN_CREDIT_CHUNK {
        0
    } else {
        chunk
    }
}

/// The shared bucket's burst when each of `cpus` CPUs may hold `chunk` bytes of credit:
/// the two together never exceed `burst_bytes`.
pub fn shared_burst(burst_bytes: u64, cpus: u64, chunk: u64) -> u64 {
    burst_bytes - cpus * chunk
}

/// What a packet of `bytes` does with `credit` bytes of this CPU's credit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CreditUse {
    /// The credit covers the packet; `left` remains.
    Covered { left: u64 },
    /// Charge the shared bucket `first` bytes (a chunk, or what is missing if more), or
    /// failing that `fallback` (exactly what is missing); the credit then becomes
    /// `credit + charged - bytes`.
    Take { first: u64, fallback: u64 },
}

#[inline(always)]
pub fn use_credit(credit: u64, bytes: u64, chunk: u64) -> CreditUse {
    if credit >= bytes {
        return CreditUse::Covered {
            left: credit - bytes,
        };
    }
    let missing = bytes - credit;
    CreditUse::Take {
        first: if chunk > missing { chunk } else { missing },
        fallback: missing,
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
    let (now, _, next) = advance(tat, now_ns, bytes, cost);
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
    let (now, start, next) = advance(tat, now_ns, bytes, cost);
    if start - now > horizon_ticks {
        return None;
    }
    Some((next, start >> TICK_BITS))
}

/// The one GCRA step every use of a bucket word shares: `now` in ticks, the packet's
/// start `max(tat, now)`, and the word after it, `start + bytes / rate`.
#[inline(always)]
pub fn advance(tat: u64, now_ns: u64, bytes: u64, cost: &ByteCost) -> (u64, u64, u64) {
    let now = ticks(now_ns);
    let start = if tat > now { tat } else { now };
    (now, start, start + cost.ticks_for(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rates from the slowest the arithmetic supports to the fastest it is specified for.
    const RATES: [u64; 6] = [
        8,
        1_000,
        12_345_678,
        100_000_000,
        1_000_000_000,
        400_000_000_000,
    ];

    /// The exact ticks `bytes` are worth at `rate`, rounded down (u128 reference).
    fn exact_ticks(bytes: u64, rate: u64) -> u128 {
        bytes as u128 * 8 * TICKS_PER_SEC / rate as u128
    }

    #[test]
    fn a_charge_above_the_largest_is_the_largest() {
        for rate in RATES {
            let cost = ByteCost::new(rate, 1 << 20);
            assert_eq!(
                cost.ticks_for(MAX_CHARGE_BYTES + 1),
                cost.ticks_for(MAX_CHARGE_BYTES)
            );
            assert_eq!(cost.ticks_for(u64::MAX), cost.ticks_for(MAX_CHARGE_BYTES));
            assert!(cost.ticks_for(MAX_CHARGE_BYTES) > cost.ticks_for(MAX_CHARGE_BYTES - 10));
        }
    }

    #[test]
    fn tokens_in_ticks_are_the_exact_worth_rounded_down() {
        for rate in RATES {
            let cost = ByteCost::new(rate, 1 << 20);
            // (No whole tick a byte at 400 Gbit/s: nothing to saturate.)
            let room = (1u64 << 63)
                .checked_div(cost.ticks_per_byte)
                .unwrap_or(u64::MAX);
            for bytes in [1u64, 1500, 1 << 20, 123_456_789, 1 << 30, 1 << 39] {
                let exact = exact_ticks(bytes, rate);
                let got = cost.ticks_in(bytes) as u128;
                if bytes > room {
                    assert_eq!(got, 1 << 63, "{bytes} B at {rate} bit/s saturates");
                    continue;
                }
                // The stored cost is the exact one rounded up by under 2^-24 tick a byte,
                // and ticks_in takes that excess (and one tick more) off again.
                let slack = (bytes >> FRAC_BITS) as u128 + 2;
                assert!(
                    got <= exact && got + slack >= exact,
                    "{bytes} B at {rate} bit/s: {got} ticks, exactly {exact}"
                );
            }
            // Token counts above 2^39 bytes count as 2^39.
            assert_eq!(
                cost.ticks_in(1 << 40),
                cost.ticks_in(1 << 39),
                "{rate} bit/s"
            );
        }
        // The slowest rate: the worth saturates one byte past what 2^63 ticks hold.
        let slowest = ByteCost::new(MIN_RATE_BITS_PER_SEC, 1 << 20);
        let room = (1u64 << 63) / slowest.ticks_per_byte;
        assert!(slowest.ticks_in(room) < 1 << 63);
        assert_eq!(slowest.ticks_in(room + 1), 1 << 63);
    }

    #[test]
    fn bytes_in_ticks_are_the_exact_count_rounded_down() {
        for rate in RATES {
            let cost = ByteCost::new(rate, 1 << 20);
            // Also three and a half 65 536-byte units: the remainder's part of the count.
            let units = (cost.ticks_per_byte << 16) * 3 + (cost.ticks_per_byte << 15);
            for ticks in [1u64, 1 << 20, 123_456_789_012, 1 << 50, units, u64::MAX] {
                let exact = ticks as u128 * rate as u128 / (8 * TICKS_PER_SEC);
                let got = cost.bytes_in(ticks);
                // Past 2^63 bytes the count saturates there.
                if exact >= 1 << 63 {
                    assert_eq!(got, 1 << 63, "{ticks} ticks at {rate} bit/s");
                    continue;
                }
                let exact = exact as u64;
                // Rounded down, by a divisor rounded up by under 2^-14 of itself.
                assert!(
                    got <= exact && got + 1 + (exact >> 14) >= exact,
                    "{ticks} ticks at {rate} bit/s: {got} bytes, exactly {exact}"
                );
            }
        }
    }

    #[test]
    fn a_chunk_of_exactly_one_frame_is_a_chunk() {
        // 1 ms at 12.112 Mbit/s is 1514 bytes: one full-size frame.
        assert_eq!(credit_chunk(12_112_000, 1 << 20, 1), MIN_CREDIT_CHUNK);
        assert_eq!(credit_chunk(12_111_999, 1 << 20, 1), 0);
    }

    #[test]
    fn credit_covers_or_takes_a_chunk_or_what_is_missing() {
        assert_eq!(
            use_credit(5000, 1000, 8192),
            CreditUse::Covered { left: 4000 }
        );
        assert_eq!(
            use_credit(500, 1000, 8192),
            CreditUse::Take {
                first: 8192,
                fallback: 500
            }
        );
        // A GSO packet larger than a chunk takes just what it lacks.
        assert_eq!(
            use_credit(0, 65_000, 8192),
            CreditUse::Take {
                first: 65_000,
                fallback: 65_000
            }
        );
        assert_eq!(credit_chunk(1_000_000_000, 3000, 2), 0);
        assert_eq!(credit_chunk(1_000_000_000, 128 * 1024, 2), 16 * 1024);
        assert_eq!(credit_chunk(1_000_000_000, 64 * 1024, 2), 8 * 1024);
        // 1 ms at 100 Mbit/s is 12 500 bytes; at 10 Mbit/s less than a frame.
        assert_eq!(credit_chunk(100_000_000, 1 << 20, 2), 12_500);
        assert_eq!(credit_chunk(10_000_000, 1 << 20, 2), 0);
        assert_eq!(shared_burst(64 * 1024, 2, 8 * 1024), 48 * 1024);
    }

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
