//! Child processes, every wait bounded: a peer that hangs fails the test instead of
//! hanging the suite. Also the shaper binary under test ([`shaper_bin`]) and the lab's
//! delay line ([`delay_line_bin`]), each built once per test process when `SHAPER_BIN`
//! (`SHAPER_DELAY_LINE_BIN`) is not set, so a plain `cargo test` never runs a stale binary.

use anyhow::{bail, Context as _, Result};
use serde_json::Value;
use std::{
    io::Read as _,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::{mpsc, OnceLock},
    thread,
    time::{Duration, Instant},
};

/// How long a command of the lab (ip, tc, ss, sysctl, a shaper command) may take.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(120);
/// How long building shaper for the tests may take.
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);

/// The shaper binary under test: `SHAPER_BIN`, else the workspace's own build of the
/// shaper-cli package (shaper and shaper-cni), made once per test process so that
/// `cargo test` outside xtask never runs a stale binary. Panics when that build fails.
pub fn shaper_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SHAPER_BIN") {
        return PathBuf::from(path);
    }
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BUILT.get_or_init(|| build_shaper().map_err(|e| format!("{e:#}"))) {
        Ok(path) => path.clone(),
        Err(error) => panic!(
            "SHAPER_BIN is not set and `cargo build --package shaper-cli` failed: {error}\n\
             (run the lab tests with `cargo xtask test`, or build shaper yourself and set \
             SHAPER_BIN=target/debug/shaper)"
        ),
    }
}

/// `cargo build --package shaper-cli` from the workspace root, with the cargo running
/// these tests; the path of the `shaper` executable it reports.
fn build_shaper() -> Result<PathBuf> {
    eprintln!("SHAPER_BIN is not set: building shaper (cargo build --package shaper-cli)");
    let executable = cargo_build(&["--package", "shaper-cli"], "shaper")?;
    for binary in [executable.clone(), executable.with_file_name("shaper-cni")] {
        if !binary.exists() {
            bail!("{} is missing after the build", binary.display());
        }
    }
    Ok(executable)
}

/// The delay line a lab with a base RTT runs ([`crate::Lab::with_delay`]):
/// `SHAPER_DELAY_LINE_BIN`, else this crate's `shaper-delay-line`, built once per test
/// process (as [`shaper_bin`], so a plain `cargo test` never runs a stale one). Panics when
/// that build fails.
pub fn delay_line_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("SHAPER_DELAY_LINE_BIN") {
        return PathBuf::from(path);
    }
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        eprintln!(
            "SHAPER_DELAY_LINE_BIN is not set: building the delay line \
             (cargo build --package shaper-tests --bin shaper-delay-line)"
        );
        cargo_build(
            &["--package", "shaper-tests", "--bin", "shaper-delay-line"],
            "shaper-delay-line",
        )
        .map_err(|e| format!("{e:#}"))
    });
    match built {
        Ok(path) => path.clone(),
        Err(error) => panic!(
            "SHAPER_DELAY_LINE_BIN is not set and \
             `cargo build --package shaper-tests --bin shaper-delay-line` failed: {error}"
        ),
    }
}

/// `cargo build ARGS` from the workspace root, with the cargo running these tests; the
/// path of the executable of target `target` it reports.
fn cargo_build(args: &[&str], target: &str) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the tests crate lives in the workspace")?;
    let child = Command::new(&cargo)
        .current_dir(root)
        .arg("build")
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot run {}", cargo.to_string_lossy()))?;
    let output = wait_with_output_bounded(child, BUILD_LIMIT)?;
    if !output.status.success() {
        bail!("cargo exited with {} (its errors are above)", output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let executable = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| {
            message["reason"] == "compiler-artifact" && message["target"]["name"] == target
        })
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo reported no {target} executable"))?;
    if !executable.exists() {
        bail!("{} is missing after the build", executable.display());
    }
    Ok(executable)
}

/// Waits for `child` at most `limit`; past it, kills the child and fails. Every wait on a
/// child of the lab goes through here, so a hung peer fails a test instead of hanging it.
pub fn wait_bounded(child: &mut Child, limit: Duration) -> Result<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("cannot wait for process {}", child.id()))?
        {
            return Ok(status);
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        thread::sleep((deadline - now).min(Duration::from_millis(20)));
    }
    let _ = child.kill();
    // SIGKILL is immediate but for a process stuck in the kernel: reap it, briefly.
    let reap_deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < reap_deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "process {} was still running after {:.1} s: killed",
        child.id(),
        limit.as_secs_f64()
    )
}

/// `wait_with_output` bounded by `limit` (see [`wait_bounded`]): the child's stdout and
/// stderr (those that were piped) are read by threads meanwhile.
pub fn wait_with_output_bounded(mut child: Child, limit: Duration) -> Result<Output> {
    let (sender, receiver) = mpsc::channel();
    let mut readers = 0;
    let pipes: [Option<Box<dyn std::io::Read + Send>>; 2] = [
        child.stdout.take().map(|p| Box::new(p) as _),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    for (index, pipe) in pipes.into_iter().enumerate() {
        if let Some(mut pipe) = pipe {
            let sender = sender.clone();
            readers += 1;
            thread::spawn(move || {
                let mut buffer = Vec::new();
                let _ = pipe.read_to_end(&mut buffer);
                let _ = sender.send((index, buffer));
            });
        }
    }
    let status = wait_bounded(&mut child, limit);
    // The pipes close with the child, unless it left a process behind holding them.
    let mut outputs = [Vec::new(), Vec::new()];
    let drain_deadline = Instant::now() + Duration::from_secs(5);
    for _ in 0..readers {
        let left = drain_deadline.saturating_duration_since(Instant::now());
        match receiver.recv_timeout(left) {
            Ok((index, buffer)) => outputs[index] = buffer,
            Err(_) => break,
        }
    }
    let [stdout, stderr] = outputs;
    match status {
        Ok(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        Err(error) => Err(error.context(format!(
            "stderr so far: {}",
            String::from_utf8_lossy(&stderr).trim()
        ))),
    }
}

/// `command.output()` bounded by `limit` (stdin empty, stdout and stderr captured).
pub fn output_bounded(command: &mut Command, limit: Duration) -> Result<Output> {
    let child = dies_with_parent(command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {command:?}"))?;
    wait_with_output_bounded(child, limit).with_context(|| format!("{command:?}"))
}

/// `command`'s output, or an error with its stderr when it exits non-zero.
pub(crate) fn run_checked(command: &mut Command) -> Result<Output> {
    let output = output_bounded(command, COMMAND_LIMIT)?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(output)
}

/// `output()` of a [`Command`], bounded by [`COMMAND_LIMIT`]: a child that
/// hangs is killed and the call fails, instead of hanging the suite.
pub trait BoundedCommand {
    fn output_within_limit(&mut self) -> Result<Output>;
    /// [`BoundedCommand::output_within_limit`] that must also succeed: a non-zero exit is
    /// an error naming the command, its status and its stderr.
    fn succeed_within_limit(&mut self) -> Result<Output>;
}

impl BoundedCommand for Command {
    fn output_within_limit(&mut self) -> Result<Output> {
        output_bounded(self, COMMAND_LIMIT)
    }

    fn succeed_within_limit(&mut self) -> Result<Output> {
        run_checked(self)
    }
}

/// Makes `command`'s child die (SIGKILL) when the thread that spawns it ends, so that a
/// test process killed outright leaves no server, daemon or probe running behind it
/// (PR_SET_PDEATHSIG, kept across `exec`, so through `ip netns exec` too; a child whose
/// parent is already gone exits at once). Spawn from the thread that owns the child for
/// its whole life: a thread that ends takes its children with it.
pub fn dies_with_parent(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt as _;
    let parent = std::process::id();
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs in the child.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            if nix::unistd::getppid().as_raw() as u32 != parent {
                nix::libc::_exit(1);
            }
            Ok(())
        })
    }
}

/// The transport a server listens on, for [`wait_listening`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Udp,
}

/// Waits (at most 5 s) until `child`, a server started in `ns`, has a socket listening on
/// `port`: a readiness check, not a sleep. Fails at once when the child exits first.
pub fn wait_listening(
    ns: &crate::topology::Netns,
    child: &mut Child,
    transport: Transport,
    port: u16,
) -> Result<()> {
    let flags = match transport {
        Transport::Tcp => "-Hltn",
        Transport::Udp => "-Hlun",
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("the server for port {port} exited before listening ({status})");
        }
        let out = ns.run("ss", &[flags, &format!("sport = :{port}")])?;
        if !out.stdout.is_empty() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "no server listening on {transport:?} port {port} in {} after 5 s",
        ns.name
    );
}

/// A child's output lines, read on a thread of their own so a caller can wait on them with
/// a timeout; the channel closes when the output does.
pub fn lines_of(output: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    use std::io::BufRead as _;
    let (sender, lines) = mpsc::channel();
    thread::spawn(move || {
        for line in std::io::BufReader::new(output).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_past_its_limit_kills_the_child_and_fails() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let started = Instant::now();
        let error = wait_bounded(&mut child, Duration::from_millis(500)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3), "{error:#}");
        assert!(error.to_string().contains("killed"), "{error:#}");
        // Killed and reaped.
        assert!(child.try_wait().unwrap().is_some());

        let error = output_bounded(
            Command::new("sh").args(["-c", "echo started >&2; sleep 30"]),
            Duration::from_millis(500),
        )
        .unwrap_err();
        assert!(format!("{error:#}").contains("started"), "{error:#}");

        let output = output_bounded(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(output.status.code(), Some(3));
        assert_eq!(
            (&output.stdout[..], &output.stderr[..]),
            (&b"out\n"[..], &b"err\n"[..])
        );
    }
}
