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
//! **The share.** In fair queueing a backlogged flow is served `rate / backlogged flows`,
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
/// flows' weights, [`SHARE_ONE`] each without hosts) and `over_weight` (the weights of
/// those found over their share). Within `[SHARE_ONE, max(bulk_weight, SHARE_ONE)]`.
#[inline(always)]
pub fn next_share(share: u64, congested: bool, bulk_weight: u64, over_weight: u64) -> u64 {
    let share = share.clamp(SHARE_ONE, MAX_SHARE);
    let next = if congested {
        let raised = share + share / SHARE_RAISE_DIVISOR;
        // Flows (hosts) all found over their share want at least an equal split.
        if over_weight > raised {
            over_weight
        } else {
            raised
        }
    } else {
        share - share / SHARE_LOWER_DIVISOR
    };
    let most = bulk_weight.clamp(SHARE_ONE, MAX_SHARE);
    next.clamp(SHARE_ONE, most)
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

    #[test]
    fn a_congested_class_splits_its_rate_among_its_bulk_flows() {
        let two = 2 * SHARE_ONE;
        // Two flows over their share: at once to two.
        assert_eq!(next_share(SHARE_ONE, true, two, two), two);
        // One over its share: a step at a time, up to the bulk flows.
        assert_eq!(
            next_share(SHARE_ONE, true, two, SHARE_ONE),
            SHARE_ONE * 5 / 4
        );
        assert_eq!(next_share(two, true, two, SHARE_ONE), two);
        // A fresh census (share 0) reads as one.
        assert_eq!(next_share(0, true, two, 0), SHARE_ONE * 5 / 4);
    }

    #[test]
    fn an_idle_moment_gives_the_flows_that_want_more_a_larger_share() {
        let two = 2 * SHARE_ONE;
        assert_eq!(next_share(two, false, two, two), two - two / 16);
        assert_eq!(next_share(SHARE_ONE, false, two, 0), SHARE_ONE);
        // Fewer bulk flows than the share: down to them at once.
        assert_eq!(next_share(4 * SHARE_ONE, true, two, two), two);
    }

    #[test]
    fn hosts_share_first_then_their_flows() {
        // Host A's eight flows and host B's one, all over their shares: weight 2.
        let weight = 8 * flow_weight(8) + flow_weight(1);
        let m = next_share(SHARE_ONE, true, weight, weight);
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
