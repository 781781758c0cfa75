//! The global classes as this host runs them: found from the configuration, their
//! counters read, their shares written into the maps.

use super::*;
use crate::classes::ClassSpec;

/// A global class as this host runs it: where, which, and its counters now.
#[derive(Clone, Debug)]
pub struct HostClass {
    pub location: Location,
    pub name: String,
    pub key: String,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
    pub on_loss: OnLoss,
    /// The share in force (the class's rate on this host).
    pub share_bits_per_sec: u64,
    /// The hosts and the time of Redis's answer that share came with (Unix ms; 0: none).
    pub hosts: u32,
    pub answered_unix_ms: u64,
    pub usage: Usage,
}

/// Every global class of `configured` (as a configuration names them, with where) that is
/// in place now, with its share and counters (hash lookups only: no scan of the class
/// table, which a debug build takes tens of milliseconds over). Classes not applied yet
/// are left out.
pub fn host_classes<'a>(
    configured: impl IntoIterator<Item = (Location, &'a ClassSpec)>,
) -> anyhow::Result<Vec<HostClass>> {
    let mut found = Vec::new();
    for (location, spec) in configured {
        let Some(global) = &spec.global else {
            continue;
        };
        if !location.dir().exists() {
            continue;
        }
        let Ok(attachment) = Attachment::open(&location) else {
            continue;
        };
        let Some((id, _)) = attachment.find_class(&spec.name)? else {
            continue;
        };
        let share = classes::share_of(&attachment, id)?;
        if share.limit_bits_per_sec == 0 {
            // Not (yet) a global class in the kernel.
            continue;
        }
        let stats = attachment.class_stats(id)?;
        let config = attachment.classes()?.get(&id, 0)?;
        let backlogged = config.action == shaper_common::Action::Shape as u8 && {
            let (delay_ns, dropping) = attachment.shape_queue(id)?;
            dropping || delay_ns > config.codel.target_ns
        };
        found.push(HostClass {
            location,
            name: spec.name.clone(),
            key: global.key.clone(),
            limit_bits_per_sec: share.limit_bits_per_sec,
            floor_bits_per_sec: share.floor_bits_per_sec,
            on_loss: global.on_loss,
            share_bits_per_sec: share.share_bits_per_sec,
            hosts: share.hosts,
            answered_unix_ms: share.answered_unix_ms,
            usage: Usage {
                passed_bytes: stats.passed_bytes,
                dropped_bytes: stats.dropped_bytes,
                marked_bytes: stats.marked_bytes,
                backlogged,
            },
        });
    }
    Ok(found)
}

/// A share for `class` as the packet path takes it: the expiry armed `EXPIRY_INTERVALS`
/// intervals from now.
pub fn update_for(
    share_bits_per_sec: u64,
    hosts: u32,
    answered_unix_ms: u64,
    interval: Duration,
) -> ShareUpdate {
    ShareUpdate {
        share_bits_per_sec,
        hosts,
        answered_unix_ms,
        expires_ns: state::monotonic_ns() + (interval * EXPIRY_INTERVALS).as_nanos() as u64,
    }
}

/// Renews `class`'s share when it stays as it is (no lock needed); `false` when it must
/// be installed with [`install`].
pub fn renew(class: &HostClass, update: ShareUpdate) -> anyhow::Result<bool> {
    let attachment = Attachment::open(&class.location)?;
    classes::renew_share(&attachment, &class.name, update)
}

/// Installs a new share on `class`, inside its namespace (a shape class's HTB class
/// follows). Needs the state lock. Whether the rate changed.
pub fn install(class: &HostClass, update: ShareUpdate) -> anyhow::Result<bool> {
    crate::netns::in_namespace(&class.location.netns, || {
        let attachment = Attachment::open(&class.location)?;
        classes::set_share(&attachment, &class.name, update)
    })
}

/// A global class's share as `stats`, `class list` and metrics show it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareView {
    pub limit_bits_per_sec: u64,
    /// The share in force: the floor once the packet path installed it.
    pub share_bits_per_sec: u64,
    pub hosts: u32,
    /// Seconds since Redis last answered (`None`: never).
    pub age_seconds: Option<f64>,
    /// The daemon stopped renewing the share and the packet path fell to the floor.
    pub expired: bool,
}

impl ShareView {
    pub fn of(share: &shaper_common::GlobalShare) -> Self {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let expired = if share.expires_ns == 0 {
            share.answered_unix_ms != 0
        } else {
            state::monotonic_ns() > share.expires_ns
        };
        Self {
            limit_bits_per_sec: share.limit_bits_per_sec,
            share_bits_per_sec: if expired {
                share.floor_bits_per_sec
            } else {
                share.share_bits_per_sec
            },
            hosts: share.hosts,
            age_seconds: (share.answered_unix_ms != 0)
                .then(|| now_ms.saturating_sub(share.answered_unix_ms) as f64 / 1000.0),
            expired,
        }
    }
}
