//! A real redis-server for global classes: on a loopback port picked here, no persistence,
//! stopped on drop (also when a test panics). `restart_empty` is the "Redis restarted and
//! lost everything" case.

use crate::process::{output_bounded, wait_bounded};
use anyhow::{bail, Context as _, Result};
use std::{
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
}

/// A loopback port nothing listens on now.
pub fn free_port() -> Result<u16> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(socket.local_addr()?.port())
}

impl RedisServer {
    pub fn start() -> Result<Self> {
        let mut server = Self {
            port: free_port()?,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn spawn(&mut self) -> Result<()> {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start redis-server (Debian package redis-server; `cargo xtask setup` installs it)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self
                .cli(&["PING"])
                .is_ok_and(|reply| reply.trim() == "PONG")
            {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(20));
        }
        bail!("redis-server on port {} did not answer PING", self.port)
    }

    /// Kills the server (SIGKILL: no goodbye to the clients).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(5));
        }
    }

    /// A new, empty server on the same port (a restart that lost every key and script).
    pub fn restart_empty(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }

    /// One command through redis-cli; its reply as text.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let output = output_bounded(
            Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(args),
            Duration::from_secs(10),
        )?;
        if !output.status.success() {
            bail!("redis-cli {args:?} failed");
        }
        Ok(String::from_utf8_lossy(&output.stdout).to_string())
    }

    /// Calls of `command` since the server started (`INFO commandstats`).
    pub fn calls(&self, command: &str) -> Result<u64> {
        let info = self.cli(&["INFO", "commandstats"])?;
        let prefix = format!("cmdstat_{command}:calls=");
        Ok(info
            .lines()
            .find_map(|line| line.trim().strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse().ok())
            .unwrap_or(0))
    }

    /// CPU seconds the server has used (`INFO cpu`: user + sys).
    pub fn cpu_seconds(&self) -> Result<f64> {
        let info = self.cli(&["INFO", "cpu"])?;
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.trim().strip_prefix(&format!("{name}:")))
                .and_then(|value| value.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Ok(field("used_cpu_user") + field("used_cpu_sys"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
