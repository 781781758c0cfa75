//! The daemon's side of a global class: renewing the share in force, or installing a new
//! one (the same in-place change as `class change --rate`, so this sits above `change`).

use super::{
    encode::global_of,
    share::{floor_costs, next_version},
    *,
};
use crate::state::Attachment;
use anyhow::Result;
use shaper_common::{ClassConfig, GlobalShare};

/// What the daemon learnt for a global class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareUpdate {
    /// This host's share now (bit/s), within [floor, limit].
    pub share_bits_per_sec: u64,
    /// Hosts sharing the limit at the last answer (0: none yet).
    pub hosts: u32,
    /// When Redis last answered (Unix ms; 0: never).
    pub answered_unix_ms: u64,
    /// `bpf_ktime_get_ns()` time past which the packet path installs the floor.
    pub expires_ns: u64,
}

/// The `SHARES` entry of global class `id`.
pub fn share_of(attachment: &Attachment, id: u32) -> Result<GlobalShare> {
    Ok(attachment.shares()?.get(&id, 0)?)
}

/// Renews a global class's share as it is: when `update` keeps the share in force (and
/// the packet path has not fallen to the floor), its hosts, answer time and expiry are
/// written and `true` returned; otherwise the share must be installed with
/// [`set_share`] (under the state lock). One map entry of the daemon's own: no lock
/// needed.
pub fn renew_share(attachment: &Attachment, name: &str, update: ShareUpdate) -> Result<bool> {
    match Renewal::read(attachment, name, update)? {
        Some(renewal) => renewal.write(attachment),
        None => Ok(false),
    }
}

/// A renewal read but not written yet ([`renew_share`]'s two steps: apart, a test can
/// put the packet path's floor install between them).
pub struct Renewal {
    id: u32,
    /// The class's cost version when the share was read.
    version: u32,
    share: GlobalShare,
}

impl Renewal {
    /// Class `name`'s share renewed by `update`; `None` when `update` does not keep the
    /// share in force or the packet path has fallen to the floor.
    pub fn read(attachment: &Attachment, name: &str, update: ShareUpdate) -> Result<Option<Self>> {
        let Some((id, _)) = find(attachment, name)? else {
            return Ok(None);
        };
        let config = attachment.classes()?.get(&id, 0)?;
        let mut share = attachment.shares()?.get(&id, 0)?;
        if config.global == 0 || needs_install(&config, &share, update.share_bits_per_sec) {
            return Ok(None);
        }
        share.hosts = update.hosts;
        share.answered_unix_ms = update.answered_unix_ms;
        share.floor_version = next_version(&config);
        share.expires_ns = update.expires_ns;
        Ok(Some(Self {
            id,
            version: config.version,
            share,
        }))
    }

    /// Writes the renewal. The entry is written whole, so a floor the packet path
    /// installed since [`Renewal::read`] (the share expired meanwhile) would be covered
    /// by a live-looking entry while the class runs at its floor: seen by the class's cost
    /// version having moved, the entry is marked expired again and `false` returned, so
    /// the share is installed with [`set_share`].
    pub fn write(mut self, attachment: &Attachment) -> Result<bool> {
        let mut shares = attachment.shares()?;
        shares.set(self.id, self.share, 0)?;
        let now = attachment.classes()?.get(&self.id, 0)?;
        if now.version != self.version {
            self.share.expires_ns = 0;
            shares.set(self.id, self.share, 0)?;
            return Ok(false);
        }
        Ok(true)
    }
}

/// Whether `wanted` differs from the share in force, or the packet path installed the
/// floor (the share expired) and the share must go back in.
fn needs_install(config: &ClassConfig, share: &GlobalShare, wanted: u64) -> bool {
    let wanted = wanted.clamp(share.floor_bits_per_sec, share.limit_bits_per_sec);
    let floored = share.expires_ns == 0
        && config.version == share.floor_version
        && config.cost == share.floor.cost
        && share.share_bits_per_sec != share.floor_bits_per_sec;
    wanted != share.share_bits_per_sec || floored
}

/// Installs `update` on global class `name`: a share that differs from the one in force
/// (or a floor the packet path installed at expiry) is changed in place, bucket and
/// counters kept; then the floor and the expiry are armed again. Needs the state lock.
/// Returns whether the class's rate changed.
pub fn set_share(attachment: &Attachment, name: &str, update: ShareUpdate) -> Result<bool> {
    let (id, meta) = find(attachment, name)?
        .ok_or_else(|| crate::error::runtime(format!("no class '{name}'")))?;
    let mut shares = attachment.shares()?;
    let configs = attachment.classes()?;
    let config = configs.get(&id, 0)?;
    if config.global == 0 {
        return Err(crate::error::runtime(format!(
            "class '{name}' is not a global class"
        )));
    }
    let mut share = shares.get(&id, 0)?;
    let changed = needs_install(&config, &share, update.share_bits_per_sec);
    share.share_bits_per_sec = update
        .share_bits_per_sec
        .clamp(share.floor_bits_per_sec, share.limit_bits_per_sec);
    share.hosts = update.hosts;
    share.answered_unix_ms = update.answered_unix_ms;
    if changed {
        // Disarmed while the costs change, so the packet path cannot install a floor of
        // the version the change is about to take.
        share.expires_ns = 0;
        shares.set(id, share, 0)?;
        // Rates, HTB class and CoDel follow the share (see `change`).
        super::change::apply(attachment, name, super::Change::default())?;
    }
    let config = configs.get(&id, 0)?;
    let mut spec = ClassSpec::from_meta(&meta, &config);
    spec.global = Some(global_of(&share));
    share.floor = floor_costs(&spec, &share);
    share.floor_version = next_version(&config);
    share.expires_ns = update.expires_ns;
    shares.set(id, share, 0)?;
    Ok(changed)
}
