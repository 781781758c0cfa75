//! shaper's ifb devices: the one an ingress attachment queues its shape classes on (and
//! splits aggregates through with `--split-aggregates`), and the egress splitter's, with
//! the splitter's clsact filter (`state::splitter`).

use super::{clsact_filters, ip, link, link_kind, tc};
use crate::error::runtime;
use anyhow::Result;
use std::process::Command;

/// The ifb device an ingress attachment of `dev` queues its shape classes on, in the
/// interface's namespace: shaper's own, named from the interface's name (`shpq` and 8 hex
/// digits of its FNV-1a hash: 12 characters, within IFNAMSIZ).
pub fn ifb_name(dev: &str) -> String {
    format!("shpq{:08x}", name_hash(dev))
}

/// The ifb that splits the forwarded aggregates of `dev`'s egress shape classes
/// (`state::splitter`): `shps` and the same hash as [`ifb_name`].
pub fn splitter_ifb_name(dev: &str) -> String {
    format!("shps{:08x}", name_hash(dev))
}

fn name_hash(dev: &str) -> u32 {
    dev.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// Fails when the name of `dev`'s ifb is taken by a device that is not an ifb; whether
/// the ifb exists.
pub(crate) fn check_ifb_name(dev: &str) -> Result<bool> {
    let ifb = ifb_name(dev);
    match link_kind(&ifb).as_deref() {
        None => Ok(false),
        Some("ifb") => Ok(true),
        Some(kind) => Err(runtime(format!(
            "{ifb} exists and is not an ifb ({kind}): shaper queues and splits {dev}'s \
             ingress on an ifb of that name; rename or delete it"
        ))),
    }
}

/// The ifb's queue length: with splitting every packet of the interface crosses it (an
/// ifb's default, 32, would drop bursts), and HTB's direct queue takes the same length.
const IFB_TXQUEUELEN: &str = "1000";

/// Makes the ifb of `dev`'s ingress (up, with `dev`'s MTU, a transmit queue per CPU)
/// unless it is there; its ifindex, which the program redirects the class's packets to.
/// The ifb hands each packet back to `dev`'s ingress past the TC hook, so it is
/// classified once.
pub(crate) fn ensure_ifb(dev: &str) -> Result<u32> {
    let ifb = ifb_name(dev);
    if !check_ifb_name(dev)? {
        add_ifb(dev, &ifb)?;
    }
    ip(&["link", "set", "dev", &ifb, "up"])?;
    crate::netns::ifindex(&ifb)
}

/// Makes the splitter's ifb of `dev` unless it is there (up, cutting every aggregate it
/// takes into segments: `gso_max_segs` 1); its ifindex.
pub(crate) fn ensure_splitter_ifb(dev: &str) -> Result<u32> {
    let ifb = splitter_ifb_name(dev);
    match link_kind(&ifb).as_deref() {
        None => add_ifb(dev, &ifb)?,
        Some("ifb") => {}
        Some(kind) => {
            return Err(runtime(format!(
                "{ifb} exists and is not an ifb ({kind}): shaper splits {dev}'s forwarded \
                 aggregates through an ifb of that name; rename or delete it"
            )))
        }
    }
    ip(&["link", "set", "dev", &ifb, "gso_max_segs", "1", "up"])?;
    crate::netns::ifindex(&ifb)
}

/// Deletes the splitter's ifb of `dev`, if there is one.
pub(crate) fn remove_splitter_ifb(dev: &str) {
    let ifb = splitter_ifb_name(dev);
    if link_kind(&ifb).as_deref() == Some("ifb") {
        let _ = ip(&["link", "del", "dev", &ifb]);
    }
}

/// The egress splitter's filter in `dev`'s clsact hook: after every other shaper filter
/// (those take the kernel's automatic preferences, 49152 and below).
const SPLITTER_PREF: &str = "65000";

/// Puts the splitter (the program pinned at `pin`) in `dev`'s clsact egress hook with a
/// mirred action to the splitter's ifb, making the clsact qdisc if it is missing. Returns
/// whether it made the qdisc. A filter already there is replaced.
pub(crate) fn set_splitter_filter(dev: &str, pin: &std::path::Path) -> Result<bool> {
    let made_clsact = tc(&["qdisc", "add", "dev", dev, "clsact"]).is_ok();
    let pin = pin.to_string_lossy();
    let ifb = splitter_ifb_name(dev);
    #[rustfmt::skip]
    let filter = [
        "filter", "replace", "dev", dev, "egress", "pref", SPLITTER_PREF, "handle", "1",
        "bpf", "object-pinned", &pin, "action", "mirred", "egress", "redirect", "dev", &ifb,
    ];
    match tc(&filter) {
        Ok(_) => Ok(made_clsact),
        Err(error) => {
            if made_clsact {
                let _ = tc(&["qdisc", "del", "dev", dev, "clsact"]);
            }
            Err(error)
        }
    }
}

/// Whether the splitter's filter is in `dev`'s clsact egress hook.
pub(crate) fn has_splitter_filter(dev: &str) -> bool {
    clsact_filters(dev, "egress").is_ok_and(|filters| {
        filters.iter().any(|filter| {
            filter["pref"].as_u64().map(|pref| pref.to_string()) == Some(SPLITTER_PREF.into())
        })
    })
}

/// Removes the splitter's filter from `dev`'s clsact egress hook, and the clsact qdisc
/// when `remove_qdisc` (the splitter made it) and no filter is left in either direction;
/// whether the qdisc went.
pub(crate) fn remove_splitter_filter(dev: &str, remove_qdisc: bool) -> bool {
    let _ = tc(&["filter", "del", "dev", dev, "egress", "pref", SPLITTER_PREF]);
    let empty = |direction| clsact_filters(dev, direction).is_ok_and(|filters| filters.is_empty());
    remove_qdisc
        && empty("egress")
        && empty("ingress")
        && tc(&["qdisc", "del", "dev", dev, "clsact"]).is_ok()
}

/// Makes `ifb` for `dev` (loading the module if need be).
fn add_ifb(dev: &str, ifb: &str) -> Result<()> {
    let mtu = link(dev)
        .and_then(|link| link["mtu"].as_u64())
        .unwrap_or(1500)
        .to_string();
    if !std::path::Path::new("/sys/module/ifb").exists() {
        // Loaded on demand it would also make ifb0 and ifb1 in the host's namespace.
        let _ = Command::new("modprobe").args(["ifb", "numifbs=0"]).output();
    }
    let queues = std::thread::available_parallelism()
        .map_or(1, |cpus| cpus.get())
        .to_string();
    #[rustfmt::skip]
    let add = [
        "link", "add", ifb, "mtu", &mtu, "txqueuelen", IFB_TXQUEUELEN,
        "numtxqueues", &queues, "numrxqueues", &queues, "type", "ifb",
    ];
    ip(&add).map_err(|error| {
        runtime(format!(
            "--action shape on ingress queues on an ifb device, which this kernel \
             refused ({error}); load the ifb module (modprobe ifb) or police instead"
        ))
    })
}

/// Sets the `gso_max_segs` of `dev`'s ifb, if it exists: 1 splits every aggregate it
/// takes; `None` gives the kernel's default back.
pub(crate) fn ifb_gso_max_segs(dev: &str, segments: Option<u32>) -> Result<()> {
    let ifb = ifb_name(dev);
    if link_kind(&ifb).as_deref() != Some("ifb") {
        return Ok(());
    }
    let segments = segments.unwrap_or(65_535).to_string();
    ip(&["link", "set", "dev", &ifb, "gso_max_segs", &segments])
}

/// Deletes the ifb of `dev`'s ingress, with its qdiscs, if shaper made one.
pub(crate) fn remove_ifb(dev: &str) {
    let ifb = ifb_name(dev);
    if link_kind(&ifb).as_deref() == Some("ifb") {
        let _ = ip(&["link", "del", "dev", &ifb]);
    }
}
