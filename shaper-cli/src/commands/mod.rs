//! One module per command; each validates its whole command line before touching state.

mod attach;
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
