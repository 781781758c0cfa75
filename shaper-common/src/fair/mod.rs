//! Flow isolation inside a shape class (`--fair flow|src|dst`): each flow gets a fair share
//! of the class's rate while it wants it, with no queue of its own to do it.
//!
//! A shape class has one real queue (an HTB leaf, or fq's under EDT) and a virtual copy of
//! it (the class's GCRA word). Fairness adds a *virtual queue per flow* in the flow table,
//! draining at the flow's fair share: `finish` is when the flow's admitted bytes would
//! have left a fair queue (deficit round robin, as fq_codel serves its flows). A flow whose
//! packets arrive faster than its share builds a backlog there, and only there: it is
//! *over its share* ([`over_share`]), and only its packets meet the class queue's CoDel,
//! which drops or CE-marks them; beyond its cap ([`flow_cap_ns`]) its excess is dropped
//! whole (an unresponsive flow is held to its share). A flow below its share has no
//! backlog, so it is never dropped for another's excess, and the packets admitted add up
//! to about the class rate, so the real queue stays short for everyone.
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

/// `ClassConfig::codel.fair` values: how a shape class shares its rate among its flows.
pub const FAIR_NONE: u32 = 0;
/// Every flow (5-tuple) its share: the default for shape classes.
pub const FAIR_FLOW: u32 = 1;
/// Each source address its share first, then each of its flows within it.
pub const FAIR_SRC: u32 = 2;
/// Each destination address its share first, then each of its flows within it.
pub const FAIR_DST: u32 = 3;
/// The low bits of `codel.fair`: which of the above.
pub const FAIR_MODE: u32 = 0xff;
/// Set beside the mode when the class's bulk leaf is a queue per flow with a CoDel of its
/// own (fq_codel, where the kernel has it): that leaf's CoDel judges each flow's real
/// queue, so the program's CoDel on the class's one queue stands aside.
pub const FAIR_FLOW_QUEUES: u32 = 1 << 8;

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
/// last counted in as over its share, and `interval_bytes` its bytes judged since the
/// census counted it in this interval (see [`settle_spare`]).
///
/// For a host (the key of scope src or dst): `counted_in` is the end of the interval it
/// counts flows in, `over_share_in` its flows counted so far in it, `sparse` its flows in
/// the interval before (see [`host_flows`]), `finish` its own virtual queue's end at
/// the host's share, and `interval_bytes` its bytes judged in the interval.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowQueue {
    pub sparse: u64,
    pub counted_in: u64,
    pub finish: u64,
    pub over_share_in: u64,
    pub interval_bytes: u64,
    /// The bytes the flow (host) lost to its cap in this interval, and [`HELD`] when it is
    /// held to the short cap for it (see [`roll_cap_drops`]).
    pub cap_drops: u64,
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
///   probe beside it: the flow gets the rate less the probe's); while the queue stands
///   `m` never falls for it, and once the queue empties it falls by 1/16 an interval
///   toward that.
/// - A queue that stood with no flow over its share: `m` rises by a quarter (the shares
///   are too large to tell whose queue it is).
/// - Otherwise (the queue emptied: the rate went unused, or no flow is over its share)
///   `m` falls by 1/16 an interval, so
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
    let raised = share + share / SHARE_RAISE_DIVISOR;
    let next = if congested && contended {
        if over_weight > raised {
            over_weight
        } else {
            raised
        }
    } else if congested && over_weight == 0 {
        // A queue that stood with nobody over their share: the shares are too large for
        // CoDel to tell whose queue it is (at `m` = 1 four flows stood 64 ms unjudged).
        raised
    } else if contended || over_weight == 0 {
        // Nobody over their share: every byte was spare, and what that would leave a
        // flow says nothing (a Cubic flow under a share of half, beside a probe, was held
        // there: 0.35 of the rate).
        lowered
    } else {
        let left = what_others_leave(over_weight, spare_bytes, window_bytes);
        // A queue that stood carried the whole rate: nothing went unused to hand the flow
        // over its share, and lowering `m` would hand it what a neighbour backing off
        // (a Cubic sawtooth) will want back (host B's one flow beside host A's eight
        // under `--fair src`: 0.436-0.446 so, 0.449-0.457 held).
        let floor = if congested { share } else { lowered };
        if left > floor {
            left
        } else {
            floor
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

/// Whether a flow is over its share: its virtual queue still holds more than this
/// packet's own charge when the packet arrives, or more than `frame_ticks` (a full-size
/// frame at the class rate) if that is larger. A flow at or below its share finds it
/// about drained; a probe whose small packets now and then come two at once is not over
/// it (so flagged, it made two contenders of one bulk flow and a probe, and halved the
/// flow's share). (A frame at the flow's share instead let four Cubic flows each stand
/// a frame's time unjudged: Jain 0.68, 57 ms.)
#[inline(always)]
pub fn over_share(finish: u64, now_ticks: u64, charge_ticks: u64, frame_ticks: u64) -> bool {
    let slack = if charge_ticks > frame_ticks {
        charge_ticks
    } else {
        frame_ticks
    };
    finish > now_ticks.saturating_add(slack)
}

/// The class's spare bytes in an interval, as the census added them up (a flow found over
/// its share takes back what it had added before: a wrapped negative), read when it
/// rolls: what only the flows under their share sent, never below zero.
#[inline(always)]
pub fn settle_spare(spare: u64) -> u64 {
    if spare > u64::MAX / 2 {
        0
    } else {
        spare
    }
}

/// Whether a flow counts as contending for the rate in the interval that ends at `end`:
/// it was found over its share in it or in the one before (`over_share_in`, the end of
/// the last interval it was). Its packets are then never the others' spare bytes.
#[inline(always)]
pub fn contending(over_share_in: u64, end: u64, interval_ns: u64) -> bool {
    over_share_in != 0 && end <= over_share_in.saturating_add(2 * interval_ns)
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

/// Where a flow's (or host's) virtual queue stands when a packet arrives: its end
/// (`finish`), less `idle_ticks` (how long the class's link has been idle, at the flow's
/// share: `flow_ticks` of it), never before now. A fair queue serves a backlogged flow at
/// the whole rate while the others send nothing; without this, a flow whose neighbours
/// paused ran into its cap on an idle link (four Cubic flows at 100 Mbit/s timed out 120
/// times in 47 s: 0.86-0.89 of the rate). Only the idle time counts, not an empty real
/// queue (forgiving a UDP flood its whole queue whenever the real one emptied took Cubic
/// beside it from 0.48 to 0.43 of the rate over 40 ms).
#[inline(always)]
pub fn served_from(finish: u64, now_ticks: u64, idle_ticks: u64) -> u64 {
    finish.saturating_sub(idle_ticks).max(now_ticks)
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

mod cap;
pub use cap::*;

#[cfg(test)]
mod tests;
