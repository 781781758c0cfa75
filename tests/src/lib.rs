//! The network-namespace lab: client → router → server joined by veth pairs.
//!
//! ```text
//!  client ns            router ns                     server ns
//!  c0 198.18.1.2  ───  r0 198.18.1.1 | r1 198.18.2.1  ───  s0 198.18.2.2
//!     fd00:1::2           fd00:1::1  |    fd00:2::1           fd00:2::2
//! ```
//! Addresses come only from 198.18.0.0/15 (benchmarking) and fd00::/8; the namespaces
//! have no route anywhere else. Names are unique per run (`shp<pid>x<n>-…`); dropping
//! the [`Lab`] (also while a test panics) detaches shaper, removes its pins and deletes
//! the namespaces, and [`Lab::new`] first sweeps what a crashed earlier run left behind.

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

pub const CLIENT_V4: &str = "198.18.1.2";
pub const SERVER_V4: &str = "198.18.2.2";
pub const CLIENT_V6: &str = "fd00:1::2";
pub const SERVER_V6: &str = "fd00:2::2";
/// The router's interface toward the server, and the server's interface.
pub const ROUTER_TO_SERVER: &str = "r1";
pub const ROUTER_TO_CLIENT: &str = "r0";
pub const SERVER_DEV: &str = "s0";
pub const CLIENT_DEV: &str = "c0";
const NAME_PREFIX: &str = "shp";
const PIN_ROOT: &str = "/sys/fs/bpf/shaper";
/// Ethernet + IPv4 + UDP headers per datagram, and the IPv6 equivalent.
pub const UDP_V4_OVERHEAD: u64 = 14 + 20 + 8;
pub const UDP_V6_OVERHEAD: u64 = 14 + 40 + 8;

static LAB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// The shaper binary under test: `SHAPER_BIN`, else the workspace's debug build.
pub fn shaper_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SHAPER_BIN") {
        return PathBuf::from(path);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/shaper")
}

fn run_checked(command: &mut Command) -> Result<Output> {
    let output = command
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output)
}

fn ip(args: &[&str]) -> Result<()> {
    run_checked(Command::new("ip").args(args)).map(|_| ())
}

/// A network namespace of the lab.
#[derive(Clone, Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A command run inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name, program]);
        command
    }

    pub fn run(&self, program: &str, args: &[&str]) -> Result<Output> {
        run_checked(self.command(program).args(args))
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    fn sysctl(&self, setting: &str) -> Result<()> {
        self.run("sysctl", &["-qw", setting]).map(|_| ())
    }

    /// Interface counters (rx_bytes, tx_packets, ...) as the kernel keeps them.
    pub fn link_stat(&self, dev: &str, stat: &str) -> Result<u64> {
        let out = self.run("cat", &[&format!("/sys/class/net/{dev}/statistics/{stat}")])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    }
}

pub struct Lab {
    pub client: Netns,
    pub router: Netns,
    pub server: Netns,
    next_port: u16,
}

/// Result of one iperf3 UDP run, measured at the server.
#[derive(Debug, Clone)]
pub struct UdpResult {
    /// Offered payload rate per stream (bit/s).
    pub offered_bps: f64,
    /// Received L2 rate per stream, over the steady-state intervals (bit/s).
    pub stream_l2_bps: Vec<f64>,
    /// The server's interval samples: (end time s, L2 bits summed over streams).
    pub intervals: Vec<(f64, f64)>,
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
    /// Goodput received by the server over the whole run (bit/s).
    pub goodput_bps: f64,
    /// The server's interval samples: (end time s, payload bits received).
    pub intervals: Vec<(f64, f64)>,
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
            tos: None,
            interval: None,
        }
    }
}

impl Lab {
    pub fn new() -> Result<Self> {
        sweep_stale();
        let id = format!(
            "{NAME_PREFIX}{}x{}",
            std::process::id(),
            LAB_COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let lab = Self {
            client: Netns {
                name: format!("{id}-client"),
            },
            router: Netns {
                name: format!("{id}-router"),
            },
            server: Netns {
                name: format!("{id}-server"),
            },
            next_port: 5201,
        };
        // Built inside `lab` so a failure half-way still cleans up on drop.
        lab.build().context("building the lab failed")?;
        Ok(lab)
    }

    fn build(&self) -> Result<()> {
        for ns in [&self.client, &self.router, &self.server] {
            ip(&["netns", "add", &ns.name])?;
            ns.ip(&["link", "set", "lo", "up"])?;
        }
        self.client.ip(&[
            "link",
            "add",
            CLIENT_DEV,
            "type",
            "veth",
            "peer",
            "name",
            ROUTER_TO_CLIENT,
            "netns",
            &self.router.name,
        ])?;
        self.server.ip(&[
            "link",
            "add",
            SERVER_DEV,
            "type",
            "veth",
            "peer",
            "name",
            ROUTER_TO_SERVER,
            "netns",
            &self.router.name,
        ])?;
        let addresses = [
            (&self.client, CLIENT_DEV, "198.18.1.2/24", "fd00:1::2/64"),
            (
                &self.router,
                ROUTER_TO_CLIENT,
                "198.18.1.1/24",
                "fd00:1::1/64",
            ),
            (
                &self.router,
                ROUTER_TO_SERVER,
                "198.18.2.1/24",
                "fd00:2::1/64",
            ),
            (&self.server, SERVER_DEV, "198.18.2.2/24", "fd00:2::2/64"),
        ];
        for (ns, dev, v4, v6) in addresses {
            ns.ip(&["addr", "add", v4, "dev", dev])?;
            ns.ip(&["-6", "addr", "add", v6, "dev", dev, "nodad"])?;
            ns.ip(&["link", "set", dev, "up"])?;
        }
        // Routes only toward the lab's own prefixes: nothing can leave the machine.
        self.client
            .ip(&["route", "add", "198.18.2.0/24", "via", "198.18.1.1"])?;
        self.client
            .ip(&["-6", "route", "add", "fd00:2::/64", "via", "fd00:1::1"])?;
        self.server
            .ip(&["route", "add", "198.18.1.0/24", "via", "198.18.2.1"])?;
        self.server
            .ip(&["-6", "route", "add", "fd00:1::/64", "via", "fd00:2::1"])?;
        self.router.sysctl("net.ipv4.ip_forward=1")?;
        self.router.sysctl("net.ipv6.conf.all.forwarding=1")?;
        Ok(())
    }

    /// Runs `shaper` with `args` (no netns flag added).
    pub fn shaper(&self, args: &[&str]) -> Output {
        Command::new(shaper_bin())
            .args(args)
            .output()
            .expect("cannot run the shaper binary (build it first)")
    }

    /// Runs `shaper --netns NS args...` and fails on a non-zero exit.
    pub fn shaper_in(&self, ns: &Netns, args: &[&str]) -> Result<String> {
        let mut all = vec!["--netns", ns.name.as_str()];
        all.extend_from_slice(args);
        let output = self.shaper(&all);
        if !output.status.success() {
            bail!(
                "shaper {} failed: {}",
                all.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).to_string())
    }

    /// `shaper --netns NS stats --json` as parsed JSON.
    pub fn stats(&self, ns: &Netns) -> Result<Vec<Value>> {
        let text = self.shaper_in(ns, &["stats", "--json"])?;
        Ok(serde_json::from_str::<Value>(&text)?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn port(&mut self) -> u16 {
        self.next_port += 1;
        self.next_port
    }

    /// Starts a one-shot iperf3 server in the server namespace and waits until it listens.
    pub fn iperf_server(&self, port: u16) -> Result<Child> {
        iperf_server_in(&self.server, port, 1.0)
    }

    /// One iperf3 run: a one-shot server, the client with `args`, the client's JSON
    /// (with the server's own report inside).
    fn iperf(&self, port: u16, args: &[String], interval: f64) -> Result<Value> {
        self.iperf_between(&self.client, &self.server, port, args, interval)
    }

    fn iperf_between(
        &self,
        from: &Netns,
        to: &Netns,
        port: u16,
        args: &[String],
        interval: f64,
    ) -> Result<Value> {
        let mut server = iperf_server_in(to, port, interval)?;
        let json = iperf_client_in(from, port, args);
        let _ = server.wait();
        json
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
        let json = self.iperf_between(from, to, port, &args, options.interval.unwrap_or(1.0))?;
        let overhead = if options.ipv6 {
            UDP_V6_OVERHEAD
        } else {
            UDP_V4_OVERHEAD
        };
        parse_udp(&json, options, overhead)
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
        let port = self.port();
        let args: Vec<String> = [
            "-c",
            SERVER_V4,
            "-t",
            &seconds.to_string(),
            "-C",
            congestion,
            "-i",
            &interval.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let json = self.iperf(port, &args, interval)?;
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
        Ok(TcpResult {
            goodput_bps,
            intervals,
        })
    }
}

/// Starts a one-shot iperf3 server in `ns`, reporting every `interval` seconds, and waits
/// until it listens.
fn iperf_server_in(ns: &Netns, port: u16, interval: f64) -> Result<Child> {
    let child = ns
        .command("iperf3")
        .args(["-s", "-1", "--json", "-p", &port.to_string()])
        .args(["-i", &interval.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let out = ns.run("ss", &["-Hltn", &format!("sport = :{port}")])?;
        if !out.stdout.is_empty() {
            return Ok(child);
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!("iperf3 server did not start listening on port {port}");
}

/// Runs the iperf3 client in `ns` against a server on `port`; its JSON output.
fn iperf_client_in(ns: &Netns, port: u16, args: &[String]) -> Result<Value> {
    let mut command = ns.command("timeout");
    // Bounded in time whatever happens to the peer.
    command.args([
        "60",
        "iperf3",
        "-p",
        &port.to_string(),
        "--json",
        "--get-server-output",
    ]);
    command.args(args);
    let output = command.output()?;
    let json: Value = serde_json::from_slice(&output.stdout).with_context(|| {
        format!(
            "iperf3 printed no JSON: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    if let Some(error) = json.get("error") {
        bail!("iperf3 failed: {error}");
    }
    Ok(json)
}

fn parse_udp(json: &Value, options: &Udp, overhead: u64) -> Result<UdpResult> {
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
    Ok(UdpResult {
        offered_bps: crate::parse_iperf_rate(options.rate),
        stream_l2_bps: per_stream_bits.iter().map(|b| b / steady_seconds).collect(),
        intervals: samples,
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

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.client, &self.router, &self.server] {
            remove_namespace(&ns.name);
        }
    }
}

/// Detaches shaper inside `name`, removes its pins, deletes the namespace.
fn remove_namespace(name: &str) {
    let pin_dir = Path::new(PIN_ROOT).join(format!("netns-{name}"));
    if let Ok(devs) = std::fs::read_dir(&pin_dir) {
        for dev in devs.flatten() {
            let dev = dev.file_name().to_string_lossy().to_string();
            let _ = Command::new(shaper_bin())
                .args(["--netns", name, "detach", &dev])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    // Whatever detach could not remove (a missing binary, a half-made attachment).
    let _ = std::fs::remove_dir_all(&pin_dir);
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// Removes namespaces (and their pins) left by lab runs whose process is gone.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('x') else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            remove_namespace(name);
        }
    }
}

/// Asserts `value` is within `tolerance` (fraction) of `expected`, with a clear message.
pub fn assert_within(what: &str, value: f64, expected: f64, tolerance: f64) {
    let error = (value - expected) / expected;
    println!(
        "{what}: {:.3} Mbit/s, expected {:.3} ±{:.1} % → error {:+.2} %",
        value / 1e6,
        expected / 1e6,
        tolerance * 100.0,
        error * 100.0
    );
    assert!(
        error.abs() <= tolerance,
        "{what}: measured {:.3} Mbit/s, expected {:.3} Mbit/s ±{:.1} % (error {:+.2} %)",
        value / 1e6,
        expected / 1e6,
        tolerance * 100.0,
        error * 100.0
    );
}

/// A packet capture (tcpdump) on an interface of a lab namespace, written to a file and
/// read back with filters once stopped. Bounded: `-c` packets at most.
pub struct Capture {
    child: Option<Child>,
    stderr: Option<std::io::BufReader<std::process::ChildStderr>>,
    file: PathBuf,
    /// What tcpdump reported when it stopped (packets captured / dropped by the kernel).
    pub report: String,
}

impl Capture {
    pub fn start(ns: &Netns, dev: &str, filter: &str) -> Result<Self> {
        use std::io::{BufRead as _, BufReader};
        static CAPTURES: AtomicU32 = AtomicU32::new(0);
        let file = std::env::temp_dir().join(format!(
            "shaper-capture-{}-{}.pcap",
            std::process::id(),
            CAPTURES.fetch_add(1, Ordering::SeqCst)
        ));
        let mut child = ns
            .command("tcpdump")
            .args([
                "-i",
                dev,
                "-n",
                "-U",
                "--immediate-mode",
                "-c",
                "2000000",
                "-s",
                "128",
                "-w",
            ])
            .arg(&file)
            .arg(filter)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start tcpdump")?;
        // tcpdump says "listening on ..." once it captures.
        let mut stderr = BufReader::new(child.stderr.take().context("no tcpdump stderr")?);
        let mut line = String::new();
        stderr.read_line(&mut line)?;
        if !line.contains("listening") {
            let _ = child.kill();
            bail!("tcpdump did not start: {line}");
        }
        Ok(Self {
            child: Some(child),
            stderr: Some(stderr),
            file,
            report: String::new(),
        })
    }

    /// Stops capturing (flushes the file).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // tcpdump may still be draining its ring when the traffic ends: wait until the
            // file stops growing (at most 3 s), or SIGINT would lose the last packets.
            let size = || std::fs::metadata(&self.file).map(|m| m.len()).unwrap_or(0);
            let mut last = size();
            for _ in 0..15 {
                thread::sleep(Duration::from_millis(200));
                let now = size();
                if now == last {
                    break;
                }
                last = now;
            }
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            if let Some(mut stderr) = self.stderr.take() {
                use std::io::Read as _;
                let _ = stderr.read_to_string(&mut self.report);
            }
            let _ = child.wait();
        }
    }

    /// The decoded lines (`tcpdump -v`) of the captured packets matching `filter`.
    pub fn lines(&mut self, filter: &str) -> Result<Vec<String>> {
        self.stop();
        let output = run_checked(
            Command::new("tcpdump")
                .args(["-r"])
                .arg(&self.file)
                .args(["-n", "-t", "-v", filter]),
        )?;
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        // -v puts each IP header on its own line starting with the address family.
        Ok(text
            .lines()
            .filter(|l| l.starts_with("IP"))
            .map(str::to_string)
            .collect())
    }

    /// How many captured packets match `filter`.
    pub fn count(&mut self, filter: &str) -> Result<usize> {
        Ok(self.lines(filter)?.len())
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.file);
    }
}
