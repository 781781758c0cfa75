//! The house's rules, read from the sources (no root, no build of the eBPF object): the
//! core library's modules (and the files of each of its module directories) import each
//! other without a circle, no product source file
//! is over 450 lines, and no function outside the eBPF program is over 80 lines (in-file
//! unit tests excluded).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

const MAX_FILE_LINES: usize = 450;
const MAX_FUNCTION_LINES: usize = 80;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace above shaper/")
        .to_path_buf()
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            found.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// A file's lines before its in-file unit tests.
fn product_lines(path: &Path) -> Vec<String> {
    let text = fs::read_to_string(path).expect("a readable source");
    text.lines()
        .take_while(|line| !line.starts_with("#[cfg(test)]"))
        .map(str::to_string)
        .collect()
}

/// The modules of `modules` a file's code names after `prefix` (`crate::` for the top
/// level, `super::` for siblings): `crate::x`, or `x` in a `use crate::{..}` list.
fn imports(lines: &[String], prefix: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let code: String = lines
        .iter()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        if let Some(list) = rest.strip_prefix('{') {
            // `use crate::{a::b, c, d::{e, f}}`: the names at the list's top level.
            let mut depth = 0;
            let mut items = vec![String::new()];
            for c in list.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(String::new());
                        continue;
                    }
                    _ => {}
                }
                items.last_mut().expect("an item").push(c);
            }
            for item in items {
                let name = identifier(item.trim_start());
                if modules.contains(&name) {
                    found.insert(name);
                }
            }
        } else {
            let name = identifier(rest);
            if modules.contains(&name) {
                found.insert(name);
            }
        }
    }
    found
}

fn identifier(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The modules of `graph` (module → the modules it imports) that sit on a circle or import
/// one that does: what is left once modules importing only peeled ones are peeled off.
fn on_a_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    let mut left = graph.clone();
    while let Some(leaf) = left
        .iter()
        .find(|(_, deps)| deps.iter().all(|d| !left.contains_key(d)))
        .map(|(name, _)| name.clone())
    {
        left.remove(&leaf);
    }
    left.into_keys().collect()
}

/// Within one module directory: which sibling files each file imports, through
/// `super::x` paths or through a name `mod.rs` re-exports from `x` (used under
/// `super::*`).
fn sibling_graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let stem = |path: &Path| path.file_stem().unwrap().to_string_lossy().into_owned();
    let files: Vec<PathBuf> = fs::read_dir(dir)
        .expect("a module directory")
        .map(|entry| entry.expect("an entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .collect();
    let siblings: BTreeSet<String> = files
        .iter()
        .map(|path| stem(path))
        .filter(|name| name != "mod")
        .collect();
    // `pub use x::{a, b};` in mod.rs: a → x, b → x.
    let mut exported_by: BTreeMap<String, String> = BTreeMap::new();
    for line in product_lines(&dir.join("mod.rs")) {
        let Some(rest) = line.trim().split_once("use ").map(|(_, rest)| rest) else {
            continue;
        };
        let Some((module, items)) = rest.split_once("::") else {
            continue;
        };
        if siblings.contains(module) {
            for item in items.split([',', '{', '}', ';', ' ']) {
                if !item.is_empty() {
                    exported_by.insert(item.to_string(), module.to_string());
                }
            }
        }
    }
    let mut graph = BTreeMap::new();
    for path in files.iter().filter(|path| stem(path) != "mod") {
        let lines = product_lines(path);
        let mut names = imports(&lines, "super::", &siblings);
        if lines
            .iter()
            .any(|line| line.contains("super::*") || line.contains(" *,"))
        {
            let code = code_of(&lines);
            names.extend(
                exported_by
                    .iter()
                    .filter(|(item, _)| uses_item(&code, item))
                    .map(|(_, module)| module.clone()),
            );
        }
        names.remove(&stem(path));
        graph.insert(stem(path), names);
    }
    graph
}

/// A file's code: comments and string literals left out.
fn code_of(lines: &[String]) -> String {
    let mut code = String::new();
    let (mut in_string, mut escaped) = (false, false);
    for line in lines {
        let line = if in_string {
            line.as_str()
        } else {
            line.split("//").next().unwrap_or_default()
        };
        for c in line.chars().chain(['\n']) {
            if in_string {
                in_string = escaped || c != '"';
                escaped = !escaped && c == '\\';
            } else if c == '"' {
                in_string = true;
            } else {
                code.push(c);
            }
        }
    }
    code
}

/// Whether `code` uses the item `name` that `mod.rs` re-exports: a type or constant
/// (capitalised) anywhere, a function only where it is called as a free function (not
/// `x.name(`: a field or method of the same name is not the item).
fn uses_item(code: &str, name: &str) -> bool {
    let capitalised = name.starts_with(|c: char| c.is_ascii_uppercase());
    code.match_indices(name).any(|(at, _)| {
        let before = code[..at].chars().next_back().unwrap_or(' ');
        let after = code[at + name.len()..].chars().next().unwrap_or(' ');
        let word = |c: char| c.is_alphanumeric() || c == '_';
        if word(before) || word(after) {
            return false;
        }
        capitalised || (after == '(' && before != '.' && !code[..at].ends_with("fn "))
    })
}

#[test]
fn the_files_of_each_module_directory_import_each_other_without_a_circle() {
    let mut directories = 0;
    for path in sources(&workspace().join("shaper/src")) {
        if path.file_name().is_some_and(|name| name == "mod.rs") {
            let dir = path.parent().expect("a directory");
            let graph = sibling_graph(dir);
            let left = on_a_circle(&graph);
            assert!(
                left.is_empty(),
                "the files of {} import each other in a circle among {left:?} ({graph:?})",
                dir.display()
            );
            directories += 1;
        }
    }
    assert!(directories > 3, "{directories} module directories");
    // What this test knows to be real: `change` installs a class at its share, and
    // installing a new share (`renewal`) goes through `change`.
    let classes = sibling_graph(&workspace().join("shaper/src/classes"));
    assert!(classes["change"].contains("share") && classes["renewal"].contains("change"));
}

#[test]
fn the_core_library_s_modules_import_each_other_without_a_circle() {
    let src = workspace().join("shaper/src");
    let module_of = |path: &Path| {
        let relative = path.strip_prefix(&src).expect("under shaper/src");
        let first = relative.components().next().expect("a first component");
        first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string()
    };
    let files = sources(&src);
    let modules: BTreeSet<String> = files
        .iter()
        .map(|path| module_of(path))
        .filter(|name| name != "lib")
        .collect();
    assert!(modules.len() > 10, "{modules:?}");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in &files {
        let module = module_of(path);
        if module == "lib" {
            continue;
        }
        let mut names = imports(&product_lines(path), "crate::", &modules);
        names.remove(&module);
        graph.entry(module).or_default().extend(names);
    }
    let left = on_a_circle(&graph);
    assert!(
        left.is_empty(),
        "shaper's modules import each other in a circle among {left:?}"
    );
    // The layering this test knows is real: the daemon sits on config and global.
    assert!(graph["daemon"].contains("config") && graph["daemon"].contains("global"));
}

#[test]
fn no_product_file_over_450_lines_and_no_function_over_80() {
    let root = workspace();
    let mut long_files = Vec::new();
    let mut long_functions = Vec::new();
    for crate_dir in [
        "shaper",
        "shaper-cli",
        "shaper-common",
        "shaper-ebpf",
        "xtask",
    ] {
        for path in sources(&root.join(crate_dir).join("src")) {
            let lines = product_lines(&path);
            let name = path.strip_prefix(&root).unwrap().display().to_string();
            if crate_dir != "xtask" && lines.len() > MAX_FILE_LINES {
                long_files.push(format!("{name}: {} lines", lines.len()));
            }
            if crate_dir == "shaper-ebpf" {
                continue;
            }
            for (start, length) in functions(&lines) {
                if length > MAX_FUNCTION_LINES {
                    long_functions.push(format!("{name}:{}: {length} lines", start + 1));
                }
            }
        }
    }
    assert!(
        long_files.is_empty(),
        "files over {MAX_FILE_LINES} lines: {long_files:?}"
    );
    assert!(
        long_functions.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines: {long_functions:?}"
    );
}

/// Each function's first line and length: from its `fn` line to the first line after it
/// that closes a brace at the `fn` line's indent (rustfmt's layout).
fn functions(lines: &[String]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = &line[..line.len() - code.len()];
        let words: Vec<&str> = code.split_whitespace().collect();
        let is_fn = words
            .iter()
            .take_while(|w| {
                [
                    "pub",
                    "pub(crate)",
                    "pub(super)",
                    "const",
                    "async",
                    "unsafe",
                ]
                .contains(w)
                    || w.starts_with("pub(")
            })
            .count();
        if words.get(is_fn) != Some(&"fn") || code.ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[start + 1..]
            .iter()
            .position(|l| l.starts_with(&close) && !l[indent.len()..].starts_with(' '))
        {
            found.push((start, end + 2));
        }
    }
    found
}

#[test]
fn the_function_finder_measures_what_rustfmt_writes() {
    let text = "fn a() {\n    1\n}\n\nimpl X {\n    pub(crate) fn b(&self) -> u8 {\n        if x {\n        }\n        2\n    }\n    fn c();\n}\n";
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    assert_eq!(functions(&lines), vec![(0, 3), (5, 5)]);
}
