//! The one class validator: [`ClassInput::check`] turns a class as written into a
//! checked [`ClassSpec`] or the list of every problem, each tied to its field (a TOML
//! file maps the field back to its line).

use crate::{
    actions::ActionSpec,
    classes::{check_name, parse_scope, ClassSpec, Fair, OnLoss},
    rules::{parse_cidr, PortRange, Proto, Rule},
    state::Direction,
    units::{parse_duration_ns, parse_rate, parse_size, parse_switch},
};
use shaper_common::Scope;
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
pub(super) struct Checker {
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

    pub(super) fn fail(&mut self, field: &'static str, message: impl Into<String>) {
        self.errors.push(FieldError {
            field,
            message: message.into(),
        });
    }
}

/// Every field of a class, parsed on its own.
pub(super) struct Fields {
    pub(super) name: String,
    pub(super) direction: Direction,
    pub(super) rate: u64,
    pub(super) burst: Option<u64>,
    pub(super) scope: Scope,
    pub(super) rule: Rule,
    pub(super) prio: u32,
    pub(super) action: Option<ActionSpec>,
    pub(super) excess_burst: Option<u64>,
    pub(super) peak_rate: Option<u64>,
    pub(super) peak_burst: Option<u64>,
    pub(super) exceed: Option<ActionSpec>,
    pub(super) violate: Option<ActionSpec>,
    pub(super) target: Option<u64>,
    pub(super) interval: Option<u64>,
    pub(super) ecn: Option<bool>,
    pub(super) fair: Option<Fair>,
    pub(super) parent: Option<String>,
    pub(super) ceil: Option<u64>,
    pub(super) cburst: Option<u64>,
    pub(super) global: Option<String>,
    pub(super) on_loss: Option<OnLoss>,
    pub(super) floor: Option<u64>,
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
        let fair = c.optional("fair", &self.fair, Fair::from_name);
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
            fair: fair?,
            parent: parent?,
            ceil: ceil?,
            cburst: cburst?,
            global: global?,
            on_loss: on_loss?,
            floor: floor?,
        })
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

fn parse_prio(text: &str) -> Result<u32, String> {
    text.parse()
        .map_err(|_| format!("{text} is not in 0..=4294967295"))
}

#[cfg(test)]
mod tests {
    //! The validator is pure: its checks run on the host, without root.
    use super::*;
    use crate::{
        classes::Meter,
        units::{default_burst, default_shape_burst},
    };
    use shaper_common::Action;

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
    fn a_shape_class_is_fair_by_flow_unless_told_and_reads_back_as_written() {
        let shaped = |fair: Option<&str>| ClassInput {
            action: Some("shape".into()),
            fair: fair.map(str::to_string),
            ..input("s", "10mbit")
        };
        for (given, wanted, written) in [
            (None, Fair::Flow, None),
            (Some("none"), Fair::None, Some("none")),
            (Some("flow"), Fair::Flow, None),
            (Some("src"), Fair::Src, Some("src")),
            (Some("dst"), Fair::Dst, Some("dst")),
        ] {
            let (direction, spec) = shaped(given).check().unwrap();
            assert_eq!(spec.codel.map(|c| c.fair), Some(wanted), "{given:?}");
            // What `export` writes: the default left out, and it reads back the same.
            let exported = ClassInput::from_spec(direction, &spec);
            assert_eq!(exported.fair.as_deref(), written, "{given:?}");
            assert_eq!(exported.check().unwrap().1, spec);
        }
        assert_eq!(fields_of(shaped(Some("host")).check()), ["fair"]);
        let policed = ClassInput {
            fair: Some("flow".into()),
            ..input("p", "10mbit")
        };
        assert_eq!(fields_of(policed.check()), ["fair"]);
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
        let cases: [(ClassInput, &str); 6] = [
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
    fn shape_is_accepted_on_ingress_where_an_ifb_queues() {
        let (direction, spec) = ClassInput {
            direction: Some("ingress".into()),
            action: Some("shape".into()),
            ..input("a", "1mbit")
        }
        .check()
        .unwrap();
        assert_eq!(direction, Direction::Ingress);
        assert_eq!(spec.action.action, Action::Shape);
        assert!(spec.codel.is_some(), "CoDel judges its queue as on egress");
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
