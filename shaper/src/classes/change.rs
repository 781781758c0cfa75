//! Changing a live class in place: rate, burst, action, CoDel's knobs and its place in
//! the tree. `class change` and `apply` both say what the class should be after the
//! change (checked by the one validator); [`Change::between`] finds what differs.

use super::{
    share::{at_share, global_share},
    tree::{check_guarantees, children_rate, refresh_htb, rerank, TreeView},
    *,
};
use crate::{
    actions::ActionSpec,
    error::{runtime, usage},
    qdisc,
    state::Attachment,
    units::{format_duration_ns, format_rate, format_size},
};
use shaper_common::{codel::sparse_cost, Action, ClassConfig};

/// What differs between a class and the class it should be, where that is a change in
/// place (bucket state and counters kept).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub rate_bits_per_sec: Option<u64>,
    pub burst_bytes: Option<u64>,
    pub action: Option<ActionSpec>,
    /// Shape classes: CoDel's new knobs.
    pub codel: Option<Codel>,
    /// A new place: `Some(None)` the top level, `Some(Some(tree))` under a parent.
    pub tree: Option<Option<Tree>>,
}

/// Why a class cannot become the other in place.
const TO_OR_FROM_SHAPE: &str =
    "a class cannot change to or from --action shape; delete it and add it again";
const NOT_IN_PLACE: &str = "only the rate, burst, action, CoDel's knobs, parent and ceiling change in place; a new rule, scope, priority, meter or global setting needs the class deleted and added (or `apply`)";

impl Change {
    /// What differs from `current` to `wanted`, or why that is no change in place.
    pub fn between(current: &ClassSpec, wanted: &ClassSpec) -> Result<Change, &'static str> {
        let shaping = |spec: &ClassSpec| spec.action.action == Action::Shape;
        if shaping(current) != shaping(wanted) {
            return Err(TO_OR_FROM_SHAPE);
        }
        let mut probe = wanted.clone();
        probe.rate_bits_per_sec = current.rate_bits_per_sec;
        probe.burst_bytes = current.burst_bytes;
        probe.action = current.action;
        probe.codel = current.codel;
        probe.tree = current.tree.clone();
        if !same_class(&probe, current) {
            return Err(NOT_IN_PLACE);
        }
        Ok(Change {
            rate_bits_per_sec: changed(current.rate_bits_per_sec, wanted.rate_bits_per_sec),
            burst_bytes: changed(current.burst_bytes, wanted.burst_bytes),
            action: (as_written(current.action) != as_written(wanted.action))
                .then_some(wanted.action),
            codel: changed(current.codel, wanted.codel).flatten(),
            tree: changed(current.tree.clone(), wanted.tree.clone()),
        })
    }

    /// What the change does, as `apply` prints it: `rate 10Mbit -> 20Mbit, parent - -> web`.
    pub fn describe(&self, current: &ClassSpec) -> String {
        let mut what = Vec::new();
        if let Some(rate) = self.rate_bits_per_sec {
            let before = format_rate(current.rate_bits_per_sec);
            what.push(format!("rate {before} -> {}", format_rate(rate)));
        }
        if let Some(burst) = self.burst_bytes {
            let before = format_size(current.burst_bytes);
            what.push(format!("burst {before} -> {}", format_size(burst)));
        }
        if let Some(action) = self.action {
            what.push(format!("action {} -> {action}", current.action));
        }
        if let (Some(before), Some(after)) = (current.codel, self.codel) {
            let codel = |c: Codel| {
                let ecn = if c.ecn { "" } else { " noecn" };
                // Fair by flow, the default, goes unsaid.
                let fair = match c.fair {
                    Fair::Flow => String::new(),
                    fair => format!(" fair {}", fair.name()),
                };
                let (target, interval) = (c.target_ns, c.interval_ns);
                format!(
                    "{}/{}{ecn}{fair}",
                    format_duration_ns(target),
                    format_duration_ns(interval)
                )
            };
            what.push(format!("codel {} -> {}", codel(before), codel(after)));
        }
        if let Some(tree) = &self.tree {
            let before = current.tree.as_ref();
            let after = tree.as_ref();
            let parent = |t: Option<&Tree>| t.map_or_else(|| "-".to_string(), |t| t.parent.clone());
            let ceil = |t: Option<&Tree>| {
                t.and_then(|t| t.ceil_bits_per_sec)
                    .map_or_else(|| "rate".to_string(), format_rate)
            };
            let cburst = |t: Option<&Tree>| {
                t.and_then(|t| t.cburst_bytes)
                    .map_or_else(|| "burst".to_string(), format_size)
            };
            for (field, text) in [
                ("parent", &parent as &dyn Fn(_) -> String),
                ("ceil", &ceil),
                ("cburst", &cburst),
            ] {
                if text(before) != text(after) {
                    what.push(format!("{field} {} -> {}", text(before), text(after)));
                }
            }
        }
        what.join(", ")
    }
}

fn changed<T: PartialEq>(before: T, after: T) -> Option<T> {
    (before != after).then_some(after)
}

/// Two specs are the same class when everything that reaches the kernel is equal
/// (the yellow action of a class without a meter is never used).
pub(crate) fn same_class(a: &ClassSpec, b: &ClassSpec) -> bool {
    let normal = |s: &ClassSpec| {
        let mut s = s.clone();
        if s.meter == Meter::None {
            s.exceed = ActionSpec::PASS;
        }
        s.action = as_written(s.action);
        s
    };
    normal(a) == normal(b)
}

/// An action as a file writes it: a shape class's argument is the HTB leaf shaper picked,
/// never part of the file.
fn as_written(action: ActionSpec) -> ActionSpec {
    if action.action == Action::Shape {
        ActionSpec::plain(Action::Shape)
    } else {
        action
    }
}

/// Makes the class `wanted.name` what `wanted` says, in place: counters are untouched,
/// and each bucket word is converted to the new rate and burst by the first packet that
/// meets it (tokens kept, clipped to the new burst), so the change is effective at the
/// next packet with neither a blackout nor a free refill. A move ranks the classifier
/// entries again at the class's new depth.
pub fn change(attachment: &Attachment, wanted: &ClassSpec) -> Result<()> {
    let (_, current) = read_class(attachment, &wanted.name)?
        .ok_or_else(|| super::table::not_found(attachment, &wanted.name))?;
    let change = Change::between(&current, wanted).map_err(usage)?;
    let changed = apply(attachment, &wanted.name, change);
    if [&current, wanted]
        .iter()
        .any(|spec| spec.action.action == Action::Shape)
    {
        super::shape_classes_changed(attachment);
    }
    changed
}

/// Where a change leaves a class in the tree.
struct Placement {
    tree: TreeView,
    old_parent: Option<u32>,
    new_parent: Option<u32>,
}

impl Placement {
    fn moved(&self) -> bool {
        self.new_parent != self.old_parent
    }
}

/// Carries out `change` on class `name` (an empty change re-derives the class's rates
/// from its state, as a new global share needs).
pub(crate) fn apply(attachment: &Attachment, name: &str, change: Change) -> Result<()> {
    let (id, mut meta) = attachment
        .find_class(name)?
        .ok_or_else(|| super::table::not_found(attachment, name))?;
    let mut classes = attachment.classes()?;
    let mut config = classes.get(&id, 0)?;
    let shaping = config.action == Action::Shape as u8;
    meta.rate_bits_per_sec = change.rate_bits_per_sec.unwrap_or(meta.rate_bits_per_sec);
    meta.burst_bytes = change.burst_bytes.unwrap_or(meta.burst_bytes);
    if let Some(codel) = change.codel.filter(|_| shaping) {
        meta.codel_target_ns = codel.target_ns;
        meta.codel_interval_ns = codel.interval_ns;
        meta.codel_no_ecn = !codel.ecn as u8;
        meta.fair = codel.fair.code() as u8;
    }
    let placement = place(attachment, id, &mut meta, &mut config, &change)?;
    // A global class runs at its share: the limit (`meta`'s rate) is for all hosts.
    let share = global_share(attachment, id, &config, &meta)?;
    let rated = {
        let spec = ClassSpec::from_meta(&meta, &config);
        match &share {
            Some(share) => at_share(&spec, share),
            None => spec,
        }
    };
    if shaping {
        resync_shaping(attachment, id, &rated, &placement, &mut config)?;
    }
    if let Some(action) = change.action.filter(|_| !shaping) {
        config.action = action.action as u8;
        config.action_arg = action.arg;
        config.action_mask = action.mask;
    }
    recost(&meta, &mut config, rated.drain());
    classes.set(id, config, 0)?;
    attachment.meta()?.set(id, meta, 0)?;
    if placement.moved() {
        // Its depth (and its descendants') ranks its classifier entries.
        rerank(attachment)?;
    }
    let htb = shaping && config.action_arg != 0;
    if htb && (change.rate_bits_per_sec.is_some() || placement.moved()) {
        // The parents' own leaves are guaranteed what their children are not.
        let parents: Vec<u32> = [placement.old_parent, placement.new_parent]
            .into_iter()
            .flatten()
            .collect();
        // Read only for a class in a tree (each read is every class's).
        if !parents.is_empty() {
            let tree = TreeView::read(attachment, &attachment.class_list()?)?;
            for parent in parents {
                refresh_htb(attachment, &tree, parent, 0)?;
            }
        }
    }
    Ok(())
}

/// The class's place after the change, checked against the tree's guarantees; a move
/// writes the new parent and ceiling into `config` and `meta`.
fn place(
    attachment: &Attachment,
    id: u32,
    meta: &mut ClassMeta,
    config: &mut ClassConfig,
    change: &Change,
) -> Result<Placement> {
    // A global class is a top-level leaf: unless the change moves it, there is no tree
    // to read (its share changes every few intervals).
    let tree = if config.global != 0 && change.tree.is_none() {
        TreeView::default()
    } else {
        TreeView::read(attachment, &attachment.class_list()?)?
    };
    let old_parent = tree.parent_of(id);
    let mut spec = ClassSpec::from_meta(meta, config);
    match &change.tree {
        Some(place) => spec.tree = place.clone(),
        None => {
            if let (Some(placed), Some(parent)) = (&mut spec.tree, old_parent) {
                placed.parent = tree.name_of(parent).to_string();
            }
        }
    }
    let new_parent = check_guarantees(&tree, attachment, id, &spec)?;
    let placement = Placement {
        tree,
        old_parent,
        new_parent,
    };
    if placement.moved()
        && config.action == Action::Shape as u8
        && placement.tree.children(id).next().is_some()
    {
        return Err(runtime(format!(
            "shape class '{}' has children: its HTB subtree cannot move; move or delete them first",
            spec.name
        )));
    }
    if change.tree.is_some() {
        config.parent = new_parent.map_or(0, |p| p as u16 + 1);
        let tree = spec.tree.as_ref();
        meta.peak_rate_bits_per_sec = tree.and_then(|t| t.ceil_bits_per_sec).unwrap_or(0);
        meta.peak_burst_bytes = tree.and_then(|t| t.cburst_bytes).unwrap_or(0);
    }
    Ok(placement)
}

/// A shape class's HTB class at its new rate (made again under a new parent) and its
/// CoDel and sparse-flow cost at the new drain rate.
fn resync_shaping(
    attachment: &Attachment,
    id: u32,
    rated: &ClassSpec,
    placement: &Placement,
    config: &mut ClassConfig,
) -> Result<()> {
    let (drain_rate, _) = rated.drain();
    if config.action_arg != 0 {
        let dev = &attachment.location.queue_dev();
        let children = children_rate(&placement.tree, id);
        let htb = rated.htb_class(placement.new_parent, children);
        if placement.moved() {
            // HTB cannot re-parent a class: it is made again under the new parent (the
            // few packets in its queues are dropped); if that fails, again under the old
            // one, so the class keeps shaping where its state says it is.
            qdisc::delete_class(dev, id)?;
            if let Err(error) = qdisc::set_class(dev, id, &htb, true) {
                // The maps still hold the class as it was.
                let meta = attachment.meta()?.get(&id, 0)?;
                let was = ClassSpec::from_meta(&meta, &attachment.classes()?.get(&id, 0)?);
                let before = was.htb_class(placement.old_parent, children);
                let _ = qdisc::set_class(dev, id, &before, true);
                return Err(error);
            }
        } else {
            qdisc::set_class(dev, id, &htb, false)?;
        }
    }
    // Made again without `FAIR_FLOW_QUEUES`: the leaf is a FIFO now, whatever an earlier
    // shaper made (`qdisc::set_class` above replaced an fq_codel leaf).
    config.codel = rated.codel.unwrap_or_default().config(drain_rate);
    config.sparse_cost = sparse_cost(drain_rate);
    Ok(())
}

/// The class's byte costs at its new rate and burst (`drain`: at its share for a global
/// class), as a new cost version every bucket word converts to at its next packet.
fn recost(meta: &ClassMeta, config: &mut ClassConfig, (drain_rate, drain_burst): (u64, u64)) {
    let mut costs = config.costs();
    let meter = Meter::from_meta(meta, config.meter);
    costs.peak_cost = meter
        .second_cost(meta.rate_bits_per_sec, meta.burst_bytes)
        .1;
    let spec = ClassSpec::from_meta(meta, config);
    if let Some(tree) = &spec.tree {
        costs.peak_cost = spec.second_word_cost(tree);
    }
    (costs.cost, config.credit_chunk) = bucket_cost(
        drain_rate,
        drain_burst,
        config.scope,
        config.meter,
        config.action,
        config.parent != 0,
    );
    // Every bucket word (the class's, each key's, a meter's second one) is converted at
    // its next packet, keeping its tokens (or a shaper's backlog).
    config.set_costs(costs, crate::state::monotonic_ns());
    // Credit the CPUs took at the old rate and burst is dropped.
    config.credit_epoch = config.credit_epoch.wrapping_add(1);
}
