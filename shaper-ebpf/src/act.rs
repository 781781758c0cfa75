//! Act: over the rate, apply the class's action; and count every packet the class
//! judged (`count_pass` / `count_drop`, also used by meters and shaping).

use crate::{
    bucket::Verdict,
    maps::STATS,
    parse::Packet,
    rewrite::{set_dscp, set_ecn_ce},
};
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use shaper_common::{Action, ClassConfig, ClassStats};

/// Applies an over-rate action; `Some(marked)` when the packet passes, `None` to drop.
#[inline(always)]
pub(crate) fn apply(
    ctx: &TcContext,
    packet: &Packet,
    action: u8,
    arg: u32,
    mask: u32,
) -> Option<bool> {
    if action == Action::Pass as u8 {
        Some(true)
    } else if action == Action::Dscp as u8 {
        set_dscp(ctx, packet, arg as u8);
        Some(true)
    } else if action == Action::Fwmark as u8 {
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark((mark & !mask) | arg);
        Some(true)
    } else {
        None
    }
}

/// This CPU's counters of a class (per-CPU: no other CPU writes them).
#[inline(always)]
pub(crate) fn stats_of(class_id: u32) -> Option<&'static mut ClassStats> {
    STATS
        .get_ptr_mut(class_id)
        .map(|stats| unsafe { &mut *stats })
}

#[inline(always)]
pub(crate) fn count_pass(stats: &mut ClassStats, bytes: u64, marked: bool) -> i32 {
    stats.passed_packets += 1;
    stats.passed_bytes += bytes;
    if marked {
        stats.marked_packets += 1;
        stats.marked_bytes += bytes;
    }
    TC_ACT_UNSPEC
}

#[inline(always)]
pub(crate) fn count_drop(stats: &mut ClassStats, bytes: u64) -> i32 {
    stats.dropped_packets += 1;
    stats.dropped_bytes += bytes;
    TC_ACT_SHOT as i32
}

#[inline(always)]
pub(crate) fn act(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    verdict: Verdict,
    packet: &Packet,
) -> i32 {
    let Some(stats) = stats_of(class_id) else {
        return TC_ACT_UNSPEC;
    };
    let bytes = packet.wire_len;
    match verdict {
        // ECN: CE-mark early, once the bucket is more than half drained, so ECN-capable
        // TCP backs off before anything has to be dropped.
        Verdict::Within { occupancy } => {
            let marked = class.action == Action::Ecn as u8
                && occupancy > class.cost.tolerance_ticks / 2
                && set_ecn_ce(ctx, packet);
            count_pass(stats, bytes, marked)
        }
        // Drop, and ECN once the bucket is empty: policing stays exact.
        Verdict::Exceed => match apply(
            ctx,
            packet,
            class.action,
            class.action_arg,
            class.action_mask,
        ) {
            Some(marked) => count_pass(stats, bytes, marked),
            None => count_drop(stats, bytes),
        },
    }
}
