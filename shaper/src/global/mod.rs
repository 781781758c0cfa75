//! Global classes: one limit across hosts. Each host keeps enforcing locally in eBPF at
//! its share of the limit; every interval its daemon reports the class's demand to Redis
//! and reads back its share from a max-min fill of the limit over the hosts that reported
//! lately (`allocate.lua`, one EVALSHA per class, host and interval). Redis is never on
//! the packet path: when it cannot be reached the share follows the class's
//! `on_coordinator_loss`, and when the daemon stops renewing it the packet path itself
//! falls to the floor at the share's expiry.
//!
//! [`Tracker`] is the per-class decision (pure, tested on the host); [`Coordinator`] the
//! Redis side.

use crate::{
    classes::{self, OnLoss, ShareUpdate},
    state::{self, Attachment, Location},
};
use std::time::Duration;

/// How often hosts report and re-read their shares unless `[coordination] interval` says.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
/// Parts per million of the limit the fill leaves free: shares that move between two
/// reports never add up above the limit.
pub const HEADROOM_PPM: u64 = 20_000;
/// Intervals a `static` host keeps its last share without Redis, before it falls to the
/// limit over the last host count.
pub const STATIC_HOLD_INTERVALS: u32 = 3;
/// A share written into the packet path lasts this many intervals unless renewed: a host
/// whose daemon died falls to its floor when the others (which forget a host silent for
/// three intervals, then rise an interval later) may already take its share.
pub const EXPIRY_INTERVALS: u32 = 3;

/// A host's reported demand falls to no less than 1/`DEMAND_FALL` per interval.
pub const DEMAND_FALL: u64 = 3;
/// After a host squeezed below a quarter of an equal part asked for more and was given it,
/// it keeps asking for at least that much this long: a TCP sender that met the floor may
/// sit in retransmission backoff (0.2 + 0.4 + 0.8 + 1.6 s) before it sends again; judged
/// idle meanwhile, it would lose the share before it could use it and stay at the floor.
pub const RAMP_GRACE: Duration = Duration::from_secs(3);

/// The allocation script (see its header).
pub const ALLOCATE: &str = include_str!("allocate.lua");

/// The Redis keys of global key `key`: its hosts' demands and its last fill's shares,
/// two hashes hash-tagged so a Redis Cluster keeps a class's state in one slot.
pub fn redis_keys(key: &str) -> [String; 2] {
    [
        format!("shaper:{{{key}}}"),
        format!("shaper:{{{key}}}:shares"),
    ]
}

/// Whether the Redis client accepts `url` (`redis://`, `rediss://`, `redis+unix://`).
pub fn check_url(url: &str) -> Result<(), String> {
    redis::Client::open(url)
        .map(|_| ())
        .map_err(|error| format!("bad Redis URL '{url}': {error}"))
}

/// A class's counters at one moment (bytes since the class was added).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub passed_bytes: u64,
    pub dropped_bytes: u64,
    pub marked_bytes: u64,
    /// A shape class's queue stands (its virtual queue above CoDel's target, or CoDel
    /// dropping) at this moment: it holds back traffic that would go now.
    pub backlogged: bool,
}

/// What this host asks for, from the class's counters over the last interval. A host
/// that was held back (its shape queue stands, it dropped or marked more than 1 % of
/// what it offered, or it sent 95 % of its share) could use more: it asks for what it was offered, at least a quarter
/// above its share and at least `fair_bits_per_sec` (the limit over the hosts last
/// counted), so a host squeezed to a small share by elastic traffic elsewhere gets an
/// equal part back at once instead of growing a quarter per interval. Any other host asks
/// for what it sent and a tenth more (so a steady sender below its share is never held
/// back by its own demand).
pub fn demand(
    before: &Usage,
    after: &Usage,
    elapsed: Duration,
    share_bits_per_sec: u64,
    fair_bits_per_sec: u64,
) -> u64 {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    let rate = |bytes: u64| bytes as f64 * 8.0 / seconds;
    let passed = after.passed_bytes.saturating_sub(before.passed_bytes);
    let dropped = after.dropped_bytes.saturating_sub(before.dropped_bytes);
    let marked = after.marked_bytes.saturating_sub(before.marked_bytes);
    let offered = passed + dropped;
    let share = share_bits_per_sec as f64;
    let held_back = after.backlogged
        || (dropped + marked) * 100 > offered
        || rate(passed) >= 0.95 * share && share > 0.0;
    let wanted = if held_back {
        rate(offered)
            .max(1.25 * share)
            .max(fair_bits_per_sec as f64)
    } else {
        1.1 * rate(passed)
    };
    wanted as u64
}

/// Redis's answer for one class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub share_bits_per_sec: u64,
    pub hosts: u32,
    /// When the class's state in Redis began (ms): a new one means Redis lost it.
    pub epoch_ms: u64,
}

/// One global class's share on this host, from one tick to the next.
#[derive(Clone, Debug)]
pub struct Tracker {
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
    pub on_loss: OnLoss,
    /// The share in force on this host.
    pub applied: u64,
    /// The last answer's share: a higher share is applied only when two answers in a row
    /// allow it, so a host never rises before the others have lowered.
    last_answer: Option<u64>,
    /// Hosts at the last answer.
    pub hosts: u32,
    /// Ticks in a row without an answer.
    pub missed: u32,
    /// The demand last reported (see [`Tracker::report_demand`]).
    pub demand: u64,
    pub epoch_ms: Option<u64>,
    /// [`RAMP_GRACE`] in ticks.
    ramp_ticks: u32,
    /// Ticks left in which the reported demand stays at least `ramp_share`.
    ramp_left: u32,
    ramp_share: u64,
}

/// What a tick changed, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Steady,
    /// Redis answered with a state younger than the one this host knew.
    Relearning,
    /// The first tick without Redis.
    Lost,
    /// The first answer after a loss.
    Back,
}

impl Tracker {
    pub fn new(limit: u64, floor: u64, on_loss: OnLoss, applied: u64, interval: Duration) -> Self {
        let interval_ms = interval.as_millis().max(1);
        Self {
            limit_bits_per_sec: limit,
            floor_bits_per_sec: floor,
            on_loss,
            applied: applied.clamp(floor, limit),
            last_answer: None,
            hosts: 0,
            missed: 0,
            demand: 0,
            epoch_ms: None,
            // At least two ticks: a rise is applied an answer after it is allowed.
            ramp_ticks: RAMP_GRACE.as_millis().div_ceil(interval_ms).max(2) as u32,
            ramp_left: 0,
            ramp_share: 0,
        }
    }

    /// The demand to report from this interval's `measured` one: it rises at once but
    /// falls to no less than a third per interval. An elastic sender (TCP) needs a few
    /// round trips to grow into a share it was just given; judged by one interval it
    /// would look idle, lose the share, collapse and ask again, never settling. A host
    /// that stopped still gives its share up within a few intervals (10 Mbit/s to under
    /// 0.4 in three). A share it asked for and was just given is kept asked for during
    /// [`RAMP_GRACE`].
    pub fn report_demand(&mut self, measured: u64) -> u64 {
        let mut demand = measured.max(self.demand / DEMAND_FALL);
        if self.ramp_left > 0 {
            self.ramp_left -= 1;
            demand = demand.max(self.ramp_share);
        }
        self.demand = demand;
        self.demand
    }

    /// An equal part of the limit among the hosts last counted (the whole limit before
    /// any answer).
    pub fn fair_share(&self) -> u64 {
        self.limit_bits_per_sec / u64::from(self.hosts.max(1))
    }

    /// Redis answered: lower at once, rise an answer later.
    pub fn answered(&mut self, answer: Answer) -> Event {
        let share = answer
            .share_bits_per_sec
            .clamp(self.floor_bits_per_sec, self.limit_bits_per_sec);
        let event = if self.missed > 0 {
            Event::Back
        } else if self.epoch_ms.is_some_and(|known| known != answer.epoch_ms) {
            Event::Relearning
        } else {
            Event::Steady
        };
        let allowed = self.last_answer.unwrap_or(self.applied);
        let before = self.applied;
        self.applied = share.min(allowed);
        // Only a host climbing out of a squeeze: one near its part asks and rises often
        // and must still give its share up at once when it stops.
        if self.applied > before && self.demand > before && before < self.fair_share() / 4 {
            self.ramp_left = self.ramp_ticks;
            self.ramp_share = self.applied.min(self.demand);
        }
        self.last_answer = Some(share);
        self.hosts = answer.hosts;
        self.missed = 0;
        self.epoch_ms = Some(answer.epoch_ms);
        event
    }

    /// No answer this tick: `static` holds the share, then takes the limit (less the
    /// headroom) over the last host count; `open` the limit; `closed` the floor.
    pub fn lost(&mut self) -> Event {
        self.missed += 1;
        self.last_answer = None;
        self.applied = match self.on_loss {
            // A host that never had an answer knows no host count: it keeps its floor.
            OnLoss::Static if self.missed <= STATIC_HOLD_INTERVALS || self.hosts == 0 => {
                self.applied
            }
            OnLoss::Static => {
                let budget =
                    self.limit_bits_per_sec - self.limit_bits_per_sec * HEADROOM_PPM / 1_000_000;
                (budget / self.hosts.max(1) as u64).max(self.floor_bits_per_sec)
            }
            OnLoss::Open => self.limit_bits_per_sec,
            OnLoss::Closed => self.floor_bits_per_sec,
        };
        if self.missed == 1 {
            Event::Lost
        } else {
            Event::Steady
        }
    }
}

/// A global class as this host runs it: where, which, and its counters now.
#[derive(Clone, Debug)]
pub struct HostClass {
    pub location: Location,
    pub name: String,
    pub key: String,
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
    pub on_loss: OnLoss,
    /// The share in force (the class's rate on this host).
    pub share_bits_per_sec: u64,
    pub usage: Usage,
}

/// Every global class `desired` names that is in place now, with its share and counters
/// (hash lookups only: no scan of the class table, which a debug build takes tens of
/// milliseconds over). Classes not applied yet are left out.
pub fn host_classes(desired: &crate::config::Desired) -> anyhow::Result<Vec<HostClass>> {
    let mut found = Vec::new();
    for interface in &desired.interfaces {
        for (direction, spec) in &interface.classes {
            let Some(global) = &spec.global else {
                continue;
            };
            let location = Location {
                netns: interface.netns.clone(),
                dev: interface.dev.clone(),
                direction: *direction,
            };
            if !location.dir().exists() {
                continue;
            }
            let Ok(attachment) = Attachment::open(&location) else {
                continue;
            };
            let Some((id, _)) = attachment.find_class(&spec.name)? else {
                continue;
            };
            let share = classes::share_of(&attachment, id)?;
            if share.limit_bits_per_sec == 0 {
                // Not (yet) a global class in the kernel.
                continue;
            }
            let stats = attachment.class_stats(id)?;
            let config = attachment.classes()?.get(&id, 0)?;
            let backlogged = config.action == shaper_common::Action::Shape as u8 && {
                let (delay_ns, dropping) = attachment.shape_queue(id)?;
                dropping || delay_ns > config.codel.target_ns
            };
            found.push(HostClass {
                location,
                name: spec.name.clone(),
                key: global.key.clone(),
                limit_bits_per_sec: share.limit_bits_per_sec,
                floor_bits_per_sec: share.floor_bits_per_sec,
                on_loss: global.on_loss,
                share_bits_per_sec: share.share_bits_per_sec,
                usage: Usage {
                    passed_bytes: stats.passed_bytes,
                    dropped_bytes: stats.dropped_bytes,
                    marked_bytes: stats.marked_bytes,
                    backlogged,
                },
            });
        }
    }
    Ok(found)
}

/// A share for `class` as the packet path takes it: the expiry armed `EXPIRY_INTERVALS`
/// intervals from now.
pub fn update_for(
    share_bits_per_sec: u64,
    hosts: u32,
    answered_unix_ms: u64,
    interval: Duration,
) -> ShareUpdate {
    ShareUpdate {
        share_bits_per_sec,
        hosts,
        answered_unix_ms,
        expires_ns: state::monotonic_ns() + (interval * EXPIRY_INTERVALS).as_nanos() as u64,
    }
}

/// Renews `class`'s share when it stays as it is (no lock needed); `false` when it must
/// be installed with [`install`].
pub fn renew(class: &HostClass, update: ShareUpdate) -> anyhow::Result<bool> {
    let attachment = Attachment::open(&class.location)?;
    classes::renew_share(&attachment, &class.name, update)
}

/// Installs a new share on `class`, inside its namespace (a shape class's HTB class
/// follows). Needs the state lock. Whether the rate changed.
pub fn install(class: &HostClass, update: ShareUpdate) -> anyhow::Result<bool> {
    crate::netns::in_namespace(&class.location.netns, || {
        let attachment = Attachment::open(&class.location)?;
        classes::set_share(&attachment, &class.name, update)
    })
}

/// A global class's share as `stats`, `class list` and metrics show it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShareView {
    pub limit_bits_per_sec: u64,
    /// The share in force: the floor once the packet path installed it.
    pub share_bits_per_sec: u64,
    pub hosts: u32,
    /// Seconds since Redis last answered (`None`: never).
    pub age_seconds: Option<f64>,
    /// The daemon stopped renewing the share and the packet path fell to the floor.
    pub expired: bool,
}

impl ShareView {
    pub fn of(share: &shaper_common::GlobalShare) -> Self {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let expired = if share.expires_ns == 0 {
            share.answered_unix_ms != 0
        } else {
            state::monotonic_ns() > share.expires_ns
        };
        Self {
            limit_bits_per_sec: share.limit_bits_per_sec,
            share_bits_per_sec: if expired {
                share.floor_bits_per_sec
            } else {
                share.share_bits_per_sec
            },
            hosts: share.hosts,
            age_seconds: (share.answered_unix_ms != 0)
                .then(|| now_ms.saturating_sub(share.answered_unix_ms) as f64 / 1000.0),
            expired,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    const MBIT: u64 = 1_000_000;

    fn usage(passed: u64, dropped: u64) -> Usage {
        Usage {
            passed_bytes: passed,
            dropped_bytes: dropped,
            marked_bytes: 0,
            backlogged: false,
        }
    }

    /// Redis's answer: `share` among 3 hosts, in a state begun at 7 ms.
    fn answer(share: u64) -> Answer {
        Answer {
            share_bits_per_sec: share,
            hosts: 3,
            epoch_ms: 7,
        }
    }

    #[test]
    fn a_held_back_host_asks_for_what_it_was_offered() {
        let fair = 10 * MBIT;
        // One second from zero counters: `passed` and `dropped` in bit/s.
        let ask = |passed: u64, dropped: u64, share: u64| {
            let after = usage(passed / 8, dropped / 8);
            demand(&usage(0, 0), &after, Duration::from_secs(1), share, fair)
        };
        // 10 Mbit/s passed, 20 dropped, share 10: offered 30.
        assert_eq!(ask(10 * MBIT, 20 * MBIT, 10 * MBIT), 30 * MBIT);
        // An elastic sender using its whole share asks for a quarter more.
        assert_eq!(ask(10 * MBIT, 0, 10 * MBIT), 12_500_000);
        // ... and one squeezed to 1 Mbit/s asks for an equal part at once.
        assert_eq!(ask(MBIT, 0, MBIT), fair);
        // A steady 5 Mbit/s sender with a share of 10 asks for 5.5 ...
        assert_eq!(ask(5 * MBIT, 0, 10 * MBIT), 5_500_000);
        // ... and keeps it at its own share of 5.5: 5 is below 95 % of it.
        assert_eq!(ask(5 * MBIT, 0, 5_500_000), 5_500_000);
        // A shape class whose queue stands is held back, whatever it sent.
        let standing = Usage {
            backlogged: true,
            ..usage(MBIT / 8, 0)
        };
        let second = Duration::from_secs(1);
        assert_eq!(
            demand(&usage(0, 0), &standing, second, 5 * MBIT, fair),
            fair
        );
    }

    #[test]
    fn a_higher_share_waits_an_answer_a_lower_one_does_not() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        tracker.answered(answer(10 * MBIT));
        assert_eq!(tracker.applied, MBIT, "the first answer does not raise");
        tracker.answered(answer(12 * MBIT));
        assert_eq!(
            tracker.applied,
            10 * MBIT,
            "raised to the lower of two answers"
        );
        tracker.answered(answer(4 * MBIT));
        assert_eq!(tracker.applied, 4 * MBIT, "lowered at once");
        assert_eq!(tracker.answered(answer(40 * MBIT)), Event::Steady);
        assert_eq!(tracker.applied, 4 * MBIT);
        tracker.answered(answer(40 * MBIT));
        assert_eq!(tracker.applied, 30 * MBIT, "never above the limit");
        let mut restarted = answer(10 * MBIT);
        restarted.epoch_ms = 8;
        assert_eq!(tracker.answered(restarted), Event::Relearning);
    }

    #[test]
    fn demand_rises_at_once_and_falls_to_a_third_at_most_per_interval() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        assert_eq!(tracker.report_demand(27 * MBIT), 27 * MBIT);
        assert_eq!(tracker.report_demand(MBIT), 9 * MBIT);
        assert_eq!(tracker.report_demand(0), 3 * MBIT);
        assert_eq!(tracker.report_demand(8 * MBIT), 8 * MBIT);
    }

    #[test]
    fn a_share_given_to_a_host_that_asked_is_kept_asked_for_while_it_ramps() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        // Held back at the floor: it asks for an equal part and gets it an answer later.
        tracker.report_demand(10 * MBIT);
        tracker.answered(answer(10 * MBIT));
        tracker.report_demand(10 * MBIT);
        tracker.answered(answer(10 * MBIT));
        assert_eq!(tracker.applied, 10 * MBIT);
        // Its TCP sender sits in retransmission backoff: nothing sent for the grace...
        let grace_ticks = RAMP_GRACE.as_millis() / DEFAULT_INTERVAL.as_millis();
        for tick in 0..grace_ticks {
            assert_eq!(tracker.report_demand(0), 10 * MBIT, "tick {tick}");
        }
        // ... then the demand falls as any other.
        assert_eq!(tracker.report_demand(0), 10 * MBIT / DEMAND_FALL);
        // A share that rose without being asked for (spare spread evenly) is not held.
        let mut idle = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        idle.report_demand(0);
        idle.answered(answer(10 * MBIT));
        idle.report_demand(0);
        idle.answered(answer(10 * MBIT));
        assert_eq!(idle.applied, 10 * MBIT);
        assert_eq!(idle.report_demand(0), 0);
        // Nor one that rose from near its part: it gives the share up at once on stopping.
        let mut near = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 5 * MBIT, DEFAULT_INTERVAL);
        near.hosts = 3;
        near.report_demand(10 * MBIT);
        near.answered(answer(10 * MBIT));
        near.report_demand(10 * MBIT);
        near.answered(answer(10 * MBIT));
        assert_eq!(near.applied, 10 * MBIT);
        assert_eq!(near.report_demand(0), 10 * MBIT / DEMAND_FALL);
    }

    #[test]
    fn without_redis_each_mode_falls_where_it_says() {
        let mut held = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 5 * MBIT, DEFAULT_INTERVAL);
        held.hosts = 3;
        for _ in 0..STATIC_HOLD_INTERVALS {
            held.lost();
            assert_eq!(held.applied, 5 * MBIT);
        }
        held.lost();
        assert_eq!(held.applied, 9_800_000, "(30 less 2 %) / 3");
        let mut open = Tracker::new(30 * MBIT, MBIT, OnLoss::Open, 5 * MBIT, DEFAULT_INTERVAL);
        assert_eq!(open.lost(), Event::Lost);
        assert_eq!(open.applied, 30 * MBIT);
        let mut closed = Tracker::new(30 * MBIT, MBIT, OnLoss::Closed, 5 * MBIT, DEFAULT_INTERVAL);
        closed.lost();
        assert_eq!(closed.applied, MBIT);
        let back = Answer {
            share_bits_per_sec: 10 * MBIT,
            hosts: 3,
            epoch_ms: 1,
        };
        assert_eq!(closed.answered(back), Event::Back);
        assert_eq!(
            closed.applied, MBIT,
            "back from a loss, it rises an answer later"
        );
    }
}
