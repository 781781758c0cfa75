//! Global classes: one limit across hosts, agreed through a real redis-server.
//!
//! - the allocation script against Redis itself: warm-up, max-min fill, forgetting;
//! - three hosts (namespaces), each with its own attachment and daemon, one sink: the
//!   limit held together, an app-limited host, a host that stops, Redis killed and
//!   restarted empty, a daemon killed, one Redis call per class, host and interval;
//! - TCP through a global shape class;
//! - `rediss://` with a private CA, trusted and not;
//! - a bad day: Redis silent for seconds under eight global classes, and a flood of
//!   connections to a daemon's metrics listener.

use anyhow::Result;
use shaper::global::{
    is_refused, redis_keys, Keys, EXPIRY_INTERVALS, FILL, HEADROOM_PPM, REPORT_INTERVALS,
};
use shaper_tests::{
    global::{class_row_in, WINDOW},
    median,
    redis_cluster::ok_after,
    GlobalClass, GlobalLab, RedisServer, Role,
};
use std::{
    thread,
    time::{Duration, Instant},
};

const LIMIT: f64 = 30e6;
const MBIT: u64 = 1_000_000;

/// One host's report as its daemon writes it: its own key (demand, what it holds, its
/// daemon's instance; lasting three intervals) and its announcement.
fn report(redis: &RedisServer, key: &str, host: &str, demand: u64, current: u64, interval_ms: u64) {
    let keys = Keys::of(key, host);
    let value = format!("{demand} {current} i{host}");
    let ttl = (REPORT_INTERVALS as u64 * interval_ms).to_string();
    redis
        .cli(&["SET", &keys.report, &value, "PX", &ttl])
        .unwrap();
    redis.cli(&["SADD", &keys.announce, host]).unwrap();
}

/// One fill as an allocator runs it (30 Mbit/s, floor 0.3 unless published): (filled,
/// hosts, dropped).
fn fill(redis: &RedisServer, key: &str, interval_ms: u64) -> (u64, u64, u64) {
    let [shares, announce, _] = redis_keys(key);
    let reply = redis
        .cli(&[
            "EVAL",
            FILL,
            "2",
            &shares,
            &announce,
            &(30 * MBIT).to_string(),
            "300000",
            &interval_ms.to_string(),
            &HEADROOM_PPM.to_string(),
        ])
        .unwrap();
    let numbers: Vec<u64> = reply
        .lines()
        .map(|line| line.trim().parse().unwrap())
        .collect();
    (numbers[0], numbers[1], numbers[2])
}

/// A host's share in the last fill (none: not in it) and the fill's host count.
fn share(redis: &RedisServer, key: &str, host: &str) -> (Option<u64>, u64) {
    let [shares, ..] = redis_keys(key);
    let reply = redis.cli(&["HMGET", &shares, host, ".hosts"]).unwrap();
    let mut lines = reply.lines().map(|line| line.trim().parse::<u64>().ok());
    (lines.next().flatten(), lines.next().flatten().unwrap_or(0))
}

#[test]
fn the_fill_is_max_min_over_the_reports_there_and_forgets_silent_hosts() {
    let redis = RedisServer::start().unwrap();
    // Long enough that the calls between two sleeps (a few ms each) stay well within
    // the half interval a fill is kept.
    let interval = 1000;
    // A fill is kept for half an interval: a little more makes the next call fill again.
    let refill = || thread::sleep(Duration::from_millis(interval / 2 + 10));
    // A new state: for two intervals nobody rises above what it holds.
    report(&redis, "t", "a", 30 * MBIT, 300_000, interval);
    assert_eq!(fill(&redis, "t", interval), (1, 1, 0));
    assert_eq!(share(&redis, "t", "a"), (Some(300_000), 1));
    // Three saturated hosts: the limit less 2 % in three, once the state is learnt.
    report(&redis, "t", "b", 30 * MBIT, 300_000, interval);
    report(&redis, "t", "c", 30 * MBIT, 300_000, interval);
    assert_eq!(
        fill(&redis, "t", interval).0,
        0,
        "a fill stands for half an interval"
    );
    assert_eq!(
        share(&redis, "t", "b"),
        (None, 1),
        "b is not in the last fill yet"
    );
    thread::sleep(Duration::from_millis(2 * interval + 30));
    for host in ["a", "b", "c"] {
        report(&redis, "t", host, 30 * MBIT, 300_000, interval);
    }
    assert_eq!(fill(&redis, "t", interval), (1, 3, 0));
    for host in ["a", "b", "c"] {
        assert_eq!(
            share(&redis, "t", host),
            (Some(9_800_000), 3),
            "host {host}"
        );
    }
    // The announcements were taken: the hosts of the last fill stay without them.
    let [shares_key, announce_key, _] = redis_keys("t");
    assert_eq!(redis.cli(&["SCARD", &announce_key]).unwrap().trim(), "0");
    // One host asks for 5.5: the others split the rest.
    report(&redis, "t", "a", 5_500_000, 9_800_000, interval);
    refill();
    fill(&redis, "t", interval);
    assert_eq!(share(&redis, "t", "b").0, Some(11_950_000));
    assert_eq!(share(&redis, "t", "a").0, Some(5_500_000));
    // Hosts that ask for nothing keep their floor; the spare is spread over everyone.
    report(&redis, "t", "a", 0, 9_800_000, interval);
    report(&redis, "t", "b", 0, 9_800_000, interval);
    report(&redis, "t", "c", 1_000_000, 9_800_000, interval);
    refill();
    fill(&redis, "t", interval);
    assert_eq!(
        share(&redis, "t", "c").0,
        Some(1_000_000 + (29_400_000 - 1_600_000) / 3)
    );
    // Three intervals of silence and a host's report is gone: the next fill leaves it out
    // (c keeps reporting).
    let silent = Instant::now();
    while silent.elapsed() < Duration::from_millis(3 * interval + 30) {
        report(&redis, "t", "c", 30 * MBIT, 9_800_000, interval);
        fill(&redis, "t", interval);
        thread::sleep(Duration::from_millis(interval / 2));
    }
    refill();
    fill(&redis, "t", interval);
    assert_eq!(share(&redis, "t", "c"), (Some(29_400_000), 1));
    assert_eq!(share(&redis, "t", "a").0, None);
    // The fill lives on only while allocators run: it expires after 40 intervals.
    let ttl: i64 = redis
        .cli(&["PTTL", &shares_key])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(ttl > 0 && ttl <= 40 * interval as i64, "ttl {ttl}");
    // What a host's user can write: its own report (unreadable: it is left out and
    // counted) and names in the announcements (no report: nobody; not a host id:
    // counted).
    redis
        .cli(&["SET", &Keys::of("t", "d").report, "nan 1 x", "PX", "3000"])
        .unwrap();
    for name in ["d", "ghost", ".hosts", "h:x y"] {
        redis.cli(&["SADD", &announce_key, name]).unwrap();
    }
    report(&redis, "t", "c", 30 * MBIT, 29_400_000, interval);
    refill();
    assert_eq!(fill(&redis, "t", interval), (1, 1, 3));
    assert_eq!(share(&redis, "t", "c"), (Some(29_400_000), 1));
    for name in ["d", "ghost"] {
        assert_eq!(share(&redis, "t", name).0, None, "{name}");
    }
    // An allocator's bad arguments, and keys that do not belong to one class, are
    // refused before anything is written.
    let eval = |keys: [&str; 2], limit: &str, floor: &str| {
        redis
            .cli(&[
                "EVAL", FILL, "2", keys[0], keys[1], limit, floor, "1000", "20000",
            ])
            .unwrap_or_else(|error| format!("{error:#}"))
    };
    let [s, a, _] = redis_keys("t");
    for (limit, floor) in [("-5", "0"), ("30000000", "40000000"), ("thirty", "300000")] {
        let reply = eval([&s, &a], limit, floor);
        assert!(reply.contains("shaper: bad"), "{limit} {floor}: {reply}");
    }
    let other = redis_keys("u");
    let mismatched = eval([&s, &other[1]], "30000000", "300000");
    assert!(mismatched.contains("KEYS must be"), "{mismatched}");
    // Redis's clock stepped back an hour (TIME is the wall clock): the stamps it wrote are
    // in the future. Fills go on, and the state is not held in re-learning.
    let hour_ahead = |field: &str| {
        let stamp: u64 = redis
            .cli(&["HGET", &shares_key, field])
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        redis
            .cli(&["HSET", &shares_key, field, &(stamp + 3_600_000).to_string()])
            .unwrap();
    };
    hour_ahead(".epoch");
    hour_ahead(".filled");
    report(&redis, "t", "a", 10 * MBIT, 300_000, interval);
    report(&redis, "t", "c", 30 * MBIT, 29_400_000, interval);
    assert_eq!(
        fill(&redis, "t", interval),
        (1, 2, 0),
        "a fill stamped ahead does not stand"
    );
    assert_eq!(
        share(&redis, "t", "a").0,
        Some(10 * MBIT),
        "a rises to its demand: not held in re-learning"
    );
    // No fill for three intervals (every allocator gone, a failover, a paused Redis):
    // a new state, in which nobody takes more than it holds while the others re-learn.
    thread::sleep(Duration::from_millis(3 * interval + 30));
    report(&redis, "t", "a", 30 * MBIT, 9_800_000, interval);
    fill(&redis, "t", interval);
    assert_eq!(
        share(&redis, "t", "a"),
        (Some(9_800_000), 1),
        "alone after a silence, a rose above what it held"
    );
    // A fill takes at most 4 096 announcements (its work stays bounded): 5 000 hosts new
    // at once all count after two fills, none twice.
    let mut connection = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut many = redis::pipe();
    for index in 0..5_000 {
        let keys = Keys::of("v", &format!("m{index}"));
        many.cmd("SET")
            .arg(&keys.report)
            .arg(format!("1000 1000 im{index}"))
            .arg("PX")
            .arg(60_000)
            .ignore()
            .cmd("SADD")
            .arg(&keys.announce)
            .arg(format!("m{index}"))
            .ignore();
    }
    many.exec(&mut connection).unwrap();
    assert_eq!(fill(&redis, "v", interval).1, 4_096);
    thread::sleep(Duration::from_millis(interval / 2 + 10));
    assert_eq!(fill(&redis, "v", interval), (1, 5_000, 0));
    let [_, announce_v, _] = redis_keys("v");
    assert_eq!(redis.cli(&["SCARD", &announce_v]).unwrap().trim(), "0");
}

/// A host's user under the ACL docs/GUIDE.md gives it: everything that would move
/// another host's share, the fill, the published limits or another tenant's keys is
/// refused by Redis itself, and what it may write (its own report, names in the
/// announcements, a flood of them) moves no other host's share and is counted by the
/// fill. (With the last design's ACL, `HSET shaper:{KEY} .filled nan` and forged shares
/// held one host at its floor while two sent 20 Mbit/s each through a 30 Mbit/s limit.)
#[test]
fn a_hosts_user_can_change_nothing_but_its_own_report() {
    let mut redis = RedisServer::start().unwrap();
    let interval = 1000;
    let rogue_url = redis
        .user(
            "rogue",
            "rogue-password",
            Role::Host {
                tenant: Some("tenant-a-".into()),
            },
        )
        .unwrap();
    let tenant = "tenant-a-t";
    let other_tenant = "tenant-b-t";
    for host in ["a", "b"] {
        report(&redis, tenant, host, 30 * MBIT, 300_000, interval);
    }
    report(&redis, other_tenant, "z", 30 * MBIT, 300_000, interval);
    report(&redis, tenant, "rogue", 30 * MBIT, 300_000, interval);
    // The first fills start the states, learnt two intervals later.
    fill(&redis, tenant, interval);
    fill(&redis, other_tenant, interval);
    thread::sleep(Duration::from_millis(2 * interval + 30));
    for host in ["a", "b", "rogue"] {
        report(&redis, tenant, host, 30 * MBIT, 300_000, interval);
    }
    fill(&redis, tenant, interval);
    fill(&redis, other_tenant, interval);
    assert_eq!(share(&redis, tenant, "a"), (Some(9_800_000), 3));
    let client = redis::Client::open(rogue_url.as_str()).unwrap();
    let mut rogue = client.get_connection().unwrap();
    let [shares, announce, limits] = redis_keys(tenant);
    let [other_shares, _, _] = redis_keys(other_tenant);
    let own = Keys::of(tenant, "rogue").report;
    let attempts: Vec<(&str, Vec<String>)> = vec![
        (
            "a fill stamp of nan",
            vec![
                "HSET".into(),
                shares.clone(),
                ".filled".into(),
                "nan".into(),
            ],
        ),
        (
            "an epoch of inf",
            vec!["HSET".into(), shares.clone(), ".epoch".into(), "inf".into()],
        ),
        (
            "a host count of -1",
            vec!["HSET".into(), shares.clone(), ".hosts".into(), "-1".into()],
        ),
        (
            "forged shares",
            vec![
                "HSET".into(),
                shares.clone(),
                "a".into(),
                "0".into(),
                "rogue".into(),
                "30000000".into(),
            ],
        ),
        ("the shares deleted", vec!["DEL".into(), shares.clone()]),
        (
            "the shares kept forever",
            vec!["PERSIST".into(), shares.clone()],
        ),
        (
            "another host's report",
            vec!["SET".into(), Keys::of(tenant, "a").report, "0 0 x".into()],
        ),
        (
            "another host's report read",
            vec!["GET".into(), Keys::of(tenant, "a").report],
        ),
        (
            "a report key of its own making",
            vec![
                "SET".into(),
                format!("shaper:{{{tenant}}}:r:a:r:rogue"),
                "1 1 x".into(),
            ],
        ),
        (
            "the published limits",
            vec![
                "HSET".into(),
                limits.clone(),
                "limit".into(),
                "1000000000000".into(),
            ],
        ),
        (
            "another tenant's shares read",
            vec!["HGETALL".into(), other_shares.clone()],
        ),
        (
            "another tenant's shares deleted",
            vec!["DEL".into(), other_shares.clone()],
        ),
        (
            "a script of its own",
            vec!["SCRIPT".into(), "LOAD".into(), "while true do end".into()],
        ),
        ("EVAL", vec!["EVAL".into(), "return 1".into(), "0".into()]),
        (
            "a function library",
            vec![
                "FUNCTION".into(),
                "LOAD".into(),
                "#!lua name=x\nredis.register_function('f', function() return 1 end)".into(),
            ],
        ),
        (
            "the announcements emptied",
            vec!["DEL".into(), announce.clone()],
        ),
        (
            "the announcements read",
            vec!["SMEMBERS".into(), announce.clone()],
        ),
        ("every key listed", vec!["KEYS".into(), "*".into()]),
        ("FLUSHALL", vec!["FLUSHALL".into()]),
        (
            "CONFIG SET",
            vec![
                "CONFIG".into(),
                "SET".into(),
                "maxmemory".into(),
                "1".into(),
            ],
        ),
        (
            "ACL SETUSER",
            vec![
                "ACL".into(),
                "SETUSER".into(),
                "rogue".into(),
                "+@all".into(),
            ],
        ),
    ];
    for (what, command) in &attempts {
        let mut cmd = redis::cmd(&command[0]);
        for arg in &command[1..] {
            cmd.arg(arg);
        }
        let reply: redis::RedisResult<redis::Value> = cmd.query(&mut rogue);
        let error = reply.expect_err(&format!("{what}: Redis let the host's user do it"));
        assert!(
            error.to_string().to_ascii_uppercase().contains("NOPERM")
                || error.to_string().contains("can't run this command"),
            "{what}: {error}"
        );
    }
    // What it may do: its own report (a demand of nan: left out and counted) and
    // announcements (a million names: dropped whole and counted).
    let _: () = redis::cmd("SET")
        .arg(&own)
        .arg("nan 0 x")
        .arg("PX")
        .arg(3000)
        .query(&mut rogue)
        .unwrap();
    let names: Vec<String> = (0..1_000_000).map(|i| format!("n{i}")).collect();
    for chunk in names.chunks(10_000) {
        let _: u64 = redis::cmd("SADD")
            .arg(&announce)
            .arg(chunk)
            .query(&mut rogue)
            .unwrap();
    }
    for host in ["a", "b"] {
        report(&redis, tenant, host, 30 * MBIT, 9_800_000, interval);
    }
    thread::sleep(Duration::from_millis(interval / 2 + 10));
    let (filled, hosts, dropped) = fill(&redis, tenant, interval);
    assert_eq!((filled, hosts), (1, 2));
    assert!(dropped >= 1_000_001, "dropped {dropped}");
    // a and b split the limit: the rogue host is out, its flood gone.
    assert_eq!(share(&redis, tenant, "a"), (Some(14_700_000), 2));
    assert_eq!(share(&redis, tenant, "b"), (Some(14_700_000), 2));
    assert_eq!(redis.cli(&["EXISTS", &announce]).unwrap().trim(), "0");
    // The other tenant's state is as its allocator left it.
    assert_eq!(share(&redis, other_tenant, "z"), (Some(29_400_000), 1));
}

/// `shaper global publish` with `args`: (success, stdout, stderr).
fn publish(args: &[&str]) -> (bool, String, String) {
    publish_with_password(args, "")
}

/// `publish`, with `password` (if any) in `$SHAPER_REDIS_PASSWORD`.
fn publish_with_password(args: &[&str], password: &str) -> (bool, String, String) {
    let output = std::process::Command::new(shaper_tests::process::shaper_bin())
        .args(["global", "publish"])
        .args(args)
        .env("SHAPER_REDIS_PASSWORD", password)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn published_limits_replace_the_callers_and_a_hosts_acl_cannot_write_them() -> Result<()> {
    let mut redis = RedisServer::start()?;
    let host_url = redis.host_user("node-a", "pw-a")?;
    let file = std::env::temp_dir().join(format!("shaper-publish-{}.toml", std::process::id()));
    struct Remove<'p>(&'p std::path::Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&file);
    let write_file = |rate: &str| {
        std::fs::write(
            &file,
            format!(
                "[coordination]\nredis = \"{host_url}\"\nhost_id = \"a\"\ninterval = \"1s\"\n\n\
                 [[interface]]\ndev = \"h0\"\n\n[[interface.class]]\nname = \"tenant\"\n\
                 rate = \"{rate}\"\naction = \"drop\"\nglobal = \"p\"\n"
            ),
        )
    };
    write_file("30mbit")?;
    let path = file.to_str().unwrap();
    // The file's own URL is a host's user: it may read the limits, not write them.
    let (ok, _, stderr) = publish(&["-f", path]);
    assert!(!ok, "a host's user published: {stderr}");
    assert!(
        stderr.contains("may not write shaper:{p}:limits") && !stderr.contains("pw-a"),
        "{stderr}"
    );
    // An administrator with a password: never on the command line, from the environment.
    redis::cmd("ACL")
        .arg(&["SETUSER", "admin", "on", ">admin-pw", "~*", "+@all"])
        .exec(&mut redis::Client::open(redis.url())?.get_connection()?)?;
    let admin_url = |login: &str| {
        redis
            .url()
            .replace("redis://", &format!("redis://{login}@"))
    };
    let (ok, _, stderr) = publish(&["-f", path, "--redis", &admin_url("admin:admin-pw")]);
    assert!(!ok, "a password on the command line was taken");
    assert!(
        stderr.contains("carries a password")
            && stderr.contains("SHAPER_REDIS_PASSWORD")
            && !stderr.contains("admin-pw"),
        "{stderr}"
    );
    let admin = admin_url("admin");
    // The environment's password is the one sent: a wrong one is refused.
    let (ok, _, stderr) = publish_with_password(&["-f", path, "--redis", &admin], "wrong");
    assert!(!ok && !stderr.contains("wrong"), "{stderr}");
    // --dry-run says what it would publish and writes nothing: the publish after it is
    // the first (version 1).
    let (ok, stdout, stderr) =
        publish_with_password(&["-f", path, "--redis", &admin, "--dry-run"], "admin-pw");
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("would publish p: limit 30Mbit,"),
        "{stdout}"
    );
    let (ok, stdout, stderr) = publish_with_password(&["-f", path, "--redis", &admin], "admin-pw");
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("published p: limit 30Mbit,") && stdout.contains("(version 1)"),
        "{stdout}"
    );
    // The password from --password-file (a file of the owner's alone), none in the
    // environment; a wrong one in the file is refused.
    let password_file = file.with_extension("password");
    let _remove_password = Remove(&password_file);
    let with_file = |password: &str| {
        std::fs::write(&password_file, password).unwrap();
        std::fs::set_permissions(
            &password_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        publish(&[
            "-f",
            path,
            "--redis",
            &admin,
            "--password-file",
            password_file.to_str().unwrap(),
        ])
    };
    let (ok, _, stderr) = with_file("wrong");
    assert!(!ok && !stderr.contains("wrong"), "{stderr}");
    let (ok, stdout, stderr) = with_file("admin-pw");
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("unchanged p:") && stdout.contains("(version 1)"),
        "{stdout}"
    );
    write_file("15mbit")?;
    let (_, stdout, _) = publish_with_password(&["-f", path, "--redis", &admin], "admin-pw");
    assert!(
        stdout.contains("limit 15Mbit,") && stdout.contains("(version 2)"),
        "{stdout}"
    );

    // An allocator whose own file says a huge limit fills with the published one, and
    // the host reads what it used.
    let [shares, announce, limits] = redis_keys("p");
    let mut host = redis::Client::open(host_url.as_str())?.get_connection()?;
    let own = Keys::of("p", "node-a").report;
    redis::cmd("SET")
        .arg(&own)
        .arg("1125899906842624 0 i")
        .arg("PX")
        .arg(3000)
        .exec(&mut host)?;
    redis::cmd("SADD")
        .arg(&announce)
        .arg("node-a")
        .exec(&mut host)?;
    let reply = redis.cli(&[
        "EVAL",
        FILL,
        "2",
        &shares,
        &announce,
        "1000000000000000",
        "0",
        "1000",
        "0",
    ])?;
    assert!(
        reply.lines().map(str::trim).eq(["1", "1", "0", "2"]),
        "{reply}"
    );
    let read: Vec<Option<u64>> = redis::cmd("HMGET")
        .arg(&shares)
        .arg(&["node-a", ".limit", ".version"])
        .query(&mut host)?;
    // In re-learning a new state nobody rises above what it holds (0): the limit and
    // version are what the fill used.
    assert_eq!(read, [Some(0), Some(15_000_000), Some(2)], "{read:?}");

    // What a host's user cannot do: write or remove the limits (directly or through a
    // script of its own), touch other keys, run scripts, or manage the server.
    let refused = |host: &mut redis::Connection, args: &[&str]| -> String {
        let mut command = redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        match command.exec(host) {
            Ok(()) => panic!("a host's user may {args:?}"),
            Err(error) => error.to_string(),
        }
    };
    let own_script = "return redis.call('HSET', KEYS[1], 'limit', '1')";
    for args in [
        &["HSET", &limits, "limit", "1"][..],
        &["DEL", &limits],
        &["HGETALL", &limits],
        &["HSET", "other", "a", "1"],
        &["EVAL", own_script, "1", &limits],
        &["SCRIPT", "LOAD", own_script],
        &["FLUSHALL"],
        &["CONFIG", "SET", "maxmemory", "1"],
        &["ACL", "SETUSER", "node-a", "+@all"],
        &["KEYS", "*"],
    ] {
        let error = refused(&mut host, args);
        assert!(
            error.to_ascii_uppercase().contains("NOPERM") || error.contains("can't run"),
            "{args:?}: {error}"
        );
    }
    assert_eq!(redis.cli(&["HGET", &limits, "limit"])?.trim(), "15000000");
    Ok(())
}

/// Sums of each window.
fn aggregate(windows: &[Vec<f64>]) -> Vec<f64> {
    windows.iter().map(|w| w.iter().sum()).collect()
}

fn column(windows: &[Vec<f64>], host: usize) -> Vec<f64> {
    windows.iter().map(|w| w[host]).collect()
}

fn mbit(value: f64) -> String {
    format!("{:.2}", value / 1e6)
}

#[test]
fn three_hosts_hold_one_limit_through_demand_changes_and_failures() -> Result<()> {
    three_hosts(false)
}

/// The same over a Redis Cluster (3 primaries, a replica each), whose every node is killed
/// in phase 4 and restarted empty: the hosts re-learn their shares within 3 intervals of
/// the cluster serving again (Redis holds a restarted primary back about 2 s first).
#[test]
fn three_hosts_hold_one_limit_through_demand_changes_and_failures_in_a_cluster() -> Result<()> {
    three_hosts(true)
}

fn three_hosts(cluster: bool) -> Result<()> {
    // Each host loses Redis its own way in phase 4.
    let class = GlobalClass {
        on_loss_by_host: &["static", "open", "closed"],
        cluster,
        ..GlobalClass::default()
    };
    let interval = Duration::from_millis(250);
    let mut lab = GlobalLab::new(3, class)?;
    let key = lab.key.clone();
    for host in 0..3 {
        lab.send(host, "20M", 60)?;
    }
    let mut all = Vec::new();
    // 1. All three saturating.
    lab.windows(Duration::from_secs(3), |_, _| Ok(()))?;
    // Control traffic is counted over phases 1 and 2 (three live hosts).
    let calls_from = Instant::now();
    let calls_before = lab.redis_of(&key)?.calls("set")?;
    let saturated = lab.windows(Duration::from_secs(4), |_, _| Ok(()))?;
    let total = median(&aggregate(&saturated));
    println!(
        "1. saturated: aggregate {} Mbit/s, hosts {} / {} / {}",
        mbit(total),
        mbit(median(&column(&saturated, 0))),
        mbit(median(&column(&saturated, 1))),
        mbit(median(&column(&saturated, 2)))
    );
    assert!(
        (0.95 * LIMIT..=1.03 * LIMIT).contains(&total),
        "aggregate {total}"
    );
    for host in 0..3 {
        let rate = median(&column(&saturated, host));
        assert!(
            (rate - LIMIT / 3.0).abs() <= 0.1 * LIMIT / 3.0,
            "host {host}: {rate}"
        );
    }
    all.extend(saturated);
    // The daemon's metrics and `shaper stats` show the share, the hosts and the age.
    // One scrape shows one interval's split, which moves with the demand each sender
    // showed in it (a sender held off the CPU for part of an interval asks for less): the
    // share is the median of five scrapes an interval apart, as the rates are medians of
    // windows.
    let mut scrapes = Vec::new();
    for _ in 0..5 {
        scrapes.push(lab.metrics(1)?);
        thread::sleep(interval);
    }
    let sample_of = |metrics: &str, name: &str| {
        metrics
            .lines()
            .find(|line| line.starts_with(&format!("{name}{{")))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse::<f64>().ok())
    };
    let shares: Vec<f64> = scrapes
        .iter()
        .map(|metrics| {
            sample_of(metrics, "shaper_class_global_share_bytes_per_second").unwrap_or(0.0) * 8.0
        })
        .collect();
    let share = median(&shares);
    println!(
        "   host 1's share in its metrics: {} Mbit/s (scrapes {:?})",
        mbit(share),
        shares.iter().map(|s| mbit(*s)).collect::<Vec<_>>()
    );
    assert!(
        (share - 0.98 * LIMIT / 3.0).abs() < 0.05 * LIMIT / 3.0,
        "share {share} (median of {shares:?})"
    );
    let metrics = &scrapes[scrapes.len() - 1];
    let sample = |name: &str| sample_of(metrics, name);
    assert_eq!(sample("shaper_class_global_hosts"), Some(3.0), "{metrics}");
    assert!(sample("shaper_class_global_share_age_seconds").is_some_and(|age| age < 1.0));
    assert_eq!(sample("shaper_class_global_share_expired"), Some(0.0));
    let row = lab.class_row(1)?;
    assert_eq!(row["hosts"], 3, "{row}");
    assert_eq!(row["global"], lab.key.as_str());

    // 2. Host 0 app-limited at 5 Mbit/s.
    lab.send(0, "5M", 40)?;
    all.extend(lab.windows(Duration::from_secs(2), |_, _| Ok(()))?);
    let limited = lab.windows(Duration::from_secs(4), |_, _| Ok(()))?;
    let wanted = (LIMIT - 5e6) / 2.0;
    println!(
        "2. host 0 at 5 Mbit/s: hosts {} / {} / {} (want {} each for 1 and 2)",
        mbit(median(&column(&limited, 0))),
        mbit(median(&column(&limited, 1))),
        mbit(median(&column(&limited, 2))),
        mbit(wanted)
    );
    for host in 1..3 {
        let rate = median(&column(&limited, host));
        assert!((rate - wanted).abs() <= 0.1 * wanted, "host {host}: {rate}");
    }
    all.extend(limited);
    let calls_elapsed = calls_from.elapsed();
    let calls = lab.redis_of(&key)?.calls("set")? - calls_before;

    // 3. Host 0 stops: the others take the limit within 2 s.
    let stopped = lab.windows(Duration::from_secs(4), |lab, window| {
        if window == 0 {
            lab.stop_sender(0)?;
        }
        Ok(())
    })?;
    let others: Vec<f64> = stopped.iter().map(|w| w[1] + w[2]).collect();
    let reached = others.iter().position(|&rate| rate >= 0.95 * LIMIT);
    let seconds = reached.map(|i| (i + 1) as f64 * WINDOW.as_secs_f64());
    println!(
        "3. host 0 stopped: hosts 1 + 2 per window {:?} Mbit/s, at 0.95 of the limit after {seconds:?} s",
        others.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    assert!(seconds.is_some_and(|s| s <= 2.0), "{seconds:?}");
    assert!(median(&others[reached.unwrap()..]) >= 0.95 * LIMIT);
    all.extend(stopped);

    // 4. Redis killed for 5 s, restarted empty. Meanwhile each host does what its
    // `on_coordinator_loss` says: host 0 (`static`) keeps its last share for three
    // intervals, then the limit less the headroom over the last host count (both a third
    // of 0.98 of the limit here); host 1 (`open`) its local rate (the limit: its 20 Mbit/s
    // sender passes whole); host 2 (`closed`) its floor. Then all re-learn their shares.
    lab.send(0, "20M", 40)?;
    all.extend(lab.windows(Duration::from_secs(2), |_, _| Ok(()))?);
    let floor = lab.class_row(2)?["floor_bps"]
        .as_f64()
        .expect("the class row has its floor");
    let names: Vec<String> = lab.hosts.iter().map(|h| h.name.clone()).collect();
    let nodes: Vec<u16> = lab
        .cluster
        .iter()
        .flat_map(|c| &c.nodes)
        .map(|n| n.port)
        .collect();
    let (mut watcher, mut serving) = (None, None);
    // A restarted cluster takes seconds to serve: the outage's windows go on longer.
    let length = Duration::from_secs(if cluster { 11 } else { 8 });
    let outage = lab.windows(length, |lab, window| {
        if window == 0 {
            lab.kill_redis();
        }
        if window == 10 {
            // Users 300 ms late: the hosts that try meanwhile are refused their login and
            // must not wait for the daemon's 4-interval backstop (1066 ms in one CI run).
            lab.restart_redis_empty(Duration::from_millis(300))?;
            let (names, nodes, restart) = (names.clone(), nodes.clone(), Instant::now());
            watcher = Some(thread::spawn(move || reconverged_after(&names, restart)));
            serving = Some(thread::spawn(move || {
                ok_after(&nodes, restart, Duration::from_secs(10))
            }));
        }
        Ok(())
    })?;
    let converged = watcher.expect("restarted").join().expect("watcher")?;
    // When the restarted Redis served again (a server: at once).
    let serving = serving.expect("restarted").join().expect("watcher")?;
    // The seconds without Redis after the first (the hosts notice within an interval).
    let without = &outage[2..10];
    let during = |host| median(&column(without, host));
    println!(
        "4. Redis down 5 s: hosts per window {:?} Mbit/s; without Redis: static {} / open {} / \
         closed {} (floor {}); shares re-learnt {:.0} ms after the restart, Redis served \
         again after {:.0} ms",
        outage
            .iter()
            .map(|w| w.iter().map(|r| mbit(*r)).collect::<Vec<_>>().join("/"))
            .collect::<Vec<_>>(),
        mbit(during(0)),
        mbit(during(1)),
        mbit(during(2)),
        mbit(floor),
        converged.as_secs_f64() * 1000.0,
        serving.as_secs_f64() * 1000.0
    );
    let part = LIMIT * (1.0 - HEADROOM_PPM as f64 / 1e6) / 3.0;
    assert!(
        (0.95 * part..=1.05 * part).contains(&during(0)),
        "static: {} Mbit/s, not its share of {}",
        mbit(during(0)),
        mbit(part)
    );
    // Its sender's 20 Mbit/s of payload, 1242-byte frames of 1200 bytes on the wire.
    let open_offered = 20e6 * 1242.0 / 1200.0;
    assert!(
        during(1) >= 0.95 * open_offered,
        "open: {} Mbit/s, not its sender's {}",
        mbit(during(1)),
        mbit(open_offered)
    );
    // Within 15 %: a 500 ms window of the 300 kbit/s floor holds 15 datagrams.
    assert!(
        (0.85 * floor..=1.15 * floor).contains(&during(2)),
        "closed: {} Mbit/s, not its floor {}",
        mbit(during(2)),
        mbit(floor)
    );
    assert!(
        converged <= serving + 3 * interval,
        "re-converged after {converged:?}, Redis served after {serving:?}"
    );
    // The limit held again once the shares were re-learnt (without Redis, from the kill
    // on, `open` lets its host exceed it by design): from 1 s after the restart, in a
    // cluster from the second window after they were.
    let relearnt = match cluster {
        true => 11 + converged.as_millis().div_ceil(WINDOW.as_millis()) as usize,
        false => 12,
    };
    all.extend(outage[relearnt.min(outage.len())..].iter().cloned());

    // 5. Host 0's daemon killed: its share expires to the floor, the others take it.
    let mut killed_at = None;
    let dead = lab.windows(Duration::from_secs(4), |lab, window| {
        if window == 0 {
            lab.kill_daemon(0);
            killed_at = Some(Instant::now());
        }
        Ok(())
    })?;
    let others: Vec<f64> = dead.iter().map(|w| w[1] + w[2]).collect();
    // After its expiry and four more intervals, measured in whole windows.
    let due = interval * (EXPIRY_INTERVALS + 4);
    let due_windows = due.as_millis().div_ceil(WINDOW.as_millis()) as usize;
    println!(
        "5. host 0's daemon killed: host 0 per window {:?}, hosts 1 + 2 {:?} Mbit/s",
        column(&dead, 0)
            .iter()
            .map(|r| mbit(*r))
            .collect::<Vec<_>>(),
        others.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    let row = lab.class_row(0)?;
    assert_eq!(row["share_expired"], true, "{row}");
    let floor = row["floor_bps"].as_f64().unwrap();
    assert!(
        median(&column(&dead, 0)[due_windows..]) <= 2.0 * floor,
        "host 0 kept more than its floor"
    );
    assert!(
        others[due_windows..]
            .iter()
            .all(|&rate| rate >= 0.95 * (LIMIT - floor)),
        "hosts 1 and 2 did not take host 0's share within {due:?}"
    );
    all.extend(dead);

    // 6. Control traffic: one report (SET of its own key) per class, host and interval at
    // most; the allocator's fills at most one per half interval.
    let intervals = calls_elapsed.as_secs_f64() / interval.as_secs_f64();
    let allowed = (3.0 * intervals).ceil() as u64 + 3;
    println!(
        "6. {calls} reports in {:.1} s from 3 hosts (at most {allowed}); fills: {}",
        calls_elapsed.as_secs_f64(),
        lab.redis_of(&key)?.calls("evalsha")?
    );
    assert!(calls <= allowed, "{calls} > {allowed}");
    assert!(
        calls as f64 >= 3.0 * (intervals - 2.0),
        "the hosts stopped reporting: {calls}"
    );

    // Never above 1.05 of the limit, in any window of the whole run.
    let worst = aggregate(&all).into_iter().fold(0.0, f64::max);
    println!(
        "highest aggregate window of the run: {} Mbit/s",
        mbit(worst)
    );
    assert!(worst <= 1.05 * LIMIT, "a window reached {worst}");
    // Through a Redis killed, restarted empty and refusing logins, no daemon's log
    // showed a password (URLs are logged redacted).
    let leaks = lab.password_leaks();
    assert!(leaks.is_empty(), "passwords in the logs: {leaks:?}");
    assert!(
        (0..3).any(|host| lab.daemon_log(host).contains(":***@")),
        "no redacted URL logged: the check above saw nothing to check"
    );
    Ok(())
}

/// How long after `restart` every host had its share answered again by the new Redis
/// with all three hosts counted. From each host's share age (the answer's own time), so
/// polling adds at most one poll's lag, never less than the truth.
fn reconverged_after(hosts: &[String], restart: Instant) -> Result<Duration> {
    let deadline = restart + Duration::from_secs(10);
    let mut answered: Vec<Option<Duration>> = vec![None; hosts.len()];
    while Instant::now() < deadline {
        for (host, first) in hosts.iter().zip(answered.iter_mut()) {
            if first.is_some() {
                continue;
            }
            let row = class_row_in(host)?;
            let age = Duration::from_secs_f64(row["share_age_seconds"].as_f64().unwrap_or(1e9));
            if let Some(at) = Instant::now().checked_sub(age) {
                if at > restart && row["hosts"] == 3 {
                    *first = Some(at - restart);
                }
            }
        }
        if answered.iter().all(Option::is_some) {
            return Ok(answered.into_iter().flatten().max().unwrap_or_default());
        }
        thread::sleep(Duration::from_millis(20));
    }
    anyhow::bail!("the hosts did not re-learn their shares within 10 s: {answered:?}")
}

/// iperf3's per-second sender intervals: (bit/s, retransmissions).
fn per_second(json: &serde_json::Value) -> Vec<(Option<f64>, u64)> {
    json["intervals"]
        .as_array()
        .map(|intervals| {
            intervals
                .iter()
                .map(|i| {
                    let sum = &i["sum"];
                    (
                        sum["bits_per_second"].as_f64(),
                        sum["retransmits"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The mean of iperf3's per-second sender rates from second `from` on.
fn steady_bps(json: &serde_json::Value, from: usize) -> f64 {
    let rates: Vec<f64> = per_second(json)
        .into_iter()
        .skip(from)
        .filter_map(|(bps, _)| bps)
        .collect();
    rates.iter().sum::<f64>() / rates.len().max(1) as f64
}

#[test]
fn tcp_through_a_global_shape_class_fills_the_limit() -> Result<()> {
    tcp_through(false)
}

/// Out of the suite (47 s of its 30 minutes): the fill is the same Lua on either
/// backend, and the cluster's client is held by the failover test and the cluster twins
/// of the bad days. `cargo test --test global -- --ignored` runs it.
#[test]
#[ignore = "the standalone twin runs in the suite: cargo test --test global -- --ignored"]
fn tcp_through_a_global_shape_class_fills_the_limit_in_a_cluster() -> Result<()> {
    tcp_through(true)
}

fn tcp_through(cluster: bool) -> Result<()> {
    // Hosts that trust each other: their daemons fill too (`allocate = auto` with users
    // that may), with no allocator of the lab's.
    let class = GlobalClass {
        action: "shape",
        pods: true,
        hosts_allocate: true,
        cluster,
        ..GlobalClass::default()
    };
    let lab = GlobalLab::new(3, class)?;
    // The flows start on hosts whose daemons already agreed on their parts, as on nodes
    // that ran a while. (A flow that starts on a host squeezed to its floor sits in
    // retransmission backoff for a few seconds first: see `RAMP_GRACE`.)
    let mut shares = lab.wait_equal_parts()?;
    // The daemons fill (no allocator here) with the headroom: three idle hosts get equal
    // parts of the limit less 2 %, within 1 %.
    let part = LIMIT * (1.0 - HEADROOM_PPM as f64 / 1e6) / 3.0;
    let near = |shares: &[u64]| {
        shares
            .iter()
            .all(|share| (*share as f64 - part).abs() <= 0.01 * part)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !near(&shares) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        shares = (0..3)
            .map(|index| lab.share(index))
            .collect::<Result<_>>()?;
    }
    assert!(
        near(&shares),
        "the daemons' parts {shares:?}, not {part:.0} each (the limit less the headroom, over 3)"
    );
    // Those parts do not last: the first flow to start asks for more and the idle hosts'
    // shares fall at once, so flows that start a moment later slow-start into half a part,
    // lose a burst and may sit out retransmission timeouts (up to 2.5 s) before the parts
    // are equal again (4-8 s after the start here). Steady state is counted from 10 s, over
    // 30 s: a flow through a shape class on this µs path loses 8-10 % of its packets to
    // CoDel (a 5 ms queue is 4 frames at a third of 30 Mbit/s), now and then one of them a
    // retransmission: a 24 s window from the 6th second read 0.875 once in CI (a 14 s one
    // 0.891 once before), against 0.927-0.949 in most runs.
    // What the sink received on the wire from 10 s to 39 s, against the limit (also a wire
    // rate).
    let (runs, l2) = thread::scope(|scope| {
        let runs = scope.spawn(|| lab.tcp_all(40));
        thread::sleep(Duration::from_secs(10));
        let start = lab.delivered().map(|bytes| (bytes, Instant::now()));
        thread::sleep(Duration::from_secs(29));
        let end = lab.delivered();
        let runs = runs.join().expect("the TCP runs");
        let l2 = start.and_then(|(before, at)| {
            let seconds = at.elapsed().as_secs_f64();
            Ok(end?
                .iter()
                .zip(&before)
                .map(|(after, before)| (after - before) as f64 * 8.0 / seconds)
                .collect::<Vec<f64>>())
        });
        (runs, l2)
    });
    let (runs, l2) = (runs?, l2?);
    let per_host: Vec<f64> = runs.iter().map(|json| steady_bps(json, 10)).collect();
    let total: f64 = per_host.iter().sum();
    let total_l2: f64 = l2.iter().sum();
    println!(
        "7. one Cubic flow per host through a global shape class: {} Mbit/s on the wire ({:.3} of \
         the limit), hosts {:?}; goodput {} Mbit/s, hosts {:?}",
        mbit(total_l2),
        total_l2 / LIMIT,
        l2.iter().map(|r| mbit(*r)).collect::<Vec<_>>(),
        mbit(total),
        per_host.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    for (index, json) in runs.iter().enumerate() {
        println!(
            "   host {index}, Mbit/s/retransmits per second: {}",
            per_second(json)
                .iter()
                .map(|(bps, retransmits)| format!("{}/{retransmits}", mbit(bps.unwrap_or(0.0))))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    // Wire rate against the wire limit, both ways (goodput is at most 1448/1514 of it:
    // against the limit, its old upper bound of 1.03 was 1.077 in wire terms).
    assert!(total_l2 >= 0.90 * LIMIT, "aggregate on the wire {total_l2}");
    assert!(total_l2 <= 1.03 * LIMIT, "above the limit: {total_l2}");
    Ok(())
}

/// `rediss://`: a daemon that trusts the private CA that signed Redis's certificate
/// (`SSL_CERT_FILE`) agrees over TLS and gets the limit less the headroom (it is the
/// only host); restarted trusting another CA, it cannot verify the server, says so in its
/// log, calls Redis no more, and holds only its floor (`on_coordinator_loss = "closed"`).
#[test]
fn a_daemon_agrees_over_tls_and_refuses_a_server_it_cannot_verify() -> Result<()> {
    tls_verified(false)
}

#[test]
fn a_daemon_agrees_over_tls_and_refuses_a_cluster_it_cannot_verify() -> Result<()> {
    tls_verified(true)
}

fn tls_verified(cluster: bool) -> Result<()> {
    let mut lab = GlobalLab::new(
        1,
        GlobalClass {
            tls: true,
            on_loss: "closed",
            cluster,
            ..GlobalClass::default()
        },
    )?;
    let key = lab.key.clone();
    let shares = lab.wait_equal_parts()?;
    println!("over TLS: share {} bit/s of {LIMIT}", shares[0]);
    let row = lab.class_row(0)?;
    assert_eq!(row["hosts"], 1, "{row}");
    assert!(
        lab.redis_of(&key)?.calls("set")? > 0,
        "the host reported to Redis"
    );

    lab.trust = lab.other_ca();
    lab.kill_daemon(0);
    lab.start_daemon(0)?;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (row, log) = loop {
        let row = lab.class_row(0)?;
        let log = lab.daemon_log(0);
        if row["share_bps"] == row["floor_bps"] && log.contains("UnknownIssuer") {
            break (row, log);
        }
        assert!(
            Instant::now() < deadline,
            "an unverifiable server: the share stayed above the floor or the log gave no \
             reason: {row}\n{log}"
        );
        thread::sleep(Duration::from_millis(100));
    };
    let floor = row["floor_bps"].as_f64().unwrap_or(0.0);
    assert!(floor > 0.0 && floor < 0.5 * LIMIT, "{row}");
    let calls = lab.redis_of(&key)?.calls("set")?;
    thread::sleep(Duration::from_secs(2));
    assert_eq!(
        lab.redis_of(&key)?.calls("set")?,
        calls,
        "no call got through TLS with the wrong CA"
    );
    let row = lab.class_row(0)?;
    assert_eq!(row["share_bps"], row["floor_bps"], "the floor held: {row}");
    println!(
        "another CA: share {floor} bit/s (the floor); log: {}",
        log.lines()
            .find(|line| line.contains("UnknownIssuer"))
            .unwrap_or_default()
    );
    Ok(())
}

/// Every class of host 0 has its share from Redis (one host: the limit less the headroom).
fn wait_answered(lab: &GlobalLab, classes: usize) -> Result<Vec<serde_json::Value>> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows = lab.class_rows(0)?;
        let answered = rows
            .iter()
            .filter(|row| row["hosts"] == 1 && row["share_bps"].as_f64() > Some(0.9 * LIMIT))
            .count();
        if answered == classes {
            return Ok(rows);
        }
        assert!(
            Instant::now() < deadline,
            "{answered} of {classes} classes got their share within 15 s: {rows:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// Every class on every host holds its part (`hosts` counted, at least 0.9 of an equal
/// part of the limit less the headroom); the rows by host.
fn wait_all_parts(lab: &GlobalLab, classes: usize) -> Result<Vec<Vec<serde_json::Value>>> {
    let hosts = lab.hosts.len();
    let part = 0.98 * LIMIT / hosts as f64;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows: Vec<Vec<serde_json::Value>> = (0..hosts)
            .map(|h| lab.class_rows(h))
            .collect::<Result<_>>()?;
        let held = rows.iter().all(|rows| {
            rows.len() == classes
                && rows.iter().all(|row| {
                    row["hosts"] == hosts && row["share_bps"].as_f64() >= Some(0.9 * part)
                })
        });
        if held {
            return Ok(rows);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "not every class holds its part: {rows:?}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// The reports each host counted as failed, summed.
fn failed_reports(lab: &GlobalLab) -> Result<f64> {
    let mut sum = 0.0;
    for host in 0..lab.hosts.len() {
        sum += lab
            .metrics(host)?
            .lines()
            .find(|line| {
                line.starts_with("shaper_daemon_coordination_reports_total{result=\"failed\"}")
            })
            .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0);
    }
    Ok(sum)
}

/// Redis black-holed for 10 s (the proxy forwards nothing) under 16 global classes on
/// three hosts at 250 ms, each host with its own `on_coordinator_loss`: sampled every
/// 100 ms, no `static` or `open` class falls to its floor or expires; `static` keeps its
/// part, `open` takes its own rate within a second, `closed` its floor.
#[test]
fn a_black_holed_redis_floors_no_class_but_the_closed_ones() -> Result<()> {
    black_holed(false)
}

/// The same with every node of a Redis Cluster (3 primaries) black-holed at once.
#[test]
fn a_black_holed_cluster_floors_no_class_but_the_closed_ones() -> Result<()> {
    black_holed(true)
}

fn black_holed(cluster: bool) -> Result<()> {
    const CLASSES: usize = 16;
    let lab = GlobalLab::new(
        3,
        GlobalClass {
            classes: CLASSES,
            proxy: true,
            cluster,
            on_loss_by_host: &["static", "open", "closed"],
            ..GlobalClass::default()
        },
    )?;
    let part = 0.98 * LIMIT / 3.0;
    wait_all_parts(&lab, CLASSES)?;
    let failed_before = failed_reports(&lab)?;
    lab.proxies().iter().for_each(|proxy| proxy.hold());
    let held = Instant::now();
    let mut samples = 0;
    while held.elapsed() < Duration::from_secs(10) {
        let at = held.elapsed().as_secs_f64();
        for host in 0..3 {
            for row in lab.class_rows(host)? {
                let share = row["share_bps"].as_f64().unwrap_or(0.0);
                let floor = row["floor_bps"].as_f64().unwrap_or(0.0);
                let fell = || {
                    format!(
                        "{at:.1} s into the black hole, host {host}: {row}\n{}",
                        lab.daemon_log(host)
                    )
                };
                match host {
                    0 => assert!(
                        row["share_expired"] == false && share >= 0.95 * part,
                        "{}",
                        fell()
                    ),
                    1 => {
                        assert!(
                            row["share_expired"] == false && share >= 0.95 * part,
                            "{}",
                            fell()
                        );
                        assert!(
                            at < 1.0 || share == LIMIT,
                            "open: not its own rate; {}",
                            fell()
                        );
                    }
                    _ => assert!(
                        at < 1.0 || share == floor,
                        "closed: not its floor; {}",
                        fell()
                    ),
                }
            }
        }
        samples += 1;
        thread::sleep(Duration::from_millis(100));
    }
    let failed = failed_reports(&lab)? - failed_before;
    for proxy in lab.proxies() {
        proxy.set_delay(Duration::ZERO);
    }
    let back = Instant::now();
    wait_all_parts(&lab, CLASSES)?;
    println!(
        "Redis black-holed 10 s under {CLASSES} classes on 3 hosts: {samples} samples of \
         48 rows, no static or open class at its floor; {failed} reports failed; every \
         class back at its part {:.2} s after the proxy forwarded again",
        back.elapsed().as_secs_f64()
    );
    assert!(samples >= 40, "{samples} samples in 10 s");
    assert!(
        failed >= (3 * CLASSES * 30) as f64,
        "reports failed meanwhile: {failed}"
    );
    Ok(())
}

/// Redis 50 ms away (25 ms each way through the proxy) under 16 global classes on three
/// saturating hosts: the sum holds the limit; then the state lock held for 2 s (by
/// another program) floors no class: renewals take no lock.
#[test]
fn redis_50_ms_away_holds_the_limit_and_a_held_lock_floors_no_class() -> Result<()> {
    redis_50_ms_away(false)
}

/// The same with every node of a Redis Cluster (3 primaries) 50 ms away.
#[test]
fn a_cluster_50_ms_away_holds_the_limit_and_a_held_lock_floors_no_class() -> Result<()> {
    redis_50_ms_away(true)
}

fn redis_50_ms_away(cluster: bool) -> Result<()> {
    const CLASSES: usize = 16;
    let mut lab = GlobalLab::new(
        3,
        GlobalClass {
            classes: CLASSES,
            proxy: true,
            cluster,
            ..GlobalClass::default()
        },
    )?;
    for proxy in lab.proxies() {
        proxy.set_delay(Duration::from_millis(25));
    }
    for host in 0..3 {
        lab.send(host, "20M", 30)?;
    }
    lab.wait_equal_parts()?;
    lab.windows(Duration::from_secs(2), |_, _| Ok(()))?;
    let windows = lab.windows(Duration::from_secs(4), |_, _| Ok(()))?;
    let sums = aggregate(&windows);
    let total = median(&sums);
    println!(
        "Redis 50 ms away, {CLASSES} classes, 3 hosts: aggregate {:?} Mbit/s",
        sums.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    assert!(
        (0.95 * LIMIT..=1.03 * LIMIT).contains(&total),
        "aggregate {total}"
    );
    let holder = shaper_tests::state_lock::StateLockHolder::take()?;
    let locked = Instant::now();
    let mut samples = 0;
    while locked.elapsed() < Duration::from_secs(2) {
        for host in 0..3 {
            for row in lab.class_rows(host)? {
                let share = row["share_bps"].as_f64().unwrap_or(0.0);
                let floor = row["floor_bps"].as_f64().unwrap_or(0.0);
                assert!(
                    row["share_expired"] == false && share > floor,
                    "{:.1} s into the held lock, host {host}: {row}",
                    locked.elapsed().as_secs_f64()
                );
            }
        }
        samples += 1;
        thread::sleep(Duration::from_millis(100));
    }
    drop(holder);
    println!("the state lock held 2 s: {samples} samples of 48 rows, none at its floor");
    assert!(samples >= 8, "{samples} samples in 2 s");
    Ok(())
}

/// A local flood of 1 000 idle connections to a daemon's metrics listener: at most 32
/// wait for a request (each new one closes the oldest), so while all 1 000 are held
/// open the daemon's descriptors stay bounded, a scrape is answered within a second and
/// the global class keeps its share.
#[test]
fn a_connection_flood_keeps_no_scraper_out_and_costs_few_descriptors() -> Result<()> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    use std::io::Read as _;
    const FLOOD: usize = 1000;
    // This test process holds the flood: room for it.
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard.min(8192), hard)?;
    let lab = GlobalLab::new(1, GlobalClass::default())?;
    wait_answered(&lab, 1)?;
    let (pid, port) = lab.daemon_process(0).expect("the daemon runs");
    let descriptors =
        || -> Result<usize> { Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count()) };
    let idle = descriptors()?;
    let flood: Vec<std::net::TcpStream> = (0..FLOOD)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)))
        .collect::<std::io::Result<_>>()?;
    thread::sleep(Duration::from_millis(300));
    let during = descriptors()?;
    let asked = Instant::now();
    let metrics = lab.metrics(0)?;
    let answered_in = asked.elapsed();
    let row = lab.class_row(0)?;
    // Closed by the daemon: a read returns at once (end of stream); open: it would block.
    let mut closed = 0;
    for mut stream in &flood {
        stream.set_nonblocking(true)?;
        let mut byte = [0u8; 1];
        if matches!(stream.read(&mut byte), Ok(0)) {
            closed += 1;
        }
    }
    let refused = metrics
        .lines()
        .find(|line| line.starts_with("shaper_daemon_metrics_connections_refused_total"))
        .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    println!(
        "{FLOOD} idle connections held open: {during} descriptors (idle {idle}), /metrics \
         answered in {:.0} ms, {closed} closed by the daemon, {refused} counted",
        answered_in.as_secs_f64() * 1000.0
    );
    assert!(
        during <= idle + 32 + 4,
        "{during} descriptors with {FLOOD} connections open (idle: {idle})"
    );
    assert!(
        answered_in < Duration::from_secs(1),
        "/metrics took {answered_in:?}"
    );
    assert!(metrics.contains("shaper_class_global_share"), "{metrics}");
    assert!(row["share_expired"] == false, "{row}");
    assert!(closed >= FLOOD - 32, "closed by the daemon: {closed}");
    assert!(refused >= (FLOOD - 32) as f64, "counted: {refused}");
    drop(flood);
    Ok(())
}

/// Redis gone, and the daemon unable to make a new client (its password file removed
/// meanwhile): every report counts as unanswered, so `on_coordinator_loss` still decides
/// and the share in force keeps being renewed. With `open`, the host takes the whole
/// limit; a daemon that skipped its ticks without a client let the share expire to the
/// floor.
#[test]
fn without_a_redis_client_on_coordinator_loss_still_decides() -> Result<()> {
    let mut lab = GlobalLab::new(
        1,
        GlobalClass {
            on_loss: "open",
            ..GlobalClass::default()
        },
    )?;
    wait_answered(&lab, 1)?;
    let file = lab
        .password_file(0)
        .expect("host 0 reads a password file")
        .clone();
    std::fs::remove_file(&file)?;
    lab.redis.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = lab.daemon_log(0);
        if log.contains("coordination off") && log.contains("password_file") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no failed client in the log:\n{log}"
        );
        thread::sleep(Duration::from_millis(100));
    }
    // Past the expiry (3 intervals) several times over.
    thread::sleep(Duration::from_secs(3));
    let row = lab.class_row(0)?;
    println!("no Redis client, on_coordinator_loss = open: {row}");
    assert!(row["share_expired"] == false, "{row}");
    assert_eq!(
        row["share_bps"].as_f64(),
        Some(LIMIT),
        "open takes the limit: {row}"
    );
    Ok(())
}

/// Two hosts cloned with one host_id: the allocator keeps the id with the daemon that
/// reported first and refuses the other's reports, which says so in its log and its
/// metrics and holds the floor. Before, both counted as one host and each enforced the
/// share of a host alone: twice the limit.
#[test]
fn two_daemons_with_one_host_id_do_not_merge_into_one_host() -> Result<()> {
    two_daemons_with_one_host_id(false)
}

/// As [`two_daemons_with_one_host_id_do_not_merge_into_one_host`], in a Redis Cluster.
#[test]
fn two_daemons_with_one_host_id_do_not_merge_in_a_cluster() -> Result<()> {
    two_daemons_with_one_host_id(true)
}

fn two_daemons_with_one_host_id(cluster: bool) -> Result<()> {
    let lab = GlobalLab::new(
        2,
        GlobalClass {
            one_host_id: true,
            cluster,
            ..GlobalClass::default()
        },
    )?;
    let message = "another daemon reports with this host_id";
    let deadline = Instant::now() + Duration::from_secs(10);
    let (winner, loser) = loop {
        let logs = [lab.daemon_log(0), lab.daemon_log(1)];
        match (logs[0].contains(message), logs[1].contains(message)) {
            (false, true) => break (0, 1),
            (true, false) => break (1, 0),
            (true, true) => panic!("both daemons were refused:\n{}\n{}", logs[0], logs[1]),
            (false, false) => {}
        }
        assert!(
            Instant::now() < deadline,
            "no daemon was refused the shared id:\n{}\n{}",
            logs[0],
            logs[1]
        );
        thread::sleep(Duration::from_millis(100));
    };
    // A few intervals on: still one of them refused, the other the only host.
    thread::sleep(Duration::from_secs(2));
    let (kept, refused) = (lab.class_row(winner)?, lab.class_row(loser)?);
    println!("one host_id on two hosts: kept {kept}\nrefused {refused}");
    assert_eq!(kept["hosts"], 1, "{kept}");
    assert!(kept["share_bps"].as_f64() > Some(0.9 * LIMIT), "{kept}");
    assert_eq!(refused["share_bps"], refused["floor_bps"], "{refused}");
    assert!(!lab.daemon_log(winner).contains(message));
    let taken = lab
        .metrics(loser)?
        .lines()
        .find(|line| line.starts_with("shaper_daemon_host_id_taken_total"))
        .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(taken >= 4.0, "refused reports counted: {taken}");
    let [shares_key, ..] = redis_keys(&lab.key);
    let fields = lab.redis_of(&lab.key)?.cli(&["HKEYS", &shares_key])?;
    let hosts: Vec<&str> = fields.lines().filter(|f| !f.starts_with('.')).collect();
    assert_eq!(hosts, ["host-0"], "{fields}");
    Ok(())
}

/// A daemon restarted on its host is no clone: it takes over the instance of the one
/// before it (`/run/shaper/global-HOST.instance`) and Redis answers it at once. Three
/// hosts each offered 20 Mbit/s under 30 Mbit/s; host 0's daemon SIGTERMed and started
/// again (`systemctl restart`): every 250 ms bin of host 0 at least 0.9 of its part;
/// SIGKILLed and started again: at its part again within 2 intervals (500 ms), and no
/// refusal in either new daemon's log. (Before, the new daemon was refused for three
/// intervals and held its floor: 0.75 of its part over the 3 s after a restart.) Two
/// live daemons with one host id are still refused
/// (`two_daemons_with_one_host_id_do_not_merge_into_one_host`).
#[test]
fn a_restarted_daemon_keeps_its_share() -> Result<()> {
    restarted_daemon(false)
}

/// As [`a_restarted_daemon_keeps_its_share`], in a Redis Cluster.
#[test]
fn a_restarted_daemon_keeps_its_share_in_a_cluster() -> Result<()> {
    restarted_daemon(true)
}

fn restarted_daemon(cluster: bool) -> Result<()> {
    const BIN: Duration = Duration::from_millis(250);
    let mut lab = GlobalLab::new(
        3,
        GlobalClass {
            cluster,
            ..GlobalClass::default()
        },
    )?;
    for host in 0..3 {
        lab.send(host, "20M", 40)?;
    }
    lab.wait_equal_parts()?;
    thread::sleep(Duration::from_secs(1));
    let part = LIMIT / 3.0;
    let refused = "another daemon reports with this host_id";
    for (how, stop) in [("SIGTERM", true), ("SIGKILL", false)] {
        let bins = lab.windows_of(BIN, Duration::from_secs(4), |lab, bin| {
            if bin == 4 {
                if stop {
                    lab.terminate_daemon(0)?;
                } else {
                    lab.kill_daemon(0);
                }
                lab.start_daemon(0)?;
            }
            Ok(())
        })?;
        let host0 = column(&bins, 0);
        println!(
            "{how} and start again: host 0 in 250 ms bins {:?} Mbit/s (part {})",
            host0.iter().map(|r| mbit(*r)).collect::<Vec<_>>(),
            mbit(part)
        );
        // SIGTERM: every bin; SIGKILL: from 2 intervals after the start on.
        let from = if stop { 0 } else { 4 + 2 };
        let least = host0[from..].iter().copied().fold(f64::MAX, f64::min);
        assert!(
            least >= 0.9 * part,
            "{how}: a bin at {least} of part {part}"
        );
        // Together, over 500 ms (two bins) as the other tests' windows.
        let totals = aggregate(&bins);
        let highest = totals
            .windows(2)
            .map(|pair| (pair[0] + pair[1]) / 2.0)
            .fold(0.0, f64::max);
        assert!(
            highest <= 1.05 * LIMIT,
            "{how}: 500 ms at {highest}: {:?}",
            totals.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
        );
        assert!(
            !lab.daemon_log(0).contains(refused),
            "{how}: the new daemon was refused as a clone:\n{}",
            lab.daemon_log(0)
        );
    }
    Ok(())
}

/// A host's user (the ACL docs/GUIDE.md gives a host) that misbehaves for as long as
/// `stop` is false: every round it tries what would move the others' shares (stamps and
/// counts of `nan`, `inf`, `-1` and text, forged shares, another host's report, keys of
/// its own making, the limits, another tenant's keys, scripts), writes its own report
/// unreadable and a million announcements, ten thousand a round (`flood`). (refused,
/// rounds): the attempts Redis
/// refused, and the rounds made.
fn misbehave(
    url: &str,
    key: &str,
    stop: &std::sync::atomic::AtomicBool,
    flood: &[redis::Cmd],
) -> Result<(u64, u64)> {
    let mut connection = redis::Client::open(url)?.get_connection()?;
    let [shares, announce, limits] = redis_keys(key);
    let other = Keys::of(key, "host-1").report;
    let own = Keys::of(key, "rogue").report;
    let mut attempts: Vec<Vec<String>> = Vec::new();
    for bad in ["nan", "inf", "-1", "text"] {
        for field in [".filled", ".epoch", ".hosts"] {
            attempts.push(vec![
                "HSET".into(),
                shares.clone(),
                field.into(),
                bad.into(),
            ]);
        }
    }
    let forged = [
        "HSET", &shares, "host-0", "30000000", "host-1", "0", "host-2", "30000000",
    ];
    attempts.push(forged.iter().map(|a| a.to_string()).collect());
    attempts.push(vec!["PEXPIRE".into(), shares.clone(), "100000000".into()]);
    attempts.push(vec!["SET".into(), other.clone(), "0 0 forged".into()]);
    attempts.push(vec!["DEL".into(), other]);
    attempts.push(vec![
        "SET".into(),
        format!("shaper:{{{key}}}:r:host-1:r:rogue"),
        "1 1 x".into(),
    ]);
    attempts.push(vec![
        "HSET".into(),
        limits.clone(),
        "limit".into(),
        "1000000000000".into(),
    ]);
    attempts.push(vec![
        "HGETALL".into(),
        "shaper:{other-tenant}:shares".into(),
    ]);
    attempts.push(vec!["DEL".into(), "shaper:{other-tenant}:shares".into()]);
    attempts.push(vec![
        "SCRIPT".into(),
        "LOAD".into(),
        "while true do end".into(),
    ]);
    attempts.push(vec!["EVAL".into(), "while true do end".into(), "0".into()]);
    attempts.push(vec!["DEL".into(), announce.clone()]);
    let (mut refused, mut rounds) = (0, 0);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) && rounds < 2_000 {
        for attempt in &attempts {
            let mut command = redis::cmd(&attempt[0]);
            for arg in &attempt[1..] {
                command.arg(arg);
            }
            match command.exec(&mut connection) {
                Err(error) if is_refused(&error) => refused += 1,
                outcome => anyhow::bail!("{attempt:?}: Redis did not refuse it: {outcome:?}"),
            }
        }
        // What it may write: its own report, unreadable, and its name announced.
        redis::cmd("SET")
            .arg(&own)
            .arg("nan inf rogue")
            .arg("PX")
            .arg(750)
            .exec(&mut connection)?;
        redis::cmd("SADD")
            .arg(&announce)
            .arg("rogue")
            .exec(&mut connection)?;
        // The flood goes out a command a round (ten thousand names): a sustained one.
        if let Some(command) = flood.get(rounds as usize) {
            command.exec(&mut connection)?;
        }
        rounds += 1;
        thread::sleep(Duration::from_millis(50));
    }
    Ok((refused, rounds))
}

/// A hostile host: its own Redis user with the ACL docs/GUIDE.md gives a host, trying
/// everything `misbehave` does for 8 s while three hosts each offer 20 Mbit/s under 30
/// Mbit/s. Every attempt that would move another's share is refused by Redis; what it
/// may write (its own report unreadable, a million announcements) is left out of the
/// fill, counted and logged by the allocator; every host's share stays within 2 % of its
/// part and the total within 1.03 x the limit, throughout.
#[test]
fn a_hostile_host_moves_no_other_hosts_share() -> Result<()> {
    hostile_host(false)
}

/// As [`a_hostile_host_moves_no_other_hosts_share`], in a Redis Cluster: the rogue
/// talks to the primary of the key's slot (Redis checks a user's rights before it
/// redirects, so every refusal is the same).
#[test]
fn a_hostile_host_moves_no_other_hosts_share_in_a_cluster() -> Result<()> {
    hostile_host(true)
}

fn hostile_host(cluster: bool) -> Result<()> {
    let mut lab = GlobalLab::new(
        3,
        GlobalClass {
            cluster,
            ..GlobalClass::default()
        },
    )?;
    lab.user("rogue", "pw-rogue", Role::Host { tenant: None })?;
    let rogue_url = format!(
        "redis://rogue:pw-rogue@127.0.0.1:{}/0",
        lab.redis_of(&lab.key)?.port
    );
    // A million announcements, made before the senders start: making them in this debug
    // build takes a core for a second, and sent at once they took Redis about as long;
    // either starved the hosts' senders on a 2-core machine, and so their demands and
    // shares. Sent ten thousand a round, they are a sustained flood.
    let [_, announce, _] = redis_keys(&lab.key);
    let names: Vec<String> = (0..1_000_000).map(|i| format!("n{i}")).collect();
    let flood: Vec<redis::Cmd> = names
        .chunks(10_000)
        .map(|chunk| {
            let mut command = redis::cmd("SADD");
            command.arg(&announce).arg(chunk);
            command
        })
        .collect();
    drop(names);
    for host in 0..3 {
        lab.send(host, "20M", 40)?;
    }
    let part = LIMIT * (1.0 - HEADROOM_PPM as f64 / 1e6) / 3.0;
    // Settled first: every share at its part for a whole second with the senders
    // running (an idle host's share is a part too: the spare is spread evenly, so the
    // first look passes before the senders' demands arrive). From then on, nothing may
    // move them.
    let started = Instant::now();
    let mut steady_since = Instant::now();
    while steady_since.elapsed() < Duration::from_secs(1) {
        let at_parts = (0..3).all(|host| {
            lab.share(host)
                .is_ok_and(|share| (share as f64 - part).abs() <= 0.01 * part)
        });
        if !at_parts {
            steady_since = Instant::now();
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(15),
            "the shares did not settle at their parts in 15 s"
        );
        thread::sleep(Duration::from_millis(50));
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let key = lab.key.clone();
    let mut shares_seen: Vec<f64> = Vec::new();
    let (windows, (refused, rounds)) = thread::scope(|scope| -> Result<_> {
        let rogue = scope.spawn(|| misbehave(&rogue_url, &key, &stop, &flood));
        let windows = lab.windows(Duration::from_secs(8), |lab, _| {
            for host in 0..3 {
                let row = lab.class_row(host)?;
                shares_seen.push(row["share_bps"].as_f64().unwrap_or(0.0));
            }
            Ok(())
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let rogue = rogue.join().expect("the rogue client panicked")?;
        Ok((windows?, rogue))
    })?;
    let totals = aggregate(&windows);
    println!(
        "a hostile host: {refused} attempts refused in {rounds} rounds; shares seen {:?} Mbit/s (part {}); aggregate per window {:?}",
        shares_seen.iter().map(|r| mbit(*r)).collect::<Vec<_>>(),
        mbit(part),
        totals.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    anyhow::ensure!(rounds > 50, "the rogue made {rounds} rounds");
    for share in &shares_seen {
        assert!(
            (share - part).abs() <= 0.02 * part,
            "a host's share at {share}, its part {part}"
        );
    }
    let highest = totals.iter().copied().fold(0.0, f64::max);
    assert!(highest <= 1.03 * LIMIT, "a window at {highest}");
    let log = lab.allocator_log();
    assert!(
        log.contains("could not read"),
        "the allocator did not say what it left out:\n{log}"
    );
    Ok(())
}

/// A primary, a replica and three sentinels, all over TLS (`rediss+sentinel://`); the
/// hosts name first a sentinel address that never answers, then a lying sentinel that
/// names a decoy server (with Redis's own certificate and the hosts' users) as the
/// primary. No host ever calls the decoy: the three outvote it. The primary killed
/// under three saturating hosts: every host follows the failover within 2 s of most
/// sentinels naming the replica, with no window above 1.05 of the limit.
#[test]
fn a_sentinel_failover_is_followed_over_tls_and_a_lying_sentinel_is_outvoted() -> Result<()> {
    let class = GlobalClass {
        sentinel: true,
        tls: true,
        ..GlobalClass::default()
    };
    let mut lab = GlobalLab::new(3, class)?;
    for host in 0..3 {
        lab.send(host, "20M", 40)?;
    }
    lab.wait_equal_parts()
        .map_err(|e| anyhow::anyhow!("{e:#}\n{}", lab.daemon_log(0)))?;
    let before = lab.windows(Duration::from_secs(2), |_, _| Ok(()))?;
    let replica_port = lab
        .replica
        .as_ref()
        .and_then(|r| r.tls())
        .map(|tls| tls.port)
        .unwrap();
    let names: Vec<String> = lab.hosts.iter().map(|h| h.name.clone()).collect();
    let sentinel_ports: Vec<u16> = lab.sentinels.iter().map(|s| s.port).collect();
    // The primary killed; from then on, every 100 ms: which primary Sentinel names, and
    // whether every host holds a share answered since the kill.
    lab.redis.kill();
    let killed = Instant::now();
    let (during, samples) = windows_sampled(&mut lab, killed, Duration::from_secs(8), |at| {
        let switched = sentinel_ports
            .iter()
            .filter(|&&port| {
                shaper_tests::sentinel::primary_of(port).is_ok_and(|p| p == replica_port)
            })
            .count()
            >= 2;
        let answered = names.iter().all(|name| {
            class_row_in(name).is_ok_and(|row| {
                row["hosts"] == 3
                    && row["share_age_seconds"]
                        .as_f64()
                        .is_some_and(|age| age < at)
            })
        });
        (switched, answered)
    })?;
    let switched = samples.iter().find(|s| s.1 .0).map(|s| s.0);
    let relearnt = samples.iter().find(|s| s.1 .1).map(|s| s.0);
    let sums = aggregate(&during);
    println!(
        "sentinel failover: most sentinels named the replica {switched:?} s after the kill, every host answered by it {relearnt:?} s after; aggregate before {:?}, during {:?} Mbit/s",
        aggregate(&before).iter().map(|r| mbit(*r)).collect::<Vec<_>>(),
        sums.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    let (switched, relearnt) = (
        switched.expect("no failover in 8 s"),
        relearnt.expect("shares never re-learnt"),
    );
    assert_failover_followed(switched, relearnt, &sums);
    let (decoy, _) = lab.decoy.as_ref().unwrap();
    assert_eq!(
        (
            decoy.calls("evalsha")?,
            decoy.calls("set")?,
            decoy.calls("auth")?
        ),
        (0, 0, 0),
        "a host logged in to the decoy a lying sentinel named"
    );
    Ok(())
}

/// Each host's rate per window, and samples of something else at seconds after a start.
type SampledWindows<T> = (Vec<Vec<f64>>, Vec<(f64, T)>);

/// The lab's windows for `duration` from `from`, and beside them, every 100 ms, what
/// `sample` says at that many seconds after `from` (a failover's progress).
fn windows_sampled<T: Send>(
    lab: &mut GlobalLab,
    from: Instant,
    duration: Duration,
    sample: impl Fn(f64) -> T + Sync,
) -> Result<SampledWindows<T>> {
    thread::scope(|scope| {
        let poll = scope.spawn(|| {
            let mut samples = Vec::new();
            while from.elapsed() < duration {
                let at = from.elapsed().as_secs_f64();
                samples.push((at, sample(at)));
                thread::sleep(Duration::from_millis(100));
            }
            samples
        });
        let during = lab.windows(duration, |_, _| Ok(()));
        let samples = poll.join().expect("the poller panicked");
        Ok((during?, samples))
    })
}

/// A failover's targets: the hosts answered by the new primary within 2 s of its
/// promotion (`moved` and `followed`: seconds after the kill), no 500 ms window of
/// `sums` above 1.05 of the limit, and the last four at 0.95 of it or more.
fn assert_failover_followed(moved: f64, followed: f64, sums: &[f64]) {
    assert!(
        followed - moved <= 2.0,
        "answered by the new primary {followed} s after the kill, which it was {moved} s after"
    );
    let highest = sums.iter().copied().fold(0.0, f64::max);
    assert!(highest <= 1.05 * LIMIT, "a window at {highest}");
    let tail = median(&sums[sums.len() - 4..]);
    assert!(
        tail >= 0.95 * LIMIT,
        "after the failover the hosts hold {tail}"
    );
}

/// Each class's key (`tenant`'s is the lab's key, then `KEY-1` ...) and the sum of the
/// hosts' shares of it, from every host's rows.
fn shares_by_key(lab: &GlobalLab) -> Result<Vec<(String, f64)>> {
    let mut sums: std::collections::BTreeMap<String, f64> = Default::default();
    for host in 0..lab.hosts.len() {
        for row in lab.class_rows(host)? {
            let key = row["global"].as_str().unwrap_or_default().to_string();
            *sums.entry(key).or_default() += row["share_bps"].as_f64().unwrap_or(0.0);
        }
    }
    Ok(sums.into_iter().collect())
}

/// Three hosts on eight global keys through a Redis Cluster over TLS (three primaries,
/// a replica each, made by `redis-cli --cluster create`, clients and bus on TLS with a
/// private CA's certificate; every host and the allocator its own ACL user on every
/// node; `rediss+cluster://`), the keys spread over the primaries: every key's shares
/// add up to 0.95-1.03 of its limit and the traffic class holds its limit. Then the
/// primary of the traffic class's slot is killed: its replica is promoted, every host's
/// every class is answered again within 2 s of the promotion, and no 500 ms window is
/// above 1.05 of the limit. Last, `shaper global publish` through the cluster sets a
/// key's limit, which its shares follow.
#[test]
fn global_classes_hold_over_a_redis_cluster_and_follow_a_failover() -> Result<()> {
    const CLASSES: usize = 8;
    let mut lab = GlobalLab::new(
        3,
        GlobalClass {
            classes: CLASSES,
            cluster: true,
            tls: true,
            ..GlobalClass::default()
        },
    )?;
    let cluster = lab.cluster.as_ref().unwrap();
    let keys: Vec<String> = std::iter::once(lab.key.clone())
        .chain((1..CLASSES).map(|i| format!("{}-{i}", lab.key)))
        .collect();
    let serving: Vec<usize> = keys
        .iter()
        .map(|key| cluster.primary_of(&redis_keys(key)[0]))
        .collect::<Result<_>>()?;
    let primaries: std::collections::BTreeSet<usize> = serving.iter().copied().collect();
    for host in 0..3 {
        lab.send(host, "20M", 40)?;
    }
    wait_all_parts(&lab, CLASSES)?;
    let before = aggregate(&lab.windows(Duration::from_secs(3), |_, _| Ok(()))?);
    let sums = shares_by_key(&lab)?;
    println!(
        "a cluster: {} keys on {} primaries (nodes {serving:?}); shares by key {:?} Mbit/s; aggregate {:?}",
        keys.len(),
        primaries.len(),
        sums.iter().map(|(_, s)| mbit(*s)).collect::<Vec<_>>(),
        before.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    assert!(
        primaries.len() >= 2,
        "every key on one primary: {serving:?}"
    );
    assert_eq!(sums.len(), CLASSES, "{sums:?}");
    for (key, sum) in &sums {
        assert!(
            (0.95 * LIMIT..=1.03 * LIMIT).contains(sum),
            "key {key}: shares add up to {sum}"
        );
    }
    let total = median(&before);
    assert!(
        (0.95 * LIMIT..=1.03 * LIMIT).contains(&total),
        "aggregate {total}"
    );
    let victim = serving[0];
    let cluster = lab.cluster.as_ref().unwrap();
    let heir = cluster.replica_of(victim)?;
    let heir_port = cluster.nodes[heir].port;
    let names: Vec<String> = lab.hosts.iter().map(|h| h.name.clone()).collect();
    lab.cluster.as_mut().unwrap().nodes[victim].kill();
    let killed = Instant::now();
    // Every 100 ms: whether the replica is a primary, and since when every class of
    // every host holds a share answered (seconds after the kill).
    let (during, samples) = windows_sampled(&mut lab, killed, Duration::from_secs(10), |at| {
        let promoted = shaper_tests::process::output_bounded(
            std::process::Command::new("redis-cli").args(["-p", &heir_port.to_string(), "ROLE"]),
            Duration::from_secs(2),
        )
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).starts_with("master"));
        let oldest = names
            .iter()
            .map(|name| shaper_tests::global::class_rows_in(name))
            .map(|rows| {
                rows.ok()
                    .filter(|rows| rows.len() == CLASSES)
                    .and_then(|rows| {
                        rows.iter()
                            .map(|row| row["share_age_seconds"].as_f64())
                            .try_fold(0.0, |old: f64, age| Some(old.max(age?)))
                    })
                    .unwrap_or(f64::INFINITY)
            })
            .fold(0.0, f64::max);
        (promoted, at - oldest)
    })?;
    let promoted = samples.iter().find(|s| s.1 .0).map(|s| s.0);
    // Answered since the promotion: every share's age is younger than the promotion.
    let followed = promoted.and_then(|promoted| {
        samples
            .iter()
            .find(|s| s.0 > promoted && s.1 .1 > promoted)
            .map(|s| s.0)
    });
    let sums = aggregate(&during);
    println!(
        "a cluster's primary killed: its replica a primary {promoted:?} s after, every class answered since by {followed:?} s; aggregate {:?} Mbit/s",
        sums.iter().map(|r| mbit(*r)).collect::<Vec<_>>()
    );
    let promoted = promoted.expect("no replica promoted in 10 s");
    let followed = followed.unwrap_or_else(|| {
        panic!(
            "the shares were not answered again after the promotion; host 0's log:\n{}",
            lab.daemon_log(0)
        )
    });
    assert_failover_followed(promoted, followed, &sums);
    // `shaper global publish` through the cluster (as its default user, the lab's
    // administrator): a 15 Mbit/s limit for the second key, which the allocator then
    // fills with, on whichever primary serves it.
    let published_key = &keys[1];
    let file = std::env::temp_dir().join(format!("{}-publish.toml", lab.key));
    std::fs::write(
        &file,
        format!(
            "[coordination]\nredis = \"redis://127.0.0.1:1/0\"\nhost_id = \"admin\"\n\n\
             [[interface]]\ndev = \"h0\"\n\n[[interface.class]]\nname = \"half\"\n\
             rate = \"15mbit\"\naction = \"drop\"\nglobal = \"{published_key}\"\n"
        ),
    )?;
    let cluster = lab.cluster.as_ref().unwrap();
    let output = std::process::Command::new(shaper_tests::process::shaper_bin())
        .args(["global", "publish", "-f"])
        .arg(&file)
        .args(["--redis", &cluster.url_of("")])
        .envs(cluster.ca().map(|ca| ("SSL_CERT_FILE", ca)))
        .output()?;
    let _ = std::fs::remove_file(&file);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "publish through the cluster: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    let published = loop {
        let sums = shares_by_key(&lab)?;
        let sum = sums
            .iter()
            .find(|(key, _)| key == published_key)
            .map_or(0.0, |(_, sum)| *sum);
        if (sum - 0.98 * 15e6).abs() <= 0.01 * 15e6 || Instant::now() > deadline {
            break sum;
        }
        thread::sleep(Duration::from_millis(100));
    };
    println!("published through the cluster: {stdout:?}; the key's shares add up to {published}");
    assert!(
        (published - 0.98 * 15e6).abs() <= 0.01 * 15e6,
        "shares of the published key: {published}"
    );
    Ok(())
}
