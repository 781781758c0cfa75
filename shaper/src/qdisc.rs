//! The qdisc shaper owns for `--action shape`: an HTB root (handle 5348:) whose classes
//! 5348:<class id + 1> carry each shaping class's rate and burst. The eBPF program steers
//! packets into them by setting skb->priority to the class handle, so no tc filter runs
//! and classification stays shaper's own. Only a root qdisc the kernel installed itself (noqueue,
//! pfifo_fast, mq, … with handle 0:) is ever replaced; deleting shaper's root brings the kernel's default back.
//!
//! Asked for with `SHAPER_SHAPE_BACKEND=edt` (where the kernel has `fq`), shaper's root is
//! fq instead and the program paces shape classes by earliest departure time
//! (skb->tstamp). CoDel runs on the same virtual queue in both. A root shaper made earlier
//! keeps its kind: the choice is made once, when the root is made.
//!
//! aya and the rtnetlink crates have no HTB support; iproute2's `tc` is on every machine
//! that has TC, so this module drives it.

use crate::error::runtime;
use anyhow::{Context as _, Result};
use serde_json::Value;
use shaper_common::codel::SPARSE_RATE_DIVISOR;
use std::process::Command;

mod ifb;
mod leaf;
mod redirect;
pub(crate) use ifb::{
    check_ifb_name, ensure_ifb, ensure_splitter_ifb, has_splitter_filter, ifb_gso_max_segs,
    remove_ifb, remove_splitter_filter, remove_splitter_ifb, set_splitter_filter,
};
pub use ifb::{ifb_name, splitter_ifb_name};
pub(crate) use leaf::bulk_leaf_counts;
use leaf::set_leaf_qdisc;
pub use leaf::LeafCounts;
pub(crate) use redirect::require_ifb_redirect;
pub use redirect::{ifb_redirect_works, IFB_REDIRECT_KERNEL};

/// "SH": the major handle of shaper's HTB root.
pub(crate) const HTB_MAJOR: u32 = 0x5348;
/// Root qdiscs the kernel installs by itself (`net.core.default_qdisc` can name several).
/// The kernel's own always have handle 0:, a user's never do (tc gives them 8001: and up),
/// so only a root of one of these kinds *and* handle 0: is replaced: it loses nothing,
/// and deleting shaper's root brings it back.
const DEFAULT_ROOTS: &[&str] = &["noqueue", "pfifo_fast", "mq", "fq_codel", "pfifo", "noop"];
const KERNEL_HANDLE: &str = "0:";

/// Runs an iproute2 command (`tc`, `ip`); its standard output, or its error in one line.
fn iproute2(program: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program} (iproute2)"))?;
    if !output.status.success() {
        return Err(runtime(format!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).to_string())
}

pub(crate) fn tc(args: &[&str]) -> Result<String> {
    iproute2("tc", args)
}

/// The filters in the clsact hook of `dev` (`direction`: egress or ingress), as `tc -j`
/// lists them. A listing that cannot be read (tc failing, or printing anything but a JSON
/// list of filters) is an error: a hook that cannot be read is never taken for an empty one.
pub(crate) fn clsact_filters(dev: &str, direction: &str) -> Result<Vec<Value>> {
    let text = tc(&["-j", "filter", "show", "dev", dev, direction])?;
    let unreadable = |why: &str| {
        runtime(format!(
            "cannot read the clsact hook of {dev} {direction}: tc -j printed {why}"
        ))
    };
    match serde_json::from_str::<Value>(text.trim()) {
        Ok(Value::Array(filters)) if filters.iter().all(Value::is_object) => Ok(filters),
        Ok(_) => Err(unreadable("something other than a list of filters")),
        Err(error) => Err(unreadable(&format!("no JSON ({error})"))),
    }
}

/// Ids of the BPF programs in the clsact hook of `dev` (`direction`: egress or ingress).
pub(crate) fn clsact_program_ids(dev: &str, direction: &str) -> Result<Vec<u32>> {
    Ok(clsact_filters(dev, direction)?
        .iter()
        .filter_map(|filter| filter["options"]["prog"]["id"].as_u64())
        .map(|id| id as u32)
        .collect())
}

/// (priority, handle) of the clsact filter on `dev` (`direction`) that runs program
/// `program_id`, for replacing its program in place.
pub(crate) fn clsact_filter_of(dev: &str, direction: &str, program_id: u32) -> Result<(u16, u32)> {
    clsact_filters(dev, direction)?
        .iter()
        .filter(|filter| filter["options"]["prog"]["id"].as_u64() == Some(program_id.into()))
        .find_map(|filter| {
            let priority = u16::try_from(filter["pref"].as_u64()?).ok()?;
            let handle = filter["options"]["handle"].as_str()?;
            let handle = u32::from_str_radix(handle.trim_start_matches("0x"), 16).ok()?;
            Some((priority, handle))
        })
        .ok_or_else(|| {
            runtime(format!(
                "shaper's clsact filter (program {program_id}) is not on {dev} {direction}; \
                 run `shaper attach {dev}` to re-hook it first"
            ))
        })
}

/// Minor-number blocks of shaper's HTB tree: shape class `id` is the inner class
/// `id + 1` with two leaves, sparse `SPARSE_BASE + id + 1` and bulk `BULK_BASE + id + 1`
/// (16 384 classes fit each block of the 16-bit minor space).
const SPARSE_BASE: u32 = 0x4000;
const BULK_BASE: u32 = 0x8000;

/// The inner HTB class of shape class `class_id`: it holds the class's rate and burst.
pub(crate) fn class_handle(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (class_id + 1)
}

/// The leaf bulk flows queue in (`action_arg`).
pub(crate) fn bulk_leaf(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (BULK_BASE + class_id + 1)
}

/// The leaf sparse flows queue in, served first (`sparse_priority`).
pub(crate) fn sparse_leaf(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (SPARSE_BASE + class_id + 1)
}

fn handle_text(handle: u32) -> String {
    format!("{:x}:{:x}", handle >> 16, handle & 0xffff)
}

/// (kind, handle) of the root qdisc, if any.
fn root(dev: &str) -> Result<Option<(String, String)>> {
    let text = tc(&["-j", "qdisc", "show", "dev", dev, "root"])?;
    let json: Value = serde_json::from_str(text.trim()).unwrap_or(Value::Null);
    Ok(json.as_array().and_then(|a| a.first()).map(|q| {
        (
            q["kind"].as_str().unwrap_or_default().to_string(),
            q["handle"].as_str().unwrap_or_default().to_string(),
        )
    }))
}

/// How shape classes queue on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Shaper's HTB root; each shape class has an HTB class with a bounded bfifo leaf.
    Htb,
    /// Shaper's fq root: the program paces by earliest departure time (skb->tstamp).
    EdtFq,
}

/// The backend of shaper's own root qdisc, if the root is ours.
fn ours(root: &Option<(String, String)>) -> Option<Backend> {
    match root {
        Some((kind, handle)) if *handle == format!("{HTB_MAJOR:x}:") => match kind.as_str() {
            "htb" => Some(Backend::Htb),
            "fq" => Some(Backend::EdtFq),
            _ => None,
        },
        _ => None,
    }
}

/// Makes shaper's root the root qdisc of `dev`, refusing to replace one the user made:
/// HTB by default; `fq` with EDT pacing when `SHAPER_SHAPE_BACKEND=edt` asks for it (an
/// error where the kernel has no fq) and `edt_allowed` (an interface's egress; an
/// ingress ifb is always HTB). `SHAPER_SHAPE_BACKEND=htb` is the default said explicitly.
pub(crate) fn ensure_root(dev: &str, edt_allowed: bool) -> Result<Backend> {
    let current = root(dev)?;
    if let Some(backend) = ours(&current) {
        return Ok(backend);
    }
    let wanted = if edt_allowed {
        wanted_backend()?
    } else {
        Backend::Htb
    };
    if let Some((kind, handle)) = &current {
        if !DEFAULT_ROOTS.contains(&kind.as_str()) || handle != KERNEL_HANDLE {
            return Err(runtime(format!(
                "{dev} has a root qdisc that shaper did not create ({kind} {handle}); \
                 --action shape needs the root: remove it (tc qdisc del dev {dev} root) \
                 or use --action drop or mark"
            )));
        }
    }
    let handle = format!("{HTB_MAJOR:x}:");
    if wanted == Backend::EdtFq {
        tc(&[
            "qdisc", "replace", "dev", dev, "root", "handle", &handle, "fq",
        ])
        .map_err(|error| {
            runtime(format!(
                "{SHAPE_BACKEND_VAR}=edt needs the fq qdisc, which {dev} refused ({error}); \
                 unset it to shape with HTB"
            ))
        })?;
        return Ok(Backend::EdtFq);
    }
    // default 0: traffic no class claims leaves unshaped, as without shaper.
    tc(&[
        "qdisc", "replace", "dev", dev, "root", "handle", &handle, "htb", "default", "0",
    ])?;
    Ok(Backend::Htb)
}

/// The environment variable that picks shape's backend on a device shaper has no root on.
pub const SHAPE_BACKEND_VAR: &str = "SHAPER_SHAPE_BACKEND";

/// The backend `SHAPER_SHAPE_BACKEND` asks for: HTB when unset (measured beside EDT + fq
/// in Debian's kernels, docs/BENCHMARKS.md: HTB kept the Cubic flows' queue as short or
/// shorter with more goodput, and it is the path every kernel has).
fn wanted_backend() -> Result<Backend> {
    match std::env::var(SHAPE_BACKEND_VAR).as_deref() {
        Err(_) | Ok("htb") | Ok("") => Ok(Backend::Htb),
        Ok("edt") => Ok(Backend::EdtFq),
        Ok(other) => Err(runtime(format!(
            "{SHAPE_BACKEND_VAR}={other}: expected htb (the default) or edt"
        ))),
    }
}

/// What shaper's HTB class for one shape class is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HtbClass {
    /// The parent shape class's id in a tree (its HTB class is this one's parent).
    pub parent: Option<u32>,
    pub rate_bits_per_sec: u64,
    pub burst_bytes: u64,
    /// What the class may borrow up to (htb's ceil and cburst); the rate at the top.
    pub ceil_bits_per_sec: u64,
    pub cburst_bytes: u64,
    /// What the class's own two leaves are guaranteed: its rate less its children's.
    pub own_rate_bits_per_sec: u64,
    /// The leaf bfifo's limit (bytes): never the 1000-packet default.
    pub leaf_limit_bytes: u64,
}

/// Creates or changes the HTB classes of shaper class `class_id`: the inner class at the
/// class's rate and burst (and ceiling, under its parent's inner class in a tree), and
/// under it the sparse leaf (priority 0) and the bulk leaf (priority 1), each borrowing
/// up to the class's ceiling and each with a bounded bfifo. Child classes' inner classes
/// hang beside the two leaves, as in any htb tree.
pub(crate) fn set_class(dev: &str, class_id: u32, class: &HtbClass, create: bool) -> Result<()> {
    let result = set_tree(dev, class_id, class, create);
    if result.is_err() && create {
        let _ = delete_class(dev, class_id);
    }
    result
}

fn set_tree(dev: &str, class_id: u32, class: &HtbClass, create: bool) -> Result<()> {
    let parent = match class.parent {
        Some(parent) => handle_text(class_handle(parent)),
        None => format!("{HTB_MAJOR:x}:"),
    };
    let inner = handle_text(class_handle(class_id));
    let verb = if create { "add" } else { "change" };
    let htb_class = |parent: &str, classid: &str, rate: u64, ceil: u64, prio: &str| {
        let (rate, ceil) = (format!("{rate}bit"), format!("{ceil}bit"));
        let burst = format!("{}b", class.burst_bytes);
        let cburst = format!("{}b", class.cburst_bytes);
        tc(&[
            "class", verb, "dev", dev, "parent", parent, "classid", classid, "htb", "rate", &rate,
            "ceil", &ceil, "burst", &burst, "cburst", &cburst, "prio", prio, "quantum", "1514",
        ])
    };
    let ceil = class.ceil_bits_per_sec;
    htb_class(&parent, &inner, class.rate_bits_per_sec, ceil, "0")?;
    // Guarantees split 1:15, as the sparse bucket's rate; either borrows the rest.
    let own_rate = class.own_rate_bits_per_sec;
    let sparse_rate = (own_rate / SPARSE_RATE_DIVISOR).max(8);
    let leaves = [
        (sparse_leaf(class_id), sparse_rate, "0"),
        (
            bulk_leaf(class_id),
            own_rate.saturating_sub(sparse_rate).max(8),
            "1",
        ),
    ];
    for (leaf, leaf_rate, prio) in leaves {
        let leaf = handle_text(leaf);
        htb_class(&inner, &leaf, leaf_rate, ceil, prio)?;
        // Bounds the real queue (HTB's default leaf is a txqueuelen-long pfifo).
        let limit = class.leaf_limit_bytes.to_string();
        set_leaf_qdisc(dev, &leaf, &["bfifo", "limit", &limit], create)?;
    }
    Ok(())
}

/// Deletes the class's HTB classes, leaves first (HTB refuses to delete a parent). A
/// device that is gone (an ifb someone deleted) took them with it; one made again never
/// had them.
pub(crate) fn delete_class(dev: &str, class_id: u32) -> Result<()> {
    if !has_class(dev, class_id) {
        return Ok(());
    }
    let handle = handle_text(class_handle(class_id));
    for leaf in [sparse_leaf(class_id), bulk_leaf(class_id)] {
        let classid = handle_text(leaf);
        // A leaf that was never made (a failed add) is not an error.
        let _ = tc(&["class", "del", "dev", dev, "classid", &classid]);
    }
    tc(&["class", "del", "dev", dev, "classid", &handle]).map(drop)
}

/// Whether `dev` exists and has the class's HTB class (a listing tc cannot give counts
/// as yes: the caller then tries, and says what failed).
pub(crate) fn has_class(dev: &str, class_id: u32) -> bool {
    let handle = handle_text(class_handle(class_id));
    crate::netns::ifindex(dev).is_ok()
        && !tc(&["class", "show", "dev", dev, "classid", &handle])
            .is_ok_and(|text| text.trim().is_empty())
}

/// `ip -j -d link show dev NAME` in this thread's namespace (sysfs would show the
/// host's), if the link exists.
pub(crate) fn link(name: &str) -> Option<Value> {
    let output = Command::new("ip")
        .args(["-j", "-d", "link", "show", "dev", name])
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    let links: Value = serde_json::from_slice(&output.stdout).ok()?;
    links.get(0).cloned()
}

/// The kind of link `name` is (`ip -d`'s `info_kind`: "ifb", "veth", ""), if it exists.
pub(crate) fn link_kind(name: &str) -> Option<String> {
    link(name).map(|link| {
        link["linkinfo"]["info_kind"]
            .as_str()
            .unwrap_or("")
            .to_string()
    })
}

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    iproute2("ip", args).map(|_| ())
}

/// Removes shaper's root (the kernel's default root comes back); no-op otherwise.
pub(crate) fn remove_root(dev: &str) {
    if root(dev).is_ok_and(|r| ours(&r).is_some()) {
        let _ = tc(&["qdisc", "del", "dev", dev, "root"]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ifb_name_fits_ifnamsiz_and_differs_by_interface() {
        assert_eq!(ifb_name("tap0").len(), 12);
        assert_ne!(ifb_name("tap0"), ifb_name("tap1"));
        assert_eq!(ifb_name("tap0"), ifb_name("tap0"));
    }

    #[test]
    fn class_handles_live_under_shapers_major() {
        assert_eq!(handle_text(class_handle(0)), "5348:1");
        assert_eq!(handle_text(class_handle(16_383)), "5348:4000");
        assert_eq!(handle_text(sparse_leaf(16_383)), "5348:8000");
        assert_eq!(handle_text(bulk_leaf(0)), "5348:8001");
        assert_eq!(handle_text(bulk_leaf(16_383)), "5348:c000");
    }
}
