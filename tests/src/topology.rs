//! The lab's topology: client → router → server, joined by veth pairs.
//!
//! ```text
//!  client ns            router ns                     server ns
//!  c0 198.18.1.2  ───  r0 198.18.1.1 | r1 198.18.2.1  ───  s0 198.18.2.2
//!     fd00:1::2           fd00:1::1  |    fd00:2::1           fd00:2::2
//! ```
//! Addresses come only from 198.18.0.0/15 (benchmarking) and fd00::/8; the namespaces
//! have no route anywhere else. [`Lab::with_delay`] puts a fourth namespace with a delay
//! line between `r1` and `s0` (see [`crate::delay`]); addresses, routes and the router's
//! bottleneck `r1` stay the same. Names are unique per run (`shp<pid>x<n>-…`); dropping
//! the [`Lab`] (also while a test panics) removes what it made (see [`crate::cleanup`]),
//! and [`Lab::new`] first sweeps what a crashed earlier run left behind.

use crate::{
    cleanup::{remove_namespace, sweep_stale},
    delay::{DelayLine, DELAY_TO_ROUTER, DELAY_TO_SERVER},
    process::{delay_line_bin, dies_with_parent, run_checked, shaper_bin},
};
use anyhow::{Context as _, Result};
use std::{
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
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
/// The start of every lab namespace's name: `shp<pid>x<n>-…`.
pub(crate) const NAME_PREFIX: &str = "shp";
/// Where shaper pins its maps and programs.
pub(crate) const PIN_ROOT: &str = "/sys/fs/bpf/shaper";

static LAB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// A new lab's name stem, `shp<pid>x<n>`: unique in this run, and tied to the process so
/// `sweep_stale` can tell a dead run's leftovers (every kind of lab takes it from here).
pub(crate) fn new_lab_id() -> String {
    format!(
        "{NAME_PREFIX}{}x{}",
        std::process::id(),
        LAB_COUNTER.fetch_add(1, Ordering::SeqCst)
    )
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
    /// A command run inside the namespace, dying with the thread that spawns it
    /// ([`dies_with_parent`]).
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        dies_with_parent(&mut command).args(["netns", "exec", &self.name, program]);
        command
    }

    pub fn run(&self, program: &str, args: &[&str]) -> Result<Output> {
        run_checked(self.command(program).args(args))
    }

    /// Moves the calling thread into the namespace (setns): for work that must run
    /// there in-process, on a thread of its own.
    pub fn enter(&self) -> Result<()> {
        let path = format!("/run/netns/{}", self.name);
        let netns = std::fs::File::open(&path).with_context(|| format!("cannot open {path}"))?;
        nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("setns into namespace {}", self.name))
    }

    /// A TCP connection to `address` made from inside the namespace (on a thread of its
    /// own: setns is per thread; the socket stays the namespace's wherever it is used).
    pub fn connect(&self, address: &str) -> Result<std::net::TcpStream> {
        let (ns, address) = (self.clone(), address.to_string());
        std::thread::spawn(move || -> Result<std::net::TcpStream> {
            ns.enter()?;
            std::net::TcpStream::connect(&address)
                .with_context(|| format!("cannot connect to {address} in {}", ns.name))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the connecting thread panicked"))?
    }

    /// `GET path` from `address` inside the namespace, one request on its own connection:
    /// the status and the body (a chunked body joined).
    pub fn http_get(&self, address: &str, path: &str) -> Result<(u16, String)> {
        use std::io::{Read as _, Write as _};
        let mut stream = self.connect(address)?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("no HTTP status")?;
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        Ok((
            status,
            if chunked {
                dechunked(body)
            } else {
                body.to_string()
            },
        ))
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    fn sysctl(&self, setting: &str) -> Result<()> {
        self.run("sysctl", &["-qw", setting]).map(|_| ())
    }

    /// Turns off the offloads that make super-frames: TSO/GSO (the sender segments before
    /// the wire), GRO (the receiver does not merge), and TX checksumming, or frames would
    /// cross the delay line with checksums left for a NIC that is not there.
    pub fn offloads_off(&self, dev: &str) -> Result<()> {
        self.run(
            "ethtool",
            &[
                "-K", dev, "tx", "off", "tso", "off", "gso", "off", "gro", "off",
            ],
        )
        .map(|_| ())
        .with_context(|| {
            format!("turning offloads off on {dev} (needs ethtool, Debian package ethtool)")
        })
    }

    /// `gso_max_segs` of `dev`: the largest aggregate its senders build (shaper caps it
    /// on a device with shape classes).
    pub fn gso_max_segs(&self, dev: &str) -> Result<u64> {
        let out = self.run("ip", &["-j", "-d", "link", "show", dev])?;
        let links: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        links[0]["gso_max_segs"]
            .as_u64()
            .with_context(|| format!("no gso_max_segs for {dev}"))
    }

    /// Interface counters (rx_bytes, tx_packets, ...) as the kernel keeps them.
    pub fn link_stat(&self, dev: &str, stat: &str) -> Result<u64> {
        let out = self.run("cat", &[&format!("/sys/class/net/{dev}/statistics/{stat}")])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    }
}

/// The three namespaces of one lab (four with a delay line); see the module documentation.
pub struct Lab {
    pub client: Netns,
    pub router: Netns,
    pub server: Netns,
    /// The delay line's namespace, between router and server ([`Lab::with_delay`]).
    pub delay: Option<Netns>,
    delay_line: Option<DelayLine>,
    /// The last iperf3 port handed out (see `Lab::port`).
    pub(crate) next_port: u16,
}

impl Lab {
    pub fn new() -> Result<Self> {
        Self::create(None)
    }

    /// The lab with a delay line between router and server adding `one_way` in each
    /// direction: base RTT 2 × `one_way`. Offloads are off on `r1` and `s0` (and the delay
    /// line's `d0`, `d1`) so that only wire-size frames reach its packet sockets; `r1`'s
    /// egress is still the bottleneck where classes go. Needs `ethtool`.
    pub fn with_delay(one_way: Duration) -> Result<Self> {
        Self::with_delays(one_way, one_way)
    }

    /// The lab with netem adding `one_way` on the client's and the server's egress: base
    /// RTT 2 × `one_way`, with the router's egress toward the server still the bottleneck.
    /// For kernels that have netem (the guests of `cargo xtask bench --vm`); the lab's own
    /// kernel has not, hence the delay line.
    pub fn with_netem(one_way: Duration) -> Result<Self> {
        let lab = Self::new()?;
        let delay = format!("{}us", one_way.as_micros());
        for (ns, dev) in [(&lab.client, CLIENT_DEV), (&lab.server, SERVER_DEV)] {
            // A limit far above the path's bandwidth-delay product: netem only delays.
            ns.run(
                "tc",
                &[
                    "qdisc", "replace", "dev", dev, "root", "netem", "delay", &delay, "limit",
                    "100000",
                ],
            )
            .with_context(|| format!("netem on {dev} (does this kernel have sch_netem?)"))?;
        }
        Ok(lab)
    }

    /// [`Lab::with_delay`] with a delay of its own per direction: `to_server` on the
    /// router → server path, `to_router` on the way back.
    pub fn with_delays(to_server: Duration, to_router: Duration) -> Result<Self> {
        Self::create(Some((to_server, to_router)))
    }

    /// The delay line, when the lab has one (its counters, its delays).
    pub fn delay_line(&mut self) -> Option<&mut DelayLine> {
        self.delay_line.as_mut()
    }

    /// The round-trip time the delay line adds (zero without one).
    pub fn base_rtt(&self) -> Duration {
        self.delay_line
            .as_ref()
            .map_or(Duration::ZERO, DelayLine::base_rtt)
    }

    fn create(delays: Option<(Duration, Duration)>) -> Result<Self> {
        // Resolved (built, without SHAPER_BIN) before anything needs cleaning up with it.
        shaper_bin();
        if delays.is_some() {
            delay_line_bin();
        }
        sweep_stale();
        let id = new_lab_id();
        let mut lab = Self {
            client: Netns {
                name: format!("{id}-client"),
            },
            router: Netns {
                name: format!("{id}-router"),
            },
            server: Netns {
                name: format!("{id}-server"),
            },
            delay: delays.map(|_| Netns {
                name: format!("{id}-delay"),
            }),
            delay_line: None,
            next_port: 5201,
        };
        // Built inside `lab` so a failure half-way still cleans up on drop.
        lab.build().context("building the lab failed")?;
        if let (Some(ns), Some((to_server, to_router))) = (&lab.delay, delays) {
            lab.delay_line = Some(DelayLine::start(ns, to_server, to_router)?);
        }
        Ok(lab)
    }

    fn build(&self) -> Result<()> {
        for ns in [&self.client, &self.router, &self.server] {
            ip(&["netns", "add", &ns.name])?;
            ns.ip(&["link", "set", "lo", "up"])?;
        }
        if let Some(delay) = &self.delay {
            ip(&["netns", "add", &delay.name])?;
            // The delay namespace only bridges: its own kernel must send nothing (no IPv6
            // link-local address, router solicitations, MLD) into the lab.
            delay.sysctl("net.ipv6.conf.all.disable_ipv6=1")?;
            delay.sysctl("net.ipv6.conf.default.disable_ipv6=1")?;
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
        match &self.delay {
            None => self.server.ip(&[
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
            ])?,
            Some(delay) => {
                for (ns, dev, peer) in [
                    (&self.router, ROUTER_TO_SERVER, DELAY_TO_ROUTER),
                    (&self.server, SERVER_DEV, DELAY_TO_SERVER),
                ] {
                    ns.ip(&[
                        "link",
                        "add",
                        dev,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        peer,
                        "netns",
                        &delay.name,
                    ])?;
                }
                for dev in [DELAY_TO_ROUTER, DELAY_TO_SERVER] {
                    delay.ip(&["link", "set", dev, "up"])?;
                }
                for (ns, dev) in [
                    (&self.router, ROUTER_TO_SERVER),
                    (&self.server, SERVER_DEV),
                    (delay, DELAY_TO_ROUTER),
                    (delay, DELAY_TO_SERVER),
                ] {
                    ns.offloads_off(dev)?;
                }
                // No DAD for the link-local addresses either (the lab's own addresses are
                // `nodad`): the router solicits a forwarded packet's next hop from its
                // link-local address only, and with DAD taking 1 s plus the delay line's
                // RTT, IPv6 would stall for about 2 s after the lab is built.
                for (ns, dev) in [(&self.router, ROUTER_TO_SERVER), (&self.server, SERVER_DEV)] {
                    ns.sysctl(&format!("net.ipv6.conf.{dev}.accept_dad=0"))?;
                }
            }
        }
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
}

impl Drop for Lab {
    fn drop(&mut self) {
        // The delay line first: it reports its counters before its namespace goes.
        drop(self.delay_line.take());
        for ns in [&self.client, &self.router, &self.server]
            .into_iter()
            .chain(&self.delay)
        {
            remove_namespace(&ns.name);
        }
    }
}

/// A chunked HTTP body (`Transfer-Encoding: chunked`) joined.
fn dechunked(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}
