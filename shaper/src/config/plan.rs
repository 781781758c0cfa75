//! The plan: what differs between a parsed file and the pinned state, as steps (attach,
//! add, change in place, replace, delete, detach), touching only what differs.

use super::parse::{Desired, DesiredInterface};
use crate::{
    classes::{self, ClassSpec},
    netns,
    state::{self, AttachMode, Attachment, Direction, Location},
    units::{format_rate, format_size},
};
use anyhow::Result;
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
    /// Another attach mode: hooked the new way, then unhooked the old (classes, buckets
    /// and counters kept).
    SwitchMode {
        location: Location,
        from: AttachMode,
        to: AttachMode,
    },
    /// Another flow table size: a new table filled from the old, swapped in under
    /// traffic (classes, buckets and counters kept).
    Resize {
        location: Location,
        from: u32,
        to: u32,
    },
    /// Splitting aggregates on an ingress attachment turned on or off.
    Split {
        location: Location,
        on: bool,
    },
    Detach(Location),
    /// Pins of a namespace or interface that is gone.
    Forget(Location),
    Add(Location, ClassSpec),
    /// Rate, burst, action, CoDel or place only: bucket state and counters are kept.
    Change {
        location: Location,
        wanted: ClassSpec,
        what: String,
    },
    /// The rule, scope, priority or meter differs: delete and add again.
    Replace(Location, ClassSpec),
    /// The ifb of these ingress shape classes was deleted: made again, their queues put
    /// back on it (ids, buckets and counters kept).
    Requeue(Location, Vec<String>),
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
            Step::SwitchMode { location, from, to } => write!(
                f,
                "switch  {} {} -> {} (under traffic, classes kept)",
                location.describe(),
                from.name(),
                to.name()
            ),
            Step::Resize { location, from, to } => write!(
                f,
                "resize  {} flow table {from} -> {to} (under traffic, buckets kept)",
                location.describe()
            ),
            Step::Split { location, on } => write!(
                f,
                "split   {} aggregates {}",
                location.describe(),
                if *on { "on" } else { "off" }
            ),
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
                wanted,
                what,
            } => write!(
                f,
                "change  class {} on {}: {what}",
                wanted.name,
                location.describe()
            ),
            Step::Replace(location, spec) => write!(
                f,
                "replace class {} on {}: {} (rule, scope, prio or meter changed; counters restart)",
                spec.name,
                location.describe(),
                summary(spec)
            ),
            Step::Requeue(location, names) => write!(
                f,
                "requeue classes {} on {}: their ifb was deleted (made again; counters kept)",
                names.join(", "),
                location.describe()
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

fn parent_of(spec: &ClassSpec) -> Option<String> {
    spec.tree.as_ref().map(|tree| tree.parent.clone())
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
    detaches_last(&mut plan.steps);
    Ok(plan)
}

/// Detaches and forgotten pins run last: they cannot be undone, so they come only after
/// every step that can fail has succeeded, and a failing apply keeps every attachment it
/// found. The order is otherwise kept (no detached location is attached again in the
/// same plan).
fn detaches_last(steps: &mut Vec<Step>) {
    let (others, last): (Vec<Step>, Vec<Step>) = steps
        .drain(..)
        .partition(|step| !matches!(step, Step::Detach(_) | Step::Forget(_)));
    steps.extend(others);
    steps.extend(last);
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
        if !interface.directions.contains(&direction) {
            if location.dir().exists() {
                plan.steps.push(Step::Detach(location));
            }
            continue;
        }
        let current = attachment_steps(interface, &location, plan)?;
        class_steps(&location, &current, wanted, plan);
    }
    Ok(())
}

/// Attaches, re-attaches or attaches afresh where the interface needs it; the classes
/// the attachment keeps (none when it starts afresh).
fn attachment_steps(
    interface: &DesiredInterface,
    location: &Location,
    plan: &mut Plan,
) -> Result<Vec<ClassSpec>> {
    let attach = Step::Attach {
        location: location.clone(),
        flow_table_size: interface.flow_table_size,
        mode: interface.attach_mode,
    };
    let split = (location.direction == Direction::Ingress).then_some(interface.split_aggregates);
    let split_step = |on| Step::Split {
        location: location.clone(),
        on,
    };
    if !location.dir().exists() {
        plan.steps.push(attach);
        if split == Some(true) {
            plan.steps.push(split_step(true));
        }
        return Ok(Vec::new());
    }
    let attachment = Attachment::open(location)?;
    let status = attachment.status()?;
    if !status.live {
        plan.steps.push(Step::Reattach(location.clone()));
    }
    if let Some(to) = interface.attach_mode.filter(|&m| m != status.mode) {
        plan.steps.push(Step::SwitchMode {
            location: location.clone(),
            from: status.mode,
            to,
        });
    }
    if status.flow_table_size != interface.flow_table_size {
        plan.steps.push(Step::Resize {
            location: location.clone(),
            from: status.flow_table_size,
            to: interface.flow_table_size,
        });
    }
    // A stale split (its ifb deleted or made again) is made good by turning it on again.
    let splitting = classes::split_state(&attachment)?;
    let wrong = |on: bool| match on {
        true => !matches!(splitting, classes::Split::On(_)),
        false => splitting != classes::Split::Off,
    };
    if let Some(on) = split.filter(|&on| wrong(on)) {
        plan.steps.push(split_step(on));
    }
    // Ingress shape classes whose ifb was deleted are queued on it again.
    let stale = classes::stale_queues(&attachment)?;
    if !stale.is_empty() {
        let names = stale.into_iter().map(|(_, name)| name).collect();
        plan.steps.push(Step::Requeue(location.clone(), names));
    }
    Ok(classes::read_classes(&attachment)?
        .into_iter()
        .map(|view| view.spec)
        .collect())
}

/// The classes' steps on one attachment: children are deleted before their parents and
/// parents added before children; a parent whose children stay (moved elsewhere) is
/// deleted once they have moved.
fn class_steps(
    location: &Location,
    current: &[ClassSpec],
    mut wanted: Vec<&ClassSpec>,
    plan: &mut Plan,
) {
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
    sort_by_depth(&mut wanted);
    for spec in wanted {
        let step = match current.iter().find(|c| c.name == spec.name) {
            None => Step::Add(location.clone(), spec.clone()),
            Some(existing) if classes::same_class(existing, spec) => {
                plan.unchanged += 1;
                continue;
            }
            Some(existing) => match classes::Change::between(existing, spec) {
                Ok(change) => Step::Change {
                    location: location.clone(),
                    wanted: spec.clone(),
                    what: change.describe(existing),
                },
                Err(_) => Step::Replace(location.clone(), spec.clone()),
            },
        };
        plan.steps.push(step);
    }
    plan.steps.extend(after_moves);
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
        let change = classes::Change::between(&current, &faster).unwrap();
        assert_eq!(change.rate_bits_per_sec, Some(20_000_000));
        assert_eq!(change.describe(&current), "rate 10Mbit -> 20Mbit");
        let mut other_port = current.clone();
        other_port.rule.dport = PortRange { lo: 1, hi: 1 };
        assert!(classes::Change::between(&current, &other_port).is_err());
        assert!(classes::same_class(&current, &current.clone()));
    }

    #[test]
    fn a_shape_class_read_back_with_its_htb_leaf_is_the_file_s_class() {
        let file = "[[interface]]\ndev = \"planned0\"\n[[interface.class]]\nname = \"vm\"\nrate = \"10mbit\"\naction = \"shape\"\n";
        let desired = parse("shape.toml", file).unwrap();
        let wanted = desired.interfaces[0].classes[0].1.clone();
        let mut current = wanted.clone();
        // What `class add` stored: the class's bulk HTB leaf.
        current.action.arg = 0x1_0002;
        assert!(classes::same_class(&current, &wanted));
        let mut faster = wanted.clone();
        faster.rate_bits_per_sec *= 2;
        let change = classes::Change::between(&current, &faster).unwrap();
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

    fn location(dev: &str) -> Location {
        Location {
            netns: None,
            dev: dev.into(),
            direction: Direction::Egress,
        }
    }

    #[test]
    fn detaches_and_forgotten_pins_come_after_every_other_step() {
        let desired = parse("good.toml", GOOD).unwrap();
        let spec = desired.interfaces[0].classes[0].1.clone();
        let mut steps = vec![
            Step::Detach(location("a0")),
            Step::Add(location("b0"), spec.clone()),
            Step::Forget(location("c0")),
            Step::Delete(location("b0"), "old".into()),
            Step::Reattach(location("d0")),
        ];
        detaches_last(&mut steps);
        let order: Vec<String> = steps.iter().map(|s| s.to_string()).collect();
        assert!(
            order[0].starts_with("add     class voip on b0"),
            "{order:?}"
        );
        assert!(order[1].starts_with("delete  class old on b0"), "{order:?}");
        assert!(order[2].starts_with("reattach d0"), "{order:?}");
        assert!(order[3].starts_with("detach  a0"), "{order:?}");
        assert!(order[4].starts_with("forget  c0"), "{order:?}");
    }
}
