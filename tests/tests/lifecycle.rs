//! Attachments over their life: attach is idempotent and concurrent invocations all
//! land, an interface deleted and re-created gets its program and classes back, bpffs is
//! mounted when missing, and detach cleans up after a namespace that was deleted.

use shaper_tests::{
    dies_with_parent, shaper_bin, wait_bounded, BoundedCommand, Lab, Netns, COMMAND_LIMIT,
    ROUTER_TO_CLIENT, ROUTER_TO_SERVER,
};
use std::process::Command;

/// `shaper --netns ROUTER class add c<i> --dev r1 --rate 1mbit --proto udp --dport 7000+i`,
/// to be run alongside others.
fn add_class_command(router: &str, i: u32) -> Command {
    let mut command = Command::new(shaper_bin());
    dies_with_parent(&mut command).args([
        "--netns",
        router,
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
    ]);
    command
}

/// Runs `command(i)` for every `i` of `range`, each from its own thread, all at once;
/// asserts that every one succeeded.
fn all_succeed_from_threads(range: std::ops::Range<u32>, command: impl Fn(u32) -> Command + Sync) {
    std::thread::scope(|scope| {
        let handles: Vec<_> = range
            .map(|i| {
                let command = &command;
                scope.spawn(move || command(i).succeed_within_limit().unwrap())
            })
            .collect();
        for handle in handles {
            handle.join().expect("a command thread panicked");
        }
    });
}

/// Idempotent attach and concurrent invocations: no duplicate, no lost class.
#[test]
fn attach_is_idempotent_and_concurrent_adds_all_land() {
    let lab = Lab::new().unwrap();
    let router = lab.router.name.clone();
    for _ in 0..2 {
        lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    }
    let status = lab.router.shaper_json(&["status", "--json"]).unwrap();
    assert_eq!(
        status.as_array().unwrap().len(),
        1,
        "a second attach must not add a second program"
    );
    // Eight invocations at once, each adding a class.
    let children: Vec<_> = (0..8)
        .map(|i| add_class_command(&router, i).spawn().unwrap())
        .collect();
    for mut child in children {
        assert!(wait_bounded(&mut child, COMMAND_LIMIT).unwrap().success());
    }
    all_succeed_from_threads(0..8, |i| {
        let mut command = Command::new(shaper_bin());
        command.args([
            "--netns",
            &router,
            "class",
            "change",
            &format!("c{i}"),
            "--dev",
            ROUTER_TO_SERVER,
            "--rate",
            &format!("{}mbit", i + 2),
        ]);
        command
    });
    let list = lab
        .router
        .shaper_json(&["class", "list", "--json"])
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
    all_succeed_from_threads(8..16, |i| add_class_command(&router, i));
    let list = lab
        .router
        .shaper_json(&["class", "list", "--json"])
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
    lab.router.attach("tap0", &[]).unwrap();
    lab.router
        .class_add("vm", "tap0", &["--rate", "50mbit"])
        .unwrap();
    let live = |lab: &Lab| -> bool {
        let status = lab.router.shaper_json(&["status", "--json"]).unwrap();
        status[0]["live"].as_bool().unwrap()
    };
    assert!(live(&lab));
    lab.router.run("ip", &["link", "del", "tap0"]).unwrap();
    assert!(
        !live(&lab),
        "status must report an attachment whose interface is gone"
    );
    create();
    let output = lab.router.attach("tap0", &[]).unwrap();
    assert!(output.contains("re-attached"), "{output}");
    assert!(live(&lab));
    let list = lab
        .router
        .shaper_json(&["class", "list", "--json"])
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
        .succeed_within_limit()
        .unwrap();
    Command::new("ip")
        .args([
            "-n", &name, "link", "add", "gone0", "type", "veth", "peer", "name", "gone1",
        ])
        .succeed_within_limit()
        .unwrap();
    let gone = Netns { name: name.clone() };
    gone.attach("gone0", &[]).unwrap();
    Command::new("ip")
        .args(["netns", "del", &name])
        .succeed_within_limit()
        .unwrap();
    let pins = std::path::Path::new("/sys/fs/bpf/shaper").join(format!("netns-{name}"));
    assert!(pins.exists());
    gone.shaper(&["detach", "gone0"]).unwrap();
    assert!(!pins.exists(), "pins left in {}", pins.display());
}
