//! Configuration files for `apply` and the daemon: reading one (every problem printed on
//! its own line, one line summing up as the error) and describing a plan.

use anyhow::{Context as _, Result};
use shaper::{
    config::{self, Desired, Plan},
    error::{runtime, usage},
};

/// Reads a configuration file (or standard input for `-`) and checks all of it.
pub(crate) fn load(file: &str) -> Result<Desired> {
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
pub(crate) fn describe(plan: &Plan) -> Vec<String> {
    let mut lines: Vec<String> = plan.steps.iter().map(|step| step.to_string()).collect();
    for missing in &plan.missing {
        lines.push(format!("waiting for {missing}: not present"));
    }
    lines
}
