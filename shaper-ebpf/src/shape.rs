//! Shape: CoDel on the class's virtual queue, then steer into shaper's HTB class or pace
//! by earliest departure time.
//!
//! The class's GCRA word runs at the class rate as a virtual copy of the real queue:
//! `tat - now` is the delay the packet will see behind the bytes already admitted. CoDel
//! (`shaper_common::codel`) judges that predicted sojourn before the packet is queued; a
//! congested packet is CE-marked when ECN-capable and dropped otherwise, and a dropped
//! packet does not advance the virtual queue. Beyond the hard cap everything is dropped.
//! Packets of sparse flows (a ping, a DNS query) skip CoDel and the bulk queue: they go to
//! the class's sparse HTB leaf (higher priority) or leave at once under EDT.
//!
//! With flow isolation (`--fair flow|src|dst`) each bulk flow also has a virtual queue of
//! its own at its fair share (`shaper_common::fair`): past its cap a flow's excess is
//! dropped, and the class queue's CoDel judges only the packets of flows over their
//! share, so drops and marks land on them (an ancestor's queue in a tree is judged on
//! every borrowing packet, as before).

use crate::{
    act::{count_drop, count_pass, stats_of},
    bucket::swap,
    fair::{count_cause, Cause, FAIR_DROPPED, FAIR_OVER},
    flows::FlowLookup,
    maps::{CLASSES, CLASS_BUCKETS, CODEL, SHAPE_PACKET},
    parse::Packet,
    rewrite::{ecn_capable, set_ecn_ce},
};
use aya_ebpf::{
    bindings::TC_ACT_UNSPEC,
    helpers::{bpf_get_prandom_u32, bpf_redirect, bpf_skb_set_tstamp},
    programs::TcContext,
};
use aya_log_ebpf::warn;
use shaper_common::{
    bucket::{departure, ticks, TAT_MASK},
    codel::{judge, sojourn_ns, CodelConfig, CodelState},
    fair::FAIR_NONE,
    hierarchy::MAX_LEVELS,
    Bucket, ClassConfig,
};

/// Compare-and-swap attempts on the virtual queue: fewer than a policer's, because every
/// attempt multiplies the paths the verifier walks through the longer shape path; a
/// packet that loses four races in a row is dropped (counted).
const ENQUEUE_ATTEMPTS: u32 = 4;
/// BPF_SKB_TSTAMP_DELIVERY_MONO (uapi bpf.h): the tstamp is a monotonic departure time.
const SKB_TSTAMP_DELIVERY_MONO: u32 = 1;

/// `shape`: with an HTB class id in `action_arg`, steer the packet into shaper's HTB class
/// (skb->priority, so no tc filter runs); without one, pace it by earliest departure time
/// (skb->tstamp, for the fq qdisc). On ingress (`action_mask`: an ifb's ifindex) the HTB
/// is on the ifb, and the packet is redirected there.
///
/// A BPF-to-BPF call, not inlined: the caller's stack is dead once it returns, so the
/// verifier can merge the many paths classification leaves and walk this long path once
/// per distinct state instead of once per path (inlined, the program exceeds its limit).
///
/// `flow` is what `look_up_flow` and `judge_flow` found of the packet's flow, called by
/// the entry program before this: each a subprogram of its own, so no two of their
/// frames sit on the stack at once (512 bytes over the whole chain of calls).
#[inline(never)]
pub(crate) fn shape(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    now: u64,
    flow: FlowLookup,
) -> i32 {
    let (Some(stats), Some(bucket), Some(packet)) = (
        stats_of(class_id),
        CLASS_BUCKETS.get_ptr_mut(class_id),
        SHAPE_PACKET.get_ptr(0),
    ) else {
        return TC_ACT_UNSPEC;
    };
    let packet = unsafe { &*packet };
    let word = unsafe { &raw mut (*bucket).tat };
    let stored = unsafe { core::ptr::read_volatile(word) };
    // Not converted after a rate change (`settle` would cost this long path a subprogram
    // call, beyond the stack the verifier allows): the estimate is off by the rate ratio
    // only until the queue drains, at most the cap (100 ms by default) later.
    let tat = stored & TAT_MASK;
    // In a tree the class's own queue drains at its ceiling (`ClassSpec::drain`), exact
    // while its siblings idle. Above its guarantee it borrows, and then the parent may
    // be the bottleneck: the class is judged by the fullest ancestor queue, with that
    // ancestor's CoDel state, so the shared queue's drops fall on the borrowers in
    // proportion to their packets (a per-class state would drop a small flow as often
    // as a big one and starve it). Within its guarantee HTB serves it at once.
    let mut judge_id = class_id;
    let mut sojourn = sojourn_ns(tat, ticks(now), class.shape_burst_ticks());
    if class.parent != 0 && borrowing(bucket, class, now) {
        let (ancestor, ancestor_sojourn) = fullest_ancestor(class.parent as u32, now);
        if ancestor_sojourn > sojourn {
            (judge_id, sojourn) = (ancestor, ancestor_sojourn);
        }
    }
    // The class's own config unless an ancestor judges: no second lookup on the flat path.
    let judge = if judge_id == class_id {
        Some(class)
    } else {
        CLASSES.get(judge_id)
    };
    let (Some(judge), Some(codel)) = (judge, CODEL.get_ptr_mut(judge_id)) else {
        return TC_ACT_UNSPEC;
    };
    // Sparse flows queue apart (their own bounded leaf, or no wait under EDT): the cap
    // and CoDel guard the bulk queue.
    let sparse = flow.sparse();
    // Trees: the judging ancestor's queue holds its children's flows, not counted there.
    let flows = if judge_id == class_id {
        flow.flows()
    } else {
        1
    };
    let fair = class.codel.fair != FAIR_NONE;
    // Flow isolation: the flow's own queue judged first (`judge_flow`).
    let verdict = flow.verdict();
    if verdict == FAIR_DROPPED {
        count_cause(class_id, Cause::FairDrop, packet.wire_len);
        return count_drop(stats, packet.wire_len);
    }
    if !sparse && sojourn > judge.codel.cap_ns {
        count_cause(class_id, Cause::QueueDrop, packet.wire_len);
        return count_drop(stats, packet.wire_len);
    }
    let mut marked = false;
    // Under flow isolation the class queue's CoDel judges only the packets of flows over
    // their share (`judge_flow`'s verdict): the queue is theirs, and a flow under its share
    // is never dropped for it. An ancestor's queue (a tree's borrowing) is still judged on
    // every borrowing flow: a flow's share is of its own class's rate, which says nothing
    // of who holds the ancestor's queue (spared by share, borrowers stood 72 ms there).
    let over_share = verdict == FAIR_OVER;
    let (congested, entered) = if sparse || (fair && judge_id == class_id && !over_share) {
        (false, false)
    } else {
        let spare = || spares_aggregate(ctx, packet, class.codel.ecn != 0);
        judge_packet(
            unsafe { &mut *codel },
            sojourn,
            now,
            &judge.codel,
            flows,
            spare,
        )
    };
    if entered {
        warn!(
            ctx,
            "class {}: queue above its CoDel target for an interval; entered CoDel's dropping state", judge_id
        );
    }
    if congested {
        if class.codel.ecn != 0 && set_ecn_ce(ctx, packet) {
            marked = true;
            if fair && over_share {
                count_cause(class_id, Cause::FairMark, packet.wire_len);
            }
        } else {
            count_cause(class_id, Cause::QueueDrop, packet.wire_len);
            return count_drop(stats, packet.wire_len);
        }
    }
    // The cap was checked above; only a racing CPU can push the start further, so the
    // horizon here is unbounded.
    let Some(mut leave_at) = enqueue(word, stored, now, packet.wire_len, class) else {
        return count_drop(stats, packet.wire_len);
    };
    if class.parent != 0 {
        guarantee_enqueue(bucket, class, now, packet.wire_len);
        let ancestors_leave_at = ancestors_enqueue(class.parent as u32, now, packet.wire_len);
        if class.action_arg == 0 {
            // EDT has no HTB tree to hold the ancestors: pace by the latest of their queues.
            leave_at = leave_at.max(ancestors_leave_at);
        }
    }
    if class.action_arg != 0 {
        let leaf = if sparse && class.sparse_priority != 0 {
            class.sparse_priority
        } else {
            class.action_arg
        };
        unsafe { (*ctx.skb.skb).priority = leaf };
    } else {
        let leave_at = if sparse { now } else { leave_at };
        unsafe { bpf_skb_set_tstamp(ctx.skb.skb, leave_at, SKB_TSTAMP_DELIVERY_MONO) };
    }
    let verdict = count_pass(stats, packet.wire_len, marked);
    if class.action_mask != 0 {
        // An ingress class queues on shaper's ifb (its ifindex here), which hands the
        // packet back to this interface's ingress past this hook.
        return unsafe { bpf_redirect(class.action_mask, 0) } as i32;
    }
    verdict
}

/// Whether a GSO aggregate CoDel chose to drop is let through instead: an aggregate of k
/// segments is dropped with probability 1/k, so each CoDel decision costs the sender one
/// segment on average, as CoDel means it to, not up to 44 at once (three pods' TCP with
/// TSO on through global shape classes: 0.66-0.70 of the limit when dropped whole,
/// 0.74-0.78 when dropped one time in k; in a later A/B 0.78-0.83 with that, 0.83-0.89
/// once a spared one also left CoDel's count). k is the parser's count (a VM's aggregate,
/// SKB_GSO_DODGY, has it from gso_size, as the kernel will segment it). An ECN-capable
/// aggregate is marked instead (with `ecn` on), never spared (should the CE write fail,
/// it is dropped whole: a rare case). Asked by CoDel only for a condemned packet, before
/// its state moves: a spared aggregate is no signal and leaves the control law's count
/// (`shaper_common::codel::judge`).
#[inline(always)]
pub(crate) fn spares_aggregate(ctx: &TcContext, packet: &Packet, ecn: bool) -> bool {
    let segments = packet.segments;
    segments > 1
        && !(ecn && ecn_capable(ctx, packet))
        && unsafe { bpf_get_prandom_u32() } % segments != 0
}

/// CoDel's verdict on the packet. The control word moves by one compare-and-swap: of
/// CPUs racing for one drop slot exactly one wins and drops; a packet whose CPU loses the
/// race passes (the winner acted on the same queue at the same instant).
/// Returns (congested, whether this packet started a dropping state); a spared packet is
/// not congested.
#[inline(always)]
pub(crate) fn judge_packet(
    state: &mut CodelState,
    sojourn: u64,
    now: u64,
    config: &CodelConfig,
    flows: u64,
    spare: impl FnOnce() -> bool,
) -> (bool, bool) {
    let control_word = &raw mut state.control;
    let first_above_word = &raw mut state.first_above;
    let control = unsafe { core::ptr::read_volatile(control_word) };
    let first_above = unsafe { core::ptr::read_volatile(first_above_word) };
    let judgement = judge(control, first_above, sojourn, now, config, flows, spare);
    if let Some(next) = judgement.first_above {
        // Only 0 <-> one deadline: a lost race moves the deadline by nanoseconds.
        swap(first_above_word, first_above, next);
    }
    match judgement.control {
        None => (judgement.congested, false),
        Some(next) => {
            let won = swap(control_word, control, next);
            (won && judgement.congested, won && judgement.entered)
        }
    }
}

/// Whether a class in a tree sends above its guarantee: its second word, a virtual queue
/// at its rate and burst (`peak_cost`), is backlogged.
#[inline(always)]
fn borrowing(bucket: *mut Bucket, class: &ClassConfig, now: u64) -> bool {
    let tat = unsafe { core::ptr::read_volatile(&raw const (*bucket).tat2) } & TAT_MASK;
    sojourn_ns(tat, ticks(now), class.peak_cost.tolerance_ticks) > 0
}

/// Advances the guarantee word by an admitted packet, no further than an interval beyond
/// its burst (it only tells borrowing from not; bounded, it says so again soon after the class
/// falls back within its rate). One attempt: a lost race leaves the word a packet short.
#[inline(always)]
fn guarantee_enqueue(bucket: *mut Bucket, class: &ClassConfig, now: u64, bytes: u64) {
    let word = unsafe { &raw mut (*bucket).tat2 };
    let stored = unsafe { core::ptr::read_volatile(word) };
    let horizon = class.peak_cost.tolerance_ticks + ticks(class.codel.interval_ns);
    if let Some((next, _)) = departure(stored & TAT_MASK, now, bytes, &class.peak_cost, horizon) {
        swap(word, stored, class.stamp(next));
    }
}

/// The ancestor (id) whose virtual queue predicts the longest sojourn, and that sojourn.
#[inline(always)]
fn fullest_ancestor(parent: u32, now: u64) -> (u32, u64) {
    let (mut fullest, mut longest, mut next) = (parent - 1, 0, parent);
    for _ in 1..MAX_LEVELS {
        let Some(class) = next.checked_sub(1).and_then(|id| CLASSES.get(id)) else {
            break;
        };
        let Some(bucket) = CLASS_BUCKETS.get_ptr(next - 1) else {
            break;
        };
        let tat = unsafe { core::ptr::read_volatile(&raw const (*bucket).tat) } & TAT_MASK;
        let sojourn = sojourn_ns(tat, ticks(now), class.shape_burst_ticks());
        if sojourn > longest {
            (fullest, longest) = (next - 1, sojourn);
        }
        next = class.parent as u32;
    }
    (fullest, longest)
}

/// Advances every ancestor's virtual queue by an admitted packet (each at the rate it may
/// drain: its ceiling, the top class its rate); the latest departure among them, which
/// EDT paces by, so no level runs above its rate. An ancestor whose word
/// keeps losing races misses the packet: its estimate runs short by one packet.
#[inline(always)]
fn ancestors_enqueue(parent: u32, now: u64, bytes: u64) -> u64 {
    let (mut latest, mut next) = (0, parent);
    for _ in 1..MAX_LEVELS {
        let Some(class) = next.checked_sub(1).and_then(|id| CLASSES.get(id)) else {
            break;
        };
        let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(next - 1) else {
            break;
        };
        let word = unsafe { &raw mut (*bucket).tat };
        let stored = unsafe { core::ptr::read_volatile(word) };
        if let Some(leave_at) = enqueue(word, stored, now, bytes, class) {
            latest = latest.max(leave_at);
        }
        next = class.parent as u32;
    }
    latest
}

/// Advances the virtual queue by the packet, starting from the word as already read (a
/// racing CPU makes the swap fail and the word is read again); its departure time (ns).
#[inline(always)]
fn enqueue(
    word: *mut u64,
    mut stored: u64,
    now: u64,
    bytes: u64,
    class: &ClassConfig,
) -> Option<u64> {
    for _ in 0..ENQUEUE_ATTEMPTS {
        let tat = stored & TAT_MASK;
        let (next, leave_at) = departure(tat, now, bytes, &class.cost, u64::MAX)?;
        if swap(word, stored, class.stamp(next)) {
            return Some(leave_at);
        }
        stored = unsafe { core::ptr::read_volatile(word) };
    }
    None
}
