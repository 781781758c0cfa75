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
//! Qdiscs and classes go to the kernel over rtnetlink (`netlink`: a shape class's five
//! objects in one send, no process per object). Reading the clsact hook, the leaves'
//! counters for reports and the splitter's filter (a pinned program with a mirred
//! action) stay with iproute2's `tc`: none is on a path that grows with the classes.

use crate::error::runtime;
use anyhow::{Context as _, Result};
use serde_json::Value;
use std::process::Command;

mod htb;
mod ifb;
mod leaf;
mod netlink;
mod redirect;
use htb::HTB_MAJOR;
pub(crate) use htb::{
    bulk_leaf, delete_class, delete_classes, has_class, set_class, sparse_leaf, HtbClass,
};
pub(crate) use ifb::{
    check_ifb_name, ensure_ifb, ensure_splitter_ifb, has_splitter_filter, ifb_gso_max_segs,
    remove_ifb, remove_splitter_filter, remove_splitter_ifb, set_splitter_filter,
};
pub use ifb::{ifb_name, splitter_ifb_name};
pub(crate) use leaf::bulk_leaf_counts;
pub use leaf::LeafCounts;
use netlink::{handle_text, Request};
pub(crate) use redirect::require_ifb_redirect;
pub use redirect::{ifb_redirect_works, IFB_REDIRECT_KERNEL};

/// Root qdiscs the kernel installs by itself (`net.core.default_qdisc` can name several).
/// The kernel's own always have handle 0:, a user's never do (tc gives them 8001: and up),
/// so only a root of one of these kinds *and* handle 0: is replaced: it loses nothing,
/// and deleting shaper's root brings it back.
const DEFAULT_ROOTS: &[&str] = &["noqueue", "pfifo_fast", "mq", "fq_codel", "pfifo", "noop"];

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

/// (kind, handle) of the root qdisc, if the kernel shows one.
fn root(dev: &str) -> Result<Option<(String, u32)>> {
    let ifindex = crate::netns::ifindex(dev)?;
    let Some(root) = netlink::get(Request::get_root(dev, ifindex))? else {
        return Ok(None);
    };
    let kind = root
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            netlink_packet_route::tc::TcAttribute::Kind(kind) => Some(kind.clone()),
            _ => None,
        });
    Ok(Some((
        kind.unwrap_or_default(),
        u32::from(root.header.handle),
    )))
}

/// How shape classes queue on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Shaper's HTB root; each shape class has an HTB class with bounded bfifo leaves.
    Htb,
    /// Shaper's fq root: the program paces by earliest departure time (skb->tstamp).
    EdtFq,
}

/// The backend of shaper's own root qdisc, if the root is ours.
fn ours(root: &Option<(String, u32)>) -> Option<Backend> {
    match root {
        Some((kind, handle)) if *handle == HTB_MAJOR << 16 => match kind.as_str() {
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
        if !DEFAULT_ROOTS.contains(&kind.as_str()) || *handle != 0 {
            let handle = handle_text(*handle);
            return Err(runtime(format!(
                "{dev} has a root qdisc that shaper did not create ({kind} {handle}); \
                 --action shape needs the root: remove it (tc qdisc del dev {dev} root) \
                 or use --action drop or mark"
            )));
        }
    }
    let ifindex = crate::netns::ifindex(dev)?;
    let place = (netlink::ROOT, HTB_MAJOR << 16);
    if wanted == Backend::EdtFq {
        let fq = Request::replace_qdisc(dev, ifindex, place, netlink::plain("fq"));
        netlink::run(&[fq]).map_err(|error| {
            runtime(format!(
                "{SHAPE_BACKEND_VAR}=edt needs the fq qdisc, which {dev} refused ({error}); \
                 unset it to shape with HTB"
            ))
        })?;
        return Ok(Backend::EdtFq);
    }
    // default 0: traffic no class claims leaves unshaped, as without shaper.
    let htb = Request::replace_qdisc(dev, ifindex, place, netlink::htb_root(0));
    netlink::run(&[htb])?;
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
        if let Ok(ifindex) = crate::netns::ifindex(dev) {
            let _ = netlink::run(&[Request::delete_root(dev, ifindex)]);
        }
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
        use htb::class_handle;
        assert_eq!(handle_text(class_handle(0)), "5348:1");
        assert_eq!(handle_text(class_handle(16_383)), "5348:4000");
        assert_eq!(handle_text(sparse_leaf(16_383)), "5348:8000");
        assert_eq!(handle_text(bulk_leaf(0)), "5348:8001");
        assert_eq!(handle_text(bulk_leaf(16_383)), "5348:c000");
    }
}
