//! The house's rules, read from the sources (no root, no build of the eBPF object): the
//! core library's modules import each other without a circle, no product source file
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

/// The top-level modules of `shaper` another module's code names (`crate::x`, or `x` in
/// a `use crate::{..}` list).
fn imports(lines: &[String], modules: &BTreeSet<String>) -> BTreeSet<String> {
    let code: String = lines
        .iter()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
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
        let mut names = imports(&product_lines(path), &modules);
        names.remove(&module);
        graph.entry(module).or_default().extend(names);
    }
    // Peel off modules that import only peeled ones: what is left sits on a circle.
    let mut left = graph.clone();
    while let Some(leaf) = left
        .iter()
        .find(|(_, deps)| deps.iter().all(|d| !left.contains_key(d)))
        .map(|(name, _)| name.clone())
    {
        left.remove(&leaf);
    }
    assert!(
        left.is_empty(),
        "shaper's modules import each other in a circle among {:?}",
        left
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
