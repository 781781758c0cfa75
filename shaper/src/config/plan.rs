//! The plan: what differs between a parsed file and the pinned state, as steps (attach,
//! add, change in place, replace, delete, detach), touching only what differs.

use super::parse::{Desired, DesiredInterface};
use crate::{
    actions::ActionSpec,
    classes::{self, ClassSpec, Meter},
    netns,
    state::{self, AttachMode, Attachment, Direction, Location},
    units::{format_duration_ns, format_rate, format_size},
};
use anyhow::Result;
use shaper_common::Action;
use std::fmt;

/// One change the plan makes.
#[derive(Clone, Debug)]
pub enum Step {
    Attach {
        location: Location,
        flow_table_size: u32,
        mode: Option<AttachMode>,
    },
    /// The interface was re-created: hook the pinned program again, classes kept.
    Reattach(Location),
    Detach(Location),
    /// Pins of a namespace or interface that is gone.
    Forget(Location),
    Add(Location, ClassSpec),
    /// Rate, burst or action only: bucket state and counters are kept.
    Change {
        location: Location,
        name: String,
        change: classes::Change,
        what: String,
    },
    /// The rule, scope, priority or meter differs: delete and add again.
    Replace(Location, ClassSpec),
    Delete(Location, String),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Attach {
                location,
                flow_table_size,
                ..
            } => write!(
                f,
                "attach  {} (flow table {flow_table_size})",
                location.describe()
            ),
            Step::Reattach(location) => {
                write!(f, "reattach {} (interface re-created)", location.describe())
            }
            Step::Detach(location) => write!(f, "detach  {}", location.describe()),
            Step::Forget(location) => write!(f, "forget  {} (gone)", location.describe()),
            Step::Add(location, spec) => {
                write!(
                    f,
                    "add     class {} on {}: {}",
                    spec.name,
                    location.describe(),
                    summary(spec)
                )
            }
            Step::Change {
                location,
                name,
                what,
                ..
            } => write!(f, "change  class {name} on {}: {what}", location.describe()),
            Step::Replace(location, spec) => write!(
                f,
                "replace class {} on {}: {} (rule, scope, prio or meter changed; counters restart)",
                spec.name,
                location.describe(),
                summary(spec)
            ),
            Step::Delete(location, name) => {
                write!(f, "delete  class {name} on {}", location.describe())
            }
        }
    }
}

fn summary(spec: &ClassSpec) -> String {
    format!(
        "rate {} burst {} per {} action {}",
        format_rate(spec.rate_bits_per_sec),
        format_size(spec.burst_bytes),
        spec.scope.name(),
        spec.action
    )
}

/// Two specs are the same class when everything that reaches the kernel is equal
/// (the yellow action of a class without a meter is never used).
fn same_class(a: &ClassSpec, b: &ClassSpec) -> bool {
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

/// What differs, when only rate, burst and action differ.
fn in_place_change(current: &ClassSpec, wanted: &ClassSpec) -> Option<(classes::Change, String)> {
    let mut probe = wanted.clone();
    probe.rate_bits_per_sec = current.rate_bits_per_sec;
    probe.burst_bytes = current.burst_bytes;
    probe.action = current.action;
    probe.codel = current.codel;
    probe.tree = current.tree.clone();
    let shaping = |s: &ClassSpec| s.action.action == Action::Shape;
    if !same_class(&probe, current) || shaping(current) != shaping(wanted) {
        return None;
    }
    let change = classes::Change {
        rate_bits_per_sec: changed(current.rate_bits_per_sec, wanted.rate_bits_per_sec),
        burst_bytes: changed(current.burst_bytes, wanted.burst_bytes),
        action: (as_written(current.action) != as_written(wanted.action)).then_some(wanted.action),
        codel_target_ns: current
            .codel
            .zip(wanted.codel)
            .and_then(|(c, w)| changed(c.target_ns, w.target_ns)),
        codel_interval_ns: current
            .codel
            .zip(wanted.codel)
            .and_then(|(c, w)| changed(c.interval_ns, w.interval_ns)),
        codel_ecn: current
            .codel
            .zip(wanted.codel)
            .and_then(|(c, w)| (c.ecn != w.ecn).then_some(w.ecn)),
        parent: changed(parent_of(current), parent_of(wanted)),
        ceil_bits_per_sec: changed(ceil_of(current), ceil_of(wanted)),
        cburst_bytes: changed(cburst_of(current), cburst_of(wanted)),
    };
    let mut what = Vec::new();
    if let Some(rate) = change.rate_bits_per_sec {
        let before = format_rate(current.rate_bits_per_sec);
        what.push(format!("rate {before} -> {}", format_rate(rate)));
    }
    if let Some(burst) = change.burst_bytes {
        let before = format_size(current.burst_bytes);
        what.push(format!("burst {before} -> {}", format_size(burst)));
    }
    if let Some(action) = change.action {
        what.push(format!("action {} -> {action}", current.action));
    }
    if let (Some(before), Some(after)) = (current.codel, wanted.codel) {
        if before != after {
            let ecn = |on: bool| if on { "" } else { " noecn" };
            what.push(format!(
                "codel {}/{}{} -> {}/{}{}",
                format_duration_ns(before.target_ns),
                format_duration_ns(before.interval_ns),
                ecn(before.ecn),
                format_duration_ns(after.target_ns),
                format_duration_ns(after.interval_ns),
                ecn(after.ecn)
            ));
        }
    }
    if let Some(parent) = &change.parent {
        let name = |p: &Option<String>| p.clone().unwrap_or_else(|| "-".to_string());
        what.push(format!(
            "parent {} -> {}",
            name(&parent_of(current)),
            name(parent)
        ));
    }
    if let Some(ceil) = change.ceil_bits_per_sec {
        let text = |c: Option<u64>| c.map_or_else(|| "rate".to_string(), format_rate);
        what.push(format!("ceil {} -> {}", text(ceil_of(current)), text(ceil)));
    }
    if let Some(cburst) = change.cburst_bytes {
        let text = |c: Option<u64>| c.map_or_else(|| "burst".to_string(), format_size);
        what.push(format!(
            "cburst {} -> {}",
            text(cburst_of(current)),
            text(cburst)
        ));
    }
    Some((change, what.join(", ")))
}

fn changed<T: PartialEq>(before: T, after: T) -> Option<T> {
    (before != after).then_some(after)
}

fn parent_of(spec: &ClassSpec) -> Option<String> {
    spec.tree.as_ref().map(|tree| tree.parent.clone())
}

fn ceil_of(spec: &ClassSpec) -> Option<u64> {
    spec.tree.as_ref().and_then(|tree| tree.ceil_bits_per_sec)
}

fn cburst_of(spec: &ClassSpec) -> Option<u64> {
    spec.tree.as_ref().and_then(|tree| tree.cburst_bytes)
}

/// The plan, plus what could not be planned yet.
#[derive(Debug, Default)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Interfaces (or namespaces) of the file that do not exist now.
    pub missing: Vec<String>,
    /// Classes that already match.
    pub unchanged: usize,
}

/// Which attachments not named in the file to detach.
pub enum Prune<'a> {
    Nothing,
    /// Every attachment not in the file.
    All,
    /// Only these interfaces (netns, dev), e.g. the ones a daemon configured before.
    These(&'a [(Option<String>, String)]),
}

fn namespace_exists(netns: &Option<String>) -> bool {
    netns
        .as_ref()
        .is_none_or(|name| std::path::Path::new(&format!("/run/netns/{name}")).exists())
}

/// Compares the file with the pinned state. Interfaces that do not exist are listed in
/// `missing` (nothing is planned for them).
pub fn plan(desired: &Desired, prune: Prune) -> Result<Plan> {
    let mut plan = Plan::default();
    for interface in &desired.interfaces {
        if !namespace_exists(&interface.netns) {
            plan.missing.push(interface.describe());
            continue;
        }
        // One trip into the namespace: look the device up, then plan it.
        netns::in_namespace(&interface.netns, || {
            if netns::ifindex(&interface.dev).is_err() {
                plan.missing.push(interface.describe());
                return Ok(());
            }
            plan_interface(interface, &mut plan)
        })?;
    }
    let named: Vec<(Option<String>, String)> = desired
        .interfaces
        .iter()
        .map(|i| (i.netns.clone(), i.dev.clone()))
        .collect();
    for location in state::list_locations(None)? {
        let key = (location.netns.clone(), location.dev.clone());
        if named.contains(&key) {
            continue;
        }
        let pruned = match &prune {
            Prune::Nothing => false,
            Prune::All => true,
            Prune::These(list) => list.contains(&key),
        };
        if pruned {
            if namespace_exists(&location.netns) {
                plan.steps.push(Step::Detach(location));
            } else {
                plan.steps.push(Step::Forget(location));
            }
        }
    }
    Ok(plan)
}

fn plan_interface(interface: &DesiredInterface, plan: &mut Plan) -> Result<()> {
    for direction in Direction::BOTH {
        let location = Location {
            netns: interface.netns.clone(),
            dev: interface.dev.clone(),
            direction,
        };
        let wanted: Vec<&ClassSpec> = interface
            .classes
            .iter()
            .filter(|(d, _)| *d == direction)
            .map(|(_, spec)| spec)
            .collect();
        let attached = location.dir().exists();
        if !interface.directions.contains(&direction) {
            if attached {
                plan.steps.push(Step::Detach(location));
            }
            continue;
        }
        let mut current = Vec::new();
        if attached {
            let attachment = Attachment::open(&location)?;
            let status = attachment.status()?;
            let mode_differs = interface.attach_mode.is_some_and(|m| m != status.mode);
            if status.flow_table_size != interface.flow_table_size || mode_differs {
                // Map sizes and the hook are fixed at attach time: attach afresh.
                plan.steps.push(Step::Detach(location.clone()));
                plan.steps.push(Step::Attach {
                    location: location.clone(),
                    flow_table_size: interface.flow_table_size,
                    mode: interface.attach_mode,
                });
            } else {
                if !status.live {
                    plan.steps.push(Step::Reattach(location.clone()));
                }
                current = classes::read_classes(&attachment)?
                    .into_iter()
                    .map(|view| view.spec)
                    .collect();
            }
        } else {
            plan.steps.push(Step::Attach {
                location: location.clone(),
                flow_table_size: interface.flow_table_size,
                mode: interface.attach_mode,
            });
        }
        // Children are deleted before their parents, and parents added before children.
        // A parent whose children stay (moved elsewhere) is deleted once they have moved.
        let stays = |name: &str| wanted.iter().any(|w| w.name == name);
        let mut current_by_depth: Vec<&ClassSpec> = current.iter().collect();
        sort_by_depth(&mut current_by_depth);
        let (mut after_moves, mut deferred) = (Vec::new(), std::collections::HashSet::new());
        for spec in current_by_depth.into_iter().rev() {
            if stays(&spec.name) {
                continue;
            }
            // Children come first here, so a deferred child has deferred its parent too.
            let waits = current.iter().any(|child| {
                parent_of(child).as_deref() == Some(spec.name.as_str())
                    && (stays(&child.name) || deferred.contains(&child.name))
            });
            let delete = Step::Delete(location.clone(), spec.name.clone());
            if waits {
                deferred.insert(spec.name.clone());
                after_moves.push(delete);
            } else {
                plan.steps.push(delete);
            }
        }
        let mut wanted = wanted;
        sort_by_depth(&mut wanted);
        for spec in wanted {
            match current.iter().find(|c| c.name == spec.name) {
                None => plan.steps.push(Step::Add(location.clone(), spec.clone())),
                Some(existing) if same_class(existing, spec) => plan.unchanged += 1,
                Some(existing) => match in_place_change(existing, spec) {
                    Some((change, what)) => plan.steps.push(Step::Change {
                        location: location.clone(),
                        name: spec.name.clone(),
                        change,
                        what,
                    }),
                    None => plan
                        .steps
                        .push(Step::Replace(location.clone(), spec.clone())),
                },
            }
        }
        plan.steps.extend(after_moves);
    }
    Ok(())
}

/// Orders classes top-level first, then by their depth in the tree `specs` make (a
/// stable sort: the file's order within one depth). Linear in the classes: a file of
/// 10 000 is planned at once.
fn sort_by_depth(specs: &mut [&ClassSpec]) {
    let parents: std::collections::HashMap<&str, &str> = specs
        .iter()
        .filter_map(|s| {
            s.tree
                .as_ref()
                .map(|t| (s.name.as_str(), t.parent.as_str()))
        })
        .collect();
    let depth_of = |name: &str| {
        let (mut depth, mut at) = (0, name);
        while let Some(parent) = parents.get(at) {
            if depth > shaper_common::hierarchy::MAX_LEVELS {
                break;
            }
            depth += 1;
            at = parent;
        }
        depth
    };
    let depths: std::collections::HashMap<String, usize> = specs
        .iter()
        .map(|s| (s.name.clone(), depth_of(&s.name)))
        .collect();
    specs.sort_by_key(|spec| depths[&spec.name]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config::{parse, TEST_FILE as GOOD},
        rules::PortRange,
    };

    #[test]
    fn in_place_changes_are_told_apart_from_replacements() {
        let desired = parse("good.toml", GOOD).unwrap();
        let current = desired.interfaces[0].classes[0].1.clone();
        let mut faster = current.clone();
        faster.rate_bits_per_sec *= 2;
        let (change, what) = in_place_change(&current, &faster).unwrap();
        assert_eq!(change.rate_bits_per_sec, Some(20_000_000));
        assert_eq!(what, "rate 10Mbit -> 20Mbit");
        let mut other_port = current.clone();
        other_port.rule.dport = PortRange { lo: 1, hi: 1 };
        assert!(in_place_change(&current, &other_port).is_none());
        assert!(same_class(&current, &current.clone()));
    }

    #[test]
    fn a_shape_class_read_back_with_its_htb_leaf_is_the_file_s_class() {
        let file = "[[interface]]\ndev = \"planned0\"\n[[interface.class]]\nname = \"vm\"\nrate = \"10mbit\"\naction = \"shape\"\n";
        let desired = parse("shape.toml", file).unwrap();
        let wanted = desired.interfaces[0].classes[0].1.clone();
        let mut current = wanted.clone();
        // What `class add` stored: the class's bulk HTB leaf.
        current.action.arg = 0x1_0002;
        assert!(same_class(&current, &wanted));
        let mut faster = wanted.clone();
        faster.rate_bits_per_sec *= 2;
        let (change, _) = in_place_change(&current, &faster).unwrap();
        assert_eq!(change.action, None, "the leaf is not an action change");
    }

    #[test]
    fn parents_are_planned_before_their_children() {
        let file = r#"
[[interface]]
dev = "planned0"
[[interface.class]]
name = "leaf"
parent = "mid"
rate = "1mbit"
[[interface.class]]
name = "mid"
parent = "top"
rate = "2mbit"
[[interface.class]]
name = "other"
rate = "1mbit"
[[interface.class]]
name = "top"
rate = "5mbit"
"#;
        let desired = parse("tree.toml", file).unwrap();
        let mut specs: Vec<&ClassSpec> = desired.interfaces[0]
            .classes
            .iter()
            .map(|(_, spec)| spec)
            .collect();
        sort_by_depth(&mut specs);
        let order: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(order, ["other", "top", "mid", "leaf"]);
    }
}
