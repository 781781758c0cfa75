//! Three-colour meters, colour-blind: RFC 2697 (srTCM) and RFC 2698 (trTCM), each kept
//! as two GCRA words (see [`crate::bucket`]) so every word is updated by one
//! compare-and-swap.
//!
//! trTCM: bucket P (PIR, PBS) and bucket C (CIR, CBS) map one to one onto two GCRA words.
//!
//! srTCM: bucket C (CIR, CBS) overflows into bucket E (EBS). Tokens always go to C first,
//! so while C is not full E does not grow, and the pair is exactly described by C's word
//! and a word for the *total* deficit of C and E (rate CIR, tolerance CBS + EBS): the
//! total deficit shrinks at CIR, all of it C's until C is full, then E's. E's deficit is
//! the difference of the two. A green packet deepens both, a yellow one only the total.

use crate::{
    bucket::{ticks, ByteCost, TAT_MASK},
    ClassConfig, CostKind,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Colour {
    Green,
    Yellow,
    Red,
}

/// Meter kinds as stored in `ClassConfig::meter`.
pub const METER_NONE: u8 = 0;
pub const METER_SRTCM: u8 = 1;
pub const METER_TRTCM: u8 = 2;

/// How deep a bucket word is at `now` (0 = full), in ticks.
#[inline(always)]
pub fn deficit(tat: u64, now_ns: u64) -> u64 {
    tat.saturating_sub(ticks(now_ns))
}

/// The word after charging `cost_ticks` at `now`.
#[inline(always)]
pub fn charged(tat: u64, now_ns: u64, cost_ticks: u64) -> u64 {
    let now = ticks(now_ns);
    (if tat > now { tat } else { now }) + cost_ticks
}

/// RFC 2698, colour-blind. `peak` is (PIR, PBS), `committed` (CIR, CBS). Returns the
/// colour and the new words (P, C).
#[inline(always)]
pub fn trtcm(
    tat_p: u64,
    tat_c: u64,
    now_ns: u64,
    bytes: u64,
    peak: &ByteCost,
    committed: &ByteCost,
) -> (Colour, u64, u64) {
    let cost_p = peak.ticks_for(bytes);
    let cost_c = committed.ticks_for(bytes);
    // "If Tp(t)-B < 0, the packet is red."
    if deficit(tat_p, now_ns) + cost_p > peak.tolerance_ticks {
        return (Colour::Red, tat_p, tat_c);
    }
    let new_p = charged(tat_p, now_ns, cost_p);
    // "else if Tc(t)-B < 0, the packet is yellow and Tp is decremented by B."
    if deficit(tat_c, now_ns) + cost_c > committed.tolerance_ticks {
        return (Colour::Yellow, new_p, tat_c);
    }
    // "else the packet is green and both Tp and Tc are decremented by B."
    (Colour::Green, new_p, charged(tat_c, now_ns, cost_c))
}

/// RFC 2697, colour-blind. `committed` is (CIR, CBS), `total` is (CIR, CBS + EBS).
/// Returns the colour and the new words (C, total).
#[inline(always)]
pub fn srtcm(
    tat_c: u64,
    tat_total: u64,
    now_ns: u64,
    bytes: u64,
    committed: &ByteCost,
    total: &ByteCost,
) -> (Colour, u64, u64) {
    let cost = committed.ticks_for(bytes);
    let deficit_c = deficit(tat_c, now_ns);
    // "If Tc(t)-B >= 0, the packet is green and Tc is decremented by B."
    if deficit_c + cost <= committed.tolerance_ticks {
        return (
            Colour::Green,
            charged(tat_c, now_ns, cost),
            charged(tat_total, now_ns, cost),
        );
    }
    // "else if Te(t)-B >= 0, the packet is yellow and Te is decremented by B."
    if excess_has_room(tat_c, tat_total, now_ns, cost, committed, total) {
        return (Colour::Yellow, tat_c, charged(tat_total, now_ns, cost));
    }
    (Colour::Red, tat_c, tat_total)
}

/// srTCM: whether bucket E holds `cost` ticks (E's deficit is the total's less C's).
#[inline(always)]
pub fn excess_has_room(
    tat_c: u64,
    tat_total: u64,
    now_ns: u64,
    cost: u64,
    committed: &ByteCost,
    total: &ByteCost,
) -> bool {
    let excess_burst = total.tolerance_ticks - committed.tolerance_ticks;
    let deficit_e = deficit(tat_total, now_ns).saturating_sub(deficit(tat_c, now_ns));
    deficit_e + cost <= excess_burst
}

/// One of a meter's two stored words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeterWord {
    /// C, the committed bucket (both meters).
    Committed,
    /// trTCM's P; srTCM's total of C and E.
    Second,
}

/// A meter's two words as every CPU shares them: the map value in the eBPF program, a
/// model of racing CPUs in the host tests.
pub trait MeterWords {
    fn load(&mut self, word: MeterWord) -> u64;
    /// Compare-and-swap: true when `current` was still stored and is now `new`.
    fn swap(&mut self, word: MeterWord, current: u64, new: u64) -> bool;
}

/// The colour of one packet; each of the meter's two words changes by compare-and-swap,
/// at most `attempts` rounds (then the packet is red).
///
/// The second word is charged first: every packet that is not red deepens it (trTCM's P,
/// srTCM's total), and a green packet then deepens C. Between a green packet's two swaps
/// other CPUs see it charged as a yellow packet, never as not charged at all, so they
/// judge against fewer tokens than the meter holds, never more. A green packet whose C
/// changed under it (another CPU took C's tokens) gets the colour it would have had
/// without C: yellow in trTCM; in srTCM yellow if E had room for it in the snapshot it was
/// judged on, which holds no more of E than there is, else red (its bytes stay in the
/// total: the meter holds a packet less than it could). Under contention a packet may
/// come out a colour worse than in some serial order, never better: no bucket of a meter
/// admits more than it holds.
#[inline(always)]
pub fn colour_of<W: MeterWords>(
    words: &mut W,
    class: &ClassConfig,
    bytes: u64,
    now: u64,
    attempts: u32,
) -> Colour {
    let trtcm_meter = class.meter == METER_TRTCM;
    // A swap of the second word succeeds only if no packet was charged to it since it was
    // read, and every packet charges it before C: so C as read then holds no packet the
    // second word does not, and E (their difference) is judged to hold no more than it does.
    let mut stored_c = words.load(MeterWord::Committed);
    let mut stored_second = words.load(MeterWord::Second);
    // Words of an older cost version are converted (tokens kept) in the swaps below. Only
    // the first read can find one: a CPU that won a race wrote the current version.
    let mut c = class.settle(stored_c, now, CostKind::Main);
    let mut second = class.settle(stored_second, now, CostKind::Peak);
    for _ in 0..attempts {
        let (colour, new_c, new_second, without_c) = if trtcm_meter {
            let (colour, new_p, new_c) =
                trtcm(second, c, now, bytes, &class.peak_cost, &class.cost);
            (colour, new_c, new_p, Colour::Yellow)
        } else {
            let (colour, new_c, new_total) =
                srtcm(c, second, now, bytes, &class.cost, &class.peak_cost);
            // Needed only when C's swap is lost, but computed here: computed there, the
            // eBPF meter's frame grows past the 512-byte stack it shares.
            let cost = class.cost.ticks_for(bytes);
            let excess = excess_has_room(c, second, now, cost, &class.cost, &class.peak_cost);
            (
                colour,
                new_c,
                new_total,
                if excess { Colour::Yellow } else { Colour::Red },
            )
        };
        if colour == Colour::Red {
            return Colour::Red;
        }
        if words.swap(MeterWord::Second, stored_second, class.stamp(new_second)) {
            if colour == Colour::Yellow
                || words.swap(MeterWord::Committed, stored_c, class.stamp(new_c))
            {
                return colour;
            }
            return without_c;
        }
        stored_c = words.load(MeterWord::Committed);
        stored_second = words.load(MeterWord::Second);
        (c, second) = (stored_c & TAT_MASK, stored_second & TAT_MASK);
    }
    Colour::Red
}

/// The RFCs' own definitions, token by token: the reference the two-word meters are
/// checked against, on the host (below) and in the kernel (BPF_PROG_TEST_RUN replays in
/// the tests crate). Tokens are counted in ticks (bytes × ticks per byte); `last` and
/// the times given are nanoseconds. Buckets start full.
pub mod rfc {
    use super::Colour;
    use crate::bucket::{ticks, ByteCost};

    /// RFC 2698 section 3: Tp and Tc start full and grow by PIR / CIR, capped at PBS / CBS.
    pub struct RfcTrTcm {
        pub tp: u64,
        pub tc: u64,
        pub pbs: u64,
        pub cbs: u64,
        pub last: u64,
    }

    impl RfcTrTcm {
        pub fn packet(&mut self, now: u64, cost_p: u64, cost_c: u64) -> Colour {
            let dt = ticks(now - self.last);
            self.last = now;
            self.tp = (self.tp + dt).min(self.pbs);
            self.tc = (self.tc + dt).min(self.cbs);
            if self.tp < cost_p {
                Colour::Red
            } else if self.tc < cost_c {
                self.tp -= cost_p;
                Colour::Yellow
            } else {
                self.tp -= cost_p;
                self.tc -= cost_c;
                Colour::Green
            }
        }
    }

    /// RFC 2697 section 3: tokens go to C until it holds CBS, then to E up to EBS.
    pub struct RfcSrTcm {
        pub tc: u64,
        pub te: u64,
        pub cbs: u64,
        pub ebs: u64,
        pub last: u64,
    }

    impl RfcSrTcm {
        pub fn packet(&mut self, now: u64, cost: u64) -> Colour {
            let mut refill = ticks(now - self.last);
            self.last = now;
            let to_c = refill.min(self.cbs - self.tc);
            self.tc += to_c;
            refill -= to_c;
            self.te = (self.te + refill).min(self.ebs);
            if self.tc >= cost {
                self.tc -= cost;
                Colour::Green
            } else if self.te >= cost {
                self.te -= cost;
                Colour::Yellow
            } else {
                Colour::Red
            }
        }
    }

    impl RfcTrTcm {
        /// Full buckets P (PIR, PBS) and C (CIR, CBS) at `now_ns`.
        pub fn full(peak: &ByteCost, committed: &ByteCost, now_ns: u64) -> Self {
            Self {
                tp: peak.tolerance_ticks,
                tc: committed.tolerance_ticks,
                pbs: peak.tolerance_ticks,
                cbs: committed.tolerance_ticks,
                last: now_ns,
            }
        }
    }

    impl RfcSrTcm {
        /// Full buckets C (CIR, CBS) and E (EBS) at `now_ns`; `total` is (CIR, CBS + EBS).
        pub fn full(committed: &ByteCost, total: &ByteCost, now_ns: u64) -> Self {
            let ebs = total.tolerance_ticks - committed.tolerance_ticks;
            Self {
                tc: committed.tolerance_ticks,
                te: ebs,
                cbs: committed.tolerance_ticks,
                ebs,
                last: now_ns,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The RFCs' own definitions, token by token, against the two-word meters. Rates are
    //! chosen with a whole number of ticks per byte so both sides are exact integers:
    //! tokens are counted in ticks (bytes × ticks per byte).
    use super::{rfc::*, *};

    /// RFC 2698: a packet that takes a bucket's last token (Tp(t) - B = 0) is not red,
    /// nor yellow by C: "< 0" is the test.
    #[test]
    fn a_packet_of_exactly_the_tokens_left_conforms() {
        // 1 µs a byte: 1500 bytes' cost is exactly the 1500-byte burst's tolerance.
        let committed = ByteCost::new(8_000_000, 1500);
        assert_eq!(committed.ticks_for(1500), committed.tolerance_ticks);
        let peak = ByteCost::new(8_000_000, 1500);
        let now = 1_000_000_000;
        assert_eq!(trtcm(0, 0, now, 1500, &peak, &committed).0, Colour::Green);
        // One byte more than either holds: red by P.
        assert_eq!(trtcm(0, 0, now, 1501, &peak, &committed).0, Colour::Red);
        // P has room, C exactly: green; C one byte short: yellow.
        let roomy = ByteCost::new(16_000_000, 3000);
        assert_eq!(trtcm(0, 0, now, 1500, &roomy, &committed).0, Colour::Green);
        assert_eq!(trtcm(0, 0, now, 1501, &roomy, &committed).0, Colour::Yellow);
        // The RFCs' own models say the same at the same edges.
        let cost = |bytes| committed.ticks_for(bytes);
        assert_eq!(
            RfcTrTcm::full(&peak, &committed, now).packet(now, cost(1500), cost(1500)),
            Colour::Green
        );
        assert_eq!(
            RfcTrTcm::full(&roomy, &committed, now).packet(now, roomy.ticks_for(1500), cost(1501)),
            Colour::Yellow
        );
        assert_eq!(
            RfcTrTcm::full(&peak, &committed, now).packet(now, cost(1501), cost(1501)),
            Colour::Red
        );
        assert_eq!(
            RfcTrTcm::full(&roomy, &committed, now).packet(now, roomy.ticks_for(1500), cost(1500)),
            Colour::Green
        );
    }

    /// srTCM's E holds EBS: the total's tolerance less C's.
    #[test]
    fn an_srtcm_starts_with_c_and_e_full() {
        let committed = ByteCost::new(8_000_000, 1500);
        let total = ByteCost::new(8_000_000, 1500 + 4500);
        let rfc = RfcSrTcm::full(&committed, &total, 7);
        assert_eq!(
            (rfc.tc, rfc.cbs),
            (committed.ticks_for(1500), committed.ticks_for(1500))
        );
        assert_eq!(
            (rfc.te, rfc.ebs),
            (committed.ticks_for(4500), committed.ticks_for(4500))
        );
        assert_eq!(rfc.last, 7);
    }

    const NS: u64 = 1;

    /// A tiny deterministic generator (no dependency for a test's dice).
    struct Dice(u64);
    impl Dice {
        fn next(&mut self, bound: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % bound
        }
    }

    /// Phases of overload (up to 0.4 ms apart) and of quiet (up to 4 ms apart), 500
    /// packets each, so every colour and every bucket level occurs.
    fn load_phase_gap(dice: &mut Dice, index: u32) -> u64 {
        if (index / 500).is_multiple_of(2) {
            dice.next(400_000)
        } else {
            dice.next(4_000_000)
        }
    }

    #[test]
    fn trtcm_matches_rfc_2698_token_by_token() {
        // CIR 8 Mbit/s (16 000 ticks/B), PIR 16 Mbit/s (8 000 ticks/B).
        let committed = ByteCost::new(8_000_000, 6_000);
        let peak = ByteCost::new(16_000_000, 12_000);
        let mut rfc = RfcTrTcm {
            tp: peak.tolerance_ticks,
            tc: committed.tolerance_ticks,
            pbs: peak.tolerance_ticks,
            cbs: committed.tolerance_ticks,
            last: 1_000_000 * NS,
        };
        let (mut tat_p, mut tat_c) = (0, 0);
        let mut now = rfc.last;
        let mut dice = Dice(3);
        let mut seen = [0; 3];
        for index in 0..20_000 {
            now += load_phase_gap(&mut dice, index);
            let bytes = 64 + dice.next(1437);
            let (colour, p, c) = trtcm(tat_p, tat_c, now, bytes, &peak, &committed);
            (tat_p, tat_c) = (p, c);
            let expected = rfc.packet(now, peak.ticks_for(bytes), committed.ticks_for(bytes));
            assert_eq!(colour, expected);
            assert_eq!(peak.tolerance_ticks - deficit(tat_p, now), rfc.tp, "Tp");
            assert_eq!(
                committed.tolerance_ticks - deficit(tat_c, now),
                rfc.tc,
                "Tc"
            );
            seen[colour as usize] += 1;
        }
        assert!(seen.iter().all(|n| *n > 100), "colours seen: {seen:?}");
    }

    #[test]
    fn srtcm_matches_rfc_2697_token_by_token() {
        let committed = ByteCost::new(8_000_000, 6_000);
        let total = ByteCost::new(8_000_000, 6_000 + 9_000);
        let mut rfc = RfcSrTcm {
            tc: committed.tolerance_ticks,
            te: total.tolerance_ticks - committed.tolerance_ticks,
            cbs: committed.tolerance_ticks,
            ebs: total.tolerance_ticks - committed.tolerance_ticks,
            last: 1_000_000 * NS,
        };
        let (mut tat_c, mut tat_t) = (0, 0);
        let mut now = rfc.last;
        let mut dice = Dice(11);
        let mut seen = [0; 3];
        for index in 0..20_000 {
            now += load_phase_gap(&mut dice, index);
            let bytes = 64 + dice.next(1437);
            let (colour, c, t) = srtcm(tat_c, tat_t, now, bytes, &committed, &total);
            (tat_c, tat_t) = (c, t);
            assert_eq!(colour, rfc.packet(now, committed.ticks_for(bytes)));
            let deficit_c = deficit(tat_c, now);
            assert_eq!(committed.tolerance_ticks - deficit_c, rfc.tc, "Tc");
            assert_eq!(rfc.ebs - (deficit(tat_t, now) - deficit_c), rfc.te, "Te");
            seen[colour as usize] += 1;
        }
        assert!(seen.iter().all(|n| *n > 100), "colours seen: {seen:?}");
    }
}
