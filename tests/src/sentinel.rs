//! Redis Sentinel for global classes' failover test: three sentinels on loopback ports
//! picked here, watching a primary ([`crate::redis::RedisServer`]) with a replica, quick to
//! judge it down (500 ms). Each runs from its own temp directory (Sentinel rewrites its
//! file), killed with the test process, stopped and removed on drop.

use crate::process::{dies_with_parent, output_bounded, wait_bounded};
use crate::redis::{free_port, RedisServer, Tls};
use anyhow::{bail, Context as _, Result};
use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// The temp directories of sentinels: `{prefix}{pid}-{port}`, swept after a killed run.
pub const SENTINEL_PREFIX: &str = "shaper-sentinel-";
/// The service the sentinels watch.
pub const SERVICE: &str = "shaper-lab";

pub struct Sentinel {
    pub port: u16,
    /// With TLS: the port that speaks it (`port` stays plain, for the test's own checks).
    pub tls_port: Option<u16>,
    dir: PathBuf,
    child: Option<Child>,
}

impl Sentinel {
    /// A sentinel watching the primary on `primary_port` (quorum 2 of 3), ready once it
    /// names that primary.
    pub fn start(primary_port: u16) -> Result<Self> {
        Self::start_with(primary_port, None)
    }

    /// A sentinel watching `primary`'s TLS port over TLS, itself answering on a TLS port
    /// too, with `primary`'s certificate (a TLS primary's replica announces its TLS port).
    pub fn start_tls(primary: &RedisServer) -> Result<Self> {
        let tls = primary.tls().context("the primary speaks no TLS")?;
        Self::start_with(tls.port, Some(tls))
    }

    fn start_with(primary_port: u16, tls: Option<&Tls>) -> Result<Self> {
        let port = free_port()?;
        let tls_port = tls.map(|_| free_port()).transpose()?;
        let dir =
            std::env::temp_dir().join(format!("{SENTINEL_PREFIX}{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("sentinel.conf");
        std::fs::write(
            &file,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds {SERVICE} 500\n\
                 sentinel failover-timeout {SERVICE} 5000\n\
                 sentinel parallel-syncs {SERVICE} 1\n{tls}",
                dir = dir.display(),
                tls = match (tls, tls_port) {
                    (Some(tls), Some(tls_port)) => {
                        let file = |name: &str| tls.dir.join(name).display().to_string();
                        format!(
                            "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\n\
                             tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                            file("server.pem"),
                            file("server.key"),
                            file("ca.pem")
                        )
                    }
                    _ => String::new(),
                }
            ),
        )?;
        let child = dies_with_parent(Command::new("redis-server").arg(&file).arg("--sentinel"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server --sentinel")?;
        let sentinel = Self {
            port,
            tls_port,
            dir,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.primary().ok() != Some(primary_port) {
            if Instant::now() > deadline {
                bail!("sentinel on port {port} does not name the primary");
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(sentinel)
    }

    /// The port of the primary this sentinel names now.
    pub fn primary(&self) -> Result<u16> {
        primary_of(self.port)
    }

    /// Replicas this sentinel knows of the service.
    pub fn replicas(&self) -> Result<usize> {
        let output = output_bounded(
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["SENTINEL", "replicas", SERVICE]),
            Duration::from_secs(5),
        )?;
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| *line == "name")
            .count())
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The port of the primary that the sentinel on `port` names now.
pub fn primary_of(port: u16) -> Result<u16> {
    let output = output_bounded(
        Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(["SENTINEL", "get-master-addr-by-name", SERVICE]),
        Duration::from_secs(5),
    )?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .nth(1)
        .and_then(|port| port.trim().parse().ok())
        .with_context(|| format!("no primary in {text:?}"))
}
