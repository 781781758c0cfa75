//! `shaper apply -f FILE [--dry-run] [--prune]` and `shaper export [--dev DEV]`.

use super::prepare;
use crate::cli::{ApplyArgs, ExportArgs};
use anyhow::{Context as _, Result};
use shaper::{
    config::{self, Desired, Plan, Prune},
    error::{runtime, usage},
    state,
};

/// Reads a configuration file (or standard input for `-`) and checks all of it.
pub fn load(file: &str) -> Result<Desired> {
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
    } else {
        std::fs::read_to_string(file).map_err(|e| runtime(format!("cannot read {file}: {e}")))?
    };
    let name = if file == "-" { "<stdin>" } else { file };
    config::parse(name, &text).map_err(|problems| {
        // Every problem on its own line; the last line (the one-line error) sums up.
        for problem in problems.to_string().lines() {
            eprintln!("shaper: {problem}");
        }
        usage(format!(
            "{} problem(s) in {name}; nothing was changed",
            problems.problems.len()
        ))
    })
}

/// Prints a plan the way `apply` and the daemon log it.
pub fn describe(plan: &Plan) -> Vec<String> {
    let mut lines: Vec<String> = plan.steps.iter().map(|step| step.to_string()).collect();
    for missing in &plan.missing {
        lines.push(format!("waiting for {missing}: not present"));
    }
    lines
}

pub fn run(netns: Option<String>, args: ApplyArgs) -> Result<()> {
    if netns.is_some() {
        return Err(usage(
            "apply takes namespaces from the file (netns = \"...\" per interface), not --netns",
        ));
    }
    let desired = load(&args.file)?;
    prepare(&None)?;
    let _lock = state::lock()?;
    let prune = if args.prune {
        Prune::All
    } else {
        Prune::Nothing
    };
    let plan = config::plan(&desired, prune)?;
    if args.dry_run {
        for line in describe(&plan) {
            println!("would {line}");
        }
    }
    if !plan.missing.is_empty() {
        return Err(runtime(format!(
            "not present: {}; nothing was changed",
            plan.missing.join(", ")
        )));
    }
    if plan.steps.is_empty() {
        println!(
            "no changes: {} class(es) already as configured",
            plan.unchanged
        );
        return Ok(());
    }
    if args.dry_run {
        return Ok(());
    }
    for line in describe(&plan) {
        println!("{line}");
    }
    config::execute(&plan)?;
    println!(
        "applied {} change(s); {} class(es) unchanged",
        plan.steps.len(),
        plan.unchanged
    );
    Ok(())
}

pub fn export(netns: Option<String>, args: ExportArgs) -> Result<()> {
    prepare(&None)?;
    let filter = netns.map(Some);
    print!("{}", config::export(filter.as_ref(), args.dev.as_deref())?);
    Ok(())
}
