//! `cargo xtask dist`: the Debian package (cargo-deb, `[package.metadata.deb]` in
//! shaper-cli/Cargo.toml). The release build carries the release eBPF object; man pages,
//! completions and the inert conffile are made by that very binary into target/dist.

use crate::{cargo, workspace_root};
use anyhow::{bail, Context as _, Result};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

/// The workspace version, which the package carries (Debian revision 1).
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The build a package is made of.
#[derive(Clone, Copy)]
pub enum Profile {
    /// What `cargo xtask dist` ships.
    Release,
    /// The debug build the lab tests already made: `cargo xtask test` packages it for the
    /// package tests, the same files from the same sources, without a release build of
    /// the whole workspace (about 3 minutes of CI).
    Dev,
}

impl Profile {
    /// Cargo's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Dev => "dev",
        }
    }

    /// Where cargo puts its binaries.
    pub fn dir(self) -> &'static str {
        match self {
            Profile::Release => "target/release",
            Profile::Dev => "target/debug",
        }
    }
}

/// Builds the package from `profile`'s build; its path.
pub fn dist(profile: Profile) -> Result<PathBuf> {
    let root = workspace_root();
    check_changelog(&read(&root.join("debian/changelog"))?)?;
    cargo(&[
        "build",
        "--profile",
        profile.name(),
        "--locked",
        "--package",
        "shaper-cli",
    ])?;
    let shaper = root.join(profile.dir()).join("shaper");
    let stage = root.join("target/dist");
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(stage.join("completions"))?;
    write_man_pages(&shaper, &stage.join("man"))?;
    for (shell, file) in [
        ("bash", "shaper.bash"),
        ("zsh", "_shaper"),
        ("fish", "shaper.fish"),
    ] {
        let script = command_output(&shaper, &["completions", shell])?;
        fs::write(stage.join("completions").join(file), script)?;
    }
    let example = read(&root.join("contrib/shaper.toml"))?;
    fs::write(stage.join("shaper.toml"), inert_config(&example))?;
    let arch = String::from_utf8(command_output(
        Path::new("dpkg"),
        &["--print-architecture"],
    )?)?;
    let deb = root.join(format!(
        "target/debian/shaper_{VERSION}-1_{}.deb",
        arch.trim()
    ));
    cargo(&[
        "deb",
        "--package",
        "shaper-cli",
        "--no-build",
        // cargo-deb reads the `target/release/` assets from this profile's directory.
        "--profile",
        profile.name(),
        "--output",
        &deb.display().to_string(),
    ])?;
    println!("[xtask] package: {}", deb.display());
    Ok(deb)
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// A command's standard output; its standard error in the error when it fails.
/// The man pages of `shaper` (one per command, section 8) into `dir`.
pub fn write_man_pages(shaper: &Path, dir: &Path) -> Result<()> {
    command_output(shaper, &["manpages", &dir.display().to_string()])?;
    Ok(())
}

fn command_output(program: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// debian/changelog's newest entry must be this version, or the package would say one
/// version and the binary another.
fn check_changelog(changelog: &str) -> Result<()> {
    let wanted = format!("shaper ({VERSION}-1) ");
    if !changelog.starts_with(&wanted) {
        bail!("debian/changelog's first entry is not {VERSION}-1 (the workspace version): add one");
    }
    Ok(())
}

/// /etc/shaper/shaper.toml: the commented example with every setting commented out, so
/// installing the package (or starting the unit) attaches nothing.
fn inert_config(example: &str) -> String {
    let mut text = String::from(
        "# shaper's configuration: `shaper daemon` (shaper.service, which the package does\n\
         # not enable) keeps it applied; `shaper apply -f` applies it once. Everything below\n\
         # is commented out, so nothing is attached until you say so. The same example,\n\
         # active, is /usr/share/doc/shaper/examples/shaper.toml.\n\n",
    );
    for line in example.lines() {
        if line.is_empty() || line.starts_with('#') {
            text.push_str(line);
        } else {
            text.push_str("# ");
            text.push_str(line);
        }
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conffile_has_no_active_line() {
        let inert = inert_config("# a comment\n[[interface]]\ndev = \"eth0\"\n\n");
        assert!(inert.contains("# [[interface]]\n# dev = \"eth0\"\n"));
        assert!(inert
            .lines()
            .all(|line| line.is_empty() || line.starts_with('#')));
    }

    #[test]
    fn a_changelog_of_another_version_is_refused() {
        assert!(check_changelog(&format!("shaper ({VERSION}-1) unstable; urgency=medium")).is_ok());
        assert!(check_changelog("shaper (0.0.1-1) unstable; urgency=medium").is_err());
    }
}
