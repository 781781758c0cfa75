//! The validator's checks across fields: the meter and the actions it takes, CoDel's
//! knobs, the class's place in a tree and a limit across hosts.

use super::{
    check::{Checker, Fields},
    ClassInput,
};
use crate::{
    actions::ActionSpec,
    classes::{default_floor, ClassSpec, Codel, Global, Meter, Tree},
    state::Direction,
    units::{default_burst, default_shape_burst, format_duration_ns},
};
use shaper_common::{Action, Scope};

impl ClassInput {
    /// The checks across fields: the meter, the actions it takes, shaping's limits, the
    /// rule's families and ports.
    pub(super) fn combine(&self, f: Fields, c: &mut Checker) -> Option<(Direction, ClassSpec)> {
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
                ("fair", f.fair.is_some()),
            ];
            if let Some((field, _)) = given.iter().find(|(_, given)| *given) {
                c.fail(
                    field,
                    "--target, --interval, --ecn and --fair tune the queue of --action shape; this class does not shape",
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
            fair: f.fair.unwrap_or(defaults.fair),
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
