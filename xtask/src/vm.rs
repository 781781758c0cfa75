//! `cargo xtask vm-test [--kernel 6.1|6.12|PATH]...`: the lab tests that matter most for a
//! kernel (every program variant loaded by its verifier, both attach modes, policing,
//! marks, a meter, shape, a hierarchy, upgrade, the CNI plugin) run inside Debian 12's own
//! kernels under qemu, as aya's integration tests do.
//!
//! Each kernel package comes from the Debian registry (`apt-get download`, cached under
//! target/vm). The guest boots from an initramfs made here: busybox for its init, the
//! host's own tools (ip, tc, iperf3, ...) with the libraries `ldd` names, the kernel's
//! modules the lab needs (decompressed, loaded in `modprobe --show-depends` order), shaper
//! and the test binaries, stripped. The init runs the kernel's test plan and prints
//! markers on the serial console; the host reads them, with a bound on the whole boot.

use crate::workspace_root;
use anyhow::{bail, ensure, Context as _, Result};
use serde_json::Value;
use std::{
    collections::BTreeSet,
    fs,
    io::{BufRead as _, BufReader},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, OnceLock},
    time::{Duration, Instant},
};

/// The kernels `vm-test` runs with no `--kernel`: Debian 11's (older than shaper's
/// floor, which it must refuse), Debian 12's LTS kernel and the one from its security suite
/// (the first with TCX); cloud flavour (virtio, small).
pub const DEFAULT_KERNELS: [&str; 3] = ["5.10", "6.1", "6.12"];
/// The kernels `bench --vm` measures on with no `--kernel`: Debian 12's two, both with fq,
/// fq_codel, CAKE and netem.
pub const BENCH_KERNELS: [&str; 2] = ["6.12", "6.1"];

/// shaper's floor (docs/KERNELS.md): older kernels only check the refusal.
const FLOOR: (u32, u32) = (5, 18);
/// TCX arrived in 6.6.
const TCX: (u32, u32) = (6, 6);

/// A kernel package of the Debian registry for a short version: the name's fixed start,
/// the part that varies by release (digits), its fixed end, and the Debian suite.
fn kernel_source(short: &str) -> Option<(&'static str, &'static str, &'static str)> {
    match short {
        "5.10" => Some(("linux-image-5.10.0-", "-cloud-amd64", "bullseye")),
        "6.1" => Some(("linux-image-6.1.0-", "-cloud-amd64", "bookworm")),
        "6.12" => Some(("linux-image-6.12.", "+deb12-cloud-amd64", "bookworm")),
        _ => None,
    }
}

/// Modules the lab and its peers need (those built in are skipped).
const MODULES: &[&str] = &[
    "veth",
    "tun",
    "bridge",
    "ifb",
    "sch_ingress",
    "cls_bpf",
    // The hierarchy tests' htb reference classifies with u32.
    "cls_u32",
    "act_mirred",
    "sch_htb",
    "sch_tbf",
    "sch_fq",
    "sch_fq_codel",
    "sch_cake",
    "sch_netem",
    // The bench's BBR rows (iperf3 -C bbr; no module autoloading in the guest).
    "tcp_bbr",
    "nf_tables",
    "nft_chain_nat",
    "nft_ct",
];

/// Host commands copied into the guest with their libraries (what the lab runs).
const GUEST_COMMANDS: &[&str] = &[
    "ip", "tc", "ss", "iperf3", "irtt", "ping", "ethtool", "nsenter", "unshare", "setpriv",
    "flock", "sysctl", "nft", "tcpdump",
];

/// The reference CNI plugins the CNI test runs beside shaper-cni.
const CNI_PLUGINS: &str = "/usr/lib/cni";

/// What a guest runs.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Plan {
    /// Every guest test ([`GUEST_TESTS`]): `cargo xtask vm-test`.
    Full,
    /// CI's share ([`CI_TESTS`]), run by `cargo xtask test` within its ten minutes.
    Ci,
    /// Latency under load beside the qdiscs users pick instead (`shaper-bench --only
    /// peers`): `cargo xtask bench --vm`.
    Bench,
}

/// Which kernels a group of guest tests needs.
#[derive(Clone, Copy, PartialEq)]
enum Needs {
    /// Any kernel shaper runs on (the floor and later).
    Any,
    /// A kernel from the floor up to TCX: clsact is the attach mode it gets.
    ClsactOnly,
    /// TCX (6.6 and later): the tests that force `--attach-mode tcx`.
    Tcx,
    /// A kernel below the floor: the refusal (an ignored test, run only there).
    BelowFloor,
    /// A kernel with the fq and fq_codel qdiscs (each Debian kernel from the floor up; not
    /// the lab's): shape's EDT path and the per-flow bulk leaf (ignored tests on the host).
    Fq,
}

/// The guest's test plan: a test binary (the `tests/tests/*.rs` file) and the tests of it
/// to run (all when empty).
const GUEST_TESTS: &[(&str, &[&str], Needs)] = &[
    // BPF_PROG_TEST_RUN against the host models: the clocked variant loaded by this
    // kernel's verifier (the random differential and two-CPU race tests are left to the
    // host: thousands of runs, too slow emulated).
    (
        "test_run",
        &[
            "every_program_variant_loads",
            "a_thousand_packets_admit_exactly_what_the_model_predicts",
            "bucket_words_are_converted_at_a_rate_change_as_the_model_predicts",
            "codel_drops_a_gso_aggregate_of_k_segments_one_time_in_k",
            "crafted_packets_get_the_expected_class_and_verdict",
            "gso_packets_are_charged_their_bytes_on_the_wire",
            "kernel_srtcm_matches_rfc_2697_packet_by_packet",
            "kernel_trtcm_matches_rfc_2698_packet_by_packet",
            "shaping_with_codel_matches_the_model_packet_by_packet",
            "tree::a_three_level_tree_matches_the_model_packet_by_packet",
            "global::an_expired_share_falls_to_the_floor_in_the_packet_path",
            "fair_flows_hold_the_flow_over_its_share_and_spare_the_other",
        ],
        Needs::Any,
    ),
    (
        "policing",
        &[
            "udp_is_policed_to_10mbit_in_clsact_mode",
            "detach_restores_unshaped_traffic_clsact",
            "per_flow_buckets_give_each_flow_the_rate",
            "udp_out_of_a_tun_device_is_policed",
            "udp_into_a_tun_device_is_policed_on_its_ingress",
        ],
        Needs::Any,
    ),
    (
        "policing",
        &[
            "udp_ipv4_is_policed_to_10mbit_on_the_router",
            "udp_ipv6_is_policed_to_10mbit_on_the_router",
            "detach_restores_unshaped_traffic_tcx",
        ],
        Needs::Tcx,
    ),
    (
        "actions",
        &[
            "dscp_remarks_over_rate_packets_ipv4_and_ipv6",
            "ecn_marks_capable_packets_and_drops_the_rest",
            "shape_through_htb_keeps_tcp_and_udp_at_the_rate",
        ],
        Needs::Any,
    ),
    (
        "actions",
        &["shape_on_the_edt_path_keeps_tcp_and_udp_at_the_rate"],
        Needs::Fq,
    ),
    (
        "meters",
        &["trtcm_colours_match_the_offered_load"],
        Needs::Any,
    ),
    (
        "hierarchy",
        &["a_child_alone_borrows_the_parents_rate_and_busy_children_share_it"],
        Needs::Any,
    ),
    (
        "upgrade",
        &["upgrade_swaps_the_clsact_program_under_load_without_a_gap"],
        Needs::Any,
    ),
    (
        "upgrade",
        &["upgrade_swaps_the_tcx_program_under_load_without_a_gap"],
        Needs::Tcx,
    ),
    (
        "cni",
        &["shaper_cni_add_check_del_like_a_runtime_next_to_the_reference_plugin"],
        Needs::Any,
    ),
    (
        "latency",
        &["shape_at_10mbit_keeps_a_cubic_flows_queue_and_neighbours_short"],
        Needs::Any,
    ),
    (
        "fairness",
        &["cubic_keeps_half_and_its_queue_short_beside_a_udp_flood"],
        Needs::Any,
    ),
    (
        "policing",
        &["ifb_paths_carry_traffic_or_are_refused_where_the_kernel_drops_redirects"],
        Needs::Any,
    ),
    (
        "bad_inputs",
        &["a_kernel_older_than_the_floor_is_refused_in_one_line"],
        Needs::BelowFloor,
    ),
];

/// CI's share of the guest plan: each kernel's verifier loads every program variant, flow
/// isolation holds a flow over its share and spares the other (clock driven, on the
/// kernel's own packet path), shaper attaches in the mode the kernel gives it (and to a
/// tun device), polices UDP to the rate and detaches leaving nothing, its ifb paths carry
/// traffic or are refused (before 6.4, whose ifb drops redirects); the CNI plugin's
/// ADD/CHECK/DEL; a kernel below the floor refuses in one line. Under TCG each load of
/// the program on 6.1 verifies for 15–20 s.
const CI_TESTS: &[(&str, &[&str], Needs)] = &[
    (
        "test_run",
        &[
            "every_program_variant_loads",
            "fair_flows_hold_the_flow_over_its_share_and_spare_the_other",
        ],
        Needs::Any,
    ),
    (
        "policing",
        &[
            "udp_is_policed_to_10mbit_in_clsact_mode",
            "detach_restores_unshaped_traffic_clsact",
            "udp_out_of_a_tun_device_is_policed",
            "ifb_paths_carry_traffic_or_are_refused_where_the_kernel_drops_redirects",
        ],
        Needs::ClsactOnly,
    ),
    (
        "policing",
        &[
            "udp_ipv4_is_policed_to_10mbit_on_the_router",
            "detach_restores_unshaped_traffic_tcx",
            "udp_out_of_a_tun_device_is_policed",
            "ifb_paths_carry_traffic_or_are_refused_where_the_kernel_drops_redirects",
        ],
        Needs::Tcx,
    ),
    (
        "cni",
        &["shaper_cni_add_check_del_like_a_runtime_next_to_the_reference_plugin"],
        Needs::Any,
    ),
    (
        "bad_inputs",
        &["a_kernel_older_than_the_floor_is_refused_in_one_line"],
        Needs::BelowFloor,
    ),
];

/// How long one kernel's boot and test plan may take before the guest is killed.
fn guest_limit(plan: Plan) -> Duration {
    match plan {
        Plan::Full => Duration::from_secs(15 * 60),
        Plan::Ci => Duration::from_secs(6 * 60),
        // The latency rows' 48 runs and the isolation rows' 40, of 30 s each: about 32
        // and 30 minutes under TCG with each lab's set-up, the idle RTT and the tools'
        // start.
        Plan::Bench => Duration::from_secs(100 * 60),
    }
}
/// How long a boot with KVM may take to reach the init before KVM is taken for broken.
const KVM_PROBE_LIMIT: Duration = Duration::from_secs(30);
/// Serial-console markers the guest's init prints.
const READY: &str = "SHAPER-VM-READY";
const TEST_DONE: &str = "SHAPER-VM-TEST";
const EXIT: &str = "SHAPER-VM-EXIT";
/// The kernel argument of the KVM probe's boot: the init only says it got there.
const PROBE: &str = "shaper.probe";
const REPORT_BEGIN: &str = "SHAPER-VM-REPORT-BEGIN";
const REPORT_END: &str = "SHAPER-VM-REPORT-END";

/// A kernel unpacked from its package: its release (`uname -r`), image and module tree.
struct Kernel {
    label: String,
    release: String,
    image: PathBuf,
    /// The unpacked package: lib/modules/RELEASE under it.
    root: PathBuf,
}

/// A kernel release's major and minor numbers ("6.12.118+deb12-cloud-amd64": (6, 12)).
fn version_of(release: &str) -> (u32, u32) {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// What one kernel's guest did.
pub struct GuestOutcome {
    pub kernel: String,
    accel: &'static str,
    seconds: f64,
    /// Per test group: its binary, and whether it passed.
    groups: Vec<(String, bool)>,
    exit: Option<i32>,
    /// What the guest printed between [`REPORT_BEGIN`] and [`REPORT_END`] (the bench's
    /// JSON), one line per element.
    pub report: Vec<String>,
}

/// Boots each of `kernels` (the default set when empty) with `plan`; fails unless every
/// guest ran its whole plan and passed. Returns what each guest did.
pub fn vm_test(kernels: &[String], plan: Plan) -> Result<Vec<GuestOutcome>> {
    check_guest_tools()?;
    let kernels: Vec<String> = if !kernels.is_empty() {
        kernels.to_vec()
    } else if plan == Plan::Bench {
        BENCH_KERNELS.iter().map(|k| k.to_string()).collect()
    } else {
        DEFAULT_KERNELS.iter().map(|k| k.to_string()).collect()
    };
    let binaries = guest_binaries()?;
    let mut accel = None;
    let mut outcomes = Vec::new();
    for spec in &kernels {
        let kernel = fetch_kernel(spec)?;
        if groups(&kernel.release, plan).is_empty() {
            println!(
                "== kernel {}: none of the plan's tests is named like {:?}; not booted",
                kernel.label,
                TEST_FILTER.get().map_or("", String::as_str)
            );
            continue;
        }
        let image = initramfs(&kernel, &binaries, plan)?;
        let accel = match accel {
            Some(accel) => accel,
            None => {
                let chosen = choose_accel(&kernel, &image)?;
                accel = Some(chosen);
                chosen
            }
        };
        outcomes.push(boot(&kernel, &image, accel, plan)?);
    }
    ensure!(
        !outcomes.is_empty(),
        "vm-test: no test of the {plan:?} plan is named like {:?} on these kernels",
        TEST_FILTER.get().map_or("", String::as_str)
    );
    let failed = print_outcomes(&outcomes, plan);
    if !failed.is_empty() {
        bail!("vm-test failed: {}", failed.join("; "));
    }
    Ok(outcomes)
}

/// The host tools a guest is built and booted with.
fn check_guest_tools() -> Result<()> {
    let needed = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("busybox", "busybox-static"),
        ("modprobe", "kmod"),
        ("depmod", "kmod"),
        ("cpio", "cpio"),
        ("dpkg-deb", "dpkg"),
        ("apt-get", "apt"),
        ("strip", "binutils"),
    ];
    for (command, package) in needed {
        ensure!(
            crate::setup::has_command(command),
            "vm-test needs {command} (Debian package {package}; `cargo xtask setup` installs it)"
        );
    }
    Ok(())
}

/// Each guest's groups and exit, printed; what failed.
fn print_outcomes(outcomes: &[GuestOutcome], plan: Plan) -> Vec<String> {
    println!("== vm-test ({plan:?} plan)");
    let mut failed = Vec::new();
    for outcome in outcomes {
        for (group, passed) in &outcome.groups {
            println!(
                "{:>6} {:4} {:12} {}",
                outcome.kernel,
                outcome.accel,
                group,
                if *passed { "passed" } else { "FAILED" }
            );
            if !passed {
                failed.push(format!("{} on {}", group, outcome.kernel));
            }
        }
        println!(
            "{:>6} {:4} guest exit {:?} after {:.0} s",
            outcome.kernel, outcome.accel, outcome.exit, outcome.seconds
        );
        let planned = groups(&outcome.kernel, plan).len();
        if outcome.exit != Some(0) || outcome.groups.len() != planned {
            failed.push(format!(
                "the guest of {} ran {} of {planned} test groups and exited {:?}",
                outcome.kernel,
                outcome.groups.len(),
                outcome.exit
            ));
        }
    }
    failed
}

/// `vm-test --test NAME`: only the plan's tests whose name contains NAME run (set once,
/// before the first guest is made).
static TEST_FILTER: OnceLock<String> = OnceLock::new();

/// Narrows every guest to the plan's tests whose name contains `name`.
pub fn only_tests_named(name: String) {
    let _ = TEST_FILTER.set(name);
}

/// `bench --vm --rows TEXT`: only the peers rows whose setup contains TEXT.
static PEERS_ROWS: OnceLock<String> = OnceLock::new();

/// Narrows the bench's guests to the peers rows whose setup contains `text`.
pub fn only_peers_rows(text: String) {
    let _ = PEERS_ROWS.set(text);
}

/// A test group of the guest: a test binary, the tests of it to run (all when empty),
/// and whether they are ignored ones (run with `--ignored`).
struct Group {
    binary: &'static str,
    tests: Vec<&'static str>,
    ignored: bool,
}

/// The bench's guest: one group, the bench driver's peers section.
const BENCH_GROUP: &str = "shaper-bench";

/// The test groups a kernel of `release` runs under `plan`.
fn groups(release: &str, plan: Plan) -> Vec<Group> {
    let version = version_of(release);
    let tests = match plan {
        Plan::Full => GUEST_TESTS,
        Plan::Ci => CI_TESTS,
        Plan::Bench => {
            return vec![Group {
                binary: BENCH_GROUP,
                tests: Vec::new(),
                ignored: false,
            }]
        }
    };
    tests
        .iter()
        .filter(|(_, _, needs)| match needs {
            Needs::Any | Needs::Fq => version >= FLOOR,
            Needs::ClsactOnly => version >= FLOOR && version < TCX,
            Needs::Tcx => version >= TCX,
            Needs::BelowFloor => version < FLOOR,
        })
        .map(|(binary, tests, needs)| Group {
            binary,
            tests: tests
                .iter()
                .copied()
                .filter(|test| TEST_FILTER.get().is_none_or(|name| test.contains(name)))
                .collect(),
            ignored: matches!(needs, Needs::BelowFloor | Needs::Fq),
        })
        .filter(|group| !group.tests.is_empty())
        .collect()
}

/// The binaries the guest runs: shaper, shaper-cni, the delay line, and each test file's
/// executable by its name.
struct GuestBinaries {
    shaper_dir: PathBuf,
    tests: Vec<(String, PathBuf)>,
}

fn guest_binaries() -> Result<GuestBinaries> {
    crate::cargo(&["build", "--package", "shaper-cli"])?;
    // The same selection and features as `cargo xtask test`'s build, so nothing is built
    // twice when it runs the guests after its own tests.
    let args = [
        "test",
        "--workspace",
        "--exclude",
        "shaper-ebpf",
        "--features",
        "shaper-tests/bench",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ];
    println!("[xtask] cargo {}", args.join(" "));
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(args)
        .current_dir(workspace_root())
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo")?;
    ensure!(output.status.success(), "building the lab tests failed");
    let mut tests = Vec::new();
    let mut delay_line = None;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        let (Some(name), Some(executable)) = (
            message["target"]["name"].as_str(),
            message["executable"].as_str(),
        ) else {
            continue;
        };
        let kinds = &message["target"]["kind"];
        let lab = message["manifest_path"]
            .as_str()
            .is_some_and(|path| path.ends_with("/tests/Cargo.toml"));
        if lab && message["profile"]["test"] == true && kinds[0] == "test" {
            tests.push((name.to_string(), PathBuf::from(executable)));
        } else if name == crate::DELAY_LINE {
            delay_line = Some(PathBuf::from(executable));
        }
    }
    let shaper_dir = workspace_root().join(crate::dist::Profile::Dev.dir());
    if delay_line.is_none() {
        crate::cargo(&[
            "build",
            "--package",
            "shaper-tests",
            "--features",
            "bench",
            "--bin",
            crate::DELAY_LINE,
        ])?;
    }
    for (binary, _, _) in GUEST_TESTS.iter().chain(CI_TESTS) {
        ensure!(
            tests.iter().any(|(name, _)| name == binary),
            "no test executable {binary} among the lab tests"
        );
    }
    Ok(GuestBinaries { shaper_dir, tests })
}

/// Downloads (once) and unpacks the kernel package for `spec`: "6.1", "6.12", or the
/// path of a linux-image .deb.
fn fetch_kernel(spec: &str) -> Result<Kernel> {
    let cache = workspace_root().join("target/vm");
    fs::create_dir_all(&cache)?;
    let deb = if Path::new(spec).is_file() {
        PathBuf::from(spec)
    } else {
        let (start, end, suite) = kernel_source(spec).with_context(|| {
            format!("--kernel {spec}: expected 5.10, 6.1, 6.12 or the path of a linux-image .deb")
        })?;
        let apt = apt_options(&cache, suite)?;
        let package = newest_package(&apt, start, end)?;
        let deb = find_deb(&cache, &package);
        match deb {
            Some(deb) => deb,
            None => {
                println!("[xtask] apt-get download {package}");
                let status = Command::new("apt-get")
                    .args(&apt)
                    .args(["download", "-qq", &package])
                    .current_dir(&cache)
                    .status()
                    .context("cannot run apt-get")?;
                ensure!(
                    status.success(),
                    "cannot download {package} from the Debian registry (apt-get download failed)"
                );
                find_deb(&cache, &package)
                    .with_context(|| format!("apt-get download left no {package} .deb"))?
            }
        }
    };
    let stem = deb
        .file_stem()
        .and_then(|s| s.to_str())
        .context("a .deb without a name")?
        .to_string();
    let root = cache.join(format!("{stem}.d"));
    if !root.join(".unpacked").exists() {
        let _ = fs::remove_dir_all(&root);
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        fs::write(root.join(".unpacked"), "")?;
    }
    let modules = modules_dir(&root)?;
    let release = fs::read_dir(&modules)?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .next()
        .with_context(|| format!("{} holds no kernel's modules", modules.display()))?;
    let image = root.join(format!("boot/vmlinuz-{release}"));
    ensure!(image.exists(), "{} has no kernel image", deb.display());
    // modprobe and depmod read lib/modules under the root they are given.
    if modules != root.join("lib/modules") {
        let lib = root.join("lib");
        if !lib.exists() {
            std::os::unix::fs::symlink("usr/lib", &lib)?;
        }
    }
    if !modules.join(&release).join("modules.dep").exists() {
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    }
    Ok(Kernel {
        label: spec.to_string(),
        release,
        image,
        root,
    })
}

fn modules_dir(root: &Path) -> Result<PathBuf> {
    ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|dir| root.join(dir))
        .find(|dir| dir.is_dir())
        .with_context(|| format!("{} has no lib/modules", root.display()))
}

/// apt options for a private view of one Debian suite (its own sources and package
/// lists under `cache`), so the host's apt sources are neither needed nor touched.
fn apt_options(cache: &Path, suite: &str) -> Result<Vec<String>> {
    let dir = cache.join(format!("apt-{suite}"));
    for sub in ["lists/partial", "cache/archives/partial", "sources.d"] {
        fs::create_dir_all(dir.join(sub))?;
    }
    let sources = dir.join("sources.list");
    fs::write(
        &sources,
        format!(
            "deb http://deb.debian.org/debian {suite} main\n\
             deb http://deb.debian.org/debian {suite}-updates main\n\
             deb http://deb.debian.org/debian-security {suite}-security main\n"
        ),
    )?;
    let option = |name: &str, path: PathBuf| format!("-oDir::{name}={}", path.display());
    Ok(vec![
        option("Etc::SourceList", sources),
        option("Etc::SourceParts", dir.join("sources.d")),
        option("State::Lists", dir.join("lists")),
        option("Cache", dir.join("cache")),
    ])
}

/// The newest package of the suite `apt` sees named `start` DIGITS `end` (its package
/// lists fetched when there are none yet, or the name is not among them).
fn newest_package(apt: &[String], start: &str, end: &str) -> Result<String> {
    let mut names = String::new();
    for attempt in 0..2 {
        names = output(
            Command::new("apt-cache")
                .args(apt)
                .args(["pkgnames", start]),
        )
        .unwrap_or_default();
        if names.lines().any(|name| name.ends_with(end)) || attempt == 1 {
            break;
        }
        println!("[xtask] apt-get update (the package lists of {start}*{end})");
        output(Command::new("apt-get").args(apt).args(["update", "-qq"]))
            .context("cannot fetch the Debian registry's package lists (apt-get update)")?;
    }
    names
        .lines()
        .filter_map(|name| {
            let middle = name.strip_prefix(start)?.strip_suffix(end)?;
            let number = middle.parse::<u32>().ok()?;
            Some((number, name.to_string()))
        })
        .max()
        .map(|(_, name)| name)
        .with_context(|| format!("the Debian registry has no {start}N{end}"))
}

fn find_deb(dir: &Path, package: &str) -> Option<PathBuf> {
    let prefix = format!("{}_", package.replace('+', "%2b"));
    let plain = format!("{package}_");
    fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path())
        .find(|path| {
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            (name.starts_with(&prefix) || name.starts_with(&plain)) && name.ends_with(".deb")
        })
}

/// The module files to load for [`MODULES`], in load order, dependencies first.
fn module_closure(kernel: &Kernel) -> Result<Vec<PathBuf>> {
    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for module in MODULES {
        let text = match output(Command::new("modprobe").arg("-d").arg(&kernel.root).args([
            "-S",
            &kernel.release,
            "--show-depends",
            module,
        ])) {
            Ok(text) => text,
            Err(_) => {
                // The tests that need it fail saying so.
                println!("[xtask] kernel {} has no module {module}", kernel.release);
                continue;
            }
        };
        for line in text.lines() {
            // "insmod /path/x.ko[.xz] [options]" or "builtin x".
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = path.split_whitespace().next().unwrap_or_default();
                if seen.insert(path.to_string()) {
                    order.push(PathBuf::from(path));
                }
            }
        }
    }
    Ok(order)
}

/// Builds (or reuses) the guest's initramfs for `kernel`.
fn initramfs(kernel: &Kernel, binaries: &GuestBinaries, plan: Plan) -> Result<PathBuf> {
    let stage = workspace_root().join(format!("target/vm/guest-{}", kernel.release));
    let _ = fs::remove_dir_all(&stage);
    for dir in [
        "bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "etc", "tests",
        "modules", "var", "root",
    ] {
        fs::create_dir_all(stage.join(dir))?;
    }
    std::os::unix::fs::symlink("/run", stage.join("var/run"))?;
    stage_binaries(&stage, kernel, binaries, plan)?;
    if Path::new(CNI_PLUGINS).is_dir() {
        for entry in fs::read_dir(CNI_PLUGINS)? {
            copy_into(&stage, &entry?.path())?;
        }
    }
    // Name lookups the tools make.
    // tcpdump drops its privileges to its own user.
    fs::write(
        stage.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\ntcpdump:x:104:110::/nonexistent:/bin/false\n",
    )?;
    fs::write(stage.join("etc/group"), "root:x:0:\ntcpdump:x:110:\n")?;
    fs::write(stage.join("etc/hosts"), "127.0.0.1 localhost\n")?;
    fs::write(stage.join("etc/nsswitch.conf"), "hosts: files\n")?;
    stage_modules(&stage, kernel)?;
    let init = stage.join("init");
    fs::write(&init, init_script(&kernel.release, plan))?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))?;
    let archive = workspace_root().join(format!(
        "target/vm/initramfs-{}-{plan:?}.cpio",
        kernel.release
    ));
    write_cpio(&stage, &archive)?;
    let size = fs::metadata(&archive)?.len();
    println!(
        "[xtask] initramfs for {}: {} ({} MiB)",
        kernel.release,
        archive.display(),
        size >> 20
    );
    let _ = fs::remove_dir_all(&stage);
    Ok(archive)
}

/// Host tools at the paths the host has them, shaper's binaries and the planned test
/// binaries (stripped), and every library they load.
fn stage_binaries(
    stage: &Path,
    kernel: &Kernel,
    binaries: &GuestBinaries,
    plan: Plan,
) -> Result<()> {
    // Host tools, at the paths the host has them, and their libraries.
    let mut libraries = BTreeSet::new();
    let busybox = which("busybox")?;
    fs::copy(&busybox, stage.join("bin/busybox"))?;
    libraries.extend(libraries_of(&busybox)?);
    for command in GUEST_COMMANDS {
        let path = which(command)?;
        copy_into(stage, &path)?;
        libraries.extend(libraries_of(&path)?);
    }
    let shaper = stage.join("usr/local/bin");
    fs::create_dir_all(&shaper)?;
    let bench = (plan == Plan::Bench).then_some(BENCH_GROUP);
    for name in ["shaper", "shaper-cni", crate::DELAY_LINE]
        .into_iter()
        .chain(bench)
    {
        let from = binaries.shaper_dir.join(name);
        strip_into(&from, &shaper.join(name))?;
        libraries.extend(libraries_of(&from)?);
    }
    for group in groups(&kernel.release, plan) {
        let binary = group.binary;
        if binary == BENCH_GROUP {
            continue;
        }
        let (_, path) = binaries
            .tests
            .iter()
            .find(|(name, _)| name == binary)
            .context("a planned test binary is missing")?;
        let target = stage.join("tests").join(binary);
        if !target.exists() {
            strip_into(path, &target)?;
            libraries.extend(libraries_of(path)?);
        }
    }
    for library in &libraries {
        copy_into(stage, library)?;
    }
    Ok(())
}

/// The kernel's modules the lab needs, decompressed (busybox's insmod reads plain .ko
/// files), with their load order.
fn stage_modules(stage: &Path, kernel: &Kernel) -> Result<()> {
    let mut order = String::new();
    for (index, module) in module_closure(kernel)?.iter().enumerate() {
        let name = module
            .file_name()
            .context("a module without a name")?
            .to_string_lossy()
            .into_owned();
        let plain = format!(
            "{index:02}-{}",
            name.trim_end_matches(".xz").trim_end_matches(".zst")
        );
        let target = stage.join("modules").join(&plain);
        if name.ends_with(".xz") {
            let data = output_bytes(Command::new("xz").arg("-dc").arg(module))?;
            fs::write(&target, data)?;
        } else if name.ends_with(".zst") {
            let data = output_bytes(Command::new("zstd").arg("-dc").arg(module))?;
            fs::write(&target, data)?;
        } else {
            fs::copy(module, &target)?;
        }
        order.push_str(&format!("/modules/{plain}\n"));
    }
    fs::write(stage.join("modules/order"), order)?;
    Ok(())
}

/// The staged tree as a newc cpio archive, its files in a stable order.
fn write_cpio(stage: &Path, archive: &Path) -> Result<()> {
    let list = output_bytes(
        Command::new("sh")
            .arg("-c")
            .arg("find . -mindepth 1 | LC_ALL=C sort")
            .current_dir(stage),
    )?;
    let mut cpio = Command::new("cpio")
        .args(["--quiet", "-o", "-H", "newc", "-O"])
        .arg(archive)
        .current_dir(stage)
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot run cpio")?;
    std::io::Write::write_all(cpio.stdin.as_mut().context("cpio's stdin")?, &list)?;
    drop(cpio.stdin.take());
    ensure!(
        cpio.wait()?.success(),
        "cpio failed to write {}",
        archive.display()
    );
    Ok(())
}

/// The guest's init: mounts, modules, the lab's sysctls, then the test plan; prints a
/// marker per test group and one at the end, and powers off. `shaper.probe` on the kernel
/// command line only says it reached the init (the KVM probe).
fn init_script(release: &str, plan: Plan) -> String {
    let mut script = String::from(
        r#"#!/bin/busybox sh
/bin/busybox mkdir -p /bbin
/bin/busybox --install -s /bbin
export PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/bbin HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /dev/net /sys/fs/bpf /run/netns
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mkdir -p /run/netns
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
"#,
    );
    script.push_str(&format!(
        "if grep -q {PROBE} /proc/cmdline; then echo {READY} probe; poweroff -f; fi\n"
    ));
    script.push_str(
        r#"while read module; do insmod "$module" || echo "insmod $module failed"; done < /modules/order
ip link set lo up
cd /tmp
export SHAPER_BIN=/usr/local/bin/shaper SHAPER_DELAY_LINE_BIN=/usr/local/bin/shaper-delay-line
export RUST_BACKTRACE=1
"#,
    );
    script.push_str(&format!(
        "echo {READY} $(uname -r) $(nproc) CPUs\nstatus=0\n"
    ));
    if plan == Plan::Bench {
        // `bench --vm --rows TEXT`: single-quoted for the guest's shell.
        let rows = PEERS_ROWS.get().map_or(String::new(), |text| {
            format!(" --rows '{}'", text.replace('\'', "'\\''"))
        });
        script.push_str(&format!(
            "echo '== {BENCH_GROUP}'\n/usr/local/bin/{BENCH_GROUP} --only peers{rows} --json /tmp/peers.json\nrc=$?\n\
             echo {REPORT_BEGIN}\ncat /tmp/peers.json\necho\necho {REPORT_END}\n\
             echo {TEST_DONE} {BENCH_GROUP} $rc\n[ $rc = 0 ] || status=1\n"
        ));
    }
    for group in groups(release, plan) {
        if group.binary == BENCH_GROUP {
            continue;
        }
        let binary = group.binary;
        let mut line = format!("/tests/{binary} --test-threads=1");
        if group.ignored {
            line.push_str(" --ignored");
        }
        if !group.tests.is_empty() {
            line.push_str(" --exact");
            for test in &group.tests {
                line.push(' ');
                line.push_str(test);
            }
        }
        script.push_str(&format!(
            "echo '== {binary}'\n{line}\nrc=$?\necho {TEST_DONE} {binary} $rc\n[ $rc = 0 ] || status=1\n"
        ));
    }
    script.push_str(&format!("echo {EXIT} $status\npoweroff -f\n"));
    script
}

/// KVM when a probe boot with it reaches the init, else TCG (said, with why).
fn choose_accel(kernel: &Kernel, initramfs: &Path) -> Result<&'static str> {
    if !Path::new("/dev/kvm").exists() {
        println!("[xtask] no /dev/kvm: the guests run under TCG (emulated, slow)");
        return Ok("tcg");
    }
    let mut child = qemu(kernel, initramfs, "kvm", PROBE)?;
    let (lines, _reader) = read_lines(&mut child)?;
    let started = Instant::now();
    let mut reached = false;
    let mut last = Vec::new();
    while started.elapsed() < KVM_PROBE_LIMIT {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                if line.contains(READY) {
                    reached = true;
                    break;
                }
                // Nested KVM failing says so at once (and then hangs): no need to wait.
                if line.contains("KVM internal error") || line.contains("emulation failure") {
                    last.push(line);
                    break;
                }
                last.push(line);
                if last.len() > 3 {
                    last.remove(0);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    stop(&mut child);
    if reached {
        println!(
            "[xtask] KVM boots {}: the guests run under KVM",
            kernel.release
        );
        Ok("kvm")
    } else {
        println!(
            "[xtask] KVM did not reach the init of {} within {:?} (last: {}): the guests run \
             under TCG (emulated, slow)",
            kernel.release,
            KVM_PROBE_LIMIT,
            last.join(" / ")
        );
        Ok("tcg")
    }
}

fn qemu(kernel: &Kernel, initramfs: &Path, accel: &str, extra: &str) -> Result<Child> {
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-accel", accel, "-cpu", "max", "-smp", "2", "-m", "3G"])
        .args([
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
            "-serial",
            "stdio",
        ])
        .args(["-monitor", "none"])
        .arg("-kernel")
        .arg(&kernel.image)
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(format!(
            "console=ttyS0 panic=-1 loglevel=4 rdinit=/init mitigations=off {extra}"
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // The probe reads qemu's messages (KVM failing); a test run lets them through.
        .stderr(if extra == PROBE {
            Stdio::piped()
        } else {
            Stdio::inherit()
        });
    command.spawn().context("cannot start qemu-system-x86_64")
}

type Lines = (mpsc::Receiver<String>, std::thread::JoinHandle<()>);

/// The guest's console lines, and qemu's own messages when its stderr is piped (the KVM
/// probe's: a failing nested KVM says so there).
fn read_lines(child: &mut Child) -> Result<Lines> {
    let stdout = child.stdout.take().context("qemu's console")?;
    let (send, receive) = mpsc::channel();
    if let Some(stderr) = child.stderr.take() {
        let send = send.clone();
        std::thread::spawn(move || forward_lines(stderr, &send));
    }
    let reader = std::thread::spawn(move || forward_lines(stdout, &send));
    Ok((receive, reader))
}

fn forward_lines(from: impl std::io::Read, send: &mpsc::Sender<String>) {
    for line in BufReader::new(from).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line)
            .trim_end_matches('\r')
            .to_string();
        if send.send(line).is_err() {
            break;
        }
    }
}

fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Boots a guest that dies before its init at most this many times in a row.
const BOOT_ATTEMPTS: u32 = 5;

/// Boots `kernel` with `plan`, echoing its console, within [`guest_limit`]. A kernel that
/// dies before it reaches the init (under TCG here, 6.12 oopsed on an int3 in
/// `sched_clock_cpu` while patching its code at boot, two boots in eight here) is booted
/// again, saying so: no test has run, so no result is retried.
fn boot(
    kernel: &Kernel,
    initramfs: &Path,
    accel: &'static str,
    plan: Plan,
) -> Result<GuestOutcome> {
    println!(
        "== kernel {} ({}) under {accel}: {} test groups",
        kernel.label,
        kernel.release,
        groups(&kernel.release, plan).len()
    );
    let mut attempt = 1;
    loop {
        let (outcome, reached_init) = boot_once(kernel, initramfs, accel, plan)?;
        if reached_init || attempt == BOOT_ATTEMPTS {
            return Ok(outcome);
        }
        attempt += 1;
        println!(
            "[xtask] the kernel {} died before its init (above): booting it again, attempt \
             {attempt} of {BOOT_ATTEMPTS}",
            kernel.release
        );
    }
}

/// One boot: what the guest did, and whether its kernel reached the init.
fn boot_once(
    kernel: &Kernel,
    initramfs: &Path,
    accel: &'static str,
    plan: Plan,
) -> Result<(GuestOutcome, bool)> {
    let limit = guest_limit(plan);
    let mut reached_init = false;
    let mut in_report = false;
    let started = Instant::now();
    let mut child = qemu(kernel, initramfs, accel, "")?;
    let (lines, reader) = read_lines(&mut child)?;
    let mut outcome = GuestOutcome {
        kernel: kernel.release.clone(),
        accel,
        seconds: 0.0,
        groups: Vec::new(),
        exit: None,
        report: Vec::new(),
    };
    loop {
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            println!(
                "[xtask] the guest of {} ran past {:?}: killed",
                kernel.release, limit
            );
            break;
        }
        match lines.recv_timeout(left) {
            Ok(line) => {
                if line.trim() == REPORT_BEGIN {
                    in_report = true;
                    continue;
                }
                if line.trim() == REPORT_END {
                    in_report = false;
                    continue;
                }
                if in_report {
                    outcome.report.push(line);
                    continue;
                }
                println!("[{}] {line}", kernel.label);
                reached_init |= line.contains(READY);
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    [TEST_DONE, binary, rc] => {
                        outcome.groups.push((binary.to_string(), *rc == "0"));
                    }
                    [EXIT, status] => {
                        outcome.exit = status.parse().ok();
                    }
                    _ => {}
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    stop(&mut child);
    let _ = reader.join();
    outcome.seconds = started.elapsed().as_secs_f64();
    Ok((outcome, reached_init))
}

fn which(command: &str) -> Result<PathBuf> {
    let path = output(Command::new("sh").args(["-c", &format!("command -v {command}")]))
        .with_context(|| format!("{command} is not installed (`cargo xtask setup`)"))?;
    let path = PathBuf::from(path.trim());
    Ok(fs::canonicalize(&path).unwrap_or(path))
}

/// The shared libraries `ldd` names for `binary` (with the dynamic loader).
fn libraries_of(binary: &Path) -> Result<Vec<PathBuf>> {
    let text = output(Command::new("ldd").arg(binary)).unwrap_or_default();
    Ok(text
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// Copies `path` into `stage` at the same path (its content, not a link).
fn copy_into(stage: &Path, path: &Path) -> Result<()> {
    let target = stage.join(path.strip_prefix("/").unwrap_or(path));
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent)?;
    }
    if !target.exists() {
        fs::copy(path, &target).with_context(|| format!("cannot copy {}", path.display()))?;
    }
    Ok(())
}

fn strip_into(from: &Path, to: &Path) -> Result<()> {
    run(Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(to)
        .arg(from))
}

fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {command:?}"))?;
    ensure!(status.success(), "{command:?} failed ({status})");
    Ok(())
}

fn output(command: &mut Command) -> Result<String> {
    Ok(String::from_utf8_lossy(&output_bytes(command)?).into_owned())
}

fn output_bytes(command: &mut Command) -> Result<Vec<u8>> {
    let output = command
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    ensure!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(output.stdout)
}
