//! `cargo xtask bench --vm`: the bench's peers section in each kernel's guest, its figures
//! kept under target/vm and published by the bench driver on this host.

use crate::{dist, use_binaries_of, workspace_root};
use anyhow::{bail, Context as _, Result};
use std::process::Command;

/// `bench --vm`: the peers section in each kernel's guest, each guest's figures kept under
/// target/vm, then published (docs/BENCHMARKS.md's section, its plot) and held to the
/// targets by the bench driver on this host.
/// Which of the peers section's rows `bench --vm` runs.
pub enum VmRows {
    /// Every row: both sections published.
    All,
    /// The flow isolation rows: their section published.
    Isolation,
    /// The held-out cells: their section published.
    HeldOut,
    /// The rows whose setup contains the text: a quick look, not published.
    Named(String),
}

pub fn bench_vm(kernels: &[String], rows: VmRows) -> Result<()> {
    let prefix = match &rows {
        VmRows::All => "peers",
        VmRows::Isolation => "isolation",
        VmRows::HeldOut => "heldout",
        // A quick look (its tables were printed by the guest): kept apart from the
        // published figures.
        VmRows::Named(_) => "rows",
    };
    match rows {
        VmRows::All => {}
        // Every isolation row's setup starts so (`shaper-bench`'s `peer_setup`).
        VmRows::Isolation => super::only_peers_rows("isolation: ".to_string()),
        // And every held-out row's with "held-out: " (`shaper-bench`'s heldout::PREFIX).
        VmRows::HeldOut => super::only_peers_rows("held-out: ".to_string()),
        VmRows::Named(text) => super::only_peers_rows(text),
    }
    let commit = commit_measured()?;
    let outcomes = super::vm_test(kernels, super::Plan::Bench)?;
    let dir = workspace_root().join("target/vm");
    for outcome in &outcomes {
        let path = dir.join(format!("{prefix}-{}.json", outcome.kernel));
        let mut report: serde_json::Value = serde_json::from_str(&outcome.report.join("\n"))
            .with_context(|| format!("the guest of {} printed no JSON report", outcome.kernel))?;
        // What the guest cannot know: the build it ran and how it was emulated.
        report["commit"] = commit.clone().into();
        report["accel"] = outcome.accel.into();
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
        println!("[xtask] {}'s figures: {}", outcome.kernel, path.display());
    }
    if prefix == "rows" {
        return Ok(());
    }
    // Every kernel measured so far (one at a time is fine: `--kernel 6.12`, then 6.1),
    // newest kernel first; each table carries its kernel and date, and the bench takes
    // each kernel's newest isolation and held-out rows from the files that have them.
    let mut files: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| {
                ["peers-", "isolation-", "heldout-"]
                    .iter()
                    .any(|prefix| n.starts_with(prefix))
                    && n.ends_with(".json")
            })
        })
        .map(|path| path.display().to_string())
        .collect();
    files.sort();
    files.reverse();
    let binaries = use_binaries_of(dist::Profile::Dev);
    let mut command = Command::new(binaries.join("shaper-bench"));
    command
        .arg("--publish-peers")
        .arg(files.join(","))
        .arg("--report")
        .arg(workspace_root().join("docs/BENCHMARKS.md"))
        .current_dir(workspace_root());
    println!("[xtask] {command:?}");
    let status = command.status().context("cannot run shaper-bench")?;
    if !status.success() {
        bail!("the peers bench missed its targets (above)");
    }
    Ok(())
}

/// The commit the guests run: HEAD, with `-dirty` when the tree has changes not committed
/// (such figures are for a look, and `--publish-peers` refuses to mix them with others).
fn commit_measured() -> Result<String> {
    let head = crate::git(&["rev-parse", "--short=12", "HEAD"])?
        .trim()
        .to_string();
    let dirty = !crate::git(&["status", "--porcelain", "--untracked-files=no"])?
        .trim()
        .is_empty();
    Ok(if dirty { format!("{head}-dirty") } else { head })
}
