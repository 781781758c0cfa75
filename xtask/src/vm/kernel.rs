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

/// A kernel package of the Debian registry, pinned so that every run (CI's included) boots
/// the same kernel: a newer one is a one-line change of `package` and `version` here, and
/// `vm-test` says when the registry has one. `start` DIGITS `end` names the newer ones.
pub(super) struct Pin {
    short: &'static str,
    package: &'static str,
    version: &'static str,
    suite: &'static str,
    start: &'static str,
    end: &'static str,
}

pub(super) const PINS: [Pin; 3] = [
    Pin {
        short: "5.10",
        package: "linux-image-5.10.0-46-cloud-amd64",
        version: "5.10.262-1",
        suite: "bullseye",
        start: "linux-image-5.10.0-",
        end: "-cloud-amd64",
    },
    Pin {
        short: "6.1",
        package: "linux-image-6.1.0-57-cloud-amd64",
        version: "6.1.192-3",
        suite: "bookworm",
        start: "linux-image-6.1.0-",
        end: "-cloud-amd64",
    },
    Pin {
        short: "6.12",
        package: "linux-image-6.12.118+deb12-cloud-amd64",
        version: "6.12.118-1~deb12u1",
        suite: "bookworm",
        start: "linux-image-6.12.",
        end: "+deb12-cloud-amd64",
    },
];

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
        let pin = PINS.iter().find(|pin| pin.short == spec).with_context(|| {
            format!("--kernel {spec}: expected 5.10, 6.1, 6.12 or the path of a linux-image .deb")
        })?;
        pinned_deb(&cache, pin)?
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

fn modules_dir(root: &Path) -> Result<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|dir| root.join(dir))
        .find(|dir| dir.is_dir())
        .with_context(|| format!("{} has no lib/modules", root.display()))
}

/// apt options for a private view of one Debian suite (its own sources and package
/// lists under `cache`), so the host's apt sources are neither needed nor touched.
fn apt_options(cache: &Path, suite: &str) -> Result<Vec<String>> {
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

/// The pinned package's .deb (downloaded once into `cache`), saying when the registry has
/// a newer kernel of the same line. A pin the registry no longer serves (the security
/// suite keeps only its newest) falls back to the newest, saying so loudly: a run then
/// still boots a kernel of that line, and its report names the release it booted.
fn pinned_deb(cache: &Path, pin: &Pin) -> Result<PathBuf> {
    if let Some(deb) = find_deb(cache, pin.package, pin.version) {
        return Ok(deb);
    }
    let apt = apt_options(cache, pin.suite)?;
    let newest = newest_package(&apt, pin.start, pin.end)?;
    if newest != pin.package {
        println!(
            "[xtask] the Debian registry has a newer {} kernel, {newest} (pinned: {} {}; \
             a one-line change in xtask/src/vm/kernel.rs)",
            pin.short, pin.package, pin.version
        );
    }
    if download(cache, &apt, &format!("{}={}", pin.package, pin.version)).is_ok() {
        return find_deb(cache, pin.package, pin.version)
            .with_context(|| format!("apt-get download left no {} .deb", pin.package));
    }
    println!(
        "[xtask] WARNING: the pinned {} {} is no longer in the Debian registry: booting the \
         newest, {newest} (update the pin in xtask/src/vm/kernel.rs)",
        pin.package, pin.version
    );
    download(cache, &apt, &newest)?;
    find_deb(cache, &newest, "").with_context(|| format!("apt-get download left no {newest} .deb"))
}

/// `apt-get download WHAT` into `cache`.
fn download(cache: &Path, apt: &[String], what: &str) -> Result<()> {
    println!("[xtask] apt-get download {what}");
    let status = Command::new("apt-get")
        .args(apt)
        .args(["download", "-qq", what])
        .current_dir(cache)
        .status()
        .context("cannot run apt-get")?;
    ensure!(
        status.success(),
        "cannot download {what} from the Debian registry (apt-get download failed)"
    );
    Ok(())
}

/// The newest package of the suite `apt` sees named `start` DIGITS `end` (its package
/// lists fetched when there are none yet, or the name is not among them).
fn newest_package(apt: &[String], start: &str, end: &str) -> Result<String> {
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

/// The .deb of `package` at `version` (any version when empty) in `dir`, under the name
/// apt gives it (`+` and `~` escaped or not).
fn find_deb(dir: &Path, package: &str, version: &str) -> Option<PathBuf> {
    let escape = |text: &str| text.replace('+', "%2b").replace('~', "%7e");
    let starts = [
        format!("{package}_{version}"),
        escape(&format!("{package}_{version}")),
    ];
    fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .find(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let rest = starts
                .iter()
                .find_map(|start| name.strip_prefix(start.as_str()));
            rest.is_some_and(|rest| {
                rest.ends_with(".deb") && (version.is_empty() || rest.starts_with('_'))
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_deb_is_found_by_its_package_and_version_only() {
        let dir = std::env::temp_dir().join(format!("shaper-find-deb-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for name in [
            "linux-image-6.12.118+deb12-cloud-amd64_6.12.118-1~deb12u1_amd64.deb",
            "linux-image-6.1.0-57-cloud-amd64_6.1.192-30_amd64.deb",
        ] {
            fs::write(dir.join(name), "").unwrap();
        }
        let found = find_deb(
            &dir,
            "linux-image-6.12.118+deb12-cloud-amd64",
            "6.12.118-1~deb12u1",
        );
        let wrong_version = find_deb(&dir, "linux-image-6.1.0-57-cloud-amd64", "6.1.192-3");
        let any_version = find_deb(&dir, "linux-image-6.1.0-57-cloud-amd64", "");
        let _ = fs::remove_dir_all(&dir);
        assert!(found.is_some());
        assert_eq!(wrong_version, None);
        assert!(any_version.is_some());
    }

    #[test]
    fn every_pin_is_a_package_of_its_own_line() {
        for pin in &PINS {
            let middle = pin.package.strip_prefix(pin.start).unwrap();
            let digits = middle.strip_suffix(pin.end).unwrap();
            assert!(digits.parse::<u32>().is_ok(), "{}", pin.package);
            assert!(pin.version.starts_with(pin.short), "{}", pin.version);
        }
    }
}
