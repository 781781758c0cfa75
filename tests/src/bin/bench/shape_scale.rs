//! Shape classes at scale (issue 54), side by side in one run on veths in the router's
//! namespace: `shaper batch` adding N shape classes, beside `tc -batch` building the
//! reference tree (an HTB class, a bfifo leaf and a u32 filter per class) and shaper's own
//! tree by hand (an inner class with two leaf classes and their bfifos per class); then
//! one `class change`, deleting them all with one batch, `apply` of a file with them and
//! of the same file again (nothing to do), and `detach`.

use super::timed;
use anyhow::Result;
use serde_json::{json, Value};
use shaper_tests::{Lab, Netns};
use std::process::Command;

fn shaper(router: &Netns, args: &[&str]) -> Command {
    let mut command = Command::new(shaper_tests::shaper_bin());
    command.args(["--netns", &router.name]).args(args);
    command
}

fn add_line(i: u32) -> String {
    format!(
        "class add s{i} --dev ss0 --rate {}mbit --dst 198.19.{}.{}/32 --action shape",
        1 + i % 50,
        i / 250,
        i % 250 + 1
    )
}

/// `tc -batch` lines building `count` classes on `dev`: shaper's tree when `shapers`,
/// the reference tree otherwise.
fn tc_lines(dev: &str, count: u32, shapers: bool) -> Vec<String> {
    let mut lines = vec![format!(
        "qdisc add dev {dev} root handle 5348: htb default 0"
    )];
    for i in 0..count {
        let class = format!("5348:{:x}", i + 1);
        let rate = format!("{}mbit", 1 + i % 50);
        lines.push(format!(
            "class add dev {dev} parent 5348: classid {class} htb rate {rate} burst 128k quantum 1514"
        ));
        if shapers {
            for (base, prio) in [(0x4000, 0), (0x8000, 1)] {
                let leaf = format!("5348:{:x}", base + i + 1);
                lines.push(format!(
                    "class add dev {dev} parent {class} classid {leaf} htb rate 1mbit ceil {rate} \
                     burst 128k prio {prio} quantum 1514"
                ));
                lines.push(format!(
                    "qdisc add dev {dev} parent {leaf} bfifo limit 125000"
                ));
            }
        } else {
            lines.push(format!(
                "qdisc add dev {dev} parent {class} bfifo limit 125000"
            ));
            lines.push(format!(
                "filter add dev {dev} parent 5348: protocol ip prio 1 u32 match ip dst 198.19.{}.{}/32 flowid {class}",
                i / 250,
                i % 250 + 1
            ));
        }
    }
    lines
}

/// The section: times in seconds, and the targets beside them.
pub(crate) fn shape_scale(lab: &Lab, count: u32) -> Result<Value> {
    let router = &lab.router;
    for dev in ["ss0", "ss1", "ss2"] {
        let peer = format!("{dev}p");
        router.run(
            "ip",
            &["link", "add", dev, "type", "veth", "peer", "name", &peer],
        )?;
    }
    router.shaper(&["attach", "ss0"])?;
    let dir = std::env::temp_dir().join(format!("shaper-bench-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = |name: &str, lines: &[String]| -> Result<std::path::PathBuf> {
        let path = dir.join(name);
        std::fs::write(&path, lines.join("\n") + "\n")?;
        Ok(path)
    };
    // One tree at a time, each taken down before the next is timed: the kernel keeps
    // one machine-wide list of the filter blocks of devices like veths, which every new
    // HTB class scans, so a tree left standing slows the next one down.
    let tc_batch = |dev: &str, shapers: bool| -> Result<f64> {
        let path = file(dev, &tc_lines(dev, count, shapers))?;
        let mut command = router.command("tc");
        command.arg("-batch").arg(path);
        let seconds = timed(command)?;
        router.run("tc", &["qdisc", "del", "dev", dev, "root"])?;
        Ok(seconds)
    };
    let tc_reference = tc_batch("ss1", false)?;
    let tc_same_tree = tc_batch("ss2", true)?;
    let adds: Vec<String> = (0..count).map(add_line).collect();
    let batch = |path: std::path::PathBuf| {
        let mut command = shaper(router, &["batch", "-f"]);
        command.arg(path);
        timed(command)
    };
    let batch_add = batch(file("add", &adds)?)?;
    let middle = (count / 2).to_string();
    let change = timed(shaper(
        router,
        &[
            "class",
            "change",
            &format!("s{middle}"),
            "--dev",
            "ss0",
            "--rate",
            "7mbit",
        ],
    ))?;
    // This device's classes only: the bench's other sections leave attachments in the
    // same namespace, which a whole export would apply too.
    let exported = router.shaper(&["export", "--dev", "ss0"])?;
    let deletes: Vec<String> = (0..count)
        .map(|i| format!("class del s{i} --dev ss0"))
        .collect();
    let delete_all = batch(file("del", &deletes)?)?;
    // The exported file names its namespace: applied without --netns.
    let config = file("config.toml", &[exported])?;
    let apply = || {
        let mut command = Command::new(shaper_tests::shaper_bin());
        command.arg("apply").arg("-f").arg(&config);
        timed(command)
    };
    let apply_all = apply()?;
    let apply_again = apply()?;
    let detach = timed(shaper(router, &["detach", "ss0"]))?;
    let _ = std::fs::remove_dir_all(&dir);
    let report = json!({
        "classes": count,
        "seconds": {
            "shaper_batch_add": batch_add,
            "tc_batch_reference_tree": tc_reference,
            "tc_batch_shapers_tree": tc_same_tree,
            "class_change": change,
            "shaper_batch_delete_all": delete_all,
            "apply_file": apply_all,
            "apply_same_file_again": apply_again,
            "detach": detach,
        },
        "ratio_batch_to_tc_reference": batch_add / tc_reference,
        "ratio_batch_to_tc_same_tree": batch_add / tc_same_tree,
    });
    print(&report);
    Ok(report)
}

fn print(report: &Value) {
    let s = |name: &str| report["seconds"][name].as_f64().unwrap_or(f64::NAN);
    let count = report["classes"].as_u64().unwrap_or(0);
    println!(
        "{count} shape classes: shaper batch {:.2} s; tc -batch reference tree (class + bfifo + u32) {:.2} s (ratio {:.2}, target <= 1.5; <= 5 s at 10 000); tc -batch of shaper's own tree {:.2} s (ratio {:.2})",
        s("shaper_batch_add"),
        s("tc_batch_reference_tree"),
        report["ratio_batch_to_tc_reference"].as_f64().unwrap_or(f64::NAN),
        s("tc_batch_shapers_tree"),
        report["ratio_batch_to_tc_same_tree"].as_f64().unwrap_or(f64::NAN),
    );
    println!(
        "  class change {:.1} ms (target <= 20); delete all {:.2} s and detach {:.2} s (target <= 2); apply {:.2} s, the same file again {:.2} s (target <= 1)",
        s("class_change") * 1e3,
        s("shaper_batch_delete_all"),
        s("detach"),
        s("apply_file"),
        s("apply_same_file_again"),
    );
}

/// The section in BENCHMARKS.md (nothing for a report from before it).
pub(crate) fn markdown(report: &Value) -> String {
    if report.is_null() {
        return String::new();
    }
    let s = |name: &str| report["seconds"][name].as_f64().unwrap_or(f64::NAN);
    let mut out = format!(
        "\n### Shape classes at scale\n\n{} shape classes on one veth (`shaper-bench --only shape-scale` alone). Targets (issue 54): `shaper batch` ≤ 1.5 × `tc -batch` of the reference tree and ≤ 5 s at 10 000; delete all or detach ≤ 2 s; `apply` of the same file again ≤ 1 s; one `class change` ≤ 20 ms.\n\n| what | seconds | × tc -batch, reference tree |\n|---|---|---|\n",
        report["classes"]
    );
    let tc = s("tc_batch_reference_tree");
    for (what, name) in [
        ("`shaper batch` adding them", "shaper_batch_add"),
        ("`tc -batch`, reference tree: an HTB class, a bfifo leaf and a u32 filter each", "tc_batch_reference_tree"),
        ("`tc -batch`, shaper's own tree: an inner class, two leaf classes and their bfifos each", "tc_batch_shapers_tree"),
        ("`shaper class change` of one", "class_change"),
        ("`shaper batch` deleting them all", "shaper_batch_delete_all"),
        ("`shaper apply` of a file with them", "apply_file"),
        ("`shaper apply` of the same file again", "apply_same_file_again"),
        ("`shaper detach`", "detach"),
    ] {
        out.push_str(&format!("| {what} | {:.3} | {:.2} |\n", s(name), s(name) / tc));
    }
    out
}
