//! A real Prometheus and Alertmanager (Debian's `prometheus` and
//! `prometheus-alertmanager`) in a lab namespace, on its loopback, for the alert rules end
//! to end (issue 53): Prometheus scrapes the daemon every second and evaluates
//! contrib/prometheus/shaper-rules.yml with every duration in seconds where the file says
//! minutes (a 10-minute `for:` takes 10 s); Alertmanager sends what fires and what
//! resolves to a webhook receiver of the test's. Everything is stopped and its directory
//! removed on drop.

use crate::{wait_bounded, Netns};
use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    thread,
    time::{Duration, Instant},
};

/// Where each listens, inside the lab's namespace (a namespace of its own: no port there
/// is taken).
pub const PROMETHEUS: &str = "127.0.0.1:9090";
const ALERTMANAGER: &str = "127.0.0.1:9093";
const WEBHOOK: &str = "127.0.0.1:9099";
/// Prometheus's scrape and evaluation interval.
pub const EVALUATION_INTERVAL: Duration = Duration::from_secs(1);

/// One alert as the webhook received it.
#[derive(Clone, Debug)]
pub struct Notification {
    pub at: Instant,
    /// `firing` or `resolved`.
    pub status: String,
    pub alertname: String,
    pub labels: Value,
}

pub struct Monitoring {
    ns: Netns,
    dir: PathBuf,
    children: Vec<Child>,
    stop: Arc<AtomicBool>,
    receiver: Option<thread::JoinHandle<()>>,
    pub notifications: mpsc::Receiver<Notification>,
}

/// The shipped rules with every duration in minutes (`10m`, `[5m]`, `[15m:1m]`) in
/// seconds instead.
pub fn rules_in_seconds(rules: &str) -> String {
    let mut out = String::with_capacity(rules.len());
    let chars: Vec<char> = rules.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        let after_digit = i > 0 && chars[i - 1].is_ascii_digit();
        let next = chars.get(i + 1).copied().unwrap_or(' ');
        if c == 'm' && after_digit && !next.is_ascii_alphanumeric() {
            out.push('s');
        } else {
            out.push(c);
        }
    }
    out
}

impl Monitoring {
    /// Prometheus scraping `target` (in `ns`) and Alertmanager, both in `ns`, and the
    /// webhook receiver; returns once both answer `/-/ready`.
    pub fn start(ns: &Netns, target: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "shaper-monitoring-{}-{}",
            std::process::id(),
            ns.name
        ));
        std::fs::create_dir_all(&dir)?;
        let rules = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../contrib/prometheus/shaper-rules.yml"
        ))?;
        std::fs::write(dir.join("rules.yml"), rules_in_seconds(&rules))?;
        let interval = format!("{}s", EVALUATION_INTERVAL.as_secs());
        std::fs::write(
            dir.join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n\
                 rule_files: [rules.yml]\n\
                 alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{ALERTMANAGER}']\n\
                 scrape_configs:\n  - job_name: shaper\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )?;
        std::fs::write(
            dir.join("alertmanager.yml"),
            format!(
                "route:\n  receiver: test\n  group_by: ['...']\n  group_wait: 0s\n  group_interval: 1s\n  repeat_interval: 1h\n\
                 receivers:\n  - name: test\n    webhook_configs:\n      - url: 'http://{WEBHOOK}/'\n        send_resolved: true\n"
            ),
        )?;
        let (sender, notifications) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let receiver = webhook_receiver(ns, Arc::clone(&stop), sender)?;
        let mut monitoring = Self {
            ns: ns.clone(),
            dir: dir.clone(),
            children: Vec::new(),
            stop,
            receiver: Some(receiver),
            notifications,
        };
        let path = |name: &str| dir.join(name).display().to_string();
        monitoring.spawn(
            "prometheus",
            &[
                &format!("--config.file={}", path("prometheus.yml")),
                &format!("--storage.tsdb.path={}", path("data")),
                &format!("--web.listen-address={PROMETHEUS}"),
                "--log.level=warn",
            ],
        )?;
        monitoring.spawn(
            "prometheus-alertmanager",
            &[
                &format!("--config.file={}", path("alertmanager.yml")),
                &format!("--storage.path={}", path("alertmanager")),
                &format!("--web.listen-address={ALERTMANAGER}"),
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
        )?;
        for address in [PROMETHEUS, ALERTMANAGER] {
            let deadline = Instant::now() + Duration::from_secs(30);
            while ns
                .http_get(address, "/-/ready")
                .map(|(status, _)| status)
                .ok()
                != Some(200)
            {
                if Instant::now() > deadline {
                    bail!(
                        "{address} is not ready after 30 s; logs in {}",
                        dir.display()
                    );
                }
                thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(monitoring)
    }

    fn spawn(&mut self, program: &str, args: &[&str]) -> Result<()> {
        // `ip netns exec` would start and fail only later: say what is missing now.
        let found = std::env::var("PATH")
            .unwrap_or_default()
            .split(':')
            .any(|dir| std::path::Path::new(dir).join(program).exists());
        if !found {
            bail!(
                "{program} not found: Debian's package {program} (cargo xtask setup installs it)"
            );
        }
        let log = std::fs::File::create(self.dir.join(format!("{program}.log")))?;
        // The namespace's command dies with the test.
        let child = self
            .ns
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {program} (Debian's package of that name)"))?;
        self.children.push(child);
        Ok(())
    }

    /// Prometheus's answer to an instant query: its `data.result` (an error when the
    /// query failed).
    pub fn query(&self, expr: &str) -> Result<Vec<Value>> {
        self.api(
            expr,
            &format!("/api/v1/query?query={}", percent_encoded(expr)),
        )
    }

    /// A range query from `start` to `end` (unix seconds) every `step` seconds: its
    /// `data.result` (one object per series, `metric` and `values`).
    pub fn query_range(&self, expr: &str, start: f64, end: f64, step: f64) -> Result<Vec<Value>> {
        self.api(
            expr,
            &format!(
                "/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step={step}",
                percent_encoded(expr)
            ),
        )
    }

    /// A query API call's `data.result`, or the error Prometheus gave for `expr`.
    fn api(&self, expr: &str, path: &str) -> Result<Vec<Value>> {
        let (status, body) = self.ns.http_get(PROMETHEUS, path)?;
        let answer: Value = serde_json::from_str(&body)
            .with_context(|| format!("Prometheus answered {status}: {body}"))?;
        if answer["status"] != "success" {
            bail!("{expr}: {}", answer["error"]);
        }
        Ok(answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Waits (30 s at most) until Prometheus has scraped its target.
    pub fn wait_until_scraped(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self
            .query("up{job=\"shaper\"} == 1")
            .is_ok_and(|result| !result.is_empty())
        {
            if Instant::now() > deadline {
                bail!("Prometheus has not scraped the daemon in 30 s");
            }
            thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// Prometheus's clock now (unix seconds): `time()`, a scalar `[timestamp, "value"]`.
    pub fn now(&self) -> Result<f64> {
        let answer = self.query("time()")?;
        answer
            .get(1)
            .and_then(|value| value.as_str()?.parse().ok())
            .with_context(|| format!("time() answered {answer:?}"))
    }

    /// The first notification of `alertname` with `status` within `limit`.
    pub fn wait_for(&self, alertname: &str, status: &str, limit: Duration) -> Result<Notification> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.notifications.recv_timeout(left) {
                Ok(note) if note.alertname == alertname && note.status == status => {
                    return Ok(note)
                }
                Ok(_) => continue,
                Err(_) => bail!(
                    "no {status} {alertname} within {limit:?}; logs in {}",
                    self.dir.display()
                ),
            }
        }
    }
}

impl Drop for Monitoring {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = wait_bounded(child, Duration::from_secs(5));
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(receiver) = self.receiver.take() {
            let _ = receiver.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A query string's value, percent-encoded.
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The webhook receiver: Alertmanager's POSTs, each alert of each sent on `sender`;
/// answers 200; stops when `stop` is set.
fn webhook_receiver(
    ns: &Netns,
    stop: Arc<AtomicBool>,
    sender: mpsc::Sender<Notification>,
) -> Result<thread::JoinHandle<()>> {
    let ns = ns.clone();
    let (ready, listening) = mpsc::channel();
    let handle = thread::spawn(move || {
        let listener = ns.enter().and_then(|()| {
            let listener = TcpListener::bind(WEBHOOK)?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        });
        let listener = match listener {
            Ok(listener) => {
                let _ = ready.send(Ok(()));
                listener
            }
            Err(error) => {
                let _ = ready.send(Err(format!("{error:#}")));
                return;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    for note in read_notifications(stream).unwrap_or_default() {
                        let _ = sender.send(note);
                    }
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    match listening.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(error)) => bail!("the webhook receiver: {error}"),
        Err(_) => bail!("the webhook receiver did not start"),
    }
}

/// One POST from Alertmanager: its alerts; the connection answered 200.
fn read_notifications(stream: TcpStream) -> Result<Vec<Notification>> {
    let at = Instant::now();
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    (&stream).write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let message: Value = serde_json::from_slice(&body)?;
    Ok(message["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|alert| Notification {
            at,
            status: alert["status"].as_str().unwrap_or_default().to_string(),
            alertname: alert["labels"]["alertname"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            labels: alert["labels"].clone(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_become_seconds_and_nothing_else_changes() {
        let rules =
            "for: 10m\nexpr: rate(x[5m]) > 0.05 and avg_over_time(y[15m:1m])\n# 10 minutes, 5ms\n";
        assert_eq!(
            rules_in_seconds(rules),
            "for: 10s\nexpr: rate(x[5s]) > 0.05 and avg_over_time(y[15s:1s])\n# 10 minutes, 5ms\n"
        );
        assert_eq!(percent_encoded("a b{c=\"d\"}"), "a%20b%7Bc%3D%22d%22%7D");
    }
}
