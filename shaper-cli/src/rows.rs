//! Output shared by commands: every class as the JSON object `class list --json` and
//! `stats --json` print (and their tables are drawn from), from the core library's
//! typed report rows.

use anyhow::Result;
use serde_json::Value;
use shaper::report::{class_rows, Detail};

/// Every class of every selected attachment, as JSON objects (shared with `stats`);
/// `keys`: with the flow-table census of `--per` classes (a walk of the table).
pub(crate) fn collect(
    netns: &Option<String>,
    dev: &Option<String>,
    keys: bool,
) -> Result<Vec<Value>> {
    let detail = Detail { keys, level: false };
    class_rows(netns, dev.as_deref(), detail)?
        .iter()
        .map(|row| Ok(serde_json::to_value(row)?))
        .collect()
}

/// A global class's share on this host: "KEY 9.8Mbit of 3 hosts, 0.2s ago" (its floor
/// and "expired" once the packet path fell to it); "-" for a class of this host alone.
pub(crate) fn share_text(row: &Value) -> String {
    let Some(key) = row["global"].as_str() else {
        return "-".into();
    };
    let share = shaper::units::format_rate(row["share_bps"].as_u64().unwrap_or(0));
    if row["share_expired"].as_bool() == Some(true) {
        return format!("{key} {share} (floor: share expired)");
    }
    match row["share_age_seconds"].as_f64() {
        Some(age) => format!(
            "{key} {share} of {} hosts, {age:.1}s ago",
            row["hosts"].as_u64().unwrap_or(0)
        ),
        None => format!("{key} {share} (floor: no answer yet)"),
    }
}
