//! The Redis side of global classes.

use super::{target::Target, *};

/// The Redis side: one lazily connected manager (it reconnects by itself after an I/O
/// error) and the allocation script (EVALSHA; reloaded after NOSCRIPT, as after a Redis
/// restart). Behind Sentinel the manager is made for the primary Sentinel names, and
/// made afresh (Sentinel asked again) after a tick without any answer.
pub struct Coordinator {
    target: Target,
    config: redis::aio::ConnectionManagerConfig,
    connection: Option<redis::aio::ConnectionManager>,
    script: redis::Script,
    host_id: String,
    /// This daemon among those reporting for the host id (`instance::for_host`).
    instance: String,
    interval: Duration,
}

impl Coordinator {
    /// Never waits for Redis: the connection is made at the first report. `password`
    /// (from a `password_file`) is used instead of one in the URL.
    pub fn new(
        url: &str,
        password: Option<&str>,
        host_id: &str,
        interval: Duration,
    ) -> anyhow::Result<Self> {
        // A report must answer within the interval or count as lost. The manager makes one
        // attempt per reconnect: the daemon's next tick is the retry, and a pending backoff
        // would hold the tick that finds Redis back.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(interval / 2))
            .set_response_timeout(Some(interval / 2))
            .set_number_of_retries(0);
        Ok(Self {
            target: Target::new(url, password)?,
            config,
            connection: None,
            script: redis::Script::new(ALLOCATE),
            host_id: host_id.to_string(),
            instance: super::instance::for_host(host_id),
            interval,
        })
    }

    /// The connection to report on: the one kept, or a new one (for Sentinel, to the
    /// primary most sentinels name now; asking each is bounded by half an interval, as a
    /// report is).
    async fn connection(&mut self) -> redis::RedisResult<redis::aio::ConnectionManager> {
        if let Some(connection) = &self.connection {
            return Ok(connection.clone());
        }
        let client = self.target.client(self.interval / 2).await?;
        let connection = client.get_connection_manager_lazy(self.config.clone())?;
        self.connection = Some(connection.clone());
        Ok(connection)
    }

    /// Reports this host's demand for every class at once and returns each share (in
    /// `reports`' order). The calls share the multiplexed connection, so a slow or silent
    /// Redis costs a tick one response timeout, not one per class. Calls that find the
    /// connection gone (Redis restarted, say) are made once more at once on the
    /// connection the manager has just started (behind Sentinel: on the primary it names
    /// now), so the tick that finds Redis back is answered. A refused login (Redis back
    /// before its ACL users) is never retried by the manager: the connection is made
    /// afresh for the next tick, as it is behind Sentinel after a tick with no answer (a
    /// primary that is gone, or one demoted to a replica, which refuses writes).
    pub async fn report_all(&mut self, reports: &[Report]) -> Vec<redis::RedisResult<Reply>> {
        let all: Vec<&Report> = reports.iter().collect();
        let mut answers = self.call_all(&all).await;
        let dropped: Vec<usize> = (0..answers.len())
            .filter(|&i| matches!(&answers[i], Err(error) if error.is_connection_dropped()))
            .collect();
        if !dropped.is_empty() {
            if self.target.is_sentinel() {
                self.connection = None;
            }
            let again: Vec<&Report> = dropped.iter().map(|&i| &reports[i]).collect();
            for (i, answer) in dropped.into_iter().zip(self.call_all(&again).await) {
                answers[i] = answer;
            }
        }
        let refused = |answer: &redis::RedisResult<Reply>| matches!(answer, Err(error) if error.kind() == redis::ErrorKind::AuthenticationFailed);
        // The primary gone (no answer, refused, reset) or demoted (READONLY): behind
        // Sentinel, ask for the primary again. Other errors (a bad published limit, say)
        // are the server's own answer.
        let lost = |answer: &redis::RedisResult<Reply>| {
            matches!(answer, Err(error) if error.is_io_error()
                || error.is_timeout()
                || error.is_connection_refusal()
                || error.is_connection_dropped()
                || error.to_string().contains("READONLY"))
        };
        let unanswered = !answers.is_empty() && answers.iter().all(lost);
        if answers.iter().any(refused) || (unanswered && self.target.is_sentinel()) {
            self.connection = None;
        }
        answers
    }

    async fn call_all(&mut self, reports: &[&Report]) -> Vec<redis::RedisResult<Reply>> {
        let connection = match self.connection().await {
            Ok(connection) => connection,
            Err(error) => return reports.iter().map(|_| Err(error.clone())).collect(),
        };
        let calls = reports.iter().map(|report| {
            let mut connection = connection.clone();
            let [hosts_key, shares_key, _] = redis_keys(&report.key);
            let mut invocation = self.script.key(hosts_key);
            invocation
                .key(shares_key)
                .arg(&self.host_id)
                .arg(report.demand)
                .arg(report.applied)
                .arg(report.limit_bits_per_sec)
                .arg(report.floor_bits_per_sec)
                .arg(self.interval.as_millis() as u64)
                .arg(HEADROOM_PPM)
                .arg(&self.instance);
            async move {
                let reply: Vec<u64> = invocation.invoke_async(&mut connection).await?;
                let &[share, hosts, epoch, taken, limit, version, dropped, interval_ms] =
                    reply.as_slice()
                else {
                    return Err((
                        redis::ErrorKind::UnexpectedReturnType,
                        "the allocation script answered with another number of values",
                    )
                        .into());
                };
                Ok(if taken != 0 {
                    Reply::HostIdTaken
                } else {
                    Reply::Share(Answer {
                        share_bits_per_sec: share,
                        hosts: hosts as u32,
                        epoch_ms: epoch,
                        limits: Limits {
                            limit_bits_per_sec: limit,
                            version,
                            interval_ms,
                        },
                        dropped_fields: dropped as u32,
                    })
                })
            }
        });
        futures_util::future::join_all(calls).await
    }
}

/// Redis's answer to one report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Share(Answer),
    /// Another daemon holds this host id (it reported within 3 intervals): this one's
    /// report was refused.
    HostIdTaken,
}

/// One class's report: its key, this host's demand, and what the allocator needs from
/// its tracker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub key: String,
    pub demand: u64,
    /// The share this host applies now.
    pub applied: u64,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
}
