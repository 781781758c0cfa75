//! The documentation kept true: every `shaper` command shown in README.md and docs/
//! parses with the CLI as built, and every relative link (and its `#anchor`) resolves.

use crate::cli::Cli;
use clap::Parser as _;
use std::{
    fs,
    path::{Path, PathBuf},
};

pub(crate) fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("shaper-cli sits in the repository")
        .to_path_buf()
}

/// README.md and every Markdown file under docs/.
fn documents() -> Vec<PathBuf> {
    let root = repository();
    let mut found = vec![root.join("README.md")];
    let mut docs: Vec<_> = fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|entry| entry.expect("docs/ is readable").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    found.extend(docs);
    found
}

/// A document's lines but the code fences, each with its line number and the language
/// of the code block it stands in (`Some("")` for a block without one, `None` outside).
fn lines_in_blocks(text: &str) -> Vec<(usize, &str, Option<&str>)> {
    let mut block = None;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if let Some(language) = line.trim().strip_prefix("```") {
            block = if block.is_some() {
                None
            } else {
                Some(language)
            };
            continue;
        }
        lines.push((index + 1, line, block));
    }
    lines
}

/// The `shaper …` lines of a document's ```sh blocks (comments after ` #` cut), with
/// their line numbers.
fn shell_commands(text: &str) -> Vec<(usize, String)> {
    let shell = |block| matches!(block, Some("sh" | "bash" | "console"));
    let mut commands = Vec::new();
    for (number, line, block) in lines_in_blocks(text) {
        let trimmed = line.trim();
        let line = trimmed.strip_prefix("# ").unwrap_or(trimmed);
        let line = line.split(" #").next().unwrap_or_default().trim();
        if shell(block) && line.starts_with("shaper ") && !line.ends_with('\\') {
            commands.push((number, line.to_string()));
        }
    }
    commands
}

/// The section of `text` under the `## heading`, up to the next `## `.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README has a section `{heading}`"));
    let body = &text[start + 1..];
    let end = body[3..].find("\n## ").map_or(body.len(), |at| at + 3);
    &body[..end]
}

#[test]
fn every_command_of_the_readme_tour_parses() {
    let readme = fs::read_to_string(repository().join("README.md")).unwrap();
    let tour = shell_commands(section(&readme, "A five-minute tour"));
    assert!(
        tour.len() >= 20,
        "the tour shows the CLI ({} commands)",
        tour.len()
    );
    for (line, command) in tour {
        if let Err(error) = Cli::try_parse_from(command.split_whitespace()) {
            panic!("README's tour, `{command}` (line {line}) does not parse:\n{error}");
        }
    }
}

#[test]
fn every_shaper_command_in_the_docs_parses() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for document in documents() {
        let text = fs::read_to_string(&document).unwrap();
        for (line, command) in shell_commands(&text) {
            // Synopses (`<NAME>`, `[--option]`, `…`, `$VAR`) are prose, not commands.
            if ['<', '[', '…', '$']
                .iter()
                .any(|mark| command.contains(*mark))
            {
                continue;
            }
            checked += 1;
            if let Err(error) = Cli::try_parse_from(command.split_whitespace()) {
                let first = error.to_string();
                let first = first.lines().next().unwrap_or_default().to_string();
                failures.push(format!(
                    "{}:{line}: `{command}`: {first}",
                    document.display()
                ));
            }
        }
    }
    assert!(checked >= 30, "the docs show commands ({checked} checked)");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens;
/// a repeated heading gets `-1`, `-2`, ….
fn anchors(text: &str) -> Vec<String> {
    let (mut bases, mut seen): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    for (_, line, block) in lines_in_blocks(text) {
        let Some(heading) = line.strip_prefix('#').filter(|_| block.is_none()) else {
            continue;
        };
        let heading = heading.trim_start_matches('#').trim();
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let repeats = bases.iter().filter(|base| **base == slug).count();
        bases.push(slug.clone());
        seen.push(if repeats == 0 {
            slug
        } else {
            format!("{slug}-{repeats}")
        });
    }
    seen
}

/// The targets of a document's Markdown links `[text](target)`, outside code blocks.
fn link_targets(text: &str) -> Vec<(usize, String)> {
    let mut targets = Vec::new();
    for (number, line, block) in lines_in_blocks(text) {
        if block.is_some() {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push((number, after[..end].to_string()));
            rest = &after[end..];
        }
    }
    targets
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut checked = 0;
    let mut broken = Vec::new();
    for document in documents() {
        let text = fs::read_to_string(&document).unwrap();
        let dir = document.parent().unwrap();
        for (line, target) in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                document.clone()
            } else {
                dir.join(path)
            };
            let where_ = format!("{}:{line}: ({target})", document.display());
            if !file.exists() {
                broken.push(format!("{where_}: no such file"));
            } else if !anchor.is_empty() {
                let target_text = fs::read_to_string(&file).unwrap_or_default();
                if !anchors(&target_text).iter().any(|a| a == anchor) {
                    broken.push(format!("{where_}: no such heading"));
                }
            }
        }
    }
    assert!(
        checked >= 50,
        "the docs link to each other ({checked} links)"
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn anchors_follow_github() {
    let text =
        "# A title\n## Choosing an action: `shape`, ECN\n```\n# not a heading\n```\n## A title\n";
    assert_eq!(
        anchors(text),
        ["a-title", "choosing-an-action-shape-ecn", "a-title-1"]
    );
}

/// Every command and every argument it takes, by path (`shaper class add --dev`), that
/// has no help line.
fn without_help(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
    if command.get_about().is_none() && !command.is_hide_set() {
        missing.push(path.to_string());
    }
    for arg in command.get_arguments() {
        let name = arg.get_id().as_str();
        if name == "help" || name == "version" || arg.is_hide_set() {
            continue;
        }
        if arg.get_help().is_none() {
            missing.push(format!(
                "{path} {}",
                arg.get_long()
                    .map_or(name.to_uppercase(), |long| format!("--{long}"))
            ));
        }
    }
    for sub in command.get_subcommands() {
        if sub.get_name() != "help" {
            without_help(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
}

#[test]
fn every_command_and_option_has_a_help_line() {
    use clap::CommandFactory as _;
    let mut missing = Vec::new();
    without_help(&Cli::command(), "shaper", &mut missing);
    assert!(
        missing.is_empty(),
        "without a help line:\n{}",
        missing.join("\n")
    );
}
