//! Where Redis is: one server (`redis://`, `rediss://`, `redis+unix://`), or the primary
//! that Redis Sentinel names (`redis+sentinel://` or, over TLS to the sentinels and the
//! primary, `rediss+sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`),
//! asked again after every failure so a failover is followed. Every listed sentinel is
//! asked at once and the primary is taken only when most of those that answer name it:
//! one stale or lying sentinel cannot send the hosts' passwords elsewhere, and one that
//! never answers costs a lookup only its own timeout. Or a Redis Cluster
//! (`redis+cluster://` / `rediss+cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]`):
//! the nodes listed are where the client first learns the slots; every key's state is in
//! its own slot (its hash tag), and MOVED, ASK and a failover are followed by the client.

use super::redacted;
use redis::IntoConnectionInfo as _;
use std::time::Duration;

/// A cluster node's connection may take this many of a call's waits.
pub const CLUSTER_CONNECT_WAITS: u32 = 4;

/// Sentinel's own port when a URL's host names none.
const SENTINEL_PORT: u16 = 26379;

/// A server, or the sentinels that name the primary of a service.
pub enum Target {
    Server(redis::Client),
    Sentinel(Sentinels),
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// A connection to a server (the primary, behind Sentinel) or to a cluster: either
/// answers a command or a one-slot pipeline.
#[derive(Clone)]
pub enum Connection {
    Server(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Server(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Server(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The sentinels of a service and how to log in to the primary they name.
pub struct Sentinels {
    /// `redis://` or `rediss://` URLs, one per sentinel.
    urls: Vec<String>,
    service: String,
    /// The primary's login and database.
    node: redis::RedisConnectionInfo,
    tls: bool,
}

impl Sentinels {
    /// The primary most of the answering sentinels name (strictly more than half).
    async fn primary(&self, wait: Duration) -> redis::RedisResult<(String, u16)> {
        let asks = self.urls.iter().map(|url| async move {
            let ask = async {
                let client = redis::Client::open(url.as_str())?;
                let mut connection = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.service)
                    .query_async::<Option<(String, u16)>>(&mut connection)
                    .await
            };
            tokio::time::timeout(wait, ask).await.ok()?.ok().flatten()
        });
        // What each said (`None`: no answer, an error, or no such service).
        let answers: Vec<Option<(String, u16)>> = futures_util::future::join_all(asks).await;
        agreed(&answers).ok_or_else(|| {
            let named: Vec<String> = answers
                .iter()
                .flatten()
                .map(|(host, port)| format!("{host}:{port}"))
                .collect();
            redis::RedisError::from((
                redis::ErrorKind::Io,
                "the sentinels named no primary by a majority",
                format!(
                    "{} of {} answered for {}: {named:?}",
                    named.len(),
                    self.urls.len(),
                    self.service
                ),
            ))
        })
    }

    /// A client of the primary at `host:port`, with the login the URL gave.
    fn client_of(&self, host: &str, port: u16) -> redis::RedisResult<redis::Client> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_string()
        };
        let info = format!("{scheme}://{host}:{port}")
            .into_connection_info()?
            .set_redis_settings(self.node.clone());
        redis::Client::open(info)
    }
}

/// The address strictly more than half of the answering sentinels name.
fn agreed(answers: &[Option<(String, u16)>]) -> Option<(String, u16)> {
    let named: Vec<&(String, u16)> = answers.iter().flatten().collect();
    named
        .iter()
        .find(|address| 2 * named.iter().filter(|other| other == address).count() > named.len())
        .map(|address| (*address).clone())
}

impl Target {
    /// The target of `url`, with `password` instead of the URL's; nothing is contacted.
    pub fn new(url: &str, password: Option<&str>) -> anyhow::Result<Self> {
        let bad = |error: &dyn std::fmt::Display| {
            anyhow::anyhow!("bad Redis URL '{}': {error}", redacted(url))
        };
        if let Some(cluster) = cluster_of(url, password) {
            return Ok(Self::Cluster(Box::new(cluster.map_err(|e| bad(&e))?)));
        }
        let (tls, rest) = match scheme_of(url, "sentinel") {
            Some(found) => found,
            None => {
                let mut info = url.into_connection_info().map_err(|e| bad(&e))?;
                if let Some(password) = password {
                    let settings = info.redis_settings().clone().set_password(password);
                    info = info.set_redis_settings(settings);
                }
                return Ok(Self::Server(redis::Client::open(info)?));
            }
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
        let scheme = if tls { "rediss" } else { "redis" };
        let sentinels = hosts
            .split(',')
            .map(|host| match host.rsplit_once(':') {
                Some((_, port)) if !host.ends_with(']') && port.parse::<u16>().is_ok() => {
                    format!("{scheme}://{host}")
                }
                _ => format!("{scheme}://{host}:{SENTINEL_PORT}"),
            })
            .collect::<Vec<_>>();
        if hosts.is_empty()
            || sentinels
                .iter()
                .any(|s| s.ends_with(&format!("//:{SENTINEL_PORT}")))
        {
            return Err(bad(&"no Sentinel host"));
        }
        for sentinel in &sentinels {
            sentinel
                .as_str()
                .into_connection_info()
                .map_err(|e| bad(&e))?;
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
        Ok(Self::Sentinel(Sentinels {
            urls: sentinels,
            service: service.to_string(),
            node: settings,
            tls,
        }))
    }

    /// A connection made as it is first used (for Sentinel: to the primary most of the
    /// sentinels name now, each asked within `wait`), every answer awaited at most
    /// `wait`. The manager of one server makes no retry within a call, the cluster's
    /// client two at most (a redirect, a node connected again): the caller's next round
    /// is the retry.
    pub async fn connect(&self, wait: Duration) -> redis::RedisResult<Connection> {
        let server = |client: redis::Client| {
            let config = redis::aio::ConnectionManagerConfig::new()
                .set_connection_timeout(Some(wait))
                .set_response_timeout(Some(wait))
                .set_number_of_retries(0);
            client
                .get_connection_manager_lazy(config)
                .map(Connection::Server)
        };
        match self {
            Self::Server(client) => server(client.clone()),
            Self::Sentinel(sentinels) => {
                let (host, port) = sentinels.primary(wait).await?;
                server(sentinels.client_of(&host, port)?)
            }
            Self::Cluster(client) => {
                // The client connects to every node in the background (its slots read
                // again after a node fails): a node's connection (TCP, TLS, login) gets
                // longer than a call, which the caller bounds, so it completes on a busy
                // machine (at half an interval a loaded 2-core host timed out every TLS
                // connection and never followed a failover).
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(CLUSTER_CONNECT_WAITS * wait)
                    .set_response_timeout(wait);
                Ok(Connection::Cluster(
                    client.get_pending_async_connection_with_config(config),
                ))
            }
        }
    }
}

/// Whether `url` is `redis+KIND://` (false) or `rediss+KIND://` (true: TLS), and what
/// follows the scheme; `None`: another scheme.
fn scheme_of<'u>(url: &'u str, kind: &str) -> Option<(bool, &'u str)> {
    let rest = url.strip_prefix("redis")?;
    let (tls, rest) = match rest.strip_prefix('s') {
        Some(rest) => (true, rest),
        None => (false, rest),
    };
    Some((
        tls,
        rest.strip_prefix('+')?
            .strip_prefix(kind)?
            .strip_prefix("://")?,
    ))
}

/// The cluster client of a `redis+cluster://` or `rediss+cluster://` URL (`None`: another
/// scheme), with `password` instead of the URL's. Its nodes share the URL's login.
fn cluster_of(
    url: &str,
    password: Option<&str>,
) -> Option<redis::RedisResult<redis::cluster::ClusterClient>> {
    let (tls, rest) = scheme_of(url, "cluster")?;
    let scheme = if tls { "rediss" } else { "redis" };
    let (login, rest) = match rest.rsplit_once('@') {
        Some((login, rest)) => (format!("{login}@"), rest),
        None => (String::new(), rest),
    };
    let (hosts, db) = rest.split_once('/').unwrap_or((rest, ""));
    let made = (|| {
        if !db.is_empty() && db != "0" {
            return Err(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "a cluster has database 0 only",
            )));
        }
        let nodes = hosts
            .split(',')
            .filter(|host| !host.is_empty())
            .map(|host| format!("{scheme}://{login}{host}").into_connection_info())
            .collect::<redis::RedisResult<Vec<_>>>()?;
        let mut builder = redis::cluster::ClusterClient::builder(nodes).retries(2);
        if let Some(password) = password {
            builder = builder.password(password);
        }
        builder.build()
    })();
    Some(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `url` is refused with an error that says `wanted` and never its password.
    fn assert_refused(url: &str, wanted: &str) {
        let error = Target::new(url, None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains(wanted) && !error.contains("secret"),
            "{url}: {error}"
        );
    }

    #[test]
    fn sentinel_urls_name_their_hosts_and_service() {
        for url in [
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/main",
            "redis+sentinel://node-a:pw@s1,s2:5000/main/2",
            "redis+sentinel://node-a@[::1]:26379/main",
            "rediss+sentinel://node-a@s1:26380,s2:26380/main",
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
            assert_refused(url, wanted);
        }
        assert!(matches!(
            Target::new("redis://127.0.0.1:6379/0", Some("pw")),
            Ok(Target::Server(_))
        ));
    }

    #[test]
    fn cluster_urls_name_their_nodes_and_no_database() {
        for url in [
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
            "redis+cluster://node-a:pw@n1:7000,n2:7000,[::1]:7000/",
            "rediss+cluster://node-a@n1:7000/0",
        ] {
            let target = Target::new(url, Some("pw"));
            assert!(matches!(target, Ok(Target::Cluster(_))), "{url}");
        }
        for (url, wanted) in [
            ("redis+cluster://n1:7000/2", "database 0 only"),
            (
                "redis+cluster://node-a:secret@",
                "bad Redis URL 'redis+cluster://node-a:***@",
            ),
            ("redis+cluster://n1:port", "bad Redis URL"),
        ] {
            assert_refused(url, wanted);
        }
    }

    #[test]
    fn the_primary_is_the_one_most_answering_sentinels_name() {
        let at = |port: u16| Some(("10.0.0.1".to_string(), port));
        assert_eq!(agreed(&[at(1), at(1), at(2)]), at(1));
        // A liar listed first is outvoted; silent sentinels do not count.
        assert_eq!(agreed(&[at(9), None, at(1), at(1)]), at(1));
        assert_eq!(agreed(&[None, at(1), None]), at(1));
        // A tie, or nobody: no primary.
        assert_eq!(agreed(&[at(1), at(2)]), None);
        assert_eq!(agreed(&[at(1), at(2), at(3)]), None);
        assert_eq!(agreed(&[None, None]), None);
    }
}
