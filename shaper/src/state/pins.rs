//! The bpffs mount and the state lock.

use super::*;

use crate::error::runtime;
use anyhow::Result;
use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};
use std::{
    fs,
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Mounts bpffs at /sys/fs/bpf when it is not there yet (root-only, as systemd mounts
/// it) and creates the pin root, root-only too; an existing pin root must be ours.
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
            Some("mode=0700"),
        )
        .with_context(|| format!("cannot mount bpffs at {BPFFS}"))?;
    }
    ensure_private_dir(Path::new(PIN_ROOT))
}

/// Exclusive lock over all of shaper's state; released on drop.
pub struct StateLock {
    _lock: Flock<fs::File>,
}

/// How long [`lock`] waits for another shaper to finish, in ms (`--wait`).
static LOCK_WAIT_MS: AtomicU64 = AtomicU64::new(DEFAULT_LOCK_WAIT.as_millis() as u64);
/// `iptables -w`'s spirit: wait a while for the other writer, never forever.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(10);
const LOCK_POLL: Duration = Duration::from_millis(20);

/// Sets how long every later [`lock`] waits for the lock (the CLI's `--wait`).
pub fn set_lock_wait(wait: Duration) {
    LOCK_WAIT_MS.store(wait.as_millis() as u64, Ordering::Relaxed);
}

/// Takes the state lock, waiting up to `--wait` for another shaper that holds it; then
/// fails with one line naming the holder. Also makes sure bpffs and the pin root are
/// there and safe.
pub fn lock() -> Result<StateLock> {
    let wait = Duration::from_millis(LOCK_WAIT_MS.load(Ordering::Relaxed));
    let deadline = Instant::now() + wait;
    loop {
        if let Some(lock) = try_lock()? {
            return Ok(lock);
        }
        if Instant::now() >= deadline {
            return Err(runtime(format!(
                "{} holds shaper's state lock ({LOCK_FILE}) and did not let go within {}; \
                 retry, or wait longer with --wait SECONDS",
                lock_holder().unwrap_or_else(|| "another process".to_string()),
                humantime::format_duration(wait)
            )));
        }
        std::thread::sleep(LOCK_POLL);
    }
}

/// Takes the state lock if nobody holds it; `None` if somebody does. Never blocks (the
/// daemon skips a tick instead, so its metrics and signals keep being served).
pub fn try_lock() -> Result<Option<StateLock>> {
    let file = open_lock_file()?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            ensure_bpffs()?;
            Ok(Some(StateLock { _lock: lock }))
        }
        Err((_, Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(runtime(format!("cannot lock {LOCK_FILE}: {errno}"))),
    }
}

/// The lock file, in a directory only root may enter: a world-writable lock directory
/// (`/run/lock`) let any user take the lock and stall every shaper command. Symlinks are
/// not followed.
fn open_lock_file() -> Result<fs::File> {
    ensure_private_dir(Path::new(LOCK_DIR))?;
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(LOCK_FILE)
        .map_err(|e| runtime(format!("cannot open the state lock {LOCK_FILE}: {e}")))
}

/// Creates `dir` (mode 0700) or checks that the existing one is a real directory owned by
/// this user and writable by nobody else; an old, looser mode of our own is tightened.
pub(crate) fn ensure_private_dir(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(runtime(format!("cannot create {}: {e}", dir.display())));
        }
    }
    let meta = fs::symlink_metadata(dir)
        .map_err(|e| runtime(format!("cannot inspect {}: {e}", dir.display())))?;
    check_ours(dir, &meta)?;
    if meta.permissions().mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| runtime(format!("cannot restrict {}: {e}", dir.display())))?;
    }
    Ok(())
}

/// Refuses what is not a real directory owned by this user.
fn check_ours(dir: &Path, meta: &fs::Metadata) -> Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_dir() {
        return Err(runtime(format!(
            "refusing {}: not a directory (a symlink?)",
            dir.display()
        )));
    }
    if meta.uid() != me {
        return Err(runtime(format!(
            "refusing {}: owned by uid {}, not by uid {me} that runs shaper",
            dir.display(),
            meta.uid()
        )));
    }
    Ok(())
}

/// Who holds the lock, from /proc/locks: "pid 1234 (shaper class add ...)".
fn lock_holder() -> Option<String> {
    let meta = fs::metadata(LOCK_FILE).ok()?;
    let (major, minor) = (
        nix::sys::stat::major(meta.dev()),
        nix::sys::stat::minor(meta.dev()),
    );
    let wanted = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = fs::read_to_string("/proc/locks").ok()?;
    let pid = locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 1234 00:1a:567 0 EOF"; a waiter's line has "->".
        (fields.get(1) == Some(&"FLOCK") && fields.get(5) == Some(&wanted.as_str()))
            .then(|| fields.get(4).map(|p| p.to_string()))
            .flatten()
    })?;
    let command = fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|part| !part.is_empty())
                .map(|part| String::from_utf8_lossy(part).to_string())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Some(if command.is_empty() {
        format!("pid {pid}")
    } else {
        format!("pid {pid} ({command})")
    })
}

/// Removes the empty directories above `dir` up to the bpffs mount.
pub(super) fn remove_empty_parents(dir: &Path) {
    let mut current = dir.parent();
    while let Some(parent) = current {
        if parent == Path::new(BPFFS) || fs::remove_dir(parent).is_err() {
            break;
        }
        current = parent.parent();
    }
}
