//! A container's upload (its own traffic out), limited three ways on the same lab: the
//! reference CNI `bandwidth` plugin (`egressRate`: tbf on an ifb fed by a mirred
//! redirect from the host veth's ingress), shaper-cni with `egressAction: "shape"`
//! (shaper's HTB and CoDel on the container's own interface, inside its namespace) and
//! shaper-cni's default (the host veth's ingress polices). The router is the host, the
//! server's namespace the container, `s0` its interface, `r1` its host veth; the uploads
//! go from the server to the client. TSO is on in the container, as in any pod.

use crate::traffic::{cni_run, Cni};
use anyhow::Result;
use serde_json::{json, Value};
use shaper_tests::{CniLeftovers, Lab, Tcp, Udp, CLIENT_V4, ROUTER_TO_SERVER, SERVER_DEV};

const RATE_BPS: u64 = 10_000_000;

/// The upload limiters, as the report names them.
const LIMITERS: [(&str, Cni, Option<&str>); 3] = [
    (
        "reference bandwidth plugin (tbf on ifb)",
        Cni::Reference,
        None,
    ),
    ("shaper-cni egressAction shape", Cni::Shaper, Some("shape")),
    (
        "shaper-cni egressAction drop (default)",
        Cni::Shaper,
        Some("drop"),
    ),
];

/// How long each run is and where its figures start.
pub struct UploadEffort {
    pub seconds: u32,
    pub steady_from: f64,
}

pub fn effort(quick: bool) -> UploadEffort {
    if quick {
        // CI's smoke run: every row measured, the figures from the second second on.
        UploadEffort {
            seconds: 3,
            steady_from: 1.0,
        }
    } else {
        UploadEffort {
            seconds: 30,
            steady_from: 10.0,
        }
    }
}

fn configure(lab: &Lab, cni: Cni, action: Option<&str>, command: &str) -> Result<()> {
    let bandwidth = json!({
        "egressRate": RATE_BPS,
        // shaper's default shape burst (128 KiB), in bits, for both.
        "egressBurst": 128 * 1024 * 8,
    });
    let extra: Vec<(&str, Value)> = action
        .map(|action| ("egressAction", json!(action)))
        .into_iter()
        .collect();
    cni_run(lab, cni, command, bandwidth, &extra)
}

/// One row per limiter and traffic: Cubic and BBR goodput with the sender's RTT, and UDP
/// at 10× the rate.
pub fn uploads(effort: &UploadEffort) -> Result<Vec<Value>> {
    let mut lab = Lab::new()?;
    let (container, host_side) = (lab.server.clone(), lab.client.clone());
    let mut rows = Vec::new();
    for (limiter, cni, action) in LIMITERS {
        let mut leftovers = CniLeftovers::new(
            Some(lab.router.name.clone()),
            &crate::traffic::cni_container_id(),
            SERVER_DEV,
            None,
        );
        leftovers.claim_host_dev(ROUTER_TO_SERVER)?;
        println!("[uploads] {limiter}");
        configure(&lab, cni, action, "ADD")?;
        for congestion in ["cubic", "bbr"] {
            let tcp = Tcp {
                congestion: congestion.into(),
                ..Tcp::for_seconds(effort.seconds)
            };
            let run = lab.tcp_between(&container, &host_side, CLIENT_V4, &tcp)?;
            rows.push(json!({
                "limiter": limiter,
                "traffic": format!("TCP {congestion}"),
                "fraction": run.steady_bps_from(effort.steady_from) / RATE_BPS as f64,
                "rtt_ms": run.steady_rtt_ms_from(effort.steady_from),
            }));
        }
        let udp = lab.udp_between(
            &container,
            &host_side,
            CLIENT_V4,
            &Udp::at("100M", effort.seconds.min(8)),
        )?;
        let udp_seconds = f64::from(effort.seconds.min(8));
        rows.push(json!({
            "limiter": limiter,
            "traffic": "UDP at 10× the rate",
            "fraction": udp.l2_bps_between(2.0, udp_seconds) / RATE_BPS as f64,
            "rtt_ms": Value::Null,
        }));
        configure(&lab, cni, action, "DEL")?;
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

pub fn markdown(report: &Value) -> String {
    let mut out = String::from(
        "\n## Uploads: a container's own traffic\n\nA 10 Mbit/s upload limit through each CNI plugin, the container sending with TSO on (Cubic and BBR: goodput over the rate and the sender's own mean RTT; UDP at 10× the rate: L2 rate received over the rate). Asserted in `cargo xtask test` (`cni.rs`): shaper-cni's shape ≥ 0.93 within base + 20 ms, UDP within 1 %.\n\n| limiter | traffic | of the rate | sender's RTT ms |\n|---|---|---|---|\n",
    );
    for row in report["uploads"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {} | {:.3} | {} |\n",
            row["limiter"].as_str().unwrap_or_default(),
            row["traffic"].as_str().unwrap_or_default(),
            row["fraction"].as_f64().unwrap_or(0.0),
            row["rtt_ms"]
                .as_f64()
                .map_or("-".to_string(), |ms| format!("{ms:.1}")),
        ));
    }
    out
}

/// Every row measured something: a limiter that passed nothing, or everything, is broken.
pub fn check(report: &Value) -> Vec<String> {
    let rows = report["uploads"].as_array().cloned().unwrap_or_default();
    let mut broken = Vec::new();
    if rows.len() != LIMITERS.len() * 3 {
        broken.push(format!(
            "uploads: {} rows, expected {}",
            rows.len(),
            LIMITERS.len() * 3
        ));
    }
    for row in rows {
        let fraction = row["fraction"].as_f64().unwrap_or(f64::NAN);
        if !(0.3..=1.1).contains(&fraction) {
            broken.push(format!(
                "uploads: {} {} at {fraction:.3} of the rate",
                row["limiter"], row["traffic"]
            ));
        }
    }
    broken
}

/// A report's rows as a run that measured everything gives them (the driver's tests).
#[cfg(test)]
pub fn sane_rows() -> Vec<Value> {
    let traffics = ["TCP cubic", "TCP bbr", "UDP at 10× the rate"];
    LIMITERS
        .iter()
        .flat_map(|(limiter, _, _)| {
            traffics.iter().map(move |traffic| {
                json!({"limiter": limiter, "traffic": traffic, "fraction": 0.95, "rtt_ms": 5.0})
            })
        })
        .collect()
}
