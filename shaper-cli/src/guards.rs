//! Every option of every command, and every class field, is guarded: tests/guards.toml
//! names, for each, the tests that fail if its value were ignored or replaced by its
//! default. This test reads the options from the command line's own definition and the
//! fields from `shaper::class_input::FIELDS`, and fails when one has no entry, when an
//! entry names nothing that exists, or when a named test is not a test.

use crate::cli::Cli;
use clap::CommandFactory as _;
use std::collections::{BTreeMap, BTreeSet};

/// Every option and positional argument, as `COMMAND PATH --long` or `COMMAND PATH
/// VALUE` (global options once, without a command).
fn options() -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let root = Cli::command();
    for arg in root.get_arguments() {
        if let Some(name) = name_of(arg) {
            found.insert(name);
        }
    }
    walk(&root, "", &mut found);
    found
}

fn walk(command: &clap::Command, path: &str, found: &mut BTreeSet<String>) {
    for sub in command.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        let path = format!("{path}{}", sub.get_name());
        for arg in sub.get_arguments().filter(|arg| !arg.is_global_set()) {
            if let Some(name) = name_of(arg) {
                found.insert(format!("{path} {name}"));
            }
        }
        walk(sub, &format!("{path} "), found);
    }
}

fn name_of(arg: &clap::Arg) -> Option<String> {
    let id = arg.get_id().as_str();
    if id == "help" || id == "version" {
        return None;
    }
    Some(match arg.get_long() {
        Some(long) => format!("--{long}"),
        None => id.to_uppercase(),
    })
}

/// tests/guards.toml: a section per kind (`options`, `fields`, `cni`), each name with
/// its tests (`FILE::TEST`, FILE under the workspace).
fn registry() -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let path = crate::docs::repository().join("tests/guards.toml");
    let text = std::fs::read_to_string(&path).expect("tests/guards.toml");
    toml::from_str(&text).expect("tests/guards.toml: a table of name = [\"FILE::TEST\", ...]")
}

/// Whether `FILE::TEST` names a `#[test]` function of that file.
fn is_a_test(guard: &str) -> Result<(), String> {
    let (file, test) = guard
        .rsplit_once("::")
        .ok_or_else(|| format!("{guard}: not FILE::TEST"))?;
    let text = std::fs::read_to_string(crate::docs::repository().join(file))
        .map_err(|_| format!("{guard}: no file {file}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let at = lines
        .iter()
        .position(|line| line.trim_start().starts_with(&format!("fn {test}(")))
        .ok_or_else(|| format!("{guard}: no fn {test} in {file}"))?;
    if lines[at.saturating_sub(3)..at]
        .iter()
        .any(|line| line.trim() == "#[test]")
    {
        Ok(())
    } else {
        Err(format!("{guard}: fn {test} is not a #[test]"))
    }
}

#[test]
fn every_option_and_field_has_a_guard() {
    let registry = registry();
    let section = |name: &str| registry.get(name).cloned().unwrap_or_default();
    let (listed_options, listed_fields) = (section("options"), section("fields"));
    let options = options();
    let fields: BTreeSet<String> = shaper::class_input::FIELDS
        .iter()
        .map(|field| field.name.to_string())
        .collect();
    // The command line's definition really is read: a few known options.
    for known in [
        "--netns",
        "attach --direction",
        "class change --burst",
        "stats --count",
    ] {
        assert!(options.contains(known), "{known} not among {options:?}");
    }
    assert!(fields.contains("rate") && fields.len() > 20, "{fields:?}");
    let mut problems = Vec::new();
    for (kind, names, listed) in [
        ("option", &options, &listed_options),
        ("field", &fields, &listed_fields),
    ] {
        for name in names {
            match listed.get(name) {
                Some(guards) if !guards.is_empty() => {}
                _ => problems.push(format!("{kind} `{name}` has no guard in tests/guards.toml")),
            }
        }
        for name in listed.keys().filter(|name| !names.contains(*name)) {
            problems.push(format!(
                "tests/guards.toml lists `{name}`, which is no {kind}"
            ));
        }
    }
    for guard in registry.values().flat_map(|names| names.values()).flatten() {
        if let Err(problem) = is_a_test(guard) {
            problems.push(problem);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
