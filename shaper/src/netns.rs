//! Named network namespaces (`ip netns`) and interface lookup.
//!
//! `--netns NAME` moves this process into `/run/netns/NAME` with setns(2): netlink and
//! interface lookups then see that namespace, while the mount namespace (and so the
//! host's bpffs with shaper's pins) stays the host's. `ip netns exec` would instead give
//! the command a private /sys, and pins made there vanish when it exits.

use crate::error::runtime;
use anyhow::Result;
use nix::sched::{setns, CloneFlags};
use std::fs::File;

/// Named namespaces live here (`ip netns add`).
pub(crate) const NETNS_RUN_DIR: &str = "/run/netns";

/// Whether the named network namespace exists.
pub fn netns_exists(name: &str) -> bool {
    check_netns_name(name).is_ok() && std::path::Path::new(NETNS_RUN_DIR).join(name).exists()
}

/// A name `ip netns` could have made: not empty, no `/`, not `.` or `..`.
pub fn check_netns_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.len() > 255 {
        return Err(crate::error::usage(format!(
            "bad network namespace name '{name}'"
        )));
    }
    Ok(())
}

pub fn enter(name: &str) -> Result<()> {
    check_netns_name(name)?;
    let path = format!("{NETNS_RUN_DIR}/{name}");
    let file = File::open(&path)
        .map_err(|_| runtime(format!("network namespace '{name}' not found (no {path})")))?;
    setns(file, CloneFlags::CLONE_NEWNET)
        .map_err(|e| runtime(format!("cannot enter network namespace '{name}': {e}")))?;
    Ok(())
}

/// `ip netns exec NAME shaper …` runs shaper in a mount namespace of its own with /sys
/// mounted afresh, without the host's bpffs: pins made there would vanish when the command
/// exits. Seen as: no bpffs on /sys/fs/bpf, a mount namespace other than the parent
/// process's (the shell `ip` was run from: `ip netns exec` execs the command), and the
/// network namespace of `/run/netns/NAME` (same inode); a sandbox that keeps the bpffs
/// (systemd's) is left alone. shaper then goes back to the parent's mount namespace (its
/// working directory kept) and goes on as `--netns NAME`: `Some(NAME)`. Where it cannot,
/// it refuses in one line naming `--netns`. `None` when not run so.
pub fn leave_ip_netns_exec() -> Result<Option<String>> {
    use std::os::unix::fs::MetadataExt;
    if bpffs_mounted_here() {
        return Ok(None);
    }
    let id = |path: &str| std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
    let parent = format!("/proc/{}/ns/mnt", nix::unistd::getppid());
    let ours = id("/proc/self/ns/mnt");
    if ours.is_none() || ours == id(&parent) {
        return Ok(None);
    }
    let here = id("/proc/thread-self/ns/net");
    let Ok(entries) = std::fs::read_dir(NETNS_RUN_DIR) else {
        return Ok(None);
    };
    let Some(name) = entries
        .filter_map(|entry| entry.ok())
        .find(|entry| here.is_some() && id(&entry.path().to_string_lossy()) == here)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
    else {
        // Another private mount namespace, without a named network namespace.
        return Ok(None);
    };
    let refuse = |why: String| {
        runtime(format!(
            "shaper runs under `ip netns exec {name}`, whose private /sys loses shaper's pins when \
             it exits, and cannot return to the host's mount namespace ({why}): run \
             `shaper --netns {name} ...` instead"
        ))
    };
    let cwd = std::env::current_dir().ok();
    let host = File::open(&parent).map_err(|e| refuse(format!("{parent}: {e}")))?;
    setns(host, CloneFlags::CLONE_NEWNS).map_err(|e| refuse(e.to_string()))?;
    // Joining a mount namespace moves the working directory to its root.
    if let Some(cwd) = cwd {
        let _ = std::env::set_current_dir(cwd);
    }
    log::debug!(
        "under `ip netns exec {name}`: back in the host's mount namespace, as --netns {name}"
    );
    Ok(Some(name))
}

/// Whether this mount namespace has a bpffs on /sys/fs/bpf (`/proc/self/mountinfo`: the
/// mount point is the fifth field, the file system type the first after ` - `).
fn bpffs_mounted_here() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|mounts| {
        mounts.lines().any(|line| {
            let mount_point = line.split(' ').nth(4);
            let fs_type = line
                .split_once(" - ")
                .and_then(|(_, rest)| rest.split(' ').next());
            mount_point == Some("/sys/fs/bpf") && fs_type == Some("bpf")
        })
    })
}

/// The longest interface name Linux takes (IFNAMSIZ - 1).
pub const IFNAME_MAX: usize = 15;

/// Checks an interface name as the kernel's `dev_valid_name` does: 1-15 bytes, not `.` or
/// `..`, no `/`, `:` or white space. Interface names become paths under the pin root, so
/// every command checks them before anything touches the filesystem.
pub fn check_ifname(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= IFNAME_MAX
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
    if valid {
        Ok(())
    } else {
        Err(crate::error::usage(format!(
            "'{name}' is not an interface name (1-{IFNAME_MAX} characters, no '/', ':' or spaces)"
        )))
    }
}

/// Link types (`ARPHRD_*`, if_arp.h) whose frames start with an Ethernet header.
const ETHERNET_LINKS: &[(u16, &str)] = &[(1, "Ethernet"), (772, "loopback")];
/// Link types whose packets start at the IP header: the program reads the protocol from
/// `skb->protocol`.
const L3_LINKS: &[(u16, &str)] = &[
    (0xfffe, "none (tun, wireguard)"),
    (519, "raw IP"),
    (512, "PPP"),
    (768, "IPIP tunnel"),
    (769, "IPv6 tunnel"),
    (776, "SIT tunnel"),
];

/// Bytes of link-layer header before the IP header on `dev` (in the current namespace):
/// 14 on Ethernet, 0 on devices that carry bare IP. Any other link type (GRE with its
/// header ops, InfiniBand, CAN, …) is refused, so nothing is attached that would let its
/// traffic pass unparsed.
pub fn link_header_len(dev: &str) -> Result<u32> {
    let link_type = link_type(dev)?;
    if ETHERNET_LINKS.iter().any(|(kind, _)| *kind == link_type) {
        return Ok(14);
    }
    if L3_LINKS.iter().any(|(kind, _)| *kind == link_type) {
        return Ok(0);
    }
    let supported: Vec<&str> = ETHERNET_LINKS
        .iter()
        .chain(L3_LINKS)
        .map(|(_, name)| *name)
        .collect();
    Err(runtime(format!(
        "interface '{dev}' has link type {link_type}, whose frames shaper cannot parse; supported: {}",
        supported.join(", ")
    )))
}

/// The device's `ARPHRD_*` link type, by SIOCGIFHWADDR on a socket of this namespace.
fn link_type(dev: &str) -> Result<u16> {
    use nix::libc;
    check_ifname(dev)?;
    // SAFETY: a plain datagram socket, closed by OwnedFd.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(runtime(format!(
            "cannot open a socket to read the link type of '{dev}': {}",
            std::io::Error::last_os_error()
        )));
    }
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    // SAFETY: ifreq is plain old data; the name fits (checked above) with its NUL.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(dev.bytes()) {
        *slot = byte as libc::c_char;
    }
    let done = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SIOCGIFHWADDR,
            &mut request,
        )
    };
    if done < 0 {
        return Err(runtime(format!("interface '{dev}' not found")));
    }
    Ok(unsafe { request.ifr_ifru.ifru_hwaddr.sa_family })
}

/// The interface's index in the current namespace, or a one-line error.
pub fn ifindex(dev: &str) -> Result<u32> {
    nix::net::if_::if_nametoindex(dev).map_err(|_| runtime(format!("interface '{dev}' not found")))
}

/// Runs `work` inside the network namespace at `path` (a CNI runtime's CNI_NETNS, e.g.
/// /proc/PID/ns/net or /var/run/netns/NAME) and comes back.
pub(crate) fn in_path<T>(path: &str, work: impl FnOnce() -> Result<T>) -> Result<T> {
    round_trip(
        || {
            let target = File::open(path)
                .map_err(|e| runtime(format!("network namespace {path} not found: {e}")))?;
            setns(target, CloneFlags::CLONE_NEWNET)
                .map_err(|e| runtime(format!("cannot enter network namespace {path}: {e}")))
        },
        work,
    )
}

/// Runs `work` inside the named namespace (or the current one for `None`) and comes back.
pub fn in_namespace<T>(netns: &Option<String>, work: impl FnOnce() -> Result<T>) -> Result<T> {
    match netns {
        None => work(),
        Some(name) => round_trip(|| enter(name), work),
    }
}

/// `go` moves this thread into another network namespace; `work` runs there, then the
/// thread returns to the namespace it came from. Its own: `/proc/self` names the main
/// thread, which may be inside another namespace at that moment (the daemon's plan while
/// a scrape renders on another thread), and would take this thread there.
fn round_trip<T>(go: impl FnOnce() -> Result<()>, work: impl FnOnce() -> Result<T>) -> Result<T> {
    let home = File::open("/proc/thread-self/ns/net")
        .map_err(|e| runtime(format!("cannot open the current network namespace: {e}")))?;
    go()?;
    let result = work();
    setns(home, CloneFlags::CLONE_NEWNET).map_err(|e| {
        runtime(format!(
            "cannot return to the original network namespace: {e}"
        ))
    })?;
    result
}
