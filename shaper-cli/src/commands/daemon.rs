//! `shaper daemon -f FILE`: keeps a configuration applied.
//!
//! - applies the file at start (an invalid file at start is an error: nothing to keep);
//! - re-applies on SIGHUP and when the file's content changes; an invalid file is logged
//!   with every problem and the last good configuration stays in force;
//! - every interval, re-checks the kernel against the last good configuration, which
//!   re-attaches an interface that was re-created (a container restarted, a VM's tap came
//!   back) and attaches one that appeared late;
//! - serves Prometheus metrics on `/metrics` and a health check on `/healthz`;
//! - on SIGTERM/SIGINT leaves everything attached (the kernel keeps enforcing), unless
//!   `--cleanup-on-exit`;
//! - forwards the eBPF program's own log records (aya-log: CoDel starting to drop on a
//!   shape class, a full flow table) of every attachment into its log;
//! - never waits for the state lock: a check that finds it held is skipped and counted.
//!
//! Everything runs on one thread (a current-thread runtime): plans and scrapes enter
//! network namespaces with setns, which is per thread, and never overlap.

use crate::cli::DaemonArgs;
use anyhow::Result;
use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;
use shaper::{
    config::{self, Desired, Prune},
    error::{runtime, usage},
    metrics::{self, Health},
    state,
};
use std::{
    cell::RefCell,
    convert::Infallible,
    net::SocketAddr,
    rc::Rc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
};

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub fn run(netns: Option<String>, args: DaemonArgs) -> Result<()> {
    if netns.is_some() {
        return Err(usage(
            "the daemon takes namespaces from the file (netns = \"...\"), not --netns",
        ));
    }
    let interval = humantime::parse_duration(&args.interval)
        .map_err(|e| usage(format!("bad --interval '{}': {e}", args.interval)))?;
    let address: SocketAddr = args.metrics_addr.parse().map_err(|_| {
        usage(format!(
            "bad --metrics-addr '{}' (expected IP:PORT)",
            args.metrics_addr
        ))
    })?;
    super::prepare(&None)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, daemon(args, interval, address))
}

/// The daemon's state, shared by the control loop, the coordination loop and the metrics
/// server.
pub(super) struct Daemon {
    file: String,
    /// The last configuration that parsed.
    pub(super) desired: Desired,
    /// The file's content as last read (to notice changes).
    last_text: Option<String>,
    pub(super) health: Health,
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
    pub(super) fn interfaces(desired: &Desired) -> Vec<(Option<String>, String)> {
        desired
            .interfaces
            .iter()
            .map(|i| (i.netns.clone(), i.dev.clone()))
            .collect()
    }

    /// Plans against `desired` and carries the plan out, logging each step. Never waits
    /// for the state lock (metrics and signals are served on this thread): when another
    /// shaper holds it, this check is skipped and `Ok(false)` returned.
    fn converge(&mut self, prune: Prune) -> Result<bool> {
        let Some(_lock) = state::try_lock()? else {
            self.health.lock_busy += 1;
            if !std::mem::replace(&mut self.retry_soon, true) {
                log::warn!("another shaper command holds the state lock; checking again shortly");
            }
            return Ok(false);
        };
        self.retry_soon = false;
        if std::mem::take(&mut self.upgrade_pending) {
            self.upgrade_attached();
        }
        let plan = config::plan(&self.desired, prune)?;
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
        if let Err(error) = config::execute(&plan) {
            self.health.apply_errors += 1;
            return Err(error);
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
    fn upgrade_attached(&mut self) {
        for (netns, dev) in Self::interfaces(&self.desired) {
            for direction in state::Direction::BOTH {
                let location = state::Location {
                    netns: netns.clone(),
                    dev: dev.clone(),
                    direction,
                };
                if !location.dir().exists() {
                    continue;
                }
                match shaper::netns::in_namespace(&netns, || state::upgrade(&location, false)) {
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

    /// Reads and applies the file; on a bad file keeps the last good configuration.
    fn reload(&mut self, why: &str) {
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
                let before = Self::interfaces(&self.desired);
                let after = Self::interfaces(&desired);
                let dropped: Vec<_> = before.into_iter().filter(|i| !after.contains(i)).collect();
                let previous = std::mem::replace(&mut self.desired, desired);
                self.health.interfaces_configured = self.desired.interfaces.len();
                match self.converge(Prune::These(&dropped)) {
                    Ok(false) => {
                        // Not applied yet: the next tick sees a changed file and retries.
                        self.desired = previous;
                        self.last_text = None;
                    }
                    Ok(true) => {
                        self.health.reloads_ok += 1;
                        self.health.config_valid = true;
                        self.health.last_success_unix = unix_now();
                    }
                    Err(error) => {
                        log::error!("{why}: applying failed: {error:#}");
                        self.health.reloads_failed += 1;
                        self.health.config_valid = false;
                    }
                }
            }
        }
    }

    /// One tick: reload when the file changed, else bring the kernel back to the file.
    fn tick(&mut self) {
        let text = std::fs::read_to_string(&self.file).ok();
        if text != self.last_text {
            self.reload("file changed");
            return;
        }
        if let Err(error) = self.converge(Prune::Nothing) {
            log::error!("re-checking the configuration failed: {error:#}");
        }
    }

    /// Forwards what the attached programs logged since the last call.
    fn forward_ebpf_logs(&mut self) {
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

    fn cleanup(&mut self) {
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

async fn daemon(args: DaemonArgs, interval: Duration, address: SocketAddr) -> Result<()> {
    // An invalid file at start is the operator's error to fix: fail loudly.
    let desired = crate::config_file::load(&args.file)?;
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| runtime(format!("cannot listen on {address} for metrics: {e}")))?;
    let daemon = Rc::new(RefCell::new(Daemon {
        file: args.file.clone(),
        desired,
        last_text: std::fs::read_to_string(&args.file).ok(),
        health: Health {
            started_unix: unix_now(),
            ..Health::default()
        },
        missing: Vec::new(),
        ebpf_logs: Default::default(),
        upgrade_pending: !args.no_upgrade,
        retry_soon: false,
    }));
    {
        let mut state = daemon.borrow_mut();
        state.health.interfaces_configured = state.desired.interfaces.len();
        match state.converge(Prune::Nothing) {
            // The lock was busy: the first tick reloads the file as if it had changed.
            Ok(false) => state.last_text = None,
            Ok(true) => {
                state.health.reloads_ok = 1;
                state.health.config_valid = true;
                state.health.last_success_unix = unix_now();
            }
            Err(error) => {
                // Start anyway: the next ticks retry (an interface may come up later).
                log::error!("applying {} failed: {error:#}", args.file);
                state.health.reloads_failed = 1;
            }
        }
    }
    log::info!(
        "serving metrics on http://{address}/metrics; checking every {}",
        humantime::format_duration(interval)
    );
    tokio::task::spawn_local(serve_metrics(listener, daemon.clone()));
    tokio::task::spawn_local(super::coordinate::run(daemon.clone()));
    let mut hangup = signal(SignalKind::hangup())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut retries: u64 = 0;
    loop {
        let retry_soon = daemon.borrow().retry_soon;
        retries += u64::from(retry_soon);
        tokio::select! {
            _ = tokio::time::sleep(retry_pause(retries)), if retry_soon => daemon.borrow_mut().tick(),
            _ = hangup.recv() => daemon.borrow_mut().reload("SIGHUP"),
            _ = ticker.tick() => {
                let mut state = daemon.borrow_mut();
                state.tick();
                state.forward_ebpf_logs();
            }
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    if args.cleanup_on_exit {
        daemon.borrow_mut().cleanup();
    } else {
        log::info!("stopping; shaper stays attached (use --cleanup-on-exit to detach)");
    }
    Ok(())
}

/// 20-119 ms, differing between processes and attempts, so daemons that found the lock
/// held do not all come back at the same moment.
fn retry_pause(attempt: u64) -> Duration {
    let spread = (u64::from(std::process::id()) * 7919 + attempt * 104_729) % 100;
    Duration::from_millis(20 + spread)
}

async fn serve_metrics(listener: TcpListener, daemon: Rc<RefCell<Daemon>>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                log::warn!("metrics: accept failed: {error}");
                continue;
            }
        };
        let daemon = daemon.clone();
        let service = service_fn(move |request: Request<hyper::body::Incoming>| {
            let response = respond(request.uri().path(), &daemon.borrow());
            async move { Ok::<_, Infallible>(response) }
        });
        tokio::task::spawn_local(async move {
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                log::debug!("metrics connection: {error}");
            }
        });
    }
}

fn respond(path: &str, daemon: &Daemon) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => match metrics::render(Some(&daemon.health)) {
            Ok(text) => (
                200,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            ),
            Err(error) => (500, "text/plain", format!("{error:#}\n")),
        },
        "/healthz" if daemon.health.config_valid => (200, "text/plain", "ok\n".to_string()),
        "/healthz" => (
            503,
            "text/plain",
            "the configuration on disk is not applied (see the daemon's log)\n".to_string(),
        ),
        _ => (404, "text/plain", "try /metrics or /healthz\n".to_string()),
    };
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}
