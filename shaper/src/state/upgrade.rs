//! `shaper upgrade`: this shaper's program swapped in for a live attachment's, under
//! traffic, with pins of an older state layout brought to this one (one step per layout
//! change, see `shaper_common::LAYOUT_VERSION`).

use super::{
    loader::{load_object, load_object_with_flow_table},
    program::load_program,
    *,
};
use crate::error::{one_line, runtime};
use anyhow::Result;
use aya::{
    maps::{Array, MapData},
    programs::{
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcHandle},
        SchedClassifier,
    },
};
use shaper_common::{map_names, program_names, LAYOUT_VERSION};
use std::fs;

/// What `upgrade` did to one attachment.
pub struct Upgraded {
    /// The layout of the pins before (0: from before layouts were stamped).
    pub from_layout: u32,
    pub old_program_id: u32,
    /// The program now hooked; the old id when it already ran this build.
    pub new_program_id: u32,
}

impl Upgraded {
    pub fn changed(&self) -> bool {
        self.new_program_id != self.old_program_id || self.from_layout != LAYOUT_VERSION
    }
}

/// Replaces the program of a live attachment with this shaper's, under traffic: the new
/// program is loaded against the pinned maps (classes, buckets and counters carry on),
/// pins of an older layout are migrated, and the program is swapped in atomically (the
/// TCX link's program is updated; the clsact filter is replaced at its priority and
/// handle), so every packet meets one program or the other. Run inside the attachment's
/// network namespace. With `reload`, a program of the very build attached is loaded and
/// swapped in too.
pub fn upgrade(location: &Location, reload: bool) -> Result<Upgraded> {
    let dir = location.dir();
    let attachment = Attachment::open_any_layout(location)?;
    let from_layout = match attachment.layout() {
        Some(found) if found == LAYOUT_VERSION || migration_from(found).is_some() => found,
        found => return Err(runtime(super::attachment::layout_mismatch(location, found))),
    };
    if let Some(migrate) = migration_from(from_layout) {
        migrate(&attachment)?;
    }
    let status = attachment.status()?;
    require_live(location, &status, "before upgrading")?;
    let globals = attachment.globals()?;
    let old_program_id = status.program_id;
    if !reload
        && from_layout == LAYOUT_VERSION
        && super::build::pinned_by_this_build(location, old_program_id)
    {
        return Ok(Upgraded {
            from_layout,
            old_program_id,
            new_program_id: old_program_id,
        });
    }
    let old_tag = aya::programs::ProgramInfo::from_pin(dir.join(PROG_PIN))?.tag();
    let mut ebpf = load_object(&dir, status.flow_table_size)?;
    let name = program_name(&globals);
    let program = load_program(&mut ebpf, name)?;
    let info = program.info()?;
    let mut new_program_id = old_program_id;
    if reload || info.tag() != old_tag {
        swap_program(program, location, status.mode, old_program_id)?;
        new_program_id = info.id();
        // Another build may classify a tuple differently: its verdicts are found anew.
        attachment.rules_changed()?;
        // Pinned under a new name, then renamed over the old pin: `prog` always names a
        // program, and the old one is freed with its last reference.
        let staged = dir.join(format!("{PROG_PIN}-new"));
        let _ = fs::remove_file(&staged);
        program.pin(&staged)?;
        fs::rename(&staged, dir.join(PROG_PIN))
            .with_context(|| format!("cannot re-pin the program in {}", dir.display()))?;
    }
    // The splitter's filter runs the program it was made with; the pin is what the next
    // one is made from (an attachment from before the splitter gains it here).
    let staged = dir.join("splitter-new");
    let _ = fs::remove_dir_all(&staged);
    fs::create_dir(&staged).with_context(|| format!("cannot create {}", staged.display()))?;
    let pinned =
        super::splitter::pin_program(&mut ebpf, location, globals.link_header_len, &staged)
            .and_then(|()| match staged.join(SPLITTER_PIN).exists() {
                true => Ok(fs::rename(
                    staged.join(SPLITTER_PIN),
                    dir.join(SPLITTER_PIN),
                )?),
                false => Ok(()),
            });
    let _ = fs::remove_dir(&staged);
    pinned.with_context(|| format!("cannot pin the splitter in {}", dir.display()))?;
    let mut layout: Array<_, u32> = Array::try_from(
        ebpf.map_mut(map_names::LAYOUT)
            .context("LAYOUT map missing")?,
    )?;
    layout.set(0, LAYOUT_VERSION, 0)?;
    super::build::record(location, new_program_id);
    Ok(Upgraded {
        from_layout,
        old_program_id,
        new_program_id,
    })
}

/// Gives a live attachment a flow table of `size` entries under traffic: a new table is
/// made beside the old one and filled from it (every key's bucket as it stands), a
/// program using it is loaded against the other pinned maps and swapped in atomically,
/// as `upgrade` does, and the new table takes the old one's pin. Classes, counters and
/// buckets carry on and no packet meets an unattached hook. What the old program charged
/// between the copy and the swap (a few milliseconds) is not carried over. A smaller
/// table keeps the keys it has room for (the LRU drops the rest, as it would). Returns
/// the keys carried over. Run inside the attachment's network namespace.
pub fn resize_flow_table(location: &Location, size: u32) -> Result<usize> {
    use aya::maps::HashMap as BpfHashMap;
    use shaper_common::{Bucket, BucketKey};
    let dir = location.dir();
    let attachment = Attachment::open(location)?;
    let status = attachment.status()?;
    require_live(location, &status, "first")?;
    let staged = dir.join(format!("{}-new", map_names::KEYED_BUCKETS));
    // Shape classes' flow queues are made anew at the new size: soft state (sparseness,
    // census stamps, fair-share queues) that each flow's next packets rebuild.
    let staged_queues = dir.join(format!("{}-new", map_names::FLOW_QUEUES));
    let staged_program = dir.join(format!("{PROG_PIN}-new"));
    let _ = fs::remove_file(&staged);
    let _ = fs::remove_file(&staged_queues);
    let _ = fs::remove_file(&staged_program);
    let result = (|| -> Result<usize> {
        let pins = [
            (map_names::KEYED_BUCKETS, staged.clone()),
            (map_names::FLOW_QUEUES, staged_queues.clone()),
        ];
        let mut ebpf = load_object_with_flow_table(&dir, size, &pins)?;
        let globals = attachment.globals()?;
        let name = program_name(&globals);
        // Verified first (a fraction of a second): the buckets are copied just before
        // the swap, so what the old program charges meanwhile is not lost.
        load_program(&mut ebpf, name)?;
        let old: BpfHashMap<MapData, BucketKey, Bucket> =
            attachment.map(map_names::KEYED_BUCKETS)?;
        let new_data = MapData::from_pin(&staged)?;
        let mut new: BpfHashMap<MapData, BucketKey, Bucket> =
            BpfHashMap::try_from(aya::maps::Map::LruHashMap(new_data))?;
        let carried = carry_buckets(&old, &mut new);
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .context("the program vanished from the object")?
            .try_into()?;
        // Pinned before the swap: after it only renames are left, which do not fail
        // within one directory of bpffs.
        program.pin(&staged_program)?;
        swap_program(program, location, status.mode, status.program_id)?;
        // What the old program charged while the copy ran: a bucket's later arrival time
        // is the one that has seen more traffic.
        carry_buckets(&old, &mut new);
        // The table first (a reader of the pins finds the table the hooked program uses),
        // then the program, each renamed over its old pin.
        fs::rename(&staged, dir.join(map_names::KEYED_BUCKETS))
            .with_context(|| format!("cannot re-pin the flow table in {}", dir.display()))?;
        fs::rename(&staged_queues, dir.join(map_names::FLOW_QUEUES))
            .with_context(|| format!("cannot re-pin the flow queues in {}", dir.display()))?;
        fs::rename(&staged_program, dir.join(PROG_PIN))
            .with_context(|| format!("cannot re-pin the program in {}", dir.display()))?;
        Ok(carried)
    })();
    // A failure before the swap leaves the old table and program as they were.
    let _ = fs::remove_file(&staged);
    let _ = fs::remove_file(&staged_queues);
    let _ = fs::remove_file(&staged_program);
    result
}

/// Refuses an attachment that is not live: its program must be hooked to be swapped.
fn require_live(location: &Location, status: &AttachmentStatus, when: &str) -> Result<()> {
    match &status.problem {
        Some(problem) => Err(runtime(format!(
            "{} is not live ({problem}): run `shaper attach {}` to repair it {when}",
            location.describe(),
            location.dev
        ))),
        None => Ok(()),
    }
}

/// The program of an attachment's kind: with a link-layer header, or bare IP.
fn program_name(globals: &shaper_common::Globals) -> &'static str {
    if globals.link_header_len == 0 {
        program_names::SHAPER_L3
    } else {
        program_names::SHAPER
    }
}

/// Every bucket of `old` into `new`, keeping the later theoretical arrival time where
/// `new` has the key already (of words in one cost version; a word the new program
/// rewrote in another version is its own); the keys written.
fn carry_buckets(
    old: &aya::maps::HashMap<MapData, shaper_common::BucketKey, shaper_common::Bucket>,
    new: &mut aya::maps::HashMap<MapData, shaper_common::BucketKey, shaper_common::Bucket>,
) -> usize {
    let mut carried = 0;
    for (key, bucket) in old.iter().flatten() {
        let later = |known: u64, old: u64| {
            use shaper_common::bucket::{word_version, TAT_MASK};
            if word_version(known) == word_version(old) && old & TAT_MASK > known & TAT_MASK {
                old
            } else {
                known
            }
        };
        let merged = match new.get(&key, 0) {
            Ok(known) => shaper_common::Bucket {
                tat: later(known.tat, bucket.tat),
                tat2: later(known.tat2, bucket.tat2),
            },
            Err(_) => bucket,
        };
        if new.insert(key, merged, 0).is_ok() {
            carried += 1;
        }
    }
    carried
}

/// Hooks `program` where `old_program_id` runs, in one step.
fn swap_program(
    program: &mut SchedClassifier,
    location: &Location,
    mode: AttachMode,
    old_program_id: u32,
) -> Result<()> {
    let swap_failed = |error: &dyn std::fmt::Display| {
        runtime(format!(
            "cannot swap the new program in on {}: {}",
            location.describe(),
            one_line(&error.to_string())
        ))
    };
    match mode {
        AttachMode::Tcx => {
            // bpf_link_update on the pinned TCX link: the link stays, its program changes.
            let pinned =
                PinnedLink::from_pin(location.dir().join(LINK_PIN)).map_err(|e| swap_failed(&e))?;
            let link =
                SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| swap_failed(&e))?;
            let id = program.attach_to_link(link).map_err(|e| swap_failed(&e))?;
            // Dropping our handle closes a descriptor; the pin keeps the link.
            drop(program.take_link(id)?);
        }
        AttachMode::Clsact => {
            let (priority, handle) = crate::qdisc::clsact_filter_of(
                &location.dev,
                location.direction.name(),
                old_program_id,
            )?;
            // The same priority and handle without NLM_F_EXCL: cls_bpf replaces the
            // filter's program in place.
            let link = SchedClassifierLink::attached(
                &location.dev,
                location.direction.tc(),
                priority,
                TcHandle::from(handle),
                None,
            )
            .map_err(|e| swap_failed(&e))?;
            let id = program.attach_to_link(link).map_err(|e| swap_failed(&e))?;
            // The filter lives on in the kernel; dropping our handle must not remove it.
            std::mem::forget(program.take_link(id)?);
        }
    }
    Ok(())
}

/// Brings pins of `layout` to this shaper's, if it knows how: every step from that layout
/// on, in order (each layout change, see `LAYOUT_VERSION`, adds its step here).
fn migration_from(layout: u32) -> Option<fn(&Attachment) -> Result<()>> {
    match layout {
        0 | 1 => Some(migrate_from_unversioned),
        // Layout 3 only added KEY_STATS, layout 4 SHARES (global classes, in a byte that
        // was padding before), and layout 5 VERDICT_CACHE (with the rules generation in a
        // spare word of GLOBALS, 0 in older pins, which no zeroed cache slot matches),
        // layout 6 CODEL_FLOWS (an empty census counts one flow until an interval has
        // passed): loading the object creates them (counting from the upgrade on). Layout
        // 7 only gave ingress shape classes a meaning (no older pins hold one), layout 8
        // added SPLIT_TO (created empty: nothing split until `attach --split-aggregates`).
        // Layout 9: `migrate_to_fair`. Layout 10 gave an egress attachment's SPLIT_TO a
        // meaning (the egress splitter, `SPLIT_EGRESS`): 0 in older pins, off until the
        // next shape class change turns it on. The version keeps an older shaper, whose
        // program would redirect every packet to that value, from loading on such pins.
        2..=8 => Some(migrate_to_fair),
        9 => Some(|_| Ok(())),
        _ => None,
    }
}

/// Layouts 0 and 1 to this one: trees (layout 2), then flow isolation (layout 9).
fn migrate_from_unversioned(attachment: &Attachment) -> Result<()> {
    migrate_to_trees(attachment)?;
    migrate_to_fair(attachment)
}

/// Layout 8 to 9: flow isolation. `CODEL_FLOWS`' values grew (the fair share's census),
/// so its pin is removed for loading the object to make it anew (the old program keeps
/// its own until the swap; the census restarts, counting one flow for an interval);
/// `FLOW_QUEUES`, `SHAPE_STATS` and `FLOW_SCRATCH` are new. The fair mode sits in fields
/// that were padding: zero, `fair none`, so upgraded classes keep the one queue they had
/// (`class change --fair flow`, or an `apply` of a file that leaves `fair` out, makes
/// them fair).
fn migrate_to_fair(attachment: &Attachment) -> Result<()> {
    let census = attachment.dir().join(map_names::CODEL_FLOWS);
    if census.exists() {
        fs::remove_file(&census)
            .with_context(|| format!("cannot remove {} for its new layout", census.display()))?;
    }
    Ok(())
}

/// Layouts 0 and 1 to 2: the sizes checked, then every classifier entry re-ranked with
/// the depth bits (all top level), so children added later rank as they should. The
/// class an entry points to is unchanged, so packets meet the same classes throughout.
fn migrate_to_trees(attachment: &Attachment) -> Result<()> {
    migrate_unstamped(attachment)?;
    let metas = attachment.meta()?;
    let mut rules = attachment.rules()?;
    let entries: Vec<_> = rules.iter().collect::<Result<_, _>>()?;
    for (key, mut value) in entries {
        let meta = metas.get(&value.class_id, 0)?;
        let ranked = shaper_common::rank(meta.prio, 0, meta.seq);
        if value.rank != ranked {
            value.rank = ranked;
            rules.insert(key, value, 0)?;
        }
    }
    attachment.rules_changed()
}

/// Layout 0 is the last unstamped one: the same maps as layouts 1 and 2 but `LAYOUT` (and
/// `KEY_STATS`, which layout 3 added), which loading the object creates; layout 1 pins
/// have no parents set. Older unstamped pins differ in some map's sizes: they are
/// refused, not misread.
fn migrate_unstamped(attachment: &Attachment) -> Result<()> {
    let object = aya_obj::Object::parse(crate::EBPF_OBJECT)
        .map_err(|e| runtime(format!("cannot read the eBPF object: {e}")))?;
    for name in map_names::ALL {
        let path = attachment.dir().join(name);
        if !path.exists() {
            continue;
        }
        let (Some(declared), Ok(info)) = (
            object.maps.get(name),
            MapData::from_pin(&path).and_then(|data| data.info()),
        ) else {
            continue;
        };
        if (info.key_size(), info.value_size()) != (declared.key_size(), declared.value_size()) {
            return Err(runtime(format!(
                "{}: map {name} has the sizes of an older, unversioned layout (key {}, value {} \
                 bytes; this shaper's are {} and {}): keep its classes with that shaper's \
                 `shaper export`, then detach and `shaper apply` the export",
                attachment.location.describe(),
                info.key_size(),
                info.value_size(),
                declared.key_size(),
                declared.value_size()
            )));
        }
    }
    Ok(())
}
