//! The daemon's side of global classes: every `[coordination] interval`, for each global
//! class on the file's interfaces, report this host's demand to Redis, decide the share
//! (`shaper::global::Tracker`) and install it with its expiry. Runs beside the control
//! loop on the daemon's one thread; Redis is awaited with no state borrowed.

use super::Daemon;
use crate::{
    config::Coordination,
    global::{self, Coordinator, Event, HostClass, Reply, Report, Tracker, Usage},
    state::{self, Location},
};
use std::{
    cell::RefCell,
    collections::HashMap,
    rc::Rc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

/// One global class between ticks.
struct Tracked {
    key: String,
    tracker: Tracker,
    usage: Usage,
    at: Instant,
    answered_unix_ms: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Waits briefly (at most 100 ms) for the state lock, which another daemon's plan may
/// hold for tens of milliseconds; `None` when it stays busy, so this tick installs nothing
/// and the next one retries.
async fn lock_briefly() -> Option<state::StateLock> {
    for _ in 0..20 {
        match state::try_lock() {
            Ok(Some(lock)) => return Some(lock),
            Ok(None) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(error) => {
                log::error!("coordination: {error:#}");
                return None;
            }
        }
    }
    None
}

/// Runs for the daemon's life; follows `[coordination]` across reloads (none: idle).
pub async fn run(daemon: Rc<RefCell<Daemon>>) {
    let mut current: Option<(Coordination, Coordinator)> = None;
    let mut silent_ticks = 0;
    let mut client_error: Option<String> = None;
    let mut tracked: HashMap<(Location, String), Tracked> = HashMap::new();
    loop {
        let wanted = daemon.borrow().desired.coordination.clone();
        let Some(settings) = wanted else {
            current = None;
            tokio::time::sleep(global::DEFAULT_INTERVAL).await;
            continue;
        };
        let interval = settings.interval;
        let started = Instant::now();
        let desired = daemon.borrow().desired.clone();
        let classes = match super::shares::configured_classes(&desired) {
            Ok(classes) => classes,
            Err(error) => {
                log::error!("coordination: cannot read the global classes: {error:#}");
                tokio::time::sleep(interval).await;
                continue;
            }
        };
        tracked.retain(|(location, name), _| {
            classes
                .iter()
                .any(|c| &c.location == location && &c.name == name)
        });
        // The shares in force are renewed before Redis is asked: however slow its answers,
        // and with no client at all, no share expires while this daemon runs.
        for class in &classes {
            renew_first(class, track(&mut tracked, class, interval), interval);
        }
        let reports: Vec<Report> = classes
            .iter()
            .map(|class| demand_of(class, track(&mut tracked, class, interval)))
            .collect();
        // Without a client (one that cannot be made: a password file gone unreadable,
        // say), every report counts as unanswered: `on_coordinator_loss` decides.
        let replies = match connected(&mut current, &settings, &mut client_error) {
            Some(coordinator) => coordinator.report_all(&reports).await,
            None => reports
                .iter()
                .map(|_| Err((redis::ErrorKind::Client, "no Redis client (see the log)").into()))
                .collect(),
        };
        let mut answered = false;
        for (class, reply) in classes.iter().zip(replies) {
            let entry = track(&mut tracked, class, interval);
            answered |= decide(&daemon, class, entry, reply);
            apply_share(&daemon, class, entry, interval).await;
        }
        // A connection that stays refused (Redis came back before its ACL users did, say)
        // is not retried forever: after a few silent ticks a new client starts afresh.
        silent_ticks = if answered || classes.is_empty() {
            0
        } else {
            silent_ticks + 1
        };
        if silent_ticks >= RECONNECT_AFTER_TICKS {
            log::info!(
                "coordination: no answer for {silent_ticks} intervals; connecting to Redis afresh"
            );
            current = None;
            silent_ticks = 0;
        }
        tokio::time::sleep(interval.saturating_sub(started.elapsed())).await;
    }
}

/// The Redis client for `settings`: the one running, or a new one when the settings
/// changed (`None`, logged, when it cannot be made).
fn connected<'c>(
    current: &'c mut Option<(Coordination, Coordinator)>,
    settings: &Coordination,
    last_error: &mut Option<String>,
) -> Option<&'c mut Coordinator> {
    if current.as_ref().map(|(known, _)| known) != Some(settings) {
        // The password file is read afresh for every new client: a rotated password is
        // picked up at the next reconnect.
        let made = settings
            .password_file
            .as_deref()
            .map(global::read_password)
            .transpose()
            .and_then(|password| {
                Coordinator::new(
                    &settings.redis,
                    password.as_deref(),
                    &settings.host_id,
                    settings.interval,
                    settings.allocate,
                )
            });
        *current = match made {
            Ok(coordinator) => {
                *last_error = None;
                log::info!(
                    "coordinating global classes through {} as host '{}' every {}",
                    global::redacted(&settings.redis),
                    settings.host_id,
                    humantime::format_duration(settings.interval)
                );
                Some((settings.clone(), coordinator))
            }
            Err(error) => {
                // Retried every tick; said once until it changes.
                let error = format!("{error:#}");
                if last_error.as_ref() != Some(&error) {
                    log::error!("coordination off: {error}");
                    *last_error = Some(error);
                }
                None
            }
        };
    }
    current.as_mut().map(|(_, coordinator)| coordinator)
}

/// The class's state between ticks, started at its share now.
fn track<'t>(
    tracked: &'t mut HashMap<(Location, String), Tracked>,
    class: &HostClass,
    interval: Duration,
) -> &'t mut Tracked {
    let id = (class.location.clone(), class.name.clone());
    tracked.entry(id).or_insert_with(|| Tracked {
        key: class.key.clone(),
        tracker: Tracker::new(
            class.limit_bits_per_sec,
            class.floor_bits_per_sec,
            class.on_loss,
            class.share_bits_per_sec,
            interval,
        ),
        usage: class.usage,
        at: Instant::now(),
        answered_unix_ms: 0,
    })
}

/// Renews the share in force with its new expiry, or installs a changed one under the
/// state lock (skipped this tick when another shaper holds it).
async fn apply_share(
    daemon: &Rc<RefCell<Daemon>>,
    class: &HostClass,
    entry: &Tracked,
    interval: Duration,
) {
    let place = || format!("{} on {}", class.name, class.location.describe());
    let update = global::update_for(
        entry.tracker.applied,
        entry.tracker.hosts,
        entry.answered_unix_ms,
        interval,
    );
    match global::renew(class, update) {
        Ok(true) => return,
        Ok(false) => {}
        Err(error) => {
            log::error!("{}: cannot renew its share: {error:#}", place());
            return;
        }
    }
    let Some(_lock) = lock_briefly().await else {
        daemon.borrow_mut().health.lock_busy += 1;
        return;
    };
    match global::install(class, update) {
        Ok(true) => log::debug!(
            "{}: share {}",
            place(),
            crate::units::format_rate(entry.tracker.applied)
        ),
        Ok(false) => {}
        Err(error) => log::error!("{}: cannot install its share: {error:#}", place()),
    }
}

/// Ticks without any answer after which the Redis client is made afresh.
const RECONNECT_AFTER_TICKS: u32 = 4;

/// Renews the share in force with a new expiry, before this tick's reports (a share
/// that changed meanwhile, a floor the packet path installed, waits for `apply_share`).
fn renew_first(class: &HostClass, entry: &Tracked, interval: Duration) {
    let update = global::update_for(
        entry.tracker.applied,
        entry.tracker.hosts,
        entry.answered_unix_ms,
        interval,
    );
    if let Err(error) = global::renew(class, update) {
        let place = format!("{} on {}", class.name, class.location.describe());
        log::error!("{place}: cannot renew its share: {error:#}");
    }
}

/// This tick's report of `class`: its demand since the last tick, and the tracker's
/// parameters as the configuration now says.
fn demand_of(class: &HostClass, entry: &mut Tracked) -> Report {
    let tracker = &mut entry.tracker;
    tracker.limit_bits_per_sec = class.limit_bits_per_sec;
    tracker.floor_bits_per_sec = class.floor_bits_per_sec;
    tracker.on_loss = class.on_loss;
    if entry.key != class.key {
        entry.key = class.key.clone();
        tracker.epoch_ms = None;
    }
    let now = Instant::now();
    let demand = tracker.report_demand(global::demand(
        &entry.usage,
        &class.usage,
        now - entry.at,
        class.share_bits_per_sec,
        tracker.fair_share(),
    ));
    entry.usage = class.usage;
    entry.at = now;
    Report {
        key: class.key.clone(),
        demand,
        applied: tracker.applied,
        limit_bits_per_sec: tracker.limit_bits_per_sec,
        floor_bits_per_sec: tracker.floor_bits_per_sec,
    }
}

/// What an answer says beside the share: counted, and logged when it changed (broken
/// fields removed, the limit and interval the hosts fill with).
fn note_answer(
    daemon: &Rc<RefCell<Daemon>>,
    class: &HostClass,
    tracker: &Tracker,
    answer: &global::Answer,
) {
    {
        let health = &mut daemon.borrow_mut().health;
        health.coordination_ok += 1;
        health.global_fields_dropped += u64::from(answer.dropped_fields);
    }
    if answer.dropped_fields > 0 {
        log::warn!(
            "{} (global '{}'): this daemon's fill left out {} announcement(s) or report(s) it could not read (written by a host's Redis user, not by shaper)",
            class.name,
            class.key,
            answer.dropped_fields
        );
    }
    if tracker.filled_with != Some(answer.limits) {
        log_limits(class, tracker.limit_bits_per_sec, answer.limits);
        let own = entry_interval_ms(daemon);
        if answer.limits.version > 0 && answer.limits.interval_ms < own {
            log::warn!(
                "{} (global '{}'): the published interval ({} ms) is shorter than this host's ({own} ms): the other hosts may forget this one between its reports; set [coordination] interval to it",
                class.name,
                class.key,
                answer.limits.interval_ms
            );
        }
    }
}

/// This daemon's own reporting interval (ms), as its file says.
fn entry_interval_ms(daemon: &Rc<RefCell<Daemon>>) -> u64 {
    daemon
        .borrow()
        .desired
        .coordination
        .as_ref()
        .map_or(global::DEFAULT_INTERVAL, |c| c.interval)
        .as_millis() as u64
}

/// Says which limit the hosts now fill with, when it changed: a published one (and
/// whether it differs from this host's rate, which still caps the share here), or this
/// host's own.
fn log_limits(class: &HostClass, own: u64, limits: global::Limits) {
    let rate = crate::units::format_rate;
    if limits.version == 0 {
        log::info!(
            "{} (global '{}'): no published limit; the hosts fill with the caller's rate ({} from this host)",
            class.name,
            class.key,
            rate(own)
        );
    } else if limits.limit_bits_per_sec == own {
        log::info!(
            "{} (global '{}'): published limit {} (version {}), as this host's rate",
            class.name,
            class.key,
            rate(limits.limit_bits_per_sec),
            limits.version
        );
    } else {
        log::warn!(
            "{} (global '{}'): published limit {} (version {}) differs from this host's rate {}: the hosts fill with the published one, and this host's share is capped at its own rate",
            class.name,
            class.key,
            rate(limits.limit_bits_per_sec),
            limits.version,
            rate(own)
        );
    }
}

/// Redis's answer (or its absence) decided into the tracker's share. Whether Redis
/// answered.
fn decide(
    daemon: &Rc<RefCell<Daemon>>,
    class: &HostClass,
    entry: &mut Tracked,
    reply: redis::RedisResult<Reply>,
) -> bool {
    let tracker = &mut entry.tracker;
    let answered = reply.is_ok();
    let event = match reply {
        Ok(Reply::Share(answer)) => {
            note_answer(daemon, class, tracker, &answer);
            entry.answered_unix_ms = unix_ms();
            tracker.answered(answer)
        }
        Ok(Reply::HostIdTaken) => {
            daemon.borrow_mut().health.host_id_taken += 1;
            // A configuration error, with the other daemon counted for this id: the
            // floor, whatever on_coordinator_loss says (which would take the limit).
            let event = tracker.lost();
            tracker.applied = tracker.floor_bits_per_sec;
            if event == Event::Lost {
                log::error!(
                    "{} (global '{}'): another daemon reports with this host_id (a cloned host?); Redis refuses this one's reports while it does; holding the floor",
                    class.name,
                    class.key
                );
            }
            event
        }
        Err(error) => {
            daemon.borrow_mut().health.coordination_failed += 1;
            let event = tracker.lost();
            if event == Event::Lost {
                log::warn!(
                    "{} (global '{}'): Redis did not answer ({error}); on_coordinator_loss = {}",
                    class.name,
                    class.key,
                    class.on_loss.name()
                );
            }
            event
        }
    };
    match event {
        Event::Back => log::info!(
            "{} (global '{}'): Redis answers again; {} hosts",
            class.name,
            class.key,
            tracker.hosts
        ),
        Event::Relearning => log::warn!(
            "{} (global '{}'): Redis lost the class's state (restarted empty?); the hosts re-learn it without rising meanwhile",
            class.name,
            class.key
        ),
        Event::Lost | Event::Steady => {}
    }
    answered
}
