//! Packet captures in the lab's namespaces, read back with tcpdump filters.

use crate::{
    process::{output_bounded, run_checked, wait_bounded},
    topology::Netns,
};
use anyhow::{bail, Context as _, Result};
use std::{
    io::Read as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    thread,
    time::Duration,
};

/// A packet capture (tcpdump) on an interface of a lab namespace, written to a file and
/// read back with filters once stopped. Bounded: `-c` packets at most.
pub struct Capture {
    child: Option<Child>,
    stderr: Option<std::io::BufReader<std::process::ChildStderr>>,
    file: PathBuf,
    /// What tcpdump reported when it stopped (packets captured / dropped by the kernel).
    pub report: String,
}

impl Capture {
    pub fn start(ns: &Netns, dev: &str, filter: &str) -> Result<Self> {
        use std::io::{BufRead as _, BufReader};
        static CAPTURES: AtomicU32 = AtomicU32::new(0);
        let file = std::env::temp_dir().join(format!(
            "shaper-capture-{}-{}.pcap",
            std::process::id(),
            CAPTURES.fetch_add(1, Ordering::SeqCst)
        ));
        let mut child = ns
            .command("tcpdump")
            .args([
                "-i",
                dev,
                "-n",
                "-U",
                "--immediate-mode",
                "-c",
                "2000000",
                "-s",
                "128",
                "-w",
            ])
            .arg(&file)
            .arg(filter)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("cannot start tcpdump")?;
        // tcpdump says "listening on ..." once it captures: read on a thread, so a
        // tcpdump that never says it cannot hang the test (10 s at most).
        let mut stderr = BufReader::new(child.stderr.take().context("no tcpdump stderr")?);
        let (sender, receiver) = mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let read = stderr.read_line(&mut line);
            let _ = sender.send((read.map(|_| line), stderr));
        });
        let started = receiver.recv_timeout(Duration::from_secs(10));
        let stderr = match started {
            Ok((Ok(line), stderr)) if line.contains("listening") => stderr,
            other => {
                let _ = child.kill();
                let _ = wait_bounded(&mut child, Duration::from_secs(2));
                let why = match other {
                    Ok((Ok(line), _)) => line,
                    Ok((Err(error), _)) => error.to_string(),
                    Err(_) => "nothing said within 10 s".to_string(),
                };
                bail!("tcpdump did not start: {why}");
            }
        };
        Ok(Self {
            child: Some(child),
            stderr: Some(stderr),
            file,
            report: String::new(),
        })
    }

    /// Stops capturing (flushes the file).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // tcpdump may still be draining its ring when the traffic ends: wait until the
            // file stops growing (at most 3 s), or SIGINT would lose the last packets.
            let size = || std::fs::metadata(&self.file).map(|m| m.len()).unwrap_or(0);
            let mut last = size();
            for _ in 0..15 {
                thread::sleep(Duration::from_millis(200));
                let now = size();
                if now == last {
                    break;
                }
                last = now;
            }
            let _ = output_bounded(
                Command::new("kill").args(["-INT", &child.id().to_string()]),
                Duration::from_secs(5),
            );
            // tcpdump flushes and exits on SIGINT; one that does not is killed at 10 s.
            if let Err(error) = wait_bounded(&mut child, Duration::from_secs(10)) {
                self.report = format!("tcpdump did not stop on SIGINT: {error:#}\n");
            }
            // The child is gone: its stderr is at its end.
            if let Some(mut stderr) = self.stderr.take() {
                let _ = stderr.read_to_string(&mut self.report);
            }
        }
    }

    /// The decoded lines (`tcpdump -v`) of the captured packets matching `filter`.
    pub fn lines(&mut self, filter: &str) -> Result<Vec<String>> {
        self.stop();
        let output = run_checked(
            Command::new("tcpdump")
                .args(["-r"])
                .arg(&self.file)
                .args(["-n", "-t", "-v", filter]),
        )?;
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        // -v puts each IP header on its own line starting with the address family.
        Ok(text
            .lines()
            .filter(|l| l.starts_with("IP"))
            .map(str::to_string)
            .collect())
    }

    /// How many captured packets match `filter`.
    pub fn count(&mut self, filter: &str) -> Result<usize> {
        Ok(self.lines(filter)?.len())
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.file);
    }
}
