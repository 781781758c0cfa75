//! Safety of the host (issue 11, items 6-10): the state lock is root-only and waits a
//! bounded time, interface names never become paths outside the pin root, the pin root
//! must be root's (checked in a private bpffs: the host's pin root is never handed to
//! another user, issue 34), a root qdisc the user made is never replaced, and a program
//! unhooked behind shaper's back is shown stale and repaired. Every wait is bounded.

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;
use shaper_tests::{
    assert_within, counter, dies_with_parent, process::lines_of, shaper, shaper_bin, stderr,
    wait_bounded, BoundedCommand, Lab, Netns, StateLockHolder, ROUTER_TO_SERVER,
    STATE_LOCK_FILE as LOCK_FILE,
};
use std::{
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

const RUN_DIR: &str = "/run/shaper";
const PIN_ROOT: &str = "/sys/fs/bpf/shaper";

fn classes(ns: &Netns) -> Result<Vec<Value>> {
    Ok(ns
        .shaper_json(&["class", "list", "--json"])?
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// `class add x` on the router, waiting at most `seconds` for the state lock.
fn add_x_waiting(router: &Netns, seconds: &str) -> std::process::Output {
    router.shaper_output(&[
        "--wait",
        seconds,
        "class",
        "add",
        "x",
        "--dev",
        ROUTER_TO_SERVER,
        "--rate",
        "1mbit",
    ])
}

#[test]
fn the_state_lock_is_root_only_waits_a_bounded_time_and_names_its_holder() -> Result<()> {
    let lab = Lab::new()?;
    lab.router.attach(ROUTER_TO_SERVER, &[])?;
    let dir = std::fs::metadata(RUN_DIR)?;
    let file = std::fs::metadata(LOCK_FILE)?;
    println!(
        "{RUN_DIR}: uid {} mode {:o}; {LOCK_FILE}: mode {:o}",
        dir.uid(),
        dir.permissions().mode() & 0o7777,
        file.permissions().mode() & 0o7777
    );
    ensure!(dir.uid() == 0 && dir.permissions().mode() & 0o077 == 0);
    ensure!(file.permissions().mode() & 0o077 == 0);

    // An unprivileged user cannot even open the lock (the reported denial of service).
    let nobody = Command::new("setpriv")
        .args(["--reuid", "nobody", "--regid", "nogroup", "--clear-groups"])
        .args(["flock", "--nonblock", LOCK_FILE, "true"])
        .output_within_limit()?;
    ensure!(!nobody.status.success(), "nobody could take {LOCK_FILE}");

    // Root's own long-running holder: a write waits --wait seconds, then one line.
    let holder = StateLockHolder::take()?;
    let started = Instant::now();
    let output = add_x_waiting(&lab.router, "1");
    let waited = started.elapsed();
    let message = stderr(&output);
    println!(
        "with the lock held: exit {:?} after {waited:?}: {message}",
        output.status.code()
    );
    ensure!(
        output.status.code() == Some(1),
        "exit {:?}",
        output.status.code()
    );
    let holder_pid = format!("pid {}", holder.0.id());
    ensure!(
        message.lines().count() == 1 && message.contains(&holder_pid),
        "{message}"
    );
    ensure!(message.contains("--wait"), "{message}");
    ensure!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "waited {waited:?} for a 1 s --wait"
    );
    ensure!(
        classes(&lab.router)?.is_empty(),
        "the class was added anyway"
    );
    // Read commands never take the lock.
    ensure!(lab.router.shaper_output(&["status"]).status.success());

    // Released while a writer waits: the writer goes on.
    let waiter = std::thread::spawn({
        let router = lab.router.clone();
        move || add_x_waiting(&router, "10")
    });
    std::thread::sleep(Duration::from_millis(500));
    drop(holder);
    let output = waiter.join().expect("waiter thread");
    ensure!(output.status.success(), "{}", stderr(&output));
    ensure!(classes(&lab.router)?.len() == 1);
    Ok(())
}

#[test]
fn interface_names_never_become_paths_outside_the_pin_root() -> Result<()> {
    let victim = std::env::temp_dir().join(format!("shaper-victim-{}", std::process::id()));
    std::fs::create_dir_all(victim.join("inner"))?;
    std::fs::write(victim.join("inner/keep"), "keep")?;
    let victim_text = victim.to_string_lossy().to_string();
    let relative = format!("../../../..{victim_text}");
    let gone_ns = format!("shp-gone-{}", std::process::id());
    let mut failures = Vec::new();
    for args in [
        // The reported case: a deleted namespace and an absolute path as the device.
        vec!["--netns", gone_ns.as_str(), "detach", victim_text.as_str()],
        vec!["--netns", gone_ns.as_str(), "detach", relative.as_str()],
        vec!["detach", victim_text.as_str()],
        vec!["attach", ".."],
        vec!["attach", "sixteen-chars-xx"],
        vec!["class", "add", "x", "--dev", "a/b", "--rate", "1mbit"],
        vec!["--netns", "../x", "status"],
    ] {
        let output = shaper(&args);
        let message = stderr(&output);
        println!(
            "{args:?}: exit {:?}: {}",
            output.status.code(),
            message.trim()
        );
        if output.status.code() != Some(2) || message.lines().count() != 1 {
            failures.push(format!(
                "{args:?}: exit {:?} {message}",
                output.status.code()
            ));
        }
    }
    let kept = std::fs::read_to_string(victim.join("inner/keep")).ok();
    let _ = std::fs::remove_dir_all(&victim);
    ensure!(
        kept.as_deref() == Some("keep"),
        "the victim directory was removed"
    );
    ensure!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// A private mount namespace with a bpffs of its own on /sys/fs/bpf, held by a process
/// that dies with this one: shaper run inside it (`nsenter --mount`) pins there, so a test
/// can hand its pin root to another user without ever touching the host's. Its pins, and
/// the programs they hold, go with it.
struct PrivateBpffs {
    holder: KilledOnDrop,
}

impl PrivateBpffs {
    /// Made after the lab: it sees the lab's namespaces as they were then.
    fn new() -> Result<Self> {
        let mut holder = dies_with_parent(&mut Command::new("unshare"))
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg("mount -t bpf bpf /sys/fs/bpf && echo ready && exec sleep 600")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?;
        let lines = lines_of(holder.stdout.take().context("no stdout")?);
        let sandbox = Self {
            holder: KilledOnDrop(holder),
        };
        match lines.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if line == "ready" => Ok(sandbox),
            other => bail!("the private bpffs did not come up: {other:?}"),
        }
    }

    /// `shaper ARGS` inside the private mount namespace.
    fn shaper(&self, args: &[&str]) -> Result<std::process::Output> {
        Command::new("nsenter")
            .arg(format!("--mount=/proc/{}/ns/mnt", self.holder.0.id()))
            .arg(shaper_bin())
            .args(args)
            .output_within_limit()
    }

    /// Where `path` of the private mount namespace is, seen from here.
    fn path(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{path}", self.holder.0.id()))
    }
}

/// The pin root must be root's and private: someone else's is refused (a user could
/// otherwise plant pins), a loose mode of root's own is tightened. Run in a private bpffs,
/// so the host's pin root never changes hands, even when the test is killed half-way.
#[test]
fn the_pin_root_must_be_roots_and_private() -> Result<()> {
    let lab = Lab::new()?;
    let sandbox = PrivateBpffs::new()?;
    let router = lab.router.name.as_str();
    let in_sandbox = |args: &[&str]| -> Result<std::process::Output> {
        sandbox.shaper(&[&["--netns", router][..], args].concat())
    };
    let attached = in_sandbox(&["attach", ROUTER_TO_SERVER])?;
    ensure!(attached.status.success(), "{}", stderr(&attached));
    let pin_root = sandbox.path(PIN_ROOT);
    ensure!(
        !Path::new(PIN_ROOT).join(format!("netns-{router}")).exists(),
        "the attachment pinned in the host's bpffs"
    );
    let root = std::fs::metadata(&pin_root)?;
    println!(
        "private {PIN_ROOT}: uid {} mode {:o}",
        root.uid(),
        root.mode() & 0o7777
    );
    ensure!(
        root.uid() == 0 && root.mode() & 0o077 == 0,
        "pin root is not private"
    );
    let add_x = || {
        in_sandbox(&[
            "--wait",
            "10",
            "class",
            "add",
            "x",
            "--dev",
            ROUTER_TO_SERVER,
            "--rate",
            "1mbit",
        ])
    };

    // Someone else's pin root is refused.
    std::os::unix::fs::chown(&pin_root, Some(65534), None)?;
    let output = add_x()?;
    let message = stderr(&output);
    println!(
        "foreign pin root: exit {:?}: {}",
        output.status.code(),
        message.trim()
    );
    ensure!(output.status.code() == Some(1) && message.contains("owned by uid 65534"));
    std::os::unix::fs::chown(&pin_root, Some(0), None)?;

    // A loose mode of our own is tightened.
    std::fs::set_permissions(&pin_root, std::fs::Permissions::from_mode(0o777))?;
    let output = add_x()?;
    ensure!(output.status.success(), "{}", stderr(&output));
    let mode = std::fs::metadata(&pin_root)?.mode() & 0o7777;
    ensure!(mode == 0o700, "pin root left at mode {mode:o}");
    Ok(())
}

/// The root qdisc of `dev` in `ns`: (kind, handle, limit).
fn root_qdisc(ns: &Netns, dev: &str) -> Result<(String, String, Option<u64>)> {
    let out = ns.run("tc", &["-j", "qdisc", "show", "dev", dev, "root"])?;
    let json: Value = serde_json::from_slice(&out.stdout)?;
    let root = &json[0];
    Ok((
        root["kind"].as_str().unwrap_or_default().to_string(),
        root["handle"].as_str().unwrap_or_default().to_string(),
        root["options"]["limit"].as_u64(),
    ))
}

#[test]
fn shape_never_replaces_a_root_qdisc_the_user_made() -> Result<()> {
    let lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.run(
        "tc",
        &["qdisc", "add", "dev", dev, "root", "pfifo", "limit", "50"],
    )?;
    let before = root_qdisc(&lab.router, dev)?;
    println!("the user's root: {before:?}");
    ensure!(before.0 == "pfifo" && before.2 == Some(50));
    lab.router.attach(dev, &[])?;
    let output = lab.router.shaper_output(&[
        "class", "add", "s", "--dev", dev, "--rate", "10mbit", "--action", "shape",
    ]);
    let message = stderr(&output);
    println!(
        "shape class: exit {:?}: {}",
        output.status.code(),
        message.trim()
    );
    ensure!(output.status.code() == Some(1) && message.lines().count() == 1);
    ensure!(message.contains("pfifo"), "{message}");
    ensure!(
        root_qdisc(&lab.router, dev)? == before,
        "the user's root changed"
    );
    ensure!(classes(&lab.router)?.is_empty());
    // A drop class does not need the root and works beside it.
    lab.router.class_add("d", dev, &["--rate", "10mbit"])?;
    lab.router.shaper(&["detach", dev])?;
    ensure!(
        root_qdisc(&lab.router, dev)? == before,
        "detach changed the user's root"
    );

    // The kernel's own root (noqueue 0: on a veth) is replaced, and comes back on detach.
    lab.router
        .run("tc", &["qdisc", "del", "dev", dev, "root"])?;
    let kernel = root_qdisc(&lab.router, dev)?;
    println!("the kernel's root: {kernel:?}");
    ensure!(kernel.1 == "0:");
    lab.router.attach(dev, &[])?;
    lab.router
        .class_add("s", dev, &["--rate", "10mbit", "--action", "shape"])?;
    ensure!(root_qdisc(&lab.router, dev)?.1 == "5348:");
    lab.router.shaper(&["detach", dev])?;
    ensure!(root_qdisc(&lab.router, dev)? == kernel);
    Ok(())
}

#[test]
fn an_unhooked_clsact_program_is_shown_stale_and_repaired() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &["--attach-mode", "clsact"])?;
    lab.router
        .class_add("udp", dev, &["--rate", "1mbit", "--proto", "udp"])?;
    let policed = lab.udp_delivered_bps()?;
    assert_within("policed", policed, 1e6, 0.05);

    // Someone deletes the clsact qdisc: the program is no longer in the path.
    lab.router
        .run("tc", &["qdisc", "del", "dev", dev, "clsact"])?;
    let state = lab.router.status_row()?;
    println!("after tc qdisc del clsact: {state}");
    ensure!(state["live"] == false && state["problem"] == "program unhooked");
    let unpoliced = lab.udp_delivered_bps()?;
    println!("unhooked: {:.2} Mbit/s delivered", unpoliced / 1e6);
    ensure!(unpoliced > 5e6, "traffic was still policed: {unpoliced}");
    let passed_before = counter(&lab.router.stats_row("udp")?, "passed_packets");

    // `attach` repairs it, keeping the class and its counters.
    let out = lab.router.attach(dev, &[])?;
    ensure!(out.contains("re-attached"), "{out}");
    ensure!(lab.router.status_row()?["live"] == true);
    assert_within("policed again", lab.udp_delivered_bps()?, 1e6, 0.05);
    ensure!(counter(&lab.router.stats_row("udp")?, "passed_packets") > passed_before);

    // `apply` (the daemon's plan, run every tick) repairs it too.
    let exported = lab.router.shaper(&["export"])?;
    lab.router
        .run("tc", &["qdisc", "del", "dev", dev, "clsact"])?;
    ensure!(lab.router.status_row()?["live"] == false);
    let file = std::env::temp_dir().join(format!("shaper-clsact-{}.toml", std::process::id()));
    std::fs::write(&file, exported)?;
    let applied = shaper(&["apply", "-f", &file.to_string_lossy()]);
    let _ = std::fs::remove_file(&file);
    let plan = String::from_utf8_lossy(&applied.stdout).to_string();
    println!("apply: {plan}");
    ensure!(
        applied.status.success() && plan.contains("reattach"),
        "{}",
        stderr(&applied)
    );
    ensure!(lab.router.status_row()?["live"] == true);
    assert_within("policed after apply", lab.udp_delivered_bps()?, 1e6, 0.05);
    Ok(())
}

#[test]
fn an_attachment_in_a_deleted_namespace_is_stale_not_an_error() -> Result<()> {
    let lab = Lab::new()?;
    // Named like the lab's namespaces, so a crashed run's leftovers are swept too.
    let ns = format!("{}-gone", lab.router.name);
    let run = |args: &[&str]| Command::new("ip").args(args).succeed_within_limit();
    run(&["netns", "add", &ns])?;
    let cleanup = scopeguard(&ns);
    run(&[
        "-n", &ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
    ])?;
    let attach = shaper(&["--netns", &ns, "attach", "v0"]);
    ensure!(attach.status.success(), "{}", stderr(&attach));
    lab.router.attach(ROUTER_TO_SERVER, &[])?;
    run(&["netns", "del", &ns])?;

    // The machine-wide status still works and shows the orphan, with what to do.
    let status = shaper(&["status", "--json"]);
    ensure!(status.status.success(), "{}", stderr(&status));
    let rows: Value = serde_json::from_slice(&status.stdout)?;
    let orphan: Vec<&Value> = rows
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["netns"] == ns.as_str())
        .collect();
    println!("orphans: {orphan:?}");
    ensure!(!orphan.is_empty() && orphan.iter().all(|r| r["problem"] == "namespace gone"));
    ensure!(shaper(&["--netns", &ns, "status"]).status.success());
    let forget = shaper(&["--netns", &ns, "detach", "v0"]);
    ensure!(forget.status.success(), "{}", stderr(&forget));
    ensure!(!Path::new(PIN_ROOT).join(format!("netns-{ns}")).exists());
    // Now the name is unknown: an error, not "not attached anywhere".
    let typo = shaper(&["--netns", &ns, "status"]);
    ensure!(typo.status.code() == Some(1), "{}", stderr(&typo));
    drop(cleanup);
    Ok(())
}

/// Deletes the namespace and its pins when dropped (also on failure).
struct NamespaceGuard(String);

fn scopeguard(ns: &str) -> NamespaceGuard {
    NamespaceGuard(ns.to_string())
}

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.0])
            .output_within_limit();
        let _ = std::fs::remove_dir_all(Path::new(PIN_ROOT).join(format!("netns-{}", self.0)));
    }
}

/// Set in the child that [`a_run_killed_outright_leaves_the_host_as_it_was`] kills.
const VICTIM: &str = "SHAPER_TEST_KILLED_CHILD";

/// What a test run killed with SIGKILL leaves (its drops never run): nothing but what
/// the next run's sweep removes. The test runs itself again as a child that builds a lab
/// with a delay line, attaches shaper in the host's bpffs and in a private one whose pin
/// root it hands to another user, and starts a redis-server, saying when each stage is
/// done; it is killed after each stage in turn. Then: the host's pin root is still root's
/// and 0700, no process is left in the child's namespaces, its redis-server is gone, and
/// the next lab's sweep removes its namespaces and pins.
#[test]
fn a_run_killed_outright_leaves_the_host_as_it_was() -> Result<()> {
    if std::env::var_os(VICTIM).is_some() {
        return be_killed();
    }
    for stage in ["pin root handed over", "redis-server up"] {
        // Dies with this test too, and is killed on any early return (the guard).
        let mut child = KilledOnDrop(
            dies_with_parent(&mut Command::new(std::env::current_exe()?))
                .args([
                    "--exact",
                    "a_run_killed_outright_leaves_the_host_as_it_was",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(VICTIM, "1")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()?,
        );
        let lines = lines_of(child.0.stdout.take().context("no stdout")?);
        let mut redis = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let line = lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .with_context(|| format!("the child never reached {stage:?}"))?;
            // libtest prints the test's name in front of its first line.
            let Some(said) = line.find("victim: ").map(|at| &line[at..]) else {
                continue;
            };
            if let Some(pid) = said.strip_prefix("victim: redis-server ") {
                redis = Some(pid.trim().to_string());
            }
            if said == format!("victim: {stage}") {
                break;
            }
        }
        let victim = child.0.id();
        child.0.kill()?;
        wait_bounded(&mut child.0, Duration::from_secs(5))?;
        println!("killed the child {victim} once {stage}");

        let root = std::fs::metadata(PIN_ROOT)?;
        ensure!(
            root.uid() == 0 && root.mode() & 0o7777 == 0o700,
            "after the kill the host's pin root is uid {} mode {:o}",
            root.uid(),
            root.mode() & 0o7777
        );
        // Its namespaces' processes (the delay line, iperf3 servers) die with it.
        let prefix = format!("shp{victim}x");
        let namespaces = || -> Result<Vec<String>> {
            let listed = Command::new("ip")
                .args(["netns", "list"])
                .succeed_within_limit()?;
            Ok(String::from_utf8_lossy(&listed.stdout)
                .lines()
                .filter_map(|line| line.split_whitespace().next())
                .filter(|name| name.starts_with(&prefix))
                .map(str::to_string)
                .collect())
        };
        let theirs = namespaces()?;
        ensure!(!theirs.is_empty(), "the child made no lab");
        let gone_by = Instant::now() + Duration::from_secs(3);
        loop {
            let mut left = Vec::new();
            for ns in &theirs {
                let pids = Command::new("ip")
                    .args(["netns", "pids", ns])
                    .succeed_within_limit()?;
                left.extend(
                    String::from_utf8_lossy(&pids.stdout)
                        .split_whitespace()
                        .map(str::to_string),
                );
            }
            if let Some(pid) = &redis {
                if Path::new("/proc").join(pid).exists() {
                    left.push(format!("redis-server {pid}"));
                }
            }
            if left.is_empty() {
                break;
            }
            ensure!(
                Instant::now() < gone_by,
                "still running after the kill: {left:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // The next lab sweeps what the dead run left: its namespaces and their pins.
        drop(Lab::new()?);
        ensure!(
            namespaces()?.is_empty(),
            "the sweep left {:?}",
            namespaces()?
        );
        // (The pin root itself goes when its last attachment does.)
        ensure!(
            !std::fs::read_dir(PIN_ROOT)
                .into_iter()
                .flatten()
                .flatten()
                .any(|entry| entry.file_name().to_string_lossy().contains(&prefix)),
            "the sweep left pins of {prefix}*"
        );
    }
    Ok(())
}

/// A child killed (and reaped, bounded) when dropped.
struct KilledOnDrop(Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = wait_bounded(&mut self.0, Duration::from_secs(5));
    }
}

/// The child: stages of a run, each said on stdout when done, then a wait to be killed.
fn be_killed() -> Result<()> {
    let lab = Lab::with_delay(Duration::from_millis(1))?;
    lab.router.attach(ROUTER_TO_SERVER, &[])?;
    let sandbox = PrivateBpffs::new()?;
    let attached = sandbox.shaper(&["--netns", &lab.router.name, "attach", "r0"])?;
    ensure!(attached.status.success(), "{}", stderr(&attached));
    std::os::unix::fs::chown(sandbox.path(PIN_ROOT), Some(65534), None)?;
    println!("victim: pin root handed over");
    let redis = shaper_tests::RedisServer::start()?;
    println!(
        "victim: redis-server {}",
        redis.pid().context("redis runs")?
    );
    println!("victim: redis-server up");
    std::thread::sleep(Duration::from_secs(60));
    bail!("the child was not killed within 60 s")
}

/// The filters in `dev`'s clsact egress hook of `ns`, by program id (real tc, no shim).
fn clsact_egress_programs(ns: &Netns, dev: &str) -> Result<Vec<u64>> {
    let out = ns.run("tc", &["-j", "filter", "show", "dev", dev, "egress"])?;
    let filters: Value = serde_json::from_slice(&out.stdout)?;
    Ok(filters
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|filter| filter["options"]["prog"]["id"].as_u64())
        .collect())
}

/// Issue 35: a clsact hook that cannot be read (tc failing, or printing garbage: a PATH
/// shim stands in for a broken iproute2) is an error in `attach` and in `apply` (the
/// daemon's check), never "unhooked": before, each such check hooked the program again
/// beside itself (three filters of one program after two re-runs, every packet charged
/// three times: 47 kbit/s through a 10 Mbit/s class), and the re-hook forgot that shaper
/// had made the clsact qdisc. Then a real re-hook (shaper's filter deleted behind its
/// back) puts back exactly one filter, the class holds its rate, and detach removes the
/// qdisc shaper made.
#[test]
fn an_unreadable_clsact_hook_is_an_error_and_the_program_is_hooked_once() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    let router = lab.router.clone();
    router.attach(dev, &["--attach-mode", "clsact"])?;
    router.class_add("udp", dev, &["--rate", "10mbit", "--proto", "udp"])?;
    let program = router.status_row()?["program_id"]
        .as_u64()
        .context("a program id")?;
    ensure!(clsact_egress_programs(&router, dev)? == [program]);

    let shims = std::env::temp_dir().join(format!("shaper-tc-shim-{}", std::process::id()));
    let _remove = RemoveOnDrop(shims.clone());
    let file = shims.join("apply.toml");
    std::fs::create_dir_all(&shims)?;
    std::fs::write(&file, router.shaper(&["export"])?)?;
    for (name, script) in [
        ("failing", "#!/bin/sh\necho 'tc: broken' >&2\nexit 1\n"),
        ("garbage", "#!/bin/sh\necho 'not json at all'\n"),
        ("not-a-list", "#!/bin/sh\necho '{\"filters\": 3}'\n"),
    ] {
        let dir = shims.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("tc"), script)?;
        std::fs::set_permissions(dir.join("tc"), std::fs::Permissions::from_mode(0o755))?;
        let path = format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        for args in [
            vec!["--netns", router.name.as_str(), "attach", dev],
            vec!["apply", "-f", file.to_str().context("a path")?],
        ] {
            let output = Command::new(shaper_bin())
                .args(&args)
                .env("PATH", &path)
                .output_within_limit()?;
            let message = stderr(&output);
            println!(
                "tc {name}: shaper {}: exit {:?}: {}",
                args.join(" "),
                output.status.code(),
                message.trim()
            );
            ensure!(
                !output.status.success() && message.trim().lines().count() == 1,
                "{name}: {args:?} did not fail with one line: {message}"
            );
            ensure!(message.contains("cannot read the clsact hook") || message.contains("tc"));
            ensure!(
                clsact_egress_programs(&router, dev)? == [program],
                "{name}: {args:?} left the hook with {:?}",
                clsact_egress_programs(&router, dev)?
            );
        }
    }

    // A real re-hook: shaper's filter deleted behind its back, the qdisc left.
    router.run("tc", &["filter", "del", "dev", dev, "egress"])?;
    ensure!(clsact_egress_programs(&router, dev)?.is_empty());
    ensure!(router.status_row()?["problem"] == "program unhooked");
    let out = router.attach(dev, &[])?;
    ensure!(out.contains("re-attached"), "{out}");
    ensure!(clsact_egress_programs(&router, dev)? == [program]);
    let run = lab.udp(&shaper_tests::Udp::default())?;
    assert_within(
        "UDP 100M through a 10mbit class after the re-hook",
        run.total_l2_bps(),
        10e6,
        0.03,
    );
    router.shaper(&["detach", dev])?;
    let qdiscs = router.run("tc", &["qdisc", "show", "dev", dev])?;
    let qdiscs = String::from_utf8_lossy(&qdiscs.stdout);
    ensure!(
        !qdiscs.contains("clsact"),
        "detach left the clsact qdisc shaper made: {qdiscs}"
    );
    Ok(())
}

/// Removes a directory tree when dropped (also when the test fails).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
