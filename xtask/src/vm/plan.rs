//! What a guest runs: the test groups each kernel gets under each plan, and the guest's
//! init script that runs them and prints markers on the console.

use super::kernel::{version_of, FLOOR, TCX};
use super::runner::{EXIT, PROBE, READY, REPORT_BEGIN, REPORT_END, TEST_DONE};
use std::{sync::OnceLock, time::Duration};

/// What a guest runs.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Plan {
    /// Every guest test ([`GUEST_TESTS`]): `cargo xtask vm-test`.
    Full,
    /// CI's share ([`CI_TESTS`]), run by `cargo xtask test`.
    Ci,
    /// Latency under load beside the qdiscs users pick instead (`shaper-bench --only
    /// peers`): `cargo xtask bench --vm`.
    Bench,
}

/// Which kernels a group of guest tests needs.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Needs {
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

impl Needs {
    /// Whether the tests are ignored ones on the host (run with `--ignored`).
    pub(super) fn is_ignored(self) -> bool {
        matches!(self, Needs::BelowFloor | Needs::Fq)
    }
}

/// The guest's test plan: a test binary (the `tests/tests/*.rs` file) and the tests of it
/// to run (all when empty).
pub(super) const GUEST_TESTS: &[(&str, &[&str], Needs)] = &[
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
/// traffic or are refused (before 6.4, whose ifb drops redirects); DSCP marks over the
/// rate; one Cubic flow shaped at 10 Mbit/s through HTB with CoDel keeps its goodput and a
/// short queue; the CNI plugin's ADD/CHECK/DEL; a kernel below the floor refuses in one
/// line. Under TCG each load of the program on 6.1 verifies for 15–20 s.
pub(super) const CI_TESTS: &[(&str, &[&str], Needs)] = &[
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
        "actions",
        &["dscp_remarks_over_rate_packets_ipv4_and_ipv6"],
        Needs::Any,
    ),
    (
        "latency",
        &["shape_at_10mbit_keeps_a_cubic_flows_queue_and_neighbours_short"],
        Needs::Any,
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
pub(super) fn guest_limit(plan: Plan) -> Duration {
    match plan {
        Plan::Full => Duration::from_secs(15 * 60),
        Plan::Ci => Duration::from_secs(10 * 60),
        // The latency rows' 48 runs and the isolation rows' 40, of 30 s each, about 32
        // and 30 minutes under TCG with each lab's set-up, the idle RTT and the tools'
        // start; then the held-out cells' 108 runs of 20 s, about 65 minutes.
        Plan::Bench => Duration::from_secs(180 * 60),
    }
}

/// `vm-test --test NAME`: only the plan's tests whose name contains NAME run (set once,
/// before the first guest is made).
pub(super) static TEST_FILTER: OnceLock<String> = OnceLock::new();

/// Narrows every guest to the plan's tests whose name contains `name`.
pub fn only_tests_named(name: String) {
    let _ = TEST_FILTER.set(name);
}

/// `bench --vm --rows TEXT`: only the peers rows whose setup contains TEXT.
pub(super) static PEERS_ROWS: OnceLock<String> = OnceLock::new();

/// Narrows the bench's guests to the peers rows whose setup contains `text`.
pub fn only_peers_rows(text: String) {
    let _ = PEERS_ROWS.set(text);
}

/// A test group of the guest: a test binary, the tests of it to run (all when empty),
/// and whether they are ignored ones (run with `--ignored`).
pub(super) struct Group {
    pub(super) binary: &'static str,
    pub(super) tests: Vec<&'static str>,
    pub(super) ignored: bool,
}

/// The bench's guest: one group, the bench driver's peers section.
pub(super) const BENCH_GROUP: &str = "shaper-bench";

/// The test groups a kernel of `release` runs under `plan`.
pub(super) fn groups(release: &str, plan: Plan) -> Vec<Group> {
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
            ignored: needs.is_ignored(),
        })
        .filter(|group| !group.tests.is_empty())
        .collect()
}

/// The guest's init: mounts, modules, the lab's sysctls, then the test plan; prints a
/// marker per test group and one at the end, and powers off. `shaper.probe` on the kernel
/// command line only says it reached the init (the KVM probe).
pub(super) fn init_script(release: &str, plan: Plan) -> String {
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
