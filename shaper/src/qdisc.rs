//! The qdisc shaper owns for `--action shape`: an HTB root (handle 5348:) whose classes
//! 5348:<class id + 1> carry each shaping class's rate and burst. The eBPF program steers
//! packets into them by setting skb->priority to the class handle, so no tc filter runs
//! and classification stays shaper's own. Only a default root qdisc (noqueue, pfifo_fast,
//! mq, …) is ever replaced; deleting shaper's root brings the kernel's default back.
//!
//! (EDT pacing through the fq qdisc is the better path where fq exists: the program
//! supports it, see `shaper-ebpf`; this kernel has no fq, so the CLI uses HTB.)
//!
//! aya and the rtnetlink crates have no HTB support; iproute2's `tc` is on every machine
//! that has TC, so this module drives it.

use crate::error::runtime;
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

fn ours(root: &Option<(String, String)>) -> bool {
    matches!(root, Some((kind, handle)) if kind == "htb" && *handle == format!("{HTB_MAJOR:x}:"))
}

/// Makes shaper's HTB the root qdisc of `dev`, refusing to replace one the user made.
pub(crate) fn ensure_htb_root(dev: &str) -> Result<()> {
    let current = root(dev)?;
    if ours(&current) {
        return Ok(());
    }
    if let Some((kind, _)) = &current {
        if !DEFAULT_ROOTS.contains(&kind.as_str()) {
            return Err(runtime(format!(
                "{dev} has a root qdisc '{kind}' that shaper did not create; --action shape needs the root: remove it first"
            )));
        }
    }
    let handle = format!("{HTB_MAJOR:x}:");
    // default 0: traffic no class claims leaves unshaped, as without shaper.
    tc(&[
        "qdisc", "replace", "dev", dev, "root", "handle", &handle, "htb", "default", "0",
    ])?;
    Ok(())
}

/// Creates or changes the HTB class of shaper class `class_id`.
pub(crate) fn set_class(
    dev: &str,
    class_id: u32,
    rate_bits_per_sec: u64,
    burst_bytes: u64,
    create: bool,
) -> Result<()> {
    let parent = format!("{HTB_MAJOR:x}:");
    let classid = handle_text(class_handle(class_id));
    let rate = format!("{rate_bits_per_sec}bit");
    let burst = format!("{burst_bytes}b");
    let verb = if create { "add" } else { "change" };
    tc(&[
        "class", verb, "dev", dev, "parent", &parent, "classid", &classid, "htb", "rate", &rate,
        "ceil", &rate, "burst", &burst, "cburst", &burst,
    ])?;
    Ok(())
}

pub(crate) fn delete_class(dev: &str, class_id: u32) -> Result<()> {
    let classid = handle_text(class_handle(class_id));
    tc(&["class", "del", "dev", dev, "classid", &classid]).map(|_| ())
}

/// Removes shaper's HTB root (the kernel's default root comes back); no-op otherwise.
pub(crate) fn remove_htb_root(dev: &str) {
    if root(dev).map(|r| ours(&r)).unwrap_or(false) {
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
