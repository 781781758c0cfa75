//! `cargo xtask setup | demo | test | bench | vm-test | mutants | man | dist`: everything that
//! orchestrates.

mod demo;
mod dist;
mod mutants;
mod setup;
mod vm;

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

#[derive(Parser)]
#[command(about = "shaper's project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent).
    Setup,
    /// Set up, build, and show shaper policing UDP and TCP on a built-in lab.
    Demo,
    /// Set up, check formatting and lints, run unit, property, BPF test-run and
    /// end-to-end tests.
    Test,
    /// Benchmarks side by side with tc: per-packet cost, memory, control plane.
    /// Writes docs/BENCHMARKS.md and target/bench.json.
    Bench {
        /// A smaller, faster run (CI runs it so the bench cannot rot).
        #[arg(long)]
        quick: bool,
        /// Where to write every figure as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Latency under load beside CAKE, fq_codel, tbf and fq, inside Debian 12's
        /// kernels under qemu (they have those qdiscs; this machine's kernel does not):
        /// writes its section of docs/BENCHMARKS.md and checks shaper against CAKE.
        #[arg(long)]
        vm: bool,
        /// With --vm: a kernel (6.1, 6.12 or a linux-image .deb; repeatable; default both).
        #[arg(long, requires = "vm")]
        kernel: Vec<String>,
        /// With --vm: only the rows whose setup contains this, e.g. "40 ms RTT, 4 cubic"
        /// (a quick look: printed and kept in target/vm/rows-KERNEL.json, not published).
        #[arg(long, requires = "vm")]
        rows: Option<String>,
        /// With --vm: only the flow isolation rows (beside CAKE and htb + fq_codel), kept
        /// in target/vm/isolation-KERNEL.json and published as their own section.
        #[arg(long, requires = "vm", conflicts_with = "rows")]
        isolation: bool,
        /// With --vm: only the held-out cells on equal terms (shaper's defaults and
        /// `--burst 32k`, CAKE's defaults and the path's `rtt`), kept in
        /// target/vm/heldout-KERNEL.json and published as their own section.
        #[arg(long, requires = "vm", conflicts_with_all = ["rows", "isolation"])]
        held_out: bool,
    },
    /// Mutation testing with cargo-mutants: every file of shaper-common (over an hour),
    /// failing below 90 % caught; or, with --in-diff, what changed since a commit in
    /// shaper-common and the library's pure modules (CI's, from xtask/mutants-judged-at),
    /// failing on a survivor xtask/mutants-accepted.txt does not accept.
    Mutants {
        /// Mutants built and tested at once.
        #[arg(long, default_value_t = 2)]
        jobs: u32,
        /// Run only this pass (arithmetic or meter).
        #[arg(long, conflicts_with = "in_diff")]
        only: Option<String>,
        /// Judge again only the mutants the last full run of a pass missed.
        #[arg(long, conflicts_with = "in_diff")]
        retest: bool,
        /// Only the mutants of what changed since this commit (the working tree's changes
        /// included).
        #[arg(long, value_name = "BASE")]
        in_diff: Option<String>,
        /// With --in-diff: when it passes, write HEAD into xtask/mutants-judged-at.
        #[arg(long, requires = "in_diff")]
        record: bool,
    },
    /// The lab tests that matter most for a kernel, inside Debian's own kernels (5.10,
    /// 6.1 and 6.12, pinned packages of the Debian registry) under qemu: KVM when it
    /// boots, TCG otherwise.
    VmTest {
        /// A kernel: 5.10, 6.1, 6.12, or the path of a linux-image .deb (repeatable;
        /// default all three).
        #[arg(long)]
        kernel: Vec<String>,
        /// CI's share of the plan (what `cargo xtask test` runs): every program variant
        /// loaded, flow isolation, attach, policing and detach in the kernel's mode, DSCP
        /// marks, one shaped Cubic flow, the CNI plugin, the floor's refusal.
        #[arg(long)]
        quick: bool,
        /// Only the plan's tests whose name contains this (kernels with none are not
        /// booted).
        #[arg(long)]
        test: Option<String>,
    },
    /// Write man pages for every shaper command into target/man (from the clap
    /// definitions; `man -l target/man/shaper.8`).
    Man,
    /// Build the Debian package (target/debian/shaper_VERSION-1_ARCH.deb): binaries,
    /// unit, inert conffile, man pages, completions, README and licences.
    Dist,
}

fn main() {
    if let Err(error) = run(Cli::parse().task) {
        eprintln!("xtask: {error:#}");
        std::process::exit(1);
    }
}

fn run(task: Task) -> Result<()> {
    with_cargo_bin_on_path();
    match task {
        Task::Setup => setup::setup(),
        Task::Demo => {
            require_root("demo")?;
            setup::setup()?;
            build_shaper()?;
            demo::run(&shaper_binary())
        }
        Task::Test => {
            require_root("test")?;
            setup::setup()?;
            test()
        }
        Task::Bench {
            quick,
            json,
            vm,
            kernel,
            rows,
            isolation,
            held_out,
        } => {
            require_root("bench")?;
            setup::setup()?;
            if vm {
                let rows = if isolation {
                    vm::VmRows::Isolation
                } else if held_out {
                    vm::VmRows::HeldOut
                } else {
                    rows.map_or(vm::VmRows::All, vm::VmRows::Named)
                };
                vm::bench_vm(&kernel, rows)
            } else {
                bench(quick, json)
            }
        }
        Task::Mutants {
            jobs,
            only,
            retest,
            in_diff,
            record,
        } => {
            setup::setup()?;
            match in_diff {
                Some(base) => mutants::in_diff(&base, jobs, record),
                None => mutants::run(jobs, only.as_deref(), retest),
            }
        }
        Task::VmTest {
            kernel,
            quick,
            test,
        } => {
            require_root("vm-test")?;
            setup::setup()?;
            if let Some(name) = test {
                vm::only_tests_named(name);
            }
            let plan = if quick { vm::Plan::Ci } else { vm::Plan::Full };
            vm::vm_test(&kernel, plan).map(|_| ())
        }
        Task::Man => {
            setup::setup()?;
            build_shaper()?;
            man()
        }
        Task::Dist => {
            setup::setup()?;
            dist::dist(dist::Profile::Release).map(|_| ())
        }
    }
}

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// cargo-installed tools (bpf-linker) must be found by the eBPF build.
fn with_cargo_bin_on_path() {
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Ok(cargo_home) = home {
        let bin = cargo_home.join("bin");
        let path = std::env::var("PATH").unwrap_or_default();
        if !path.split(':').any(|p| bin.as_path() == Path::new(p)) {
            std::env::set_var("PATH", format!("{}:{path}", bin.display()));
        }
    }
}

fn require_root(task: &str) -> Result<()> {
    if !nix_is_root() {
        bail!(
            "`cargo xtask {task}` needs root: it creates network namespaces and loads BPF programs"
        );
    }
    Ok(())
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

fn cargo(args: &[&str]) -> Result<()> {
    println!("[xtask] cargo {}", args.join(" "));
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(workspace_root())
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        bail!("cargo {} failed", args.join(" "));
    }
    Ok(())
}

/// `git ARGS` in the workspace: its stdout, or an error with its stderr.
/// Files in the work tree that git does not track (ignored ones included), outside
/// target/.
fn files_left_in_tree() -> Result<Vec<String>> {
    let status = git(&[
        "status",
        "--porcelain",
        "--ignored",
        "--untracked-files=all",
    ])?;
    Ok(status
        .lines()
        .filter_map(|line| line.strip_prefix("?? ").or(line.strip_prefix("!! ")))
        .filter(|path| !path.starts_with("target/"))
        .map(String::from)
        .collect())
}

pub fn git(args: &[&str]) -> Result<String> {
    let output = Command::new("git")
        .args(args)
        .current_dir(workspace_root())
        .output()
        .context("cannot run git")?;
    if !output.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The delay line's executable (tests/src/bin/delay_line.rs).
const DELAY_LINE: &str = "shaper-delay-line";

fn shaper_binary() -> PathBuf {
    workspace_root()
        .join(dist::Profile::Dev.dir())
        .join("shaper")
}

/// Points the lab and the bench at the shaper and the delay line of `profile`'s build
/// directory (unset, the lab would build the delay line itself, with other features,
/// under the tests: 20 s of compiling in CI, beside a measurement); returns that
/// directory.
fn use_binaries_of(profile: dist::Profile) -> PathBuf {
    let dir = workspace_root().join(profile.dir());
    std::env::set_var("SHAPER_BIN", dir.join("shaper"));
    std::env::set_var("SHAPER_DELAY_LINE_BIN", dir.join(DELAY_LINE));
    dir
}

fn build_shaper() -> Result<()> {
    cargo(&["build", "--package", "shaper-cli"])
}

/// Builds shaper and the bench driver and runs it. The full run uses release builds and
/// publishes docs/BENCHMARKS.md; the quick run (CI's smoke test) reuses the debug builds
/// the tests just made and reports to target/, leaving the published report alone.
fn bench(quick: bool, json: Option<PathBuf>) -> Result<()> {
    let profile = ["--profile", bench_profile(quick).name()];
    cargo(&[&["build"][..], &profile, &["--package", "shaper-cli"]].concat())?;
    cargo(&[&["build"][..], &profile, BENCH_BINARIES].concat())?;
    run_bench(quick, json)
}

/// The quick run uses the debug builds, the full run release builds.
fn bench_profile(quick: bool) -> dist::Profile {
    if quick {
        dist::Profile::Dev
    } else {
        dist::Profile::Release
    }
}

/// Runs the bench driver of its profile's build directory against the shaper there.
/// `cargo xtask test` calls it with the driver its lab-test build made (integration tests
/// build the package's binaries), since `cargo run` would resolve the features without
/// the tests' dev-dependencies and build shaper and its eBPF object once more (a minute).
fn run_bench(quick: bool, json: Option<PathBuf>) -> Result<()> {
    let root = workspace_root();
    let json = json.unwrap_or_else(|| root.join("target/bench.json"));
    let report = if quick {
        root.join("target/BENCHMARKS-quick.md")
    } else {
        root.join("docs/BENCHMARKS.md")
    };
    let dir = use_binaries_of(bench_profile(quick));
    let driver = dir.join("shaper-bench");
    let mut command = Command::new(&driver);
    if quick {
        command.arg("--quick");
    }
    command
        .arg("--json")
        .arg(&json)
        .arg("--report")
        .arg(&report)
        .current_dir(&root);
    println!("[xtask] {command:?}");
    let status = command
        .status()
        .with_context(|| format!("cannot run {}", driver.display()))?;
    if !status.success() {
        bail!("{} failed", driver.display());
    }
    if !quick {
        // The dashboard drawn from a lab run with a real Prometheus, beside the report
        // (docs/bench/dashboard.png, shown in docs/GUIDE.md).
        let mut command = Command::new(&driver);
        command
            .args(["--only", "dashboard", "--report"])
            .arg(&report)
            .current_dir(&root);
        println!("[xtask] {command:?}");
        if !command.status()?.success() {
            bail!("drawing the dashboard failed");
        }
    }
    Ok(())
}

/// Cargo's selection of the bench driver and the delay line its latency section runs.
const BENCH_BINARIES: &[&str] = &[
    "--package",
    "shaper-tests",
    "--features",
    "bench",
    "--bin",
    "shaper-bench",
    "--bin",
    DELAY_LINE,
];

fn man() -> Result<()> {
    let dir = workspace_root().join("target/man");
    dist::write_man_pages(&shaper_binary(), &dir)?;
    println!("[xtask] man pages in {}", dir.display());
    Ok(())
}

/// `cargo test`'s selection for the suite (and the guests' build of the same binaries):
/// the workspace without the eBPF shell, with the bench's own checks of its report (no
/// root, no lab), built once with the features the bench's quick run needs.
pub const TEST_SELECTION: &[&str] = &[
    "test",
    "--workspace",
    "--exclude",
    "shaper-ebpf",
    "--features",
    "shaper-tests/bench",
];

fn test() -> Result<()> {
    // Each stage's end, so a log shows where the suite's time goes.
    let started = std::time::Instant::now();
    let done = |stage: &str| {
        println!(
            "[xtask] test: {stage} done at {:.0} s",
            started.elapsed().as_secs_f64()
        )
    };
    cargo(&["fmt", "--all", "--", "--check"])?;
    // Clippy builds in a directory of its own: without a real eBPF object (see
    // shaper/build.rs) it spares a minute of building one.
    std::env::set_var("AYA_BUILD_SKIP", "1");
    let linted = cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]);
    std::env::remove_var("AYA_BUILD_SKIP");
    linted?;
    done("fmt and clippy");
    build_shaper()?;
    // The delay line is a package binary: the test build below makes it.
    use_binaries_of(dist::Profile::Dev);
    // The package tests install what `dist` built, from the debug build just made.
    std::env::set_var("SHAPER_DEB", dist::dist(dist::Profile::Dev)?);
    done("the build and the package");
    let files_before = files_left_in_tree()?;
    // Unit, property and lab tests in one build: two invocations (the workspace's, then
    // the lab's with the bench feature) unified features differently and compiled aya,
    // shaper and their dependencies twice (a minute). One at a time, since the lab tests'
    // measurements share two cores. shaper-ebpf is an empty shell on the host, and
    // selecting it would build its objects with other settings and so the eBPF object
    // once more (50 s).
    cargo(
        &[
            TEST_SELECTION,
            // Every test binary runs even when one fails, so a CI log shows all failures
            // at once.
            &["--no-fail-fast", "--", "--test-threads=1"],
        ]
        .concat(),
    )?;
    done("unit, property and lab tests");
    // The mutants of what changed since the last commit judged so (none: nothing to do).
    mutants::in_diff(&mutants::judged_base()?, 2, false)?;
    done("mutants of what changed");
    // The bench's quick run, so it cannot rot, with the driver the lab-test build made.
    run_bench(true, None)?;
    done("the quick bench");
    // What the tests and the bench write belongs under target/ or in temporary
    // directories they remove: a file that appeared in the tree (tracked or ignored) is
    // one a test forgot (a server's snapshot in its working directory, say).
    let left: Vec<String> = files_left_in_tree()?
        .into_iter()
        .filter(|file| !files_before.contains(file))
        .collect();
    if !left.is_empty() {
        bail!("the tests left files in the tree: {}", left.join(", "));
    }
    // The kernels users run (Debian 11's refusal, Debian 12's 6.1 and 6.12), CI's share.
    vm::vm_test(&[], vm::Plan::Ci)?;
    done("the guests");
    Ok(())
}
