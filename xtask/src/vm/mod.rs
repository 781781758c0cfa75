//! `cargo xtask vm-test [--kernel 6.1|6.12|PATH]...`: the lab tests that matter most for a
//! kernel (every program variant loaded by its verifier, both attach modes, policing,
//! marks, a meter, shape, a hierarchy, upgrade, the CNI plugin) run inside Debian 12's own
//! kernels under qemu, as aya's integration tests do.
//!
//! Each kernel package comes from the Debian registry (`apt-get download`, cached under
//! target/vm). The guest boots from an initramfs made here: busybox for its init, the
//! host's own tools (ip, tc, iperf3, ...) with the libraries `ldd` names, the kernel's
//! modules the lab needs (decompressed, loaded in `modprobe --show-depends` order), shaper
//! and the test binaries, stripped. The init runs the kernel's test plan and prints
//! markers on the serial console; the host reads them, with a bound on the whole boot.

use anyhow::{bail, ensure, Context as _, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

mod bench;
mod initramfs;
mod kernel;
mod plan;
mod runner;

pub use bench::{bench_vm, VmRows};
use initramfs::{guest_binaries, initramfs};
use kernel::fetch_kernel;
use plan::{groups, Group, TEST_FILTER};
pub use plan::{only_peers_rows, only_tests_named, Plan};
use runner::{boot, choose_accel};

/// The kernels `vm-test` runs with no `--kernel`: Debian 11's (older than shaper's
/// floor, which it must refuse), Debian 12's LTS kernel and the one from its security suite
/// (the first with TCX); cloud flavour (virtio, small).
pub const DEFAULT_KERNELS: [&str; 3] = ["5.10", "6.1", "6.12"];
/// The kernels `bench --vm` measures on with no `--kernel`: Debian 12's two, both with fq,
/// fq_codel, CAKE and netem.
pub const BENCH_KERNELS: [&str; 2] = ["6.12", "6.1"];

/// What one kernel's guest did.
pub struct GuestOutcome {
    pub kernel: String,
    accel: &'static str,
    seconds: f64,
    /// Per test group, in the order run.
    groups: Vec<GroupRun>,
    exit: Option<i32>,
    /// What the guest printed between [`REPORT_BEGIN`] and [`REPORT_END`] (the bench's
    /// JSON), one line per element.
    pub report: Vec<String>,
}

/// What one test group of a guest did: its binary, whether it exited 0, and how many
/// tests its harness said passed (from its `test result:` line; none when it printed none).
#[derive(Debug, PartialEq)]
pub(super) struct GroupRun {
    pub(super) binary: String,
    pub(super) exited_zero: bool,
    pub(super) passed: Option<usize>,
}

/// Boots each of `kernels` (the default set when empty) with `plan`; fails unless every
/// guest ran its whole plan and passed. Returns what each guest did.
pub fn vm_test(kernels: &[String], plan: Plan) -> Result<Vec<GuestOutcome>> {
    check_guest_tools()?;
    let kernels: Vec<String> = if !kernels.is_empty() {
        kernels.to_vec()
    } else if plan == Plan::Bench {
        BENCH_KERNELS.iter().map(|k| k.to_string()).collect()
    } else {
        DEFAULT_KERNELS.iter().map(|k| k.to_string()).collect()
    };
    let binaries = guest_binaries()?;
    let mut accel = None;
    let mut outcomes = Vec::new();
    for spec in &kernels {
        let kernel = fetch_kernel(spec)?;
        if groups(&kernel.release, plan).is_empty() {
            println!(
                "== kernel {}: none of the plan's tests is named like {:?}; not booted",
                kernel.label,
                TEST_FILTER.get().map_or("", String::as_str)
            );
            continue;
        }
        let image = initramfs(&kernel, &binaries, plan)?;
        let accel = match accel {
            Some(accel) => accel,
            None => {
                let chosen = choose_accel(&kernel, &image)?;
                accel = Some(chosen);
                chosen
            }
        };
        outcomes.push(boot(&kernel, &image, accel, plan)?);
    }
    ensure!(
        !outcomes.is_empty(),
        "vm-test: no test of the {plan:?} plan is named like {:?} on these kernels",
        TEST_FILTER.get().map_or("", String::as_str)
    );
    let failed = print_outcomes(&outcomes, plan);
    if !failed.is_empty() {
        bail!("vm-test failed: {}", failed.join("; "));
    }
    Ok(outcomes)
}

/// The host tools a guest is built and booted with.
fn check_guest_tools() -> Result<()> {
    let needed = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("busybox", "busybox-static"),
        ("modprobe", "kmod"),
        ("depmod", "kmod"),
        ("cpio", "cpio"),
        ("dpkg-deb", "dpkg"),
        ("apt-get", "apt"),
        ("strip", "binutils"),
    ];
    for (command, package) in needed {
        ensure!(
            crate::setup::has_command(command),
            "vm-test needs {command} (Debian package {package}; `cargo xtask setup` installs it)"
        );
    }
    Ok(())
}

/// Each guest's groups and exit, printed; what failed.
fn print_outcomes(outcomes: &[GuestOutcome], plan: Plan) -> Vec<String> {
    println!("== vm-test ({plan:?} plan)");
    let mut failed = Vec::new();
    for outcome in outcomes {
        let planned = groups(&outcome.kernel, plan);
        for (index, run) in outcome.groups.iter().enumerate() {
            let verdict = judge_group(planned.get(index), run);
            println!(
                "{:>6} {:4} {:12} {}",
                outcome.kernel,
                outcome.accel,
                run.binary,
                verdict.as_deref().unwrap_or("passed")
            );
            if let Some(why) = verdict {
                failed.push(format!("{} on {}: {why}", run.binary, outcome.kernel));
            }
        }
        println!(
            "{:>6} {:4} guest exit {:?} after {:.0} s",
            outcome.kernel, outcome.accel, outcome.exit, outcome.seconds
        );
        if outcome.exit != Some(0) || outcome.groups.len() != planned.len() {
            failed.push(format!(
                "the guest of {} ran {} of {} test groups and exited {:?}",
                outcome.kernel,
                outcome.groups.len(),
                planned.len(),
                outcome.exit
            ));
        }
    }
    failed
}

/// Why a group that ran failed (None when it passed): it exited non-zero, it is not the
/// group planned at its place, or its harness passed fewer or more tests than were named
/// (a renamed test is run by no `--exact` name, and the harness exits 0 all the same).
fn judge_group(planned: Option<&Group>, run: &GroupRun) -> Option<String> {
    let Some(planned) = planned.filter(|group| group.binary == run.binary) else {
        return Some("FAILED: not the group planned here".to_string());
    };
    if !run.exited_zero {
        return Some("FAILED".to_string());
    }
    // The bench's group names no tests: its exit is its verdict.
    if planned.tests.is_empty() {
        return None;
    }
    match run.passed {
        Some(passed) if passed == planned.tests.len() => None,
        passed => Some(format!(
            "FAILED: {} of {} planned tests ran (a test renamed or gone?)",
            passed.unwrap_or(0),
            planned.tests.len()
        )),
    }
}

/// The count of passed tests in a harness's summary line ("test result: ok. 4 passed; 0
/// failed; ...").
fn passed_in(line: &str) -> Option<usize> {
    let summary = line.trim().strip_prefix("test result: ")?;
    summary
        .split([';', '.'])
        .find_map(|part| part.trim().strip_suffix(" passed")?.trim().parse().ok())
}

fn which(command: &str) -> Result<PathBuf> {
    let path = output(Command::new("sh").args(["-c", &format!("command -v {command}")]))
        .with_context(|| format!("{command} is not installed (`cargo xtask setup`)"))?;
    let path = PathBuf::from(path.trim());
    Ok(fs::canonicalize(&path).unwrap_or(path))
}

/// The shared libraries `ldd` names for `binary` (with the dynamic loader).
fn libraries_of(binary: &Path) -> Result<Vec<PathBuf>> {
    let text = output(Command::new("ldd").arg(binary)).unwrap_or_default();
    Ok(text
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// Copies `path` into `stage` at the same path (its content, not a link).
fn copy_into(stage: &Path, path: &Path) -> Result<()> {
    let target = stage.join(path.strip_prefix("/").unwrap_or(path));
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent)?;
    }
    if !target.exists() {
        fs::copy(path, &target).with_context(|| format!("cannot copy {}", path.display()))?;
    }
    Ok(())
}

fn strip_into(from: &Path, to: &Path) -> Result<()> {
    run(Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(to)
        .arg(from))
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {command:?}"))?;
    ensure!(status.success(), "{command:?} failed ({status})");
    Ok(())
}

fn output(command: &mut Command) -> Result<String> {
    Ok(String::from_utf8_lossy(&output_bytes(command)?).into_owned())
}

fn output_bytes(command: &mut Command) -> Result<Vec<u8>> {
    let output = command
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    ensure!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(binary: &'static str, tests: &[&'static str]) -> Group {
        Group {
            binary,
            tests: tests.to_vec(),
            ignored: false,
        }
    }

    fn ran(binary: &str, exited_zero: bool, passed: Option<usize>) -> GroupRun {
        GroupRun {
            binary: binary.to_string(),
            exited_zero,
            passed,
        }
    }

    #[test]
    fn the_harness_summary_gives_the_passed_count() {
        let line = "test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 15 filtered \
                    out; finished in 52.86s";
        assert_eq!(passed_in(line), Some(4));
        assert_eq!(
            passed_in("  test result: FAILED. 1 passed; 2 failed;"),
            Some(1)
        );
        assert_eq!(passed_in("running 4 tests"), None);
        assert_eq!(passed_in("test udp ... ok"), None);
    }

    #[test]
    fn a_group_passes_only_when_every_named_test_ran_and_passed() {
        let planned = group("policing", &["a", "b"]);
        assert_eq!(
            judge_group(Some(&planned), &ran("policing", true, Some(2))),
            None
        );
        // A renamed test: `--exact` runs the other one and the harness exits 0.
        let renamed = judge_group(Some(&planned), &ran("policing", true, Some(1)));
        assert!(renamed.is_some_and(|why| why.contains("1 of 2 planned tests")));
        assert!(judge_group(Some(&planned), &ran("policing", true, None)).is_some());
        assert!(judge_group(Some(&planned), &ran("policing", false, Some(2))).is_some());
        assert!(judge_group(Some(&planned), &ran("cni", true, Some(2))).is_some());
        assert!(judge_group(None, &ran("policing", true, Some(2))).is_some());
        // The bench's group names no tests: its exit decides.
        let bench = group(plan::BENCH_GROUP, &[]);
        assert_eq!(
            judge_group(Some(&bench), &ran(plan::BENCH_GROUP, true, None)),
            None
        );
    }
}
