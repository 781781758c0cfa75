//! The egress splitter: forwarded GSO/GRO aggregates (GRO on the way in, a VM's or pod's
//! TSO) reach an egress shape class whole, up to 64 KiB at once, and a class that can
//! only pass or drop them whole queues 44 segments at a time and costs a sender 44 per
//! drop: one BBR flow through a router's 10 Mbit/s class got 0.84-0.91 of the rate, BBR
//! beside a flood 0.40-0.44 (CAKE splits them itself below 1 Gbit/s).
//!
//! While an egress attachment has a shape class below [`SPLIT_BELOW_BITS_PER_SEC`], the
//! program marks each forwarded aggregate of a shape class and hands it on to a second
//! filter in the clsact hook, the splitter (`program_names::SPLITTER`), whose mirred
//! action redirects it to the splitter's ifb (`gso_max_segs` 1): the ifb cuts it into
//! wire-size segments and sends them back out of the interface, where the program judges
//! each one. mirred, not `bpf_redirect`: an ifb hands a packet back to the device in
//! `skb_iif`, which mirred sets and a BPF redirect leaves at the device the packet came
//! in on, and ifbs before Linux 6.4 drop what a BPF redirect hands them. Everything else
//! (local traffic, whose aggregates `aggregates` caps where they are made; policed
//! classes; single frames) never crosses it.
//!
//! Best effort, like the aggregate cap: a class works without it (unsplit), so a kernel
//! without ifb or mirred is logged, not refused.

use super::{program::load_program, Attachment, Direction, Location, SPLITTER_PIN};
use crate::{error::runtime, qdisc};
use anyhow::Result;
use aya::Ebpf;
use shaper_common::{program_names, ATTACH_MODE_TCX, SPLIT_EGRESS};
use std::path::Path;

/// Shape classes at or above this rate are left unsplit by CAKE; below it a 64 KiB
/// aggregate takes over half a millisecond to drain.
pub(crate) const SPLIT_BELOW_BITS_PER_SEC: u64 = 1_000_000_000;

/// Loads the splitter from `ebpf` and pins it in `dir` (`SPLITTER_PIN`), for an egress
/// attachment of a device with a link-layer header (an ifb needs one); nothing otherwise.
pub(crate) fn pin_program(
    ebpf: &mut Ebpf,
    location: &Location,
    link_header_len: u32,
    dir: &Path,
) -> Result<()> {
    if location.direction == Direction::Egress && link_header_len != 0 {
        load_program(ebpf, program_names::SPLITTER)?.pin(dir.join(SPLITTER_PIN))?;
    }
    Ok(())
}

/// Whether the splitter of this egress attachment is on (pointed at an ifb).
pub(crate) fn is_on(attachment: &Attachment) -> Result<bool> {
    Ok(attachment.split_to()?.get(&0, 0)? & SPLIT_EGRESS != 0)
}

/// After a shape class changed on an egress attachment: the splitter is on while a shape
/// class drains below [`SPLIT_BELOW_BITS_PER_SEC`] (`slowest`: the slowest one's rate),
/// off otherwise. Puts back what is missing (a device or ifb made again).
pub(crate) fn refresh(attachment: &Attachment, slowest: Option<u64>) -> Result<()> {
    let refreshed = turn_on_or_off(attachment, slowest);
    if refreshed.is_err() {
        // Unsplit rather than sent to a splitter that is not all there (mirred drops
        // what it cannot hand to its ifb).
        remove(attachment);
    }
    refreshed
}

fn turn_on_or_off(attachment: &Attachment, slowest: Option<u64>) -> Result<()> {
    let location = &attachment.location;
    // SHAPER_EGRESS_SPLIT=off: for A/B measurements (the bench's unsplit rows).
    let wanted = slowest.is_some_and(|rate| rate < SPLIT_BELOW_BITS_PER_SEC)
        && std::env::var("SHAPER_EGRESS_SPLIT").as_deref() != Ok("off");
    if !wanted {
        if is_on(attachment)? || qdisc::link(&qdisc::splitter_ifb_name(&location.dev)).is_some() {
            remove(attachment);
        }
        return Ok(());
    }
    let pin = location.dir().join(SPLITTER_PIN);
    if !pin.exists() {
        return Err(runtime(format!(
            "{}: attached by a shaper without the aggregate splitter; `shaper upgrade` \
             gives it one",
            location.describe()
        )));
    }
    let pointed = attachment.split_to()?.get(&0, 0)?;
    let ifb = qdisc::ensure_splitter_ifb(&location.dev)?;
    if pointed == ifb | SPLIT_EGRESS && qdisc::has_splitter_filter(&location.dev) {
        return Ok(());
    }
    if qdisc::set_splitter_filter(&location.dev, &pin)? {
        // A TCX attachment has no clsact qdisc of its own: its `created_clsact` says the
        // splitter made one, which goes with it.
        let mut globals = attachment.globals()?;
        if globals.attach_mode == ATTACH_MODE_TCX {
            globals.created_clsact = 1;
            attachment.set_globals(globals)?;
        }
    }
    attachment.split_to()?.set(0, ifb | SPLIT_EGRESS, 0)?;
    Ok(())
}

/// Turns an egress attachment's splitter off: nothing is marked for it any more, then its
/// filter, its ifb and a clsact qdisc it made go.
pub(crate) fn remove(attachment: &Attachment) {
    let location = &attachment.location;
    if location.direction != Direction::Egress {
        return;
    }
    if let Ok(mut split_to) = attachment.split_to() {
        let _ = split_to.set(0, 0, 0);
    }
    let made_clsact = attachment
        .globals()
        .ok()
        .filter(|globals| globals.attach_mode == ATTACH_MODE_TCX && globals.created_clsact != 0);
    let removed = qdisc::remove_splitter_filter(&location.dev, made_clsact.is_some());
    if let (Some(mut globals), true) = (made_clsact, removed) {
        globals.created_clsact = 0;
        let _ = attachment.set_globals(globals);
    }
    qdisc::remove_splitter_ifb(&location.dev);
}
