//! `shaper daemon -f FILE`: the command line of `shaper::daemon`. Here: the arguments,
//! the signals (SIGHUP reloads; SIGTERM and SIGINT stop, leaving everything attached
//! unless `--cleanup-on-exit`) and the HTTP listener for `/metrics` and `/healthz`.
//! Everything runs on one thread (a current-thread runtime), as the daemon needs.

use crate::cli::DaemonArgs;
use anyhow::Result;
use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;
use shaper::{
    daemon::{coordinate, retry_pause, Daemon},
    error::{runtime, usage},
};
use std::{cell::RefCell, convert::Infallible, net::SocketAddr, rc::Rc, time::Duration};
use tokio::{
    net::TcpListener,
    signal::unix::{signal, SignalKind},
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
        desired,
        !args.no_upgrade,
    )));
    daemon.borrow_mut().start();
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
            let response = respond(&daemon.borrow(), request.uri().path());
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

fn respond(daemon: &Daemon, path: &str) -> Response<Full<Bytes>> {
    let (status, content_type, body) = daemon.respond(path);
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}
