use super::prepare;
use crate::{cli::StatsArgs, units::format_rate};
use anyhow::Result;
use comfy_table::Table;

pub fn run(netns: Option<String>, args: StatsArgs) -> Result<()> {
    prepare(&None)?;
    let rows = super::class::collect(&netns, &args.dev)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut table = Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header([
        "NAME",
        "DEV",
        "DIR",
        "RATE",
        "PASSED PKTS",
        "PASSED BYTES",
        "DROPPED PKTS",
        "DROPPED BYTES",
    ]);
    for row in &rows {
        let number = |key: &str| row[key].as_u64().unwrap_or(0).to_string();
        table.add_row([
            row["name"].as_str().unwrap_or_default().to_string(),
            row["dev"].as_str().unwrap_or_default().to_string(),
            row["direction"].as_str().unwrap_or_default().to_string(),
            format_rate(row["rate_bps"].as_u64().unwrap_or(0)),
            number("passed_packets"),
            number("passed_bytes"),
            number("dropped_packets"),
            number("dropped_bytes"),
        ]);
    }
    println!("{table}");
    Ok(())
}
