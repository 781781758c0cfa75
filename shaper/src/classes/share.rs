//! A global class on this host: its `SHARES` entry, the class as it runs at a share, and
//! installing a new share (the same in-place change as `class change --rate`).

use super::*;
use crate::state::Attachment;
use anyhow::Result;
use shaper_common::{bucket::COST_VERSIONS, ClassConfig, CostVersion, GlobalShare};

/// A global class's entry at `share_bits_per_sec`, no expiry armed yet.
pub(super) fn new_share(spec: &ClassSpec, global: &Global, share_bits_per_sec: u64) -> GlobalShare {
    let mut key = [0u8; shaper_common::GLOBAL_KEY_LEN];
    let bytes = global.key.as_bytes();
    let len = bytes.len().min(key.len());
    key[..len].copy_from_slice(&bytes[..len]);
    let mut share = GlobalShare {
        limit_bits_per_sec: spec.rate_bits_per_sec,
        limit_burst_bytes: spec.burst_bytes,
        floor_bits_per_sec: global.floor_bits_per_sec,
        share_bits_per_sec,
        on_loss: global.on_loss.to_u8(),
        key,
        ..GlobalShare::default()
    };
    share.floor = floor_costs(spec, &share);
    share
}

/// The class as it runs on this host: rate and burst of its share.
pub(super) fn at_share(spec: &ClassSpec, share: &GlobalShare) -> ClassSpec {
    let mut rated = spec.clone();
    rated.rate_bits_per_sec = share.share_bits_per_sec;
    let minimum = if spec.action.action == shaper_common::Action::Shape {
        crate::units::default_shape_burst(share.share_bits_per_sec)
    } else {
        crate::units::default_burst(share.share_bits_per_sec)
    };
    rated.burst_bytes = share_burst(
        share.limit_bits_per_sec,
        share.limit_burst_bytes,
        share.share_bits_per_sec,
        minimum,
    );
    rated
}

/// The costs the packet path installs when the share expires: the class at its floor.
fn floor_costs(spec: &ClassSpec, share: &GlobalShare) -> CostVersion {
    let mut at_floor = *share;
    at_floor.share_bits_per_sec = share.floor_bits_per_sec;
    let rated = at_share(spec, &at_floor);
    let (drain_rate, drain_burst) = rated.drain();
    let (cost, _) = bucket_cost(
        drain_rate,
        drain_burst,
        spec.scope as u8,
        shaper_common::meter::METER_NONE,
        spec.action.action as u8,
        false,
    );
    CostVersion {
        cost,
        peak_cost: Default::default(),
    }
}

/// The cost version a change would install next (the floor's, at expiry).
pub(super) fn next_version(config: &ClassConfig) -> u32 {
    (config.version + 1) % COST_VERSIONS as u32
}

/// A global class as read back: its key, loss mode and floor.
pub(super) fn global_of(share: &GlobalShare) -> Global {
    let end = share
        .key
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(share.key.len());
    Global {
        key: String::from_utf8_lossy(&share.key[..end]).into_owned(),
        on_loss: OnLoss::from_u8(share.on_loss),
        floor_bits_per_sec: share.floor_bits_per_sec,
    }
}

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

/// A global class's entry for a change: its limit follows the class's rate and burst
/// (`meta`), its share scaled with a new limit (so a lowered limit lowers every host at
/// once); `None` for a class of this host alone.
pub(super) fn global_share(
    attachment: &Attachment,
    id: u32,
    config: &ClassConfig,
    meta: &shaper_common::ClassMeta,
) -> Result<Option<GlobalShare>> {
    if config.global == 0 {
        return Ok(None);
    }
    let mut shares = attachment.shares()?;
    let mut share = shares.get(&id, 0)?;
    let limit = meta.rate_bits_per_sec;
    if share.limit_bits_per_sec != limit || share.limit_burst_bytes != meta.burst_bytes {
        if share.limit_bits_per_sec != 0 && limit < share.limit_bits_per_sec {
            share.share_bits_per_sec = (share.share_bits_per_sec as u128 * limit as u128
                / share.limit_bits_per_sec as u128) as u64;
        }
        share.limit_bits_per_sec = limit;
        share.limit_burst_bytes = meta.burst_bytes;
        share.floor_bits_per_sec = share.floor_bits_per_sec.min(limit);
        share.share_bits_per_sec = share
            .share_bits_per_sec
            .clamp(share.floor_bits_per_sec, limit);
        shares.set(id, share, 0)?;
    }
    Ok(Some(share))
}
