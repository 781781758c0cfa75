//! `shaper attach DEV --direction ingress --split-aggregates`: forwarded traffic reaches
//! an egress shape class as the GSO/GRO aggregates it arrived in (a pod's TSO sends 64
//! KiB at a time on a µs path; GRO merges a NIC's back-to-back frames), and a class can
//! only pass or drop an aggregate whole. With splitting on, the ingress program hands
//! every packet it lets pass to shaper's ifb of the interface (the one ingress shape
//! classes queue on), whose `gso_max_segs` of 1 cuts aggregates into wire-size segments
//! before it gives them back to the interface past the hook.

use crate::{error::runtime, qdisc, state::Attachment, state::Direction};
use anyhow::Result;

/// Turns splitting on or off for an ingress attachment; on makes (or reuses) its ifb.
pub fn set_split(attachment: &Attachment, on: bool) -> Result<()> {
    let location = &attachment.location;
    if location.direction != Direction::Ingress {
        return Err(crate::error::usage(
            "--split-aggregates splits traffic where it arrives: use it with --direction \
             ingress, on the interfaces forwarded traffic comes in on",
        ));
    }
    if !on {
        attachment.split_to()?.set(0, 0, 0)?;
        super::shape_classes_changed(attachment);
        return Ok(());
    }
    if attachment.globals()?.link_header_len == 0 {
        return Err(runtime(format!(
            "{} carries bare IP packets (no link-layer header): splitting goes through an \
             ifb, which needs one",
            location.dev
        )));
    }
    let ifb = qdisc::ensure_ifb(&location.dev)?;
    let split = qdisc::ip(&[
        "link",
        "set",
        "dev",
        &qdisc::ifb_name(&location.dev),
        "gso_max_segs",
        "1",
    ])
    .and_then(|()| Ok(attachment.split_to()?.set(0, ifb, 0)?));
    if split.is_err() {
        // An ifb made for nothing goes again (unless shape classes queue on it).
        super::shape_classes_changed(attachment);
    }
    split
}

/// The ifb an ingress attachment splits through, if splitting is on.
pub fn split_through(attachment: &Attachment) -> Result<Option<String>> {
    Ok(match attachment.split_to()?.get(&0, 0)? {
        0 => None,
        _ => Some(qdisc::ifb_name(&attachment.location.dev)),
    })
}
