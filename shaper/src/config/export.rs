//! The pinned state written back as a configuration file (`export | apply -f -` is a
//! no-op).

use super::schema::{ExportClass, ExportFile, ExportInterface};
use crate::{
    classes::{self, ClassSpec, Meter},
    rules::{PortRange, Proto},
    state::{self, AttachMode, Attachment, Direction},
    units::format_duration_ns,
};
use anyhow::Result;

/// A rate in the shortest tc spelling that is exact.
pub(crate) fn exact_rate(bits: u64) -> String {
    for (unit, factor) in [
        ("gbit", 1_000_000_000),
        ("mbit", 1_000_000),
        ("kbit", 1_000),
    ] {
        if bits >= factor && bits.is_multiple_of(factor) {
            return format!("{}{unit}", bits / factor);
        }
    }
    format!("{bits}bit")
}

fn export_class(direction: Direction, spec: &ClassSpec) -> ExportClass {
    let rule = &spec.rule;
    let ports = |range: PortRange| (!range.is_any()).then(|| range.display());
    let metered = spec.meter != Meter::None;
    ExportClass {
        name: spec.name.clone(),
        direction: direction.name().into(),
        rate: exact_rate(spec.rate_bits_per_sec),
        burst: spec.burst_bytes,
        per: spec.scope.name().into(),
        prio: spec.prio,
        proto: (rule.proto != Proto::Any).then(|| rule.proto.name().into()),
        src: rule.src.map(|n| n.to_string()),
        dst: rule.dst.map(|n| n.to_string()),
        sport: ports(rule.sport),
        dport: ports(rule.dport),
        action: (!metered).then(|| spec.action.to_string()),
        excess_burst: spec.meter.excess_burst(),
        peak_rate: spec.meter.peak_rate().map(exact_rate),
        peak_burst: spec.meter.peak_burst(),
        exceed: metered.then(|| spec.exceed.to_string()),
        violate: metered.then(|| spec.action.to_string()),
        target: spec.codel.map(|c| format_duration_ns(c.target_ns)),
        interval: spec.codel.map(|c| format_duration_ns(c.interval_ns)),
        ecn: spec.codel.filter(|c| !c.ecn).map(|_| false),
        parent: spec.tree.as_ref().map(|t| t.parent.clone()),
        ceil: spec
            .tree
            .as_ref()
            .and_then(|t| t.ceil_bits_per_sec)
            .map(exact_rate),
        cburst: spec.tree.as_ref().and_then(|t| t.cburst_bytes),
        global: spec.global.as_ref().map(|g| g.key.clone()),
        on_coordinator_loss: spec.global.as_ref().map(|g| g.on_loss.name().to_string()),
        floor: spec
            .global
            .as_ref()
            .map(|g| exact_rate(g.floor_bits_per_sec)),
    }
}

/// The pinned state as a configuration file (optionally one namespace, one interface).
pub fn export(netns_filter: Option<&Option<String>>, dev: Option<&str>) -> Result<String> {
    let mut interfaces: Vec<ExportInterface> = Vec::new();
    for location in state::list_locations(netns_filter)? {
        if dev.is_some_and(|d| d != location.dev) {
            continue;
        }
        let attachment = Attachment::open(&location)?;
        let globals = attachment.globals()?;
        let flow_table_size = attachment.flow_table_size()?;
        let mode = AttachMode::from_globals(globals.attach_mode);
        let classes: Vec<ExportClass> = classes::read_classes(&attachment)?
            .iter()
            .map(|view| export_class(location.direction, &view.spec))
            .collect();
        match interfaces
            .iter_mut()
            .find(|i| i.dev == location.dev && i.netns == location.netns)
        {
            Some(existing) => {
                existing.direction = "both".into();
                existing.class.extend(classes);
            }
            None => interfaces.push(ExportInterface {
                dev: location.dev.clone(),
                netns: location.netns.clone(),
                direction: location.direction.name().into(),
                flow_table_size,
                attach_mode: mode.name().into(),
                class: classes,
            }),
        }
    }
    let mut text = String::from("# shaper configuration, written by `shaper export`\n\n");
    text.push_str(&toml::to_string(&ExportFile {
        interface: interfaces,
    })?);
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::parse_rate;

    #[test]
    fn exact_rates_round_trip() {
        for bits in [8, 1_000, 1_500, 10_000_000, 12_345_678, 400_000_000_000] {
            assert_eq!(parse_rate(&exact_rate(bits)).unwrap(), bits);
        }
    }
}
