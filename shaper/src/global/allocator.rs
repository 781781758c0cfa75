//! `shaper global allocate`: the fill of a file's global keys (`fill.lua`) every half
//! interval, with a Redis user that may run it (a host's user may not), until stopped.

use super::{
    coordinator::fill,
    target::{Connection, Target},
    *,
};
use anyhow::Context as _;

/// Rounds a round's fills may take before they count as failed: a connection made
/// afresh 50 ms away takes a few round trips (connect, log in, NOSCRIPT, load) within
/// the first.
const ROUND_BOUND: u32 = 4;

/// Fills `keys` through `url` until the process is stopped. Each key is filled with its
/// own limits unless published; a fill that fails is logged (once until it changes) and
/// tried again at the next round, a lost connection made afresh.
pub fn allocate(url: &str, password: Option<&str>, keys: &[KeyLimits]) -> anyhow::Result<()> {
    let target = Target::new(url, password)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let round = keys
        .iter()
        .map(|limits| limits.interval)
        .min()
        .unwrap_or(DEFAULT_INTERVAL)
        / 2;
    let script = redis::Script::new(FILL);
    let stopped: anyhow::Result<()> = runtime.block_on(async {
        let mut connection: Option<Connection> = None;
        let mut last_error: Option<String> = None;
        log::info!(
            "filling {} global key(s) through {} every {}",
            keys.len(),
            redacted(url),
            humantime::format_duration(round)
        );
        loop {
            let started = tokio::time::Instant::now();
            if connection.is_none() {
                match target.connect(round).await {
                    Ok(made) => connection = Some(made),
                    Err(error) => say_once(&mut last_error, format!("cannot reach Redis: {error}")),
                }
            }
            if let Some(made) = connection.as_ref() {
                // Bounded as a whole (a cluster's client may wait out a node's silence
                // in its own retries): a round without an answer is a failed one.
                let fills = fill_every_key(made, &script, keys, &mut last_error, url);
                let failed = match tokio::time::timeout(ROUND_BOUND * round, fills).await {
                    Ok(failed) => failed?,
                    Err(_) => {
                        let late = format!("no fill answered within {ROUND_BOUND} rounds");
                        say_once(&mut last_error, late);
                        true
                    }
                };
                if failed {
                    // Made afresh: a refused login is never retried by the manager (Redis
                    // back before its ACL users), and behind Sentinel or in a cluster the
                    // primary may have moved.
                    connection = None;
                } else if last_error.take().is_some() {
                    log::info!("filling again");
                }
            }
            tokio::time::sleep_until(started + round).await;
        }
    });
    stopped.context("global allocate")
}

/// One round: every key at once on the multiplexed connection, so a round costs one
/// round trip, not one per key (16 keys 50 ms away took 0.8 s one by one). Whether a
/// fill failed; an error when this user may not run the fill at all.
async fn fill_every_key(
    connection: &Connection,
    script: &redis::Script,
    keys: &[KeyLimits],
    last_error: &mut Option<String>,
    url: &str,
) -> anyhow::Result<bool> {
    let fills = keys.iter().map(|limits| {
        let mut connection = connection.clone();
        async move {
            let args = FillArgs {
                key: limits.key.clone(),
                limit_bits_per_sec: limits.limit_bits_per_sec,
                floor_bits_per_sec: limits.floor_bits_per_sec,
            };
            (
                limits,
                fill(script, &mut connection, &args, limits.interval).await,
            )
        }
    });
    let mut failed = false;
    for (limits, outcome) in futures_util::future::join_all(fills).await {
        match outcome {
            Ok(filled) => {
                if filled.dropped > 0 {
                    log::warn!(
                        "global '{}': left out {} announcement(s) or report(s) it could not read (written by a host's Redis user, not by shaper)",
                        limits.key,
                        filled.dropped
                    );
                }
                log::debug!("global '{}': {} hosts", limits.key, filled.hosts);
            }
            Err(error) => {
                failed = true;
                if is_refused(&error) {
                    anyhow::bail!(
                        "the Redis user of {} may not run the fill ({error}): allocate as a user with +evalsha +script|load and the keys' rights (docs/GUIDE.md)",
                        redacted(url)
                    );
                }
                say_once(last_error, format!("global '{}': {error}", limits.key));
            }
        }
    }
    Ok(failed)
}

/// Logs `error` unless it is the one said last.
fn say_once(last: &mut Option<String>, error: String) {
    if last.as_ref() != Some(&error) {
        log::error!("{error}");
        *last = Some(error);
    }
}
