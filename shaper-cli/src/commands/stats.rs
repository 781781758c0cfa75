use super::{prepare, print_rows, text};
use crate::{cli::StatsArgs, units::format_rate};
use anyhow::Result;

pub fn run(netns: Option<String>, args: StatsArgs) -> Result<()> {
    prepare(&None)?;
    let rows = super::class::collect(&netns, &args.dev)?;
    let header = [
        "NAME",
        "DEV",
        "DIR",
        "RATE",
        "PASSED PKTS",
        "PASSED BYTES",
        "DROPPED PKTS",
        "DROPPED BYTES",
    ];
    print_rows(&rows, args.json, &header, |row| {
        vec![
            text(&row["name"]),
            text(&row["dev"]),
            text(&row["direction"]),
            format_rate(row["rate_bps"].as_u64().unwrap_or(0)),
            text(&row["passed_packets"]),
            text(&row["passed_bytes"]),
            text(&row["dropped_packets"]),
            text(&row["dropped_bytes"]),
            text(&row["marked_packets"]),
            text(&row["marked_bytes"]),
        ]
    })
}
