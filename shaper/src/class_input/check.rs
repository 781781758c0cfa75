//! The one class validator: [`ClassInput::check`] turns a class as written into a
//! checked [`ClassSpec`] or the list of every problem, each tied to its field (a TOML
//! file maps the field back to its line).

use crate::{
    actions::ActionSpec,
    classes::{
        check_name, default_floor, parse_scope, ClassSpec, Codel, Global, Meter, OnLoss, Tree,
    },
    rules::{parse_cidr, PortRange, Proto, Rule},
    state::Direction,
    units::{
        default_burst, default_shape_burst, format_duration_ns, parse_duration_ns, parse_rate,
        parse_size, parse_switch,
    },
};
use shaper_common::{Action, Scope};
use std::str::FromStr as _;

use super::ClassInput;

/// One problem with one field (named as in the TOML file: `peak_rate`, `dport`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

/// The default priority: lower wins, as in tc.
pub(crate) const DEFAULT_PRIO: u32 = 100;

/// Collects field problems; a field's value is `None` once it failed.
#[derive(Default)]
struct Checker {
    errors: Vec<FieldError>,
}

impl Checker {
    fn field<T>(&mut self, field: &'static str, result: Result<T, String>) -> Option<T> {
        result
            .map_err(|message| self.errors.push(FieldError { field, message }))
            .ok()
    }

    /// An optional field: `Some(None)` when left out, `None` when it failed.
    fn optional<T>(
        &mut self,
        field: &'static str,
        text: &Option<String>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Option<Option<T>> {
        match text {
            None => Some(None),
            Some(text) => self.field(field, parse(text)).map(Some),
        }
    }

    /// A field that must be given.
    fn required<T>(
        &mut self,
        field: &'static str,
        text: &Option<String>,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Option<T> {
        match text {
            None => {
                self.fail(field, format!("a class needs a {field}"));
                None
            }
            Some(text) => self.field(field, parse(text)),
        }
    }

    fn fail(&mut self, field: &'static str, message: impl Into<String>) {
        self.errors.push(FieldError {
            field,
            message: message.into(),
        });
    }
}

/// Every field of a class, parsed on its own.
struct Fields {
    name: String,
    direction: Direction,
    rate: u64,
    burst: Option<u64>,
    scope: Scope,
    rule: Rule,
    prio: u32,
    action: Option<ActionSpec>,
    excess_burst: Option<u64>,
    peak_rate: Option<u64>,
    peak_burst: Option<u64>,
    exceed: Option<ActionSpec>,
    violate: Option<ActionSpec>,
    target: Option<u64>,
    interval: Option<u64>,
    ecn: Option<bool>,
    parent: Option<String>,
    ceil: Option<u64>,
    cburst: Option<u64>,
    global: Option<String>,
    on_loss: Option<OnLoss>,
    floor: Option<u64>,
}

impl ClassInput {
    /// Checks every field, then how they combine; the class and its direction, or every
    /// problem found.
    pub fn check(&self) -> Result<(Direction, ClassSpec), Vec<FieldError>> {
        let mut checker = Checker::default();
        let fields = self.fields(&mut checker);
        match fields {
            Some(fields) if checker.errors.is_empty() => {
                let spec = self.combine(fields, &mut checker);
                match spec {
                    Some(spec) if checker.errors.is_empty() => Ok(spec),
                    _ => Err(checker.errors),
                }
            }
            _ => Err(checker.errors),
        }
    }

    fn fields(&self, c: &mut Checker) -> Option<Fields> {
        let name = c.required("name", &self.name, |name| {
            check_name(name)
                .map(|_| name.to_string())
                .map_err(|e| format!("{e:#}"))
        });
        let direction = c.optional("direction", &self.direction, Direction::from_str);
        let rate = c.required("rate", &self.rate, parse_rate);
        let burst = c.optional("burst", &self.burst, parse_size);
        let scope = c.optional("per", &self.per, parse_scope);
        let proto = c.optional("proto", &self.proto, Proto::from_str);
        let src = c.optional("src", &self.src, parse_cidr);
        let dst = c.optional("dst", &self.dst, parse_cidr);
        let sport = c.optional("sport", &self.sport, PortRange::parse);
        let dport = c.optional("dport", &self.dport, PortRange::parse);
        let prio = c.optional("prio", &self.prio, parse_prio);
        let action = c.optional("action", &self.action, ActionSpec::from_str);
        let excess_burst = c.optional("excess_burst", &self.excess_burst, parse_size);
        let peak_rate = c.optional("peak_rate", &self.peak_rate, parse_rate);
        let peak_burst = c.optional("peak_burst", &self.peak_burst, parse_size);
        let exceed = c.optional("exceed", &self.exceed, ActionSpec::from_str);
        let violate = c.optional("violate", &self.violate, ActionSpec::from_str);
        let target = c.optional("target", &self.target, parse_duration_ns);
        let interval = c.optional("interval", &self.interval, parse_duration_ns);
        let ecn = c.optional("ecn", &self.ecn, parse_switch);
        let parent = c.optional("parent", &self.parent, |name| {
            check_name(name)
                .map(|_| name.to_string())
                .map_err(|e| format!("{e:#}"))
        });
        let ceil = c.optional("ceil", &self.ceil, parse_rate);
        let cburst = c.optional("cburst", &self.cburst, parse_size);
        let global = c.optional("global", &self.global, parse_global_key);
        let on_loss = c.optional(
            "on_coordinator_loss",
            &self.on_coordinator_loss,
            OnLoss::from_name,
        );
        let floor = c.optional("floor", &self.floor, parse_rate);
        Some(Fields {
            name: name?,
            direction: direction?.unwrap_or(Direction::Egress),
            rate: rate?,
            burst: burst?,
            scope: scope?.unwrap_or(Scope::Class),
            rule: Rule {
                src: src?,
                dst: dst?,
                proto: proto?.unwrap_or(Proto::Any),
                sport: sport?.unwrap_or(PortRange::ANY),
                dport: dport?.unwrap_or(PortRange::ANY),
            },
            prio: prio?.unwrap_or(DEFAULT_PRIO),
            action: action?,
            excess_burst: excess_burst?,
            peak_rate: peak_rate?,
            peak_burst: peak_burst?,
            exceed: exceed?,
            violate: violate?,
            target: target?,
            interval: interval?,
            ecn: ecn?,
            parent: parent?,
            ceil: ceil?,
            cburst: cburst?,
            global: global?,
            on_loss: on_loss?,
            floor: floor?,
        })
    }

    /// The checks across fields: the meter, the actions it takes, shaping's limits, the
    /// rule's families and ports.
    fn combine(&self, f: Fields, c: &mut Checker) -> Option<(Direction, ClassSpec)> {
        let meter = self.meter(&f, c)?;
        if meter == Meter::None && (f.exceed.is_some() || f.violate.is_some()) {
            let field = if f.exceed.is_some() {
                "exceed"
            } else {
                "violate"
            };
            c.fail(
                field,
                "--exceed and --violate need a meter: --excess-burst (srTCM) or --peak-rate (trTCM)",
            );
            return None;
        }
        if meter != Meter::None && f.action.is_some() {
            c.fail(
                "action",
                "a metered class takes --exceed (yellow) and --violate (red) instead of --action",
            );
            return None;
        }
        let action = f.action.or(f.violate).unwrap_or_default();
        let exceed = f.exceed.unwrap_or(ActionSpec::PASS);
        if meter != Meter::None
            && (action.action == Action::Shape || exceed.action == Action::Shape)
        {
            c.fail(
                "violate",
                "meters police or mark; shape is not a meter action",
            );
            return None;
        }
        if action.action == Action::Shape && f.direction == Direction::Ingress {
            c.fail(
                "action",
                "--action shape works on egress only: a packet arriving on ingress cannot be held back; police it (drop/ecn) or shape on the sender's egress",
            );
            return None;
        }
        if let Err((field, message)) = f.rule.validate() {
            c.fail(field, message);
            return None;
        }
        let burst = f.burst.unwrap_or(if action.action == Action::Shape {
            default_shape_burst(f.rate)
        } else {
            default_burst(f.rate)
        });
        let codel = self.codel(&f, action.action, c)?;
        let tree = self.tree(&f, action.action, meter, c)?;
        let global = self.global(&f, meter, c)?;
        let spec = ClassSpec {
            global,
            tree,
            codel,
            name: f.name.clone(),
            rule: f.rule,
            rate_bits_per_sec: f.rate,
            burst_bytes: burst,
            scope: f.scope,
            prio: f.prio,
            action,
            meter,
            exceed,
        };
        Some((f.direction, spec))
    }

    /// The class's place in a tree: `--ceil`/`--cburst` need `--parent`, a ceiling is at
    /// least the rate, and a per-key class's rate is per key (no ceiling of its own).
    fn tree(
        &self,
        f: &Fields,
        action: Action,
        meter: Meter,
        c: &mut Checker,
    ) -> Option<Option<Tree>> {
        let problem = tree_problem(
            &f.name,
            f.parent.as_deref(),
            (f.ceil, f.cburst),
            f.rate,
            f.scope,
            action,
            meter,
        );
        if let Some((field, message)) = problem {
            c.fail(field, message);
            return None;
        }
        let Some(parent) = f.parent.clone() else {
            return Some(None);
        };
        Some(Some(Tree {
            parent,
            ceil_bits_per_sec: f.ceil,
            cburst_bytes: f.cburst,
        }))
    }

    /// A limit across hosts: a top-level class-wide bucket (each host's share is one
    /// rate), a floor below the limit, the loss mode and floor only with a key.
    fn global(&self, f: &Fields, meter: Meter, c: &mut Checker) -> Option<Option<Global>> {
        let Some(key) = f.global.clone() else {
            let given = [
                ("on_coordinator_loss", f.on_loss.is_some()),
                ("floor", f.floor.is_some()),
            ];
            if let Some((field, _)) = given.iter().find(|(_, given)| *given) {
                c.fail(
                    field,
                    "on_coordinator_loss and floor tune a global class: set global = \"KEY\" too",
                );
                return None;
            }
            return Some(None);
        };
        let problem = if f.parent.is_some() {
            Some(("parent", GLOBAL_IN_A_TREE))
        } else if meter != Meter::None {
            Some((
                "global",
                "a global class polices, marks or shapes at one rate; meters are per host so far",
            ))
        } else if f.scope != Scope::Class {
            Some((
                "per",
                "a global class's limit is for the class as a whole: --per is per host",
            ))
        } else {
            None
        };
        if let Some((field, message)) = problem {
            c.fail(field, message);
            return None;
        }
        let floor = f.floor.unwrap_or_else(|| default_floor(f.rate));
        if floor >= f.rate {
            c.fail(
                "floor",
                format!(
                    "floor {} is not below the limit {}",
                    crate::units::format_rate(floor),
                    crate::units::format_rate(f.rate)
                ),
            );
            return None;
        }
        Some(Some(Global {
            key,
            on_loss: f.on_loss.unwrap_or_default(),
            floor_bits_per_sec: floor,
        }))
    }

    /// CoDel's knobs: shape classes only, defaults where left out, target below interval.
    fn codel(&self, f: &Fields, action: Action, c: &mut Checker) -> Option<Option<Codel>> {
        if action != Action::Shape {
            let given = [
                ("target", f.target.is_some()),
                ("interval", f.interval.is_some()),
                ("ecn", f.ecn.is_some()),
            ];
            if let Some((field, _)) = given.iter().find(|(_, given)| *given) {
                c.fail(
                    field,
                    "--target, --interval and --ecn tune CoDel on --action shape; this class does not shape",
                );
                return None;
            }
            return Some(None);
        }
        let defaults = Codel::default();
        let codel = Codel {
            target_ns: f.target.unwrap_or(defaults.target_ns),
            interval_ns: f.interval.unwrap_or(defaults.interval_ns),
            ecn: f.ecn.unwrap_or(defaults.ecn),
        };
        if codel.target_ns >= codel.interval_ns {
            c.fail(
                "target",
                format!(
                    "--target {} must be below --interval {}",
                    format_duration_ns(codel.target_ns),
                    format_duration_ns(codel.interval_ns)
                ),
            );
            return None;
        }
        Some(Some(codel))
    }

    /// `excess_burst` makes an RFC 2697 srTCM, `peak_rate [peak_burst]` an RFC 2698 trTCM.
    fn meter(&self, f: &Fields, c: &mut Checker) -> Option<Meter> {
        match (f.excess_burst, f.peak_rate, f.peak_burst) {
            (None, None, None) => Some(Meter::None),
            (Some(_), Some(_), _) | (Some(_), _, Some(_)) => {
                c.fail(
                    "excess_burst",
                    "--excess-burst (srTCM) and --peak-rate/--peak-burst (trTCM) exclude each other",
                );
                None
            }
            (Some(excess_burst_bytes), None, None) => Some(Meter::SrTcm { excess_burst_bytes }),
            (None, None, Some(_)) => {
                c.fail("peak_burst", "--peak-burst needs --peak-rate");
                None
            }
            (None, Some(peak_rate_bits_per_sec), peak_burst) => {
                if peak_rate_bits_per_sec < f.rate {
                    c.fail(
                        "peak_rate",
                        format!(
                            "--peak-rate {} is below --rate {} (RFC 2698 needs PIR >= CIR)",
                            self.peak_rate.as_deref().unwrap_or_default(),
                            self.rate.as_deref().unwrap_or_default()
                        ),
                    );
                    return None;
                }
                Some(Meter::TrTcm {
                    peak_rate_bits_per_sec,
                    peak_burst_bytes: peak_burst
                        .unwrap_or_else(|| default_burst(peak_rate_bits_per_sec)),
                })
            }
        }
    }
}

/// A global key: what every host writes for the same limit; letters, digits and `-_.:`,
/// at most `GLOBAL_KEY_LEN` bytes.
fn parse_global_key(text: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
    if text.is_empty() || text.len() > shaper_common::GLOBAL_KEY_LEN || !text.chars().all(allowed) {
        return Err(format!(
            "bad global key '{text}' (1 to {} letters, digits, '-', '_', '.' or ':')",
            shaper_common::GLOBAL_KEY_LEN
        ));
    }
    Ok(text.to_string())
}

/// A global class has no parent (`class add` and `class change` alike): at its share's
/// expiry a ceiling above it would admit everything.
pub(crate) const GLOBAL_IN_A_TREE: &str =
    "a global class is a top-level class so far (its share is one rate on this host)";

/// The first rule a class's place in a tree breaks, as (field, message), for `class add`
/// and `class change` alike: `--ceil`/`--cburst` need a parent, a class is not its own
/// parent, meters stay top-level, a shape class in a tree is class-wide, a per-key class
/// has no ceiling of its own, and a ceiling is at least the rate.
fn tree_problem(
    name: &str,
    parent: Option<&str>,
    (ceil, cburst): (Option<u64>, Option<u64>),
    rate: u64,
    scope: Scope,
    action: Action,
    meter: Meter,
) -> Option<(&'static str, String)> {
    let problem = |field, message: &str| Some((field, message.to_string()));
    let Some(parent) = parent else {
        if ceil.is_some() || cburst.is_some() {
            let field = if ceil.is_some() { "ceil" } else { "cburst" };
            return problem(
                field,
                "--ceil and --cburst need --parent: a class without a parent has nothing to borrow from",
            );
        }
        return None;
    };
    if parent == name {
        return problem("parent", "a class cannot be its own parent");
    }
    if meter != Meter::None {
        return problem(
            "parent",
            "--parent works with the plain actions (drop, ecn, dscp, fwmark, pass, shape) so far; meters stay top-level classes",
        );
    }
    if action == Action::Shape && scope != Scope::Class {
        return problem(
            "per",
            "a shape class in a tree is one htb class: --per is for policing and marking children",
        );
    }
    if scope != Scope::Class && (ceil.is_some() || cburst.is_some()) {
        return problem(
            "ceil",
            "a --per class's --rate is each key's limit and its parent's the aggregate; --ceil and --cburst are for class-wide buckets",
        );
    }
    match ceil {
        Some(ceil) if ceil < rate => Some((
            "ceil",
            format!(
                "--ceil {} is below --rate {}: the ceiling is what a class may borrow up to",
                crate::units::format_rate(ceil),
                crate::units::format_rate(rate)
            ),
        )),
        _ => None,
    }
}

fn parse_prio(text: &str) -> Result<u32, String> {
    text.parse()
        .map_err(|_| format!("{text} is not in 0..=4294967295"))
}

#[cfg(test)]
mod tests {
    //! The validator is pure: its checks run on the host, without root.
    use super::*;

    fn input(name: &str, rate: &str) -> ClassInput {
        ClassInput {
            name: Some(name.into()),
            rate: Some(rate.into()),
            ..ClassInput::default()
        }
    }

    fn fields_of(result: Result<(Direction, ClassSpec), Vec<FieldError>>) -> Vec<&'static str> {
        result.unwrap_err().iter().map(|e| e.field).collect()
    }

    #[test]
    fn defaults_are_the_command_lines() {
        let (direction, spec) = input("web", "10mbit").check().unwrap();
        assert_eq!(direction, Direction::Egress);
        assert_eq!(spec.burst_bytes, default_burst(10_000_000));
        assert_eq!((spec.prio, spec.scope), (DEFAULT_PRIO, Scope::Class));
        assert_eq!(spec.action, ActionSpec::default());
        assert_eq!(spec.exceed.action, Action::Pass);
        let shaped = ClassInput {
            action: Some("shape".into()),
            ..input("s", "10mbit")
        };
        assert_eq!(
            shaped.check().unwrap().1.burst_bytes,
            default_shape_burst(10_000_000)
        );
    }

    #[test]
    fn every_bad_field_is_reported_not_just_the_first() {
        let bad = ClassInput {
            direction: Some("up".into()),
            burst: Some("12q".into()),
            dport: Some("70000".into()),
            prio: Some("-1".into()),
            exceed: Some("explode".into()),
            ..input("bad/name", "fast")
        };
        assert_eq!(
            fields_of(bad.check()),
            [
                "name",
                "direction",
                "rate",
                "burst",
                "dport",
                "prio",
                "exceed"
            ]
        );
    }

    #[test]
    fn combinations_are_checked_once_the_fields_are_good() {
        let cases: [(ClassInput, &str); 7] = [
            (
                ClassInput {
                    exceed: Some("pass".into()),
                    ..input("a", "1mbit")
                },
                "exceed",
            ),
            (
                ClassInput {
                    excess_burst: Some("64k".into()),
                    action: Some("ecn".into()),
                    ..input("a", "1mbit")
                },
                "action",
            ),
            (
                ClassInput {
                    excess_burst: Some("64k".into()),
                    peak_rate: Some("2mbit".into()),
                    ..input("a", "1mbit")
                },
                "excess_burst",
            ),
            (
                ClassInput {
                    peak_rate: Some("1mbit".into()),
                    ..input("a", "2mbit")
                },
                "peak_rate",
            ),
            (
                ClassInput {
                    peak_burst: Some("64k".into()),
                    ..input("a", "1mbit")
                },
                "peak_burst",
            ),
            (
                ClassInput {
                    direction: Some("ingress".into()),
                    action: Some("shape".into()),
                    ..input("a", "1mbit")
                },
                "action",
            ),
            (
                ClassInput {
                    dport: Some("53".into()),
                    ..input("a", "1mbit")
                },
                "proto",
            ),
        ];
        for (class, field) in cases {
            assert_eq!(fields_of(class.check()), [field], "{class:?}");
        }
    }

    #[test]
    fn a_trtcm_gets_its_peak_burst_by_default() {
        let (_, spec) = ClassInput {
            peak_rate: Some("20mbit".into()),
            exceed: Some("dscp=af12".into()),
            ..input("m", "10mbit")
        }
        .check()
        .unwrap();
        assert_eq!(
            spec.meter,
            Meter::TrTcm {
                peak_rate_bits_per_sec: 20_000_000,
                peak_burst_bytes: default_burst(20_000_000)
            }
        );
        assert_eq!(spec.action.action, Action::Drop);
    }
}
