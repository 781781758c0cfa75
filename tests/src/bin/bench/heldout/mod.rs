//! Held-out cells on equal terms (issue 52), in Debian's kernels (`cargo xtask bench --vm
//! --held-out`): cells no target was ever set on, each under shaper with its defaults,
//! shaper with the 32 KiB burst the peers' own shapers use (tbf's in this bench, HTB's
//! order at these rates), CAKE with its defaults (`rtt 100ms`) and CAKE with `rtt` set to
//! the path's RTT; plus the target cell (20 Mbit/s, 40 ms, one Cubic flow) under the same
//! four. Every run is a fresh lab; each cell runs [`RUNS`] times in interleaved passes
//! (pass, then cell, then limiter), and a row is the run with the median goodput, the
//! range of every figure over the runs beside it. Each row carries its configuration as
//! the kernel reads it back after setup. Where shaper's row is worse than a CAKE row's by
//! more than a figure's margin, the report lists it.

mod report;

use crate::peers::bottleneck_drops;
use anyhow::{Context as _, Result};
pub use report::table;
use report::{brief, median_run};
use serde_json::{json, Value};
use shaper_tests::{
    fairness::{jain, tcp, udp_flood},
    latency::{idle_rtt_ms, percentile, LatencyProbe, PROBE_HZ},
    shape_to_server,
    web::{short_uploads, ShortUploads},
    Lab, Tcp, Udp, ROUTER_TO_SERVER, SERVER_V4,
};
use std::time::Duration;

/// Each run (s), and where its steady state starts.
const SECONDS: u32 = 20;
const STEADY_FROM: f64 = 8.0;
/// Runs of every cell under every limiter.
pub const RUNS: usize = 3;
/// The web-like mix's short flows: a 64 KiB upload every 200 ms (about 2.6 Mbit/s
/// offered), each on a new connection, beside one bulk Cubic flow.
const WEB: ShortUploads = ShortUploads {
    bytes: 64 * 1024,
    every: Duration::from_millis(200),
    seconds: SECONDS,
};
/// What every held-out row's name starts with (`bench --vm --rows`).
pub const PREFIX: &str = "held-out: ";

/// The four limiters of every cell.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Peer {
    Shaper,
    ShaperBurst32k,
    Cake,
    CakePathRtt,
}

impl Peer {
    const ALL: [Peer; 4] = [
        Peer::Shaper,
        Peer::ShaperBurst32k,
        Peer::Cake,
        Peer::CakePathRtt,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Peer::Shaper => "shaper shape (its defaults)",
            Peer::ShaperBurst32k => "shaper shape --burst 32k",
            Peer::Cake => "cake (its defaults)",
            Peer::CakePathRtt => "cake, rtt of the path",
        }
    }

    fn is_shaper(self) -> bool {
        matches!(self, Peer::Shaper | Peer::ShaperBurst32k)
    }

    /// The commands that set it up on the router's egress toward the server.
    fn commands(self, cell: &Cell) -> Vec<String> {
        let rate = cell.rate();
        let shaper = |extra: &str| {
            vec![
                format!("shaper attach {ROUTER_TO_SERVER}"),
                format!(
                    "shaper class add bulk --dev {ROUTER_TO_SERVER} {}{extra}",
                    shape_to_server(&rate).join(" ")
                ),
            ]
        };
        let cake = format!("tc qdisc replace dev {ROUTER_TO_SERVER} root cake bandwidth {rate}");
        match self {
            Peer::Shaper => shaper(""),
            Peer::ShaperBurst32k => shaper(" --burst 32k"),
            Peer::Cake => vec![cake],
            Peer::CakePathRtt => vec![match cell.one_way {
                Some(delay) => format!("{cake} rtt {}ms", 2 * delay.as_millis()),
                // CAKE's keyword for 100 µs, the closest it has to the µs lab.
                None => format!("{cake} datacentre"),
            }],
        }
    }
}

/// What shares the class in a cell.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// `n` flows of one congestion control, each its own connection.
    Flows {
        n: usize,
        congestion: &'static str,
    },
    CubicBesideBbr,
    /// One Cubic flow beside unresponsive UDP offered at `times` the rate.
    CubicBesideUdp {
        times: u32,
    },
    /// One bulk Cubic flow beside [`WEB`]'s short uploads.
    WebMix,
}

impl Load {
    fn name(self) -> String {
        match self {
            Load::Flows { n, congestion } => format!("{n} {congestion}"),
            Load::CubicBesideBbr => "cubic beside bbr".into(),
            Load::CubicBesideUdp { times } => format!("cubic beside UDP at {times}x"),
            Load::WebMix => "1 cubic beside 64 KiB uploads, 5 a second".into(),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Cell {
    mbit: u64,
    /// netem's delay each way (None: the µs lab).
    one_way: Option<Duration>,
    load: Load,
    /// The cell the targets were set on, run again on equal terms (not held out).
    target: bool,
}

impl Cell {
    fn rate(&self) -> String {
        format!("{}mbit", self.mbit)
    }

    fn rate_bps(&self) -> f64 {
        self.mbit as f64 * 1e6
    }

    fn path(&self) -> String {
        match self.one_way {
            Some(delay) => format!("{} ms", 2 * delay.as_millis()),
            None => "µs".into(),
        }
    }

    fn name(&self) -> String {
        format!(
            "{} Mbit/s, {}, {}",
            self.mbit,
            self.path(),
            self.load.name()
        )
    }

    fn setup(&self, peer: Peer) -> String {
        format!("{PREFIX}{}, {}", self.name(), peer.label())
    }

    /// The TCP flows and UDP floods it runs (short uploads apart).
    fn traffic(&self) -> (Vec<Tcp>, Vec<Udp>) {
        let flow = |congestion| Tcp {
            interval: 0.5,
            ..tcp(congestion, SECONDS)
        };
        match self.load {
            Load::Flows { n, congestion } => (vec![flow(congestion); n], vec![]),
            Load::CubicBesideBbr => (vec![flow("cubic"), flow("bbr")], vec![]),
            Load::CubicBesideUdp { times } => {
                let offered: &'static str =
                    Box::leak(format!("{}", self.mbit * u64::from(times) * 1_000_000).into());
                (vec![flow("cubic")], vec![udp_flood(offered, SECONDS)])
            }
            Load::WebMix => (vec![flow("cubic")], vec![]),
        }
    }
}

const fn cell(mbit: u64, one_way_ms: u64, load: Load) -> Cell {
    Cell {
        mbit,
        one_way: if one_way_ms == 0 {
            None
        } else {
            Some(Duration::from_millis(one_way_ms))
        },
        load,
        target: false,
    }
}

/// The cells: the target cell, then the held-out ones (rates, RTTs, flow counts, BBR,
/// mixes no target was set on); the 100 Mbit/s cells run only where the guest's path
/// carries that rate.
fn cells() -> Vec<Cell> {
    let flows = |n, congestion| Load::Flows { n, congestion };
    vec![
        Cell {
            target: true,
            ..cell(20, 20, flows(1, "cubic"))
        },
        cell(10, 0, flows(1, "cubic")),
        cell(10, 40, flows(4, "cubic")),
        cell(10, 20, flows(16, "cubic")),
        cell(10, 40, flows(1, "bbr")),
        cell(10, 0, flows(4, "bbr")),
        cell(10, 40, Load::CubicBesideBbr),
        cell(10, 20, Load::CubicBesideUdp { times: 10 }),
        cell(10, 20, Load::WebMix),
        cell(100, 0, flows(16, "cubic")),
        cell(100, 20, flows(1, "bbr")),
    ]
}

/// Every held-out row's name (what `--rows TEXT` is matched against).
pub fn row_names() -> Vec<String> {
    cells()
        .iter()
        .flat_map(|cell| Peer::ALL.map(|peer| cell.setup(peer)))
        .collect()
}

/// Whether `--rows TEXT` names any held-out row.
pub fn any_row(text: &str) -> bool {
    row_names().iter().any(|name| name.contains(text))
}

/// Runs the held-out rows (those whose setup contains `rows`, if given) in this kernel.
pub fn run(rows: Option<&str>) -> Result<Value> {
    let chosen: Vec<(Cell, Vec<Peer>)> = cells()
        .into_iter()
        .map(|cell| {
            let peers = Peer::ALL
                .into_iter()
                .filter(|&peer| rows.is_none_or(|text| cell.setup(peer).contains(text)))
                .collect();
            (cell, peers)
        })
        .filter(|(_, peers): &(Cell, Vec<Peer>)| !peers.is_empty())
        .collect();
    if chosen.is_empty() {
        return Ok(Value::Null);
    }
    // An emulated guest may not carry the fast cells' rate: measured once, unshaped.
    let fastest = chosen.iter().map(|(cell, _)| cell.mbit).max().unwrap_or(0);
    let carried_bps = if fastest > 20 {
        Lab::new()?.tcp(5)?
    } else {
        f64::NAN
    };
    let (mut measured, mut unmeasured) = (Vec::new(), Vec::new());
    for (cell, peers) in chosen {
        if cell.rate_bps() * 1.25 > carried_bps && cell.mbit > 20 {
            println!(
                "{:64} not measured: the path carries {:.0} Mbit/s unshaped",
                cell.name(),
                carried_bps / 1e6
            );
            unmeasured.push(json!({
                "cell": cell.name(),
                "why": format!("the guest's path carries {:.0} Mbit/s unshaped, under 1.25 × the rate", carried_bps / 1e6),
            }));
            continue;
        }
        measured.push((cell, peers));
    }
    let mut runs: Vec<Vec<Vec<Value>>> = measured
        .iter()
        .map(|(_, peers)| vec![Vec::new(); peers.len()])
        .collect();
    for _pass in 0..RUNS {
        for ((cell, peers), runs) in measured.iter().zip(&mut runs) {
            for (&peer, runs) in peers.iter().zip(runs.iter_mut()) {
                let figures = one_run(cell, peer).with_context(|| cell.setup(peer))?;
                println!("{:96} {}", cell.setup(peer), brief(&figures));
                runs.push(figures);
            }
        }
    }
    let rows: Vec<Value> = measured
        .iter()
        .zip(runs)
        .flat_map(|((cell, peers), runs)| {
            peers.iter().zip(runs).map(|(&peer, runs)| {
                let mut row = median_run(runs);
                row["setup"] = cell.setup(peer).into();
                row["cell"] = cell.name().into();
                row["target_cell"] = cell.target.into();
                row["limiter"] = peer.label().into();
                row["commands"] = peer.commands(cell).join("; ").into();
                row
            })
        })
        .collect();
    let report = json!({
        "run_s": SECONDS,
        "steady_from_s": STEADY_FROM,
        "runs": RUNS,
        "carried_unshaped_bps": carried_bps.is_finite().then_some(carried_bps),
        "rows": rows,
        "unmeasured": unmeasured,
    });
    println!("{}", table(&report));
    Ok(report)
}

/// One run of a cell under a limiter: a fresh lab, the limiter, its configuration read
/// back, the traffic beside a 20 Hz ping; figures over the steady state.
fn one_run(cell: &Cell, peer: Peer) -> Result<Value> {
    // netem in Debian's kernels; the lab's own has none, and a look there (shaper's rows
    // only: it has no CAKE either) goes through the delay line.
    let (mut lab, delay) = match cell.one_way {
        Some(one_way) => match Lab::with_netem(one_way) {
            Ok(lab) => (lab, "netem"),
            Err(_) => (Lab::with_delay(one_way)?, "delay line"),
        },
        None => (Lab::new()?, "none"),
    };
    install(&lab, cell, peer)?;
    let configuration = read_back(&lab, peer)?;
    let (tcp_flows, udp_floods) = cell.traffic();
    let from = STEADY_FROM;
    let mut figures = lab.through_delay_line(|lab| {
        let idle = idle_rtt_ms(&lab.client, SERVER_V4)?;
        let web_port = lab.port();
        let probe = LatencyProbe::start(&lab.client, SERVER_V4, PROBE_HZ)?;
        let web = matches!(cell.load, Load::WebMix)
            .then(|| short_uploads(&lab.client, &lab.server, SERVER_V4, web_port, WEB))
            .transpose()?;
        let tcp_refs: Vec<&Tcp> = tcp_flows.iter().collect();
        let udp_refs: Vec<&Udp> = udp_floods.iter().collect();
        let traffic = lab.mixed(&tcp_refs, &udp_refs);
        let samples = probe.finish()?;
        let transfers = web
            .map(|handle| handle.join().expect("the short uploads panicked"))
            .transpose()?;
        let (tcp_runs, udp_runs) = traffic?;
        let shares: Vec<f64> = tcp_runs
            .iter()
            .map(|run| run.steady_bps_from(from) / cell.rate_bps())
            .collect();
        let bulk_added: Vec<f64> = tcp_runs
            .iter()
            .flat_map(|run| &run.rtt_intervals)
            .filter(|(end, _)| *end > from)
            .map(|(_, ms)| (ms - idle).max(0.0))
            .collect();
        let udp: f64 = udp_runs
            .iter()
            .map(|run| run.l2_bps_between(from, f64::from(SECONDS)) / cell.rate_bps())
            .sum();
        let probe = samples.added_rtt(Duration::from_secs_f64(from), idle)?;
        let mut figures = json!({
            "idle_rtt_ms": idle,
            "goodput": shares.iter().sum::<f64>(),
            "tcp_shares": shares,
            "jain": jain(&shares),
            "bulk_rtt_p50_ms": percentile(&bulk_added, 50.0),
            "bulk_rtt_p99_ms": percentile(&bulk_added, 99.0),
            "probe_p99_ms": probe.p99_ms,
            "probes": probe.samples,
            "probes_lost": probe.lost,
        });
        if !udp_runs.is_empty() {
            figures["udp"] = udp.into();
        }
        if let Some(transfers) = transfers {
            let steady: Vec<_> = transfers.iter().filter(|t| t.started_s >= from).collect();
            let done: Vec<f64> = steady.iter().filter_map(|t| t.completion_ms).collect();
            // The uploads count in the cell's goodput: those started in the steady
            // state and completed, over its length.
            let uploaded_bits = (done.len() * WEB.bytes * 8) as f64;
            let steady_s = f64::from(SECONDS) - from;
            figures["goodput"] =
                json!(shares.iter().sum::<f64>() + uploaded_bits / steady_s / cell.rate_bps());
            figures["short_p50_ms"] = json!(percentile(&done, 50.0));
            figures["short_p99_ms"] = json!(percentile(&done, 99.0));
            figures["short_failed"] = (steady.len() - done.len()).into();
            figures["short_started"] = steady.len().into();
        }
        Ok(figures)
    })?;
    figures["drops"] = bottleneck_drops(&lab, peer.is_shaper())?.into();
    figures["configuration"] = configuration.into();
    figures["delay"] = delay.into();
    Ok(figures)
}

fn install(lab: &Lab, cell: &Cell, peer: Peer) -> Result<()> {
    if peer.is_shaper() {
        // HTB + CoDel, the default path (a peers row before may have asked for EDT).
        std::env::set_var("SHAPER_SHAPE_BACKEND", "htb");
        lab.router.attach(ROUTER_TO_SERVER, &[])?;
        let rate = cell.rate();
        let mut options: Vec<&str> = shape_to_server(&rate).to_vec();
        if peer == Peer::ShaperBurst32k {
            options.extend(["--burst", "32k"]);
        }
        lab.router.class_add("bulk", ROUTER_TO_SERVER, &options)?;
        return Ok(());
    }
    for line in peer.commands(cell) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let out = lab.router.run(words[0], &words[1..])?;
        anyhow::ensure!(
            out.status.success(),
            "{line}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The bottleneck's configuration as the kernel (and shaper) read it back: its qdiscs and
/// classes, and shaper's class.
fn read_back(lab: &Lab, peer: Peer) -> Result<String> {
    let mut lines = Vec::new();
    for what in ["qdisc", "class"] {
        let out = lab
            .router
            .run("tc", &[what, "show", "dev", ROUTER_TO_SERVER])?;
        lines.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(|line| line.trim().to_string())
                .filter(|line| !line.is_empty()),
        );
    }
    if peer.is_shaper() {
        let list = lab
            .router
            .shaper(&["class", "list", "--dev", ROUTER_TO_SERVER])?;
        lines.extend(
            list.lines()
                .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|line| !line.is_empty()),
        );
    }
    Ok(lines.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_named_with_the_prefix_and_each_cell_has_four_limiters() {
        let names = row_names();
        assert_eq!(names.len(), cells().len() * 4);
        assert!(names.iter().all(|name| name.starts_with(PREFIX)));
        assert!(any_row("80 ms, 1 bbr, cake, rtt"));
        assert!(!any_row("no such cell"));
        let cake_rtt = Peer::CakePathRtt.commands(&cell(10, 40, Load::WebMix));
        assert_eq!(
            cake_rtt,
            [format!(
                "tc qdisc replace dev {ROUTER_TO_SERVER} root cake bandwidth 10mbit rtt 80ms"
            )]
        );
        assert!(Peer::ShaperBurst32k.commands(&cell(10, 0, Load::WebMix))[1]
            .ends_with("--action shape --burst 32k"));
    }
}
