//! Adding classes: one, or a batch that reads the attachment's state once.
//!
//! Write order keeps the packet path consistent at every instant: a class's config,
//! bucket and counters exist before any classifier entry points to it; new rule shapes
//! become visible last, with their entries in place.

use super::{
    shapes::*,
    share::{at_share, new_share, next_version},
    table::{write_entries, RulesMap},
    tree::{refresh_htb, TreeNode, TreeView},
    *,
};
use crate::{
    error::runtime,
    qdisc,
    state::{decode_name, Attachment, Direction},
};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuValues};
use shaper_common::{
    codel::{CodelState, FlowCensus},
    fair::ShapeStats,
    Action, Bucket, ClassConfig, ClassMeta, ClassStats, GlobalShare, Globals, KeyStats, RuleValue,
    CLASS_NAME_LEN, MAX_CLASSES,
};
use std::collections::HashSet;

/// Adds a class; all or nothing.
pub fn add(attachment: &Attachment, spec: &ClassSpec) -> Result<u32> {
    Ok(add_many(attachment, std::slice::from_ref(spec))?[0])
}

/// Adds classes in order, reading the attachment's state once (the batch path: ten
/// thousand classes take a fraction of a second). Each class is all or nothing; on the
/// first error the classes before it stay and the error is returned.
pub fn add_many(attachment: &Attachment, specs: &[ClassSpec]) -> Result<Vec<u32>> {
    let shaping = specs.iter().any(|spec| spec.action.action == Action::Shape);
    if shaping {
        // The new classes' ifb: the classes that queued on a deleted one follow it.
        super::requeue(attachment)?;
    }
    let mut batch = Batch::open(attachment)?;
    let added = specs.iter().map(|spec| batch.add(spec)).collect();
    if shaping {
        super::shape_classes_changed(attachment);
    }
    added
}

/// The attachment's state a batch of adds reads once and keeps up to date.
struct Batch<'a> {
    attachment: &'a Attachment,
    names: HashSet<String>,
    used: HashSet<u32>,
    next_free: u32,
    kernel_shapes: ShapeTable,
    globals: Globals,
    tree: TreeView,
    configs: Array<MapData, ClassConfig>,
    metas: Array<MapData, ClassMeta>,
    buckets: Array<MapData, Bucket>,
    codel: Array<MapData, CodelState>,
    flow_census: Array<MapData, FlowCensus>,
    rules: RulesMap,
    shares: Array<MapData, GlobalShare>,
    index: BpfHashMap<MapData, [u8; CLASS_NAME_LEN], u32>,
}

impl<'a> Batch<'a> {
    fn open(attachment: &'a Attachment) -> Result<Self> {
        let existing = attachment.class_list()?;
        Ok(Self {
            attachment,
            names: existing.iter().map(|(_, m)| decode_name(&m.name)).collect(),
            used: existing.iter().map(|(id, _)| *id).collect(),
            next_free: 0,
            kernel_shapes: ShapeTable::read(attachment)?,
            globals: attachment.globals()?,
            tree: TreeView::read(attachment, &existing)?,
            configs: attachment.classes()?,
            metas: attachment.meta()?,
            buckets: attachment.class_buckets()?,
            codel: attachment.codel()?,
            flow_census: attachment.codel_flows()?,
            rules: attachment.rules()?,
            shares: attachment.shares()?,
            index: attachment.class_index()?,
        })
    }

    /// The lowest free class id.
    fn free_id(&mut self, name: &str) -> Result<u32> {
        if self.names.contains(name) {
            return Err(runtime(format!(
                "class '{name}' already exists on {}; use 'shaper class change'",
                self.attachment.location.describe()
            )));
        }
        while self.used.contains(&self.next_free) {
            self.next_free += 1;
        }
        if self.next_free >= MAX_CLASSES {
            return Err(runtime(format!(
                "no room for another class (the limit is {MAX_CLASSES})"
            )));
        }
        Ok(self.next_free)
    }

    fn add(&mut self, spec: &ClassSpec) -> Result<u32> {
        let id = self.free_id(&spec.name)?;
        let parent = self.tree.place(self.attachment, spec, None)?;
        let mut shapes = ShapeTable {
            slots: self.kernel_shapes.slots.clone(),
        };
        let keys = class_entries(&spec.rule, &mut shapes)?;
        let mut spec = spec.clone();
        // A global class starts at its floor: this host holds no share until the hosts
        // agree on one (a new host never pushes the sum above the limit).
        let share = spec
            .global
            .as_ref()
            .map(|global| new_share(&spec, global, global.floor_bits_per_sec));
        let mut rated = match &share {
            Some(share) => at_share(&spec, share),
            None => spec.clone(),
        };
        let mut ifb = 0;
        if spec.action.action == Action::Shape {
            (spec.action.arg, ifb) = self.shape_leaf(id, &spec, &rated, parent)?;
        }
        rated.action = spec.action;
        let seq = self.globals.next_seq;
        let meta = spec.to_meta(seq)?;
        self.globals.next_seq += 1;
        self.attachment.set_globals(self.globals)?;
        // Config, bucket and counters first; nothing points at the id yet.
        self.initial_state(id)?;
        let mut config = rated.config(seq as u32, parent);
        if spec.action.action == Action::Shape && spec.action.arg != 0 {
            config.sparse_priority = qdisc::sparse_leaf(id);
            // On ingress, where the program sends the class's packets to queue.
            config.action_mask = ifb;
        }
        if let Some(mut share) = share {
            config.global = 1;
            share.floor_version = next_version(&config);
            self.shares.set(id, share, 0)?;
        }
        self.configs.set(id, config, 0)?;
        self.metas.set(id, meta, 0)?;
        self.index.insert(meta.name, id, 0)?;
        write_shapes(self.attachment, &shapes, &self.kernel_shapes)?;
        let value = RuleValue {
            class_id: id,
            _pad: 0,
            rank: rank(spec.prio, self.tree.depth_of(parent), seq),
        };
        if let Err(error) = write_entries(&mut self.rules, keys, value) {
            self.roll_back(id, &spec, &meta, &shapes, parent);
            return Err(error);
        }
        // New shapes become visible to the packet path last, with their entries in place,
        // and cached verdicts expire with the same write.
        self.globals.shape_count = shapes.count();
        self.globals.rules_changed();
        self.attachment.set_globals(self.globals)?;
        self.kernel_shapes = shapes;
        self.names.insert(spec.name.clone());
        self.used.insert(id);
        self.tree.insert(id, &spec, parent);
        Ok(id)
    }

    /// A shape class's HTB class, made before anything steers packets into it; its bulk
    /// leaf, or 0 under fq (the program paces by departure time), and on ingress the
    /// ifindex of the ifb it queues on (0 on egress).
    fn shape_leaf(
        &self,
        id: u32,
        spec: &ClassSpec,
        rated: &ClassSpec,
        parent: Option<u32>,
    ) -> Result<(u32, u32)> {
        let location = &self.attachment.location;
        let dev = &location.queue_dev();
        let ingress = location.direction == Direction::Ingress;
        let ifb = if ingress {
            // The device first: no kernel takes a bare IP packet on an ifb.
            if self.globals.link_header_len == 0 {
                // An ifb is an Ethernet device: a bare IP packet redirected to it is dropped.
                return Err(runtime(format!(
                    "{} carries bare IP packets (no link-layer header): an ingress shape \
                     class queues on an ifb, which needs one; police or mark instead",
                    location.dev
                )));
            }
            qdisc::require_ifb_redirect("an ingress shape class")?;
            let ifb = qdisc::ensure_ifb(&location.dev)?;
            // A re-made ifb has another ifindex: splitting follows it.
            super::refresh_split(self.attachment)?;
            ifb
        } else {
            0
        };
        let leaf = self.htb_leaf(dev, id, spec, rated, parent, ingress)?;
        Ok((leaf, ifb))
    }

    fn htb_leaf(
        &self,
        dev: &str,
        id: u32,
        spec: &ClassSpec,
        rated: &ClassSpec,
        parent: Option<u32>,
        ingress: bool,
    ) -> Result<u32> {
        match qdisc::ensure_root(dev, !ingress)? {
            qdisc::Backend::Htb => {
                let htb = rated.htb_class(parent, 0);
                qdisc::set_class(dev, id, &htb, true)?;
                if let Some(parent) = parent {
                    // The parent's own leaves give up the guarantee the child takes.
                    let joining = TreeNode::of_spec(spec, Some(parent)).guaranteed();
                    if let Err(error) = refresh_htb(self.attachment, &self.tree, parent, joining) {
                        let _ = qdisc::delete_class(dev, id);
                        return Err(error);
                    }
                }
                Ok(qdisc::bulk_leaf(id))
            }
            qdisc::Backend::EdtFq => Ok(0),
        }
    }

    /// A new class's counters, bucket and CoDel state from zero (a reused id must not
    /// inherit the deleted class's, its flow count included).
    fn initial_state(&mut self, id: u32) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
        let zeros = PerCpuValues::try_from(vec![ClassStats::default(); cpus])?;
        self.attachment.stats()?.set(id, zeros, 0)?;
        let zeros = PerCpuValues::try_from(vec![KeyStats::default(); cpus])?;
        self.attachment.key_stats()?.set(id, zeros, 0)?;
        let zeros = PerCpuValues::try_from(vec![ShapeStats::default(); cpus])?;
        self.attachment.shape_stats()?.set(id, zeros, 0)?;
        self.buckets.set(id, Bucket::default(), 0)?;
        self.codel.set(id, CodelState::default(), 0)?;
        self.flow_census.set(id, FlowCensus::default(), 0)?;
        Ok(())
    }

    /// Takes a class whose entries could not all be written back to exactly the state
    /// before it.
    fn roll_back(
        &mut self,
        id: u32,
        spec: &ClassSpec,
        meta: &ClassMeta,
        shapes: &ShapeTable,
        parent: Option<u32>,
    ) {
        let _ = self.metas.set(id, ClassMeta::default(), 0);
        let _ = self.index.remove(&meta.name);
        let _ = self.configs.set(id, ClassConfig::default(), 0);
        let _ = write_shapes(self.attachment, &self.kernel_shapes, shapes);
        // Entries written before the failure were live for a moment.
        self.globals.rules_changed();
        let _ = self.attachment.set_globals(self.globals);
        if spec.action.action == Action::Shape && spec.action.arg != 0 {
            let _ = qdisc::delete_class(&self.attachment.location.queue_dev(), id);
            if let Some(parent) = parent {
                let _ = refresh_htb(self.attachment, &self.tree, parent, 0);
            }
        }
    }
}
