//! `cargo xtask demo`: the lab (client → router → server), UDP and TCP without shaper,
//! then with a 10 Mbit/s class on the router's egress toward the server.

use anyhow::Result;
use comfy_table::Table;
use shaper_tests::{Lab, Udp, ROUTER_TO_SERVER};
use std::path::Path;

const SECONDS: u32 = 5;

struct Row {
    setup: &'static str,
    traffic: &'static str,
    configured: String,
    measured_mbit: f64,
    dropped: String,
}

pub fn run(shaper: &Path) -> Result<()> {
    std::env::set_var("SHAPER_BIN", shaper);
    println!("[demo] building the lab: client → router → server (198.18.0.0/15, fd00::/8)");
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    let mut rows = Vec::new();

    println!("[demo] UDP at 100 Mbit/s and one TCP flow, {SECONDS} s each, without shaper");
    let udp = lab.udp(&Udp {
        seconds: SECONDS,
        ..Udp::default()
    })?;
    rows.push(Row {
        setup: "no shaper",
        traffic: "UDP 100M offered",
        configured: "-".into(),
        measured_mbit: udp.total_l2_bps() / 1e6,
        dropped: "-".into(),
    });
    let tcp = lab.tcp(SECONDS)?;
    rows.push(Row {
        setup: "no shaper",
        traffic: "TCP, 1 flow",
        configured: "-".into(),
        measured_mbit: tcp / 1e6,
        dropped: "-".into(),
    });

    println!(
        "[demo] shaper --netns {} attach {ROUTER_TO_SERVER}",
        router.name
    );
    println!(
        "{}",
        lab.shaper_in(&router, &["attach", ROUTER_TO_SERVER])?
            .trim()
    );
    println!("[demo] shaper class add limit10 --dev {ROUTER_TO_SERVER} --rate 10mbit");
    println!(
        "{}",
        lab.shaper_in(
            &router,
            &[
                "class",
                "add",
                "limit10",
                "--dev",
                ROUTER_TO_SERVER,
                "--rate",
                "10mbit"
            ]
        )?
        .trim()
    );

    let dropped = |lab: &Lab| -> Result<u64> {
        Ok(lab
            .stats(&router)?
            .iter()
            .map(|c| c["dropped_packets"].as_u64().unwrap_or(0))
            .sum())
    };
    let before = dropped(&lab)?;
    let udp = lab.udp(&Udp {
        seconds: SECONDS,
        ..Udp::default()
    })?;
    let after_udp = dropped(&lab)?;
    rows.push(Row {
        setup: "shaper 10mbit",
        traffic: "UDP 100M offered",
        configured: "10.000".into(),
        measured_mbit: udp.total_l2_bps() / 1e6,
        dropped: (after_udp - before).to_string(),
    });
    let tcp = lab.tcp(SECONDS)?;
    rows.push(Row {
        setup: "shaper 10mbit",
        traffic: "TCP, 1 flow",
        configured: "10.000".into(),
        measured_mbit: tcp / 1e6,
        dropped: (dropped(&lab)? - after_udp).to_string(),
    });

    println!("\n{}", lab.shaper_in(&router, &["stats"])?);
    let mut table = Table::new();
    table.set_header([
        "setup",
        "traffic",
        "configured Mbit/s",
        "measured Mbit/s",
        "packets dropped",
    ]);
    for row in &rows {
        table.add_row([
            row.setup.to_string(),
            row.traffic.to_string(),
            row.configured.clone(),
            format!("{:.3}", row.measured_mbit),
            row.dropped.clone(),
        ]);
    }
    println!("{table}");
    println!("UDP: L2 rate received by the server (steady state). TCP: iperf3 goodput.");
    println!("TCP through a drop policer is poor on µs-RTT paths (see README, Known limits).");
    println!("[demo] cleaning up the lab");
    Ok(())
}
