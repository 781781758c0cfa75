//! This daemon among those that report for one host id: the allocator refuses a second
//! daemon's reports while another one with the same host id reports (a cloned host).
//! A daemon restarted on the same host (SIGTERM or SIGKILL, then started again, as
//! `systemctl restart` does) is no clone: it takes over the instance of the one before
//! it, kept in `/run/shaper/global-HOST.instance` with that daemon's pid and start time,
//! when that process is gone, so Redis goes on answering it without a pause (a new
//! instance would be refused until the old one's stamp aged out, three intervals at the
//! floor). A daemon that finds the recorded one still running is a second daemon for
//! the host id, and gets an instance of its own (which the allocator refuses).

use std::path::{Path, PathBuf};

/// A process, by its pid and its start time (clock ticks after boot, `/proc/PID/stat`):
/// a pid reused by another process does not pass for the one recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    pid: u32,
    started: u64,
}

impl Holder {
    fn of(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some(Self {
            pid,
            started: start_time(&stat)?,
        })
    }

    fn running(self) -> bool {
        Self::of(self.pid) == Some(self)
    }
}

/// Field 22 of `/proc/PID/stat` (the command in field 2 may hold spaces and parentheses:
/// counted from the last `)`).
fn start_time(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The instance this process reports as for `host_id`: taken once per host id for the
/// process's life (a coordinator made again after a reconnect or a reload reports as the
/// same, a clone's fresh instance included).
pub fn for_host(host_id: &str) -> String {
    static TAKEN: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, instance)) = taken.iter().find(|(id, _)| id == host_id) {
        return instance.clone();
    }
    let instance = take(host_id);
    taken.push((host_id.to_string(), instance.clone()));
    instance
}

/// The instance of the daemon before this one, when it is gone; else a new one.
fn take(host_id: &str) -> String {
    let path = record_path(host_id);
    let own = Holder::of(std::process::id());
    let recorded = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| parse(&text));
    // Another daemon running for the host id keeps the record: this one is the clone.
    let other_running = recorded
        .as_ref()
        .is_some_and(|(holder, _)| Some(*holder) != own && holder.running());
    let kept = recorded
        .filter(|_| !other_running)
        .map(|(_, instance)| instance);
    let instance = kept.clone().unwrap_or_else(fresh);
    if let (Some(own), false) = (own, other_running) {
        if let Err(error) = record(&path, own, &instance) {
            log::warn!(
                "cannot keep this daemon's instance in {} ({error:#}): a restart will wait for the old one's reports to age out",
                path.display()
            );
        }
    }
    if kept.is_some() {
        log::info!("global classes: reporting as the instance of the daemon before this one for host '{host_id}'");
    }
    instance
}

fn record_path(host_id: &str) -> PathBuf {
    Path::new(crate::state::RUN_DIR).join(format!("global-{host_id}.instance"))
}

/// `PID STARTED INSTANCE`.
fn parse(text: &str) -> Option<(Holder, String)> {
    let mut words = text.split_whitespace();
    let holder = Holder {
        pid: words.next()?.parse().ok()?,
        started: words.next()?.parse().ok()?,
    };
    let instance = words.next()?;
    (instance.len() <= 32 && instance.chars().all(|c| c.is_ascii_alphanumeric()))
        .then(|| (holder, instance.to_string()))
}

fn record(path: &Path, holder: Holder, instance: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    crate::state::ensure_private_dir(Path::new(crate::state::RUN_DIR))?;
    // Written whole under another name and renamed: a reader never sees half of it.
    let partial = path.with_extension("partial");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&partial)?;
    writeln!(file, "{} {} {instance}", holder.pid, holder.started)?;
    std::fs::rename(&partial, path)?;
    Ok(())
}

/// A new instance: this process's pid and the time now, in hex.
fn fresh() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("{:x}{:x}", std::process::id(), now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_time_is_read_past_a_command_with_spaces_and_parentheses() {
        let stat =
            "4242 (shaper (d) x) S 1 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 0 0";
        assert_eq!(start_time(stat), Some(987_654));
        assert_eq!(start_time("4242 (x) S 1"), None);
    }

    #[test]
    fn this_process_is_running_and_a_recorded_one_that_ended_is_not() {
        let own = Holder::of(std::process::id()).unwrap();
        assert!(own.running());
        assert!(
            !Holder {
                started: own.started + 1,
                ..own
            }
            .running(),
            "a reused pid"
        );
        assert!(!Holder {
            pid: u32::MAX,
            started: 1
        }
        .running());
    }

    #[test]
    fn a_record_reads_back_and_junk_does_not() {
        let holder = Holder {
            pid: 7,
            started: 99,
        };
        assert_eq!(parse("7 99 abc123\n"), Some((holder, "abc123".into())));
        for junk in ["", "7 99", "x 99 abc", "7 99 a/b", "7 99 ../../etc"] {
            assert_eq!(parse(junk), None, "{junk}");
        }
    }
}
