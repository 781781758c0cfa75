//! `cargo xtask mutants --in-diff BASE`: cargo-mutants on what changed since BASE in
//! shaper-common and in the core library's pure modules, failing on a surviving mutant
//! that xtask/mutants-accepted.txt does not accept. `cargo xtask test` runs it against
//! the commit xtask/mutants-judged-at names (the last one whose changes were judged so),
//! so CI judges every change made since.

use super::{read_outcomes, run_pass, Outcomes, Pass};
use crate::{git, setup, workspace_root};
use anyhow::{bail, Context as _, Result};
use std::{fmt::Write as _, fs};

/// The core library's modules with no kernel in them, each judged by the library's unit
/// tests (no root, no eBPF object).
const PURE_MODULES: &[&str] = &[
    "shaper/src/units.rs",
    "shaper/src/rules.rs",
    "shaper/src/actions.rs",
    "shaper/src/class_input/check.rs",
    "shaper/src/class_input/combine.rs",
    "shaper/src/class_input/fields.rs",
    "shaper/src/config/parse.rs",
    "shaper/src/config/plan.rs",
    "shaper/src/global/tracker.rs",
    "shaper/src/global/answer.rs",
    "shaper/src/cni/limits.rs",
    "shaper/src/qdisc/netlink/options.rs",
];

/// The passes of an in-diff run, each given the diff of its own files.
const DIFF_PASSES: &[(Pass, &[&str])] = &[
    (
        Pass {
            name: "in-diff-common",
            package: "shaper-common",
            files: &[],
            exclude: &[],
            targets: &[],
        },
        &["shaper-common/src"],
    ),
    (
        Pass {
            name: "in-diff-library",
            package: "shaper",
            files: PURE_MODULES,
            exclude: &[],
            targets: &["--lib"],
        },
        PURE_MODULES,
    ),
];

/// The file naming the last commit whose changes were judged by an in-diff run.
const JUDGED_AT: &str = "xtask/mutants-judged-at";
/// The surviving mutants accepted, each with why.
const ACCEPTED: &str = "xtask/mutants-accepted.txt";

/// The base `cargo xtask test` judges from: the commit in [`JUDGED_AT`]; where this
/// checkout lacks it (a shallow clone), the parent of HEAD, said.
pub fn judged_base() -> Result<String> {
    let text = fs::read_to_string(workspace_root().join(JUDGED_AT))
        .with_context(|| format!("cannot read {JUDGED_AT}"))?;
    let commit = text
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .with_context(|| format!("{JUDGED_AT} names no commit"))?
        .to_string();
    if git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]).is_ok() {
        Ok(commit)
    } else {
        println!("[xtask] mutants: {commit} ({JUDGED_AT}) is not in this checkout: judging HEAD~1");
        Ok("HEAD~1".to_string())
    }
}

/// Judges the mutants of what changed between `base` and the working tree; with
/// `record`, a run that passes on a tree with nothing uncommitted in the judged files
/// writes HEAD into [`JUDGED_AT`] (to be committed).
pub fn in_diff(base: &str, jobs: u32, record: bool) -> Result<()> {
    let out = workspace_root().join("target/mutants/in-diff");
    let _ = fs::remove_dir_all(&out);
    fs::create_dir_all(&out)?;
    let mut all = Outcomes::default();
    let mut judged = Vec::new();
    for (pass, paths) in DIFF_PASSES {
        let mut args = vec!["diff", "--no-color", base, "--"];
        args.extend(paths.iter());
        let diff = git(&args)?;
        if diff.trim().is_empty() {
            println!(
                "[xtask] mutants --in-diff {base}: nothing changed in {}",
                pass.package
            );
            continue;
        }
        setup::cargo_mutants()?;
        let patch = out.join(format!("{}.diff", pass.name));
        fs::write(&patch, &diff)?;
        let dir = out.join(pass.name);
        let extra = ["--in-diff".to_string(), patch.display().to_string()];
        run_pass(pass, jobs, &dir, &[], &extra)?;
        // No mutant in the changed lines (comments, a removal): no outcomes written.
        if let Ok(found) = read_outcomes(&dir) {
            all.add(found);
        }
        judged.push(pass.package);
    }
    let accepted = Accepted::read()?;
    let new = report(base, &judged, &all, &accepted, &out)?;
    if new > 0 {
        bail!(
            "{new} mutant(s) of what changed since {base} survived the tests (NEW above): add \
             a test that kills each, or accept it with why in {ACCEPTED}"
        );
    }
    if record {
        record_head()?;
    }
    Ok(())
}

/// Prints and writes the run's summary (every timeout and survivor by name, a survivor
/// not accepted marked NEW); the count of those.
fn report(
    base: &str,
    judged: &[&str],
    all: &Outcomes,
    accepted: &Accepted,
    out: &std::path::Path,
) -> Result<usize> {
    let new = all
        .survivors
        .iter()
        .filter(|name| !accepted.covers(name))
        .count();
    let mut summary = format!(
        "cargo-mutants --in-diff {base} on {}: {} mutants, {} unviable, {} caught, {} \
         missed ({new} of them new), {} timed out\n",
        if judged.is_empty() {
            "nothing".to_string()
        } else {
            judged.join(", ")
        },
        all.total,
        all.unviable,
        all.caught,
        all.missed,
        all.timeout
    );
    for timeout in &all.timeouts {
        writeln!(summary, "- timed out: {timeout}")?;
    }
    for survivor in &all.survivors {
        let mark = if accepted.covers(survivor) {
            " (accepted)"
        } else {
            " NEW"
        };
        writeln!(summary, "- survived{mark}: {survivor}")?;
    }
    print!("{summary}");
    fs::write(out.join("summary.md"), &summary)?;
    Ok(new)
}

/// Writes HEAD into [`JUDGED_AT`], once the judged files have nothing uncommitted.
fn record_head() -> Result<()> {
    let mut args = vec!["diff", "--no-color", "HEAD", "--", "shaper-common/src"];
    args.extend(PURE_MODULES.iter());
    if !git(&args)?.trim().is_empty() {
        bail!("the judged files have uncommitted changes: commit them, then run again");
    }
    let head = git(&["rev-parse", "HEAD"])?;
    fs::write(
        workspace_root().join(JUDGED_AT),
        format!(
            "# The last commit whose changes `cargo xtask mutants --in-diff` judged \
             (written by --record).\n{}\n",
            head.trim()
        ),
    )?;
    println!("[xtask] {JUDGED_AT}: {}", head.trim());
    Ok(())
}

/// The accepted survivors: lines `FILE: MUTATION in FUNCTION # why` (cargo-mutants' name
/// without its line and column; `*` for any mutation or a trailing `::*` for any function
/// of a type).
pub struct Accepted {
    entries: Vec<(String, String, String)>,
}

impl Accepted {
    pub fn read() -> Result<Self> {
        let text = fs::read_to_string(workspace_root().join(ACCEPTED))
            .with_context(|| format!("cannot read {ACCEPTED}"))?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Result<Self> {
        let mut entries = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, why) = line
                .split_once(" # ")
                .with_context(|| format!("{ACCEPTED}: no ` # why` in {line:?}"))?;
            ensure_reason(why, line)?;
            entries.push(
                split_name(name).with_context(|| format!("{ACCEPTED}: cannot read {line:?}"))?,
            );
        }
        Ok(Self { entries })
    }

    /// Whether the survivor `name` (as cargo-mutants lists it) is accepted.
    pub fn covers(&self, name: &str) -> bool {
        let Some((file, mutation, function)) = split_name(name) else {
            return false;
        };
        self.entries.iter().any(|(f, m, fun)| {
            let function_matches = match fun.strip_suffix("::*") {
                Some(owner) => function.starts_with(&format!("{owner}::")),
                None => function == *fun || function.ends_with(&format!("::{fun}")),
            };
            *f == file && (m == "*" || *m == mutation) && function_matches
        })
    }
}

fn ensure_reason(why: &str, line: &str) -> Result<()> {
    if why.trim().len() < 10 {
        bail!("{ACCEPTED}: say why {line:?} is accepted");
    }
    Ok(())
}

/// A mutant's file, mutation and function: `shaper-common/src/bucket.rs:80:5: replace |
/// with ^ in tagged` (line and column optional).
/// A whole function's body replaced is named without ` in `: `replace plan -> Result<Plan>
/// with Ok(Default::default())`; its function is the word after `replace`.
fn split_name(name: &str) -> Option<(String, String, String)> {
    let (file, rest) = name.split_once(": ")?;
    let file = file.split(':').next()?.to_string();
    let (mutation, function) = match rest.rsplit_once(" in ") {
        Some((mutation, function)) => (mutation, function),
        None => (rest, rest.strip_prefix("replace ")?.split(' ').next()?),
    };
    Some((
        file,
        mutation.trim().to_string(),
        function.trim().to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_accepted_entry_covers_its_mutant_wherever_it_moved() {
        let accepted = Accepted::parse(
            "# comment\n\
             shaper-common/src/bucket.rs: replace | with ^ in tagged # equivalent: disjoint bits\n\
             shaper-common/src/hierarchy.rs: * in TreeModel::* # the host model, not the program\n",
        )
        .unwrap();
        assert!(accepted.covers("shaper-common/src/bucket.rs:80:5: replace | with ^ in tagged"));
        assert!(accepted.covers("shaper-common/src/bucket.rs:95:9: replace | with ^ in tagged"));
        assert!(!accepted.covers("shaper-common/src/bucket.rs:80:5: replace | with & in tagged"));
        let body = Accepted::parse(
            "shaper/src/config/plan.rs: replace plan -> Result<Plan> with Ok(Default::default()) # only the lab tests reach it\n",
        )
        .unwrap();
        assert!(body.covers(
            "shaper/src/config/plan.rs:177:5: replace plan -> Result<Plan> with Ok(Default::default())"
        ));
        assert!(!body.covers(
            "shaper/src/config/plan.rs:177:5: replace plan -> Result<Plan> with Err(anyhow!(\"x\"))"
        ));
        assert!(!accepted.covers("shaper-common/src/codel.rs:80:5: replace | with ^ in tagged"));
        assert!(accepted.covers(
            "shaper-common/src/hierarchy.rs:210:9: replace += with -= in TreeModel::borrow"
        ));
        assert!(!accepted
            .covers("shaper-common/src/hierarchy.rs:56:9: replace < with <= in fair_share"));
        assert!(
            Accepted::parse("shaper-common/src/bucket.rs: replace | with ^ in tagged\n").is_err()
        );
        assert!(
            Accepted::parse("shaper-common/src/bucket.rs: replace | with ^ in tagged # ok\n")
                .is_err()
        );
    }
}
