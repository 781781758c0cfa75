//! `shaper daemon -f FILE`: the command line of `shaper::daemon`. Here: the arguments,
//! the signals (SIGHUP reloads; SIGTERM and SIGINT stop, leaving everything attached
//! unless `--cleanup-on-exit`) and the HTTP listener for `/metrics` and `/healthz`.
//! Everything runs on one thread (a current-thread runtime), as the daemon needs.

use crate::cli::DaemonArgs;
use anyhow::Result;
use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use shaper::{
    daemon::{coordinate, respond, retry_pause, Daemon},
    error::{runtime, usage},
    metrics::Health,
};
use std::{
    cell::RefCell, collections::VecDeque, convert::Infallible, net::SocketAddr, rc::Rc, sync::Arc,
    time::Duration,
};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
    sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore},
};

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

async fn daemon(args: DaemonArgs, interval: Duration, address: SocketAddr) -> Result<()> {
    // An invalid file at start is the operator's error to fix: fail loudly.
    let desired = crate::config_file::load(&args.file)?;
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| runtime(format!("cannot listen on {address} for metrics: {e}")))?;
    let daemon = Rc::new(RefCell::new(Daemon::new(
        &args.file,
        desired.clone(),
        !args.no_upgrade,
    )));
    shaper::daemon::holding_shares(&desired, || daemon.borrow_mut().start());
    log::info!(
        "serving metrics on http://{address}/metrics; checking every {}",
        humantime::format_duration(interval)
    );
    tokio::task::spawn_local(serve_metrics(listener, daemon.clone()));
    tokio::task::spawn_local(coordinate::run(daemon.clone()));
    let mut hangup = signal(SignalKind::hangup())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut retries: u64 = 0;
    loop {
        let retry_soon = daemon.borrow().retry_soon();
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

/// Connections that have not sent a whole request yet: a new one beyond this many closes
/// the oldest of them, so a flood of idle local connections costs the daemon at most
/// this many descriptors and never keeps a scraper out.
const METRICS_WAITING: usize = 32;
/// Requests rendered at once; more are answered 503 at once.
const METRICS_SERVING: usize = 8;
/// Connections open at once, served ones included (a client that never reads its answer
/// holds one until the connection timeout): more are closed at accept.
const METRICS_CONNECTIONS: usize = 64;
/// How long a client may take to send a request's headers, and to be served in all.
const METRICS_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const METRICS_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client may take to read its answer once it is rendered: one that never
/// reads (its answer larger than the sockets' buffers) frees its slot then, not after
/// [`METRICS_CONNECTION_TIMEOUT`].
const METRICS_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// The connections still waiting for their request, oldest first: each with the sender
/// that closes it (a sender dropped as its connection is served closes nothing).
#[derive(Default)]
struct Waiting {
    next_id: u64,
    queue: VecDeque<(u64, oneshot::Sender<()>)>,
}

impl Waiting {
    /// A new connection's place; the oldest waiting one is closed when all are taken.
    fn enter(&mut self) -> (u64, oneshot::Receiver<()>, bool) {
        let evicted = self.queue.len() >= METRICS_WAITING;
        if evicted {
            if let Some((_, close)) = self.queue.pop_front() {
                let _ = close.send(());
            }
        }
        let (sender, receiver) = oneshot::channel();
        self.next_id += 1;
        self.queue.push_back((self.next_id, sender));
        (self.next_id, receiver, evicted)
    }

    fn leave(&mut self, id: u64) {
        self.queue.retain(|(waiting, _)| *waiting != id);
    }
}

/// `/metrics` and `/healthz`: one request per connection, each answered off the
/// daemon's thread; at most `METRICS_WAITING` connections wait for their request (a new
/// one closes the oldest, counted as refused) and `METRICS_SERVING` are rendered at once.
async fn serve_metrics(listener: TcpListener, daemon: Rc<RefCell<Daemon>>) {
    let waiting = Rc::new(RefCell::new(Waiting::default()));
    let serving = Arc::new(Semaphore::new(METRICS_SERVING));
    let open = Arc::new(Semaphore::new(METRICS_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                log::warn!("metrics: accept failed: {error}");
                // Out of descriptors, say: the next accept a moment later.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(connection_slot) = open.clone().try_acquire_owned() else {
            log::debug!("metrics: {METRICS_CONNECTIONS} connections open; one more closed");
            daemon.borrow_mut().count_refused_connection();
            continue;
        };
        let (id, evict, evicted) = waiting.borrow_mut().enter();
        if evicted {
            log::debug!(
                "metrics: {METRICS_WAITING} connections wait for a request; the oldest closed"
            );
            daemon.borrow_mut().count_refused_connection();
        }
        // Told when the answer is ready: from then on the client has
        // METRICS_ANSWER_TIMEOUT to read it.
        let answered = Rc::new(Notify::new());
        let service = {
            let (daemon, waiting, serving) = (daemon.clone(), waiting.clone(), serving.clone());
            let answered = answered.clone();
            service_fn(move |request: Request<hyper::body::Incoming>| {
                waiting.borrow_mut().leave(id);
                let path = request.uri().path().to_string();
                let health = daemon.borrow().health();
                let slot = serving.clone().try_acquire_owned().ok();
                answer(slot, health, path, answered.clone())
            })
        };
        let waiting = waiting.clone();
        tokio::task::spawn_local(async move {
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(METRICS_HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                served = tokio::time::timeout(METRICS_CONNECTION_TIMEOUT, connection) => match served {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => log::debug!("metrics connection: {error}"),
                    Err(_) => log::debug!("metrics connection: served too slowly; closed"),
                },
                // Closed for a newer connection while it still waited for its request.
                Ok(()) = evict => {}
                () = async {
                    answered.notified().await;
                    tokio::time::sleep(METRICS_ANSWER_TIMEOUT).await;
                } => log::debug!("metrics connection: the answer was not read in time; closed"),
            }
            waiting.borrow_mut().leave(id);
            drop(connection_slot);
        });
    }
}

/// The answer to one request, rendered off the daemon's thread while `slot` is held (503
/// without one); `answered` is told once it is ready.
async fn answer(
    slot: Option<OwnedSemaphorePermit>,
    health: Health,
    path: String,
    answered: Rc<Notify>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let Some(slot) = slot else {
        return Ok(response(503, "text/plain", "busy\n".into()));
    };
    // The slot goes with the render: a client gone meanwhile does not free it while the
    // render still runs.
    let answer = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        respond(&health, &path)
    })
    .await;
    let (status, content_type, body) =
        answer.unwrap_or_else(|error| (500, "text/plain", format!("metrics failed: {error}\n")));
    answered.notify_one();
    Ok(response(status, content_type, body))
}

fn response(status: u16, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}
