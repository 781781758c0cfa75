use super::{prepare, print_rows, text};
use crate::class_args::ClassFields;
use crate::cli::{
    ClassAddArgs, ClassChangeArgs, ClassCommand, ClassDelArgs, ListArgs, SingleDirection,
};
use anyhow::Result;
use shaper::{
    class_input::ClassInput,
    classes::{self, ClassSpec},
    error::{runtime, usage},
    state::{self, Attachment, Direction, Location},
    units::{format_duration_ns, format_rate, format_size},
};

pub fn run(netns: Option<String>, command: ClassCommand) -> Result<()> {
    match command {
        ClassCommand::Add(args) => add(netns, *args),
        ClassCommand::Change(args) => change(netns, *args),
        ClassCommand::Del(args) => del(netns, args),
        ClassCommand::List(args) => list(netns, args),
    }
}

/// The command line's class, checked by the one validator; its first problem is the
/// command's one-line error.
pub fn spec_from_args(args: &ClassAddArgs) -> Result<ClassSpec> {
    ClassInput::from(args)
        .check()
        .map(|(_, spec)| spec)
        .map_err(|errors| usage(errors[0].message.clone()))
}

fn add(netns: Option<String>, args: ClassAddArgs) -> Result<()> {
    let spec = spec_from_args(&args)?;
    prepare(&netns)?;
    let location = Location {
        netns,
        dev: args.dev.clone(),
        direction: Direction::from(args.direction),
    };
    let _lock = state::lock()?;
    let attachment = Attachment::open(&location)?;
    classes::add(&attachment, &spec)?;
    let codel = spec.codel.map_or(String::new(), |c| {
        format!(
            " target {} interval {} fair {}",
            format_duration_ns(c.target_ns),
            format_duration_ns(c.interval_ns),
            c.fair.name()
        )
    });
    println!(
        "class {} added on {}: rate {} burst {} per {} action {}{codel}",
        spec.name,
        location.describe(),
        format_rate(spec.rate_bits_per_sec),
        format_size(spec.burst_bytes),
        spec.scope.name(),
        spec.action
    );
    if let Some(global) = &spec.global {
        println!(
            "global '{}': the rate is the limit for all hosts; this host holds its floor ({}) until `shaper daemon` with [coordination] sets its share",
            global.key,
            format_rate(global.floor_bits_per_sec)
        );
    }
    Ok(())
}

/// The attachment holding class `name` on `dev`: the given direction, or the only one
/// that has it.
pub(super) fn locate(
    netns: &Option<String>,
    dev: &str,
    name: &str,
    direction: Option<SingleDirection>,
) -> Result<Attachment> {
    let candidates: Vec<Direction> = match direction {
        Some(d) => vec![Direction::from(d)],
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

/// The class as it would be after the change, checked by the one validator, then changed
/// in place.
fn change(netns: Option<String>, args: ClassChangeArgs) -> Result<()> {
    if args.fields.0 == ClassInput::default() && !args.no_parent {
        let mut flags = ClassFields::<true>::flags();
        flags.push("--no-parent".into());
        return Err(usage(format!(
            "class change needs {}",
            classes::expected(flags.iter().map(String::as_str)).replace(" or ", " and/or ")
        )));
    }
    prepare(&netns)?;
    let _lock = state::lock()?;
    let attachment = locate(&netns, &args.dev, &args.name, args.direction)?;
    let (_, current) = classes::read_class(&attachment, &args.name)?
        .ok_or_else(|| runtime(format!("no class '{}' on {}", args.name, args.dev)))?;
    let after = ClassInput::from_spec(attachment.location.direction, &current)
        .changed_by(&args.fields.0, args.no_parent);
    let (_, wanted) = after
        .check()
        .map_err(|errors| usage(errors[0].message.clone()))?;
    classes::change(&attachment, &wanted)?;
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

/// A class's name indented two spaces per level below the top.
pub(crate) fn tree_name(row: &serde_json::Value) -> String {
    let depth = row["depth"].as_u64().unwrap_or(0) as usize;
    format!("{}{}", "  ".repeat(depth), text(&row["name"]))
}

/// The action, with CoDel's target/interval on shape classes: `shape 5ms/100ms`.
pub(crate) fn action_text(row: &serde_json::Value) -> String {
    match (row["target"].as_str(), row["interval"].as_str()) {
        (Some(target), Some(interval)) if row["ecn"] == false => {
            format!("{} {target}/{interval} noecn", text(&row["action"]))
        }
        (Some(target), Some(interval)) => format!("{} {target}/{interval}", text(&row["action"])),
        _ => text(&row["action"]),
    }
}

fn list(netns: Option<String>, args: ListArgs) -> Result<()> {
    prepare(&None)?;
    let rows = crate::rows::collect(&netns, &args.dev, false)?;
    let header = [
        "NAME",
        "DEV",
        "DIR",
        "PRIO",
        "RATE",
        "CEIL",
        "BURST",
        "PER",
        "ACTION",
        "PROTO",
        "SRC",
        "DST",
        "SPORT",
        "DPORT",
        "FAIR (FLOWS)",
        "GLOBAL SHARE",
    ];
    print_rows(&rows, args.json, &header, |row| {
        vec![
            tree_name(row),
            text(&row["dev"]),
            text(&row["direction"]),
            text(&row["prio"]),
            format_rate(row["rate_bps"].as_u64().unwrap_or(0)),
            row["ceil_bps"]
                .as_u64()
                .map_or_else(|| "-".to_string(), format_rate),
            format_size(row["burst_bytes"].as_u64().unwrap_or(0)),
            text(&row["per"]),
            action_text(row),
            text(&row["proto"]),
            text(&row["src"]),
            text(&row["dst"]),
            text(&row["sport"]),
            text(&row["dport"]),
            fair_text(row),
            crate::rows::share_text(row),
        ]
    })
}

/// A shape class's flow isolation and its bulk flows now.
fn fair_text(row: &serde_json::Value) -> String {
    match (row["fair"].as_str(), row["flows"].as_u64()) {
        (Some(fair), Some(flows)) => format!("{fair} ({flows})"),
        _ => "-".into(),
    }
}
