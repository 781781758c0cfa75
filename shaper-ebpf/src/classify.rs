//! Classify: a per-CPU verdict cache in front of a tuple-space search, one exact-match
//! hash lookup per distinct rule shape in use (`SHAPES`), never a scan over classes; the
//! lowest rank wins.

use crate::{
    maps::{GLOBALS, RULES, SHAPES, VERDICT_CACHE},
    parse::{Packet, TUPLE_WORDS},
};
use shaper_common::{verdict_slot, verdict_stamp, RuleKey, VerdictEntry, MAX_SHAPES, NO_CLASS};

#[inline(always)]
fn masked(value: [u32; 4], mask: [u32; 4]) -> [u32; 4] {
    [
        value[0] & mask[0],
        value[1] & mask[1],
        value[2] & mask[2],
        value[3] & mask[3],
    ]
}

/// The packet's class, if any. A tuple classified before under the same rules generation
/// takes the class (or "none") from this CPU's cache; any other runs the search and
/// leaves its answer there. The generation is read before the search, and userspace moves
/// it after its last rule write, so an answer found while rules change is never reused.
/// (That ordering relies on loads not passing loads, as on x86; on arm64 the rule lookups
/// could in principle run ahead of the generation read, and BPF has no load-acquire
/// before kernel 6.15.)
/// `CACHED` false makes every packet a miss (a benchmark's program).
#[inline(always)]
pub(crate) fn classify<const CACHED: bool>(packet: &Packet) -> Option<u32> {
    let globals = GLOBALS.get_ptr(0)?;
    let (generation, shape_count) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*globals).rules_generation),
            core::ptr::read_volatile(&raw const (*globals).shape_count),
        )
    };
    let stamp = verdict_stamp(generation);
    let mut tuple = [0u64; TUPLE_WORDS];
    for (index, word) in tuple.iter_mut().enumerate() {
        *word = packet.tuple_word(index);
    }
    let entry = VERDICT_CACHE.get_ptr_mut(verdict_slot(&tuple))?;
    let class_id = unsafe {
        let hit = CACHED
            && (*entry).stamp == stamp
            && (*entry).tuple[0] == tuple[0]
            && (*entry).tuple[1] == tuple[1]
            && (*entry).tuple[2] == tuple[2]
            && (*entry).tuple[3] == tuple[3]
            && (*entry).tuple[4] == tuple[4];
        if hit {
            (*entry).class_id
        } else {
            let class_id = search(packet, shape_count, entry);
            // Word by word: a copy of the array would be a `memcpy` call (a byte loop).
            for (index, word) in tuple.iter().enumerate() {
                core::ptr::write_volatile(&raw mut (*entry).tuple[index], *word);
            }
            (*entry).class_id = class_id;
            (*entry).stamp = stamp;
            class_id
        }
    };
    if class_id == NO_CLASS {
        None
    } else {
        Some(class_id)
    }
}

/// The tuple-space search: the best-ranked class of the packet, or `NO_CLASS`. Inlined:
/// as a subprogram, the call and return cost a cache miss about 30 ns more (no class
/// matching, every packet a miss: 129 -> 97 ns), and its key fits the 512-byte stack.
#[inline(always)]
fn search(packet: &Packet, shape_count: u32, entry: *mut VerdictEntry) -> u32 {
    // The best so far lives in the cache entry (its stamp field holds the best rank until
    // the caller stamps it), not in registers: the verifier knows nothing of a map
    // value's contents, so every iteration starts in one state. Carried in registers, the
    // best's ranges differed path by path and Debian 12's 6.1 verifier walked more than
    // its million instructions over the 32 iterations.
    let best_rank = unsafe { &raw mut (*entry).stamp };
    let best_class = unsafe { &raw mut (*entry).class_id };
    unsafe {
        core::ptr::write_volatile(best_rank, u64::MAX);
        core::ptr::write_volatile(best_class, NO_CLASS);
    }
    for index in 0..MAX_SHAPES {
        if index >= shape_count {
            break;
        }
        let Some(shape) = SHAPES.get(index) else {
            break;
        };
        if shape.in_use == 0 {
            continue;
        }
        let key = RuleKey {
            shape: index as u16,
            family: if shape.match_family != 0 {
                packet.family
            } else {
                0
            },
            proto: if shape.match_proto != 0 {
                packet.proto
            } else {
                0
            },
            flags: packet.flags,
            _pad: 0,
            _pad_word: 0,
            sport: packet.sport & shape.sport_mask,
            dport: packet.dport & shape.dport_mask,
            src: masked(packet.src, shape.src_mask),
            dst: masked(packet.dst, shape.dst_mask),
        };
        if let Some(hit) = unsafe { RULES.get(&key) } {
            unsafe {
                if hit.rank < core::ptr::read_volatile(best_rank) {
                    core::ptr::write_volatile(best_rank, hit.rank);
                    core::ptr::write_volatile(best_class, hit.class_id);
                }
            }
        }
    }
    unsafe { core::ptr::read_volatile(best_class) }
}
