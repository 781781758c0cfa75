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
use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;
use std::{
    collections::BTreeMap,
    fmt,
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
/// How late the delay line may send frames (the 99th percentile over a run, µs) for the
/// run's figures to be believed: a frame held back is delay the path does not have.
pub const LATENESS_P99_LIMIT_US: f64 = 1000.0;

/// The delay line's lateness counts at one moment, per direction: a bin's upper edge (µs)
/// and the frames that left that late (cumulative since the start).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatenessReading {
    /// Per direction: its name, its lateness bins, and the frames it lost so far.
    directions: Vec<(String, BTreeMap<u64, u64>, u64)>,
    realtime: bool,
}

/// The counters of frames a delay line direction lost (never sent on).
const LOSS_COUNTERS: [&str; 4] = [
    "socket_drops",
    "queue_full_drops",
    "oversize_drops",
    "send_errors",
];

impl LatenessReading {
    /// The reading in a `counters` event.
    pub fn from_counters(counters: &Value) -> Self {
        let directions: Vec<&Value> = counters["directions"]
            .as_array()
            .into_iter()
            .flatten()
            .collect();
        Self {
            realtime: !directions.is_empty() && directions.iter().all(|d| d["realtime"] == true),
            directions: directions
                .iter()
                .map(|d| {
                    let bins = d["late_bins"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|bin| Some((bin[0].as_u64()?, bin[1].as_u64()?)))
                        .collect();
                    let lost = LOSS_COUNTERS
                        .iter()
                        .map(|key| d[key].as_u64().unwrap_or(0))
                        .sum();
                    (d["name"].as_str().unwrap_or("?").to_string(), bins, lost)
                })
                .collect(),
        }
    }

    /// How late frames left between `earlier` and this reading.
    pub fn since(&self, earlier: &LatenessReading) -> Timekeeping {
        let directions = self
            .directions
            .iter()
            .map(|(name, bins, lost)| {
                let before = earlier
                    .directions
                    .iter()
                    .find(|(other, _, _)| other == name);
                let lost_before = before.map_or(0, |(_, _, lost)| *lost);
                let before = before.map(|(_, bins, _)| bins);
                let run: BTreeMap<u64, u64> = bins
                    .iter()
                    .map(|(edge, count)| {
                        let was = before.and_then(|b| b.get(edge)).copied().unwrap_or(0);
                        (*edge, count.saturating_sub(was))
                    })
                    .filter(|(_, count)| *count > 0)
                    .collect();
                DirectionLateness::of(name, &run, lost.saturating_sub(lost_before))
            })
            .collect();
        Timekeeping {
            directions,
            realtime: self.realtime,
        }
    }
}

/// How late one direction's frames left over a run (percentiles are bin upper edges, µs).
#[derive(Debug, Clone, PartialEq)]
pub struct DirectionLateness {
    pub name: String,
    pub frames: u64,
    /// Frames it lost (socket or queue full, oversize, a failed send).
    pub lost: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub worst_us: f64,
}

impl DirectionLateness {
    fn of(name: &str, bins: &BTreeMap<u64, u64>, lost: u64) -> Self {
        Self {
            name: name.to_string(),
            frames: bins.values().sum(),
            lost,
            p50_us: binned_percentile(bins, 50.0),
            p99_us: binned_percentile(bins, 99.0),
            worst_us: bins.keys().next_back().map_or(0.0, |edge| *edge as f64),
        }
    }
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of counts kept in bins (a bin's upper
/// edge → its count), read as the bin's upper edge (never below the truth); 0 with no
/// count. The delay line reports its lateness so, and the lab reads it so.
pub fn binned_percentile(bins: &BTreeMap<u64, u64>, p: f64) -> f64 {
    let total: u64 = bins.values().sum();
    if total == 0 {
        return 0.0;
    }
    let rank = ((p / 100.0 * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (edge, count) in bins {
        seen += count;
        if seen >= rank {
            return *edge as f64;
        }
    }
    unreachable!("the counts add up to the total")
}

/// How late the delay line sent frames over a run, per direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Timekeeping {
    pub directions: Vec<DirectionLateness>,
    /// Whether its threads ran SCHED_FIFO.
    pub realtime: bool,
}

impl Timekeeping {
    /// The highest p99 lateness of the directions (µs).
    pub fn p99_us(&self) -> f64 {
        self.directions.iter().map(|d| d.p99_us).fold(0.0, f64::max)
    }

    /// Whether the run counts: the delay line's threads ran SCHED_FIFO, it carried frames,
    /// and it kept time (p99 lateness within [`LATENESS_P99_LIMIT_US`] in every direction,
    /// no frame lost: a frame it could not take or send is loss the path does not have).
    pub fn kept_time(&self) -> bool {
        self.why_not_counted().is_none()
    }

    /// Why the run does not count (None when it does).
    pub fn why_not_counted(&self) -> Option<String> {
        let frames: u64 = self.directions.iter().map(|d| d.frames).sum();
        if !self.realtime {
            Some("its threads did not run SCHED_FIFO (see its warning above)".to_string())
        } else if frames == 0 {
            Some("it carried no frame".to_string())
        } else if self.directions.iter().any(|d| d.lost > 0) {
            Some("it lost frames".to_string())
        } else if self.p99_us() > LATENESS_P99_LIMIT_US {
            Some(format!(
                "it sent frames late (p99 {:.0} µs, at most {LATENESS_P99_LIMIT_US} µs)",
                self.p99_us()
            ))
        } else {
            None
        }
    }
}

impl fmt::Display for Timekeeping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let directions: Vec<String> = self
            .directions
            .iter()
            .map(|d| {
                format!(
                    "{} {} frames ({} lost), late p50 {:.0} µs p99 {:.0} µs, worst under {:.0} \
                     µs",
                    d.name, d.frames, d.lost, d.p50_us, d.p99_us, d.worst_us
                )
            })
            .collect();
        write!(
            f,
            "delay line{}: {}",
            if self.realtime {
                ""
            } else {
                " (not SCHED_FIFO)"
            },
            directions.join("; ")
        )
    }
}

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
        let mut child = ns
            .command(&delay_line_bin().to_string_lossy())
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

    /// Its lateness counts now (see [`LatenessReading::since`]).
    pub fn lateness(&mut self) -> Result<LatenessReading> {
        Ok(LatenessReading::from_counters(&self.counters()?))
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

/// Runs through a lab's delay line in which it kept time, at most this many tries.
pub const DELAY_LINE_TRIES: u32 = 4;
/// Before a run is made again, the host must be quiet: in [`QUIET_SECONDS`] one-second
/// windows in a row, a thread sleeping [`PROBE_SLEEP`] at a time overslept at most
/// [`QUIET_OVERSLEEP_P99_US`] at p99 and the hypervisor stole less than
/// [`QUIET_STEAL_SHARE`] of the CPUs; waited for at most [`QUIET_WAIT_LIMIT`]. (An idle
/// VM shows no steal however busy its host: a virtual CPU that does not want to run is not
/// kept from running. So the probe wakes as often as the delay line does.)
const QUIET_SECONDS: u32 = 3;
const PROBE_SLEEP: Duration = Duration::from_micros(300);
const QUIET_OVERSLEEP_P99_US: f64 = 250.0;
const QUIET_STEAL_SHARE: f64 = 0.01;
const QUIET_WAIT_LIMIT: Duration = Duration::from_secs(150);

/// The machine's CPU time so far, from the `cpu` line of /proc/stat (USER_HZ ticks, all
/// CPUs): all of it, and steal, the time the hypervisor ran something else on this VM's
/// CPUs, when nothing in the VM runs and no delay line keeps time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuTime {
    pub total: u64,
    pub steal: u64,
}

impl CpuTime {
    pub fn now() -> Result<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").context("cannot read /proc/stat")?)
    }

    pub fn parse(stat: &str) -> Result<Self> {
        let line = stat
            .lines()
            .find(|line| line.starts_with("cpu "))
            .context("/proc/stat has no cpu line")?;
        let ticks = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<Vec<u64>, _>>()
            .with_context(|| format!("/proc/stat's {line:?}"))?;
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        ensure!(ticks.len() >= 8, "/proc/stat's {line:?} has no steal");
        Ok(Self {
            total: ticks[..8].iter().sum(),
            steal: ticks[7],
        })
    }

    /// The share of CPU time stolen since `earlier` (0 when no time passed).
    pub fn steal_share_since(&self, earlier: &CpuTime) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(earlier.steal) as f64 / total as f64
    }
}

/// One probe window: how much a thread sleeping [`PROBE_SLEEP`] at a time overslept at
/// p99 over a second (µs), with the CPUs kept polling when idle as the delay line keeps
/// them, and the share of CPU time stolen meanwhile.
fn probe_window() -> Result<(f64, f64)> {
    use std::io::Write as _;
    // As the delay line does (shaper-delay-line's idle_poll); without it, the probe
    // measures halted CPUs, which the delay line never waits for.
    let _idle_poll = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/cpu_dma_latency")
        .and_then(|mut file| file.write_all(&0i32.to_ne_bytes()).map(|()| file))
        .ok();
    let before = CpuTime::now()?;
    let started = Instant::now();
    let mut oversleep = Vec::with_capacity(4096);
    while started.elapsed() < Duration::from_secs(1) {
        let asleep = Instant::now();
        std::thread::sleep(PROBE_SLEEP);
        oversleep.push(asleep.elapsed().saturating_sub(PROBE_SLEEP));
    }
    let steal = CpuTime::now()?.steal_share_since(&before);
    oversleep.sort();
    let p99 = oversleep[(oversleep.len() * 99 / 100).min(oversleep.len() - 1)];
    Ok((p99.as_secs_f64() * 1e6, steal))
}

/// Waits, at most [`QUIET_WAIT_LIMIT`], for a quiet host; what the probe saw last, and
/// how long it waited.
fn wait_for_a_quiet_host() -> Result<String> {
    let started = Instant::now();
    let mut quiet = 0;
    let mut last = (0.0, 0.0);
    while quiet < QUIET_SECONDS && started.elapsed() < QUIET_WAIT_LIMIT {
        last = probe_window()?;
        let (p99_us, steal) = last;
        quiet = if p99_us <= QUIET_OVERSLEEP_P99_US && steal < QUIET_STEAL_SHARE {
            quiet + 1
        } else {
            0
        };
    }
    Ok(format!(
        "waited {:.0} s for a quiet host ({} of {QUIET_SECONDS} seconds quiet; the last: \
         {PROBE_SLEEP:?} sleeps overslept p99 {:.0} µs, {:.1} % stolen; quiet is at most \
         {QUIET_OVERSLEEP_P99_US} µs and {:.0} %)",
        started.elapsed().as_secs_f64(),
        quiet,
        last.0,
        last.1 * 100.0,
        QUIET_STEAL_SHARE * 100.0
    ))
}

/// Every run through a delay line failed to keep time: what each run saw.
#[derive(Debug, Clone)]
pub struct DelayLineLate {
    /// Per run: the delay line's timekeeping, and the share of CPU time stolen meanwhile.
    pub runs: Vec<(Timekeeping, f64)>,
}

impl fmt::Display for DelayLineLate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the delay line did not keep time in {} runs (the machine is too busy for a \
             delayed path): {}",
            self.runs.len(),
            self.runs
                .iter()
                .map(|(timekeeping, steal)| format!(
                    "{timekeeping}, {:.1} % of CPU time stolen",
                    steal * 100.0
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        )
    }
}

impl std::error::Error for DelayLineLate {}

impl crate::Lab {
    /// Runs `run` and checks that the delay line kept time meanwhile (p99 lateness within
    /// [`LATENESS_P99_LIMIT_US`], printed with the CPU time the hypervisor stole). A run
    /// in which it did not measured a path with more delay than the lab's, so it does not
    /// count: after waiting for a quiet host it is made again, at most
    /// [`DELAY_LINE_TRIES`] times in all, and then the error is a [`DelayLineLate`].
    /// Errors of `run` itself are returned at once. A lab without a delay line runs `run`
    /// once.
    pub fn through_delay_line<T>(
        &mut self,
        mut run: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        if self.delay_line().is_none() {
            return run(self);
        }
        let mut late = DelayLineLate { runs: Vec::new() };
        for _ in 0..DELAY_LINE_TRIES {
            let (before, cpu_before) = (self.delay_line_reading()?, CpuTime::now()?);
            let result = run(self)?;
            let timekeeping = self.delay_line_reading()?.since(&before);
            let steal = CpuTime::now()?.steal_share_since(&cpu_before);
            println!(
                "{timekeeping}; {:.1} % of CPU time stolen by the hypervisor",
                steal * 100.0
            );
            let Some(why) = timekeeping.why_not_counted() else {
                return Ok(result);
            };
            // Neither comes right by waiting: a run again would measure the same nothing.
            if !timekeeping.realtime || timekeeping.directions.iter().all(|d| d.frames == 0) {
                bail!("the run through the delay line does not count: {why}");
            }
            println!("the run through the delay line does not count: {why}");
            late.runs.push((timekeeping, steal));
            if late.runs.len() < DELAY_LINE_TRIES as usize {
                println!("{}", wait_for_a_quiet_host()?);
            }
        }
        Err(late.into())
    }

    fn delay_line_reading(&mut self) -> Result<LatenessReading> {
        self.delay_line()
            .context("the lab has no delay line")?
            .lateness()
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
                 late p50 {:.0} µs p99 {:.0} µs p99.9 {:.0} µs, {:.0} µs late to {:.0} µs early \
                 at most; receive lag p99 {:.0} µs",
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
                d["late_p50_us"].as_f64().unwrap_or(f64::NAN),
                d["late_p99_us"].as_f64().unwrap_or(f64::NAN),
                d["late_p999_us"].as_f64().unwrap_or(f64::NAN),
                d["late_max_us"].as_f64().unwrap_or(f64::NAN),
                d["early_max_us"].as_f64().unwrap_or(f64::NAN),
                d["receive_lag_p99_us"].as_f64().unwrap_or(f64::NAN),
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn counters(bins_ab: &[[u64; 2]], bins_ba: &[[u64; 2]]) -> Value {
        json!({"event": "counters", "directions": [
            {"name": "d0->d1", "late_bins": bins_ab, "realtime": true},
            {"name": "d1->d0", "late_bins": bins_ba, "realtime": true},
        ]})
    }

    #[test]
    fn lateness_over_a_run_is_the_difference_of_two_readings() {
        let before =
            LatenessReading::from_counters(&counters(&[[10, 500], [3000, 40]], &[[10, 5]]));
        // The run: 980 frames in 10 µs, 15 in 20 µs, 5 in 1.51 ms one way (p99: the
        // 990th of 1000, in the 20 µs bin); 100 in 10 µs and 2 in 3 ms the other (the 40
        // from before do not count).
        let after = LatenessReading::from_counters(&counters(
            &[[10, 1480], [20, 15], [1510, 5], [3000, 40]],
            &[[10, 105], [3000, 2]],
        ));
        let run = after.since(&before);
        assert!(run.realtime);
        let ab = &run.directions[0];
        assert_eq!(
            (ab.frames, ab.p50_us, ab.p99_us, ab.worst_us),
            (1000, 10.0, 20.0, 1510.0)
        );
        let ba = &run.directions[1];
        assert_eq!((ba.frames, ba.p99_us, ba.worst_us), (102, 3000.0, 3000.0));
        assert_eq!(run.p99_us(), 3000.0);
        assert!(!run.kept_time());
        // Nothing sent in a run: nothing late, and nothing measured: it does not count.
        let idle = after.since(&after);
        assert_eq!((idle.p99_us(), idle.directions[0].frames), (0.0, 0));
        assert!(!idle.kept_time());
        assert!(idle
            .why_not_counted()
            .is_some_and(|why| why.contains("no frame")));
        // On time with frames, but without SCHED_FIFO: it does not count either.
        let mut on_time = after.since(&before);
        on_time.directions.truncate(1);
        on_time.directions[0].p99_us = 20.0;
        assert!(on_time.kept_time());
        on_time.realtime = false;
        assert!(!on_time.kept_time());
        // A frame lost in a run: the run does not count, whatever its lateness.
        let mut lossy = counters(&[[10, 600]], &[[10, 6]]);
        lossy["directions"][0]["socket_drops"] = json!(1);
        let lossy = LatenessReading::from_counters(&lossy).since(&before);
        assert_eq!((lossy.directions[0].lost, lossy.p99_us()), (1, 10.0));
        assert!(!lossy.kept_time());
        // A delay line whose threads did not get SCHED_FIFO says so.
        let mut plain = counters(&[], &[]);
        plain["directions"][1]["realtime"] = json!(false);
        assert!(
            !LatenessReading::from_counters(&plain)
                .since(&before)
                .realtime
        );
    }

    #[test]
    fn steal_is_the_eighth_figure_of_proc_stat() {
        let before = CpuTime::parse("cpu  100 0 50 800 10 0 20 20 0 0\ncpu0 1 2 3").unwrap();
        assert_eq!(
            before,
            CpuTime {
                total: 1000,
                steal: 20
            }
        );
        let after = CpuTime::parse("cpu  150 0 60 1500 10 0 30 120 5 0\n").unwrap();
        assert_eq!(after.steal_share_since(&before), 100.0 / 870.0);
        assert_eq!(after.steal_share_since(&after), 0.0);
        assert!(CpuTime::parse("cpu  1 2 3\n").is_err());
        assert!(CpuTime::parse("intr 5\n").is_err());
    }
}
