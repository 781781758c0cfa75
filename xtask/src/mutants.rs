//! `cargo xtask mutants`: cargo-mutants over shaper-common's arithmetic (the bucket, CoDel,
//! the meters, the hierarchy, the map layout's costs) with the crate's own host tests, so
//! a change that breaks the arithmetic and still passes them is found. Not in CI: a run
//! takes over an hour on two cores. Every mutant's outcome is in `target/mutants/<pass>/
//! mutants.out`; the summary (caught share of viable mutants, survivors) is printed and
//! written to `target/mutants/summary.md`; docs/TESTING.md holds the last run's and why
//! each survivor is left.

use crate::{setup, workspace_root};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{fmt::Write as _, path::Path, process::Command};

/// One cargo-mutants run: the files it mutates and the test targets it runs per mutant.
pub struct Pass {
    pub name: &'static str,
    files: &'static [&'static str],
    /// `cargo test` target selection; empty: all of the crate's tests.
    targets: &'static [&'static str],
}

/// The meter race test (thousands of thread hand-offs a case) runs only for the meters'
/// mutants: the other files' mutants meet it through the property tests' arithmetic.
pub const PASSES: &[Pass] = &[
    Pass {
        name: "arithmetic",
        files: &[
            "shaper-common/src/bucket.rs",
            "shaper-common/src/codel.rs",
            "shaper-common/src/hierarchy.rs",
            "shaper-common/src/layout/class.rs",
            "shaper-common/src/layout/global.rs",
            "shaper-common/src/layout/verdict.rs",
        ],
        targets: &[
            "--lib",
            "--test=bucket_properties",
            "--test=hierarchy_properties",
            "--test=initial_credit",
            "--test=layout_values",
            "--test=rate_change",
            "--test=verdict_cache",
        ],
    },
    Pass {
        name: "meter",
        files: &["shaper-common/src/meter.rs"],
        targets: &[],
    },
];
/// The share of viable mutants the tests must catch.
const TARGET: f64 = 0.90;
/// Cases of the meter race test per mutant (the suite's 120 take a minute on two cores;
/// fewer than 40 reach red too rarely for the test's own floor).
const RACE_CASES: &str = "40";

/// What one pass found.
#[derive(Default)]
struct Outcomes {
    total: u64,
    caught: u64,
    missed: u64,
    timeout: u64,
    unviable: u64,
    survivors: Vec<String>,
}

/// Runs every pass (or only the one named `only`), then judges the outcomes of all passes
/// (a pass not run now is read from its last run). With `retest`, a pass runs only the
/// mutants its last full run missed (after tests were added to kill them), and its
/// outcome is the full run's with those mutants judged again.
pub fn run(jobs: u32, only: Option<&str>, retest: bool) -> Result<()> {
    setup::cargo_mutants()?;
    let out = workspace_root().join("target/mutants");
    if let Some(name) = only {
        if !PASSES.iter().any(|pass| pass.name == name) {
            let names: Vec<&str> = PASSES.iter().map(|pass| pass.name).collect();
            bail!("no pass {name:?} (passes: {})", names.join(", "));
        }
    }
    let mut all = Outcomes::default();
    for pass in PASSES {
        if only.is_none_or(|name| name == pass.name) {
            run_or_retest(pass, jobs, &out, retest)?;
        }
        let found = pass_outcomes(pass, &out)?;
        all.total += found.total;
        all.caught += found.caught;
        all.missed += found.missed;
        all.timeout += found.timeout;
        all.unviable += found.unviable;
        all.survivors.extend(found.survivors);
    }
    let viable = all.caught + all.missed + all.timeout;
    if viable == 0 {
        bail!("cargo mutants tested no viable mutant");
    }
    // A mutant whose tests hang is caught by the timeout: it did not pass them.
    let share = (all.caught + all.timeout) as f64 / viable as f64;
    let files: Vec<&str> = PASSES
        .iter()
        .flat_map(|pass| pass.files.iter().copied())
        .collect();
    let mut summary = format!(
        "cargo-mutants {} on shaper-common ({}): {} mutants, {} unviable; of the {viable} \
         viable {} caught, {} timed out, {} missed: {:.1} % caught (target {:.0} %)\n",
        setup::CARGO_MUTANTS_VERSION,
        files.join(", "),
        all.total,
        all.unviable,
        all.caught,
        all.timeout,
        all.missed,
        share * 100.0,
        TARGET * 100.0
    );
    for survivor in &all.survivors {
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

/// Runs `pass` in full, or (`retest`) again on the survivors of its last full run.
fn run_or_retest(pass: &Pass, jobs: u32, out: &Path, retest: bool) -> Result<()> {
    let dir = out.join(pass.name);
    let retested = dir.join("retest");
    if retest {
        let missed = read_outcomes(&dir)
            .with_context(|| format!("pass {} has no full run to retest", pass.name))?
            .survivors;
        if missed.is_empty() {
            let _ = std::fs::remove_dir_all(&retested);
        } else {
            run_pass(pass, jobs, &retested, &missed)?;
        }
    } else {
        // A full run supersedes an earlier retest.
        let _ = std::fs::remove_dir_all(&retested);
        run_pass(pass, jobs, &dir, &[])?;
    }
    Ok(())
}

/// A pass's outcomes: its full run's, with the survivors a complete retest judged again.
fn pass_outcomes(pass: &Pass, out: &Path) -> Result<Outcomes> {
    let dir = out.join(pass.name);
    let retested = dir.join("retest");
    let mut found = read_outcomes(&dir)
        .with_context(|| format!("pass {} has no outcomes: run it", pass.name))?;
    if let Ok(again) = read_outcomes(&retested) {
        // A retest stopped halfway has judged only some survivors: its counts are not
        // an outcome.
        let judged = again.caught + again.missed + again.timeout + again.unviable;
        if judged != found.missed {
            bail!(
                "the retest of pass {} judged {judged} of its {} survivors (interrupted?): \
                 run `cargo xtask mutants --retest` again",
                pass.name,
                found.missed
            );
        }
        // The survivors judged again: caught now, or still survivors.
        found.caught += again.caught;
        found.timeout += again.timeout;
        found.unviable += again.unviable;
        found.missed = again.missed;
        found.survivors = again.survivors;
    }
    Ok(found)
}

/// One cargo-mutants run of `pass` into `out`; of the mutants named in `only` alone when
/// it names any (a survivor's line from missed.txt: `FILE:LINE:COLUMN: replace …`).
fn run_pass(pass: &Pass, jobs: u32, out: &Path, only: &[String]) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["mutants", "--package", "shaper-common", "--no-shuffle"])
        .args(["--jobs", &jobs.to_string()])
        .arg("--output")
        .arg(out)
        .env("SHAPER_RACE_CASES", RACE_CASES)
        // A property that fails is reported at once: shrinking a mutant's failure to the
        // smallest case takes minutes and tells nothing here. (The test timeout is
        // cargo-mutants' own, five times the unmutated tests' time.)
        .env("PROPTEST_MAX_SHRINK_ITERS", "0")
        .current_dir(workspace_root());
    for file in pass.files {
        command.args(["--file", file]);
    }
    for target in pass.targets {
        command.arg(format!("--cargo-test-arg={target}"));
    }
    for mutant in only {
        // Matched against the whole name, as missed.txt has it (the package's directory
        // first).
        command.arg(format!("--re=^{}$", regex_syntax::escape(mutant)));
    }
    println!("[xtask] {command:?}");
    // cargo-mutants exits 2 when a mutant survives and 3 when one times out: the outcomes
    // say which, and the summary judges them. Anything else (4: the unmutated tests
    // failed) means no mutant was judged.
    let status = command.status().context("cannot run cargo mutants")?;
    if !matches!(status.code(), Some(0 | 2 | 3)) {
        bail!("cargo mutants failed ({status}) in pass {}", pass.name);
    }
    Ok(())
}

fn read_outcomes(out: &Path) -> Result<Outcomes> {
    let path = out.join("mutants.out/outcomes.json");
    let outcomes: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let count = |field: &str| outcomes[field].as_u64().unwrap_or(0);
    Ok(Outcomes {
        total: count("total_mutants"),
        caught: count("caught"),
        missed: count("missed"),
        timeout: count("timeout"),
        unviable: count("unviable"),
        survivors: std::fs::read_to_string(out.join("mutants.out/missed.txt"))
            .unwrap_or_default()
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(str::to_string)
            .collect(),
    })
}
