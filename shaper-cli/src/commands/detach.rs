use super::{directions, prepare};
use crate::{
    cli::DetachArgs,
    error::runtime,
    state::{self, Direction, Location},
};
use anyhow::Result;

pub fn run(netns: Option<String>, args: DetachArgs) -> Result<()> {
    prepare(&netns)?;
    let _lock = state::lock()?;
    let wanted = args
        .direction
        .map(directions)
        .unwrap_or_else(|| Direction::BOTH.to_vec());
    let present: Vec<Location> = wanted
        .into_iter()
        .map(|direction| Location {
            netns: netns.clone(),
            dev: args.dev.clone(),
            direction,
        })
        .filter(|location| location.dir().exists())
        .collect();
    if present.is_empty() {
        return Err(runtime(format!("shaper is not attached to {}", args.dev)));
    }
    for location in present {
        state::detach(&location)?;
        println!("{}: detached", location.describe());
    }
    Ok(())
}
