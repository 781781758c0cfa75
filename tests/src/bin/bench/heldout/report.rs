//! The held-out rows' figures: a row from its runs, the ranges, shaper's losses beside
//! CAKE, and the table with its configurations.

use super::Peer;
use serde_json::Value;

/// A run's figures on one line.
pub(super) fn brief(figures: &Value) -> String {
    let mut line = format!(
        "goodput {:.3}, Jain {:.3}, bulk RTT +{:.1}/+{:.1} ms, probe p99 +{:.1} ms, {} drops",
        float(figures, "goodput"),
        float(figures, "jain"),
        float(figures, "bulk_rtt_p50_ms"),
        float(figures, "bulk_rtt_p99_ms"),
        float(figures, "probe_p99_ms"),
        figures["drops"]
    );
    if figures.get("short_p50_ms").is_some() {
        line.push_str(&format!(
            ", short uploads {:.0}/{:.0} ms ({} of {} failed)",
            float(figures, "short_p50_ms"),
            float(figures, "short_p99_ms"),
            figures["short_failed"],
            figures["short_started"]
        ));
    }
    line
}

fn float(value: &Value, key: &str) -> f64 {
    value[key].as_f64().unwrap_or(f64::NAN)
}

/// The figures a row shows, with the digits it shows them in.
const FIGURES: [(&str, usize); 9] = [
    ("goodput", 3),
    ("jain", 3),
    ("bulk_rtt_p50_ms", 1),
    ("bulk_rtt_p99_ms", 1),
    ("probe_p99_ms", 1),
    ("udp", 3),
    ("short_p50_ms", 0),
    ("short_p99_ms", 0),
    ("drops", 0),
];

/// A row from its runs: the run with the median goodput (every figure from that one
/// run), and each run's figures under "runs" for the ranges.
pub(super) fn median_run(mut runs: Vec<Value>) -> Value {
    runs.sort_by(|a, b| float(a, "goodput").total_cmp(&float(b, "goodput")));
    let mut row = runs.get(runs.len() / 2).cloned().unwrap_or(Value::Null);
    row["runs"] = runs
        .iter()
        .map(|run| {
            let mut figures = run.clone();
            if let Some(map) = figures.as_object_mut() {
                map.remove("configuration");
            }
            figures
        })
        .collect::<Vec<_>>()
        .into();
    row
}

/// A figure of a row and the range of its runs: `0.951 (0.948–0.957)`.
fn figure(row: &Value, key: &str, digits: usize) -> String {
    let Some(value) = row[key].as_f64() else {
        return "–".into();
    };
    let values: Vec<f64> = row["runs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|run| run[key].as_f64())
        .collect();
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.len() > 1 {
        format!("{value:.digits$} ({low:.digits$}–{high:.digits$})")
    } else {
        format!("{value:.digits$}")
    }
}

/// How much worse than a CAKE row a shaper row's figure must be to count as a loss: the
/// margins issue 35's targets allowed, and Jain's, UDP's and the short uploads' p99 by
/// their own scale.
const MARGINS: [(&str, &str, f64, bool); 8] = [
    ("goodput", "goodput", 0.02, true),
    ("jain", "Jain's index", 0.03, true),
    ("bulk_rtt_p50_ms", "bulk RTT p50 ms", 3.0, false),
    ("bulk_rtt_p99_ms", "bulk RTT p99 ms", 5.0, false),
    ("probe_p99_ms", "probe p99 ms", 2.0, false),
    // The UDP flood's share: more is worse (it is what TCP did not get).
    ("udp", "UDP's share", 0.03, false),
    ("short_p50_ms", "short uploads p50 ms", 20.0, false),
    ("short_p99_ms", "short uploads p99 ms", 20.0, false),
];

/// Where a shaper row is worse than a CAKE row of its cell by more than the margin: one
/// line each.
pub fn losses(rows: &[Value]) -> Vec<String> {
    let mut lines = Vec::new();
    let of = |cell: &str, peer: Peer| {
        rows.iter()
            .find(|row| row["cell"] == cell && row["limiter"] == peer.label())
    };
    let mut cells: Vec<&str> = rows.iter().filter_map(|row| row["cell"].as_str()).collect();
    cells.dedup();
    for cell in cells {
        for ours in [Peer::Shaper, Peer::ShaperBurst32k] {
            for theirs in [Peer::Cake, Peer::CakePathRtt] {
                let (Some(a), Some(b)) = (of(cell, ours), of(cell, theirs)) else {
                    continue;
                };
                for (key, what, margin, higher_is_better) in MARGINS {
                    let (x, y) = (float(a, key), float(b, key));
                    if x.is_nan() || y.is_nan() {
                        continue;
                    }
                    let lost = if higher_is_better {
                        x < y - margin
                    } else {
                        x > y + margin
                    };
                    if lost {
                        lines.push(format!(
                            "{cell}: {what}: {} {x:.3}, {} {y:.3}",
                            ours.label(),
                            theirs.label()
                        ));
                    }
                }
            }
        }
    }
    lines
}

/// The held-out table of one kernel's report (the `held_out` part), its losses and its
/// configurations (markdown).
pub fn table(report: &Value) -> String {
    let rows: Vec<Value> = report["rows"].as_array().cloned().unwrap_or_default();
    let mut out = String::from(
        "\n| cell | limiter | goodput / rate | Jain | bulk RTT over base p50 ms | p99 ms | probe p99 ms | UDP's share | short uploads p50 ms | p99 ms | drops |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in &rows {
        out.push_str(&format!(
            "| {}{} | {} |",
            row["cell"].as_str().unwrap_or("?"),
            if row["target_cell"] == true {
                " (the target cell)"
            } else {
                ""
            },
            row["limiter"].as_str().unwrap_or("?"),
        ));
        for (key, digits) in FIGURES {
            out.push_str(&format!(" {} |", figure(row, key, digits)));
        }
        out.push('\n');
    }
    for unmeasured in report["unmeasured"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | not measured: {} ||||||||||\n",
            unmeasured["cell"].as_str().unwrap_or("?"),
            unmeasured["why"].as_str().unwrap_or("?")
        ));
    }
    let lost = losses(&rows);
    out.push_str(&format!(
        "\nWhere a shaper row is worse than a CAKE row of its cell by more than the margin (goodput 0.02, Jain 0.03, bulk RTT p50 3 ms and p99 5 ms, probe p99 2 ms, UDP's share 0.03, short uploads' p50 and p99 20 ms): {}\n",
        if lost.is_empty() { "nowhere." } else { "" }
    ));
    for line in &lost {
        out.push_str(&format!("- {line}\n"));
    }
    out.push_str("\nConfigurations as read back after setup (`tc qdisc show`, `tc class show`, `shaper class list` on the router's egress), one run of each limiter per rate and path:\n\n");
    let mut seen = Vec::new();
    for row in &rows {
        let cell = row["cell"].as_str().unwrap_or("?");
        let rate_and_path: String = cell.splitn(3, ", ").take(2).collect::<Vec<_>>().join(", ");
        let key = (rate_and_path.clone(), row["limiter"].clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        out.push_str(&format!(
            "- {}, {}: `{}` — read back: `{}`\n",
            row["limiter"].as_str().unwrap_or("?"),
            rate_and_path,
            row["commands"].as_str().unwrap_or("?"),
            row["configuration"].as_str().unwrap_or("?"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run_of(goodput: f64, probe: f64) -> Value {
        json!({"goodput": goodput, "probe_p99_ms": probe, "configuration": "x"})
    }

    #[test]
    fn a_row_is_the_run_with_the_median_goodput_and_shows_the_range() {
        let row = median_run(vec![
            run_of(0.95, 9.0),
            run_of(0.90, 4.0),
            run_of(0.93, 30.0),
        ]);
        // Every figure from one run, not a median of each.
        assert_eq!(row["goodput"], 0.93);
        assert_eq!(row["probe_p99_ms"], 30.0);
        assert_eq!(figure(&row, "goodput", 2), "0.93 (0.90–0.95)");
        assert_eq!(figure(&row, "probe_p99_ms", 0), "30 (4–30)");
        assert_eq!(figure(&row, "udp", 3), "–");
        assert!(row["runs"][0].get("configuration").is_none());
    }

    fn row(cell: &str, peer: Peer, goodput: f64, probe: f64) -> Value {
        json!({"cell": cell, "limiter": peer.label(), "goodput": goodput, "probe_p99_ms": probe})
    }

    #[test]
    fn a_loss_is_a_shaper_row_worse_than_a_cake_row_by_more_than_the_margin() {
        let rows = vec![
            row("c", Peer::Shaper, 0.90, 10.0),
            row("c", Peer::ShaperBurst32k, 0.93, 5.0),
            row("c", Peer::Cake, 0.93, 8.5),
            row("c", Peer::CakePathRtt, 0.95, 2.5),
        ];
        let lost = losses(&rows);
        assert!(lost.contains(
            &"c: goodput: shaper shape (its defaults) 0.900, cake (its defaults) 0.930".into()
        ));
        // Within the margins: 32k's goodput beside CAKE rtt (0.02), its probe beside
        // CAKE's default.
        assert!(
            !lost.iter().any(|l| l.contains("--burst 32k 0.930")),
            "{lost:?}"
        );
        assert!(
            lost.iter().any(|l| l.contains(
                "probe p99 ms: shaper shape --burst 32k 5.000, cake, rtt of the path 2.500"
            )),
            "{lost:?}"
        );
        assert_eq!(lost.len(), 4, "{lost:?}");
    }
}
