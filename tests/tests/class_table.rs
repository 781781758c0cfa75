//! The class table's limits and all-or-nothing promises, on a real attachment: `shaper
//! batch` checks every line before it runs any, a class that would need a 33rd rule
//! shape is refused (and `apply` replacing a class by one that would puts the old one
//! back), and a `class add` that fails half-way through writing its classifier entries
//! leaves none of them behind.

use serde_json::Value;
use shaper_tests::{shaper, stderr, stdout, Lab, ROUTER_TO_SERVER};
use std::process::Output;

/// A batch file that removes itself.
struct BatchFile(std::path::PathBuf);

impl BatchFile {
    fn new(tag: &str, lines: &[String]) -> Self {
        let path =
            std::env::temp_dir().join(format!("shaper-test-{}-{tag}.batch", std::process::id()));
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        Self(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for BatchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn class_list(lab: &Lab) -> Value {
    lab.router
        .shaper_json(&["class", "list", "--dev", ROUTER_TO_SERVER, "--json"])
        .unwrap()
}

fn class_count(lab: &Lab) -> usize {
    class_list(lab).as_array().unwrap().len()
}

/// Asserts a failed command: the exit code, one `shaper:` line containing `needle`.
fn assert_refused(output: &Output, code: i32, needle: &str) {
    let message = stderr(output).trim().to_string();
    println!("exit {:?}: {message}", output.status.code());
    assert_eq!(output.status.code(), Some(code), "{message}");
    assert_eq!(message.lines().count(), 1, "one line: {message}");
    assert!(
        message.starts_with("shaper: ") && message.contains(needle),
        "{message}"
    );
}

#[test]
fn batch_checks_every_line_first_and_a_33rd_rule_shape_is_refused() {
    let lab = Lab::new().unwrap();
    lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    // 32 distinct rule shapes: source prefixes /15../32 and destination prefixes /15../28.
    let mut lines: Vec<String> = (15..=32)
        .map(|bits| format!("class add src{bits} --dev r1 --rate 1mbit --src 198.18.0.0/{bits}"))
        .chain((15..=28).map(|bits| {
            format!("class add dst{bits} --dev r1 --rate 1mbit --dst 198.18.0.0/{bits}")
        }))
        .collect();
    assert_eq!(lines.len(), 32);

    // A bad last line: nothing runs, and the line is named.
    lines.push("class add broken --dev r1 --rate fast".into());
    let bad = BatchFile::new("bad", &lines);
    let output = lab.router.shaper_output(&["batch", "-f", bad.path()]);
    assert_refused(&output, 2, &format!("{}:33:", bad.path()));
    assert_eq!(
        class_count(&lab),
        0,
        "a batch with a bad line added classes"
    );

    lines.pop();
    let good = BatchFile::new("good", &lines);
    lab.router.shaper(&["batch", "-f", good.path()]).unwrap();
    assert_eq!(class_count(&lab), 32);

    // A 33rd shape is refused and changes nothing.
    let before = class_list(&lab);
    let output = lab.router.shaper_output(&[
        "class",
        "add",
        "dst29",
        "--dev",
        ROUTER_TO_SERVER,
        "--rate",
        "1mbit",
        "--dst",
        "198.18.0.0/29",
    ]);
    assert_refused(&output, 1, "too many distinct rule shapes (the limit is 32");
    assert_eq!(
        class_list(&lab),
        before,
        "the refused class changed the table"
    );
    // What counts is shapes, not classes: another /24 destination shares a shape.
    lab.router
        .class_add(
            "another24",
            ROUTER_TO_SERVER,
            &["--rate", "1mbit", "--dst", "198.18.5.0/24"],
        )
        .unwrap();
    assert_eq!(class_count(&lab), 33);

    // `apply` replacing a class (a new rule) by one that needs a 33rd shape: no room
    // beside it, and none once it is deleted (its /24 shape stays in use by dst24). The
    // old class must come back as it was, not be lost.
    let exported = lab.router.shaper(&["export"]).unwrap();
    let wanted = exported.replace("198.18.5.0/24", "198.18.5.0/29");
    assert_ne!(wanted, exported);
    let file = BatchFile::new("replace", &[wanted]);
    let output = shaper_tests::shaper(&["apply", "-f", file.path()]);
    assert_refused(&output, 1, "too many distinct rule shapes");
    let rows = class_list(&lab);
    let kept = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["name"] == "another24")
        .cloned();
    assert_eq!(
        kept.as_ref().map(|row| row["dst"].clone()),
        Some(Value::from("198.18.5.0/24")),
        "the class a failed replacement deleted was not put back: {rows}"
    );
    assert_eq!(class_count(&lab), 33);
}

/// Fills the classifier table (262 144 entries) to 20 entries short of full, then adds a
/// class that needs 34: its first 20 entries are written, the 21st fails, and the class
/// must be rolled back to nothing. Proof that no entry leaked: after an 18-entry class is
/// deleted, 38 entries are free (18 had the 20 leaked) and another 34-entry class fits.
#[test]
fn class_add_rolls_back_a_half_written_class() {
    const FULL_CLASSES: u32 = 7709; // × 34 entries = 262 106 of 262 144
    let lab = Lab::new().unwrap();
    lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    // Each class: one source address, UDP, source ports 1-3 (2 blocks) × destination
    // ports 1-65535 (16 blocks) = 32 entries in the same 32 shapes, and 2 for packets
    // whose ports or protocol are unknown: 34.
    let source = |index: u32| format!("198.18.{}.{}/32", index / 256, index % 256);
    let full_class = |name: &str, index: u32| {
        format!(
            "class add {name} --dev r1 --rate 1mbit --proto udp --src {} --sport 1-3 --dport 1-65535",
            source(index)
        )
    };
    let mut lines: Vec<String> = (0..FULL_CLASSES)
        .map(|index| full_class(&format!("c{index}"), index))
        .collect();
    // 18 entries: one source port block (16), and the 2 for unknown ports/protocol.
    lines.push(format!(
        "class add half --dev r1 --rate 1mbit --proto udp --src {} --sport 1 --dport 1-65535",
        source(FULL_CLASSES)
    ));
    let batch = BatchFile::new("fill", &lines);
    lab.router.shaper(&["batch", "-f", batch.path()]).unwrap();
    assert_eq!(class_count(&lab) as u32, FULL_CLASSES + 1);

    let before = class_list(&lab);
    let victim = full_class("victim", FULL_CLASSES + 1);
    let victim_args: Vec<&str> = victim.split_whitespace().collect();
    let output = lab.router.shaper_output(&victim_args);
    assert_refused(&output, 1, "the classifier table is full (262144 entries");
    assert_eq!(
        class_list(&lab),
        before,
        "the failed class changed the table"
    );

    // Deleting the 18-entry class frees 18: with the 20 never used, another class of 34
    // entries (its own keys: a leaked entry of the victim's cannot be reused) fits only
    // if the failed attempt left none of its entries behind.
    lab.router
        .shaper(&["class", "del", "half", "--dev", ROUTER_TO_SERVER])
        .unwrap();
    let other = full_class("other", FULL_CLASSES + 2);
    let output = lab
        .router
        .shaper_output(&other.split_whitespace().collect::<Vec<_>>());
    assert!(
        output.status.success(),
        "the class does not fit after its rollback: entries leaked ({})",
        stderr(&output)
    );
    assert_eq!(class_count(&lab) as u32, FULL_CLASSES + 1);
}

/// `apply` of a file that adds several classes, the last of which cannot be made (a
/// shape class on a device whose root qdisc is not shaper's): the classes added before
/// it are taken back, so the device has exactly the classes it had.
#[test]
fn a_failing_apply_takes_back_every_class_it_added() {
    let lab = Lab::new().unwrap();
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "kept",
            ROUTER_TO_SERVER,
            &["--rate", "5mbit", "--proto", "tcp"],
        )
        .unwrap();
    let tc = router
        .run(
            "tc",
            &[
                "qdisc",
                "replace",
                "dev",
                ROUTER_TO_SERVER,
                "root",
                "handle",
                "1:",
                "pfifo",
                "limit",
                "1000",
            ],
        )
        .unwrap();
    assert!(tc.status.success(), "tc: {}", stderr(&tc));
    let before = class_list(&lab);
    let mut wanted = router.shaper(&["export"]).unwrap();
    for (name, port) in [("first", 9001), ("second", 9002)] {
        wanted.push_str(&format!(
            "\n[[interface.class]]\nname = \"{name}\"\nrate = \"1mbit\"\nproto = \"udp\"\n\
             dport = {port}\n"
        ));
    }
    wanted.push_str(
        "\n[[interface.class]]\nname = \"shaped\"\nrate = \"1mbit\"\nproto = \"icmp\"\n\
         action = \"shape\"\n",
    );
    let file = BatchFile::new("apply-adds", &[wanted]);
    // The plan adds the two classes before the one that fails.
    // The exported file names its namespace: applied as it is, without --netns.
    let dry = shaper(&["apply", "--dry-run", "-f", file.path()]);
    assert!(dry.status.success(), "{}", stderr(&dry));
    let planned = stdout(&dry);
    let at = |name: &str| {
        planned
            .find(&format!("class {name} "))
            .unwrap_or_else(|| panic!("no {name} in the plan: {planned}"))
    };
    assert!(
        at("first") < at("shaped") && at("second") < at("shaped"),
        "{planned}"
    );
    let output = shaper(&["apply", "-f", file.path()]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let after = class_list(&lab);
    let names = |list: &Value| -> Vec<String> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|row| row["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(&after), ["kept"], "{after}");
    assert_eq!(after[0]["id"], before[0]["id"]);
    assert_eq!(after[0]["rate_bps"], 5_000_000);
}
