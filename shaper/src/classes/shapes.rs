//! Rule shapes: the slots of the `SHAPES` table a class's classifier entries use, the
//! rank that orders classes, and the classifier that remains once a class is gone.

use super::ClassSpec;
use crate::{error::runtime, rules::Rule, state::Attachment};
use anyhow::Result;
use shaper_common::{RuleKey, RuleValue, Shape, MAX_SHAPES};
use std::collections::BTreeMap;

/// The order of classes matching one packet (the classifier contract's).
pub(crate) use shaper_common::rank;

/// Shape slots: the kernel's current table, extended as new masks appear.
pub(super) struct ShapeTable {
    pub(super) slots: Vec<Shape>,
}

impl ShapeTable {
    pub(super) fn read(attachment: &Attachment) -> Result<Self> {
        let map = attachment.shapes()?;
        let slots = (0..MAX_SHAPES)
            .map(|i| map.get(&i, 0))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { slots })
    }

    /// The slot of `shape`, allocating a free one; fails when all are taken.
    pub(super) fn slot(&mut self, shape: &Shape) -> Result<u16> {
        if let Some(index) = self.slots.iter().position(|s| s.in_use != 0 && s == shape) {
            return Ok(index as u16);
        }
        let free = self
            .slots
            .iter()
            .position(|s| s.in_use == 0)
            .ok_or_else(|| {
                runtime(format!(
                    "too many distinct rule shapes (the limit is {MAX_SHAPES} per interface and \
                 direction): use fewer distinct prefix lengths or simpler port ranges"
                ))
            })?;
        self.slots[free] = *shape;
        Ok(free as u16)
    }

    pub(super) fn count(&self) -> u32 {
        self.slots
            .iter()
            .rposition(|s| s.in_use != 0)
            .map_or(0, |i| i as u32 + 1)
    }
}

/// The classifier entries of one class, keyed with shape slots.
pub(super) fn class_entries(rule: &Rule, shapes: &mut ShapeTable) -> Result<Vec<RuleKey>> {
    rule.entries()
        .into_iter()
        .map(|(shape, key)| {
            Ok(RuleKey {
                shape: shapes.slot(&shape)?,
                ..key
            })
        })
        .collect()
}

pub(super) fn write_shapes(
    attachment: &Attachment,
    shapes: &ShapeTable,
    before: &ShapeTable,
) -> Result<()> {
    let mut map = attachment.shapes()?;
    for (index, (new, old)) in shapes.slots.iter().zip(&before.slots).enumerate() {
        if new != old {
            map.set(index as u32, *new, 0)?;
        }
    }
    Ok(())
}

pub(super) fn set_shape_count(attachment: &Attachment, count: u32) -> Result<()> {
    let mut globals = attachment.globals()?;
    if globals.shape_count != count {
        globals.shape_count = count;
        attachment.set_globals(globals)?;
    }
    Ok(())
}

/// The classifier once a class is gone: for every key of the remaining classes the
/// best-ranked one (the lowest prio, then the oldest), the deleted class's keys, and the
/// shape slots still in use.
pub(super) struct Remaining {
    pub(super) wanted: BTreeMap<RuleKey, RuleValue>,
    pub(super) deleted_keys: Vec<RuleKey>,
    pub(super) shapes_in_use: Vec<bool>,
}

/// Computes [`Remaining`] for `classes` (id, spec, rank) without the classes `deleted`
/// says are going. Pure: it touches only the in-memory shape table.
pub(super) fn remaining_without(
    classes: &[(u32, ClassSpec, u64)],
    deleted: impl Fn(u32) -> bool,
    shapes: &mut ShapeTable,
) -> Result<Remaining> {
    let mut remaining = Remaining {
        wanted: BTreeMap::new(),
        deleted_keys: Vec::new(),
        shapes_in_use: vec![false; MAX_SHAPES as usize],
    };
    for (class_id, spec, rank) in classes {
        let keys = class_entries(&spec.rule, shapes)?;
        if deleted(*class_id) {
            remaining.deleted_keys.extend(keys);
            continue;
        }
        let value = RuleValue {
            class_id: *class_id,
            _pad: 0,
            rank: *rank,
        };
        for key in keys {
            remaining.shapes_in_use[key.shape as usize] = true;
            let slot = remaining.wanted.entry(key).or_insert(value);
            if value.rank < slot.rank {
                *slot = value;
            }
        }
    }
    Ok(remaining)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prefix: u8) -> Shape {
        Shape {
            in_use: 1,
            src_mask: [u32::MAX << (32 - u32::from(prefix)), 0, 0, 0],
            ..Shape::default()
        }
    }

    #[test]
    fn a_shape_gets_one_slot_and_the_33rd_is_refused() {
        let mut table = ShapeTable {
            slots: vec![Shape::default(); MAX_SHAPES as usize],
        };
        for prefix in 1..=32u8 {
            assert_eq!(table.slot(&shape(prefix)).unwrap(), u16::from(prefix - 1));
        }
        assert_eq!(
            table.slot(&shape(7)).unwrap(),
            6,
            "a known shape reuses its slot"
        );
        assert_eq!(table.count(), 32);
        let error = table
            .slot(&Shape {
                dport_mask: 0xff00,
                ..shape(8)
            })
            .unwrap_err();
        assert!(error.to_string().contains("the limit is 32"), "{error}");
    }

    #[test]
    fn older_classes_and_lower_prios_rank_first() {
        assert!(rank(10, 0, 1) < rank(10, 0, 2));
        assert!(rank(5, 0, 99) < rank(10, 0, 1));
    }

    #[test]
    fn children_rank_before_their_ancestors_at_one_prio() {
        assert!(rank(10, 1, 9) < rank(10, 0, 1));
        assert!(rank(10, 3, 9) < rank(10, 2, 1));
        assert!(rank(5, 0, 9) < rank(10, 3, 1), "prio first");
    }
}

#[cfg(test)]
mod remaining_tests {
    //! The pure part of deletion, on the host.
    use super::*;
    use crate::class_input::ClassInput;

    fn class(name: &str, dport: &str, prio: &str) -> ClassSpec {
        let input = ClassInput {
            name: Some(name.into()),
            rate: Some("1mbit".into()),
            proto: Some("udp".into()),
            dport: Some(dport.into()),
            prio: Some(prio.into()),
            ..ClassInput::default()
        };
        input.check().unwrap().1
    }

    fn empty_shapes() -> ShapeTable {
        ShapeTable {
            slots: vec![Shape::default(); MAX_SHAPES as usize],
        }
    }

    #[test]
    fn deleting_a_class_hands_its_keys_to_the_next_best() {
        // Creation order is the rank's low word: older classes rank lower (win ties).
        let classes = vec![
            (0, class("older", "53", "10"), rank(10, 0, 1)),
            (1, class("younger", "53", "10"), rank(10, 0, 2)),
            (2, class("urgent", "53", "5"), rank(5, 0, 3)),
        ];
        let mut shapes = empty_shapes();
        let without_urgent = remaining_without(&classes, |id| id == 2, &mut shapes).unwrap();
        assert!(!without_urgent.deleted_keys.is_empty());
        for key in &without_urgent.deleted_keys {
            assert_eq!(
                without_urgent.wanted[key].class_id, 0,
                "the older of two ties"
            );
        }
        let without_older = remaining_without(&classes, |id| id == 0, &mut shapes).unwrap();
        for key in &without_older.deleted_keys {
            assert_eq!(without_older.wanted[key].class_id, 2, "the lowest prio");
        }
    }

    #[test]
    fn shapes_only_the_deleted_class_used_are_freed() {
        let classes = vec![
            (0, class("one-port", "53", "10"), rank(10, 0, 1)),
            (1, class("a-range", "1000-1001", "10"), rank(10, 0, 2)),
        ];
        let mut shapes = empty_shapes();
        let all = remaining_without(&classes, |_| false, &mut shapes).unwrap();
        let without_range = remaining_without(&classes, |id| id == 1, &mut shapes).unwrap();
        let used = |r: &Remaining| r.shapes_in_use.iter().filter(|u| **u).count();
        assert!(
            used(&without_range) < used(&all),
            "the range's port mask is freed"
        );
        assert!(without_range
            .deleted_keys
            .iter()
            .all(|key| !without_range.wanted.contains_key(key)));
    }
}
