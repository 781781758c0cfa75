use super::{directions, prepare};
use crate::cli::{AttachArgs, AttachModeArg};
use anyhow::Result;
use shaper::state::{self, AttachMode, Attachment, Location};

pub fn run(netns: Option<String>, args: AttachArgs) -> Result<()> {
    let forced_mode = args.attach_mode.map(|m| match m {
        AttachModeArg::Tcx => AttachMode::Tcx,
        AttachModeArg::Clsact => AttachMode::Clsact,
    });
    prepare(&netns)?;
    shaper::netns::ifindex(&args.dev)?;
    let _lock = state::lock()?;
    let mut attached_now = Vec::new();
    for direction in directions(args.direction) {
        let location = Location {
            netns: netns.clone(),
            dev: args.dev.clone(),
            direction,
        };
        if location.dir().exists() {
            let status = Attachment::open(&location)?.status()?;
            let resize = args
                .flow_table_size
                .filter(|&size| size != status.flow_table_size);
            let switch = forced_mode.filter(|&m| m != status.mode);
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
            shaper::classes::shape_classes_changed(&state::Attachment::open(&location)?);
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
                // All or nothing: undo the directions this call attached.
                for location in &attached_now {
                    let _ = state::detach(location);
                }
                return Err(error);
            }
        }
    }
    Ok(())
}
