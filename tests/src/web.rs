//! Web-like short transfers (issue 52's held-out mix): the client opens a new TCP
//! connection at a fixed pace, uploads a small object and waits for the server's one-byte
//! answer, so each transfer's completion time is what a page's request feels beside bulk
//! traffic. Bounded in count and time; every socket has timeouts; the server listens in
//! the server's namespace only and stops with the run.

use crate::topology::Netns;
use anyhow::{Context as _, Result};
use std::{
    io::{ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

/// The load: a `bytes` upload every `every`, for `seconds`.
#[derive(Clone, Copy, Debug)]
pub struct ShortUploads {
    pub bytes: usize,
    pub every: Duration,
    pub seconds: u32,
}

/// One transfer: its start (s since the load began) and its completion time (ms), None
/// when it did not complete within [`TRANSFER_LIMIT`].
#[derive(Clone, Copy, Debug)]
pub struct Transfer {
    pub started_s: f64,
    pub completion_ms: Option<f64>,
}

/// How long one transfer may take before it counts as failed.
pub const TRANSFER_LIMIT: Duration = Duration::from_secs(10);

/// Starts the server in `server` on `target:port`, then the uploads from `client` (on a
/// thread); joins to every transfer, in the order they started, once the last is done.
pub fn short_uploads(
    client: &Netns,
    server: &Netns,
    target: &str,
    port: u16,
    load: ShortUploads,
) -> Result<thread::JoinHandle<Result<Vec<Transfer>>>> {
    let address: SocketAddr = format!("{target}:{port}")
        .parse()
        .with_context(|| format!("{target}:{port} is not an address"))?;
    let stop = Arc::new(AtomicBool::new(false));
    // The last upload starts before `seconds` and ends within its limit.
    let longest = Duration::from_secs(u64::from(load.seconds) + 2) + TRANSFER_LIMIT;
    let sink = start_sink(server, address, Arc::clone(&stop), longest)?;
    let client = client.clone();
    Ok(thread::spawn(move || {
        let transfers = uploads(&client, address, load);
        stop.store(true, Ordering::Relaxed);
        sink.join().expect("the sink panicked")?;
        transfers
    }))
}

/// The server: reads each connection to its end and answers one byte; stops when `stop`
/// is set (or at the latest when no run could still be going).
fn start_sink(
    server: &Netns,
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    longest: Duration,
) -> Result<thread::JoinHandle<Result<()>>> {
    let server = server.clone();
    let (ready, listening) = mpsc::channel();
    let sink = thread::spawn(move || -> Result<()> {
        let listener = server
            .enter()
            .and_then(|()| {
                let listener = TcpListener::bind(address)
                    .with_context(|| format!("cannot listen on {address}"))?;
                listener.set_nonblocking(true)?;
                Ok(listener)
            })
            .inspect_err(|error| {
                let _ = ready.send(Err(format!("{error:#}")));
            })?;
        let _ = ready.send(Ok(()));
        let deadline = Instant::now() + longest;
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match listener.accept() {
                Ok((stream, _)) => {
                    thread::spawn(move || answer(stream));
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    thread::sleep(Duration::from_millis(2));
                }
                Err(error) => return Err(error).context("accept"),
            }
        }
        Ok(())
    });
    match listening.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => Ok(sink),
        Ok(Err(error)) => anyhow::bail!("the short transfers' server: {error}"),
        Err(_) => anyhow::bail!("the short transfers' server did not start"),
    }
}

/// Reads a connection to its end, then answers one byte.
fn answer(mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(TRANSFER_LIMIT))?;
    stream.set_write_timeout(Some(TRANSFER_LIMIT))?;
    let mut buffer = [0u8; 16 * 1024];
    while stream.read(&mut buffer)? > 0 {}
    stream.write_all(b"k")
}

/// The uploads, each on its own thread so that a slow one does not delay the next.
fn uploads(client: &Netns, address: SocketAddr, load: ShortUploads) -> Result<Vec<Transfer>> {
    client.enter()?;
    let count = (f64::from(load.seconds) / load.every.as_secs_f64()).floor() as u32;
    let start = Instant::now();
    let mut running = Vec::new();
    for n in 0..count {
        let due = start + load.every * n;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        let started_s = start.elapsed().as_secs_f64();
        // The thread inherits this one's namespace (setns is per task, copied on clone).
        running.push(thread::spawn(move || Transfer {
            started_s,
            completion_ms: upload(address, load.bytes).ok(),
        }));
    }
    Ok(running
        .into_iter()
        .map(|handle| handle.join().expect("an upload panicked"))
        .collect())
}

/// One upload: connect, send `bytes`, half-close, wait for the answer; its time (ms).
fn upload(address: SocketAddr, bytes: usize) -> std::io::Result<f64> {
    let began = Instant::now();
    let mut stream = TcpStream::connect_timeout(&address, TRANSFER_LIMIT)?;
    stream.set_write_timeout(Some(TRANSFER_LIMIT))?;
    stream.set_read_timeout(Some(TRANSFER_LIMIT))?;
    stream.write_all(&vec![0u8; bytes])?;
    stream.shutdown(Shutdown::Write)?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer)?;
    let elapsed = began.elapsed();
    if elapsed > TRANSFER_LIMIT {
        return Err(ErrorKind::TimedOut.into());
    }
    Ok(elapsed.as_secs_f64() * 1e3)
}
