//! What CNI plugins run by the tests and the bench leave behind, and the guard that
//! removes it ([`CniLeftovers`]); the stale sweep ([`crate::cleanup`]) finds what dead runs
//! left by the names kept here.

use crate::{
    process::{output_bounded, shaper_bin, COMMAND_LIMIT},
    topology::PIN_ROOT,
};
use anyhow::{Context as _, Result};
use std::{
    os::unix::fs::DirBuilderExt as _,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

/// Where shaper-cni records the host interface of each container (shaper-cli/src/cni.rs).
pub const CNI_RECORD_DIR: &str = "/run/shaper/cni";
/// CNI_CONTAINERID prefixes of the tests and the bench: `<prefix><pid>`, so the sweep can
/// tell the records of dead runs.
pub const CNI_TEST_CONTAINER_PREFIXES: [&str; 2] = ["shaper-test-", "shaper-bench-"];
/// host-local's data directory of the CNI test: `<temp>/shaper-test-ipam-<pid>`.
pub const CNI_IPAM_PREFIX: &str = "shaper-test-ipam-";

/// The record shaper-cni keeps for a container's interface (shaper-cli/src/cni.rs).
pub fn cni_record_path(container_id: &str, ifname: &str) -> PathBuf {
    let safe = |s: &str| s.replace(['/', '.'], "_");
    Path::new(CNI_RECORD_DIR).join(format!("{}-{}", safe(container_id), safe(ifname)))
}

/// Where test runs claim host-side interfaces: `{CNI_CLAIM_DIR}/{CNI_CLAIM_PREFIX}<pid>-<n>`
/// holding the interface's name, written before shaper-cni may attach to it. Root's own
/// (0700, beside shaper-cni's records): the sweep removes pins by what it reads there.
pub const CNI_CLAIM_DIR: &str = "/run/shaper/test-claims";
pub const CNI_CLAIM_PREFIX: &str = "claim-";

/// What CNI plugins run by a test may leave behind when it fails half-way, removed on
/// drop (also while panicking): shaper's attachment on the host-side interface and its
/// pins (under `host/`, as the plugin runs with only the host's network namespace),
/// shaper-cni's record, host-local's leases. Harmless when everything was deleted. The
/// host-side interface is claimed ([`CniLeftovers::claim_host_dev`]) in a file named with
/// this run's pid, so that the sweep of a killed run finds its pins by that token alone
/// (a bridge plugin names its veths the same way in production).
pub struct CniLeftovers {
    /// The namespace playing the host (the plugins ran under `nsenter --net` into it);
    /// None for the host's own.
    host_netns: Option<String>,
    /// CNI_CONTAINERID and CNI_IFNAME of the plugin runs.
    container_id: String,
    ifname: String,
    /// The host-side interface, once known, and its claim file.
    host_dev: Option<(String, PathBuf)>,
    /// host-local's data directory, if IPAM was used.
    ipam_dir: Option<PathBuf>,
}

impl CniLeftovers {
    pub fn new(
        host_netns: Option<String>,
        container_id: &str,
        ifname: &str,
        ipam_dir: Option<PathBuf>,
    ) -> Self {
        Self {
            host_netns,
            container_id: container_id.into(),
            ifname: ifname.into(),
            host_dev: None,
            ipam_dir,
        }
    }

    /// Names the host-side interface shaper-cni attaches to, and claims it for this run
    /// (before shaper-cni attaches to it).
    pub fn claim_host_dev(&mut self, dev: &str) -> Result<()> {
        static CLAIMS: AtomicU32 = AtomicU32::new(0);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(CNI_CLAIM_DIR)
            .with_context(|| format!("cannot create {CNI_CLAIM_DIR}"))?;
        let claim = Path::new(CNI_CLAIM_DIR).join(format!(
            "{CNI_CLAIM_PREFIX}{}-{}",
            std::process::id(),
            CLAIMS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&claim, dev).with_context(|| format!("cannot write {}", claim.display()))?;
        self.host_dev = Some((dev.into(), claim));
        Ok(())
    }
}

impl Drop for CniLeftovers {
    fn drop(&mut self) {
        if let Some((dev, claim)) = &self.host_dev {
            let pins = Path::new(PIN_ROOT).join("host").join(dev);
            if pins.exists() {
                // Detach first, so the hook goes even where the interface stays.
                let mut detach = match &self.host_netns {
                    Some(ns) => {
                        let mut command = Command::new("nsenter");
                        command
                            .arg(format!("--net=/run/netns/{ns}"))
                            .arg(shaper_bin());
                        command
                    }
                    None => Command::new(shaper_bin()),
                };
                let _ = output_bounded(detach.args(["detach", dev]), COMMAND_LIMIT);
                let _ = std::fs::remove_dir_all(&pins);
            }
            let _ = std::fs::remove_file(claim);
        }
        let _ = std::fs::remove_file(cni_record_path(&self.container_id, &self.ifname));
        if let Some(dir) = &self.ipam_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lab;

    /// What a CNI run that failed half-way leaves (shaper attached to the host-side
    /// interface with its pins under `host/`, the record, the IPAM directory, the claim)
    /// goes with the guard.
    #[test]
    fn cni_leftovers_go_with_the_guard() {
        let lab = Lab::new().unwrap();
        let dev = format!("cg{}", std::process::id());
        lab.router
            .run(
                "ip",
                &[
                    "link",
                    "add",
                    &dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &format!("{dev}p"),
                ],
            )
            .unwrap();
        let nsenter = |args: &[&str]| {
            output_bounded(
                Command::new("nsenter")
                    .arg(format!("--net=/run/netns/{}", lab.router.name))
                    .arg(shaper_bin())
                    .args(args),
                COMMAND_LIMIT,
            )
            .unwrap()
        };
        assert!(nsenter(&["attach", &dev]).status.success());
        let pins = Path::new(PIN_ROOT).join("host").join(&dev);
        assert!(pins.exists());
        let container_id = format!("shaper-test-{}", std::process::id());
        let record = cni_record_path(&container_id, "unit0");
        let record_dir_existed = Path::new(CNI_RECORD_DIR).exists();
        std::fs::create_dir_all(CNI_RECORD_DIR).unwrap();
        std::fs::write(&record, &dev).unwrap();
        let ipam_dir =
            std::env::temp_dir().join(format!("shaper-test-unit-ipam-{}", std::process::id()));
        std::fs::create_dir_all(ipam_dir.join("net")).unwrap();

        let mut leftovers = CniLeftovers::new(
            Some(lab.router.name.clone()),
            &container_id,
            "unit0",
            Some(ipam_dir.clone()),
        );
        leftovers.claim_host_dev(&dev).unwrap();
        let claim = leftovers.host_dev.as_ref().unwrap().1.clone();
        assert_eq!(std::fs::read_to_string(&claim).unwrap(), dev);
        drop(leftovers);
        assert!(!pins.exists() && !record.exists() && !ipam_dir.exists());
        assert!(!claim.exists(), "the claim goes with the guard");
        if !record_dir_existed {
            let _ = std::fs::remove_dir(CNI_RECORD_DIR);
            let _ = std::fs::remove_dir("/run/shaper");
        }
    }
}
