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
//! With flow isolation (`--fair`, the default) each bulk flow also has a virtual queue of
//! its own at its fair share (`shaper_common::fair`): its CoDel and the cap judge that
//! queue, so drops and marks land on the flows over their share, and the class queue's
//! CoDel stands aside (only the hard cap guards it, and an ancestor's queue in a tree).

use crate::{
    act::{count_drop, count_pass, stats_of},
    bucket::{bucket_key, count_new_key, swap},
    maps::{
        CLASSES, CLASS_BUCKETS, CODEL, CODEL_FLOWS, FLOW_QUEUES, FLOW_SCRATCH, SHAPE_PACKET,
        SHAPE_STATS,
    },
    parse::Packet,
    rewrite::{ecn_capable, set_ecn_ce},
};
use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_UNSPEC},
    helpers::{bpf_get_prandom_u32, bpf_redirect, bpf_skb_set_tstamp},
    programs::TcContext,
};
use aya_log_ebpf::warn;
use core::intrinsics::{atomic_xadd, atomic_xchg, AtomicOrdering};
use shaper_common::{
    bucket::{departure, ticks, TAT_MASK, TICK_BITS},
    codel::{judge, sojourn_ns, CodelConfig, CodelState, FlowCensus, FRAME_BYTES},
    fair::{
        burst_credit, flow_cap_ns, flow_sojourn_ns, flow_ticks, flow_weight, host_flows,
        next_share, over_share, sparse_at_share, FlowQueue, FlowScratch, FAIR_DST, FAIR_NONE,
        FAIR_SRC, SHARE_ONE,
    },
    hierarchy::MAX_LEVELS,
    Bucket, BucketKey, ClassConfig, Scope,
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
    let mut marked = verdict == FAIR_MARKED;
    if marked {
        count_cause(class_id, Cause::FairMark, packet.wire_len);
    }
    // Under flow isolation the flows' own CoDels judge the class's queue, not one of its
    // own; an ancestor's queue (a tree's borrowing) is still judged as before, on every
    // borrowing flow: a flow's share is of its own class's rate, which says nothing of
    // who holds the ancestor's queue (spared by share, borrowers stood 72 ms there).
    let (congested, entered) = if sparse || (fair && judge_id == class_id) {
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
fn spares_aggregate(ctx: &TcContext, packet: &Packet, ecn: bool) -> bool {
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
fn judge_packet(
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

/// What the flow table says of a shape class's packet, packed in one register (a
/// subprogram returns one; a pointer to a struct of the caller's would add its frame):
/// whether its flow is sparse, whether the class's census was reached, whether this
/// packet counted its flow in it (its first bulk packet in the interval), and the class's
/// bulk flows (at least 1; see `census_count`) from bit 8 on.
/// `judge_flow` adds its verdict (`FAIR_*`) in bits 3 and 4.
#[derive(Clone, Copy)]
pub(crate) struct FlowLookup(u64);

impl FlowLookup {
    const SPARSE: u64 = 1;
    const COUNTED: u64 = 2;
    const FRESH: u64 = 4;
    const VERDICT_SHIFT: u32 = 3;
    const FLOWS_SHIFT: u32 = 8;

    fn new(sparse: bool, counted: bool, fresh: bool, flows: u64) -> Self {
        let bit = |set: bool, value: u64| if set { value } else { 0 };
        Self(
            bit(sparse, Self::SPARSE)
                | bit(counted, Self::COUNTED)
                | bit(fresh, Self::FRESH)
                | (flows << Self::FLOWS_SHIFT),
        )
    }

    fn sparse(self) -> bool {
        self.0 & Self::SPARSE != 0
    }

    fn counted(self) -> bool {
        self.0 & Self::COUNTED != 0
    }

    fn fresh(self) -> bool {
        self.0 & Self::FRESH != 0
    }

    fn flows(self) -> u64 {
        (self.0 >> Self::FLOWS_SHIFT).max(1)
    }

    fn verdict(self) -> u64 {
        (self.0 >> Self::VERDICT_SHIFT) & 3
    }

    fn with_verdict(self, verdict: u64) -> Self {
        Self(self.0 | ((verdict & 3) << Self::VERDICT_SHIFT))
    }
}

/// The packet's flow in the flow table (`look_up_flow`), then, in a fair class, judged by
/// its own queue (`fair_judge`): each its own subprogram, called one after the other by
/// the entry program so that neither frame sits below `shape`'s.
#[inline(always)]
pub(crate) fn judge_flow(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    now: u64,
) -> FlowLookup {
    let flow = FlowLookup(look_up_flow(class_id, class, now));
    if class.codel.fair == FAIR_NONE || !flow.counted() {
        return flow;
    }
    if flow.sparse() {
        // A sparse flow's bytes are spare: the flows over their share may not have them.
        if let (Some(census), Some(packet)) =
            (CODEL_FLOWS.get_ptr_mut(class_id), SHAPE_PACKET.get_ptr(0))
        {
            add(unsafe { &raw mut (*census).spare_bytes }, unsafe {
                (*packet).wire_len
            });
        }
        return flow;
    }
    let id_and_fresh = class_id | if flow.fresh() { FRESH } else { 0 };
    flow.with_verdict(fair_judge(ctx, class, now, id_and_fresh) as u64)
}

/// The packet's flow in the flow table (`FlowLookup`, packed): whether it is sparse
/// (`shaper_common::codel::sparse`), by its own word, and the class's bulk flows. One
/// compare-and-swap: a lost race (a flow's packets on two CPUs at once) counts as bulk,
/// the safe side. No room in the table: bulk too.
///
/// Not inlined, and its key and new entry built in `FLOW_SCRATCH`: the verifier allows
/// 512 bytes of stack over the whole chain of calls, the entry program's frame included.
#[inline(never)]
fn look_up_flow(class_id: u32, class: &ClassConfig, now: u64) -> u64 {
    let (Some(packet), Some(scratch)) = (SHAPE_PACKET.get_ptr(0), FLOW_SCRATCH.get_ptr_mut(0))
    else {
        return FlowLookup::new(false, false, false, 1).0;
    };
    let packet = unsafe { &*packet };
    let scratch = unsafe { &mut *scratch };
    scratch.key = bucket_key(class_id, class.generation, Scope::Flow, packet);
    let census = CODEL_FLOWS.get_ptr_mut(class_id);
    let reached = census.is_some();
    // In a fair class a flow is sparse below 1/16 of its share (`fair::sparse_at_share`).
    let share = match census {
        Some(census) if class.codel.fair != FAIR_NONE => unsafe {
            core::ptr::read_volatile(&raw const (*census).share)
        },
        _ => SHARE_ONE,
    };
    match FLOW_QUEUES.get_ptr_mut(&scratch.key) {
        Some(entry) => {
            let word = unsafe { &raw mut (*entry).sparse };
            let stored = unsafe { core::ptr::read_volatile(word) };
            // A flow's sparseness word runs at 1/16 of the class rate with a 4-frame
            // burst; not converted after a change (as the queue above).
            let tat = stored & TAT_MASK;
            let (sparse_flow, next) =
                sparse_at_share(tat, now, packet.wire_len, &class.sparse_cost, share);
            let sparse_flow = swap(word, stored, class.stamp(next)) && sparse_flow;
            let counted = unsafe { &raw mut (*entry).counted_in };
            let (flows, fresh) = count(census, class, now, (!sparse_flow).then_some(counted));
            FlowLookup::new(sparse_flow, reached, fresh, flows).0
        }
        None => {
            // A new flow starts from an empty bucket (tat 0 is long ago); NOEXIST keeps a
            // racing CPU's entry.
            let (sparse_flow, next) =
                sparse_at_share(0, now, packet.wire_len, &class.sparse_cost, share);
            fresh_entry(&mut scratch.entry, class.stamp(next));
            let inserted = FLOW_QUEUES
                .insert(&scratch.key, &scratch.entry, BPF_NOEXIST as u64)
                .is_ok();
            if inserted {
                count_new_key(class_id);
            }
            // No room in the table (or a racing CPU's entry first): bulk, the safe side;
            // judged sparse, every packet of a flow without a word would skip CoDel. A new
            // flow is counted from its next packet on.
            let (flows, _) = count(census, class, now, None);
            FlowLookup::new(sparse_flow && inserted, reached, false, flows).0
        }
    }
}

/// The class's census, if reached, counting a bulk packet's flow (see `census`).
#[inline(always)]
fn count(
    census: Option<*mut FlowCensus>,
    class: &ClassConfig,
    now: u64,
    counted: Option<*mut u64>,
) -> (u64, bool) {
    match census {
        Some(census) => census_count(census, class, now, counted),
        None => (1, false),
    }
}

/// The class's bulk flows (`shaper_common::codel::FlowCensus`): the larger of the last
/// interval's count and this one's so far, at least 1; and whether this packet counted its
/// flow. `counted` is a bulk packet's flow word, holding the end of the interval the flow
/// was last counted in. Races cost a flow counted twice or not at all in one interval.
/// The CPU that rolls the interval also sets the next interval's fair share.
#[inline(always)]
fn census_count(
    census: *mut FlowCensus,
    class: &ClassConfig,
    now: u64,
    counted: Option<*mut u64>,
) -> (u64, bool) {
    let end_word = unsafe { &raw mut (*census).interval_end };
    let counting = unsafe { &raw mut (*census).counting };
    let end = unsafe { core::ptr::read_volatile(end_word) };
    let end = if now >= end {
        let interval = class.codel.interval_ns;
        let next = now + interval;
        if swap(end_word, end, next) {
            let seen = unsafe { atomic_xchg::<u64, { AtomicOrdering::Relaxed }>(counting, 0) };
            // After an idle interval the last one counted no flow.
            let idle = now >= end + interval;
            let seen = if idle { 0 } else { seen };
            unsafe { core::ptr::write_volatile(&raw mut (*census).counted, seen) };
            if class.codel.fair != FAIR_NONE {
                roll_share(census, class, idle);
            }
            next
        } else {
            // Another CPU rolled the interval: its end is the one flows are stamped with.
            unsafe { core::ptr::read_volatile(end_word) }
        }
    } else {
        end
    };
    let mut fresh = false;
    if let Some(word) = counted {
        if unsafe { core::ptr::read_volatile(word) } != end {
            unsafe { core::ptr::write_volatile(word, end) };
            unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(counting, 1) };
            fresh = true;
        }
    }
    let last = unsafe { core::ptr::read_volatile(&raw const (*census).counted) };
    let flows = last
        .max(unsafe { core::ptr::read_volatile(counting) })
        .max(1);
    (flows, fresh)
}

/// The next interval's share multiplier from the one that ended (`fair::next_share`);
/// after an idle interval, the class rate (1).
#[inline(always)]
fn roll_share(census: *mut FlowCensus, class: &ClassConfig, idle: bool) {
    let take = |word: *mut u64, fresh: u64| unsafe {
        atomic_xchg::<u64, { AtomicOrdering::Relaxed }>(word, fresh)
    };
    let weight = take(unsafe { &raw mut (*census).weight }, 0);
    let over_weight = take(unsafe { &raw mut (*census).over_share_weight }, 0);
    let over = take(unsafe { &raw mut (*census).over_share_counting }, 0);
    let least = take(unsafe { &raw mut (*census).least_delay_ns }, u64::MAX);
    let share = unsafe { core::ptr::read_volatile(&raw const (*census).share) };
    // A fresh census holds 0 (no packet judged): not congested.
    let congested = least != u64::MAX && least > 0;
    let spare = take(unsafe { &raw mut (*census).spare_bytes }, 0);
    let last_weight = unsafe { core::ptr::read_volatile(&raw const (*census).last_weight) };
    let (share, over) = if idle {
        (SHARE_ONE, 0)
    } else {
        let weights = (weight.max(last_weight), over_weight);
        let window = class.cost.bytes_in(ticks(class.codel.interval_ns));
        (next_share(share, congested, weights, spare, window), over)
    };
    unsafe { core::ptr::write_volatile(&raw mut (*census).last_weight, weight) };
    unsafe {
        core::ptr::write_volatile(&raw mut (*census).share, share);
        core::ptr::write_volatile(&raw mut (*census).over_share_counted, over);
    }
}

/// Set in a host entry's class id (class ids stay below `MAX_CLASSES`).
const HOST_KEY: u32 = 1 << 31;
/// Set in `fair_judge`'s class id argument: the census just counted the packet's flow.
const FRESH: u32 = 1 << 30;

/// `fair_judge`'s verdicts.
const FAIR_UNDER: u64 = 0;
const FAIR_OVER: u64 = 1;
const FAIR_MARKED: u64 = 2;
const FAIR_DROPPED: u64 = 3;

/// Flow isolation for a bulk packet of a fair class: its flow's virtual queue at the fair
/// share (`shaper_common::fair`), judged by the flow's own CoDel and the class's cap.
/// Counts the flow in the census as over its share (with its weight) or the packet's bytes
/// as spare, and moves the flow's queue on by an admitted packet. A flow without an entry
/// (a full table, or its first packet) is under its share.
///
/// Not inlined, as `shape` itself: the verifier walks this path once, not once per path of
/// the caller.
///
/// `id_and_fresh` is the class id with [`FRESH`] set when the census just counted the
/// flow. The flow's entry is looked up again here: `look_up_flow` cannot hand its pointer
/// over (see `FlowLookup`), and this frame cannot sit below that one (512 bytes of stack
/// over a chain of calls).
#[inline(never)]
fn fair_judge(ctx: &TcContext, class: &ClassConfig, now: u64, id_and_fresh: u32) -> u64 {
    let class_id = id_and_fresh & !FRESH;
    let fresh = id_and_fresh & FRESH != 0;
    let (Some(packet), Some(census), Some(scratch)) = (
        SHAPE_PACKET.get_ptr(0),
        CODEL_FLOWS.get_ptr_mut(class_id),
        FLOW_SCRATCH.get_ptr_mut(0),
    ) else {
        return FAIR_UNDER;
    };
    let packet = unsafe { &*packet };
    let bytes = packet.wire_len;
    let scratch = unsafe { &mut *scratch };
    scratch.key = bucket_key(class_id, class.generation, Scope::Flow, packet);
    let Some(entry) = FLOW_QUEUES.get_ptr_mut(&scratch.key) else {
        add(unsafe { &raw mut (*census).spare_bytes }, bytes);
        return FAIR_UNDER;
    };
    // Under `--fair src|dst` the flows of a host share its part, and the host has a
    // queue of its own at its share.
    let host = match class.codel.fair {
        FAIR_SRC | FAIR_DST => host_entry(class_id, class, packet, census, scratch, fresh),
        _ => None,
    };
    let hosts = match host {
        Some(host) => host_flows(unsafe { &*host }),
        None => 1,
    };
    let share = unsafe { core::ptr::read_volatile(&raw const (*census).share) };
    let share = if share == 0 { SHARE_ONE } else { share };
    let charge = flow_ticks(class.cost.ticks_for(bytes), share, hosts);
    let finish_word = unsafe { &raw mut (*entry).finish };
    let now_ticks = ticks(now);
    // The class's real queue (its virtual queue beyond the burst HTB sends ahead): empty,
    // a flow's packets go out within that burst (`fair::burst_credit`).
    let class_tat = match CLASS_BUCKETS.get_ptr(class_id) {
        Some(bucket) => {
            let stored = unsafe { core::ptr::read_volatile(&raw const (*bucket).tat) };
            stored & TAT_MASK
        }
        None => 0,
    };
    let burst_ticks = class.shape_burst_ticks();
    let class_delay = sojourn_ns(class_tat, now_ticks, burst_ticks);
    let within_burst = class_delay == 0;
    // The least delay the class's queue shows this interval (`roll_share`'s congestion).
    let least = unsafe { &raw mut (*census).least_delay_ns };
    if class_delay < unsafe { core::ptr::read_volatile(least) } {
        unsafe { core::ptr::write_volatile(least, class_delay) };
    }
    if fresh && host.is_none() {
        // Without hosts each flow weighs one (`host_count` counts hosts instead).
        add(unsafe { &raw mut (*census).weight }, SHARE_ONE);
    }
    let finish = unsafe { core::ptr::read_volatile(finish_word) };
    let drained = finish <= now_ticks;
    let credit_word = unsafe { &raw mut (*entry).credit };
    let credit = if drained {
        0
    } else {
        unsafe { core::ptr::read_volatile(credit_word) }
    };
    let over = over_share(finish.saturating_sub(credit), now_ticks, charge);
    if over {
        let end = unsafe { core::ptr::read_volatile(&raw const (*census).interval_end) };
        let stamp = unsafe { &raw mut (*entry).over_share_in };
        if unsafe { core::ptr::read_volatile(stamp) } != end {
            unsafe { core::ptr::write_volatile(stamp, end) };
            add(
                unsafe { &raw mut (*census).over_share_weight },
                flow_weight(hosts),
            );
            add(unsafe { &raw mut (*census).over_share_counting }, 1);
        }
    } else {
        add(unsafe { &raw mut (*census).spare_bytes }, bytes);
    }
    // Times at the flow's share: one frame (never dropped, as fq_codel never drops a
    // flow's only packet), and its queue's delay.
    let frame_ns = flow_ticks(class.cost.ticks_for(FRAME_BYTES), share, hosts) >> TICK_BITS;
    let sojourn = sojourn_ns(finish, now_ticks, credit);
    if sojourn > flow_cap_ns(class.codel.target_ns, frame_ns) {
        return FAIR_DROPPED;
    }
    let sojourn = flow_sojourn_ns(sojourn, frame_ns);
    // A host's own queue at its share bounds what all its flows together add to the
    // class's queue, however many they are.
    let host_charge = flow_ticks(class.cost.ticks_for(bytes), share, 1);
    if let Some(host) = host {
        let host_finish = unsafe { core::ptr::read_volatile(&raw const (*host).finish) };
        let host_credit = if host_finish <= now_ticks {
            0
        } else {
            unsafe { core::ptr::read_volatile(&raw const (*host).credit) }
        };
        let host_frame_ns = flow_ticks(class.cost.ticks_for(FRAME_BYTES), share, 1) >> TICK_BITS;
        let host_sojourn = sojourn_ns(host_finish, now_ticks, host_credit);
        if host_sojourn > flow_cap_ns(class.codel.target_ns, host_frame_ns) {
            return FAIR_DROPPED;
        }
    }
    let spare = || spares_aggregate(ctx, packet, class.codel.ecn != 0);
    let (congested, _) = judge_packet(
        unsafe { &mut (*entry).codel },
        sojourn,
        now,
        &class.codel,
        1,
        spare,
    );
    let marked = congested && class.codel.ecn != 0 && set_ecn_ce(ctx, packet);
    if congested && !marked {
        return FAIR_DROPPED;
    }
    let start = if finish > now_ticks {
        finish
    } else {
        now_ticks
    };
    unsafe {
        core::ptr::write_volatile(finish_word, start + charge);
        let credit = burst_credit(credit, drained, within_burst, charge, burst_ticks);
        core::ptr::write_volatile(credit_word, credit);
    }
    if let Some(host) = host {
        let host_word = unsafe { &raw mut (*host).finish };
        let host_finish = unsafe { core::ptr::read_volatile(host_word) };
        let host_drained = host_finish <= now_ticks;
        let host_start = if host_drained { now_ticks } else { host_finish };
        let credit_word = unsafe { &raw mut (*host).credit };
        let host_credit = unsafe { core::ptr::read_volatile(credit_word) };
        let host_credit = burst_credit(
            host_credit,
            host_drained,
            within_burst,
            host_charge,
            burst_ticks,
        );
        unsafe {
            core::ptr::write_volatile(host_word, host_start + host_charge);
            core::ptr::write_volatile(credit_word, host_credit);
        }
    }
    match (marked, over) {
        (true, _) => FAIR_MARKED,
        (false, true) => FAIR_OVER,
        (false, false) => FAIR_UNDER,
    }
}

/// Under `--fair src|dst`: the packet's host's entry in the flow table (`fair::FlowQueue`,
/// a host's fields), rolled to the class's interval and counting the packet's flow when
/// the census just counted it; a host new to the interval weighs one in the census. No
/// room for the host: none.
#[inline(always)]
fn host_entry(
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    census: *mut FlowCensus,
    scratch: &mut FlowScratch,
    fresh: bool,
) -> Option<*mut FlowQueue> {
    let scope = if class.codel.fair == FAIR_SRC {
        Scope::Src
    } else {
        Scope::Dst
    };
    // The class id's top bit keeps a host's entry apart from the class's flows.
    let key = bucket_key(class_id | HOST_KEY, class.generation, scope, packet);
    set_key(&mut scratch.key, &key);
    let host = match FLOW_QUEUES.get_ptr_mut(&scratch.key) {
        Some(host) => host,
        None => {
            fresh_entry(&mut scratch.entry, 0);
            let _ = FLOW_QUEUES.insert(&scratch.key, &scratch.entry, BPF_NOEXIST as u64);
            FLOW_QUEUES.get_ptr_mut(&scratch.key)?
        }
    };
    let end = unsafe { core::ptr::read_volatile(&raw const (*census).interval_end) };
    let counted_in = unsafe { &raw mut (*host).counted_in };
    let last_end = unsafe { core::ptr::read_volatile(counted_in) };
    let counting = unsafe { &raw mut (*host).over_share_in };
    if last_end != end {
        // A new interval for this host: the one before counted what it counted if it was
        // the interval just before (each ends at least an interval after the last, when a
        // packet rolls it), else nothing.
        let interval = class.codel.interval_ns;
        let counted = unsafe { core::ptr::read_volatile(counting) };
        let before = if end <= last_end + 2 * interval {
            counted
        } else {
            0
        };
        unsafe {
            core::ptr::write_volatile(&raw mut (*host).sparse, before);
            core::ptr::write_volatile(counting, 0);
            core::ptr::write_volatile(counted_in, end);
        }
        // Hosts share the class first: each weighs one in the census, once an interval.
        add(unsafe { &raw mut (*census).weight }, SHARE_ONE);
    }
    if fresh {
        add(counting, 1);
    }
    Some(host)
}

/// A new flow table entry with sparseness word `sparse`, every field written (a struct
/// literal with `..Default::default()` is a `memset` call: a byte loop in BPF).
#[inline(always)]
fn fresh_entry(entry: &mut FlowQueue, sparse: u64) {
    // Volatile: plain stores of zeros LLVM merges into a `memset` call.
    unsafe {
        core::ptr::write_volatile(&raw mut entry.sparse, sparse);
        core::ptr::write_volatile(&raw mut entry.counted_in, 0);
        core::ptr::write_volatile(&raw mut entry.finish, 0);
        core::ptr::write_volatile(&raw mut entry.over_share_in, 0);
        core::ptr::write_volatile(&raw mut entry.codel.control, 0);
        core::ptr::write_volatile(&raw mut entry.codel.first_above, 0);
        core::ptr::write_volatile(&raw mut entry.credit, 0);
    }
}

/// Writes `key` into the scratch slot word by word (volatile: a host key's zeroed
/// fields would otherwise become a `memset` call).
#[inline(always)]
fn set_key(slot: &mut BucketKey, key: &BucketKey) {
    unsafe {
        core::ptr::write_volatile(&raw mut slot.class_id, key.class_id);
        core::ptr::write_volatile(&raw mut slot.generation, key.generation);
        core::ptr::write_volatile(&raw mut slot.family, key.family);
        core::ptr::write_volatile(&raw mut slot.proto, key.proto);
        core::ptr::write_volatile(&raw mut slot._pad, 0);
        core::ptr::write_volatile(&raw mut slot.sport, key.sport);
        core::ptr::write_volatile(&raw mut slot.dport, key.dport);
        for word in 0..4 {
            core::ptr::write_volatile(&raw mut slot.src[word], key.src[word]);
            core::ptr::write_volatile(&raw mut slot.dst[word], key.dst[word]);
        }
    }
}

#[inline(always)]
fn add(word: *mut u64, value: u64) {
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, value) };
}

/// A shape class's drop and mark causes (`fair::ShapeStats`).
#[derive(Clone, Copy)]
enum Cause {
    QueueDrop,
    FairDrop,
    FairMark,
}

#[inline(always)]
fn count_cause(class_id: u32, cause: Cause, bytes: u64) {
    let Some(stats) = SHAPE_STATS.get_ptr_mut(class_id) else {
        return;
    };
    let stats = unsafe { &mut *stats };
    match cause {
        Cause::QueueDrop => {
            stats.queue_dropped_packets += 1;
            stats.queue_dropped_bytes += bytes;
        }
        Cause::FairDrop => {
            stats.fair_dropped_packets += 1;
            stats.fair_dropped_bytes += bytes;
        }
        Cause::FairMark => {
            stats.fair_marked_packets += 1;
            stats.fair_marked_bytes += bytes;
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
