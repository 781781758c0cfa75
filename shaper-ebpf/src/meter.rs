//! Meters (RFC 2697 srTCM, RFC 2698 trTCM, colour-blind): colour, count, act per colour.

use crate::{
    act::{apply, count_drop, count_pass, stats_of},
    bucket::{bucket_of, swap},
    parse::Packet,
    rewrite::set_ecn_ce,
};
use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use shaper_common::{
    meter::{colour_of, Colour, MeterWord, MeterWords},
    Action, Bucket, ClassConfig,
};

/// Compare-and-swap rounds on a meter's two words before the packet counts as red: fewer
/// than a single bucket's, for the verifier's sake (each round is walked for every path
/// that reaches the meter).
const METER_CAS_ATTEMPTS: u32 = 8;

/// A subprogram: its two words' compare-and-swap rounds are verified once, apart from the
/// flat path, and its frame is its own, not the packet path's.
#[inline(never)]
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
        Some(bucket) => colour_of(
            &mut BucketWords(bucket),
            class,
            bytes,
            now,
            METER_CAS_ATTEMPTS,
        ),
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

/// The meter's two words in the class's bucket, changed by compare-and-swap.
struct BucketWords(*mut Bucket);

impl MeterWords for BucketWords {
    #[inline(always)]
    fn load(&mut self, word: MeterWord) -> u64 {
        unsafe { core::ptr::read_volatile(self.word(word)) }
    }

    #[inline(always)]
    fn swap(&mut self, word: MeterWord, current: u64, new: u64) -> bool {
        swap(self.word(word), current, new)
    }
}

impl BucketWords {
    #[inline(always)]
    fn word(&self, word: MeterWord) -> *mut u64 {
        match word {
            MeterWord::Committed => unsafe { &raw mut (*self.0).tat },
            MeterWord::Second => unsafe { &raw mut (*self.0).tat2 },
        }
    }
}
