//! The command line. These spellings are a contract other tools and tests rely on.

use crate::class_args::ClassFields;
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
    /// Limits shared across hosts (global classes) in Redis.
    #[command(subcommand)]
    Global(GlobalCommand),
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

#[derive(Subcommand, Debug)]
pub enum GlobalCommand {
    /// Write a file's global limits into Redis, where every host's allocator reads them
    /// instead of its own file's (run once per change, as a Redis user that may write
    /// `shaper:{*}:limits`).
    Publish(PublishArgs),
    /// Run the fill of a file's global keys every half interval, as a Redis user that may
    /// (hosts' users may not): on one or more trusted machines, until stopped. Several
    /// allocators fill no more often than one.
    Allocate(AllocateArgs),
}

#[derive(Args, Debug)]
pub struct AllocateArgs {
    /// The configuration file whose global classes to fill (their rates are the limits
    /// unless published), or - for standard input.
    #[arg(short = 'f', long = "file")]
    pub file: String,
    #[command(flatten)]
    pub admin: AdminRedisArgs,
}

#[derive(Args, Debug)]
pub struct PublishArgs {
    /// The configuration file whose global classes give the limits, or - for standard
    /// input.
    #[arg(short = 'f', long = "file")]
    pub file: String,
    #[command(flatten)]
    pub admin: AdminRedisArgs,
    /// Print what would be published and write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// How `global publish` and `global allocate` reach Redis as a user other than a host's.
#[derive(Args, Debug)]
pub struct AdminRedisArgs {
    /// The Redis URL (default: the file's `[coordination] redis`); its user must be
    /// allowed what a host's user is not (writing the limits, running the fill). Without
    /// a password (refused here: `ps` shows it to everyone).
    #[arg(long)]
    pub redis: Option<String>,
    /// A file (readable by its owner alone) with that user's password; else
    /// $SHAPER_REDIS_PASSWORD.
    #[arg(long)]
    pub password_file: Option<std::path::PathBuf>,
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
    /// Capacity of the per-flow/src/dst bucket table (LRU): the most keys tracked at once
    /// [default: 65536]. On an attachment that has another size, the table is resized
    /// under traffic (buckets, classes and counters kept).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub flow_table_size: Option<u32>,
    /// Ingress (or both): hand every packet the hook lets pass to shaper's ifb of the
    /// interface, which cuts GSO/GRO aggregates into wire-size segments, so shape classes
    /// on the way out judge segments, not 64 KiB at once (forwarded TSO or GRO traffic).
    /// `--split-aggregates=false` turns it off.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub split_aggregates: Option<bool>,
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
    #[command(flatten)]
    pub fields: ClassFields<false>,
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
    #[command(flatten)]
    pub fields: ClassFields<true>,
    /// Move the class to the top level (no parent, ceiling or cburst).
    #[arg(long, conflicts_with = "parent")]
    pub no_parent: bool,
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
            name: Some(args.name.clone()),
            direction: Some(shaper::state::Direction::from(args.direction).name().into()),
            ..args.fields.0.clone()
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
