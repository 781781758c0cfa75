//! Capability check up front, so a missing capability is one clear line, not an EPERM
//! from deep inside a netlink or bpf call.

use crate::error::runtime;
use anyhow::Result;

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

fn effective() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

pub fn require() -> Result<()> {
    let caps = effective().unwrap_or(0);
    let has = |cap: u32| caps & (1 << cap) != 0;
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(runtime(format!(
            "missing capability {}: run as root or grant CAP_BPF and CAP_NET_ADMIN",
            missing.join(" and ")
        )))
    }
}
