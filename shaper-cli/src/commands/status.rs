use super::{prepare, print_rows, text};
use crate::cli::StatusArgs;
use anyhow::Result;
use serde_json::json;
use shaper::state::{list_locations, Attachment};

pub fn run(netns: Option<String>, args: StatusArgs) -> Result<()> {
    prepare(&None)?;
    let mut rows = Vec::new();
    for location in list_locations(netns.as_ref().map(|n| Some(n.clone())).as_ref())? {
        // Interface lookups happen in the attachment's own namespace.
        let status = shaper::netns::in_namespace(&location.netns, || {
            let attachment = Attachment::open(&location)?;
            let status = attachment.status()?;
            Ok((status, shaper::classes::read_classes(&attachment)?.len()))
        });
        let (status, classes) = status?;
        rows.push(json!({
            "dev": location.dev,
            "netns": location.netns,
            "direction": location.direction.name(),
            "attach_mode": status.mode.name(),
            "program_id": status.program_id,
            "live": status.live,
            "classes": classes,
            "flow_table_size": status.flow_table_size,
        }));
    }
    if rows.is_empty() && !args.json {
        println!("shaper is not attached anywhere");
        return Ok(());
    }
    let header = [
        "DEV",
        "NETNS",
        "DIRECTION",
        "MODE",
        "PROGRAM",
        "STATE",
        "CLASSES",
        "FLOW TABLE",
    ];
    print_rows(&rows, args.json, &header, |row| {
        let state = if row["live"].as_bool() == Some(true) {
            "attached"
        } else {
            "stale (interface gone?)"
        };
        vec![
            text(&row["dev"]),
            row["netns"].as_str().unwrap_or("-").to_string(),
            text(&row["direction"]),
            text(&row["attach_mode"]),
            text(&row["program_id"]),
            state.to_string(),
            text(&row["classes"]),
            text(&row["flow_table_size"]),
        ]
    })
}
