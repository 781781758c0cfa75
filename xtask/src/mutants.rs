//! `cargo xtask mutants`: cargo-mutants over shaper-common's arithmetic (the bucket, CoDel,
//! the meters, the hierarchy, the map layout's costs) with the crate's own host tests, so
//! a change that breaks the arithmetic and still passes them is found. Not in CI: a run is
//! hours on two cores. Every mutant's outcome is in `target/mutants/mutants.out`; the
//! summary (caught share of viable mutants, survivors) is printed and written to
//! `target/mutants/summary.md`; docs/TESTING.md holds the last run's and why each
//! survivor is left.

use crate::{setup, workspace_root};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{fmt::Write as _, path::Path, process::Command};

/// The files mutated.
const FILES: &[&str] = &[
    "shaper-common/src/bucket.rs",
    "shaper-common/src/codel.rs",
    "shaper-common/src/meter.rs",
    "shaper-common/src/hierarchy.rs",
    "shaper-common/src/layout.rs",
];
/// The share of viable mutants the tests must catch.
const TARGET: f64 = 0.90;
/// Cases of the meter race test per mutant (the suite's 120 take a minute on two cores).
const RACE_CASES: &str = "40";

pub fn run(jobs: u32) -> Result<()> {
    setup::cargo_mutants()?;
    let root = workspace_root();
    let out = root.join("target/mutants");
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["mutants", "--package", "shaper-common", "--no-shuffle"])
        .args(["--jobs", &jobs.to_string()])
        .arg("--output")
        .arg(&out)
        .env("SHAPER_RACE_CASES", RACE_CASES)
        .current_dir(&root);
    for file in FILES {
        command.args(["--file", file]);
    }
    println!("[xtask] {command:?}");
    // cargo-mutants exits non-zero when a mutant survives or times out: the outcomes say
    // which, and the summary judges them.
    let status = command.status().context("cannot run cargo mutants")?;
    let outcomes_path = out.join("mutants.out/outcomes.json");
    let outcomes: Value =
        serde_json::from_str(&std::fs::read_to_string(&outcomes_path).with_context(|| {
            format!(
                "cargo mutants ({status}) wrote no {}",
                outcomes_path.display()
            )
        })?)?;
    let count = |field: &str| outcomes[field].as_u64().unwrap_or(0);
    let (caught, missed, timeout, unviable) = (
        count("caught"),
        count("missed"),
        count("timeout"),
        count("unviable"),
    );
    let viable = caught + missed + timeout;
    if viable == 0 {
        bail!("cargo mutants ({status}) tested no viable mutant");
    }
    // A mutant whose tests hang is caught by the timeout: it did not pass them.
    let share = (caught + timeout) as f64 / viable as f64;
    let survivors = read_lines(&out.join("mutants.out/missed.txt"));
    let mut summary = format!(
        "cargo-mutants {} on shaper-common ({}): {} mutants, {unviable} unviable; of the \
         {viable} viable {caught} caught, {timeout} timed out, {missed} missed: {:.1} % caught \
         (target {:.0} %)\n",
        setup::CARGO_MUTANTS_VERSION,
        FILES.join(", "),
        count("total_mutants"),
        share * 100.0,
        TARGET * 100.0
    );
    for survivor in &survivors {
        writeln!(summary, "- survived: {survivor}")?;
    }
    print!("{summary}");
    std::fs::write(out.join("summary.md"), &summary)?;
    if share < TARGET {
        bail!(
            "{:.1} % of viable mutants caught, below {:.0} %",
            share * 100.0,
            TARGET * 100.0
        );
    }
    Ok(())
}

fn read_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(str::to_string)
        .collect()
}
