//! Flow isolation inside one shape class (issue 50): the cells the lab tests assert and
//! the bench prints. Every cell is one `--action shape` class on the router's egress
//! toward the server matching everything, and flows from the client (or two client
//! hosts) sharing it; goodputs are over the steady state.

use crate::{Lab, Tcp, Udp};
use anyhow::Result;
use std::time::Duration;

/// A second host on the client's link, for host isolation (`--fair src`).
pub const SECOND_CLIENT_V4: &str = "198.18.1.3";

/// Jain's fairness index of `rates`: 1 when all are equal, 1/n when one takes everything.
pub fn jain(rates: &[f64]) -> f64 {
    let sum: f64 = rates.iter().sum();
    let squares: f64 = rates.iter().map(|r| r * r).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (rates.len() as f64 * squares)
}

/// What one cell measured, as fractions of the class's rate: each TCP flow's goodput
/// and each UDP flow's delivered rate on the wire, and the TCP flows' mean smoothed RTT.
#[derive(Clone, Debug, Default)]
pub struct Shares {
    pub tcp: Vec<f64>,
    pub udp: Vec<f64>,
    pub tcp_rtt_ms: Vec<f64>,
}

impl Shares {
    /// Every flow's share together (TCP goodput, UDP on the wire).
    pub fn total(&self) -> f64 {
        self.tcp.iter().sum::<f64>() + self.udp.iter().sum::<f64>()
    }

    pub fn jain(&self) -> f64 {
        jain(&self.tcp)
    }

    pub fn worst_rtt_ms(&self) -> f64 {
        self.tcp_rtt_ms.iter().copied().fold(0.0, f64::max)
    }
}

impl std::fmt::Display for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |values: &[f64]| {
            values
                .iter()
                .map(|v| format!("{v:.3}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        write!(f, "TCP {}", list(&self.tcp))?;
        if !self.udp.is_empty() {
            write!(f, ", UDP {}", list(&self.udp))?;
        }
        write!(
            f,
            ", total {:.3}, Jain {:.3}, TCP RTT {:.1} ms",
            self.total(),
            self.jain(),
            self.worst_rtt_ms()
        )
    }
}

/// A TCP flow of `congestion` for `seconds`.
pub fn tcp(congestion: &str, seconds: u32) -> Tcp {
    Tcp {
        congestion: congestion.into(),
        ..Tcp::for_seconds(seconds)
    }
}

/// An unresponsive UDP flow at `rate` (iperf3's -b) for `seconds`, in 1400-byte datagrams.
pub fn udp_flood(rate: &'static str, seconds: u32) -> Udp {
    Udp {
        length: 1400,
        ..Udp::at(rate, seconds)
    }
}

/// Runs `tcp` and `udp` flows at once through the lab's class of `rate_bps`, each TCP
/// flow its own iperf3 client; shares measured from `steady_from` to the end.
pub fn run_cell(
    lab: &mut Lab,
    rate_bps: f64,
    tcp: &[&Tcp],
    udp: &[&Udp],
    steady_from: Duration,
) -> Result<Shares> {
    let (tcp_runs, udp_runs) = lab.mixed(tcp, udp)?;
    let from = steady_from.as_secs_f64();
    let shares = Shares {
        tcp: tcp_runs
            .iter()
            .map(|run| run.steady_bps_from(from) / rate_bps)
            .collect(),
        udp: udp_runs
            .iter()
            .zip(udp)
            .map(|(run, options)| run.l2_bps_between(from, options.seconds as f64) / rate_bps)
            .collect(),
        tcp_rtt_ms: tcp_runs
            .iter()
            .filter_map(|run| run.steady_rtt_ms_from(from))
            .collect(),
    };
    Ok(shares)
}

/// Adds [`SECOND_CLIENT_V4`] on the client's interface (the router reaches it on the
/// client's subnet), for flows from a second host.
pub fn add_second_client(lab: &Lab) -> Result<()> {
    lab.client.run(
        "ip",
        &[
            "addr",
            "add",
            &format!("{SECOND_CLIENT_V4}/24"),
            "dev",
            crate::CLIENT_DEV,
        ],
    )?;
    Ok(())
}
