//! Declarative configuration: a TOML file describing interfaces and their classes, the
//! plan that makes the kernel match it (add / change / replace / delete, only what
//! differs), and the export of the current state in the same format.
//!
//! ```toml
//! [[interface]]
//! dev = "eth0"
//! netns = "blue"          # optional: a named network namespace (ip netns)
//! direction = "both"      # egress (default), ingress or both: where shaper attaches
//! flow_table_size = 65536 # optional, as attach --flow-table-size
//!
//! [[interface.class]]
//! name = "voip"
//! direction = "egress"    # default egress
//! rate = "10mbit"
//! proto = "udp"
//! dport = "5060-5080"
//! action = "dscp=ef"      # every `class add` option, spelled as the CLI spells it
//! ```
//!
//! A file is checked completely before anything changes: every problem comes back with
//! the file, line and field it is about. The file is authoritative for the interfaces it
//! names (classes not in it are deleted there); other interfaces are left alone unless
//! the caller prunes them.

use crate::{
    actions::ActionSpec,
    classes::{self, parse_scope, scope_name, ClassSpec, Meter},
    cli::{ClassAddArgs, SingleDirection},
    commands::spec_from_args,
    netns,
    rules::{parse_cidr, PortRange, Proto},
    state::{self, AttachMode, Attachment, Direction, Location},
    units::{parse_rate, parse_size},
};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use shaper_common::{Action, DEFAULT_FLOW_TABLE_SIZE};
use std::{collections::BTreeMap, fmt, ops::Range};
use toml::Spanned;

/// A TOML scalar given either as a string ("10mbit") or a number (53).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Scalar {
    Number(i64),
    Text(String),
}

impl Scalar {
    fn text(&self) -> String {
        match self {
            Scalar::Number(n) => n.to_string(),
            Scalar::Text(t) => t.clone(),
        }
    }
}

type Field<T> = Option<Spanned<T>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    interface: Vec<InterfaceEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InterfaceEntry {
    dev: Spanned<String>,
    netns: Field<String>,
    direction: Field<String>,
    flow_table_size: Field<i64>,
    attach_mode: Field<String>,
    #[serde(default)]
    class: Vec<ClassEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassEntry {
    name: Spanned<String>,
    direction: Field<String>,
    rate: Spanned<Scalar>,
    burst: Field<Scalar>,
    per: Field<String>,
    proto: Field<String>,
    src: Field<String>,
    dst: Field<String>,
    sport: Field<Scalar>,
    dport: Field<Scalar>,
    prio: Field<i64>,
    action: Field<String>,
    excess_burst: Field<Scalar>,
    peak_rate: Field<Scalar>,
    peak_burst: Field<Scalar>,
    exceed: Field<String>,
    violate: Field<String>,
}

/// One problem found in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: usize,
    pub field: String,
    pub message: String,
}

/// Every problem of a file, each printed as `FILE:LINE: FIELD: message`.
#[derive(Debug)]
pub struct Problems {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, problem) in self.problems.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{}:{}: {}: {}",
                self.file, problem.line, problem.field, problem.message
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for Problems {}

/// The state a file asks for on one interface.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredInterface {
    pub netns: Option<String>,
    pub dev: String,
    pub directions: Vec<Direction>,
    pub flow_table_size: u32,
    pub attach_mode: Option<AttachMode>,
    /// Classes per direction, in file order.
    pub classes: Vec<(Direction, ClassSpec)>,
}

impl DesiredInterface {
    pub fn describe(&self) -> String {
        match &self.netns {
            None => self.dev.clone(),
            Some(ns) => format!("{} (netns {ns})", self.dev),
        }
    }
}

/// A parsed, checked configuration.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Desired {
    pub interfaces: Vec<DesiredInterface>,
}

fn line_of(text: &str, span: Range<usize>) -> usize {
    text[..span.start.min(text.len())].matches('\n').count() + 1
}

fn direction_of(text: &str) -> Result<Vec<Direction>, String> {
    match text {
        "egress" => Ok(vec![Direction::Egress]),
        "ingress" => Ok(vec![Direction::Ingress]),
        "both" => Ok(Direction::BOTH.to_vec()),
        other => Err(format!(
            "unknown direction '{other}' (expected egress, ingress or both)"
        )),
    }
}

/// Parses and checks a whole file; `file` names it in the problems.
pub fn parse(file: &str, text: &str) -> Result<Desired, Problems> {
    let problems = |problems| Problems {
        file: file.to_string(),
        problems,
    };
    let config: FileConfig = toml::from_str(text).map_err(|error| {
        let line = error.span().map(|s| line_of(text, s)).unwrap_or(1);
        let message = error.message().trim().to_string();
        problems(vec![Problem {
            line,
            field: "toml".into(),
            message,
        }])
    })?;
    let mut found = Vec::new();
    let mut desired = Desired::default();
    let mut seen_interfaces: BTreeMap<(Option<String>, String), usize> = BTreeMap::new();
    for entry in &config.interface {
        let line = |span: Range<usize>| line_of(text, span);
        let mut report = |span: Range<usize>, field: &str, message: String| {
            found.push(Problem {
                line: line(span),
                field: field.to_string(),
                message,
            })
        };
        let dev = entry.dev.get_ref().clone();
        if dev.is_empty() || dev.len() > 15 || dev.contains(['/', ' ']) {
            report(
                entry.dev.span(),
                "dev",
                format!("'{dev}' is not an interface name"),
            );
        }
        let netns = entry.netns.as_ref().map(|n| n.get_ref().clone());
        if let Some(name) = &entry.netns {
            if name.get_ref().is_empty() || name.get_ref().contains('/') {
                report(
                    name.span(),
                    "netns",
                    format!("bad network namespace name '{}'", name.get_ref()),
                );
            }
        }
        let key = (netns.clone(), dev.clone());
        if let Some(first) = seen_interfaces.get(&key) {
            report(
                entry.dev.span(),
                "dev",
                format!("interface '{dev}' is already described at line {first}"),
            );
        } else {
            seen_interfaces.insert(key, line(entry.dev.span()));
        }
        let directions = match &entry.direction {
            None => vec![Direction::Egress],
            Some(d) => direction_of(d.get_ref()).unwrap_or_else(|message| {
                report(d.span(), "direction", message);
                vec![Direction::Egress]
            }),
        };
        let flow_table_size = match &entry.flow_table_size {
            None => DEFAULT_FLOW_TABLE_SIZE,
            Some(size) => match u32::try_from(*size.get_ref()) {
                Ok(value) if (1..=16_777_216).contains(&value) => value,
                _ => {
                    report(
                        size.span(),
                        "flow_table_size",
                        format!("{} is not in 1..=16777216", size.get_ref()),
                    );
                    DEFAULT_FLOW_TABLE_SIZE
                }
            },
        };
        let attach_mode = match &entry.attach_mode {
            None => None,
            Some(mode) => match mode.get_ref().as_str() {
                "tcx" => Some(AttachMode::Tcx),
                "clsact" => Some(AttachMode::Clsact),
                other => {
                    report(
                        mode.span(),
                        "attach_mode",
                        format!("unknown attach mode '{other}' (expected tcx or clsact)"),
                    );
                    None
                }
            },
        };
        let mut classes = Vec::new();
        let mut class_problems = Vec::new();
        let mut names: BTreeMap<(Direction, String), usize> = BTreeMap::new();
        for class in &entry.class {
            match class_spec(class, text) {
                Ok((direction, spec)) => {
                    if !directions.contains(&direction) {
                        let span = class
                            .direction
                            .as_ref()
                            .map(|d| d.span())
                            .unwrap_or(class.name.span());
                        report(
                            span,
                            "direction",
                            format!(
                                "class '{}' is on {} but interface {dev} attaches only {}",
                                spec.name,
                                direction.name(),
                                directions
                                    .iter()
                                    .map(|d| d.name())
                                    .collect::<Vec<_>>()
                                    .join(" and ")
                            ),
                        );
                    }
                    let key = (direction, spec.name.clone());
                    if let Some(first) = names.get(&key) {
                        report(
                            class.name.span(),
                            "name",
                            format!(
                                "class '{}' is already defined on {dev} {} at line {first}",
                                spec.name,
                                direction.name()
                            ),
                        );
                    } else {
                        names.insert(key, line(class.name.span()));
                    }
                    classes.push((direction, spec));
                }
                Err(mut problems) => class_problems.append(&mut problems),
            }
        }
        found.append(&mut class_problems);
        desired.interfaces.push(DesiredInterface {
            netns,
            dev,
            directions,
            flow_table_size,
            attach_mode,
            classes,
        });
    }
    if found.is_empty() {
        Ok(desired)
    } else {
        found.sort_by_key(|p| p.line);
        Err(problems(found))
    }
}

/// One class: each field checked on its own (so each problem has its line), then the
/// combination checked by the very code `class add` uses.
fn class_spec(entry: &ClassEntry, text: &str) -> Result<(Direction, ClassSpec), Vec<Problem>> {
    let mut problems = Vec::new();
    let mut check = |field: &str, span: Range<usize>, result: Result<(), String>| {
        if let Err(message) = result {
            problems.push(Problem {
                line: line_of(text, span),
                field: field.to_string(),
                message,
            });
        }
    };
    let string = |f: &Field<String>| f.as_ref().map(|s| s.get_ref().clone());
    let scalar = |f: &Field<Scalar>| f.as_ref().map(|s| s.get_ref().text());
    let ok = |_| ();
    check(
        "name",
        entry.name.span(),
        classes::check_name(entry.name.get_ref()).map_err(|e| format!("{e:#}")),
    );
    check(
        "rate",
        entry.rate.span(),
        parse_rate(&entry.rate.get_ref().text()).map(ok),
    );
    for (field, value) in [
        ("burst", &entry.burst),
        ("excess_burst", &entry.excess_burst),
        ("peak_burst", &entry.peak_burst),
    ] {
        if let Some(v) = value {
            check(field, v.span(), parse_size(&v.get_ref().text()).map(ok));
        }
    }
    if let Some(v) = &entry.peak_rate {
        check(
            "peak_rate",
            v.span(),
            parse_rate(&v.get_ref().text()).map(ok),
        );
    }
    if let Some(v) = &entry.per {
        check("per", v.span(), parse_scope(v.get_ref()).map(|_| ()));
    }
    if let Some(v) = &entry.proto {
        check("proto", v.span(), Proto::parse(v.get_ref()).map(|_| ()));
    }
    for (field, value) in [("src", &entry.src), ("dst", &entry.dst)] {
        if let Some(v) = value {
            check(field, v.span(), parse_cidr(v.get_ref()).map(|_| ()));
        }
    }
    for (field, value) in [("sport", &entry.sport), ("dport", &entry.dport)] {
        if let Some(v) = value {
            check(
                field,
                v.span(),
                PortRange::parse(&v.get_ref().text()).map(|_| ()),
            );
        }
    }
    for (field, value) in [
        ("action", &entry.action),
        ("exceed", &entry.exceed),
        ("violate", &entry.violate),
    ] {
        if let Some(v) = value {
            check(field, v.span(), ActionSpec::parse(v.get_ref()).map(|_| ()));
        }
    }
    let prio = match &entry.prio {
        None => 100,
        Some(p) => match u32::try_from(*p.get_ref()) {
            Ok(value) => value,
            Err(_) => {
                check(
                    "prio",
                    p.span(),
                    Err(format!("{} is not in 0..=4294967295", p.get_ref())),
                );
                0
            }
        },
    };
    let direction = match &entry.direction {
        None => SingleDirection::Egress,
        Some(d) => match d.get_ref().as_str() {
            "egress" => SingleDirection::Egress,
            "ingress" => SingleDirection::Ingress,
            other => {
                check(
                    "direction",
                    d.span(),
                    Err(format!(
                        "unknown direction '{other}' (expected egress or ingress)"
                    )),
                );
                SingleDirection::Egress
            }
        },
    };
    if !problems.is_empty() {
        return Err(problems);
    }
    let args = ClassAddArgs {
        name: entry.name.get_ref().clone(),
        dev: String::new(),
        direction,
        rate: entry.rate.get_ref().text(),
        burst: scalar(&entry.burst),
        per: string(&entry.per).unwrap_or_else(|| "class".into()),
        proto: string(&entry.proto).unwrap_or_else(|| "any".into()),
        src: string(&entry.src),
        dst: string(&entry.dst),
        sport: scalar(&entry.sport),
        dport: scalar(&entry.dport),
        prio,
        action: string(&entry.action),
        excess_burst: scalar(&entry.excess_burst),
        peak_rate: scalar(&entry.peak_rate),
        peak_burst: scalar(&entry.peak_burst),
        exceed: string(&entry.exceed),
        violate: string(&entry.violate),
    };
    let direction = match direction {
        SingleDirection::Egress => Direction::Egress,
        SingleDirection::Ingress => Direction::Ingress,
    };
    spec_from_args(&args)
        .map(|spec| (direction, spec))
        .map_err(|error| {
            vec![Problem {
                line: line_of(text, entry.name.span()),
                field: "class".into(),
                message: format!("{error:#}"),
            }]
        })
}

// ---------------------------------------------------------------------------------------
// plan

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
    use crate::units::{format_rate, format_size};
    format!(
        "rate {} burst {} per {} action {}",
        format_rate(spec.rate_bits_per_sec),
        format_size(spec.burst_bytes),
        scope_name(spec.scope),
        spec.action.display()
    )
}

/// Two specs are the same class when everything that reaches the kernel is equal
/// (the yellow action of a class without a meter is never used).
fn same_class(a: &ClassSpec, b: &ClassSpec) -> bool {
    let normal = |s: &ClassSpec| {
        let mut s = s.clone();
        if s.meter == Meter::None {
            s.exceed = ActionSpec {
                action: Action::Pass,
                arg: 0,
                mask: 0,
            };
        }
        s
    };
    normal(a) == normal(b)
}

/// What differs, when only rate, burst and action differ.
fn in_place_change(current: &ClassSpec, wanted: &ClassSpec) -> Option<(classes::Change, String)> {
    use crate::units::{format_rate, format_size};
    let mut probe = wanted.clone();
    probe.rate_bits_per_sec = current.rate_bits_per_sec;
    probe.burst_bytes = current.burst_bytes;
    probe.action = current.action;
    let shaping = |s: &ClassSpec| s.action.action == Action::Shape;
    if !same_class(&probe, current) || shaping(current) != shaping(wanted) {
        return None;
    }
    let mut what = Vec::new();
    let mut change = classes::Change::default();
    if current.rate_bits_per_sec != wanted.rate_bits_per_sec {
        change.rate_bits_per_sec = Some(wanted.rate_bits_per_sec);
        what.push(format!(
            "rate {} -> {}",
            format_rate(current.rate_bits_per_sec),
            format_rate(wanted.rate_bits_per_sec)
        ));
    }
    if current.burst_bytes != wanted.burst_bytes {
        change.burst_bytes = Some(wanted.burst_bytes);
        what.push(format!(
            "burst {} -> {}",
            format_size(current.burst_bytes),
            format_size(wanted.burst_bytes)
        ));
    }
    if current.action != wanted.action {
        change.action = Some(wanted.action);
        what.push(format!(
            "action {} -> {}",
            current.action.display(),
            wanted.action.display()
        ));
    }
    Some((change, what.join(", ")))
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
        for spec in &current {
            if !wanted.iter().any(|w| w.name == spec.name) {
                plan.steps
                    .push(Step::Delete(location.clone(), spec.name.clone()));
            }
        }
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
    }
    Ok(())
}

/// Carries out a plan, in order; each step inside its namespace. Consecutive adds to one
/// attachment go in one batch.
pub fn execute(plan: &Plan) -> Result<()> {
    let mut index = 0;
    while index < plan.steps.len() {
        let step = &plan.steps[index];
        let netns_of = |location: &Location| location.netns.clone();
        match step {
            Step::Add(location, _) => {
                let mut specs = Vec::new();
                while let Some(Step::Add(next, spec)) = plan.steps.get(index) {
                    if next != location {
                        break;
                    }
                    specs.push(spec.clone());
                    index += 1;
                }
                netns::in_namespace(&netns_of(location), || {
                    classes::add_many(&Attachment::open(location)?, &specs).map(|_| ())
                })?;
                continue;
            }
            Step::Attach {
                location,
                flow_table_size,
                mode,
            } => {
                netns::in_namespace(&netns_of(location), || {
                    state::attach_fresh(location, *mode, *flow_table_size).map(|_| ())
                })?;
            }
            Step::Reattach(location) => {
                netns::in_namespace(&netns_of(location), || {
                    state::reattach(location).map(|_| ())
                })?;
            }
            Step::Detach(location) => {
                netns::in_namespace(&netns_of(location), || state::detach(location))?;
            }
            Step::Forget(location) => state::forget(location)?,
            Step::Change {
                location,
                name,
                change,
                ..
            } => {
                netns::in_namespace(&netns_of(location), || {
                    classes::change(&Attachment::open(location)?, name, *change)
                })?;
            }
            Step::Replace(location, spec) => {
                netns::in_namespace(&netns_of(location), || {
                    let attachment = Attachment::open(location)?;
                    classes::delete(&attachment, &spec.name)?;
                    classes::add(&attachment, spec).map(|_| ())
                })?;
            }
            Step::Delete(location, name) => {
                netns::in_namespace(&netns_of(location), || {
                    classes::delete(&Attachment::open(location)?, name)
                })?;
            }
        }
        index += 1;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// export

#[derive(Serialize)]
struct ExportFile {
    interface: Vec<ExportInterface>,
}

#[derive(Serialize)]
struct ExportInterface {
    dev: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    netns: Option<String>,
    direction: String,
    flow_table_size: u32,
    attach_mode: String,
    class: Vec<ExportClass>,
}

#[derive(Serialize)]
struct ExportClass {
    name: String,
    direction: String,
    rate: String,
    burst: u64,
    per: String,
    prio: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    proto: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    src: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dst: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sport: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dport: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    action: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    excess_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_rate: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exceed: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    violate: Option<String>,
}

/// A rate in the shortest tc spelling that is exact.
pub fn exact_rate(bits: u64) -> String {
    for (unit, factor) in [
        ("gbit", 1_000_000_000),
        ("mbit", 1_000_000),
        ("kbit", 1_000),
    ] {
        if bits >= factor && bits.is_multiple_of(factor) {
            return format!("{}{unit}", bits / factor);
        }
    }
    format!("{bits}bit")
}

fn export_class(direction: Direction, spec: &ClassSpec) -> ExportClass {
    let rule = &spec.rule;
    let ports = |range: PortRange| (!range.is_any()).then(|| range.display());
    let metered = spec.meter != Meter::None;
    ExportClass {
        name: spec.name.clone(),
        direction: direction.name().into(),
        rate: exact_rate(spec.rate_bits_per_sec),
        burst: spec.burst_bytes,
        per: scope_name(spec.scope).into(),
        prio: spec.prio,
        proto: (rule.proto != Proto::Any).then(|| rule.proto.name().into()),
        src: rule.src.map(|n| n.to_string()),
        dst: rule.dst.map(|n| n.to_string()),
        sport: ports(rule.sport),
        dport: ports(rule.dport),
        action: (!metered).then(|| spec.action.display()),
        excess_burst: match spec.meter {
            Meter::SrTcm { excess_burst_bytes } => Some(excess_burst_bytes),
            _ => None,
        },
        peak_rate: match spec.meter {
            Meter::TrTcm {
                peak_rate_bits_per_sec,
                ..
            } => Some(exact_rate(peak_rate_bits_per_sec)),
            _ => None,
        },
        peak_burst: match spec.meter {
            Meter::TrTcm {
                peak_burst_bytes, ..
            } => Some(peak_burst_bytes),
            _ => None,
        },
        exceed: metered.then(|| spec.exceed.display()),
        violate: metered.then(|| spec.action.display()),
    }
}

/// The pinned state as a configuration file (optionally one namespace, one interface).
pub fn export(netns_filter: Option<&Option<String>>, dev: Option<&str>) -> Result<String> {
    let mut interfaces: Vec<ExportInterface> = Vec::new();
    for location in state::list_locations(netns_filter)? {
        if dev.is_some_and(|d| d != location.dev) {
            continue;
        }
        let attachment = Attachment::open(&location)?;
        let globals = attachment.globals()?;
        let flow_table_size = attachment.flow_table_size()?;
        let mode = AttachMode::from_globals(globals.attach_mode);
        let classes: Vec<ExportClass> = classes::read_classes(&attachment)?
            .iter()
            .map(|view| export_class(location.direction, &view.spec))
            .collect();
        match interfaces
            .iter_mut()
            .find(|i| i.dev == location.dev && i.netns == location.netns)
        {
            Some(existing) => {
                existing.direction = "both".into();
                existing.class.extend(classes);
            }
            None => interfaces.push(ExportInterface {
                dev: location.dev.clone(),
                netns: location.netns.clone(),
                direction: location.direction.name().into(),
                flow_table_size,
                attach_mode: mode.name().into(),
                class: classes,
            }),
        }
    }
    let mut text = String::from("# shaper configuration, written by `shaper export`\n\n");
    text.push_str(&toml::to_string(&ExportFile {
        interface: interfaces,
    })?);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[interface]]
dev = "eth0"
direction = "both"

[[interface.class]]
name = "voip"
rate = "10mbit"
proto = "udp"
dport = 5060
action = "dscp=ef"

[[interface.class]]
name = "in"
direction = "ingress"
rate = 1000000
per = "src"
"#;

    #[test]
    fn a_good_file_parses_with_cli_defaults() {
        let desired = parse("good.toml", GOOD).unwrap();
        let interface = &desired.interfaces[0];
        assert_eq!(interface.directions, Direction::BOTH.to_vec());
        assert_eq!(interface.flow_table_size, DEFAULT_FLOW_TABLE_SIZE);
        let (direction, voip) = &interface.classes[0];
        assert_eq!(*direction, Direction::Egress);
        assert_eq!(voip.rate_bits_per_sec, 10_000_000);
        assert_eq!(voip.burst_bytes, crate::units::default_burst(10_000_000));
        assert_eq!(voip.rule.dport, PortRange { lo: 5060, hi: 5060 });
        assert_eq!(voip.action.arg, 46);
        let (direction, inbound) = &interface.classes[1];
        assert_eq!(*direction, Direction::Ingress);
        assert_eq!(inbound.scope, shaper_common::Scope::Src);
    }

    #[test]
    fn every_problem_is_reported_with_line_and_field() {
        let bad = r#"
[[interface]]
dev = "eth0"

[[interface.class]]
name = "a"
rate = "10 parsecs"
dport = "70000"

[[interface.class]]
name = "a"
rate = "1mbit"
direction = "ingress"
src = "300.1.1.1/8"
"#;
        let problems = parse("bad.toml", bad).unwrap_err();
        let got: Vec<(usize, &str)> = problems
            .problems
            .iter()
            .map(|p| (p.line, p.field.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![(7, "rate"), (8, "dport"), (14, "src")],
            "{problems}"
        );
        assert!(problems.to_string().starts_with("bad.toml:7: rate: "));
    }

    #[test]
    fn cross_field_problems_and_duplicates_are_found() {
        let bad = r#"
[[interface]]
dev = "eth0"

[[interface.class]]
name = "a"
rate = "1mbit"
exceed = "pass"

[[interface.class]]
name = "b"
rate = "1mbit"
direction = "ingress"

[[interface.class]]
name = "b"
rate = "2mbit"

[[interface.class]]
name = "b"
rate = "3mbit"

[[interface]]
dev = "eth0"
"#;
        let problems = parse("bad.toml", bad).unwrap_err();
        let got: Vec<(usize, &str)> = problems
            .problems
            .iter()
            .map(|p| (p.line, p.field.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![(6, "class"), (13, "direction"), (20, "name"), (24, "dev")],
            "{problems}"
        );
    }

    #[test]
    fn syntax_and_unknown_fields_point_at_their_line() {
        let problems = parse("x.toml", "[[interface]]\ndev = \"e\"\nrat = 1\n").unwrap_err();
        assert_eq!(problems.problems[0].line, 3);
        assert!(problems.problems[0].message.contains("rat"), "{problems}");
        let problems = parse("x.toml", "[[interface]]\ndev = \n").unwrap_err();
        assert_eq!(problems.problems[0].line, 2);
    }

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
    fn the_example_in_contrib_parses() {
        let text = include_str!("../../contrib/shaper.toml");
        let desired = parse("contrib/shaper.toml", text).unwrap();
        assert_eq!(desired.interfaces.len(), 2);
        assert_eq!(desired.interfaces[0].classes.len(), 4);
    }

    #[test]
    fn exact_rates_round_trip() {
        for bits in [8, 1_000, 1_500, 10_000_000, 12_345_678, 400_000_000_000] {
            assert_eq!(parse_rate(&exact_rate(bits)).unwrap(), bits);
        }
    }
}
