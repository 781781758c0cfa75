//! Removing what the lab made: a lab's namespaces on drop (the processes still inside,
//! shaper's attachments and pins, the namespaces), and, before a new lab is built, what
//! crashed earlier runs left behind (`sweep_stale`, run by [`crate::Lab::new`]).

use crate::{
    cni::{
        CNI_CLAIM_DIR, CNI_CLAIM_PREFIX, CNI_IPAM_PREFIX, CNI_RECORD_DIR,
        CNI_TEST_CONTAINER_PREFIXES,
    },
    process::{output_bounded, shaper_bin, COMMAND_LIMIT},
    redis::REDIS_TLS_PREFIX,
    redis_cluster::CLUSTER_PREFIX,
    sentinel::SENTINEL_PREFIX,
    topology::{NAME_PREFIX, PIN_ROOT},
};
use std::{
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

/// The pids of the processes inside namespace `name` (`ip netns pids`).
fn pids_in(name: &str) -> Vec<u32> {
    let own = std::process::id();
    output_bounded(
        Command::new("ip").args(["netns", "pids", name]),
        Duration::from_secs(10),
    )
    .map(|out| {
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|pid| pid.parse().ok())
            .filter(|pid| *pid != own)
            .collect()
    })
    .unwrap_or_default()
}

/// SIGKILLs every process inside namespace `name` and waits (at most 3 s) until none is
/// left. Returns the pids still there at the deadline.
fn kill_processes_in(name: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let pids = pids_in(name);
        if pids.is_empty() || Instant::now() >= deadline {
            return pids;
        }
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let _ = output_bounded(
            Command::new("kill").arg("-KILL").args(&pids),
            Duration::from_secs(5),
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Kills what still runs inside `name`, detaches shaper there, removes its pins, deletes
/// the namespace.
pub(crate) fn remove_namespace(name: &str) {
    if Path::new("/run/netns").join(name).exists() {
        let left = kill_processes_in(name);
        if !left.is_empty() {
            eprintln!("lab: processes {left:?} survived SIGKILL in namespace {name}");
        }
    }
    remove_namespace_pins(name);
    let _ = output_bounded(
        Command::new("ip").args(["netns", "del", name]),
        Duration::from_secs(30),
    );
}

/// Detaches shaper from every interface it has pins for in namespace `name` (which may
/// be gone: `detach` then only removes the pins), then removes what is left of the pins.
fn remove_namespace_pins(name: &str) {
    let pin_dir = Path::new(PIN_ROOT).join(format!("netns-{name}"));
    if let Ok(devs) = std::fs::read_dir(&pin_dir) {
        for dev in devs.flatten() {
            let dev = dev.file_name().to_string_lossy().to_string();
            let _ = output_bounded(
                Command::new(shaper_bin()).args(["--netns", name, "detach", &dev]),
                COMMAND_LIMIT,
            );
        }
    }
    // Whatever detach could not remove (a missing binary, a half-made attachment).
    let _ = std::fs::remove_dir_all(&pin_dir);
    // And the records of which build pinned programs whose pins are gone
    // (`/run/shaper/builds/`, each named by its pin directory's path with `%` for `/`).
    for record in names_in(BUILD_RECORDS) {
        if !Path::new(&record.replace('%', "/")).exists() {
            let _ = std::fs::remove_file(Path::new(BUILD_RECORDS).join(record));
        }
    }
}

/// Where shaper notes which build pinned each attachment's program.
const BUILD_RECORDS: &str = "/run/shaper/builds";

/// The pid in a lab name `shp<pid>x<n>-…`.
fn lab_pid(name: &str) -> Option<u32> {
    let (pid, _) = name.strip_prefix(NAME_PREFIX)?.split_once('x')?;
    pid.parse().ok()
}

/// The pid in `<prefix><pid>[-…]`, for one of `prefixes`.
fn pid_after_prefix(name: &str, prefixes: &[&str]) -> Option<u32> {
    let rest = prefixes.iter().find_map(|p| name.strip_prefix(p))?;
    let digits = rest.split('-').next()?;
    digits.parse().ok()
}

fn process_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The names of the current network namespaces (`ip netns list`).
fn namespaces() -> Vec<String> {
    output_bounded(
        Command::new("ip").args(["netns", "list"]),
        Duration::from_secs(10),
    )
    .map(|out| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next().map(str::to_string))
            .collect()
    })
    .unwrap_or_default()
}

fn names_in(dir: impl AsRef<Path>) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().to_string())
        .collect()
}

/// Whether an interface `dev` exists in the host's namespace or in any named one. When
/// a namespace cannot be asked, the answer is yes (nothing is removed on a doubt).
fn interface_exists_anywhere(dev: &str) -> bool {
    if Path::new("/sys/class/net").join(dev).exists() {
        return true;
    }
    namespaces().iter().any(|ns| {
        match output_bounded(
            Command::new("ip").args(["-n", ns, "-o", "link", "show", "dev", dev]),
            Duration::from_secs(10),
        ) {
            Ok(out) => out.status.success(),
            Err(_) => true,
        }
    })
}

/// Removes what lab runs whose process is gone left behind: their namespaces (with the
/// processes still inside and shaper's pins), pins of their namespaces that are already
/// gone, their CNI records, claims and IPAM directories, and host pins of the interfaces
/// those CNI runs recorded or claimed, once no namespace has such an interface any more.
/// Everything is found by a name carrying a dead run's pid, never by the shape of a name
/// (a production bridge plugin names its veths as the tests' do).
pub(crate) fn sweep_stale() {
    // Namespaces of dead runs.
    for name in namespaces() {
        if lab_pid(&name).is_some_and(|pid| !process_alive(pid)) {
            remove_namespace(&name);
        }
    }
    // Pins of lab namespaces that are gone, of dead runs only (a live test may delete a
    // namespace on purpose and look at its pins).
    for entry in names_in(PIN_ROOT) {
        let Some(name) = entry.strip_prefix("netns-") else {
            continue;
        };
        if lab_pid(name).is_some_and(|pid| !process_alive(pid))
            && !Path::new("/run/netns").join(name).exists()
        {
            remove_namespace_pins(name);
        }
    }
    // Host-side interfaces dead runs attached to, by their CNI records and their claims
    // (both in root's own /run/shaper): their `host/<dev>` pins go once the interface
    // exists nowhere; a record or claim stays until then (its pins are still there).
    let evidence = [
        (CNI_RECORD_DIR, &CNI_TEST_CONTAINER_PREFIXES[..]),
        (CNI_CLAIM_DIR, &[CNI_CLAIM_PREFIX][..]),
    ];
    for (dir, prefixes) in evidence {
        for name in names_in(dir) {
            if pid_after_prefix(&name, prefixes).is_none_or(process_alive) {
                continue;
            }
            let path = Path::new(dir).join(&name);
            // A CNI record's first line is the host veth (a second may name the
            // container's interface, which went with its namespace).
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let dev = text.lines().next().unwrap_or_default().trim();
            if dev.is_empty() || dev.contains('/') || dev.starts_with('.') {
                let _ = std::fs::remove_file(&path);
            } else if !interface_exists_anywhere(dev) {
                let _ = std::fs::remove_dir_all(Path::new(PIN_ROOT).join("host").join(dev));
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    // host-local's leases, TLS Redis servers' keys, clusters' and sentinels' files of dead
    // test runs.
    for name in names_in(std::env::temp_dir()) {
        if pid_after_prefix(
            &name,
            &[
                CNI_IPAM_PREFIX,
                REDIS_TLS_PREFIX,
                CLUSTER_PREFIX,
                SENTINEL_PREFIX,
            ],
        )
        .is_some_and(|pid| !process_alive(pid))
        {
            let _ = std::fs::remove_dir_all(std::env::temp_dir().join(name));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{cni::cni_record_path, process::wait_bounded, Lab};

    /// A one-shot iperf3 server that never gets its client (as with a TCP bug) ends in an
    /// error at the bound, not in a hang; and dropping the lab kills what runs inside.
    #[test]
    fn a_server_without_client_is_killed_at_the_bound() {
        let lab = Lab::new().unwrap();
        let mut server = lab.iperf_server(5999).unwrap();
        let started = Instant::now();
        let error = wait_bounded(&mut server, Duration::from_secs(2)).unwrap_err();
        println!("{error:#} after {:.1} s", started.elapsed().as_secs_f64());
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(pids_in(&lab.server.name).is_empty());

        // Left running on purpose: the lab's drop must kill it.
        let mut stray = lab.router.command("sleep").arg("300").spawn().unwrap();
        // (`ip netns exec` enters the namespace a moment after the spawn.)
        let deadline = Instant::now() + Duration::from_secs(2);
        while pids_in(&lab.router.name).is_empty() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pids_in(&lab.router.name), vec![stray.id()]);
        let router = lab.router.name.clone();
        drop(lab);
        assert!(wait_bounded(&mut stray, Duration::from_secs(2)).is_ok());
        assert!(!Path::new("/run/netns").join(router).exists());
    }

    #[test]
    fn the_sweep_recognises_only_what_tests_make() {
        assert_eq!(lab_pid("shp1234x0-router"), Some(1234));
        assert_eq!(lab_pid("shp1234x0-router-gone"), Some(1234));
        // The delay line's namespace (Lab::with_delay) is swept like the others.
        assert_eq!(lab_pid("shp1234x0-delay"), Some(1234));
        assert_eq!(lab_pid("cni-1234"), None);
        let prefixes = &CNI_TEST_CONTAINER_PREFIXES;
        assert_eq!(pid_after_prefix("shaper-test-77-eth1", prefixes), Some(77));
        assert_eq!(pid_after_prefix("shaper-bench-77-s0", prefixes), Some(77));
        assert_eq!(pid_after_prefix("k8s-pod-77-eth0", prefixes), None);
        assert_eq!(
            pid_after_prefix("shaper-test-ipam-9", &[CNI_IPAM_PREFIX]),
            Some(9)
        );
        assert_eq!(
            pid_after_prefix("shaper-redis-tls-9-0", &[REDIS_TLS_PREFIX]),
            Some(9)
        );
        assert_eq!(pid_after_prefix("claim-9-3", &[CNI_CLAIM_PREFIX]), Some(9));
        // A bridge plugin's veth carries no run's token: never a candidate by its name.
        assert_eq!(pid_after_prefix("veth0a1b2c3d", &[CNI_CLAIM_PREFIX]), None);
        assert_eq!(
            cni_record_path("shaper-test-5", "eth1"),
            Path::new("/run/shaper/cni/shaper-test-5-eth1")
        );
    }
}
