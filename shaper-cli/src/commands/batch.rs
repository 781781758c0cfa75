//! `shaper batch -f FILE`: one shaper command per line, like `tc -batch`. Every line is
//! parsed before anything runs (a bad line changes nothing and is reported with its line
//! number); consecutive `class add` lines for one interface and direction are applied
//! with one read of the state, which makes ten thousand classes take well under a second,
//! and so are consecutive `class del` lines.

use super::{class::locate, prepare, run as run_command, spec_from_args};
use crate::cli::{BatchArgs, ClassCommand, Cli, Command};
use anyhow::{Context as _, Result};
use clap::{CommandFactory as _, FromArgMatches as _};
use shaper::{
    classes,
    error::usage,
    state::{self, Attachment, Direction, Location},
};

pub fn run(netns: Option<String>, args: BatchArgs) -> Result<()> {
    let text = if args.file == "-" {
        std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
    } else {
        std::fs::read_to_string(&args.file)
            .map_err(|e| shaper::error::runtime(format!("cannot read {}: {e}", args.file)))?
    };
    let mut commands = Vec::new();
    // Built once for the file: building clap's command anew for each line was most of
    // a batch's time (60 % of 1 000 `class add` lines in a debug build).
    let mut parser = Cli::command();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = vec!["shaper".to_string()];
        if let Some(name) = &netns {
            words.extend(["--netns".to_string(), name.clone()]);
        }
        words.extend(line.split_whitespace().map(str::to_string));
        let parsed = parser
            .try_get_matches_from_mut(&words)
            .and_then(|matches| Cli::from_arg_matches(&matches));
        let cli = parsed.map_err(|e| {
            let first = e
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_string();
            usage(format!("{}:{}: {first}", args.file, index + 1))
        })?;
        if matches!(cli.command, Command::Batch(_)) {
            return Err(usage(format!(
                "{}:{}: batch files cannot nest",
                args.file,
                index + 1
            )));
        }
        commands.push((index + 1, cli));
    }
    prepare(&netns)?;
    let mut pending: Vec<(usize, Location, Queued)> = Vec::new();
    for (line, cli) in commands {
        if let Command::Class(class_command) = &cli.command {
            match class_command.as_ref() {
                ClassCommand::Add(add) => {
                    let spec = spec_from_args(add)
                        .map_err(|e| usage(format!("{}:{line}: {e:#}", args.file)))?;
                    let location = Location {
                        netns: netns.clone(),
                        dev: add.dev.clone(),
                        direction: Direction::from(add.direction),
                    };
                    pending.push((line, location, Queued::Add(Box::new(spec))));
                    continue;
                }
                ClassCommand::Del(del) => {
                    // Found where the adds before it have been made.
                    if pending.last().is_some_and(|(_, _, queued)| queued.is_add()) {
                        flush(&args.file, &mut pending)?;
                    }
                    let attachment = locate(&netns, &del.dev, &del.name, del.direction)
                        .map_err(|e| e.context(format!("{}:{line}", args.file)))?;
                    let queued = Queued::Del(del.name.clone());
                    pending.push((line, attachment.location.clone(), queued));
                    continue;
                }
                _ => {}
            }
        }
        flush(&args.file, &mut pending)?;
        run_command(cli).map_err(|e| e.context(format!("{}:{line}", args.file)))?;
    }
    flush(&args.file, &mut pending)?;
    Ok(())
}

/// A `class add` or `class del` line waiting to run with its neighbours.
enum Queued {
    Add(Box<classes::ClassSpec>),
    Del(String),
}

impl Queued {
    fn is_add(&self) -> bool {
        matches!(self, Queued::Add(_))
    }
}

/// Runs the queued lines: consecutive adds to one attachment in one batch, consecutive
/// deletes from one attachment in another, each reading the attachment's state once.
fn flush(file: &str, pending: &mut Vec<(usize, Location, Queued)>) -> Result<()> {
    if pending.is_empty() {
        return Ok(());
    }
    let _lock = state::lock()?;
    let mut start = 0;
    while start < pending.len() {
        let (location, add) = (pending[start].1.clone(), pending[start].2.is_add());
        let end = pending[start..]
            .iter()
            .position(|(_, l, queued)| *l != location || queued.is_add() != add)
            .map_or(pending.len(), |n| start + n);
        let attachment = Attachment::open(&location)?;
        let (first, last) = (pending[start].0, pending[end - 1].0);
        let group = &pending[start..end];
        if add {
            let specs: Vec<classes::ClassSpec> = group
                .iter()
                .filter_map(|(_, _, queued)| match queued {
                    Queued::Add(spec) => Some(spec.as_ref().clone()),
                    Queued::Del(_) => None,
                })
                .collect();
            let added = classes::add_many(&attachment, &specs)
                .map_err(|e| e.context(format!("{file}:{first}-{last}: class add")))?;
            println!("{}: {} classes added", location.describe(), added.len());
        } else {
            let names: Vec<String> = group
                .iter()
                .filter_map(|(_, _, queued)| match queued {
                    Queued::Del(name) => Some(name.clone()),
                    Queued::Add(_) => None,
                })
                .collect();
            classes::delete_many(&attachment, &names)
                .map_err(|e| e.context(format!("{file}:{first}-{last}: class del")))?;
            println!("{}: {} classes deleted", location.describe(), names.len());
        }
        start = end;
    }
    pending.clear();
    Ok(())
}
