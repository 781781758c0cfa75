//! Meters (RFC 2697 srTCM, RFC 2698 trTCM, colour-blind): colour, count, act per colour.

use crate::{
    act::{apply, count_drop, count_pass, stats_of},
    bucket::{bucket_of, swap},
    parse::Packet,
    rewrite::set_ecn_ce,
};
use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use shaper_common::{
    bucket::TAT_MASK,
    meter::{charged, srtcm, trtcm, Colour, METER_TRTCM},
    Action, Bucket, ClassConfig, CostKind,
};

/// Compare-and-swap rounds on a meter's two words (and on its second word alone after a
/// green packet) before the packet counts as red: fewer than a single bucket's, because
/// the verifier walks the rounds of both loops nested, and 16 × 16 of them left no room
/// for the rest of the program.
const METER_CAS_ATTEMPTS: u32 = 8;

#[inline(always)]
pub(crate) fn meter(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    now: u64,
) -> i32 {
    let Some(stats) = stats_of(class_id) else {
        return TC_ACT_UNSPEC;
    };
    let bytes = packet.wire_len;
    let colour = match bucket_of(class_id, class, packet) {
        Some(bucket) => colour_of(bucket, class, bytes, now),
        None => Colour::Green, // no room for a bucket: fail open, as for policing
    };
    let (action, arg, mask) = match colour {
        Colour::Green => {
            stats.green_packets += 1;
            stats.green_bytes += bytes;
            return count_pass(stats, bytes, false);
        }
        Colour::Yellow => {
            stats.yellow_packets += 1;
            stats.yellow_bytes += bytes;
            (class.exceed_action, class.exceed_arg, class.exceed_mask)
        }
        Colour::Red => {
            stats.red_packets += 1;
            stats.red_bytes += bytes;
            (class.action, class.action_arg, class.action_mask)
        }
    };
    // ECN on a meter colour: CE-mark ECN-capable packets, drop the rest.
    let outcome = if action == Action::Ecn as u8 {
        if set_ecn_ce(ctx, packet) {
            Some(true)
        } else {
            None
        }
    } else {
        apply(ctx, packet, action, arg, mask)
    };
    match outcome {
        Some(marked) => count_pass(stats, bytes, marked),
        None => count_drop(stats, bytes),
    }
}

/// The colour of one packet; each of the meter's two words changes by compare-and-swap.
/// Under contention a packet whose first word was charged but whose second changed
/// meanwhile keeps the lesser colour: no bucket ever admits more than it holds.
#[inline(always)]
fn colour_of(bucket: *mut Bucket, class: &ClassConfig, bytes: u64, now: u64) -> Colour {
    let first = unsafe { &raw mut (*bucket).tat };
    let second = unsafe { &raw mut (*bucket).tat2 };
    let trtcm_meter = class.meter == METER_TRTCM;
    let (mut stored_a, mut stored_b) = unsafe {
        (
            core::ptr::read_volatile(first),
            core::ptr::read_volatile(second),
        )
    };
    // Words of an older cost version are converted (tokens kept) in the swaps below. Only
    // the first read can find one: a CPU that won a race wrote the current version.
    let mut a = class.settle(stored_a, now, CostKind::Main);
    let mut b = class.settle(stored_b, now, CostKind::Peak);
    for _ in 0..METER_CAS_ATTEMPTS {
        if trtcm_meter {
            // Words: (C, P). P decides red; C decides green.
            let (colour, new_p, new_c) = trtcm(b, a, now, bytes, &class.peak_cost, &class.cost);
            if colour == Colour::Red {
                return Colour::Red;
            }
            if swap(second, stored_b, class.stamp(new_p)) {
                if colour == Colour::Green && swap(first, stored_a, class.stamp(new_c)) {
                    return Colour::Green;
                }
                return Colour::Yellow;
            }
        } else {
            // srTCM. Words: (C, total).
            let (colour, new_c, new_total) = srtcm(a, b, now, bytes, &class.cost, &class.peak_cost);
            match colour {
                Colour::Red => return Colour::Red,
                Colour::Yellow => {
                    if swap(second, stored_b, class.stamp(new_total)) {
                        return Colour::Yellow;
                    }
                }
                Colour::Green => {
                    if swap(first, stored_a, class.stamp(new_c)) {
                        // Green always deepens the total too; retry only that word.
                        let cost = class.cost.ticks_for(bytes);
                        let (mut stored_total, mut total) = (stored_b, b);
                        for _ in 0..METER_CAS_ATTEMPTS {
                            let next = class.stamp(charged(total, now, cost));
                            if swap(second, stored_total, next) {
                                break;
                            }
                            stored_total = unsafe { core::ptr::read_volatile(second) };
                            total = stored_total & TAT_MASK;
                        }
                        return Colour::Green;
                    }
                }
            }
        }
        (stored_a, stored_b) = unsafe {
            (
                core::ptr::read_volatile(first),
                core::ptr::read_volatile(second),
            )
        };
        (a, b) = (stored_a & TAT_MASK, stored_b & TAT_MASK);
    }
    Colour::Red
}
