//! The daemon in a lab: a configuration file that removes itself, `shaper daemon` run in
//! the router's namespace (as systemd's unit would, or in a bpffs of its own), and its
//! HTTP answers (`/metrics`, `/healthz`).

use crate::{dies_with_parent, shaper_bin, wait_bounded, BoundedCommand, Netns};
use anyhow::{bail, Result};
use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// A configuration file that removes itself.
pub struct ConfigFile(pub PathBuf);

impl ConfigFile {
    pub fn new(tag: &str, text: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("shaper-test-{}-{tag}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        Self(path)
    }

    pub fn write(&self, text: &str) {
        // Write then rename, as editors and config managers do.
        let next = self.0.with_extension("next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, &self.0).unwrap();
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The daemon as a child process in the router's network namespace (nsenter --net keeps
/// the host's mount namespace, so pins stay in the host's bpffs); stopped on drop.
pub struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Daemon {
    pub fn start(router: &Netns, file: &ConfigFile, extra: &[&str]) -> Result<Self> {
        let log = file.0.with_extension(format!("log{}", extra.len()));
        let child = dies_with_parent(&mut Command::new("nsenter"))
            .arg(format!("--net=/run/netns/{}", router.name))
            .arg(shaper_bin())
            .args(["daemon", "-f", file.path(), "--interval", "200ms"])
            .args(["--metrics-addr", "127.0.0.1:9464"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Self { child, log })
    }

    /// The daemon as systemd would run contrib/shaper.service, as far as this machine
    /// (no systemd as PID 1) can show it: in a mount namespace whose every mount is
    /// read-only but the unit's `ReadWritePaths=` and `RuntimeDirectory=`, with the
    /// unit's `CapabilityBoundingSet=` as bounding and ambient set, and no new
    /// privileges. (The unit's seccomp filter and namespace and address-family
    /// restrictions are checked offline, by systemd-analyze in the package test.)
    pub fn start_sandboxed(router: &Netns, file: &ConfigFile) -> Result<Self> {
        let unit = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../contrib/shaper.service"
        ))?;
        let setting = |name: &str| -> Vec<String> {
            unit.lines()
                .filter_map(|line| line.strip_prefix(&format!("{name}=")))
                .flat_map(|value| value.split_whitespace().map(String::from))
                .collect()
        };
        let mut writable = setting("ReadWritePaths");
        writable.extend(
            setting("RuntimeDirectory")
                .iter()
                .map(|d| format!("/run/{d}")),
        );
        let caps: Vec<String> = setting("CapabilityBoundingSet")
            .iter()
            .map(|cap| format!("+{}", cap.trim_start_matches("CAP_").to_lowercase()))
            .collect();
        anyhow::ensure!(
            !writable.is_empty() && !caps.is_empty(),
            "the unit names no writable path or capability"
        );
        let caps = format!("-all,{}", caps.join(","));
        let mut script = String::from(
            "set -e\nmount --make-rslave /\n\
             for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do \
             mount -o remount,bind,ro \"$m\" 2>/dev/null || true; done\n",
        );
        for path in &writable {
            script.push_str(&format!(
                "mkdir -p {path} 2>/dev/null || true\nmount --bind {path} {path}\nmount -o remount,bind,rw {path}\n"
            ));
        }
        // Proof the sandbox holds: a file outside the writable paths cannot be made.
        script.push_str(
            "if touch /etc/shaper-sandbox-probe 2>/dev/null; then rm -f /etc/shaper-sandbox-probe; echo 'sandbox: /etc writable' >&2; exit 9; fi\n\
             echo 'sandbox: /etc read-only' >&2\n",
        );
        script.push_str(&format!(
            "exec nsenter --net=/run/netns/{} setpriv --bounding-set {caps} --inh-caps {caps} --ambient-caps {caps} --no-new-privs {} daemon -f {} --interval 200ms --metrics-addr 127.0.0.1:9464\n",
            router.name,
            shaper_bin().display(),
            file.path()
        ));
        let log = file.0.with_extension("sandboxed.log");
        let child = dies_with_parent(&mut Command::new("unshare"))
            .args(["--mount", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Self { child, log })
    }

    /// [`Daemon::start`] in a mount namespace of its own with a fresh bpffs on
    /// /sys/fs/bpf: its pins (an interface without `netns` is the daemon's own
    /// namespace's, not a lab's) vanish with it, however it ends.
    pub fn start_in_private_bpffs(router: &Netns, file: &ConfigFile) -> Result<Self> {
        let script = format!(
            "set -e\nmount --make-rprivate /\nmount -t bpf bpf /sys/fs/bpf\n\
             exec nsenter --net=/run/netns/{} {} daemon -f {} --interval 200ms --metrics-addr 127.0.0.1:9464\n",
            router.name,
            shaper_bin().display(),
            file.path()
        );
        let log = file.0.with_extension("private.log");
        let child = dies_with_parent(&mut Command::new("unshare"))
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Self { child, log })
    }

    /// The daemon's process id (nsenter and unshare's shell exec it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends signal `name` to the daemon, which must still be running to take it.
    pub fn signal(&self, name: &str) {
        Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .succeed_within_limit()
            .expect("the daemon takes the signal");
    }

    /// SIGTERM and the exit status.
    pub fn stop(mut self) -> Result<std::process::ExitStatus> {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            thread::sleep(Duration::from_millis(50));
        }
        bail!("the daemon did not stop on SIGTERM; log:\n{}", self.log())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = wait_bounded(&mut self.child, Duration::from_secs(5));
        let _ = std::fs::remove_file(&self.log);
    }
}

/// GET `path` from the daemon's metrics address inside the router's namespace.
pub fn http_get(router: &Netns, path: &str) -> Result<(u16, String)> {
    router.http_get("127.0.0.1:9464", path)
}

/// The value of the one sample whose name and labels contain all of `parts`.
pub fn sample(metrics: &str, name: &str, parts: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub fn wait_for(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check()? {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    bail!("timed out waiting for {what}")
}
