//! The daemon (`shaper daemon -f FILE`): keeps a configuration applied.
//!
//! - applies the file at start (an invalid file at start is the caller's error);
//! - re-applies on [`Daemon::reload`] (SIGHUP) and when the file's content changes; an
//!   invalid file is logged with every problem and the last good configuration stays in
//!   force; a file that parses but fails to apply is retried with backoff
//!   ([`retry_delay`]), the step it failed at first, so that a retry that fails again
//!   changes nothing in the kernel (no class replaced, no counter reset, no bucket
//!   refilled);
//! - every [`Daemon::tick`], re-checks the kernel against the last good configuration,
//!   which re-attaches an interface that was re-created (a container restarted, a VM's
//!   tap came back) and attaches one that appeared late;
//! - answers `/metrics` and `/healthz` ([`respond`], off the daemon's thread);
//! - coordinates global classes through Redis ([`coordinate::run`]);
//! - forwards the eBPF program's own log records (aya-log: CoDel starting to drop on a
//!   shape class, a full flow table) of every attachment into its log;
//! - never waits for the state lock: a check that finds it held is skipped and counted.
//!
//! Everything runs on one thread: plans and scrapes enter network namespaces with setns,
//! which is per thread, and never overlap. The command line (`shaper-cli`) owns the
//! arguments, the signals and the HTTP listener.

use crate::{
    config::{self, Desired, Prune},
    metrics::{self, Health},
    state,
};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub mod coordinate;
mod shares;

pub use shares::holding_shares;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// How long after its `attempts`-th failure a file that fails to apply is tried again: 1 s
/// after the first, doubling to 60 s. A change to the file, or SIGHUP, tries at once.
pub fn retry_delay(attempts: u32) -> Duration {
    let doubled = 1u64 << attempts.saturating_sub(1).min(6);
    Duration::from_secs(doubled.min(60))
}

/// A configuration that parsed but failed to apply, waiting for its next try.
struct Pending {
    desired: Desired,
    /// Interfaces it dropped from the file: detached when it applies.
    dropped: Vec<(Option<String>, String)>,
    /// The step it failed at last (as the plan prints it), tried first next time.
    failed_step: Option<String>,
    attempts: u32,
    next_try: Instant,
}

/// The daemon's state, shared by the control loop, the coordination loop and the metrics
/// server.
pub struct Daemon {
    file: String,
    /// The configuration in force: the last that applied (at start, the file's until a
    /// first application fails; then nothing until it applies).
    desired: Desired,
    /// A newer configuration that failed to apply, retried with backoff.
    pending: Option<Pending>,
    /// The file's content as last read (to notice changes).
    last_text: Option<String>,
    health: Health,
    /// Missing interfaces at the last check (logged when this changes).
    missing: Vec<String>,
    /// Readers of each attached program's log ring buffer, by program id.
    ebpf_logs: std::collections::HashMap<u32, aya_log::EbpfLogger<&'static dyn log::Log>>,
    /// Whether the configured interfaces still get this build's program swapped in (once,
    /// at the first check that holds the lock).
    upgrade_pending: bool,
    /// The last check found the lock held: check again after a short, per-process
    /// jittered pause rather than a whole tick later (daemons started together would
    /// otherwise meet the same holder at every tick).
    retry_soon: bool,
}

impl Daemon {
    /// A daemon keeping `desired` (read from `file`) applied; with `upgrade`, the first
    /// check that holds the state lock swaps this build's program in where another
    /// build's runs (as `shaper upgrade`).
    pub fn new(file: &str, desired: Desired, upgrade: bool) -> Self {
        let interfaces_configured = desired.interfaces.len();
        Self {
            file: file.to_string(),
            desired,
            pending: None,
            last_text: std::fs::read_to_string(file).ok(),
            health: Health {
                started_unix: unix_now(),
                interfaces_configured,
                ..Health::default()
            },
            missing: Vec::new(),
            ebpf_logs: Default::default(),
            upgrade_pending: upgrade,
            retry_soon: false,
        }
    }

    /// The first application of the file. A failure is logged and counted, not fatal:
    /// nothing of the file is in force (all or nothing) and it is retried with backoff.
    pub fn start(&mut self) {
        let desired = std::mem::take(&mut self.desired);
        match self.converge(&desired, Prune::Nothing, None) {
            // The lock was busy: the first tick reloads the file as if it had changed.
            Ok(false) => {
                self.desired = desired;
                self.last_text = None;
            }
            Ok(true) => {
                self.desired = desired;
                self.health.reloads_ok = 1;
                self.health.config_valid = true;
                self.health.last_success_unix = unix_now();
            }
            Err(failed) => {
                self.health.interfaces_configured = 0;
                self.failed("start", desired, Vec::new(), failed, 0);
            }
        }
    }

    /// Whether the last check found the state lock held, so the next comes after
    /// [`retry_pause`] rather than a whole interval later.
    pub fn retry_soon(&self) -> bool {
        self.retry_soon
    }

    /// What `/metrics` and `/healthz` need of the daemon, taken on its thread so the
    /// answer can be rendered off it.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// A connection to the metrics listener closed at accept.
    pub fn count_refused_connection(&mut self) {
        self.health.metrics_connections_refused += 1;
    }

    fn interfaces(desired: &Desired) -> Vec<(Option<String>, String)> {
        desired
            .interfaces
            .iter()
            .map(|i| (i.netns.clone(), i.dev.clone()))
            .collect()
    }

    /// Plans against `desired` and carries the plan out, logging each step; with
    /// `failed_first`, the step a plan failed at before runs first where it can. Never
    /// waits for the state lock (metrics and signals are served on this thread): when
    /// another shaper holds it, this check is skipped and `Ok(false)` returned.
    fn converge(
        &mut self,
        desired: &Desired,
        prune: Prune,
        failed_first: Option<&str>,
    ) -> Result<bool, config::Failed> {
        let Some(_lock) = state::try_lock().map_err(config::Failed::unnamed)? else {
            self.health.lock_busy += 1;
            if !std::mem::replace(&mut self.retry_soon, true) {
                log::warn!("another shaper command holds the state lock; checking again shortly");
            }
            return Ok(false);
        };
        self.retry_soon = false;
        if std::mem::take(&mut self.upgrade_pending) {
            self.upgrade_attached(desired);
        }
        let mut plan = config::plan(desired, prune).map_err(config::Failed::unnamed)?;
        if let Some(step) = failed_first {
            if plan.failed_step_first(step) {
                log::info!("trying first what failed last time");
            }
        }
        for step in &plan.steps {
            log::info!("{step}");
        }
        if plan.missing != self.missing {
            for missing in &plan.missing {
                log::warn!("waiting for {missing}: not present");
            }
            self.missing = plan.missing.clone();
        }
        self.health.interfaces_missing = plan.missing.len();
        if let Err(failed) = config::execute_naming_the_failure(&plan) {
            self.health.apply_errors += 1;
            return Err(failed);
        }
        if !plan.steps.is_empty() {
            log::info!(
                "applied {} change(s), {} class(es) unchanged",
                plan.steps.len(),
                plan.unchanged
            );
        }
        Ok(true)
    }

    /// Swaps this build's program in on the configured interfaces that another build
    /// attached (as `shaper upgrade`); an attachment that cannot be upgraded is logged and
    /// left as it is. Called with the state lock held.
    fn upgrade_attached(&mut self, desired: &Desired) {
        for (netns, dev) in Self::interfaces(desired) {
            for direction in state::Direction::BOTH {
                let location = state::Location {
                    netns: netns.clone(),
                    dev: dev.clone(),
                    direction,
                };
                if !location.dir().exists() {
                    continue;
                }
                match crate::netns::in_namespace(&netns, || state::upgrade(&location, false)) {
                    Ok(done) if done.changed() => log::info!(
                        "{}: upgraded to this build (program {} -> {}, state layout {} -> {})",
                        location.describe(),
                        done.old_program_id,
                        done.new_program_id,
                        done.from_layout,
                        shaper_common::LAYOUT_VERSION
                    ),
                    Ok(_) => {}
                    Err(error) => {
                        log::error!("{}: not upgraded: {error:#}", location.describe())
                    }
                }
            }
        }
    }

    /// Reads and applies the file (at once: a change or SIGHUP does not wait for a
    /// pending retry); on a bad file keeps the last good configuration.
    pub fn reload(&mut self, why: &str) {
        let text = match std::fs::read_to_string(&self.file) {
            Ok(text) => text,
            Err(error) => {
                log::error!(
                    "{why}: cannot read {}: {error}; keeping the last good configuration",
                    self.file
                );
                self.health.reloads_failed += 1;
                self.health.config_valid = false;
                self.last_text = None;
                return;
            }
        };
        self.last_text = Some(text.clone());
        // What was pending is superseded by what the file says now; the step it failed at
        // still goes first if the new plan has it (SIGHUP on an unchanged broken file).
        let failed_step = self.pending.take().and_then(|pending| pending.failed_step);
        match config::parse(&self.file, &text) {
            Err(problems) => {
                for line in problems.to_string().lines() {
                    log::error!("{line}");
                }
                log::error!(
                    "{why}: {} problem(s); keeping the last good configuration",
                    problems.problems.len()
                );
                self.health.reloads_failed += 1;
                self.health.config_valid = false;
            }
            Ok(desired) => {
                log::info!("{why}: applying {}", self.file);
                // Interfaces dropped from the file are detached; others are left alone.
                let after = Self::interfaces(&desired);
                let dropped: Vec<_> = Self::interfaces(&self.desired)
                    .into_iter()
                    .filter(|i| !after.contains(i))
                    .collect();
                self.attempt(why, desired, dropped, failed_step, 0);
            }
        }
    }

    /// Applies `desired` (detaching `dropped`), trying `failed_step` first; on success it
    /// is the configuration in force, else it waits for its next try (`attempts` so far).
    fn attempt(
        &mut self,
        why: &str,
        desired: Desired,
        dropped: Vec<(Option<String>, String)>,
        failed_step: Option<String>,
        attempts: u32,
    ) {
        match self.converge(&desired, Prune::These(&dropped), failed_step.as_deref()) {
            // Not applied yet (the lock was held): tried again at the next check.
            Ok(false) => {
                self.pending = Some(Pending {
                    desired,
                    dropped,
                    failed_step,
                    attempts,
                    next_try: Instant::now(),
                })
            }
            Ok(true) => {
                self.desired = desired;
                self.health.interfaces_configured = self.desired.interfaces.len();
                self.health.reloads_ok += 1;
                self.health.config_valid = true;
                self.health.last_success_unix = unix_now();
            }
            Err(failed) => self.failed(why, desired, dropped, failed, attempts),
        }
    }

    /// `desired` failed to apply: the last good configuration stays in force, and it is
    /// tried again after [`retry_delay`], the step it failed at first.
    fn failed(
        &mut self,
        why: &str,
        desired: Desired,
        dropped: Vec<(Option<String>, String)>,
        failed: config::Failed,
        attempts: u32,
    ) {
        let attempts = attempts + 1;
        let delay = retry_delay(attempts);
        log::error!(
            "{why}: applying {} failed: {:#}; keeping the last good configuration, trying again in {} s",
            self.file,
            failed.error,
            delay.as_secs()
        );
        self.health.reloads_failed += 1;
        self.health.config_valid = false;
        self.pending = Some(Pending {
            desired,
            dropped,
            failed_step: failed.step,
            attempts,
            next_try: Instant::now() + delay,
        });
    }

    /// One tick: reload when the file changed, try a pending configuration again when
    /// its time has come, else bring the kernel back to the configuration in force.
    pub fn tick(&mut self) {
        let text = std::fs::read_to_string(&self.file).ok();
        if text != self.last_text {
            self.reload("file changed");
            return;
        }
        if let Some(pending) = self.pending.take() {
            if Instant::now() >= pending.next_try {
                let Pending {
                    desired,
                    dropped,
                    failed_step,
                    attempts,
                    ..
                } = pending;
                self.attempt("retry", desired, dropped, failed_step, attempts);
                return;
            }
            self.pending = Some(pending);
        }
        let desired = self.desired.clone();
        if let Err(failed) = self.converge(&desired, Prune::Nothing, None) {
            log::error!("re-checking the configuration failed: {:#}", failed.error);
        }
    }

    /// Forwards what the attached programs logged since the last call.
    pub fn forward_ebpf_logs(&mut self) {
        let mut live = Vec::new();
        for location in state::list_locations(None).unwrap_or_default() {
            let Ok(attachment) = state::Attachment::open(&location) else {
                continue;
            };
            let Ok(id) = attachment.program_id() else {
                continue;
            };
            live.push(id);
            if let std::collections::hash_map::Entry::Vacant(entry) = self.ebpf_logs.entry(id) {
                match aya_log::EbpfLogger::init_from_id(id) {
                    Ok(logger) => {
                        entry.insert(logger);
                    }
                    Err(error) => {
                        log::debug!("no eBPF log reader for {}: {error}", location.describe())
                    }
                }
            }
        }
        self.ebpf_logs.retain(|id, _| live.contains(id));
        for logger in self.ebpf_logs.values_mut() {
            logger.flush();
        }
    }

    /// Detaches every configured interface (`--cleanup-on-exit`).
    pub fn cleanup(&mut self) {
        let empty = Desired::default();
        let everything = Self::interfaces(&self.desired);
        // On the way out a bounded wait (--wait) for the lock is fine.
        let result = state::lock().and_then(|_lock| {
            let plan = config::plan(&empty, Prune::These(&everything))?;
            for step in &plan.steps {
                log::info!("cleanup: {step}");
            }
            config::execute(&plan)
        });
        if let Err(error) = result {
            log::error!("cleanup failed: {error:#}");
        }
    }
}

/// 20-119 ms, differing between processes and attempts, so daemons that found the lock
/// held do not all come back at the same moment.
pub fn retry_pause(attempt: u64) -> Duration {
    let spread = (u64::from(std::process::id()) * 7919 + attempt * 104_729) % 100;
    Duration::from_millis(20 + spread)
}

/// The HTTP answer (status, content type, body) to a GET of `path` for a daemon whose
/// health is `health`: `/metrics` (OpenMetrics) or `/healthz` (200 while the file on disk
/// is applied, else 503). `/metrics` reads every attachment's maps (a walk of each
/// flow table): the HTTP listener renders it off the daemon's thread, so a scrape never
/// delays a tick or a share's renewal.
pub fn respond(health: &Health, path: &str) -> (u16, &'static str, String) {
    match path {
        "/metrics" => match metrics::render(Some(health)) {
            Ok(text) => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            ),
            Err(error) => (500, "text/plain", format!("{error:#}\n")),
        },
        "/healthz" if health.config_valid => (200, "text/plain", "ok\n".to_string()),
        "/healthz" => (
            503,
            "text/plain",
            "the configuration on disk is not applied (see the daemon's log)\n".to_string(),
        ),
        _ => (404, "text/plain", "try /metrics or /healthz\n".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_file_is_tried_again_after_1_s_doubling_to_60() {
        let delays: Vec<u64> = (1..=9).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(retry_delay(u32::MAX), Duration::from_secs(60));
    }
}
