//! Shape: steer into shaper's HTB class, or pace by earliest departure time.

use crate::{
    act::{count_drop, count_pass, stats_of},
    bucket::{swap, CAS_ATTEMPTS},
    maps::CLASS_BUCKETS,
    parse::Packet,
};
use aya_ebpf::{bindings::TC_ACT_UNSPEC, helpers::bpf_skb_set_tstamp, programs::TcContext};
use aya_log_ebpf::warn;
use shaper_common::{
    bucket::{departure, ticks},
    ByteCost, ClassConfig,
};

const NANOS_PER_MILLI: u64 = 1_000_000;
/// BPF_SKB_TSTAMP_DELIVERY_MONO (uapi bpf.h): the tstamp is a monotonic departure time.
const SKB_TSTAMP_DELIVERY_MONO: u32 = 1;

/// `shape`: with an HTB class id in `action_arg`, steer the packet into shaper's HTB class
/// (skb->priority, so no tc filter runs); without one, pace it by earliest departure time
/// (skb->tstamp, for the fq qdisc), dropping what would leave beyond the horizon
/// (`action_mask` milliseconds).
#[inline(always)]
pub(crate) fn shape(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    now: u64,
) -> i32 {
    let Some(stats) = stats_of(class_id) else {
        return TC_ACT_UNSPEC;
    };
    if class.action_arg != 0 {
        unsafe { (*ctx.skb.skb).priority = class.action_arg };
    } else {
        let horizon = ticks(class.action_mask as u64 * NANOS_PER_MILLI);
        let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(class_id) else {
            return TC_ACT_UNSPEC;
        };
        let word = unsafe { &raw mut (*bucket).tat };
        match schedule(word, now, packet.wire_len, &class.cost, horizon) {
            Some(leave_at) => unsafe {
                bpf_skb_set_tstamp(ctx.skb.skb, leave_at, SKB_TSTAMP_DELIVERY_MONO);
            },
            None => {
                warn!(
                    ctx,
                    "class {}: departure beyond the {} ms horizon; packet dropped",
                    class_id,
                    class.action_mask
                );
                return count_drop(stats, packet.wire_len);
            }
        }
    }
    count_pass(stats, packet.wire_len, false)
}

/// [`departure`] on the bucket word with compare-and-swap; the departure time in ns.
#[inline(always)]
fn schedule(word: *mut u64, now: u64, bytes: u64, cost: &ByteCost, horizon: u64) -> Option<u64> {
    for _ in 0..CAS_ATTEMPTS {
        let tat = unsafe { core::ptr::read_volatile(word) };
        let (next, leave_at) = departure(tat, now, bytes, cost, horizon)?;
        if swap(word, tat, next) {
            return Some(leave_at);
        }
    }
    None
}
