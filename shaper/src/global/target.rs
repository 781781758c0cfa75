//! Where Redis is: one server (`redis://`, `rediss://`, `redis+unix://`), or the primary
//! that Redis Sentinel names (`redis+sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`),
//! asked again after every failure so a failover is followed.

use super::redacted;
use redis::{
    sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType},
    IntoConnectionInfo as _,
};

/// Sentinel's own port when a URL's host names none.
const SENTINEL_PORT: u16 = 26379;

/// A server, or the Sentinels that name the primary of a service.
pub enum Target {
    Server(redis::Client),
    Sentinel(SentinelClient, Sentinels),
}

/// What a Sentinel client is made of, to make it again with another Sentinel first.
pub struct Sentinels {
    urls: Vec<String>,
    service: String,
    node: redis::RedisConnectionInfo,
}

impl Sentinels {
    fn client(&self) -> redis::RedisResult<SentinelClient> {
        SentinelClient::build(
            self.urls.clone(),
            self.service.as_str(),
            Some(
                SentinelNodeConnectionInfo::default().set_redis_connection_info(self.node.clone()),
            ),
            SentinelServerType::Master,
        )
    }
}

impl Target {
    /// The target of `url`, with `password` instead of the URL's; nothing is contacted.
    pub fn new(url: &str, password: Option<&str>) -> anyhow::Result<Self> {
        let bad = |error: &dyn std::fmt::Display| {
            anyhow::anyhow!("bad Redis URL '{}': {error}", redacted(url))
        };
        let Some(rest) = url.strip_prefix("redis+sentinel://") else {
            let mut info = url.into_connection_info().map_err(|e| bad(&e))?;
            if let Some(password) = password {
                let settings = info.redis_settings().clone().set_password(password);
                info = info.set_redis_settings(settings);
            }
            return Ok(Self::Server(redis::Client::open(info)?));
        };
        let (login, rest) = match rest.rsplit_once('@') {
            Some((login, rest)) => (Some(login), rest),
            None => (None, rest),
        };
        let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (service, db) = path.split_once('/').unwrap_or((path, ""));
        if service.is_empty() {
            return Err(bad(
                &"no service name (redis+sentinel://HOST:PORT,.../SERVICE)",
            ));
        }
        let sentinels = hosts
            .split(',')
            .map(|host| match host.rsplit_once(':') {
                Some((_, port)) if !host.ends_with(']') && port.parse::<u16>().is_ok() => {
                    format!("redis://{host}")
                }
                _ => format!("redis://{host}:{SENTINEL_PORT}"),
            })
            .collect::<Vec<_>>();
        if hosts.is_empty()
            || sentinels
                .iter()
                .any(|s| s.ends_with(&format!("//:{SENTINEL_PORT}")))
        {
            return Err(bad(&"no Sentinel host"));
        }
        // The login and database are the primary's, read by the client's own URL parser
        // (percent-decoding included) from the same URL with one plain host.
        let login = login.map(|login| format!("{login}@")).unwrap_or_default();
        let node = format!("redis://{login}sentinel/{db}")
            .into_connection_info()
            .map_err(|e| bad(&e))?;
        let mut settings = node.redis_settings().clone();
        if let Some(password) = password {
            settings = settings.set_password(password);
        }
        let sentinels = Sentinels {
            urls: sentinels,
            service: service.to_string(),
            node: settings,
        };
        let client = sentinels.client().map_err(|e| bad(&e))?;
        Ok(Self::Sentinel(client, sentinels))
    }

    /// The client of the server to talk to now (for Sentinel: the primary it names now).
    pub async fn client(&mut self) -> redis::RedisResult<redis::Client> {
        match self {
            Self::Server(client) => Ok(client.clone()),
            Self::Sentinel(sentinel, _) => sentinel.async_get_client().await,
        }
    }

    /// After a Sentinel lookup that did not answer in time: the next one starts at the
    /// next Sentinel (the client asks them in their order and waits on the first, so one
    /// that is black-holed would stall every lookup).
    pub fn next_sentinel_first(&mut self) {
        if let Self::Sentinel(client, sentinels) = self {
            sentinels.urls.rotate_left(1);
            if let Ok(rotated) = sentinels.client() {
                *client = rotated;
            }
        }
    }

    /// As [`Target::client`], blocking (for commands run once, as `global publish`).
    pub fn client_blocking(&mut self) -> redis::RedisResult<redis::Client> {
        match self {
            Self::Server(client) => Ok(client.clone()),
            Self::Sentinel(sentinel, _) => sentinel.get_client(),
        }
    }

    pub fn is_sentinel(&self) -> bool {
        matches!(self, Self::Sentinel(..))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_their_hosts_and_service() {
        for url in [
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/main",
            "redis+sentinel://node-a:pw@s1,s2:5000/main/2",
            "redis+sentinel://node-a@[::1]:26379/main",
        ] {
            assert!(
                matches!(Target::new(url, None), Ok(Target::Sentinel(..))),
                "{url}"
            );
        }
        for (url, wanted) in [
            ("redis+sentinel://s1:26379", "no service name"),
            ("redis+sentinel://s1:26379/", "no service name"),
            ("redis+sentinel:///main", "no Sentinel host"),
            (
                "redis+sentinel://node-a:secret@s1/main/x",
                "bad Redis URL 'redis+sentinel://node-a:***@",
            ),
        ] {
            let error = Target::new(url, None)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                error.contains(wanted) && !error.contains("secret"),
                "{url}: {error}"
            );
        }
        assert!(matches!(
            Target::new("redis://127.0.0.1:6379/0", Some("pw")),
            Ok(Target::Server(_))
        ));
    }
}
