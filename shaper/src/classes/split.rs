//! `shaper attach DEV --direction ingress --split-aggregates`: forwarded traffic reaches
//! an egress shape class as the GSO/GRO aggregates it arrived in (a pod's TSO sends 64
//! KiB at a time on a µs path; GRO merges a NIC's back-to-back frames), and a class can
//! only pass or drop an aggregate whole. With splitting on, the ingress program hands
//! every packet it lets pass to shaper's ifb of the interface (the one ingress shape
//! classes queue on), whose `gso_max_segs` of 1 cuts aggregates into wire-size segments
//! before it gives them back to the interface past the hook.

use super::ClassSpec;
use crate::{
    error::runtime,
    qdisc,
    state::{Attachment, Direction},
};
use anyhow::Result;

/// Where an ingress attachment's splitting stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Off,
    /// On, through this ifb.
    On(String),
    /// On, but the ifb it points at is gone or was made again (another ifindex): what
    /// the hook sends there is lost until `attach … --split-aggregates` or `apply`.
    Stale(String),
}

/// What splitting on `dev` needs, checked before anything is attached: a kernel whose
/// ifb takes redirected packets, an Ethernet device (an ifb needs a link-layer header)
/// and the ifb's name free or shaper's.
pub fn check_split(dev: &str) -> Result<()> {
    // The device first: no kernel takes a bare IP packet on an ifb.
    if crate::netns::link_header_len(dev)? == 0 {
        return Err(runtime(format!(
            "{dev} carries bare IP packets (no link-layer header): splitting goes through an \
             ifb, which needs one"
        )));
    }
    qdisc::require_ifb_redirect("--split-aggregates")?;
    qdisc::check_ifb_name(dev).map(|_| ())
}

/// Splitting asked of an egress attachment: a usage error.
pub fn split_needs_ingress() -> anyhow::Error {
    crate::error::usage(
        "--split-aggregates splits traffic where it arrives: use it with --direction \
         ingress, on the interfaces forwarded traffic comes in on",
    )
}

/// Turns splitting on or off for an ingress attachment; on makes (or reuses) its ifb.
pub fn set_split(attachment: &Attachment, on: bool) -> Result<()> {
    let location = &attachment.location;
    if location.direction != Direction::Ingress {
        return Err(split_needs_ingress());
    }
    if !on {
        attachment.split_to()?.set(0, 0, 0)?;
        // The ifb goes unless ingress shape classes queue on it; theirs stop being split.
        super::shape_classes_changed(attachment);
        qdisc::ifb_gso_max_segs(&location.dev, None)?;
        return Ok(());
    }
    check_split(&location.dev)?;
    point_at_ifb(attachment)
}

/// Makes the ifb (if missing), lets it split, and points `SPLIT_TO` at it.
fn point_at_ifb(attachment: &Attachment) -> Result<()> {
    let dev = &attachment.location.dev;
    let ifb = qdisc::ensure_ifb(dev)?;
    let pointed = qdisc::ifb_gso_max_segs(dev, Some(1))
        .and_then(|()| Ok(attachment.split_to()?.set(0, ifb, 0)?));
    if pointed.is_err() && attachment.split_to()?.get(&0, 0)? == 0 {
        // An ifb made for nothing goes again (unless shape classes queue on it).
        super::shape_classes_changed(attachment);
    }
    pointed
}

/// After a re-attach, or an ifb made again for an ingress shape class: splitting that is
/// on points at the ifb as it is now (a re-created ifb has another ifindex); one that
/// already does is left alone.
pub fn refresh_split(attachment: &Attachment) -> Result<()> {
    if attachment.location.direction != Direction::Ingress {
        return Ok(());
    }
    match split_state(attachment)? {
        Split::Stale(_) => point_at_ifb(attachment),
        Split::Off | Split::On(_) => Ok(()),
    }
}

/// Where the attachment's splitting stands (run in its namespace): on ingress
/// `--split-aggregates`, on egress the splitter of forwarded aggregates
/// (`state::splitter`).
pub fn split_state(attachment: &Attachment) -> Result<Split> {
    let pointed = attachment.split_to()?.get(&0, 0)?;
    if pointed == 0 {
        return Ok(Split::Off);
    }
    let dev = &attachment.location.dev;
    let (name, pointed) = match attachment.location.direction {
        Direction::Ingress => (qdisc::ifb_name(dev), pointed),
        Direction::Egress => (
            qdisc::splitter_ifb_name(dev),
            pointed & !shaper_common::SPLIT_EGRESS,
        ),
    };
    Ok(match crate::netns::ifindex(&name) {
        Ok(index) if index == pointed => Split::On(name),
        _ => Split::Stale(name),
    })
}

/// The drain rate of the attachment's slowest shape class, from each class's meta and
/// config alone (no counters: this runs after every shape class's change).
fn slowest_shape_drain(attachment: &Attachment) -> Result<Option<u64>> {
    let configs = attachment.classes()?;
    let mut slowest: Option<u64> = None;
    for (id, meta) in attachment.class_list()? {
        let config = configs.get(&id, 0)?;
        if config.action == shaper_common::Action::Shape as u8 {
            let rate = ClassSpec::from_meta(&meta, &config).drain().0;
            slowest = Some(slowest.map_or(rate, |slowest| slowest.min(rate)));
        }
    }
    Ok(slowest)
}

/// After every add, change and delete that involves a shape class: on egress the
/// device's aggregate cap follows its shape classes (`crate::state::aggregates`); on
/// ingress the ifb goes with the last shape class unless it splits aggregates (also after
/// a failed add or a rolled back apply); and after a re-attach (a re-created device has its own value again). Best effort: the classes are in place whatever happens here, so a
/// device that refuses the cap is logged, not an error.
pub fn shape_classes_changed(attachment: &Attachment) {
    let location = &attachment.location;
    let slowest = slowest_shape_drain(attachment);
    if location.direction == crate::state::Direction::Ingress {
        let splitting = !matches!(split_state(attachment), Ok(Split::Off));
        if let (Ok(None), false) = (slowest, splitting) {
            crate::qdisc::remove_ifb(&location.dev);
        }
        return;
    }
    let Ok(slowest) = slowest else {
        log::warn!(
            "{}: cannot read the classes; aggregates stay as they were",
            location.describe()
        );
        return;
    };
    if let Err(error) = crate::state::aggregates::refresh(location, slowest) {
        log::warn!(
            "{}: aggregates stay as they were ({error:#}); a TSO sender on this host may queue \
             up to 64 KiB at a time in its shape classes",
            location.describe()
        );
    }
    if attachment
        .globals()
        .is_ok_and(|globals| globals.link_header_len == 0)
    {
        return;
    }
    if let Err(error) = crate::state::splitter::refresh(attachment, slowest) {
        log::warn!(
            "{}: forwarded aggregates reach the shape classes whole ({error:#})",
            location.describe()
        );
    }
}
