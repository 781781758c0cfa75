//! The bpffs mount and the state lock.

use super::*;

use anyhow::Result;
use nix::fcntl::{Flock, FlockArg};
use std::fs;

/// Mounts bpffs at /sys/fs/bpf when it is not there yet and creates the pin root.
pub(crate) fn ensure_bpffs() -> Result<()> {
    let mounted = nix::sys::statfs::statfs(BPFFS)
        .map(|fs| fs.filesystem_type().0 == BPF_FS_MAGIC)
        .unwrap_or(false);
    if !mounted {
        fs::create_dir_all(BPFFS).with_context(|| format!("cannot create {BPFFS}"))?;
        nix::mount::mount(
            Some("bpf"),
            BPFFS,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("cannot mount bpffs at {BPFFS}"))?;
    }
    fs::create_dir_all(PIN_ROOT).with_context(|| format!("cannot create {PIN_ROOT}"))?;
    Ok(())
}

/// Exclusive lock over all of shaper's state; released on drop.
pub struct StateLock {
    _lock: Flock<fs::File>,
}

pub fn lock() -> Result<StateLock> {
    // A lock file outside bpffs, so the pin root itself can go when the last attachment does.
    fs::create_dir_all(LOCK_DIR).with_context(|| format!("cannot create {LOCK_DIR}"))?;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .with_context(|| format!("cannot open {LOCK_FILE}"))?;
    let lock = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| errno)
        .with_context(|| format!("cannot lock {LOCK_FILE}"))?;
    ensure_bpffs()?;
    Ok(StateLock { _lock: lock })
}
