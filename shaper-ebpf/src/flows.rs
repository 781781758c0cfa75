//! A shape class's packet in the flow table (`FLOW_QUEUES`): its flow's sparseness, the
//! class's census of bulk flows (and, under flow isolation, the share it sets each
//! interval), then the flow's own queue (`fair`). Subprograms called one after the other
//! by the entry program, before `shape`.

use crate::{
    bucket::{bucket_key, count_new_key, swap},
    fair::{add, fresh_entry, shaper_fair_judge, FRESH},
    maps::{CODEL_FLOWS, FLOW_QUEUES, FLOW_SCRATCH, SHAPE_PACKET},
};
use aya_ebpf::bindings::BPF_NOEXIST;
use core::intrinsics::{atomic_xadd, atomic_xchg, AtomicOrdering};
use shaper_common::{
    bucket::{ticks, TAT_MASK},
    codel::FlowCensus,
    fair::{next_share, settle_spare, sparse_at_share, FAIR_NONE, SHARE_ONE},
    ClassConfig, Scope,
};

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

    pub(crate) fn sparse(self) -> bool {
        self.0 & Self::SPARSE != 0
    }

    fn counted(self) -> bool {
        self.0 & Self::COUNTED != 0
    }

    fn fresh(self) -> bool {
        self.0 & Self::FRESH != 0
    }

    pub(crate) fn flows(self) -> u64 {
        (self.0 >> Self::FLOWS_SHIFT).max(1)
    }

    pub(crate) fn verdict(self) -> u64 {
        (self.0 >> Self::VERDICT_SHIFT) & 3
    }

    fn with_verdict(self, verdict: u64) -> Self {
        Self(self.0 | ((verdict & 3) << Self::VERDICT_SHIFT))
    }
}

/// The packet's flow in the flow table (`look_up_flow`), then, in a fair class, judged by
/// its own queue (`shaper_fair_judge`): each its own subprogram, called one after the other by
/// the entry program so that neither frame sits below `shape`'s.
#[inline(always)]
pub(crate) fn judge_flow(class_id: u32, class: &ClassConfig, now: u64) -> FlowLookup {
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
    flow.with_verdict(shaper_fair_judge(id_and_fresh, now) as u64)
}

/// The packet's flow in the flow table (`FlowLookup`, packed): whether it is sparse
/// (`shaper_common::codel::sparse`), by its own word, and the class's bulk flows. One
/// compare-and-swap: a lost race (a flow's packets on two CPUs at once) counts as bulk,
/// the safe side. No room in the table: bulk too.
///
/// Not inlined, and its key and new entry built in `FLOW_SCRATCH`: the verifier allows
/// 512 bytes of stack over the whole chain of calls, the entry program's frame included.
#[inline(never)]
pub(crate) fn look_up_flow(class_id: u32, class: &ClassConfig, now: u64) -> u64 {
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
pub(crate) fn count(
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
pub(crate) fn census_count(
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
    (census_flows(census), fresh)
}

/// The class's bulk flows by its census (the larger of the last interval's count and
/// this one's so far, at least 1), as `census_count` reads them: CoDel's drop spacing
/// divides by them.
#[inline(always)]
fn census_flows(census: *mut FlowCensus) -> u64 {
    let last = unsafe { core::ptr::read_volatile(&raw const (*census).counted) };
    let now = unsafe { core::ptr::read_volatile(&raw const (*census).counting) };
    last.max(now).max(1)
}

/// The next interval's share multiplier from the one that ended (`fair::next_share`);
/// after an idle interval, the class rate (1).
#[inline(always)]
pub(crate) fn roll_share(census: *mut FlowCensus, class: &ClassConfig, idle: bool) {
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
    let spare = settle_spare(take(unsafe { &raw mut (*census).spare_bytes }, 0));
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
