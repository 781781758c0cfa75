//! A class ⇄ its map entries: the packet path's config, the bookkeeping meta, the
//! bucket's cost; and the classes read back from an attachment.

use super::*;
use crate::{
    actions::ActionSpec,
    rules::{bytes, words, PortRange, Proto, Rule},
    state::{decode_name, encode_name, possible_cpus, Attachment},
};
use anyhow::Result;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use shaper_common::{
    bucket::{credit_chunk, shared_burst},
    codel::{sparse_cost, DEFAULT_INTERVAL_NS, DEFAULT_TARGET_NS},
    meter::METER_NONE,
    Action, ByteCost, ClassConfig, ClassMeta, Scope, FAMILY_ANY, FAMILY_V4,
};
use std::net::{Ipv4Addr, Ipv6Addr};

pub(super) fn cidr_from_meta(family: u8, addr: [u32; 4], prefix: u8) -> Option<IpNet> {
    let raw = bytes(addr);
    match family {
        FAMILY_ANY => None,
        FAMILY_V4 => Ipv4Net::new(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]), prefix)
            .ok()
            .map(IpNet::V4),
        _ => Ipv6Net::new(Ipv6Addr::from(raw), prefix)
            .ok()
            .map(IpNet::V6),
    }
}

pub(super) fn cidr_to_meta(net: Option<IpNet>) -> (u8, [u32; 4], u8) {
    match net {
        None => (FAMILY_ANY, [0; 4], 0),
        Some(IpNet::V4(v4)) => {
            let mut raw = [0u8; 16];
            raw[..4].copy_from_slice(&v4.network().octets());
            (FAMILY_V4, words(raw), v4.prefix_len())
        }
        Some(IpNet::V6(v6)) => (
            shaper_common::FAMILY_V6,
            words(v6.network().octets()),
            v6.prefix_len(),
        ),
    }
}

impl ClassSpec {
    pub(super) fn from_meta(meta: &ClassMeta, config: &ClassConfig) -> Self {
        let exceed =
            ActionSpec::from_config(config.exceed_action, config.exceed_arg, config.exceed_mask);
        Self {
            name: decode_name(&meta.name),
            rule: Rule {
                src: cidr_from_meta(meta.src_family, meta.src_addr, meta.src_prefix),
                dst: cidr_from_meta(meta.dst_family, meta.dst_addr, meta.dst_prefix),
                proto: Proto::from_u8(meta.proto),
                sport: PortRange {
                    lo: meta.sport_lo,
                    hi: meta.sport_hi,
                },
                dport: PortRange {
                    lo: meta.dport_lo,
                    hi: meta.dport_hi,
                },
            },
            rate_bits_per_sec: meta.rate_bits_per_sec,
            burst_bytes: meta.burst_bytes,
            scope: Scope::try_from(config.scope).unwrap_or(Scope::Class),
            prio: meta.prio,
            action: ActionSpec::from_config(config.action, config.action_arg, config.action_mask),
            meter: Meter::from_meta(meta, config.meter),
            exceed,
            // Zero where a class predates the knobs: the defaults it ran with.
            codel: (config.action == Action::Shape as u8).then(|| Codel {
                target_ns: Some(meta.codel_target_ns)
                    .filter(|&t| t != 0)
                    .unwrap_or(DEFAULT_TARGET_NS),
                interval_ns: Some(meta.codel_interval_ns)
                    .filter(|&t| t != 0)
                    .unwrap_or(DEFAULT_INTERVAL_NS),
                ecn: meta.codel_no_ecn == 0,
                fair: Fair::from_code(meta.fair as u32),
            }),
            // The parent's name is filled in by `read_classes`, which knows every class.
            tree: (config.parent != 0 && config.meter == METER_NONE).then(|| Tree {
                parent: String::new(),
                ceil_bits_per_sec: Some(meta.peak_rate_bits_per_sec).filter(|&c| c != 0),
                cburst_bytes: Some(meta.peak_burst_bytes).filter(|&c| c != 0),
            }),
            // Filled in by `read_classes`, from the class's `SHARES` entry.
            global: None,
        }
    }

    pub(super) fn to_meta(&self, seq: u64) -> Result<ClassMeta> {
        let (src_family, src_addr, src_prefix) = cidr_to_meta(self.rule.src);
        let (dst_family, dst_addr, dst_prefix) = cidr_to_meta(self.rule.dst);
        let (peak_rate_bits_per_sec, peak_burst_bytes, excess_burst_bytes) = match self.meter {
            // A class in a tree keeps its ceiling there (0: as its rate or burst).
            Meter::None => match &self.tree {
                Some(tree) => (
                    tree.ceil_bits_per_sec.unwrap_or(0),
                    tree.cburst_bytes.unwrap_or(0),
                    0,
                ),
                None => (0, 0, 0),
            },
            Meter::SrTcm { excess_burst_bytes } => (0, 0, excess_burst_bytes),
            Meter::TrTcm {
                peak_rate_bits_per_sec,
                peak_burst_bytes,
            } => (peak_rate_bits_per_sec, peak_burst_bytes, 0),
        };
        Ok(ClassMeta {
            peak_rate_bits_per_sec,
            peak_burst_bytes,
            excess_burst_bytes,
            name: encode_name(&self.name)?,
            seq,
            rate_bits_per_sec: self.rate_bits_per_sec,
            burst_bytes: self.burst_bytes,
            src_addr,
            dst_addr,
            prio: self.prio,
            sport_lo: self.rule.sport.lo,
            sport_hi: self.rule.sport.hi,
            dport_lo: self.rule.dport.lo,
            dport_hi: self.rule.dport.hi,
            src_family,
            src_prefix,
            dst_family,
            dst_prefix,
            proto: self.rule.proto.to_u8(),
            in_use: 1,
            codel_target_ns: self.codel.map_or(0, |c| c.target_ns),
            codel_interval_ns: self.codel.map_or(0, |c| c.interval_ns),
            codel_no_ecn: self.codel.is_some_and(|c| !c.ecn) as u8,
            fair: self.codel.map_or(0, |c| c.fair.code() as u8),
            ..ClassMeta::default()
        })
    }

    /// The packet path's config; `parent` is the parent's id for a class in a tree.
    pub(super) fn config(&self, generation: u32, parent: Option<u32>) -> ClassConfig {
        let (meter, mut peak_cost) = self
            .meter
            .second_cost(self.rate_bits_per_sec, self.burst_bytes);
        if let Some(tree) = &self.tree {
            peak_cost = self.second_word_cost(tree);
        }
        // A shape class's word is its virtual queue, draining at `drain()`.
        let (drain_rate, drain_burst) = self.drain();
        let (cost, credit_chunk) = bucket_cost(
            drain_rate,
            drain_burst,
            self.scope as u8,
            meter,
            self.action.action as u8,
            parent.is_some(),
        );
        let mut config = ClassConfig {
            cost,
            credit_chunk,
            peak_cost,
            meter,
            exceed_action: self.exceed.action as u8,
            exceed_arg: self.exceed.arg,
            exceed_mask: self.exceed.mask,
            generation,
            scope: self.scope as u8,
            action: self.action.action as u8,
            action_arg: self.action.arg,
            action_mask: self.action.mask,
            in_use: 1,
            codel: self.codel.map(|c| c.config(drain_rate)).unwrap_or_default(),
            sparse_cost: if self.codel.is_some() {
                sparse_cost(drain_rate)
            } else {
                ByteCost::default()
            },
            ..ClassConfig::default()
        };
        config.parent = parent.map_or(0, |id| id as u16 + 1);
        config.start_costs();
        config
    }
}

impl ClassSpec {
    /// The second word's cost of a class in a tree: the ceiling's for policing and marking
    /// (`shaper_common::hierarchy`); for shape, whose first word drains at the ceiling,
    /// the guarantee's (it tells when the class borrows).
    pub(crate) fn second_word_cost(&self, tree: &Tree) -> ByteCost {
        if self.action.action == Action::Shape {
            ByteCost::new(self.rate_bits_per_sec, self.burst_bytes)
        } else {
            ByteCost::new(
                tree.ceil(self.rate_bits_per_sec),
                tree.cburst(self.burst_bytes),
            )
        }
    }
}

/// The class bucket's cost and per-CPU credit chunk. Class-scoped buckets of policing and
/// marking classes get per-CPU credit (see `shaper_common::bucket`), with the shared
/// bucket's burst lowered by what the CPUs may hold; `ecn` (which marks by the bucket's
/// occupancy), `shape`, meters, per-key buckets and classes with a parent (whose walk
/// takes each word per packet) are charged per packet.
pub(crate) fn bucket_cost(
    rate_bits_per_sec: u64,
    burst_bytes: u64,
    scope: u8,
    meter: u8,
    action: u8,
    has_parent: bool,
) -> (ByteCost, u32) {
    let eligible = scope == Scope::Class as u8
        && !has_parent
        && meter == METER_NONE
        && action != Action::Ecn as u8
        && action != Action::Shape as u8;
    let cpus = possible_cpus();
    let chunk = if eligible {
        credit_chunk(rate_bits_per_sec, burst_bytes, cpus)
    } else {
        0
    };
    (
        ByteCost::new(rate_bits_per_sec, shared_burst(burst_bytes, cpus, chunk)),
        chunk as u32,
    )
}

/// Reads every class of an attachment with its counters.
pub fn read_classes(attachment: &Attachment) -> Result<Vec<ClassView>> {
    let configs = attachment.classes()?;
    // Opened once: each open is a syscall and a descriptor to close.
    let stats = attachment.stats()?;
    let list = attachment.class_list()?;
    let names: std::collections::HashMap<u32, String> = list
        .iter()
        .map(|(id, meta)| (*id, decode_name(&meta.name)))
        .collect();
    let mut views = Vec::new();
    for (id, meta) in list {
        let config = configs.get(&id, 0)?;
        let spec = stored_spec(attachment, id, &meta, &config, |parent| {
            Ok(names.get(&parent).cloned().unwrap_or_default())
        })?;
        views.push(ClassView {
            id,
            spec,
            seq: meta.seq,
            stats: crate::state::summed(&stats.get(&id, 0)?),
        });
    }
    Ok(views)
}

/// One class's spec as stored (its parent's name and its global key filled in), by name.
pub fn read_class(attachment: &Attachment, name: &str) -> Result<Option<(u32, ClassSpec)>> {
    let Some((id, meta)) = attachment.find_class(name)? else {
        return Ok(None);
    };
    let config = attachment.classes()?.get(&id, 0)?;
    let meta_map = attachment.meta()?;
    let spec = stored_spec(attachment, id, &meta, &config, |parent| {
        Ok(decode_name(&meta_map.get(&parent, 0)?.name))
    })?;
    Ok(Some((id, spec)))
}

/// A class's spec from its maps; `parent_name` names a parent by its id.
fn stored_spec(
    attachment: &Attachment,
    id: u32,
    meta: &ClassMeta,
    config: &ClassConfig,
    parent_name: impl Fn(u32) -> Result<String>,
) -> Result<ClassSpec> {
    let mut spec = ClassSpec::from_meta(meta, config);
    if config.global != 0 {
        spec.global = Some(global_of(&attachment.shares()?.get(&id, 0)?));
    }
    if let Some(tree) = &mut spec.tree {
        tree.parent = parent_name(config.parent as u32 - 1)?;
    }
    Ok(spec)
}

/// A global class as read back: its key, loss mode and floor.
pub(super) fn global_of(share: &shaper_common::GlobalShare) -> Global {
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
