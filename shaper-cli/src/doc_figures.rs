//! docs/TESTING.md quotes the code's own figures (bounds, counts, limits): each quote below
//! must be in the document, word for word, and the constant it quotes must still have the
//! value it had when the quote was written. A changed bound fails here until the document
//! says the new one.

/// (what docs/TESTING.md says, the file, the constant, its value as the code writes it).
const QUOTES: &[(&str, &str, &str, &str)] = &[
    (
        "Every cell runs 3 times in interleaved passes",
        "tests/src/bin/bench/heldout/mod.rs",
        "RUNS",
        "3",
    ),
    (
        "a transfer over 10 s counts as failed",
        "tests/src/web.rs",
        "TRANSFER_LIMIT",
        "Duration::from_secs(10)",
    ),
    (
        "1 000 deterministic cases",
        "shaper-common/tests/bucket_properties.rs",
        "CASES",
        "1000",
    ),
    (
        "from 8 bit/s",
        "shaper-common/src/bucket.rs",
        "MIN_RATE_BITS_PER_SEC",
        "8",
    ),
    (
        "to 400 Gbit/s",
        "shaper-common/src/bucket.rs",
        "MAX_RATE_BITS_PER_SEC",
        "400_000_000_000",
    ),
    (
        "120 cases of 100–300 racing groups",
        "shaper-common/tests/meter_race.rs",
        "CASES",
        "120",
    ),
    (
        "runs 40 cases a mutant",
        "xtask/src/mutants/mod.rs",
        "RACE_CASES",
        "\"40\"",
    ),
    (
        "400 random three-level trees",
        "shaper-common/tests/hierarchy_properties.rs",
        "CASES",
        "400",
    ),
    (
        "over 450 lines",
        "shaper/tests/house.rs",
        "MAX_FILE_LINES",
        "450",
    ),
    (
        "eBPF program over 80",
        "shaper/tests/house.rs",
        "MAX_FUNCTION_LINES",
        "80",
    ),
    (
        "4 000 packets on random CPUs",
        "tests/tests/test_run/tree.rs",
        "PACKETS",
        "4000",
    ),
    (
        "(3 silent intervals)",
        "shaper/src/global/mod.rs",
        "REPORT_INTERVALS",
        "3",
    ),
    (
        "1 000 idle connections",
        "tests/tests/global.rs",
        "FLOOD",
        "1000",
    ),
    (
        "The lab's 500 ms windows",
        "tests/src/global.rs",
        "WINDOW",
        "Duration::from_millis(500)",
    ),
    (
        "a new set every 500 frames",
        "tests/tests/test_run/differential.rs",
        "PER_RULE_SET",
        "500",
    ),
    (
        "the last 100 frames of each set",
        "tests/tests/test_run/differential.rs",
        "CARRIED",
        "100",
    ),
    (
        "30 s runs from 10 s",
        "tests/tests/fairness.rs",
        "SECONDS",
        "30",
    ),
    ("UDP ≤ 0.55", "tests/tests/fairness.rs", "UDP_MOST", "0.55"),
    (
        "together ≥ 0.95",
        "tests/tests/fairness.rs",
        "TOGETHER_LEAST",
        "0.95",
    ),
    (
        "keep the RTT ≤ 9.5 ms",
        "tests/tests/fairness.rs",
        "RTT_MOST_MS",
        "9.5",
    ),
    (
        "at most 1 % lost",
        "tests/tests/latency.rs",
        "PROBE_LOSS",
        "0.01",
    ),
    (
        "irtt at 1.5 × the sparse threshold",
        "tests/tests/latency.rs",
        "QUEUE_PROBE_OVER_SPARSE",
        "1.5",
    ),
    (
        "the sparse threshold, 1/16 of the rate",
        "shaper-common/src/codel.rs",
        "SPARSE_RATE_DIVISOR",
        "16",
    ),
    (
        "idle ping within ±0.5 ms",
        "tests/tests/delay_line.rs",
        "RTT_TOLERANCE_MS",
        "0.5",
    ),
    (
        "p99 lateness ≤ 1 ms over the run",
        "tests/src/delay.rs",
        "LATENESS_P99_LIMIT_US",
        "1000.0",
    ),
    (
        "at most four runs",
        "tests/src/delay.rs",
        "DELAY_LINE_TRIES",
        "4",
    ),
    (
        "three one-second windows in a row",
        "tests/src/delay.rs",
        "QUIET_SECONDS",
        "3",
    ),
    (
        "a thread sleeping 300 µs",
        "tests/src/delay.rs",
        "PROBE_SLEEP",
        "Duration::from_micros(300)",
    ),
    (
        "overslept at most 250 µs at p99",
        "tests/src/delay.rs",
        "QUIET_OVERSLEEP_P99_US",
        "250.0",
    ),
    (
        "waited for at most 150 s",
        "tests/src/delay.rs",
        "QUIET_WAIT_LIMIT",
        "Duration::from_secs(150)",
    ),
    (
        "latency plus 20 µs early",
        "tests/src/bin/delay_line.rs",
        "EARLY_SEND_NS",
        "20_000",
    ),
    (
        "at most 0.5 ms, the cap",
        "tests/src/bin/delay_line.rs",
        "MAX_EARLY_NS",
        "500_000",
    ),
    (
        "the 262 144-entry classifier table",
        "shaper-common/src/layout/mod.rs",
        "MAX_RULES",
        "262_144",
    ),
    (
        "(27.1.0, installed by the task itself",
        "xtask/src/setup.rs",
        "CARGO_MUTANTS_VERSION",
        "\"27.1.0\"",
    ),
    (
        "fails below 90 % of viable",
        "xtask/src/mutants/mod.rs",
        "TARGET",
        "0.90",
    ),
    (
        "an iperf3 run gets its length + 15 s",
        "tests/src/iperf.rs",
        "IPERF_GRACE",
        "Duration::from_secs(15)",
    ),
    (
        "a command 120 s",
        "tests/src/process.rs",
        "COMMAND_LIMIT",
        "Duration::from_secs(120)",
    ),
    (
        "21 turns of 200 000 passes",
        "tests/src/bin/bench/main.rs",
        "COMPARE_TURNS",
        "21",
    ),
    (
        "21 turns of 200 000 passes",
        "tests/src/bin/bench/main.rs",
        "COMPARE_REPEAT",
        "200_000",
    ),
    (
        "accuracy ratio above 1.5",
        "tests/src/bin/bench/main.rs",
        "MAX_SANE_RATIO",
        "1.5",
    ),
];

/// The value of `const NAME: T = VALUE;` (or `static`) in `source`, as written.
fn constant<'a>(source: &'a str, name: &str) -> Option<&'a str> {
    source.lines().find_map(|line| {
        let line = line.trim_start();
        let rest = ["pub(crate) ", "pub ", ""]
            .iter()
            .find_map(|vis| line.strip_prefix(vis))?;
        let rest = rest
            .strip_prefix("const ")
            .or_else(|| rest.strip_prefix("static "))?;
        let rest = rest.strip_prefix(name)?.strip_prefix(':')?;
        let (_, value) = rest.split_once(" = ")?;
        Some(value.trim().trim_end_matches(';'))
    })
}

#[test]
fn testing_md_quotes_the_codes_own_figures() {
    let root = crate::docs::repository();
    let doc = std::fs::read_to_string(root.join("docs/TESTING.md")).expect("docs/TESTING.md");
    // Quotes may wrap: compared with every run of white space as one space.
    let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut problems = Vec::new();
    for (quote, file, name, value) in QUOTES {
        if !doc.contains(quote) {
            problems.push(format!("docs/TESTING.md no longer says {quote:?}"));
        }
        let source = std::fs::read_to_string(root.join(file)).unwrap_or_default();
        match constant(&source, name) {
            Some(found) if found == *value => {}
            Some(found) => problems.push(format!(
                "{file} {name} is {found}, where docs/TESTING.md quotes {value} ({quote:?})"
            )),
            None => problems.push(format!("{file} has no constant {name}")),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert_eq!(constant("pub const X: u32 = 7;", "X"), Some("7"));
    assert_eq!(constant("const XY: u32 = 7;", "X"), None);
}
