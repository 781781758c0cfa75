use super::{prepare, print_rows, single, text};
use crate::{
    actions::ActionSpec,
    classes::{self, parse_scope, scope_name, ClassSpec, ClassView, Meter},
    cli::{ClassAddArgs, ClassChangeArgs, ClassCommand, ClassDelArgs, ListArgs, SingleDirection},
    error::{runtime, usage},
    rules::{parse_cidr, PortRange, Proto, Rule},
    state::{self, Attachment, Direction, Location},
    units::{default_burst, default_shape_burst, format_rate, format_size, parse_rate, parse_size},
};
use anyhow::Result;
use serde_json::{json, Value};
use shaper_common::Action;

pub fn run(netns: Option<String>, command: ClassCommand) -> Result<()> {
    match command {
        ClassCommand::Add(args) => add(netns, *args),
        ClassCommand::Change(args) => change(netns, args),
        ClassCommand::Del(args) => del(netns, args),
        ClassCommand::List(args) => list(netns, args),
    }
}

pub fn spec_from_args(args: &ClassAddArgs) -> Result<ClassSpec> {
    classes::check_name(&args.name)?;
    let rate = parse_rate(&args.rate).map_err(usage)?;
    let meter = meter_from_args(args, rate)?;
    if meter == Meter::None && (args.exceed.is_some() || args.violate.is_some()) {
        return Err(usage(
            "--exceed and --violate need a meter: --excess-burst (srTCM) or --peak-rate (trTCM)",
        ));
    }
    if meter != Meter::None && args.action.is_some() {
        return Err(usage(
            "a metered class takes --exceed (yellow) and --violate (red) instead of --action",
        ));
    }
    let action = match (&args.action, &args.violate) {
        (Some(text), _) | (None, Some(text)) => parse_action(text)?,
        (None, None) => ActionSpec::default(),
    };
    let exceed = match &args.exceed {
        Some(text) => parse_action(text)?,
        None => ActionSpec {
            action: Action::Pass,
            arg: 0,
            mask: 0,
        },
    };
    if meter != Meter::None && (action.action == Action::Shape || exceed.action == Action::Shape) {
        return Err(usage("meters police or mark; shape is not a meter action"));
    }
    if action.action == Action::Shape && args.direction == SingleDirection::Ingress {
        return Err(usage(
            "--action shape works on egress only: a packet arriving on ingress cannot be held back; police it (drop/ecn) or shape on the sender's egress",
        ));
    }
    let burst = match &args.burst {
        Some(text) => parse_size(text).map_err(usage)?,
        None if action.action == Action::Shape => default_shape_burst(rate),
        None => default_burst(rate),
    };
    let port = |text: &Option<String>| match text {
        Some(text) => PortRange::parse(text).map_err(usage),
        None => Ok(PortRange::ANY),
    };
    let cidr = |text: &Option<String>| text.as_deref().map(parse_cidr).transpose().map_err(usage);
    let rule = Rule {
        src: cidr(&args.src)?,
        dst: cidr(&args.dst)?,
        proto: Proto::parse(&args.proto).map_err(usage)?,
        sport: port(&args.sport)?,
        dport: port(&args.dport)?,
    };
    rule.validate().map_err(usage)?;
    Ok(ClassSpec {
        name: args.name.clone(),
        rule,
        rate_bits_per_sec: rate,
        burst_bytes: burst,
        scope: parse_scope(&args.per).map_err(usage)?,
        prio: args.prio,
        action,
        meter,
        exceed,
    })
}

/// `--excess-burst` makes an RFC 2697 srTCM, `--peak-rate [--peak-burst]` an RFC 2698 trTCM.
fn meter_from_args(args: &ClassAddArgs, rate: u64) -> Result<Meter> {
    match (&args.excess_burst, &args.peak_rate, &args.peak_burst) {
        (None, None, None) => Ok(Meter::None),
        (Some(_), Some(_), _) | (Some(_), _, Some(_)) => Err(usage(
            "--excess-burst (srTCM) and --peak-rate/--peak-burst (trTCM) exclude each other",
        )),
        (Some(excess), None, None) => Ok(Meter::SrTcm {
            excess_burst_bytes: parse_size(excess).map_err(usage)?,
        }),
        (None, None, Some(_)) => Err(usage("--peak-burst needs --peak-rate")),
        (None, Some(peak), peak_burst) => {
            let peak_rate_bits_per_sec = parse_rate(peak).map_err(usage)?;
            if peak_rate_bits_per_sec < rate {
                return Err(usage(format!(
                    "--peak-rate {peak} is below --rate {} (RFC 2698 needs PIR >= CIR)",
                    args.rate
                )));
            }
            let peak_burst_bytes = match peak_burst {
                Some(text) => parse_size(text).map_err(usage)?,
                None => default_burst(peak_rate_bits_per_sec),
            };
            Ok(Meter::TrTcm {
                peak_rate_bits_per_sec,
                peak_burst_bytes,
            })
        }
    }
}

fn parse_action(text: &str) -> Result<ActionSpec> {
    ActionSpec::parse(text).map_err(usage)
}

fn add(netns: Option<String>, args: ClassAddArgs) -> Result<()> {
    let spec = spec_from_args(&args)?;
    prepare(&netns)?;
    let location = Location {
        netns,
        dev: args.dev.clone(),
        direction: single(args.direction),
    };
    let _lock = state::lock()?;
    let attachment = Attachment::open(&location)?;
    classes::add(&attachment, &spec)?;
    println!(
        "class {} added on {}: rate {} burst {} per {} action {}",
        spec.name,
        location.describe(),
        format_rate(spec.rate_bits_per_sec),
        format_size(spec.burst_bytes),
        scope_name(spec.scope),
        spec.action.display()
    );
    Ok(())
}

/// The attachment holding class `name` on `dev`: the given direction, or the only one
/// that has it.
fn locate(
    netns: &Option<String>,
    dev: &str,
    name: &str,
    direction: Option<SingleDirection>,
) -> Result<Attachment> {
    let candidates: Vec<Direction> = match direction {
        Some(d) => vec![single(d)],
        None => Direction::BOTH.to_vec(),
    };
    let mut holders = Vec::new();
    let mut attached_any = false;
    for direction in candidates.iter().copied() {
        let location = Location {
            netns: netns.clone(),
            dev: dev.to_string(),
            direction,
        };
        if !location.dir().exists() {
            continue;
        }
        attached_any = true;
        let attachment = Attachment::open(&location)?;
        if classes::find(&attachment, name)?.is_some() {
            holders.push(attachment);
        }
    }
    if !attached_any {
        let location = Location {
            netns: netns.clone(),
            dev: dev.to_string(),
            direction: candidates[0],
        };
        return Attachment::open(&location).map(|_| unreachable!());
    }
    match holders.len() {
        0 => Err(runtime(format!("no class '{name}' on {dev}"))),
        1 => Ok(holders.remove(0)),
        _ => Err(usage(format!(
            "class '{name}' exists on both directions of {dev}; pass --direction"
        ))),
    }
}

fn change(netns: Option<String>, args: ClassChangeArgs) -> Result<()> {
    let rate = args
        .rate
        .as_deref()
        .map(parse_rate)
        .transpose()
        .map_err(usage)?;
    let burst = args
        .burst
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(usage)?;
    let action = args.action.as_deref().map(parse_action).transpose()?;
    if rate.is_none() && burst.is_none() && action.is_none() {
        return Err(usage("class change needs --rate, --burst and/or --action"));
    }
    prepare(&netns)?;
    let _lock = state::lock()?;
    let attachment = locate(&netns, &args.dev, &args.name, args.direction)?;
    let change = classes::Change {
        rate_bits_per_sec: rate,
        burst_bytes: burst,
        action,
    };
    classes::change(&attachment, &args.name, change)?;
    println!(
        "class {} changed on {}",
        args.name,
        attachment.location.describe()
    );
    Ok(())
}

fn del(netns: Option<String>, args: ClassDelArgs) -> Result<()> {
    prepare(&netns)?;
    let _lock = state::lock()?;
    let attachment = locate(&netns, &args.dev, &args.name, args.direction)?;
    classes::delete(&attachment, &args.name)?;
    println!(
        "class {} deleted from {}",
        args.name,
        attachment.location.describe()
    );
    Ok(())
}

/// Every class of every selected attachment, as JSON objects (shared with `stats`).
pub fn collect(netns: &Option<String>, dev: &Option<String>) -> Result<Vec<Value>> {
    let filter = netns.as_ref().map(|n| Some(n.clone()));
    let mut rows = Vec::new();
    for location in state::list_locations(filter.as_ref())? {
        if dev.as_ref().is_some_and(|d| *d != location.dev) {
            continue;
        }
        let attachment = Attachment::open(&location)?;
        for view in classes::read_classes(&attachment)? {
            rows.push(class_json(&location, &view));
        }
    }
    if rows.is_empty() {
        if let Some(dev) = dev {
            let any = state::list_locations(filter.as_ref())?
                .iter()
                .any(|l| l.dev == *dev);
            if !any {
                return Err(runtime(format!("shaper is not attached to {dev}")));
            }
        }
    }
    Ok(rows)
}

fn class_json(location: &Location, view: &ClassView) -> Value {
    let spec = &view.spec;
    let rule = &spec.rule;
    let ports = |range: PortRange| {
        if range.is_any() {
            Value::Null
        } else {
            json!(range.display())
        }
    };
    let mut row = json!({
        "name": spec.name,
        "dev": location.dev,
        "netns": location.netns,
        "direction": location.direction.name(),
        "id": view.id,
        "rate_bps": spec.rate_bits_per_sec,
        "burst_bytes": spec.burst_bytes,
        "per": scope_name(spec.scope),
        "prio": spec.prio,
        "proto": rule.proto.name(),
        "src": rule.src.map(|n| n.to_string()),
        "dst": rule.dst.map(|n| n.to_string()),
        "sport": ports(rule.sport),
        "dport": ports(rule.dport),
        "action": spec.action.display(),
        "passed_packets": view.stats.passed_packets,
        "passed_bytes": view.stats.passed_bytes,
        "dropped_packets": view.stats.dropped_packets,
        "dropped_bytes": view.stats.dropped_bytes,
        "marked_packets": view.stats.marked_packets,
        "marked_bytes": view.stats.marked_bytes,
    });
    if spec.meter != Meter::None {
        let extra = json!({
            "meter": spec.meter.name(),
            "exceed": spec.exceed.display(),
            "violate": spec.action.display(),
            "peak_rate_bps": match spec.meter { Meter::TrTcm { peak_rate_bits_per_sec, .. } => json!(peak_rate_bits_per_sec), _ => Value::Null },
            "peak_burst_bytes": match spec.meter { Meter::TrTcm { peak_burst_bytes, .. } => json!(peak_burst_bytes), _ => Value::Null },
            "excess_burst_bytes": match spec.meter { Meter::SrTcm { excess_burst_bytes } => json!(excess_burst_bytes), _ => Value::Null },
            "green_packets": view.stats.green_packets,
            "green_bytes": view.stats.green_bytes,
            "yellow_packets": view.stats.yellow_packets,
            "yellow_bytes": view.stats.yellow_bytes,
            "red_packets": view.stats.red_packets,
            "red_bytes": view.stats.red_bytes,
        });
        for (key, value) in extra.as_object().into_iter().flatten() {
            row[key] = value.clone();
        }
    }
    row
}

fn list(netns: Option<String>, args: ListArgs) -> Result<()> {
    prepare(&None)?;
    let rows = collect(&netns, &args.dev)?;
    let header = [
        "NAME", "DEV", "DIR", "PRIO", "RATE", "BURST", "PER", "ACTION", "PROTO", "SRC", "DST",
        "SPORT", "DPORT",
    ];
    print_rows(&rows, args.json, &header, |row| {
        vec![
            text(&row["name"]),
            text(&row["dev"]),
            text(&row["direction"]),
            text(&row["prio"]),
            format_rate(row["rate_bps"].as_u64().unwrap_or(0)),
            format_size(row["burst_bytes"].as_u64().unwrap_or(0)),
            text(&row["per"]),
            text(&row["action"]),
            text(&row["proto"]),
            text(&row["src"]),
            text(&row["dst"]),
            text(&row["sport"]),
            text(&row["dport"]),
        ]
    })
}
