//! The network-namespace lab: client → router → server joined by veth pairs.
//!
//! ```text
//!  client ns            router ns                     server ns
//!  c0 198.18.1.2  ───  r0 198.18.1.1 | r1 198.18.2.1  ───  s0 198.18.2.2
//!     fd00:1::2           fd00:1::1  |    fd00:2::1           fd00:2::2
//! ```
//! Addresses come only from 198.18.0.0/15 (benchmarking) and fd00::/8; the namespaces
//! have no route anywhere else. Names are unique per run (`shp<pid>x<n>-…`); dropping
//! the [`Lab`] (also while a test panics) kills what still runs inside, detaches shaper,
//! removes its pins and deletes the namespaces, and [`Lab::new`] first sweeps what a
//! crashed earlier run left behind (namespaces, pins, CNI records and leases).
//!
//! Every wait on a child process is bounded ([`wait_bounded`], [`output_bounded`]): a
//! peer that hangs fails the test instead of hanging the suite. Without `SHAPER_BIN`, the
//! first use of [`shaper_bin`] builds the shaper-cli package, so a plain `cargo test`
//! never runs a stale binary.

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc, OnceLock,
    },
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
/// Where shaper-cni records the host interface of each container (shaper-cli/src/cni.rs).
pub const CNI_RECORD_DIR: &str = "/run/shaper/cni";
/// CNI_CONTAINERID prefixes of the tests and the bench: `<prefix><pid>`, so the sweep can
/// tell the records of dead runs.
pub const CNI_TEST_CONTAINER_PREFIXES: [&str; 2] = ["shaper-test-", "shaper-bench-"];
/// host-local's data directory of the CNI test: `<temp>/shaper-test-ipam-<pid>`.
const CNI_IPAM_PREFIX: &str = "shaper-test-ipam-";
/// Ethernet + IPv4 + UDP headers per datagram, and the IPv6 equivalent.
pub const UDP_V4_OVERHEAD: u64 = 14 + 20 + 8;
pub const UDP_V6_OVERHEAD: u64 = 14 + 40 + 8;
/// How long a command of the lab (ip, tc, ss, sysctl, a shaper command) may take.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(120);
/// How long an iperf3 peer may take beyond the run's own length.
pub const IPERF_GRACE: Duration = Duration::from_secs(15);
/// How long building shaper for the tests may take.
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);

static LAB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// The shaper binary under test: `SHAPER_BIN`, else the workspace's own build of the
/// shaper-cli package (shaper and shaper-cni), made once per test process so that
/// `cargo test` outside xtask never runs a stale binary. Panics when that build fails.
pub fn shaper_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SHAPER_BIN") {
        return PathBuf::from(path);
    }
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(|| build_shaper().map_err(|e| format!("{e:#}"))) {
        Ok(path) => path.clone(),
        Err(error) => panic!(
            "SHAPER_BIN is not set and `cargo build --package shaper-cli` failed: {error}\n\
             (run the lab tests with `cargo xtask test`, or build shaper yourself and set \
             SHAPER_BIN=target/debug/shaper)"
        ),
    }
}

/// `cargo build --package shaper-cli` from the workspace root, with the cargo running
/// these tests; the path of the `shaper` executable it reports.
fn build_shaper() -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate lives in the workspace")?;
    eprintln!("SHAPER_BIN is not set: building shaper (cargo build --package shaper-cli)");
    let child = Command::new(&cargo)
        .current_dir(root)
        .args([
            "build",
            "--package",
            "shaper-cli",
            "--message-format=json-render-diagnostics",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot run {}", cargo.to_string_lossy()))?;
    let output = wait_with_output_bounded(child, BUILD_LIMIT)?;
    if !output.status.success() {
        bail!("cargo exited with {} (its errors are above)", output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let executable = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| {
            message["reason"] == "compiler-artifact" && message["target"]["name"] == "shaper"
        })
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .context("cargo reported no shaper executable")?;
    for binary in [executable.clone(), executable.with_file_name("shaper-cni")] {
        if !binary.exists() {
            bail!("{} is missing after the build", binary.display());
        }
    }
    Ok(executable)
}

/// Waits for `child` at most `limit`; past it, kills the child and fails. Every wait on a
/// child of the lab goes through here, so a hung peer fails a test instead of hanging it.
pub fn wait_bounded(child: &mut Child, limit: Duration) -> Result<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("cannot wait for process {}", child.id()))?
        {
            return Ok(status);
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        thread::sleep((deadline - now).min(Duration::from_millis(20)));
    }
    let _ = child.kill();
    // SIGKILL is immediate but for a process stuck in the kernel: reap it, briefly.
    let reap_deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < reap_deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "process {} was still running after {:.1} s: killed",
        child.id(),
        limit.as_secs_f64()
    )
}

/// `wait_with_output` bounded by `limit` (see [`wait_bounded`]): the child's stdout and
/// stderr (those that were piped) are read by threads meanwhile.
pub fn wait_with_output_bounded(mut child: Child, limit: Duration) -> Result<Output> {
    let (sender, receiver) = mpsc::channel();
    let mut readers = 0;
    let pipes: [Option<Box<dyn std::io::Read + Send>>; 2] = [
        child.stdout.take().map(|p| Box::new(p) as _),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    for (index, pipe) in pipes.into_iter().enumerate() {
        if let Some(mut pipe) = pipe {
            let sender = sender.clone();
            readers += 1;
            thread::spawn(move || {
                let mut buffer = Vec::new();
                let _ = pipe.read_to_end(&mut buffer);
                let _ = sender.send((index, buffer));
            });
        }
    }
    let status = wait_bounded(&mut child, limit);
    // The pipes close with the child, unless it left a process behind holding them.
    let mut outputs = [Vec::new(), Vec::new()];
    let drain_deadline = Instant::now() + Duration::from_secs(5);
    for _ in 0..readers {
        let left = drain_deadline.saturating_duration_since(Instant::now());
        match receiver.recv_timeout(left) {
            Ok((index, buffer)) => outputs[index] = buffer,
            Err(_) => break,
        }
    }
    let [stdout, stderr] = outputs;
    match status {
        Ok(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        Err(error) => Err(error.context(format!(
            "stderr so far: {}",
            String::from_utf8_lossy(&stderr).trim()
        ))),
    }
}

/// `command.output()` bounded by `limit` (stdin empty, stdout and stderr captured).
pub fn output_bounded(command: &mut Command, limit: Duration) -> Result<Output> {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {command:?}"))?;
    wait_with_output_bounded(child, limit).with_context(|| format!("{command:?}"))
}

fn run_checked(command: &mut Command) -> Result<Output> {
    let output = output_bounded(command, COMMAND_LIMIT)?;
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

impl TcpResult {
    /// Goodput (bit/s) over the intervals after the first second: the initial burst a
    /// policer grants lands in the first second, so this is what the rate alone allows.
    pub fn steady_bps(&self) -> f64 {
        let (mut bits, mut seconds, mut previous_end) = (0.0, 0.0, 0.0);
        for &(end, interval_bits) in &self.intervals {
            if previous_end >= 0.999 && end - previous_end >= 0.5 {
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
        }
    }
}

impl Lab {
    pub fn new() -> Result<Self> {
        // Resolved (built, without SHAPER_BIN) before anything needs cleaning up with it.
        shaper_bin();
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
        output_bounded(Command::new(shaper_bin()).args(args), COMMAND_LIMIT)
            .unwrap_or_else(|e| panic!("running shaper failed: {e:#}"))
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
        iperf_server_in(&self.server, port, 1.0, None)
    }

    /// One iperf3 run of `seconds`: a one-shot server, the client with `args`, the
    /// client's JSON (with the server's own report inside).
    fn iperf(&self, port: u16, args: &[String], interval: f64, seconds: u32) -> Result<Value> {
        self.iperf_between(&self.client, &self.server, port, args, interval, seconds)
    }

    /// Both peers are bounded: together they get the run's length plus [`IPERF_GRACE`];
    /// past it they are killed and the run fails.
    fn iperf_between(
        &self,
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
        let mut server = iperf_server_in(to, port, interval, target)?;
        let json = iperf_client_in(from, port, args, deadline);
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

    /// Several UDP runs at once, each (from, to, target, options) on its own port; their
    /// results in the same order.
    pub fn udp_concurrently(
        &mut self,
        runs: &[(&Netns, &Netns, &str, &Udp)],
    ) -> Result<Vec<UdpResult>> {
        let ports: Vec<u16> = runs.iter().map(|_| self.port()).collect();
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
        let json = self.iperf_between(
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
        let json = self.iperf(port, &args, interval, seconds)?;
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
/// until it listens. A server that does not listen within 5 s is killed. The caller waits
/// for the returned child with [`wait_bounded`] (or kills it).
fn iperf_server_in(ns: &Netns, port: u16, interval: f64, bind: Option<&str>) -> Result<Child> {
    // `ip netns exec` execs iperf3 itself: the child is the server, and killing it works.
    let mut command = ns.command("iperf3");
    if let Some(address) = bind {
        command.args(["-B", address]);
    }
    let mut child = command
        .args(["-s", "-1", "--json", "-p", &port.to_string()])
        .args(["-i", &interval.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the iperf3 server")?;
    match wait_listening(ns, port, &mut child) {
        Ok(()) => Ok(child),
        Err(error) => {
            let _ = child.kill();
            let _ = wait_bounded(&mut child, Duration::from_secs(2));
            Err(error)
        }
    }
}

fn wait_listening(ns: &Netns, port: u16, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("the iperf3 server on port {port} exited before listening ({status})");
        }
        let out = ns.run("ss", &["-Hltn", &format!("sport = :{port}")])?;
        if !out.stdout.is_empty() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!("iperf3 server did not start listening on port {port}");
}

/// Runs the iperf3 client in `ns` against a server on `port`, killed at `deadline`; its
/// JSON output.
fn iperf_client_in(ns: &Netns, port: u16, args: &[String], deadline: Instant) -> Result<Value> {
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

/// The pids of the processes inside namespace `name` (`ip netns pids`).
fn pids_in(name: &str) -> Vec<u32> {
    let own = std::process::id();
    output_bounded(
        Command::new("ip").args(["netns", "pids", name]),
        Duration::from_secs(10),
    )
    .map(|out| {
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|pid| pid.parse().ok())
            .filter(|pid| *pid != own)
            .collect()
    })
    .unwrap_or_default()
}

/// SIGKILLs every process inside namespace `name` and waits (at most 3 s) until none is
/// left. Returns the pids still there at the deadline.
fn kill_processes_in(name: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let pids = pids_in(name);
        if pids.is_empty() || Instant::now() >= deadline {
            return pids;
        }
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let _ = output_bounded(
            Command::new("kill").arg("-KILL").args(&pids),
            Duration::from_secs(5),
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Kills what still runs inside `name`, detaches shaper there, removes its pins, deletes
/// the namespace.
fn remove_namespace(name: &str) {
    if Path::new("/run/netns").join(name).exists() {
        let left = kill_processes_in(name);
        if !left.is_empty() {
            eprintln!("lab: processes {left:?} survived SIGKILL in namespace {name}");
        }
    }
    remove_namespace_pins(name);
    let _ = output_bounded(
        Command::new("ip").args(["netns", "del", name]),
        Duration::from_secs(30),
    );
}

/// Detaches shaper from every interface it has pins for in namespace `name` (which may
/// be gone: `detach` then only removes the pins), then removes what is left of the pins.
fn remove_namespace_pins(name: &str) {
    let pin_dir = Path::new(PIN_ROOT).join(format!("netns-{name}"));
    if let Ok(devs) = std::fs::read_dir(&pin_dir) {
        for dev in devs.flatten() {
            let dev = dev.file_name().to_string_lossy().to_string();
            let _ = output_bounded(
                Command::new(shaper_bin()).args(["--netns", name, "detach", &dev]),
                COMMAND_LIMIT,
            );
        }
    }
    // Whatever detach could not remove (a missing binary, a half-made attachment).
    let _ = std::fs::remove_dir_all(&pin_dir);
}

/// The pid in a lab name `shp<pid>x<n>-…`.
fn lab_pid(name: &str) -> Option<u32> {
    let (pid, _) = name.strip_prefix(NAME_PREFIX)?.split_once('x')?;
    pid.parse().ok()
}

/// The pid in `<prefix><pid>[-…]`, for one of `prefixes`.
fn pid_after_prefix(name: &str, prefixes: &[&str]) -> Option<u32> {
    let rest = prefixes.iter().find_map(|p| name.strip_prefix(p))?;
    let digits = rest.split('-').next()?;
    digits.parse().ok()
}

fn process_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The names of the current network namespaces (`ip netns list`).
fn namespaces() -> Vec<String> {
    output_bounded(
        Command::new("ip").args(["netns", "list"]),
        Duration::from_secs(10),
    )
    .map(|out| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| line.split_whitespace().next().map(str::to_string))
            .collect()
    })
    .unwrap_or_default()
}

fn names_in(dir: impl AsRef<Path>) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().to_string())
        .collect()
}

/// Whether an interface `dev` exists in the host's namespace or in any named one. When
/// a namespace cannot be asked, the answer is yes (nothing is removed on a doubt).
fn interface_exists_anywhere(dev: &str) -> bool {
    if Path::new("/sys/class/net").join(dev).exists() {
        return true;
    }
    namespaces().iter().any(|ns| {
        match output_bounded(
            Command::new("ip").args(["-n", ns, "-o", "link", "show", "dev", dev]),
            Duration::from_secs(10),
        ) {
            Ok(out) => out.status.success(),
            Err(_) => true,
        }
    })
}

/// A host-side interface name a crashed CNI test or bench run could have left pins for
/// under `host/`: the bridge plugin's `veth` + 8 hex digits (the test), the lab's `r1`
/// (the bench runs shaper-cni on it).
fn test_made_host_dev(dev: &str) -> bool {
    let random_veth = dev
        .strip_prefix("veth")
        .is_some_and(|hex| hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    random_veth || dev == ROUTER_TO_SERVER
}

/// Removes what lab runs whose process is gone left behind: their namespaces (with the
/// processes still inside and shaper's pins), pins of their namespaces that are already
/// gone, their CNI records and IPAM directories, and host pins of the interfaces those
/// CNI runs attached to, once no namespace has such an interface any more.
fn sweep_stale() {
    // Namespaces of dead runs.
    for name in namespaces() {
        if lab_pid(&name).is_some_and(|pid| !process_alive(pid)) {
            remove_namespace(&name);
        }
    }
    // Pins of lab namespaces that are gone, of dead runs only (a live test may delete a
    // namespace on purpose and look at its pins).
    for entry in names_in(PIN_ROOT) {
        let Some(name) = entry.strip_prefix("netns-") else {
            continue;
        };
        if lab_pid(name).is_some_and(|pid| !process_alive(pid))
            && !Path::new("/run/netns").join(name).exists()
        {
            remove_namespace_pins(name);
        }
    }
    // CNI records of dead runs; the interfaces they name are candidates below.
    let mut host_devs: Vec<String> = Vec::new();
    for record in names_in(CNI_RECORD_DIR) {
        if pid_after_prefix(&record, &CNI_TEST_CONTAINER_PREFIXES)
            .is_some_and(|pid| !process_alive(pid))
        {
            let path = Path::new(CNI_RECORD_DIR).join(&record);
            if let Ok(dev) = std::fs::read_to_string(&path) {
                host_devs.push(dev.trim().to_string());
            }
            let _ = std::fs::remove_file(&path);
        }
    }
    // host-local's leases of dead CNI test runs.
    for dir in names_in(std::env::temp_dir()) {
        if pid_after_prefix(&dir, &[CNI_IPAM_PREFIX]).is_some_and(|pid| !process_alive(pid)) {
            let _ = std::fs::remove_dir_all(std::env::temp_dir().join(dir));
        }
    }
    // Host pins of test-made interfaces that no longer exist anywhere.
    let host_pins = Path::new(PIN_ROOT).join("host");
    for dev in names_in(&host_pins) {
        let candidate = test_made_host_dev(&dev) || host_devs.contains(&dev);
        if candidate && !dev.is_empty() && !interface_exists_anywhere(&dev) {
            let _ = std::fs::remove_dir_all(host_pins.join(&dev));
        }
    }
}

/// The record shaper-cni keeps for a container's interface (shaper-cli/src/cni.rs).
pub fn cni_record_path(container_id: &str, ifname: &str) -> PathBuf {
    let safe = |s: &str| s.replace(['/', '.'], "_");
    Path::new(CNI_RECORD_DIR).join(format!("{}-{}", safe(container_id), safe(ifname)))
}

/// What CNI plugins run by a test may leave behind when it fails half-way, removed on
/// drop (also while panicking): shaper's attachment on the host-side interface and its
/// pins (under `host/`, as the plugin runs with only the host's network namespace),
/// shaper-cni's record, host-local's leases. Harmless when everything was deleted.
pub struct CniLeftovers {
    /// The namespace playing the host (the plugins ran under `nsenter --net` into it);
    /// None for the host's own.
    pub host_netns: Option<String>,
    /// CNI_CONTAINERID and CNI_IFNAME of the plugin runs.
    pub container_id: String,
    pub ifname: String,
    /// The host-side interface, once known.
    pub host_dev: Option<String>,
    /// host-local's data directory, if IPAM was used.
    pub ipam_dir: Option<PathBuf>,
}

impl Drop for CniLeftovers {
    fn drop(&mut self) {
        if let Some(dev) = &self.host_dev {
            let pins = Path::new(PIN_ROOT).join("host").join(dev);
            if pins.exists() {
                // Detach first, so the hook goes even where the interface stays.
                let mut detach = match &self.host_netns {
                    Some(ns) => {
                        let mut command = Command::new("nsenter");
                        command
                            .arg(format!("--net=/run/netns/{ns}"))
                            .arg(shaper_bin());
                        command
                    }
                    None => Command::new(shaper_bin()),
                };
                let _ = output_bounded(detach.args(["detach", dev]), COMMAND_LIMIT);
                let _ = std::fs::remove_dir_all(&pins);
            }
        }
        let _ = std::fs::remove_file(cni_record_path(&self.container_id, &self.ifname));
        if let Some(dir) = &self.ipam_dir {
            let _ = std::fs::remove_dir_all(dir);
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
        // tcpdump says "listening on ..." once it captures: read on a thread, so a
        // tcpdump that never says it cannot hang the test (10 s at most).
        let mut stderr = BufReader::new(child.stderr.take().context("no tcpdump stderr")?);
        let (sender, receiver) = mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let read = stderr.read_line(&mut line);
            let _ = sender.send((read.map(|_| line), stderr));
        });
        let started = receiver.recv_timeout(Duration::from_secs(10));
        let stderr = match started {
            Ok((Ok(line), stderr)) if line.contains("listening") => stderr,
            other => {
                let _ = child.kill();
                let _ = wait_bounded(&mut child, Duration::from_secs(2));
                let why = match other {
                    Ok((Ok(line), _)) => line,
                    Ok((Err(error), _)) => error.to_string(),
                    Err(_) => "nothing said within 10 s".to_string(),
                };
                bail!("tcpdump did not start: {why}");
            }
        };
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
            let _ = output_bounded(
                Command::new("kill").args(["-INT", &child.id().to_string()]),
                Duration::from_secs(5),
            );
            // tcpdump flushes and exits on SIGINT; one that does not is killed at 10 s.
            if let Err(error) = wait_bounded(&mut child, Duration::from_secs(10)) {
                self.report = format!("tcpdump did not stop on SIGINT: {error:#}\n");
            }
            // The child is gone: its stderr is at its end.
            if let Some(mut stderr) = self.stderr.take() {
                let _ = stderr.read_to_string(&mut self.report);
            }
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

/// Asserts that steady-state TCP goodput ([`TcpResult::steady_bps`]), as a fraction of the
/// class rate, lies in `lower..=0.99`. The upper bound is what makes the check bite:
/// goodput is payload, the rate counts every header (a full-size TCP segment carries 1448
/// of its 1514 bytes), so a limiter that did nothing would give many times the rate. A
/// working policer admits at most burst + rate × t in any window t: with the default burst
/// (250 ms at the rate) over the 9 s after the first second of a 10 s run that is at most
/// 0.956 × (1 + 0.25 / 9) = 0.983 of the rate, below 0.99 even when every loss lets the
/// bucket refill.
pub fn assert_goodput_fraction(what: &str, fraction: f64, lower: f64) {
    println!(
        "{what}: goodput {:.1} % of the rate (expected {:.0}–99 %)",
        fraction * 100.0,
        lower * 100.0
    );
    assert!(
        (lower..=0.99).contains(&fraction),
        "{what}: goodput {:.1} % of the rate, outside {:.0}–99 %",
        fraction * 100.0,
        lower * 100.0
    );
}

/// Ids of every BPF program loaded in the kernel.
pub fn loaded_program_ids() -> Vec<u32> {
    aya::programs::loaded_programs()
        .flatten()
        .map(|p| p.id())
        .collect()
}

/// Asserts that none of the programs `ids` is loaded any more. TCX links are not tc
/// filters, so "no filter left" proves nothing under TCX: a detached program is gone
/// from the kernel. It is freed asynchronously (RCU): polled for up to 2 s.
pub fn assert_programs_unloaded(what: &str, ids: &[u32]) {
    assert!(!ids.is_empty(), "{what}: no program ids to check");
    let mut left = ids.to_vec();
    for _ in 0..100 {
        let loaded = loaded_program_ids();
        left.retain(|id| loaded.contains(id));
        if left.is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
    panic!("{what}: programs {left:?} still loaded 2 s later");
}

/// The program ids of every row of `shaper status --json` output for `dev`.
pub fn status_program_ids(status_json: &str, dev: &str) -> Vec<u32> {
    serde_json::from_str::<Value>(status_json)
        .unwrap_or_default()
        .as_array()
        .into_iter()
        .flatten()
        .filter(|row| row["dev"] == dev)
        .filter_map(|row| row["program_id"].as_u64().map(|id| id as u32))
        .collect()
}

/// `output()` and `status()` of a [`Command`], bounded by [`COMMAND_LIMIT`]: a child that
/// hangs is killed and the call fails, instead of hanging the suite.
pub trait BoundedCommand {
    fn output_within_limit(&mut self) -> Result<Output>;
    fn status_within_limit(&mut self) -> Result<ExitStatus>;
}

impl BoundedCommand for Command {
    fn output_within_limit(&mut self) -> Result<Output> {
        output_bounded(self, COMMAND_LIMIT)
    }

    fn status_within_limit(&mut self) -> Result<ExitStatus> {
        Ok(output_bounded(self, COMMAND_LIMIT)?.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_past_its_limit_kills_the_child_and_fails() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let started = Instant::now();
        let error = wait_bounded(&mut child, Duration::from_millis(500)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3), "{error:#}");
        assert!(error.to_string().contains("killed"), "{error:#}");
        // Killed and reaped.
        assert!(child.try_wait().unwrap().is_some());

        let error = output_bounded(
            Command::new("sh").args(["-c", "echo started >&2; sleep 30"]),
            Duration::from_millis(500),
        )
        .unwrap_err();
        assert!(format!("{error:#}").contains("started"), "{error:#}");

        let output = output_bounded(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(
            (&output.stdout[..], &output.stderr[..]),
            (&b"out\n"[..], &b"err\n"[..])
        );
    }

    /// A one-shot iperf3 server that never gets its client (as with a TCP bug) ends in an
    /// error at the bound, not in a hang; and dropping the lab kills what runs inside.
    #[test]
    fn a_server_without_client_is_killed_at_the_bound() {
        let lab = Lab::new().unwrap();
        let mut server = lab.iperf_server(5999).unwrap();
        let started = Instant::now();
        let error = wait_bounded(&mut server, Duration::from_secs(2)).unwrap_err();
        println!("{error:#} after {:.1} s", started.elapsed().as_secs_f64());
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(pids_in(&lab.server.name).is_empty());

        // Left running on purpose: the lab's drop must kill it.
        let mut stray = lab.router.command("sleep").arg("300").spawn().unwrap();
        // (`ip netns exec` enters the namespace a moment after the spawn.)
        let deadline = Instant::now() + Duration::from_secs(2);
        while pids_in(&lab.router.name).is_empty() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pids_in(&lab.router.name), vec![stray.id()]);
        let router = lab.router.name.clone();
        drop(lab);
        assert!(wait_bounded(&mut stray, Duration::from_secs(2)).is_ok());
        assert!(!Path::new("/run/netns").join(router).exists());
    }

    /// What a CNI run that failed half-way leaves (shaper attached to the host-side
    /// interface with its pins under `host/`, the record, the IPAM directory) goes with
    /// the guard.
    #[test]
    fn cni_leftovers_go_with_the_guard() {
        let lab = Lab::new().unwrap();
        let dev = format!("cg{}", std::process::id());
        lab.router
            .run(
                "ip",
                &[
                    "link",
                    "add",
                    &dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &format!("{dev}p"),
                ],
            )
            .unwrap();
        let nsenter = |args: &[&str]| {
            output_bounded(
                Command::new("nsenter")
                    .arg(format!("--net=/run/netns/{}", lab.router.name))
                    .arg(shaper_bin())
                    .args(args),
                COMMAND_LIMIT,
            )
            .unwrap()
        };
        assert!(nsenter(&["attach", &dev]).status.success());
        let pins = Path::new(PIN_ROOT).join("host").join(&dev);
        assert!(pins.exists());
        let container_id = format!("shaper-test-{}", std::process::id());
        let record = cni_record_path(&container_id, "unit0");
        let record_dir_existed = Path::new(CNI_RECORD_DIR).exists();
        std::fs::create_dir_all(CNI_RECORD_DIR).unwrap();
        std::fs::write(&record, &dev).unwrap();
        let ipam_dir =
            std::env::temp_dir().join(format!("shaper-test-unit-ipam-{}", std::process::id()));
        std::fs::create_dir_all(ipam_dir.join("net")).unwrap();

        drop(CniLeftovers {
            host_netns: Some(lab.router.name.clone()),
            container_id,
            ifname: "unit0".into(),
            host_dev: Some(dev.clone()),
            ipam_dir: Some(ipam_dir.clone()),
        });
        assert!(!pins.exists() && !record.exists() && !ipam_dir.exists());
        if !record_dir_existed {
            let _ = std::fs::remove_dir(CNI_RECORD_DIR);
            let _ = std::fs::remove_dir("/run/shaper");
        }
    }

    #[test]
    fn the_sweep_recognises_only_what_tests_make() {
        assert_eq!(lab_pid("shp1234x0-router"), Some(1234));
        assert_eq!(lab_pid("shp1234x0-router-gone"), Some(1234));
        assert_eq!(lab_pid("cni-1234"), None);
        let prefixes = &CNI_TEST_CONTAINER_PREFIXES;
        assert_eq!(pid_after_prefix("shaper-test-77-eth1", prefixes), Some(77));
        assert_eq!(pid_after_prefix("shaper-bench-77-s0", prefixes), Some(77));
        assert_eq!(pid_after_prefix("k8s-pod-77-eth0", prefixes), None);
        assert_eq!(
            pid_after_prefix("shaper-test-ipam-9", &[CNI_IPAM_PREFIX]),
            Some(9)
        );
        assert!(test_made_host_dev("veth0a1b2c3d"));
        assert!(test_made_host_dev("r1"));
        assert!(!test_made_host_dev("veth0a1b2c3")); // Docker's 7 hex digits
        assert!(!test_made_host_dev("eth0"));
        assert_eq!(
            cni_record_path("shaper-test-5", "eth1"),
            Path::new("/run/shaper/cni/shaper-test-5-eth1")
        );
    }
}
