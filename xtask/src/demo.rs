//! `cargo xtask demo`: the lab (client → router → server), UDP and TCP without shaper,
//! then through 10 Mbit/s classes with each action, side by side with tc's tbf on the
//! same link, and with the policer and the shaper on the sending host's own egress.
//! Beside every run a 20 Hz ping from the client to the server measures the RTT the
//! traffic adds.

use anyhow::Result;
use comfy_table::Table;
use shaper_tests::{
    latency::{idle_rtt_ms, LatencyProbe, PROBE_HZ},
    Lab, Netns, Udp, CLIENT_DEV, ROUTER_TO_CLIENT, ROUTER_TO_SERVER, SERVER_V4,
};
use std::{path::Path, time::Duration};

/// The issue-3 TCP targets are stated for 10 s runs; the initial burst weighs less.
const SECONDS: u32 = 10;
const RATE_BPS: f64 = 10e6;
/// The probe's figures leave out the start of each run (slow start, the initial burst).
const PROBE_STEADY_FROM: Duration = Duration::from_secs(2);

struct Row {
    setup: String,
    traffic: &'static str,
    measured_bps: f64,
    /// The probe's added RTT, "p50 / p99" in ms.
    added_rtt: String,
    dropped: String,
}

/// What runs through one setup.
enum Traffic {
    Udp,
    Tcp(&'static str),
}

impl Traffic {
    fn label(&self) -> &'static str {
        match self {
            Traffic::Udp => "UDP 100M offered (L2 rate)",
            Traffic::Tcp("cubic") => "TCP cubic (goodput)",
            Traffic::Tcp(_) => "TCP bbr (goodput)",
        }
    }
}

/// Runs `traffic` with the probe beside it: the rate, and the probe's added RTT over the
/// idle RTT ("p50 / p99" ms; what went wrong when no probe came back).
fn measure(lab: &mut Lab, traffic: &Traffic) -> Result<(f64, String)> {
    let idle = idle_rtt_ms(&lab.client, SERVER_V4)?;
    let probe = LatencyProbe::start(&lab.client, SERVER_V4, PROBE_HZ)?;
    let measured = run_traffic(lab, traffic);
    let samples = probe.finish()?;
    let measured = measured?;
    let added = match samples.added_rtt(PROBE_STEADY_FROM, idle) {
        Ok(added) if added.lost > 0 => format!(
            "{:.1} / {:.1} ({} lost)",
            added.p50_ms, added.p99_ms, added.lost
        ),
        Ok(added) => format!("{:.1} / {:.1}", added.p50_ms, added.p99_ms),
        Err(error) => format!("- ({error})"),
    };
    Ok((measured, added))
}

fn run_traffic(lab: &mut Lab, traffic: &Traffic) -> Result<f64> {
    match traffic {
        Traffic::Udp => Ok(lab
            .udp(&Udp {
                seconds: SECONDS,
                ..Udp::default()
            })?
            .total_l2_bps()),
        Traffic::Tcp(congestion) => lab.tcp_with(SECONDS, congestion),
    }
}

fn dropped(ns: &Netns) -> Result<u64> {
    Ok(ns
        .stats()?
        .iter()
        .map(|c| c["dropped_packets"].as_u64().unwrap_or(0))
        .sum())
}

/// Runs `traffics` through a shaper class with `action` on `dev` in `ns`.
fn with_shaper(
    lab: &mut Lab,
    ns: &Netns,
    dev: &str,
    action: &str,
    label: &str,
    traffics: &[Traffic],
    rows: &mut Vec<Row>,
) -> Result<()> {
    println!("[demo] shaper --netns {} attach {dev}; class add c --dev {dev} --rate 10mbit --action {action}", ns.name);
    ns.shaper(&["attach", dev])?;
    ns.shaper(&[
        "class", "add", "c", "--dev", dev, "--rate", "10mbit", "--action", action,
    ])?;
    for traffic in traffics {
        let before = dropped(ns)?;
        let (measured_bps, added_rtt) = measure(lab, traffic)?;
        rows.push(Row {
            setup: label.to_string(),
            traffic: traffic.label(),
            measured_bps,
            added_rtt,
            dropped: (dropped(ns)? - before).to_string(),
        });
    }
    println!("{}", ns.shaper(&["stats"])?.trim_end());
    ns.shaper(&["detach", dev])?;
    Ok(())
}

pub fn run(shaper: &Path) -> Result<()> {
    std::env::set_var("SHAPER_BIN", shaper);
    println!("[demo] building the lab: client → router → server (198.18.0.0/15, fd00::/8)");
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    let client = lab.client.clone();
    let mut rows = Vec::new();

    println!("[demo] without shaper, {SECONDS} s per run");
    let unshaped = [Traffic::Udp, Traffic::Tcp("cubic")];
    rows.extend(without_shaper(&mut lab, "no shaper", &unshaped)?);
    let both = [Traffic::Udp, Traffic::Tcp("cubic"), Traffic::Tcp("bbr")];
    with_shaper(
        &mut lab,
        &router,
        ROUTER_TO_SERVER,
        "drop",
        "shaper drop (router)",
        &both,
        &mut rows,
    )?;
    client.run("sysctl", &["-qw", "net.ipv4.tcp_ecn=1"])?;
    with_shaper(
        &mut lab,
        &router,
        ROUTER_TO_SERVER,
        "ecn",
        "shaper ecn (router, ECN on)",
        &[Traffic::Tcp("cubic")],
        &mut rows,
    )?;
    client.run("sysctl", &["-qw", "net.ipv4.tcp_ecn=2"])?;
    with_shaper(
        &mut lab,
        &router,
        ROUTER_TO_SERVER,
        "shape",
        "shaper shape (router, HTB)",
        &both,
        &mut rows,
    )?;
    split_rows(&mut lab, &router, &mut rows)?;
    with_shaper(
        &mut lab,
        &client,
        CLIENT_DEV,
        "drop",
        "shaper drop (sender's own egress)",
        &[Traffic::Tcp("cubic")],
        &mut rows,
    )?;
    // TSO on at the client: the class caps the device's aggregates (issue 37).
    with_shaper(
        &mut lab,
        &client,
        CLIENT_DEV,
        "shape",
        "shaper shape (sender's own egress)",
        &[Traffic::Tcp("cubic"), Traffic::Tcp("bbr")],
        &mut rows,
    )?;

    rows.extend(with_tbf(&mut lab, &router, &both)?);

    print_table(&rows);
    println!("[demo] cleaning up the lab");
    Ok(())
}

/// The router's receiving interface splits the client's TSO aggregates, so the shape
/// class on its way out judges segments (issue 37).
fn split_rows(lab: &mut Lab, router: &Netns, rows: &mut Vec<Row>) -> Result<()> {
    let split = ["--direction", "ingress", "--split-aggregates"];
    router.shaper(&[&["attach", ROUTER_TO_CLIENT][..], &split].concat())?;
    with_shaper(
        lab,
        router,
        ROUTER_TO_SERVER,
        "shape",
        "shaper shape (router, aggregates split)",
        &[Traffic::Tcp("cubic"), Traffic::Tcp("bbr")],
        rows,
    )?;
    router.shaper(&["detach", ROUTER_TO_CLIENT, "--direction", "ingress"])?;
    Ok(())
}

/// Runs of `traffics` without shaper (`setup` names what limits them, if anything).
fn without_shaper(lab: &mut Lab, setup: &str, traffics: &[Traffic]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for traffic in traffics {
        let (measured_bps, added_rtt) = measure(lab, traffic)?;
        rows.push(Row {
            setup: setup.into(),
            traffic: traffic.label(),
            measured_bps,
            added_rtt,
            dropped: "-".into(),
        });
    }
    Ok(rows)
}

/// The same runs through tc's tbf on the router, the reference.
fn with_tbf(lab: &mut Lab, router: &Netns, traffics: &[Traffic]) -> Result<Vec<Row>> {
    println!(
        "[demo] tc qdisc add dev {ROUTER_TO_SERVER} root tbf rate 10mbit burst 32k latency 50ms"
    );
    router.run(
        "tc",
        &[
            "qdisc",
            "add",
            "dev",
            ROUTER_TO_SERVER,
            "root",
            "tbf",
            "rate",
            "10mbit",
            "burst",
            "32k",
            "latency",
            "50ms",
        ],
    )?;
    let rows = without_shaper(lab, "tc tbf (router)", traffics)?;
    router.run("tc", &["qdisc", "del", "dev", ROUTER_TO_SERVER, "root"])?;
    Ok(rows)
}

/// The demo's table: each run's rate, its fraction of the class's and the added RTT.
fn print_table(rows: &[Row]) {
    let mut table = Table::new();
    table.set_header([
        "setup (10 Mbit/s)",
        "traffic",
        "measured Mbit/s",
        "of the rate",
        "added RTT p50 / p99 ms",
        "packets dropped by shaper",
    ]);
    for row in rows {
        let fraction = if row.setup == "no shaper" {
            "-".to_string()
        } else {
            format!("{:.1} %", row.measured_bps / RATE_BPS * 100.0)
        };
        table.add_row([
            row.setup.clone(),
            row.traffic.to_string(),
            format!("{:.3}", row.measured_bps / 1e6),
            fraction,
            row.added_rtt.clone(),
            row.dropped.clone(),
        ]);
    }
    println!("{table}");
    println!("Default bursts: drop/ecn 250 ms at the rate (see docs/CHOOSING.md), shape 128 KiB (10 ms at the rate above 105 Mbit/s).");
    println!(
        "Added RTT: a {PROBE_HZ:.0} Hz ping from the client to the server beside each run, minus the idle RTT measured just before, from {} s into the run.",
        PROBE_STEADY_FROM.as_secs()
    );
}
