use super::{directions, prepare};
use crate::cli::DetachArgs;
use anyhow::Result;
use shaper::{
    error::runtime,
    state::{self, Direction, Location},
};

pub fn run(netns: Option<String>, args: DetachArgs) -> Result<()> {
    let wanted = args
        .direction
        .map(directions)
        .unwrap_or_else(|| Direction::BOTH.to_vec());
    // A deleted namespace took its interfaces and hooks with it; only pins remain.
    if let Some(name) = &netns {
        if !std::path::Path::new("/run/netns").join(name).exists() {
            shaper::caps::require()?;
            let _lock = state::lock()?;
            let mut forgotten = 0;
            for direction in wanted {
                let location = Location {
                    netns: netns.clone(),
                    dev: args.dev.clone(),
                    direction,
                };
                if location.dir().exists() {
                    state::forget(&location)?;
                    println!("{}: namespace is gone; pins removed", location.describe());
                    forgotten += 1;
                }
            }
            if forgotten == 0 {
                return Err(runtime(format!("network namespace '{name}' not found")));
            }
            return Ok(());
        }
    }
    prepare(&netns)?;
    let _lock = state::lock()?;
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
