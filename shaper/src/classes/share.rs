//! A global class on this host: its `SHARES` entry and the class as it runs at a share
//! (installing a new share is in `renewal.rs`).

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
pub(super) fn floor_costs(spec: &ClassSpec, share: &GlobalShare) -> CostVersion {
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
