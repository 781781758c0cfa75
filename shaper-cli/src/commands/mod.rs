//! One module per command; each validates its whole command line before touching state.

mod apply;
mod attach;
mod batch;
mod class;
mod daemon;
mod detach;
mod global;
mod stats;
mod status;
mod upgrade;

use crate::cli::{Cli, Command, DirectionArg};
use anyhow::Result;
use shaper::state::Direction;

pub fn run(cli: Cli) -> Result<()> {
    // `ip netns exec NS shaper …` works as `shaper --netns NS …` (its private /sys would
    // lose the pins).
    let netns = match cli.netns {
        Some(name) => Some(name),
        None if !matches!(cli.command, Command::Completions(_) | Command::Manpages(_)) => {
            shaper::netns::leave_ip_netns_exec()?
        }
        None => None,
    };
    shaper::state::set_lock_wait(std::time::Duration::from_secs(cli.wait));
    match cli.command {
        Command::Attach(args) => attach::run(netns, args),
        Command::Detach(args) => detach::run(netns, args),
        Command::Upgrade(args) => upgrade::run(netns, args),
        Command::Class(command) => class::run(netns, *command),
        Command::Stats(args) => stats::run(netns, args),
        Command::Status(args) => status::run(netns, args),
        Command::Batch(args) => batch::run(netns, args),
        Command::Apply(args) => apply::run(netns, args),
        Command::Export(args) => apply::export(netns, args),
        Command::Daemon(args) => daemon::run(netns, args),
        Command::Global(command) => global::run(netns, command),
        Command::Completions(args) => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(args.shell, &mut command, "shaper", &mut std::io::stdout());
            Ok(())
        }
        Command::Manpages(args) => manpages(&args.dir),
    }
}

/// Capability check, then the move into the target namespace (if any).
fn prepare(netns: &Option<String>) -> Result<()> {
    shaper::caps::require()?;
    if let Some(name) = netns {
        shaper::netns::enter(name)?;
    }
    Ok(())
}

pub use class::spec_from_args;

/// One man page per command and subcommand (shaper.8, shaper-class-add.8, ...).
fn manpages(dir: &std::path::Path) -> Result<()> {
    fn write(dir: &std::path::Path, command: clap::Command, name: String) -> Result<()> {
        let mut page = Vec::new();
        // clap names are &'static: this command runs once and exits.
        let static_name: &'static str = Box::leak(name.clone().into_boxed_str());
        // Section 8: shaper administers the system (it installs in /usr/sbin).
        clap_mangen::Man::new(command.clone().name(static_name))
            .section("8")
            .render(&mut page)?;
        std::fs::write(dir.join(format!("{name}.8")), page)?;
        for sub in command
            .get_subcommands()
            .filter(|s| !s.is_hide_set() && s.get_name() != "help")
        {
            write(dir, sub.clone(), format!("{name}-{}", sub.get_name()))?;
        }
        Ok(())
    }
    std::fs::create_dir_all(dir)?;
    let mut command = <Cli as clap::CommandFactory>::command();
    command.build();
    write(dir, command, "shaper".into())
}

fn directions(arg: DirectionArg) -> Vec<Direction> {
    match arg {
        DirectionArg::Egress => vec![Direction::Egress],
        DirectionArg::Ingress => vec![Direction::Ingress],
        DirectionArg::Both => Direction::BOTH.to_vec(),
    }
}

/// Prints read-command output: pretty JSON for scripts, else an aligned table.
fn print_rows(
    rows: &[serde_json::Value],
    json: bool,
    header: &[&str],
    cells: impl Fn(&serde_json::Value) -> Vec<String>,
) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(rows)?);
        return Ok(());
    }
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header(header);
    for row in rows {
        table.add_row(cells(row));
    }
    println!("{table}");
    Ok(())
}

/// A JSON field as a table cell: strings bare, null as `*` (matches anything).
fn text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Null => "*".to_string(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
