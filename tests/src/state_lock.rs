//! Holding shaper's state lock from outside, as another program would.

use crate::process::{dies_with_parent, wait_bounded};
use anyhow::Result;
use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// shaper's state lock (root-only directory).
pub const STATE_LOCK_FILE: &str = "/run/shaper/lock";

/// `flock --no-fork STATE_LOCK_FILE sleep 30` as a child: holds shaper's state lock until
/// dropped (without --no-fork, killing flock would leave its `sleep` holding the lock).
pub struct StateLockHolder(pub Child);

impl StateLockHolder {
    /// Takes the lock (shaper must have run once, so that its directory exists).
    pub fn take() -> Result<Self> {
        let holder = Self(
            dies_with_parent(&mut Command::new("flock"))
                .args(["--no-fork", STATE_LOCK_FILE, "sleep", "30"])
                .stdin(Stdio::null())
                .spawn()?,
        );
        // Wait until the kernel lists the lock (bounded); a failure kills the child.
        let deadline = Instant::now() + Duration::from_secs(5);
        let pid = holder.0.id().to_string();
        while Instant::now() < deadline {
            let locks = std::fs::read_to_string("/proc/locks")?;
            let held = locks.lines().any(|line| {
                line.contains("FLOCK") && line.split_whitespace().nth(4) == Some(pid.as_str())
            });
            if held {
                return Ok(holder);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        anyhow::bail!("flock never took {STATE_LOCK_FILE}")
    }
}

impl Drop for StateLockHolder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = wait_bounded(&mut self.0, Duration::from_secs(5));
    }
}
