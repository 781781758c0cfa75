//! Booting a guest under qemu: KVM or TCG, the console read line by line with a bound on
//! the whole boot, and the markers the init prints turned into an outcome.

use super::kernel::Kernel;
use super::plan::{groups, guest_limit, Plan};
use super::{passed_in, GroupRun, GuestOutcome};
use anyhow::{Context as _, Result};
use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// How long a boot with KVM may take to reach the init before KVM is taken for broken.
pub(super) const KVM_PROBE_LIMIT: Duration = Duration::from_secs(30);
/// Serial-console markers the guest's init prints.
pub(super) const READY: &str = "SHAPER-VM-READY";
pub(super) const TEST_DONE: &str = "SHAPER-VM-TEST";
pub(super) const EXIT: &str = "SHAPER-VM-EXIT";
/// The kernel argument of the KVM probe's boot: the init only says it got there.
pub(super) const PROBE: &str = "shaper.probe";
pub(super) const REPORT_BEGIN: &str = "SHAPER-VM-REPORT-BEGIN";
pub(super) const REPORT_END: &str = "SHAPER-VM-REPORT-END";

/// KVM when a probe boot with it reaches the init, else TCG (said, with why).
pub(super) fn choose_accel(kernel: &Kernel, initramfs: &Path) -> Result<&'static str> {
    if !Path::new("/dev/kvm").exists() {
        println!("[xtask] no /dev/kvm: the guests run under TCG (emulated, slow)");
        return Ok("tcg");
    }
    let mut child = qemu(kernel, initramfs, "kvm", PROBE)?;
    let (lines, _reader) = read_lines(&mut child)?;
    let started = Instant::now();
    let mut reached = false;
    let mut last = Vec::new();
    while started.elapsed() < KVM_PROBE_LIMIT {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                if line.contains(READY) {
                    reached = true;
                    break;
                }
                // Nested KVM failing says so at once (and then hangs): no need to wait.
                if line.contains("KVM internal error") || line.contains("emulation failure") {
                    last.push(line);
                    break;
                }
                last.push(line);
                if last.len() > 3 {
                    last.remove(0);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    stop(&mut child);
    if reached {
        println!(
            "[xtask] KVM boots {}: the guests run under KVM",
            kernel.release
        );
        Ok("kvm")
    } else {
        println!(
            "[xtask] KVM did not reach the init of {} within {:?} (last: {}): the guests run \
             under TCG (emulated, slow)",
            kernel.release,
            KVM_PROBE_LIMIT,
            last.join(" / ")
        );
        Ok("tcg")
    }
}

pub(super) fn qemu(kernel: &Kernel, initramfs: &Path, accel: &str, extra: &str) -> Result<Child> {
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-accel", accel, "-cpu", "max", "-smp", "2", "-m", "3G"])
        .args([
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
            "-serial",
            "stdio",
        ])
        .args(["-monitor", "none"])
        .arg("-kernel")
        .arg(&kernel.image)
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 loglevel=4 rdinit=/init mitigations=off {extra}"
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // The probe reads qemu's messages (KVM failing); a test run lets them through.
        .stderr(if extra == PROBE {
            Stdio::piped()
        } else {
            Stdio::inherit()
        });
    command.spawn().context("cannot start qemu-system-x86_64")
}

pub(super) type Lines = (mpsc::Receiver<String>, std::thread::JoinHandle<()>);

/// The guest's console lines, and qemu's own messages when its stderr is piped (the KVM
/// probe's: a failing nested KVM says so there).
pub(super) fn read_lines(child: &mut Child) -> Result<Lines> {
    let stdout = child.stdout.take().context("qemu's console")?;
    let (send, receive) = mpsc::channel();
    if let Some(stderr) = child.stderr.take() {
        let send = send.clone();
        std::thread::spawn(move || forward_lines(stderr, &send));
    }
    let reader = std::thread::spawn(move || forward_lines(stdout, &send));
    Ok((receive, reader))
}

pub(super) fn forward_lines(from: impl std::io::Read, send: &mpsc::Sender<String>) {
    for line in BufReader::new(from).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line)
            .trim_end_matches('\r')
            .to_string();
        if send.send(line).is_err() {
            break;
        }
    }
}

pub(super) fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Boots a guest that dies before its init at most this many times in a row.
pub(super) const BOOT_ATTEMPTS: u32 = 5;

/// Boots `kernel` with `plan`, echoing its console, within [`guest_limit`]. A kernel that
/// dies before it reaches the init (under TCG here, 6.12 oopsed on an int3 in
/// `sched_clock_cpu` while patching its code at boot, two boots in eight here) is booted
/// again, saying so: no test has run, so no result is retried.
pub(super) fn boot(
    kernel: &Kernel,
    initramfs: &Path,
    accel: &'static str,
    plan: Plan,
) -> Result<GuestOutcome> {
    println!(
        "== kernel {} ({}) under {accel}: {} test groups",
        kernel.label,
        kernel.release,
        groups(&kernel.release, plan).len()
    );
    let mut attempt = 1;
    loop {
        let (outcome, reached_init) = boot_once(kernel, initramfs, accel, plan)?;
        if reached_init || attempt == BOOT_ATTEMPTS {
            return Ok(outcome);
        }
        attempt += 1;
        println!(
            "[xtask] the kernel {} died before its init (above): booting it again, attempt \
             {attempt} of {BOOT_ATTEMPTS}",
            kernel.release
        );
    }
}

/// One boot: what the guest did, and whether its kernel reached the init.
pub(super) fn boot_once(
    kernel: &Kernel,
    initramfs: &Path,
    accel: &'static str,
    plan: Plan,
) -> Result<(GuestOutcome, bool)> {
    let limit = guest_limit(plan);
    let mut reached_init = false;
    let mut in_report = false;
    // The last harness summary's count of passed tests, given to the group that ends next.
    let mut last_passed = None;
    let started = Instant::now();
    let mut child = qemu(kernel, initramfs, accel, "")?;
    let (lines, reader) = read_lines(&mut child)?;
    let mut outcome = GuestOutcome {
        kernel: kernel.release.clone(),
        accel,
        seconds: 0.0,
        groups: Vec::new(),
        exit: None,
        report: Vec::new(),
    };
    loop {
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            println!(
                "[xtask] the guest of {} ran past {:?}: killed",
                kernel.release, limit
            );
            break;
        }
        match lines.recv_timeout(left) {
            Ok(line) => {
                if line.trim() == REPORT_BEGIN {
                    in_report = true;
                    continue;
                }
                if line.trim() == REPORT_END {
                    in_report = false;
                    continue;
                }
                if in_report {
                    outcome.report.push(line);
                    continue;
                }
                println!("[{}] {line}", kernel.label);
                reached_init |= line.contains(READY);
                if let Some(passed) = passed_in(&line) {
                    last_passed = Some(passed);
                }
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    [TEST_DONE, binary, rc] => {
                        outcome.groups.push(GroupRun {
                            binary: binary.to_string(),
                            exited_zero: *rc == "0",
                            passed: last_passed.take(),
                        });
                    }
                    [EXIT, status] => {
                        outcome.exit = status.parse().ok();
                    }
                    _ => {}
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    stop(&mut child);
    let _ = reader.join();
    outcome.seconds = started.elapsed().as_secs_f64();
    Ok((outcome, reached_init))
}
