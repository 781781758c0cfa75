//! The classes' tree as the table's checks see it: each class's name, parent and the
//! rate it is guaranteed; placing a class in it, keeping its guarantees, the classifier
//! ranks that follow a class's depth, and the HTB classes of a shape tree.

use super::{shapes::*, *};
use crate::{
    error::runtime,
    qdisc,
    state::{decode_name, Attachment},
};
use aya::maps::{Array, MapData};
use shaper_common::{hierarchy::MAX_LEVELS, Action, ClassConfig, ClassMeta};
use std::collections::BTreeMap;

/// The classes' tree as far as checks need it: each class's name, parent and the rate it
/// is guaranteed (0 for a per-key class, whose rate is per key).
#[derive(Default)]
pub(super) struct TreeView {
    pub(super) classes: BTreeMap<u32, TreeNode>,
    /// Indexes, so a batch of ten thousand children is placed in linear time.
    by_name: std::collections::HashMap<String, u32>,
    children_of: std::collections::HashMap<u32, Vec<u32>>,
}

pub(super) struct TreeNode {
    pub(super) name: String,
    pub(super) parent: Option<u32>,
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
    pub(super) fn read(attachment: &Attachment, list: &[(u32, ClassMeta)]) -> Result<Self> {
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

    pub(super) fn insert(&mut self, id: u32, spec: &ClassSpec, parent: Option<u32>) {
        self.put(id, TreeNode::of_spec(spec, parent));
    }

    fn put(&mut self, id: u32, node: TreeNode) {
        self.by_name.insert(node.name.clone(), id);
        if let Some(parent) = node.parent {
            self.children_of.entry(parent).or_default().push(id);
        }
        self.classes.insert(id, node);
    }

    pub(super) fn children(&self, id: u32) -> impl Iterator<Item = (&u32, &TreeNode)> {
        self.children_of
            .get(&id)
            .into_iter()
            .flatten()
            .filter_map(|child| self.classes.get_key_value(child))
    }

    /// The parent's id for `spec` (`moving`: the class's own id when it is already in the
    /// tree), checked: the parent exists here and can lend, the tree stays within
    /// `MAX_LEVELS` levels, and its children's guaranteed rates fit its rate.
    pub(super) fn place(
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
        parent.can_parent(&tree.parent, spec)?;
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
    pub(super) fn depth_of(&self, parent: Option<u32>) -> usize {
        let (mut depth, mut above) = (0, parent);
        while let Some(id) = above {
            depth += 1;
            above = self.classes.get(&id).and_then(|node| node.parent);
        }
        depth
    }

    /// The parent of class `id` (`None`: top level or not in the tree).
    pub(super) fn parent_of(&self, id: u32) -> Option<u32> {
        self.classes.get(&id).and_then(|node| node.parent)
    }

    /// The name of class `id` (empty when not in the tree).
    pub(super) fn name_of(&self, id: u32) -> &str {
        self.classes.get(&id).map_or("", |node| node.name.as_str())
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

    pub(super) fn of_spec(spec: &ClassSpec, parent: Option<u32>) -> Self {
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

    /// Whether this class, `parent_name`, can be `spec`'s parent: meters and global
    /// classes stay leaves, and a shape tree is an htb tree, shaping throughout.
    fn can_parent(&self, parent_name: &str, spec: &ClassSpec) -> Result<()> {
        if self.metered {
            return Err(runtime(format!(
                "class '{}' cannot be a parent: meters stay leaves so far",
                parent_name
            )));
        }
        if self.global {
            return Err(runtime(format!(
                "class '{}' cannot be a parent: a global class's share is one rate on this host, a leaf so far",
                parent_name
            )));
        }
        let shapes = spec.action.action == Action::Shape;
        if self.shapes != shapes {
            let (what, other) = if shapes {
                ("shapes", "polices or marks")
            } else {
                ("polices or marks", "shapes")
            };
            return Err(runtime(format!(
                "class '{}' {what} and its parent '{}' {other}: a shape tree is an htb tree, shaping throughout",
                spec.name, parent_name
            )));
        }
        Ok(())
    }

    /// The rate the class is guaranteed within its parent.
    pub(super) fn guaranteed(&self) -> u64 {
        if self.per_key {
            0
        } else {
            self.rate
        }
    }
}

/// What the children of `id` are guaranteed in all.
pub(super) fn children_rate(tree: &TreeView, id: u32) -> u64 {
    tree.children(id).map(|(_, node)| node.guaranteed()).sum()
}

/// Every class with its spec and its classifier rank (prio, depth in the tree, age).
pub(super) fn ranked(
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
pub(super) fn rerank(attachment: &Attachment) -> Result<()> {
    let all = attachment.class_list()?;
    let tree = TreeView::read(attachment, &all)?;
    let configs = attachment.classes()?;
    let classes = ranked(&all, &tree, &configs)?;
    let mut shapes = ShapeTable::read(attachment)?;
    let wanted = remaining_without(&classes, |_| false, &mut shapes)?.wanted;
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
pub(super) fn refresh_htb(
    attachment: &Attachment,
    tree: &TreeView,
    id: u32,
    joining: u64,
) -> Result<()> {
    let config = attachment.classes()?.get(&id, 0)?;
    if config.action != Action::Shape as u8 || config.action_arg == 0 {
        return Ok(());
    }
    let meta = attachment.meta()?.get(&id, 0)?;
    let parent = tree.classes.get(&id).and_then(|node| node.parent);
    let spec = ClassSpec::from_meta(&meta, &config);
    let htb = spec.htb_class(parent, children_rate(tree, id) + joining);
    qdisc::set_class(&attachment.location.queue_dev(), id, &htb, false)
}

/// A change keeps the tree's guarantees: a class's rate within what its parent has left
/// beside its siblings (checked where `spec.tree` places it: its parent, or a new one),
/// a parent's rate at least its children's. The parent's id.
pub(super) fn check_guarantees(
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

impl ClassSpec {
    /// The HTB class of a shape class under `parent`, whose children are guaranteed
    /// `children_rate` in all.
    pub(super) fn htb_class(&self, parent: Option<u32>, children_rate: u64) -> qdisc::HtbClass {
        let (ceil, cburst) = self.drain();
        let codel = self.codel.unwrap_or_default();
        qdisc::HtbClass {
            parent,
            rate_bits_per_sec: self.rate_bits_per_sec,
            burst_bytes: self.burst_bytes,
            ceil_bits_per_sec: ceil,
            cburst_bytes: cburst,
            own_rate_bits_per_sec: self.rate_bits_per_sec.saturating_sub(children_rate),
            leaf_limit_bytes: codel.leaf_limit_bytes(ceil),
        }
    }
}
