//! The class table's classifier entries, and deleting a class.
//!
//! Write order keeps the packet path consistent at every instant: a deleted class's
//! entries are gone (or re-pointed at the next-best class) before its config is cleared.

use super::{
    shapes::*,
    tree::{ranked, refresh_htb, TreeView},
    *,
};
use crate::{
    error::runtime,
    qdisc,
    state::{decode_name, Attachment},
};
use anyhow::Result;
use aya::maps::MapError;
use shaper_common::{
    Action, ClassConfig, ClassMeta, RuleKey, RuleValue, Shape, MAX_RULES, MAX_SHAPES,
};
use std::collections::BTreeMap;

/// Why a classifier entry could not be written, in the user's terms.
fn rule_insert_error(error: &MapError) -> String {
    match error {
        // A full BPF hash map answers an insert with E2BIG.
        MapError::SyscallError(failed)
            if failed.io_error.raw_os_error() == Some(nix::errno::Errno::E2BIG as i32) =>
        {
            format!(
                "cannot add classifier entry: the classifier table is full ({MAX_RULES} entries \
                 per interface and direction; port ranges take one entry per power-of-two block)"
            )
        }
        other => format!(
            "cannot add classifier entry: {other}: {}",
            root_cause(other)
        ),
    }
}

fn root_cause(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// The classifier map of an attachment.
pub(super) type RulesMap = aya::maps::HashMap<aya::maps::MapData, RuleKey, RuleValue>;

/// Writes a class's classifier entries, skipping keys an older or higher-priority class
/// owns; on failure every entry already written gets its previous value back.
pub(super) fn write_entries(
    rules: &mut RulesMap,
    keys: Vec<RuleKey>,
    value: RuleValue,
) -> Result<()> {
    let mut written: Vec<(RuleKey, Option<RuleValue>)> = Vec::new();
    let mut outcome = Ok(());
    for key in keys {
        let previous = match rules.get(&key, 0) {
            Ok(v) => Some(v),
            Err(MapError::KeyNotFound) => None,
            Err(e) => {
                outcome = Err(e.into());
                break;
            }
        };
        if previous.is_some_and(|p| p.rank <= value.rank) {
            continue;
        }
        if let Err(e) = rules.insert(key, value, 0) {
            outcome = Err(runtime(rule_insert_error(&e)));
            break;
        }
        written.push((key, previous));
    }
    if outcome.is_err() {
        for (key, previous) in written.into_iter().rev() {
            let _ = match previous {
                Some(v) => rules.insert(key, v, 0),
                None => rules.remove(&key),
            };
        }
    }
    outcome
}

/// Finds a class by name.
pub fn find(attachment: &Attachment, name: &str) -> Result<Option<(u32, ClassMeta)>> {
    attachment.find_class(name)
}

pub(super) fn not_found(attachment: &Attachment, name: &str) -> anyhow::Error {
    runtime(format!(
        "no class '{name}' on {}",
        attachment.location.describe()
    ))
}

/// Deletes a class; keys it owned go to the next-best class that matches them.
/// The classifier once a class is gone: for every key of the remaining classes the
/// best-ranked one (the lowest prio, then the oldest), the deleted class's keys, and the
/// shape slots still in use.
pub(super) struct Remaining {
    pub(super) wanted: BTreeMap<RuleKey, RuleValue>,
    pub(super) deleted_keys: Vec<RuleKey>,
    pub(super) shapes_in_use: Vec<bool>,
}

/// Computes [`Remaining`] for `classes` (id, spec, rank) without class `deleted`. Pure:
/// it touches only the in-memory shape table.
pub(super) fn remaining_without(
    classes: &[(u32, ClassSpec, u64)],
    deleted: u32,
    shapes: &mut ShapeTable,
) -> Result<Remaining> {
    let mut remaining = Remaining {
        wanted: BTreeMap::new(),
        deleted_keys: Vec::new(),
        shapes_in_use: vec![false; MAX_SHAPES as usize],
    };
    for (class_id, spec, rank) in classes {
        let keys = class_entries(&spec.rule, shapes)?;
        if *class_id == deleted {
            remaining.deleted_keys = keys;
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

pub fn delete(attachment: &Attachment, name: &str) -> Result<()> {
    let all = attachment.class_list()?;
    let (id, _) = all
        .iter()
        .find(|(_, m)| decode_name(&m.name) == name)
        .cloned()
        .ok_or_else(|| not_found(attachment, name))?;
    let tree = TreeView::read(attachment, &all)?;
    let children: Vec<&str> = tree.children(id).map(|(_, n)| n.name.as_str()).collect();
    if !children.is_empty() {
        return Err(runtime(format!(
            "class '{name}' is the parent of {}: delete or move them first",
            children.join(", ")
        )));
    }
    let configs = attachment.classes()?;
    let mut shapes = ShapeTable::read(attachment)?;
    let before = ShapeTable {
        slots: shapes.slots.clone(),
    };
    let classes = ranked(&all, &tree, &configs)?;
    let Remaining {
        wanted,
        deleted_keys,
        shapes_in_use,
    } = remaining_without(&classes, id, &mut shapes)?;
    let mut rules = attachment.rules()?;
    let rewritten = deleted_keys
        .iter()
        .try_for_each(|key| match wanted.get(key) {
            Some(next) => Ok(rules.insert(key, next, 0)?),
            None => match rules.remove(key) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(anyhow::Error::from(e)),
            },
        });
    // At once (and after a failure too): the class's cached verdicts would keep its
    // packets unclassified until the end of the delete, or for good if a later step
    // failed; the search finds the next-best class.
    attachment.rules_changed()?;
    rewritten?;
    let mut meta_map = attachment.meta()?;
    let name = meta_map.get(&id, 0)?.name;
    meta_map.set(id, ClassMeta::default(), 0)?;
    match attachment.class_index()?.remove(&name) {
        Ok(()) | Err(MapError::KeyNotFound) => {}
        Err(e) => return Err(e.into()),
    }
    let mut configs = configs;
    let config = configs.get(&id, 0)?;
    let in_htb = config.action == Action::Shape as u8 && config.action_arg != 0;
    configs.set(id, ClassConfig::default(), 0)?;
    if config.global != 0 {
        attachment
            .shares()?
            .set(id, shaper_common::GlobalShare::default(), 0)?;
    }
    if in_htb {
        release_htb(attachment, &tree, id)?;
    }
    // Free shapes no class uses any more.
    for (index, slot) in shapes.slots.iter_mut().enumerate() {
        if !shapes_in_use[index] {
            *slot = Shape::default();
        }
    }
    set_shape_count(attachment, shapes.count())?;
    write_shapes(attachment, &shapes, &before)?;
    attachment.rules_changed()?;
    if config.action == Action::Shape as u8 {
        super::shape_classes_changed(attachment);
    }
    Ok(())
}

/// A deleted shape class's HTB classes go, and its parent gives their guarantee back to
/// its other leaves (unless the parent's queue went with a deleted ifb).
fn release_htb(attachment: &Attachment, tree: &TreeView, id: u32) -> Result<()> {
    let queue_dev = attachment.location.queue_dev();
    qdisc::delete_class(&queue_dev, id)?;
    let parent = tree.classes.get(&id).and_then(|node| node.parent);
    if let Some(parent) = parent.filter(|&parent| qdisc::has_class(&queue_dev, parent)) {
        let tree = TreeView::read(attachment, &attachment.class_list()?)?;
        refresh_htb(attachment, &tree, parent, 0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
        let without_urgent = remaining_without(&classes, 2, &mut shapes).unwrap();
        assert!(!without_urgent.deleted_keys.is_empty());
        for key in &without_urgent.deleted_keys {
            assert_eq!(
                without_urgent.wanted[key].class_id, 0,
                "the older of two ties"
            );
        }
        let without_older = remaining_without(&classes, 0, &mut shapes).unwrap();
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
        let all = remaining_without(&classes, u32::MAX, &mut shapes).unwrap();
        let without_range = remaining_without(&classes, 1, &mut shapes).unwrap();
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
