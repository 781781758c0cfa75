//! What shaper reports, once: about each class ([`ClassRow`], read by `class list`,
//! `stats` (their tables and `--json`) and `/metrics`) and each attachment
//! ([`AttachmentRow`], read by `status`).

use crate::{
    classes::{self, ClassView, Meter},
    error::runtime,
    rules::PortRange,
    state::{self, Attachment, Location},
    units::format_duration_ns,
};
use anyhow::Result;
use serde::Serialize;
use shaper_common::Scope;

/// One class as reported: its settings, its counters, and what its kind adds.
#[derive(Clone, Debug, Serialize)]
pub struct ClassRow {
    pub name: String,
    pub dev: String,
    pub netns: Option<String>,
    pub direction: &'static str,
    pub id: u32,
    pub rate_bps: u64,
    pub burst_bytes: u64,
    pub per: &'static str,
    pub prio: u32,
    pub proto: &'static str,
    pub src: Option<String>,
    pub dst: Option<String>,
    pub sport: Option<String>,
    pub dport: Option<String>,
    pub action: String,
    pub passed_packets: u64,
    pub passed_bytes: u64,
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    pub marked_packets: u64,
    pub marked_bytes: u64,
    pub parent: Option<String>,
    pub ceil_bps: Option<u64>,
    pub cburst_bytes: Option<u64>,
    /// Levels below the top (0: a top-level class), in [`in_tree_order`].
    pub depth: usize,
    #[serde(flatten)]
    pub meter: Option<MeterRow>,
    #[serde(flatten)]
    pub keys: Option<KeysRow>,
    #[serde(flatten)]
    pub global: Option<GlobalRow>,
    #[serde(flatten)]
    pub codel: Option<CodelRow>,
    /// The class-wide bucket's fill in bytes (with [`Detail::level`]).
    #[serde(skip)]
    pub level_bytes: Option<u64>,
}

/// A metered class: its meter, actions and colour counters.
#[derive(Clone, Debug, Serialize)]
pub struct MeterRow {
    pub meter: &'static str,
    pub exceed: String,
    pub violate: String,
    pub peak_rate_bps: Option<u64>,
    pub peak_burst_bytes: Option<u64>,
    pub excess_burst_bytes: Option<u64>,
    pub green_packets: u64,
    pub green_bytes: u64,
    pub yellow_packets: u64,
    pub yellow_bytes: u64,
    pub red_packets: u64,
    pub red_bytes: u64,
}

/// A `--per` class's keys in the flow table.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct KeysRow {
    pub keys: u64,
    pub keys_live: u64,
    pub new_keys: u64,
    pub evicted_keys: u64,
}

/// A global class: its key and this host's share.
#[derive(Clone, Debug, Serialize)]
pub struct GlobalRow {
    pub global: String,
    pub on_coordinator_loss: &'static str,
    pub floor_bps: u64,
    pub share_bps: u64,
    pub hosts: u32,
    pub share_age_seconds: Option<f64>,
    pub share_expired: bool,
}

/// A shape class: CoDel's knobs and its queue now.
#[derive(Clone, Debug, Serialize)]
pub struct CodelRow {
    pub target: String,
    pub interval: String,
    pub ecn: bool,
    pub queue_delay_us: u64,
    pub codel_dropping: bool,
    /// Flow isolation: flow, src, dst or none.
    pub fair: &'static str,
    /// Bulk flows in the last CoDel interval, and those of them over their fair share.
    pub flows: u64,
    pub flows_over_share: u64,
    /// Flow isolation: a flow's fair share of the rate now (the rate while at most one
    /// flow wants more than it has).
    pub fair_share_bps: u64,
    /// Dropped by the class's queue (its CoDel and hard cap), and by a flow's own queue
    /// for being over its fair share (its CoDel and the cap); CE marks on flows over
    /// their share. Part of `dropped_*` and `marked_*`.
    pub queue_dropped_packets: u64,
    pub queue_dropped_bytes: u64,
    pub fair_dropped_packets: u64,
    pub fair_dropped_bytes: u64,
    pub fair_marked_packets: u64,
    /// The bulk leaf (`flow queues`: fq_codel, each flow's CoDel there; `fifo`; `none`
    /// under EDT; `unknown`: tc cannot list it) and what it dropped and CE-marked itself,
    /// outside `dropped_*` and `marked_*` (the program had passed those packets).
    pub bulk_leaf: &'static str,
    pub leaf_dropped_packets: u64,
    pub leaf_marked_packets: u64,
}

/// What a report reads beyond each class's maps.
#[derive(Clone, Copy, Debug, Default)]
pub struct Detail {
    /// `--per` classes' keys: one walk of the flow table for the attachment.
    pub keys: bool,
    /// Class-wide buckets' fill.
    pub level: bool,
}

impl ClassRow {
    fn of(location: &Location, view: &ClassView) -> Self {
        let spec = &view.spec;
        let (rule, stats, tree) = (&spec.rule, &view.stats, spec.tree.as_ref());
        let ports = |range: PortRange| (!range.is_any()).then(|| range.display());
        ClassRow {
            name: spec.name.clone(),
            dev: location.dev.clone(),
            netns: location.netns.clone(),
            direction: location.direction.name(),
            id: view.id,
            rate_bps: spec.rate_bits_per_sec,
            burst_bytes: spec.burst_bytes,
            per: spec.scope.name(),
            prio: spec.prio,
            proto: rule.proto.name(),
            src: rule.src.map(|n| n.to_string()),
            dst: rule.dst.map(|n| n.to_string()),
            sport: ports(rule.sport),
            dport: ports(rule.dport),
            action: spec.action.to_string(),
            passed_packets: stats.passed_packets,
            passed_bytes: stats.passed_bytes,
            dropped_packets: stats.dropped_packets,
            dropped_bytes: stats.dropped_bytes,
            marked_packets: stats.marked_packets,
            marked_bytes: stats.marked_bytes,
            parent: tree.map(|t| t.parent.clone()),
            ceil_bps: tree.map(|t| t.ceil(spec.rate_bits_per_sec)),
            cburst_bytes: tree.map(|t| t.cburst(spec.burst_bytes)),
            depth: 0,
            meter: (spec.meter != Meter::None).then(|| MeterRow {
                meter: spec.meter.name().unwrap_or_default(),
                exceed: spec.exceed.to_string(),
                violate: spec.action.to_string(),
                peak_rate_bps: spec.meter.peak_rate(),
                peak_burst_bytes: spec.meter.peak_burst(),
                excess_burst_bytes: spec.meter.excess_burst(),
                green_packets: stats.green_packets,
                green_bytes: stats.green_bytes,
                yellow_packets: stats.yellow_packets,
                yellow_bytes: stats.yellow_bytes,
                red_packets: stats.red_packets,
                red_bytes: stats.red_bytes,
            }),
            keys: None,
            global: None,
            codel: None,
            level_bytes: None,
        }
    }
}

/// One attachment's classes, and the keys its flow table holds in all (with
/// [`Detail::keys`]).
pub struct AttachmentRows {
    pub rows: Vec<ClassRow>,
    pub keys_held: u64,
}

/// Every class of one attachment, with what `detail` asks for.
pub fn attachment_rows(
    attachment: &Attachment,
    location: &Location,
    detail: Detail,
) -> Result<AttachmentRows> {
    let views = classes::read_classes(attachment)?;
    let per_key = |view: &ClassView| view.spec.scope != Scope::Class;
    // One walk of the flow table (O(entries)) for every class's keys and the total.
    let census = if detail.keys {
        attachment.key_census()?
    } else {
        Default::default()
    };
    let mut rows = Vec::with_capacity(views.len());
    // The HTB leaves' counters: one tc call in the attachment's namespace. Unreadable
    // (the interface gone): the leaves are unknown, the rest of the report stands.
    let has_leaf = |view: &ClassView| view.spec.codel.is_some() && view.spec.action.arg != 0;
    let leaves = if views.iter().any(has_leaf) {
        crate::netns::in_namespace(&location.netns, || {
            crate::qdisc::bulk_leaf_counts(&location.queue_dev())
        })
        .unwrap_or_default()
    } else {
        Default::default()
    };
    for view in views {
        let mut row = ClassRow::of(location, &view);
        let spec = &view.spec;
        if detail.keys && per_key(&view) {
            let keys = attachment.key_pressure(&census, view.id, view.seq as u32)?;
            row.keys = Some(KeysRow {
                keys: keys.held,
                keys_live: keys.live,
                new_keys: keys.created,
                evicted_keys: keys.evicted,
            });
        }
        if let Some(global) = &spec.global {
            let share = crate::global::ShareView::of(&classes::share_of(attachment, view.id)?);
            row.global = Some(GlobalRow {
                global: global.key.clone(),
                on_coordinator_loss: global.on_loss.name(),
                floor_bps: global.floor_bits_per_sec,
                share_bps: share.share_bits_per_sec,
                hosts: share.hosts,
                share_age_seconds: share.age_seconds,
                share_expired: share.expired,
            });
        }
        if let Some(codel) = spec.codel {
            let leaf = has_leaf(&view).then(|| leaves.get(&spec.action.arg).copied());
            row.codel = Some(codel_row(attachment, &view, codel, leaf)?);
        }
        if detail.level && spec.scope == Scope::Class {
            // The word's own rate and burst (a shape class's in a tree drains at its ceil).
            let (rate, burst) = spec.drain();
            row.level_bytes = Some(attachment.bucket_level(view.id, rate, burst)?);
        }
        rows.push(row);
    }
    let keys_held = census.values().map(|owner| owner.held).sum();
    Ok(AttachmentRows { rows, keys_held })
}

/// A shape class's CoDel row; `leaf`: its bulk leaf's counters (`None` without an HTB leaf,
/// `Some(None)` when tc did not list it).
fn codel_row(
    attachment: &Attachment,
    view: &ClassView,
    codel: classes::Codel,
    leaf: Option<Option<crate::qdisc::LeafCounts>>,
) -> Result<CodelRow> {
    let bulk_leaf = match leaf {
        None => "none",
        Some(None) => "unknown",
        Some(Some(counts)) if counts.per_flow => "flow queues",
        Some(Some(_)) => "fifo",
    };
    let leaf = leaf.flatten().unwrap_or_default();
    let (delay_ns, dropping) = attachment.shape_queue(view.id)?;
    let flows = attachment.shape_flows(view.id)?;
    Ok(CodelRow {
        target: format_duration_ns(codel.target_ns),
        interval: format_duration_ns(codel.interval_ns),
        ecn: codel.ecn,
        queue_delay_us: delay_ns / 1000,
        codel_dropping: dropping,
        fair: codel.fair.name(),
        flows: flows.flows,
        flows_over_share: flows.over_share,
        fair_share_bps: fair_share(view.spec.drain().0, flows.share),
        queue_dropped_packets: flows.stats.queue_dropped_packets,
        queue_dropped_bytes: flows.stats.queue_dropped_bytes,
        fair_dropped_packets: flows.stats.fair_dropped_packets,
        fair_dropped_bytes: flows.stats.fair_dropped_bytes,
        fair_marked_packets: flows.stats.fair_marked_packets,
        bulk_leaf,
        leaf_dropped_packets: leaf.dropped_packets,
        leaf_marked_packets: leaf.marked_packets,
    })
}

/// Every class of every attachment (in namespace `netns`, on `dev` when given), each
/// tree's children right after their parent.
pub fn class_rows(
    netns: &Option<String>,
    dev: Option<&str>,
    detail: Detail,
) -> Result<Vec<ClassRow>> {
    state::check_netns_known(netns)?;
    let filter = netns.as_ref().map(|n| Some(n.clone()));
    let locations = state::list_locations(filter.as_ref())?;
    let mut rows = Vec::new();
    let mut attached = false;
    for location in locations.iter().filter(|l| dev.is_none_or(|d| d == l.dev)) {
        attached = true;
        let attachment = Attachment::open(location)?;
        rows.extend(attachment_rows(&attachment, location, detail)?.rows);
    }
    if let (Some(dev), false) = (dev, attached) {
        return Err(runtime(format!("shaper is not attached to {dev}")));
    }
    Ok(in_tree_order(rows))
}

/// Rows with each class's children right after it (a depth-first walk from the
/// top-level classes, in their order), each row's `depth` set. Children are indexed
/// once, so 10 000 classes list at once.
pub fn in_tree_order(rows: Vec<ClassRow>) -> Vec<ClassRow> {
    let key = |row: &ClassRow, name: &str| {
        let place = (row.netns.clone(), row.dev.clone(), row.direction);
        (place, name.to_string())
    };
    let mut children: std::collections::HashMap<_, Vec<usize>> = Default::default();
    for (i, row) in rows.iter().enumerate() {
        if let Some(parent) = &row.parent {
            children.entry(key(row, parent)).or_default().push(i);
        }
    }
    let mut placed = vec![false; rows.len()];
    let mut order = Vec::with_capacity(rows.len());
    let mut stack: Vec<(usize, usize)> = (0..rows.len())
        .rev()
        .filter(|&i| rows[i].parent.is_none())
        .map(|i| (i, 0))
        .collect();
    while let Some((i, depth)) = stack.pop() {
        if std::mem::replace(&mut placed[i], true) {
            continue;
        }
        order.push((i, depth));
        if let Some(below) = children.get(&key(&rows[i], &rows[i].name)) {
            stack.extend(below.iter().rev().map(|&j| (j, depth + 1)));
        }
    }
    // A row whose parent is missing (never in a consistent state) still shows.
    order.extend((0..rows.len()).filter(|&i| !placed[i]).map(|i| (i, 0)));
    let mut slots: Vec<Option<ClassRow>> = rows.into_iter().map(Some).collect();
    order
        .into_iter()
        .filter_map(|(i, depth)| {
            let mut row = slots[i].take()?;
            row.depth = depth;
            Some(row)
        })
        .collect()
}

/// One attachment as `status` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct AttachmentRow {
    pub dev: String,
    pub netns: Option<String>,
    pub direction: &'static str,
    pub attach_mode: &'static str,
    pub program_id: Option<u32>,
    pub live: bool,
    /// Why it is not live, or pins of another layout (then nothing else is read).
    pub problem: Option<String>,
    pub classes: Option<usize>,
    pub flow_table_size: Option<u32>,
    /// The ifb an ingress attachment splits aggregates through (`--split-aggregates`), or
    /// an egress one its shape classes' forwarded aggregates (`state::splitter`), "NAME
    /// (gone)" when it was deleted or made again since.
    pub split_through: Option<String>,
}

/// The attachment at `location`: pins of another shaper's layout are shown, not read (the
/// command line says what to do with them); one whose namespace was deleted is stale.
pub fn attachment_row(location: &Location) -> Result<AttachmentRow> {
    let attachment = Attachment::open_any_layout(location)?;
    let mut row = AttachmentRow {
        dev: location.dev.clone(),
        netns: location.netns.clone(),
        direction: location.direction.name(),
        attach_mode: attachment.mode_from_pins().name(),
        program_id: attachment.program_id().ok(),
        live: false,
        problem: None,
        classes: None,
        flow_table_size: attachment.flow_table_size().ok(),
        split_through: None,
    };
    if let Some(problem) = attachment.layout_problem() {
        row.problem = Some(problem.to_string());
        return Ok(row);
    }
    // Interface lookups happen in the attachment's own namespace.
    let (status, split, stale_queues) = if location
        .netns
        .as_ref()
        .is_some_and(|ns| !crate::netns::netns_exists(ns))
    {
        (attachment.status_without_namespace()?, None, Vec::new())
    } else {
        crate::netns::in_namespace(&location.netns, || {
            Ok((
                attachment.status()?,
                Some(classes::split_state(&attachment)?),
                // A class map that cannot be read must not hide the row.
                classes::stale_queues(&attachment).unwrap_or_default(),
            ))
        })?
    };
    row.attach_mode = status.mode.name();
    row.program_id = Some(status.program_id);
    row.live = status.live;
    row.problem = status.problem.map(str::to_string);
    if row.problem.is_none() && !stale_queues.is_empty() {
        let names: Vec<String> = stale_queues.into_iter().map(|(_, name)| name).collect();
        row.problem = Some(format!(
            "ifb {} was deleted: shape classes {} lose their traffic until `shaper attach \
             {} --direction ingress` or `apply` queues them again",
            crate::qdisc::ifb_name(&location.dev),
            names.join(", "),
            location.dev
        ));
    }
    row.classes = Some(attachment.class_list()?.len());
    row.flow_table_size = Some(status.flow_table_size);
    row.split_through = match split {
        None | Some(classes::Split::Off) => None,
        Some(classes::Split::On(ifb)) => Some(ifb),
        Some(classes::Split::Stale(ifb)) => Some(format!("{ifb} (gone)")),
    };
    Ok(row)
}

/// The rate `rate_bps` divided by a share multiplier (`fair::SHARE_ONE` is 1).
fn fair_share(rate_bps: u64, share: u64) -> u64 {
    let one = u128::from(shaper_common::fair::SHARE_ONE);
    (u128::from(rate_bps) * one / u128::from(share.max(1))) as u64
}
