//! Options that no other test would miss if their value were ignored, each read back from
//! what it changes (the program's maps, `class list`, `status`, the output): `--dev` and
//! `--direction` of every command that takes them, class fields given on the command line
//! and changed in place, `stats --interval`, and `-v`. No traffic. Every option and field
//! is listed with the tests that guard it in tests/guards.toml (checked by shaper-cli's
//! `every_option_and_field_has_a_guard`).

use anyhow::{Context as _, Result};
use serde_json::Value;
use shaper::state::{Attachment, Direction, Location};
use shaper_common::{codel::CodelConfig, fair::FAIR_FLOW, Action, ClassConfig};
use shaper_tests::{
    output_bounded, shaper_bin, stderr, Lab, Netns, COMMAND_LIMIT, ROUTER_TO_CLIENT,
    ROUTER_TO_SERVER,
};
use std::process::Command;

/// `class list --json ARGS` as (dev, direction, name, rate), sorted.
fn classes(ns: &Netns, args: &[&str]) -> Result<Vec<(String, String, String, u64)>> {
    let list = ns.shaper_json(&[&["class", "list", "--json"][..], args].concat())?;
    let mut rows: Vec<_> = list
        .as_array()
        .context("class list is a list")?
        .iter()
        .map(|row| {
            (
                row["dev"].as_str().unwrap_or_default().to_string(),
                row["direction"].as_str().unwrap_or_default().to_string(),
                row["name"].as_str().unwrap_or_default().to_string(),
                row["rate_bps"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    rows.sort();
    Ok(rows)
}

/// Every (interface, direction) shaper is attached to in `ns`, sorted.
fn hooked(ns: &Netns) -> Result<Vec<(String, String)>> {
    Ok(ns
        .attachments()?
        .into_iter()
        .map(|(dev, direction, _)| (dev, direction))
        .collect())
}

fn pair(dev: &str, direction: &str) -> (String, String) {
    (dev.to_string(), direction.to_string())
}

fn row(dev: &str, direction: &str, name: &str, mbit: u64) -> (String, String, String, u64) {
    (dev.into(), direction.into(), name.into(), mbit * 1_000_000)
}

/// One name in both directions of r1 and a class on r0; each command narrowed to one of
/// them touches only it: `class list`, `stats` and `export` by `--dev`; `class change`,
/// `class del`, `upgrade` and `detach` by `--direction` (and a name in both directions
/// without it is refused).
#[test]
fn every_command_keeps_to_the_device_and_direction_it_names() -> Result<()> {
    let lab = Lab::new()?;
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &["--direction", "both"])?;
    router.attach(ROUTER_TO_CLIENT, &[])?;
    router.class_add("x", ROUTER_TO_SERVER, &["--rate", "1mbit"])?;
    router.class_add(
        "x",
        ROUTER_TO_SERVER,
        &["--direction", "ingress", "--rate", "2mbit"],
    )?;
    router.class_add("y", ROUTER_TO_CLIENT, &["--rate", "4mbit"])?;

    assert_eq!(
        classes(router, &["--dev", ROUTER_TO_SERVER])?,
        vec![row("r1", "egress", "x", 1), row("r1", "ingress", "x", 2)]
    );
    let stats = router.shaper_json(&["stats", "--json", "--dev", ROUTER_TO_CLIENT])?;
    let names: Vec<&str> = stats
        .as_array()
        .context("stats is a list")?
        .iter()
        .filter_map(|row| row["name"].as_str())
        .collect();
    assert_eq!(names, ["y"]);
    let exported = router.shaper(&["export", "--dev", ROUTER_TO_CLIENT])?;
    assert!(
        exported.contains("dev = \"r0\"") && !exported.contains("dev = \"r1\""),
        "{exported}"
    );

    for verb in [&["change", "x", "--rate", "3mbit"][..], &["del", "x"][..]] {
        let args = [&["class"][..], verb, &["--dev", ROUTER_TO_SERVER][..]].concat();
        let output = router.shaper_output(&args);
        assert_eq!(
            output.status.code(),
            Some(2),
            "a name in both directions needs --direction: {}",
            stderr(&output)
        );
    }
    router.shaper(&[
        "class",
        "change",
        "x",
        "--dev",
        ROUTER_TO_SERVER,
        "--direction",
        "ingress",
        "--rate",
        "3mbit",
    ])?;
    assert_eq!(
        classes(router, &["--dev", ROUTER_TO_SERVER])?,
        vec![row("r1", "egress", "x", 1), row("r1", "ingress", "x", 3)]
    );
    router.shaper(&[
        "class",
        "del",
        "x",
        "--dev",
        ROUTER_TO_SERVER,
        "--direction",
        "egress",
    ])?;
    assert_eq!(
        classes(router, &[])?,
        vec![row("r0", "egress", "y", 4), row("r1", "ingress", "x", 3)]
    );

    let before = router.attachments()?;
    router.shaper(&[
        "upgrade",
        ROUTER_TO_SERVER,
        "--reload",
        "--direction",
        "ingress",
    ])?;
    let after = router.attachments()?;
    let changed: Vec<(&str, &str)> = before
        .iter()
        .zip(&after)
        .filter(|(old, new)| old.2 != new.2)
        .map(|(old, _)| (old.0.as_str(), old.1.as_str()))
        .collect();
    assert_eq!(changed, [("r1", "ingress")], "{before:?} -> {after:?}");

    router.shaper(&["detach", ROUTER_TO_SERVER, "--direction", "ingress"])?;
    let left = hooked(router)?;
    assert_eq!(left, [pair("r0", "egress"), pair("r1", "egress")]);
    Ok(())
}

/// The class `name` on r1's egress: its `class list` row and its config in the program's
/// class map.
fn class_state(ns: &Netns, name: &str) -> Result<(Value, ClassConfig, Attachment)> {
    let list = ns.shaper_json(&["class", "list", "--json", "--dev", ROUTER_TO_SERVER])?;
    let row = list
        .as_array()
        .context("class list is a list")?
        .iter()
        .find(|row| row["name"] == name)
        .with_context(|| format!("no class {name}"))?
        .clone();
    let id = row["id"].as_u64().context("a class id")? as u32;
    let attachment = Attachment::open(&Location {
        netns: Some(ns.name.clone()),
        dev: ROUTER_TO_SERVER.into(),
        direction: Direction::Egress,
    })?;
    let config = attachment.classes()?.get(&id, 0)?;
    Ok((row, config, attachment))
}

/// Class fields given to `class add` and `class change` on the command line reach the
/// program's class map and `class list`: CoDel's target, interval and ECN; burst and
/// action changed in place; a child's ceiling burst added and changed, and the child
/// moved to the top; a global class's loss mode.
#[test]
fn class_fields_on_the_command_line_reach_the_program() -> Result<()> {
    let lab = Lab::new()?;
    let router = &lab.router;
    router.attach(ROUTER_TO_SERVER, &[])?;
    let change = |name: &str, args: &[&str]| -> Result<String> {
        router.shaper(
            &[
                &["class", "change", name, "--dev", ROUTER_TO_SERVER][..],
                args,
            ]
            .concat(),
        )
    };

    let codel = |target_ms: u64, interval_ms: u64| {
        CodelConfig::new(target_ms * 1_000_000, interval_ms * 1_000_000, 10_000_000)
            .with_ecn(false)
            .with_fair(FAIR_FLOW)
    };
    router.class_add(
        "shaped",
        ROUTER_TO_SERVER,
        &[
            "--rate",
            "10mbit",
            "--action",
            "shape",
            "--proto",
            "tcp",
            "--target",
            "3ms",
            "--interval",
            "50ms",
            "--ecn",
            "off",
        ],
    )?;
    let (row, config, _) = class_state(router, "shaped")?;
    assert_eq!(
        (&row["target"], &row["interval"], &row["ecn"]),
        (
            &Value::from("3ms"),
            &Value::from("50ms"),
            &Value::from(false)
        )
    );
    assert_eq!(config.codel, codel(3, 50));
    change("shaped", &["--target", "10ms"])?;
    let (row, config, _) = class_state(router, "shaped")?;
    assert_eq!(row["target"], "10ms");
    assert_eq!(config.codel, codel(10, 50));

    router.class_add(
        "policed",
        ROUTER_TO_SERVER,
        &["--rate", "1mbit", "--proto", "udp", "--dport", "9"],
    )?;
    let (_, default_burst, _) = class_state(router, "policed")?;
    assert_ne!(default_burst.cost.burst_bytes, 65_536);
    change("policed", &["--burst", "64k"])?;
    let (row, config, _) = class_state(router, "policed")?;
    assert_eq!(
        (row["burst_bytes"].as_u64(), config.cost.burst_bytes),
        (Some(65_536), 65_536)
    );
    change("policed", &["--action", "fwmark=0x20"])?;
    let (row, config, _) = class_state(router, "policed")?;
    assert_eq!(row["action"], "fwmark=0x20");
    assert_eq!(
        (config.action, config.action_arg),
        (Action::Fwmark as u8, 0x20)
    );

    router.class_add(
        "tenant",
        ROUTER_TO_SERVER,
        &["--rate", "8mbit", "--proto", "udp", "--dport", "7000-7999"],
    )?;
    router.class_add(
        "child",
        ROUTER_TO_SERVER,
        &[
            "--parent", "tenant", "--rate", "2mbit", "--ceil", "4mbit", "--cburst", "50000",
            "--proto", "udp", "--dport", "7100",
        ],
    )?;
    let (row, config, _) = class_state(router, "child")?;
    assert_eq!(
        (row["cburst_bytes"].as_u64(), config.peak_cost.burst_bytes),
        (Some(50_000), 50_000)
    );
    change("child", &["--cburst", "40k"])?;
    let (row, config, _) = class_state(router, "child")?;
    assert_eq!(
        (row["cburst_bytes"].as_u64(), config.peak_cost.burst_bytes),
        (Some(40_960), 40_960)
    );
    assert_ne!(config.parent, 0, "the child is under tenant");
    change("child", &["--no-parent"])?;
    let (row, config, _) = class_state(router, "child")?;
    assert_eq!(
        (&row["parent"], row["depth"].as_u64()),
        (&Value::Null, Some(0))
    );
    assert_eq!(config.parent, 0, "a top-level class in the map");

    router.class_add(
        "shared",
        ROUTER_TO_SERVER,
        &[
            "--rate",
            "10mbit",
            "--proto",
            "udp",
            "--dport",
            "8000",
            "--global",
            "options-key",
            "--floor",
            "1mbit",
            "--on-coordinator-loss",
            "closed",
        ],
    )?;
    let (row, _, attachment) = class_state(router, "shared")?;
    assert_eq!(row["on_coordinator_loss"], "closed");
    let id = row["id"].as_u64().context("a class id")? as u32;
    let share = shaper::classes::share_of(&attachment, id)?;
    assert_eq!(share.on_loss, shaper_common::on_loss::CLOSED);
    Ok(())
}

/// `stats --watch --interval` samples at the interval asked (the default is 1 s).
#[test]
fn stats_watch_samples_at_the_interval_asked() -> Result<()> {
    let lab = Lab::new()?;
    lab.router.attach(ROUTER_TO_SERVER, &[])?;
    lab.router
        .class_add("idle", ROUTER_TO_SERVER, &["--rate", "1mbit"])?;
    let output = lab.router.shaper(&[
        "stats",
        "--watch",
        "--json",
        "--interval",
        "300ms",
        "--count",
        "3",
    ])?;
    let intervals: Vec<f64> = output
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).map(|v| v["interval_seconds"].clone()))
        .collect::<Result<Vec<_>, _>>()?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    assert_eq!(intervals.len(), 3, "{output}");
    assert!(
        intervals.iter().all(|s| (0.28..0.7).contains(s)),
        "{intervals:?}"
    );
    Ok(())
}

/// `-v` turns on debug lines (the program loaded, with its id), which are not printed
/// without it.
#[test]
fn verbose_prints_debug_lines_only_when_asked() -> Result<()> {
    let lab = Lab::new()?;
    let attach = |verbose: bool| -> Result<String> {
        let mut command = Command::new(shaper_bin());
        command
            .env_remove("RUST_LOG")
            .args(["--netns", &lab.router.name])
            .args(verbose.then_some("-v"))
            .args(["attach", ROUTER_TO_SERVER]);
        let output = output_bounded(&mut command, COMMAND_LIMIT)?;
        anyhow::ensure!(output.status.success(), "attach: {}", stderr(&output));
        lab.router.shaper(&["detach", ROUTER_TO_SERVER])?;
        Ok(stderr(&output))
    };
    let quiet = attach(false)?;
    assert!(!quiet.contains("DEBUG"), "{quiet}");
    let verbose = attach(true)?;
    assert!(
        verbose.contains("DEBUG") && verbose.contains("program loaded"),
        "{verbose}"
    );
    Ok(())
}

/// `attach --direction both --split-aggregates`: both directions attached, and the
/// ingress one splits aggregates through shaper's ifb (where the kernel's ifb forwards
/// redirects; elsewhere the attach is refused and leaves nothing).
#[test]
fn attach_both_directions_with_split_aggregates_splits_the_ingress() -> Result<()> {
    let lab = Lab::new()?;
    let router = &lab.router;
    let args = ["--direction", "both", "--split-aggregates"];
    if !shaper::qdisc::ifb_redirect_works() {
        let output = router.shaper_output(&[&["attach", ROUTER_TO_CLIENT][..], &args].concat());
        assert!(!output.status.success());
        assert!(router.attachments()?.is_empty(), "nothing half-attached");
        return Ok(());
    }
    router.attach(ROUTER_TO_CLIENT, &args)?;
    let directions = hooked(router)?;
    assert_eq!(directions, [pair("r0", "egress"), pair("r0", "ingress")]);
    let ifb = router.split_through(ROUTER_TO_CLIENT)?;
    assert!(ifb.is_some(), "the ingress splits through an ifb");
    Ok(())
}

/// Issue 53: `ip netns exec NS shaper …` works as `shaper --netns NS …`. ip netns exec
/// gives the command a private /sys without the host's bpffs; shaper goes back to the
/// host's mount namespace, so its pins outlive the command and `--netns` finds them (and
/// the other way round).
#[test]
fn ip_netns_exec_works_as_netns() -> Result<()> {
    let lab = Lab::new()?;
    let router = &lab.router;
    let shaper = shaper_bin();
    let exec = |args: &[&str]| -> Result<String> {
        let output = output_bounded(
            router
                .command(shaper.to_str().context("a UTF-8 path")?)
                .args(args),
            COMMAND_LIMIT,
        )?;
        anyhow::ensure!(
            output.status.success(),
            "ip netns exec {} shaper {}: {}",
            router.name,
            args.join(" "),
            stderr(&output)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    exec(&["attach", ROUTER_TO_SERVER])?;
    assert_eq!(hooked(router)?, [pair(ROUTER_TO_SERVER, "egress")]);
    exec(&[
        "class",
        "add",
        "web",
        "--dev",
        ROUTER_TO_SERVER,
        "--rate",
        "5mbit",
    ])?;
    assert_eq!(
        classes(router, &[])?,
        [row(ROUTER_TO_SERVER, "egress", "web", 5)]
    );
    router.class_add("api", ROUTER_TO_SERVER, &["--rate", "2mbit"])?;
    let listed = exec(&["class", "list"])?;
    assert!(listed.contains("api") && listed.contains("web"), "{listed}");
    exec(&["detach", ROUTER_TO_SERVER])?;
    assert!(hooked(router)?.is_empty());
    Ok(())
}
