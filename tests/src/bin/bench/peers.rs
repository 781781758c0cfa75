//! Latency under load beside the qdiscs a user would pick instead (`--only peers`, run in
//! Debian's kernels by `cargo xtask bench --vm`: the lab's own kernel has no fq, fq_codel,
//! CAKE or netem). Each row is a fresh lab with netem's base RTT on the client's and the
//! server's egress, one limiter on the router's egress toward the server, bulk TCP from the
//! client and a 20 Hz ping beside it; figures over the steady state.
//!
//! `--publish-peers` (on the host, with each guest's JSON) writes the section of
//! docs/BENCHMARKS.md, its plot, and holds shaper's shape to the targets against CAKE.

use crate::latency::{install_limiter, Limiter};
use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use shaper_tests::{
    counter,
    latency::{percentile, tcp_under_probe},
    Lab, Tcp, CLIENT_DEV, ROUTER_TO_CLIENT, ROUTER_TO_SERVER, SERVER_DEV,
};
use std::{path::Path, time::Duration};

const SECONDS: u32 = 30;
const STEADY_FROM: Duration = Duration::from_secs(10);
/// Runs of each cell the targets compare (shaper's two shape paths and CAKE, Cubic, 20
/// Mbit/s over 40 ms): one emulated run of a four-flow cell can differ from the next by 2×
/// (CAKE's bulk queue 5.5 then 11.0 ms), so the targets read the median of three.
const TARGET_RUNS: usize = 3;
/// The figures a repeated cell reports as the median of its runs (each run kept beside).
const FIGURES: [&str; 6] = [
    "goodput_ratio",
    "bulk_added_p50_ms",
    "probe_p50_ms",
    "probe_p99_ms",
    "probes_lost",
    "drops",
];
/// A section of docs/BENCHMARKS.md that `bench --vm` writes between its two markers (the
/// full bench on this host keeps it as it is).
pub struct Section {
    begin: &'static str,
    end: &'static str,
}

/// Latency under load beside the peers.
pub const PEERS: Section = Section {
    begin: "<!-- peers: written by `cargo xtask bench --vm` -->",
    end: "<!-- peers: end -->",
};
/// Held-out cells on equal terms (`bench --vm --held-out` alone, or the full `bench --vm`).
pub const HELD_OUT: Section = Section {
    begin: "<!-- held-out: written by `cargo xtask bench --vm` -->",
    end: "<!-- held-out: end -->",
};
/// Flow isolation beside CAKE and htb + fq_codel (`bench --vm --isolation` alone, or the
/// full `bench --vm`).
pub const ISOLATION: Section = Section {
    begin: "<!-- isolation: written by `cargo xtask bench --vm` -->",
    end: "<!-- isolation: end -->",
};

/// One row: a limiter, its rate, the path, the load.
#[derive(Clone, Debug)]
struct PeerCase {
    limiter: Limiter,
    rate_bps: u64,
    /// netem's delay each way (None: the µs lab).
    one_way: Option<Duration>,
    flows: u32,
    congestion: &'static str,
    /// TSO, GSO and GRO on (the veths' default) or off on the path's devices.
    offloads: bool,
}

impl PeerCase {
    fn at_40ms(limiter: Limiter, congestion: &'static str, flows: u32) -> Self {
        Self {
            limiter,
            rate_bps: 20_000_000,
            one_way: Some(Duration::from_millis(20)),
            flows,
            congestion,
            offloads: true,
        }
    }

    /// A cell the targets read (`check`): run [`TARGET_RUNS`] times.
    fn is_target(&self) -> bool {
        matches!(
            self.limiter,
            Limiter::Shape | Limiter::ShapeEdt | Limiter::Cake
        ) && self.congestion == "cubic"
            && self.offloads
            && self.rate_bps == 20_000_000
            && self.one_way.is_some()
    }

    fn path(&self) -> String {
        match self.one_way {
            Some(delay) => format!("{} ms", 2 * delay.as_millis()),
            None => "µs".into(),
        }
    }

    fn setup(&self) -> String {
        format!(
            "{}, {} Mbit/s, {} RTT, {} {}{}",
            self.limiter.label(),
            self.rate_bps / 1_000_000,
            self.path(),
            self.flows,
            self.congestion,
            if self.offloads { "" } else { ", offloads off" }
        )
    }
}

/// The table (every limiter, Cubic and BBR, one and four flows, 20 Mbit/s over 40 ms),
/// then shaper's two shape paths where they might part: offloads off, and 10 Mbit/s on
/// the µs lab.
fn cases() -> Vec<PeerCase> {
    let limiters = [
        Limiter::Shape,
        Limiter::ShapeEdt,
        Limiter::Drop,
        Limiter::Cake,
        Limiter::HtbFqCodel,
        Limiter::Tbf,
        Limiter::FqMaxrate,
    ];
    let mut cases = Vec::new();
    for flows in [1, 4] {
        for congestion in ["cubic", "bbr"] {
            for limiter in limiters {
                cases.push(PeerCase::at_40ms(limiter, congestion, flows));
            }
        }
    }
    for congestion in ["cubic", "bbr"] {
        for limiter in [Limiter::Shape, Limiter::ShapeEdt] {
            cases.push(PeerCase {
                offloads: false,
                ..PeerCase::at_40ms(limiter, congestion, 1)
            });
            cases.push(PeerCase {
                rate_bps: 10_000_000,
                one_way: None,
                ..PeerCase::at_40ms(limiter, congestion, 1)
            });
        }
    }
    cases
}

/// Packets dropped on the bottleneck: every qdisc's drops there, and shaper's own when
/// `shaper` is one of its rows.
pub fn bottleneck_drops(lab: &Lab, shaper: bool) -> Result<u64> {
    let output = lab.router.run(
        "tc",
        &["-s", "-j", "qdisc", "show", "dev", ROUTER_TO_SERVER],
    )?;
    let qdiscs: Value = serde_json::from_slice(&output.stdout).context("tc -s -j qdisc")?;
    let mut total: u64 = qdiscs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| q["drops"].as_u64())
        .sum();
    if shaper {
        total += lab
            .router
            .stats()?
            .iter()
            .map(|row| counter(row, "dropped_packets"))
            .sum::<u64>();
    }
    Ok(total)
}

fn one_row(case: &PeerCase) -> Result<Value> {
    let mut lab = match case.one_way {
        Some(delay) => Lab::with_netem(delay)?,
        None => Lab::new()?,
    };
    if !case.offloads {
        for (ns, dev) in [
            (&lab.client, CLIENT_DEV),
            (&lab.router, ROUTER_TO_CLIENT),
            (&lab.router, ROUTER_TO_SERVER),
            (&lab.server, SERVER_DEV),
        ] {
            ns.offloads_off(dev)?;
        }
    }
    install_limiter(&lab, case.limiter, case.rate_bps)?;
    let tcp = Tcp {
        flows: case.flows,
        congestion: case.congestion.into(),
        ..Tcp::for_seconds(SECONDS)
    };
    let run = tcp_under_probe(&mut lab, &tcp, STEADY_FROM, None)?;
    let from = STEADY_FROM.as_secs_f64();
    let bulk_added: Vec<f64> = run
        .sender_rtt_series
        .iter()
        .filter(|(end, _)| *end > from)
        .map(|(_, ms)| ms - run.idle_rtt_ms)
        .collect();
    let row = json!({
        "setup": case.setup(),
        "limiter": case.limiter.label(),
        "configuration": case
            .limiter
            .commands(case.rate_bps)
            .iter()
            .map(|words| words.join(" "))
            .collect::<Vec<_>>()
            .join("; "),
        "rate_bps": case.rate_bps,
        "path": case.path(),
        "flows": case.flows,
        "congestion": case.congestion,
        "offloads": case.offloads,
        "idle_rtt_ms": run.idle_rtt_ms,
        "goodput_ratio": run.steady_goodput_bps / case.rate_bps as f64,
        "bulk_added_p50_ms": percentile(&bulk_added, 50.0),
        "probe_p50_ms": run.added.p50_ms,
        "probe_p99_ms": run.added.p99_ms,
        "probes": run.added.samples,
        "probes_lost": run.added.lost,
        "drops": bottleneck_drops(&lab, case.limiter.is_shaper())?,
        "bulk_series": run
            .sender_rtt_series
            .iter()
            .map(|(end, ms)| (end, ms - run.idle_rtt_ms))
            .collect::<Vec<_>>(),
    });
    drop(lab);
    Ok(row)
}

/// Runs every row in this kernel, then the target cells again (passes, so a slow spell
/// of the emulator falls on every limiter alike); the report as JSON.
/// `rows`: only the rows whose setup contains it (a quick look at a few cells; such a
/// report is not published).
pub fn run(rows: Option<&str>) -> Result<Value> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_string();
    let started = std::time::Instant::now();
    // `--rows TEXT` may name isolation rows only (then no latency row runs).
    let cases = cases_named(rows)?;
    let mut runs: Vec<Vec<Value>> = vec![Vec::new(); cases.len()];
    for pass in 0..TARGET_RUNS {
        for (case, runs) in cases.iter().zip(&mut runs) {
            if pass > 0 && !case.is_target() {
                continue;
            }
            let row = one_row(case).with_context(|| case.setup())?;
            println!(
                "{:64} goodput {:.3}, bulk +{:.1} ms, probe p50 {:+.1} p99 {:+.1} ms, {} drops",
                case.setup(),
                row["goodput_ratio"].as_f64().unwrap_or(f64::NAN),
                row["bulk_added_p50_ms"].as_f64().unwrap_or(f64::NAN),
                row["probe_p50_ms"].as_f64().unwrap_or(f64::NAN),
                row["probe_p99_ms"].as_f64().unwrap_or(f64::NAN),
                row["drops"]
            );
            runs.push(row);
        }
    }
    // Flow isolation beside CAKE and htb + fq_codel (issue 50), after the latency rows,
    // then the held-out cells (issue 52).
    let isolation = crate::fairness::beside_peers(rows)?;
    let held_out = crate::heldout::run(rows)?;
    let report = json!({
        "kernel": kernel,
        "date": crate::date(),
        "seconds": started.elapsed().as_secs_f64(),
        "steady_from_s": STEADY_FROM.as_secs(),
        "run_s": SECONDS,
        "target_runs": TARGET_RUNS,
        "rows_filter": rows,
        "rows": runs.into_iter().map(median_row).collect::<Vec<_>>(),
        "isolation": isolation,
        "held_out": held_out,
    });
    println!("{}", table(&report));
    println!("{}", crate::fairness::peers_table(&isolation_of(&report)));
    Ok(report)
}

/// The rows whose setup contains `rows` (every row without it); an error naming the
/// rows there are when it matches none.
fn cases_named(rows: Option<&str>) -> Result<Vec<PeerCase>> {
    let all = cases();
    let Some(text) = rows else {
        return Ok(all);
    };
    let chosen: Vec<PeerCase> = all
        .iter()
        .filter(|case| case.setup().contains(text))
        .cloned()
        .collect();
    if chosen.is_empty() && !crate::fairness::any_peer_row(text) && !crate::heldout::any_row(text) {
        let names: Vec<String> = all
            .iter()
            .map(PeerCase::setup)
            .chain(crate::fairness::peer_rows())
            .chain(crate::heldout::row_names())
            .collect();
        bail!(
            "--rows {text:?} matches no row; the rows are: {}",
            names.join("; ")
        );
    }
    Ok(chosen)
}

/// One cell from its runs: the first run's description and series, each figure the median
/// of the runs (each figure on its own: the median run of one need not be of another),
/// and every run's figures under "runs" when there was more than one.
fn median_row(runs: Vec<Value>) -> Value {
    let mut row = runs.first().cloned().unwrap_or(Value::Null);
    if runs.len() > 1 {
        for key in FIGURES {
            let values: Vec<f64> = runs.iter().filter_map(|run| run[key].as_f64()).collect();
            row[key] = json!(percentile(&values, 50.0));
        }
        row["runs"] = runs
            .iter()
            .map(|run| {
                FIGURES
                    .iter()
                    .map(|key| (key.to_string(), run[*key].clone()))
                    .collect()
            })
            .collect::<Vec<serde_json::Map<_, _>>>()
            .into();
    }
    row
}

/// A figure of a row, with the range of its runs when the row has several: `8.4 (5.1–10.1)`.
fn figure(row: &Value, key: &str, digits: usize) -> String {
    let median = number(&row[key], digits);
    let values: Vec<f64> = row["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|run| run[key].as_f64())
        .collect();
    match (
        values.iter().copied().reduce(f64::min),
        values.iter().copied().reduce(f64::max),
    ) {
        (Some(low), Some(high)) if values.len() > 1 => {
            format!("{median} ({low:.digits$}–{high:.digits$})")
        }
        _ => median,
    }
}

fn number(value: &Value, digits: usize) -> String {
    value
        .as_f64()
        .map_or("–".into(), |v| format!("{v:.digits$}"))
}

fn row_of<'a>(
    report: &'a Value,
    limiter: Limiter,
    congestion: &str,
    flows: u64,
) -> Option<&'a Value> {
    report["rows"].as_array()?.iter().find(|row| {
        row["limiter"] == limiter.label()
            && row["congestion"] == congestion
            && row["flows"] == flows
            && row["offloads"] == true
            && row["path"] == "40 ms"
            && row["rate_bps"] == 20_000_000
    })
}

/// The targets, per kernel: at 20 Mbit/s over 40 ms with one and with four Cubic flows,
/// shaper's shape (on the path the kernel gives it by default) against CAKE: goodput ≥
/// CAKE's − 0.02, the bulk flow's added RTT p50 ≤ CAKE's + 3 ms, the probe's p99 ≤ CAKE's
/// + 2 ms. Each line says what held or broke.
pub fn check(report: &Value, shape: Limiter) -> (Vec<String>, Vec<String>) {
    let mut held = Vec::new();
    let mut broken = Vec::new();
    let kernel = report["kernel"].as_str().unwrap_or("?");
    for flows in [1, 4] {
        let (Some(ours), Some(cake)) = (
            row_of(report, shape, "cubic", flows),
            row_of(report, Limiter::Cake, "cubic", flows),
        ) else {
            broken.push(format!("{kernel}, {flows} cubic: a row is missing"));
            continue;
        };
        let figure = |row: &Value, key: &str| row[key].as_f64().unwrap_or(f64::NAN);
        for (what, key, slack, higher_is_better) in [
            ("goodput", "goodput_ratio", 0.02, true),
            ("bulk added RTT p50", "bulk_added_p50_ms", 3.0, false),
            ("probe p99", "probe_p99_ms", 2.0, false),
        ] {
            let (a, b) = (figure(ours, key), figure(cake, key));
            let ok = if higher_is_better {
                a >= b - slack
            } else {
                a <= b + slack
            };
            let line = format!(
                "{kernel}, {flows} cubic, {what}: {} {a:.3}, cake {b:.3} (allowed {}{slack})",
                shape.label(),
                if higher_is_better { "−" } else { "+" }
            );
            if ok {
                held.push(line);
            } else {
                broken.push(line);
            }
        }
    }
    (held, broken)
}

/// A report's isolation rows (none in a report from before they were measured).
fn isolation_of(report: &Value) -> Vec<Value> {
    report["isolation"].as_array().cloned().unwrap_or_default()
}

/// The markdown of one kernel's table.
fn table(report: &Value) -> String {
    let mut out = format!(
        "\n### {} ({}; {} s runs, figures from {} s on; the cells the targets read: the median of {} runs, their range in brackets)\n\n| setup | goodput / rate | bulk flow's added RTT p50 ms | probe added RTT p50 ms | p99 ms | probes lost | drops |\n|---|---|---|---|---|---|---|\n",
        report["kernel"].as_str().unwrap_or("?"),
        report["date"].as_str().unwrap_or("?"),
        report["run_s"],
        report["steady_from_s"],
        report["target_runs"].as_u64().unwrap_or(1)
    );
    for row in report["rows"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} of {} | {} |\n",
            row["setup"].as_str().unwrap_or("?"),
            figure(row, "goodput_ratio", 3),
            figure(row, "bulk_added_p50_ms", 1),
            figure(row, "probe_p50_ms", 1),
            figure(row, "probe_p99_ms", 1),
            number(&row["probes_lost"], 0),
            row["probes"],
            number(&row["drops"], 0),
        ));
    }
    out
}

/// `--publish-peers FILE,FILE --report docs/BENCHMARKS.md`: writes the sections the files
/// carry into the report in place of the last ones: the latency rows' (tables, plots,
/// targets) from every file with them, the isolation rows' and the held-out rows' from the
/// newest file of each kernel with them; a section no file carries is kept. The files of
/// one section must come from one build. Fails when a target broke.
pub fn publish(files: &[String], report: &Path) -> Result<()> {
    let mut parsed = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {file}"))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{file} is not the bench's JSON"))?;
        parsed.push(value);
    }
    let named: Vec<(&str, &Value)> = files.iter().map(String::as_str).zip(&parsed).collect();
    let mut text = std::fs::read_to_string(report).unwrap_or_default();
    let mut all_broken = Vec::new();
    let with_rows: Vec<(&str, &Value)> = named
        .iter()
        .copied()
        .filter(|(_, file)| has_latency_rows(file))
        .collect();
    if !with_rows.is_empty() {
        refuse_mixed_commits(&with_rows)?;
        let values: Vec<&Value> = with_rows.iter().map(|(_, file)| *file).collect();
        let (section, broken) = latency_section(&values, report)?;
        text = PEERS.replace_in(&text, &section);
        all_broken.extend(broken);
    }
    let isolation = newest_by_kernel(&named, |file| !isolation_of(file).is_empty());
    if !isolation.is_empty() {
        refuse_mixed_commits(&isolation)?;
        let values: Vec<&Value> = isolation.iter().map(|(_, file)| *file).collect();
        let (section, broken) = isolation_section(&values);
        text = ISOLATION.replace_in(&text, &section);
        all_broken.extend(broken);
    }
    let held_out = newest_by_kernel(&named, has_held_out_rows);
    if !held_out.is_empty() {
        refuse_mixed_commits(&held_out)?;
        let values: Vec<&Value> = held_out.iter().map(|(_, file)| *file).collect();
        text = HELD_OUT.replace_in(&text, &held_out_section(&values));
    }
    std::fs::write(report, text)?;
    println!("wrote {}", report.display());
    for line in &all_broken {
        println!("missed: {line}");
    }
    if !all_broken.is_empty() {
        bail!("{} target(s) missed", all_broken.len());
    }
    Ok(())
}

fn has_latency_rows(file: &Value) -> bool {
    file["rows"].as_array().is_some_and(|rows| !rows.is_empty())
}

fn has_held_out_rows(file: &Value) -> bool {
    file["held_out"]["rows"]
        .as_array()
        .is_some_and(|rows| !rows.is_empty())
}

/// Figures of different builds are not one comparison: every file of a section must name
/// the same commit (`bench --vm` writes it; a file without one is from before it did).
fn refuse_mixed_commits(files: &[(&str, &Value)]) -> Result<()> {
    let commit_of = |file: &Value| file["commit"].as_str().unwrap_or("unknown").to_string();
    let mut commits: Vec<String> = files.iter().map(|(_, file)| commit_of(file)).collect();
    commits.sort();
    commits.dedup();
    if commits.len() > 1 {
        let each: Vec<String> = files
            .iter()
            .map(|(name, value)| format!("{name}: {}", commit_of(value)))
            .collect();
        bail!(
            "the figures come from {} builds ({}): measure every kernel at one commit, or \
             remove the older files",
            commits.len(),
            each.join("; ")
        );
    }
    Ok(())
}

/// Of the files for which `has` holds, the newest of each kernel (by its date), newest
/// kernel first.
fn newest_by_kernel<'a>(
    files: &[(&'a str, &'a Value)],
    has: impl Fn(&Value) -> bool,
) -> Vec<(&'a str, &'a Value)> {
    let mut chosen: Vec<(&str, &Value)> = Vec::new();
    for &(name, file) in files.iter().filter(|(_, file)| has(file)) {
        match chosen
            .iter_mut()
            .find(|(_, kept)| kept["kernel"] == file["kernel"])
        {
            Some(kept) if kept.1["date"].as_str() < file["date"].as_str() => *kept = (name, file),
            Some(_) => {}
            None => chosen.push((name, file)),
        }
    }
    chosen.sort_by(|a, b| b.1["kernel"].as_str().cmp(&a.1["kernel"].as_str()));
    chosen
}

/// The held-out section: each kernel's table, losses and configurations.
fn held_out_section(files: &[&Value]) -> String {
    let held_out = |key: &str| {
        files
            .first()
            .map_or(Value::Null, |file| file["held_out"][key].clone())
    };
    let mut section = format!(
        "{}\n## Held-out cells on equal terms (Debian's kernels under qemu)\n\n\
         `cargo xtask bench --vm --held-out` (or the full `bench --vm`) runs cells no target \
         was set on, each a fresh lab as above with one limiter on the router's egress toward \
         the server, and the target cell (20 Mbit/s, 40 ms, one Cubic flow) again. Every \
         cell runs under four limiters: shaper with its defaults (a 128 KiB shape burst), \
         shaper with `--burst 32k` (the burst tbf has in this bench, HTB's order at these \
         rates), CAKE with its defaults (`rtt 100ms`) and CAKE with `rtt` set to the path's \
         RTT (`datacentre` on the µs lab). Each cell runs {} times in interleaved passes \
         (every cell under every limiter once, then again); a row is the run with the median \
         goodput, every figure from that run, the range over the runs in brackets. Runs are \
         {} s, figures from {} s on: goodput is the TCP flows' together over the rate (in the \
         web mix with the short uploads started from then on and completed); Jain's index is \
         the bulk flows'; the bulk RTT is the senders' smoothed RTT (iperf3, every 0.5 s, all \
         flows pooled) over the idle RTT; the probe is a 20 Hz ping's RTT over the idle RTT; \
         UDP's share is its L2 rate received over the rate; short uploads are 64 KiB each on \
         a new connection, five a second, timed from connect to the server's answer; drops \
         are the bottleneck's. Nothing here is a target: the figures are as measured and \
         shaper's losses are listed.\n",
        HELD_OUT.begin,
        held_out("runs"),
        held_out("run_s"),
        held_out("steady_from_s"),
    );
    for file in files {
        section.push_str(&format!(
            "\n### {} ({}; commit {}, {})\n",
            file["kernel"].as_str().unwrap_or("?"),
            file["date"].as_str().unwrap_or("?"),
            file["commit"].as_str().unwrap_or("unknown"),
            file["accel"].as_str().unwrap_or("?"),
        ));
        section.push_str(&crate::heldout::table(&file["held_out"]));
    }
    section.push_str(&format!("\n{}\n", HELD_OUT.end));
    section
}

/// The latency section: each file's table, its plot (written beside `report`), and the
/// targets against CAKE; with the targets it missed.
fn latency_section(files: &[&Value], report: &Path) -> Result<(String, Vec<String>)> {
    crate::plots::register_font()?;
    let dir = report.parent().unwrap_or(Path::new(".")).join("bench");
    std::fs::create_dir_all(&dir)?;
    let mut section = format!(
        "{}\n## Beside CAKE, fq_codel, tbf and fq (Debian's kernels under qemu)\n\n\
         `cargo xtask bench --vm` runs these rows inside Debian 12's own kernels (the lab's \
         kernel has none of fq, fq_codel, CAKE or netem), booted under qemu with TCG here \
         (emulated: a guest's CPU is some ten times slower than the host's, so rates stay at \
         10–20 Mbit/s). Each row is a fresh lab: netem adds half the base RTT on the client's \
         and on the server's egress, one limiter sits on the router's egress toward the \
         server, bulk TCP runs from the client for {SECONDS} s beside a 20 Hz ping. Goodput is \
         the server's over the steady state; the bulk flow's added RTT is the sender's \
         smoothed RTT (iperf3, per second) over the idle RTT, its median; the probe's added RTT \
         is the ping's over the idle RTT; drops are the bottleneck's (its qdiscs' and \
         shaper's). `fq maxrate` caps each flow, not the sum (four flows may take four times \
         the rate): it stands in for Cilium's per-pod EDT, whose aggregate rate a BPF program \
         sets, like shaper's EDT path. Target (issue 35): shaper's shape on its default path, one and four \
         Cubic flows, the median of {TARGET_RUNS} runs of each cell, goodput ≥ CAKE's − 0.02, bulk added RTT p50 ≤ CAKE's + 3 ms, probe p99 ≤ \
         CAKE's + 2 ms.\n",
        PEERS.begin
    );
    let mut all_broken = Vec::new();
    for &parsed in files {
        let kernel = parsed["kernel"].as_str().unwrap_or("unknown").to_string();
        section.push_str(&table(parsed));
        let name = format!("peers-{kernel}.png");
        let series: crate::latency::RttSeries = parsed["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|row| {
                row["congestion"] == "cubic"
                    && row["flows"] == 1
                    && row["offloads"] == true
                    && row["path"] == "40 ms"
            })
            .map(|row| {
                let points = row["bulk_series"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect();
                (row["limiter"].as_str().unwrap_or("?").to_string(), points)
            })
            .collect();
        crate::plots::queue_over_time(
            &dir.join(&name),
            &format!("Bulk flow's added RTT, one cubic flow, 20 Mbit/s, 40 ms ({kernel})"),
            &series,
        )?;
        section.push_str(&format!(
            "\n![the bulk flow's added RTT on {kernel}](bench/{name})\n"
        ));
        // The targets hold shape's default path (HTB + CoDel); the EDT path, asked for by
        // name, is compared the same way and reported.
        let (held, broken) = check(parsed, Limiter::Shape);
        let (edt_held, edt_broken) = check(parsed, Limiter::ShapeEdt);
        section.push_str("\nTargets against CAKE (shape's default path, HTB + CoDel):\n\n");
        for line in &held {
            section.push_str(&format!("- held: {line}\n"));
        }
        for line in &broken {
            section.push_str(&format!("- **missed**: {line}\n"));
        }
        section.push_str("\nThe same comparison for the EDT + fq path (reported, not held):\n\n");
        for line in &edt_held {
            section.push_str(&format!("- within: {line}\n"));
        }
        for line in &edt_broken {
            section.push_str(&format!("- beyond: {line}\n"));
        }
        println!("{}", table(parsed));
        all_broken.extend(broken);
    }
    section.push_str(&format!("\n{}\n", PEERS.end));
    Ok((section, all_broken))
}

/// The isolation section: each kernel's rows, held against CAKE's defaults and reported
/// against CAKE with the path's RTT and htb + fq_codel; with the targets it missed.
fn isolation_section(files: &[&Value]) -> (String, Vec<String>) {
    use crate::fairness::{check_beside, CAKE, CAKE_RTT, HTB_FQ_CODEL, SHAPER, SHAPER_SPLIT};
    let mut section = format!(
        "{}\n## Flow isolation beside CAKE and htb + fq_codel (Debian's kernels under qemu)\n\n\
         `cargo xtask bench --vm --isolation` (or the full `bench --vm`) runs these rows in \
         Debian 12's kernels under qemu (TCG here), each a fresh lab as above: one class (or \
         qdisc) of 10 Mbit/s on the router's egress toward the server matching everything, \
         {} s runs from 10 s on, on the µs path and over 40 ms (netem). TCP's goodput and \
         UDP's rate received are over the rate; Jain's index is the TCP flows'; the RTT is \
         the worst TCP flow's mean smoothed RTT over the base. Senders use TSO, so forwarded \
         traffic reaches the router as 64 KiB aggregates: CAKE splits them itself \
         (`split-gso`), HTB and fq_codel do not, and shaper's second row splits them on the \
         router's ingress as docs/GUIDE.md asks of a router (`attach r0 --direction ingress \
         --split-aggregates`). Target (issue 50): shaper's default row's smallest TCP share \
         within 0.03 of CAKE's and its worst TCP RTT within CAKE's + 3 ms, in every cell.\n",
        ISOLATION.begin,
        crate::fairness::PEER_SECONDS,
    );
    let mut all_broken = Vec::new();
    for &parsed in files {
        let kernel = parsed["kernel"].as_str().unwrap_or("unknown").to_string();
        // Flow isolation (issue 50): held against CAKE's defaults, reported against CAKE
        // with the path's RTT and htb + fq_codel.
        let isolation = isolation_of(parsed);
        section.push_str(&format!(
            "\n### {kernel} ({}; one run of each row)\n",
            parsed["date"].as_str().unwrap_or("?")
        ));
        section.push_str(&crate::fairness::peers_table(&isolation));
        let (iso_held, iso_broken) = check_beside(&isolation, &kernel, (SHAPER, CAKE));
        section.push_str("\nIsolation targets against CAKE's defaults (smallest TCP share within 0.03, worst TCP RTT within + 3 ms):\n\n");
        for line in &iso_held {
            section.push_str(&format!("- held: {line}\n"));
        }
        for line in &iso_broken {
            section.push_str(&format!("- **missed**: {line}\n"));
        }
        // No splitting row where the kernel's ifb drops redirected packets (before 6.4).
        let split = isolation.iter().any(|row| row["limiter"] == SHAPER_SPLIT);
        let splitting: &[(&str, &str)] = if split {
            &[(SHAPER_SPLIT, CAKE), (SHAPER_SPLIT, CAKE_RTT)]
        } else {
            &[]
        };
        for &pair in [(SHAPER, CAKE_RTT), (SHAPER, HTB_FQ_CODEL)]
            .iter()
            .chain(splitting)
        {
            let (within, beyond) = check_beside(&isolation, &kernel, pair);
            section.push_str(&format!(
                "\nThe same, {} against {} (reported, not held):\n\n",
                pair.0, pair.1
            ));
            for line in &within {
                section.push_str(&format!("- within: {line}\n"));
            }
            for line in &beyond {
                section.push_str(&format!("- beyond: {line}\n"));
            }
        }
        println!("{}", crate::fairness::peers_table(&isolation));
        all_broken.extend(iso_broken);
    }
    section.push_str(&format!("\n{}\n", ISOLATION.end));
    (section, all_broken)
}

impl Section {
    /// `text` with this section replaced by `section` (appended when it has none).
    pub fn replace_in(&self, text: &str, section: &str) -> String {
        match (text.find(self.begin), text.find(self.end)) {
            (Some(start), Some(end)) if end > start => {
                let after = end + self.end.len();
                let rest = text[after..].strip_prefix('\n').unwrap_or(&text[after..]);
                format!("{}{section}{rest}", &text[..start])
            }
            _ => format!("{}\n\n{section}", text.trim_end()),
        }
    }

    /// This section of a report `text`, to keep when the rest is written anew.
    pub fn of(&self, text: &str) -> Option<String> {
        let start = text.find(self.begin)?;
        let end = text.find(self.end)?;
        (end > start).then(|| format!("{}\n", &text[start..end + self.end.len()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_of_two_builds_are_not_published_together() {
        let (abc, def) = (json!({"commit": "abc"}), json!({"commit": "def"}));
        assert!(refuse_mixed_commits(&[("a.json", &abc), ("b.json", &abc)]).is_ok());
        let error = refuse_mixed_commits(&[("a.json", &abc), ("b.json", &def)])
            .unwrap_err()
            .to_string();
        assert!(error.contains("b.json: def"), "{error}");
        let unstamped = json!({"kernel": "6.1"});
        assert!(refuse_mixed_commits(&[("a.json", &abc), ("b.json", &unstamped)]).is_err());
    }

    #[test]
    fn the_section_is_replaced_in_place_and_kept() {
        let (begin, end) = (PEERS.begin, PEERS.end);
        let section = format!("{begin}\nnew\n{end}\n");
        let text = format!("# head\n{begin}\nold\n{end}\n## tail\n");
        let replaced = PEERS.replace_in(&text, &section);
        assert_eq!(replaced, format!("# head\n{begin}\nnew\n{end}\n## tail\n"));
        assert_eq!(PEERS.of(&replaced).as_deref(), Some(section.as_str()));
        assert_eq!(ISOLATION.of(&replaced), None, "the other section is apart");
        assert_eq!(
            PEERS.replace_in("# head\n", &section),
            format!("# head\n\n{section}")
        );
        assert_eq!(PEERS.of("# head\n"), None);
    }

    #[test]
    fn each_kernel_publishes_its_newest_isolation_rows() {
        let file = |kernel: &str, date: &str, rows: usize| {
            json!({"kernel": kernel, "date": date, "rows": [],
                "isolation": vec![json!({"limiter": "cake"}); rows]})
        };
        let files = [
            file("6.1", "2026-12-04 18:20 UTC", 40),
            file("6.12", "2026-12-06 12:30 UTC", 40),
            file("6.12", "2026-12-04 17:47 UTC", 40),
            // A run before the isolation rows: nothing to publish.
            file("6.1", "2026-12-07 08:00 UTC", 0),
        ];
        let named: Vec<(&str, &Value)> = files.iter().map(|file| ("f.json", file)).collect();
        let chosen = newest_by_kernel(&named, |file| !isolation_of(file).is_empty());
        let seen: Vec<(&str, &str)> = chosen
            .iter()
            .map(|(_, f)| (f["kernel"].as_str().unwrap(), f["date"].as_str().unwrap()))
            .collect();
        assert_eq!(
            seen,
            [
                ("6.12", "2026-12-06 12:30 UTC"),
                ("6.1", "2026-12-04 18:20 UTC")
            ]
        );
    }

    #[test]
    fn rows_are_chosen_by_their_setup() {
        let four_cubic = cases_named(Some("40 ms RTT, 4 cubic")).unwrap();
        assert_eq!(four_cubic.len(), 7, "every limiter once");
        assert!(four_cubic
            .iter()
            .all(|case| case.flows == 4 && case.congestion == "cubic"));
        assert_eq!(cases_named(None).unwrap().len(), cases().len());
        let error = cases_named(Some("5 flows")).unwrap_err().to_string();
        assert!(error.contains("matches no row") && error.contains("cake, 20 Mbit/s"));
        assert!(error.contains("isolation: bbr beside UDP at 2x, µs, "));
        // Isolation rows alone: no latency row, and no error.
        assert!(cases_named(Some("isolation")).unwrap().is_empty());
        assert!(cases_named(Some("bbr beside UDP at 2x, µs"))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_repeated_cell_reports_each_figure_as_its_median_with_the_range() {
        let run = |goodput: f64, bulk: f64| {
            json!({"setup": "cake", "goodput_ratio": goodput, "bulk_added_p50_ms": bulk,
                   "probe_p50_ms": 0.1, "probe_p99_ms": 2.0, "probes_lost": 0, "drops": 10})
        };
        let row = median_row(vec![run(0.90, 11.0), run(0.95, 5.5), run(0.80, 7.0)]);
        assert_eq!(row["goodput_ratio"], 0.90);
        assert_eq!(row["bulk_added_p50_ms"], 7.0);
        assert_eq!(row["runs"].as_array().map(Vec::len), Some(3));
        assert_eq!(figure(&row, "bulk_added_p50_ms", 1), "7.0 (5.5–11.0)");
        assert_eq!(figure(&row, "drops", 0), "10 (10–10)");
        let single = median_row(vec![run(0.93, 4.0)]);
        assert_eq!(figure(&single, "goodput_ratio", 3), "0.930");
        assert!(single.get("runs").is_none());
    }

    #[test]
    fn targets_compare_shaper_with_cake_row_by_row() {
        let row = |limiter: Limiter, flows: u64, goodput: f64, bulk: f64, p99: f64| {
            json!({"limiter": limiter.label(), "congestion": "cubic", "flows": flows,
                   "offloads": true, "path": "40 ms", "rate_bps": 20_000_000,
                   "goodput_ratio": goodput, "bulk_added_p50_ms": bulk, "probe_p99_ms": p99})
        };
        let report = json!({"kernel": "6.12", "rows": [
            row(Limiter::Cake, 1, 0.95, 5.0, 3.0),
            row(Limiter::Cake, 4, 0.95, 5.0, 3.0),
            row(Limiter::ShapeEdt, 1, 0.94, 7.9, 4.9),
            row(Limiter::ShapeEdt, 4, 0.92, 8.1, 5.1),
        ]});
        let (held, broken) = check(&report, Limiter::ShapeEdt);
        assert_eq!(held.len(), 3, "{held:?}");
        assert_eq!(broken.len(), 3, "{broken:?}");
        assert!(broken.iter().all(|line| line.contains("4 cubic")));
        let (_, missing) = check(&report, Limiter::Shape);
        assert_eq!(missing.len(), 2, "{missing:?}");
    }
}
