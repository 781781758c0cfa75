//! Flow isolation (issue 50): flows sharing one shape class on the router (matching
//! everything toward the server), shaper's `--fair flow` (the default) beside `--fair none`
//! (one queue) and tbf in the class's place (a 200 ms buffer), on the µs lab
//! and over a 40 ms path. Cells: Cubic and BBR beside an unresponsive UDP flow at 1.5× and
//! 10× the rate, Cubic beside BBR, 4 Cubic flows at 10 Mbit/s, 16 and 64 at 100 Mbit/s,
//! and (`--fair src`) eight flows of one host beside one of another. CAKE and htb +
//! fq_codel need Debian's kernels (`cargo xtask bench --vm`); they are not on the lab's.

use crate::senders::{lab, FORTY_MS_PATH};
use anyhow::{Context as _, Result};
use serde_json::{json, Value};
use shaper_tests::{
    fairness::{add_second_client, run_cell, tcp, udp_flood, Shares, SECOND_CLIENT_V4},
    shape_to_server, Lab, Tcp, Udp, ROUTER_TO_CLIENT, ROUTER_TO_SERVER,
};
use std::time::Duration;

/// The limiters, as the report names them.
const FAIR: &str = "shaper shape --fair flow (the default)";
const FAIR_SRC: &str = "shaper shape --fair src";
const ONE_QUEUE: &str = "shaper shape --fair none";
const TBF: &str = "tbf, 200 ms buffer";

/// What shares one class in a cell.
#[derive(Clone, Copy)]
enum Traffic {
    /// One TCP flow (`congestion`) beside UDP offered at `times` the rate.
    TcpBesideUdp {
        congestion: &'static str,
        times: f64,
    },
    CubicBesideBbr,
    /// `n` Cubic flows.
    Cubics(usize),
    /// Eight Cubic flows of one host beside one of another.
    Hosts,
}

impl Traffic {
    fn name(self) -> String {
        match self {
            Traffic::TcpBesideUdp { congestion, times } => {
                format!("{congestion} beside UDP at {times}x")
            }
            Traffic::CubicBesideBbr => "cubic beside bbr".into(),
            Traffic::Cubics(n) => format!("{n} cubic"),
            Traffic::Hosts => "8 cubic of host A, 1 of host B".into(),
        }
    }
}

#[derive(Clone, Copy)]
struct Cell {
    rate: &'static str,
    rate_bps: f64,
    one_way: Option<Duration>,
    traffic: Traffic,
}

pub struct FairnessEffort {
    seconds: u32,
    steady_from: f64,
    cells: Vec<Cell>,
    /// Whether shaper's fair rows are held to the targets (the full run).
    targets: bool,
}

const fn cell(
    rate: &'static str,
    rate_bps: f64,
    one_way: Option<Duration>,
    traffic: Traffic,
) -> Cell {
    Cell {
        rate,
        rate_bps,
        one_way,
        traffic,
    }
}

pub fn effort(quick: bool) -> FairnessEffort {
    let flood = |congestion, times| Traffic::TcpBesideUdp { congestion, times };
    if quick {
        // CI's smoke run: one isolation cell, briefly.
        return FairnessEffort {
            seconds: 5,
            steady_from: 2.0,
            cells: vec![cell("10mbit", 10e6, None, flood("cubic", 2.0))],
            targets: false,
        };
    }
    let mut cells = Vec::new();
    for one_way in [None, Some(FORTY_MS_PATH)] {
        for congestion in ["cubic", "bbr"] {
            for times in [1.5, 10.0] {
                cells.push(cell("10mbit", 10e6, one_way, flood(congestion, times)));
            }
        }
        cells.push(cell("10mbit", 10e6, one_way, Traffic::CubicBesideBbr));
        cells.push(cell("10mbit", 10e6, one_way, Traffic::Cubics(4)));
    }
    cells.push(cell("100mbit", 100e6, None, Traffic::Cubics(16)));
    cells.push(cell("100mbit", 100e6, None, Traffic::Cubics(64)));
    cells.push(cell("10mbit", 10e6, None, Traffic::Hosts));
    FairnessEffort {
        seconds: 30,
        steady_from: 10.0,
        cells,
        targets: true,
    }
}

impl FairnessEffort {
    /// Keeps only the cells whose traffic's name contains `text` (`--rows`); none is an
    /// error.
    pub fn only_cells(&mut self, text: &str) -> Result<()> {
        self.cells.retain(|cell| cell.traffic.name().contains(text));
        if self.cells.is_empty() {
            anyhow::bail!("--rows {text}: no fairness cell's traffic contains it");
        }
        Ok(())
    }
}

/// The limiters a cell runs under.
fn limiters(traffic: Traffic) -> &'static [&'static str] {
    match traffic {
        Traffic::Hosts => &[FAIR_SRC, FAIR, TBF],
        _ => &[FAIR, ONE_QUEUE, TBF],
    }
}

fn configure(lab: &Lab, limiter: &str, rate: &str) -> Result<()> {
    if limiter == TBF {
        let args = [
            "qdisc", "replace", "dev", "r1", "root", "tbf", "rate", rate, "burst", "128k",
            "latency", "200ms",
        ];
        let out = lab.router.run("tc", &args)?;
        anyhow::ensure!(out.status.success(), "tbf on r1: {out:?}");
        return Ok(());
    }
    let fair = match limiter {
        FAIR_SRC => "src",
        ONE_QUEUE => "none",
        _ => "flow",
    };
    let options = [&shape_to_server(rate)[..], &["--fair", fair]].concat();
    lab.router.attach("r1", &[])?;
    lab.router.class_add("bulk", "r1", &options)?;
    Ok(())
}

/// Every row of the section: one per cell and limiter. A held row outside its targets
/// is run twice more, each in a fresh lab, and the median run by its key figure
/// ([`key_figure`]) is the row, with the three figures in `runs` (as `fairness.rs`
/// judges its cells: one event now and then costs a 20 s window a few percent).
pub fn fairness(effort: &FairnessEffort) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for &cell in &effort.cells {
        for &limiter in limiters(cell.traffic) {
            let first = measure(effort, cell, limiter)?;
            if first["held"] != true || broken(&first).is_none() {
                rows.push(first);
                continue;
            }
            let mut runs = vec![
                first,
                measure(effort, cell, limiter)?,
                measure(effort, cell, limiter)?,
            ];
            let figures: Vec<f64> = runs.iter().map(key_figure).collect();
            runs.sort_by(|a, b| key_figure(a).total_cmp(&key_figure(b)));
            let mut median = runs.swap_remove(1);
            median["runs"] = json!(figures);
            rows.push(median);
        }
    }
    Ok(rows)
}

/// One run of `cell` under `limiter` in a fresh lab: its row.
fn measure(effort: &FairnessEffort, cell: Cell, limiter: &str) -> Result<Value> {
    let mut lab = lab(cell.one_way)?;
    configure(&lab, limiter, cell.rate)?;
    let shares = run(&mut lab, effort, cell)?;
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    println!(
        "{limiter}, {} at {} over {base_rtt_ms:.0} ms: {shares}",
        cell.traffic.name(),
        cell.rate
    );
    Ok(json!({
        "limiter": limiter,
        "rate": cell.rate,
        "base_rtt_ms": base_rtt_ms,
        "traffic": cell.traffic.name(),
        "tcp": shares.tcp,
        "udp": shares.udp,
        "total": shares.total(),
        "jain": shares.jain(),
        "rtt_over_base_ms": (shares.worst_rtt_ms() - base_rtt_ms).max(0.0),
        "held": effort.targets && held(limiter, cell.traffic),
    }))
}

/// The figure a row's runs are ordered by: host B's share in the hosts cell, the least
/// TCP share where TCP shares with UDP or BBR, else the flows' total.
fn key_figure(row: &Value) -> f64 {
    let traffic = row["traffic"].as_str().unwrap_or_default();
    let tcp = floats(&row["tcp"]);
    if traffic.starts_with("8 cubic") {
        tcp.last().copied().unwrap_or(0.0)
    } else if traffic.contains("beside") {
        tcp.iter().copied().fold(f64::INFINITY, f64::min)
    } else {
        row["total"].as_f64().unwrap_or(0.0)
    }
}

/// Whether a row is held to the targets: shaper's fair rows, but in the hosts
/// cell only `--fair src`'s (fair by flow, host B's one flow gets a ninth by design).
fn held(limiter: &str, traffic: Traffic) -> bool {
    match traffic {
        Traffic::Hosts => limiter == FAIR_SRC,
        _ => limiter == FAIR || limiter == FAIR_SRC,
    }
}

fn run(lab: &mut Lab, effort: &FairnessEffort, cell: Cell) -> Result<Shares> {
    let seconds = effort.seconds;
    let from = Duration::from_secs_f64(effort.steady_from);
    let cubic = tcp("cubic", seconds);
    match cell.traffic {
        Traffic::TcpBesideUdp { congestion, times } => {
            let offered: &'static str =
                Box::leak(format!("{}", (cell.rate_bps * times) as u64).into_boxed_str());
            let flood: Udp = udp_flood(offered, seconds);
            run_cell(
                lab,
                cell.rate_bps,
                &[&tcp(congestion, seconds)],
                &[&flood],
                from,
            )
        }
        Traffic::CubicBesideBbr => run_cell(
            lab,
            cell.rate_bps,
            &[&cubic, &tcp("bbr", seconds)],
            &[],
            from,
        ),
        Traffic::Cubics(n) => {
            let flows: Vec<&Tcp> = std::iter::repeat_n(&cubic, n).collect();
            run_cell(lab, cell.rate_bps, &flows, &[], from)
        }
        Traffic::Hosts => {
            add_second_client(lab)?;
            let single = Tcp {
                bind: Some(SECOND_CLIENT_V4),
                ..tcp("cubic", seconds)
            };
            let flows: Vec<&Tcp> = std::iter::repeat_n(&cubic, 8).chain([&single]).collect();
            run_cell(lab, cell.rate_bps, &flows, &[], from)
        }
    }
}

/// A JSON array of shares as a table cell: "0.470 / 0.510".
fn share_list(value: &Value) -> String {
    floats(value)
        .iter()
        .map(|v| format!("{v:.3}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// A JSON array's numbers.
fn floats(value: &Value) -> Vec<f64> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect()
}

/// The targets for a held row, or what breaks them.
fn broken(row: &Value) -> Option<String> {
    let traffic = row["traffic"].as_str().unwrap_or_default();
    let (tcp, udp) = (floats(&row["tcp"]), floats(&row["udp"]));
    let total = row["total"].as_f64().unwrap_or(0.0);
    let jain = row["jain"].as_f64().unwrap_or(0.0);
    let fail = |what: String| Some(format!("fairness: {traffic}: {what}"));
    if traffic.contains("beside UDP") {
        let (t, u) = (tcp.first().copied()?, udp.first().copied()?);
        if t < 0.45 || u > 0.55 || total < 0.95 {
            return fail(format!(
                "TCP {t:.3} (≥ 0.45), UDP {u:.3} (≤ 0.55), together {total:.3} (≥ 0.95)"
            ));
        }
    } else if traffic == "cubic beside bbr" {
        if tcp.iter().any(|&share| share < 0.40) {
            return fail(format!("{tcp:?}: each ≥ 0.40"));
        }
    } else if traffic.starts_with("8 cubic") {
        let single = tcp.last().copied()?;
        if single < 0.45 {
            return fail(format!("host B {single:.3} (≥ 0.45)"));
        }
    } else {
        let least = match tcp.len() {
            4 => 0.98,
            16 => 0.97,
            _ => 0.95,
        };
        if jain < least || total < 0.95 {
            return fail(format!(
                "Jain {jain:.3} (≥ {least}), together {total:.3} (≥ 0.95)"
            ));
        }
    }
    None
}

pub fn markdown(report: &Value) -> String {
    let mut out = String::from(
        "\n## Fairness: flows sharing one shape class\n\nOne class on the router matching everything toward the server; TCP: each flow's goodput over the rate, UDP (an unresponsive sender at 1.5× or 10× the rate): its L2 rate received over the rate; Jain's index of the TCP flows; the worst TCP flow's mean RTT over the path's base. Held in the full run (column *held*; a row outside is run twice more and the median run by its key figure shown, with the three), shaper's fair rows: TCP beside UDP ≥ 0.45 with UDP ≤ 0.55 and together ≥ 0.95; Cubic and BBR each ≥ 0.40; Jain ≥ 0.98 / 0.97 / 0.95 for 4 / 16 / 64 Cubic flows with together ≥ 0.95; under `--fair src`, host B's one flow ≥ 0.45 beside host A's eight. `cargo xtask test` asserts one representative cell of each (`fairness.rs`); CAKE and htb + fq_codel beside shaper: the peers section.\n\n| limiter | rate | base RTT ms | traffic | TCP | UDP | together | Jain | RTT over base ms | held |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in report["fairness"].as_array().into_iter().flatten() {
        let verdict = match (row["held"] == true, broken(row).is_some()) {
            (false, _) => "",
            (true, true) => "**no**",
            (true, false) => "yes",
        };
        // A row run three times says so, with the three key figures.
        let held = match row["runs"].as_array() {
            Some(runs) => format!("{verdict} (median of {})", share_list(&json!(runs))),
            None => verdict.to_string(),
        };
        out.push_str(&format!(
            "| {} | {} | {:.0} | {} | {} | {} | {:.3} | {:.3} | {:.1} | {held} |\n",
            row["limiter"].as_str().unwrap_or_default(),
            row["rate"].as_str().unwrap_or_default(),
            row["base_rtt_ms"].as_f64().unwrap_or(0.0),
            row["traffic"].as_str().unwrap_or_default(),
            share_list(&row["tcp"]),
            share_list(&row["udp"]),
            row["total"].as_f64().unwrap_or(0.0),
            row["jain"].as_f64().unwrap_or(0.0),
            row["rtt_over_base_ms"].as_f64().unwrap_or(0.0),
        ));
    }
    out
}

/// The section's rows that break their targets, and a section with no rows.
pub fn check(report: &Value) -> Vec<String> {
    let rows = report["fairness"].as_array().cloned().unwrap_or_default();
    let mut problems = Vec::new();
    if rows.is_empty() {
        problems.push("fairness: no rows".to_string());
    }
    for row in rows.iter().filter(|row| row["held"] == true) {
        problems.extend(broken(row));
    }
    problems
}

/// Flow isolation beside the qdiscs that give it, in Debian's kernels (`bench --vm`, the
/// peers section): CAKE with its defaults (`triple-isolate`, `rtt 100ms`), CAKE with `rtt`
/// at the path's RTT, and htb + fq_codel, each in the router's egress toward the server
/// in place of shaper's class, at 10 Mbit/s on the µs path and over 40 ms (netem).
pub const CAKE: &str = "cake";
pub const CAKE_RTT: &str = "cake, rtt of the path";
pub const HTB_FQ_CODEL: &str = "htb + fq_codel";
/// shaper's row beside them: one shape class, its defaults (fair by flow, HTB + CoDel).
pub const SHAPER: &str = "shaper shape";
/// The same with the router's ingress splitting aggregates (`attach --split-aggregates`),
/// what docs/GUIDE.md asks of a router whose senders use TSO: CAKE splits them itself
/// (`split-gso`, on by default below 1 Gbit/s), HTB's leaf and fq_codel do not.
pub const SHAPER_SPLIT: &str = "shaper shape, aggregates split";
/// Whether a limiter is one of shaper's rows.
fn is_shaper(limiter: &str) -> bool {
    limiter == SHAPER || limiter == SHAPER_SPLIT
}
/// Every isolation row's limiter, in the order a cell runs them.
const PEER_LIMITERS: [&str; 5] = [SHAPER, SHAPER_SPLIT, CAKE, CAKE_RTT, HTB_FQ_CODEL];
/// Each isolation row's run (s).
pub const PEER_SECONDS: u32 = 30;
const PEER_RATE: &str = "10mbit";
const PEER_RATE_BPS: f64 = 10e6;

/// The isolation cells the guests run: TCP beside UDP at 2x, Cubic beside BBR, four
/// Cubic flows, on the µs path and over 40 ms.
fn peer_cells() -> Vec<(Option<Duration>, Traffic)> {
    let flood = |congestion| Traffic::TcpBesideUdp {
        congestion,
        times: 2.0,
    };
    let mut cells = Vec::new();
    for one_way in [None, Some(FORTY_MS_PATH)] {
        for traffic in [
            flood("cubic"),
            flood("bbr"),
            Traffic::CubicBesideBbr,
            Traffic::Cubics(4),
        ] {
            cells.push((one_way, traffic));
        }
    }
    cells
}

fn path_name(one_way: Option<Duration>) -> String {
    match one_way {
        Some(delay) => format!("{} ms", 2 * delay.as_millis()),
        None => "µs".into(),
    }
}

/// What a peer row sets up on the router's egress toward the server, as tc or shaper
/// spell it.
fn peer_configuration(limiter: &str, one_way: Option<Duration>) -> String {
    let rtt = match one_way {
        Some(delay) => format!("rtt {}ms", 2 * delay.as_millis()),
        // CAKE's keyword for 100 µs, the closest it has to the lab's µs path.
        None => "datacentre".into(),
    };
    match limiter {
        CAKE => format!("tc qdisc replace dev {ROUTER_TO_SERVER} root cake bandwidth {PEER_RATE}"),
        CAKE_RTT => format!(
            "tc qdisc replace dev {ROUTER_TO_SERVER} root cake bandwidth {PEER_RATE} {rtt}"
        ),
        HTB_FQ_CODEL => crate::latency::Limiter::HtbFqCodel
            .commands(PEER_RATE_BPS as u64)
            .iter()
            .map(|words| words.join(" "))
            .collect::<Vec<_>>()
            .join("; "),
        SHAPER_SPLIT => format!(
            "shaper attach {ROUTER_TO_CLIENT} --direction ingress --split-aggregates; {}",
            peer_configuration(SHAPER, one_way)
        ),
        _ => format!(
            "shaper attach {ROUTER_TO_SERVER}; shaper class add bulk --dev {ROUTER_TO_SERVER} --rate {PEER_RATE} --action shape (fair by flow, burst 128k, CoDel 5/100 ms; forwarded aggregates split on the way out; HTB leaf one bfifo)"
        ),
    }
}

fn install_peer(lab: &Lab, limiter: &str, one_way: Option<Duration>) -> Result<()> {
    if is_shaper(limiter) {
        // The default path (a peers row before may have asked for EDT).
        std::env::set_var("SHAPER_SHAPE_BACKEND", "htb");
        if limiter == SHAPER_SPLIT {
            lab.router.attach(
                ROUTER_TO_CLIENT,
                &["--direction", "ingress", "--split-aggregates"],
            )?;
        }
        lab.router.attach(ROUTER_TO_SERVER, &[])?;
        lab.router
            .class_add("bulk", ROUTER_TO_SERVER, &shape_to_server(PEER_RATE))?;
        return Ok(());
    }
    for line in peer_configuration(limiter, one_way).split("; ") {
        let words: Vec<&str> = line.split_whitespace().collect();
        let out = lab.router.run(words[0], &words[1..])?;
        anyhow::ensure!(out.status.success(), "{line}: {out:?}");
    }
    Ok(())
}

/// A peer row's name, which `--rows TEXT` matches.
fn peer_setup(limiter: &str, one_way: Option<Duration>, traffic: Traffic) -> String {
    format!(
        "isolation: {}, {}, {limiter}",
        traffic.name(),
        path_name(one_way)
    )
}

/// Every isolation row's setup (what `--rows TEXT` is matched against).
pub fn peer_rows() -> Vec<String> {
    peer_cells()
        .into_iter()
        .flat_map(|(one_way, traffic)| {
            PEER_LIMITERS.map(|limiter| peer_setup(limiter, one_way, traffic))
        })
        .collect()
}

/// Whether `--rows TEXT` names any isolation row.
pub fn any_peer_row(text: &str) -> bool {
    peer_rows().iter().any(|setup| setup.contains(text))
}

/// Runs the isolation rows (those whose setup contains `rows`, if given) in this kernel,
/// each limiter of a cell one after the other; one JSON row each.
pub fn beside_peers(rows: Option<&str>) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    let effort = FairnessEffort {
        seconds: PEER_SECONDS,
        steady_from: 10.0,
        cells: Vec::new(),
        targets: false,
    };
    for (one_way, traffic) in peer_cells() {
        for limiter in PEER_LIMITERS {
            let setup = peer_setup(limiter, one_way, traffic);
            if rows.is_some_and(|text| !setup.contains(text)) {
                continue;
            }
            if limiter == SHAPER_SPLIT && !shaper::qdisc::ifb_redirect_works() {
                // shaper refuses to split there (its ifb would drop what it is handed).
                println!("{setup:64} not run: this kernel's ifb drops redirected packets");
                continue;
            }
            let mut lab = match one_way {
                Some(delay) => Lab::with_netem(delay)?,
                None => Lab::new()?,
            };
            install_peer(&lab, limiter, one_way).with_context(|| setup.clone())?;
            let cell = cell(PEER_RATE, PEER_RATE_BPS, None, traffic);
            let shares = run(&mut lab, &effort, cell).with_context(|| setup.clone())?;
            let base_rtt_ms = one_way.map_or(0.0, |d| 2.0 * d.as_secs_f64() * 1e3);
            // Where shaper's losses were: its class queue, a flow's cap, or the leaf.
            let drops = if is_shaper(limiter) {
                let row = lab.router.stats_row("bulk")?;
                json!({
                    "queue": row["queue_dropped_packets"],
                    "fair": row["fair_dropped_packets"],
                    "leaf": row["leaf_dropped_packets"],
                    "leaf_marked": row["leaf_marked_packets"],
                    "mean_packet_bytes": row["passed_bytes"].as_u64().unwrap_or(0)
                        / row["passed_packets"].as_u64().unwrap_or(0).max(1),
                })
            } else {
                Value::Null
            };
            println!("{setup:64} {shares}; shaper's drops {drops}");
            out.push(json!({
                "setup": setup,
                "limiter": limiter,
                "configuration": peer_configuration(limiter, one_way),
                "path": path_name(one_way),
                "traffic": traffic.name(),
                "tcp": shares.tcp,
                "udp": shares.udp,
                "total": shares.total(),
                "jain": shares.jain(),
                "rtt_over_base_ms": (shares.worst_rtt_ms() - base_rtt_ms).max(0.0),
                "shaper_drops": drops,
            }));
        }
    }
    Ok(out)
}

/// The isolation rows' table (markdown).
pub fn peers_table(rows: &[Value]) -> String {
    let mut out = String::from(
        "\n| path | traffic | limiter | TCP | UDP | together | Jain | worst TCP RTT over base ms | shaper's drops: class queue / flow caps / leaf; mean packet bytes | configuration |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let drops = &row["shaper_drops"];
        let drops = if drops.is_object() {
            format!(
                "{} / {} / {}; {}",
                drops["queue"], drops["fair"], drops["leaf"], drops["mean_packet_bytes"]
            )
        } else {
            String::new()
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.1} | {drops} | `{}` |\n",
            row["path"].as_str().unwrap_or_default(),
            row["traffic"].as_str().unwrap_or_default(),
            row["limiter"].as_str().unwrap_or_default(),
            share_list(&row["tcp"]),
            share_list(&row["udp"]),
            row["total"].as_f64().unwrap_or(0.0),
            row["jain"].as_f64().unwrap_or(0.0),
            row["rtt_over_base_ms"].as_f64().unwrap_or(0.0),
            row["configuration"].as_str().unwrap_or_default(),
        ));
    }
    out
}

/// Issue 50's comparison in one kernel's rows: in every cell the smallest TCP share of
/// shaper's row `shaper` within 0.03 of `peer`'s, and its worst TCP RTT no more than
/// `peer`'s + 3 ms. Each line says what held or broke (a cell without both rows is
/// broken).
pub fn check_beside(
    rows: &[Value],
    kernel: &str,
    (shaper, peer): (&str, &str),
) -> (Vec<String>, Vec<String>) {
    let (mut held, mut broken) = (Vec::new(), Vec::new());
    let least = |row: &Value| floats(&row["tcp"]).into_iter().fold(f64::MAX, f64::min);
    let rtt = |row: &Value| row["rtt_over_base_ms"].as_f64().unwrap_or(f64::NAN);
    for (one_way, traffic) in peer_cells() {
        let find = |limiter: &str| {
            rows.iter().find(|row| {
                row["limiter"] == limiter
                    && row["path"] == path_name(one_way).as_str()
                    && row["traffic"] == traffic.name().as_str()
            })
        };
        let cell = format!("{kernel}, {}, {}", traffic.name(), path_name(one_way));
        let (Some(ours), Some(theirs)) = (find(shaper), find(peer)) else {
            broken.push(format!("{cell}: a row is missing"));
            continue;
        };
        for (what, a, b, ok) in [
            (
                "smallest TCP share",
                least(ours),
                least(theirs),
                least(ours) >= least(theirs) - 0.03,
            ),
            (
                "worst TCP RTT over base ms",
                rtt(ours),
                rtt(theirs),
                rtt(ours) <= rtt(theirs) + 3.0,
            ),
        ] {
            let line = format!("{cell}, {what}: {shaper} {a:.3}, {peer} {b:.3}");
            if ok {
                held.push(line);
            } else {
                broken.push(line);
            }
        }
    }
    (held, broken)
}

/// Rows a sane full run could report (the driver's own tests).
#[cfg(test)]
pub fn sane_rows() -> Vec<Value> {
    vec![
        json!({"limiter": FAIR, "rate": "10mbit", "base_rtt_ms": 0.0, "traffic": "cubic beside UDP at 10x",
            "tcp": [0.47], "udp": [0.51], "total": 0.98, "jain": 1.0, "rtt_over_base_ms": 12.0, "held": true}),
        json!({"limiter": FAIR, "rate": "10mbit", "base_rtt_ms": 0.0, "traffic": "4 cubic",
            "tcp": [0.24, 0.24, 0.24, 0.24], "udp": [], "total": 0.96, "jain": 1.0, "rtt_over_base_ms": 15.0, "held": true}),
        json!({"limiter": TBF, "rate": "10mbit", "base_rtt_ms": 0.0, "traffic": "cubic beside UDP at 10x",
            "tcp": [0.01], "udp": [0.99], "total": 1.0, "jain": 1.0, "rtt_over_base_ms": 180.0, "held": false}),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hosts cell holds `--fair src` to host B's share, not fair by flow (a ninth by
    /// design); the other cells hold both fair rows; tbf and one queue never.
    #[test]
    fn only_the_fair_rows_that_can_meet_a_target_are_held() {
        assert!(held(FAIR_SRC, Traffic::Hosts));
        assert!(!held(FAIR, Traffic::Hosts));
        assert!(held(FAIR, Traffic::Cubics(4)));
        assert!(!held(TBF, Traffic::Cubics(4)));
        assert!(!held(ONE_QUEUE, Traffic::CubicBesideBbr));
    }

    #[test]
    fn held_rows_are_checked_and_others_are_not() {
        let report = json!({ "fairness": sane_rows() });
        assert!(check(&report).is_empty(), "{:?}", check(&report));
        let mut starved = report.clone();
        starved["fairness"][0]["tcp"] = json!([0.30]);
        assert_eq!(check(&starved).len(), 1);
        let mut unequal = report.clone();
        unequal["fairness"][1]["jain"] = json!(0.9);
        assert_eq!(check(&unequal).len(), 1);
        assert_eq!(check(&json!({"fairness": []})), ["fairness: no rows"]);
    }

    /// Runs are ordered by host B's share, the least TCP share beside UDP or BBR, or the
    /// flows' total; a row run three times prints its three figures beside its verdict.
    #[test]
    fn a_row_run_three_times_is_ordered_by_its_key_figure_and_says_so() {
        let rows = sane_rows();
        assert_eq!(key_figure(&rows[0]), 0.47);
        assert_eq!(key_figure(&rows[1]), 0.96);
        let bbr = json!({"traffic": "cubic beside bbr", "tcp": [0.50, 0.44], "total": 0.94});
        assert_eq!(key_figure(&bbr), 0.44);
        let hosts = json!({"traffic": "8 cubic of host A, 1 of host B",
            "tcp": [0.06, 0.06, 0.06, 0.06, 0.06, 0.06, 0.06, 0.06, 0.46], "total": 0.94});
        assert_eq!(key_figure(&hosts), 0.46);
        let mut median = rows[0].clone();
        median["runs"] = json!([0.44, 0.47, 0.48]);
        let text = markdown(&json!({ "fairness": [median] }));
        assert!(
            text.contains("| yes (median of 0.440 / 0.470 / 0.480) |"),
            "{text}"
        );
    }

    #[test]
    fn rows_narrow_the_cells_to_those_whose_traffic_names_it() {
        let mut effort = effort(false);
        effort.only_cells("host B").unwrap();
        assert_eq!(effort.cells.len(), 1);
        assert_eq!(
            effort.cells[0].traffic.name(),
            "8 cubic of host A, 1 of host B"
        );
        let mut effort = self::effort(false);
        effort.only_cells("cubic beside bbr").unwrap();
        assert_eq!(effort.cells.len(), 2, "the µs lab's and the 40 ms path's");
        assert!(self::effort(false).only_cells("no such traffic").is_err());
    }

    /// Every isolation cell with a shaper row and a CAKE row: `tcp` shares and RTT each.
    fn peer_rows(ours: (&[f64], f64), cake: (&[f64], f64)) -> Vec<Value> {
        let mut rows = Vec::new();
        for (one_way, traffic) in peer_cells() {
            for (limiter, (tcp, rtt)) in [(SHAPER, ours), (CAKE, cake)] {
                rows.push(json!({"limiter": limiter, "path": path_name(one_way),
                    "traffic": traffic.name(), "tcp": tcp, "rtt_over_base_ms": rtt}));
            }
        }
        rows
    }

    #[test]
    fn isolation_is_held_within_cake_s_share_less_0_03_and_rtt_plus_3_ms() {
        let cells = peer_cells().len();
        let (held, broken) = check_beside(
            &peer_rows((&[0.46], 8.0), (&[0.48], 6.0)),
            "k",
            (SHAPER, CAKE),
        );
        assert_eq!((held.len(), broken.len()), (2 * cells, 0), "{broken:?}");
        // The smallest of a cell's TCP shares is the one compared.
        let (_, broken) = check_beside(
            &peer_rows((&[0.50, 0.44], 5.0), (&[0.48, 0.48], 5.0)),
            "k",
            (SHAPER, CAKE),
        );
        assert_eq!(broken.len(), cells, "{broken:?}");
        assert!(broken[0].contains("smallest TCP share: shaper shape 0.440, cake 0.480"));
        // 3.5 ms more RTT than CAKE is beyond.
        let (_, broken) = check_beside(
            &peer_rows((&[0.48], 9.5), (&[0.48], 6.0)),
            "k",
            (SHAPER, CAKE),
        );
        assert_eq!(broken.len(), cells, "{broken:?}");
        // A cell without CAKE's row is broken, not skipped.
        let (_, broken) = check_beside(
            &peer_rows((&[0.48], 5.0), (&[0.48], 5.0)),
            "k",
            (SHAPER, HTB_FQ_CODEL),
        );
        assert_eq!(broken.len(), cells);
        assert!(broken[0].ends_with("a row is missing"));
    }
}
