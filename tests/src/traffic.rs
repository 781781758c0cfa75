//! Real traffic through the lab with iperf3: UDP at a given rate (one or several streams,
//! IPv4 or IPv6, several runs at once) and TCP with a given congestion control (one or
//! several flows, with the sender's smoothed RTT); rates measured at the receiver. How
//! iperf3 itself is run is in [`crate::iperf`].

use crate::{
    iperf,
    topology::{Lab, Netns, SERVER_V4, SERVER_V6},
};
use anyhow::Result;
use std::{process::Child, thread, time::Duration};

/// Ethernet + IPv4 + UDP headers per datagram, and the IPv6 equivalent.
pub const UDP_V4_OVERHEAD: u64 = 14 + 20 + 8;
pub const UDP_V6_OVERHEAD: u64 = 14 + 40 + 8;

/// Result of one iperf3 UDP run, measured at the server.
#[derive(Debug, Clone)]
pub struct UdpResult {
    /// Offered payload rate per stream (bit/s).
    pub offered_bps: f64,
    /// Received L2 rate per stream, over the steady-state intervals (bit/s).
    pub stream_l2_bps: Vec<f64>,
    /// The server's interval samples: (end time s, L2 bits summed over streams).
    pub intervals: Vec<(f64, f64)>,
    /// Datagrams the server accounted for over the whole run (lost ones included), summed
    /// over streams.
    pub packets: u64,
    /// Datagrams the server saw missing from the sequence.
    pub lost_packets: u64,
    /// Datagrams that arrived after a later one.
    pub out_of_order: u64,
}

impl UdpResult {
    pub fn total_l2_bps(&self) -> f64 {
        self.stream_l2_bps.iter().sum()
    }

    /// Received L2 rate (bit/s) over the one-second server intervals whose end, rounded
    /// to the second, lies in (from, to].
    pub fn l2_bps_between(&self, from: f64, to: f64) -> f64 {
        let mut bits = 0.0;
        let mut seconds = 0.0;
        let mut previous_end = 0.0;
        for (interval_end, interval_bits) in &self.intervals {
            let second = interval_end.round();
            if second > from && second <= to {
                bits += interval_bits;
                seconds += interval_end - previous_end;
            }
            previous_end = *interval_end;
        }
        if seconds > 0.0 {
            bits / seconds
        } else {
            0.0
        }
    }
}

/// Result of one iperf3 TCP run.
#[derive(Debug, Clone)]
pub struct TcpResult {
    /// Goodput received by the server over the whole run (bit/s), summed over flows.
    pub goodput_bps: f64,
    /// The server's interval samples: (end time s, payload bits received, all flows).
    pub intervals: Vec<(f64, f64)>,
    /// The sender's smoothed RTT per client interval: (end time s, ms, the mean over the
    /// flows that reported one). Empty where iperf3 reports no RTT.
    pub rtt_intervals: Vec<(f64, f64)>,
    /// The sender's mean smoothed RTT over the run (ms), averaged over the flows
    /// (iperf3's `end.streams[].sender.mean_rtt`).
    pub mean_rtt_ms: Option<f64>,
}

impl TcpResult {
    /// Goodput (bit/s) over the intervals after the first second: the initial burst a
    /// policer grants lands in the first second, so this is what the rate alone allows.
    pub fn steady_bps(&self) -> f64 {
        self.steady_bps_from(1.0)
    }

    /// The sender's smoothed RTT (ms) averaged over the client intervals that end after
    /// `from` seconds: the steady state, without slow start's overshoot.
    pub fn steady_rtt_ms_from(&self, from: f64) -> Option<f64> {
        let rtts: Vec<f64> = self
            .rtt_intervals
            .iter()
            .filter(|(end, _)| *end > from)
            .map(|(_, ms)| *ms)
            .collect();
        (!rtts.is_empty()).then(|| rtts.iter().sum::<f64>() / rtts.len() as f64)
    }

    /// Goodput (bit/s) over the intervals (of at least half a second) that start at
    /// `from` seconds or later.
    pub fn steady_bps_from(&self, from: f64) -> f64 {
        let (mut bits, mut seconds, mut previous_end) = (0.0, 0.0, 0.0);
        for &(end, interval_bits) in &self.intervals {
            if previous_end >= from - 0.001 && end - previous_end >= 0.5 {
                bits += interval_bits;
                seconds += end - previous_end;
            }
            previous_end = end;
        }
        if seconds > 0.0 {
            bits / seconds
        } else {
            0.0
        }
    }
}

/// Options of a TCP run ([`Lab::tcp_run`]).
#[derive(Debug, Clone)]
pub struct Tcp {
    pub seconds: u32,
    /// Congestion control (iperf3 -C): cubic, bbr, reno.
    pub congestion: String,
    /// Report interval in seconds (iperf3 -i), of the server's goodput and the sender's RTT.
    pub interval: f64,
    /// Parallel flows (iperf3 -P).
    pub flows: u32,
    pub ipv6: bool,
    /// The client's source address (iperf3 -B), for a second host on the client's link.
    pub bind: Option<&'static str>,
}

impl Tcp {
    /// The default run (one cubic flow over IPv4, reported every second) for `seconds`.
    pub fn for_seconds(seconds: u32) -> Self {
        Self {
            seconds,
            ..Self::default()
        }
    }
}

impl Default for Tcp {
    fn default() -> Self {
        Self {
            seconds: 10,
            congestion: "cubic".to_string(),
            interval: 1.0,
            flows: 1,
            ipv6: false,
            bind: None,
        }
    }
}

/// Options of a UDP run.
pub struct Udp {
    pub rate: &'static str,
    pub seconds: u32,
    pub streams: u32,
    pub ipv6: bool,
    pub port: Option<u16>,
    /// Datagram payload size.
    pub length: u32,
    /// IP TOS byte of the datagrams (iperf3 -S), e.g. 2 for ECT(0).
    pub tos: Option<u8>,
    /// Report interval in seconds (iperf3 -i); one second when unset.
    pub interval: Option<f64>,
    /// Source address of the client (iperf3 -B), e.g. a second address of the client.
    pub bind: Option<&'static str>,
    /// Socket buffers of both ends (iperf3 -w, passed on to the server), e.g. "1M": the
    /// kernel gives twice the smaller of it and the host's net.core.rmem_max, which the
    /// tests leave as they find it. Unset: the kernel's default (212992 bytes, about 90
    /// datagrams of 1400 bytes).
    pub window: Option<&'static str>,
}

impl Udp {
    /// The default run, at `rate` (iperf3's spelling: "20M") for `seconds`.
    pub fn at(rate: &'static str, seconds: u32) -> Self {
        Self {
            rate,
            seconds,
            ..Self::default()
        }
    }
}

impl Default for Udp {
    fn default() -> Self {
        Self {
            rate: "100M",
            seconds: 5,
            streams: 1,
            ipv6: false,
            port: None,
            length: 1400,
            bind: None,
            tos: None,
            interval: None,
            window: None,
        }
    }
}

impl Lab {
    /// A port no earlier run of this lab used.
    pub fn port(&mut self) -> u16 {
        self.next_port += 1;
        self.next_port
    }

    /// Starts a one-shot iperf3 server in the server namespace and waits until it listens.
    pub fn iperf_server(&self, port: u16) -> Result<Child> {
        iperf::start_server(&self.server, port, 1.0, None)
    }

    /// [`Self::iperf_server`] for a test whose datagrams a sink drops before they reach
    /// it: it receives nothing for minutes, and iperf3 ends a test that receives nothing
    /// for its receive timeout (120 s by default), so that is raised to 10 minutes.
    pub fn iperf_server_behind_sink(&self, port: u16) -> Result<Child> {
        iperf::start_server_with(&self.server, port, 1.0, None, &["--rcv-timeout", "600000"])
    }

    /// UDP at 10 Mbit/s (1200-byte datagrams) from client to server for 3 s: the L2 rate
    /// the server received over the last 2 (bit/s). Enough to tell a 1 Mbit/s class
    /// policing from no program in the path.
    pub fn udp_delivered_bps(&mut self) -> Result<f64> {
        let run = self.udp(&Udp {
            length: 1200,
            ..Udp::at("10M", 3)
        })?;
        Ok(run.l2_bps_between(1.0, 3.0))
    }

    /// Runs a UDP flow (or several) from client to server; rates measured at the server.
    pub fn udp(&mut self, options: &Udp) -> Result<UdpResult> {
        let target = if options.ipv6 { SERVER_V6 } else { SERVER_V4 };
        let (client, server) = (self.client.clone(), self.server.clone());
        self.udp_between(&client, &server, target, options)
    }

    /// A UDP run from namespace `from` to `target`, an address of namespace `to`.
    pub fn udp_between(
        &mut self,
        from: &Netns,
        to: &Netns,
        target: &str,
        options: &Udp,
    ) -> Result<UdpResult> {
        let port = options.port.unwrap_or_else(|| self.port());
        self.udp_on_port(from, to, target, port, options)
    }

    /// Several UDP runs at once, each (from, to, target, options) on its own port (the
    /// options' port, else one the lab picks); their results in the same order.
    pub fn udp_concurrently(
        &mut self,
        runs: &[(&Netns, &Netns, &str, &Udp)],
    ) -> Result<Vec<UdpResult>> {
        let ports: Vec<u16> = runs
            .iter()
            .map(|(_, _, _, options)| options.port.unwrap_or_else(|| self.port()))
            .collect();
        let lab = &*self;
        thread::scope(|scope| {
            let handles: Vec<_> = runs
                .iter()
                .zip(ports)
                .map(|(&(from, to, target, options), port)| {
                    scope.spawn(move || lab.udp_on_port(from, to, target, port, options))
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().expect("a UDP run panicked"))
                .collect()
        })
    }

    fn udp_on_port(
        &self,
        from: &Netns,
        to: &Netns,
        target: &str,
        port: u16,
        options: &Udp,
    ) -> Result<UdpResult> {
        let args: Vec<String> = [
            "-c",
            target,
            "-u",
            "-b",
            options.rate,
            "-t",
            &options.seconds.to_string(),
            "-P",
            &options.streams.to_string(),
            "-l",
            &options.length.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut args = args;
        if let Some(tos) = options.tos {
            args.extend(["-S".to_string(), tos.to_string()]);
        }
        if let Some(interval) = options.interval {
            args.extend(["-i".to_string(), interval.to_string()]);
        }
        if let Some(address) = options.bind {
            args.extend(["-B".to_string(), address.to_string()]);
        }
        if let Some(window) = options.window {
            args.extend(["-w".to_string(), window.to_string()]);
        }
        let json = iperf::run(
            from,
            to,
            port,
            &args,
            options.interval.unwrap_or(1.0),
            options.seconds,
        )?;
        let overhead = if options.ipv6 {
            UDP_V6_OVERHEAD
        } else {
            UDP_V4_OVERHEAD
        };
        iperf::parse_udp(&json, options, overhead)
    }

    /// Runs one TCP flow for `seconds`; returns the goodput received by the server (bit/s).
    pub fn tcp(&mut self, seconds: u32) -> Result<f64> {
        self.tcp_with(seconds, "cubic")
    }

    /// One TCP flow with the given congestion control (cubic, bbr, reno).
    pub fn tcp_with(&mut self, seconds: u32, congestion: &str) -> Result<f64> {
        Ok(self.tcp_series(seconds, congestion, 1.0)?.goodput_bps)
    }

    /// One TCP flow, with the server's goodput reported every `interval` seconds.
    pub fn tcp_series(
        &mut self,
        seconds: u32,
        congestion: &str,
        interval: f64,
    ) -> Result<TcpResult> {
        self.tcp_run(&Tcp {
            seconds,
            congestion: congestion.to_string(),
            interval,
            ..Tcp::default()
        })
    }

    /// A TCP run from client to server: `options.flows` parallel flows; the server's
    /// goodput and the sender's smoothed RTT, per interval and over the run.
    pub fn tcp_run(&mut self, options: &Tcp) -> Result<TcpResult> {
        let port = self.port();
        self.tcp_on_port(port, options)
    }

    /// Several TCP runs from client to server at once, each to its own server port (so
    /// classes can tell them apart by `--dport`); results in the same order.
    pub fn tcp_concurrently(&mut self, runs: &[(u16, &Tcp)]) -> Result<Vec<TcpResult>> {
        let lab = &*self;
        thread::scope(|scope| {
            let handles: Vec<_> = runs
                .iter()
                .map(|&(port, options)| scope.spawn(move || lab.tcp_on_port(port, options)))
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().expect("a TCP run panicked"))
                .collect()
        })
    }

    /// TCP runs (each its own iperf3 client and server port) and UDP runs from client to
    /// server, all at once: flows that share one class. Results in the order given.
    pub fn mixed(
        &mut self,
        tcp: &[&Tcp],
        udp: &[&Udp],
    ) -> Result<(Vec<TcpResult>, Vec<UdpResult>)> {
        let tcp_ports: Vec<u16> = tcp.iter().map(|_| self.port()).collect();
        let udp_ports: Vec<u16> = udp
            .iter()
            .map(|options| options.port.unwrap_or_else(|| self.port()))
            .collect();
        let lab = &*self;
        thread::scope(|scope| {
            let tcp_runs: Vec<_> = tcp
                .iter()
                .zip(&tcp_ports)
                .map(|(&options, &port)| scope.spawn(move || lab.tcp_on_port(port, options)))
                .collect();
            let udp_runs: Vec<_> = udp
                .iter()
                .zip(&udp_ports)
                .map(|(&options, &port)| {
                    let target = if options.ipv6 { SERVER_V6 } else { SERVER_V4 };
                    scope.spawn(move || {
                        lab.udp_on_port(&lab.client, &lab.server, target, port, options)
                    })
                })
                .collect();
            let tcp = tcp_runs
                .into_iter()
                .map(|handle| handle.join().expect("a TCP run panicked"))
                .collect::<Result<Vec<_>>>()?;
            let udp = udp_runs
                .into_iter()
                .map(|handle| handle.join().expect("a UDP run panicked"))
                .collect::<Result<Vec<_>>>()?;
            Ok((tcp, udp))
        })
    }

    fn tcp_on_port(&self, port: u16, options: &Tcp) -> Result<TcpResult> {
        let target = if options.ipv6 { SERVER_V6 } else { SERVER_V4 };
        tcp_from_to(&self.client, &self.server, target, port, options)
    }

    /// A TCP run from namespace `from` to the iperf3 server in `to` at `target`.
    pub fn tcp_between(
        &mut self,
        from: &Netns,
        to: &Netns,
        target: &str,
        options: &Tcp,
    ) -> Result<TcpResult> {
        let port = self.port();
        tcp_from_to(from, to, target, port, options)
    }
}

fn tcp_from_to(
    from: &Netns,
    to: &Netns,
    target: &str,
    port: u16,
    options: &Tcp,
) -> Result<TcpResult> {
    let args: Vec<String> = [
        "-c",
        target,
        "-t",
        &options.seconds.to_string(),
        "-C",
        &options.congestion,
        "-i",
        &options.interval.to_string(),
        "-P",
        &options.flows.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut args = args;
    if let Some(address) = options.bind {
        args.extend(["-B".to_string(), address.to_string()]);
    }
    let json = iperf::run(from, to, port, &args, options.interval, options.seconds)?;
    iperf::parse_tcp(&json)
}

/// Sends UDP from namespace `from` to `target:dport` at `rate_bps` (L3 payload bits)
/// for `duration`, every datagram from a fresh socket, so from a new source port: a
/// sender that churns flow keys. Runs on a thread that joins `from` (setns); bounded by
/// the duration and by the datagrams that rate allows. The datagrams sent.
pub fn udp_port_churn(
    from: &Netns,
    target: &str,
    dport: u16,
    rate_bps: f64,
    duration: Duration,
    payload: usize,
) -> thread::JoinHandle<Result<u64>> {
    let from = from.clone();
    let destination = format!("{target}:{dport}");
    thread::spawn(move || {
        from.enter()?;
        let data = vec![0u8; payload];
        let gap = Duration::from_secs_f64(payload as f64 * 8.0 / rate_bps);
        let limit = (duration.as_secs_f64() * rate_bps / (payload as f64 * 8.0)).ceil() as u64;
        let start = std::time::Instant::now();
        let mut sent = 0u64;
        while sent < limit && start.elapsed() < duration {
            let due = start + gap * sent as u32;
            if let Some(wait) = due.checked_duration_since(std::time::Instant::now()) {
                thread::sleep(wait);
            }
            let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
            socket.send_to(&data, &destination)?;
            sent += 1;
        }
        Ok(sent)
    })
}
