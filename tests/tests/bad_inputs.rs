//! Scenario 10: every bad input prints one line on stderr, exits 2 (usage) or 1
//! (runtime), and leaves the configured state exactly as it was.

use serde_json::Value;
use shaper_tests::{
    shaper_bin, wait_bounded, BoundedCommand, Lab, COMMAND_LIMIT, ROUTER_TO_CLIENT,
    ROUTER_TO_SERVER,
};
use std::process::Command;

/// Everything a user can observe: attachments and classes with their settings.
fn snapshot(lab: &Lab, router: &str) -> (Value, Value) {
    let status = lab.shaper(&["--netns", router, "status", "--json"]);
    let classes = lab.shaper(&["--netns", router, "class", "list", "--json"]);
    let mut classes: Value = serde_json::from_slice(&classes.stdout).unwrap();
    // Counters may move with background traffic (none here, but be exact about intent).
    for class in classes.as_array_mut().unwrap() {
        for counter in [
            "passed_packets",
            "passed_bytes",
            "dropped_packets",
            "dropped_bytes",
        ] {
            class.as_object_mut().unwrap().remove(counter);
        }
    }
    (serde_json::from_slice(&status.stdout).unwrap(), classes)
}

#[test]
fn scenario10_bad_inputs_fail_cleanly_and_change_nothing() {
    let lab = Lab::new().unwrap();
    let router = lab.router.name.clone();
    let ns = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["--netns".to_string(), router.clone()];
        all.extend(args.iter().map(|s| s.to_string()));
        all
    };
    lab.shaper_in(&lab.router, &["attach", ROUTER_TO_SERVER])
        .unwrap();
    lab.shaper_in(
        &lab.router,
        &[
            "class",
            "add",
            "web",
            "--dev",
            ROUTER_TO_SERVER,
            "--rate",
            "10mbit",
            "--proto",
            "tcp",
            "--dport",
            "80",
        ],
    )
    .unwrap();
    let before = snapshot(&lab, &router);
    assert_eq!(before.0.as_array().unwrap().len(), 1);
    assert_eq!(before.1.as_array().unwrap().len(), 1);

    let owned = |args: &[&str]| -> Vec<String> { args.iter().map(|s| s.to_string()).collect() };
    let r1 = ROUTER_TO_SERVER;
    // `class add x --dev r1 --rate 1mbit` plus the options under test.
    let add_x = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["class", "add", "x", "--dev", r1, "--rate", "1mbit"];
        args.extend_from_slice(extra);
        ns(&args)
    };
    let cases: Vec<(&str, Vec<String>, i32)> = vec![
        ("unknown device", ns(&["attach", "nosuchdev0"]), 1),
        (
            "unknown namespace",
            vec![
                "--netns".into(),
                "shp-no-such-ns".into(),
                "attach".into(),
                r1.into(),
            ],
            1,
        ),
        (
            "bad attach mode",
            ns(&["attach", r1, "--attach-mode", "xdp"]),
            2,
        ),
        (
            "bad direction",
            ns(&["attach", r1, "--direction", "sideways"]),
            2,
        ),
        (
            "bad rate word",
            ns(&["class", "add", "x", "--dev", r1, "--rate", "fast"]),
            2,
        ),
        (
            "zero rate",
            ns(&["class", "add", "x", "--dev", r1, "--rate", "0"]),
            2,
        ),
        (
            "rate above 400gbit",
            ns(&["class", "add", "x", "--dev", r1, "--rate", "1tbit"]),
            2,
        ),
        (
            "bad rate unit",
            ns(&["class", "add", "x", "--dev", r1, "--rate", "10mbits"]),
            2,
        ),
        ("bad size unit", add_x(&["--burst", "12q"]), 2),
        ("burst below one frame", add_x(&["--burst", "100"]), 2),
        ("bad CIDR", add_x(&["--src", "300.1.1.1/8"]), 2),
        ("bad prefix", add_x(&["--dst", "198.18.0.0/40"]), 2),
        (
            "mixed families",
            add_x(&["--src", "198.18.0.0/15", "--dst", "fd00::/8"]),
            2,
        ),
        (
            "empty port range",
            add_x(&["--proto", "udp", "--dport", "9-1"]),
            2,
        ),
        (
            "port out of range",
            add_x(&["--proto", "udp", "--sport", "70000"]),
            2,
        ),
        ("ports without tcp/udp", add_x(&["--dport", "53"]), 2),
        ("bad protocol", add_x(&["--proto", "sctp"]), 2),
        ("bad scope", add_x(&["--per", "packet"]), 2),
        (
            "bad class name",
            ns(&["class", "add", "bad/name", "--dev", r1, "--rate", "1mbit"]),
            2,
        ),
        (
            "duplicate class",
            ns(&["class", "add", "web", "--dev", r1, "--rate", "1mbit"]),
            1,
        ),
        (
            "class on a device not attached",
            ns(&[
                "class",
                "add",
                "x",
                "--dev",
                ROUTER_TO_CLIENT,
                "--rate",
                "1mbit",
            ]),
            1,
        ),
        (
            "change unknown class",
            ns(&["class", "change", "nosuch", "--dev", r1, "--rate", "1mbit"]),
            1,
        ),
        (
            "change with nothing to change",
            ns(&["class", "change", "web", "--dev", r1]),
            2,
        ),
        (
            "change to a bad rate",
            ns(&["class", "change", "web", "--dev", r1, "--rate", "-3mbit"]),
            2,
        ),
        (
            "delete unknown class",
            ns(&["class", "del", "nosuch", "--dev", r1]),
            1,
        ),
        (
            "detach a device not attached",
            ns(&["detach", ROUTER_TO_CLIENT]),
            1,
        ),
        (
            "stats of a device not attached",
            ns(&["stats", "--dev", ROUTER_TO_CLIENT]),
            1,
        ),
        ("unknown command", ns(&["explode"]), 2),
        (
            "apply of a missing file",
            owned(&["apply", "-f", "/nonexistent/shaper.toml"]),
            1,
        ),
        ("apply with --netns", ns(&["apply", "-f", "/dev/null"]), 2),
        (
            "daemon with a bad metrics address",
            owned(&["daemon", "-f", "/dev/null", "--metrics-addr", "nowhere"]),
            2,
        ),
        (
            "daemon with a bad interval",
            owned(&["daemon", "-f", "/dev/null", "--interval", "soon"]),
            2,
        ),
        (
            "stats --watch too often",
            ns(&["stats", "--watch", "--interval", "1ms"]),
            2,
        ),
    ];
    let mut failures = Vec::new();
    for (what, args, expected_code) in &cases {
        let output = Command::new(shaper_bin())
            .args(args)
            .output_within_limit()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        let lines: Vec<&str> = stderr.lines().collect();
        println!(
            "{what:32} exit {:?}  {}",
            output.status.code(),
            stderr.trim()
        );
        if output.status.code() != Some(*expected_code) {
            failures.push(format!(
                "{what}: exit {:?}, expected {expected_code}",
                output.status.code()
            ));
        }
        if lines.len() != 1 || !lines[0].starts_with("shaper: ") {
            failures.push(format!(
                "{what}: stderr is not one 'shaper: ...' line: {stderr:?}"
            ));
        }
        if snapshot(&lab, &router) != before {
            failures.push(format!("{what}: the state changed"));
        }
    }

    // Without CAP_NET_ADMIN (and CAP_BPF/CAP_SYS_ADMIN): a clear line, exit 1.
    for (cap, name) in [
        ("-net_admin", "CAP_NET_ADMIN"),
        ("-bpf,-sys_admin", "CAP_BPF"),
    ] {
        let output = Command::new("setpriv")
            .args(["--inh-caps", "-all", "--bounding-set", cap])
            .arg(shaper_bin())
            .args(add_x(&[]))
            .output_within_limit()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        println!(
            "{:32} exit {:?}  {}",
            format!("without {name}"),
            output.status.code(),
            stderr.trim()
        );
        if output.status.code() != Some(1) || stderr.lines().count() != 1 || !stderr.contains(name)
        {
            failures.push(format!(
                "without {name}: exit {:?}, stderr {stderr:?}",
                output.status.code()
            ));
        }
        if snapshot(&lab, &router) != before {
            failures.push(format!("without {name}: the state changed"));
        }
    }
    assert!(
        failures.is_empty(),
        "bad inputs handled badly:\n{}",
        failures.join("\n")
    );
}

/// Idempotent attach and concurrent invocations: no duplicate, no lost class.
#[test]
fn attach_is_idempotent_and_concurrent_adds_all_land() {
    let lab = Lab::new().unwrap();
    let router = lab.router.name.clone();
    for _ in 0..2 {
        lab.shaper_in(&lab.router, &["attach", ROUTER_TO_SERVER])
            .unwrap();
    }
    let status: Value =
        serde_json::from_str(&lab.shaper_in(&lab.router, &["status", "--json"]).unwrap()).unwrap();
    assert_eq!(
        status.as_array().unwrap().len(),
        1,
        "a second attach must not add a second program"
    );
    // Eight invocations at once, each adding a class.
    let children: Vec<_> = (0..8)
        .map(|i| {
            Command::new(shaper_bin())
                .args([
                    "--netns",
                    &router,
                    "class",
                    "add",
                    &format!("c{i}"),
                    "--dev",
                    ROUTER_TO_SERVER,
                    "--rate",
                    "1mbit",
                    "--proto",
                    "udp",
                    "--dport",
                    &(7000 + i).to_string(),
                ])
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        assert!(wait_bounded(&mut child, COMMAND_LIMIT).unwrap().success());
    }
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let router = router.clone();
            std::thread::spawn(move || {
                Command::new(shaper_bin())
                    .args([
                        "--netns",
                        &router,
                        "class",
                        "change",
                        &format!("c{i}"),
                        "--dev",
                        ROUTER_TO_SERVER,
                        "--rate",
                        &format!("{}mbit", i + 2),
                    ])
                    .status_within_limit()
                    .unwrap()
            })
        })
        .collect();
    for handle in handles {
        assert!(handle.join().unwrap().success());
    }
    let list: Value = serde_json::from_str(
        &lab.shaper_in(&lab.router, &["class", "list", "--json"])
            .unwrap(),
    )
    .unwrap();
    let mut rates: Vec<(String, u64)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                c["rate_bps"].as_u64().unwrap(),
            )
        })
        .collect();
    rates.sort();
    let expected: Vec<(String, u64)> = (0..8)
        .map(|i| (format!("c{i}"), (i + 2) * 1_000_000))
        .collect();
    assert_eq!(rates, expected);
    // Adds racing each other from threads.
    let handles: Vec<_> = (8..16)
        .map(|i| {
            let router = router.clone();
            std::thread::spawn(move || {
                Command::new(shaper_bin())
                    .args([
                        "--netns",
                        &router,
                        "class",
                        "add",
                        &format!("c{i}"),
                        "--dev",
                        ROUTER_TO_SERVER,
                        "--rate",
                        "1mbit",
                        "--proto",
                        "udp",
                        "--dport",
                        &(7000 + i).to_string(),
                    ])
                    .status_within_limit()
                    .unwrap()
            })
        })
        .collect();
    for handle in handles {
        assert!(handle.join().unwrap().success());
    }
    let list: Value = serde_json::from_str(
        &lab.shaper_in(&lab.router, &["class", "list", "--json"])
            .unwrap(),
    )
    .unwrap();
    let mut ids: Vec<u64> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_u64().unwrap())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 16, "every concurrent add got its own class id");
}

/// A re-created interface (a VM's tap, a container's veth) gets the pinned program back
/// on `attach`, with its classes; until then `status` reports the attachment as stale.
#[test]
fn attach_after_the_interface_was_recreated_keeps_classes() {
    let lab = Lab::new().unwrap();
    let create = || {
        lab.router
            .run(
                "ip",
                &[
                    "link", "add", "tap0", "type", "veth", "peer", "name", "tap1",
                ],
            )
            .unwrap()
    };
    create();
    lab.shaper_in(&lab.router, &["attach", "tap0"]).unwrap();
    lab.shaper_in(
        &lab.router,
        &["class", "add", "vm", "--dev", "tap0", "--rate", "50mbit"],
    )
    .unwrap();
    let live = |lab: &Lab| -> bool {
        let status: Value =
            serde_json::from_str(&lab.shaper_in(&lab.router, &["status", "--json"]).unwrap())
                .unwrap();
        status[0]["live"].as_bool().unwrap()
    };
    assert!(live(&lab));
    lab.router.run("ip", &["link", "del", "tap0"]).unwrap();
    assert!(
        !live(&lab),
        "status must report an attachment whose interface is gone"
    );
    create();
    let output = lab.shaper_in(&lab.router, &["attach", "tap0"]).unwrap();
    assert!(output.contains("re-attached"), "{output}");
    assert!(live(&lab));
    let list: Value = serde_json::from_str(
        &lab.shaper_in(&lab.router, &["class", "list", "--json"])
            .unwrap(),
    )
    .unwrap();
    assert_eq!(list[0]["name"], "vm");
    assert_eq!(list[0]["rate_bps"], 50_000_000);
}

/// On a machine where bpffs is not mounted, the first command that needs pins mounts it.
/// Run in a private mount namespace so the host's bpffs is untouched.
#[test]
fn bpffs_is_mounted_when_missing() {
    let lab = Lab::new().unwrap();
    let script = format!(
        "umount /sys/fs/bpf 2>/dev/null; umount /sys/fs/bpf 2>/dev/null; \
         [ \"$(stat -f -c %T /sys/fs/bpf)\" != bpf_fs ] || exit 10; \
         {} --netns {} attach {} >/dev/null || exit 11; stat -f -c %T /sys/fs/bpf",
        shaper_bin().display(),
        lab.router.name,
        ROUTER_TO_CLIENT
    );
    let output = Command::new("unshare")
        .args(["--mount", "sh", "-c", &script])
        .output_within_limit()
        .unwrap();
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "bpf_fs");
}

/// When a namespace is deleted with shaper attached inside, `detach` still cleans up
/// the pins it left in the host's bpffs.
#[test]
fn detach_after_the_namespace_was_deleted_removes_the_pins() {
    let lab = Lab::new().unwrap();
    let name = format!("{}-gone", lab.router.name);
    Command::new("ip")
        .args(["netns", "add", &name])
        .status_within_limit()
        .unwrap();
    Command::new("ip")
        .args([
            "-n", &name, "link", "add", "gone0", "type", "veth", "peer", "name", "gone1",
        ])
        .status_within_limit()
        .unwrap();
    let attach = lab.shaper(&["--netns", &name, "attach", "gone0"]);
    assert!(
        attach.status.success(),
        "{}",
        String::from_utf8_lossy(&attach.stderr)
    );
    Command::new("ip")
        .args(["netns", "del", &name])
        .status_within_limit()
        .unwrap();
    let pins = std::path::Path::new("/sys/fs/bpf/shaper").join(format!("netns-{name}"));
    assert!(pins.exists());
    let detach = lab.shaper(&["--netns", &name, "detach", "gone0"]);
    assert!(
        detach.status.success(),
        "{}",
        String::from_utf8_lossy(&detach.stderr)
    );
    assert!(!pins.exists(), "pins left in {}", pins.display());
}
