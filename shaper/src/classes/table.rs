//! The class table's classifier entries, and deleting a class.
//!
//! Write order keeps the packet path consistent at every instant: a deleted class's
//! entries are gone (or re-pointed at the next-best class) before its config is cleared.

use super::{
    shapes::*,
    tree::{ranked, refresh_htb, TreeView},
};
use crate::{
    error::runtime,
    qdisc,
    state::{decode_name, Attachment},
};
use anyhow::Result;
use aya::maps::MapError;
use shaper_common::{Action, ClassConfig, ClassMeta, RuleKey, RuleValue, Shape, MAX_RULES};

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
