//! Prometheus exposition of every attachment's classes, read from the pinned maps at
//! scrape time (the kernel keeps the counters; nothing is cached here), plus the daemon's
//! own health.

use crate::{
    report::{attachment_rows, ClassRow, Detail},
    state::{self, Attachment, Location},
};
use anyhow::Result;
use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use shaper_common::MAX_CLASSES;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// What the daemon knows about itself, exposed with the class metrics.
#[derive(Clone, Debug, Default)]
pub struct Health {
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    pub config_valid: bool,
    pub last_success_unix: f64,
    pub started_unix: f64,
    pub interfaces_configured: usize,
    pub interfaces_missing: usize,
    pub apply_errors: u64,
    /// Ticks skipped because another shaper held the state lock.
    pub lock_busy: u64,
    /// Global classes' reports to Redis answered, and those that failed or timed out.
    pub coordination_ok: u64,
    pub coordination_failed: u64,
    /// Connections to the metrics listener closed at accept (too many open).
    pub metrics_connections_refused: u64,
    /// Ticks this daemon wrote no report because another daemon holds this host's id.
    pub host_id_taken: u64,
    /// Announcements and reports this daemon's fills could not read and left out.
    pub global_fields_dropped: u64,
}

#[derive(Default)]
struct Families {
    packets: Family<Labels, Counter>,
    bytes: Family<Labels, Counter>,
    colour_packets: Family<Labels, Counter>,
    colour_bytes: Family<Labels, Counter>,
    rate: Family<Labels, FloatGauge>,
    burst: Family<Labels, Gauge>,
    ceil: Family<Labels, FloatGauge>,
    cburst: Family<Labels, Gauge>,
    level: Family<Labels, Gauge>,
    keys: Family<Labels, Gauge>,
    keys_live: Family<Labels, Gauge>,
    evicted: Family<Labels, Gauge>,
    keyed: Family<Labels, Gauge>,
    fill: Family<Labels, FloatGauge>,
    up: Family<Labels, Gauge>,
    global_share: Family<Labels, FloatGauge>,
    global_hosts: Family<Labels, Gauge>,
    global_age: Family<Labels, FloatGauge>,
    global_expired: Family<Labels, Gauge>,
    flows: Family<Labels, Gauge>,
    flows_over_share: Family<Labels, Gauge>,
    queue_delay: Family<Labels, FloatGauge>,
    codel_target: Family<Labels, FloatGauge>,
    shape_dropped_packets: Family<Labels, Counter>,
    shape_dropped_bytes: Family<Labels, Counter>,
    fair_marked: Family<Labels, Counter>,
    leaf_marked: Family<Labels, Counter>,
}

fn location_labels(location: &Location) -> Labels {
    vec![
        ("netns".into(), location.netns.clone().unwrap_or_default()),
        ("dev".into(), location.dev.clone()),
        ("direction".into(), location.direction.name().into()),
    ]
}

fn with(labels: &Labels, extra: &[(&str, &str)]) -> Labels {
    let mut all = labels.clone();
    all.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    all
}

fn attachment_metrics(location: &Location, families: &Families) -> Result<()> {
    let labels = location_labels(location);
    let attachment = Attachment::open(location)?;
    let live = crate::netns::in_namespace(&location.netns, || Ok(attachment.status()?.live))
        .unwrap_or(false);
    families.up.get_or_create(&labels).set(i64::from(live));
    let detail = Detail {
        keys: true,
        level: true,
    };
    let report = attachment_rows(&attachment, location, detail)?;
    for row in &report.rows {
        // `parent`: the class's parent in a tree, empty at the top level (one label set).
        let parent = row.parent.as_deref().unwrap_or_default();
        let class = with(&labels, &[("class", &row.name), ("parent", parent)]);
        class_metrics(row, &class, families);
    }
    let capacity = attachment.flow_table_size()?;
    families
        .keyed
        .get_or_create(&labels)
        .set(report.keys_held as i64);
    families
        .fill
        .get_or_create(&with(&labels, &[("map", "keyed_buckets")]))
        .set(report.keys_held as f64 / f64::from(capacity.max(1)));
    families
        .fill
        .get_or_create(&with(&labels, &[("map", "classes")]))
        .set(report.rows.len() as f64 / f64::from(MAX_CLASSES));
    Ok(())
}

/// One class's series, labelled `class`.
fn class_metrics(row: &ClassRow, class: &Labels, families: &Families) {
    for (verdict, packets, bytes) in [
        ("passed", row.passed_packets, row.passed_bytes),
        ("dropped", row.dropped_packets, row.dropped_bytes),
        ("marked", row.marked_packets, row.marked_bytes),
    ] {
        let verdict = with(class, &[("verdict", verdict)]);
        families.packets.get_or_create(&verdict).inc_by(packets);
        families.bytes.get_or_create(&verdict).inc_by(bytes);
    }
    if let Some(meter) = &row.meter {
        for (colour, packets, bytes) in [
            ("green", meter.green_packets, meter.green_bytes),
            ("yellow", meter.yellow_packets, meter.yellow_bytes),
            ("red", meter.red_packets, meter.red_bytes),
        ] {
            let colour = with(class, &[("color", colour)]);
            families
                .colour_packets
                .get_or_create(&colour)
                .inc_by(packets);
            families.colour_bytes.get_or_create(&colour).inc_by(bytes);
        }
    }
    let bytes_per_sec = |bits: u64| bits as f64 / 8.0;
    families
        .rate
        .get_or_create(class)
        .set(bytes_per_sec(row.rate_bps));
    families
        .burst
        .get_or_create(class)
        .set(row.burst_bytes as i64);
    if let (Some(ceil), Some(cburst)) = (row.ceil_bps, row.cburst_bytes) {
        families.ceil.get_or_create(class).set(bytes_per_sec(ceil));
        families.cburst.get_or_create(class).set(cburst as i64);
    }
    if let Some(global) = &row.global {
        let keyed = with(class, &[("global", &global.global)]);
        let share = bytes_per_sec(global.share_bps);
        families.global_share.get_or_create(&keyed).set(share);
        families
            .global_hosts
            .get_or_create(&keyed)
            .set(i64::from(global.hosts));
        if let Some(age) = global.share_age_seconds {
            families.global_age.get_or_create(&keyed).set(age);
        }
        let expired = i64::from(global.share_expired);
        families.global_expired.get_or_create(&keyed).set(expired);
    }
    if let Some(keys) = &row.keys {
        families.keys.get_or_create(class).set(keys.keys as i64);
        families
            .keys_live
            .get_or_create(class)
            .set(keys.keys_live as i64);
        // A gauge, though it only grows: read beside a moving table, it may step back by
        // the keys created during the scrape, which a counter must never do.
        let evicted = keys.evicted_keys as i64;
        families.evicted.get_or_create(class).set(evicted);
    }
    if let Some(level) = row.level_bytes {
        families.level.get_or_create(class).set(level as i64);
    }
    if let Some(shape) = &row.codel {
        shape_metrics(shape, class, families);
    }
}

/// A shape class's flows and its drops and marks by cause.
fn shape_metrics(shape: &crate::report::CodelRow, class: &Labels, families: &Families) {
    families.flows.get_or_create(class).set(shape.flows as i64);
    let over = shape.flows_over_share as i64;
    families.flows_over_share.get_or_create(class).set(over);
    let delay = shape.queue_delay_us as f64 / 1e6;
    families.queue_delay.get_or_create(class).set(delay);
    // The report spells the target as the file does ("5ms"); the alert rules compare.
    if let Ok(target_ns) = crate::units::parse_duration_ns(&shape.target) {
        let target = target_ns as f64 / 1e9;
        families.codel_target.get_or_create(class).set(target);
    }
    for (cause, packets, bytes) in [
        (
            "queue",
            shape.queue_dropped_packets,
            shape.queue_dropped_bytes,
        ),
        ("fair", shape.fair_dropped_packets, shape.fair_dropped_bytes),
    ] {
        let cause = with(class, &[("cause", cause)]);
        families
            .shape_dropped_packets
            .get_or_create(&cause)
            .inc_by(packets);
        families
            .shape_dropped_bytes
            .get_or_create(&cause)
            .inc_by(bytes);
    }
    let marked = shape.fair_marked_packets;
    families.fair_marked.get_or_create(class).inc_by(marked);
    if shape.bulk_leaf != "none" && shape.bulk_leaf != "unknown" {
        // The leaf's own drops (fq_codel's CoDel on each flow's queue, or a full FIFO):
        // packets only, tc keeps no bytes for them.
        let leaf = with(class, &[("cause", "leaf")]);
        let dropped = shape.leaf_dropped_packets;
        families
            .shape_dropped_packets
            .get_or_create(&leaf)
            .inc_by(dropped);
        let marked = shape.leaf_marked_packets;
        families.leaf_marked.get_or_create(class).inc_by(marked);
    }
}

/// The exposition text: every attachment under the pin root, and `health` when given.
pub fn render(health: Option<&Health>) -> Result<String> {
    let mut registry = Registry::default();
    let families = Families::default();
    let mut errors = 0;
    for location in state::list_locations(None)? {
        if let Err(error) = attachment_metrics(&location, &families) {
            log::warn!("metrics of {}: {error:#}", location.describe());
            errors += 1;
        }
    }
    register_attachment_families(&mut registry, families);
    registry.register(
        "shaper_scrape_errors",
        "Attachments that could not be read during this scrape",
        gauge(errors),
    );
    if let Some(health) = health {
        register_daemon_health(&mut registry, health);
    }
    let mut text = String::new();
    encode(&mut text, &registry)?;
    Ok(text)
}

fn gauge(value: i64) -> Gauge {
    let gauge: Gauge = Gauge::default();
    gauge.set(value);
    gauge
}

fn float_gauge(value: f64) -> FloatGauge {
    let gauge: FloatGauge = Gauge::default();
    gauge.set(value);
    gauge
}

/// Registers each family under its name and help, listed once.
macro_rules! register_families {
    ($registry:expr, $families:expr, [$(($field:ident, $name:literal, $help:literal),)*]) => {
        $( $registry.register($name, $help, $families.$field); )*
    };
}

fn register_attachment_families(registry: &mut Registry, families: Families) {
    register_families!(registry, families, [
        (packets, "shaper_class_packets", "Packets seen by a class, by verdict (marked packets are also passed)"),
        (bytes, "shaper_class_bytes", "Bytes (as on the wire) seen by a class, by verdict"),
        (colour_packets, "shaper_class_color_packets", "Packets of a metered class by RFC 2697/2698 colour"),
        (colour_bytes, "shaper_class_color_bytes", "Bytes of a metered class by RFC 2697/2698 colour"),
        (rate, "shaper_class_rate_bytes_per_second", "Configured rate of a class"),
        (burst, "shaper_class_burst_bytes", "Configured burst of a class"),
        (ceil, "shaper_class_ceil_bytes_per_second", "Ceiling of a class in a tree: what it may borrow up to (its rate when it does not)"),
        (cburst, "shaper_class_cburst_bytes", "Burst at the ceiling of a class in a tree"),
        (level, "shaper_class_bucket_level_bytes", "Tokens in a class-scoped bucket now (burst when idle, 0 when exhausted)"),
        (keys, "shaper_class_keys", "Keys (flows, sources or destinations) a --per class holds in the flow table"),
        (keys_live, "shaper_class_keys_live", "Keys of a --per class whose bucket is still refilling (evicted, one would return with a full burst)"),
        (evicted, "shaper_class_keys_evicted", "Keys a --per class created that the flow table's LRU has since evicted"),
        (keyed, "shaper_keyed_buckets", "Live per-flow/source/destination buckets of an attachment"),
        (fill, "shaper_map_fill_ratio", "Used fraction of an attachment's map"),
        (up, "shaper_attachment_up", "1 when the attachment's program is hooked to its interface, 0 when stale"),
        (global_share, "shaper_class_global_share_bytes_per_second", "A global class's share of its limit on this host now (its rate is the limit for all hosts)"),
        (global_hosts, "shaper_class_global_hosts", "Hosts sharing a global class's limit at Redis's last answer"),
        (global_age, "shaper_class_global_share_age_seconds", "Seconds since Redis last answered for a global class"),
        (global_expired, "shaper_class_global_share_expired", "1 when a global class's share expired and the packet path holds it at its floor"),
        (flows, "shaper_class_flows", "Bulk flows of a shape class in its last CoDel interval"),
        (flows_over_share, "shaper_class_flows_over_share", "Flows of a fair shape class over their fair share in its last CoDel interval"),
        (queue_delay, "shaper_class_queue_delay_seconds", "How long the packet at the head of a shape class's queue waited (its CoDel sojourn time) now"),
        (codel_target, "shaper_class_codel_target_seconds", "A shape class's CoDel target: the queue delay it tolerates standing"),
        (shape_dropped_packets, "shaper_class_shape_dropped_packets", "Packets a shape class dropped, by cause: queue (the class queue's CoDel or cap), fair (a flow over its fair share) or leaf (its HTB leaf: fq_codel's CoDel on a flow's own queue, or a full FIFO)"),
        (shape_dropped_bytes, "shaper_class_shape_dropped_bytes", "Bytes a shape class dropped, by cause (as shaper_class_shape_dropped_packets)"),
        (fair_marked, "shaper_class_fair_marked_packets", "Packets a fair shape class CE-marked on flows over their fair share"),
        (leaf_marked, "shaper_class_leaf_marked_packets", "Packets a shape class's HTB leaf CE-marked itself (fq_codel's CoDel on a flow's own queue)"),
    ]);
}

fn register_daemon_health(registry: &mut Registry, health: &Health) {
    registry.register(
        "shaper_daemon_config_reloads",
        "Configuration loads by result",
        by_result(&[
            ("success", health.reloads_ok),
            ("failure", health.reloads_failed),
        ]),
    );
    registry.register(
        "shaper_daemon_config_valid",
        "1 when the file on disk is valid and applied, 0 when the last good one is kept",
        gauge(i64::from(health.config_valid)),
    );
    registry.register(
        "shaper_daemon_last_reload_success_timestamp_seconds",
        "When a configuration was last applied successfully",
        float_gauge(health.last_success_unix),
    );
    registry.register(
        "shaper_daemon_start_time_seconds",
        "When the daemon started",
        float_gauge(health.started_unix),
    );
    registry.register(
        "shaper_daemon_interfaces_configured",
        "Interfaces named by the configuration",
        gauge(health.interfaces_configured as i64),
    );
    registry.register(
        "shaper_daemon_interfaces_missing",
        "Configured interfaces (or namespaces) that do not exist now",
        gauge(health.interfaces_missing as i64),
    );
    for (name, help, value) in [
        (
            "shaper_daemon_apply_errors",
            "Plans that failed to apply",
            health.apply_errors,
        ),
        (
            "shaper_daemon_host_id_taken",
            "Ticks this daemon wrote no report because another daemon reports with this host_id",
            health.host_id_taken,
        ),
        (
            "shaper_daemon_global_fields_dropped",
            "Announcements and reports of global classes this daemon's fills could not read and left out (written by a host's Redis user, not by shaper)",
            health.global_fields_dropped,
        ),
        (
            "shaper_daemon_metrics_connections_refused",
            "Connections to this listener closed at once because as many were open as it serves",
            health.metrics_connections_refused,
        ),
        (
            "shaper_daemon_lock_busy",
            "Checks skipped because another shaper command held the state lock",
            health.lock_busy,
        ),
    ] {
        let counter: Counter = Counter::default();
        counter.inc_by(value);
        registry.register(name, help, counter);
    }
    registry.register(
        "shaper_daemon_coordination_reports",
        "Global classes' reports to Redis, by result (a failed one follows on_coordinator_loss)",
        by_result(&[
            ("answered", health.coordination_ok),
            ("failed", health.coordination_failed),
        ]),
    );
}

/// A counter per `result` label.
fn by_result(counts: &[(&str, u64)]) -> Family<Labels, Counter> {
    let family: Family<Labels, Counter> = Family::default();
    for (result, count) in counts {
        family
            .get_or_create(&vec![("result".into(), (*result).into())])
            .inc_by(*count);
    }
    family
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::CodelRow;

    /// A shape class's row as the report reads it: 7 fair drops, 2 by the queue.
    fn shape_row() -> ClassRow {
        ClassRow {
            name: "vm".into(),
            dev: "tap0".into(),
            netns: None,
            direction: "egress",
            id: 3,
            rate_bps: 10_000_000,
            burst_bytes: 131_072,
            per: "class",
            prio: 100,
            proto: "any",
            src: None,
            dst: None,
            sport: None,
            dport: None,
            action: "shape".into(),
            passed_packets: 100,
            passed_bytes: 150_000,
            dropped_packets: 9,
            dropped_bytes: 13_500,
            marked_packets: 1,
            marked_bytes: 1_500,
            parent: None,
            ceil_bps: None,
            cburst_bytes: None,
            depth: 0,
            meter: None,
            keys: None,
            global: None,
            codel: Some(CodelRow {
                target: "5ms".into(),
                interval: "100ms".into(),
                ecn: true,
                queue_delay_us: 800,
                codel_dropping: false,
                fair: "flow",
                flows: 4,
                flows_over_share: 3,
                fair_share_bps: 2_500_000,
                queue_dropped_packets: 2,
                queue_dropped_bytes: 3_000,
                fair_dropped_packets: 7,
                fair_dropped_bytes: 10_500,
                fair_marked_packets: 1,
                bulk_leaf: "flow queues",
                leaf_dropped_packets: 5,
                leaf_marked_packets: 6,
            }),
            level_bytes: None,
        }
    }

    #[test]
    fn a_shape_class_exposes_its_flows_and_drops_by_cause() {
        let families = Families::default();
        let labels = vec![("class".to_string(), "vm".to_string())];
        class_metrics(&shape_row(), &labels, &families);
        let mut registry = Registry::default();
        register_attachment_families(&mut registry, families);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for line in [
            "shaper_class_flows{class=\"vm\"} 4",
            "shaper_class_flows_over_share{class=\"vm\"} 3",
            "shaper_class_queue_delay_seconds{class=\"vm\"} 0.0008",
            "shaper_class_codel_target_seconds{class=\"vm\"} 0.005",
            "shaper_class_shape_dropped_packets_total{class=\"vm\",cause=\"fair\"} 7",
            "shaper_class_shape_dropped_packets_total{class=\"vm\",cause=\"queue\"} 2",
            "shaper_class_shape_dropped_bytes_total{class=\"vm\",cause=\"fair\"} 10500",
            "shaper_class_fair_marked_packets_total{class=\"vm\"} 1",
            "shaper_class_shape_dropped_packets_total{class=\"vm\",cause=\"leaf\"} 5",
            "shaper_class_leaf_marked_packets_total{class=\"vm\"} 6",
            // Every verdict, each with its own counts.
            "shaper_class_packets_total{class=\"vm\",verdict=\"passed\"} 100",
            "shaper_class_packets_total{class=\"vm\",verdict=\"dropped\"} 9",
            "shaper_class_packets_total{class=\"vm\",verdict=\"marked\"} 1",
            "shaper_class_bytes_total{class=\"vm\",verdict=\"marked\"} 1500",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
    }
}
