//! Limits across hosts: a global class against a static split of the same limit under
//! skewed demand (one host busy, two idle), and many simulated hosts against one real
//! redis-server (what the allocation script costs it per interval).

use anyhow::{Context as _, Result};
use serde_json::{json, Value};
use shaper::global::{redis_keys, ALLOCATE, HEADROOM_PPM};
use shaper_tests::{median, GlobalClass, GlobalLab, RedisServer};
use std::time::{Duration, Instant};

pub struct GlobalEffort {
    /// Seconds measured after the shares settle.
    pub seconds: u64,
    /// Simulated host counts against one Redis.
    pub hosts: Vec<u32>,
    /// Intervals simulated per host count.
    pub intervals: u32,
}

pub fn effort(quick: bool) -> GlobalEffort {
    if quick {
        GlobalEffort {
            seconds: 3,
            hosts: vec![10, 300],
            intervals: 4,
        }
    } else {
        GlobalEffort {
            seconds: 6,
            hosts: vec![10, 100, 1000, 3000, 10_000],
            intervals: 8,
        }
    }
}

const LIMIT: f64 = 30e6;

/// The busy host's delivered rate (median of 500 ms windows) over the limit, with host 0
/// offering 40 Mbit/s and the two others nothing.
fn skewed_utilisation(class: GlobalClass, seconds: u64) -> Result<f64> {
    let mut lab = GlobalLab::new(3, class)?;
    lab.send(0, "40M", (seconds + 5) as u32)?;
    lab.windows(Duration::from_secs(3), |_, _| Ok(()))?;
    let windows = lab.windows(Duration::from_secs(seconds), |_, _| Ok(()))?;
    let busy: Vec<f64> = windows.iter().map(|w| w[0]).collect();
    Ok(median(&busy) / LIMIT)
}

pub fn skewed(effort: &GlobalEffort) -> Result<Value> {
    let global = skewed_utilisation(GlobalClass::default(), effort.seconds)?;
    let split = skewed_utilisation(
        GlobalClass {
            limit: "10mbit",
            global: false,
            ..GlobalClass::default()
        },
        effort.seconds,
    )?;
    println!("  skewed demand: global {global:.3} of the limit, static G/3 split {split:.3}");
    Ok(json!({ "global": global, "static_split": split }))
}

/// `hosts` simulated hosts, each reporting once per interval (250 ms) for `intervals`
/// intervals through the daemons' script on one connection: Redis's own time in the
/// script per interval (commandstats) and its CPU (INFO cpu) per second of the run.
fn simulate(hosts: u32, intervals: u32) -> Result<Value> {
    let redis = RedisServer::start()?;
    let client = redis::Client::open(redis.url())?;
    let mut connection = client.get_connection()?;
    let script = redis::Script::new(ALLOCATE);
    let interval = Duration::from_millis(250);
    let [hosts_key, shares_key, _] = redis_keys("bench");
    let usec = |redis: &RedisServer| -> Result<f64> {
        let info = redis.cli(&["INFO", "commandstats"])?;
        Ok(info
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
            .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("usec=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0))
    };
    // Every host's call of one interval, pipelined: the simulator's own round trips do
    // not limit how many hosts it can stand for (Redis runs the calls one after another,
    // as it would from many daemons).
    let round = |connection: &mut redis::Connection| -> Result<()> {
        let mut pipe = redis::pipe();
        for host in 0..hosts {
            let demand = u64::from(host % 10 + 1) * 1_000_000;
            pipe.cmd("EVALSHA")
                .arg(script.get_hash())
                .arg(2)
                .arg(&hosts_key)
                .arg(&shares_key)
                .arg(format!("sim-{host}"))
                .arg(demand)
                .arg(demand)
                .arg(30_000_000u64)
                .arg(300_000u64)
                .arg(interval.as_millis() as u64)
                .arg(HEADROOM_PPM);
        }
        // Read as lists: the reply's length is the script's to grow.
        let replies: Vec<Vec<u64>> = pipe
            .query(connection)
            .context("the allocation script failed")?;
        anyhow::ensure!(replies.len() == hosts as usize, "{} replies", replies.len());
        Ok(())
    };
    // The script loaded, then one round: every host known.
    script.prepare_invoke().load(&mut connection)?;
    round(&mut connection)?;
    let (usec_before, cpu_before, started) = (usec(&redis)?, redis.cpu_seconds()?, Instant::now());
    let mut late = 0;
    for index in 0..intervals {
        let due = started + interval * (index + 1);
        round(&mut connection)?;
        match due.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => late += 1,
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let script_ms = (usec(&redis)? - usec_before) / 1000.0 / f64::from(intervals);
    let cpu = (redis.cpu_seconds()? - cpu_before) / wall;
    println!(
        "  {hosts} hosts: {script_ms:.1} ms of script per 250 ms interval, Redis CPU {:.0} % of a core, {late} of {intervals} intervals overran",
        cpu * 100.0
    );
    Ok(json!({
        "hosts": hosts,
        "script_ms_per_interval": script_ms,
        "redis_cpu_fraction": cpu,
        "intervals_overran": late,
        "intervals": intervals,
    }))
}

pub fn redis_scale(effort: &GlobalEffort) -> Result<Vec<Value>> {
    effort
        .hosts
        .iter()
        .map(|&hosts| simulate(hosts, effort.intervals))
        .collect()
}

pub fn markdown(report: &Value) -> String {
    let global = &report["global"];
    let mut out = String::new();
    out.push_str("\n## Limits across hosts\n\n");
    out.push_str(&format!(
        "Three hosts (namespaces with their own attachment and daemon, one redis-server on loopback), a limit of 30 Mbit/s; host 0 offers 40 Mbit/s of UDP, the two others nothing. Median of 500 ms windows at the sink, over the limit.\n\n| setup | busy host / limit |\n|---|---|\n| global class (`global = KEY`) | {:.3} |\n| static split: a 10 Mbit/s class per host | {:.3} |\n",
        global["skewed"]["global"].as_f64().unwrap_or(0.0),
        global["skewed"]["static_split"].as_f64().unwrap_or(0.0)
    ));
    out.push_str("\nMany hosts on one class against one redis-server: each simulated host calls the allocation script once per 250 ms interval (as a daemon does). Redis's time in the script per interval (`INFO commandstats`) and its CPU (`INFO cpu`) over the run.\n\n| hosts | script ms per interval | Redis CPU (share of a core) | intervals overrun |\n|---|---|---|---|\n");
    for row in global["redis"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} | {} of {} |\n",
            row["hosts"],
            row["script_ms_per_interval"].as_f64().unwrap_or(0.0),
            row["redis_cpu_fraction"].as_f64().unwrap_or(0.0),
            row["intervals_overran"],
            row["intervals"]
        ));
    }
    out
}

/// Prints how the global-class targets fare; the measurements that are missing or absurd.
pub fn check(report: &Value) -> Vec<String> {
    let mut broken = Vec::new();
    let skewed = &report["global"]["skewed"];
    let (global, split) = (skewed["global"].as_f64(), skewed["static_split"].as_f64());
    match (global, split) {
        (Some(global), Some(split)) if global > 0.0 && split > 0.0 => println!(
            "target skewed demand, a global class uses ≥ 0.90 of the limit where a static split uses a third: {} ({global:.3} vs {split:.3})",
            if global >= 0.90 { "meets" } else { "misses" }
        ),
        _ => broken.push(format!("skewed demand: {skewed}")),
    }
    let rows = report["global"]["redis"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if rows.is_empty() {
        broken.push("no simulated-hosts row".to_string());
    }
    for row in rows {
        if !row["script_ms_per_interval"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0 && ms.is_finite())
        {
            broken.push(format!("simulated hosts: {row}"));
        }
    }
    broken
}
