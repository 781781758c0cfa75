//! The delay line of a lab with a base RTT ([`crate::Lab::with_delay`]): a fourth
//! namespace between router and server whose `shaper-delay-line` bridges `d0` (toward the
//! router's `r1`) and `d1` (toward the server's `s0`), adding a constant one-way delay in
//! each direction. The lab's kernel has no netem, so this is how its paths get an RTT.
//!
//! ```text
//!  router ns                 delay ns                      server ns
//!  r1 198.18.2.1  ───  d0 ⇄ shaper-delay-line ⇄ d1  ───  s0 198.18.2.2
//! ```

use crate::{
    process::{delay_line_bin, lines_of, output_bounded, wait_bounded},
    topology::Netns,
};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    process::{Child, Command, Stdio},
    sync::{
        mpsc::{Receiver, RecvTimeoutError},
        Mutex,
    },
    time::{Duration, Instant},
};

/// The delay namespace's interface toward the router, and the one toward the server.
pub const DELAY_TO_ROUTER: &str = "d0";
pub const DELAY_TO_SERVER: &str = "d1";

/// SCHED_FIFO priority of the delay line's threads: traffic and iperf3 keep both cores
/// busy, and a forwarding thread that waits for a core delays every frame behind it.
const RT_PRIORITY: &str = "10";
/// How long the delay line may take to bind its sockets, and to answer a signal.
const ANSWER_LIMIT: Duration = Duration::from_secs(10);

/// A running `shaper-delay-line` in a lab's delay namespace; stopped on drop, which prints
/// its counters (frames forwarded and dropped, how late they left).
pub struct DelayLine {
    /// Delay from router to server.
    pub to_server: Duration,
    /// Delay from server to router.
    pub to_router: Duration,
    ns: Netns,
    child: Option<Child>,
    /// Its stdout, a line at a time (read on a thread: it must never block the lab). In a
    /// mutex only so that a `&Lab` can be shared between threads (`Lab::udp_concurrently`).
    lines: Mutex<Receiver<String>>,
}

impl DelayLine {
    /// Starts the delay line in `ns` between [`DELAY_TO_ROUTER`] and [`DELAY_TO_SERVER`]
    /// (both up, offloads off) and waits until it forwards.
    pub(crate) fn start(ns: &Netns, to_server: Duration, to_router: Duration) -> Result<Self> {
        let milliseconds = |delay: Duration| format!("{}", delay.as_secs_f64() * 1e3);
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns.name])
            .arg(delay_line_bin())
            .args(["--a", DELAY_TO_ROUTER, "--b", DELAY_TO_SERVER])
            .args(["--delay-ab-ms", &milliseconds(to_server)])
            .args(["--delay-ba-ms", &milliseconds(to_router)])
            .args(["--rt-priority", RT_PRIORITY])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // Its own errors (a socket it cannot open) go straight to the test's output.
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the delay line")?;
        let stdout = child.stdout.take().context("no delay line stdout")?;
        let lines = lines_of(stdout);
        let mut line = Self {
            to_server,
            to_router,
            ns: ns.clone(),
            child: Some(child),
            lines: Mutex::new(lines),
        };
        line.wait_event("ready")
            .context("the delay line did not start")?;
        Ok(line)
    }

    /// Round-trip time the delay line adds.
    pub fn base_rtt(&self) -> Duration {
        self.to_server + self.to_router
    }

    /// Its counters now: `{"event":"counters","directions":[{"name":"d0->d1",
    /// "received":…,"sent":…,"queue_full_drops":…,"error_mean_us":…,…}, {…"d1->d0"…}]}`.
    pub fn counters(&mut self) -> Result<Value> {
        // Lines nobody asked for (none are expected) must not pass for the answer.
        while self.lines().try_recv().is_ok() {}
        self.signal("USR1")?;
        self.wait_event("counters")
    }

    fn lines(&mut self) -> &Receiver<String> {
        // Poisoned only by a panic while holding it, which nothing here can do.
        self.lines.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    fn signal(&self, signal: &str) -> Result<()> {
        let child = self.child.as_ref().context("the delay line was stopped")?;
        // `ip netns exec` execs the delay line: the child is the delay line itself.
        let output = output_bounded(
            Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]),
            ANSWER_LIMIT,
        )?;
        if !output.status.success() {
            bail!(
                "kill -{signal} {}: {}",
                child.id(),
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    }

    /// The next stdout line whose `event` is `event`, within [`ANSWER_LIMIT`].
    fn wait_event(&mut self, event: &str) -> Result<Value> {
        let deadline = Instant::now() + ANSWER_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines().recv_timeout(left) {
                Ok(line) => {
                    let value: Value = serde_json::from_str(&line)
                        .with_context(|| format!("the delay line said {line:?}"))?;
                    if value["event"] == event {
                        return Ok(value);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    bail!("no {event:?} from the delay line within {ANSWER_LIMIT:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self
                        .child
                        .as_mut()
                        .map(|child| wait_bounded(child, Duration::from_secs(2)));
                    bail!("the delay line exited before saying {event:?} ({status:?})")
                }
            }
        }
    }

    /// SIGTERM (it prints its counters and exits), SIGKILL past the bound; the counters.
    fn stop(&mut self) -> Option<Value> {
        let counters = self
            .signal("TERM")
            .and_then(|()| self.wait_event("counters"))
            .ok();
        if let Some(mut child) = self.child.take() {
            // Killed at the bound when it does not exit; the namespace removal also would.
            let _ = wait_bounded(&mut child, Duration::from_secs(3));
        }
        counters
    }
}

/// One line per direction: what went through, what was lost, how late it left.
pub fn describe_counters(counters: &Value) -> String {
    counters["directions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            format!(
                "{} ({} ms): {} frames in, {} out, {} dropped (socket {}, queue full {}, \
                 oversize {}, send errors {}), max queue {}, sent vs due: mean {:+.0} µs, \
                 {:.0} µs late to {:.0} µs early at most, {} frames over 1 ms late ({} over 5 ms)",
                d["name"].as_str().unwrap_or("?"),
                d["delay_ms"],
                d["received"],
                d["sent"],
                [
                    "socket_drops",
                    "queue_full_drops",
                    "oversize_drops",
                    "send_errors"
                ]
                .iter()
                .map(|k| d[k].as_u64().unwrap_or(0))
                .sum::<u64>(),
                d["socket_drops"],
                d["queue_full_drops"],
                d["oversize_drops"],
                d["send_errors"],
                d["max_queue"],
                d["error_mean_us"].as_f64().unwrap_or(f64::NAN),
                d["late_max_us"].as_f64().unwrap_or(f64::NAN),
                d["early_max_us"].as_f64().unwrap_or(f64::NAN),
                d["late_over_1ms"],
                d["late_over_5ms"],
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        match self.stop() {
            Some(counters) => eprintln!(
                "delay line in {}:\n{}",
                self.ns.name,
                describe_counters(&counters)
            ),
            None => eprintln!("delay line in {}: no counters at exit", self.ns.name),
        }
    }
}
