//! Shape classes at scale (issue 54): their qdiscs and HTB classes go to the kernel over
//! rtnetlink. A thousand applied are all in the kernel with their rates and bursts (tc's
//! own reading), a hundred change in one `apply`, the same file again changes nothing;
//! and a kernel refusal in the middle of a batch or an apply fails in one line and leaves
//! no half-made class.

use shaper_tests::{daemon::ConfigFile, shaper, stderr, stdout, Lab, Netns, ROUTER_TO_SERVER};
use std::collections::BTreeMap;
use std::time::Instant;

const CLASSES: usize = 1000;

/// An HTB class as `tc class show` prints it: rate and ceil in bits/s, burst in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TcClass {
    rate: f64,
    ceil: f64,
    burst: f64,
}

/// tc's figures: `10Mbit`, `18750Kbit`, `64Kb` (Kb and Mb are 1024s), `1600b`.
fn tc_number(text: &str) -> f64 {
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let number: f64 = digits
        .parse()
        .unwrap_or_else(|_| panic!("tc figure {text}"));
    let unit = &text[digits.len()..];
    number
        * match unit {
            "bit" | "b" => 1.0,
            "Kbit" => 1e3,
            "Mbit" => 1e6,
            "Gbit" => 1e9,
            "Kb" => 1024.0,
            "Mb" => 1024.0 * 1024.0,
            other => panic!("unit {other} in {text}"),
        }
}

/// Every HTB class on `dev`, by handle, from one `tc class show`.
fn htb_classes(router: &Netns, dev: &str) -> BTreeMap<String, TcClass> {
    let output = router.run("tc", &["class", "show", "dev", dev]).unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    stdout(&output)
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |key: &str| {
                let at = words.iter().position(|word| *word == key)?;
                words.get(at + 1).map(|figure| tc_number(figure))
            };
            let class = TcClass {
                rate: after("rate")?,
                ceil: after("ceil")?,
                burst: after("burst")?,
            };
            Some((words.get(2)?.to_string(), class))
        })
        .collect()
}

fn class_ids(router: &Netns) -> BTreeMap<String, u64> {
    let list = router
        .shaper_json(&["class", "list", "--dev", ROUTER_TO_SERVER, "--json"])
        .unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let name = row["name"].as_str().unwrap().to_string();
            (name, row["id"].as_u64().unwrap())
        })
        .collect()
}

/// shaper's HTB handles of class `id`: the class, its sparse leaf, its bulk leaf.
fn handles(id: u64) -> [String; 3] {
    [0, 0x4000, 0x8000].map(|base| format!("5348:{:x}", base + id + 1))
}

/// Class `i`'s rate (Mbit/s) and burst (KiB) in a file: each differs from its neighbours.
fn rate_and_burst(i: usize, bump: usize) -> (usize, usize) {
    (1 + (i + bump) % 50, 16 + 4 * (i % 8))
}

fn config(router: &Netns, bump_first: usize) -> String {
    let mut text = format!(
        "[[interface]]\ndev = \"{ROUTER_TO_SERVER}\"\nnetns = \"{}\"\n",
        router.name
    );
    for i in 0..CLASSES {
        let (rate, burst) = rate_and_burst(i, usize::from(i < bump_first));
        text.push_str(&format!(
            "\n[[interface.class]]\nname = \"s{i}\"\nrate = \"{rate}mbit\"\nburst = \"{burst}k\"\n\
             dst = \"198.19.{}.{}/32\"\naction = \"shape\"\n",
            i / 250,
            i % 250 + 1
        ));
    }
    text
}

/// Every class of the file is in the kernel: its class at its rate and burst, and both
/// leaves, which may borrow up to that rate.
fn assert_in_the_kernel(router: &Netns, bump_first: usize) {
    let kernel = htb_classes(router, ROUTER_TO_SERVER);
    assert_eq!(
        kernel.len(),
        3 * CLASSES,
        "shaper's HTB classes on the device"
    );
    let ids = class_ids(router);
    assert_eq!(ids.len(), CLASSES);
    for i in 0..CLASSES {
        let (rate, burst) = rate_and_burst(i, usize::from(i < bump_first));
        let (rate, burst) = (rate as f64 * 1e6, burst as f64 * 1024.0);
        let [class, sparse, bulk] = handles(ids[&format!("s{i}")]);
        let made = kernel[&class];
        assert_eq!(
            (made.rate, made.ceil),
            (rate, rate),
            "s{i} ({class}): {made:?}"
        );
        // The kernel keeps a burst as time in 64 ns ticks: tc's reading is within 16 bytes.
        assert!(
            (made.burst - burst).abs() <= 16.0,
            "s{i} ({class}) burst {made:?}"
        );
        for leaf in [sparse, bulk] {
            assert_eq!(kernel[&leaf].ceil, rate, "s{i}'s leaf {leaf}");
        }
    }
}

#[test]
fn a_thousand_shape_classes_apply_read_back_and_a_hundred_change_in_one_apply() {
    let lab = Lab::new().unwrap();
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    let file = ConfigFile::new("shape-scale", &config(router, 0));
    let timed_apply = |what: &str| {
        let started = Instant::now();
        let output = shaper(&["apply", "-f", file.path()]);
        let seconds = started.elapsed().as_secs_f64();
        assert!(output.status.success(), "{what}: {}", stderr(&output));
        println!(
            "{what}: {seconds:.2} s ({})",
            stdout(&output).lines().last().unwrap_or("")
        );
        stdout(&output)
    };
    timed_apply("apply 1000 shape classes");
    assert_in_the_kernel(router, 0);
    let again = timed_apply("the same file again");
    assert!(
        again.contains(&format!(
            "no changes: {CLASSES} class(es) already as configured"
        )),
        "{again}"
    );
    file.write(&config(router, 100));
    let applied = timed_apply("100 rates changed");
    let changes = applied
        .lines()
        .filter(|line| line.starts_with("change  class s"))
        .count();
    assert_eq!(changes, 100, "{applied}");
    assert_in_the_kernel(router, 100);
}

/// An HTB class of someone else's, made with tc in shaper's root at `classid`.
fn add_theirs(router: &Netns, classid: &str) {
    let tc = [
        "class",
        "add",
        "dev",
        ROUTER_TO_SERVER,
        "parent",
        "5348:",
        "classid",
        classid,
    ];
    let output = router
        .run("tc", &[&tc[..], &["htb", "rate", "1mbit"]].concat())
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
}

/// Lines adding `count` shape classes b0, b1, … to the router's device.
fn batch_lines(count: usize) -> String {
    (0..count)
        .map(|i| {
            format!(
                "class add b{i} --dev {ROUTER_TO_SERVER} --rate 2mbit --dst 198.19.{}.{}/32 \
                 --action shape\n",
                i / 250,
                i % 250 + 1
            )
        })
        .collect()
}

#[test]
fn a_kernel_refusal_mid_batch_fails_in_one_line_and_leaves_no_half_made_class() {
    let lab = Lab::new().unwrap();
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "first",
            ROUTER_TO_SERVER,
            &["--rate", "5mbit", "--proto", "icmp", "--action", "shape"],
        )
        .unwrap();
    // A class of someone else's where the batch's 500th class (id 500) will want its own.
    let taken = "5348:1f5";
    add_theirs(router, taken);
    let file = ConfigFile::new("mid-batch", &batch_lines(CLASSES));
    let output = router.shaper_output(&["batch", "-f", file.path()]);
    let message = stderr(&output).trim().to_string();
    println!("batch: exit {:?}: {message}", output.status.code());
    assert_eq!(output.status.code(), Some(1), "{message}");
    let error_lines: Vec<&str> = message
        .lines()
        .filter(|l| l.starts_with("shaper: "))
        .collect();
    assert_eq!(error_lines.len(), 1, "{message}");
    assert!(
        error_lines[0].contains(&format!(
            "cannot add HTB class {taken} on {ROUTER_TO_SERVER}: File exists"
        )),
        "{message}"
    );
    // A batch keeps the classes before the failing one, each whole; nothing of b499.
    let ids = class_ids(router);
    assert_eq!(ids.len(), 1 + 499, "first and b0..b498");
    assert!(!ids.contains_key("b499"));
    let kernel = htb_classes(router, ROUTER_TO_SERVER);
    assert_eq!(
        kernel.len(),
        3 * ids.len() + 1,
        "theirs and three per class"
    );
    for id in ids.values() {
        for handle in handles(*id) {
            assert!(kernel.contains_key(&handle), "{handle} of class {id}");
        }
    }
    for leaf in &handles(500)[1..] {
        assert!(!kernel.contains_key(leaf), "half of b499 made: {leaf}");
    }

    // `apply` is all or nothing: adding the rest fails at b699, theirs now, and takes
    // back the 200 classes it added before it.
    let moved = "5348:2bd";
    let tc_del = ["class", "del", "dev", ROUTER_TO_SERVER, "classid", taken];
    assert!(router.run("tc", &tc_del).unwrap().status.success());
    add_theirs(router, moved);
    let kernel = htb_classes(router, ROUTER_TO_SERVER);
    let mut wanted = router.shaper(&["export"]).unwrap();
    for i in 499..CLASSES {
        wanted.push_str(&format!(
            "\n[[interface.class]]\nname = \"b{i}\"\nrate = \"2mbit\"\ndst = \"198.19.{}.{}/32\"\n\
             action = \"shape\"\n",
            i / 250,
            i % 250 + 1
        ));
    }
    let file = ConfigFile::new("mid-apply", &wanted);
    let output = shaper(&["apply", "-f", file.path()]);
    let message = stderr(&output).trim().to_string();
    println!("apply: exit {:?}: {message}", output.status.code());
    assert_eq!(output.status.code(), Some(1), "{message}");
    assert!(
        message.contains(&format!(
            "cannot add HTB class {moved} on {ROUTER_TO_SERVER}: File exists"
        )),
        "{message}"
    );
    assert_eq!(class_ids(router), ids, "apply took back what it added");
    assert_eq!(htb_classes(router, ROUTER_TO_SERVER), kernel);
}

/// `class del` lines in a batch go together (one read of the state): checked first (a
/// parent before its children is refused and nothing goes), a part of the classes leaves
/// the others' HTB classes whole, and the last ones take shaper's root with them.
#[test]
fn a_batch_deletes_its_classes_together_and_the_last_take_the_root() {
    let lab = Lab::new().unwrap();
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    let shape = ["--action", "shape", "--proto", "tcp"];
    router
        .class_add(
            "p",
            ROUTER_TO_SERVER,
            &[&["--rate", "10mbit"][..], &shape].concat(),
        )
        .unwrap();
    for child in ["c1", "c2"] {
        let options = ["--parent", "p", "--rate", "2mbit", "--dport", "80"];
        router
            .class_add(child, ROUTER_TO_SERVER, &[&options[..], &shape].concat())
            .unwrap();
    }
    let flat = ConfigFile::new("flat", &batch_lines(50));
    router.shaper(&["batch", "-f", flat.path()]).unwrap();
    let del = |names: &[String]| -> String {
        names
            .iter()
            .map(|name| format!("class del {name} --dev {ROUTER_TO_SERVER}\n"))
            .collect()
    };
    let names = |list: &[&str]| -> Vec<String> { list.iter().map(|n| n.to_string()).collect() };

    let parent_first = ConfigFile::new("parent-first", &del(&names(&["b0", "p", "c1", "c2"])));
    let output = router.shaper_output(&["batch", "-f", parent_first.path()]);
    let message = stderr(&output).trim().to_string();
    assert_eq!(output.status.code(), Some(1), "{message}");
    assert!(
        message.contains("class del: class 'p' is the parent of c1, c2: delete or move them first"),
        "{message}"
    );
    assert_eq!(class_ids(router).len(), 53, "nothing deleted");
    assert_eq!(htb_classes(router, ROUTER_TO_SERVER).len(), 3 * 53);

    let half: Vec<String> = (0..25).map(|i| format!("b{i}")).collect();
    let half = ConfigFile::new("half", &del(&half));
    let done = router.shaper(&["batch", "-f", half.path()]).unwrap();
    assert!(done.contains("25 classes deleted"), "{done}");
    let ids = class_ids(router);
    assert_eq!(ids.len(), 28);
    let kernel = htb_classes(router, ROUTER_TO_SERVER);
    assert_eq!(
        kernel.len(),
        3 * 28,
        "the others' HTB classes whole: {kernel:?}"
    );
    for id in ids.values() {
        for handle in handles(*id) {
            assert!(kernel.contains_key(&handle), "{handle} of class {id}");
        }
    }

    let mut rest: Vec<String> = (25..50).map(|i| format!("b{i}")).collect();
    rest.extend(names(&["c2", "c1", "p"]));
    let rest = ConfigFile::new("rest", &del(&rest));
    router.shaper(&["batch", "-f", rest.path()]).unwrap();
    assert!(class_ids(router).is_empty());
    assert!(htb_classes(router, ROUTER_TO_SERVER).is_empty());
    let root = router
        .run("tc", &["qdisc", "show", "dev", ROUTER_TO_SERVER, "root"])
        .unwrap();
    assert!(
        !stdout(&root).contains("5348:"),
        "shaper's root is gone: {}",
        stdout(&root)
    );
}
