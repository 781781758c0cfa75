//! The pinned state written back as a configuration file (`export | apply -f -` is a
//! no-op).

use super::schema::{ExportFile, ExportInterface};
use crate::{
    class_input::ClassInput,
    classes,
    state::{self, AttachMode, Attachment},
};
use anyhow::Result;

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
        // Egress splits forwarded aggregates by itself (`state::splitter`): not a setting.
        let split_aggregates = location.direction == state::Direction::Ingress
            && classes::split_state(&attachment)? != classes::Split::Off;
        let classes: Vec<ClassInput> = classes::read_classes(&attachment)?
            .iter()
            .map(|view| ClassInput::from_spec(location.direction, &view.spec))
            .collect();
        match interfaces
            .iter_mut()
            .find(|i| i.dev == location.dev && i.netns == location.netns)
        {
            Some(existing) => {
                existing.direction = "both".into();
                existing.split_aggregates |= split_aggregates;
                existing.class.extend(classes);
            }
            None => interfaces.push(ExportInterface {
                dev: location.dev.clone(),
                netns: location.netns.clone(),
                direction: location.direction.name().into(),
                flow_table_size,
                attach_mode: mode.name().into(),
                split_aggregates,
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
    use crate::units::{exact_rate, parse_rate};

    #[test]
    fn exact_rates_round_trip() {
        for bits in [8, 1_000, 1_500, 10_000_000, 12_345_678, 400_000_000_000] {
            assert_eq!(parse_rate(&exact_rate(bits)).unwrap(), bits);
        }
    }
}
