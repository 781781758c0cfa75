//! A TCP proxy on loopback between the daemons and Redis, for a bad day's network: it
//! forwards with a delay each way ([`Proxy::set_delay`]), or holds everything it
//! receives, forwarding nothing, as a path that black-holes packets does
//! ([`Proxy::hold`]); what it held goes on once it forwards again, as TCP's
//! retransmissions would deliver it. Threads per connection; every one stops on drop.

use anyhow::Result;
use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Forward { delay: Duration },
    Hold,
}

struct Shared {
    mode: Mutex<Mode>,
    stop: AtomicBool,
    streams: Mutex<Vec<TcpStream>>,
}

pub struct Proxy {
    pub port: u16,
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy to `127.0.0.1:upstream`, forwarding at once.
    pub fn start(upstream: u16) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Forward {
                delay: Duration::ZERO,
            }),
            stop: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
        });
        let accepting = shared.clone();
        thread::spawn(move || {
            while !accepting.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = connect(&accepting, client, upstream);
                    }
                    Err(_) => thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(Self { port, shared })
    }

    /// Forwards each way `delay` after it received (half a round trip).
    pub fn set_delay(&self, delay: Duration) {
        *self.shared.mode.lock().unwrap() = Mode::Forward { delay };
    }

    /// Forwards nothing from now on, and accepts but never answers new connections.
    pub fn hold(&self) {
        *self.shared.mode.lock().unwrap() = Mode::Hold;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for stream in self.shared.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

fn connect(shared: &Arc<Shared>, client: TcpStream, upstream: u16) -> Result<()> {
    client.set_nonblocking(false)?;
    let server = TcpStream::connect(("127.0.0.1", upstream))?;
    for stream in [&client, &server] {
        stream.set_nodelay(true)?;
        shared.streams.lock().unwrap().push(stream.try_clone()?);
    }
    pump(shared, client.try_clone()?, server.try_clone()?);
    pump(shared, server, client);
    Ok(())
}

/// `from` to `to`: a reader that stamps what it reads, a writer that sends it on when
/// the mode lets it.
fn pump(shared: &Arc<Shared>, mut from: TcpStream, mut to: TcpStream) {
    let (sender, received) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::spawn(move || {
        let mut buffer = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buffer) {
            if n == 0 || sender.send((Instant::now(), buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    let shared = shared.clone();
    thread::spawn(move || {
        while let Ok((at, bytes)) = received.recv() {
            loop {
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                let mode = *shared.mode.lock().unwrap();
                match mode {
                    Mode::Hold => thread::sleep(Duration::from_millis(10)),
                    Mode::Forward { delay } => {
                        if let Some(wait) = (at + delay).checked_duration_since(Instant::now()) {
                            thread::sleep(wait.min(Duration::from_millis(10)));
                            continue;
                        }
                        break;
                    }
                }
            }
            if to.write_all(&bytes).is_err() {
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
