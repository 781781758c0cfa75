//! The alert rules shipped in contrib/prometheus/ (issue 53), as Prometheus's own tool
//! reads them: `promtool check rules`, and `promtool test rules` with the unit tests beside
//! them, in which every alert fires for one host and stays quiet for another.

use std::{path::PathBuf, process::Command};

fn contrib() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../contrib/prometheus")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(contrib())
        .output()
        .expect("promtool (Debian's prometheus package; cargo xtask setup installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// The alert names of the rules file, in order.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|line| line.trim().strip_prefix("- alert: "))
        .map(|name| name.trim().to_string())
        .collect()
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let checked = promtool(&["check", "rules", "shaper-rules.yml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", "shaper-rules.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn every_alert_says_what_to_do_and_is_tested_firing_and_quiet() {
    let rules = std::fs::read_to_string(contrib().join("shaper-rules.yml")).unwrap();
    let tests = std::fs::read_to_string(contrib().join("shaper-rules.test.yml")).unwrap();
    let names = alert_names(&rules);
    assert!(names.len() >= 12, "{names:?}");
    // Each alert's block: from its `- alert:` line to the next.
    let blocks: Vec<&str> = rules.split("- alert: ").skip(1).collect();
    for (name, block) in names.iter().zip(&blocks) {
        for field in ["summary:", "description:", "severity:"] {
            assert!(block.contains(field), "{name} has no {field}");
        }
        let cases = tests
            .lines()
            .filter(|line| line.trim() == format!("alertname: {name}"))
            .count();
        // One evaluation where it must not fire, one where it must (with the quiet
        // host's series beside it).
        assert!(cases >= 2, "{name} is tested {cases} time(s)");
    }
    assert_eq!(
        tests.matches("exp_alerts:").count(),
        names.len(),
        "each alert fires in exactly one expectation"
    );
}

/// The rules in a real Prometheus with its Alertmanager (issue 53), both in the router's
/// namespace, scraping the daemon every second, with the rules' minutes read as seconds:
/// a policed class flooded at twice its rate raises `ShaperClassDropping`, which reaches
/// the test's webhook within 2 evaluation intervals after its `for:` and resolves once the
/// flood stops; an attached interface deleted makes `shaper_attachment_up` 0 and
/// `ShaperAttachmentDown` fire.
#[test]
fn alerts_fire_and_resolve_in_a_real_prometheus() -> anyhow::Result<()> {
    use shaper_tests::{
        daemon::{ConfigFile, Daemon},
        monitoring::{Monitoring, EVALUATION_INTERVAL},
        Lab, Udp,
    };
    use std::time::Duration;
    let mut lab = Lab::new()?;
    let router = lab.router.clone();
    router.run(
        "ip",
        &[
            "link", "add", "gone0", "type", "veth", "peer", "name", "gone1",
        ],
    )?;
    router.run("ip", &["link", "set", "gone0", "up"])?;
    let file = ConfigFile::new(
        "alerts",
        &format!(
            "[[interface]]\ndev = \"r1\"\nnetns = \"{ns}\"\n[[interface.class]]\nname = \"flood\"\nrate = \"10mbit\"\nproto = \"udp\"\n\n\
             [[interface.class]]\nname = \"bulk\"\nrate = \"5mbit\"\nproto = \"tcp\"\naction = \"shape\"\n\n\
             [[interface.class]]\nname = \"echo\"\nrate = \"1mbit\"\nper = \"flow\"\nproto = \"udp\"\ndport = 7\n\n\
             [[interface]]\ndev = \"gone0\"\nnetns = \"{ns}\"\n[[interface.class]]\nname = \"idle\"\nrate = \"1mbit\"\n",
            ns = router.name
        ),
    );
    let daemon = Daemon::start(&router, &file, &[])?;
    let monitoring = Monitoring::start(&router, "127.0.0.1:9464")?;
    monitoring.wait_until_scraped()?;
    // The rule's 10-minute `for:`, read as seconds.
    let hold = Duration::from_secs(10);
    let flood = Udp::at("20M", 25);
    let fired = std::thread::scope(|scope| -> anyhow::Result<_> {
        let run = scope.spawn(|| lab.udp(&flood));
        let fired = monitoring.wait_for("ShaperClassDropping", "firing", Duration::from_secs(40));
        // Prometheus's own clock: when the alert became active, and now.
        let active_at = monitoring
            .query("ALERTS_FOR_STATE{alertname=\"ShaperClassDropping\"}")?
            .first()
            .and_then(|sample| sample["value"][1].as_str()?.parse::<f64>().ok());
        let server_now = monitoring.now()?;
        run.join().expect("the flood panicked")?;
        Ok((fired?, active_at, server_now))
    })?;
    let (note, active_at, server_now) = fired;
    assert_eq!(note.labels["class"], "flood", "{:?}", note.labels);
    assert_eq!(note.labels["severity"], "warning");
    let active_at = active_at.expect("ALERTS_FOR_STATE holds the alert's start");
    // Read after the notification: an upper bound on how long after it became active it
    // was delivered.
    let delivered_within = server_now - active_at;
    println!(
        "ShaperClassDropping delivered at most {delivered_within:.1} s after it became active (for: {} s)",
        hold.as_secs()
    );
    assert!(
        delivered_within <= (hold + 2 * EVALUATION_INTERVAL).as_secs_f64() + 0.5,
        "delivered {delivered_within:.1} s after it became active"
    );
    // Every expression of the dashboard is PromQL this Prometheus takes, and each answers
    // with series here but those of global classes (none in this lab).
    for expr in dashboard_expressions()? {
        let lab_expr = expr
            .replace("$__rate_interval", "5s")
            .replace("$instance", ".*")
            .replace("$dev", ".*")
            .replace("$class", ".*");
        let result = monitoring
            .query(&lab_expr)
            .map_err(|error| anyhow::anyhow!("the dashboard's `{expr}`: {error:#}"))?;
        assert!(
            !result.is_empty() || expr.contains("global"),
            "the dashboard's `{expr}` has no series in the lab"
        );
    }
    monitoring.wait_for("ShaperClassDropping", "resolved", Duration::from_secs(30))?;
    // The attached interface deleted: the attachment is stale, its alert fires.
    router.run("ip", &["link", "del", "gone0"])?;
    let down = monitoring.wait_for("ShaperAttachmentDown", "firing", Duration::from_secs(20))?;
    assert_eq!(down.labels["dev"], "gone0");
    let up = monitoring.query("shaper_attachment_up{dev=\"gone0\"}")?;
    assert_eq!(up.first().map(|s| s["value"][1].clone()), Some("0".into()));
    drop(monitoring);
    daemon.stop()?;
    Ok(())
}

/// Every query of contrib/grafana/shaper.json's panels.
fn dashboard_expressions() -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(contrib().join("../grafana/shaper.json"))?;
    let dashboard: serde_json::Value = serde_json::from_str(&text)?;
    let expressions: Vec<String> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|panel| panel["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|target| target["expr"].as_str().map(String::from))
        .collect();
    anyhow::ensure!(expressions.len() >= 20, "{expressions:?}");
    Ok(expressions)
}
