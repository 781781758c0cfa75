//! Output shared by commands: every class as the JSON object `class list --json` and
//! `stats --json` print (and their tables are drawn from).

use anyhow::Result;
use serde_json::{json, Value};
use shaper::{
    classes::{self, ClassView, Meter},
    error::runtime,
    rules::PortRange,
    state::{self, Attachment, Location},
    units::format_duration_ns,
};
use shaper_common::Scope;

/// Every class of every selected attachment, as JSON objects (shared with `stats`);
/// `keys`: with the flow-table census of `--per` classes (a walk of the table).
pub(crate) fn collect(
    netns: &Option<String>,
    dev: &Option<String>,
    keys: bool,
) -> Result<Vec<Value>> {
    shaper::netns::check_netns_known(netns)?;
    let filter = netns.as_ref().map(|n| Some(n.clone()));
    let mut rows = Vec::new();
    for location in state::list_locations(filter.as_ref())? {
        if dev.as_ref().is_some_and(|d| *d != location.dev) {
            continue;
        }
        let attachment = Attachment::open(&location)?;
        let views = classes::read_classes(&attachment)?;
        let per_key = |view: &ClassView| view.spec.scope != Scope::Class;
        let census = if keys && views.iter().any(per_key) {
            attachment.key_census()?
        } else {
            Default::default()
        };
        for view in views {
            let mut row = class_json(&location, &view);
            if keys && per_key(&view) {
                let keys = attachment.key_pressure(&census, view.id, view.seq as u32)?;
                let extra = json!({
                    "keys": keys.held,
                    "keys_live": keys.live,
                    "new_keys": keys.created,
                    "evicted_keys": keys.evicted,
                });
                merge(&mut row, extra);
            }
            if let Some(global) = &view.spec.global {
                let share =
                    shaper::global::ShareView::of(&classes::share_of(&attachment, view.id)?);
                let extra = json!({
                    "global": global.key,
                    "on_coordinator_loss": global.on_loss.name(),
                    "floor_bps": global.floor_bits_per_sec,
                    "share_bps": share.share_bits_per_sec,
                    "hosts": share.hosts,
                    "share_age_seconds": share.age_seconds,
                    "share_expired": share.expired,
                });
                merge(&mut row, extra);
            }
            if let Some(codel) = view.spec.codel {
                let (delay_ns, dropping) = attachment.shape_queue(view.id)?;
                let extra = json!({
                    "target": format_duration_ns(codel.target_ns),
                    "interval": format_duration_ns(codel.interval_ns),
                    "ecn": codel.ecn,
                    "queue_delay_us": delay_ns / 1000,
                    "codel_dropping": dropping,
                });
                merge(&mut row, extra);
            }
            rows.push(row);
        }
    }
    let rows = in_tree_order(rows);
    if rows.is_empty() {
        if let Some(dev) = dev {
            let any = state::list_locations(filter.as_ref())?
                .iter()
                .any(|l| l.dev == *dev);
            if !any {
                return Err(runtime(format!("shaper is not attached to {dev}")));
            }
        }
    }
    Ok(rows)
}

fn class_json(location: &Location, view: &ClassView) -> Value {
    let spec = &view.spec;
    let rule = &spec.rule;
    let ports = |range: PortRange| {
        if range.is_any() {
            Value::Null
        } else {
            json!(range.display())
        }
    };
    let mut row = json!({
        "name": spec.name,
        "dev": location.dev,
        "netns": location.netns,
        "direction": location.direction.name(),
        "id": view.id,
        "rate_bps": spec.rate_bits_per_sec,
        "burst_bytes": spec.burst_bytes,
        "per": spec.scope.name(),
        "prio": spec.prio,
        "proto": rule.proto.name(),
        "src": rule.src.map(|n| n.to_string()),
        "dst": rule.dst.map(|n| n.to_string()),
        "sport": ports(rule.sport),
        "dport": ports(rule.dport),
        "action": spec.action.to_string(),
        "passed_packets": view.stats.passed_packets,
        "passed_bytes": view.stats.passed_bytes,
        "dropped_packets": view.stats.dropped_packets,
        "dropped_bytes": view.stats.dropped_bytes,
        "marked_packets": view.stats.marked_packets,
        "marked_bytes": view.stats.marked_bytes,
        "parent": spec.tree.as_ref().map(|t| t.parent.clone()),
        "ceil_bps": spec.tree.as_ref().map(|t| t.ceil(spec.rate_bits_per_sec)),
        "cburst_bytes": spec.tree.as_ref().map(|t| t.cburst(spec.burst_bytes)),
    });
    if spec.meter != Meter::None {
        let extra = json!({
            "meter": spec.meter.name(),
            "exceed": spec.exceed.to_string(),
            "violate": spec.action.to_string(),
            "peak_rate_bps": spec.meter.peak_rate(),
            "peak_burst_bytes": spec.meter.peak_burst(),
            "excess_burst_bytes": spec.meter.excess_burst(),
            "green_packets": view.stats.green_packets,
            "green_bytes": view.stats.green_bytes,
            "yellow_packets": view.stats.yellow_packets,
            "yellow_bytes": view.stats.yellow_bytes,
            "red_packets": view.stats.red_packets,
            "red_bytes": view.stats.red_bytes,
        });
        merge(&mut row, extra);
    }
    row
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

/// Rows with each class's children right after it (a depth-first walk from the
/// top-level classes, in their order), each row's `depth` set (0: top level). Children
/// are indexed once, so 10 000 classes list at once.
fn in_tree_order(rows: Vec<Value>) -> Vec<Value> {
    let key = |row: &Value, name: &Value| {
        (
            row["netns"].to_string(),
            row["dev"].to_string(),
            row["direction"].to_string(),
            name.to_string(),
        )
    };
    let mut children: std::collections::HashMap<_, Vec<usize>> = Default::default();
    for (i, row) in rows.iter().enumerate() {
        if !row["parent"].is_null() {
            children
                .entry(key(row, &row["parent"]))
                .or_default()
                .push(i);
        }
    }
    let mut ordered = Vec::with_capacity(rows.len());
    let mut placed = vec![false; rows.len()];
    let mut stack: Vec<(usize, usize)> = (0..rows.len())
        .rev()
        .filter(|&i| rows[i]["parent"].is_null())
        .map(|i| (i, 0))
        .collect();
    while let Some((i, depth)) = stack.pop() {
        if std::mem::replace(&mut placed[i], true) {
            continue;
        }
        let mut row = rows[i].clone();
        row["depth"] = depth.into();
        ordered.push(row);
        if let Some(below) = children.get(&key(&rows[i], &rows[i]["name"])) {
            stack.extend(below.iter().rev().map(|&j| (j, depth + 1)));
        }
    }
    // A row whose parent is missing (never in a consistent state) still shows.
    for (i, row) in rows.into_iter().enumerate() {
        if !placed[i] {
            ordered.push(row);
        }
    }
    ordered
}

fn merge(row: &mut Value, extra: Value) {
    for (key, value) in extra.as_object().into_iter().flatten() {
        row[key] = value.clone();
    }
}
