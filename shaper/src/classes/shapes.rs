//! Rule shapes: the slots of the `SHAPES` table a class's classifier entries use, and
//! the rank that orders classes.

use crate::{error::runtime, rules::Rule, state::Attachment};
use anyhow::Result;
use shaper_common::{RuleKey, Shape, MAX_SHAPES};

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
