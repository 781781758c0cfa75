//! Classify: tuple-space search, one exact-match hash lookup per distinct rule shape in
//! use (`SHAPES`), never a scan over classes; the lowest rank wins.

use crate::{
    maps::{GLOBALS, RULES, SHAPES},
    parse::Packet,
};
use shaper_common::{RuleKey, MAX_SHAPES};

#[inline(always)]
fn masked(value: [u32; 4], mask: [u32; 4]) -> [u32; 4] {
    [
        value[0] & mask[0],
        value[1] & mask[1],
        value[2] & mask[2],
        value[3] & mask[3],
    ]
}

#[inline(always)]
pub(crate) fn classify(packet: &Packet) -> Option<u32> {
    let shape_count = GLOBALS.get(0)?.shape_count;
    let mut best_class = 0u32;
    let mut best_rank = u64::MAX;
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
            if hit.rank < best_rank {
                best_rank = hit.rank;
                best_class = hit.class_id;
            }
        }
    }
    if best_rank == u64::MAX {
        None
    } else {
        Some(best_class)
    }
}
