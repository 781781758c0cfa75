//! `shaper apply -f FILE [--dry-run] [--prune]` and `shaper export [--dev DEV]`.

use super::prepare;
use crate::cli::{ApplyArgs, ExportArgs};
use anyhow::Result;
use shaper::{
    config::{self, Prune},
    error::{runtime, usage},
    state,
};

pub fn run(netns: Option<String>, args: ApplyArgs) -> Result<()> {
    if netns.is_some() {
        return Err(usage(
            "apply takes namespaces from the file (netns = \"...\" per interface), not --netns",
        ));
    }
    let desired = crate::config_file::load(&args.file)?;
    prepare(&None)?;
    let _lock = state::lock()?;
    let prune = if args.prune {
        Prune::All
    } else {
        Prune::Nothing
    };
    let plan = config::plan(&desired, prune)?;
    if args.dry_run {
        for line in crate::config_file::describe(&plan) {
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
    for line in crate::config_file::describe(&plan) {
        println!("{line}");
    }
    config::execute(&plan)?;
    println!(
        "applied {} change(s); {} class(es) unchanged",
        plan.steps.len(),
        plan.unchanged
    );
    let globals = plan.steps.iter().filter_map(|step| match step {
        config::Step::Add(_, spec) | config::Step::Replace(_, spec) => spec.global.as_ref(),
        _ => None,
    });
    for global in globals {
        println!(
            "global '{}': this host holds its floor ({}) until `shaper daemon` with [coordination] sets its share",
            global.key,
            shaper::units::format_rate(global.floor_bits_per_sec)
        );
    }
    Ok(())
}

pub fn export(netns: Option<String>, args: ExportArgs) -> Result<()> {
    prepare(&None)?;
    shaper::state::check_netns_known(&netns)?;
    let filter = netns.map(Some);
    print!("{}", config::export(filter.as_ref(), args.dev.as_deref())?);
    Ok(())
}
