//! The one declaration of a class's fields. The TOML schema (`config`), the command line's
//! `class add` and `class change` options (shaper-cli builds them from [`FIELDS`]), the
//! CNI plugin's classes and `export` all follow from it: adding a field is one line here
//! plus its check in `check.rs`.

use crate::{
    classes::{ClassSpec, Fair, Meter},
    rules::{PortRange, Proto},
    state::Direction,
    units::{exact_rate, format_duration_ns, parse_switch},
};
use serde::ser::{Serialize, SerializeMap, Serializer};

/// How a field is written in a file: text, a number where the text is one, or a boolean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Text,
    Number,
    Switch,
}

/// One class field as every front end shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldInfo {
    /// The TOML key; `--name-with-dashes` on the command line.
    pub name: &'static str,
    pub kind: Kind,
    /// The placeholder in `--help` (`RATE`, `SIZE`, `on|off`).
    pub value_name: &'static str,
    /// The one-line help (the doc comment of the field).
    pub help: &'static str,
    /// The command line's default (`class add` only; the validator defaults the same).
    pub default: Option<&'static str>,
    /// `class add` cannot do without it.
    pub required: bool,
    /// `class change` can change it on a live class.
    pub in_place: bool,
}

impl FieldInfo {
    const fn new(
        name: &'static str,
        kind: Kind,
        value_name: &'static str,
        help: &'static str,
    ) -> Self {
        Self {
            name,
            kind,
            value_name,
            help,
            default: None,
            required: false,
            in_place: false,
        }
    }

    const fn required(self) -> Self {
        Self {
            required: true,
            ..self
        }
    }

    const fn in_place(self) -> Self {
        Self {
            in_place: true,
            ..self
        }
    }

    const fn default(self, value: &'static str) -> Self {
        Self {
            default: Some(value),
            ..self
        }
    }

    /// The help text with the doc comment's line breaks and indents folded and, as clap
    /// shows its other one-line helps, no final full stop.
    pub fn help_line(&self) -> String {
        let line = self.help.split_whitespace().collect::<Vec<_>>().join(" ");
        line.strip_suffix('.').map_or(line.clone(), str::to_string)
    }
}

/// Declares [`ClassInput`] (every field as text, `None` where left out), [`FIELDS`] and
/// access by name; each field is `name: Kind = "VALUE_NAME"` and its flags
/// (`required`, `in_place`, `default("...")`).
macro_rules! class_fields {
    ($( $(#[doc = $doc:literal])+ $field:ident : $kind:ident = $value:literal $(, $flag:ident $(($arg:literal))?)* ;)*) => {
        /// A class as written: every option's text, `None` where left out.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct ClassInput {
            $( $(#[doc = $doc])+ pub $field: Option<String>, )*
        }

        /// Every class field, in the order files and `--help` show them.
        pub const FIELDS: &[FieldInfo] = &[
            $( FieldInfo::new(stringify!($field), Kind::$kind, $value, concat!($($doc),+))
                $(.$flag($($arg)?))* , )*
        ];

        impl ClassInput {
            /// A field's text by its name (`None` for a name that is no field).
            pub fn get(&self, name: &str) -> Option<&Option<String>> {
                match name {
                    $( stringify!($field) => Some(&self.$field), )*
                    _ => None,
                }
            }

            /// A field's slot by its name (`None` for a name that is no field).
            pub fn get_mut(&mut self, name: &str) -> Option<&mut Option<String>> {
                match name {
                    $( stringify!($field) => Some(&mut self.$field), )*
                    _ => None,
                }
            }
        }
    };
}

class_fields! {
    /// The class's name, unique per interface and direction: 1-47 letters, digits, '-',
    /// '_', '.', ':'.
    name: Text = "NAME", required;
    /// Which attachment of the interface the class is on: egress or ingress.
    direction: Text = "egress|ingress", default("egress");
    /// Rate as in tc: 10mbit, 1gbit, 125kbps, ... (bare number = bit/s); a change takes
    /// effect at the next packet, buckets keep their tokens.
    rate: Text = "RATE", required, in_place;
    /// Burst as in tc: 64k, 1mb, ... Default: max(128k, 250 ms at the rate); with
    /// `--action shape`, max(128k, 10 ms at the rate).
    burst: Number = "SIZE", in_place;
    /// Who shares one bucket: the whole class, each flow (5-tuple), each source or each
    /// destination address.
    per: Text = "class|flow|src|dst", default("class");
    /// Rule: the IP protocol, tcp, udp, icmp (ICMP or ICMPv6) or any.
    proto: Text = "PROTO", default("any");
    /// Rule: the source address or prefix, IPv4 or IPv6 (198.18.0.0/15, fd00::1).
    src: Text = "CIDR";
    /// Rule: the destination address or prefix, IPv4 or IPv6.
    dst: Text = "CIDR";
    /// Rule: the TCP or UDP source port or range (443, 5060-5080).
    sport: Number = "P[-P]";
    /// Rule: the TCP or UDP destination port or range.
    dport: Number = "P[-P]";
    /// Lower number wins, as in tc.
    prio: Number = "N", default("100");
    /// What happens to packets over the rate: drop (default), ecn, dscp=VALUE,
    /// fwmark=N[/MASK], pass, shape (a class does not change to or from shape).
    action: Text = "ACTION", in_place;
    /// RFC 2697 srTCM meter: excess burst size (with --rate as CIR, --burst as CBS).
    excess_burst: Number = "SIZE";
    /// RFC 2698 trTCM meter: peak information rate (>= --rate, the CIR).
    peak_rate: Text = "RATE";
    /// RFC 2698 trTCM meter: peak burst size (default: as --burst for the peak rate).
    peak_burst: Number = "SIZE";
    /// Meters: action on yellow packets (default pass).
    exceed: Text = "ACTION";
    /// Meters: action on red packets (default drop).
    violate: Text = "ACTION";
    /// Shape: CoDel's target, the standing queue delay to keep (default 5ms; raised to
    /// 1.5 frame times at low rates). A larger one keeps the class's bulk packets queued
    /// longer (sparse flows such as pings and DNS skip that queue), and on a long path it
    /// makes back-to-back cuts of a sender's window more frequent.
    target: Text = "DURATION", in_place;
    /// Shape: CoDel's interval, how long the delay may stay above target before drops
    /// start, and the spacing of the first drops (default 100ms). Set it to about the
    /// path's RTT plus the time a sender's answer takes to drain the queue: a single bulk
    /// flow over a long path fills the rate better with a longer one (80 ms RTT,
    /// 20 Mbit/s: median 0.92 with 200ms, 0.90 with 100ms). The standing queue stays at
    /// the target; the hard cap and the bfifo grow with the interval.
    interval: Text = "DURATION", in_place;
    /// Shape: `on` (default) CE-marks ECN-capable packets where CoDel would drop them;
    /// `off` drops them too.
    ecn: Switch = "on|off", in_place;
    /// Shape: how the class shares its rate among its flows: flow (the default: each
    /// flow a fair share while it wants it, an unresponsive flow held to it), src or dst
    /// (each source or destination host a fair share first, then each of its flows), or
    /// none (one queue for all).
    fair: Text = "flow|src|dst|none", in_place;
    /// A class on the same interface and direction that this one is charged to as well:
    /// its rate is guaranteed within the parent, and it may borrow up to --ceil.
    parent: Text = "CLASS", in_place;
    /// With --parent: the rate this class may reach by borrowing what its parent has
    /// spare (default: its --rate, no borrowing; `class change --ceil rate` goes back).
    ceil: Text = "RATE", in_place;
    /// With --parent: the burst at the ceiling (default: as --burst; `class change
    /// --cburst burst` goes back).
    cburst: Number = "SIZE", in_place;
    /// A limit across hosts: --rate is for all hosts with this key together, and
    /// `shaper daemon` with `[coordination]` sets this host's share (it starts at --floor).
    global: Text = "KEY";
    /// With --global, when Redis cannot be reached: static (keep the share, then the limit
    /// over the last host count), open (the whole --rate) or closed (--floor).
    on_coordinator_loss: Text = "MODE";
    /// With --global: the least this host keeps (default: 1 % of --rate, at least 64kbit).
    floor: Text = "RATE";
}

/// `class change --ceil rate` and `--cburst burst`: back to the class's own.
const BACK_TO_OWN: [(&str, &str); 2] = [("ceil", "rate"), ("cburst", "burst")];

impl ClassInput {
    /// The class as a file writes it: what differs from the defaults, in exact spellings
    /// that read back to the same class.
    pub fn from_spec(direction: Direction, spec: &ClassSpec) -> Self {
        let rule = &spec.rule;
        let ports = |range: PortRange| (!range.is_any()).then(|| range.display());
        let metered = spec.meter != Meter::None;
        let tree = spec.tree.as_ref();
        let global = spec.global.as_ref();
        Self {
            name: Some(spec.name.clone()),
            direction: Some(direction.name().into()),
            rate: Some(exact_rate(spec.rate_bits_per_sec)),
            burst: Some(spec.burst_bytes.to_string()),
            per: Some(spec.scope.name().into()),
            proto: (rule.proto != Proto::Any).then(|| rule.proto.name().into()),
            src: rule.src.map(|n| n.to_string()),
            dst: rule.dst.map(|n| n.to_string()),
            sport: ports(rule.sport),
            dport: ports(rule.dport),
            prio: Some(spec.prio.to_string()),
            action: (!metered).then(|| spec.action.to_string()),
            excess_burst: spec.meter.excess_burst().map(|b| b.to_string()),
            peak_rate: spec.meter.peak_rate().map(exact_rate),
            peak_burst: spec.meter.peak_burst().map(|b| b.to_string()),
            exceed: metered.then(|| spec.exceed.to_string()),
            violate: metered.then(|| spec.action.to_string()),
            target: spec.codel.map(|c| format_duration_ns(c.target_ns)),
            interval: spec.codel.map(|c| format_duration_ns(c.interval_ns)),
            // Written only when off: on is the default.
            ecn: spec.codel.filter(|c| !c.ecn).map(|_| "off".into()),
            // Written only when not the default (flow).
            fair: spec
                .codel
                .filter(|c| c.fair != Fair::default())
                .map(|c| c.fair.name().into()),
            parent: tree.map(|t| t.parent.clone()),
            ceil: tree.and_then(|t| t.ceil_bits_per_sec).map(exact_rate),
            cburst: tree.and_then(|t| t.cburst_bytes).map(|b| b.to_string()),
            global: global.map(|g| g.key.clone()),
            on_coordinator_loss: global.map(|g| g.on_loss.name().into()),
            floor: global.map(|g| exact_rate(g.floor_bits_per_sec)),
        }
    }

    /// The class after `change`: each field it gives replaces this one's; `to_top`
    /// takes the class out of its tree (no parent, ceiling or cburst), and `--ceil rate`
    /// and `--cburst burst` go back to the class's own rate and burst.
    pub fn changed_by(&self, change: &ClassInput, to_top: bool) -> ClassInput {
        let mut after = self.clone();
        if to_top {
            for field in ["parent", "ceil", "cburst"] {
                after.get_mut(field).map(Option::take);
            }
        }
        for field in FIELDS {
            let Some(Some(text)) = change.get(field.name) else {
                continue;
            };
            let slot = after.get_mut(field.name).expect("a field of FIELDS");
            *slot = if BACK_TO_OWN.contains(&(field.name, text.as_str())) {
                None
            } else {
                Some(text.clone())
            };
        }
        after
    }
}

/// A file's class table: the fields given, each in its kind (`burst = 65536`,
/// `ecn = false`), in [`FIELDS`] order.
impl Serialize for ClassInput {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let given: Vec<(&FieldInfo, &String)> = FIELDS
            .iter()
            .filter_map(|field| Some((field, self.get(field.name)?.as_ref()?)))
            .collect();
        let mut map = serializer.serialize_map(Some(given.len()))?;
        for (field, text) in given {
            match (field.kind, text.parse::<i64>(), parse_switch(text)) {
                (Kind::Number, Ok(number), _) => map.serialize_entry(field.name, &number)?,
                (Kind::Switch, _, Ok(on)) => map.serialize_entry(field.name, &on)?,
                _ => map.serialize_entry(field.name, text)?,
            }
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_has_one_help_line_and_a_placeholder() {
        for field in FIELDS {
            let help = field.help.trim();
            assert!(help.ends_with('.'), "{}: {help}", field.name);
            assert!(!field.help_line().ends_with('.'), "{}", field.name);
            assert!(!field.value_name.is_empty(), "{}", field.name);
            assert!(ClassInput::default().get(field.name).is_some());
        }
        assert!(ClassInput::default().get("nonsense").is_none());
    }

    #[test]
    fn a_change_replaces_given_fields_and_goes_back_to_the_own_rate() {
        let current = ClassInput {
            name: Some("a".into()),
            rate: Some("1mbit".into()),
            parent: Some("p".into()),
            ceil: Some("5mbit".into()),
            cburst: Some("9000".into()),
            ..ClassInput::default()
        };
        let change = ClassInput {
            rate: Some("2mbit".into()),
            ceil: Some("rate".into()),
            ..ClassInput::default()
        };
        let after = current.changed_by(&change, false);
        assert_eq!(after.rate.as_deref(), Some("2mbit"));
        assert_eq!((after.ceil, after.cburst.as_deref()), (None, Some("9000")));
        let top = current.changed_by(&ClassInput::default(), true);
        assert_eq!((top.parent, top.ceil, top.cburst), (None, None, None));
    }
}
