//! `cargo xtask bench`: shaper measured side by side with its peers in one run, on the
//! namespace lab. Every figure is a ratio of two measurements taken in the same run.
//!
//! Usage: shaper-bench [--quick] [--only latency|per-packet|forwarding|global|uploads|senders|fairness] [--json FILE]
//! [--report FILE], or shaper-bench --compare OBJECT,OBJECT[,…] (builds of the eBPF object
//! timed against the first, turn by turn), or shaper-bench --only fairness [--rows TEXT]
//! (`--rows`: only the cells whose traffic contains TEXT, e.g. "host B": one cell, a
//! quick look), or, in a guest of `cargo xtask bench --vm`,
//! shaper-bench --only peers [--rows TEXT] --json FILE (`--rows`: only the rows whose
//! setup contains TEXT).
//! (`--only latency` runs the latency section alone, for a quick look; its report and
//! JSON hold that section only and its targets are the only ones checked.)
//! `--only dashboard [--report FILE]` draws contrib/grafana/shaper.json's panels from a
//! lab run with a real Prometheus into `bench/dashboard.png` beside the report.
//! (plots go to `bench/` beside the report).

mod dashboard;
mod fairness;
mod global;
mod heldout;
mod latency;
mod peers;
mod plots;
mod senders;
mod shape_scale;
mod traffic;
mod uploads;

use anyhow::{bail, Context as _, Result};
use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData},
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use serde_json::{json, Value};
use shaper::{
    classes::{self, ClassSpec, Fair, Tree},
    rules::{PortRange, Proto, Rule},
    state::{self, Attachment},
};
use shaper_common::{map_names, program_names, Bucket, BucketKey, Scope, FAMILY_V4, PROTO_UDP};
use shaper_tests::{output_bounded, Lab, Netns, COMMAND_LIMIT};
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};
use traffic::{AccuracyKey, Peer, TrafficEffort};

struct Options {
    quick: bool,
    /// Only this section (`latency`, `per-packet`, `forwarding`, `global`).
    only: Option<String>,
    json: Option<PathBuf>,
    report: Option<PathBuf>,
    /// `--compare`: builds of the eBPF object to time against the first, paired.
    compare: Vec<PathBuf>,
    /// `--publish-peers`: the guests' JSON of the peers section, to publish.
    publish_peers: Vec<String>,
    /// `--rows TEXT` (with `--only peers` or `--only fairness`): only the peers rows whose
    /// setup, or the fairness cells whose traffic, contains TEXT.
    rows: Option<String>,
}

fn options() -> Result<Options> {
    options_from(std::env::args().skip(1))
}

/// The non-empty items of a comma-separated option value.
fn comma_separated(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').filter(|item| !item.is_empty())
}

fn options_from(mut args: impl Iterator<Item = String>) -> Result<Options> {
    let mut options = Options {
        quick: false,
        only: None,
        json: None,
        report: None,
        compare: Vec::new(),
        publish_peers: Vec::new(),
        rows: None,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => options.quick = true,
            "--only" => {
                let section = args.next().context("--only needs a section")?;
                if ![
                    "latency",
                    "per-packet",
                    "global",
                    "forwarding",
                    "peers",
                    "uploads",
                    "fairness",
                    "senders",
                    "dashboard",
                    "shape-scale",
                ]
                .contains(&section.as_str())
                {
                    bail!(
                        "--only {section}: the sections that run alone are latency, per-packet, forwarding, global, uploads, senders, fairness, peers, dashboard and shape-scale"
                    );
                }
                options.only = Some(section);
            }
            "--compare" => {
                let objects = args.next().context("--compare needs OBJECT,OBJECT")?;
                options.compare = comma_separated(&objects).map(Into::into).collect();
                if options.compare.len() < 2 {
                    bail!("--compare {objects}: name two or more builds of the eBPF object, comma-separated");
                }
            }
            "--publish-peers" => {
                let files = args.next().context("--publish-peers needs FILE[,FILE]")?;
                options.publish_peers = comma_separated(&files).map(String::from).collect();
            }
            "--rows" => options.rows = Some(args.next().context("--rows needs a text")?),
            "--json" => options.json = Some(args.next().context("--json needs a file")?.into()),
            "--report" => {
                options.report = Some(args.next().context("--report needs a file")?.into())
            }
            other => {
                bail!("unknown argument {other} (expected --quick, --only latency|per-packet|forwarding|global|uploads|senders|fairness|peers|dashboard, --compare OBJECT,OBJECT, --publish-peers FILE,FILE, --rows TEXT, --json FILE, --report FILE)")
            }
        }
    }
    let other_options =
        options.only.is_some() || options.json.is_some() || options.report.is_some();
    if !options.compare.is_empty() && other_options {
        bail!("--compare runs alone: it takes no --only, --json or --report");
    }
    if options.rows.is_some() && !matches!(options.only.as_deref(), Some("peers" | "fairness")) {
        bail!("--rows narrows the peers or fairness section: it needs --only peers or --only fairness");
    }
    Ok(options)
}

/// Repetitions per test run and runs per case.
struct Effort {
    repeat: u32,
    runs: usize,
    live_flows: u32,
    classes: u16,
    /// Classes the control-plane section applies (and the tree's children).
    control_plane_classes: u16,
    traffic: TrafficEffort,
    latency: latency::LatencyEffort,
}

/// Classes the full run's control-plane section applies (its tree: 1 000 parents of 10).
const FULL_CONTROL_PLANE_CLASSES: u16 = 10_000;

/// How much a run does: `--quick` (CI) or the full run.
fn effort(quick: bool) -> Effort {
    if quick {
        Effort {
            repeat: 200_000,
            runs: 3,
            live_flows: 100_000,
            classes: 10_000,
            // 10 000 take a minute of applying (shaper's batch, tc's, and their trees):
            // the smoke test checks the figures exist with a tenth.
            control_plane_classes: 1_000,
            traffic: TrafficEffort {
                rounds: 1,
                // The windows of a smoke run (the on/off turns are the measure; the
                // windows only have to exist): 26 of them took 78 s at 3 s.
                forward_seconds: 1,
                on_off_pairs: 15,
                many_classes: 1000,
                accuracy_mbit: vec![10],
                accuracy_seconds: 3,
                tcp_mbit: vec![10],
                tcp_seconds: 4,
                tcp_peers: vec![
                    Peer::Shaper("drop"),
                    Peer::Tbf,
                    Peer::CniBandwidth,
                    Peer::ShaperCni,
                ],
            },
            latency: latency::effort(true),
        }
    } else {
        Effort {
            repeat: 1_000_000,
            runs: 7,
            live_flows: 1_000_000,
            classes: 10_000,
            control_plane_classes: FULL_CONTROL_PLANE_CLASSES,
            traffic: TrafficEffort {
                rounds: 5,
                forward_seconds: 5,
                on_off_pairs: 100,
                many_classes: 1000,
                accuracy_mbit: vec![1, 10, 100, 1000],
                accuracy_seconds: 6,
                tcp_mbit: vec![10, 100],
                tcp_seconds: 10,
                tcp_peers: vec![
                    Peer::Shaper("drop"),
                    Peer::Shaper("ecn"),
                    Peer::Shaper("shape"),
                    Peer::Shaper("dscp=af11"),
                    Peer::Tbf,
                    Peer::Htb,
                    Peer::CniBandwidth,
                    Peer::ShaperCni,
                ],
            },
            latency: latency::effort(false),
        }
    }
}

fn main() -> Result<()> {
    let options = options()?;
    let effort = effort(options.quick);
    let started = Instant::now();
    if options.only.as_deref() == Some("latency") {
        return latency_only(&options, &effort, started);
    }
    if !options.publish_peers.is_empty() {
        let report = options
            .report
            .as_deref()
            .context("--publish-peers needs --report FILE")?;
        return peers::publish(&options.publish_peers, report);
    }
    if options.only.as_deref() == Some("peers") {
        // Inside a guest of `cargo xtask bench --vm`: measure, print, write the JSON.
        println!("== peers: latency under load beside CAKE, fq_codel, tbf and fq");
        let report = peers::run(options.rows.as_deref())?;
        if let Some(path) = &options.json {
            std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            println!("wrote {}", path.display());
        }
        return Ok(());
    }
    if options.only.as_deref() == Some("global") {
        // A quick look at the limits-across-hosts section alone.
        let global_effort = global::effort(options.quick);
        let report = json!({ "global": {
            "skewed": global::skewed(&global_effort)?,
            "redis": global::redis_scale(&global_effort)?,
            "cluster": global::cluster_scale(&global_effort)?,
        }});
        println!("{}", global::markdown(&report));
        let broken = global::check(&report);
        if !broken.is_empty() {
            bail!("broken: {}", broken.join("; "));
        }
        return Ok(());
    }
    if options.only.as_deref() == Some("uploads") {
        // The uploads section alone, printed (a quick look).
        let report = json!({ "uploads": uploads::uploads(&uploads::effort(options.quick))? });
        println!("{}", uploads::markdown(&report));
        let broken = uploads::check(&report);
        if !broken.is_empty() {
            bail!("broken: {}", broken.join("; "));
        }
        return Ok(());
    }
    if options.only.as_deref() == Some("fairness") {
        // The flow-isolation section alone, printed (a quick look).
        let mut effort = fairness::effort(options.quick);
        if let Some(text) = &options.rows {
            effort.only_cells(text)?;
        }
        let report = json!({ "fairness": fairness::fairness(&effort)? });
        println!("{}", fairness::markdown(&report));
        let broken = fairness::check(&report);
        if !broken.is_empty() {
            bail!("broken: {}", broken.join("; "));
        }
        return Ok(());
    }
    if options.only.as_deref() == Some("dashboard") {
        // The dashboard drawn from a lab run, beside the report (docs/bench/).
        let report = options
            .report
            .clone()
            .unwrap_or_else(|| PathBuf::from("docs/BENCHMARKS.md"));
        let dir = report.parent().unwrap_or(Path::new(".")).join("bench");
        std::fs::create_dir_all(&dir)?;
        return dashboard::dashboard(&dir.join("dashboard.png"));
    }
    if options.only.as_deref() == Some("senders") {
        // The every-sender section alone, printed (a quick look).
        let report = json!({ "senders": senders::senders(&senders::effort(options.quick))? });
        println!("{}", senders::markdown(&report));
        let broken = senders::check(&report);
        if !broken.is_empty() {
            bail!("broken: {}", broken.join("; "));
        }
        return Ok(());
    }
    if !options.compare.is_empty() {
        let lab = Lab::new()?;
        return compare_objects(&lab, &options.compare);
    }
    if options.only.as_deref() == Some("shape-scale") {
        // Shape classes at scale alone, printed (a quick look).
        let lab = Lab::new()?;
        shape_scale::shape_scale(&lab, effort.control_plane_classes.into())?;
        return Ok(());
    }
    if options.only.as_deref() == Some("forwarding") {
        // The forwarding rows alone, at the run's effort (5 rounds in the full run).
        let lab = Lab::new()?;
        println!("== forwarding throughput (64-byte UDP, two senders, one per core)");
        let throughput = traffic::throughput(&lab, &effort.traffic, stats_overhead_ns(&lab)?)?;
        println!("{}", serde_json::to_string_pretty(&throughput)?);
        return Ok(());
    }
    let lab = Lab::new()?;
    println!(
        "== per-packet cost (BPF_PROG_TEST_RUN, repeat {}, {} runs)",
        effort.repeat, effort.runs
    );
    let (per_packet, scaling) = per_packet(&lab, &effort)?;
    if options.only.as_deref() == Some("per-packet") {
        // A quick look while working on the packet path: the table's rows alone.
        println!("{}", serde_json::to_string_pretty(&per_packet)?);
        return Ok(());
    }
    println!("== memory (kernel map accounting)");
    let memory = memory(&lab)?;
    println!(
        "== control plane: {} classes, and a rate change",
        effort.control_plane_classes
    );
    let control = control_plane(&lab, &effort)?;
    println!("== shape classes at scale");
    let shape_scale = shape_scale::shape_scale(&lab, effort.control_plane_classes.into())?;
    drop(lab);
    // A fresh lab for traffic: the per-packet attachments above hold large maps.
    let mut lab = Lab::new()?;
    println!("== forwarding throughput (64-byte UDP, two senders, one per core)");
    let throughput = traffic::throughput(&lab, &effort.traffic, stats_overhead_ns(&lab)?)?;
    println!("== accuracy (UDP at 10× the rate) and TCP goodput (one cubic flow)");
    let mut series = traffic::Plots::default();
    let accuracy = traffic::accuracy(&mut lab, &effort.traffic, &mut series)?;
    drop(lab);
    println!("== latency under load (a 20 Hz probe beside bulk TCP; each row a fresh lab)");
    let (latency_rows, rtt_series) = latency::latency(&effort.latency)?;
    println!("== uploads: a container's own traffic through each CNI plugin");
    let uploads = uploads::uploads(&uploads::effort(options.quick))?;
    println!("== every sender: the class on the sender's egress, through a router split or whole");
    let senders = senders::senders(&senders::effort(options.quick))?;
    println!("== fairness: flows sharing one shape class");
    let fairness = fairness::fairness(&fairness::effort(options.quick))?;
    println!("== limits across hosts (three hosts, one Redis; many simulated hosts)");
    let global_effort = global::effort(options.quick);
    let global = json!({
        "skewed": global::skewed(&global_effort)?,
        "redis": global::redis_scale(&global_effort)?,
        "cluster": global::cluster_scale(&global_effort)?,
    });
    let mut plot_files = match &options.report {
        Some(report) => draw_plots(report, &series, &scaling, &per_packet)?,
        None => Vec::new(),
    };
    if let Some(report) = &options.report {
        plot_files.extend(draw_latency_plot(report, &rtt_series)?);
    }
    let report = json!({
        "date": date(),
        "machine": machine(),
        "quick": options.quick,
        "seconds": started.elapsed().as_secs_f64(),
        "per_packet": per_packet,
        "scaling": scaling,
        "memory": memory,
        "control_plane": control,
        "shape_scale": shape_scale,
        "throughput": throughput,
        "sender_max_udp_bps": accuracy["sender_max_udp_bps"],
        "accuracy": accuracy["rows"],
        "latency": latency_rows,
        "uploads": uploads,
        "senders": senders,
        "fairness": fairness,
        "global": global,
        "plots": plot_files,
    });
    if let Some(path) = &options.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &options.report {
        // The sections from Debian's kernels (`bench --vm`) are kept as they are.
        let old = std::fs::read_to_string(path).unwrap_or_default();
        let mut text = markdown(&report);
        for kept in [&peers::PEERS, &peers::ISOLATION] {
            if let Some(section) = kept.of(&old) {
                text = kept.replace_in(&text, &section);
            }
        }
        std::fs::write(path, text)?;
        println!("wrote {}", path.display());
    }
    check_targets(&report, &Expected::of(&effort))
}

// ---------------------------------------------------------------------------------------
// per-packet cost

fn udp_frame(dport: u16, sport: u16) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x08, 0x00];
    let mut ip = vec![
        0x45, 0, 0, 92, 0, 0, 0, 0, 64, 17, 0, 0, 198, 18, 1, 2, 198, 18, 2, 2,
    ];
    frame.append(&mut ip);
    frame.extend_from_slice(&sport.to_be_bytes());
    frame.extend_from_slice(&dport.to_be_bytes());
    frame.extend_from_slice(&[0, 72, 0, 0]);
    frame.resize(14 + 92, 0);
    frame
}

/// A veth left down in the router namespace: attached, never sees real traffic.
fn bench_attachment(lab: &Lab, dev: &str, flow_table: u32) -> Result<Attachment> {
    lab.router.run(
        "ip",
        &[
            "link",
            "add",
            dev,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{dev}p"),
        ],
    )?;
    lab.router
        .shaper(&["attach", dev, "--flow-table-size", &flow_table.to_string()])?;
    Attachment::open(&traffic::router_egress(lab, dev))
}

/// What the kernel's run-time statistics (BPF_ENABLE_STATS) record per run of the empty
/// program in a test run: their own two clock reads around the call, the call and the
/// empty body, which their figure for any program includes. It moves by about ±10 ns
/// between runs here.
fn stats_overhead_ns(lab: &Lab) -> Result<f64> {
    const DEV: &str = "benchstats";
    let attachment = bench_attachment(lab, DEV, 1024)?;
    let measured = (|| -> Result<f64> {
        let mut ebpf = state::load_object(attachment.dir(), 1024)?;
        state::load_program(&mut ebpf, program_names::FLOOR)?;
        let floor = program(&ebpf, program_names::FLOOR)?;
        let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)?;
        let before = floor.info()?;
        floor.test_run(TestRunOptions {
            data_in: Some(&udp_frame(5000, 40000)),
            repeat: 1_000_000,
            ..TestRunOptions::default()
        })?;
        let after = floor.info()?;
        traffic::ns_per_run(
            after.run_time().saturating_sub(before.run_time()),
            after.run_count().saturating_sub(before.run_count()),
            "the empty program",
        )
    })();
    drop(attachment);
    lab.router.shaper(&["detach", DEV])?;
    lab.router.run("ip", &["link", "del", DEV])?;
    let measured = measured?;
    println!("run-time statistics' own cost: {measured:.1} ns a run (empty program, test run)");
    Ok(measured)
}

fn udp_class(name: String, dport: u16, scope: Scope) -> ClassSpec {
    ClassSpec {
        name,
        rule: Rule {
            src: None,
            dst: None,
            proto: Proto::Udp,
            sport: PortRange::ANY,
            dport: PortRange {
                lo: dport,
                hi: dport,
            },
        },
        rate_bits_per_sec: 400_000_000_000, // never reached: every packet takes the pass path
        burst_bytes: 1 << 30,
        scope,
        prio: 100,
        action: Default::default(),
        meter: Default::default(),
        exceed: Default::default(),
        codel: None,
        tree: None,
        global: None,
    }
}

/// ns per packet of `program` on `frame`, one figure per run.
fn time_runs(program: &SchedClassifier, frame: &[u8], effort: &Effort) -> Result<Vec<f64>> {
    let mut samples = Vec::new();
    for _ in 0..effort.runs {
        samples.push(test_run_ns(program, frame, effort.repeat)?);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples)
}

/// One test run of `repeat` passes: the kernel's mean time per pass.
fn test_run_ns(program: &SchedClassifier, frame: &[u8], repeat: u32) -> Result<f64> {
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        repeat,
        ..TestRunOptions::default()
    })?;
    Ok(result.duration.as_nanos() as f64)
}

/// Turns of `--compare` (odd: the median is one turn's figure).
const COMPARE_TURNS: usize = 21;
const COMPARE_REPEAT: u32 = 200_000;
/// Flow table entries of `--compare`'s attachments (one flow uses it).
const COMPARE_FLOW_TABLE: u32 = 1024;

/// `--compare A,B,…`: the per-packet cases that decide a packet-path change, timed for
/// each build of the object on the same attachments, the builds taking turns run by
/// run. A VM's speed drifts by tens of per cent between minutes (the same object read
/// 42–63 ns in three quick runs), so builds are compared by the median of their paired
/// ratios to the first, never by runs made apart.
fn compare_objects(lab: &Lab, objects: &[PathBuf]) -> Result<()> {
    let flow_scoped = bench_attachment(lab, "bench0", COMPARE_FLOW_TABLE)?;
    classes::add(&flow_scoped, &udp_class("one".into(), 5000, Scope::Flow))?;
    let class_wide = bench_attachment(lab, "bench1", COMPARE_FLOW_TABLE)?;
    classes::add(&class_wide, &udp_class("wide".into(), 5000, Scope::Class))?;
    let attachments = [&flow_scoped, &class_wide];
    // (case, attachment, program, frame)
    let cases = [
        (CASE_FLOOR, 0, program_names::FLOOR, udp_frame(5000, 40000)),
        (CASE_D, 0, program_names::SHAPER, udp_frame(6000, 40000)),
        (CASE_FLAT, 1, program_names::SHAPER, udp_frame(5000, 40000)),
        (CASE_A, 0, program_names::SHAPER, udp_frame(5000, 40000)),
    ];
    let mut builds = Vec::new();
    for path in objects {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        let mut loaded = Vec::new();
        for attachment in attachments {
            let mut ebpf = state::load_object_bytes(attachment.dir(), COMPARE_FLOW_TABLE, &bytes)
                .with_context(|| format!("{}", path.display()))?;
            state::load_program(&mut ebpf, program_names::FLOOR)?;
            state::load_program(&mut ebpf, program_names::SHAPER)?;
            loaded.push(ebpf);
        }
        builds.push(loaded);
    }
    // samples[build][case][turn]
    let mut samples = vec![vec![Vec::with_capacity(COMPARE_TURNS); cases.len()]; builds.len()];
    for turn in 0..COMPARE_TURNS {
        // Every other turn in reverse, so no build always runs first.
        let mut order: Vec<usize> = (0..builds.len()).collect();
        if turn % 2 == 1 {
            order.reverse();
        }
        for build in order {
            let loaded = &builds[build];
            for (case, (_, attachment, name, frame)) in cases.iter().enumerate() {
                let program = program(&loaded[*attachment], name)?;
                samples[build][case].push(test_run_ns(program, frame, COMPARE_REPEAT)?);
            }
        }
    }
    println!(
        "== paired test runs ({COMPARE_TURNS} turns of {COMPARE_REPEAT}); ns median, × the first build (median of paired ratios)"
    );
    for (build, path) in objects.iter().enumerate() {
        println!("{}", path.display());
        print_program_sizes(&builds[build][0])?;
        for (case, (label, ..)) in cases.iter().enumerate() {
            let runs = &samples[build][case];
            let ratios: Vec<f64> = runs
                .iter()
                .zip(&samples[0][case])
                .map(|(run, first)| run / first)
                .collect();
            println!(
                "  {label:44} {:>7.1} ns  × first {:.3}",
                shaper_tests::global::median(runs),
                shaper_tests::global::median(&ratios)
            );
        }
    }
    Ok(())
}

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

const CASE_FLOOR: &str = "floor: empty TC program";
const CASE_CLOCK: &str = "floor + one clock read";
const CASE_A: &str = "(a) 1 class, 1 flow";
const CASE_D: &str = "(d) no class matches";
const CASE_FLAT: &str = "(e) 1 class-wide class, no parent";
const CASE_FLAT_SHARED: &str = "(k) (e) without per-CPU credit";
const CASE_CHAIN: &str = "(f) leaf of a 3-level chain";
const CASE_SECOND_SHAPE: &str = "(g) class in the 2nd of 2 rule shapes";
const CASE_SHAPE_ONE_QUEUE: &str = "(l) shape class, --fair none";
const CASE_SHAPE_FAIR: &str = "(m) shape class, fair by flow";
const CASE_SHAPE_FAIR_SRC: &str = "(n) shape class, --fair src";
const CASE_A_MISS: &str = "(h) (a), verdict cache missed";
const CASE_D_MISS: &str = "(i) (d), verdict cache missed";
const CASE_SECOND_SHAPE_MISS: &str = "(j) (g), verdict cache missed";

fn case_b(live_flows: u32) -> String {
    format!("(b) 1 class, {live_flows} live flows")
}

fn case_c(classes: u16) -> String {
    format!("(c) {classes} classes")
}

/// The live-flow counts measured: decades from 1000 up to `live_flows`.
fn flow_levels(live_flows: u32) -> Vec<u32> {
    std::iter::successors(Some(1000u32), |level| level.checked_mul(10))
        .take_while(|level| *level <= live_flows)
        .collect()
}

/// The class counts measured: decades from 1, the last one `classes`.
fn class_levels(classes: u16) -> Vec<u16> {
    let mut levels = vec![1u16];
    while let Some(&level) = levels.last().filter(|level| **level < classes) {
        levels.push(level.saturating_mul(10).min(classes));
    }
    levels
}

/// The fixed cases (floor, a–d), and the cost at growing numbers of flows and classes.
fn per_packet(lab: &Lab, effort: &Effort) -> Result<(Vec<Value>, Value)> {
    let one = bench_attachment(lab, "bench0", effort.live_flows.next_power_of_two() * 2)?;
    classes::add(&one, &udp_class("one".into(), 5000, Scope::Flow))?;
    let many = bench_attachment(lab, "bench1", 1024)?;

    let mut one_ebpf = state::load_object(one.dir(), 1024)?;
    state::load_program(&mut one_ebpf, program_names::FLOOR)?;
    state::load_program(&mut one_ebpf, program_names::FLOOR_CLOCK)?;
    state::load_program(&mut one_ebpf, program_names::SHAPER)?;
    state::load_program(&mut one_ebpf, program_names::SHAPER_UNCACHED)?;
    let mut many_ebpf = state::load_object(many.dir(), 1024)?;
    state::load_program(&mut many_ebpf, program_names::SHAPER)?;
    let (floor, shaper_one) = (
        program(&one_ebpf, program_names::FLOOR)?,
        program(&one_ebpf, program_names::SHAPER)?,
    );
    let shaper_many = program(&many_ebpf, program_names::SHAPER)?;

    let matching = udp_frame(5000, 40000);
    let mut cases: Vec<(String, Vec<f64>)> = Vec::new();
    cases.push((CASE_FLOOR.into(), time_runs(floor, &matching, effort)?));
    let floor_clock = program(&one_ebpf, program_names::FLOOR_CLOCK)?;
    cases.push((
        CASE_CLOCK.into(),
        time_runs(floor_clock, &matching, effort)?,
    ));
    cases.push((CASE_A.into(), time_runs(shaper_one, &matching, effort)?));
    cases.push((
        CASE_D.into(),
        time_runs(shaper_one, &udp_frame(6000, 40000), effort)?,
    ));
    // A test run repeats one frame, which the verdict cache serves after the first: the
    // same cases with every packet searching the rules, as new flows do.
    let uncached_one = program(&one_ebpf, program_names::SHAPER_UNCACHED)?;
    cases.push((
        CASE_A_MISS.into(),
        time_runs(uncached_one, &matching, effort)?,
    ));
    cases.push((
        CASE_D_MISS.into(),
        time_runs(uncached_one, &udp_frame(6000, 40000), effort)?,
    ));
    // Two rule shapes (a dport class and a sport class); the packet matches the second.
    let shapes = bench_attachment(lab, "bench3", 1024)?;
    classes::add(&shapes, &udp_class("by-dport".into(), 8000, Scope::Class))?;
    let mut by_sport = udp_class("by-sport".into(), 0, Scope::Class);
    by_sport.rule.dport = PortRange::ANY;
    by_sport.rule.sport = PortRange {
        lo: 40001,
        hi: 40001,
    };
    classes::add(&shapes, &by_sport)?;
    let mut shapes_ebpf = state::load_object(shapes.dir(), 1024)?;
    state::load_program(&mut shapes_ebpf, program_names::SHAPER)?;
    state::load_program(&mut shapes_ebpf, program_names::SHAPER_UNCACHED)?;
    let second_shape = udp_frame(5000, 40001);
    cases.push((
        CASE_SECOND_SHAPE.into(),
        time_runs(
            program(&shapes_ebpf, program_names::SHAPER)?,
            &second_shape,
            effort,
        )?,
    ));
    cases.push((
        CASE_SECOND_SHAPE_MISS.into(),
        time_runs(
            program(&shapes_ebpf, program_names::SHAPER_UNCACHED)?,
            &second_shape,
            effort,
        )?,
    ));
    print_program_sizes(&one_ebpf)?;
    cases.extend(shape_cases(lab, effort)?);

    // Hierarchy: a packet of a three-level chain's leaf against one of a flat class.
    let tree = bench_attachment(lab, "bench2", 1024)?;
    classes::add(&tree, &udp_class("flat".into(), 7000, Scope::Class))?;
    // A burst too small for per-CPU credit (a quarter of it per CPU under one frame):
    // every packet reads the clock and swaps the shared word, as the chain's do.
    let mut shared = udp_class("flat-shared".into(), 7004, Scope::Class);
    shared.burst_bytes = 4096;
    classes::add(&tree, &shared)?;
    let mut parent = None;
    for (level, dport) in [("root", 7001), ("mid", 7002), ("leaf", 7003)] {
        let mut spec = udp_class(level.into(), dport, Scope::Class);
        spec.tree = parent.map(|parent: &str| Tree {
            parent: parent.into(),
            ceil_bits_per_sec: None,
            cburst_bytes: None,
        });
        classes::add(&tree, &spec)?;
        parent = Some(level);
    }
    let mut tree_ebpf = state::load_object(tree.dir(), 1024)?;
    state::load_program(&mut tree_ebpf, program_names::SHAPER)?;
    let shaper_tree = program(&tree_ebpf, program_names::SHAPER)?;
    cases.push((
        CASE_FLAT.into(),
        time_runs(shaper_tree, &udp_frame(7000, 40000), effort)?,
    ));
    cases.push((
        CASE_FLAT_SHARED.into(),
        time_runs(shaper_tree, &udp_frame(7004, 40000), effort)?,
    ));
    cases.push((
        CASE_CHAIN.into(),
        time_runs(shaper_tree, &udp_frame(7003, 40000), effort)?,
    ));

    // Flows: the table grows in decades; the packet's own flow is one of them.
    let mut flows = vec![(1.0, median(&case_samples(&cases, CASE_A)))];
    let mut live = 1;
    for level in flow_levels(effort.live_flows) {
        populate_flows(&one, live, level)?;
        live = level;
        let samples = time_runs(shaper_one, &matching, effort)?;
        println!("  {level:>8} live flows: {:6.1} ns", median(&samples));
        flows.push((f64::from(level), median(&samples)));
        if level == effort.live_flows {
            cases.push((case_b(level), samples));
        }
    }
    // Classes: added in decades to one attachment; the packet matches the first class.
    let mut class_points = Vec::new();
    let mut added: u16 = 0;
    for level in class_levels(effort.classes) {
        let specs: Vec<ClassSpec> = (added..level)
            .map(|i| udp_class(format!("c{i}"), 10_000 + i, Scope::Class))
            .collect();
        classes::add_many(&many, &specs)?;
        added = level;
        let samples = time_runs(shaper_many, &udp_frame(10_000, 40000), effort)?;
        println!("  {level:>8} classes:    {:6.1} ns", median(&samples));
        class_points.push((f64::from(level), median(&samples)));
        if level >= effort.classes {
            cases.push((case_c(level), samples));
        }
    }

    let floor_ns = median(&cases[0].1);
    let base_ns = median(&case_samples(&cases, CASE_A));
    let mut rows = Vec::new();
    for (case, samples) in &cases {
        let row = json!({
            "case": case,
            "ns_median": median(samples),
            "ns_min": samples[0],
            "ratio_to_floor": median(samples) / floor_ns,
            "ratio_to_a": median(samples) / base_ns,
        });
        println!(
            "{case:32} median {:6.1} ns  min {:6.1} ns  ×floor {:.2}  ×(a) {:.2}",
            median(samples),
            samples[0],
            median(samples) / floor_ns,
            median(samples) / base_ns
        );
        rows.push(row);
    }
    println!("  stage by stage (differences of the fastest runs):");
    for (stage, ns) in stage_costs(&rows) {
        println!("    {stage:56} {ns:6.1} ns");
    }
    let scaling = json!({
        "floor_ns": floor_ns,
        "flows": flows.iter().map(|(n, ns)| json!({"count": n, "ns_median": ns})).collect::<Vec<_>>(),
        "classes": class_points.iter().map(|(n, ns)| json!({"count": n, "ns_median": ns})).collect::<Vec<_>>(),
    });
    Ok((rows, scaling))
}

/// A shape class's bulk packet (HTB backend) with one queue, fair by flow (the default: a
/// second flow table lookup and the census) and by source host first (a third lookup, the
/// host's). The rate, 20 Gbit/s, is above what a test run sends (about 5 Gbit/s of these
/// frames: no queue builds) and below 16 times it (the flow is bulk, not sparse: at
/// 400 Gbit/s every case took the sparse path and cost the same).
fn shape_cases(lab: &Lab, effort: &Effort) -> Result<Vec<(String, Vec<f64>)>> {
    let shaped = bench_attachment(lab, "bench4", 1024)?;
    let modes = [
        (CASE_SHAPE_ONE_QUEUE, Fair::None, 7100),
        (CASE_SHAPE_FAIR, Fair::Flow, 7101),
        (CASE_SHAPE_FAIR_SRC, Fair::Src, 7102),
    ];
    // Through the command line: a shape class's HTB leaf is made in the device's
    // namespace.
    for (_, fair, dport) in modes {
        let name = format!("shape-{}", fair.name());
        let dport = dport.to_string();
        let options = [
            "class",
            "add",
            &name,
            "--dev",
            "bench4",
            "--proto",
            "udp",
            "--dport",
            &dport,
            "--rate",
            "400gbit",
            "--burst",
            "1mb",
            "--action",
            "shape",
            "--fair",
            fair.name(),
        ];
        lab.router.shaper(&options)?;
    }
    let mut ebpf = state::load_object(shaped.dir(), 1024)?;
    state::load_program(&mut ebpf, program_names::SHAPER)?;
    let shaper = program(&ebpf, program_names::SHAPER)?;
    modes
        .into_iter()
        .map(|(case, _, dport)| {
            Ok((
                case.into(),
                time_runs(shaper, &udp_frame(dport, 40000), effort)?,
            ))
        })
        .collect()
}

/// The samples of one case.
fn case_samples(cases: &[(String, Vec<f64>)], case: &str) -> Vec<f64> {
    cases
        .iter()
        .find(|(name, _)| name == case)
        .map(|(_, samples)| samples.clone())
        .unwrap_or_default()
}

/// One figure of a per-packet row (NaN when the row is missing).
fn case_figure(rows: &[Value], case: &str, figure: &str) -> f64 {
    rows.iter()
        .find(|row| row["case"] == case)
        .map_or(f64::NAN, |row| f(&row[figure]))
}

/// What each stage of the packet path adds, from differences of the cases' fastest runs
/// (the least disturbed; medians of a quick run wander by a few ns):
/// the clock read, parse and a verdict cache hit, the class and its credit, the shared
/// word's compare-and-swap, a flow's LRU lookup, and a cache miss's search.
fn stage_costs(rows: &[Value]) -> Vec<(&'static str, f64)> {
    let ns = |case: &str| case_figure(rows, case, "ns_min");
    let clock = ns(CASE_CLOCK) - ns(CASE_FLOOR);
    vec![
        ("empty program (the floor)", ns(CASE_FLOOR)),
        ("clock read (bpf_ktime_get_ns)", clock),
        (
            "parse + verdict cache hit, no class",
            ns(CASE_D) - ns(CASE_FLOOR),
        ),
        (
            "class config, per-CPU credit, counters",
            ns(CASE_FLAT) - ns(CASE_D),
        ),
        (
            "shared bucket word (compare-and-swap), less the clock",
            ns(CASE_FLAT_SHARED) - ns(CASE_FLAT) - clock,
        ),
        (
            "flow bucket (LRU hash, 48-byte key)",
            ns(CASE_A) - ns(CASE_FLAT_SHARED),
        ),
        (
            "rule search on a cache miss (1 shape)",
            ns(CASE_D_MISS) - ns(CASE_D),
        ),
    ]
}

/// Fills the per-flow table of class "one" with live buckets number `from..to`.
fn populate_flows(attachment: &Attachment, from: u32, to: u32) -> Result<()> {
    let config = attachment.classes()?.get(&0, 0)?;
    let data = MapData::from_pin(attachment.dir().join(map_names::KEYED_BUCKETS))?;
    let mut table: BpfHashMap<MapData, BucketKey, Bucket> =
        BpfHashMap::try_from(Map::from_map_data(data)?)?;
    for index in from..to {
        let key = BucketKey {
            class_id: 0,
            generation: config.generation,
            family: FAMILY_V4,
            proto: PROTO_UDP,
            sport: (index & 0xffff) as u16,
            dport: 5001,
            src: [u32::from_ne_bytes([198, 18, 1, 2]), 0, 0, index >> 16],
            dst: [u32::from_ne_bytes([198, 18, 2, 2]), 0, 0, 0],
            ..BucketKey::default()
        };
        table.insert(key, Bucket::default(), 0)?;
    }
    Ok(())
}

/// Draws the PNGs into `bench/` beside the report; returns their paths relative to it.
fn draw_plots(
    report: &std::path::Path,
    series: &traffic::Plots,
    scaling: &Value,
    per_packet: &[Value],
) -> Result<Vec<String>> {
    let dir = report
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join("bench");
    std::fs::create_dir_all(&dir)?;
    plots::register_font()?;
    let points = |axis: &str| -> Vec<(f64, f64)> {
        scaling[axis]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                (
                    p["count"].as_f64().unwrap_or(0.0),
                    p["ns_median"].as_f64().unwrap_or(0.0),
                )
            })
            .collect()
    };
    let floor_ns = per_packet[0]["ns_median"].as_f64().unwrap_or(0.0);
    let mut files = Vec::new();
    let mut draw = |name: &str, result: Result<()>| -> Result<()> {
        result?;
        println!("wrote {}", dir.join(name).display());
        files.push(format!("bench/{name}"));
        Ok(())
    };
    draw(
        "cost-vs-scale.png",
        plots::cost_vs_scale(
            &dir.join("cost-vs-scale.png"),
            &points("flows"),
            &points("classes"),
            floor_ns,
        ),
    )?;
    if !series.udp.is_empty() {
        draw(
            "udp-10mbit.png",
            plots::rate_over_time(
                &dir.join("udp-10mbit.png"),
                "UDP at 100 Mbit/s into a 10 Mbit/s limit (L2 rate at the receiver)",
                &series.udp,
                10.0,
            ),
        )?;
    }
    if !series.tcp.is_empty() {
        draw(
            "tcp-10mbit.png",
            plots::rate_over_time(
                &dir.join("tcp-10mbit.png"),
                "One TCP cubic flow through a 10 Mbit/s limit (goodput at the receiver)",
                &series.tcp,
                10.0,
            ),
        )?;
    }
    Ok(files)
}

/// The probe's added RTT over time for rows a–d (40 ms), into `bench/` beside the report.
fn draw_latency_plot(report: &std::path::Path, series: &latency::RttSeries) -> Result<Vec<String>> {
    if series.is_empty() {
        return Ok(Vec::new());
    }
    let dir = report
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join("bench");
    std::fs::create_dir_all(&dir)?;
    let name = "latency-40ms.png";
    plots::rtt_over_time(
        &dir.join(name),
        "Probe's added RTT, one cubic flow through 20 Mbit/s, 40 ms base RTT",
        series,
    )?;
    println!("wrote {}", dir.join(name).display());
    Ok(vec![format!("bench/{name}")])
}

/// `--only latency`: the latency section alone, its report, JSON and targets.
fn latency_only(options: &Options, effort: &Effort, started: Instant) -> Result<()> {
    println!("== latency under load (a 20 Hz probe beside bulk TCP; each row a fresh lab)");
    let (rows, series) = latency::latency(&effort.latency)?;
    let plot_files = match &options.report {
        Some(report) => {
            plots::register_font()?;
            draw_latency_plot(report, &series)?
        }
        None => Vec::new(),
    };
    let report = json!({
        "date": date(),
        "machine": machine(),
        "quick": options.quick,
        "only": options.only,
        "seconds": started.elapsed().as_secs_f64(),
        "latency": rows,
        "plots": plot_files,
    });
    if let Some(path) = &options.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &options.report {
        std::fs::write(path, latency::markdown(&report))?;
        println!("wrote {}", path.display());
    }
    let broken = latency::check(&report, &latency::expected(&effort.latency));
    if broken.is_empty() {
        return Ok(());
    }
    bail!(
        "{} measurement(s) missing or absurd:\n  {}",
        broken.len(),
        broken.join("\n  ")
    )
}

/// The attached program's size as the kernel holds it: instructions after the verifier's
/// rewrites, JIT bytes, and the instructions the verifier walked to accept it.
fn print_program_sizes(ebpf: &aya::Ebpf) -> Result<()> {
    let info = program(ebpf, program_names::SHAPER)?.info()?;
    println!(
        "  program {}: {} instructions translated, {} bytes jitted, {} instructions verified",
        program_names::SHAPER,
        info.size_translated().unwrap_or(0) / 8,
        info.size_jitted(),
        info.verified_instruction_count().unwrap_or(0),
    );
    Ok(())
}

fn program<'a>(ebpf: &'a aya::Ebpf, name: &str) -> Result<&'a SchedClassifier> {
    Ok(ebpf.program(name).context("program missing")?.try_into()?)
}

// ---------------------------------------------------------------------------------------
// memory

/// The kernel's own accounting of a pinned map (fdinfo "memlock").
fn map_memory(path: &std::path::Path) -> Result<(u64, u32)> {
    let data = MapData::from_pin(path)?;
    let max_entries = data.info()?.max_entries();
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let fd = data.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    let memlock = info
        .lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .context("no memlock in fdinfo")?
        .trim()
        .parse()?;
    Ok((memlock, max_entries))
}

fn memory(lab: &Lab) -> Result<Value> {
    let dir = traffic::router_egress(lab, "bench0").dir();
    let mut maps = Vec::new();
    let mut total = 0;
    for name in map_names::ALL {
        let (bytes, entries) = map_memory(&dir.join(name))?;
        total += bytes;
        println!(
            "{name:16} {:>12} bytes for {entries:>8} entries ({:.1} bytes/entry)",
            bytes,
            bytes as f64 / entries as f64
        );
        maps.push(json!({"map": name, "bytes": bytes, "max_entries": entries, "bytes_per_entry": bytes as f64 / entries as f64}));
    }
    let (flow_bytes, flow_entries) = map_memory(&dir.join(map_names::KEYED_BUCKETS))?;
    let per_flow = flow_bytes as f64 / flow_entries as f64;
    let per_class: f64 = [
        map_names::CLASSES,
        map_names::CLASS_BUCKETS,
        map_names::STATS,
        map_names::CLASS_META,
    ]
    .iter()
    .map(|name| map_memory(&dir.join(name)).map(|(b, e)| b as f64 / e as f64))
    .sum::<Result<f64>>()?;
    println!("per live flow {per_flow:.1} bytes, per class {per_class:.1} bytes (+ classifier entries), 1M flows {:.1} MiB", per_flow * 1e6 / 1048576.0);
    Ok(json!({
        "maps": maps,
        "total_bytes_for_this_attachment": total,
        "bytes_per_flow": per_flow,
        "bytes_per_class": per_class,
        "bytes_for_1m_flows": per_flow * 1e6,
    }))
}

// ---------------------------------------------------------------------------------------
// control plane

fn timed(mut command: Command) -> Result<f64> {
    let started = Instant::now();
    let output = output_bounded(&mut command, COMMAND_LIMIT)?;
    if !output.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(started.elapsed().as_secs_f64())
}

fn control_plane(lab: &Lab, effort: &Effort) -> Result<Value> {
    let count = effort.control_plane_classes as u32;
    // shaper: one batch file of `class add` lines.
    let router = &lab.router;
    router.run(
        "ip",
        &["link", "add", "cp0", "type", "veth", "peer", "name", "cp0p"],
    )?;
    router.shaper(&["attach", "cp0"])?;
    let batch = std::env::temp_dir().join(format!("shaper-bench-{}.batch", std::process::id()));
    let lines: Vec<String> = (0..count)
        .map(|i| {
            format!(
                "class add c{i} --dev cp0 --rate {}mbit --proto udp --dport {}",
                1 + i % 100,
                10_000 + i
            )
        })
        .collect();
    std::fs::write(&batch, lines.join("\n"))?;
    let mut command = Command::new(shaper_tests::shaper_bin());
    command
        .args(["--netns", &router.name, "batch", "-f"])
        .arg(&batch);
    let shaper_seconds = timed(command)?;

    // tc: the same classes as HTB classes with u32 filters, in one `tc -batch`.
    router.run(
        "ip",
        &["link", "add", "cp1", "type", "veth", "peer", "name", "cp1p"],
    )?;
    let mut tc_lines = vec!["qdisc add dev cp1 root handle 1: htb default 0".to_string()];
    for i in 0..count {
        let minor = i + 1;
        tc_lines.push(format!(
            "class add dev cp1 parent 1: classid 1:{minor:x} htb rate {}mbit",
            1 + i % 100
        ));
        tc_lines.push(format!(
            "filter add dev cp1 parent 1: protocol ip prio 1 u32 match ip protocol 17 0xff match ip dport {} 0xffff flowid 1:{minor:x}",
            10_000 + i
        ));
    }
    std::fs::write(&batch, tc_lines.join("\n"))?;
    let mut command = router.command("tc");
    command.arg("-batch").arg(&batch);
    let tc_seconds = timed(command)?;
    let _ = std::fs::remove_file(&batch);
    println!("{count} classes: shaper batch {shaper_seconds:.3} s, tc -batch (htb + u32) {tc_seconds:.3} s, ratio {:.2}", shaper_seconds / tc_seconds);

    // A two-level tree: parents of ten children each, every child with its own port.
    let (tree_shaper, tree_tc) = tree_apply(router, count / 10, &batch)?;
    println!(
        "a tree of {} parents x 10 children: shaper batch {tree_shaper:.3} s, tc -batch {tree_tc:.3} s, ratio {:.2}",
        count / 10,
        tree_shaper / tree_tc
    );

    // One rate change: shaper's CLI vs tc class change, each a whole command.
    let mut command = Command::new(shaper_tests::shaper_bin());
    command.args([
        "--netns",
        &router.name,
        "class",
        "change",
        "c7",
        "--dev",
        "cp0",
        "--rate",
        "50mbit",
    ]);
    let shaper_change = timed(command)?;
    let mut command = router.command("tc");
    command.args([
        "class", "change", "dev", "cp1", "classid", "1:8", "htb", "rate", "50mbit",
    ]);
    let tc_change = timed(command)?;
    println!(
        "rate change: shaper {:.1} ms, tc {:.1} ms",
        shaper_change * 1e3,
        tc_change * 1e3
    );
    Ok(json!({
        "classes": count,
        "apply_seconds": {"shaper_batch": shaper_seconds, "tc_batch_htb_u32": tc_seconds},
        "apply_ratio_shaper_to_tc": shaper_seconds / tc_seconds,
        "tree_parents": count / 10,
        "tree_apply_seconds": {"shaper_batch": tree_shaper, "tc_batch_htb_u32": tree_tc},
        "tree_apply_ratio_shaper_to_tc": tree_shaper / tree_tc,
        "rate_change_seconds": {"shaper": shaper_change, "tc_class_change": tc_change},
    }))
}

/// Seconds to apply `parents` parents of ten children each: shaper (`batch -f`, children
/// with `--parent` and `--ceil`) and the same htb tree through `tc -batch` (a u32 filter
/// per child, whose port it matches). Each child's rate 1-10 Mbit/s, ceil its parent's.
fn tree_apply(router: &Netns, parents: u32, batch: &std::path::Path) -> Result<(f64, f64)> {
    for dev in ["tree0", "tree1"] {
        let peer = format!("{dev}p");
        router.run(
            "ip",
            &["link", "add", dev, "type", "veth", "peer", "name", &peer],
        )?;
    }
    router.shaper(&["attach", "tree0"])?;
    let port = |parent: u32, child: u32| 20_000 + parent * 10 + child;
    let mut lines = Vec::new();
    for p in 0..parents {
        lines.push(format!(
            "class add p{p} --dev tree0 --rate 100mbit --proto udp --dport {}-{}",
            port(p, 0),
            port(p, 9)
        ));
        for c in 0..10 {
            lines.push(format!(
                "class add p{p}c{c} --dev tree0 --parent p{p} --rate {}mbit --ceil 100mbit --proto udp --dport {}",
                1 + c,
                port(p, c)
            ));
        }
    }
    std::fs::write(batch, lines.join("\n"))?;
    let mut command = Command::new(shaper_tests::shaper_bin());
    command
        .args(["--netns", &router.name, "batch", "-f"])
        .arg(batch);
    let shaper_seconds = timed(command)?;

    let mut tc_lines = vec!["qdisc add dev tree1 root handle 1: htb default 0".to_string()];
    for p in 0..parents {
        let parent = p * 11 + 1;
        tc_lines.push(format!(
            "class add dev tree1 parent 1: classid 1:{parent:x} htb rate 100mbit"
        ));
        for c in 0..10 {
            let minor = parent + 1 + c;
            tc_lines.push(format!(
                "class add dev tree1 parent 1:{parent:x} classid 1:{minor:x} htb rate {}mbit ceil 100mbit",
                1 + c
            ));
            tc_lines.push(format!(
                "filter add dev tree1 parent 1: protocol ip prio 1 u32 match ip protocol 17 0xff match ip dport {} 0xffff flowid 1:{minor:x}",
                port(p, c)
            ));
        }
    }
    std::fs::write(batch, tc_lines.join("\n"))?;
    let mut command = router.command("tc");
    command.arg("-batch").arg(batch);
    let tc_seconds = timed(command)?;
    Ok((shaper_seconds, tc_seconds))
}

// ---------------------------------------------------------------------------------------
// report

fn date() -> String {
    output_bounded(
        Command::new("date").args(["-u", "+%Y-%m-%d %H:%M UTC"]),
        Duration::from_secs(10),
    )
    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    .unwrap_or_default()
}

fn machine() -> Value {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    json!({"kernel": kernel.trim(), "cpu": cpu, "cores": cores})
}

fn markdown(report: &Value) -> String {
    let machine = &report["machine"];
    let mut out = String::new();
    out.push_str("# shaper benchmarks\n\n");
    out.push_str("Regenerated by `cargo xtask bench` (this file is its output; `--quick` runs a smaller set in CI).\n");
    out.push_str(&format!(
        "Run {} on {} ({} cores), kernel {}{}.\n\n",
        report["date"].as_str().unwrap_or_default(),
        machine["cpu"].as_str().unwrap_or_default(),
        machine["cores"],
        machine["kernel"].as_str().unwrap_or_default(),
        if report["quick"] == true {
            ", quick mode"
        } else {
            ""
        }
    ));
    out.push_str("Every figure is a ratio of measurements taken side by side in the same run.\n\n");
    out.push_str("## Per-packet cost\n\nBPF_PROG_TEST_RUN on the loaded programs (same object), a 106-byte UDP frame; `ratio` is median / median of the empty program. Target: ≤ 2.0× the floor, ≤ +20 % from (a) to (b) and (c). Command: `cargo xtask bench`.\n\n");
    out.push_str("| case | median ns | min ns | × floor | × (a) |\n|---|---|---|---|---|\n");
    for row in report["per_packet"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.2} |\n",
            row["case"].as_str().unwrap_or_default(),
            row["ns_median"].as_f64().unwrap_or(0.0),
            row["ns_min"].as_f64().unwrap_or(0.0),
            row["ratio_to_floor"].as_f64().unwrap_or(0.0),
            row["ratio_to_a"].as_f64().unwrap_or(0.0)
        ));
    }
    let rows = report["per_packet"].as_array().cloned().unwrap_or_default();
    out.push_str(
        "\nStage by stage (differences of the fastest runs above):\n\n| stage | ns |\n|---|---|\n",
    );
    for (stage, ns) in stage_costs(&rows) {
        out.push_str(&format!("| {stage} | {ns:.1} |\n"));
    }
    let memory = &report["memory"];
    out.push_str("\n## Memory\n\nFrom the kernel's own accounting (`memlock` in the map's fdinfo).\n\n| map | bytes | entries | bytes/entry |\n|---|---|---|---|\n");
    for row in memory["maps"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} |\n",
            row["map"].as_str().unwrap_or_default(),
            row["bytes"],
            row["max_entries"],
            row["bytes_per_entry"].as_f64().unwrap_or(0.0)
        ));
    }
    out.push_str(&format!(
        "\nPer live flow: {:.1} bytes; per class: {:.1} bytes (plus its classifier entries); 1 M flows: {:.1} MiB.\n",
        memory["bytes_per_flow"].as_f64().unwrap_or(0.0),
        memory["bytes_per_class"].as_f64().unwrap_or(0.0),
        memory["bytes_for_1m_flows"].as_f64().unwrap_or(0.0) / 1048576.0
    ));
    let control = &report["control_plane"];
    out.push_str(&format!(
        "\n## Control plane\n\n| what | shaper | tc | shaper / tc |\n|---|---|---|---|\n| apply {} classes (`shaper batch -f` vs `tc -batch` with htb classes + u32 filters) | {:.3} s | {:.3} s | {:.2} |\n| one rate change (`shaper class change` vs `tc class change`) | {:.1} ms | {:.1} ms | {:.2} |\n",
        control["classes"],
        control["apply_seconds"]["shaper_batch"].as_f64().unwrap_or(0.0),
        control["apply_seconds"]["tc_batch_htb_u32"].as_f64().unwrap_or(0.0),
        control["apply_ratio_shaper_to_tc"].as_f64().unwrap_or(0.0),
        control["rate_change_seconds"]["shaper"].as_f64().unwrap_or(0.0) * 1e3,
        control["rate_change_seconds"]["tc_class_change"].as_f64().unwrap_or(0.0) * 1e3,
        control["rate_change_seconds"]["shaper"].as_f64().unwrap_or(0.0) / control["rate_change_seconds"]["tc_class_change"].as_f64().unwrap_or(1.0),
    ));
    out.push_str(&format!(
        "| apply a tree of {} parents × 10 children (`--parent`, `--ceil` vs htb parent and child classes + u32 filters) | {:.3} s | {:.3} s | {:.2} |\n",
        control["tree_parents"],
        f(&control["tree_apply_seconds"]["shaper_batch"]),
        f(&control["tree_apply_seconds"]["tc_batch_htb_u32"]),
        f(&control["tree_apply_ratio_shaper_to_tc"]),
    ));
    out.push_str(&shape_scale::markdown(&report["shape_scale"]));
    out.push_str(&traffic_markdown(report));
    out.push_str(&latency::markdown(report));
    out.push_str(&uploads::markdown(report));
    out.push_str(&senders::markdown(report));
    out.push_str(&fairness::markdown(report));
    out.push_str(&global::markdown(report));
    out
}

fn f(value: &Value) -> f64 {
    value.as_f64().unwrap_or(0.0)
}

/// A JSON array of per-round ratios, as the report prints them.
fn rounds(ratios: &Value) -> String {
    let ratios: Vec<f64> = ratios.as_array().into_iter().flatten().map(f).collect();
    traffic::joined(&ratios)
}

/// The throughput, accuracy, TCP, plot and limits sections.
fn traffic_markdown(report: &Value) -> String {
    let mut out = String::new();
    out.push_str("\n## Cost against scale\n\nMedian ns per packet as the per-flow table fills and as classes are added (same program, same packet).\n\n| live flows | ns | | classes | ns |\n|---|---|---|---|---|\n");
    let flows = report["scaling"]["flows"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let classes = report["scaling"]["classes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for index in 0..flows.len().max(classes.len()) {
        let cell = |rows: &[Value]| match rows.get(index) {
            Some(row) => format!("{} | {:.1}", row["count"], f(&row["ns_median"])),
            None => " | ".into(),
        };
        out.push_str(&format!("| {} | | {} |\n", cell(&flows), cell(&classes)));
    }
    out.push_str("\n![cost per packet against flows and classes](bench/cost-vs-scale.png)\n");

    out.push_str("\n## Forwarding throughput\n\nThe lab's router forwards 64-byte UDP datagrams from two iperf3 senders (`-u -b 0 -l 64`, one pinned to each core) toward the server, which drops them at prerouting (nftables) once the streams are set up, so the cores go to sending and forwarding; each round keeps one blast running and installs, measures and removes every setup in turn, with a window of nothing attached before the first setup and after each; packets/s is the router's tx packets/s on its server-side veth over a setup's window (the median of the rounds), and × nothing is the median over rounds of each window against the mean of the nothing-attached windows either side of it (every round's ratio in brackets). The empty program is the object's `shaper_floor` on the same hook, and with one clock read its `shaper_floor_clock` (what the clock costs on the path); `shaper, 1 class no packet matches` has its one class on a port no sender uses (parse and verdict cache, no class). For shaper, the kernel's own run-time statistics (BPF_ENABLE_STATS, on for 1 s after the window) give its program's time per forwarded packet on this path, less the statistics' own cost (what they record for the empty program in a test run: their clock reads, the call, the empty body); capacity × nothing is what that time leaves of the machine's time per forwarded packet with nothing attached (cores × 1 s / packets/s): budget / (budget + program). For the programs (the empty one and shaper's), × nothing on/off is the precise figure: in the same blast, the program's TCX link is attached and detached in turns of 120 ms (20 ms to settle, 100 ms counted; shaper's own link is unpinned for the turns and pinned again after them), each on-turn against the mean of the off-turns either side, and the mean over every round's pairs ± its standard error (that of the rounds' means with three rounds or more, since rounds differ by more than their pairs do; with one round a lower bound, since neighbouring pairs share an off-window). The turns come after the setup's windows, set up again for them, and a fresh window of nothing follows them, so the windows stay neighbours. The forwarding rate wanders by about 5 % between neighbouring windows at every length from 0.1 to 5 s (120 s of nothing attached on this machine), so a few 5 s windows cannot tell 1 % from 3 %; hundreds of short turns can, since drift slower than a turn cancels between neighbours. Limits are set so high that no rate is ever reached: this is the cost of being on the path. With many classes, the senders match the last class or filter added (u32 walks its list in order; shaper's classifier does one hash lookup per rule shape): once with every class in one rule shape (4-port blocks), once with the idle classes in a second shape (single ports). Senders: `iperf3 -c 198.18.2.2 -u -b 0 -l 64 -A CPU` (ports 20001 and 20002). Target: shaper ≥ 97 % of nothing (judged on the on/off figure), and above tbf/htb.\n\n| setup | packets/s (median) | × nothing (rounds) | × nothing on/off (± s.e., pairs) | program ns / packet | capacity × nothing | configuration |\n|---|---|---|---|---|---|---|\n");
    for row in report["throughput"].as_array().into_iter().flatten() {
        let (program, capacity) = if row["program_ns"].is_null() {
            ("-".to_string(), "-".to_string())
        } else {
            (
                format!(
                    "{:.0} of {:.0}",
                    f(&row["program_ns"]),
                    f(&row["budget_ns"])
                ),
                format!("{:.3}", f(&row["capacity_ratio"])),
            )
        };
        let on_off = if row["on_off_ratio"].is_null() {
            "-".to_string()
        } else {
            format!(
                "{:.3} ± {:.3} ({} pairs; rounds {})",
                f(&row["on_off_ratio"]),
                f(&row["on_off_error"]),
                row["on_off_pairs"],
                rounds(&row["on_off_rounds"])
            )
        };
        out.push_str(&format!(
            "| {} | {:.0} | {:.3} ({}) | {on_off} | {program} | {capacity} | {} |\n",
            row["setup"].as_str().unwrap_or_default(),
            f(&row["pps"]),
            f(&row["ratio_to_none"]),
            rounds(&row["ratio_runs"]),
            row["command"].as_str().unwrap_or_default()
        ));
    }

    out.push_str(&format!("\n## Accuracy and TCP goodput\n\nClass (or qdisc) on the router's egress toward the server. UDP: iperf3 at 10× the rate, 1400-byte datagrams, L2 rate received by the server over the steady state (the first second, with the initial burst, left out). TCP: one cubic flow, goodput received by the server over the whole run, initial burst included. Unlimited, the sender here reaches {:.0} Mbit/s of UDP; rows where it cannot offer 2× the rate say so.\n\n| tool | action | proto | configured Mbit/s | measured Mbit/s | ratio | configuration |\n|---|---|---|---|---|---|---|\n", f(&report["sender_max_udp_bps"]) / 1e6));
    for row in report["accuracy"].as_array().into_iter().flatten() {
        let note = row["note"].as_str().unwrap_or_default();
        let action = row["action"].as_str().unwrap_or_default();
        // A marking action does not limit: its ratio only says how fast the link is.
        let ratio = if action.starts_with("dscp") {
            "not limited".to_string()
        } else {
            format!("{:.4}", f(&row["ratio"]))
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.3} | {} | `{}`{} |\n",
            row["tool"].as_str().unwrap_or_default(),
            action,
            row["proto"].as_str().unwrap_or_default(),
            row["configured_bps"].as_u64().unwrap_or(0) / 1_000_000,
            f(&row["measured_bps"]) / 1e6,
            ratio,
            row["command"].as_str().unwrap_or_default(),
            if note.is_empty() {
                String::new()
            } else {
                format!(" ({note})")
            }
        ));
    }
    out.push_str("\n`dscp=af11` only marks: it is there to show that a marking class does not limit (the flow runs at the line rate). TCP through `ecn` runs with `net.ipv4.tcp_ecn=1` on the client. In the plots, the policer (`shaper drop`) lets TCP through in bursts: a loss stops the flow until the 200 ms minimum RTO, by when the bucket has refilled, so 100 ms bins alternate between ~2× the rate and nothing while the average stays at the rate; a shaper (tbf, or `--action shape`) queues instead and the line is flat.\n");
    out.push_str("\n![UDP rate over time, shaper vs tbf](bench/udp-10mbit.png)\n\n![TCP goodput over time, shaper vs tbf](bench/tcp-10mbit.png)\n");

    out.push_str("\n## Honest limits\n\n");
    out.push_str("- This kernel has no `fq`, `cake`, `act_police` or `fq_codel` modules, so tc's policer (`tc filter ... action police`), fq's EDT pacing and cake cannot be compared here; shaper's own EDT path is checked with BPF_PROG_TEST_RUN only (tests/tests/test_run.rs).\n");
    out.push_str("- The lab is three namespaces on one 2-core machine: the senders, the router and the receivers share the cores, so forwarding figures are ratios, not line rates, and the highest UDP rate is set by the sender (see the accuracy note).\n");
    out.push_str("- The CNI `bandwidth` plugin is given the same burst as shaper's default; Kubernetes passes a burst of 2^31 − 1 bits when a pod sets only a rate, which lets the first ~268 MB through unlimited.\n");
    out.push_str("- Per-packet cost misses the ≤ 2× floor target: see the table; the stage table shows where the time goes: an empty program and one clock read alone are about 2× the floor, so a flow-scoped class (which needs the clock and an LRU lookup) cannot get there.\n");
    out
}

/// Every row and figure a run of an effort must report.
struct Expected {
    per_packet: Vec<String>,
    flow_counts: Vec<u32>,
    class_counts: Vec<u16>,
    maps: Vec<&'static str>,
    control_plane_classes: u16,
    throughput: Vec<String>,
    accuracy: Vec<AccuracyKey>,
    latency: Vec<String>,
}

impl Expected {
    fn of(effort: &Effort) -> Self {
        Self {
            per_packet: vec![
                CASE_FLOOR.into(),
                CASE_CLOCK.into(),
                CASE_A.into(),
                CASE_D.into(),
                CASE_FLAT.into(),
                CASE_FLAT_SHARED.into(),
                CASE_CHAIN.into(),
                CASE_A_MISS.into(),
                CASE_D_MISS.into(),
                CASE_SECOND_SHAPE.into(),
                CASE_SECOND_SHAPE_MISS.into(),
                case_b(effort.live_flows),
                case_c(effort.classes),
            ],
            flow_counts: std::iter::once(1)
                .chain(flow_levels(effort.live_flows))
                .collect(),
            class_counts: class_levels(effort.classes),
            maps: map_names::ALL.to_vec(),
            control_plane_classes: effort.control_plane_classes,
            throughput: traffic::expected_throughput(&effort.traffic),
            accuracy: traffic::expected_accuracy(&effort.traffic),
            latency: latency::expected(&effort.latency),
        }
    }
}

/// Most a measured rate may exceed what limits it (or a setup what forwards without it)
/// before the figure is taken for a broken measurement.
const MAX_SANE_RATIO: f64 = 1.5;

/// A figure that is there, finite and positive, and at most `max`.
fn sane(value: &Value, max: f64) -> bool {
    value
        .as_f64()
        .is_some_and(|v| v.is_finite() && v > 0.0 && v <= max)
}

/// Prints how the targets fare, and fails when a measurement the run was to make is
/// missing or absurd: a row of `expected` absent, a figure zero, NaN (null in JSON) or
/// negative, a throughput or accuracy ratio above [`MAX_SANE_RATIO`].
fn check_targets(report: &Value, expected: &Expected) -> Result<()> {
    let mut broken: Vec<String> = Vec::new();
    let rows_of = |key: &str| report[key].as_array().cloned().unwrap_or_default();

    // Per-packet cost: ratios to the floor are legitimately well above 1.
    let per_packet = rows_of("per_packet");
    // Issue 14's targets: (a)-(c) within 2× the floor, (d) within 1.5×; the other rows
    // explain them.
    for row in &per_packet {
        let case = row["case"].as_str().unwrap_or_default();
        let limit = if case == CASE_D {
            1.5
        } else if ["(a)", "(b)", "(c)"]
            .iter()
            .any(|tag| case.starts_with(tag))
        {
            2.0
        } else {
            continue;
        };
        let ratio = row["ratio_to_floor"].as_f64().unwrap_or(f64::NAN);
        let verdict = if ratio <= limit { "meets" } else { "misses" };
        // The ns too: a VM with a fast floor misses a ratio with the lowest ns measured.
        println!(
            "target ≤ {limit:.1}× floor: {case} {verdict} ({ratio:.2}; {:.1} ns, floor {:.1} ns)",
            f(&row["ns_median"]),
            case_figure(&per_packet, CASE_FLOOR, "ns_median")
        );
    }
    let ns_of = |case: &str| case_figure(&per_packet, case, "ns_median");
    // Like with like: the chain's classes read the clock and swap shared words for every
    // packet, so the flat class compared is one that does too (no per-CPU credit).
    let chain = ns_of(CASE_CHAIN) / ns_of(CASE_FLAT_SHARED);
    println!(
        "target 3-level chain ≤ 1.5× a flat class on its shared word: {} ({chain:.2}; {:.2}× \
         a flat class its CPU's credit covers)",
        if chain <= 1.5 { "meets" } else { "misses" },
        ns_of(CASE_CHAIN) / ns_of(CASE_FLAT)
    );
    for case in &expected.per_packet {
        match per_packet.iter().find(|row| row["case"] == case.as_str()) {
            None => broken.push(format!("per-packet row missing: {case}")),
            Some(row) => {
                for figure in ["ns_median", "ratio_to_floor"] {
                    if !sane(&row[figure], f64::INFINITY) {
                        broken.push(format!("per-packet {case}: {figure} is {}", row[figure]));
                    }
                }
            }
        }
    }
    for (axis, counts) in [
        (
            "flows",
            expected
                .flow_counts
                .iter()
                .map(|&n| f64::from(n))
                .collect::<Vec<_>>(),
        ),
        (
            "classes",
            expected
                .class_counts
                .iter()
                .map(|&n| f64::from(n))
                .collect(),
        ),
    ] {
        let points = report["scaling"][axis]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let measured: Vec<f64> = points.iter().filter_map(|p| p["count"].as_f64()).collect();
        if measured != counts {
            broken.push(format!(
                "scaling by {axis}: counts {measured:?}, expected {counts:?}"
            ));
        }
        if let Some(point) = points
            .iter()
            .find(|p| !sane(&p["ns_median"], f64::INFINITY))
        {
            broken.push(format!("scaling by {axis}: {point}"));
        }
    }
    if !sane(&report["scaling"]["floor_ns"], f64::INFINITY) {
        broken.push(format!(
            "scaling: floor_ns is {}",
            report["scaling"]["floor_ns"]
        ));
    }

    // Memory and control plane.
    let memory = &report["memory"];
    let maps = memory["maps"].as_array().cloned().unwrap_or_default();
    for name in &expected.maps {
        match maps.iter().find(|row| row["map"] == *name) {
            None => broken.push(format!("memory row missing: {name}")),
            Some(row) => {
                for figure in ["bytes", "max_entries", "bytes_per_entry"] {
                    if !sane(&row[figure], f64::INFINITY) {
                        broken.push(format!("memory {name}: {figure} is {}", row[figure]));
                    }
                }
            }
        }
    }
    for figure in ["bytes_per_flow", "bytes_per_class", "bytes_for_1m_flows"] {
        if !sane(&memory[figure], f64::INFINITY) {
            broken.push(format!("memory: {figure} is {}", memory[figure]));
        }
    }
    let control = &report["control_plane"];
    if control["classes"].as_u64() != Some(expected.control_plane_classes.into()) {
        broken.push(format!(
            "control plane: {} classes, expected {}",
            control["classes"], expected.control_plane_classes
        ));
    }
    for (group, figure) in [
        ("apply_seconds", "shaper_batch"),
        ("apply_seconds", "tc_batch_htb_u32"),
        ("rate_change_seconds", "shaper"),
        ("rate_change_seconds", "tc_class_change"),
    ] {
        if !sane(&control[group][figure], f64::INFINITY) {
            broken.push(format!(
                "control plane: {group}.{figure} is {}",
                control[group][figure]
            ));
        }
    }
    for figure in ["shaper_batch", "tc_batch_htb_u32"] {
        if !sane(&control["tree_apply_seconds"][figure], f64::INFINITY) {
            broken.push(format!(
                "control plane: tree_apply_seconds.{figure} is {}",
                control["tree_apply_seconds"][figure]
            ));
        }
    }
    let tree_ratio = f(&control["tree_apply_ratio_shaper_to_tc"]);
    // The target is about scale (tc's u32 lists grow worse than linearly): a quick run's
    // small tree reports its ratio without a verdict.
    let verdict = if expected.control_plane_classes < FULL_CONTROL_PLANE_CLASSES {
        format!("not judged below {} x 10", FULL_CONTROL_PLANE_CLASSES / 10)
    } else if tree_ratio < 1.0 {
        "meets".into()
    } else {
        "misses".into()
    };
    println!(
        "target: a {} x 10 tree applied faster than tc -batch: {verdict} ({tree_ratio:.2})",
        control["tree_parents"],
    );
    if !sane(&control["apply_ratio_shaper_to_tc"], f64::INFINITY) {
        broken.push(format!(
            "control plane: apply_ratio_shaper_to_tc is {}",
            control["apply_ratio_shaper_to_tc"]
        ));
    }

    // Forwarding throughput.
    let throughput = rows_of("throughput");
    let ratio_of = |prefix: &str, nth: usize| {
        throughput
            .iter()
            .filter(|row| {
                row["setup"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with(prefix)
            })
            .nth(nth)
            .map(|row| f(&row["ratio_to_none"]))
            .unwrap_or(f64::NAN)
    };
    let shaper_figure = |nth: usize, field: &str| {
        throughput
            .iter()
            .filter(|row| !row["capacity_ratio"].is_null())
            .nth(nth)
            .map(|row| f(&row[field]))
            .unwrap_or(f64::NAN)
    };
    // Judged on the on/off figure (the precise one); the windows' median is printed too.
    for (nth, label, peers) in [
        (0, "1 class", [ratio_of("tbf", 0), ratio_of("htb", 0)]),
        (
            1,
            "1000 classes, 1 rule shape",
            [ratio_of("htb", 1), f64::NAN],
        ),
        (
            2,
            "1000 classes, 2 rule shapes",
            [ratio_of("htb", 1), f64::NAN],
        ),
    ] {
        let shaper = shaper_figure(nth, "on_off_ratio");
        let verdict = if shaper >= 0.97 && peers.iter().all(|p| p.is_nan() || shaper > *p) {
            "meets"
        } else {
            "misses"
        };
        println!(
            "target ≥ 97 % of nothing and above tbf/htb: shaper {label} {verdict} ({shaper:.3} ± {:.3} on/off, windows {:.3}, capacity from the program's run time {:.3}; tbf/htb by windows)",
            shaper_figure(nth, "on_off_error"),
            ratio_of("shaper", nth),
            shaper_figure(nth, "capacity_ratio")
        );
    }
    for setup in &expected.throughput {
        match throughput.iter().find(|row| row["setup"] == setup.as_str()) {
            None => broken.push(format!("throughput row missing: {setup}")),
            Some(row) => {
                if !sane(&row["pps"], f64::INFINITY) {
                    broken.push(format!("throughput {setup}: pps is {}", row["pps"]));
                }
                if !sane(&row["ratio_to_none"], MAX_SANE_RATIO) {
                    broken.push(format!(
                        "throughput {setup}: ratio to nothing is {} (expected in (0, {MAX_SANE_RATIO}])",
                        row["ratio_to_none"]
                    ));
                }
                // The programs' rows carry their on/off figure and its error.
                if (setup.starts_with("shaper") || setup.starts_with("empty"))
                    && !(sane(&row["on_off_ratio"], MAX_SANE_RATIO)
                        && sane(&row["on_off_error"], 1.0)
                        && sane(&row["on_off_pairs"], f64::INFINITY)
                        && row["on_off_rounds"]
                            .as_array()
                            .is_some_and(|rounds| rounds.iter().all(|r| sane(r, MAX_SANE_RATIO))))
                {
                    broken.push(format!(
                        "throughput {setup}: on/off figure {} ± {}",
                        row["on_off_ratio"], row["on_off_error"]
                    ));
                }
                // shaper's rows carry its program's run time on the path as the kernel
                // recorded it, the statistics' own cost, what is left (0 would mean the
                // subtraction failed), and what that leaves of the machine's time per
                // packet (below 1 by construction).
                if setup.starts_with("shaper")
                    && !(sane(&row["program_measured_ns"], f64::INFINITY)
                        && sane(&row["stats_overhead_ns"], f64::INFINITY)
                        && sane(&row["program_ns"], f64::INFINITY)
                        && sane(&row["capacity_ratio"], 1.0))
                {
                    broken.push(format!(
                        "throughput {setup}: program run time {} ns, capacity {}",
                        row["program_measured_ns"], row["capacity_ratio"]
                    ));
                }
            }
        }
    }

    // Accuracy and TCP goodput.
    if !sane(&report["sender_max_udp_bps"], f64::INFINITY) {
        broken.push(format!(
            "sender_max_udp_bps is {}",
            report["sender_max_udp_bps"]
        ));
    }
    let accuracy = rows_of("accuracy");
    for key in &expected.accuracy {
        match accuracy.iter().find(|row| key.matches(row)) {
            None => broken.push(format!("accuracy row missing: {key}")),
            Some(row) => {
                if !sane(&row["measured_bps"], f64::INFINITY) {
                    broken.push(format!("accuracy {key}: measured {}", row["measured_bps"]));
                }
                // A marking class does not limit: its flow runs at the line rate.
                let max = if key.limits() {
                    MAX_SANE_RATIO
                } else {
                    f64::INFINITY
                };
                if !sane(&row["ratio"], max) {
                    broken.push(format!(
                        "accuracy {key}: measured / configured is {} (expected in (0, {max}])",
                        row["ratio"]
                    ));
                }
            }
        }
    }

    // Latency under load.
    broken.extend(latency::check(report, &expected.latency));
    // Limits across hosts.
    broken.extend(uploads::check(report));
    broken.extend(senders::check(report));
    broken.extend(fairness::check(report));
    broken.extend(global::check(report));

    if broken.is_empty() {
        return Ok(());
    }
    for problem in &broken {
        eprintln!("broken measurement: {problem}");
    }
    bail!(
        "{} measurement(s) missing or absurd:\n  {}",
        broken.len(),
        broken.join("\n  ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report with every row the quick run makes, every figure plausible.
    fn sane_report(expected: &Expected) -> Value {
        let counts = |counts: Vec<f64>| -> Vec<Value> {
            counts
                .into_iter()
                .map(|n| json!({"count": n, "ns_median": 30.0}))
                .collect()
        };
        json!({
            "per_packet": expected.per_packet.iter().enumerate().map(|(i, case)| json!({
                "case": case,
                "ns_median": 10.0 + 10.0 * i as f64,
                "ns_min": 9.0,
                "ratio_to_floor": 1.0 + i as f64,
                "ratio_to_a": 1.0,
            })).collect::<Vec<_>>(),
            "scaling": {
                "floor_ns": 10.0,
                "flows": counts(expected.flow_counts.iter().map(|&n| f64::from(n)).collect()),
                "classes": counts(expected.class_counts.iter().map(|&n| f64::from(n)).collect()),
            },
            "memory": {
                "maps": expected.maps.iter().map(|name| json!({
                    "map": name, "bytes": 4096, "max_entries": 64, "bytes_per_entry": 64.0,
                })).collect::<Vec<_>>(),
                "total_bytes_for_this_attachment": 4096 * expected.maps.len(),
                "bytes_per_flow": 120.0,
                "bytes_per_class": 300.0,
                "bytes_for_1m_flows": 120e6,
            },
            "control_plane": {
                "classes": expected.control_plane_classes,
                "apply_seconds": {"shaper_batch": 0.5, "tc_batch_htb_u32": 1.0},
                "apply_ratio_shaper_to_tc": 0.5,
                "tree_parents": 1000,
                "tree_apply_seconds": {"shaper_batch": 0.5, "tc_batch_htb_u32": 1.0},
                "tree_apply_ratio_shaper_to_tc": 0.5,
                "rate_change_seconds": {"shaper": 0.01, "tc_class_change": 0.005},
            },
            "throughput": expected.throughput.iter().map(|setup| json!({
                "setup": setup, "command": "-", "pps": 3e5, "pps_runs": [3e5], "ratio_to_none": 0.97,
                "ratio_runs": [0.97], "program_measured_ns": 160.0, "stats_overhead_ns": 60.0,
                "program_ns": 100.0, "budget_ns": 4000.0, "capacity_ratio": 0.976,
                "on_off_ratio": 0.975, "on_off_error": 0.001, "on_off_pairs": 500,
                "on_off_rounds": [0.975],
            })).collect::<Vec<_>>(),
            "sender_max_udp_bps": 9e8,
            "accuracy": expected.accuracy.iter().map(|key| json!({
                "tool": key.tool,
                "action": key.action,
                "proto": key.proto,
                "configured_bps": key.configured_bps,
                "measured_bps": key.configured_bps as f64 * 0.99,
                "ratio": 0.99,
                "command": "-",
                "note": "",
            })).collect::<Vec<_>>(),
            "latency": expected.latency.iter().map(|setup| json!({
                "setup": setup,
                "goodput_ratio": 0.95,
                "added_p50_ms": 3.0,
                "added_p99_ms": 9.0,
                "probes": 400,
                "probes_lost": 0,
                "sender_rtt_ms": 45.0,
            })).collect::<Vec<_>>(),
            "uploads": uploads::sane_rows(),
            "senders": senders::sane_rows(),
            "fairness": fairness::sane_rows(),
            "global": {
                "skewed": {"global": 0.95, "static_split": 0.33},
                "redis": [{"hosts": 10, "script_ms_per_interval": 0.3}],
                "cluster": [
                    {"primaries": 1, "reports_carried_per_interval": 12000.0},
                    {"primaries": 3, "reports_carried_per_interval": 29000.0},
                    {"primaries": 6, "reports_carried_per_interval": 45000.0},
                ],
            },
        })
    }

    fn rejected(report: &Value, expected: &Expected, what: &str) {
        let error = check_targets(report, expected).expect_err("a broken report passed");
        let message = format!("{error:#}");
        assert!(message.contains(what), "{message}");
    }

    #[test]
    fn compare_takes_two_builds_or_more() {
        let args = |line: &str| line.split(' ').map(String::from).collect::<Vec<_>>();
        let options = options_from(args("--compare old.o,new.o").into_iter()).unwrap();
        assert_eq!(
            options.compare,
            vec![PathBuf::from("old.o"), PathBuf::from("new.o")]
        );
        let error = options_from(args("--compare new.o").into_iter())
            .err()
            .unwrap();
        assert!(error.to_string().contains("two or more builds"), "{error}");
        assert!(options_from(args("--compare").into_iter()).is_err());
        assert!(options_from(args("--compare new.o,").into_iter()).is_err());
        let error = options_from(args("--compare old.o,new.o --json out.json").into_iter())
            .err()
            .unwrap();
        assert!(error.to_string().contains("runs alone"), "{error}");
    }

    #[test]
    fn the_quick_run_fails_on_a_missing_or_absurd_measurement() {
        let expected = Expected::of(&effort(true));
        // What the quick run must produce, derived from its effort.
        assert_eq!(expected.per_packet.len(), 13);
        assert!(expected
            .per_packet
            .contains(&"(b) 1 class, 100000 live flows".into()));
        assert_eq!(expected.flow_counts, [1, 1000, 10_000, 100_000]);
        assert_eq!(expected.class_counts, [1, 10, 100, 1000, 10_000]);
        assert_eq!(expected.throughput.len(), 10);
        assert_eq!(expected.accuracy.len(), 2 + 4);
        let sane = sane_report(&expected);
        check_targets(&sane, &expected).unwrap();

        // A row missing, of each kind.
        let mut report = sane.clone();
        let flows_row = expected
            .per_packet
            .iter()
            .position(|case| case == "(b) 1 class, 100000 live flows")
            .unwrap();
        report["per_packet"]
            .as_array_mut()
            .unwrap()
            .remove(flows_row);
        rejected(
            &report,
            &expected,
            "per-packet row missing: (b) 1 class, 100000 live flows",
        );
        let mut report = sane.clone();
        report["throughput"].as_array_mut().unwrap().pop();
        rejected(
            &report,
            &expected,
            "throughput row missing: shaper, 1 class no packet matches",
        );
        let mut report = sane.clone();
        report["throughput"][1]["on_off_ratio"] = Value::Null;
        rejected(
            &report,
            &expected,
            "throughput empty TC program (TCX): on/off figure null",
        );
        let mut report = sane.clone();
        report["accuracy"].as_array_mut().unwrap().pop();
        rejected(
            &report,
            &expected,
            "accuracy row missing: shaper-cni drop tcp at 10 Mbit/s",
        );
        let mut report = sane.clone();
        report["memory"]["maps"].as_array_mut().unwrap().remove(0);
        rejected(&report, &expected, "memory row missing");
        let mut report = sane.clone();
        report["control_plane"]["rate_change_seconds"] = json!({});
        rejected(&report, &expected, "rate_change_seconds.shaper is null");
        let mut report = sane.clone();
        report["control_plane"]["tree_apply_seconds"] = json!({});
        rejected(
            &report,
            &expected,
            "tree_apply_seconds.shaper_batch is null",
        );
        let mut report = sane.clone();
        report["scaling"]["flows"].as_array_mut().unwrap().pop();
        rejected(&report, &expected, "scaling by flows");
        let mut report = sane.clone();
        report["global"]["redis"] = json!([]);
        rejected(&report, &expected, "no simulated-hosts row");
        let mut report = sane.clone();
        report["global"]["cluster"][2]["reports_carried_per_interval"] = json!(f64::NAN);
        rejected(&report, &expected, "a cluster row");
        let mut report = sane.clone();
        report["uploads"].as_array_mut().unwrap().pop();
        rejected(&report, &expected, "uploads: 8 rows, expected 9");
        let mut report = sane.clone();
        report["uploads"][0]["fraction"] = json!(0.0);
        rejected(
            &report,
            &expected,
            "TCP cubic at 10mbit over 0.0 ms: 0.000 of the rate",
        );
        let mut report = sane.clone();
        report["uploads"][4]["fraction"] = json!(0.92);
        rejected(
            &report,
            &expected,
            "TCP bbr at 10mbit over 0.0 ms: 0.920 < 0.93",
        );
        let mut report = sane.clone();
        report["uploads"][5]["fraction"] = json!(1.02);
        rejected(&report, &expected, "1.020 of the rate, not within 0.01");
        let mut report = sane.clone();
        report["uploads"][3]["rtt_ms"] = json!(21.0);
        rejected(&report, &expected, "RTT base + 21.0 ms > + 20");
        // BBR over 100 Mbit/s x 40 ms is held to the reference's tbf beside it.
        let mut report = sane.clone();
        for (row, fraction) in [(1, 0.935), (4, 0.92)] {
            let long_path = json!({"rate": "100mbit", "rate_bps": 100e6, "base_rtt_ms": 40.0});
            for (key, value) in long_path.as_object().unwrap() {
                report["uploads"][row][key] = value.clone();
            }
            report["uploads"][row]["fraction"] = json!(fraction);
        }
        rejected(
            &report,
            &expected,
            "0.920 < the reference's 0.935 − 0.01 (at least 0.9)",
        );
        report["uploads"][1]["fraction"] = json!(0.925);
        assert!(
            check_targets(&report, &expected).is_ok(),
            "within 0.01 of tbf"
        );
        let mut report = sane.clone();
        report["uploads"][7]["fraction"] = json!(0.05);
        assert!(
            check_targets(&report, &expected).is_ok(),
            "a policer's TCP may get little"
        );
        let mut report = sane.clone();
        report["senders"] = json!([]);
        rejected(&report, &expected, "senders: no rows");
        let mut report = sane.clone();
        report["senders"][1]["fraction"] = json!(0.9);
        rejected(&report, &expected, "0.900 < 0.93");
        let mut report = sane.clone();
        report["senders"][0]["rtt_over_base_ms"] = json!(25.0);
        rejected(&report, &expected, "RTT base + 25.0 ms");
        let mut report = sane.clone();
        report["senders"][2]["fraction"] = json!(0.8);
        assert!(
            check_targets(&report, &expected).is_ok(),
            "an unsplit row has no target"
        );
        let mut report = sane.clone();
        report["senders"][3]["fraction"] = json!(0.92);
        rejected(
            &report,
            &expected,
            "0.920 < tbf's 0.935 − 0.01 (at least 0.9)",
        );
        let mut report = sane.clone();
        report["senders"].as_array_mut().unwrap().pop();
        rejected(&report, &expected, "no tbf row beside it");

        // A zero ratio, of each kind; NaN, which JSON writes as null.
        let mut report = sane.clone();
        let no_class_row = expected
            .per_packet
            .iter()
            .position(|case| case == CASE_D)
            .unwrap();
        report["per_packet"][no_class_row]["ratio_to_floor"] = json!(0.0);
        rejected(
            &report,
            &expected,
            "(d) no class matches: ratio_to_floor is 0.0",
        );
        let mut report = sane.clone();
        report["throughput"][1]["ratio_to_none"] = json!(0.0);
        rejected(&report, &expected, "ratio to nothing is 0.0");
        let mut report = sane.clone();
        report["accuracy"][0]["ratio"] = json!(0.0);
        rejected(
            &report,
            &expected,
            "shaper drop udp at 10 Mbit/s: measured / configured is 0.0",
        );
        let mut report = sane.clone();
        report["throughput"][0]["ratio_to_none"] = json!(f64::NAN);
        rejected(&report, &expected, "ratio to nothing is null");

        // Ratios above 1.5: absurd for throughput and accuracy, fine per packet.
        let mut report = sane.clone();
        report["throughput"][4]["ratio_to_none"] = json!(1.6);
        rejected(&report, &expected, "ratio to nothing is 1.6");
        // A shaper row without its program's run time on the path.
        let mut report = sane.clone();
        report["throughput"][3]
            .as_object_mut()
            .unwrap()
            .remove("program_measured_ns");
        rejected(&report, &expected, "program run time null ns");
        let mut report = sane.clone();
        report["accuracy"][3]["ratio"] = json!(1.6);
        rejected(
            &report,
            &expected,
            "tbf shape tcp at 10 Mbit/s: measured / configured is 1.6",
        );
        let mut report = sane.clone();
        report["per_packet"][4]["ratio_to_floor"] = json!(8.5);
        check_targets(&report, &expected).unwrap();

        // Latency: shaper's and tbf's rows at 40 ms; one missing, a goodput of zero, a NaN
        // p99.
        assert_eq!(expected.latency.len(), 2);
        let mut report = sane.clone();
        report["latency"].as_array_mut().unwrap().remove(1);
        rejected(
            &report,
            &expected,
            "latency row missing: tbf, 20 Mbit/s, 40 ms RTT",
        );
        let mut report = sane.clone();
        report["latency"][0]["goodput_ratio"] = json!(0.0);
        rejected(
            &report,
            &expected,
            "shaper shape, 20 Mbit/s, 40 ms RTT, 1 cubic: goodput",
        );
        let mut report = sane.clone();
        report["latency"][1]["added_p99_ms"] = json!(f64::NAN);
        rejected(&report, &expected, "added_p99_ms is null");
        // A row whose delay line did not keep time: printed in a quick run, missing in a
        // full one.
        let mut report = sane.clone();
        report["latency"][1] = json!({
            "setup": expected.latency[1],
            "void": "the delay line did not keep time in 4 runs",
        });
        report["quick"] = json!(true);
        check_targets(&report, &expected).unwrap();
        report["quick"] = json!(false);
        rejected(
            &report,
            &expected,
            "latency tbf, 20 Mbit/s, 40 ms RTT, 1 cubic: not measured, the delay line",
        );
    }

    #[test]
    fn a_marking_class_may_run_at_the_line_rate_in_the_full_run() {
        let expected = Expected::of(&effort(false));
        assert!(expected
            .per_packet
            .contains(&"(b) 1 class, 1000000 live flows".into()));
        assert_eq!(expected.accuracy.len(), 4 * 2 + 2 * 8);
        let mut report = sane_report(&expected);
        check_targets(&report, &expected).unwrap();
        let dscp = expected
            .accuracy
            .iter()
            .position(|key| key.action == "dscp=af11")
            .unwrap();
        report["accuracy"][dscp]["ratio"] = json!(95.0);
        check_targets(&report, &expected).unwrap();
        report["accuracy"][dscp]["ratio"] = json!(0.0);
        rejected(&report, &expected, "dscp=af11");
    }
}
