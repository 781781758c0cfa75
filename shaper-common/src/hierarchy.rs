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
//! [`TreeModel`] is the host model the property tests and the BPF test runs check the
//! program against; the program runs the same steps word by word with compare-and-swap.

use crate::bucket::{advance, conform, ByteCost};

/// Levels in a tree, the class a packet is classified to included.
pub const MAX_LEVELS: usize = 4;

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
                    None => return self.refuse(&path, &charged, key_word, level, bytes),
                }
                charged[level] = true;
            }
            if let Some(next) = conform(c.rate_tat, now_ns, bytes, &c.rate) {
                self.classes[id].rate_tat = next;
                return self.lent(&path, depth, level, now_ns, bytes);
            }
            if !has_parent {
                return self.refuse(&path, &charged, key_word, level, bytes);
            }
        }
        unreachable!("the top level lends or refuses")
    }

    /// Gives back the ceiling words charged below (and at) `level`.
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
