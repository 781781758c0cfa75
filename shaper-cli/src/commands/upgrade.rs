use super::directions;
use crate::cli::UpgradeArgs;
use anyhow::Result;
use shaper::{
    error::{one_line, runtime},
    netns::{in_namespace, netns_exists},
    state::check_netns_known,
    state::{self, list_locations, Direction},
};

pub fn run(netns: Option<String>, args: UpgradeArgs) -> Result<()> {
    shaper::caps::require()?;
    check_netns_known(&netns)?;
    let wanted = args
        .direction
        .map(directions)
        .unwrap_or_else(|| Direction::BOTH.to_vec());
    let _lock = state::lock()?;
    let locations: Vec<_> = list_locations(netns.as_ref().map(|n| Some(n.clone())).as_ref())?
        .into_iter()
        .filter(|location| args.all || Some(&location.dev) == args.dev.as_ref())
        .filter(|location| wanted.contains(&location.direction))
        // Pins of a deleted namespace have nothing left to upgrade.
        .filter(|location| location.netns.as_ref().is_none_or(|ns| netns_exists(ns)))
        .collect();
    if locations.is_empty() {
        return Err(runtime(match &args.dev {
            Some(dev) => format!("shaper is not attached to {dev}"),
            None => "shaper is not attached anywhere".to_string(),
        }));
    }
    let mut failed = 0;
    for location in &locations {
        match in_namespace(&location.netns, || state::upgrade(location, args.reload)) {
            Ok(done) if done.changed() => println!(
                "{}: upgraded (program {} -> {}, state layout {} -> {})",
                location.describe(),
                done.old_program_id,
                done.new_program_id,
                done.from_layout,
                shaper_common::LAYOUT_VERSION
            ),
            Ok(done) => println!(
                "{}: already runs this build (program {})",
                location.describe(),
                done.old_program_id
            ),
            // One attachment: its error is the command's one line.
            Err(error) if locations.len() == 1 => return Err(error),
            Err(error) => {
                eprintln!("shaper: {}", one_line(&format!("{error:#}")));
                failed += 1;
            }
        }
    }
    if failed > 0 {
        return Err(runtime(format!(
            "{failed} of {} attachments were not upgraded (see above)",
            locations.len()
        )));
    }
    Ok(())
}
