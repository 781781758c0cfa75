//! The Redis side of global classes.

use super::*;

/// The Redis side: one lazily connected manager (it reconnects by itself after an I/O
/// error) and the allocation script (EVALSHA; reloaded after NOSCRIPT, as after a Redis
/// restart).
pub struct Coordinator {
    client: redis::Client,
    config: redis::aio::ConnectionManagerConfig,
    connection: redis::aio::ConnectionManager,
    script: redis::Script,
    host_id: String,
    interval: Duration,
}

impl Coordinator {
    /// Never waits for Redis: the connection is made at the first report.
    pub fn new(url: &str, host_id: &str, interval: Duration) -> anyhow::Result<Self> {
        let client = redis::Client::open(url)?;
        // A report must answer within the interval or count as lost. The manager makes one
        // attempt per reconnect: the daemon's next tick is the retry, and a pending backoff
        // would hold the tick that finds Redis back.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(interval / 2))
            .set_response_timeout(Some(interval / 2))
            .set_number_of_retries(0);
        Ok(Self {
            connection: client.get_connection_manager_lazy(config.clone())?,
            client,
            config,
            script: redis::Script::new(ALLOCATE),
            host_id: host_id.to_string(),
            interval,
        })
    }

    /// Reports this host's demand for `key` and returns its share. A call that finds the
    /// connection gone (Redis restarted, say) is made once more at once on the connection
    /// the manager has just started, so the tick that finds Redis back is answered. A
    /// refused login (Redis back before its ACL users) is never retried by the manager:
    /// the connection is made afresh for the next tick.
    pub async fn report(
        &mut self,
        key: &str,
        demand: u64,
        tracker: &Tracker,
    ) -> redis::RedisResult<Answer> {
        match self.call(key, demand, tracker).await {
            Err(error) if error.is_connection_dropped() => self.call(key, demand, tracker).await,
            Err(error) if error.kind() == redis::ErrorKind::AuthenticationFailed => {
                self.connection = self
                    .client
                    .get_connection_manager_lazy(self.config.clone())?;
                Err(error)
            }
            reply => reply,
        }
    }

    async fn call(
        &mut self,
        key: &str,
        demand: u64,
        tracker: &Tracker,
    ) -> redis::RedisResult<Answer> {
        let [hosts_key, shares_key] = redis_keys(key);
        let (share, hosts, epoch): (u64, u32, u64) = self
            .script
            .key(hosts_key)
            .key(shares_key)
            .arg(&self.host_id)
            .arg(demand)
            .arg(tracker.applied)
            .arg(tracker.limit_bits_per_sec)
            .arg(tracker.floor_bits_per_sec)
            .arg(self.interval.as_millis() as u64)
            .arg(HEADROOM_PPM)
            .invoke_async(&mut self.connection)
            .await?;
        Ok(Answer {
            share_bits_per_sec: share,
            hosts,
            epoch_ms: epoch,
        })
    }
}
