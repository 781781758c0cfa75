//! Running shaper commands from the tests. A command in a lab namespace is a method of
//! that [`Netns`]: [`Netns::shaper`] for any command, [`Netns::class_add`] and
//! [`Netns::stats_row`] for the two every test file needs; [`shaper`] runs one as is,
//! whatever its exit, for the tests of failures.

use crate::{
    process::{output_bounded, shaper_bin, COMMAND_LIMIT},
    topology::{Lab, Netns},
};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::process::{Command, Output};

/// Every user-facing command; each has a man page and a completion.
pub const COMMANDS: &[&str] = &[
    "attach",
    "detach",
    "upgrade",
    "class",
    "stats",
    "status",
    "batch",
    "apply",
    "export",
    "daemon",
    "global",
    "completions",
];

/// The subcommands of `shaper class`, which have pages of their own.
pub const CLASS_COMMANDS: &[&str] = &["add", "change", "del", "list"];

/// The subcommands of `shaper global`.
pub const GLOBAL_COMMANDS: &[&str] = &["publish", "allocate"];

/// The man pages `shaper manpages` writes (without the section suffix).
pub fn man_page_names() -> Vec<String> {
    let commands = COMMANDS.iter().map(|command| format!("shaper-{command}"));
    let class_commands = CLASS_COMMANDS
        .iter()
        .map(|command| format!("shaper-class-{command}"));
    let global_commands = GLOBAL_COMMANDS
        .iter()
        .map(|command| format!("shaper-global-{command}"));
    std::iter::once("shaper".to_string())
        .chain(commands)
        .chain(class_commands)
        .chain(global_commands)
        .collect()
}

/// `shaper ARGS` (no `--netns` added), whatever its exit status. Panics only when shaper
/// cannot be run or outlives [`COMMAND_LIMIT`].
pub fn shaper(args: &[&str]) -> Output {
    output_bounded(Command::new(shaper_bin()).args(args), COMMAND_LIMIT)
        .unwrap_or_else(|e| panic!("running shaper failed: {e:#}"))
}

/// A command's stdout as text.
pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).to_string()
}

/// A command's stderr as text.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

impl Netns {
    /// `shaper --netns NS ARGS`, whatever its exit status.
    pub fn shaper_output(&self, args: &[&str]) -> Output {
        self.shaper_output_with(&[], args)
    }

    /// [`Netns::shaper_output`] with `vars` added to shaper's environment (the variable
    /// that picks shape's backend, for one command without touching the test process's).
    pub fn shaper_output_with(&self, vars: &[(&str, &str)], args: &[&str]) -> Output {
        let mut command = Command::new(shaper_bin());
        command
            .args(["--netns", self.name.as_str()])
            .args(args)
            .envs(vars.iter().copied());
        output_bounded(&mut command, COMMAND_LIMIT)
            .unwrap_or_else(|e| panic!("running shaper failed: {e:#}"))
    }

    /// `shaper --netns NS ARGS`: its stdout, or an error with its stderr when it exits
    /// non-zero.
    pub fn shaper(&self, args: &[&str]) -> Result<String> {
        let output = self.shaper_output(args);
        if !output.status.success() {
            bail!(
                "shaper --netns {} {} failed: {}",
                self.name,
                args.join(" "),
                stderr(&output).trim()
            );
        }
        Ok(stdout(&output))
    }

    /// [`Netns::shaper`] of a `--json` command, its output parsed.
    pub fn shaper_json(&self, args: &[&str]) -> Result<Value> {
        let text = self.shaper(args)?;
        serde_json::from_str(&text)
            .with_context(|| format!("shaper {} printed no JSON: {text}", args.join(" ")))
    }

    /// `shaper attach DEV OPTIONS…` in this namespace.
    pub fn attach(&self, dev: &str, options: &[&str]) -> Result<String> {
        // Loading the program takes the verifier about 2.4 s on the lab's machine: tests
        // that attach in several labs at once queue on the state lock longer than its
        // default 10 s wait.
        self.shaper(&[&["--wait", "60", "attach", dev][..], options].concat())
    }

    /// `shaper class add NAME --dev DEV OPTIONS…` in this namespace (`--rate` is one of
    /// the options).
    pub fn class_add(&self, name: &str, dev: &str, options: &[&str]) -> Result<String> {
        self.shaper(&[&["class", "add", name, "--dev", dev][..], options].concat())
    }

    /// `status --json`'s `split_through` for `dev`'s ingress attachment: the ifb it splits
    /// aggregates through, or None.
    pub fn split_through(&self, dev: &str) -> Result<Option<String>> {
        let rows: Value = serde_json::from_str(&self.shaper(&["status", "--json"])?)?;
        Ok(rows
            .as_array()
            .into_iter()
            .flatten()
            .find(|row| row["dev"] == dev && row["direction"] == "ingress")
            .and_then(|row| row["split_through"].as_str().map(str::to_string)))
    }

    /// `shaper stats --json` in this namespace: one row per class.
    pub fn stats(&self) -> Result<Vec<Value>> {
        Ok(self
            .shaper_json(&["stats", "--json"])?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Every attachment `shaper status --json` shows here: (interface, direction, program
    /// id), sorted.
    pub fn attachments(&self) -> Result<Vec<(String, String, u64)>> {
        let rows = self.shaper_json(&["status", "--json"])?;
        let mut found: Vec<(String, String, u64)> = rows
            .as_array()
            .context("status is a list")?
            .iter()
            .map(|row| {
                (
                    row["dev"].as_str().unwrap_or_default().to_string(),
                    row["direction"].as_str().unwrap_or_default().to_string(),
                    row["program_id"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// The first row of `shaper status --json` here (the lab's tests attach one interface
    /// and direction).
    pub fn status_row(&self) -> Result<Value> {
        let rows = self.shaper_json(&["status", "--json"])?;
        Ok(rows[0].clone())
    }

    /// Waits (at most `within`) until class `name` has counted a packet: the traffic a test
    /// started flows through it. What a test times an action from, instead of a sleep
    /// that guesses when the traffic began.
    pub fn wait_for_class_traffic(&self, name: &str, within: std::time::Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let row = self.stats_row(name)?;
            if counter(&row, "passed_packets") + counter(&row, "dropped_packets") > 0 {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "class {name} in {} saw no traffic within {within:?}",
                    self.name
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The `stats --json` row of class `name` (its settings and counters).
    pub fn stats_row(&self, name: &str) -> Result<Value> {
        self.stats()?
            .into_iter()
            .find(|row| row["name"] == name)
            .with_context(|| format!("no class {name} in the stats of {}", self.name))
    }
}

/// A counter of a `stats --json` row (`passed_packets`, `dropped_bytes`, …); panics,
/// naming it, when the row has no such number.
pub fn counter(row: &Value, field: &str) -> u64 {
    row[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {field} in {row}"))
}

impl Lab {
    /// A new lab with shaper attached to the router's `dev` and one class there, `c`,
    /// with `options` (`--rate` among them; a `--direction` there is also the direction
    /// attached, egress otherwise).
    pub fn with_router_class(dev: &str, options: &[&str]) -> Result<Self> {
        let lab = Self::new()?;
        let direction = options
            .iter()
            .position(|option| *option == "--direction")
            .and_then(|index| options.get(index + 1))
            .copied()
            .unwrap_or("egress");
        lab.router.attach(dev, &["--direction", direction])?;
        lab.router.class_add("c", dev, options)?;
        Ok(lab)
    }
}

/// `class add` options of a shape class at `rate` for everything to the lab's server (the
/// bulk class of the latency tests and the bench).
pub fn shape_to_server(rate: &str) -> [&str; 6] {
    [
        "--rate",
        rate,
        "--dst",
        "198.18.2.2/32",
        "--action",
        "shape",
    ]
}
