//! `shaper-delay-line`: a constant one-way delay between two interfaces of one network
//! namespace, each direction with its own delay. The lab's kernel has no netem, so this is
//! how a lab gets a base RTT ([`shaper_tests::Lab::with_delay`]).
//!
//! ```text
//! shaper-delay-line --a DEV --b DEV --delay-ab-ms MS --delay-ba-ms MS
//!                   [--limit FRAMES] [--rt-priority N]
//! ```
//!
//! Each interface has one AF_PACKET socket (all protocols, promiscuous, its own sends
//! ignored). Per direction a receive thread stamps every frame with CLOCK_MONOTONIC and
//! queues it with its due time; a send thread sleeps until the head's due time (absolute
//! `clock_nanosleep`, 1 ns timer slack) and sends it out of the other interface. The delay
//! is constant per direction, so the head is always due first and order is kept. At most
//! `--limit` frames (default 100 000) wait per direction; more are dropped and counted.
//!
//! Two thread wake-ups per direction would otherwise add their latency to the delay
//! (about 0.1 ms each on a VM): the receive stamp is the kernel's (SO_TIMESTAMPNS, taken
//! when the frame reached the interface), and the send thread aims early by the mean
//! wake-up latency it has seen.
//!
//! Stdout, one JSON object a line: `{"event":"ready"}` once both sockets are bound, the
//! counters (`{"event":"counters",...}`) on SIGUSR1, and once more on SIGTERM or SIGINT,
//! after which it exits 0. The interfaces' offloads must be off (TSO/GSO/GRO on both
//! sides): a packet socket cannot send a 64 KiB super-frame out of a 1500-byte link.

use anyhow::{bail, Context as _, Result};
use nix::{
    libc,
    sys::{
        prctl,
        signal::{SigSet, Signal},
        socket::{recvmsg, setsockopt as set_option, sockopt, ControlMessageOwned, MsgFlags},
        time::{TimeSpec, TimeValLike as _},
    },
    time::{clock_gettime, clock_nanosleep, ClockId, ClockNanosleepFlags},
};
use serde_json::{json, Value};
use std::{
    collections::VecDeque,
    io::{self, IoSliceMut},
    mem,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    process::ExitCode,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Condvar, Mutex,
    },
    thread,
    time::Duration,
};

/// Receive buffer: any frame the link can carry (1518 bytes and jumbo frames alike); a
/// longer one (an offload left on) is counted as oversize and dropped.
const FRAME_BUFFER: usize = 64 * 1024;
/// Socket buffers: room for bursts while a thread is not scheduled (8 MiB is about 5 000
/// full-size frames, 0.6 s at 100 Mbit/s).
const SOCKET_BUFFER: libc::c_int = 8 << 20;
const DEFAULT_LIMIT: usize = 100_000;
/// A kernel receive stamp older than this is not believed (the frame's own clock stamp
/// leaking through, a clock step): the thread's own stamp is used instead.
const STAMP_MAX_AGE_NS: i64 = 100_000_000;
/// Most the send thread aims early by, whatever wake-up latency it has seen.
const MAX_EARLY_NS: u64 = 500_000;

struct Args {
    a: String,
    b: String,
    delay_ab: Duration,
    delay_ba: Duration,
    limit: usize,
    /// SCHED_FIFO priority of the forwarding threads; 0 keeps the normal scheduler.
    rt_priority: i32,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args> {
    let (mut a, mut b, mut delay_ab, mut delay_ba) = (None, None, None, None);
    let (mut limit, mut rt_priority) = (DEFAULT_LIMIT, 0);
    let milliseconds = |value: &str| -> Result<Duration> {
        let ms: f64 = value
            .parse()
            .with_context(|| format!("bad delay {value:?}"))?;
        if !(0.0..=60_000.0).contains(&ms) {
            bail!("delay {ms} ms is outside 0..=60000 ms");
        }
        Ok(Duration::from_secs_f64(ms / 1e3))
    };
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--a" => a = Some(value),
            "--b" => b = Some(value),
            "--delay-ab-ms" => delay_ab = Some(milliseconds(&value)?),
            "--delay-ba-ms" => delay_ba = Some(milliseconds(&value)?),
            "--limit" => limit = value.parse().context("bad --limit")?,
            "--rt-priority" => rt_priority = value.parse().context("bad --rt-priority")?,
            _ => bail!("unknown argument {flag:?}"),
        }
    }
    Ok(Args {
        a: a.context("--a DEV is required")?,
        b: b.context("--b DEV is required")?,
        delay_ab: delay_ab.context("--delay-ab-ms is required")?,
        delay_ba: delay_ba.context("--delay-ba-ms is required")?,
        limit: limit.max(1),
        rt_priority,
    })
}

/// A clock in nanoseconds.
fn clock_ns(clock: ClockId) -> u64 {
    let now = clock_gettime(clock).expect("the clocks are readable");
    now.num_nanoseconds() as u64
}

/// CLOCK_MONOTONIC in nanoseconds.
fn now_ns() -> u64 {
    clock_ns(ClockId::CLOCK_MONOTONIC)
}

/// Sleeps until CLOCK_MONOTONIC reaches `due_ns`: an absolute deadline does not drift by
/// the time spent between reading the clock and sleeping.
fn sleep_until(due_ns: u64) {
    let due = TimeSpec::new(
        (due_ns / 1_000_000_000) as libc::time_t,
        (due_ns % 1_000_000_000) as libc::c_long,
    );
    // EINTR (a signal) just sleeps again; nothing else can fail with a valid time.
    while clock_nanosleep(
        ClockId::CLOCK_MONOTONIC,
        ClockNanosleepFlags::TIMER_ABSTIME,
        &due,
    ) == Err(nix::errno::Errno::EINTR)
    {}
}

/// An AF_PACKET socket bound to one interface: every frame it receives, and promiscuous
/// so frames for the peers' MAC addresses are seen too.
struct PacketSocket {
    fd: OwnedFd,
    dev: String,
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` points to a live T of the size passed.
    let result = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl PacketSocket {
    fn open(dev: &str) -> Result<Self> {
        let ifindex = nix::net::if_::if_nametoindex(dev)
            .with_context(|| format!("no interface {dev}"))? as libc::c_int;
        // Protocol 0: no frame is queued before `bind` picks the interface (with ETH_P_ALL
        // here, frames of every interface would arrive until then).
        // SAFETY: plain socket(2); the descriptor is owned right away.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error()).context("socket(AF_PACKET)");
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // Frames this socket sends would otherwise come back to it as outgoing ones.
        setsockopt(
            &fd,
            libc::SOL_PACKET,
            libc::PACKET_IGNORE_OUTGOING,
            &1 as &libc::c_int,
        )
        .context("PACKET_IGNORE_OUTGOING")?;
        // The kernel's receive time of every frame (CLOCK_REALTIME), with the frame.
        set_option(&fd, sockopt::ReceiveTimestampns, &true).context("SO_TIMESTAMPNS")?;
        for (force, plain) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        ] {
            // FORCE passes net.core.*mem_max (as root); the plain option is capped by it.
            if setsockopt(&fd, libc::SOL_SOCKET, force, &SOCKET_BUFFER).is_err() {
                setsockopt(&fd, libc::SOL_SOCKET, plain, &SOCKET_BUFFER)
                    .context("socket buffer size")?;
            }
        }
        // SAFETY: sockaddr_ll is plain data; zero is a valid start.
        let mut address: libc::sockaddr_ll = unsafe { mem::zeroed() };
        address.sll_family = libc::AF_PACKET as u16;
        address.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        address.sll_ifindex = ifindex;
        // SAFETY: `address` is a valid sockaddr_ll of the size passed.
        let bound = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&address as *const libc::sockaddr_ll).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if bound != 0 {
            return Err(io::Error::last_os_error()).with_context(|| format!("bind to {dev}"));
        }
        // SAFETY: packet_mreq is plain data; zero is a valid start.
        let mut membership: libc::packet_mreq = unsafe { mem::zeroed() };
        membership.mr_ifindex = ifindex;
        membership.mr_type = libc::PACKET_MR_PROMISC as u16;
        setsockopt(
            &fd,
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            &membership,
        )
        .with_context(|| format!("promiscuous mode on {dev}"))?;
        Ok(Self {
            fd,
            dev: dev.to_string(),
        })
    }

    /// One frame into `buffer`: its full length (longer than the buffer when truncated)
    /// and when it arrived (CLOCK_MONOTONIC ns; the kernel's stamp when there is one).
    fn receive(&self, buffer: &mut [u8], control: &mut Vec<u8>) -> io::Result<(usize, u64)> {
        let mut iov = [IoSliceMut::new(buffer)];
        // MSG_TRUNC: a packet socket then returns the frame's full length.
        let message = recvmsg::<()>(
            self.fd.as_raw_fd(),
            &mut iov,
            Some(control),
            MsgFlags::MSG_TRUNC,
        )?;
        let (mono, real) = (now_ns(), clock_ns(ClockId::CLOCK_REALTIME));
        let stamp = message.cmsgs().ok().and_then(|mut cmsgs| {
            cmsgs.find_map(|cmsg| match cmsg {
                ControlMessageOwned::ScmTimestampns(at) => Some(at.num_nanoseconds()),
                _ => None,
            })
        });
        // The stamp's age by the real-time clock, carried over to the monotonic one.
        let age = stamp.map_or(0, |at| real as i64 - at);
        let arrived = if (0..STAMP_MAX_AGE_NS).contains(&age) {
            mono - age as u64
        } else {
            mono
        };
        Ok((message.bytes, arrived))
    }

    /// Frames the kernel dropped because this socket's receive buffer was full, since the
    /// last call (PACKET_STATISTICS resets on read).
    fn kernel_drops(&self) -> u64 {
        // SAFETY: tpacket_stats is plain data; zero is a valid start.
        let mut stats: libc::tpacket_stats = unsafe { mem::zeroed() };
        let mut length = mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: `stats` is valid for `length` bytes.
        let result = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut stats as *mut libc::tpacket_stats).cast(),
                &mut length,
            )
        };
        if result == 0 {
            u64::from(stats.tp_drops)
        } else {
            0
        }
    }

    fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: the frame is valid for its length. A bound packet socket sends out of
        // its interface, with the protocol read from the frame's Ethernet header.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    received_bytes: AtomicU64,
    sent: AtomicU64,
    sent_bytes: AtomicU64,
    queue_full_drops: AtomicU64,
    oversize_drops: AtomicU64,
    receive_errors: AtomicU64,
    /// Dropped by the kernel before the receive thread read them (receive buffer full).
    socket_drops: AtomicU64,
    send_errors: AtomicU64,
    max_queue: AtomicU64,
    /// When frames left against their due time: the sum of (sent − due) (ns, two's
    /// complement: early frames count negative), the latest and the earliest (ns).
    error_sum_ns: AtomicU64,
    late_max_ns: AtomicU64,
    early_max_ns: AtomicU64,
    /// Frames that left more than 1 ms / 5 ms after their due time (a thread held off
    /// its CPU: how often the lab itself adds jitter).
    late_over_1ms: AtomicU64,
    late_over_5ms: AtomicU64,
}

/// One direction: frames received on `from`, due at receive time + `delay`, sent on `to`.
struct Direction {
    name: String,
    /// The receiving socket, for the kernel's drop count.
    from: Arc<PacketSocket>,
    delay_ns: u64,
    limit: usize,
    queue: Mutex<VecDeque<(u64, Vec<u8>)>>,
    queued: Condvar,
    counters: Counters,
}

impl Direction {
    fn receive_loop(&self, from: &PacketSocket) {
        let mut buffer = vec![0u8; FRAME_BUFFER];
        let mut control = nix::cmsg_space!(libc::timespec);
        let c = &self.counters;
        loop {
            let (length, arrived) = match from.receive(&mut buffer, &mut control) {
                Ok(received) => received,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    // A link going down reports ENETDOWN once; keep going, without spinning.
                    c.receive_errors.fetch_add(1, Ordering::Relaxed);
                    thread::sleep(Duration::from_millis(1));
                    continue;
                }
            };
            let due = arrived + self.delay_ns;
            c.received.fetch_add(1, Ordering::Relaxed);
            c.received_bytes.fetch_add(length as u64, Ordering::Relaxed);
            if length > buffer.len() {
                c.oversize_drops.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let frame = buffer[..length].to_vec();
            let mut queue = self.queue.lock().expect("queue lock");
            if queue.len() >= self.limit {
                c.queue_full_drops.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            queue.push_back((due, frame));
            c.max_queue.fetch_max(queue.len() as u64, Ordering::Relaxed);
            drop(queue);
            self.queued.notify_one();
        }
    }

    fn send_loop(&self, to: &PacketSocket) {
        let c = &self.counters;
        // Mean wake-up latency of this thread (ns), an EWMA over its sleeps (1/16 a sleep).
        let mut wake_latency: u64 = 0;
        loop {
            let (due, frame) = {
                let mut queue = self.queue.lock().expect("queue lock");
                loop {
                    if let Some(head) = queue.pop_front() {
                        break head;
                    }
                    queue = self.queued.wait(queue).expect("queue lock");
                }
            };
            // Constant delay: every later frame is due later, so sleeping on this one
            // cannot hold back another. Aimed early by the usual wake-up latency, so that
            // on average it leaves at its due time.
            let wake_at = due.saturating_sub(wake_latency.min(MAX_EARLY_NS));
            if now_ns() < wake_at {
                sleep_until(wake_at);
                let woke = now_ns().saturating_sub(wake_at);
                wake_latency = (wake_latency * 15 + woke) / 16;
            }
            let sent_at = now_ns();
            c.error_sum_ns
                .fetch_add(sent_at.wrapping_sub(due), Ordering::Relaxed);
            let late = sent_at.saturating_sub(due);
            c.late_max_ns.fetch_max(late, Ordering::Relaxed);
            if late > 1_000_000 {
                c.late_over_1ms.fetch_add(1, Ordering::Relaxed);
            }
            if late > 5_000_000 {
                c.late_over_5ms.fetch_add(1, Ordering::Relaxed);
            }
            c.early_max_ns
                .fetch_max(due.saturating_sub(sent_at), Ordering::Relaxed);
            match to.send(&frame) {
                Ok(()) => {
                    c.sent.fetch_add(1, Ordering::Relaxed);
                    c.sent_bytes
                        .fetch_add(frame.len() as u64, Ordering::Relaxed);
                }
                // ENOBUFS (the peer's backlog is full) or a link that is down: the frame
                // is lost, as on a wire.
                Err(_) => {
                    c.send_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn counters(&self) -> Value {
        let c = &self.counters;
        c.socket_drops
            .fetch_add(self.from.kernel_drops(), Ordering::Relaxed);
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let sent = get(&c.sent);
        let handled = sent + get(&c.send_errors);
        json!({
            "name": self.name,
            "delay_ms": self.delay_ns as f64 / 1e6,
            "received": get(&c.received),
            "received_bytes": get(&c.received_bytes),
            "sent": sent,
            "sent_bytes": get(&c.sent_bytes),
            "queued": self.queue.lock().map(|q| q.len()).unwrap_or(0),
            "queue_full_drops": get(&c.queue_full_drops),
            "oversize_drops": get(&c.oversize_drops),
            "receive_errors": get(&c.receive_errors),
            "socket_drops": get(&c.socket_drops),
            "send_errors": get(&c.send_errors),
            "max_queue": get(&c.max_queue),
            // Mean of (sent − due): about 0 when the wake-up compensation works.
            "error_mean_us": if handled > 0 {
                get(&c.error_sum_ns) as i64 as f64 / handled as f64 / 1e3
            } else {
                0.0
            },
            "late_max_us": get(&c.late_max_ns) as f64 / 1e3,
            "early_max_us": get(&c.early_max_ns) as f64 / 1e3,
            "late_over_1ms": get(&c.late_over_1ms),
            "late_over_5ms": get(&c.late_over_5ms),
        })
    }
}

/// Puts the calling thread on SCHED_FIFO at `priority` (if not 0), so a busy machine
/// delays frames less; a failure (no CAP_SYS_NICE, no RT budget in this cgroup) only warns.
fn realtime(priority: i32, what: &str) {
    if priority <= 0 {
        return;
    }
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; `param` is valid.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        eprintln!(
            "shaper-delay-line: {what}: SCHED_FIFO {priority} refused ({}), \
             staying on the normal scheduler",
            io::Error::last_os_error()
        );
    }
}

fn counters_line(directions: &[&Arc<Direction>]) -> String {
    json!({
        "event": "counters",
        "directions": directions.iter().map(|d| d.counters()).collect::<Vec<_>>(),
    })
    .to_string()
}

fn run() -> Result<()> {
    let args = parse_args(std::env::args().skip(1))?;
    // Blocked in every thread (they inherit the mask) and taken by `wait` below, so no
    // signal interrupts a forwarding thread and no handler runs in async context.
    let mut signals = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGUSR1] {
        signals.add(signal);
    }
    signals.thread_block().context("blocking signals")?;
    // Timer slack is per thread and inherited: the default 50 µs would be added to every
    // sleep of the send threads.
    prctl::set_timerslack(1).context("PR_SET_TIMERSLACK")?;

    let a = Arc::new(PacketSocket::open(&args.a)?);
    let b = Arc::new(PacketSocket::open(&args.b)?);
    let direction = |from: &Arc<PacketSocket>, to: &PacketSocket, delay: Duration| {
        Arc::new(Direction {
            name: format!("{}->{}", from.dev, to.dev),
            from: from.clone(),
            delay_ns: delay.as_nanos() as u64,
            limit: args.limit,
            queue: Mutex::new(VecDeque::new()),
            queued: Condvar::new(),
            counters: Counters::default(),
        })
    };
    let ab = direction(&a, &b, args.delay_ab);
    let ba = direction(&b, &a, args.delay_ba);
    for (dir, from, to) in [(&ab, &a, &b), (&ba, &b, &a)] {
        let (receiving, receive_dir) = (from.clone(), dir.clone());
        let priority = args.rt_priority;
        thread::Builder::new()
            .name(format!("rx {}", from.dev))
            .spawn(move || {
                realtime(priority, "receive thread");
                receive_dir.receive_loop(&receiving)
            })
            .context("spawning a receive thread")?;
        let (sending, send_dir) = (to.clone(), dir.clone());
        thread::Builder::new()
            .name(format!("tx {}", to.dev))
            .spawn(move || {
                realtime(priority, "send thread");
                send_dir.send_loop(&sending)
            })
            .context("spawning a send thread")?;
    }
    println!(
        "{}",
        json!({"event": "ready", "a": args.a, "b": args.b,
               "delay_ab_ms": args.delay_ab.as_secs_f64() * 1e3,
               "delay_ba_ms": args.delay_ba.as_secs_f64() * 1e3})
    );
    loop {
        let signal = signals.wait().context("waiting for a signal")?;
        println!("{}", counters_line(&[&ab, &ba]));
        if signal != Signal::SIGUSR1 {
            return Ok(());
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("shaper-delay-line: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Result<Args> {
        parse_args(line.split_whitespace().map(str::to_string))
    }

    #[test]
    fn arguments_take_fractional_milliseconds() {
        let parsed = args("--a d0 --b d1 --delay-ab-ms 20 --delay-ba-ms 0.25").unwrap();
        assert_eq!((parsed.a.as_str(), parsed.b.as_str()), ("d0", "d1"));
        assert_eq!(parsed.delay_ab, Duration::from_millis(20));
        assert_eq!(parsed.delay_ba, Duration::from_micros(250));
        assert_eq!((parsed.limit, parsed.rt_priority), (DEFAULT_LIMIT, 0));
        assert!(args("--a d0 --b d1 --delay-ab-ms 20").is_err());
        assert!(args("--a d0 --b d1 --delay-ab-ms -1 --delay-ba-ms 1").is_err());
        assert!(args("--a d0 --b d1 --delay-ab-ms 1 --delay-ba-ms 1 --bogus 1").is_err());
    }
}
