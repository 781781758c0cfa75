//! One module per command; each validates its whole command line before touching state.

mod attach;
mod batch;
mod class;
mod detach;
mod stats;
mod status;

use crate::{
    cli::{Cli, Command, DirectionArg, SingleDirection},
    state::Direction,
};
use anyhow::Result;

pub fn run(cli: Cli) -> Result<()> {
    let netns = cli.netns;
    match cli.command {
        Command::Attach(args) => attach::run(netns, args),
        Command::Detach(args) => detach::run(netns, args),
        Command::Class(command) => class::run(netns, *command),
        Command::Stats(args) => stats::run(netns, args),
        Command::Status(args) => status::run(netns, args),
        Command::Batch(args) => batch::run(netns, args),
    }
}

/// Capability check, then the move into the target namespace (if any).
fn prepare(netns: &Option<String>) -> Result<()> {
    crate::caps::require()?;
    if let Some(name) = netns {
        crate::netns::enter(name)?;
    }
    Ok(())
}

use class::spec_from_args;

fn directions(arg: DirectionArg) -> Vec<Direction> {
    match arg {
        DirectionArg::Egress => vec![Direction::Egress],
        DirectionArg::Ingress => vec![Direction::Ingress],
        DirectionArg::Both => Direction::BOTH.to_vec(),
    }
}

fn single(arg: SingleDirection) -> Direction {
    match arg {
        SingleDirection::Egress => Direction::Egress,
        SingleDirection::Ingress => Direction::Ingress,
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
