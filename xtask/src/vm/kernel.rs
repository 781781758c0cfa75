//! The kernel packages: Debian's cloud kernels by short version, fetched from the registry
//! with a private apt view of their suite, unpacked, and the modules the lab needs.

use super::{output, run};
use crate::workspace_root;
use anyhow::{ensure, Context as _, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

/// shaper's floor (docs/KERNELS.md): older kernels only check the refusal.
pub(super) const FLOOR: (u32, u32) = (5, 18);
/// TCX arrived in 6.6.
pub(super) const TCX: (u32, u32) = (6, 6);

/// A kernel package of the Debian registry for a short version: the name's fixed start,
/// the part that varies by release (digits), its fixed end, and the Debian suite.
pub(super) fn kernel_source(short: &str) -> Option<(&'static str, &'static str, &'static str)> {
    match short {
        "5.10" => Some(("linux-image-5.10.0-", "-cloud-amd64", "bullseye")),
        "6.1" => Some(("linux-image-6.1.0-", "-cloud-amd64", "bookworm")),
        "6.12" => Some(("linux-image-6.12.", "+deb12-cloud-amd64", "bookworm")),
        _ => None,
    }
}

/// A kernel unpacked from its package: its release (`uname -r`), image and module tree.
pub(super) struct Kernel {
    pub(super) label: String,
    pub(super) release: String,
    pub(super) image: PathBuf,
    /// The unpacked package: lib/modules/RELEASE under it.
    pub(super) root: PathBuf,
}

/// A kernel release's major and minor numbers ("6.12.118+deb12-cloud-amd64": (6, 12)).
pub(super) fn version_of(release: &str) -> (u32, u32) {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// Downloads (once) and unpacks the kernel package for `spec`: "6.1", "6.12", or the
/// path of a linux-image .deb.
pub(super) fn fetch_kernel(spec: &str) -> Result<Kernel> {
    let cache = workspace_root().join("target/vm");
    fs::create_dir_all(&cache)?;
    let deb = if Path::new(spec).is_file() {
        PathBuf::from(spec)
    } else {
        let (start, end, suite) = kernel_source(spec).with_context(|| {
            format!("--kernel {spec}: expected 5.10, 6.1, 6.12 or the path of a linux-image .deb")
        })?;
        let apt = apt_options(&cache, suite)?;
        let package = newest_package(&apt, start, end)?;
        let deb = find_deb(&cache, &package);
        match deb {
            Some(deb) => deb,
            None => {
                println!("[xtask] apt-get download {package}");
                let status = Command::new("apt-get")
                    .args(&apt)
                    .args(["download", "-qq", &package])
                    .current_dir(&cache)
                    .status()
                    .context("cannot run apt-get")?;
                ensure!(
                    status.success(),
                    "cannot download {package} from the Debian registry (apt-get download failed)"
                );
                find_deb(&cache, &package)
                    .with_context(|| format!("apt-get download left no {package} .deb"))?
            }
        }
    };
    let stem = deb
        .file_stem()
        .and_then(|s| s.to_str())
        .context("a .deb without a name")?
        .to_string();
    let root = cache.join(format!("{stem}.d"));
    if !root.join(".unpacked").exists() {
        let _ = fs::remove_dir_all(&root);
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        fs::write(root.join(".unpacked"), "")?;
    }
    let modules = modules_dir(&root)?;
    let release = fs::read_dir(&modules)?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("{} holds no kernel's modules", modules.display()))?;
    let image = root.join(format!("boot/vmlinuz-{release}"));
    ensure!(image.exists(), "{} has no kernel image", deb.display());
    // modprobe and depmod read lib/modules under the root they are given.
    if modules != root.join("lib/modules") {
        let lib = root.join("lib");
        if !lib.exists() {
            std::os::unix::fs::symlink("usr/lib", &lib)?;
        }
    }
    if !modules.join(&release).join("modules.dep").exists() {
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    }
    Ok(Kernel {
        label: spec.to_string(),
        release,
        image,
        root,
    })
}

pub(super) fn modules_dir(root: &Path) -> Result<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|dir| root.join(dir))
        .find(|dir| dir.is_dir())
        .with_context(|| format!("{} has no lib/modules", root.display()))
}

/// apt options for a private view of one Debian suite (its own sources and package
/// lists under `cache`), so the host's apt sources are neither needed nor touched.
pub(super) fn apt_options(cache: &Path, suite: &str) -> Result<Vec<String>> {
    let dir = cache.join(format!("apt-{suite}"));
    for sub in ["lists/partial", "cache/archives/partial", "sources.d"] {
        fs::create_dir_all(dir.join(sub))?;
    }
    let sources = dir.join("sources.list");
    fs::write(
        &sources,
        format!(
            "deb http://deb.debian.org/debian {suite} main\n\
             deb http://deb.debian.org/debian {suite}-updates main\n\
             deb http://deb.debian.org/debian-security {suite}-security main\n"
        ),
    )?;
    let option = |name: &str, path: PathBuf| format!("-oDir::{name}={}", path.display());
    Ok(vec![
        option("Etc::SourceList", sources),
        option("Etc::SourceParts", dir.join("sources.d")),
        option("State::Lists", dir.join("lists")),
        option("Cache", dir.join("cache")),
    ])
}

/// The newest package of the suite `apt` sees named `start` DIGITS `end` (its package
/// lists fetched when there are none yet, or the name is not among them).
pub(super) fn newest_package(apt: &[String], start: &str, end: &str) -> Result<String> {
    let mut names = String::new();
    for attempt in 0..2 {
        names = output(
            Command::new("apt-cache")
                .args(apt)
                .args(["pkgnames", start]),
        )
        .unwrap_or_default();
        if names.lines().any(|name| name.ends_with(end)) || attempt == 1 {
            break;
        }
        println!("[xtask] apt-get update (the package lists of {start}*{end})");
        output(Command::new("apt-get").args(apt).args(["update", "-qq"]))
            .context("cannot fetch the Debian registry's package lists (apt-get update)")?;
    }
    names
        .lines()
        .filter_map(|name| {
            let middle = name.strip_prefix(start)?.strip_suffix(end)?;
            let number = middle.parse::<u32>().ok()?;
            Some((number, name.to_string()))
        })
        .max()
        .map(|(_, name)| name)
        .with_context(|| format!("the Debian registry has no {start}N{end}"))
}

pub(super) fn find_deb(dir: &Path, package: &str) -> Option<PathBuf> {
    let prefix = format!("{}_", package.replace('+', "%2b"));
    let plain = format!("{package}_");
    fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .find(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            (name.starts_with(&prefix) || name.starts_with(&plain)) && name.ends_with(".deb")
        })
}
