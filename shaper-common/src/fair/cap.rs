//! A flow's (or host's) own queue's cap: short for a flow that heeds no drop, long for
//! TCP, and passed while the link is about to idle (see the module above).

use super::flow_ticks;

/// The most a flow's own queue may hold (ns, at its share) before its excess is dropped:
/// four CoDel targets, at least four packets at its share, and at least two of the packet
/// at hand (`packet_ns`, its charge: a GSO aggregate, forwarded as one, costs up to 44
/// frames). The class queue's CoDel judges the flows over their share long before (their
/// packets, not a neighbour's), so this holds what heeds no CoDel (UDP, or BBR beyond its
/// share) and bounds what it adds to everyone's delay. (Eight targets kept four Cubic
/// flows at 100 Mbit/s at 0.956 of the rate once, but cost Cubic its share beside UDP and
/// BBR: 0.444, 0.377. Without the aggregates' bound, one 64 KiB aggregate at a quarter of
/// 100 Mbit/s, 21 ms, filled the cap, and the flow's next one was dropped.)
#[inline(always)]
pub fn flow_cap_ns(target_ns: u64, frame_ns: u64, packet_ns: u64) -> u64 {
    let targets = 4 * target_ns;
    let frames = frame_ns.saturating_mul(4);
    let packets = packet_ns.saturating_mul(2);
    targets.max(frames).max(packets)
}

/// In [`FlowQueue::cap_drops`]: the flow (host) is held to the short cap for this
/// interval (see [`roll_cap_drops`]).
pub const HELD: u64 = 1 << 63;
/// In [`FlowQueue::cap_drops`]: how many intervals in a row, up to the last, it lost at
/// least 1/[`UNRESPONSIVE_DIVISOR`] of its bytes to its cap (six bits).
const STREAK_SHIFT: u32 = 56;
const STREAK_MAX: u64 = 63;
/// In [`FlowQueue::cap_drops`]: its bytes lost to its cap in this interval.
const DROPPED_MASK: u64 = (1 << STREAK_SHIFT) - 1;
/// One part in this of a flow's bytes lost to its cap makes an interval a lossy one: a
/// flood loses its excess there (a third of its bytes at 1.5x its share, two thirds and
/// more beside TCP at 1.5x the class rate), TCP a packet or two of a window before it
/// backs off, but one lost 64 KiB aggregate is a fifth of a flow's interval at 25 Mbit/s.
/// Four Cubic flows at 100 Mbit/s with TSO: 0.954-0.956 of the rate with a quarter,
/// 0.931-0.945 with an eighth, 0.90 with four packets an interval.
pub const UNRESPONSIVE_DIVISOR: u64 = 4;
/// Lossy intervals in a row that mark a flow as one that heeds no drop: a flood over its
/// share is lossy every interval, TCP now and then.
pub const UNRESPONSIVE_INTERVALS: u64 = 3;

/// A flow's (host's) cap word at the start of its interval, from the last one's word and
/// its bytes judged then (`offered`, the dropped included): the streak of lossy intervals
/// carried on or ended, [`HELD`] from [`UNRESPONSIVE_INTERVALS`] of them on (held after
/// one, four Cubic flows at 100 Mbit/s kept 0.90 of the rate), and no drops counted yet.
#[inline(always)]
pub fn roll_cap_drops(word: u64, offered: u64) -> u64 {
    let dropped = word & DROPPED_MASK;
    let lossy = dropped > 0 && dropped.saturating_mul(UNRESPONSIVE_DIVISOR) >= offered;
    let streak = if lossy {
        ((word & !HELD) >> STREAK_SHIFT)
            .saturating_add(1)
            .min(STREAK_MAX)
    } else {
        0
    };
    let held = if streak >= UNRESPONSIVE_INTERVALS {
        HELD
    } else {
        0
    };
    (streak << STREAK_SHIFT) | held
}

/// The most of the class's queue (ns, in the class's time) one flow's long cap holds:
/// a sixth of the class's own cap (`class_cap_ns`) for a flow on its own, a quarter for a
/// host and the flows within one (`by_host`, under `--fair src|dst`). Four Cubic flows
/// stood 11.5 ms (lab) and 12.3 ms (Debian 6.1, CAKE 8.7) with a quarter each, 7.6-10.3
/// with a sixth at the same goodput; a host's one flow beside another's eight lost to
/// the sixth (0.420-0.437 of the rate, against 0.449-0.457), as it did to a host held
/// to the short cap.
#[inline(always)]
pub fn long_cap_budget_ns(class_cap_ns: u64, by_host: bool) -> u64 {
    if by_host {
        class_cap_ns / 4
    } else {
        class_cap_ns / 6
    }
}

/// The cap of a flow's (host's) own queue (ns at its share): the short one
/// ([`flow_cap_ns`]) while it is [`HELD`], else the long one, two CoDel intervals, which
/// TCP needs where its window is a few packets (16 and 64 Cubic flows at 100 Mbit/s:
/// 0.94-0.97 of the rate, against 0.77-0.80 with the short one, which drops the tail of
/// a small window: a retransmission timeout). The long cap holds at most `budget_ns` of
/// the class's queue ([`long_cap_budget_ns`], in the class's time; a flow's time runs
/// `share x hosts` times slower), so a flood found unresponsive only after three
/// intervals never fills the class queue for the flows under their share, and a flow
/// alone stays near the short cap (with half the class's cap, a lone Cubic flow let a
/// probe beside it wait 33 ms at p99; 22-23 ms with a quarter). Never below the short
/// one.
#[inline(always)]
pub fn cap_for_ns(
    cap_drops: u64,
    short_ns: u64,
    interval_ns: u64,
    budget_ns: u64,
    share: u64,
    hosts: u64,
) -> u64 {
    if cap_drops & HELD != 0 {
        return short_ns;
    }
    let budget =
        flow_ticks(crate::bucket::ticks(budget_ns), share, hosts) >> crate::bucket::TICK_BITS;
    interval_ns.saturating_mul(2).min(budget).max(short_ns)
}

/// Whether a flow's packet beyond its cap passes all the same: the class's real queue
/// holds at most a frame (`link_idling`: the link is about to idle, and a fair queue would
/// serve the packet at once, as CoDel never drops from one frame), the flow heeds drops
/// (its cap word is not [`HELD`]), and the class is fair by flow alone (`by_host` false).
/// Four Cubic flows at 10 Mbit/s lost the link to their own caps: 0.952 of the rate, 0.956-0.957
/// so (a full frame's payload is 0.956 of its wire size). A flood held to its share
/// passing so took Cubic beside it over 40 ms from 0.48 to 0.456; a host's eight flows
/// passing so (their host's cap still held) took its neighbour's one from 0.449-0.457 to
/// 0.443-0.449.
#[inline(always)]
pub fn passes_beyond_cap(link_idling: bool, cap_drops: u64, by_host: bool) -> bool {
    link_idling && cap_drops & HELD == 0 && !by_host
}
