//! Limits across hosts: a global class against a static split of the same limit under
//! skewed demand (one host busy, two idle), and many simulated hosts against one real
//! redis-server (what the allocation script costs it per interval).

use anyhow::{Context as _, Result};
use serde_json::{json, Value};
use shaper::global::{redis_keys, Keys, FILL, FILL_FIELDS, HEADROOM_PPM};
use shaper_tests::{median, redis_cluster::RedisCluster, GlobalClass, GlobalLab, RedisServer};
use std::time::{Duration, Instant};

pub struct GlobalEffort {
    /// Seconds measured after the shares settle.
    pub seconds: u64,
    /// Simulated host counts against one Redis.
    pub hosts: Vec<u32>,
    /// Intervals simulated per host count.
    pub intervals: u32,
    /// Against a Redis Cluster of 1, 3 and 6 primaries: this many keys of this many
    /// simulated hosts each.
    pub cluster_keys: u32,
    pub cluster_hosts_per_key: u32,
}

pub fn effort(quick: bool) -> GlobalEffort {
    if quick {
        GlobalEffort {
            seconds: 3,
            hosts: vec![10, 300],
            intervals: 4,
            cluster_keys: 12,
            cluster_hosts_per_key: 50,
        }
    } else {
        GlobalEffort {
            seconds: 6,
            hosts: vec![10, 100, 1000, 3000, 10_000],
            intervals: 8,
            cluster_keys: 48,
            cluster_hosts_per_key: 100,
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
/// intervals as the daemons do (its own report read and written, its share read), and
/// one allocator filling once per interval, on one connection: Redis's own time in every
/// command per interval (commandstats) and its CPU (INFO cpu) per second of the run.
fn simulate(hosts: u32, intervals: u32) -> Result<Value> {
    let redis = RedisServer::start()?;
    let client = redis::Client::open(redis.url())?;
    let mut connection = client.get_connection()?;
    let script = redis::Script::new(FILL);
    let interval = Duration::from_millis(250);
    // Every host's calls of one interval, pipelined: the simulator's own round trips do
    // not limit how many hosts it can stand for (Redis runs the calls one after another,
    // as it would from many daemons).
    let round = |connection: &mut redis::Connection| -> Result<()> {
        key_round(connection, &script, "bench", hosts, interval)
    };
    // One round: every host known.
    round(&mut connection)?;
    // A fill at most every half interval: the first timed round fills again.
    std::thread::sleep(interval / 2);
    let (usec_before, cpu_before, started) =
        (command_usec(&redis)?, redis.cpu_seconds()?, Instant::now());
    let late = paced(intervals, interval, || round(&mut connection))?;
    let wall = started.elapsed().as_secs_f64();
    let redis_ms = (command_usec(&redis)? - usec_before) / 1000.0 / f64::from(intervals);
    let cpu = (redis.cpu_seconds()? - cpu_before) / wall;
    println!(
        "  {hosts} hosts: {redis_ms:.1} ms of Redis's time per 250 ms interval, Redis CPU {:.0} % of a core, {late} of {intervals} intervals overran",
        cpu * 100.0
    );
    Ok(json!({
        "hosts": hosts,
        "script_ms_per_interval": redis_ms,
        "redis_cpu_fraction": cpu,
        "intervals_overran": late,
        "intervals": intervals,
    }))
}

/// `rounds` calls of `round`, one per `interval` from now; how many overran theirs.
fn paced(rounds: u32, interval: Duration, mut round: impl FnMut() -> Result<()>) -> Result<u32> {
    let started = Instant::now();
    let mut late = 0;
    for index in 0..rounds {
        let due = started + interval * (index + 1);
        round()?;
        match due.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => late += 1,
        }
    }
    Ok(late)
}

/// Redis's own time in every command so far, µs (`INFO commandstats`).
fn command_usec(redis: &RedisServer) -> Result<f64> {
    let info = redis.cli(&["INFO", "commandstats"])?;
    Ok(info
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| l.split(',').find_map(|f| f.strip_prefix("usec=")))
        .filter_map(|v| v.parse::<f64>().ok())
        .sum())
}

/// One interval of `hosts` simulated hosts of global key `key` and its fill, as
/// [`simulate`]'s round, on any connection (one key's calls stay in its slot).
fn key_round(
    connection: &mut impl redis::ConnectionLike,
    script: &redis::Script,
    key: &str,
    hosts: u32,
    interval: Duration,
) -> Result<()> {
    let [shares, announce, _] = redis_keys(key);
    let mut looks = redis::pipe();
    let mut writes = redis::pipe();
    let mut reads = redis::pipe();
    for host in 0..hosts {
        let name = format!("sim-{host}");
        let keys = Keys::of(key, &name);
        let demand = u64::from(host % 10 + 1) * 1_000_000;
        looks
            .cmd("GET")
            .arg(&keys.report)
            .cmd("HEXISTS")
            .arg(&shares)
            .arg(&name);
        writes
            .cmd("SET")
            .arg(&keys.report)
            .arg(format!("{demand} {demand} sim"))
            .arg("PX")
            .arg(3 * interval.as_millis() as u64)
            .ignore()
            .cmd("SADD")
            .arg(&announce)
            .arg(&name)
            .ignore();
        reads.cmd("HMGET").arg(&shares).arg(&name).arg(&FILL_FIELDS);
    }
    let _: Vec<redis::Value> = looks.query(connection).context("the hosts' reads failed")?;
    writes
        .query::<()>(connection)
        .context("the hosts' reports failed")?;
    let _: Vec<u64> = script
        .key(&shares)
        .key(&announce)
        .arg(30_000_000u64)
        .arg(300_000u64)
        .arg(interval.as_millis() as u64)
        .arg(HEADROOM_PPM)
        .invoke(connection)
        .context("the fill failed")?;
    let replies: Vec<redis::Value> = reads.query(connection).context("the hosts' shares")?;
    anyhow::ensure!(replies.len() == hosts as usize, "{} replies", replies.len());
    Ok(())
}

/// `keys` global keys of `hosts_per_key` simulated hosts each against a Redis Cluster of
/// `primaries` primaries (the slots split evenly): each primary's own time in commands
/// per 250 ms interval, and the reports per interval the busiest primary could carry
/// in a whole interval.
fn simulate_cluster(
    primaries: usize,
    keys: u32,
    hosts_per_key: u32,
    intervals: u32,
) -> Result<Value> {
    let cluster = RedisCluster::start_without_replicas(primaries)?;
    // Each key's calls go straight to the primary that serves its slot (the slots were
    // split evenly here): what a cluster client does after its first MOVED, without a
    // simulator of its own in the way.
    let mut connections: Vec<redis::Connection> = cluster
        .nodes
        .iter()
        .map(|node| Ok(redis::Client::open(node.url())?.get_connection()?))
        .collect::<Result<_>>()?;
    let script = redis::Script::new(FILL);
    let interval = Duration::from_millis(250);
    let names: Vec<(String, usize)> = (0..keys)
        .map(|k| {
            let name = format!("bench-{k}");
            Ok((name.clone(), cluster.primary_of(&redis_keys(&name)[0])?))
        })
        .collect::<Result<_>>()?;
    let round = |connections: &mut [redis::Connection]| -> Result<()> {
        for (key, node) in &names {
            key_round(
                &mut connections[*node],
                &script,
                key,
                hosts_per_key,
                interval,
            )?;
        }
        Ok(())
    };
    round(&mut connections)?;
    std::thread::sleep(interval / 2);
    let usec_all = || -> Result<Vec<f64>> { cluster.nodes.iter().map(command_usec).collect() };
    let before = usec_all()?;
    let late = paced(intervals, interval, || round(&mut connections))?;
    let per_node: Vec<f64> = usec_all()?
        .iter()
        .zip(&before)
        .map(|(after, before)| (after - before) / 1000.0 / f64::from(intervals))
        .collect();
    let busiest = per_node.iter().copied().fold(0.0, f64::max);
    let reports = keys * hosts_per_key;
    let carried = f64::from(reports) * interval.as_secs_f64() * 1000.0 / busiest;
    println!(
        "  a cluster of {primaries}: {reports} reports per interval on {keys} keys; Redis ms per interval by primary {per_node:.1?}; the busiest could carry {carried:.0} reports per interval; {late} of {intervals} intervals overran"
    );
    Ok(json!({
        "primaries": primaries,
        "keys": keys,
        "reports_per_interval": reports,
        "ms_per_interval_by_primary": per_node,
        "reports_carried_per_interval": carried,
        "intervals_overran": late,
        "intervals": intervals,
    }))
}

/// The cluster rows: 1, 3 and 6 primaries under one load.
pub fn cluster_scale(effort: &GlobalEffort) -> Result<Vec<Value>> {
    [1, 3, 6]
        .iter()
        .map(|&primaries| {
            simulate_cluster(
                primaries,
                effort.cluster_keys,
                effort.cluster_hosts_per_key,
                effort.intervals,
            )
        })
        .collect()
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
    out.push_str("\nMany hosts on one class against one redis-server: each simulated host reads and writes its own report and reads its share once per 250 ms interval (as a daemon does), and one allocator fills once per interval. Redis's time in every command per interval (`INFO commandstats`) and its CPU (`INFO cpu`) over the run.\n\n| hosts | Redis ms per interval | Redis CPU (share of a core) | intervals overrun |\n|---|---|---|---|\n");
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
    let cluster_rows = global["cluster"].as_array().cloned().unwrap_or_default();
    let hosts_per_key = cluster_rows.first().map_or(0, |row| {
        row["reports_per_interval"].as_u64().unwrap_or(0) / row["keys"].as_u64().unwrap_or(1).max(1)
    });
    out.push_str(&format!("\nThe same calls against a Redis Cluster (every node a redis-server on loopback, the slots split evenly, no replicas): keys of {hosts_per_key} simulated hosts each, each key's calls in its own slot. Each primary's own time in commands per 250 ms interval, and the reports per interval the busiest primary could carry in a whole interval.\n\n| primaries | reports per interval | Redis ms per interval, by primary | reports the busiest carries per interval | intervals overrun |\n|---|---|---|---|---|\n", hosts_per_key = hosts_per_key));
    for row in &cluster_rows {
        let by_primary: Vec<String> = row["ms_per_interval_by_primary"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|ms| format!("{:.1}", ms.as_f64().unwrap_or(0.0)))
            .collect();
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} of {} |\n",
            row["primaries"],
            row["reports_per_interval"],
            by_primary.join(" / "),
            row["reports_carried_per_interval"].as_f64().unwrap_or(0.0),
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
    let cluster = report["global"]["cluster"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if cluster.len() != 3 {
        broken.push(format!("cluster rows: {cluster:?}"));
    }
    for row in cluster {
        if !row["reports_carried_per_interval"]
            .as_f64()
            .is_some_and(|n| n > 0.0 && n.is_finite())
        {
            broken.push(format!("a cluster row: {row}"));
        }
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
