//! A container's upload (its own traffic out), limited three ways on the same lab: the
//! reference CNI `bandwidth` plugin (`egressRate`: tbf on an ifb fed by a mirred
//! redirect from the host veth's ingress), shaper-cni with `egressAction: "shape"`
//! (shaper's HTB and CoDel on the container's own interface, inside its namespace) and
//! shaper-cni's default (the host veth's ingress polices). The router is the host, the
//! server's namespace the container, `s0` its interface, `r1` its host veth; the uploads
//! go from the server to the client. TSO is on in the container, as in any pod, on the µs
//! lab; over the 40 ms path it is off (the delay line beside the container carries
//! wire-size frames only).

use crate::{
    senders::{
        fraction_beside, lab, BBR_FLOOR, BELOW_REFERENCE, FORTY_MS_PATH, HELD_BDP_BYTES,
        TARGET_FRACTION, TARGET_RTT_OVER_BASE_MS,
    },
    traffic::{cni_run, Cni},
};
use anyhow::{Context as _, Result};
use serde_json::{json, Value};
use shaper_tests::{CniLeftovers, Lab, Tcp, Udp, CLIENT_V4, ROUTER_TO_SERVER, SERVER_DEV};
use std::time::Duration;

/// The upload limiters, as the report names them.
const LIMITERS: [(&str, Cni, Option<&str>); 3] = [
    (
        "reference bandwidth plugin (tbf on ifb)",
        Cni::Reference,
        None,
    ),
    (SHAPE, Cni::Shaper, Some("shape")),
    (
        "shaper-cni egressAction drop (default)",
        Cni::Shaper,
        Some("drop"),
    ),
];

/// The limiter the targets are for.
const SHAPE: &str = "shaper-cni egressAction shape";
/// What makes a row the same traffic as another's.
const SAME_TRAFFIC: &[&str] = &["rate", "base_rtt_ms", "traffic"];

fn is_reference(row: &Value) -> bool {
    row["limiter"] == LIMITERS[0].0
}
/// UDP at 10× the rate arrives within this fraction of it.
const UDP_TOLERANCE: f64 = 0.01;

/// A rate and a path the limiters are measured at.
#[derive(Clone, Copy)]
pub struct Setting {
    rate: &'static str,
    rate_bps: u64,
    /// UDP's offered rate, iperf3's spelling: 10× the rate.
    udp_rate: &'static str,
    /// One-way delay through the delay line (None: the µs lab).
    one_way: Option<Duration>,
}

const TEN: Setting = Setting {
    rate: "10mbit",
    rate_bps: 10_000_000,
    udp_rate: "100M",
    one_way: None,
};
const HUNDRED: Setting = Setting {
    rate: "100mbit",
    rate_bps: 100_000_000,
    udp_rate: "1000M",
    one_way: None,
};

/// How long each run is, where its figures start, at which settings.
pub struct UploadEffort {
    pub seconds: u32,
    pub steady_from: f64,
    settings: &'static [Setting],
    /// Whether shaper-cni's shape rows are held to the targets (the full run).
    targets: bool,
}

pub fn effort(quick: bool) -> UploadEffort {
    if quick {
        // CI's smoke run: every limiter at 10 Mbit/s on the µs lab, the figures from the
        // second second on.
        UploadEffort {
            seconds: 3,
            steady_from: 1.0,
            settings: &[TEN],
            targets: false,
        }
    } else {
        UploadEffort {
            seconds: 30,
            steady_from: 10.0,
            settings: &[
                TEN,
                HUNDRED,
                Setting {
                    one_way: Some(FORTY_MS_PATH),
                    ..TEN
                },
                Setting {
                    one_way: Some(FORTY_MS_PATH),
                    ..HUNDRED
                },
            ],
            targets: true,
        }
    }
}

fn configure(
    lab: &Lab,
    setting: Setting,
    limiter: (Cni, Option<&str>),
    command: &str,
) -> Result<()> {
    let (cni, action) = limiter;
    let bandwidth = json!({
        "egressRate": setting.rate_bps,
        // shaper's default shape burst (128 KiB), in bits, for both.
        "egressBurst": 128 * 1024 * 8,
    });
    let extra: Vec<(&str, Value)> = action
        .map(|action| ("egressAction", json!(action)))
        .into_iter()
        .collect();
    cni_run(lab, cni, command, bandwidth, &extra)
}

/// Every setting's rows.
pub fn uploads(effort: &UploadEffort) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for &setting in effort.settings {
        rows.extend(uploads_at(effort, setting)?);
    }
    Ok(rows)
}

/// One row per limiter and traffic at `setting`: Cubic and BBR goodput with the sender's
/// RTT, and UDP at 10× the rate.
fn uploads_at(effort: &UploadEffort, setting: Setting) -> Result<Vec<Value>> {
    let mut lab = lab(setting.one_way)?;
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    let (container, host_side) = (lab.server.clone(), lab.client.clone());
    let rate_bps = setting.rate_bps as f64;
    let mut rows = Vec::new();
    for (limiter, cni, action) in LIMITERS {
        let mut leftovers = CniLeftovers::new(
            Some(lab.router.name.clone()),
            &crate::traffic::cni_container_id(),
            SERVER_DEV,
            None,
        );
        leftovers.claim_host_dev(ROUTER_TO_SERVER)?;
        println!(
            "[uploads] {limiter} at {} over {base_rtt_ms:.0} ms",
            setting.rate
        );
        configure(&lab, setting, (cni, action), "ADD")?;
        let held = effort.targets && limiter == SHAPE;
        let row = |traffic: String, fraction: f64, rtt_ms: Option<f64>| {
            json!({
                "limiter": limiter,
                "rate": setting.rate,
                "rate_bps": setting.rate_bps,
                "base_rtt_ms": base_rtt_ms.round(),
                "traffic": traffic,
                "fraction": fraction,
                "rtt_ms": rtt_ms,
                "held": held,
                "settings_in_run": effort.settings.len(),
            })
        };
        for congestion in ["cubic", "bbr"] {
            let tcp = Tcp {
                congestion: congestion.into(),
                ..Tcp::for_seconds(effort.seconds)
            };
            let run = lab.tcp_between(&container, &host_side, CLIENT_V4, &tcp)?;
            let rtt = run.steady_rtt_ms_from(effort.steady_from);
            let rtt = rtt.context("iperf3 reported no RTT")?;
            let fraction = run.steady_bps_from(effort.steady_from) / rate_bps;
            rows.push(row(format!("TCP {congestion}"), fraction, Some(rtt)));
        }
        let udp_seconds = effort.seconds.min(8);
        let udp = Udp::at(setting.udp_rate, udp_seconds);
        let udp = lab.udp_between(&container, &host_side, CLIENT_V4, &udp)?;
        let fraction = udp.l2_bps_between(2.0, f64::from(udp_seconds)) / rate_bps;
        rows.push(row(UDP.to_string(), fraction, None));
        configure(&lab, setting, (cni, action), "DEL")?;
        if matches!(cni, Cni::Reference) {
            // The reference plugin's DEL deletes its ifb but leaves the host veth's
            // ingress qdisc for the veth's deletion; the lab's veth stays.
            let _ = lab
                .router
                .run("tc", &["qdisc", "del", "dev", ROUTER_TO_SERVER, "ingress"]);
        }
    }
    Ok(rows)
}

const UDP: &str = "UDP at 10× the rate";

pub fn markdown(report: &Value) -> String {
    let mut out = format!(
        "\n## Uploads: a container's own traffic\n\nAn upload limit through each CNI plugin, the container sending with TSO on (off over the 40 ms path: the delay line carries wire-size frames only; Cubic and BBR: goodput over the rate and the sender's own mean RTT over the path's base; UDP at 10× the rate: L2 rate received over the rate), at 10 and 100 Mbit/s on the µs lab and over a 40 ms path in the full run. Held in the full run (column *held*), shaper-cni's shape: TCP ≥ {TARGET_FRACTION} of the rate within base + {TARGET_RTT_OVER_BASE_MS} ms (BBR where the rate times the RTT is above 100 KB: no more than {BELOW_REFERENCE} under the reference plugin's tbf beside it, since BBR v1's PROBE_RTT caps one flow near 0.93 there), UDP within {:.0} %. `cargo xtask test` asserts the 10 Mbit/s µs figures (`cni.rs`).\n\n| limiter | rate | base RTT ms | traffic | of the rate | sender's RTT over base ms | held |\n|---|---|---|---|---|---|---|\n",
        UDP_TOLERANCE * 100.0
    );
    for row in report["uploads"].as_array().into_iter().flatten() {
        let base = row["base_rtt_ms"].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "| {} | {} | {base:.0} | {} | {:.3} | {} | {} |\n",
            row["limiter"].as_str().unwrap_or_default(),
            row["rate"].as_str().unwrap_or_default(),
            row["traffic"].as_str().unwrap_or_default(),
            row["fraction"].as_f64().unwrap_or(0.0),
            row["rtt_ms"]
                .as_f64()
                .map_or("-".to_string(), |ms| format!("{:.1}", ms - base)),
            if row["held"].as_bool() == Some(true) {
                "yes"
            } else {
                "-"
            },
        ));
    }
    out
}

/// Every row measured something (a limiter that passed nothing, or everything, is
/// broken), and the held rows meet the targets.
pub fn check(report: &Value) -> Vec<String> {
    let rows = report["uploads"].as_array().cloned().unwrap_or_default();
    // Every setting the run measured at has all its rows.
    let settings = rows.first().and_then(|row| row["settings_in_run"].as_u64());
    let expected = LIMITERS.len() * 3 * settings.unwrap_or(1) as usize;
    let mut broken = Vec::new();
    if rows.len() != expected {
        broken.push(format!("uploads: {} rows, expected {expected}", rows.len()));
    }
    for row in rows.iter().cloned() {
        let what = format!(
            "uploads: {} {} at {} over {} ms",
            row["limiter"].as_str().unwrap_or_default(),
            row["traffic"].as_str().unwrap_or_default(),
            row["rate"].as_str().unwrap_or_default(),
            row["base_rtt_ms"]
        );
        let fraction = row["fraction"].as_f64().unwrap_or(f64::NAN);
        let udp = row["traffic"].as_str() == Some(UDP);
        // A policer's TCP at a high rate over a 128 KiB burst may get little, not nothing.
        let policed_tcp = !udp && row["limiter"] != SHAPE && !is_reference(&row);
        let sane = if policed_tcp { 0.01..=1.1 } else { 0.3..=1.1 };
        if !sane.contains(&fraction) {
            broken.push(format!("{what}: {fraction:.3} of the rate"));
        }
        if row["held"].as_bool() != Some(true) {
            continue;
        }
        if udp && (fraction - 1.0).abs() > UDP_TOLERANCE {
            broken.push(format!(
                "{what}: {fraction:.3} of the rate, not within {UDP_TOLERANCE}"
            ));
        }
        match (udp, held_to_reference(&row)) {
            (true, _) => {}
            (false, false) if fraction < TARGET_FRACTION => {
                broken.push(format!("{what}: {fraction:.3} < {TARGET_FRACTION}"));
            }
            (false, true) => match fraction_beside(&rows, &row, SAME_TRAFFIC, is_reference) {
                None => broken.push(format!("{what}: no reference row beside it")),
                Some(tbf) if fraction < (tbf - BELOW_REFERENCE).max(BBR_FLOOR) => {
                    broken.push(format!(
                        "{what}: {fraction:.3} < the reference's {tbf:.3} − {BELOW_REFERENCE} \
                         (at least {BBR_FLOOR})"
                    ))
                }
                Some(_) => {}
            },
            _ => {}
        }
        let over_base =
            row["rtt_ms"].as_f64().unwrap_or(f64::NAN) - row["base_rtt_ms"].as_f64().unwrap_or(0.0);
        if !udp && (over_base.is_nan() || over_base > TARGET_RTT_OVER_BASE_MS) {
            broken.push(format!(
                "{what}: RTT base + {over_base:.1} ms > + {TARGET_RTT_OVER_BASE_MS}"
            ));
        }
    }
    broken
}

/// BBR over a path whose BDP is above `HELD_BDP_BYTES` is held to the reference plugin's
/// tbf beside it: BBR v1's PROBE_RTT caps one flow near 0.93 there whatever queues it.
fn held_to_reference(row: &Value) -> bool {
    let bdp_bytes = row["rate_bps"].as_f64().unwrap_or(0.0) / 8.0
        * row["base_rtt_ms"].as_f64().unwrap_or(0.0)
        / 1e3;
    row["traffic"].as_str() == Some("TCP bbr") && bdp_bytes > HELD_BDP_BYTES
}

/// A report's rows as a run that measured everything gives them (the driver's tests).
#[cfg(test)]
pub fn sane_rows() -> Vec<Value> {
    let traffics = ["TCP cubic", "TCP bbr", UDP];
    LIMITERS
        .iter()
        .flat_map(|(limiter, _, _)| {
            traffics.iter().map(move |traffic| {
                let fraction = if *traffic == UDP { 1.0 } else { 0.95 };
                json!({"limiter": limiter, "rate": "10mbit", "base_rtt_ms": 0.0,
                    "traffic": traffic, "fraction": fraction, "rtt_ms": 5.0,
                    "held": *limiter == SHAPE})
            })
        })
        .collect()
}
