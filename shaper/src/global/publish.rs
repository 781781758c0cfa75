//! `shaper global publish`: a configuration's global limits written into Redis, where
//! the fill reads them instead of its allocator's own (`fill.lua`, KEYS[3]).
//! Run with a Redis user that may write `shaper:{*}:limits`, which the hosts' users may
//! only read: no host can then change a limit, and a rolling change of a host's file
//! no longer makes the fills alternate between two limits.

use super::*;
use crate::classes::ClassSpec;
use anyhow::{bail, Context as _};
use std::collections::BTreeMap;

/// One global key's limits as a configuration declares them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyLimits {
    pub key: String,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
    pub interval: Duration,
}

/// What publishing one key did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    pub limits: KeyLimits,
    /// The version in Redis now (raised by one when anything changed).
    pub version: u64,
    pub changed: bool,
}

/// The global keys of `classes` (each with the interface it is on), each once, with the
/// file's coordination `interval`. A key declared twice with other numbers (on two
/// interfaces, say) is refused: the hosts would not know which one is meant.
pub fn key_limits<'c>(
    classes: impl IntoIterator<Item = (&'c str, &'c ClassSpec)>,
    interval: Duration,
) -> anyhow::Result<Vec<KeyLimits>> {
    let mut keys: BTreeMap<String, (KeyLimits, String)> = BTreeMap::new();
    for (dev, spec) in classes {
        let Some(global) = &spec.global else { continue };
        let limits = KeyLimits {
            key: global.key.clone(),
            limit_bits_per_sec: spec.rate_bits_per_sec,
            floor_bits_per_sec: global.floor_bits_per_sec,
            interval,
        };
        let place = format!("class {} on {dev}", spec.name);
        match keys.get(&global.key) {
            Some((known, first)) if *known != limits => bail!(
                "global key '{}' has other limits in {first} than in {place}",
                global.key
            ),
            Some(_) => {}
            None => {
                keys.insert(global.key.clone(), (limits, place));
            }
        }
    }
    Ok(keys.into_values().map(|(limits, _)| limits).collect())
}

/// Writes each key's limits (with the fill's headroom), raising its version when they
/// changed; unchanged keys keep theirs, so publishing the same file twice changes nothing.
const PUBLISH: &str = r"
local now = redis.call('HMGET', KEYS[1], 'limit', 'floor', 'interval', 'headroom', 'version')
local version = tonumber(now[5]) or 0
if now[1] == ARGV[1] and now[2] == ARGV[2] and now[3] == ARGV[3] and now[4] == ARGV[4] and version > 0 then
  return {version, 0}
end
version = version + 1
redis.call('HSET', KEYS[1], 'limit', ARGV[1], 'floor', ARGV[2], 'interval', ARGV[3],
  'headroom', ARGV[4], 'version', version)
return {version, 1}
";

/// Publishes `keys` through `url` (the password from a `password_file`, if given).
pub fn publish(
    url: &str,
    password: Option<&str>,
    keys: &[KeyLimits],
) -> anyhow::Result<Vec<Published>> {
    let target = target::Target::new(url, password)?;
    let script = redis::Script::new(PUBLISH);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut connection = target
            .connect(Duration::from_secs(5))
            .await
            .with_context(|| format!("cannot reach Redis at {}", redacted(url)))?;
        let mut published = Vec::new();
        for limits in keys {
            let [_, _, limits_key] = redis_keys(&limits.key);
            let (version, changed): (u64, u8) = script
                .key(&limits_key)
                .arg(limits.limit_bits_per_sec)
                .arg(limits.floor_bits_per_sec)
                .arg(limits.interval.as_millis() as u64)
                .arg(HEADROOM_PPM)
                .invoke_async(&mut connection)
                .await
                .map_err(|error| denied(error, url, &limits_key))?;
            published.push(Published {
                limits: limits.clone(),
                version,
                changed: changed != 0,
            });
        }
        Ok(published)
    })
}

/// A refused write said as the operator's next step: a host's user may only read limits.
fn denied(error: redis::RedisError, url: &str, key: &str) -> anyhow::Error {
    let text = error.to_string();
    if text.to_ascii_uppercase().contains("NOPERM") || text.contains("can't run this command") {
        anyhow::anyhow!(
            "the Redis user of {} may not write {key} (a host's user only reads limits): publish with an administrator's URL (--redis)",
            redacted(url)
        )
    } else if error.is_io_error() || error.is_connection_refusal() || error.is_timeout() {
        anyhow::anyhow!("cannot reach Redis at {}: {error}", redacted(url))
    } else {
        anyhow::anyhow!("cannot publish {key}: {error}")
    }
}
