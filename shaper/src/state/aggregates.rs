//! The aggregate cap: on a device with shape classes, the largest GSO/TSO aggregate a
//! socket of this host builds (`gso_max_segs`) drains in about a millisecond at the
//! slowest shape class's rate.
//!
//! Why: since Linux 5.18 TCP adds up to 64 KiB to every TSO aggregate when its minimum
//! RTT is below 512 µs (`tcp_tso_autosize`), so on a short path a sender on the shaping
//! host queues 64 KiB at a time, 52 ms at 10 Mbit/s. A class on the sender's own egress
//! then held Cubic's RTT at 17-38 ms, and every aggregate CoDel dropped cost BBR up to
//! 44 segments it does not slow down for (0.76-0.79 of the rate). Two segments per
//! aggregate at 10 Mbit/s gave 0.955 for both, at 4.7-5.6 ms (issue 37; CAKE splits
//! aggregates on enqueue for the same reason).
//!
//! The device's value is kept in `/run/shaper/aggregates` when shaper first lowers it
//! and put back when the last shape class goes (or the egress attachment), unless
//! someone changed it meanwhile.
//! Sockets read the cap when they connect: connections open before keep theirs.

use super::{Location, PIN_ROOT, RUN_DIR};
use crate::error::runtime;
use anyhow::{Context as _, Result};
use std::path::{Path, PathBuf};

/// How long an aggregate may take to drain at the slowest shape class's rate.
const DRAIN_NS: u64 = 1_000_000;
/// Full-size frames the cap counts in.
const FRAME_BYTES: u64 = 1514;
/// The fewest segments the cap leaves: two keep TCP's own minimum (`tcp_min_tso_segs`)
/// and halve the per-packet cost of one.
const MIN_SEGMENTS: u32 = 2;

/// The cap for a class draining at `rate_bits_per_sec`: a power of two (a global class's
/// share moves every few seconds; the cap changes only when it halves or doubles), at
/// least [`MIN_SEGMENTS`].
pub(crate) fn segments_for(rate_bits_per_sec: u64) -> u32 {
    let frames = rate_bits_per_sec / 8 / (1_000_000_000 / DRAIN_NS) / FRAME_BYTES;
    let frames = u32::try_from(frames).unwrap_or(u32::MAX).max(MIN_SEGMENTS);
    1 << (31 - frames.leading_zeros())
}

/// What the device holds now.
struct Device {
    ifindex: u64,
    gso_max_segs: u32,
}

fn device(dev: &str) -> Result<Device> {
    let link = crate::qdisc::link(dev);
    let field = |name: &str| link.as_ref().and_then(|link| link[name].as_u64());
    match (field("ifindex"), field("gso_max_segs")) {
        (Some(ifindex), Some(segs)) => Ok(Device {
            ifindex,
            gso_max_segs: u32::try_from(segs).unwrap_or(u32::MAX),
        }),
        _ => Err(runtime(format!(
            "cannot read gso_max_segs of {dev} (ip -j -d link show dev {dev})"
        ))),
    }
}

fn set_segments(dev: &str, segments: u32) -> Result<()> {
    crate::qdisc::ip(&[
        "link",
        "set",
        "dev",
        dev,
        "gso_max_segs",
        &segments.to_string(),
    ])
}

/// The record of a device shaper capped, `<ifindex> <original> <cap set>`, beside the
/// attachment's own place (`host/DEV`, `netns-NAME/DEV`): `forget` finds it when the
/// namespace is gone.
fn record_path(location: &Location) -> PathBuf {
    let pins = location.dir();
    let relative = pins
        .parent()
        .and_then(|dev| dev.strip_prefix(PIN_ROOT).ok())
        .unwrap_or(Path::new("unknown"));
    Path::new(RUN_DIR).join("aggregates").join(relative)
}

/// (original, cap) from the record, if it names this device and the device still holds
/// the cap shaper set: otherwise the record is stale (the device was re-created, or
/// someone set the value since) and the device's value is its own.
fn record(path: &Path, device: &Device) -> Option<(u32, u32)> {
    let text = std::fs::read_to_string(path).ok()?;
    let words: Vec<u64> = text
        .split_whitespace()
        .filter_map(|word| word.parse().ok())
        .collect();
    match words[..] {
        [ifindex, original, cap]
            if ifindex == device.ifindex && cap == u64::from(device.gso_max_segs) =>
        {
            Some((u32::try_from(original).ok()?, device.gso_max_segs))
        }
        _ => None,
    }
}

/// Makes the aggregate cap of the device at `location` (run inside its namespace) match
/// its shape classes: `slowest` is the lowest rate a shape class on it drains at, `None`
/// when it has none (the device's own value comes back). Never raises the cap above
/// what the device had before shaper.
pub(crate) fn refresh(location: &Location, slowest: Option<u64>) -> Result<()> {
    let dev = &location.dev;
    let device = device(dev)?;
    let path = record_path(location);
    let recorded = record(&path, &device);
    let Some(rate) = slowest else {
        if let Some((original, _)) = recorded {
            set_segments(dev, original)?;
        }
        forget(location);
        return Ok(());
    };
    let original = recorded.map_or(device.gso_max_segs, |(original, _)| original);
    let cap = segments_for(rate).min(original);
    if cap == device.gso_max_segs && recorded.is_some() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&path, format!("{} {original} {cap}\n", device.ifindex))
        .with_context(|| format!("cannot write {}", path.display()))?;
    set_segments(dev, cap)
}

/// Drops the record of a device whose namespace is gone (it went with it).
pub(crate) fn forget(location: &Location) {
    let path = record_path(location);
    let _ = std::fs::remove_file(&path);
    if let Some(dir) = path.parent() {
        // Only when empty: other devices of the namespace may have records.
        let _ = std::fs::remove_dir(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregate_drains_in_about_a_millisecond_in_powers_of_two() {
        assert_eq!(segments_for(1_000_000), 2);
        assert_eq!(segments_for(10_000_000), 2);
        // 100 Mbit/s: 12 500 bytes a millisecond, 8.3 frames.
        assert_eq!(segments_for(100_000_000), 8);
        assert_eq!(segments_for(1_000_000_000), 64);
        assert_eq!(segments_for(10_000_000_000), 512);
        assert_eq!(segments_for(u64::MAX), 1 << 31);
    }
}
