//! Class hierarchies: htb's borrowing on GCRA words.
//!
//! Every class in a tree has two words: its rate word (`Bucket::tat`, at the class's
//! rate and burst: what it is guaranteed) and its ceiling word (`Bucket::tat2`, at ceil
//! and cburst: what it may reach by borrowing). A packet classified to a class walks up
//! from it, as htb's `htb_charge_class` does:
//! - a level whose ceiling word cannot take the packet refuses it; the ceiling words
//!   already charged below are given back exactly;
//! - a level whose rate word takes it *lends*: the packet passes;
//! - a level over its rate but within its ceiling *borrows*: the walk goes on to its
//!   parent (a top-level class has nothing to borrow from and refuses);
//! - every level above the lender is charged in debt (its words move on whether or not
//!   they conform), so traffic a class is guaranteed is never refused because a sibling
//!   borrowed, and borrowed traffic finds the parent's rate word the fuller for it.
//!
//! A per-key class (`--per flow|src|dst`) under a parent has no rate of its own for the
//! aggregate: its key's word is the key's ceiling, and every packet borrows from the
//! parent. The words of levels that borrow are left alone (htb refills them).
//!
//! Fair borrowing: htb splits a parent's spare evenly between the children that borrow
//! it (deficit round robin with equal quanta); a policer has no queues to take turns
//! from, so first come would be first served. Instead each parent learns a fair share
//! (`share`, a cost per byte) and each child has a fair word (`fair_tat`) at that share:
//! a borrowed packet must fit the borrower's fair word as well as the parent. The share
//! rises while a fair word refuses a packet the parent had room for (more than half its
//! burst left), and falls whenever the parent refuses a borrowed packet; so it settles
//! where the borrowers' fair words, not the order of their packets, divide the spare,
//! with the parent's rate word running between half full and empty.
//!
//! [`TreeModel`] is the host model the property tests and the BPF test runs check the
//! program against; the program runs the same steps word by word with compare-and-swap.

use crate::bucket::{advance, conform, ticks, ByteCost, FRAC_BITS, MIN_RATE_BITS_PER_SEC};

/// Levels in a tree, the class a packet is classified to included.
pub const MAX_LEVELS: usize = 4;

/// How far a borrower may run ahead of its fair share (the fair word's burst): 20 ms, and
/// never less than the packet at hand, so a full-size or GSO packet fits an idle fair
/// word at any share (a burst in bytes instead would let every borrower at a small share
/// run far ahead of it).
pub const FAIR_TOLERANCE_NS: u64 = 20_000_000;
/// A share moves by 1/32 of itself per step.
const SHARE_STEP_SHIFT: u32 = 5;
/// A share goes no lower than 2^-10 of the parent's rate.
const SHARE_FLOOR_SHIFT: u32 = 10;

/// A fair share as a cost: fixed-point ticks per byte (`ticks_per_byte << FRAC_BITS |
/// frac`), between what the parent can pass (`parent`: its rate at the top, its ceiling
/// below; a lone borrower may take all of it) and 1/1024 of it (or the lowest rate the
/// arithmetic supports), so a share that overload pushed down climbs back within a few
/// hundred steps. 0 (never learned) is the fastest.
#[inline(always)]
pub fn fair_share(share: u64, parent: &ByteCost) -> u64 {
    let fastest = fixed(parent);
    let slowest = if fastest > MIN_RATE_FIXED >> SHARE_FLOOR_SHIFT {
        MIN_RATE_FIXED
    } else {
        fastest << SHARE_FLOOR_SHIFT
    };
    if share < fastest {
        fastest
    } else if share > slowest {
        slowest
    } else {
        share
    }
}

/// The fixed-point cost of the lowest rate (8 bit/s: one byte a second).
const MIN_RATE_FIXED: u64 = ((8 * 1_000_000_000u64) << 4 << FRAC_BITS) / MIN_RATE_BITS_PER_SEC;

#[inline(always)]
fn fixed(cost: &ByteCost) -> u64 {
    (cost.ticks_per_byte << FRAC_BITS) | cost.ticks_per_byte_frac
}

/// The fair word's cost at `share` (see [`fair_share`]) for a packet of `bytes`.
#[inline(always)]
pub fn fair_cost(share: u64, bytes: u64) -> ByteCost {
    let mut cost = ByteCost {
        ticks_per_byte: share >> FRAC_BITS,
        ticks_per_byte_frac: share & ((1 << FRAC_BITS) - 1),
        tolerance_ticks: ticks(FAIR_TOLERANCE_NS),
        burst_bytes: 0,
    };
    let packet = cost.ticks_for(bytes);
    if packet > cost.tolerance_ticks {
        cost.tolerance_ticks = packet;
    }
    cost
}

/// Of a parent's rate and ceiling word (each given with its cost), the one that says what
/// it can pass for a borrowing child: its rate word at the top of a tree, its ceiling word
/// below (it borrows in turn).
#[inline(always)]
pub fn lending_word<T>(has_parent: bool, rate: T, ceil: T) -> T {
    if has_parent {
        ceil
    } else {
        rate
    }
}

/// A larger share (a lower cost): a fair word refused what the parent had room for.
#[inline(always)]
pub fn share_up(share: u64, parent: &ByteCost) -> u64 {
    let share = fair_share(share, parent);
    fair_share(share - (share >> SHARE_STEP_SHIFT), parent)
}

/// A smaller share: the parent refused a borrowed packet.
#[inline(always)]
pub fn share_down(share: u64, parent: &ByteCost) -> u64 {
    let share = fair_share(share, parent);
    fair_share(share + (share >> SHARE_STEP_SHIFT) + 1, parent)
}

/// Whether a word has more than half its burst left (its occupancy below half).
#[inline(always)]
pub fn has_room(tat: u64, now_ns: u64, cost: &ByteCost) -> bool {
    let now = ticks(now_ns);
    tat <= now || tat - now < cost.tolerance_ticks / 2
}

/// A word charged in debt: `max(tat, now) + cost`, conforming or not.
#[inline(always)]
pub fn in_debt(tat: u64, now_ns: u64, bytes: u64, cost: &ByteCost) -> u64 {
    advance(tat, now_ns, bytes, cost).2
}

/// What the walk decided for one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Passed; the level (0 = the packet's class) whose rate word lent.
    Lent { level: usize },
    /// Refused at this level (0 = the packet's class).
    Refused { level: usize },
}

/// One class of the model.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelClass {
    pub parent: Option<usize>,
    pub rate: ByteCost,
    pub ceil: ByteCost,
    /// The class's buckets are per key; the caller holds the key's word.
    pub per_key: bool,
    pub rate_tat: u64,
    pub ceil_tat: u64,
    /// The class's fair word against its parent's share (see the module's text).
    pub fair_tat: u64,
    /// The fair share the class gives each child that borrows from it.
    pub share: u64,
}

/// Up to 16 classes in trees; the serial semantics of the program's walk.
#[derive(Clone, Debug, Default)]
pub struct TreeModel {
    pub classes: [ModelClass; 16],
}

impl TreeModel {
    /// The path from `class` to its top-level ancestor.
    pub fn path(&self, class: usize) -> ([usize; MAX_LEVELS], usize) {
        let mut path = [0; MAX_LEVELS];
        let (mut at, mut depth) = (Some(class), 0);
        while let Some(id) = at {
            if depth == MAX_LEVELS {
                break;
            }
            path[depth] = id;
            depth += 1;
            at = self.classes[id].parent;
        }
        (path, depth)
    }

    /// Admits or refuses `bytes` at `now_ns` for a packet of `class`; `key_word` is the
    /// packet's key's word when the class is per key.
    pub fn admit(
        &mut self,
        class: usize,
        key_word: Option<&mut u64>,
        now_ns: u64,
        bytes: u64,
    ) -> Outcome {
        let (path, depth) = self.path(class);
        let mut key_word = key_word;
        // The ceiling words charged so far, by level, to give back on a refusal.
        let mut charged = [false; MAX_LEVELS];
        for level in 0..depth {
            let id = path[level];
            let c = self.classes[id];
            let has_parent = level + 1 < depth;
            if level > 0 {
                // The child below borrows: it must fit its fair word at this class's share.
                let child = path[level - 1];
                let (word, lends) =
                    lending_word(has_parent, (c.rate_tat, &c.rate), (c.ceil_tat, &c.ceil));
                let share = fair_share(c.share, lends);
                let fair = self.classes[child].fair_tat;
                match conform(fair, now_ns, bytes, &fair_cost(share, bytes)) {
                    Some(next) => self.classes[child].fair_tat = next,
                    None => {
                        if has_room(word, now_ns, lends) {
                            self.classes[id].share = share_up(c.share, lends);
                        }
                        return self.refuse(&path, &charged, key_word, level - 1, bytes);
                    }
                }
            }
            if level == 0 && c.per_key {
                let word = key_word
                    .as_deref_mut()
                    .expect("a per-key class needs its key's word");
                match conform(*word, now_ns, bytes, &c.rate) {
                    Some(next) => *word = next,
                    None => return Outcome::Refused { level },
                }
                if !has_parent {
                    return self.lent(&path, depth, level, now_ns, bytes);
                }
                charged[level] = true;
                continue;
            }
            if has_parent {
                match conform(c.ceil_tat, now_ns, bytes, &c.ceil) {
                    Some(next) => self.classes[id].ceil_tat = next,
                    None => {
                        self.refused_borrowing(id, level);
                        return self.refuse(&path, &charged, key_word, level, bytes);
                    }
                }
                charged[level] = true;
            }
            if let Some(next) = conform(c.rate_tat, now_ns, bytes, &c.rate) {
                self.classes[id].rate_tat = next;
                return self.lent(&path, depth, level, now_ns, bytes);
            }
            if !has_parent {
                self.refused_borrowing(id, level);
                return self.refuse(&path, &charged, key_word, level, bytes);
            }
        }
        unreachable!("the top level lends or refuses")
    }

    /// Gives back the ceiling words charged below (and at) `level` (fair words are not
    /// given back: a borrower's refused packets count against its share too).
    fn refuse(
        &mut self,
        path: &[usize; MAX_LEVELS],
        charged: &[bool; MAX_LEVELS],
        key_word: Option<&mut u64>,
        level: usize,
        bytes: u64,
    ) -> Outcome {
        let mut key_word = key_word;
        for (below, _) in charged.iter().enumerate().filter(|(_, was)| **was) {
            let c = &mut self.classes[path[below]];
            if below == 0 && c.per_key {
                if let Some(word) = key_word.as_deref_mut() {
                    *word -= c.rate.ticks_for(bytes);
                }
            } else {
                c.ceil_tat -= c.ceil.ticks_for(bytes);
            }
        }
        Outcome::Refused { level }
    }

    /// A class above the packet's refused what its child borrowed: its share falls.
    fn refused_borrowing(&mut self, id: usize, level: usize) {
        if level > 0 {
            let c = &mut self.classes[id];
            let lends = lending_word(c.parent.is_some(), &c.rate, &c.ceil);
            c.share = share_down(c.share, lends);
        }
    }

    /// The levels above the lender go into debt.
    fn lent(
        &mut self,
        path: &[usize; MAX_LEVELS],
        depth: usize,
        level: usize,
        now_ns: u64,
        bytes: u64,
    ) -> Outcome {
        for (above, &id) in path.iter().enumerate().take(depth).skip(level + 1) {
            let c = &mut self.classes[id];
            c.rate_tat = in_debt(c.rate_tat, now_ns, bytes, &c.rate);
            if above + 1 < depth {
                c.ceil_tat = in_debt(c.ceil_tat, now_ns, bytes, &c.ceil);
            }
        }
        Outcome::Lent { level }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_lies_between_the_parents_rate_and_a_1024th_of_it() {
        // A fast parent: shares go no lower than 1/1024 of its rate.
        let parent = ByteCost::new(1_000_000_000, 1 << 20);
        let fastest = fixed(&parent);
        assert_eq!(
            fair_share(0, &parent),
            fastest,
            "never learned: the parent's rate"
        );
        assert_eq!(fair_share(fastest * 3, &parent), fastest * 3);
        assert_eq!(fair_share(u64::MAX, &parent), fastest << SHARE_FLOOR_SHIFT);
        // A parent slower than 1024 times the lowest rate: the floor is the lowest rate,
        // whose cost is what the bucket arithmetic makes of it.
        assert_eq!(
            MIN_RATE_FIXED,
            fixed(&ByteCost::new(MIN_RATE_BITS_PER_SEC, 1 << 20))
        );
        let slow = ByteCost::new(1_000, 1 << 20);
        assert!(fixed(&slow) > MIN_RATE_FIXED >> SHARE_FLOOR_SHIFT);
        assert_eq!(fair_share(u64::MAX, &slow), MIN_RATE_FIXED);
        assert_eq!(fair_share(0, &slow), fixed(&slow));
    }

    #[test]
    fn a_fair_word_runs_at_its_share_with_room_for_the_packet() {
        let parent = ByteCost::new(80_000_000, 1 << 20);
        let share = fixed(&parent) * 8; // an eighth of the parent's rate
        let cost = fair_cost(share, 1500);
        assert_eq!(
            (cost.ticks_per_byte, cost.ticks_per_byte_frac),
            (share >> FRAC_BITS, share & ((1 << FRAC_BITS) - 1))
        );
        assert_eq!(cost.tolerance_ticks, ticks(FAIR_TOLERANCE_NS));
        // A packet worth more than 20 ms at a tiny share: the tolerance is that packet.
        let tiny = fair_share(u64::MAX, &parent);
        let gso = fair_cost(tiny, 64 * 1024);
        assert_eq!(gso.tolerance_ticks, gso.ticks_for(64 * 1024));
        assert!(gso.tolerance_ticks > ticks(FAIR_TOLERANCE_NS));
    }

    #[test]
    fn a_share_steps_by_a_32nd_of_itself() {
        let parent = ByteCost::new(80_000_000, 1 << 20);
        let share = fixed(&parent) * 64;
        assert_eq!(share_up(share, &parent), share - share / 32);
        assert_eq!(share_down(share, &parent), share + share / 32 + 1);
        // Clamped at both ends.
        assert_eq!(share_up(fixed(&parent), &parent), fixed(&parent));
        let floor = fair_share(u64::MAX, &parent);
        assert_eq!(share_down(floor, &parent), floor);
    }

    #[test]
    fn room_is_less_than_half_the_burst_owed() {
        let cost = ByteCost::new(8_000_000, 100_000);
        let now = 1_000_000_000u64;
        let half = cost.tolerance_ticks / 2;
        assert!(has_room(0, now, &cost), "a word in the past");
        assert!(has_room(ticks(now) + half - 1, now, &cost));
        assert!(!has_room(ticks(now) + half, now, &cost));
        assert!(!has_room(ticks(now) + cost.tolerance_ticks, now, &cost));
    }
}
