//! Loading the object with its maps pinned, attaching (TCX or clsact, all or nothing),
//! re-attaching, detaching.

use super::{pins::remove_empty_parents, *};

use crate::error::{one_line, runtime};
use anyhow::Result;
use aya::{
    maps::Array,
    programs::{
        links::FdLink,
        tc::{NlOptions, TcAttachOptions},
        LinkOrder, SchedClassifier,
    },
    Ebpf, EbpfLoader,
};
use shaper_common::{
    map_names, program_names, Globals, ATTACH_MODE_CLSACT, ATTACH_MODE_TCX, LAYOUT_VERSION,
};
use std::{
    fs,
    path::{Path, PathBuf},
};

/// Loads the eBPF object with its maps pinned in `dir`: maps already pinned there are
/// reused, missing ones are created and pinned.
pub fn load_object(dir: &Path, flow_table_size: u32) -> Result<Ebpf> {
    load_object_bytes(dir, flow_table_size, crate::EBPF_OBJECT)
}

/// [`load_object`] for another build of the object with the same maps (benchmarks
/// compare two builds on one attachment's state).
pub fn load_object_bytes(dir: &Path, flow_table_size: u32, object: &[u8]) -> Result<Ebpf> {
    load_with_pins(object, flow_table_size, |name| dir.join(name))
}

/// [`load_object`] with the flow table and the shape classes' flow queues at the
/// `staged` pins instead of their places in `dir` (new tables of `flow_table_size` entries
/// are made there): a resize under traffic.
pub fn load_object_with_flow_table(
    dir: &Path,
    flow_table_size: u32,
    staged: &[(&str, PathBuf)],
) -> Result<Ebpf> {
    load_with_pins(crate::EBPF_OBJECT, flow_table_size, |name| {
        staged
            .iter()
            .find(|(staged_name, _)| *staged_name == name)
            .map_or_else(|| dir.join(name), |(_, pin)| pin.clone())
    })
}

fn load_with_pins(
    object: &[u8],
    flow_table_size: u32,
    pin_of: impl Fn(&str) -> PathBuf,
) -> Result<Ebpf> {
    if object.is_empty() {
        return Err(runtime(
            "this shaper was built without its eBPF object (AYA_BUILD_SKIP): build it again without that variable",
        ));
    }
    super::features::require_kernel_features()?;
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(map_names::KEYED_BUCKETS, flow_table_size);
    loader.map_max_entries(map_names::FLOW_QUEUES, flow_table_size);
    let paths: Vec<(&str, PathBuf)> = map_names::ALL.iter().map(|n| (*n, pin_of(n))).collect();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader.load(object).map_err(|e| {
        runtime(format!(
            "cannot load the eBPF object: {}",
            one_line(&e.to_string())
        ))
    })
}

/// Attaches a fresh program at `location` (which must not exist yet), all or nothing.
/// Returns the mode actually used.
pub fn attach_fresh(
    location: &Location,
    forced_mode: Option<AttachMode>,
    flow_table_size: u32,
) -> Result<AttachMode> {
    // A device whose frames the program cannot parse is refused before anything is made.
    let link_header_len = crate::netns::link_header_len(&location.dev)?;
    let final_dir = location.dir();
    let staging = final_dir.with_file_name(format!("{}-staging", location.direction.name()));
    // A crash may have left a staging directory: it never holds a live attachment.
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    let mut detach_on_failure = None;
    let result = (|| -> Result<AttachMode> {
        let mut ebpf = load_object(&staging, flow_table_size)?;
        let name = if link_header_len == 0 {
            program_names::SHAPER_L3
        } else {
            program_names::SHAPER
        };
        super::splitter::pin_program(&mut ebpf, location, link_header_len, &staging)?;
        let program = load_program(&mut ebpf, name)?;
        program.pin(staging.join(PROG_PIN))?;
        let program_id = program.info()?.id();
        log::debug!(
            "{}: program loaded ({name}, id {program_id})",
            location.describe()
        );
        let (mode, created_clsact) = attach_program(
            program,
            location,
            forced_mode,
            &staging,
            &mut detach_on_failure,
        )?;
        let ifindex = crate::netns::ifindex(&location.dev)?;
        let mut globals: Array<_, Globals> = Array::try_from(
            ebpf.map_mut(map_names::GLOBALS)
                .context("GLOBALS map missing")?,
        )?;
        globals.set(
            0,
            Globals {
                ifindex,
                attach_mode: match mode {
                    AttachMode::Tcx => ATTACH_MODE_TCX,
                    AttachMode::Clsact => ATTACH_MODE_CLSACT,
                },
                created_clsact: u32::from(created_clsact),
                next_seq: 1,
                link_header_len,
                ..Globals::default()
            },
            0,
        )?;
        let mut layout: Array<_, u32> = Array::try_from(
            ebpf.map_mut(map_names::LAYOUT)
                .context("LAYOUT map missing")?,
        )?;
        layout.set(0, LAYOUT_VERSION, 0)?;
        fs::rename(&staging, &final_dir)
            .with_context(|| format!("cannot move pins into {}", final_dir.display()))?;
        super::build::record(location, program_id);
        Ok(mode)
    })();
    if result.is_err() {
        if let Some((dev, direction, created)) = detach_on_failure {
            detach_clsact_filter(&dev, direction, created);
        }
        let _ = fs::remove_dir_all(&staging);
        remove_empty_parents(&final_dir);
    }
    result
}

fn attach_program(
    program: &mut SchedClassifier,
    location: &Location,
    forced_mode: Option<AttachMode>,
    pin_dir: &Path,
    detach_on_failure: &mut Option<(String, Direction, bool)>,
) -> Result<(AttachMode, bool)> {
    let attach_type = location.direction.tc();
    if forced_mode != Some(AttachMode::Clsact) {
        match program.attach_with_options(
            &location.dev,
            attach_type,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        ) {
            Ok(link_id) => {
                let link: FdLink = program.take_link(link_id)?.try_into()?;
                link.pin(pin_dir.join(LINK_PIN))
                    .map_err(|e| runtime(format!("cannot pin the TCX link: {e}")))?;
                return Ok((AttachMode::Tcx, false));
            }
            Err(error) if forced_mode == Some(AttachMode::Tcx) => {
                return Err(runtime(format!(
                    "TCX attach failed on {} (kernel older than 6.6?): {}",
                    location.dev,
                    one_line(&format!("{error:#}"))
                )));
            }
            Err(_) => {} // Fall back to clsact below.
        }
    }
    let created_clsact = aya::programs::tc::qdisc_add_clsact(&location.dev).is_ok();
    *detach_on_failure = Some((location.dev.clone(), location.direction, created_clsact));
    let link_id = program
        .attach_with_options(
            &location.dev,
            attach_type,
            TcAttachOptions::Netlink(NlOptions::default()),
        )
        .map_err(|e| {
            runtime(format!(
                "clsact attach failed on {}: {}",
                location.dev,
                one_line(&format!("{e:#}"))
            ))
        })?;
    // The netlink filter lives on in the kernel; dropping our handle must not remove it.
    std::mem::forget(program.take_link(link_id)?);
    Ok((AttachMode::Clsact, created_clsact))
}

/// Whether an attachment has a filter in the device's clsact qdisc: its own (clsact mode)
/// or its egress splitter's (any mode).
fn uses_clsact(globals: &Globals, attachment: &Attachment) -> bool {
    globals.attach_mode == ATTACH_MODE_CLSACT || super::splitter::is_on(attachment).unwrap_or(true)
}

/// Removes shaper's clsact filter (found by program name) and, when shaper created the
/// clsact qdisc, the qdisc too.
fn detach_clsact_filter(dev: &str, direction: Direction, remove_qdisc: bool) {
    for name in [program_names::SHAPER, program_names::SHAPER_L3] {
        let _ = aya::programs::tc::qdisc_detach_program(dev, direction.tc(), name);
    }
    if remove_qdisc {
        // aya has no qdisc deletion; iproute2's tc is on every machine that has TC.
        let _ = std::process::Command::new("tc")
            .args(["qdisc", "del", "dev", dev, "clsact"])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Hooks the pinned program of an existing attachment to its interface again (the
/// interface was re-created: a VM's tap, a container's veth), keeping every class, bucket
/// and counter.
pub fn reattach(location: &Location) -> Result<AttachMode> {
    let dir = location.dir();
    let attachment = Attachment::open(location)?;
    let mut globals = attachment.globals()?;
    let mode = AttachMode::from_globals(globals.attach_mode);
    // A re-created interface of the same name may be of another kind, which the pinned
    // program cannot parse.
    let link_header_len = crate::netns::link_header_len(&location.dev)?;
    if (link_header_len == 0) != (globals.link_header_len == 0) {
        return Err(runtime(format!(
            "{} was re-created as another kind of device (link-layer header {} bytes, was {}); \
             detach and attach it again",
            location.describe(),
            link_header_len,
            globals.link_header_len
        )));
    }
    let mut program = SchedClassifier::from_pin(dir.join(PROG_PIN))
        .map_err(|e| runtime(format!("cannot open the pinned program: {e}")))?;
    // The old link (if any) points at a vanished interface: drop it first. In clsact
    // mode, shaper's own filters still in the hook go first too (by the program's name,
    // over netlink): the program is hooked once, never beside an older copy of itself.
    let _ = fs::remove_file(dir.join(LINK_PIN));
    if mode == AttachMode::Clsact {
        detach_clsact_filter(&location.dev, location.direction, false);
    }
    let mut created = None;
    let (mode, created_clsact) =
        attach_program(&mut program, location, Some(mode), &dir, &mut created)?;
    globals.ifindex = crate::netns::ifindex(&location.dev)?;
    // A clsact qdisc shaper made and still finds there stays shaper's to remove.
    globals.created_clsact = u32::from(globals.created_clsact != 0 || created_clsact);
    attachment.set_globals(globals)?;
    Ok(mode)
}

/// Moves a live attachment to attach mode `mode` under traffic: its pinned program is
/// hooked the new way first, then unhooked the old way, so every packet meets it (one
/// that passes in the moment both hooks hold it is charged twice). Classes, buckets and
/// counters are the pinned maps': kept. A clsact qdisc shaper made for the old hook is
/// removed when the other direction does not use it.
pub fn switch_mode(location: &Location, mode: AttachMode) -> Result<()> {
    let dir = location.dir();
    let attachment = Attachment::open(location)?;
    let mut globals = attachment.globals()?;
    let old = AttachMode::from_globals(globals.attach_mode);
    if old == mode {
        return Ok(());
    }
    let mut program = SchedClassifier::from_pin(dir.join(PROG_PIN))
        .map_err(|e| runtime(format!("cannot open the pinned program: {e}")))?;
    // The old TCX link's pin moves aside while the new hook is made, and back if that fails.
    let old_link = dir.join(format!("{LINK_PIN}-old"));
    if old == AttachMode::Tcx {
        fs::rename(dir.join(LINK_PIN), &old_link)?;
    }
    let mut created = None;
    let hooked = attach_program(&mut program, location, Some(mode), &dir, &mut created);
    let (_, created_clsact) = match hooked {
        Ok(hooked) => hooked,
        Err(error) => {
            if old == AttachMode::Tcx {
                let _ = fs::rename(&old_link, dir.join(LINK_PIN));
            }
            // A clsact qdisc made for the new hook goes with it.
            if let Some((dev, direction, made)) = created {
                detach_clsact_filter(&dev, direction, made);
            }
            return Err(error);
        }
    };
    // From TCX: a qdisc the egress splitter made is still shaper's.
    let mut keeps_qdisc = globals.created_clsact != 0;
    match old {
        // Unpinning the link drops its last reference: the kernel unhooks the program.
        AttachMode::Tcx => fs::remove_file(&old_link)?,
        AttachMode::Clsact => {
            let other = Location {
                direction: match location.direction {
                    Direction::Egress => Direction::Ingress,
                    Direction::Ingress => Direction::Egress,
                },
                ..location.clone()
            };
            // The other direction's pins, unreadable, count as using the qdisc (kept).
            let other_globals = other
                .dir()
                .exists()
                .then(|| Attachment::open(&other).and_then(|a| Ok((a.globals()?, a))));
            // An egress splitter's filter lives in the qdisc too, whatever the mode.
            let other_uses_clsact = match &other_globals {
                None => false,
                Some(Ok((g, a))) => uses_clsact(g, a),
                Some(Err(_)) => true,
            };
            let ours = globals.created_clsact != 0;
            let own_splitter = super::splitter::is_on(&attachment).unwrap_or(true);
            detach_clsact_filter(
                &location.dev,
                location.direction,
                ours && !other_uses_clsact && !own_splitter,
            );
            // A qdisc shaper made stays shaper's to remove, with the direction still on it
            // (this one, while its splitter's filter is in it).
            keeps_qdisc = ours && own_splitter;
            if let (true, Some(Ok((mut g, other_attachment)))) = (ours, other_globals) {
                if uses_clsact(&g, &other_attachment) {
                    g.created_clsact = 1;
                    other_attachment.set_globals(g)?;
                }
            }
        }
    }
    globals.attach_mode = match mode {
        AttachMode::Tcx => ATTACH_MODE_TCX,
        AttachMode::Clsact => ATTACH_MODE_CLSACT,
    };
    globals.created_clsact = u32::from(created_clsact || keeps_qdisc);
    attachment.set_globals(globals)
}

/// Removes the pins of an attachment whose network namespace no longer exists: its
/// interfaces, TCX links, filters and qdiscs went with the namespace.
pub fn forget(location: &Location) -> Result<()> {
    let dir = location.dir();
    super::aggregates::forget(location);
    fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    remove_empty_parents(&dir);
    Ok(())
}

/// Detaches the program at `location` and removes every pin it owns, whatever shaper
/// version attached it.
pub fn detach(location: &Location) -> Result<()> {
    let dir = location.dir();
    let attachment = Attachment::open_any_layout(location)?;
    // GLOBALS of another layout may not read as ours: then the pins tell the mode, and a
    // clsact qdisc is left in place (whether shaper created it is not known).
    let (mode, created_clsact) = match attachment.globals() {
        Ok(globals) if [ATTACH_MODE_TCX, ATTACH_MODE_CLSACT].contains(&globals.attach_mode) => (
            AttachMode::from_globals(globals.attach_mode),
            globals.created_clsact != 0,
        ),
        _ => (attachment.mode_from_pins(), false),
    };
    // Nothing goes to the ifb before it is deleted (the hook lets go a little later).
    if let (Direction::Ingress, Ok(mut split_to)) = (location.direction, attachment.split_to()) {
        let _ = split_to.set(0, 0, 0);
    }
    super::splitter::remove(&attachment);
    super::build::forget(location);
    match mode {
        // Unpinning the link drops its last reference: the kernel detaches the program.
        AttachMode::Tcx => {
            let _ = fs::remove_file(dir.join(LINK_PIN));
        }
        AttachMode::Clsact => {
            let mut remove_qdisc = created_clsact;
            // Both directions share one clsact qdisc: keep it while the other uses it.
            let other = Location {
                direction: match location.direction {
                    Direction::Egress => Direction::Ingress,
                    Direction::Ingress => Direction::Egress,
                },
                ..location.clone()
            };
            if remove_qdisc && other.dir().exists() {
                match Attachment::open(&other) {
                    Ok(other_attachment) => {
                        let mut other_globals = other_attachment.globals()?;
                        if uses_clsact(&other_globals, &other_attachment) {
                            other_globals.created_clsact = 1;
                            other_attachment.set_globals(other_globals)?;
                            remove_qdisc = false;
                        }
                    }
                    // Another shaper's pins: it may hook the qdisc, so it stays.
                    Err(_) => remove_qdisc = false,
                }
            }
            detach_clsact_filter(&location.dev, location.direction, remove_qdisc);
        }
    }
    if location.direction == Direction::Ingress {
        crate::qdisc::remove_ifb(&location.dev);
    } else {
        crate::qdisc::remove_root(&location.dev);
        let restored = super::aggregates::refresh(location, None);
        restored.unwrap_or_else(|error| log::warn!("{}: {error:#}", location.describe()));
    }
    fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    remove_empty_parents(&dir);
    Ok(())
}
