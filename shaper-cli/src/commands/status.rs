use super::{prepare, print_rows, text};
use crate::cli::StatusArgs;
use anyhow::Result;
use shaper::{
    report::attachment_row,
    state::{check_netns_known, list_locations},
};

pub fn run(netns: Option<String>, args: StatusArgs) -> Result<()> {
    prepare(&None)?;
    check_netns_known(&netns)?;
    let mut rows = Vec::new();
    for location in list_locations(netns.as_ref().map(|n| Some(n.clone())).as_ref())? {
        rows.push(serde_json::to_value(attachment_row(&location)?)?);
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
        "SPLIT",
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
            row["split_through"].as_str().unwrap_or("-").to_string(),
        ]
    })
}
