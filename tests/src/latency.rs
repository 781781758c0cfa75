//! Latency as a flow's neighbours see it: the idle RTT ([`idle_rtt_ms`]), a ping probe
//! running beside the traffic ([`LatencyProbe`]), and the RTT the traffic adds over the
//! idle one in steady state ([`AddedRtt`]). Percentiles are nearest-rank.

use crate::{
    process::{
        lines_of, output_bounded, wait_bounded, wait_listening, wait_with_output_bounded, Transport,
    },
    topology::Netns,
};
use anyhow::{bail, ensure, Context as _, Result};
use std::{
    collections::BTreeMap,
    fmt,
    process::{Child, Command, Stdio},
    sync::mpsc::Receiver,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// Probes of an idle-RTT measurement, and their rate.
const IDLE_PROBES: u32 = 20;
const IDLE_HZ: f64 = 20.0;
/// How long a [`LatencyProbe::start`] probe may run at most.
pub const PROBE_LIMIT: Duration = Duration::from_secs(300);
/// ping's sequence numbers are 16 bits: a probe stays below the wrap.
const MAX_PROBES: u64 = 65_000;

/// One echo reply as `ping -n -D` prints it:
/// `[1715000000.123456] 64 bytes from 198.18.2.2: icmp_seq=7 ttl=63 time=40.1 ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PingReply {
    /// When the reply arrived (unix seconds, from `-D`).
    pub unix_s: f64,
    pub seq: u32,
    pub rtt_ms: f64,
    /// A duplicate reply (`(DUP!)`).
    pub duplicate: bool,
}

/// The reply in one line of `ping -n -D` output; None for any other line (the header,
/// errors such as `Destination Host Unreachable`, the summary).
pub fn parse_ping_reply(line: &str) -> Option<PingReply> {
    let rest = line.trim().strip_prefix('[')?;
    let (stamp, rest) = rest.split_once(']')?;
    if !rest.contains(" bytes from ") {
        return None;
    }
    let field = |name: &str| {
        rest.split_whitespace()
            .find_map(|word| word.strip_prefix(name))
    };
    Some(PingReply {
        unix_s: stamp.parse().ok()?,
        seq: field("icmp_seq=")?.parse().ok()?,
        rtt_ms: field("time=")?.parse().ok()?,
        duplicate: rest.contains("(DUP!)"),
    })
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of `values`: the smallest value with
/// at least p % of the values at or below it. None when `values` is empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    // p × n first: whole percentiles of whole counts stay exact.
    let rank = (p * sorted.len() as f64 / 100.0).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The idle RTT from `client` to `target` (ms): the median of 20 pings at 20 Hz. Run it
/// while nothing else crosses the path.
pub fn idle_rtt_ms(client: &Netns, target: &str) -> Result<f64> {
    let interval = format!("{}", 1.0 / IDLE_HZ);
    let count = IDLE_PROBES.to_string();
    // -w: ping gives up after 10 s whatever it got; the wait is bounded beyond that.
    let output = output_bounded(
        client.command("ping").args([
            "-n", "-D", "-i", &interval, "-c", &count, "-w", "10", target,
        ]),
        Duration::from_secs(20),
    )?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let rtts: Vec<f64> = stdout
        .lines()
        .filter_map(parse_ping_reply)
        .filter(|reply| !reply.duplicate)
        .map(|reply| reply.rtt_ms)
        .collect();
    // The first probe may wait for ARP or ND; the median does not mind a few such.
    ensure!(
        rtts.len() as u32 >= IDLE_PROBES / 2,
        "only {} of {IDLE_PROBES} pings to {target} were answered: {}{}",
        rtts.len(),
        stdout.trim(),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(percentile(&rtts, 50.0).expect("there are replies"))
}

/// A ping running in the background (`ping -n -D -i 1/hz`), bounded in probes and time,
/// killed on drop; [`LatencyProbe::finish`] stops it and returns what it saw.
pub struct LatencyProbe {
    child: Option<Child>,
    /// Its stdout lines, read on a thread (at 100 Hz a pipe fills in seconds).
    lines: Receiver<String>,
    started_unix_s: f64,
    hz: f64,
}

impl LatencyProbe {
    /// Pings `target` from `ns` at `hz` (at most 1000) for at most [`PROBE_LIMIT`].
    pub fn start(ns: &Netns, target: &str, hz: f64) -> Result<Self> {
        Self::start_for(ns, target, hz, PROBE_LIMIT)
    }

    /// [`LatencyProbe::start`], ping giving up by itself after `limit`.
    pub fn start_for(ns: &Netns, target: &str, hz: f64, limit: Duration) -> Result<Self> {
        ensure!(
            hz > 0.0 && hz <= 1000.0,
            "probe rate {hz} Hz is outside (0, 1000]"
        );
        let seconds = limit.as_secs_f64().ceil().max(1.0);
        let count = ((seconds * hz).ceil() as u64).min(MAX_PROBES);
        let started_unix_s = unix_now();
        // `ip netns exec` execs ping: the child is ping itself, and signals reach it.
        let mut child = ns
            .command("ping")
            .args(["-n", "-D", "-i", &format!("{}", 1.0 / hz)])
            .args(["-c", &count.to_string(), "-w", &format!("{seconds}")])
            .arg(target)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start ping")?;
        let stdout = child.stdout.take().context("no ping stdout")?;
        let lines = lines_of(stdout);
        Ok(Self {
            child: Some(child),
            lines,
            started_unix_s,
            hz,
        })
    }

    /// Stops the probe (SIGINT, SIGKILL past 5 s) and returns its samples.
    pub fn finish(mut self) -> Result<ProbeSamples> {
        let mut child = self.child.take().context("the probe was stopped")?;
        let _ = output_bounded(
            Command::new("kill").args(["-INT", &child.id().to_string()]),
            Duration::from_secs(5),
        );
        // ping exits 1 when a probe went unanswered: only a hang is an error.
        wait_bounded(&mut child, Duration::from_secs(5)).context("ping did not stop")?;
        // The reader ends with the pipe; bounded anyway, in case something else holds it.
        let mut lines = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            lines.push(line);
        }
        Ok(ProbeSamples::from_lines(
            self.started_unix_s,
            self.hz,
            lines.iter().map(String::as_str),
        ))
    }
}

impl Drop for LatencyProbe {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(5));
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A probe that is no sparse flow: irtt sends isochronous UDP packets from a client to an
/// irtt server at a rate the caller sets above a shape class's sparse threshold, so its
/// packets wait in the class's bulk queue with the bulk flows' and read the delay CoDel
/// lets that queue keep. Its added RTT is over its own idle RTT, measured the same way
/// (irtt's user-space stamps) for a second before the load. The server listens on the
/// lab's server address only, on a port the caller picks; both are killed on drop.
pub struct QueueProbe {
    server: Option<Child>,
    client: Option<Child>,
    started_unix_s: f64,
    /// The median RTT (ms) of the probe on the idle path.
    pub idle_rtt_ms: f64,
    /// The probe's own payload rate (bit/s): part of what the class delivers.
    pub payload_bps: f64,
}

/// The queue probe's packet length (irtt's UDP payload, bytes).
const QUEUE_PROBE_LENGTH: u32 = 1000;
/// How long the idle RTT is measured.
const QUEUE_PROBE_IDLE: Duration = Duration::from_secs(1);

impl QueueProbe {
    /// Probes from `client` to `server`'s `address` on `port` at `payload_bps`, for
    /// `duration` (after a second on the idle path).
    pub fn start(
        client: &Netns,
        server: &Netns,
        address: &str,
        port: u16,
        payload_bps: f64,
        duration: Duration,
    ) -> Result<Self> {
        let interval_us = (f64::from(QUEUE_PROBE_LENGTH) * 8.0 / payload_bps * 1e6).round();
        let bind = format!("{address}:{port}");
        // No minimum interval, no length limit; the test's duration bounds each run.
        let server_child = server
            .command("irtt")
            .args(["server", "-b", &bind, "-i", "0", "-l", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start irtt (Debian package irtt; `cargo xtask setup` installs it)")?;
        let mut probe = Self {
            server: Some(server_child),
            client: None,
            started_unix_s: 0.0,
            idle_rtt_ms: 0.0,
            payload_bps: f64::from(QUEUE_PROBE_LENGTH) * 8.0 / (interval_us / 1e6),
        };
        let server_child = probe.server.as_mut().expect("just started");
        wait_listening(server, server_child, Transport::Udp, port)?;
        let client_run = |run: Duration| {
            client
                .command("irtt")
                .args(["client", "-Q", "-o", "-"])
                .args(["-i", &format!("{interval_us}us")])
                .args(["-l", &QUEUE_PROBE_LENGTH.to_string()])
                .args(["-d", &format!("{}ms", run.as_millis())])
                .arg("--wait=1s")
                .arg(&bind)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("cannot start the irtt client")
        };
        let idle_start = unix_now();
        let idle = irtt_samples(client_run(QUEUE_PROBE_IDLE)?, idle_start)?;
        let rtts: Vec<f64> = idle.samples.iter().map(|(_, rtt)| *rtt).collect();
        probe.idle_rtt_ms = percentile(&rtts, 50.0).context("no irtt reply on the idle path")?;
        probe.started_unix_s = unix_now();
        probe.client = Some(client_run(duration)?);
        Ok(probe)
    }

    /// Waits for the client's end (its duration and a second more) and returns what it
    /// saw: each answered packet's RTT by its reply time, the lost ones by send time.
    pub fn finish(mut self) -> Result<ProbeSamples> {
        let client = self.client.take().context("the queue probe was stopped")?;
        irtt_samples(client, self.started_unix_s)
    }
}

/// The samples of an irtt client run started at `started_unix_s`, once it ends.
fn irtt_samples(client: Child, started_unix_s: f64) -> Result<ProbeSamples> {
    let output = wait_with_output_bounded(client, Duration::from_secs(120))?;
    ensure!(
        output.status.success(),
        "irtt client failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
    let json: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("irtt's JSON output does not parse")?;
    ProbeSamples::from_irtt(started_unix_s, &json)
}

impl Drop for QueueProbe {
    fn drop(&mut self) {
        for child in [self.client.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(5));
        }
    }
}

/// What a [`LatencyProbe`] saw.
#[derive(Debug, Clone, Default)]
pub struct ProbeSamples {
    /// When the probe was started (unix seconds).
    pub started_unix_s: f64,
    /// Answered probes: (unix time the reply arrived s, RTT ms), in arrival order.
    pub samples: Vec<(f64, f64)>,
    /// Lost probes, by their estimated send time (unix seconds): every sequence number
    /// below the highest answered one that got no answer. Probes still in flight when the
    /// probe stopped are not counted.
    pub lost: Vec<f64>,
}

impl ProbeSamples {
    /// The samples in `lines` of ping output, from a probe started at `started_unix_s`
    /// sending at `hz`.
    pub fn from_lines<'a>(
        started_unix_s: f64,
        hz: f64,
        lines: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let mut samples = Vec::new();
        // Send time of each answered sequence number (reply time − RTT).
        let mut sent: BTreeMap<u32, f64> = BTreeMap::new();
        for reply in lines.into_iter().filter_map(parse_ping_reply) {
            if reply.duplicate || sent.contains_key(&reply.seq) {
                continue;
            }
            samples.push((reply.unix_s, reply.rtt_ms));
            sent.insert(reply.seq, reply.unix_s - reply.rtt_ms / 1e3);
        }
        let mut lost = Vec::new();
        if let (Some((&first, _)), Some((&last, _))) =
            (sent.first_key_value(), sent.last_key_value())
        {
            // iputils numbers probes from 1.
            for seq in (1..last).filter(|seq| !sent.contains_key(seq)) {
                // From the nearest answered probe before it (after it, for the first ones),
                // one interval per probe.
                let (anchor, at) = if seq < first {
                    (first, sent[&first])
                } else {
                    let (&anchor, &at) = sent.range(..seq).next_back().expect("first < seq");
                    (anchor, at)
                };
                lost.push(at + (f64::from(seq) - f64::from(anchor)) / hz);
            }
        }
        Self {
            started_unix_s,
            samples,
            lost,
        }
    }

    /// The samples in irtt's JSON output (`round_trips`: each with `lost`, the client's
    /// send and receive wall-clock stamps and the RTT in ns), of a probe started at
    /// `started_unix_s`.
    pub fn from_irtt(started_unix_s: f64, json: &serde_json::Value) -> Result<Self> {
        let trips = json["round_trips"]
            .as_array()
            .context("irtt's output has no round_trips")?;
        let (mut samples, mut lost) = (Vec::new(), Vec::new());
        for trip in trips {
            let client = &trip["timestamps"]["client"];
            let send_s = client["send"]["wall"].as_f64().unwrap_or(0.0) / 1e9;
            if trip["lost"] == "false" {
                let rtt_ms = trip["delay"]["rtt"]
                    .as_f64()
                    .context("an answered irtt packet without an RTT")?
                    / 1e6;
                let reply_s = client["receive"]["wall"].as_f64().unwrap_or(0.0) / 1e9;
                samples.push((reply_s, rtt_ms));
            } else {
                lost.push(send_s);
            }
        }
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Self {
            started_unix_s,
            samples,
            lost,
        })
    }

    /// The RTT added over `idle_rtt_ms` by probes from `after` the probe's start on.
    pub fn added_rtt(&self, after: Duration, idle_rtt_ms: f64) -> Result<AddedRtt> {
        self.added_rtt_between(after, Duration::MAX, idle_rtt_ms)
    }

    /// The RTT added over `idle_rtt_ms` by probes between `from` and `to` after the
    /// probe's start (answered probes by reply time, lost ones by send time).
    pub fn added_rtt_between(
        &self,
        from: Duration,
        to: Duration,
        idle_rtt_ms: f64,
    ) -> Result<AddedRtt> {
        let start = self.started_unix_s + from.as_secs_f64();
        let end = self.started_unix_s + to.as_secs_f64().min(1e9);
        let window = |time: f64| time >= start && time < end;
        let added: Vec<f64> = self
            .samples
            .iter()
            .filter(|(time, _)| window(*time))
            .map(|(_, rtt)| rtt - idle_rtt_ms)
            .collect();
        let lost = self.lost.iter().filter(|time| window(**time)).count();
        let (Some(p50_ms), Some(p99_ms)) = (percentile(&added, 50.0), percentile(&added, 99.0))
        else {
            bail!(
                "no answered probe between {:.1} s and {:.1} s ({} in all, {lost} lost there)",
                from.as_secs_f64(),
                to.as_secs_f64(),
                self.samples.len()
            );
        };
        Ok(AddedRtt {
            p50_ms,
            p99_ms,
            samples: added.len(),
            lost,
        })
    }
}

/// RTT over the idle RTT, as the probes of a window saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AddedRtt {
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Answered probes in the window.
    pub samples: usize,
    /// Lost probes in the window.
    pub lost: usize,
}

impl fmt::Display for AddedRtt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "added RTT p50 {:+.2} ms, p99 {:+.2} ms ({} probes, {} lost)",
            self.p50_ms, self.p99_ms, self.samples, self.lost
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_replies_are_read_from_their_lines() {
        let line = "[1715000000.123456] 64 bytes from 198.18.2.2: icmp_seq=7 ttl=63 time=40.1 ms";
        assert_eq!(
            parse_ping_reply(line),
            Some(PingReply {
                unix_s: 1715000000.123456,
                seq: 7,
                rtt_ms: 40.1,
                duplicate: false
            })
        );
        let v6 = "[1715000001.5] 64 bytes from fd00:2::2: icmp_seq=65000 ttl=63 time=0.045 ms";
        let reply = parse_ping_reply(v6).unwrap();
        assert_eq!((reply.seq, reply.rtt_ms), (65000, 0.045));
        let dup = "[1.0] 64 bytes from 198.18.2.2: icmp_seq=3 ttl=63 time=1234 ms (DUP!)";
        assert!(parse_ping_reply(dup).unwrap().duplicate);
        for other in [
            "PING 198.18.2.2 (198.18.2.2) 56(84) bytes of data.",
            "[1715000000.1] From 198.18.1.1 icmp_seq=4 Destination Host Unreachable",
            "20 packets transmitted, 19 received, 5% packet loss, time 950ms",
            "rtt min/avg/max/mdev = 40.071/40.120/40.301/0.050 ms",
            "",
            // Without -D there is no time stamp to place the sample.
            "64 bytes from 198.18.2.2: icmp_seq=1 ttl=63 time=40.1 ms",
        ] {
            assert_eq!(parse_ping_reply(other), None, "{other:?}");
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        assert_eq!(percentile(&values, 50.0), Some(5.0));
        assert_eq!(percentile(&values, 99.0), Some(10.0));
        assert_eq!(percentile(&values, 90.0), Some(9.0));
        assert_eq!(percentile(&values, 91.0), Some(10.0));
        assert_eq!(percentile(&values, 0.0), Some(1.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[2.0, 1.0, 3.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[], 50.0), None);
        // 100 values: p99 is the 99th, not the largest.
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&hundred, 99.0), Some(99.0));
    }

    fn reply(unix_s: f64, seq: u32, rtt_ms: f64) -> String {
        format!("[{unix_s}] 64 bytes from 198.18.2.2: icmp_seq={seq} ttl=63 time={rtt_ms} ms")
    }

    #[test]
    fn irtt_round_trips_become_samples_and_losses() {
        let trip = |seq: u64, lost: &str, send_ms: u64, rtt_ms: u64| {
            serde_json::json!({
                "seqno": seq,
                "lost": lost,
                "timestamps": {"client": {
                    "send": {"wall": (100_000 + send_ms) * 1_000_000},
                    "receive": {"wall": (100_000 + send_ms + rtt_ms) * 1_000_000},
                }},
                "delay": {"rtt": rtt_ms * 1_000_000},
            })
        };
        let json = serde_json::json!({"round_trips": [
            trip(0, "false", 0, 12),
            trip(1, "true", 4, 0),
            trip(2, "true_down", 8, 0),
            trip(3, "false", 12, 7),
        ]});
        let probe = ProbeSamples::from_irtt(100.0, &json).unwrap();
        assert_eq!(probe.samples, [(100.012, 12.0), (100.019, 7.0)]);
        assert_eq!(probe.lost, [100.004, 100.008]);
        let added = probe.added_rtt(Duration::ZERO, 5.0).unwrap();
        assert_eq!((added.samples, added.lost, added.p99_ms), (2, 2, 7.0));
        assert!(ProbeSamples::from_irtt(100.0, &serde_json::json!({})).is_err());
    }

    #[test]
    fn samples_count_lost_probes_and_skip_the_warm_up() {
        // 10 Hz from t = 100 s: probe n sent at 100 + (n − 1)/10, answered 20 ms later,
        // but 1 (lost at the start), 5 and 6 (lost) and 11 (in flight at the end).
        let mut lines: Vec<String> = (2..=10)
            .filter(|seq| ![5, 6].contains(seq))
            .map(|seq| {
                let rtt = if seq < 4 { 20.0 } else { 25.0 };
                reply(100.0 + f64::from(seq - 1) / 10.0 + rtt / 1e3, seq, rtt)
            })
            .collect();
        lines.insert(3, reply(100.34, 3, 20.0).replace(" ms", " ms (DUP!)"));
        lines.push("11 packets transmitted, 7 received, 36% packet loss".into());
        let probe = ProbeSamples::from_lines(100.0, 10.0, lines.iter().map(String::as_str));
        assert_eq!(probe.samples.len(), 7);
        assert_eq!(probe.lost.len(), 3);
        for (lost, expected) in probe.lost.iter().zip([100.0, 100.4, 100.5]) {
            assert!((lost - expected).abs() < 1e-6, "{:?}", probe.lost);
        }
        // From 0.3 s on: probes 4, 7–10 answered (+5 ms over 20), 5 and 6 lost.
        let added = probe.added_rtt(Duration::from_millis(300), 20.0).unwrap();
        assert_eq!((added.samples, added.lost), (5, 2));
        assert!((added.p50_ms - 5.0).abs() < 1e-9 && (added.p99_ms - 5.0).abs() < 1e-9);
        // All of it: 7 answered, 3 lost, p50 over {0, 0, 5 ×5}.
        let all = probe.added_rtt(Duration::ZERO, 20.0).unwrap();
        assert_eq!((all.samples, all.lost, all.p50_ms), (7, 3, 5.0));
        let early = probe
            .added_rtt_between(Duration::ZERO, Duration::from_millis(250), 20.0)
            .unwrap();
        assert_eq!((early.samples, early.lost, early.p50_ms), (2, 1, 0.0));
        assert!(probe.added_rtt(Duration::from_secs(5), 20.0).is_err());
    }
}

/// A bulk run measured the way a neighbour feels it: goodput and the probe's added RTT
/// over the steady state, and the sender's own smoothed RTT.
#[derive(Debug, Clone)]
pub struct LoadedRun {
    /// The idle RTT (ms) measured just before the load: what added RTTs are over.
    pub idle_rtt_ms: f64,
    /// Goodput (bit/s) over the server's intervals ending after the steady-state start.
    pub steady_goodput_bps: f64,
    /// What the sparse ping probe saw.
    pub added: AddedRtt,
    /// What the queue probe ([`QueueProbe`]) saw, when it ran.
    pub queue: Option<AddedRtt>,
    /// The queue probe's payload rate (bit/s; 0 when it did not run): the class carries
    /// it beside the bulk flows.
    pub queue_probe_bps: f64,
    /// The sender's mean smoothed RTT (ms) over the steady state; None for UDP.
    pub sender_rtt_ms: Option<f64>,
    /// The sender's smoothed RTT per interval: (end s, ms), for plots.
    pub sender_rtt_series: Vec<(f64, f64)>,
    /// The probe's added RTT per answered probe: (s since start, ms), for plots.
    pub probe_series: Vec<(f64, f64)>,
}

/// Probes per second beside the bulk traffic.
pub const PROBE_HZ: f64 = 20.0;
/// The queue probe's irtt server port in the server namespace (irtt's own; iperf3's
/// ports count up from 5202).
const QUEUE_PROBE_PORT: u16 = 2112;

/// Runs `tcp` from the client to the server while a [`PROBE_HZ`] ping from the client to
/// the server runs beside it, and, with `queue_probe` (its payload rate, bit/s), a
/// [`QueueProbe`] too; figures over the seconds from `steady_from` on. Through a delay
/// line, only a run in which it kept time counts ([`crate::Lab::through_delay_line`]).
pub fn tcp_under_probe(
    lab: &mut crate::Lab,
    tcp: &crate::traffic::Tcp,
    steady_from: Duration,
    queue_probe: Option<f64>,
) -> Result<LoadedRun> {
    lab.through_delay_line(|lab| {
        let idle = idle_rtt_ms(&lab.client, crate::topology::SERVER_V4)?;
        let probe = LatencyProbe::start(&lab.client, crate::topology::SERVER_V4, PROBE_HZ)?;
        let queue_probe = queue_probe
            .map(|payload_bps| {
                QueueProbe::start(
                    &lab.client,
                    &lab.server,
                    crate::topology::SERVER_V4,
                    QUEUE_PROBE_PORT,
                    payload_bps,
                    Duration::from_secs(u64::from(tcp.seconds) + 2),
                )
            })
            .transpose()?;
        let queue_probe_bps = queue_probe.as_ref().map_or(0.0, |q| q.payload_bps);
        let queue_idle_ms = queue_probe.as_ref().map_or(0.0, |q| q.idle_rtt_ms);
        let run = lab.tcp_run(tcp);
        let samples = probe.finish()?;
        let queue_samples = queue_probe.map(QueueProbe::finish).transpose()?;
        let run = run?;
        let from = steady_from.as_secs_f64();
        let steady_goodput_bps = run.steady_bps_from(from);
        ensure!(
            steady_goodput_bps > 0.0,
            "no goodput interval after {from} s"
        );
        Ok(LoadedRun {
            idle_rtt_ms: idle,
            steady_goodput_bps,
            added: samples.added_rtt(steady_from, idle)?,
            queue: queue_samples
                .map(|q| q.added_rtt(steady_from, queue_idle_ms))
                .transpose()?,
            queue_probe_bps,
            sender_rtt_ms: run.steady_rtt_ms_from(from),
            sender_rtt_series: run.rtt_intervals.clone(),
            probe_series: series(&samples, idle),
        })
    })
}

/// Runs a UDP flow while the probe runs beside it; the L2 rate delivered from
/// `steady_from` on, and the probe's added RTT.
pub fn udp_under_probe(
    lab: &mut crate::Lab,
    udp: &crate::traffic::Udp,
    steady_from: Duration,
) -> Result<(f64, AddedRtt)> {
    lab.through_delay_line(|lab| {
        let idle = idle_rtt_ms(&lab.client, crate::topology::SERVER_V4)?;
        let probe = LatencyProbe::start(&lab.client, crate::topology::SERVER_V4, PROBE_HZ)?;
        let run = lab.udp(udp);
        let samples = probe.finish()?;
        let run = run?;
        let delivered = run.l2_bps_between(steady_from.as_secs_f64(), udp.seconds as f64);
        Ok((delivered, samples.added_rtt(steady_from, idle)?))
    })
}

fn series(samples: &ProbeSamples, idle_ms: f64) -> Vec<(f64, f64)> {
    samples
        .samples
        .iter()
        .map(|(time, rtt)| (time - samples.started_unix_s, rtt - idle_ms))
        .collect()
}
