use super::{directions, prepare};
use crate::cli::{AttachArgs, AttachModeArg, DirectionArg};
use anyhow::Result;
use shaper::state::{self, AttachMode, Attachment, Direction, Location};

pub fn run(netns: Option<String>, args: AttachArgs) -> Result<()> {
    let forced_mode = args.attach_mode.map(|m| match m {
        AttachModeArg::Tcx => AttachMode::Tcx,
        AttachModeArg::Clsact => AttachMode::Clsact,
    });
    if args.split_aggregates.is_some() && args.direction == DirectionArg::Egress {
        return Err(shaper::classes::split_needs_ingress());
    }
    prepare(&netns)?;
    shaper::netns::ifindex(&args.dev)?;
    let _lock = state::lock()?;
    if args.split_aggregates == Some(true) {
        // Before anything is hooked, resized or switched: all or nothing.
        shaper::classes::check_split(&args.dev)?;
    }
    let mut attached_now = Vec::new();
    let locations: Vec<Location> = directions(args.direction)
        .into_iter()
        .map(|direction| Location {
            netns: netns.clone(),
            dev: args.dev.clone(),
            direction,
        })
        .collect();
    hook(&args, forced_mode, &locations, &mut attached_now)?;
    if let Some(on) = args.split_aggregates {
        // With --direction both, the ingress attachment splits.
        for location in locations
            .iter()
            .filter(|l| l.direction == Direction::Ingress)
        {
            let split = shaper::classes::set_split(&Attachment::open(location)?, on);
            if let Err(error) = split {
                undo(&attached_now);
                return Err(error);
            }
            match on {
                true => println!(
                    "{}: aggregates split through {}",
                    location.describe(),
                    shaper::qdisc::ifb_name(&location.dev)
                ),
                false => println!("{}: aggregates pass whole", location.describe()),
            }
        }
    }
    Ok(())
}

/// Hooks each location (fresh, re-attached, resized or switched); the fresh ones are
/// pushed to `attached_now`. On an error every fresh one is detached again.
fn hook(
    args: &AttachArgs,
    forced_mode: Option<AttachMode>,
    locations: &[Location],
    attached_now: &mut Vec<Location>,
) -> Result<()> {
    for location in locations {
        let location = location.clone();
        if location.dir().exists() {
            let status = Attachment::open(&location)?.status()?;
            let resize = args
                .flow_table_size
                .filter(|&size| size != status.flow_table_size);
            let switch = forced_mode.filter(|&m| m != status.mode);
            if status.live {
                requeue(&location).inspect_err(|_| undo(attached_now))?;
            }
            if status.live && (resize.is_some() || switch.is_some()) {
                if let Some(size) = resize {
                    let carried = state::resize_flow_table(&location, size)?;
                    println!(
                        "{}: flow table resized from {} to {size} under traffic ({carried} keys carried over)",
                        location.describe(),
                        status.flow_table_size
                    );
                }
                if let Some(mode) = switch {
                    state::switch_mode(&location, mode)?;
                    println!(
                        "{}: switched from {} to {} under traffic, classes kept",
                        location.describe(),
                        status.mode.name(),
                        mode.name()
                    );
                }
                continue;
            }
            if status.live {
                println!(
                    "{}: already attached ({})",
                    location.describe(),
                    status.mode.name()
                );
                continue;
            }
            // The interface was re-created or the program unhooked: hook the pinned
            // program again, keeping classes, buckets and counters.
            let mode = state::reattach(&location)?;
            let attachment = state::Attachment::open(&location)?;
            shaper::classes::refresh_split(&attachment)?;
            shaper::classes::requeue(&attachment)?;
            shaper::classes::shape_classes_changed(&attachment);
            println!(
                "{}: re-attached ({}), classes kept",
                location.describe(),
                mode.name()
            );
            continue;
        }
        let size = args
            .flow_table_size
            .unwrap_or(shaper_common::DEFAULT_FLOW_TABLE_SIZE);
        match state::attach_fresh(&location, forced_mode, size) {
            Ok(mode) => {
                println!("{}: attached ({})", location.describe(), mode.name());
                attached_now.push(location);
            }
            Err(error) => {
                undo(attached_now);
                return Err(error);
            }
        }
    }
    Ok(())
}

/// Ingress shape classes whose ifb was deleted are queued on it again.
fn requeue(location: &Location) -> Result<()> {
    let requeued = shaper::classes::requeue(&Attachment::open(location)?)?;
    if !requeued.is_empty() {
        let names = requeued.join(", ");
        println!("{}: {names} queued again on a new ifb", location.describe());
    }
    Ok(())
}

/// All or nothing: detaches the directions this call attached.
fn undo(attached_now: &[Location]) {
    for location in attached_now {
        let _ = state::detach(location);
    }
}
