//! The guest's initramfs: busybox, the host's tools and their libraries, shaper and the
//! planned test binaries (stripped), the kernel's modules in load order, and the init.

use super::kernel::Kernel;
use super::plan::{groups, init_script, Plan, BENCH_GROUP, CI_TESTS, GUEST_TESTS};
use super::{copy_into, libraries_of, output, output_bytes, strip_into, which};
use crate::workspace_root;
use anyhow::{ensure, Context as _, Result};
use serde_json::Value;
use std::{
    collections::BTreeSet,
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// Modules the lab and its peers need (those built in are skipped).
pub(super) const MODULES: &[&str] = &[
    "veth",
    "tun",
    "bridge",
    "ifb",
    "sch_ingress",
    "cls_bpf",
    // The hierarchy tests' htb reference classifies with u32.
    "cls_u32",
    "act_mirred",
    "sch_htb",
    "sch_tbf",
    "sch_fq",
    "sch_fq_codel",
    "sch_cake",
    "sch_netem",
    // The bench's BBR rows (iperf3 -C bbr; no module autoloading in the guest).
    "tcp_bbr",
    "nf_tables",
    "nft_chain_nat",
    "nft_ct",
];

/// Host commands copied into the guest with their libraries (what the lab runs).
pub(super) const GUEST_COMMANDS: &[&str] = &[
    "ip", "tc", "ss", "iperf3", "irtt", "ping", "ethtool", "nsenter", "unshare", "setpriv",
    "flock", "sysctl", "nft", "tcpdump",
];

/// The reference CNI plugins the CNI test runs beside shaper-cni.
pub(super) const CNI_PLUGINS: &str = "/usr/lib/cni";

/// The binaries the guest runs: shaper, shaper-cni, the delay line, and each test file's
/// executable by its name.
pub(super) struct GuestBinaries {
    shaper_dir: PathBuf,
    tests: Vec<(String, PathBuf)>,
}

pub(super) fn guest_binaries() -> Result<GuestBinaries> {
    crate::cargo(&["build", "--package", "shaper-cli"])?;
    // The same selection and features as `cargo xtask test`'s build, so nothing is built
    // twice when it runs the guests after its own tests.
    let args = [
        crate::TEST_SELECTION,
        &["--no-run", "--message-format=json-render-diagnostics"],
    ]
    .concat();
    println!("[xtask] cargo {}", args.join(" "));
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(workspace_root())
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo")?;
    ensure!(output.status.success(), "building the lab tests failed");
    let mut tests = Vec::new();
    let mut delay_line = None;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let (Some(name), Some(executable)) = (
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) else {
            continue;
        };
        let kinds = &message["target"]["kind"];
        let lab = message["manifest_path"]
            .as_str()
            .is_some_and(|path| path.ends_with("/tests/Cargo.toml"));
        if lab && message["profile"]["test"] == true && kinds[0] == "test" {
            tests.push((name.to_string(), PathBuf::from(executable)));
        } else if name == crate::DELAY_LINE {
            delay_line = Some(PathBuf::from(executable));
        }
    }
    let shaper_dir = workspace_root().join(crate::dist::Profile::Dev.dir());
    if delay_line.is_none() {
        crate::cargo(&[
            "build",
            "--package",
            "shaper-tests",
            "--features",
            "bench",
            "--bin",
            crate::DELAY_LINE,
        ])?;
    }
    check_planned_tests_exist(&tests)?;
    Ok(GuestBinaries { shaper_dir, tests })
}

/// Every test the guest plans is in its binary's `--list` (ignored ones among its
/// `--ignored` list): a renamed test fails here, before a guest boots, as well as in the
/// guest's count of tests run.
fn check_planned_tests_exist(tests: &[(String, PathBuf)]) -> Result<()> {
    for (binary, names, needs) in GUEST_TESTS.iter().chain(CI_TESTS) {
        let (_, path) = tests
            .iter()
            .find(|(name, _)| name == binary)
            .with_context(|| format!("no test executable {binary} among the lab tests"))?;
        let mut list = Command::new(path);
        list.args(["--list", "--format", "terse"]);
        if needs.is_ignored() {
            list.arg("--ignored");
        }
        let listed = output(&mut list)?;
        let listed: BTreeSet<&str> = listed
            .lines()
            .filter_map(|line| line.strip_suffix(": test"))
            .collect();
        for name in *names {
            ensure!(
                listed.contains(name),
                "the guest plan names {binary}::{name}, which {binary} does not have{}",
                if needs.is_ignored() {
                    " among its ignored tests"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// Builds (or reuses) the guest's initramfs for `kernel`.
pub(super) fn initramfs(kernel: &Kernel, binaries: &GuestBinaries, plan: Plan) -> Result<PathBuf> {
    let stage = workspace_root().join(format!("target/vm/guest-{}", kernel.release));
    let _ = fs::remove_dir_all(&stage);
    for dir in [
        "bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "etc", "tests",
        "modules", "var", "root",
    ] {
        fs::create_dir_all(stage.join(dir))?;
    }
    std::os::unix::fs::symlink("/run", stage.join("var/run"))?;
    stage_binaries(&stage, kernel, binaries, plan)?;
    if Path::new(CNI_PLUGINS).is_dir() {
        for entry in fs::read_dir(CNI_PLUGINS)? {
            copy_into(&stage, &entry?.path())?;
        }
    }
    // Name lookups the tools make.
    // tcpdump drops its privileges to its own user.
    fs::write(
        stage.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\ntcpdump:x:104:110::/nonexistent:/bin/false\n",
    )?;
    fs::write(stage.join("etc/group"), "root:x:0:\ntcpdump:x:110:\n")?;
    fs::write(stage.join("etc/hosts"), "127.0.0.1 localhost\n")?;
    fs::write(stage.join("etc/nsswitch.conf"), "hosts: files\n")?;
    stage_modules(&stage, kernel)?;
    let init = stage.join("init");
    fs::write(&init, init_script(&kernel.release, plan))?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))?;
    let archive = workspace_root().join(format!(
        "target/vm/initramfs-{}-{plan:?}.cpio",
        kernel.release
    ));
    write_cpio(&stage, &archive)?;
    let size = fs::metadata(&archive)?.len();
    println!(
        "[xtask] initramfs for {}: {} ({} MiB)",
        kernel.release,
        archive.display(),
        size >> 20
    );
    let _ = fs::remove_dir_all(&stage);
    Ok(archive)
}

/// Host tools at the paths the host has them, shaper's binaries and the planned test
/// binaries (stripped), and every library they load.
pub(super) fn stage_binaries(
    stage: &Path,
    kernel: &Kernel,
    binaries: &GuestBinaries,
    plan: Plan,
) -> Result<()> {
    // Host tools, at the paths the host has them, and their libraries.
    let mut libraries = BTreeSet::new();
    let busybox = which("busybox")?;
    fs::copy(&busybox, stage.join("bin/busybox"))?;
    libraries.extend(libraries_of(&busybox)?);
    for command in GUEST_COMMANDS {
        let path = which(command)?;
        copy_into(stage, &path)?;
        libraries.extend(libraries_of(&path)?);
    }
    let shaper = stage.join("usr/local/bin");
    fs::create_dir_all(&shaper)?;
    let bench = (plan == Plan::Bench).then_some(BENCH_GROUP);
    for name in ["shaper", "shaper-cni", crate::DELAY_LINE]
        .into_iter()
        .chain(bench)
    {
        let from = binaries.shaper_dir.join(name);
        strip_into(&from, &shaper.join(name))?;
        libraries.extend(libraries_of(&from)?);
    }
    for group in groups(&kernel.release, plan) {
        let binary = group.binary;
        if binary == BENCH_GROUP {
            continue;
        }
        let (_, path) = binaries
            .tests
            .iter()
            .find(|(name, _)| name == binary)
            .context("a planned test binary is missing")?;
        let target = stage.join("tests").join(binary);
        if !target.exists() {
            strip_into(path, &target)?;
            libraries.extend(libraries_of(path)?);
        }
    }
    for library in &libraries {
        copy_into(stage, library)?;
    }
    Ok(())
}

/// The kernel's modules the lab needs, decompressed (busybox's insmod reads plain .ko
/// files), with their load order.
pub(super) fn stage_modules(stage: &Path, kernel: &Kernel) -> Result<()> {
    let mut order = String::new();
    for (index, module) in module_closure(kernel)?.iter().enumerate() {
        let name = module
            .file_name()
            .context("a module without a name")?
            .to_string_lossy()
            .into_owned();
        let plain = format!(
            "{index:02}-{}",
            name.trim_end_matches(".xz").trim_end_matches(".zst")
        );
        let target = stage.join("modules").join(&plain);
        if name.ends_with(".xz") {
            let data = output_bytes(Command::new("xz").arg("-dc").arg(module))?;
            fs::write(&target, data)?;
        } else if name.ends_with(".zst") {
            let data = output_bytes(Command::new("zstd").arg("-dc").arg(module))?;
            fs::write(&target, data)?;
        } else {
            fs::copy(module, &target)?;
        }
        order.push_str(&format!("/modules/{plain}\n"));
    }
    fs::write(stage.join("modules/order"), order)?;
    Ok(())
}

/// The staged tree as a newc cpio archive, its files in a stable order.
pub(super) fn write_cpio(stage: &Path, archive: &Path) -> Result<()> {
    let list = output_bytes(
        Command::new("sh")
            .arg("-c")
            .arg("find . -mindepth 1 | LC_ALL=C sort")
            .current_dir(stage),
    )?;
    let mut cpio = Command::new("cpio")
        .args(["--quiet", "-o", "-H", "newc", "-O"])
        .arg(archive)
        .current_dir(stage)
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot run cpio")?;
    std::io::Write::write_all(cpio.stdin.as_mut().context("cpio's stdin")?, &list)?;
    drop(cpio.stdin.take());
    ensure!(
        cpio.wait()?.success(),
        "cpio failed to write {}",
        archive.display()
    );
    Ok(())
}

/// The module files to load for [`MODULES`], in load order, dependencies first.
fn module_closure(kernel: &Kernel) -> Result<Vec<PathBuf>> {
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for module in MODULES {
        let text = match output(Command::new("modprobe").arg("-d").arg(&kernel.root).args([
            "-S",
            &kernel.release,
            "--show-depends",
            module,
        ])) {
            Ok(text) => text,
            Err(_) => {
                // The tests that need it fail saying so.
                println!("[xtask] kernel {} has no module {module}", kernel.release);
                continue;
            }
        };
        for line in text.lines() {
            // "insmod /path/x.ko[.xz] [options]" or "builtin x".
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = path.split_whitespace().next().unwrap_or_default();
                if seen.insert(path.to_string()) {
                    order.push(PathBuf::from(path));
                }
            }
        }
    }
    Ok(order)
}
