//! How iperf3 is run: a one-shot server and its client in two namespaces, both bounded,
//! and the client's JSON read into the results of [`crate::traffic`].

use crate::{
    process::{output_bounded, wait_bounded, wait_listening, Transport},
    topology::Netns,
    traffic::{TcpResult, Udp, UdpResult},
};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    process::{Child, Stdio},
    time::{Duration, Instant},
};

/// How long an iperf3 peer may take beyond the run's own length.
pub const IPERF_GRACE: Duration = Duration::from_secs(15);

/// One iperf3 run of `seconds` from `from` to `to`: a one-shot server, the client with
/// `args`, the client's JSON (with the server's own report inside). Both peers are
/// bounded: together they get the run's length plus [`IPERF_GRACE`]; past it they are
/// killed and the run fails.
pub(crate) fn run(
    from: &Netns,
    to: &Netns,
    port: u16,
    args: &[String],
    interval: f64,
    seconds: u32,
) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(seconds.into()) + IPERF_GRACE;
    // The server listens on the address the client targets: iperf3's UDP replies
    // must come from it, and to a second address of the server they would otherwise
    // leave from the primary one and never reach the client.
    let target = args
        .iter()
        .position(|arg| arg == "-c")
        .and_then(|index| args.get(index + 1))
        .map(String::as_str);
    let mut server = start_server(to, port, interval, target)?;
    let json = run_client(from, port, args, deadline);
    if json.is_err() {
        // The one-shot server may never see its client: do not wait for it.
        let _ = server.kill();
    }
    let waited = wait_bounded(
        &mut server,
        deadline.saturating_duration_since(Instant::now()),
    );
    let json = json?;
    waited.context("the iperf3 server did not exit after its run")?;
    Ok(json)
}

/// Starts a one-shot iperf3 server in `ns`, reporting every `interval` seconds, and waits
/// until it listens. A server that does not listen within 5 s is killed. The caller waits
/// for the returned child with [`wait_bounded`] (or kills it).
pub(crate) fn start_server(
    ns: &Netns,
    port: u16,
    interval: f64,
    bind: Option<&str>,
) -> Result<Child> {
    start_server_with(ns, port, interval, bind, &[])
}

/// [`start_server`] with more of iperf3's server options.
pub(crate) fn start_server_with(
    ns: &Netns,
    port: u16,
    interval: f64,
    bind: Option<&str>,
    options: &[&str],
) -> Result<Child> {
    // `ip netns exec` execs iperf3 itself: the child is the server, and killing it works.
    let mut command = ns.command("iperf3");
    if let Some(address) = bind {
        command.args(["-B", address]);
    }
    command.args(options);
    let mut child = command
        .args(["-s", "-1", "--json", "-p", &port.to_string()])
        .args(["-i", &interval.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the iperf3 server")?;
    match wait_listening(ns, &mut child, Transport::Tcp, port) {
        Ok(()) => Ok(child),
        Err(error) => {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(2));
            Err(error)
        }
    }
}

/// Runs the iperf3 client in `ns` against a server on `port`, killed at `deadline`; its
/// JSON output.
fn run_client(ns: &Netns, port: u16, args: &[String], deadline: Instant) -> Result<Value> {
    let mut command = ns.command("iperf3");
    command.args(["-p", &port.to_string(), "--json", "--get-server-output"]);
    command.args(args);
    let output = output_bounded(
        &mut command,
        deadline.saturating_duration_since(Instant::now()),
    )
    .context("the iperf3 client did not finish in time")?;
    let json: Value = serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "iperf3 printed no JSON: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    if let Some(error) = json.get("error") {
        bail!("iperf3 failed: {error}");
    }
    if !output.status.success() {
        bail!(
            "iperf3 exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(json)
}

/// A UDP run's [`UdpResult`] from the client's JSON (the server's report inside), with
/// `overhead` bytes of headers added to every datagram that arrived.
pub(crate) fn parse_udp(json: &Value, options: &Udp, overhead: u64) -> Result<UdpResult> {
    let server = &json["server_output_json"];
    let intervals = server["intervals"]
        .as_array()
        .context("no server intervals")?;
    // L2 bits of what arrived: payload plus the headers of every datagram.
    let l2_bits = |sample: &Value| {
        let bytes = sample["bytes"].as_u64().unwrap_or(0);
        // iperf3's "packets" counts sequence numbers seen, lost ones included.
        let packets = sample["packets"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(sample["lost_packets"].as_u64().unwrap_or(0));
        (bytes + packets * overhead) as f64 * 8.0
    };
    let streams = options.streams as usize;
    // Steady state: skip the first second, where the initial burst lands, and a short
    // last interval.
    let interval_seconds = options.interval.unwrap_or(1.0);
    let mut per_stream_bits = vec![0.0; streams];
    let mut steady_seconds = 0.0;
    let mut samples = Vec::new();
    for (index, interval) in intervals.iter().enumerate() {
        let sum = &interval["sum"];
        let end = sum["end"].as_f64().unwrap_or(0.0);
        let seconds = sum["seconds"].as_f64().unwrap_or(0.0);
        samples.push((end, l2_bits(sum)));
        if index == 0 || end - seconds < 0.999 || seconds < interval_seconds / 2.0 {
            continue;
        }
        steady_seconds += seconds;
        for (stream_index, stream) in interval["streams"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            if stream_index < streams {
                per_stream_bits[stream_index] += l2_bits(stream);
            }
        }
    }
    if steady_seconds <= 0.0 {
        bail!("the server reported no steady-state interval");
    }
    // The server's totals over the run, summed over its streams.
    let total = |key: &str| -> u64 {
        server["end"]["streams"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|stream| stream["udp"][key].as_u64().unwrap_or(0))
            .sum()
    };
    Ok(UdpResult {
        offered_bps: parse_iperf_rate(options.rate),
        stream_l2_bps: per_stream_bits.iter().map(|b| b / steady_seconds).collect(),
        intervals: samples,
        packets: total("packets"),
        lost_packets: total("lost_packets"),
        out_of_order: total("out_of_order"),
    })
}

/// A TCP run's [`TcpResult`] from the client's JSON: the server's goodput (its report is
/// inside), the sender's smoothed RTT (µs in the JSON, ms here) averaged over the flows.
pub(crate) fn parse_tcp(json: &Value) -> Result<TcpResult> {
    let goodput_bps = json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 JSON has no end.sum_received.bits_per_second")?;
    let intervals = json["server_output_json"]["intervals"]
        .as_array()
        .context("no server intervals")?
        .iter()
        .map(|interval| {
            let sum = &interval["sum"];
            (
                sum["end"].as_f64().unwrap_or(0.0),
                sum["bytes"].as_f64().unwrap_or(0.0) * 8.0,
            )
        })
        .collect();
    // The mean of the flows' values that are there, in ms.
    let mean_ms = |values: Vec<f64>| {
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64 / 1e3)
    };
    let rtt_intervals = json["intervals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|interval| {
            let rtts = interval["streams"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|stream| stream["rtt"].as_f64())
                .collect();
            Some((interval["sum"]["end"].as_f64()?, mean_ms(rtts)?))
        })
        .collect();
    let mean_rtt_ms = mean_ms(
        json["end"]["streams"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|stream| stream["sender"]["mean_rtt"].as_f64())
            .collect(),
    );
    Ok(TcpResult {
        goodput_bps,
        intervals,
        rtt_intervals,
        mean_rtt_ms,
    })
}

/// "100M" -> 100e6 (iperf3's -b spelling).
pub fn parse_iperf_rate(rate: &str) -> f64 {
    let (number, factor) = match rate.chars().last() {
        Some('K') | Some('k') => (&rate[..rate.len() - 1], 1e3),
        Some('M') | Some('m') => (&rate[..rate.len() - 1], 1e6),
        Some('G') | Some('g') => (&rate[..rate.len() - 1], 1e9),
        _ => (rate, 1.0),
    };
    number.parse::<f64>().unwrap_or(0.0) * factor
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tcp_runs_report_the_senders_rtt_averaged_over_flows() {
        let stream = |rtt: u64| json!({"rtt": rtt, "bytes": 1000});
        let json = json!({
            "intervals": [
                {"streams": [stream(40_000), stream(42_000)], "sum": {"end": 1.0}},
                // A flow without an RTT sample is left out of the mean.
                {"streams": [stream(50_000), {"bytes": 0}], "sum": {"end": 2.0}},
                {"streams": [{"bytes": 0}], "sum": {"end": 2.5}},
            ],
            "end": {
                "sum_received": {"bits_per_second": 9.5e6},
                "streams": [
                    {"sender": {"mean_rtt": 44_000}},
                    {"sender": {"mean_rtt": 46_000}},
                ],
            },
            "server_output_json": {
                "intervals": [
                    {"sum": {"end": 1.0, "bytes": 1_000_000}},
                    {"sum": {"end": 2.0, "bytes": 1_250_000}},
                ],
            },
        });
        let result = parse_tcp(&json).unwrap();
        assert_eq!(result.goodput_bps, 9.5e6);
        assert_eq!(result.intervals, vec![(1.0, 8e6), (2.0, 10e6)]);
        assert_eq!(result.rtt_intervals, vec![(1.0, 41.0), (2.0, 50.0)]);
        assert_eq!(result.mean_rtt_ms, Some(45.0));

        let mut without_rtt = json;
        without_rtt["end"]["streams"] = json!([{"sender": {}}]);
        assert_eq!(parse_tcp(&without_rtt).unwrap().mean_rtt_ms, None);
    }
}
