//! Flow isolation inside a shape class (`--fair flow|src|dst`): each flow gets a fair share
//! of the class's rate while it wants it, with no queue of its own to do it.
//!
//! A shape class has one real queue (an HTB leaf, or fq's under EDT) and a virtual copy of
//! it (the class's GCRA word). Fairness adds a *virtual queue per flow* in the flow table,
//! draining at the flow's fair share: `finish` is when the flow's admitted bytes would
//! have left a fair queue (deficit round robin, as fq_codel serves its flows). A flow whose
//! packets arrive faster than its share builds a backlog there, and only there: its own
//! CoDel judges that backlog's sojourn and drops or CE-marks *its* packets, and beyond the
//! class's hard cap its excess is dropped whole (an unresponsive flow is held to its
//! share). A flow below its share has no backlog, so it is never dropped for another's
//! excess, and the packets admitted add up to about the class rate, so the real queue stays
//! short for everyone.
//!
//! **The share.** (See [`next_share`] for the rule.) In fair queueing a backlogged flow is served `rate / backlogged flows`,
//! and flows below that keep what they send. Here a flow's packet is charged its cost at
//! the class rate times the class's *share multiplier* `m` (rates are charged as time, so
//! the multiplier is all a flow's word needs), set once per CoDel interval by feedback
//! from the class's real queue ([`next_share`]): an interval through which the queue never
//! emptied means the flows together admit more than the rate, so `m` rises (by 1/4, or at
//! once to the weight of the flows found over their share); an interval in which it
//! emptied means the rate went unused, so `m` falls by 1/16 and the flows that want more
//! get it. `m` stays between 1 (one flow may take the whole rate) and the weight of the
//! class's bulk flows (an equal split among them).
//!
//! **Hosts first** (`--fair src|dst`, CAKE's dual-srchost/dual-dsthost): a flow weighs
//! `1 / (its host's flows)`, so a host with eight flows and a host with one split the rate
//! in half, and the eight share their half.
//!
//! Everything here is integer arithmetic the eBPF program runs, tested on the host.

use crate::codel::CodelState;

/// `ClassConfig::codel.fair` values: how a shape class shares its rate among its flows.
pub const FAIR_NONE: u32 = 0;
/// Every flow (5-tuple) its share: the default for shape classes.
pub const FAIR_FLOW: u32 = 1;
/// Each source address its share first, then each of its flows within it.
pub const FAIR_SRC: u32 = 2;
/// Each destination address its share first, then each of its flows within it.
pub const FAIR_DST: u32 = 3;

/// 1.0 in the share multiplier's and the weights' fixed point (16 fraction bits).
pub const SHARE_ONE: u64 = 1 << 16;
/// The largest share multiplier: a class's rate split among at most 65 536 flows.
pub const MAX_SHARE: u64 = SHARE_ONE << 16;
/// A host's flows counted at most (its flows' weights stay above zero).
pub const MAX_HOST_FLOWS: u64 = 1 << 16;
/// The spare bytes count at most 15/16 of an interval's: one flow beside many under their
/// share is not held to less than 1/16 of the rate by them.
const MAX_SPARE_DIVISOR: u64 = 16;
/// The share multiplier rises by 1/4 of itself an interval the queue stood, and falls by
/// 1/16 an interval it emptied: slowly, so that a flow that backed off (a Cubic sawtooth,
/// slow to grow back over a long path) keeps most of its share meanwhile.
const SHARE_RAISE_DIVISOR: u64 = 4;
const SHARE_LOWER_DIVISOR: u64 = 16;

/// A flow's (or, under `--fair src|dst`, a host's) entry in the shape flow table
/// (`FLOW_QUEUES`).
///
/// For a flow: `sparse` is its sparseness word (`codel::sparse`), `counted_in` the end of
/// the CoDel interval it was last counted in by the class's census, `finish` its virtual
/// queue's end (ticks, at its fair share), `over_share_in` the end of the interval it was
/// last counted in as over its share, and `codel` its own CoDel state.
///
/// For a host (the key of scope src or dst): `counted_in` is the end of the interval it
/// counts flows in, `over_share_in` its flows counted so far in it, `sparse` its flows in
/// the interval before (see [`host_flows`]), and `finish` its own virtual queue's end at
/// the host's share.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowQueue {
    pub sparse: u64,
    pub counted_in: u64,
    pub finish: u64,
    pub over_share_in: u64,
    pub codel: CodelState,
    /// The part of `finish`'s lead the flow (host) sent within the burst HTB sends ahead
    /// while the class's real queue was empty: it waits nowhere, so its queue's delay
    /// leaves it out (see [`burst_credit`]).
    pub credit: u64,
}

/// The shape path's per-CPU scratch (`FLOW_SCRATCH`): a flow table key and a new entry.
/// Never read by userspace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowScratch {
    pub key: crate::BucketKey,
    pub entry: FlowQueue,
}

/// What each CPU counts of a shape class's drops and marks by cause (one per-CPU map value
/// per class): the class queue's (its CoDel and hard cap) apart from a flow's own queue's
/// (a flow over its fair share: its CoDel and the cap).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShapeStats {
    pub queue_dropped_packets: u64,
    pub queue_dropped_bytes: u64,
    pub fair_dropped_packets: u64,
    pub fair_dropped_bytes: u64,
    pub fair_marked_packets: u64,
    pub fair_marked_bytes: u64,
}

impl ShapeStats {
    /// Adds another CPU's counters.
    pub fn accumulate(&mut self, other: &ShapeStats) {
        self.queue_dropped_packets += other.queue_dropped_packets;
        self.queue_dropped_bytes += other.queue_dropped_bytes;
        self.fair_dropped_packets += other.fair_dropped_packets;
        self.fair_dropped_bytes += other.fair_dropped_bytes;
        self.fair_marked_packets += other.fair_marked_packets;
        self.fair_marked_bytes += other.fair_marked_bytes;
    }
}

/// The share multiplier for the next interval from the one that ended: `share` (its own),
/// `congested` (the class's queue never emptied through it), `bulk_weight` (its bulk
/// flows' weights, [`SHARE_ONE`] each without hosts), `over_weight` (the weights of those
/// found over their share), `spare_bytes` (every other packet's bytes) and `window_bytes`
/// (what the class sends in an interval at its rate). Within
/// `[SHARE_ONE, max(bulk_weight, SHARE_ONE)]`.
///
/// - Two flows or more over their share and a queue that stood: they contend, and `m`
///   rises by a quarter, or at once to their weight (an equal split among them).
/// - At most one flow over its share: nobody contends with it, and it may have what the
///   others leave, `weight / (1 − spare / window)` (max-min fairness; a flow alone and a
///   probe beside it: the flow gets the rate less the probe's).
/// - Otherwise (the queue emptied: the rate went unused) `m` falls by 1/16 an interval, so
///   flows that want more get what others leave, slowly enough that a flow that backed
///   off keeps most of its share while it grows back; never below the max-min bound.
#[inline(always)]
pub fn next_share(
    share: u64,
    congested: bool,
    (bulk_weight, over_weight): (u64, u64),
    spare_bytes: u64,
    window_bytes: u64,
) -> u64 {
    let share = share.clamp(SHARE_ONE, MAX_SHARE);
    let contended = over_weight > SHARE_ONE;
    let lowered = share - share / SHARE_LOWER_DIVISOR;
    let next = if congested && contended {
        let raised = share + share / SHARE_RAISE_DIVISOR;
        if over_weight > raised {
            over_weight
        } else {
            raised
        }
    } else if contended {
        lowered
    } else {
        let left = what_others_leave(over_weight, spare_bytes, window_bytes);
        if left > lowered {
            left
        } else {
            lowered
        }
    };
    let most = bulk_weight.clamp(SHARE_ONE, MAX_SHARE);
    // min/max, not `clamp`: with a bound the compiler cannot prove ordered, `clamp` keeps
    // a panic path, which 6.1's verifier walks and refuses (newer ones prove it dead).
    next.max(SHARE_ONE).min(most)
}

/// `weight / (1 − spare / window)` in the share's fixed point: the multiplier that leaves
/// the flows over their share (`weight`) what the others' `spare_bytes` leave of the
/// interval's `window_bytes`; the spare held to 15/16 of the window.
#[inline(always)]
fn what_others_leave(weight: u64, spare_bytes: u64, window_bytes: u64) -> u64 {
    // Bytes up to 2^40 a window (400 Gbit/s for 20 s): the ratio's shift stays in 64 bits.
    let window = window_bytes.clamp(1, 1 << 40);
    let left = window
        .saturating_sub(spare_bytes)
        .max(window / MAX_SPARE_DIVISOR)
        .max(1);
    // In [1, 16] with 16 fraction bits; `checked_div`: no panic path for the verifier.
    let ratio = (window << 16).checked_div(left).unwrap_or(SHARE_ONE);
    let weight = weight.clamp(SHARE_ONE, MAX_SHARE);
    (weight * ratio) >> 16
}

/// A flow's charge for a packet that costs `class_ticks` at the class rate: that times the
/// share multiplier and its host's flow count (1 without hosts), saturating far above
/// any queue (2^62 ticks).
#[inline(always)]
pub fn flow_ticks(class_ticks: u64, share: u64, host_flows: u64) -> u64 {
    const CEILING: u64 = 1 << 62;
    let share = share.clamp(SHARE_ONE, MAX_SHARE);
    // Split so neither product overflows: (hi << 16 + lo) * share >> 16, with share at
    // most 2^32. No `saturating_mul`: its overflow check is a 128-bit multiply, which the
    // BPF target lacks.
    let high = class_ticks >> 16;
    if high >= 1 << 30 {
        return CEILING;
    }
    let low = ((class_ticks & 0xffff) * share) >> 16;
    let ticks = high * share + low;
    // At most 2^16 flows a host; a charge of 2^46 ticks (73 minutes) already saturates.
    let hosts = host_flows.clamp(1, MAX_HOST_FLOWS);
    if ticks >= 1 << 46 {
        return CEILING;
    }
    ticks * hosts
}

/// A flow's weight in the census: [`SHARE_ONE`] divided among its host's flows.
#[inline(always)]
pub fn flow_weight(host_flows: u64) -> u64 {
    SHARE_ONE
        .checked_div(host_flows.max(1))
        .unwrap_or(SHARE_ONE)
        .max(1)
}

/// Whether a flow is over its share: its virtual queue still holds more than this packet's
/// own charge when the packet arrives (a flow at or below its share finds it drained, but
/// for the packet just before).
#[inline(always)]
pub fn over_share(finish: u64, now_ticks: u64, charge_ticks: u64) -> bool {
    finish > now_ticks.saturating_add(charge_ticks)
}

/// Whether a flow's packet is sparse in a fair class (`codel::sparse`, with the packet's
/// cost on the sparseness word times the share multiplier): sparse below 1/16 of the
/// flow's fair share, not of the class rate, so that with many flows (each under 1/16 of
/// the rate) a bulk flow still is one, and is held to its share.
#[inline(always)]
pub fn sparse_at_share(
    tat: u64,
    now_ns: u64,
    bytes: u64,
    cost: &crate::ByteCost,
    share: u64,
) -> (bool, u64) {
    let now = crate::bucket::ticks(now_ns);
    let start = if tat > now { tat } else { now };
    let next = start + flow_ticks(cost.ticks_for(bytes), share, 1);
    (next - now <= cost.tolerance_ticks, next)
}

/// A flow's own queue's delay (ns, at its share) as its CoDel judges it: 0 while it holds
/// at most one frame (`frame_ns`: a frame's time at the flow's share), as fq_codel never
/// drops a flow's only packet.
#[inline(always)]
pub fn flow_sojourn_ns(sojourn_ns: u64, frame_ns: u64) -> u64 {
    if sojourn_ns <= frame_ns {
        0
    } else {
        sojourn_ns
    }
}

/// The most a flow's own queue may hold (ns, at its share) before its excess is dropped:
/// four CoDel targets and at least four packets at its share. The class's real queue
/// holds about the average of its flows' own queues, so this bounds what an unresponsive
/// flow (UDP, or BBR beyond its share) adds to everyone's delay. (Letting a flow that
/// heeds its CoDel stand up to the class's cap, as one queue's flow could, gave Cubic
/// more beside BBR, 0.53 / 0.39, and no more beside UDP over 40 ms: not kept.)
#[inline(always)]
pub fn flow_cap_ns(target_ns: u64, frame_ns: u64) -> u64 {
    let targets = 4 * target_ns;
    let frames = frame_ns.saturating_mul(4);
    if targets > frames {
        targets
    } else {
        frames
    }
}

/// A flow's (or host's) credit after an admitted packet of `charge` ticks: what it sent
/// while the class's real queue was empty (`within_burst`) went out within the burst HTB
/// sends ahead and waits nowhere, so it is credited, up to the class's burst
/// (`burst_ticks`); a flow whose queue drained (`drained`) starts over. Each flow gets
/// credit only for the burst it took, so the flows' queues add up to the real queue: a
/// share of the burst granted to every flow would let each stand that much queue.
#[inline(always)]
pub fn burst_credit(
    credit: u64,
    drained: bool,
    within_burst: bool,
    charge: u64,
    burst_ticks: u64,
) -> u64 {
    let credit = if drained { 0 } else { credit };
    if !within_burst {
        return credit;
    }
    let credit = credit.saturating_add(charge);
    if credit > burst_ticks {
        burst_ticks
    } else {
        credit
    }
}

/// A host's flows: the larger of the last interval's count and this one's so far, at least
/// 1 (as the class's census).
#[inline(always)]
pub fn host_flows(host: &FlowQueue) -> u64 {
    host.sparse.max(host.over_share_in).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: u64 = 125_000;

    #[test]
    fn contending_flows_split_the_rate_among_them() {
        let two = 2 * SHARE_ONE;
        // Two flows over their share and a standing queue: at once to two.
        assert_eq!(next_share(SHARE_ONE, true, (two, two), 0, WINDOW), two);
        // Four bulk flows, three over their share: a quarter at a time past three.
        let four = 4 * SHARE_ONE;
        let three = 3 * SHARE_ONE;
        assert_eq!(
            next_share(three, true, (four, three), 0, WINDOW),
            three * 5 / 4
        );
        // Never past the bulk flows: an equal split among them.
        assert_eq!(next_share(four, true, (two, two), 0, WINDOW), two);
    }

    #[test]
    fn a_flow_alone_over_its_share_gets_what_the_others_leave() {
        let two = 2 * SHARE_ONE;
        // A flow beside a probe sending 1/10 of the window: 1 / 0.9.
        let m = next_share(SHARE_ONE, true, (two, SHARE_ONE), WINDOW / 10, WINDOW);
        assert!((m as i64 - (SHARE_ONE * 10 / 9) as i64).abs() <= 2, "{m}");
        // A flood beside a flow using 0.4 of the rate: the flood gets 0.6.
        let m = next_share(SHARE_ONE, true, (two, SHARE_ONE), WINDOW * 4 / 10, WINDOW);
        assert!((m as i64 - (SHARE_ONE * 10 / 6) as i64).abs() <= 2, "{m}");
        // ... but falls toward it by 1/16 an interval, not at once.
        let m = next_share(two, true, (two, SHARE_ONE), 0, WINDOW);
        assert_eq!(m, two - two / 16);
        // Spare bytes beyond the window: held to 15/16.
        let m = next_share(
            SHARE_ONE,
            false,
            (32 * SHARE_ONE, SHARE_ONE),
            10 * WINDOW,
            WINDOW,
        );
        assert!(m.abs_diff(16 * SHARE_ONE) <= 16 * SHARE_ONE / 1000, "{m}");
    }

    #[test]
    fn an_idle_moment_lowers_the_share_of_contending_flows_slowly() {
        let two = 2 * SHARE_ONE;
        assert_eq!(
            next_share(two, false, (two, two), 0, WINDOW),
            two - two / 16
        );
        // A fresh census (share 0) reads as one.
        assert_eq!(next_share(0, false, (two, 0), 0, WINDOW), SHARE_ONE);
    }

    #[test]
    fn hosts_share_first_then_their_flows() {
        // Host A's eight flows and host B's one, all over their shares: weight 2.
        let weight = 8 * flow_weight(8) + flow_weight(1);
        let m = next_share(SHARE_ONE, true, (weight, weight), 0, WINDOW);
        assert_eq!(m, 2 * SHARE_ONE);
        let cost = 1_000_000;
        // A's flows pay 16 times the class cost (1/16 each, 1/2 together); B's twice.
        assert_eq!(flow_ticks(cost, m, 8), 16 * cost);
        assert_eq!(flow_ticks(cost, m, 1), 2 * cost);
    }

    #[test]
    fn charges_keep_their_precision_and_saturate() {
        // 1500 bytes at 100 Gbit/s is 1920 ticks: times 3/2 exactly.
        assert_eq!(flow_ticks(1920, SHARE_ONE * 3 / 2, 1), 2880);
        assert_eq!(flow_ticks(u64::MAX, MAX_SHARE, MAX_SHARE), 1 << 62);
        assert_eq!(flow_ticks(1 << 45, SHARE_ONE, 4), 1 << 47);
        assert_eq!(flow_ticks(1 << 46, SHARE_ONE, 4), 1 << 62);
        assert_eq!(flow_ticks(7, 0, 0), 7, "below one: the class rate");
    }

    #[test]
    fn a_flow_is_over_its_share_only_with_more_than_its_packet_queued() {
        assert!(!over_share(0, 1_000, 100));
        assert!(!over_share(1_100, 1_000, 100));
        assert!(over_share(1_101, 1_000, 100));
    }

    #[test]
    fn a_flow_queue_of_one_frame_is_never_judged_and_the_cap_holds_four() {
        assert_eq!(flow_sojourn_ns(1_000, 1_200), 0);
        assert_eq!(flow_sojourn_ns(1_300, 1_200), 1_300);
        assert_eq!(flow_cap_ns(5_000_000, 1_200_000), 20_000_000);
        // 64 flows at 10 Mbit/s: a frame takes 77 ms at a share.
        assert_eq!(flow_cap_ns(5_000_000, 77_000_000), 308_000_000);
    }

    #[test]
    fn a_flow_is_sparse_below_a_sixteenth_of_its_share() {
        let cost = crate::codel::sparse_cost(10_000_000);
        // At a share of one this is the class's own rule.
        for bytes in [64, 1514] {
            assert_eq!(
                sparse_at_share(0, 1_000_000, bytes, &cost, SHARE_ONE),
                crate::codel::sparse(0, 1_000_000, bytes, &cost)
            );
        }
        // A steady flow at 1/20 of the class rate is sparse alone, bulk among 4 sharing it.
        let gap_ns = 1514 * 8 * 1_000_000_000 / (10_000_000 / 20);
        let mut words = (0, 0);
        let mut verdicts = (true, true);
        for packet in 1..200u64 {
            let now = packet * gap_ns;
            let alone = sparse_at_share(words.0, now, 1514, &cost, SHARE_ONE);
            let shared = sparse_at_share(words.1, now, 1514, &cost, 4 * SHARE_ONE);
            words = (alone.1, shared.1);
            verdicts = (alone.0, shared.0);
        }
        assert_eq!(verdicts, (true, false));
    }

    #[test]
    fn only_what_a_flow_sent_within_the_burst_is_credited() {
        // Within the burst: credited, up to the burst.
        assert_eq!(burst_credit(0, false, true, 100, 1_000), 100);
        assert_eq!(burst_credit(950, false, true, 100, 1_000), 1_000);
        // Behind a real queue: kept as it was, not grown.
        assert_eq!(burst_credit(300, false, false, 100, 1_000), 300);
        // A drained queue starts over.
        assert_eq!(burst_credit(300, true, false, 100, 1_000), 0);
        assert_eq!(burst_credit(300, true, true, 100, 1_000), 100);
    }

    #[test]
    fn a_host_counts_at_least_one_flow() {
        let host = FlowQueue::default();
        assert_eq!(host_flows(&host), 1);
        let host = FlowQueue {
            sparse: 3,
            over_share_in: 5,
            ..FlowQueue::default()
        };
        assert_eq!(host_flows(&host), 5);
        assert_eq!(flow_weight(0), SHARE_ONE);
        assert_eq!(flow_weight(4), SHARE_ONE / 4);
    }
}
