//! Which build pinned an attachment's program: a record per attachment under
//! `/run/shaper/builds/` (tmpfs, gone at reboot as the pins are), the build's
//! fingerprint and the id of the program it pinned. A daemon starting on an attachment
//! this very build pinned skips loading and verifying the program only to compare it
//! (`upgrade`): that took a second and more, during which a restarted daemon renewed
//! and reported nothing. Any other pin (another build, `flow-table` resizing) changes the
//! program id, and the full comparison runs again.

use super::{Location, RUN_DIR};
use std::{
    hash::{Hash as _, Hasher as _},
    path::PathBuf,
};

/// This build: its program object and version (the same binary gives the same number).
fn fingerprint() -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    crate::EBPF_OBJECT.hash(&mut hasher);
    env!("CARGO_PKG_VERSION").hash(&mut hasher);
    hasher.finish()
}

fn record_path(location: &Location) -> PathBuf {
    let name = location.dir().to_string_lossy().replace('/', "%");
    PathBuf::from(RUN_DIR).join("builds").join(name)
}

/// Notes that this build pinned program `program_id` for `location` (best effort: without
/// the record the next start compares in full).
pub(crate) fn record(location: &Location, program_id: u32) {
    let path = record_path(location);
    let written = (|| -> anyhow::Result<()> {
        super::ensure_private_dir(std::path::Path::new(RUN_DIR))?;
        super::ensure_private_dir(path.parent().unwrap_or(std::path::Path::new(RUN_DIR)))?;
        let partial = path.with_extension("partial");
        std::fs::write(&partial, format!("{:x} {program_id}\n", fingerprint()))?;
        std::fs::rename(&partial, &path)?;
        Ok(())
    })();
    if let Err(error) = written {
        log::debug!("cannot record the build in {}: {error:#}", path.display());
    }
}

/// Whether this build pinned `location`'s program, which is `program_id` now.
pub(crate) fn pinned_by_this_build(location: &Location, program_id: u32) -> bool {
    std::fs::read_to_string(record_path(location))
        .is_ok_and(|text| text.trim() == format!("{:x} {program_id}", fingerprint()))
}

/// Forgets `location`'s record (its pins are gone).
pub(crate) fn forget(location: &Location) {
    let _ = std::fs::remove_file(record_path(location));
}
