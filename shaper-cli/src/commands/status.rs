use super::{prepare, print_rows, text};
use crate::cli::StatusArgs;
use anyhow::Result;
use serde_json::json;
use shaper::{
    netns::netns_exists,
    state::{check_netns_known, list_locations, Attachment},
};

pub fn run(netns: Option<String>, args: StatusArgs) -> Result<()> {
    prepare(&None)?;
    check_netns_known(&netns)?;
    let mut rows = Vec::new();
    for location in list_locations(netns.as_ref().map(|n| Some(n.clone())).as_ref())? {
        let attachment = Attachment::open_any_layout(&location)?;
        // Pins of another shaper's layout are shown, not read: the command line says
        // what to do with them.
        if let Some(problem) = attachment.layout_problem() {
            rows.push(json!({
                "dev": location.dev,
                "netns": location.netns,
                "direction": location.direction.name(),
                "attach_mode": attachment.mode_from_pins().name(),
                "program_id": attachment.program_id().ok(),
                "live": false,
                "problem": problem,
                "classes": null,
                "flow_table_size": attachment.flow_table_size().ok(),
            }));
            continue;
        }
        let classes = shaper::classes::read_classes(&attachment)?.len();
        // Interface lookups happen in the attachment's own namespace; one whose namespace
        // was deleted is shown as stale, with the command that clears it.
        let status = if location.netns.as_ref().is_some_and(|ns| !netns_exists(ns)) {
            attachment.status_without_namespace()?
        } else {
            shaper::netns::in_namespace(&location.netns, || attachment.status())?
        };
        rows.push(json!({
            "dev": location.dev,
            "netns": location.netns,
            "direction": location.direction.name(),
            "attach_mode": status.mode.name(),
            "program_id": status.program_id,
            "live": status.live,
            "problem": status.problem,
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
        let state = match row["problem"].as_str() {
            None => "attached".to_string(),
            Some(problem) if problem.starts_with("state layout") => {
                format!("other shaper version ({problem})")
            }
            Some(problem) => format!("stale ({problem})"),
        };
        vec![
            text(&row["dev"]),
            row["netns"].as_str().unwrap_or("-").to_string(),
            text(&row["direction"]),
            text(&row["attach_mode"]),
            text(&row["program_id"]),
            state,
            text(&row["classes"]),
            text(&row["flow_table_size"]),
        ]
    })
}
