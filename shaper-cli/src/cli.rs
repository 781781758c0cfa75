//! The command line. These spellings are a contract other tools and tests rely on.

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "shaper",
    version,
    about = "eBPF traffic shaper: police UDP/TCP per class, flow, source or destination"
)]
pub struct Cli {
    /// Operate on an interface inside this named network namespace (ip netns); pins stay
    /// in the host's bpffs.
    #[arg(long, global = true, value_name = "NAME", value_parser = netns_name)]
    pub netns: Option<String>,
    /// Wait at most SECONDS for another shaper command that holds the state lock (as
    /// `iptables -w`), then fail naming it; 0 fails at once.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub wait: u64,
    /// More log output on stderr: -v debug, -vv trace (also `RUST_LOG`).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Attach shaper's program to an interface (idempotent).
    Attach(AttachArgs),
    /// Detach shaper from an interface and remove every pin it owns.
    Detach(DetachArgs),
    /// Swap this shaper's program in for the attached one under traffic, keeping classes,
    /// buckets and counters (and migrating state of an older layout).
    Upgrade(UpgradeArgs),
    /// Add, change, delete or list classes.
    #[command(subcommand)]
    Class(Box<ClassCommand>),
    /// Per-class counters.
    Stats(StatsArgs),
    /// What is attached where.
    Status(StatusArgs),
    /// Run shaper commands from a file, one per line (like tc -batch).
    Batch(BatchArgs),
    /// Make the kernel state match a TOML configuration file (only what differs changes).
    Apply(ApplyArgs),
    /// Print the current state as a configuration file (`export | apply -f -` is a no-op).
    Export(ExportArgs),
    /// Keep a configuration file applied: reload on SIGHUP and on change, re-attach
    /// re-created interfaces, serve Prometheus metrics.
    Daemon(DaemonArgs),
    /// Print a shell completion script.
    Completions(CompletionsArgs),
    /// Write man pages for every command into a directory (used by `cargo xtask man`).
    #[command(hide = true)]
    Manpages(ManpagesArgs),
}

#[derive(Args, Debug)]
pub struct ApplyArgs {
    /// The configuration file, or - for standard input.
    #[arg(short = 'f', long = "file")]
    pub file: String,
    /// Print the plan (add / change / replace / delete) and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Also detach shaper from interfaces the file does not name.
    #[arg(long)]
    pub prune: bool,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Only this interface.
    #[arg(long, value_parser = interface_name)]
    pub dev: Option<String>,
}

#[derive(Args, Debug)]
pub struct DaemonArgs {
    /// The configuration file.
    #[arg(short = 'f', long = "file")]
    pub file: String,
    /// Where to serve Prometheus metrics (/metrics) and a health check (/healthz).
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics_addr: String,
    /// How often to check the file and the interfaces (1s, 500ms, ...).
    #[arg(long, default_value = "1s")]
    pub interval: String,
    /// Keep the programs attached by another shaper build: by default the daemon swaps
    /// its own in at start (as `shaper upgrade`), keeping classes, buckets and counters.
    #[arg(long)]
    pub no_upgrade: bool,
    /// Detach the configured interfaces when the daemon stops (default: leave them
    /// shaped; the kernel keeps enforcing without the daemon).
    #[arg(long)]
    pub cleanup_on_exit: bool,
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to print the script for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub struct ManpagesArgs {
    /// The directory to write the pages into.
    pub dir: std::path::PathBuf,
}

#[derive(Args, Debug)]
pub struct BatchArgs {
    /// The file, or - for standard input.
    #[arg(short = 'f', long = "file")]
    pub file: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DirectionArg {
    Egress,
    Ingress,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SingleDirection {
    Egress,
    Ingress,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttachModeArg {
    Tcx,
    Clsact,
}

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// Interface name.
    #[arg(value_parser = interface_name)]
    pub dev: String,
    /// Which way of the interface's traffic to hook: egress (sent), ingress (received)
    /// or both.
    #[arg(long, value_enum, default_value = "egress")]
    pub direction: DirectionArg,
    /// Force an attach mode; by default TCX, falling back to clsact where TCX is missing.
    #[arg(long, value_enum)]
    pub attach_mode: Option<AttachModeArg>,
    /// Capacity of the per-flow/src/dst bucket table (LRU): the most keys tracked at once.
    #[arg(long, default_value_t = shaper_common::DEFAULT_FLOW_TABLE_SIZE, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub flow_table_size: u32,
}

#[derive(Args, Debug)]
pub struct DetachArgs {
    /// Interface name.
    #[arg(value_parser = interface_name)]
    pub dev: String,
    /// Default: every direction shaper is attached to.
    #[arg(long, value_enum)]
    pub direction: Option<DirectionArg>,
}

#[derive(Args, Debug)]
pub struct UpgradeArgs {
    /// The interface to upgrade (every direction shaper is attached to, unless
    /// --direction).
    #[arg(value_parser = interface_name, required_unless_present = "all", conflicts_with = "all")]
    pub dev: Option<String>,
    /// Every attachment on the machine (with --netns: in that namespace).
    #[arg(long)]
    pub all: bool,
    /// Load and swap in the program even where the attached one is this very build (it
    /// is verified afresh; classes, buckets and counters stay).
    #[arg(long)]
    pub reload: bool,
    /// Only this direction (default: every direction shaper is attached to).
    #[arg(long, value_enum)]
    pub direction: Option<DirectionArg>,
}

#[derive(Subcommand, Debug)]
pub enum ClassCommand {
    /// Add a class: a rule plus a token bucket.
    Add(Box<ClassAddArgs>),
    /// Change a class in place (rate, burst, action, CoDel, parent, ceiling), effective at once.
    Change(Box<ClassChangeArgs>),
    /// Delete a class.
    Del(ClassDelArgs),
    /// List classes.
    List(ListArgs),
}

#[derive(Args, Debug)]
pub struct ClassAddArgs {
    /// The class's name, unique per interface and direction: 1-47 letters, digits, '-',
    /// '_', '.', ':'.
    pub name: String,
    /// The interface the class is on (shaper attached there).
    #[arg(long, value_parser = interface_name)]
    pub dev: String,
    /// Which attachment of the interface the class is on.
    #[arg(long, value_enum, default_value = "egress")]
    pub direction: SingleDirection,
    /// Rate as in tc: 10mbit, 1gbit, 125kbps, ... (bare number = bit/s).
    #[arg(long)]
    pub rate: String,
    /// Burst as in tc: 64k, 1mb, ... Default: max(128k, 250 ms at the rate); with
    /// `--action shape`, max(128k, 10 ms at the rate).
    #[arg(long)]
    pub burst: Option<String>,
    /// Who shares one bucket: the whole class, each flow (5-tuple), each source or
    /// each destination address.
    #[arg(long, default_value = "class")]
    pub per: String,
    /// Rule: the IP protocol, tcp, udp, icmp (ICMP or ICMPv6) or any.
    #[arg(long, default_value = "any")]
    pub proto: String,
    /// Rule: the source address or prefix, IPv4 or IPv6 (198.18.0.0/15, fd00::1).
    #[arg(long, value_name = "CIDR")]
    pub src: Option<String>,
    /// Rule: the destination address or prefix, IPv4 or IPv6.
    #[arg(long, value_name = "CIDR")]
    pub dst: Option<String>,
    /// Rule: the TCP or UDP source port or range (443, 5060-5080).
    #[arg(long, value_name = "P[-P]")]
    pub sport: Option<String>,
    /// Rule: the TCP or UDP destination port or range.
    #[arg(long, value_name = "P[-P]")]
    pub dport: Option<String>,
    /// Lower number wins, as in tc.
    #[arg(long, default_value_t = 100)]
    pub prio: u32,
    /// What happens to packets over the rate: drop (default), ecn, dscp=VALUE,
    /// fwmark=N[/MASK], pass, shape.
    #[arg(long)]
    pub action: Option<String>,
    /// RFC 2697 srTCM meter: excess burst size (with --rate as CIR, --burst as CBS).
    #[arg(long, value_name = "SIZE")]
    pub excess_burst: Option<String>,
    /// RFC 2698 trTCM meter: peak information rate (>= --rate, the CIR).
    #[arg(long, value_name = "RATE")]
    pub peak_rate: Option<String>,
    /// RFC 2698 trTCM meter: peak burst size (default: as --burst for the peak rate).
    #[arg(long, value_name = "SIZE")]
    pub peak_burst: Option<String>,
    /// Meters: action on yellow packets (default pass).
    #[arg(long, value_name = "ACTION")]
    pub exceed: Option<String>,
    /// Meters: action on red packets (default drop).
    #[arg(long, value_name = "ACTION")]
    pub violate: Option<String>,
    #[command(flatten)]
    pub codel: CodelArgs,
    /// A class on the same interface and direction that this one is charged to as well:
    /// its rate is guaranteed within the parent, and it may borrow up to --ceil.
    #[arg(long, value_name = "CLASS")]
    pub parent: Option<String>,
    /// With --parent: the rate this class may reach by borrowing what its parent has
    /// spare (default: its --rate, no borrowing).
    #[arg(long, value_name = "RATE")]
    pub ceil: Option<String>,
    /// With --parent: the burst at the ceiling (default: as --burst).
    #[arg(long, value_name = "SIZE")]
    pub cburst: Option<String>,
    /// A limit across hosts: --rate is for all hosts with this key together, and
    /// `shaper daemon` with `[coordination]` sets this host's share (it starts at --floor).
    #[arg(long, value_name = "KEY")]
    pub global: Option<String>,
    /// With --global, when Redis cannot be reached: static (keep the share, then the limit
    /// over the last host count), open (the whole --rate) or closed (--floor).
    #[arg(long, value_name = "MODE")]
    pub on_coordinator_loss: Option<String>,
    /// With --global: the least this host keeps (default: 1 % of --rate, at least 64kbit).
    #[arg(long, value_name = "RATE")]
    pub floor: Option<String>,
}

/// CoDel's knobs on a shape class (`class add` and `class change`).
#[derive(Args, Debug)]
pub struct CodelArgs {
    /// Shape: CoDel's target, the standing queue delay to keep (default 5ms; raised to
    /// 1.5 frame times at low rates). A larger one keeps the class's bulk packets queued
    /// longer (sparse flows such as pings and DNS skip that queue), and on a long path it
    /// makes back-to-back cuts of a sender's window more frequent.
    #[arg(long, value_name = "DURATION")]
    pub target: Option<String>,
    /// Shape: CoDel's interval, how long the delay may stay above target before drops
    /// start, and the spacing of the first drops (default 100ms). Set it to about the
    /// path's RTT plus the time a sender's answer takes to drain the queue: a single bulk
    /// flow over a long path fills the rate better with a longer one (80 ms RTT,
    /// 20 Mbit/s: median 0.92 with 200ms, 0.90 with 100ms). The standing queue stays at
    /// the target; the hard cap and the bfifo grow with the interval.
    #[arg(long, value_name = "DURATION")]
    pub interval: Option<String>,
    /// Shape: `on` (default) CE-marks ECN-capable packets where CoDel would drop them;
    /// `off` drops them too.
    #[arg(long, value_name = "on|off")]
    pub ecn: Option<String>,
}

#[derive(Args, Debug)]
pub struct ClassChangeArgs {
    /// The class to change.
    pub name: String,
    /// The interface the class is on.
    #[arg(long, value_parser = interface_name)]
    pub dev: String,
    /// Needed only when the name exists in both directions.
    #[arg(long, value_enum)]
    pub direction: Option<SingleDirection>,
    /// A new rate, as in tc (10mbit); buckets carry on at the new rate.
    #[arg(long)]
    pub rate: Option<String>,
    /// A new burst, as in tc (64k).
    #[arg(long)]
    pub burst: Option<String>,
    /// A new action over the rate (as `class add --action`).
    #[arg(long)]
    pub action: Option<String>,
    #[command(flatten)]
    pub codel: CodelArgs,
    /// Move the class under another parent (same interface and direction).
    #[arg(long, value_name = "CLASS", conflicts_with = "no_parent")]
    pub parent: Option<String>,
    /// Move the class to the top level (no parent).
    #[arg(long)]
    pub no_parent: bool,
    /// A new ceiling (`rate`: back to the class's rate).
    #[arg(long, value_name = "RATE")]
    pub ceil: Option<String>,
    /// A new burst at the ceiling (`burst`: back to the class's burst).
    #[arg(long, value_name = "SIZE")]
    pub cburst: Option<String>,
}

#[derive(Args, Debug)]
pub struct ClassDelArgs {
    /// The class to delete (a parent only once its children are deleted or moved).
    pub name: String,
    /// The interface the class is on.
    #[arg(long, value_parser = interface_name)]
    pub dev: String,
    /// Needed only when the name exists in both directions.
    #[arg(long, value_enum)]
    pub direction: Option<SingleDirection>,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only this interface.
    #[arg(long, value_parser = interface_name)]
    pub dev: Option<String>,
    /// JSON: an array of classes.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// Only this interface.
    #[arg(long, value_parser = interface_name)]
    pub dev: Option<String>,
    /// JSON: an array, or with --watch one object per line.
    #[arg(long)]
    pub json: bool,
    /// Refresh every --interval with current bit/s, packets/s, drop and mark percentages.
    #[arg(long)]
    pub watch: bool,
    /// With --watch: the time between samples (1s, 500ms, ...).
    #[arg(long, default_value = "1s")]
    pub interval: String,
    /// With --watch: stop after this many samples.
    #[arg(long)]
    pub count: Option<u64>,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// JSON: one object per attachment.
    #[arg(long)]
    pub json: bool,
}

impl From<&ClassAddArgs> for shaper::class_input::ClassInput {
    fn from(args: &ClassAddArgs) -> Self {
        Self {
            name: args.name.clone(),
            direction: Some(shaper::state::Direction::from(args.direction).name().into()),
            rate: args.rate.clone(),
            burst: args.burst.clone(),
            per: Some(args.per.clone()),
            proto: Some(args.proto.clone()),
            src: args.src.clone(),
            dst: args.dst.clone(),
            sport: args.sport.clone(),
            dport: args.dport.clone(),
            prio: Some(args.prio.to_string()),
            action: args.action.clone(),
            excess_burst: args.excess_burst.clone(),
            peak_rate: args.peak_rate.clone(),
            peak_burst: args.peak_burst.clone(),
            exceed: args.exceed.clone(),
            violate: args.violate.clone(),
            target: args.codel.target.clone(),
            interval: args.codel.interval.clone(),
            ecn: args.codel.ecn.clone(),
            parent: args.parent.clone(),
            ceil: args.ceil.clone(),
            cburst: args.cburst.clone(),
            global: args.global.clone(),
            on_coordinator_loss: args.on_coordinator_loss.clone(),
            floor: args.floor.clone(),
        }
    }
}

impl From<SingleDirection> for shaper::state::Direction {
    fn from(arg: SingleDirection) -> Self {
        match arg {
            SingleDirection::Egress => Self::Egress,
            SingleDirection::Ingress => Self::Ingress,
        }
    }
}

/// An interface name as the kernel takes it (checked before it becomes a path).
fn interface_name(text: &str) -> Result<String, String> {
    shaper::netns::check_ifname(text)
        .map(|()| text.to_string())
        .map_err(|error| error.to_string())
}

/// A network namespace name `ip netns` could have made.
fn netns_name(text: &str) -> Result<String, String> {
    shaper::netns::check_netns_name(text)
        .map(|()| text.to_string())
        .map_err(|error| error.to_string())
}
