//! The one loader/pinning layer every command goes through.
//!
//! State lives only in the kernel, pinned under `/sys/fs/bpf/shaper/<netns>/<dev>/<dir>/`:
//! one pin per map (named as in the object), `prog` (the attached program) and, in TCX
//! mode, `link` (the TCX link; unpinning it detaches the program). Every invocation
//! rebuilds its view from these pins. Mutations take an exclusive `flock` on
//! `/run/shaper/lock` (a root-only directory), so two invocations at once never interleave;
//! a command waits up to `--wait` for another one, then fails naming the holder.

use anyhow::{Context as _, Result};
use aya::programs::TcAttachType;
use shaper_common::ATTACH_MODE_CLSACT;
use std::{
    fs,
    path::{Path, PathBuf},
};

pub(crate) mod aggregates;
mod attachment;
mod build;
mod features;
mod loader;
mod names;
mod pins;
mod program;
mod shape_flows;
pub(crate) mod splitter;
mod upgrade;

pub use attachment::{summed, Attachment, AttachmentStatus, KeyCensus, KeyPressure};
pub use loader::{
    attach_fresh, detach, forget, load_object, load_object_bytes, reattach, switch_mode,
};
pub use names::decode_name;
pub(crate) use names::encode_name;
pub(crate) use pins::ensure_private_dir;
pub use pins::{lock, set_lock_wait, try_lock, StateLock, DEFAULT_LOCK_WAIT};
pub use program::load_program;
pub use shape_flows::ShapeFlows;
pub use upgrade::{resize_flow_table, upgrade, Upgraded};

pub(crate) const BPFFS: &str = "/sys/fs/bpf";
pub const PIN_ROOT: &str = "/sys/fs/bpf/shaper";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// Root-only (0700): the state lock and the CNI plugin's records.
pub(crate) const RUN_DIR: &str = "/run/shaper";
const LOCK_DIR: &str = RUN_DIR;
const LOCK_FILE: &str = "/run/shaper/lock";
const HOST_NAMESPACE_DIR: &str = "host";
const NETNS_DIR_PREFIX: &str = "netns-";
/// The attachment's program, pinned in its directory ([`Location::dir`]).
pub const PROG_PIN: &str = "prog";
/// The attachment's TCX link, pinned beside the program (TCX mode only).
pub const LINK_PIN: &str = "link";
/// An egress attachment's aggregate splitter (`splitter`), pinned for its clsact filter.
pub const SPLITTER_PIN: &str = "splitter";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Egress,
    Ingress,
}

impl Direction {
    pub const BOTH: [Direction; 2] = [Direction::Egress, Direction::Ingress];

    pub fn name(self) -> &'static str {
        match self {
            Self::Egress => "egress",
            Self::Ingress => "ingress",
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::BOTH
            .into_iter()
            .find(|direction| direction.name() == name)
    }

    fn tc(self) -> TcAttachType {
        match self {
            Self::Egress => TcAttachType::Egress,
            Self::Ingress => TcAttachType::Ingress,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Tcx,
    Clsact,
}

impl AttachMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        }
    }

    pub(crate) fn from_globals(value: u32) -> Self {
        if value == ATTACH_MODE_CLSACT {
            Self::Clsact
        } else {
            Self::Tcx
        }
    }
}

impl std::str::FromStr for Direction {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::from_name(text)
            .ok_or_else(|| format!("unknown direction '{text}' (expected egress or ingress)"))
    }
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AttachMode {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        [Self::Tcx, Self::Clsact]
            .into_iter()
            .find(|mode| mode.name() == text)
            .ok_or_else(|| format!("unknown attach mode '{text}' (expected tcx or clsact)"))
    }
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an attachment lives: an interface in the host or a named network namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    pub netns: Option<String>,
    pub dev: String,
    pub direction: Direction,
}

impl Location {
    pub fn dir(&self) -> PathBuf {
        let ns = match &self.netns {
            None => HOST_NAMESPACE_DIR.to_string(),
            Some(name) => format!("{NETNS_DIR_PREFIX}{}", escape(name)),
        };
        Path::new(PIN_ROOT)
            .join(ns)
            .join(escape(&self.dev))
            .join(self.direction.name())
    }

    /// The device this attachment's shape classes queue on: the interface itself on
    /// egress, shaper's ifb on ingress (`qdisc::ifb_name`).
    pub(crate) fn queue_dev(&self) -> String {
        match self.direction {
            Direction::Egress => self.dev.clone(),
            Direction::Ingress => crate::qdisc::ifb_name(&self.dev),
        }
    }

    pub fn describe(&self) -> String {
        match &self.netns {
            None => format!("{} {}", self.dev, self.direction.name()),
            Some(ns) => format!("{} {} (netns {ns})", self.dev, self.direction.name()),
        }
    }
}

/// CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns().
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// bpffs reserves dots in names (EPERM), yet interface names like `eth0.100` have them.
/// A `/` is escaped too, so no name can lead out of the pin root (names are checked
/// before they get here; this is the second wall).
fn escape(name: &str) -> String {
    name.replace('%', "%25")
        .replace('.', "%2E")
        .replace('/', "%2F")
}

fn unescape(name: &str) -> String {
    name.replace("%2F", "/")
        .replace("%2E", ".")
        .replace("%25", "%")
}

/// Every attachment pinned under the root, optionally only those of one namespace.
pub fn list_locations(netns_filter: Option<&Option<String>>) -> Result<Vec<Location>> {
    let mut found = Vec::new();
    let Ok(namespaces) = fs::read_dir(PIN_ROOT) else {
        return Ok(found);
    };
    for ns_entry in namespaces.flatten() {
        let ns_name = ns_entry.file_name().to_string_lossy().to_string();
        let netns = if ns_name == HOST_NAMESPACE_DIR {
            None
        } else if let Some(name) = ns_name.strip_prefix(NETNS_DIR_PREFIX) {
            Some(unescape(name))
        } else {
            continue;
        };
        if netns_filter.is_some_and(|wanted| *wanted != netns) {
            continue;
        }
        for dev_entry in fs::read_dir(ns_entry.path())?.flatten() {
            for dir_entry in fs::read_dir(dev_entry.path())?.flatten() {
                let Some(direction) =
                    Direction::from_name(&dir_entry.file_name().to_string_lossy())
                else {
                    continue;
                };
                found.push(Location {
                    netns: netns.clone(),
                    dev: unescape(&dev_entry.file_name().to_string_lossy()),
                    direction,
                });
            }
        }
    }
    found.sort_by(|a, b| (&a.netns, &a.dev, a.direction).cmp(&(&b.netns, &b.dev, b.direction)));
    Ok(found)
}

/// CPUs a per-CPU map holds values for (the possible CPUs).
pub fn possible_cpus() -> u64 {
    aya::util::nr_cpus().map(|n| n as u64).unwrap_or(1).max(1)
}

/// A namespace name a read command (`status`, `class list`, `stats`, `export`) was given
/// must exist, or at least have pins left from when it did: a typo is an error, not "not
/// attached anywhere".
pub fn check_netns_known(netns: &Option<String>) -> Result<()> {
    let Some(name) = netns else {
        return Ok(());
    };
    crate::netns::check_netns_name(name)?;
    if crate::netns::netns_exists(name) || !list_locations(Some(netns))?.is_empty() {
        return Ok(());
    }
    Err(crate::error::runtime(format!(
        "network namespace '{name}' not found (no {}/{name})",
        crate::netns::NETNS_RUN_DIR
    )))
}
