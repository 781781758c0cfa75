//! The qdisc shaper owns for `--action shape`: an HTB root (handle 5348:) whose classes
//! 5348:<class id + 1> carry each shaping class's rate and burst. The eBPF program steers
//! packets into them by setting skb->priority to the class handle, so no tc filter runs
//! and classification stays shaper's own. Only a default root qdisc (noqueue, pfifo_fast,
//! mq, …) is ever replaced; deleting shaper's root brings the kernel's default back.
//!
//! Where the kernel has `fq`, shaper's root is fq instead and the program paces shape
//! classes by earliest departure time (skb->tstamp); [`ensure_root`] probes for it once,
//! when the root is made. CoDel runs on the same virtual queue in both.
//!
//! aya and the rtnetlink crates have no HTB support; iproute2's `tc` is on every machine
//! that has TC, so this module drives it.

use crate::{classes::ClassSpec, error::runtime};
use anyhow::{Context as _, Result};
use serde_json::Value;
use std::process::Command;

/// "SH": the major handle of shaper's HTB root.
pub(crate) const HTB_MAJOR: u32 = 0x5348;
/// Root qdiscs the kernel installs by itself: replacing them loses nothing.
const DEFAULT_ROOTS: &[&str] = &["noqueue", "pfifo_fast", "mq", "fq_codel", "pfifo", "noop"];

fn tc(args: &[&str]) -> Result<String> {
    let output = Command::new("tc")
        .args(args)
        .output()
        .context("cannot run tc (iproute2)")?;
    if !output.status.success() {
        return Err(runtime(format!(
            "tc {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).to_string())
}

/// The handle of an HTB class for shaper class `class_id`.
pub(crate) fn class_handle(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (class_id + 1)
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
/// `fq` with EDT pacing where the kernel has fq (probed by trying it), HTB otherwise.
/// `SHAPER_SHAPE_BACKEND=htb` skips the probe (for comparing the two where fq exists).
pub(crate) fn ensure_root(dev: &str) -> Result<Backend> {
    let current = root(dev)?;
    if let Some(backend) = ours(&current) {
        return Ok(backend);
    }
    if let Some((kind, _)) = &current {
        if !DEFAULT_ROOTS.contains(&kind.as_str()) {
            return Err(runtime(format!(
                "{dev} has a root qdisc '{kind}' that shaper did not create; --action shape needs the root: remove it first"
            )));
        }
    }
    let handle = format!("{HTB_MAJOR:x}:");
    let htb_only = std::env::var("SHAPER_SHAPE_BACKEND").is_ok_and(|v| v == "htb");
    if !htb_only
        && tc(&[
            "qdisc", "replace", "dev", dev, "root", "handle", &handle, "fq",
        ])
        .is_ok()
    {
        return Ok(Backend::EdtFq);
    }
    // default 0: traffic no class claims leaves unshaped, as without shaper.
    tc(&[
        "qdisc", "replace", "dev", dev, "root", "handle", &handle, "htb", "default", "0",
    ])?;
    Ok(Backend::Htb)
}

/// What shaper's HTB class for one shape class is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HtbClass {
    pub rate_bits_per_sec: u64,
    pub burst_bytes: u64,
    /// The leaf bfifo's limit (bytes): never the 1000-packet default.
    pub leaf_limit_bytes: u64,
}

/// The HTB class of a shape class.
pub(crate) fn htb_class(spec: &ClassSpec) -> HtbClass {
    HtbClass {
        rate_bits_per_sec: spec.rate_bits_per_sec,
        burst_bytes: spec.burst_bytes,
        leaf_limit_bytes: spec
            .codel
            .unwrap_or_default()
            .leaf_limit_bytes(spec.rate_bits_per_sec),
    }
}

/// Creates or changes the HTB class of shaper class `class_id`, with its bounded leaf.
pub(crate) fn set_class(dev: &str, class_id: u32, class: &HtbClass, create: bool) -> Result<()> {
    let parent = format!("{HTB_MAJOR:x}:");
    let classid = handle_text(class_handle(class_id));
    let rate = format!("{}bit", class.rate_bits_per_sec);
    let burst = format!("{}b", class.burst_bytes);
    let verb = if create { "add" } else { "change" };
    tc(&[
        "class", verb, "dev", dev, "parent", &parent, "classid", &classid, "htb", "rate", &rate,
        "ceil", &rate, "burst", &burst, "cburst", &burst,
    ])?;
    // The leaf bounds the real queue (HTB's default would be a txqueuelen-long pfifo).
    let limit = class.leaf_limit_bytes.to_string();
    let leaf = tc(&[
        "qdisc", "replace", "dev", dev, "parent", &classid, "bfifo", "limit", &limit,
    ]);
    if leaf.is_err() && create {
        let _ = delete_class(dev, class_id);
    }
    leaf.map(|_| ())
}

pub(crate) fn delete_class(dev: &str, class_id: u32) -> Result<()> {
    let classid = handle_text(class_handle(class_id));
    tc(&["class", "del", "dev", dev, "classid", &classid]).map(|_| ())
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
    fn class_handles_live_under_shapers_major() {
        assert_eq!(handle_text(class_handle(0)), "5348:1");
        assert_eq!(handle_text(class_handle(16_383)), "5348:4000");
    }
}
