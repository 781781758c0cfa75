//! Upgrades (issue 11, item 11): pins carry the layout version of the shaper that made
//! them, and a shaper of another layout refuses them with what to do, shows them in
//! `status`, and can still detach them, while the attached program keeps policing.

use anyhow::{ensure, Context as _, Result};
use aya::maps::{Array, Map, MapData};
use shaper_common::{map_names, LAYOUT_VERSION};
use shaper_tests::{
    assert_within, counter, stderr, Lab, Netns, Udp, CLIENT_DEV, ROUTER_TO_CLIENT, ROUTER_TO_SERVER,
};
use std::{path::PathBuf, time::Duration};

/// Maps layouts after 0 added, which an upgrade from layout 0 creates.
const ADDED_SINCE_LAYOUT_0: [&str; 8] = [
    map_names::KEY_STATS,
    map_names::SHARES,
    map_names::VERDICT_CACHE,
    map_names::CODEL_FLOWS,
    map_names::SPLIT_TO,
    map_names::FLOW_QUEUES,
    map_names::SHAPE_STATS,
    map_names::FLOW_SCRATCH,
];

/// The router's egress attachment's pin directory.
fn pin_dir(router: &Netns) -> PathBuf {
    PathBuf::from(format!(
        "/sys/fs/bpf/shaper/netns-{}/{ROUTER_TO_SERVER}/egress",
        router.name.replace('.', "%2E")
    ))
}

fn set_layout(router: &Netns, version: u32) -> Result<()> {
    let pin = pin_dir(router).join(map_names::LAYOUT);
    let data = MapData::from_pin(&pin).with_context(|| format!("open {}", pin.display()))?;
    let mut layout: Array<MapData, u32> = Array::try_from(Map::from_map_data(data)?)?;
    layout.set(0, version, 0)?;
    Ok(())
}

/// `class add` on the router: must fail with one line containing `expected`.
fn refused(router: &Netns, args: &[&str], expected: &str) -> Result<()> {
    let output = router.shaper_output(args);
    let message = stderr(&output);
    println!(
        "shaper {}: exit {:?}: {message}",
        args.join(" "),
        output.status.code()
    );
    ensure!(
        output.status.code() == Some(1),
        "exit {:?}",
        output.status.code()
    );
    ensure!(message.lines().count() == 1, "not one line: {message}");
    ensure!(message.contains(expected), "{message}");
    Ok(())
}

#[test]
fn pins_of_another_layout_are_refused_shown_and_still_detach() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &[])?;
    lab.router
        .class_add("udp", dev, &["--rate", "1mbit", "--proto", "udp"])?;
    ensure!(lab.router.status_row()?["problem"].is_null());

    // A newer shaper's pins: every command that reads or writes them says so.
    set_layout(&lab.router, LAYOUT_VERSION + 1)?;
    let newer = format!(
        "attached by a newer shaper (state layout {}; this shaper reads layout {LAYOUT_VERSION})",
        LAYOUT_VERSION + 1
    );
    let add = [
        "class", "add", "x", "--dev", dev, "--rate", "2mbit", "--proto", "tcp",
    ];
    refused(&lab.router, &add, &newer)?;
    refused(&lab.router, &["class", "list"], &newer)?;
    refused(&lab.router, &["stats"], &newer)?;
    refused(&lab.router, &["export"], &newer)?;
    refused(&lab.router, &["attach", dev], &newer)?;
    refused(&lab.router, &["upgrade", dev], &newer)?;
    // `status` shows it and succeeds; the program it cannot read still polices.
    let row = lab.router.status_row()?;
    println!("status: {row}");
    ensure!(
        row["live"] == false
            && row["problem"]
                == format!(
                    "state layout {}, this shaper reads {LAYOUT_VERSION}",
                    LAYOUT_VERSION + 1
                )
            && row["classes"].is_null(),
        "{row}"
    );
    let text = lab.router.shaper(&["status"])?;
    ensure!(text.contains("other shaper version"), "{text}");
    assert_within(
        "policed under a newer layout",
        lab.udp_delivered_bps()?,
        1e6,
        0.05,
    );

    // Pins from before the stamp (no LAYOUT map) are an older shaper's.
    std::fs::remove_file(pin_dir(&lab.router).join(map_names::LAYOUT))?;
    refused(
        &lab.router,
        &add,
        &format!(
            "attached by an older shaper (state layout 0; this shaper reads layout \
             {LAYOUT_VERSION}): run `shaper --netns {} upgrade r1`",
            lab.router.name
        ),
    )?;

    // Detach works whatever the layout: the pins and the hook are gone.
    let detach = lab.router.shaper_output(&["detach", dev]);
    ensure!(detach.status.success(), "{}", stderr(&detach));
    ensure!(!pin_dir(&lab.router).exists());
    let rows = lab.router.shaper_json(&["status", "--json"])?;
    ensure!(
        rows.as_array().is_some_and(|rows| rows.is_empty()),
        "{rows}"
    );
    let unpoliced = lab.udp_delivered_bps()?;
    println!("after detach: {:.2} Mbit/s delivered", unpoliced / 1e6);
    ensure!(unpoliced > 5e6, "still policed after detach: {unpoliced}");

    // A fresh attach stamps this shaper's layout again.
    lab.router.attach(dev, &[])?;
    ensure!(lab.router.status_row()?["problem"].is_null());
    Ok(())
}

/// The class's counters: (passed, dropped) packets.
fn counted(router: &Netns) -> Result<(u64, u64)> {
    let row = router.stats_row("udp")?;
    Ok((
        counter(&row, "passed_packets"),
        counter(&row, "dropped_packets"),
    ))
}

/// `shaper upgrade --reload` in the middle of 6 s of UDP at 10 Mbit/s through a 5 Mbit/s
/// class, on pins made layout 0 just before (as the last unversioned shaper left them,
/// without the `LAYOUT` map): the program is
/// swapped, the layout migrated, every datagram met one program or the other (the class
/// counted them all), and no 100 ms bin at the server shows a gap or a burst.
fn upgrade_under_load(mode: &str) -> Result<()> {
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    let dev = ROUTER_TO_SERVER;
    router.attach(dev, &["--attach-mode", mode])?;
    router.class_add("udp", dev, &["--rate", "5mbit", "--proto", "udp"])?;
    let old_program = router.status_row()?["program_id"].clone();
    let (run, upgraded, at) = std::thread::scope(|scope| -> Result<_> {
        let traffic = scope.spawn(|| {
            lab.udp(&Udp {
                interval: Some(0.1),
                ..Udp::at("10M", 6)
            })
        });
        // Two seconds after the first datagram met the class: mid-run.
        router.wait_for_class_traffic("udp", Duration::from_secs(10))?;
        std::thread::sleep(Duration::from_secs(2));
        let before = counted(&router)?;
        // Layout 0 pins: no LAYOUT stamp, and no KEY_STATS (layout 3), SHARES (layout 4),
        // VERDICT_CACHE (layout 5), CODEL_FLOWS (layout 6), SPLIT_TO (layout 8) or the
        // flow isolation's maps (layout 9), which the upgrade creates.
        let added_since = ADDED_SINCE_LAYOUT_0;
        for map in [map_names::LAYOUT].iter().chain(&added_since) {
            std::fs::remove_file(pin_dir(&router).join(map))?;
        }
        let upgraded = router.shaper(&["upgrade", dev, "--reload"])?;
        let run = traffic.join().expect("the UDP run")?;
        Ok((run, upgraded, before))
    })?;
    println!("{mode}: {}", upgraded.trim());
    ensure!(
        upgraded.contains("upgraded")
            && upgraded.contains(&format!("state layout 0 -> {LAYOUT_VERSION}")),
        "{upgraded}"
    );
    let row = router.status_row()?;
    ensure!(row["problem"].is_null(), "{row}");
    for map in ADDED_SINCE_LAYOUT_0 {
        ensure!(
            pin_dir(&router).join(map).exists(),
            "the upgrade did not create {map}"
        );
    }
    ensure!(
        row["program_id"] != old_program,
        "the program was not swapped: {row}"
    );

    let (passed, dropped) = counted(&router)?;
    println!(
        "{mode}: counters at the upgrade {at:?}, after the run ({passed}, {dropped}); the \
         server accounted for {} datagrams",
        run.packets
    );
    ensure!(
        passed > at.0 && dropped > at.1,
        "the counters did not carry on"
    );
    // iperf3's few setup datagrams are UDP too: the class counts them, the run does not.
    let counted_all = passed + dropped;
    ensure!(
        counted_all >= run.packets && counted_all <= run.packets + 4,
        "the class counted {counted_all} datagrams of {}: some passed no program",
        run.packets
    );
    assert_within("rate over the run", run.l2_bps_between(1.0, 6.0), 5e6, 0.03);
    let bins: Vec<f64> = run
        .intervals
        .iter()
        .filter(|(end, _)| *end > 1.05 && *end <= 6.0)
        .map(|(_, bits)| bits / 0.1)
        .collect();
    let (low, high) = bins.iter().fold((f64::MAX, 0.0f64), |(low, high), &bps| {
        (low.min(bps), high.max(bps))
    });
    println!(
        "{mode}: {} bins of 100 ms from 1 s: {:.2}-{:.2} Mbit/s",
        bins.len(),
        low / 1e6,
        high / 1e6
    );
    ensure!(bins.len() >= 45, "only {} bins", bins.len());
    ensure!(
        low > 0.9 * 5e6 && high < 1.1 * 5e6,
        "a 100 ms bin left the rate: {low:.0}-{high:.0} bit/s"
    );
    Ok(())
}

#[test]
fn upgrade_swaps_the_tcx_program_under_load_without_a_gap() -> Result<()> {
    upgrade_under_load("tcx")
}

#[test]
fn upgrade_swaps_the_clsact_program_under_load_without_a_gap() -> Result<()> {
    upgrade_under_load("clsact")
}

/// `upgrade --all` (with `--netns`: that namespace's attachments only) swaps the program
/// of every attachment there, both directions, keeps their classes and counters, and
/// leaves another namespace's attachment alone.
#[test]
fn upgrade_all_swaps_every_attachment_of_the_namespace() -> Result<()> {
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[])?;
    router.class_add(
        "udp",
        ROUTER_TO_SERVER,
        &["--rate", "5mbit", "--proto", "udp"],
    )?;
    router.attach(ROUTER_TO_CLIENT, &["--direction", "ingress"])?;
    router.class_add(
        "in",
        ROUTER_TO_CLIENT,
        &[
            "--direction",
            "ingress",
            "--rate",
            "50mbit",
            "--proto",
            "udp",
        ],
    )?;
    lab.client.attach(CLIENT_DEV, &[])?;
    let client_before = lab.client.attachments()?;
    lab.udp(&Udp::at("10M", 2))?;
    let counters_before = counted(&router)?;
    let before = router.attachments()?;
    let upgraded = router.shaper(&["upgrade", "--all", "--reload"])?;
    // No traffic since: the counters are exactly as they were.
    ensure!(
        counted(&router)? == counters_before,
        "the upgrade changed the counters: {counters_before:?} -> {:?}",
        counted(&router)?
    );
    println!("{}", upgraded.trim());
    let after = router.attachments()?;
    println!("router before {before:?}, after {after:?}");
    ensure!(after.len() == 2, "{after:?}");
    for ((dev, direction, old), (_, _, new)) in before.iter().zip(&after) {
        ensure!(old != new, "{dev} {direction}: program {old} not swapped");
        ensure!(
            upgraded.contains(dev.as_str()),
            "{dev} not in the output: {upgraded}"
        );
    }
    ensure!(
        lab.client.attachments()? == client_before,
        "the client namespace's attachment changed"
    );
    let run = lab.udp(&Udp::at("10M", 3))?;
    assert_within(
        "after upgrade --all",
        run.l2_bps_between(1.0, 3.0),
        5e6,
        0.03,
    );
    let (passed, dropped) = counted(&router)?;
    ensure!(
        passed > counters_before.0 && dropped > counters_before.1,
        "the counters did not carry on: {counters_before:?} -> ({passed}, {dropped})"
    );
    Ok(())
}

/// A file to `apply`, removed on drop.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new(tag: &str, text: &str) -> Result<Self> {
        let path =
            std::env::temp_dir().join(format!("shaper-test-{}-{tag}.toml", std::process::id()));
        std::fs::write(&path, text)?;
        Ok(Self(path))
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// UDP at 10 Mbit/s for 6 s through the router's `udp` class, with `during` run 2 s into
/// it: the run, the class's counters just before `during`, and what `during` returned.
fn under_load<T>(
    lab: &mut Lab,
    during: impl FnOnce(&Netns) -> Result<T> + Send,
) -> Result<(shaper_tests::UdpResult, (u64, u64), T)>
where
    T: Send,
{
    let router = lab.router.clone();
    std::thread::scope(|scope| -> Result<_> {
        let traffic = scope.spawn(|| {
            lab.udp(&Udp {
                interval: Some(0.1),
                ..Udp::at("10M", 6)
            })
        });
        router.wait_for_class_traffic("udp", Duration::from_secs(10))?;
        std::thread::sleep(Duration::from_secs(2));
        let before = counted(&router)?;
        let result = during(&router);
        let run = traffic.join().expect("the UDP run")?;
        Ok((run, before, result?))
    })
}

/// The server's 100 ms bins from the 1st second on (at least 45 of them) all within
/// `low`-`high` times the class's 5 Mbit/s; `what` names the run in the output.
fn bins_within(what: &str, run: &shaper_tests::UdpResult, low: f64, high: f64) -> Result<()> {
    let (lowest, highest, count) = bins(run);
    println!(
        "{what}: {count} bins of 100 ms from 1 s: {:.2}-{:.2} Mbit/s",
        lowest / 1e6,
        highest / 1e6
    );
    ensure!(count >= 45, "only {count} bins");
    ensure!(
        lowest > low * 5e6 && highest < high * 5e6,
        "a 100 ms bin left the rate: {lowest:.0}-{highest:.0} bit/s"
    );
    Ok(())
}

/// The class's counters went on from `at` (both passed and dropped grew); they now.
fn carried_on(router: &Netns, at: (u64, u64)) -> Result<(u64, u64)> {
    let (passed, dropped) = counted(router)?;
    ensure!(
        passed > at.0 && dropped > at.1,
        "the counters did not carry on"
    );
    Ok((passed, dropped))
}

/// The lowest and highest 100 ms bin at the server from the 1st second on, and how many.
fn bins(run: &shaper_tests::UdpResult) -> (f64, f64, usize) {
    let bins: Vec<f64> = run
        .intervals
        .iter()
        .filter(|(end, _)| *end > 1.05 && *end <= 6.0)
        .map(|(_, bits)| bits / 0.1)
        .collect();
    let (low, high) = bins.iter().fold((f64::MAX, 0.0f64), |(low, high), &bps| {
        (low.min(bps), high.max(bps))
    });
    (low, high, bins.len())
}

/// `apply` of a file whose flow table is 4 times larger, 2 s into a UDP run through a
/// per-flow class: the table is resized under traffic (not detached and attached again),
/// the flow's bucket, the class and its counters carry on, and no 100 ms bin leaves the
/// rate by more than 5 %.
#[test]
fn apply_resizes_the_flow_table_under_load_without_a_gap() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &["--flow-table-size", "1024"])?;
    lab.router.class_add(
        "udp",
        dev,
        &["--rate", "5mbit", "--proto", "udp", "--per", "flow"],
    )?;
    let old_program = lab.router.status_row()?["program_id"].clone();
    let exported = lab.router.shaper(&["export"])?;
    let wanted = exported.replace("flow_table_size = 1024", "flow_table_size = 4096");
    ensure!(
        wanted != exported,
        "no flow_table_size in the export: {exported}"
    );
    let file = ConfigFile::new("resize", &wanted)?;
    let (run, at, applied) = under_load(&mut lab, |_| {
        let output = shaper_tests::shaper(&["apply", "-f", file.path()]);
        ensure!(output.status.success(), "{}", stderr(&output));
        Ok(shaper_tests::stdout(&output))
    })?;
    println!("apply: {}", applied.trim());
    ensure!(
        applied.contains("resize") && !applied.contains("detach"),
        "{applied}"
    );
    let row = lab.router.status_row()?;
    ensure!(
        row["flow_table_size"] == 4096 && row["problem"].is_null(),
        "{row}"
    );
    ensure!(
        row["program_id"] != old_program,
        "the program was not swapped: {row}"
    );
    let stats = lab.router.stats_row("udp")?;
    let (passed, dropped) = carried_on(&lab.router, at)?;
    let counted_all = passed + dropped;
    ensure!(
        counted_all >= run.packets && counted_all <= run.packets + 4,
        "the class counted {counted_all} datagrams of {}: some passed no program",
        run.packets
    );
    ensure!(stats["keys"] == 1, "the flow's bucket: {stats}");
    bins_within("resize under load", &run, 0.95, 1.05)?;
    Ok(())
}

/// `apply` of a file that changes a class's rate and adds a third class that cannot be
/// added (a shape class, where the interface's root qdisc is one the user made), 2 s into
/// a UDP run: exit 1 with one line, the change rolled back (the rate, the counters and
/// the class kept), and the traffic policed throughout at the old rate.
#[test]
fn a_failing_apply_rolls_back_under_load() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &[])?;
    lab.router
        .class_add("udp", dev, &["--rate", "5mbit", "--proto", "udp"])?;
    lab.router
        .class_add("tcp", dev, &["--rate", "2mbit", "--proto", "tcp"])?;
    let tc = lab.router.run(
        "tc",
        &[
            "qdisc", "replace", "dev", dev, "root", "handle", "1:", "pfifo", "limit", "1000",
        ],
    )?;
    ensure!(tc.status.success(), "tc: {}", stderr(&tc));
    let exported = lab.router.shaper(&["export"])?;
    let changed = exported.replace("rate = \"5mbit\"", "rate = \"3mbit\"");
    ensure!(
        changed != exported,
        "no 5mbit rate in the export: {exported}"
    );
    let wanted = format!(
        "{changed}\n[[interface.class]]\nname = \"bulk\"\nrate = \"1mbit\"\nproto = \"icmp\"\naction = \"shape\"\n"
    );
    let file = ConfigFile::new("rollback", &wanted)?;
    let (run, at, output) = under_load(&mut lab, |_| {
        Ok(shaper_tests::shaper(&["apply", "-f", file.path()]))
    })?;
    let message = stderr(&output);
    println!("apply: exit {:?}: {message}", output.status.code());
    ensure!(
        output.status.code() == Some(1),
        "exit {:?}",
        output.status.code()
    );
    ensure!(
        message.trim().lines().count() == 1,
        "not one line: {message}"
    );
    let rows = lab.router.shaper_json(&["class", "list", "--json"])?;
    let names: Vec<&str> = rows
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|row| row["name"].as_str())
        .collect();
    ensure!(names == ["udp", "tcp"] || names == ["tcp", "udp"], "{rows}");
    let udp = lab.router.stats_row("udp")?;
    ensure!(
        udp["rate_bps"] == 5_000_000,
        "the change was not rolled back: {udp}"
    );
    carried_on(&lab.router, at)?;
    assert_within("rate over the run", run.l2_bps_between(1.0, 6.0), 5e6, 0.03);
    bins_within("failed apply under load", &run, 0.9, 1.05)?;
    Ok(())
}

/// `apply` of a file with `attach_mode = "tcx"` 2 s into a UDP run through a class on a
/// clsact attachment: the program is hooked by TCX, then unhooked from clsact (not
/// detached and attached again); the class and its counters carry on and no 100 ms bin
/// leaves the rate by more than 5 % up or 10 % down.
#[test]
fn apply_switches_the_attach_mode_under_load_without_a_gap() -> Result<()> {
    let mut lab = Lab::new()?;
    let dev = ROUTER_TO_SERVER;
    lab.router.attach(dev, &["--attach-mode", "clsact"])?;
    lab.router
        .class_add("udp", dev, &["--rate", "5mbit", "--proto", "udp"])?;
    let exported = lab.router.shaper(&["export"])?;
    let wanted = exported.replace("attach_mode = \"clsact\"", "attach_mode = \"tcx\"");
    ensure!(
        wanted != exported,
        "no attach_mode in the export: {exported}"
    );
    let file = ConfigFile::new("switch", &wanted)?;
    let (run, at, applied) = under_load(&mut lab, |_| {
        let output = shaper_tests::shaper(&["apply", "-f", file.path()]);
        ensure!(output.status.success(), "{}", stderr(&output));
        Ok(shaper_tests::stdout(&output))
    })?;
    println!("apply: {}", applied.trim());
    ensure!(
        applied.contains("switch") && !applied.contains("detach"),
        "{applied}"
    );
    let row = lab.router.status_row()?;
    ensure!(
        row["attach_mode"] == "tcx" && row["problem"].is_null(),
        "{row}"
    );
    let filters = lab
        .router
        .run("tc", &["filter", "show", "dev", dev, "egress"])?;
    ensure!(
        String::from_utf8_lossy(&filters.stdout).trim().is_empty(),
        "a clsact filter is left: {}",
        String::from_utf8_lossy(&filters.stdout)
    );
    carried_on(&lab.router, at)?;
    bins_within("attach mode switched under load", &run, 0.9, 1.05)?;
    // And back by `attach --attach-mode clsact`: one clsact filter, the TCX link gone.
    let switched = lab.router.attach(dev, &["--attach-mode", "clsact"])?;
    ensure!(
        switched.contains("switched from tcx to clsact"),
        "{switched}"
    );
    let row = lab.router.status_row()?;
    ensure!(
        row["attach_mode"] == "clsact" && row["problem"].is_null(),
        "{row}"
    );
    let filters = lab
        .router
        .run("tc", &["filter", "show", "dev", dev, "egress"])?;
    let filters = String::from_utf8_lossy(&filters.stdout).to_string();
    ensure!(
        filters.matches("bpf").count() >= 1,
        "no clsact filter: {filters}"
    );
    assert_within(
        "policed after switching back",
        lab.udp_delivered_bps()?,
        5e6,
        0.05,
    );
    Ok(())
}

/// Layout 8 to 9 (flow isolation): a shape class attached by a layout-8 shaper (its fair
/// mode zero in what was padding, none of the new maps pinned) comes out of `upgrade`
/// with the one queue it had (`fair none`), the new maps made; `class change --fair
/// flow` then isolates it in place: a UDP flood at twice the rate leaves a Cubic flow its
/// share.
#[test]
fn upgrade_from_layout_8_keeps_shape_classes_and_change_makes_them_fair() -> Result<()> {
    use shaper_common::{ClassConfig, ClassMeta};
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[])?;
    router.class_add(
        "bulk",
        ROUTER_TO_SERVER,
        &shaper_tests::shape_to_server("10mbit"),
    )?;
    // What a layout-8 shaper left: the class's fair mode zero, the new maps absent.
    let open = |name: &str| -> Result<Map> {
        let pin = pin_dir(&router).join(name);
        Ok(Map::from_map_data(MapData::from_pin(&pin)?)?)
    };
    let mut classes: Array<MapData, ClassConfig> = Array::try_from(open(map_names::CLASSES)?)?;
    let mut metas: Array<MapData, ClassMeta> = Array::try_from(open(map_names::CLASS_META)?)?;
    let id = (0..shaper_common::MAX_CLASSES)
        .find(|&id| classes.get(&id, 0).is_ok_and(|c| c.in_use != 0))
        .context("the class's id")?;
    let mut config = classes.get(&id, 0)?;
    config.codel.fair = 0;
    classes.set(id, config, 0)?;
    let mut meta = metas.get(&id, 0)?;
    meta.fair = 0;
    metas.set(id, meta, 0)?;
    for map in [
        map_names::FLOW_QUEUES,
        map_names::SHAPE_STATS,
        map_names::FLOW_SCRATCH,
    ] {
        std::fs::remove_file(pin_dir(&router).join(map))?;
    }
    set_layout(&router, 8)?;
    let upgraded = router.shaper(&["upgrade", ROUTER_TO_SERVER])?;
    println!("{}", upgraded.trim());
    ensure!(
        upgraded.contains(&format!("state layout 8 -> {LAYOUT_VERSION}")),
        "{upgraded}"
    );
    let rows = router.shaper_json(&["class", "list", "--json"])?;
    ensure!(rows[0]["fair"] == "none", "after the upgrade: {}", rows[0]);
    router.shaper(&[
        "class",
        "change",
        "bulk",
        "--dev",
        ROUTER_TO_SERVER,
        "--fair",
        "flow",
    ])?;
    let rows = router.shaper_json(&["class", "list", "--json"])?;
    ensure!(rows[0]["fair"] == "flow", "after the change: {}", rows[0]);
    ensure!(classes.get(&id, 0)?.codel.fair == shaper_common::fair::FAIR_FLOW);
    for map in [
        map_names::FLOW_QUEUES,
        map_names::SHAPE_STATS,
        map_names::FLOW_SCRATCH,
    ] {
        ensure!(
            pin_dir(&router).join(map).exists(),
            "no {map} after the upgrade"
        );
    }
    // As `fairness.rs`' cell (30 s from 10 s): 10 s from 5 s read 0.395 once, the
    // shares still settling.
    let flood = shaper_tests::fairness::udp_flood("20M", 30);
    let cubic = shaper_tests::fairness::tcp("cubic", 30);
    let shares = shaper_tests::fairness::run_cell(
        &mut lab,
        10e6,
        &[&cubic],
        &[&flood],
        Duration::from_secs(10),
    )?;
    println!("after the upgrade: {shares}");
    ensure!(
        shares.tcp[0] >= 0.4,
        "Cubic got {:.3} beside the flood",
        shares.tcp[0]
    );
    Ok(())
}
