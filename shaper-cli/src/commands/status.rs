use super::prepare;
use crate::{
    cli::StatusArgs,
    state::{list_locations, Attachment},
};
use anyhow::Result;
use comfy_table::Table;
use serde_json::json;

pub fn run(netns: Option<String>, args: StatusArgs) -> Result<()> {
    prepare(&None)?;
    let mut rows = Vec::new();
    for location in list_locations(netns.as_ref().map(|n| Some(n.clone())).as_ref())? {
        // Interface lookups happen in the attachment's own namespace.
        let status = crate::netns::in_namespace(&location.netns, || {
            let attachment = Attachment::open(&location)?;
            let status = attachment.status()?;
            Ok((status, crate::classes::read_classes(&attachment)?.len()))
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
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("shaper is not attached anywhere");
        return Ok(());
    }
    let mut table = Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header([
        "DEV",
        "NETNS",
        "DIRECTION",
        "MODE",
        "PROGRAM",
        "STATE",
        "CLASSES",
        "FLOW TABLE",
    ]);
    for row in rows {
        table.add_row([
            row["dev"].as_str().unwrap_or_default().to_string(),
            row["netns"].as_str().unwrap_or("-").to_string(),
            row["direction"].as_str().unwrap_or_default().to_string(),
            row["attach_mode"].as_str().unwrap_or_default().to_string(),
            row["program_id"].to_string(),
            if row["live"].as_bool() == Some(true) {
                "attached"
            } else {
                "stale (interface gone?)"
            }
            .to_string(),
            row["classes"].to_string(),
            row["flow_table_size"].to_string(),
        ]);
    }
    println!("{table}");
    Ok(())
}
