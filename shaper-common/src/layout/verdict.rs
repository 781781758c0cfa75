//! The per-CPU verdict cache: a slot's entry, its stamp and the slot of a tuple.

use super::*;

/// One slot of the per-CPU verdict cache: a packet's classification tuple (the first 40
/// bytes of the packet path's parsed packet: family, protocol, flags, ports, addresses)
/// and the class the rules gave it, `NO_CLASS` included. The cache only saves the search:
/// the class's state and bucket are read for every packet as before.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerdictEntry {
    pub tuple: [u64; 5],
    /// `verdict_stamp` of the rules generation the class was found under; 0 never matches.
    pub stamp: u64,
    pub class_id: u32,
    pub _pad: u32,
}

/// The stamp of verdicts found under `rules_generation`: never 0, the zeroed slot's.
pub const fn verdict_stamp(rules_generation: u32) -> u64 {
    rules_generation as u64 + 1
}

/// The cache slot of a tuple: each word folded (its upper half into its lower) and
/// multiplied by its own odd constant, the products summed, folded and mixed once more;
/// the top bits pick one of `VERDICT_CACHE_SLOTS`. The five products are independent,
/// so they run side by side; the fold used before mixed word after word and waited for
/// five multiplies in a row. The folds matter: a product carries a word's top bits only
/// into its own top few, and the fields that tell flows apart often sit there (the
/// destination port; a host number, the last byte of an address in network order).
#[inline(always)]
pub const fn verdict_slot(tuple: &[u64; 5]) -> u32 {
    const KEYS: [u64; 5] = [
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
        0xd6e8_feb8_6659_fd93,
        0xff51_afd7_ed55_8ccd,
    ];
    #[inline(always)]
    const fn term(word: u64, key: u64) -> u64 {
        (word ^ (word >> 32)).wrapping_mul(key)
    }
    let hash = term(tuple[0], KEYS[0])
        .wrapping_add(term(tuple[1], KEYS[1]))
        .wrapping_add(term(tuple[2], KEYS[2]))
        .wrapping_add(term(tuple[3], KEYS[3]))
        .wrapping_add(term(tuple[4], KEYS[4]));
    let mixed = term(hash, KEYS[0]);
    (mixed >> (64 - VERDICT_CACHE_SLOTS.trailing_zeros())) as u32
}
