//! `cargo xtask setup`: installs what building and testing need, idempotently, and
//! quickly when nothing is missing. Every step says what it does; a step that cannot be
//! done fails with a message saying which and why.

use anyhow::{bail, Context as _, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// The bpf-linker release that builds against the nightly toolchain's own libLLVM.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// The cargo-deb release `cargo xtask dist` builds the Debian package with.
const CARGO_DEB_VERSION: &str = "3.8.0";
/// Debian packages the tests, the demo and the bench use, with a command (or an absolute
/// path) each provides.
const PACKAGES: &[(&str, &str)] = &[
    ("iproute2", "ip"),
    ("iperf3", "iperf3"),
    ("iputils-ping", "ping"),
    ("util-linux", "setpriv"),
    ("tcpdump", "tcpdump"),
    ("nftables", "nft"),
    // The latency tests' queue probe: isochronous UDP above a shape class's sparse
    // threshold, so it waits in the bulk queue.
    ("irtt", "irtt"),
    // Offloads off on the delay line's veths (64 KiB super-frames do not fit a packet socket).
    ("ethtool", "/usr/sbin/ethtool"),
    // The reference CNI `bandwidth`, `bridge` and `host-local` plugins: the bench's and the
    // CNI tests' side-by-side peer.
    ("containernetworking-plugins", "/usr/lib/cni/bandwidth"),
    // Global classes agree through Redis: the tests and the bench start their own
    // redis-server on a loopback port they pick (redis-cli reads its INFO).
    ("redis-server", "redis-server"),
    ("redis-tools", "redis-cli"),
    // The alert rules' checks and unit tests (promtool), and the lab's own Prometheus and
    // Alertmanager that scrape a daemon and deliver its alerts (on loopback ports they pick).
    ("prometheus", "promtool"),
    ("prometheus-alertmanager", "prometheus-alertmanager"),
    // The TLS test's private CAs and the server certificate (`rediss://`).
    ("openssl", "openssl"),
    // The package's own check (`cargo xtask dist`, the package tests), and what the
    // package test checks the installed package with.
    ("lintian", "lintian"),
    ("man-db", "man"),
    ("systemd", "systemd-analyze"),
    // `cargo xtask vm-test`: Debian's kernels booted under qemu from an initramfs made of
    // busybox, the host's tools and the kernel's modules (depmod/modprobe order them).
    ("qemu-system-x86", "qemu-system-x86_64"),
    ("busybox-static", "busybox"),
    ("kmod", "/usr/sbin/depmod"),
    ("cpio", "cpio"),
    // The font the bench's plots are labelled with.
    (
        "fonts-dejavu-core",
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    ),
];

fn step(message: &str) {
    println!("[setup] {message}");
}

fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!("{program} {} failed", args.join(" "));
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed with {status}");
    }
    Ok(())
}

pub(crate) fn has_command(name: &str) -> bool {
    if name.starts_with('/') {
        return Path::new(name).exists();
    }
    Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn setup() -> Result<()> {
    nightly_rust_src()?;
    bpf_linker()?;
    cargo_deb()?;
    debian_packages()?;
    step("ready");
    Ok(())
}

fn nightly_rust_src() -> Result<()> {
    let toolchains = output("rustup", &["toolchain", "list"])?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        step("installing the nightly toolchain (for the eBPF crate)");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))
        .context("the nightly toolchain is missing and cannot be installed")?;
    }
    let installed = output(
        "rustup",
        &["component", "list", "--toolchain", "nightly", "--installed"],
    )?;
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        step("rust-src on nightly: present");
    } else {
        step("adding rust-src to nightly (build-std=core for bpfel-unknown-none)");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

/// Where bpf-linker's LLVM prefix lives: symlinks to nightly's own libLLVM.
fn llvm_prefix() -> Result<PathBuf> {
    let home = std::env::var("HOME").context("HOME is not set")?;
    Ok(Path::new(&home).join(".cache/shaper/llvm"))
}

fn nightly_libllvm() -> Result<PathBuf> {
    let sysroot = output("rustc", &["+nightly", "--print", "sysroot"])?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let mut candidates: Vec<PathBuf> = fs::read_dir(&lib)
        .with_context(|| format!("cannot read {}", lib.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            name.starts_with("libLLVM.so.")
                || (name.starts_with("libLLVM-") && name.ends_with(".so"))
        })
        .filter(|p| fs::metadata(p).is_ok_and(|m| m.len() > 1_000_000))
        .collect();
    candidates.sort();
    candidates
        .pop()
        .with_context(|| format!("no libLLVM shared library in {}", lib.display()))
}

/// "libLLVM.so.22.1-rust-1.97.0-nightly" -> 22
fn llvm_major(lib: &Path) -> Result<u32> {
    let name = lib
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .to_string();
    let digits: String = name
        .trim_start_matches("libLLVM.so.")
        .trim_start_matches("libLLVM-")
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits
        .parse()
        .with_context(|| format!("cannot read the LLVM version from {name}"))
}

fn bpf_linker() -> Result<()> {
    let prefix = llvm_prefix()?;
    let libllvm = nightly_libllvm()?;
    let stamp = prefix.join("built-against");
    let wanted = format!("{} {}", BPF_LINKER_VERSION, libllvm.display());
    let works = Command::new("bpf-linker")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if works && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        step("bpf-linker: present, built against nightly's libLLVM");
        return Ok(());
    }
    step(&format!(
        "building bpf-linker {BPF_LINKER_VERSION} against {} (about a minute)",
        libllvm.display()
    ));
    let lib_dir = prefix.join("lib");
    fs::create_dir_all(&lib_dir)?;
    let soname = libllvm.file_name().context("bad libLLVM path")?;
    for link in [lib_dir.join("libLLVM.so"), lib_dir.join(soname)] {
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("cannot link {}", link.display()))?;
    }
    let feature = format!("llvm-{}", llvm_major(&libllvm)?);
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--force",
        ])
        .args(["--no-default-features", "--features", &feature])
        .env("LLVM_PREFIX", &prefix))
    .context("building bpf-linker failed")?;
    fs::write(&stamp, wanted)?;
    Ok(())
}

/// cargo-deb, at the version `cargo xtask dist` was written against.
fn cargo_deb() -> Result<()> {
    cargo_tool("cargo-deb", "deb", CARGO_DEB_VERSION)
}

/// The cargo-mutants release `cargo xtask mutants` runs (installed only when a run has a
/// mutant to judge: it takes minutes to build, and `cargo xtask test` mostly has none).
pub const CARGO_MUTANTS_VERSION: &str = "27.1.0";

pub fn cargo_mutants() -> Result<()> {
    cargo_tool("cargo-mutants", "mutants", CARGO_MUTANTS_VERSION)
}

/// Installs `crate_name` at `version` from crates.io (`cargo install --locked`) unless
/// `cargo SUBCOMMAND --version` already reports that version.
fn cargo_tool(crate_name: &str, subcommand: &str, version: &str) -> Result<()> {
    let present = Command::new("cargo")
        .args([subcommand, "--version"])
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(version));
    if present {
        step(&format!("{crate_name} {version}: present"));
        return Ok(());
    }
    step(&format!("building {crate_name} {version} (a few minutes)"));
    run(Command::new("cargo").args([
        "install",
        crate_name,
        "--version",
        version,
        "--locked",
        "--force",
    ]))
    .with_context(|| format!("building {crate_name} failed"))
}

fn debian_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(_, command)| !has_command(command))
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        let names: Vec<&str> = PACKAGES.iter().map(|(package, _)| *package).collect();
        step(&format!("Debian packages ({}): present", names.join(", ")));
        return Ok(());
    }
    step(&format!(
        "installing Debian packages: {}",
        missing.join(" ")
    ));
    run(Command::new("apt-get").arg("update").arg("-qq"))
        .context("apt-get update failed (are you root?)")?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get install failed")?;
    for service in SERVICES_TESTS_RUN_THEMSELVES {
        if missing.contains(service) {
            quiet_packaged_service(service);
        }
    }
    Ok(())
}

/// Packages whose Debian service starts on install (redis-server on 127.0.0.1:6379,
/// Prometheus on :9090 and its node exporter, Alertmanager on :9093): nothing here uses
/// them, the tests start their own on loopback ports they pick.
const SERVICES_TESTS_RUN_THEMSELVES: &[&str] =
    &["redis-server", "prometheus", "prometheus-alertmanager"];

/// Stops and disables a packaged service the tests do not use.
fn quiet_packaged_service(service: &str) {
    step(&format!(
        "{service}: stopping the packaged service (tests start their own)"
    ));
    let mut command = if Path::new("/run/systemd/system").exists() {
        let mut command = Command::new("systemctl");
        command.args(["disable", "--now", service]);
        command
    } else {
        let mut command = Command::new("service");
        command.args([service, "stop"]);
        command
    };
    let _ = command.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llvm_major_is_read_from_the_file_name() {
        assert_eq!(
            llvm_major(Path::new("/x/libLLVM.so.22.1-rust-1.97.0-nightly")).unwrap(),
            22
        );
        assert_eq!(
            llvm_major(Path::new("/x/libLLVM-21-rust-1.9.0-nightly.so")).unwrap(),
            21
        );
        assert!(llvm_major(Path::new("/x/libfoo.so")).is_err());
    }
}
