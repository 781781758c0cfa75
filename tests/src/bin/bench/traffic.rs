//! Real traffic through the lab's router (client → router → server), with the limiter on
//! the router's interface toward the server: forwarding throughput, accuracy under UDP
//! overload and single-flow TCP goodput, shaper side by side with tc's tbf and htb and the
//! reference CNI `bandwidth` plugin, each set up and torn down in turn on the same link.

use anyhow::{bail, Context as _, Result};
use aya::programs::{
    links::FdLink, tc::SchedClassifierLinkId, tc::TcAttachOptions, LinkOrder, SchedClassifier,
    TcAttachType,
};
use serde_json::{json, Value};
use shaper_common::layout::program_names;
use shaper_tests::{
    global::median, wait_bounded, wait_with_output_bounded, CniLeftovers, Lab, Udp, COMMAND_LIMIT,
    ROUTER_TO_SERVER, SERVER_DEV, SERVER_V4,
};
use std::{
    collections::HashMap,
    io::Write as _,
    process::{Child, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

/// The limited interface: the router's egress toward the server.
const DEV: &str = ROUTER_TO_SERVER;
/// The reference CNI plugins (Debian's containernetworking-plugins, installed by setup).
const CNI_DIR: &str = "/usr/lib/cni";
/// A rate no run here reaches, for "attached but never limiting" setups.
const NEVER_REACHED: &str = "40gbit";
/// A port no sender uses.
const UNMATCHED_PORT: u16 = 30_000;
/// Ports the throughput senders use; the classes and filters that match them come last.
const BLAST_PORTS: [u16; 2] = [20001, 20002];
/// What limits the UDP accuracy runs.
const UDP_PEERS: [Peer; 2] = [Peer::Shaper("drop"), Peer::Tbf];

/// How much of each measurement a run does.
pub struct TrafficEffort {
    pub rounds: usize,
    pub forward_seconds: u32,
    /// On/off pairs a round for each program's row (see [`TurnedProgram`]).
    pub on_off_pairs: usize,
    pub many_classes: u32,
    pub accuracy_mbit: Vec<u64>,
    pub accuracy_seconds: u32,
    pub tcp_mbit: Vec<u64>,
    pub tcp_seconds: u32,
    pub tcp_peers: Vec<Peer>,
}

/// What sits on the router's interface.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Peer {
    /// shaper with a class of this action.
    Shaper(&'static str),
    Tbf,
    Htb,
    /// The reference CNI `bandwidth` plugin, run as a runtime runs it.
    CniBandwidth,
    /// shaper's own CNI plugin with the same configuration.
    ShaperCni,
}

impl Peer {
    pub fn tool(self) -> &'static str {
        match self {
            Peer::Shaper(_) => "shaper",
            Peer::Tbf => "tbf",
            Peer::Htb => "htb",
            Peer::CniBandwidth => "cni-bandwidth",
            Peer::ShaperCni => "shaper-cni",
        }
    }

    pub fn action(self) -> &'static str {
        match self {
            Peer::Shaper(action) => action,
            Peer::ShaperCni => "drop",
            _ => "shape",
        }
    }

    /// The exact configuration, as printed in the report.
    fn command(self, rate_bps: u64) -> String {
        let burst = tbf_burst(rate_bps);
        match self {
            Peer::Shaper(action) => format!(
                "shaper attach {DEV}; shaper class add c --dev {DEV} --rate {rate_bps}bit --action {action}"
            ),
            Peer::Tbf => format!(
                "tc qdisc add dev {DEV} root tbf rate {rate_bps}bit burst {burst} latency 50ms"
            ),
            Peer::Htb => format!(
                "tc qdisc add dev {DEV} root handle 1: htb default 1; tc class add dev {DEV} parent 1: classid 1:1 htb rate {rate_bps}bit"
            ),
            Peer::CniBandwidth => format!(
                "CNI ADD of /usr/lib/cni/bandwidth with runtimeConfig.bandwidth ingressRate {rate_bps}, ingressBurst {} (bits)",
                shaper_burst(rate_bps) * 8
            ),
            Peer::ShaperCni => format!(
                "CNI ADD of shaper-cni with the same runtimeConfig.bandwidth (ingressRate {rate_bps}, ingressBurst {})",
                shaper_burst(rate_bps) * 8
            ),
        }
    }
}

/// shaper's default policing burst (max(128 KiB, 250 ms at rate)), also given to the CNI
/// plugin so both start from the same bucket.
fn shaper_burst(rate_bps: u64) -> u64 {
    (128 * 1024).max(rate_bps / 8 / 4)
}

/// tbf's burst as a tc user sizes it: 4 ms at rate, at least 32 KiB.
fn tbf_burst(rate_bps: u64) -> u64 {
    (32 * 1024).max(rate_bps / 8 / 250)
}

fn tc_batch(lab: &Lab, lines: &[String]) -> Result<()> {
    let path = std::env::temp_dir().join(format!("shaper-bench-tc-{}.batch", std::process::id()));
    std::fs::write(&path, lines.join("\n"))?;
    let result = lab
        .router
        .run("tc", &["-batch", path.to_str().context("temp path")?]);
    let _ = std::fs::remove_file(&path);
    result.map(|_| ())
}

/// Installs `peer` limiting everything toward the server to `rate_bps`.
fn install(lab: &Lab, peer: Peer, rate_bps: u64) -> Result<()> {
    let rate = format!("{rate_bps}bit");
    match peer {
        Peer::Shaper(action) => {
            lab.router.shaper(&["attach", DEV])?;
            lab.router.shaper(&[
                "class", "add", "c", "--dev", DEV, "--rate", &rate, "--action", action,
            ])?;
            if action == "ecn" {
                lab.client
                    .run("sysctl", &["-qw", "net.ipv4.tcp_ecn=1"])
                    .map(|_| ())?;
            }
        }
        Peer::Tbf => tc_batch(
            lab,
            &[format!(
                "qdisc add dev {DEV} root tbf rate {rate} burst {} latency 50ms",
                tbf_burst(rate_bps)
            )],
        )?,
        Peer::Htb => tc_batch(
            lab,
            &[
                format!("qdisc add dev {DEV} root handle 1: htb default 1"),
                format!("class add dev {DEV} parent 1: classid 1:1 htb rate {rate}"),
            ],
        )?,
        Peer::CniBandwidth => cni_plugin(lab, Cni::Reference, "ADD", rate_bps)?,
        Peer::ShaperCni => cni_plugin(lab, Cni::Shaper, "ADD", rate_bps)?,
    }
    Ok(())
}

fn remove(lab: &Lab, peer: Peer, rate_bps: u64) -> Result<()> {
    match peer {
        Peer::Shaper(action) => {
            lab.router.shaper(&["detach", DEV])?;
            if action == "ecn" {
                lab.client
                    .run("sysctl", &["-qw", "net.ipv4.tcp_ecn=2"])
                    .map(|_| ())?;
            }
        }
        Peer::Tbf | Peer::Htb => tc_batch(lab, &[format!("qdisc del dev {DEV} root")])?,
        Peer::CniBandwidth => {
            cni_plugin(lab, Cni::Reference, "DEL", rate_bps)?;
            // The reference plugin leaves the host veth's tbf for the veth's deletion
            // (the container going away) to remove; the lab's veth stays, so remove it.
            tc_batch(lab, &[format!("qdisc del dev {DEV} root")])?;
        }
        Peer::ShaperCni => cni_plugin(lab, Cni::Shaper, "DEL", rate_bps)?,
    }
    Ok(())
}

#[derive(Clone, Copy)]
pub enum Cni {
    Reference,
    Shaper,
}

/// CNI_CONTAINERID of the bench's plugin runs (with the pid, so the lab's sweep can tell
/// the record of a dead run).
pub fn cni_container_id() -> String {
    format!("shaper-bench-{}", std::process::id())
}

/// For a CNI peer, the guard that removes what its plugin may leave when a run fails
/// half-way (shaper-cni's pins and record); None for the other peers.
fn cni_leftovers(lab: &Lab, peer: Peer) -> Result<Option<CniLeftovers>> {
    if !matches!(peer, Peer::CniBandwidth | Peer::ShaperCni) {
        return Ok(None);
    }
    let mut leftovers = CniLeftovers::new(
        Some(lab.router.name.clone()),
        &cni_container_id(),
        SERVER_DEV,
        None,
    );
    leftovers.claim_host_dev(DEV)?;
    Ok(Some(leftovers))
}

/// Runs a CNI plugin as a container runtime would: the router is the host, the server
/// namespace the container, `r1` its host-side veth and `s0` its interface; container
/// ingress (host → container) is what it limits, on `r1`. The plugin runs with the
/// router's network namespace only (nsenter --net), so shaper-cni's pins land in the
/// host's bpffs as they would under a runtime.
fn cni_plugin(lab: &Lab, plugin: Cni, command: &str, rate_bps: u64) -> Result<()> {
    let bandwidth = json!({
        "ingressRate": rate_bps,
        "ingressBurst": shaper_burst(rate_bps) * 8,
    });
    cni_run(lab, plugin, command, bandwidth, &[])
}

/// Runs `plugin`'s `command` with `runtimeConfig.bandwidth` = `bandwidth` and the
/// configuration's `extra` keys (shaper-cni's `egressAction`), as [`cni_plugin`] says.
pub fn cni_run(
    lab: &Lab,
    plugin: Cni,
    command: &str,
    bandwidth: Value,
    extra: &[(&str, Value)],
) -> Result<()> {
    let sandbox = format!("/var/run/netns/{}", lab.server.name);
    let mac = |ns: &shaper_tests::Netns, dev: &str| -> Result<String> {
        let out = ns.run("cat", &[&format!("/sys/class/net/{dev}/address")])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let mut config = json!({
        "cniVersion": "1.0.0",
        "name": "shaper-bench",
        "type": match plugin { Cni::Reference => "bandwidth", Cni::Shaper => "shaper-cni" },
        "runtimeConfig": {"bandwidth": bandwidth},
        "prevResult": {
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": DEV, "mac": mac(&lab.router, DEV)?},
                {"name": SERVER_DEV, "mac": mac(&lab.server, SERVER_DEV)?, "sandbox": sandbox},
            ],
            "ips": [{"address": format!("{SERVER_V4}/24"), "interface": 1}],
        },
    });
    for (key, value) in extra {
        config[*key] = value.clone();
    }
    let binary = match plugin {
        Cni::Reference => format!("{CNI_DIR}/bandwidth"),
        Cni::Shaper => shaper_tests::shaper_bin()
            .with_file_name("shaper-cni")
            .display()
            .to_string(),
    };
    let mut child = std::process::Command::new("nsenter");
    child
        .arg(format!("--net=/run/netns/{}", lab.router.name))
        .arg(&binary);
    let mut child = child
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", cni_container_id())
        .env("CNI_NETNS", &sandbox)
        .env("CNI_IFNAME", SERVER_DEV)
        .env("CNI_PATH", CNI_DIR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| {
            format!("cannot run {binary} (cargo xtask setup installs the reference plugins)")
        })?;
    child
        .stdin
        .take()
        .context("no stdin")?
        .write_all(config.to_string().as_bytes())?;
    let output = wait_with_output_bounded(child, COMMAND_LIMIT)
        .with_context(|| format!("CNI {binary} {command}"))?;
    if !output.status.success() {
        bail!(
            "CNI {binary} {command} failed: {}{}",
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Kills and reaps child processes when dropped, so a failed measurement leaves none.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = wait_bounded(child, Duration::from_secs(5));
        }
    }
}

// ---------------------------------------------------------------------------------------
// forwarding throughput

/// What is attached for one throughput row.
#[derive(Clone, Copy)]
enum Forwarder {
    Nothing,
    /// The empty TC program (the per-packet floor), attached by TCX: what any program on
    /// this hook costs before it does anything.
    EmptyProgram,
    /// The empty program plus one read of the clock shaper's packet path uses: what that
    /// read costs on the path.
    ClockProgram,
    /// shaper with this many classes, in one rule shape (every class matches a 4-port
    /// block) or in two (the idle classes match one port each).
    Shaper {
        classes: u32,
        one_shape: bool,
    },
    Tbf,
    HtbU32(u32),
    /// shaper with one class the senders do not match: parse, verdict cache, no class.
    ShaperUnmatched,
}

impl Forwarder {
    fn label(self) -> String {
        match self {
            Forwarder::Nothing => "nothing attached".into(),
            Forwarder::EmptyProgram => "empty TC program (TCX)".into(),
            Forwarder::ClockProgram => "empty TC program + one clock read".into(),
            Forwarder::ShaperUnmatched => "shaper, 1 class no packet matches".into(),
            Forwarder::Shaper { classes: 1, .. } => "shaper, 1 class (rate never reached)".into(),
            Forwarder::Shaper {
                classes,
                one_shape: true,
            } => format!("shaper, {classes} classes in 1 rule shape"),
            Forwarder::Shaper { classes, .. } => {
                format!("shaper, {classes} classes in 2 rule shapes")
            }
            Forwarder::Tbf => "tbf (rate never reached)".into(),
            Forwarder::HtbU32(1) => "htb + 1 u32 filter (rate never reached)".into(),
            Forwarder::HtbU32(n) => format!("htb, {n} classes + {n} u32 filters"),
        }
    }
}

impl Forwarder {
    /// The program of shaper's object this setup attaches on its own, if any.
    fn object_program(self) -> Option<&'static str> {
        match self {
            Forwarder::EmptyProgram => Some(program_names::FLOOR),
            Forwarder::ClockProgram => Some(program_names::FLOOR_CLOCK),
            _ => None,
        }
    }

    /// Whether shaper's CLI sets this setup up.
    fn is_shaper(self) -> bool {
        matches!(self, Forwarder::Shaper { .. } | Forwarder::ShaperUnmatched)
    }

    /// The configuration, as printed in the report.
    fn command(self) -> String {
        match self {
            Forwarder::Nothing => "-".into(),
            Forwarder::EmptyProgram | Forwarder::ClockProgram => format!(
                "the object's {} attached at {DEV} egress by TCX (aya)",
                self.object_program().unwrap_or_default()
            ),
            Forwarder::ShaperUnmatched => format!(
                "shaper attach {DEV}; shaper class add other --dev {DEV} --rate {NEVER_REACHED} --proto udp --dport {UNMATCHED_PORT}"
            ),
            Forwarder::Shaper { classes: 1, .. } => format!(
                "shaper attach {DEV}; shaper class add blast --dev {DEV} --rate {NEVER_REACHED} --proto udp --dport 20000-20003"
            ),
            Forwarder::Shaper { classes, one_shape } => format!(
                "shaper batch -f: {} × `class add idleN --dev {DEV} --rate {NEVER_REACHED} --proto udp --dport {}`, then the blast class",
                classes - 1,
                if one_shape { "P-P+3" } else { "P" }
            ),
            Forwarder::Tbf => format!(
                "tc qdisc add dev {DEV} root tbf rate {NEVER_REACHED} burst 10mb latency 50ms"
            ),
            Forwarder::HtbU32(n) => format!(
                "tc -batch: htb root (default 0), {n} × (`class add … htb rate {NEVER_REACHED}` + `filter add … u32 match ip protocol 17 0xff match ip dport P 0xffff`), the senders' filter last"
            ),
        }
    }
}

/// Sets up `forwarder`; with n classes, n - 1 classes (filters) match ports nobody uses
/// and the last one (ports 20000-20003) matches the senders, so u32 walks its whole list
/// as it does for the last-added rule, while shaper's classifier does one hash lookup per
/// rule shape.
fn install_forwarder(lab: &Lab, forwarder: Forwarder) -> Result<()> {
    match forwarder {
        // The object's programs' links live as long as an `ObjectOnPath`, held by the caller.
        Forwarder::Nothing | Forwarder::EmptyProgram | Forwarder::ClockProgram => Ok(()),
        Forwarder::ShaperUnmatched => {
            lab.router.shaper(&["attach", DEV])?;
            lab.router
                .shaper(&[
                    "class",
                    "add",
                    "other",
                    "--dev",
                    DEV,
                    "--rate",
                    NEVER_REACHED,
                    "--proto",
                    "udp",
                    "--dport",
                    &UNMATCHED_PORT.to_string(),
                ])
                .map(|_| ())
        }
        Forwarder::Shaper {
            classes: count,
            one_shape,
        } => {
            lab.router.shaper(&["attach", DEV])?;
            let mut lines: Vec<String> = (0..count - 1)
                .map(|i| {
                    let ports = if one_shape {
                        format!("{}-{}", 4000 + 4 * i, 4003 + 4 * i)
                    } else {
                        (10_000 + i).to_string()
                    };
                    format!(
                        "class add idle{i} --dev {DEV} --rate {NEVER_REACHED} --proto udp --dport {ports}"
                    )
                })
                .collect();
            lines.push(format!(
                "class add blast --dev {DEV} --rate {NEVER_REACHED} --proto udp --dport 20000-20003"
            ));
            let path = std::env::temp_dir()
                .join(format!("shaper-bench-classes-{}.batch", std::process::id()));
            std::fs::write(&path, lines.join("\n"))?;
            let result = lab
                .router
                .shaper(&["batch", "-f", path.to_str().context("temp path")?]);
            let _ = std::fs::remove_file(&path);
            result.map(|_| ())
        }
        Forwarder::Tbf => tc_batch(
            lab,
            &[format!(
                "qdisc add dev {DEV} root tbf rate {NEVER_REACHED} burst 10mb latency 50ms"
            )],
        ),
        Forwarder::HtbU32(count) => {
            let mut lines = vec![format!("qdisc add dev {DEV} root handle 1: htb default 0")];
            for i in 1..=count {
                lines.push(format!(
                    "class add dev {DEV} parent 1: classid 1:{i:x} htb rate {NEVER_REACHED}"
                ));
                let matcher = if i == count {
                    "match ip dport 20000 0xfffc".to_string()
                } else {
                    format!("match ip dport {} 0xffff", 10_000 + i)
                };
                lines.push(format!(
                    "filter add dev {DEV} parent 1: protocol ip prio 1 u32 match ip protocol 17 0xff {matcher} flowid 1:{i:x}"
                ));
            }
            tc_batch(lab, &lines)
        }
    }
}

fn remove_forwarder(lab: &Lab, forwarder: Forwarder) -> Result<()> {
    match forwarder {
        Forwarder::Nothing | Forwarder::EmptyProgram | Forwarder::ClockProgram => Ok(()),
        Forwarder::Shaper { .. } | Forwarder::ShaperUnmatched => {
            lab.router.shaper(&["detach", DEV]).map(|_| ())
        }
        Forwarder::Tbf | Forwarder::HtbU32(_) => {
            tc_batch(lab, &[format!("qdisc del dev {DEV} root")])
        }
    }
}

/// A program of shaper's object (the empty one, or it plus a clock read) attached at the
/// router's egress, held by a thread inside the router's namespace (aya attaches by name
/// in the caller's namespace); detached when dropped.
struct ObjectOnPath {
    stop: Option<mpsc::Sender<()>>,
    holder: Option<thread::JoinHandle<()>>,
}

impl ObjectOnPath {
    fn attach(lab: &Lab, name: &'static str) -> Result<Self> {
        let router = lab.router.clone();
        let (stop, stopped) = mpsc::channel::<()>();
        let (ready, attached) = mpsc::channel::<Result<()>>();
        let holder = thread::spawn(move || {
            let loaded = (|| -> Result<aya::Ebpf> {
                router.enter()?;
                let mut ebpf = aya::Ebpf::load(shaper::EBPF_OBJECT)?;
                attach_tcx(shaper::state::load_program(&mut ebpf, name)?)?;
                Ok(ebpf)
            })();
            match loaded {
                Ok(ebpf) => {
                    let _ = ready.send(Ok(()));
                    // Bounded: the section stops it long before.
                    let _ = stopped.recv_timeout(Duration::from_secs(600));
                    drop(ebpf);
                }
                Err(error) => {
                    let _ = ready.send(Err(error));
                }
            }
        });
        let mut on_path = Self {
            stop: Some(stop),
            holder: Some(holder),
        };
        match attached.recv_timeout(COMMAND_LIMIT) {
            Ok(Ok(())) => Ok(on_path),
            Ok(Err(error)) => Err(error.context(format!("cannot attach {name}"))),
            Err(_) => {
                // Left to finish on its own: joining a stuck load could wait forever.
                on_path.stop.take();
                on_path.holder.take();
                bail!("attaching {name} did not finish")
            }
        }
    }
}

impl Drop for ObjectOnPath {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(holder) = self.holder.take() {
            let _ = holder.join();
        }
    }
}

/// A program on the path, measured against nothing in on/off turns: its TCX link attached
/// and detached in quick turns during the blast. The forwarding rate wanders by about 5 %
/// from one window to the next at every window length from 0.1 to 5 s (120 s of nothing
/// attached on this machine), so a few 5 s windows cannot tell 1 % from 3 %; hundreds of
/// short windows that alternate can, as drift slower than a turn cancels between
/// neighbours.
enum TurnedProgram {
    /// A program of the object, loaded by the measuring thread.
    Object(&'static str),
    /// shaper's own attachment, its pinned program and link in this directory: the link
    /// pin is taken over for the turns and pinned again after them.
    Shaper(std::path::PathBuf),
}

/// How long a program is left on (or off) the path before its window is counted.
const TURN_SETTLE: Duration = Duration::from_millis(20);
/// One counted window of a turn.
const TURN_WINDOW: Duration = Duration::from_millis(100);

/// The time `pairs` on/off pairs take (an off window before the first).
fn on_off_time(pairs: usize) -> Duration {
    (2 * pairs as u32 + 1) * (TURN_SETTLE + TURN_WINDOW)
}

/// shaper's attachment at the router's `dev` egress (its pins are under `.dir()`).
pub fn router_egress(lab: &Lab, dev: &str) -> shaper::state::Location {
    shaper::state::Location {
        netns: Some(lab.router.name.clone()),
        dev: dev.into(),
        direction: shaper::state::Direction::Egress,
    }
}

/// `pairs` on/off pairs of `program` at the router's egress, from a thread in the
/// router's namespace: each on-window's packets/s against the mean of the off-windows
/// either side of it.
fn on_off_turns(lab: &Lab, program: TurnedProgram, pairs: usize) -> Result<Vec<f64>> {
    let router = lab.router.clone();
    let (done, finished) = mpsc::channel::<Result<Vec<f64>>>();
    thread::spawn(move || {
        let turned = (|| -> Result<Vec<f64>> {
            router.enter()?;
            match program {
                TurnedProgram::Object(name) => {
                    let mut ebpf = aya::Ebpf::load(shaper::EBPF_OBJECT)?;
                    turns(shaper::state::load_program(&mut ebpf, name)?, pairs)
                }
                TurnedProgram::Shaper(dir) => {
                    let mut program = SchedClassifier::from_pin(dir.join(shaper::state::PROG_PIN))
                        .context("cannot open shaper's pinned program")?;
                    let link_pin = dir.join(shaper::state::LINK_PIN);
                    // Unpinning the link detaches it: the turns attach the same program,
                    // with its maps and classes, by links of their own.
                    std::fs::remove_file(&link_pin)
                        .with_context(|| format!("cannot take over {}", link_pin.display()))?;
                    let ratios = turns(&mut program, pairs);
                    // Back as shaper left it, whatever the turns did: `shaper detach`
                    // finds its link. (After a timeout the directory may be gone: the
                    // pin then fails and the link goes with this thread.)
                    let link_id = attach_tcx(&mut program)?;
                    let link: FdLink = program.take_link(link_id)?.try_into()?;
                    link.pin(&link_pin)
                        .with_context(|| format!("cannot pin {} again", link_pin.display()))?;
                    ratios
                }
            }
        })();
        let _ = done.send(turned);
    });
    let limit = on_off_time(pairs) + COMMAND_LIMIT;
    match finished.recv_timeout(limit) {
        Ok(turned) => turned,
        // Left to finish on its own: joining a stuck attach could wait forever.
        Err(_) => bail!("the on/off turns did not finish in {limit:?}"),
    }
}

fn attach_tcx(program: &mut SchedClassifier) -> Result<SchedClassifierLinkId> {
    Ok(program.attach_with_options(
        DEV,
        TcAttachType::Egress,
        TcAttachOptions::TcxOrder(LinkOrder::default()),
    )?)
}

/// The turns themselves, on the calling thread (in the router's namespace), `program`
/// off the path before and after.
fn turns(program: &mut SchedClassifier, pairs: usize) -> Result<Vec<f64>> {
    let mut off_before = turn_pps()?;
    let mut ratios = Vec::with_capacity(pairs);
    for _ in 0..pairs {
        let link_id = attach_tcx(program)?;
        let on = turn_pps();
        program.detach(link_id)?;
        let on = on?;
        let off_after = turn_pps()?;
        ratios.push(on / ((off_before + off_after) / 2.0));
        off_before = off_after;
    }
    Ok(ratios)
}

/// Packets/s the router sent toward the server over one turn's window, read from the
/// calling thread's own namespace (`/proc/thread-self`; `/sys/class/net` shows the
/// namespace sysfs was mounted in).
fn turn_pps() -> Result<f64> {
    thread::sleep(TURN_SETTLE);
    let before = tx_packets()?;
    let started = Instant::now();
    thread::sleep(TURN_WINDOW);
    let after = tx_packets()?;
    if after <= before {
        bail!("no packets were forwarded during an on/off turn");
    }
    Ok((after - before) as f64 / started.elapsed().as_secs_f64())
}

fn tx_packets() -> Result<u64> {
    let table = std::fs::read_to_string("/proc/thread-self/net/dev")?;
    tx_packets_in(&table, DEV)
        .with_context(|| format!("no tx_packets of {DEV} in /proc/thread-self/net/dev"))
}

/// `dev`'s tx_packets in a `/proc/net/dev` table: after the colon, 8 receive counters,
/// then tx_bytes and tx_packets.
fn tx_packets_in(table: &str, dev: &str) -> Option<u64> {
    table.lines().find_map(|line| {
        let (name, counters) = line.split_once(':')?;
        (name.trim() == dev).then(|| counters.split_whitespace().nth(9)?.parse().ok())?
    })
}

/// The mean of `values` and its standard error (NaN below two values).
fn mean_and_error(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, f64::NAN);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (variance / n).sqrt())
}

/// Ratios as the printouts and the report list them.
pub fn joined(ratios: &[f64]) -> String {
    ratios
        .iter()
        .map(|r| format!("{r:.3}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// An nftables table in the server's namespace that drops the senders' datagrams at
/// prerouting; removed on drop.
struct Sink<'a>(&'a shaper_tests::Netns);

impl<'a> Sink<'a> {
    const TABLE: &'static str = "shaper_bench_sink";

    fn install(server: &'a shaper_tests::Netns) -> Result<Self> {
        let rules = format!(
            "table inet {} {{\n chain prerouting {{\n  type filter hook prerouting priority -300;\n  udp dport {}-{} drop\n }}\n}}\n",
            Self::TABLE,
            BLAST_PORTS[0],
            BLAST_PORTS[1]
        );
        let mut child = server
            .command("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(rules.as_bytes())?;
        if !wait_bounded(&mut child, COMMAND_LIMIT)?.success() {
            bail!("nft could not install the sink");
        }
        Ok(Self(server))
    }
}

impl Drop for Sink<'_> {
    fn drop(&mut self) {
        let _ = self.0.run("nft", &["delete", "table", "inet", Self::TABLE]);
    }
}

/// Waits (until `deadline` at the latest) for the router to forward the senders' blast:
/// at least 1000 packets in 100 ms toward the server.
fn wait_for_blast(lab: &Lab, deadline: Instant) -> Result<()> {
    let mut last = lab.router.link_stat(DEV, "tx_packets")?;
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        let now = lab.router.link_stat(DEV, "tx_packets")?;
        if now >= last + 1000 {
            return Ok(());
        }
        last = now;
    }
    bail!("the senders' blast never started")
}

/// Two iperf3 senders, one pinned to each core, sending 64-byte UDP datagrams as fast as
/// they can for the whole forwarding section, and the server's sink dropping them on
/// arrival. One blast for every setup of a round: a sender's start (where its core lands,
/// how fast its stream ramps) adds noise between separate runs, so the setups of a
/// round are measured in windows of the same blast. Stopped (senders killed, sink
/// removed) when dropped.
struct Blast<'a> {
    lab: &'a Lab,
    // Declared before the iperf3 peers: the sink goes before they are killed.
    sink: Option<Sink<'a>>,
    peers: Children,
}

impl<'a> Blast<'a> {
    /// Starts the blast for at most `seconds` (the senders' own limit; the section stops
    /// them as soon as it is done) and waits until the router forwards it.
    fn start(lab: &'a Lab, seconds: u32) -> Result<Self> {
        let mut children = Children(Vec::new());
        for port in BLAST_PORTS {
            children.0.push(lab.iperf_server_behind_sink(port)?);
        }
        for (cpu, port) in BLAST_PORTS.iter().enumerate() {
            let child = lab
                .client
                .command("iperf3")
                .args([
                    "-c",
                    SERVER_V4,
                    "-u",
                    "-b",
                    "0",
                    "-l",
                    "64",
                    "-t",
                    &seconds.to_string(),
                    "-p",
                    &port.to_string(),
                    "-A",
                    &cpu.to_string(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            children.0.push(child);
        }
        let mut blast = Self {
            lab,
            sink: None,
            peers: children,
        };
        // Once iperf3 has set up its streams, the server drops the datagrams before any
        // socket sees them: the two cores then go to sending and forwarding, not to the
        // receivers, and the measurement is less at the mercy of the scheduler. The sink
        // goes in only once the blast flows (a stream whose set-up datagrams met the sink
        // would never start): on a slow machine that takes longer than the usual second.
        thread::sleep(Duration::from_secs(1));
        wait_for_blast(lab, Instant::now() + Duration::from_secs(10))?;
        blast.sink = Some(Sink::install(&lab.server)?);
        Ok(blast)
    }

    /// Packets per second the router forwarded toward the server over `window`, after
    /// `settle` (a setup just installed, the blast's queues refilling).
    fn pps(&mut self, settle: Duration, window: Duration) -> Result<f64> {
        thread::sleep(settle);
        let before = self.lab.router.link_stat(DEV, "tx_packets")?;
        let started = Instant::now();
        thread::sleep(window);
        let after = self.lab.router.link_stat(DEV, "tx_packets")?;
        let elapsed = started.elapsed().as_secs_f64();
        // A peer that ended during the window (a sender at its time limit, a server at
        // its receive timeout) left part of it without the blast: not a measurement.
        for child in &mut self.peers.0 {
            if child.try_wait()?.is_some() {
                bail!("an iperf3 peer of the blast ended during a throughput window");
            }
        }
        if after <= before {
            bail!("no packets were forwarded during a throughput window");
        }
        Ok((after - before) as f64 / elapsed)
    }
}

/// shaper's program's run time per run on the real path, from the kernel's own
/// accounting (BPF_ENABLE_STATS) over `window`: what being on the path costs each
/// forwarded packet, to the nanosecond, where the throughput itself is too noisy to
/// show it. The statistics cost every run of every program two clock reads, so they are
/// on only in this window. Summed over the programs of the attached program's name that
/// were loaded for the whole window (only the one on the router's egress runs here).
fn program_ns_per_run(window: Duration) -> Result<f64> {
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("cannot enable the kernel's BPF run-time statistics")?;
    let snapshot = || -> HashMap<u32, (Duration, u64)> {
        aya::programs::loaded_programs()
            .flatten()
            .filter(|program| program.name_as_str() == Some(program_names::SHAPER))
            .map(|program| (program.id(), (program.run_time(), program.run_count())))
            .collect()
    };
    let before = snapshot();
    thread::sleep(window);
    let (mut time, mut runs) = (Duration::ZERO, 0u64);
    for (id, (time_after, count_after)) in snapshot() {
        if let Some((time_before, count_before)) = before.get(&id) {
            time += time_after.saturating_sub(*time_before);
            runs += count_after.saturating_sub(*count_before);
        }
    }
    ns_per_run(time, runs, "shaper's program")
}

/// Run time per run from the run-time statistics' deltas; no run counted is an error,
/// not 0 ns.
pub fn ns_per_run(time: Duration, runs: u64, program: &str) -> Result<f64> {
    if runs == 0 {
        bail!("the run-time statistics counted no run of {program}");
    }
    Ok(time.as_nanos() as f64 / runs as f64)
}

/// Throughput rows: one blast a round; every setup installed, measured over a window
/// and removed in turn, with a window of nothing attached before the first setup and
/// after each. A setup's ratio to nothing attached is the median over rounds of its
/// window against the mean of the two nothing-attached windows either side of it; pps
/// is the median of its windows (nothing attached: of all its windows).
///
/// `stats_overhead_ns`: what the run-time statistics record for an empty program (their
/// own clock reads, the call and the empty body), taken off shaper's figure.
pub fn throughput(lab: &Lab, effort: &TrafficEffort, stats_overhead_ns: f64) -> Result<Vec<Value>> {
    let setups = setups(effort);
    let settle = Duration::from_millis(500);
    let window = Duration::from_secs(effort.forward_seconds.into());
    // The senders' own limit for a round: up to three windows and the on/off turns a
    // setup, generous (installing a thousand classes under load takes seconds); the
    // section stops them when done.
    let turns_seconds = on_off_time(effort.on_off_pairs).as_secs() as u32 + 1;
    let limit = 2 * (setups.len() as u32 * (3 * effort.forward_seconds + turns_seconds + 10) + 10);
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    let mut program_samples: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    let mut on_off: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    let mut on_off_rounds: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    for round in 0..effort.rounds {
        // A blast per round: iperf3's server ends a test that receives nothing (the sink
        // drops it all) for 120 s.
        let mut blast = Blast::start(lab, limit)?;
        // Nothing attached is measured before the first setup and again after each: a
        // setup is paired with the mean of the windows either side of it, so neither
        // drift within the blast nor its place in the round favours it.
        let mut nothing_before = blast.pps(settle, window)?;
        print_window(round, Forwarder::Nothing, nothing_before, None);
        samples[0].push(nothing_before);
        ratios[0].push(1.0);
        for (index, setup) in setups.iter().enumerate().skip(1) {
            install_forwarder(lab, *setup)?;
            let object = match setup.object_program() {
                Some(name) => Some(ObjectOnPath::attach(lab, name)?),
                None => None,
            };
            let pps = blast.pps(settle, window).and_then(|pps| {
                let program_ns = if setup.is_shaper() {
                    Some(program_ns_per_run(STATS_WINDOW)?)
                } else {
                    None
                };
                Ok((pps, program_ns))
            });
            drop(object);
            remove_forwarder(lab, *setup)?;
            let (pps, program_ns) = pps?;
            print_window(round, *setup, pps, program_ns);
            let nothing_after = blast.pps(settle, window)?;
            print_window(round, Forwarder::Nothing, nothing_after, None);
            samples[index].push(pps);
            ratios[index].push(pps / ((nothing_before + nothing_after) / 2.0));
            samples[0].push(nothing_after);
            nothing_before = nothing_after;
            if let Some(ns) = program_ns {
                program_samples[index].push(ns);
            }
            // The turns come after the setup's windows (set up again for them), and a
            // fresh window of nothing after them: the windows stay neighbours.
            let program = if let Some(name) = setup.object_program() {
                TurnedProgram::Object(name)
            } else if setup.is_shaper() {
                install_forwarder(lab, *setup)?;
                TurnedProgram::Shaper(router_egress(lab, DEV).dir())
            } else {
                continue;
            };
            let turned = on_off_turns(lab, program, effort.on_off_pairs);
            if setup.is_shaper() {
                remove_forwarder(lab, *setup)?;
            }
            let turned = turned?;
            let (ratio, error) = mean_and_error(&turned);
            println!(
                "round {}: {:44} on/off every {:?}: {ratio:.3} ± {error:.3} × nothing ({} pairs)",
                round + 1,
                setup.label(),
                TURN_SETTLE + TURN_WINDOW,
                turned.len()
            );
            on_off[index].extend(turned);
            on_off_rounds[index].push(ratio);
            nothing_before = blast.pps(settle, window)?;
            print_window(round, Forwarder::Nothing, nothing_before, None);
            samples[0].push(nothing_before);
        }
    }
    // The machine's time per forwarded packet with nothing attached: each sender keeps
    // its core busy sending, and forwarding runs on the sending core (veth).
    let busy_cores = BLAST_PORTS.len() as f64;
    let nothing_pps = median(&samples[0]);
    let budget_ns = busy_cores * 1e9 / nothing_pps;
    let mut rows = Vec::new();
    for (index, setup) in setups.iter().enumerate() {
        let paired = &ratios[index];
        let (pps, ratio) = (median(&samples[index]), median(paired));
        println!(
            "{:44} median {:>10.0} pps  × nothing {ratio:.3} (rounds {})",
            setup.label(),
            pps,
            joined(paired)
        );
        let mut row = json!({
            "setup": setup.label(),
            "command": setup.command(),
            "pps": pps,
            "pps_runs": samples[index],
            "ratio_runs": paired,
            "ratio_to_none": ratio,
        });
        if !on_off[index].is_empty() {
            // Rounds differ by more than their turns' errors (each blast settles its own
            // way): with three rounds or more, the error is that of the rounds' means.
            // With fewer it is the pairs', a lower bound (neighbouring pairs share an
            // off-window).
            let rounds = &on_off_rounds[index];
            let (ratio, pairs_error) = mean_and_error(&on_off[index]);
            let error = if rounds.len() >= 3 {
                mean_and_error(rounds).1
            } else {
                pairs_error
            };
            println!(
                "{:44} on/off {ratio:.3} ± {error:.3} × nothing ({} pairs; rounds {})",
                "",
                on_off[index].len(),
                joined(rounds)
            );
            row["on_off_ratio"] = json!(ratio);
            row["on_off_error"] = json!(error);
            row["on_off_pairs"] = json!(on_off[index].len());
            row["on_off_rounds"] = json!(rounds);
        }
        if !program_samples[index].is_empty() {
            let measured_ns = median(&program_samples[index]);
            let program_ns = (measured_ns - stats_overhead_ns).max(0.0);
            let capacity = capacity_ratio(program_ns, budget_ns);
            println!(
                "{:44} program {measured_ns:.0} ns a packet less the statistics' {stats_overhead_ns:.0} = {program_ns:.0} of the machine's {budget_ns:.0}: capacity × nothing {capacity:.3}",
                ""
            );
            row["program_measured_ns"] = json!(measured_ns);
            row["stats_overhead_ns"] = json!(stats_overhead_ns);
            row["program_ns"] = json!(program_ns);
            row["budget_ns"] = json!(budget_ns);
            row["capacity_ratio"] = json!(capacity);
        }
        rows.push(row);
    }
    Ok(rows)
}

fn print_window(round: usize, setup: Forwarder, pps: f64, program_ns: Option<f64>) {
    println!(
        "round {}: {:44} {:>10.0} pps{}",
        round + 1,
        setup.label(),
        pps,
        program_ns.map_or(String::new(), |ns| format!(", program {ns:.0} ns a packet"))
    );
}

/// How long the kernel's run-time statistics are on for each shaper setup.
const STATS_WINDOW: Duration = Duration::from_secs(1);

/// The forwarding rate left when every packet costs `program_ns` more of a machine that
/// spends `budget_ns` on each forwarded packet with nothing attached, × nothing.
fn capacity_ratio(program_ns: f64, budget_ns: f64) -> f64 {
    budget_ns / (budget_ns + program_ns)
}

/// The throughput setups, in the order they are measured and reported.
fn setups(effort: &TrafficEffort) -> Vec<Forwarder> {
    let n = effort.many_classes;
    vec![
        Forwarder::Nothing,
        Forwarder::EmptyProgram,
        Forwarder::ClockProgram,
        Forwarder::Shaper {
            classes: 1,
            one_shape: true,
        },
        Forwarder::Tbf,
        Forwarder::HtbU32(1),
        Forwarder::Shaper {
            classes: n,
            one_shape: true,
        },
        Forwarder::Shaper {
            classes: n,
            one_shape: false,
        },
        Forwarder::HtbU32(n),
        // Last of shaper's rows: the targets read shaper's rows in order.
        Forwarder::ShaperUnmatched,
    ]
}

/// The setup column of every throughput row a run of `effort` reports.
pub fn expected_throughput(effort: &TrafficEffort) -> Vec<String> {
    setups(effort).iter().map(|setup| setup.label()).collect()
}

// ---------------------------------------------------------------------------------------
// accuracy and TCP goodput

/// One rate-over-time series for the plots: (seconds, Mbit/s) per 100 ms bin.
pub type Series = Vec<(f64, f64)>;

fn bins(intervals: &[(f64, f64)]) -> Series {
    let mut previous = 0.0;
    intervals
        .iter()
        .filter_map(|(end, bits)| {
            let seconds = end - previous;
            previous = *end;
            (seconds > 0.01).then(|| (*end, bits / seconds / 1e6))
        })
        .collect()
}

/// What identifies an accuracy row: tool, action, protocol, configured rate (bit/s).
#[derive(Clone, Debug, PartialEq)]
pub struct AccuracyKey {
    pub tool: &'static str,
    pub action: &'static str,
    pub proto: &'static str,
    pub configured_bps: u64,
}

impl AccuracyKey {
    fn new(peer: Peer, proto: &'static str, mbit: u64) -> Self {
        Self {
            tool: peer.tool(),
            action: peer.action(),
            proto,
            configured_bps: mbit * 1_000_000,
        }
    }

    pub fn matches(&self, row: &Value) -> bool {
        row["tool"] == self.tool
            && row["action"] == self.action
            && row["proto"] == self.proto
            && row["configured_bps"].as_u64() == Some(self.configured_bps)
    }

    /// A marking action does not limit: its rate is the line's, not the class's.
    pub fn limits(&self) -> bool {
        !self.action.starts_with("dscp")
    }
}

impl std::fmt::Display for AccuracyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} at {} Mbit/s",
            self.tool,
            self.action,
            self.proto,
            self.configured_bps / 1_000_000
        )
    }
}

/// Every accuracy and TCP row a run of `effort` reports, in order.
pub fn expected_accuracy(effort: &TrafficEffort) -> Vec<AccuracyKey> {
    let udp = effort
        .accuracy_mbit
        .iter()
        .flat_map(|&mbit| UDP_PEERS.map(|peer| AccuracyKey::new(peer, "udp", mbit)));
    let tcp = effort.tcp_mbit.iter().flat_map(|&mbit| {
        effort
            .tcp_peers
            .iter()
            .map(move |&peer| AccuracyKey::new(peer, "tcp", mbit))
    });
    udp.chain(tcp).collect()
}

/// Series kept for the 10 Mbit/s plots.
#[derive(Default)]
pub struct Plots {
    pub udp: Vec<(String, Series)>,
    pub tcp: Vec<(String, Series)>,
}

fn accuracy_row(
    peer: Peer,
    proto: &str,
    configured_bps: u64,
    measured_bps: f64,
    note: &str,
) -> Value {
    let ratio = measured_bps / configured_bps as f64;
    println!(
        "{:14} {:10} {proto:3} {:>6} Mbit/s configured, {:>9.3} measured, ratio {ratio:.4}{note}",
        peer.tool(),
        peer.action(),
        configured_bps / 1_000_000,
        measured_bps / 1e6,
    );
    json!({
        "tool": peer.tool(),
        "action": peer.action(),
        "proto": proto,
        "configured_bps": configured_bps,
        "measured_bps": measured_bps,
        "ratio": ratio,
        "command": peer.command(configured_bps),
        "note": note.trim_start_matches([';', ' ']),
    })
}

/// UDP at 10× the rate through shaper (drop) and tbf, L2 rate measured at the server over
/// the steady state; TCP single-flow goodput through every peer.
pub fn accuracy(lab: &mut Lab, effort: &TrafficEffort, plots: &mut Plots) -> Result<Value> {
    let mut rows = Vec::new();
    // What the sender can offer at all, unlimited: above it the sender is the limit.
    let top = effort.accuracy_mbit.iter().max().copied().unwrap_or(10);
    let offered = format!("{}M", top * 10);
    let sender_max_bps = lab
        .udp(&Udp {
            rate: Box::leak(offered.into_boxed_str()),
            seconds: effort.accuracy_seconds,
            ..Udp::default()
        })?
        .total_l2_bps();
    println!(
        "UDP with nothing attached, {} Mbit/s offered: {:.0} Mbit/s arrive (the sender's limit)",
        top * 10,
        sender_max_bps / 1e6
    );
    for &mbit in &effort.accuracy_mbit {
        let rate_bps = mbit * 1_000_000;
        let offered: &'static str = Box::leak(format!("{}M", mbit * 10).into_boxed_str());
        let note = if sender_max_bps < 2.0 * rate_bps as f64 {
            format!(
                "; the sender offers only {:.0} Mbit/s, {:.1}× the rate",
                sender_max_bps / 1e6,
                sender_max_bps / rate_bps as f64
            )
        } else {
            String::new()
        };
        for peer in UDP_PEERS {
            let _leftovers = cni_leftovers(lab, peer)?;
            install(lab, peer, rate_bps)?;
            let result = lab.udp(&Udp {
                rate: offered,
                seconds: effort.accuracy_seconds,
                interval: Some(0.1),
                ..Udp::default()
            });
            remove(lab, peer, rate_bps)?;
            let result = result?;
            rows.push(accuracy_row(
                peer,
                "udp",
                rate_bps,
                result.total_l2_bps(),
                &note,
            ));
            if mbit == 10 {
                let label = format!("{} {}", peer.tool(), peer.action());
                plots.udp.push((label, bins(&result.intervals)));
            }
        }
    }
    for &mbit in &effort.tcp_mbit {
        let rate_bps = mbit * 1_000_000;
        for &peer in &effort.tcp_peers {
            // Dropped after `remove`, or on an early return: a CNI run leaves nothing.
            let _leftovers = cni_leftovers(lab, peer)?;
            install(lab, peer, rate_bps)?;
            let result = lab.tcp_series(effort.tcp_seconds, "cubic", 0.1);
            remove(lab, peer, rate_bps)?;
            let result = result?;
            rows.push(accuracy_row(
                peer,
                "tcp",
                rate_bps,
                result.goodput_bps,
                "; cubic, goodput",
            ));
            if mbit == 10 && matches!(peer, Peer::Shaper("drop" | "shape") | Peer::Tbf) {
                let label = format!("{} {}", peer.tool(), peer.action());
                plots.tcp.push((label, bins(&result.intervals)));
            }
        }
    }
    Ok(json!({ "sender_max_udp_bps": sender_max_bps, "rows": rows }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tx_packets_are_the_tenth_counter_after_the_colon() {
        // Two header lines, then one line per interface; a long name leaves no space
        // after the colon.
        let table = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
    r1: 9876543   12345    0    0    0     0          0         0 87654321  424242    0    0    0     0       0          0
averylongname0:1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16
";
        assert_eq!(tx_packets_in(table, "r1"), Some(424_242));
        assert_eq!(tx_packets_in(table, "averylongname0"), Some(10));
        assert_eq!(tx_packets_in(table, "lo"), Some(0));
        assert_eq!(tx_packets_in(table, "r2"), None);
    }

    #[test]
    fn the_error_is_the_standard_deviation_over_the_root_of_the_count() {
        // Sample standard deviation of 1, 2, 3, 4 is sqrt(5/3).
        let (mean, error) = mean_and_error(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(mean, 2.5);
        assert!((error - (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        assert!(mean_and_error(&[0.97]).1.is_nan());
    }
}
