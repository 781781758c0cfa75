//! `cargo xtask mutants`: cargo-mutants over every file of shaper-common (the bucket, CoDel,
//! the meters, the hierarchy, flow isolation, the map layout) with the crate's own host
//! tests, so a change that breaks the arithmetic and still passes them is found. A full
//! run takes over an hour on two cores; CI runs `--in-diff` (diff.rs) on what changed.
//! Every pass starts from a fresh output directory, `target/mutants/<pass>/mutants.out`;
//! the summary (the caught share of viable mutants, timeouts apart, survivors) is printed
//! and written to `target/mutants/summary.md`; the survivors accepted, each with why, are
//! in xtask/mutants-accepted.txt.

mod diff;

pub use diff::{in_diff, judged_base};

use crate::{setup, workspace_root};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{fmt::Write as _, path::Path, process::Command};

/// One cargo-mutants run: the package, the files it mutates and leaves out (globs), and
/// the test targets it runs per mutant.
pub struct Pass {
    pub name: &'static str,
    package: &'static str,
    /// Empty: every file of the package.
    files: &'static [&'static str],
    exclude: &'static [&'static str],
    /// `cargo test` target selection; empty: all of the crate's tests.
    targets: &'static [&'static str],
}

/// The meter race test (thousands of thread hand-offs a case) runs only for the meters'
/// mutants: the other files' mutants meet it through the property tests' arithmetic.
/// Together the two passes mutate every file of shaper-common.
pub const PASSES: &[Pass] = &[
    Pass {
        name: "arithmetic",
        package: "shaper-common",
        files: &[],
        exclude: &["shaper-common/src/meter.rs"],
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
        package: "shaper-common",
        files: &["shaper-common/src/meter.rs"],
        exclude: &[],
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
    timeouts: Vec<String>,
}

/// Runs every pass (or only the one named `only`) and judges what it ran: never an
/// earlier run's outcomes. With `retest`, a pass runs only the mutants its last full run
/// missed (after tests were added to kill them), and its outcome is that full run's with
/// those mutants judged again.
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
    let mut judged = Vec::new();
    for pass in PASSES
        .iter()
        .filter(|pass| only.is_none_or(|name| name == pass.name))
    {
        run_or_retest(pass, jobs, &out, retest)?;
        let found = pass_outcomes(pass, &out)?;
        all.add(found);
        judged.push(pass.name);
    }
    let summary = summarise(&all, &judged)?;
    print!("{summary}");
    std::fs::write(out.join("summary.md"), &summary)?;
    let share = all.caught_share();
    if share < TARGET {
        bail!(
            "{:.1} % of viable mutants caught, below {:.0} %",
            share * 100.0,
            TARGET * 100.0
        );
    }
    Ok(())
}

impl Outcomes {
    fn add(&mut self, other: Outcomes) {
        self.total += other.total;
        self.caught += other.caught;
        self.missed += other.missed;
        self.timeout += other.timeout;
        self.unviable += other.unviable;
        self.survivors.extend(other.survivors);
        self.timeouts.extend(other.timeouts);
    }

    fn viable(&self) -> u64 {
        self.caught + self.missed + self.timeout
    }

    /// Caught over viable: a mutant that timed out is not counted as caught (its tests
    /// hung; whether they would have failed is not known).
    fn caught_share(&self) -> f64 {
        self.caught as f64 / self.viable().max(1) as f64
    }
}

/// The run's summary: counts, the caught share, and every timeout and survivor by name
/// (a survivor not in xtask/mutants-accepted.txt marked so).
fn summarise(all: &Outcomes, passes: &[&str]) -> Result<String> {
    if all.viable() == 0 {
        bail!("cargo mutants tested no viable mutant");
    }
    let accepted = diff::Accepted::read()?;
    let mut summary = format!(
        "cargo-mutants {} on shaper-common (passes {}): {} mutants, {} unviable; of the {} \
         viable {} caught, {} missed, {} timed out (not counted as caught): {:.1} % caught \
         (target {:.0} %)\n",
        setup::CARGO_MUTANTS_VERSION,
        passes.join(", "),
        all.total,
        all.unviable,
        all.viable(),
        all.caught,
        all.missed,
        all.timeout,
        all.caught_share() * 100.0,
        TARGET * 100.0
    );
    for timeout in &all.timeouts {
        writeln!(summary, "- timed out: {timeout}")?;
    }
    for survivor in &all.survivors {
        let mark = if accepted.covers(survivor) {
            ""
        } else {
            " (not accepted)"
        };
        writeln!(summary, "- survived{mark}: {survivor}")?;
    }
    Ok(summary)
}

/// Runs `pass` in full, or (`retest`) again on the survivors of its last full run.
fn run_or_retest(pass: &Pass, jobs: u32, out: &Path, retest: bool) -> Result<()> {
    let dir = out.join(pass.name);
    let retested = dir.join("retest");
    if retest {
        let missed = read_outcomes(&dir)
            .with_context(|| format!("pass {} has no full run to retest", pass.name))?
            .survivors;
        let _ = std::fs::remove_dir_all(&retested);
        if !missed.is_empty() {
            run_pass(pass, jobs, &retested, &missed, &[])?;
        }
    } else {
        // From a fresh directory: nothing of an earlier run (its retest included) can be
        // read as this run's.
        let _ = std::fs::remove_dir_all(&dir);
        run_pass(pass, jobs, &dir, &[], &[])?;
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
        found.timeouts.extend(again.timeouts);
    }
    Ok(found)
}

/// One cargo-mutants run of `pass` into `out`; of the mutants named in `only` alone when
/// it names any (a survivor's line from missed.txt: `FILE:LINE:COLUMN: replace …`), with
/// `extra` arguments (`--in-diff FILE`).
fn run_pass(pass: &Pass, jobs: u32, out: &Path, only: &[String], extra: &[String]) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command
        .args(["mutants", "--package", pass.package, "--no-shuffle"])
        .args(extra)
        .args(["--jobs", &jobs.to_string()])
        .arg("--output")
        .arg(out)
        .env("SHAPER_RACE_CASES", RACE_CASES)
        // A property that fails is reported at once: shrinking a mutant's failure to the
        // smallest case takes minutes and tells nothing here. (The test timeout is
        // cargo-mutants' own, five times the unmutated tests' time.)
        .env("PROPTEST_MAX_SHRINK_ITERS", "0")
        .current_dir(workspace_root());
    if pass.package == "shaper" {
        // The library's pure modules need no eBPF object (see shaper/build.rs).
        command.env("AYA_BUILD_SKIP", "1");
    }
    for file in pass.files {
        command.args(["--file", file]);
    }
    for file in pass.exclude {
        command.args(["--exclude", file]);
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
        survivors: names_in(&out.join("mutants.out/missed.txt")),
        timeouts: names_in(&out.join("mutants.out/timeout.txt")),
    })
}

/// The mutants a cargo-mutants list file names, one a line.
fn names_in(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(str::to_string)
        .collect()
}
