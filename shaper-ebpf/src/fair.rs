//! Flow isolation on the packet path (`shaper_common::fair`): a bulk packet of a fair
//! class judged by its flow's own virtual queue at its fair share (and its host's, under
//! `--fair src|dst`), and the class's drops and marks counted by cause.

use crate::{
    bucket::{bucket_key, swap},
    maps::{
        CLASSES, CLASS_BUCKETS, CODEL_FLOWS, FLOW_QUEUES, FLOW_SCRATCH, SHAPE_PACKET, SHAPE_STATS,
    },
    parse::Packet,
};
use aya_ebpf::bindings::BPF_NOEXIST;
use core::intrinsics::{atomic_xadd, AtomicOrdering};
use shaper_common::{
    bucket::{ticks, TAT_MASK, TICK_BITS},
    codel::{sojourn_ns, FlowCensus, FRAME_BYTES},
    fair::{
        burst_credit, cap_for_ns, contending, flow_cap_ns, flow_ticks, flow_weight, host_flows,
        long_cap_budget_ns, over_share, passes_beyond_cap, roll_cap_drops, served_from, FlowQueue,
        FlowScratch, FAIR_DST, FAIR_FLOW_QUEUES, FAIR_MODE, FAIR_SRC, SHARE_ONE,
    },
    BucketKey, ClassConfig, Scope,
};

/// Set in a host entry's class id (class ids stay below `MAX_CLASSES`).
pub(crate) const HOST_KEY: u32 = 1 << 31;
/// Set in `shaper_fair_judge`'s class id argument: the census just counted the packet's flow.
pub(crate) const FRESH: u32 = 1 << 30;

/// `shaper_fair_judge`'s verdicts: under or over its share (passed on to `shape`, whose class
/// queue CoDel judges the flows over it; never over with a queue per flow in the leaf),
/// dropped beyond the flow's cap.
pub(crate) const FAIR_UNDER: u64 = 0;
pub(crate) const FAIR_OVER: u64 = 1;
pub(crate) const FAIR_DROPPED: u64 = 2;

/// Flow isolation for a bulk packet of a fair class: its flow's virtual queue at the fair
/// share (`shaper_common::fair`), held to its cap; whether it is over its share, which
/// `shape` hands to the class queue's CoDel.
/// Counts the flow in the census as over its share (with its weight) or the packet's bytes
/// as spare, and moves the flow's queue on by an admitted packet. A flow without an entry
/// (a full table, or its first packet) is under its share.
///
/// A global function (exported by `bpf-linker-v3`, so its BTF says global): the verifier
/// checks it once, on its own, not again for every state its caller reaches it in (one
/// comparison more here cost 177 000 instructions as a static subprogram). So its
/// arguments are scalars: the class is looked up again here.
///
/// `id_and_fresh` is the class id with [`FRESH`] set when the census just counted the
/// flow. The flow's entry is looked up again here: `look_up_flow` cannot hand its pointer
/// over (see `FlowLookup`), and this frame cannot sit below that one (512 bytes of stack
/// over a chain of calls).
#[no_mangle]
#[inline(never)]
pub extern "C" fn shaper_fair_judge(id_and_fresh: u32, now: u64) -> u64 {
    let class_id = id_and_fresh & !FRESH;
    let fresh = id_and_fresh & FRESH != 0;
    let (Some(class), Some(packet), Some(census), Some(scratch)) = (
        CLASSES.get(class_id),
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
    // Null without one: an `Option` of a pointer leaves the register undefined when
    // `None`, and LLVM may spill it, which the verifier refuses (an uninitialized read).
    let host = match class.codel.fair & FAIR_MODE {
        FAIR_SRC | FAIR_DST => host_entry(class_id, class, packet, census, scratch, fresh)
            .unwrap_or(core::ptr::null_mut()),
        _ => core::ptr::null_mut(),
    };
    let hosts = if host.is_null() {
        1
    } else {
        host_flows(unsafe { &*host })
    };
    let share = unsafe { core::ptr::read_volatile(&raw const (*census).share) };
    let share = if share == 0 { SHARE_ONE } else { share };
    // The packet's and a full frame's cost at the class rate, each worked out once.
    let class_charge = class.cost.ticks_for(bytes);
    let class_frame = class.cost.ticks_for(FRAME_BYTES);
    let charge = flow_ticks(class_charge, share, hosts);
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
    if fresh && host.is_null() {
        // Without hosts each flow weighs one (`host_count` counts hosts instead).
        add(unsafe { &raw mut (*census).weight }, SHARE_ONE);
    }
    // The link idle since the class's queue emptied (`fair::served_from`): a fair queue
    // would have served the flow at the whole rate meanwhile.
    let idle_ticks = now_ticks.saturating_sub(class_tat);
    let stored_finish = unsafe { core::ptr::read_volatile(finish_word) };
    let finish = shaper_fair_start(stored_finish, now_ticks, idle_ticks, share, hosts);
    let drained = finish <= now_ticks;
    let credit_word = unsafe { &raw mut (*entry).credit };
    let credit = if drained {
        0
    } else {
        unsafe { core::ptr::read_volatile(credit_word) }
    };
    // Over its share by more than this packet, or a full-size frame at the class rate
    // for small packets (`fair::over_share`).
    let over = over_share(
        finish.saturating_sub(credit),
        now_ticks,
        charge,
        class_frame,
    );
    let end = unsafe { core::ptr::read_volatile(&raw const (*census).interval_end) };
    let stamp = unsafe { &raw mut (*entry).over_share_in };
    let last_over = unsafe { core::ptr::read_volatile(stamp) };
    // The flow's bytes in this interval so far (from the packet the census counted it
    // by), which it added to the spare bytes while under its share.
    let bytes_word = unsafe { &raw mut (*entry).interval_bytes };
    let drops_word = unsafe { &raw mut (*entry).cap_drops };
    if fresh {
        // The last interval's losses to the cap against its bytes: held to the short cap?
        unsafe {
            let offered = core::ptr::read_volatile(bytes_word);
            let drops = core::ptr::read_volatile(drops_word);
            core::ptr::write_volatile(drops_word, roll_cap_drops(drops, offered));
            core::ptr::write_volatile(bytes_word, 0);
        }
    }
    let sent_before = unsafe { core::ptr::read_volatile(bytes_word) };
    add(bytes_word, bytes);
    if over {
        if last_over != end {
            unsafe { core::ptr::write_volatile(stamp, end) };
            if !contending(last_over, end, class.codel.interval_ns) {
                // Found over its share: what it sent earlier in this interval was no one
                // else's to leave it (counted spare, a lone flow's own bytes held it to
                // half the rate).
                add(
                    unsafe { &raw mut (*census).spare_bytes },
                    0u64.wrapping_sub(sent_before),
                );
            }
            add(
                unsafe { &raw mut (*census).over_share_weight },
                flow_weight(hosts),
            );
            add(unsafe { &raw mut (*census).over_share_counting }, 1);
        }
    } else if !contending(last_over, end, class.codel.interval_ns) {
        // Only others' bytes are spare: a contending flow's own packets that find its
        // queue drained would otherwise count as what the others leave it, and hold it
        // to less (one Cubic flow beside a probe kept 0.46-0.69 of the rate so).
        add(unsafe { &raw mut (*census).spare_bytes }, bytes);
    }
    // The flow's queue at its share beyond its cap: its excess (an unresponsive flow's,
    // or one's that heeds no CoDel) is dropped. Within the cap, the class queue's CoDel
    // judges the flows over their share (below).
    let frame_ns = flow_ticks(class_frame, share, hosts) >> TICK_BITS;
    let short_ns = flow_cap_ns(class.codel.target_ns, frame_ns, charge >> TICK_BITS);
    let drops = unsafe { core::ptr::read_volatile(drops_word) };
    let cap_ns = cap_for_ns(
        drops,
        short_ns,
        class.codel.interval_ns,
        long_cap_budget_ns(class.codel.cap_ns, !host.is_null()),
        share,
        hosts,
    );
    // With at most a frame in the class's real queue the link is about to idle: a fair
    // queue would serve the packet at once, so a flow that heeds drops passes beyond its
    // cap, its queue not moved on (`fair::passes_beyond_cap`; never with hosts, so
    // nothing of a host's is skipped here).
    if sojourn_ns(finish, now_ticks, credit) > cap_ns {
        let link_idling = class_delay <= class_frame >> TICK_BITS;
        if passes_beyond_cap(link_idling, drops, !host.is_null()) {
            return FAIR_UNDER;
        }
        add(drops_word, bytes);
        return FAIR_DROPPED;
    }
    // A host's own queue at its share bounds what all its flows together add to the
    // class's queue, however many they are.
    if !host.is_null() {
        let host_charge = flow_ticks(class_charge, share, 1);
        let host_word = unsafe { &raw mut (*host).finish };
        let host_stored = unsafe { core::ptr::read_volatile(host_word) };
        let host_finish = shaper_fair_start(host_stored, now_ticks, idle_ticks, share, 1);
        let host_drained = host_finish <= now_ticks;
        let credit_word = unsafe { &raw mut (*host).credit };
        let host_credit = if host_drained {
            0
        } else {
            unsafe { core::ptr::read_volatile(credit_word) }
        };
        let host_frame_ns = flow_ticks(class_frame, share, 1) >> TICK_BITS;
        let host_short_ns = flow_cap_ns(
            class.codel.target_ns,
            host_frame_ns,
            host_charge >> TICK_BITS,
        );
        add(unsafe { &raw mut (*host).interval_bytes }, bytes);
        let host_drops_word = unsafe { &raw mut (*host).cap_drops };
        let host_drops = unsafe { core::ptr::read_volatile(host_drops_word) };
        let host_cap_ns = cap_for_ns(
            host_drops,
            host_short_ns,
            class.codel.interval_ns,
            long_cap_budget_ns(class.codel.cap_ns, true),
            share,
            1,
        );
        if sojourn_ns(host_finish, now_ticks, host_credit) > host_cap_ns {
            add(host_drops_word, bytes);
            return FAIR_DROPPED;
        }
        let host_credit = burst_credit(
            host_credit,
            host_drained,
            within_burst,
            host_charge,
            burst_ticks,
        );
        advance(host_word, host_stored, host_finish, host_charge);
        unsafe { core::ptr::write_volatile(credit_word, host_credit) };
    }
    advance(finish_word, stored_finish, finish, charge);
    unsafe {
        let credit = burst_credit(credit, drained, within_burst, charge, burst_ticks);
        core::ptr::write_volatile(credit_word, credit);
    }
    // With a queue per flow in the leaf (`FAIR_FLOW_QUEUES`) each flow's CoDel is there,
    // on its own real queue: no flow is handed to the class queue's.
    if over && class.codel.fair & FAIR_FLOW_QUEUES == 0 {
        FAIR_OVER
    } else {
        FAIR_UNDER
    }
}

/// Where a flow's (host's) virtual queue stands for a packet: `fair::served_from` with
/// the link's idle time at the flow's share. A global function as `shaper_fair_judge`:
/// inline, its branches split every state after it (140 000 instructions more).
#[no_mangle]
#[inline(never)]
pub extern "C" fn shaper_fair_start(
    finish: u64,
    now_ticks: u64,
    idle_ticks: u64,
    share: u64,
    hosts: u64,
) -> u64 {
    served_from(finish, now_ticks, flow_ticks(idle_ticks, share, hosts))
}

/// Moves a virtual queue's end (`word`, read as `seen`) on by an admitted packet's
/// `charge`: from `start` (`fair::served_from`: now when it had drained, less when the link
/// idled) when that differs from what it holds, else from its end. Atomic, as the class's
/// queue: a flow's packets reach this on two CPUs at once (forwarded through an ifb), and
/// each update a plain write lost left the flow's queue short by a packet, so it fell
/// behind the real one for good (one Cubic flow's RTT climbed from 11 to 51 ms in 30 s).
#[inline(always)]
fn advance(word: *mut u64, seen: u64, start: u64, charge: u64) {
    if start != seen && swap(word, seen, start + charge) {
        return;
    }
    // Backlogged, or another CPU restarted it first: behind what it holds.
    add(word, charge);
}

/// Under `--fair src|dst`: the packet's host's entry in the flow table (`fair::FlowQueue`,
/// a host's fields), rolled to the class's interval and counting the packet's flow when
/// the census just counted it; a host new to the interval weighs one in the census. No
/// room for the host: none.
#[inline(always)]
pub(crate) fn host_entry(
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    census: *mut FlowCensus,
    scratch: &mut FlowScratch,
    fresh: bool,
) -> Option<*mut FlowQueue> {
    let scope = if class.codel.fair & FAIR_MODE == FAIR_SRC {
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
            let drops = &raw mut (*host).cap_drops;
            let offered = &raw mut (*host).interval_bytes;
            let rolled = roll_cap_drops(
                core::ptr::read_volatile(drops),
                core::ptr::read_volatile(offered),
            );
            core::ptr::write_volatile(drops, rolled);
            core::ptr::write_volatile(offered, 0);
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
pub(crate) fn fresh_entry(entry: &mut FlowQueue, sparse: u64) {
    // Volatile: plain stores of zeros LLVM merges into a `memset` call.
    unsafe {
        core::ptr::write_volatile(&raw mut entry.sparse, sparse);
        core::ptr::write_volatile(&raw mut entry.counted_in, 0);
        core::ptr::write_volatile(&raw mut entry.finish, 0);
        core::ptr::write_volatile(&raw mut entry.over_share_in, 0);
        core::ptr::write_volatile(&raw mut entry.interval_bytes, 0);
        core::ptr::write_volatile(&raw mut entry.cap_drops, 0);
        core::ptr::write_volatile(&raw mut entry.credit, 0);
    }
}

/// Writes `key` into the scratch slot word by word (volatile: a host key's zeroed
/// fields would otherwise become a `memset` call).
#[inline(always)]
pub(crate) fn set_key(slot: &mut BucketKey, key: &BucketKey) {
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
pub(crate) fn add(word: *mut u64, value: u64) {
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(word, value) };
}

/// A shape class's drop and mark causes (`fair::ShapeStats`).
#[derive(Clone, Copy)]
pub(crate) enum Cause {
    QueueDrop,
    FairDrop,
    FairMark,
}

#[inline(always)]
pub(crate) fn count_cause(class_id: u32, cause: Cause, bytes: u64) {
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
