//! The dashboard (contrib/grafana/shaper.json) drawn from a lab run (issue 53): a daemon
//! in the router's namespace with a policed class, a shape class and a per-flow class, a
//! real Prometheus scraping it every second, and a minute of traffic (four TCP flows
//! through the shape class for 40 s, a UDP flood at twice the policed class's rate
//! beside them for the first 20). Each of
//! the dashboard's class panels is queried over the run (`query_range`, the
//! expressions as Grafana sends them, `$__rate_interval` at 5 s) and drawn in a grid:
//! docs/bench/dashboard.png, shown in docs/GUIDE.md.

use anyhow::{Context as _, Result};
use serde_json::Value;
use shaper_tests::{
    daemon::{ConfigFile, Daemon},
    monitoring::Monitoring,
    Lab, Tcp, Udp,
};
use std::{path::Path, thread, time::Duration};

pub fn dashboard(png: &Path) -> Result<()> {
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    let file = ConfigFile::new(
        "dashboard",
        &format!(
            "[[interface]]\ndev = \"r1\"\nnetns = \"{}\"\n\n\
             [[interface.class]]\nname = \"flood\"\nrate = \"10mbit\"\nproto = \"udp\"\n\n\
             [[interface.class]]\nname = \"bulk\"\nrate = \"5mbit\"\nproto = \"tcp\"\naction = \"shape\"\n\n\
             [[interface.class]]\nname = \"echo\"\nrate = \"1mbit\"\nper = \"flow\"\nproto = \"udp\"\ndport = 7\n",
            router.name
        ),
    );
    let daemon = Daemon::start(&router, &file, &[])?;
    let monitoring = Monitoring::start(&router, "127.0.0.1:9464")?;
    monitoring.wait_until_scraped()?;
    let start = monitoring.now()?;
    thread::sleep(Duration::from_secs(5));
    let tcp = Tcp {
        flows: 4,
        ..Tcp::for_seconds(40)
    };
    let flood = Udp::at("20M", 20);
    lab.mixed(&[&tcp], &[&flood])?;
    thread::sleep(Duration::from_secs(10));
    let end = monitoring.now()?;
    let panels = panels()?;
    let mut drawn = Vec::new();
    for (title, targets) in panels {
        let mut series = Vec::new();
        for (expr, legend) in targets {
            let expr = expr
                .replace("$__rate_interval", "5s")
                .replace("$instance", ".*")
                .replace("$dev", ".*")
                .replace("$class", ".*");
            for result in monitoring.query_range(&expr, start, end, 1.0)? {
                let points: Vec<(f64, f64)> = result["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|pair| {
                        let at = pair[0].as_f64()?;
                        let value = pair[1].as_str()?.parse::<f64>().ok()?;
                        value.is_finite().then_some((at - start, value))
                    })
                    .collect();
                series.push((legend_of(&legend, &result["metric"]), points));
            }
        }
        drawn.push((title, series));
    }
    crate::plots::register_font()?;
    crate::plots::panel_grid(png, "shaper dashboard, from a lab run", &drawn)?;
    println!("wrote {}", png.display());
    drop(monitoring);
    daemon.stop()?;
    Ok(())
}

/// A panel's title and its queries: (expression, legend format).
type Panel = (String, Vec<(String, String)>);

/// The dashboard's class panels (its time series before the "Hosts" row, whose global
/// classes this lab has none of), in order.
fn panels() -> Result<Vec<Panel>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../contrib/grafana/shaper.json"
    ))?;
    let dashboard: Value = serde_json::from_str(&text).context("the dashboard's JSON")?;
    Ok(dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .take_while(|panel| !(panel["type"] == "row" && panel["title"] == "Hosts"))
        .filter(|panel| panel["type"] == "timeseries")
        .map(|panel| {
            let targets = panel["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| {
                    Some((
                        t["expr"].as_str()?.to_string(),
                        t["legendFormat"].as_str().unwrap_or_default().to_string(),
                    ))
                })
                .collect();
            (panel["title"].as_str().unwrap_or("?").to_string(), targets)
        })
        .collect())
}

/// A legend format (`{{dev}} {{class}}`) filled from a series' labels.
fn legend_of(format: &str, labels: &Value) -> String {
    let mut out = format.to_string();
    if let Some(labels) = labels.as_object() {
        for (name, value) in labels {
            out = out.replace(
                &format!("{{{{{name}}}}}"),
                value.as_str().unwrap_or_default(),
            );
        }
    }
    out.trim().to_string()
}
