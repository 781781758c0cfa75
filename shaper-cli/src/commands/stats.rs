use super::{prepare, print_rows, text};
use crate::cli::StatsArgs;
use anyhow::Result;
use serde_json::{json, Value};
use shaper::{error::usage, units::format_rate};
use std::{
    collections::HashMap,
    io::Write as _,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

pub fn run(netns: Option<String>, args: StatsArgs) -> Result<()> {
    let interval = humantime::parse_duration(&args.interval)
        .map_err(|e| usage(format!("bad --interval '{}': {e}", args.interval)))?;
    if interval < Duration::from_millis(100) {
        return Err(usage("--interval must be at least 100ms"));
    }
    prepare(&None)?;
    if args.watch {
        return watch(&netns, &args, interval);
    }
    let rows = crate::rows::collect(&netns, &args.dev, true)?;
    let header = [
        "NAME",
        "DEV",
        "DIR",
        "RATE",
        "PASSED PKTS",
        "PASSED BYTES",
        "DROPPED PKTS",
        "DROPPED BYTES",
        "MARKED PKTS",
        "MARKED BYTES",
        "QUEUE",
        "FLOWS (OVER SHARE)",
        "DROPS QUEUE/FAIR",
        "KEYS (EVICTED)",
        "GLOBAL SHARE",
    ];
    print_rows(&rows, args.json, &header, |row| {
        vec![
            super::class::tree_name(row),
            text(&row["dev"]),
            text(&row["direction"]),
            format_rate(row["rate_bps"].as_u64().unwrap_or(0)),
            text(&row["passed_packets"]),
            text(&row["passed_bytes"]),
            text(&row["dropped_packets"]),
            text(&row["dropped_bytes"]),
            text(&row["marked_packets"]),
            text(&row["marked_bytes"]),
            queue_text(row),
            flows_text(row),
            drop_causes_text(row),
            keys_text(row),
            crate::rows::share_text(row),
        ]
    })
}

/// A `--per` class's keys in the flow table, and how many it lost to the LRU.
fn keys_text(row: &Value) -> String {
    match (row["keys"].as_u64(), row["evicted_keys"].as_u64()) {
        (Some(keys), Some(evicted)) => format!("{keys} ({evicted})"),
        _ => "-".into(),
    }
}

/// A shape class's virtual queue: its delay now, and whether CoDel is dropping.
fn queue_text(row: &Value) -> String {
    match row["queue_delay_us"].as_u64() {
        Some(us) if row["codel_dropping"].as_bool() == Some(true) => {
            format!("{:.1}ms dropping", us as f64 / 1000.0)
        }
        Some(us) => format!("{:.1}ms", us as f64 / 1000.0),
        None => "-".into(),
    }
}

/// A shape class's bulk flows, and of those the ones over their fair share.
fn flows_text(row: &Value) -> String {
    match (row["flows"].as_u64(), row["fair"].as_str()) {
        (Some(flows), Some("none")) => flows.to_string(),
        (Some(flows), Some(_)) => format!("{flows} ({})", counter(row, "flows_over_share")),
        _ => "-".into(),
    }
}

/// A shape class's drops by cause: its queue's (CoDel, cap; with a queue per flow in the
/// leaf, the leaf's CoDel's too), and flows over their share.
fn drop_causes_text(row: &Value) -> String {
    match row["queue_dropped_packets"].as_u64() {
        Some(queue) => {
            let queue = queue + counter(row, "leaf_dropped_packets");
            format!("{queue}/{}", counter(row, "fair_dropped_packets"))
        }
        None => "-".into(),
    }
}

/// A class's identity across samples.
fn key(row: &Value) -> String {
    format!(
        "{}|{}|{}|{}",
        row["netns"], row["dev"], row["direction"], row["name"]
    )
}

fn counter(row: &Value, name: &str) -> u64 {
    row[name].as_u64().unwrap_or(0)
}

/// Rates of one class between two samples `seconds` apart.
pub fn rates(before: &Value, after: &Value, seconds: f64) -> Value {
    let delta = |name: &str| counter(after, name).saturating_sub(counter(before, name)) as f64;
    let packets = delta("passed_packets") + delta("dropped_packets");
    let percent = |part: f64| {
        if packets > 0.0 {
            100.0 * part / packets
        } else {
            0.0
        }
    };
    json!({
        "name": after["name"],
        "dev": after["dev"],
        "netns": after["netns"],
        "direction": after["direction"],
        "rate_bps": after["rate_bps"],
        "passed_bps": delta("passed_bytes") * 8.0 / seconds,
        "passed_pps": delta("passed_packets") / seconds,
        "offered_bps": (delta("passed_bytes") + delta("dropped_bytes")) * 8.0 / seconds,
        "dropped_percent": percent(delta("dropped_packets")),
        "marked_percent": percent(delta("marked_packets")),
    })
}

/// `stats --watch`: samples the counters every interval and prints the rates between
/// samples, as a refreshing table or as one JSON line per sample.
fn watch(netns: &Option<String>, args: &StatsArgs, interval: Duration) -> Result<()> {
    let mut previous: HashMap<String, Value> = HashMap::new();
    let mut taken = Instant::now();
    for row in crate::rows::collect(netns, &args.dev, false)? {
        previous.insert(key(&row), row);
    }
    let mut samples = 0;
    while args.count.is_none_or(|count| samples < count) {
        std::thread::sleep(interval);
        let rows = crate::rows::collect(netns, &args.dev, false)?;
        let now = Instant::now();
        let seconds = now.duration_since(taken).as_secs_f64();
        taken = now;
        let mut current = HashMap::new();
        let mut lines = Vec::new();
        for row in rows {
            // A class seen for the first time counts from zero.
            let before = previous.get(&key(&row)).cloned().unwrap_or(json!({}));
            lines.push(rates(&before, &row, seconds));
            current.insert(key(&row), row);
        }
        previous = current;
        samples += 1;
        if args.json {
            let time = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            println!(
                "{}",
                json!({"time": time, "interval_seconds": seconds, "classes": lines})
            );
            std::io::stdout().flush()?;
            continue;
        }
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        table.set_header([
            "NAME", "DEV", "DIR", "RATE", "PASSED", "PKT/S", "OFFERED", "DROP %", "MARK %",
        ]);
        for line in &lines {
            let bits = |name: &str| format_rate(line[name].as_f64().unwrap_or(0.0) as u64);
            table.add_row(vec![
                text(&line["name"]),
                text(&line["dev"]),
                text(&line["direction"]),
                format_rate(line["rate_bps"].as_u64().unwrap_or(0)),
                bits("passed_bps"),
                format!("{:.0}", line["passed_pps"].as_f64().unwrap_or(0.0)),
                bits("offered_bps"),
                format!("{:.1}", line["dropped_percent"].as_f64().unwrap_or(0.0)),
                format!("{:.1}", line["marked_percent"].as_f64().unwrap_or(0.0)),
            ]);
        }
        let mut stdout = std::io::stdout();
        crossterm::execute!(
            stdout,
            crossterm::terminal::Clear(crossterm::terminal::ClearType::All),
            crossterm::cursor::MoveTo(0, 0)
        )?;
        println!(
            "shaper stats --watch, every {} (Ctrl-C to stop)\n{table}",
            humantime::format_duration(interval)
        );
    }
    Ok(())
}
