//! The Redis side of global classes: a host's report and the fill (`fill.lua`).
//!
//! A host writes its own report key and nothing shared (an announcement aside), and
//! reads its share from the last fill; the fill runs with rights no host needs, by an
//! allocator (a daemon whose Redis user may run it, or `shaper global allocate`).

use super::answer::{answer_of, held_by_another, redis_time_ms};
use super::{
    target::{Connection, Target},
    *,
};

/// Whether this daemon runs the fill too (`[coordination] allocate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocate {
    /// When its Redis user may (a host's user of docs/GUIDE.md's ACL may not: then
    /// another allocator must run).
    Auto,
    Always,
    Never,
}

impl Allocate {
    /// `auto`, `always` or `never`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "auto" => Some(Self::Auto),
            "always" => Some(Self::Always),
            "never" => Some(Self::Never),
            _ => None,
        }
    }
}

/// The Redis side: one lazily made connection (the manager of one server reconnects by
/// itself after an I/O error; a cluster's client follows MOVED and a failover) and the
/// fill script (EVALSHA; reloaded after NOSCRIPT, as after a Redis restart). Behind
/// Sentinel and in a cluster the connection is made afresh (Sentinel asked again, the
/// slots read again) after a tick with a class unanswered.
pub struct Coordinator {
    target: Target,
    connection: Option<Connection>,
    /// When the connection was made: a cluster's is made afresh at most every
    /// `RENEW_INTERVALS` (each time costs every node's handshake).
    made_at: Option<std::time::Instant>,
    fill: redis::Script,
    host_id: String,
    /// This daemon among those reporting for the host id (`instance::for_host`).
    instance: String,
    interval: Duration,
    allocate: Allocate,
    /// The fill was refused this user (NOPERM) under `Allocate::Auto`: not tried again
    /// until the client is made afresh.
    fill_refused: bool,
}

/// What one fill did (`fill.lua`'s answer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Filled {
    pub filled: bool,
    pub hosts: u64,
    /// Announcements and reports it could not read.
    pub dropped: u64,
    pub version: u64,
}

/// The limits an allocator fills one key with when none are published: its own file's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FillArgs {
    pub key: String,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
}

impl Coordinator {
    /// Never waits for Redis: the connection is made at the first report. `password`
    /// (from a `password_file`) is used instead of one in the URL.
    pub fn new(
        url: &str,
        password: Option<&str>,
        host_id: &str,
        interval: Duration,
        allocate: Allocate,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            target: Target::new(url, password)?,
            connection: None,
            made_at: None,
            fill: redis::Script::new(FILL),
            host_id: host_id.to_string(),
            instance: super::instance::for_host(host_id),
            interval,
            allocate,
            fill_refused: false,
        })
    }

    /// The connection to report on: the one kept, or a new one. A report must answer
    /// within half an interval or count as lost (for Sentinel, asking each sentinel is
    /// bounded alike); the daemon's next tick is the retry, so a pending backoff never
    /// holds the tick that finds Redis back.
    async fn connection(&mut self) -> redis::RedisResult<Connection> {
        if let Some(connection) = &self.connection {
            return Ok(connection.clone());
        }
        let connection = self.target.connect(self.interval / 2).await?;
        self.connection = Some(connection.clone());
        self.made_at = Some(std::time::Instant::now());
        Ok(connection)
    }

    /// Reports this host's demand for every class at once and returns each share (in
    /// `reports`' order). Calls that find the connection gone (Redis restarted, say) are
    /// made once more at once on the connection the manager has just started (behind
    /// Sentinel or in a cluster: made afresh), so the tick that finds Redis back is
    /// answered. A refused login (Redis back before its ACL users) is never retried by
    /// the manager: the connection is made afresh for the next tick, as it is behind
    /// Sentinel or in a cluster after a tick with a class unanswered (a primary gone, or
    /// one demoted to a replica, which refuses writes).
    pub async fn report_all(&mut self, reports: &[Report]) -> Vec<redis::RedisResult<Reply>> {
        // The tick's calls, the retry included, end within the interval: a tick that ran
        // on (two intervals, in a cluster black-holed) reported half as often.
        let deadline = tokio::time::Instant::now() + self.interval;
        let mut answers = self.call_all(reports, deadline).await;
        if tokio::time::Instant::now() < deadline
            && answers
                .iter()
                .any(|answer| matches!(answer, Err(error) if error.is_connection_dropped()))
        {
            if self.renewable() {
                self.connection = None;
            }
            answers = self.call_all(reports, deadline).await;
        }
        let refused = |answer: &redis::RedisResult<Reply>| matches!(answer, Err(error) if error.kind() == redis::ErrorKind::AuthenticationFailed);
        // The primary gone (no answer, refused, reset) or demoted (READONLY), or the
        // cluster's slots still being moved: ask again. Other errors (a bad published
        // limit, say) are the server's own answer.
        let lost = |answer: &redis::RedisResult<Reply>| {
            matches!(answer, Err(error) if error.is_io_error()
                || error.is_timeout()
                || error.is_connection_refusal()
                || error.is_connection_dropped()
                || error.to_string().contains("READONLY")
                || error.to_string().contains("CLUSTERDOWN"))
        };
        // Behind Sentinel, a tick without any answer; in a cluster, a class unanswered
        // (its primary gone: the client keeps calling the address it knew).
        let unanswered = match &self.target {
            Target::Cluster(_) => answers.iter().any(lost),
            _ => !answers.is_empty() && answers.iter().all(lost),
        };
        if answers.iter().any(refused) || (unanswered && self.renewable()) {
            self.connection = None;
            self.fill_refused = false;
        }
        answers
    }

    /// Whether the connection may be made afresh to follow a moved primary: behind
    /// Sentinel at once; in a cluster once it is `RENEW_INTERVALS` old (a cluster's
    /// client connects to every node, over TLS a handshake each: made every tick, it
    /// spent each tick connecting and never answered).
    fn renewable(&self) -> bool {
        match &self.target {
            Target::Server(_) => false,
            Target::Sentinel(_) => true,
            Target::Cluster(_) => self
                .made_at
                .is_none_or(|at| at.elapsed() >= RENEW_INTERVALS * self.interval),
        }
    }

    /// One tick's calls, every class at once (in a cluster each class's keys are in one
    /// slot: its calls go to that slot's primary), each ended at `deadline`.
    async fn call_all(
        &mut self,
        reports: &[Report],
        deadline: tokio::time::Instant,
    ) -> Vec<redis::RedisResult<Reply>> {
        let connection = match self.connection().await {
            Ok(connection) => connection,
            Err(error) => return reports.iter().map(|_| Err(error.clone())).collect(),
        };
        let allocating = self.allocate != Allocate::Never && !self.fill_refused;
        let this = &*self;
        let calls = reports.iter().map(|report| {
            let mut connection = connection.clone();
            async move {
                let exchange = this.exchange(&mut connection, report, allocating);
                tokio::time::timeout_at(deadline, exchange)
                    .await
                    .unwrap_or_else(|_| {
                        let late = (redis::ErrorKind::Io, "no answer within the interval");
                        (Err(late.into()), None)
                    })
            }
        });
        let outcomes = futures_util::future::join_all(calls).await;
        let mut answers = Vec::with_capacity(outcomes.len());
        for (report, (answer, filled)) in reports.iter().zip(outcomes) {
            match filled {
                Some(Err(error)) if self.allocate == Allocate::Auto && is_refused(&error) => {
                    // Said once a process: a client made afresh asks again, quietly.
                    static SAID: std::sync::atomic::AtomicBool =
                        std::sync::atomic::AtomicBool::new(false);
                    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        log::info!(
                            "coordination: this host's Redis user may not run the fill ({error}); another allocator must (shaper global allocate, or a daemon whose user may)"
                        );
                    }
                    self.fill_refused = true;
                }
                Some(Err(error)) => {
                    log::warn!("global '{}': the fill failed: {error}", report.key)
                }
                _ => {}
            }
            answers.push(answer);
        }
        answers
    }

    /// One class's calls: (1) whose report Redis holds for this host id, and whether
    /// the last fill knows the host; (2) this host's report written (and announced where
    /// the last fill did not know it), none where another daemon holds the host id; (3)
    /// the fill, when this daemon allocates; (4) Redis's time and the last fill read.
    async fn exchange(
        &self,
        connection: &mut Connection,
        report: &Report,
        allocating: bool,
    ) -> (
        redis::RedisResult<Reply>,
        Option<redis::RedisResult<Filled>>,
    ) {
        let keys = Keys::of(&report.key, &self.host_id);
        let looked: redis::RedisResult<(Option<String>, bool)> = redis::pipe()
            .cmd("GET")
            .arg(&keys.report)
            .cmd("HEXISTS")
            .arg(&keys.shares)
            .arg(&self.host_id)
            .query_async(connection)
            .await;
        let (held, known) = match looked {
            Ok(looked) => looked,
            Err(error) => return (Err(error), None),
        };
        let taken = held_by_another(held.as_deref(), &self.instance);
        if !taken {
            if let Err(error) = self.write(connection, report, &keys, known).await {
                return (Err(error), None);
            }
        }
        let filled = if allocating {
            let args = FillArgs {
                key: report.key.clone(),
                limit_bits_per_sec: report.limit_bits_per_sec,
                floor_bits_per_sec: report.floor_bits_per_sec,
            };
            Some(fill(&self.fill, connection, &args, self.interval).await)
        } else {
            None
        };
        if taken {
            return (Ok(Reply::HostIdTaken), filled);
        }
        let read: redis::RedisResult<(redis::Value, Vec<Option<String>>)> = redis::pipe()
            .cmd("TIME")
            .cmd("HMGET")
            .arg(&keys.shares)
            .arg(&self.host_id)
            .arg(&FILL_FIELDS)
            .query_async(connection)
            .await;
        let dropped = filled
            .as_ref()
            .and_then(|f| f.as_ref().ok())
            .map_or(0, |f| f.dropped);
        let answer = read.and_then(|(time, fields)| {
            answer_of(
                &fields,
                redis_time_ms(&time),
                report,
                self.interval,
                dropped,
            )
            .map(Reply::Share)
        });
        (answer, filled)
    }

    /// This host's report, in its own key for three intervals, and its name announced
    /// where the last fill does not know it.
    async fn write(
        &self,
        connection: &mut Connection,
        report: &Report,
        keys: &Keys,
        known: bool,
    ) -> redis::RedisResult<()> {
        let ttl_ms = REPORT_INTERVALS as u64 * self.interval.as_millis() as u64;
        let value = format!("{} {} {}", report.demand, report.applied, self.instance);
        let mut writes = redis::pipe();
        writes
            .cmd("SET")
            .arg(&keys.report)
            .arg(value)
            .arg("PX")
            .arg(ttl_ms)
            .ignore();
        if !known {
            writes
                .cmd("SADD")
                .arg(&keys.announce)
                .arg(&self.host_id)
                .ignore();
        }
        writes.query_async(connection).await
    }
}

/// What a host reads of the last fill beside its own share (`fill.lua`'s fields), in
/// the order `answer_of` reads them.
pub const FILL_FIELDS: [&str; 6] = [
    ".hosts",
    ".epoch",
    ".filled",
    ".limit",
    ".version",
    ".interval",
];

/// Intervals a cluster's connection lives at least before it is made afresh: more than
/// its nodes' connections may take (`target::CLUSTER_CONNECT_WAITS` half intervals).
const RENEW_INTERVALS: u32 = 3;

/// Runs the fill of one key (`fill.lua`) with the allocator's own limits for it.
pub async fn fill(
    script: &redis::Script,
    connection: &mut Connection,
    args: &FillArgs,
    interval: Duration,
) -> redis::RedisResult<Filled> {
    let [shares, announce, _] = redis_keys(&args.key);
    let reply: Vec<u64> = script
        .key(shares)
        .key(announce)
        .arg(args.limit_bits_per_sec)
        .arg(args.floor_bits_per_sec)
        .arg(interval.as_millis() as u64)
        .arg(HEADROOM_PPM)
        .invoke_async(connection)
        .await?;
    let &[filled, hosts, dropped, version] = reply.as_slice() else {
        return Err((
            redis::ErrorKind::UnexpectedReturnType,
            "the fill answered with another number of values",
        )
            .into());
    };
    Ok(Filled {
        filled: filled != 0,
        hosts,
        dropped,
        version,
    })
}

/// Whether Redis refused a command to this user (its ACL).
pub fn is_refused(error: &redis::RedisError) -> bool {
    let text = error.to_string();
    text.to_ascii_uppercase().contains("NOPERM") || text.contains("can't run this command")
}

/// Redis's answer to one report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Share(Answer),
    /// Another daemon holds this host id (its report has not expired): this one writes
    /// none while it does.
    HostIdTaken,
}

/// One class's report: its key, this host's demand, and what the fill needs from its
/// tracker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub key: String,
    pub demand: u64,
    /// The share this host applies now.
    pub applied: u64,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
}
