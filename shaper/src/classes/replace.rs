//! Replacing a class whose rule, scope, priority, meter or global setting changes (what
//! no change in place can do), all or nothing.

use super::*;
use crate::{
    error::runtime,
    state::{encode_name, Attachment},
};

/// Replaces class `wanted.name` by `wanted`. A top-level class without children is
/// replaced with no moment unclassified: the new class is added beside it under a free
/// name (the old one, older, keeps ranking first for every key they share), takes the
/// old one's keys as that is deleted, then takes its name. Any other class, and one for
/// which there is no room beside (a 33rd rule shape, a full table), is deleted and added
/// again. Either way a failure puts the old class back as it was (its counters start
/// afresh, as the replacement's would).
pub fn replace(attachment: &Attachment, wanted: &ClassSpec) -> Result<()> {
    let (id, current) = read_class(attachment, &wanted.name)?
        .ok_or_else(|| super::table::not_found(attachment, &wanted.name))?;
    let has_children = attachment
        .classes()?
        .iter()
        .filter_map(|entry| entry.ok())
        .any(|config| config.parent as u32 == id + 1);
    if current.tree.is_some() || wanted.tree.is_some() || has_children {
        return delete_then_add(attachment, &current, wanted);
    }
    let mut beside = wanted.clone();
    beside.name = free_name(attachment, &wanted.name)?;
    let Ok(new_id) = add(attachment, &beside) else {
        return delete_then_add(attachment, &current, wanted);
    };
    if let Err(error) = delete(attachment, &wanted.name) {
        let _ = delete(attachment, &beside.name);
        return Err(error);
    }
    rename(attachment, new_id, &beside.name, &wanted.name)
}

/// The old class goes, the new one comes; if the new one cannot, the old one comes back.
fn delete_then_add(attachment: &Attachment, current: &ClassSpec, wanted: &ClassSpec) -> Result<()> {
    delete(attachment, &current.name)?;
    if let Err(error) = add(attachment, wanted) {
        if let Err(again) = add(attachment, current) {
            return Err(error.context(format!(
                "and class '{}' could not be put back: {again:#}",
                current.name
            )));
        }
        return Err(error);
    }
    Ok(())
}

/// A name for the replacement while both classes exist: `NAME:rN` (shortened to fit),
/// the first one no class has.
fn free_name(attachment: &Attachment, name: &str) -> Result<String> {
    let stem: String = name.chars().take(40).collect();
    for n in 0..100 {
        let candidate = format!("{stem}:r{n}");
        if attachment.find_class(&candidate)?.is_none() {
            return Ok(candidate);
        }
    }
    Err(runtime(format!(
        "no free name to replace class '{name}' beside itself"
    )))
}

/// Class `id` takes the name `to` (which no class has now) instead of `from`.
fn rename(attachment: &Attachment, id: u32, from: &str, to: &str) -> Result<()> {
    let mut metas = attachment.meta()?;
    let mut meta = metas.get(&id, 0)?;
    let (old, new) = (encode_name(from)?, encode_name(to)?);
    let mut index = attachment.class_index()?;
    index.insert(new, id, 0)?;
    meta.name = new;
    metas.set(id, meta, 0)?;
    let _ = index.remove(&old);
    Ok(())
}
