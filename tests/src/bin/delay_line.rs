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
//! ignored). Each direction is one thread that does everything for it, so no frame waits
//! for a second thread to wake: it drains its receiving socket in batches (`recvmmsg`),
//! stamps every frame with the kernel's receive time, queues it in a ring of preallocated
//! slots with its due time, sends every frame that is due in one batch (`sendmmsg`), and
//! then sleeps in `ppoll` until the socket has more or the head is due (1 ns timer slack).
//! The delay is constant per direction, so the head is always due first and order is kept.
//! At most `--limit` frames (default 16 384) wait per direction; more are dropped and
//! counted.
//!
//! Keeping time on a busy 2-core machine (iperf3 and the shaped traffic use both cores):
//! the threads run SCHED_FIFO (`--rt-priority`, so the traffic's processes cannot hold them
//! off a core; left free to run on either core: pinned, they kept time no better under two
//! busy loops), with all memory locked (no page fault on the path), and every CPU asked to
//! poll rather than halt when idle while it runs (`/dev/cpu_dma_latency` 0; a halted
//! virtual CPU is woken through the hypervisor; `SHAPER_DELAY_LINE_NO_IDLE_POLL=1` leaves
//! them alone); a frame due before the thread could wake for it (its mean wake-up latency
//! plus 20 µs) leaves with the frames already due, a little early.
//!
//! Stdout, one JSON object a line: `{"event":"ready"}` once both sockets are bound, the
//! counters (`{"event":"counters",...}`, with how late frames left: p50/p99/p99.9 and the
//! worst) on SIGUSR1, and once more on SIGTERM or SIGINT, after which it exits 0. The
//! interfaces' offloads must be off (TSO/GSO/GRO on both sides): a packet socket cannot
//! send a 64 KiB super-frame out of a 1500-byte link.

use anyhow::{bail, Context as _, Result};
use nix::{
    libc,
    sys::{
        prctl,
        signal::{SigSet, Signal},
        time::TimeValLike as _,
    },
    time::{clock_gettime, ClockId},
};
use serde_json::{json, Value};
use shaper_tests::delay::binned_percentile;
use std::{
    collections::BTreeMap,
    io, mem,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    process::ExitCode,
    ptr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

/// A slot of the ring: any frame a 1500-byte link carries (1518 bytes with a VLAN tag); a
/// longer one (an offload left on, a jumbo frame) is counted as oversize and dropped.
const SLOT: usize = 2048;
/// Frames received or sent by one system call.
const BATCH: usize = 64;
/// Socket buffers: room for bursts while a thread is not scheduled (8 MiB is about 5 000
/// full-size frames, 0.6 s at 100 Mbit/s).
const SOCKET_BUFFER: libc::c_int = 8 << 20;
/// Frames that may wait per direction: 16 384 is 1.3 s at 100 Mbit/s of full-size frames,
/// in 32 MiB of locked slots.
const DEFAULT_LIMIT: usize = 16_384;
/// A kernel receive stamp older than this is not believed (the frame's own clock stamp
/// leaking through, a clock step): the thread's own stamp is used instead.
const STAMP_MAX_AGE_NS: i64 = 100_000_000;
/// A frame due this soon (beyond the wake-up latency) leaves with the frames already due.
const EARLY_SEND_NS: u64 = 20_000;
/// Most a thread aims early by, whatever wake-up latency it has seen.
const MAX_EARLY_NS: u64 = 500_000;
/// Room for one SCM_TIMESTAMPNS control message (CMSG_SPACE of a timespec, rounded up).
const CONTROL: usize = 64;

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
        limit: limit.clamp(1, 1 << 20),
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

fn check(result: libc::c_int, what: &str) -> Result<()> {
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error()).context(what.to_string())
    }
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` points to a live T of the size passed.
    let result = unsafe {
        libc::setsockopt(
            fd,
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

/// An AF_PACKET socket bound to one interface: every frame it receives, and promiscuous
/// so frames for the peers' MAC addresses are seen too.
struct PacketSocket {
    fd: OwnedFd,
    dev: String,
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
        let raw = fd.as_raw_fd();
        // Frames this socket sends would otherwise come back to it as outgoing ones.
        setsockopt(raw, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1)
            .context("PACKET_IGNORE_OUTGOING")?;
        // The kernel's receive time of every frame (CLOCK_REALTIME), with the frame.
        setsockopt(raw, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, &1).context("SO_TIMESTAMPNS")?;
        for (force, plain) in [
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
        ] {
            // FORCE passes net.core.*mem_max (as root); the plain option is capped by it.
            if setsockopt(raw, libc::SOL_SOCKET, force, &SOCKET_BUFFER).is_err() {
                setsockopt(raw, libc::SOL_SOCKET, plain, &SOCKET_BUFFER)
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
                raw,
                (&address as *const libc::sockaddr_ll).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        check(bound, &format!("bind to {dev}"))?;
        // SAFETY: packet_mreq is plain data; zero is a valid start.
        let mut membership: libc::packet_mreq = unsafe { mem::zeroed() };
        membership.mr_ifindex = ifindex;
        membership.mr_type = libc::PACKET_MR_PROMISC as u16;
        setsockopt(
            raw,
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

    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
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
                self.raw(),
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
}

/// Counts of a delay (ns) in bins: 10 µs wide below 2 ms, 1 ms wide up to 100 ms, then one
/// bin for the rest, whose edge reads 200 ms; percentiles are read as a bin's upper edge
/// (never below the truth, but for the last bin's).
struct Histogram {
    bins: Vec<AtomicU64>,
}

const FINE_BIN_NS: u64 = 10_000;
const FINE_UP_TO_NS: u64 = 2_000_000;
const COARSE_BIN_NS: u64 = 1_000_000;
const COARSE_UP_TO_NS: u64 = 100_000_000;
const FINE_BINS: usize = (FINE_UP_TO_NS / FINE_BIN_NS) as usize;
const BINS: usize = FINE_BINS + ((COARSE_UP_TO_NS - FINE_UP_TO_NS) / COARSE_BIN_NS) as usize + 1;

impl Histogram {
    fn new() -> Self {
        Self {
            bins: (0..BINS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn bin_of(ns: u64) -> usize {
        if ns < FINE_UP_TO_NS {
            (ns / FINE_BIN_NS) as usize
        } else if ns < COARSE_UP_TO_NS {
            FINE_BINS + ((ns - FINE_UP_TO_NS) / COARSE_BIN_NS) as usize
        } else {
            BINS - 1
        }
    }

    /// The upper edge of a bin (ns); the last bin's is unbounded, read as 200 ms.
    fn upper_edge(bin: usize) -> u64 {
        if bin < FINE_BINS {
            (bin as u64 + 1) * FINE_BIN_NS
        } else if bin < BINS - 1 {
            FINE_UP_TO_NS + (bin - FINE_BINS + 1) as u64 * COARSE_BIN_NS
        } else {
            2 * COARSE_UP_TO_NS
        }
    }

    fn add(&self, ns: u64) {
        self.bins[Self::bin_of(ns)].fetch_add(1, Ordering::Relaxed);
    }

    /// The bins that counted something: [upper edge µs, count] each, for a reader that
    /// takes the difference of two readings (the lateness over one run).
    fn nonzero_bins(&self) -> Vec<[u64; 2]> {
        self.bins
            .iter()
            .enumerate()
            .map(|(bin, count)| [Self::upper_edge(bin) / 1000, count.load(Ordering::Relaxed)])
            .filter(|[_, count]| *count > 0)
            .collect()
    }

    /// The `p`-th percentile (0 < p ≤ 100) in µs, by nearest rank; 0 with no sample.
    fn percentile_us(&self, p: f64) -> f64 {
        let bins: BTreeMap<u64, u64> = self
            .nonzero_bins()
            .into_iter()
            .map(|[edge, count]| (edge, count))
            .collect();
        binned_percentile(&bins, p)
    }
}

#[derive(Default)]
struct Counters {
    received: AtomicU64,
    received_bytes: AtomicU64,
    sent: AtomicU64,
    sent_bytes: AtomicU64,
    queued: AtomicU64,
    queue_full_drops: AtomicU64,
    oversize_drops: AtomicU64,
    receive_errors: AtomicU64,
    /// Dropped by the kernel before the thread read them (receive buffer full).
    socket_drops: AtomicU64,
    send_errors: AtomicU64,
    max_queue: AtomicU64,
    /// When frames left against their due time: the sum of (sent − due) (ns, two's
    /// complement: early frames count negative), the latest and the earliest (ns).
    error_sum_ns: AtomicU64,
    late_max_ns: AtomicU64,
    early_max_ns: AtomicU64,
}

/// The frames of one direction waiting for their due time, oldest first, in slots
/// allocated once (nothing is allocated while forwarding).
struct Ring {
    slots: Vec<u8>,
    lengths: Vec<usize>,
    due: Vec<u64>,
    head: usize,
    len: usize,
}

impl Ring {
    fn new(limit: usize) -> Self {
        Self {
            slots: vec![0; limit * SLOT],
            lengths: vec![0; limit],
            due: vec![0; limit],
            head: 0,
            len: 0,
        }
    }

    fn capacity(&self) -> usize {
        self.due.len()
    }

    /// The slot `offset` places after the head.
    fn index(&self, offset: usize) -> usize {
        (self.head + offset) % self.capacity()
    }

    fn slot(&mut self, index: usize) -> &mut [u8] {
        &mut self.slots[index * SLOT..(index + 1) * SLOT]
    }

    fn head_due(&self) -> Option<u64> {
        (self.len > 0).then(|| self.due[self.head])
    }
}

/// One direction: frames received on `from`, due at receive time + `delay`, sent on `to`.
struct Direction {
    name: String,
    from: Arc<PacketSocket>,
    to: Arc<PacketSocket>,
    delay_ns: u64,
    counters: Counters,
    /// How late frames left (sent − due, early ones as 0).
    lateness: Histogram,
    /// How long frames waited in the receiving socket before the thread read them.
    receive_lag: Histogram,
    /// Whether the thread got SCHED_FIFO (false: it shares the cores with the traffic).
    realtime: AtomicBool,
}

/// The buffers of one `recvmmsg` or `sendmmsg` call, reused every time.
struct Batch {
    headers: Vec<libc::mmsghdr>,
    vectors: Vec<libc::iovec>,
    controls: Vec<[u8; CONTROL]>,
}

impl Batch {
    fn new() -> Self {
        Self {
            // SAFETY: mmsghdr and iovec are plain data; zero is a valid start.
            headers: vec![unsafe { mem::zeroed() }; BATCH],
            vectors: vec![unsafe { mem::zeroed() }; BATCH],
            controls: vec![[0; CONTROL]; BATCH],
        }
    }

    /// Points message `i` at `buffer` (and its control space when `control`).
    fn set(&mut self, i: usize, buffer: &mut [u8], control: bool) {
        self.vectors[i] = libc::iovec {
            iov_base: buffer.as_mut_ptr().cast(),
            iov_len: buffer.len(),
        };
        // SAFETY: msghdr is plain data; zero is a valid start.
        let mut header: libc::msghdr = unsafe { mem::zeroed() };
        header.msg_iov = &mut self.vectors[i];
        header.msg_iovlen = 1;
        if control {
            header.msg_control = self.controls[i].as_mut_ptr().cast();
            header.msg_controllen = CONTROL;
        }
        self.headers[i] = libc::mmsghdr {
            msg_hdr: header,
            msg_len: 0,
        };
    }

    /// The kernel's receive stamp of message `i` (CLOCK_REALTIME ns), if it carries one.
    fn stamp(&self, i: usize) -> Option<i64> {
        let header = &self.headers[i].msg_hdr;
        // SAFETY: the kernel filled the control buffer and set its length; the CMSG macros
        // stay within msg_control/msg_controllen.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(header);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET
                    && (*cmsg).cmsg_type == libc::SO_TIMESTAMPNS
                {
                    let at: libc::timespec = ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                    return Some(at.tv_sec * 1_000_000_000 + at.tv_nsec);
                }
                cmsg = libc::CMSG_NXTHDR(header, cmsg);
            }
        }
        None
    }
}

impl Direction {
    /// Forwards forever with `ring`: receive what is there, send what is due, sleep until
    /// either.
    fn forward(&self, mut ring: Ring) {
        let mut batch = Batch::new();
        let mut scratch = vec![0u8; SLOT];
        // Mean wake-up latency of this thread (ns), an EWMA over its timed sleeps (1/16).
        let mut wake_latency: u64 = 0;
        loop {
            self.receive_all(&mut ring, &mut batch, &mut scratch);
            // A frame due before this thread could wake for it leaves now, a little early.
            let early = EARLY_SEND_NS + wake_latency.min(MAX_EARLY_NS);
            self.send_due(&mut ring, &mut batch, now_ns() + early);
            let wake_at = ring.head_due().map(|due| due - early);
            let now = now_ns();
            let timeout = wake_at.map(|at| {
                let wait = at.saturating_sub(now);
                libc::timespec {
                    tv_sec: (wait / 1_000_000_000) as libc::time_t,
                    tv_nsec: (wait % 1_000_000_000) as libc::c_long,
                }
            });
            let mut poll = libc::pollfd {
                fd: self.from.raw(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; the timeout, when given, outlives the call.
            let ready = unsafe {
                libc::ppoll(
                    &mut poll,
                    1,
                    timeout.as_ref().map_or(ptr::null(), |t| t as *const _),
                    ptr::null(),
                )
            };
            if let (0, Some(at)) = (ready, wake_at) {
                let woke = now_ns().saturating_sub(at);
                wake_latency = (wake_latency * 15 + woke) / 16;
            }
        }
    }

    /// Reads every frame waiting in the receiving socket into the ring (or drops it and
    /// counts why), without blocking.
    fn receive_all(&self, ring: &mut Ring, batch: &mut Batch, scratch: &mut [u8]) {
        let c = &self.counters;
        loop {
            let free = ring.capacity() - ring.len;
            // A full ring still drains the socket, into a scratch slot, counting drops.
            let count = free.clamp(1, BATCH);
            let mut indices = [0usize; BATCH];
            for (i, index) in indices.iter_mut().enumerate().take(count) {
                if free == 0 {
                    batch.set(i, scratch, true);
                } else {
                    *index = ring.index(ring.len + i);
                    let slot = ring.slot(*index);
                    // Points into the ring, which does not move while the batch is used.
                    let slot = unsafe { std::slice::from_raw_parts_mut(slot.as_mut_ptr(), SLOT) };
                    batch.set(i, slot, true);
                }
            }
            // SAFETY: `count` headers, each pointing at a live buffer and control space.
            let received = unsafe {
                libc::recvmmsg(
                    self.from.raw(),
                    batch.headers.as_mut_ptr(),
                    count as libc::c_uint,
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    ptr::null_mut(),
                )
            };
            if received < 0 {
                let error = io::Error::last_os_error();
                match error.kind() {
                    io::ErrorKind::WouldBlock => return,
                    io::ErrorKind::Interrupted => continue,
                    // A link going down reports ENETDOWN once; keep going.
                    _ => {
                        c.receive_errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
            let (mono, real) = (now_ns(), clock_ns(ClockId::CLOCK_REALTIME) as i64);
            for (i, &slot) in indices.iter().enumerate().take(received as usize) {
                let length = batch.headers[i].msg_len as usize;
                c.received.fetch_add(1, Ordering::Relaxed);
                c.received_bytes.fetch_add(length as u64, Ordering::Relaxed);
                // The stamp's age by the real-time clock, carried over to the monotonic one.
                let age = batch
                    .stamp(i)
                    .map(|at| real - at)
                    .filter(|age| (0..STAMP_MAX_AGE_NS).contains(age));
                let arrived = match age {
                    Some(age) => {
                        self.receive_lag.add(age as u64);
                        mono - age as u64
                    }
                    None => mono,
                };
                if length > SLOT {
                    c.oversize_drops.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if free == 0 {
                    c.queue_full_drops.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                // Frames are received into the slots in order; an oversize one leaves a
                // hole, so each kept frame moves into the next free slot.
                let index = ring.index(ring.len);
                if index != slot {
                    ring.slots
                        .copy_within(slot * SLOT..slot * SLOT + length, index * SLOT);
                }
                ring.lengths[index] = length;
                ring.due[index] = arrived + self.delay_ns;
                ring.len += 1;
            }
            c.queued.store(ring.len as u64, Ordering::Relaxed);
            c.max_queue.fetch_max(ring.len as u64, Ordering::Relaxed);
            if (received as usize) < count {
                return;
            }
        }
    }

    /// Sends every frame due by `by` in batches, and counts how late each left.
    fn send_due(&self, ring: &mut Ring, batch: &mut Batch, by: u64) {
        let c = &self.counters;
        loop {
            let mut count = 0;
            while count < BATCH.min(ring.len) {
                let index = ring.index(count);
                if ring.due[index] > by {
                    break;
                }
                let length = ring.lengths[index];
                let slot = ring.slot(index);
                // Points into the ring, which does not move while the batch is used.
                let frame = unsafe { std::slice::from_raw_parts_mut(slot.as_mut_ptr(), length) };
                batch.set(count, frame, false);
                count += 1;
            }
            if count == 0 {
                return;
            }
            let sent_at = now_ns();
            // SAFETY: `count` headers, each pointing at a frame in the ring. A bound packet
            // socket sends out of its interface, the protocol read from the frame.
            let sent = unsafe {
                libc::sendmmsg(
                    self.to.raw(),
                    batch.headers.as_mut_ptr(),
                    count as libc::c_uint,
                    0,
                )
            };
            // The frames it took, and one more that failed (ENOBUFS: the peer's backlog
            // is full; a link that is down): lost, as on a wire.
            let (taken, failed) = if sent < 0 {
                (0, 1)
            } else {
                let sent = sent as usize;
                (sent, usize::from(sent < count))
            };
            for offset in 0..taken + failed {
                let index = ring.index(offset);
                let due = ring.due[index];
                if offset < taken {
                    c.sent.fetch_add(1, Ordering::Relaxed);
                    c.sent_bytes
                        .fetch_add(ring.lengths[index] as u64, Ordering::Relaxed);
                } else {
                    c.send_errors.fetch_add(1, Ordering::Relaxed);
                }
                c.error_sum_ns
                    .fetch_add(sent_at.wrapping_sub(due), Ordering::Relaxed);
                let late = sent_at.saturating_sub(due);
                self.lateness.add(late);
                c.late_max_ns.fetch_max(late, Ordering::Relaxed);
                c.early_max_ns
                    .fetch_max(due.saturating_sub(sent_at), Ordering::Relaxed);
            }
            ring.head = ring.index(taken + failed);
            ring.len -= taken + failed;
            c.queued.store(ring.len as u64, Ordering::Relaxed);
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
            "queued": get(&c.queued),
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
            "late_bins": self.lateness.nonzero_bins(),
            "late_p50_us": self.lateness.percentile_us(50.0),
            "late_p99_us": self.lateness.percentile_us(99.0),
            "late_p999_us": self.lateness.percentile_us(99.9),
            "late_max_us": get(&c.late_max_ns) as f64 / 1e3,
            "early_max_us": get(&c.early_max_ns) as f64 / 1e3,
            "receive_lag_p99_us": self.receive_lag.percentile_us(99.0),
            "realtime": self.realtime.load(Ordering::Relaxed),
        })
    }
}

/// Puts the calling thread on SCHED_FIFO at `priority` (if not 0), so a busy machine
/// delays frames less; a failure (no CAP_SYS_NICE, no RT budget in this cgroup) only warns.
/// Whether the thread is on SCHED_FIFO now.
fn realtime(priority: i32, what: &str) -> bool {
    let mut granted = false;
    if priority > 0 {
        let param = libc::sched_param {
            sched_priority: priority,
        };
        // SAFETY: pid 0 is the calling thread; `param` is valid.
        granted = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } == 0;
        if !granted {
            eprintln!(
                "shaper-delay-line: {what}: SCHED_FIFO {priority} refused ({}), \
                 staying on the normal scheduler",
                io::Error::last_os_error()
            );
        }
    }
    granted
}

/// Asks every CPU to poll in its idle loop instead of halting (a PM QoS request of 0 µs
/// exit latency on /dev/cpu_dma_latency, held while the file is open). In a VM a halted
/// virtual CPU must be woken by the hypervisor, which on a busy host takes milliseconds
/// (measured here: a 300 µs sleep overslept p99 175-587 µs free, 108-146 µs with this);
/// a polling one takes the timer or the frame at once. A refusal only warns.
fn idle_poll() -> Option<std::fs::File> {
    use std::io::Write as _;
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/cpu_dma_latency")
        .and_then(|mut file| file.write_all(&0i32.to_ne_bytes()).map(|()| file));
    match opened {
        Ok(file) => Some(file),
        Err(error) => {
            eprintln!(
                "shaper-delay-line: /dev/cpu_dma_latency refused ({error}), idle CPUs may halt"
            );
            None
        }
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
    // sleep of the forwarding threads.
    prctl::set_timerslack(1).context("PR_SET_TIMERSLACK")?;
    // Every page resident from the start and never paged out: a page fault on the path
    // would hold a frame back. A refusal (no CAP_IPC_LOCK) only warns.
    // SAFETY: mlockall takes flags only.
    if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) } != 0 {
        eprintln!(
            "shaper-delay-line: mlockall refused ({}), memory stays pageable",
            io::Error::last_os_error()
        );
    }

    // Held open for the delay line's life (the kernel drops the request when it closes).
    let _idle_poll = if std::env::var_os("SHAPER_DELAY_LINE_NO_IDLE_POLL").is_some() {
        None
    } else {
        idle_poll()
    };

    let a = Arc::new(PacketSocket::open(&args.a)?);
    let b = Arc::new(PacketSocket::open(&args.b)?);
    let direction = |from: &Arc<PacketSocket>, to: &Arc<PacketSocket>, delay: Duration| {
        Arc::new(Direction {
            name: format!("{}->{}", from.dev, to.dev),
            from: from.clone(),
            to: to.clone(),
            delay_ns: delay.as_nanos() as u64,
            counters: Counters::default(),
            lateness: Histogram::new(),
            receive_lag: Histogram::new(),
            realtime: AtomicBool::new(false),
        })
    };
    let ab = direction(&a, &b, args.delay_ab);
    let ba = direction(&b, &a, args.delay_ba);
    for dir in [&ab, &ba] {
        let (dir, priority) = (dir.clone(), args.rt_priority);
        // Allocated (and, locked, faulted in: tens of ms) before `ready`, not on the path.
        let ring = Ring::new(args.limit);
        thread::Builder::new()
            .name(format!("fwd {}", dir.from.dev))
            .spawn(move || {
                let granted = realtime(priority, "forwarding thread");
                dir.realtime.store(granted, Ordering::Relaxed);
                dir.forward(ring)
            })
            .context("spawning a forwarding thread")?;
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

    #[test]
    fn lateness_percentiles_are_read_from_the_bins_upper_edges() {
        let histogram = Histogram::new();
        assert_eq!(histogram.percentile_us(99.0), 0.0);
        // 98 frames 5 µs late, one 1.5 ms late, one 30 ms late.
        for _ in 0..98 {
            histogram.add(5_000);
        }
        histogram.add(1_500_000);
        histogram.add(30_000_000);
        assert_eq!(histogram.percentile_us(50.0), 10.0);
        assert_eq!(histogram.percentile_us(98.0), 10.0);
        assert_eq!(histogram.percentile_us(99.0), 1510.0);
        assert_eq!(histogram.percentile_us(100.0), 31_000.0);
        // Past the last bound: read as 200 ms, apart from the last bounded bin's 100 ms.
        histogram.add(99_500_000);
        histogram.add(5_000_000_000);
        assert_eq!(histogram.percentile_us(100.0), 200_000.0);
        assert_eq!(
            histogram.nonzero_bins().last_chunk::<2>(),
            Some(&[[100_000, 1], [200_000, 1]])
        );
        assert_eq!(Histogram::bin_of(1_999_999), FINE_BINS - 1);
        assert_eq!(Histogram::upper_edge(FINE_BINS), 3_000_000);
    }
}
