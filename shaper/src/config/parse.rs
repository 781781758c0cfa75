//! Parsing and checking a file: every problem comes back with its line and field.

use super::coordination::{self, Coordination};
use super::schema::{ClassEntry, FileConfig, InterfaceEntry, Scalar};
use crate::{
    class_input::{ClassInput, FIELDS},
    classes::ClassSpec,
    state::{AttachMode, Direction},
};
use shaper_common::DEFAULT_FLOW_TABLE_SIZE;
use std::{collections::BTreeMap, fmt, ops::Range};

/// One problem found in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub line: usize,
    pub field: String,
    pub message: String,
}

/// Every problem of a file, each printed as `FILE:LINE: FIELD: message`.
#[derive(Debug)]
pub struct Problems {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, problem) in self.problems.iter().enumerate() {
            let separator = if index > 0 { "\n" } else { "" };
            let (file, line, field) = (&self.file, problem.line, &problem.field);
            write!(f, "{separator}{file}:{line}: {field}: {}", problem.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for Problems {}

/// The state a file asks for on one interface.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredInterface {
    pub netns: Option<String>,
    pub dev: String,
    pub directions: Vec<Direction>,
    pub flow_table_size: u32,
    pub attach_mode: Option<AttachMode>,
    /// The ingress attachment splits aggregates (`attach --split-aggregates`).
    pub split_aggregates: bool,
    /// Classes per direction, in file order.
    pub classes: Vec<(Direction, ClassSpec)>,
}

impl DesiredInterface {
    pub fn describe(&self) -> String {
        match &self.netns {
            None => self.dev.clone(),
            Some(ns) => format!("{} (netns {ns})", self.dev),
        }
    }
}

/// A parsed, checked configuration.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Desired {
    pub coordination: Option<Coordination>,
    pub interfaces: Vec<DesiredInterface>,
}

fn line_of(text: &str, span: Range<usize>) -> usize {
    text[..span.start.min(text.len())].matches('\n').count() + 1
}

fn direction_of(text: &str) -> Result<Vec<Direction>, String> {
    match (text, Direction::from_name(text)) {
        ("both", _) => Ok(Direction::BOTH.to_vec()),
        (_, Some(direction)) => Ok(vec![direction]),
        (other, None) => Err(format!(
            "unknown direction '{other}' (expected egress, ingress or both)"
        )),
    }
}

/// Parses and checks a whole file; `file` names it in the problems.
pub fn parse(file: &str, text: &str) -> Result<Desired, Problems> {
    let problems = |problems| Problems {
        file: file.to_string(),
        problems,
    };
    let config: FileConfig = toml::from_str(text).map_err(|error| {
        let line = error.span().map(|s| line_of(text, s)).unwrap_or(1);
        let message = error.message().trim().to_string();
        problems(vec![Problem {
            line,
            field: "toml".into(),
            message,
        }])
    })?;
    let line_starts = std::iter::once(0)
        .chain(text.match_indices('\n').map(|(at, _)| at + 1))
        .collect();
    let mut checker = FileChecker {
        text,
        line_starts,
        found: Vec::new(),
        interfaces: BTreeMap::new(),
        global_keys: BTreeMap::new(),
    };
    let coordination = config.coordination.as_ref().and_then(|entry| {
        coordination::check(entry, &mut |span, field, message| {
            checker.report(span, field, message)
        })
    });
    let desired = Desired {
        coordination,
        interfaces: config
            .interface
            .iter()
            .map(|entry| checker.interface(entry))
            .collect(),
    };
    if desired.coordination.is_none() && config.coordination.is_none() {
        for entry in config.interface.iter().flat_map(|i| &i.class) {
            if let Some(key) = class_field(entry, "global") {
                checker.report(
                    key.span(),
                    "global",
                    "a global class needs [coordination] redis = \"redis://HOST:PORT\" in the file"
                        .to_string(),
                );
            }
        }
    }
    let mut found = checker.found;
    if found.is_empty() {
        Ok(desired)
    } else {
        found.sort_by_key(|p| p.line);
        Err(problems(found))
    }
}

/// Checks a file's entries, collecting every problem with its line.
pub(super) struct FileChecker<'a> {
    text: &'a str,
    /// Where each line of `text` starts: a span's line by binary search (counting the
    /// newlines before every class name made a 10 000-class file take 5 s to check).
    line_starts: Vec<usize>,
    found: Vec<Problem>,
    /// Interfaces described so far, with the line that described them.
    interfaces: BTreeMap<(Option<String>, String), usize>,
    /// Global keys used so far, with their line: a host reports once per key.
    global_keys: BTreeMap<String, usize>,
}

impl FileChecker<'_> {
    fn line(&self, span: Range<usize>) -> usize {
        self.line_starts
            .partition_point(|&start| start <= span.start)
    }

    pub(super) fn report(&mut self, span: Range<usize>, field: &str, message: String) {
        self.found.push(Problem {
            line: self.line(span),
            field: field.to_string(),
            message,
        });
    }

    /// One `[[interface]]`: its own fields, then its classes.
    fn interface(&mut self, entry: &InterfaceEntry) -> DesiredInterface {
        let dev = entry.dev.get_ref().clone();
        if let Err(error) = crate::netns::check_ifname(&dev) {
            self.report(entry.dev.span(), "dev", error.to_string());
        }
        let netns = entry.netns.as_ref().map(|n| n.get_ref().clone());
        if let Some(name) = &entry.netns {
            if name.get_ref().is_empty() || name.get_ref().contains('/') {
                let message = format!("bad network namespace name '{}'", name.get_ref());
                self.report(name.span(), "netns", message);
            }
        }
        let key = (netns.clone(), dev.clone());
        match self.interfaces.get(&key) {
            Some(first) => {
                let message = format!("interface '{dev}' is already described at line {first}");
                self.report(entry.dev.span(), "dev", message);
            }
            None => {
                let line = self.line(entry.dev.span());
                self.interfaces.insert(key, line);
            }
        }
        let directions = match &entry.direction {
            None => vec![Direction::Egress],
            Some(d) => direction_of(d.get_ref()).unwrap_or_else(|message| {
                self.report(d.span(), "direction", message);
                vec![Direction::Egress]
            }),
        };
        let flow_table_size = self.flow_table_size(entry);
        let attach_mode = self.attach_mode(entry);
        let split_aggregates = self.split_aggregates(entry, &directions);
        let classes = self.classes(entry, &dev, &directions);
        DesiredInterface {
            netns,
            dev,
            directions,
            flow_table_size,
            attach_mode,
            split_aggregates,
            classes,
        }
    }

    fn flow_table_size(&mut self, entry: &InterfaceEntry) -> u32 {
        let Some(size) = &entry.flow_table_size else {
            return DEFAULT_FLOW_TABLE_SIZE;
        };
        match u32::try_from(*size.get_ref()) {
            Ok(value) if (1..=16_777_216).contains(&value) => value,
            _ => {
                let message = format!("{} is not in 1..=16777216", size.get_ref());
                self.report(size.span(), "flow_table_size", message);
                DEFAULT_FLOW_TABLE_SIZE
            }
        }
    }

    fn split_aggregates(&mut self, entry: &InterfaceEntry, directions: &[Direction]) -> bool {
        let split = entry
            .split_aggregates
            .as_ref()
            .filter(|split| *split.get_ref());
        if let (Some(split), false) = (split, directions.contains(&Direction::Ingress)) {
            let message = "splits traffic where it arrives: needs direction ingress or both";
            self.report(split.span(), "split_aggregates", message.into());
        }
        split.is_some()
    }

    fn attach_mode(&mut self, entry: &InterfaceEntry) -> Option<AttachMode> {
        let mode = entry.attach_mode.as_ref()?;
        let parsed = mode.get_ref().parse::<AttachMode>();
        parsed
            .map_err(|message| self.report(mode.span(), "attach_mode", message))
            .ok()
    }

    /// The interface's classes: each checked by the validator, then against the
    /// interface (its directions) and each other (names are unique per direction).
    fn classes(
        &mut self,
        entry: &InterfaceEntry,
        dev: &str,
        directions: &[Direction],
    ) -> Vec<(Direction, ClassSpec)> {
        let mut classes = Vec::new();
        let mut names: BTreeMap<(Direction, String), usize> = BTreeMap::new();
        for class in &entry.class {
            let (direction, spec) = match class_spec(class, self.text) {
                Ok(checked) => checked,
                Err(mut problems) => {
                    self.found.append(&mut problems);
                    continue;
                }
            };
            if !directions.contains(&direction) {
                let span = field_span(class, "direction");
                let attached: Vec<&str> = directions.iter().map(|d| d.name()).collect();
                let message = format!(
                    "class '{}' is on {} but interface {dev} attaches only {}",
                    spec.name,
                    direction.name(),
                    attached.join(" and ")
                );
                self.report(span, "direction", message);
            }
            if let (Some(global), Some(field)) = (&spec.global, class_field(class, "global")) {
                let line = self.line(field.span());
                if let Some(first) = self.global_keys.get(&global.key) {
                    let message = format!(
                        "global key '{}' is already used at line {first}: a host holds one share of a limit",
                        global.key
                    );
                    self.report(field.span(), "global", message);
                } else {
                    self.global_keys.insert(global.key.clone(), line);
                }
            }
            let key = (direction, spec.name.clone());
            match names.get(&key) {
                Some(first) => {
                    let message = format!(
                        "class '{}' is already defined on {dev} {} at line {first}",
                        spec.name,
                        direction.name()
                    );
                    self.report(field_span(class, "name"), "name", message);
                }
                None => {
                    names.insert(key, self.line(field_span(class, "name")));
                }
            }
            classes.push((direction, spec));
        }
        classes
    }
}

/// One class, checked by the validator every front end uses; each problem is reported at
/// the line of its field.
fn class_spec(entry: &ClassEntry, text: &str) -> Result<(Direction, ClassSpec), Vec<Problem>> {
    let mut input = ClassInput::default();
    let mut unknown = Vec::new();
    for (key, value) in entry.get_ref() {
        match input.get_mut(key.get_ref()) {
            Some(slot) => *slot = Some(value.get_ref().text()),
            None => unknown.push(Problem {
                line: line_of(text, key.span()),
                field: key.get_ref().clone(),
                message: format!(
                    "unknown class field `{}`, expected one of {}",
                    key.get_ref(),
                    crate::classes::expected(FIELDS.iter().map(|field| field.name))
                ),
            }),
        }
    }
    if !unknown.is_empty() {
        return Err(unknown);
    }
    input.check().map_err(|errors| {
        errors
            .into_iter()
            .map(|error| Problem {
                line: line_of(text, field_span(entry, error.field)),
                field: error.field.to_string(),
                message: error.message,
            })
            .collect()
    })
}

/// A class field as the file gives it, with its place.
fn class_field<'a>(entry: &'a ClassEntry, field: &str) -> Option<&'a toml::Spanned<Scalar>> {
    let mut fields = entry.get_ref().iter();
    fields
        .find(|(key, _)| key.get_ref() == field)
        .map(|(_, value)| value)
}

/// Where a class field stands in the file; the class's name when the field is absent
/// (a problem of a combination names the field that must change), the class's table
/// when the name is too.
fn field_span(entry: &ClassEntry, field: &str) -> Range<usize> {
    class_field(entry, field)
        .or_else(|| class_field(entry, "name"))
        .map_or(entry.span(), |value| value.span())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::TEST_FILE as GOOD, rules::PortRange};

    #[test]
    fn a_global_class_parses_with_its_defaults_and_its_problems_have_lines() {
        let file = r#"
[coordination]
redis = "redis://127.0.0.1:6379/0"
host_id = "node-a"

[[interface]]
dev = "eth0"

[[interface.class]]
name = "tenant"
rate = "30mbit"
global = "tenant-a"
"#;
        let desired = parse("global.toml", file).unwrap();
        let coordination = desired.coordination.unwrap();
        assert_eq!(coordination.host_id, "node-a");
        assert_eq!(coordination.interval, crate::global::DEFAULT_INTERVAL);
        let global = desired.interfaces[0].classes[0].1.global.clone().unwrap();
        assert_eq!(global.key, "tenant-a");
        assert_eq!(global.floor_bits_per_sec, 300_000);
        assert_eq!(global.on_loss, crate::classes::OnLoss::Static);

        let bad = r#"
[coordination]
redis = "http://127.0.0.1:6379"
interval = "20s"

[[interface]]
dev = "eth0"

[[interface.class]]
name = "a"
rate = "30mbit"
global = "shared"
floor = "40mbit"

[[interface.class]]
name = "b"
rate = "30mbit"
global = "shared"
per = "flow"

[[interface.class]]
name = "c"
rate = "1mbit"
on_coordinator_loss = "open"
"#;
        let problems = parse("bad.toml", bad).unwrap_err().to_string();
        for expected in [
            "bad.toml:3: redis: bad Redis URL 'http://127.0.0.1:6379'",
            "bad.toml:4: interval: interval 20s is not within 50ms..=10s",
            "bad.toml:13: floor: floor 40Mbit is not below the limit 30Mbit",
            "bad.toml:19: per: a global class's limit is for the class as a whole",
            "bad.toml:24: on_coordinator_loss: on_coordinator_loss and floor tune a global class",
        ] {
            assert!(problems.contains(expected), "{expected}\nin:\n{problems}");
        }
        let twice = file.to_string()
            + "\n[[interface.class]]\nname = \"again\"\nrate = \"1mbit\"\nglobal = \"tenant-a\"\n";
        let problems = parse("twice.toml", &twice).unwrap_err().to_string();
        assert!(
            problems.contains("global key 'tenant-a' is already used at line 12"),
            "{problems}"
        );
        let alone = file.replace(
            "[coordination]\nredis = \"redis://127.0.0.1:6379/0\"\nhost_id = \"node-a\"\n",
            "",
        );
        let problems = parse("alone.toml", &alone).unwrap_err().to_string();
        assert!(
            problems.contains("a global class needs [coordination]"),
            "{problems}"
        );
        let dotted = file.replace("host_id = \"node-a\"", "host_id = \".hosts\"");
        let problems = parse("dotted.toml", &dotted).unwrap_err().to_string();
        assert!(
            problems.contains("dotted.toml:4: host_id: bad host_id '.hosts'"),
            "{problems}"
        );
    }

    #[test]
    fn a_password_comes_from_a_file_only_its_owner_reads_never_echoed() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("shaper-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("redis.password");
        std::fs::write(&file, "s3cret\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let text = |url: &str| {
            format!(
                "[coordination]\nredis = \"{url}\"\npassword_file = \"{}\"\n",
                file.display()
            )
        };
        let desired = parse("pw.toml", &text("redis://node-a@127.0.0.1:6379")).unwrap();
        let coordination = desired.coordination.unwrap();
        assert_eq!(coordination.password_file.as_deref(), Some(file.as_path()));
        assert_eq!(crate::global::read_password(&file).unwrap(), "s3cret");
        // Readable by the group: refused, with the fix.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let problems = parse("pw.toml", &text("redis://node-a@127.0.0.1:6379"))
            .unwrap_err()
            .to_string();
        assert!(problems.contains("pw.toml:3: password_file:"), "{problems}");
        assert!(problems.contains("chmod 600"), "{problems}");
        // A password in the URL as well: one place only. A bad URL's message hides it.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let problems = parse("pw.toml", &text("redis://node-a:hunter2@127.0.0.1:6379"))
            .unwrap_err()
            .to_string();
        assert!(problems.contains("in the URL already"), "{problems}");
        let problems = parse("pw.toml", &text("http://node-a:hunter2@127.0.0.1:6379"))
            .unwrap_err()
            .to_string();
        assert!(!problems.contains("hunter2"), "{problems}");
        assert!(
            problems.contains("http://node-a:***@127.0.0.1:6379"),
            "{problems}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_good_file_parses_with_cli_defaults() {
        let desired = parse("good.toml", GOOD).unwrap();
        let interface = &desired.interfaces[0];
        assert_eq!(interface.directions, Direction::BOTH.to_vec());
        assert_eq!(interface.flow_table_size, DEFAULT_FLOW_TABLE_SIZE);
        let (direction, voip) = &interface.classes[0];
        assert_eq!(*direction, Direction::Egress);
        assert_eq!(voip.rate_bits_per_sec, 10_000_000);
        assert_eq!(voip.burst_bytes, crate::units::default_burst(10_000_000));
        assert_eq!(voip.rule.dport, PortRange { lo: 5060, hi: 5060 });
        assert_eq!(voip.action.arg, 46);
        let (direction, inbound) = &interface.classes[1];
        assert_eq!(*direction, Direction::Ingress);
        assert_eq!(inbound.scope, shaper_common::Scope::Src);
    }

    #[test]
    fn every_problem_is_reported_with_line_and_field() {
        let bad = r#"
[[interface]]
dev = "eth0"

[[interface.class]]
name = "a"
rate = "10 parsecs"
dport = "70000"

[[interface.class]]
name = "a"
rate = "1mbit"
direction = "ingress"
src = "300.1.1.1/8"
"#;
        let problems = parse("bad.toml", bad).unwrap_err();
        let got: Vec<(usize, &str)> = problems
            .problems
            .iter()
            .map(|p| (p.line, p.field.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![(7, "rate"), (8, "dport"), (14, "src")],
            "{problems}"
        );
        assert!(problems.to_string().starts_with("bad.toml:7: rate: "));
    }

    #[test]
    fn cross_field_problems_and_duplicates_are_found() {
        let bad = r#"
[[interface]]
dev = "eth0"

[[interface.class]]
name = "a"
rate = "1mbit"
exceed = "pass"

[[interface.class]]
name = "b"
rate = "1mbit"
direction = "ingress"

[[interface.class]]
name = "b"
rate = "2mbit"

[[interface.class]]
name = "b"
rate = "3mbit"

[[interface]]
dev = "eth0"
"#;
        let problems = parse("bad.toml", bad).unwrap_err();
        let got: Vec<(usize, &str)> = problems
            .problems
            .iter()
            .map(|p| (p.line, p.field.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![(8, "exceed"), (13, "direction"), (20, "name"), (24, "dev")],
            "{problems}"
        );
    }

    #[test]
    fn splitting_aggregates_needs_an_ingress_attachment() {
        let file = |direction: &str| {
            format!("[[interface]]\ndev = \"r0\"\ndirection = \"{direction}\"\nsplit_aggregates = true\n")
        };
        for direction in ["ingress", "both"] {
            let desired = parse("split.toml", &file(direction)).unwrap();
            assert!(desired.interfaces[0].split_aggregates, "{direction}");
        }
        let problems = parse("split.toml", &file("egress")).unwrap_err();
        assert_eq!(problems.problems[0].line, 4, "{problems}");
        assert_eq!(problems.problems[0].field, "split_aggregates");
        let unsaid = parse("split.toml", "[[interface]]\ndev = \"r0\"\n").unwrap();
        assert!(!unsaid.interfaces[0].split_aggregates);
    }

    #[test]
    fn syntax_and_unknown_fields_point_at_their_line() {
        let problems = parse("x.toml", "[[interface]]\ndev = \"e\"\nrat = 1\n").unwrap_err();
        assert_eq!(problems.problems[0].line, 3);
        assert!(problems.problems[0].message.contains("rat"), "{problems}");
        let problems = parse("x.toml", "[[interface]]\ndev = \n").unwrap_err();
        assert_eq!(problems.problems[0].line, 2);
    }

    #[test]
    fn the_example_in_contrib_parses() {
        let text = include_str!("../../../contrib/shaper.toml");
        let desired = parse("contrib/shaper.toml", text).unwrap();
        assert_eq!(desired.interfaces.len(), 2);
        assert_eq!(desired.interfaces[0].classes.len(), 4);
    }
}
