//! The class table: adding, changing and deleting classes in an attachment's maps.
//!
//! Write order keeps the packet path consistent at every instant: a class's config,
//! bucket and counters exist before any classifier entry points to it, and its entries
//! are gone (or re-pointed at the next-best class) before its config is cleared.

use super::{
    shapes::*,
    share::{at_share, global_share, new_share, next_version},
    *,
};
use crate::{
    actions::ActionSpec,
    error::{runtime, usage},
    qdisc,
    state::{decode_name, Attachment},
    units::format_duration_ns,
};
use anyhow::Result;
use aya::maps::{Array, MapData, MapError, PerCpuValues};
use shaper_common::{
    codel::{sparse_cost, CodelState, FlowCensus},
    hierarchy::MAX_LEVELS,
    Action, Bucket, ClassConfig, ClassMeta, ClassStats, KeyStats, RuleKey, RuleValue, Shape,
    MAX_CLASSES, MAX_RULES, MAX_SHAPES,
};
use std::collections::BTreeMap;

fn zero_stats(attachment: &Attachment, id: u32) -> Result<()> {
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    let zeros = PerCpuValues::try_from(vec![ClassStats::default(); cpus])?;
    attachment.stats()?.set(id, zeros, 0)?;
    let zeros = PerCpuValues::try_from(vec![KeyStats::default(); cpus])?;
    attachment.key_stats()?.set(id, zeros, 0)?;
    Ok(())
}

/// Adds a class; all or nothing.
pub fn add(attachment: &Attachment, spec: &ClassSpec) -> Result<u32> {
    Ok(add_many(attachment, std::slice::from_ref(spec))?[0])
}

/// Adds classes in order, reading the attachment's state once (the batch path: ten
/// thousand classes take a fraction of a second). Each class is all or nothing; on the
/// first error the classes before it stay and the error is returned.
pub fn add_many(attachment: &Attachment, specs: &[ClassSpec]) -> Result<Vec<u32>> {
    let existing = attachment.class_list()?;
    let mut names: std::collections::HashSet<String> =
        existing.iter().map(|(_, m)| decode_name(&m.name)).collect();
    let mut used: std::collections::HashSet<u32> = existing.iter().map(|(id, _)| *id).collect();
    let mut kernel_shapes = ShapeTable::read(attachment)?;
    let mut globals = attachment.globals()?;
    let (mut configs, mut metas, mut buckets, mut codel, mut rules) = (
        attachment.classes()?,
        attachment.meta()?,
        attachment.class_buckets()?,
        attachment.codel()?,
        attachment.rules()?,
    );
    let mut shares = attachment.shares()?;
    let mut flow_census = attachment.codel_flows()?;
    let mut index = attachment.class_index()?;
    let mut tree = TreeView::read(attachment, &existing)?;
    let dev = attachment.location.dev.clone();
    let mut next_free = 0;
    let mut ids = Vec::with_capacity(specs.len());
    for spec in specs {
        if names.contains(&spec.name) {
            return Err(runtime(format!(
                "class '{}' already exists on {}; use 'shaper class change'",
                spec.name,
                attachment.location.describe()
            )));
        }
        while used.contains(&next_free) {
            next_free += 1;
        }
        let id = next_free;
        if id >= MAX_CLASSES {
            return Err(runtime(format!(
                "no room for another class (the limit is {MAX_CLASSES})"
            )));
        }
        let parent = tree.place(attachment, spec, None)?;
        let mut shapes = ShapeTable {
            slots: kernel_shapes.slots.clone(),
        };
        let keys = class_entries(&spec.rule, &mut shapes)?;
        let mut spec = spec.clone();
        // A global class starts at its floor: this host holds no share until the hosts
        // agree on one (a new host never pushes the sum above the limit).
        let share = spec
            .global
            .as_ref()
            .map(|global| new_share(&spec, global, global.floor_bits_per_sec));
        let rated = match &share {
            Some(share) => at_share(&spec, share),
            None => spec.clone(),
        };
        if spec.action.action == Action::Shape {
            // The HTB class exists before anything steers packets into it; under fq the
            // program paces by departure time (action_arg 0).
            spec.action.arg = match qdisc::ensure_root(&dev)? {
                qdisc::Backend::Htb => {
                    let htb = qdisc::htb_class(&rated, parent, 0);
                    qdisc::set_class(&dev, id, &htb, true)?;
                    if let Some(parent) = parent {
                        // The parent's own leaves give up the guarantee the child takes.
                        let joining = TreeNode::of_spec(&spec, Some(parent)).guaranteed();
                        if let Err(error) = refresh_htb(attachment, &tree, parent, joining) {
                            let _ = qdisc::delete_class(&dev, id);
                            return Err(error);
                        }
                    }
                    qdisc::bulk_leaf(id)
                }
                qdisc::Backend::EdtFq => 0,
            };
        }
        let seq = globals.next_seq;
        let meta = spec.to_meta(seq)?;
        globals.next_seq += 1;
        attachment.set_globals(globals)?;

        // Config, bucket and counters first; nothing points at the id yet.
        zero_stats(attachment, id)?;
        buckets.set(id, Bucket::default(), 0)?;
        codel.set(id, CodelState::default(), 0)?;
        // A reused id must not inherit the deleted class's flow count.
        flow_census.set(id, FlowCensus::default(), 0)?;
        let mut rated = rated;
        rated.action = spec.action;
        let mut config = rated.config(seq as u32, parent);
        if spec.action.action == Action::Shape && spec.action.arg != 0 {
            config.sparse_priority = qdisc::sparse_leaf(id);
        }
        if let Some(mut share) = share {
            config.global = 1;
            share.floor_version = next_version(&config);
            shares.set(id, share, 0)?;
        }
        configs.set(id, config, 0)?;
        metas.set(id, meta, 0)?;
        index.insert(meta.name, id, 0)?;
        write_shapes(attachment, &shapes, &kernel_shapes)?;

        let value = RuleValue {
            class_id: id,
            _pad: 0,
            rank: rank(spec.prio, tree.depth_of(parent), seq),
        };
        if let Err(error) = write_entries(&mut rules, keys, value) {
            // Roll this class back to exactly the previous state.
            let _ = metas.set(id, ClassMeta::default(), 0);
            let _ = index.remove(&meta.name);
            let _ = configs.set(id, ClassConfig::default(), 0);
            let _ = write_shapes(attachment, &kernel_shapes, &shapes);
            // Entries written before the failure were live for a moment.
            globals.rules_changed();
            let _ = attachment.set_globals(globals);
            if spec.action.action == Action::Shape && spec.action.arg != 0 {
                let _ = qdisc::delete_class(&dev, id);
                if let Some(parent) = parent {
                    let _ = refresh_htb(attachment, &tree, parent, 0);
                }
            }
            return Err(error);
        }
        // New shapes become visible to the packet path last, with their entries in place,
        // and cached verdicts expire with the same write.
        globals.shape_count = shapes.count();
        globals.rules_changed();
        attachment.set_globals(globals)?;
        kernel_shapes = shapes;
        names.insert(spec.name.clone());
        used.insert(id);
        ids.push(id);
        tree.insert(id, &spec, parent);
    }
    Ok(ids)
}

/// The classes' tree as far as checks need it: each class's name, parent and the rate it
/// is guaranteed (0 for a per-key class, whose rate is per key).
#[derive(Default)]
struct TreeView {
    classes: BTreeMap<u32, TreeNode>,
    /// Indexes, so a batch of ten thousand children is placed in linear time.
    by_name: std::collections::HashMap<String, u32>,
    children_of: std::collections::HashMap<u32, Vec<u32>>,
}

struct TreeNode {
    name: String,
    parent: Option<u32>,
    rate: u64,
    /// A per-key class's rate is each key's: it guarantees nothing within its parent.
    per_key: bool,
    /// Meters cannot be parents (yet).
    metered: bool,
    /// A shape class's tree is an htb tree: shape classes parent shape classes only.
    shapes: bool,
    /// A global class's share is one rate on this host: it has no children (yet).
    global: bool,
}

impl TreeView {
    fn read(attachment: &Attachment, list: &[(u32, ClassMeta)]) -> Result<Self> {
        let configs = attachment.classes()?;
        let mut tree = Self {
            classes: BTreeMap::new(),
            by_name: Default::default(),
            children_of: Default::default(),
        };
        for (id, meta) in list {
            let config = configs.get(id, 0)?;
            tree.put(*id, TreeNode::of(meta, &config));
        }
        Ok(tree)
    }

    fn insert(&mut self, id: u32, spec: &ClassSpec, parent: Option<u32>) {
        self.put(id, TreeNode::of_spec(spec, parent));
    }

    fn put(&mut self, id: u32, node: TreeNode) {
        self.by_name.insert(node.name.clone(), id);
        if let Some(parent) = node.parent {
            self.children_of.entry(parent).or_default().push(id);
        }
        self.classes.insert(id, node);
    }

    fn children(&self, id: u32) -> impl Iterator<Item = (&u32, &TreeNode)> {
        self.children_of
            .get(&id)
            .into_iter()
            .flatten()
            .filter_map(|child| self.classes.get_key_value(child))
    }

    /// The parent's id for `spec` (`moving`: the class's own id when it is already in the
    /// tree), checked: the parent exists here and can lend, the tree stays within
    /// `MAX_LEVELS` levels, and its children's guaranteed rates fit its rate.
    fn place(
        &self,
        attachment: &Attachment,
        spec: &ClassSpec,
        moving: Option<u32>,
    ) -> Result<Option<u32>> {
        let Some(tree) = &spec.tree else {
            return Ok(None);
        };
        let (parent_id, parent) = self
            .by_name
            .get(&tree.parent)
            .and_then(|id| self.classes.get_key_value(id))
            .ok_or_else(|| {
                runtime(format!(
                    "no parent class '{}' on {} (add it first)",
                    tree.parent,
                    attachment.location.describe()
                ))
            })?;
        if parent.metered {
            return Err(runtime(format!(
                "class '{}' cannot be a parent: meters stay leaves so far",
                tree.parent
            )));
        }
        if parent.global {
            return Err(runtime(format!(
                "class '{}' cannot be a parent: a global class's share is one rate on this host, a leaf so far",
                tree.parent
            )));
        }
        let shapes = spec.action.action == Action::Shape;
        if parent.shapes != shapes {
            let (what, other) = if shapes {
                ("shapes", "polices or marks")
            } else {
                ("polices or marks", "shapes")
            };
            return Err(runtime(format!(
                "class '{}' {what} and its parent '{}' {other}: a shape tree is an htb tree, shaping throughout",
                spec.name, tree.parent
            )));
        }
        let mut depth = 2;
        let mut above = parent.parent;
        while let Some(id) = above {
            if Some(id) == moving {
                return Err(runtime(format!(
                    "class '{}' cannot move under its own descendant '{}'",
                    spec.name, tree.parent
                )));
            }
            depth += 1;
            above = self.classes.get(&id).and_then(|node| node.parent);
        }
        // `depth` counts the class itself; a class that moves brings its subtree along.
        let below = moving.map_or(0, |id| self.height(id) - 1);
        if depth + below > MAX_LEVELS {
            return Err(runtime(format!(
                "a tree is at most {MAX_LEVELS} levels deep; under '{}' class '{}' would make {}",
                tree.parent,
                spec.name,
                depth + below
            )));
        }
        let guaranteed = TreeNode::of_spec(spec, Some(*parent_id)).guaranteed();
        let siblings: u64 = self
            .children(*parent_id)
            .filter(|(id, _)| Some(**id) != moving)
            .map(|(_, node)| node.guaranteed())
            .sum();
        if siblings + guaranteed > parent.rate {
            return Err(runtime(format!(
                "the children of '{}' would be guaranteed {} in all, above its rate {}: \
                 lower their rates (borrow with --ceil instead) or raise the parent's",
                tree.parent,
                crate::units::format_rate(siblings + guaranteed),
                crate::units::format_rate(parent.rate)
            )));
        }
        Ok(Some(*parent_id))
    }

    /// The depth of a class under `parent` (0: top level).
    fn depth_of(&self, parent: Option<u32>) -> usize {
        let (mut depth, mut above) = (0, parent);
        while let Some(id) = above {
            depth += 1;
            above = self.classes.get(&id).and_then(|node| node.parent);
        }
        depth
    }

    /// Levels from `id` down to its deepest descendant (1: no children).
    fn height(&self, id: u32) -> usize {
        1 + self
            .children(id)
            .map(|(child, _)| self.height(*child))
            .max()
            .unwrap_or(0)
    }
}

impl TreeNode {
    fn of(meta: &ClassMeta, config: &ClassConfig) -> Self {
        Self {
            name: decode_name(&meta.name),
            parent: (config.parent != 0).then(|| config.parent as u32 - 1),
            rate: meta.rate_bits_per_sec,
            per_key: config.scope != shaper_common::Scope::Class as u8,
            metered: config.meter != shaper_common::meter::METER_NONE,
            shapes: config.action == Action::Shape as u8,
            global: config.global != 0,
        }
    }

    fn of_spec(spec: &ClassSpec, parent: Option<u32>) -> Self {
        Self {
            name: spec.name.clone(),
            parent,
            rate: spec.rate_bits_per_sec,
            per_key: spec.scope != shaper_common::Scope::Class,
            metered: spec.meter != Meter::None,
            shapes: spec.action.action == Action::Shape,
            global: spec.global.is_some(),
        }
    }

    /// The rate the class is guaranteed within its parent.
    fn guaranteed(&self) -> u64 {
        if self.per_key {
            0
        } else {
            self.rate
        }
    }
}

/// Why a classifier entry could not be written, in the user's terms.
fn rule_insert_error(error: &MapError) -> String {
    match error {
        // A full BPF hash map answers an insert with E2BIG.
        MapError::SyscallError(failed)
            if failed.io_error.raw_os_error() == Some(nix::errno::Errno::E2BIG as i32) =>
        {
            format!(
                "cannot add classifier entry: the classifier table is full ({MAX_RULES} entries \
                 per interface and direction; port ranges take one entry per power-of-two block)"
            )
        }
        other => format!(
            "cannot add classifier entry: {other}: {}",
            root_cause(other)
        ),
    }
}

fn root_cause(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// The classifier map of an attachment.
type RulesMap = aya::maps::HashMap<aya::maps::MapData, RuleKey, RuleValue>;

/// Writes a class's classifier entries, skipping keys an older or higher-priority class
/// owns; on failure every entry already written gets its previous value back.
fn write_entries(rules: &mut RulesMap, keys: Vec<RuleKey>, value: RuleValue) -> Result<()> {
    let mut written: Vec<(RuleKey, Option<RuleValue>)> = Vec::new();
    let mut outcome = Ok(());
    for key in keys {
        let previous = match rules.get(&key, 0) {
            Ok(v) => Some(v),
            Err(MapError::KeyNotFound) => None,
            Err(e) => {
                outcome = Err(e.into());
                break;
            }
        };
        if previous.is_some_and(|p| p.rank <= value.rank) {
            continue;
        }
        if let Err(e) = rules.insert(key, value, 0) {
            outcome = Err(runtime(rule_insert_error(&e)));
            break;
        }
        written.push((key, previous));
    }
    if outcome.is_err() {
        for (key, previous) in written.into_iter().rev() {
            let _ = match previous {
                Some(v) => rules.insert(key, v, 0),
                None => rules.remove(&key),
            };
        }
    }
    outcome
}

/// Finds a class by name.
pub fn find(attachment: &Attachment, name: &str) -> Result<Option<(u32, ClassMeta)>> {
    attachment.find_class(name)
}

fn not_found(attachment: &Attachment, name: &str) -> anyhow::Error {
    runtime(format!(
        "no class '{name}' on {}",
        attachment.location.describe()
    ))
}

/// What `class change` may change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    pub rate_bits_per_sec: Option<u64>,
    pub burst_bytes: Option<u64>,
    pub action: Option<ActionSpec>,
    /// Shape classes only: CoDel's target and interval (ns).
    pub codel_target_ns: Option<u64>,
    pub codel_interval_ns: Option<u64>,
    pub codel_ecn: Option<bool>,
    /// A new parent (`Some(None)`: none, the class goes to the top level).
    pub parent: Option<Option<String>>,
    /// A new ceiling and its burst (`Some(None)`: back to the rate and burst).
    pub ceil_bits_per_sec: Option<Option<u64>>,
    pub cburst_bytes: Option<Option<u64>>,
}

impl Change {
    fn moves(&self) -> bool {
        self.parent.is_some() || self.ceil_bits_per_sec.is_some() || self.cburst_bytes.is_some()
    }
}

/// The class's place after a change: the current one (`current`, its parent's name filled
/// in) with the change's parent, ceiling and burst; checked as `class add` checks them.
fn placed(current: Option<Tree>, change: &Change, spec: &ClassSpec) -> Result<Option<Tree>> {
    let parent = match &change.parent {
        Some(parent) => parent.clone(),
        None => current.as_ref().map(|tree| tree.parent.clone()),
    };
    // A class that stays in a tree (under its parent or a new one) keeps its ceiling
    // unless the change sets it; one that leaves the tree has none.
    let kept = current.filter(|_| parent.is_some());
    let ceil = change
        .ceil_bits_per_sec
        .unwrap_or_else(|| kept.as_ref().and_then(|t| t.ceil_bits_per_sec));
    let cburst = change
        .cburst_bytes
        .unwrap_or_else(|| kept.as_ref().and_then(|t| t.cburst_bytes));
    let problem = crate::class_input::tree_problem(
        &spec.name,
        parent.as_deref(),
        (ceil, cburst),
        spec.rate_bits_per_sec,
        spec.scope,
        spec.action.action,
        spec.meter,
    );
    if let Some((_, message)) = problem {
        return Err(usage(message));
    }
    Ok(parent.map(|parent| Tree {
        parent,
        ceil_bits_per_sec: ceil,
        cburst_bytes: cburst,
    }))
}

/// Changes rate, burst, action, CoDel knobs, parent, ceil and/or cburst in place: counters
/// are untouched, and each bucket word is converted to the new rate and burst by the
/// first packet that meets it (tokens kept, clipped to the new burst), so the change is
/// effective at the next packet with neither a blackout nor a free refill. A move ranks
/// the classifier entries again at the class's new depth.
pub fn change(attachment: &Attachment, name: &str, change: Change) -> Result<()> {
    let moves = change.moves();
    let Change {
        rate_bits_per_sec,
        burst_bytes,
        action,
        codel_target_ns,
        codel_interval_ns,
        codel_ecn,
        ..
    } = change;
    let (id, mut meta) = find(attachment, name)?.ok_or_else(|| not_found(attachment, name))?;
    if let Some(rate) = rate_bits_per_sec {
        meta.rate_bits_per_sec = rate;
    }
    if let Some(burst) = burst_bytes {
        meta.burst_bytes = burst;
    }
    let mut classes = attachment.classes()?;
    let mut config = classes.get(&id, 0)?;
    let shaping = config.action == Action::Shape as u8;
    if config.global != 0 && matches!(change.parent, Some(Some(_))) {
        return Err(usage(crate::class_input::GLOBAL_IN_A_TREE));
    }
    if action.is_some_and(|a| (a.action == Action::Shape) != shaping) {
        return Err(usage(
            "a class cannot change to or from --action shape; delete it and add it again",
        ));
    }
    if (codel_target_ns.is_some() || codel_interval_ns.is_some() || codel_ecn.is_some()) && !shaping
    {
        return Err(usage(
            "--target, --interval and --ecn tune CoDel on --action shape; this class does not shape",
        ));
    }
    if shaping {
        let current = ClassSpec::from_meta(&meta, &config)
            .codel
            .unwrap_or_default();
        let target = codel_target_ns.unwrap_or(current.target_ns);
        let interval = codel_interval_ns.unwrap_or(current.interval_ns);
        if target >= interval {
            return Err(usage(format!(
                "--target {} must be below --interval {}",
                format_duration_ns(target),
                format_duration_ns(interval)
            )));
        }
        meta.codel_target_ns = target;
        meta.codel_interval_ns = interval;
        if let Some(ecn) = codel_ecn {
            meta.codel_no_ecn = !ecn as u8;
        }
    }
    // The class's place: where it is, or where the change moves it (checked like an add).
    // A global class is a top-level leaf: unless the change moves it, there is no tree to
    // read (its share changes every few intervals).
    let tree = if config.global != 0 && !moves {
        TreeView::default()
    } else {
        TreeView::read(attachment, &attachment.class_list()?)?
    };
    let old_parent = tree.classes.get(&id).and_then(|node| node.parent);
    let mut spec = ClassSpec::from_meta(&meta, &config);
    if let Some(placed) = &mut spec.tree {
        placed.parent = old_parent.map_or_else(String::new, |p| tree.classes[&p].name.clone());
    }
    spec.tree = placed(spec.tree.clone(), &change, &spec)?;
    let new_parent = check_guarantees(&tree, attachment, id, &spec)?;
    let moved = new_parent != old_parent;
    if moved && shaping && tree.children(id).next().is_some() {
        return Err(runtime(format!(
            "shape class '{name}' has children: its HTB subtree cannot move; move or delete them first"
        )));
    }
    if moves {
        config.parent = new_parent.map_or(0, |p| p as u16 + 1);
        let tree = spec.tree.as_ref();
        meta.peak_rate_bits_per_sec = tree.and_then(|t| t.ceil_bits_per_sec).unwrap_or(0);
        meta.peak_burst_bytes = tree.and_then(|t| t.cburst_bytes).unwrap_or(0);
    }
    // A global class runs at its share: the limit (`meta`'s rate) is for all hosts.
    let share = global_share(attachment, id, &config, &meta)?;
    let rated = |meta: &ClassMeta| {
        let spec = ClassSpec::from_meta(meta, &config);
        match &share {
            Some(share) => at_share(&spec, share),
            None => spec,
        }
    };
    let (drain_rate, drain_burst) = rated(&meta).drain();
    if shaping {
        let spec = rated(&meta);
        if config.action_arg != 0 {
            let dev = &attachment.location.dev;
            let htb = qdisc::htb_class(&spec, new_parent, children_rate(&tree, id));
            if moved {
                // HTB cannot re-parent a class: it is made again under the new parent
                // (the few packets in its queues are dropped); if that fails, again under
                // the old one, so the class keeps shaping where its state says it is.
                qdisc::delete_class(dev, id)?;
                if let Err(error) = qdisc::set_class(dev, id, &htb, true) {
                    // The maps still hold the class as it was.
                    let (meta, config) = (attachment.meta()?.get(&id, 0)?, classes.get(&id, 0)?);
                    let was = ClassSpec::from_meta(&meta, &config);
                    let before = qdisc::htb_class(&was, old_parent, children_rate(&tree, id));
                    let _ = qdisc::set_class(dev, id, &before, true);
                    return Err(error);
                }
            } else {
                qdisc::set_class(dev, id, &htb, false)?;
            }
        }
        config.codel = spec.codel.unwrap_or_default().config(drain_rate);
        config.sparse_cost = sparse_cost(drain_rate);
    }
    let mut costs = config.costs();
    let meter = Meter::from_meta(&meta, config.meter);
    if let Meter::TrTcm {
        peak_rate_bits_per_sec,
        ..
    } = meter
    {
        if meta.rate_bits_per_sec > peak_rate_bits_per_sec {
            return Err(usage(
                "the committed rate cannot exceed the class's peak rate",
            ));
        }
    }
    costs.peak_cost = meter
        .second_cost(meta.rate_bits_per_sec, meta.burst_bytes)
        .1;
    let spec = ClassSpec::from_meta(&meta, &config);
    if let Some(tree) = &spec.tree {
        costs.peak_cost = spec.second_word_cost(tree);
    }
    if let Some(action) = action.filter(|_| !shaping) {
        config.action = action.action as u8;
        config.action_arg = action.arg;
        config.action_mask = action.mask;
    }
    (costs.cost, config.credit_chunk) = bucket_cost(
        drain_rate,
        drain_burst,
        config.scope,
        config.meter,
        config.action,
        config.parent != 0,
    );
    // A new cost version: every bucket word (the class's, each key's, a meter's second
    // one) is converted at its next packet, keeping its tokens (or a shaper's backlog).
    config.set_costs(costs, crate::state::monotonic_ns());
    // Credit the CPUs took at the old rate and burst is dropped.
    config.credit_epoch = config.credit_epoch.wrapping_add(1);
    classes.set(id, config, 0)?;
    attachment.meta()?.set(id, meta, 0)?;
    if moved {
        // Its depth (and its descendants') ranks its classifier entries.
        rerank(attachment)?;
    }
    if shaping && config.action_arg != 0 && (rate_bits_per_sec.is_some() || moved) {
        // The parents' own leaves are guaranteed what their children are not.
        let tree = TreeView::read(attachment, &attachment.class_list()?)?;
        for parent in [old_parent, new_parent].into_iter().flatten() {
            refresh_htb(attachment, &tree, parent, 0)?;
        }
    }
    Ok(())
}

/// What the children of `id` are guaranteed in all.
fn children_rate(tree: &TreeView, id: u32) -> u64 {
    tree.children(id).map(|(_, node)| node.guaranteed()).sum()
}

/// Every class with its spec and its classifier rank (prio, depth in the tree, age).
fn ranked(
    all: &[(u32, ClassMeta)],
    tree: &TreeView,
    configs: &Array<MapData, ClassConfig>,
) -> Result<Vec<(u32, ClassSpec, u64)>> {
    all.iter()
        .map(|(class_id, meta)| {
            let spec = ClassSpec::from_meta(meta, &configs.get(class_id, 0)?);
            let depth = tree.depth_of(tree.classes.get(class_id).and_then(|n| n.parent));
            Ok((*class_id, spec, rank(meta.prio, depth, meta.seq)))
        })
        .collect()
}

/// Rewrites the classifier entries whose best class changed rank (after a move).
fn rerank(attachment: &Attachment) -> Result<()> {
    let all = attachment.class_list()?;
    let tree = TreeView::read(attachment, &all)?;
    let configs = attachment.classes()?;
    let classes = ranked(&all, &tree, &configs)?;
    let mut shapes = ShapeTable::read(attachment)?;
    let wanted = remaining_without(&classes, u32::MAX, &mut shapes)?.wanted;
    let mut rules = attachment.rules()?;
    let rewritten = wanted.into_iter().try_for_each(|(key, value)| {
        if rules.get(&key, 0).ok() != Some(value) {
            rules.insert(key, value, 0)?;
        }
        Ok::<_, anyhow::Error>(())
    });
    // Also after a failed insert: the entries written before it are live.
    attachment.rules_changed()?;
    rewritten
}

/// Re-sets the HTB classes of shape class `id` from its state and `tree` (its own leaves
/// guaranteed its rate less its children's and `joining`, a child's rate not in `tree`
/// yet); nothing for a class that does not shape through HTB.
fn refresh_htb(attachment: &Attachment, tree: &TreeView, id: u32, joining: u64) -> Result<()> {
    let config = attachment.classes()?.get(&id, 0)?;
    if config.action != Action::Shape as u8 || config.action_arg == 0 {
        return Ok(());
    }
    let meta = attachment.meta()?.get(&id, 0)?;
    let parent = tree.classes.get(&id).and_then(|node| node.parent);
    let spec = ClassSpec::from_meta(&meta, &config);
    let htb = qdisc::htb_class(&spec, parent, children_rate(tree, id) + joining);
    qdisc::set_class(&attachment.location.dev, id, &htb, false)
}

/// A change keeps the tree's guarantees: a class's rate within what its parent has left
/// beside its siblings (checked where `spec.tree` places it: its parent, or a new one),
/// a parent's rate at least its children's. The parent's id.
fn check_guarantees(
    tree: &TreeView,
    attachment: &Attachment,
    id: u32,
    spec: &ClassSpec,
) -> Result<Option<u32>> {
    let children = children_rate(tree, id);
    if children > spec.rate_bits_per_sec {
        return Err(runtime(format!(
            "the children of '{}' are guaranteed {} in all, above the new rate {}",
            spec.name,
            crate::units::format_rate(children),
            crate::units::format_rate(spec.rate_bits_per_sec)
        )));
    }
    tree.place(attachment, spec, Some(id))
}

/// Deletes a class; keys it owned go to the next-best class that matches them.
/// The classifier once a class is gone: for every key of the remaining classes the
/// best-ranked one (the lowest prio, then the oldest), the deleted class's keys, and the
/// shape slots still in use.
pub(super) struct Remaining {
    pub(super) wanted: BTreeMap<RuleKey, RuleValue>,
    pub(super) deleted_keys: Vec<RuleKey>,
    pub(super) shapes_in_use: Vec<bool>,
}

/// Computes [`Remaining`] for `classes` (id, spec, rank) without class `deleted`. Pure:
/// it touches only the in-memory shape table.
pub(super) fn remaining_without(
    classes: &[(u32, ClassSpec, u64)],
    deleted: u32,
    shapes: &mut ShapeTable,
) -> Result<Remaining> {
    let mut remaining = Remaining {
        wanted: BTreeMap::new(),
        deleted_keys: Vec::new(),
        shapes_in_use: vec![false; MAX_SHAPES as usize],
    };
    for (class_id, spec, rank) in classes {
        let keys = class_entries(&spec.rule, shapes)?;
        if *class_id == deleted {
            remaining.deleted_keys = keys;
            continue;
        }
        let value = RuleValue {
            class_id: *class_id,
            _pad: 0,
            rank: *rank,
        };
        for key in keys {
            remaining.shapes_in_use[key.shape as usize] = true;
            let slot = remaining.wanted.entry(key).or_insert(value);
            if value.rank < slot.rank {
                *slot = value;
            }
        }
    }
    Ok(remaining)
}

pub fn delete(attachment: &Attachment, name: &str) -> Result<()> {
    let all = attachment.class_list()?;
    let (id, _) = all
        .iter()
        .find(|(_, m)| decode_name(&m.name) == name)
        .cloned()
        .ok_or_else(|| not_found(attachment, name))?;
    let tree = TreeView::read(attachment, &all)?;
    let children: Vec<&str> = tree.children(id).map(|(_, n)| n.name.as_str()).collect();
    if !children.is_empty() {
        return Err(runtime(format!(
            "class '{name}' is the parent of {}: delete or move them first",
            children.join(", ")
        )));
    }
    let configs = attachment.classes()?;
    let mut shapes = ShapeTable::read(attachment)?;
    let before = ShapeTable {
        slots: shapes.slots.clone(),
    };
    let classes = ranked(&all, &tree, &configs)?;
    let Remaining {
        wanted,
        deleted_keys,
        shapes_in_use,
    } = remaining_without(&classes, id, &mut shapes)?;
    let mut rules = attachment.rules()?;
    let rewritten = deleted_keys
        .iter()
        .try_for_each(|key| match wanted.get(key) {
            Some(next) => Ok(rules.insert(key, next, 0)?),
            None => match rules.remove(key) {
                Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
                Err(e) => Err(anyhow::Error::from(e)),
            },
        });
    // At once (and after a failure too): the class's cached verdicts would keep its
    // packets unclassified until the end of the delete, or for good if a later step
    // failed; the search finds the next-best class.
    attachment.rules_changed()?;
    rewritten?;
    let mut meta_map = attachment.meta()?;
    let name = meta_map.get(&id, 0)?.name;
    meta_map.set(id, ClassMeta::default(), 0)?;
    match attachment.class_index()?.remove(&name) {
        Ok(()) | Err(MapError::KeyNotFound) => {}
        Err(e) => return Err(e.into()),
    }
    let mut configs = configs;
    let config = configs.get(&id, 0)?;
    let in_htb = config.action == Action::Shape as u8 && config.action_arg != 0;
    configs.set(id, ClassConfig::default(), 0)?;
    if config.global != 0 {
        attachment
            .shares()?
            .set(id, shaper_common::GlobalShare::default(), 0)?;
    }
    if in_htb {
        qdisc::delete_class(&attachment.location.dev, id)?;
        if let Some(parent) = tree.classes.get(&id).and_then(|node| node.parent) {
            let tree = TreeView::read(attachment, &attachment.class_list()?)?;
            refresh_htb(attachment, &tree, parent, 0)?;
        }
    }
    // Free shapes no class uses any more.
    for (index, slot) in shapes.slots.iter_mut().enumerate() {
        if !shapes_in_use[index] {
            *slot = Shape::default();
        }
    }
    set_shape_count(attachment, shapes.count())?;
    write_shapes(attachment, &shapes, &before)?;
    attachment.rules_changed()
}

#[cfg(test)]
mod tests {
    //! The pure part of deletion, on the host.
    use super::*;
    use crate::class_input::ClassInput;

    fn class(name: &str, dport: &str, prio: &str) -> ClassSpec {
        let input = ClassInput {
            name: name.into(),
            rate: "1mbit".into(),
            proto: Some("udp".into()),
            dport: Some(dport.into()),
            prio: Some(prio.into()),
            ..ClassInput::default()
        };
        input.check().unwrap().1
    }

    fn empty_shapes() -> ShapeTable {
        ShapeTable {
            slots: vec![Shape::default(); MAX_SHAPES as usize],
        }
    }

    #[test]
    fn deleting_a_class_hands_its_keys_to_the_next_best() {
        // Creation order is the rank's low word: older classes rank lower (win ties).
        let classes = vec![
            (0, class("older", "53", "10"), rank(10, 0, 1)),
            (1, class("younger", "53", "10"), rank(10, 0, 2)),
            (2, class("urgent", "53", "5"), rank(5, 0, 3)),
        ];
        let mut shapes = empty_shapes();
        let without_urgent = remaining_without(&classes, 2, &mut shapes).unwrap();
        assert!(!without_urgent.deleted_keys.is_empty());
        for key in &without_urgent.deleted_keys {
            assert_eq!(
                without_urgent.wanted[key].class_id, 0,
                "the older of two ties"
            );
        }
        let without_older = remaining_without(&classes, 0, &mut shapes).unwrap();
        for key in &without_older.deleted_keys {
            assert_eq!(without_older.wanted[key].class_id, 2, "the lowest prio");
        }
    }

    #[test]
    fn shapes_only_the_deleted_class_used_are_freed() {
        let classes = vec![
            (0, class("one-port", "53", "10"), rank(10, 0, 1)),
            (1, class("a-range", "1000-1001", "10"), rank(10, 0, 2)),
        ];
        let mut shapes = empty_shapes();
        let all = remaining_without(&classes, u32::MAX, &mut shapes).unwrap();
        let without_range = remaining_without(&classes, 1, &mut shapes).unwrap();
        let used = |r: &Remaining| r.shapes_in_use.iter().filter(|u| **u).count();
        assert!(
            used(&without_range) < used(&all),
            "the range's port mask is freed"
        );
        assert!(without_range
            .deleted_keys
            .iter()
            .all(|key| !without_range.wanted.contains_key(key)));
    }
}
