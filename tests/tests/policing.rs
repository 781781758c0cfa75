//! End-to-end scenarios on the namespace lab: real veths, real TC attach, real iperf3.
//! Rates are L2 rates measured at the server over the steady-state seconds of each run
//! (the first second, where the initial burst lands, is left out).

use serde_json::Value;
use shaper_tests::{
    assert_goodput_fraction, assert_programs_unloaded, assert_within, loaded_program_ids,
    shaper_bin, status_program_ids, BoundedCommand, Lab, Netns, Udp, ROUTER_TO_CLIENT,
    ROUTER_TO_SERVER, SERVER_DEV, SERVER_V4,
};
use std::{path::Path, process::Command, thread, time::Duration};

const TEN_MBIT: f64 = 10e6;

fn attach(lab: &Lab, ns: &Netns, dev: &str, extra: &[&str]) {
    let mut args = vec!["attach", dev];
    args.extend_from_slice(extra);
    lab.shaper_in(ns, &args).unwrap();
}

fn add_class(lab: &Lab, ns: &Netns, dev: &str, name: &str, rate: &str, extra: &[&str]) {
    let mut args = vec!["class", "add", name, "--dev", dev, "--rate", rate];
    args.extend_from_slice(extra);
    lab.shaper_in(ns, &args).unwrap();
}

fn class_stat(lab: &Lab, ns: &Netns, name: &str, field: &str) -> u64 {
    let stats = lab.stats(ns).unwrap();
    let class = stats
        .iter()
        .find(|c| c["name"] == name)
        .expect("class in stats");
    class[field].as_u64().unwrap()
}

fn udp_through_router(mode: &str, ipv6: bool) -> f64 {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(&lab, &router, ROUTER_TO_SERVER, &["--attach-mode", mode]);
    let status: Value =
        serde_json::from_str(&lab.shaper_in(&router, &["status", "--json"]).unwrap()).unwrap();
    assert_eq!(
        status[0]["attach_mode"], mode,
        "status reports the forced mode"
    );
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "udp10",
        "10mbit",
        &["--proto", "udp"],
    );
    let result = lab
        .udp(&Udp {
            ipv6,
            ..Udp::default()
        })
        .unwrap();
    assert!(class_stat(&lab, &router, "udp10", "dropped_packets") > 0);
    result.total_l2_bps()
}

#[test]
fn scenario01_udp_ipv4_policed_to_10mbit() {
    let rate = udp_through_router("tcx", false);
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the router (tcx)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn scenario01_udp_ipv6_policed_to_10mbit() {
    let rate = udp_through_router("tcx", true);
    assert_within(
        "UDP/IPv6, 100M offered, 10mbit class on the router (tcx)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn scenario09_udp_policed_in_clsact_mode() {
    let rate = udp_through_router("clsact", false);
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the router (clsact)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

/// Four UDP flows at 20 Mbit/s each through a 5 Mbit/s class with the given scope.
fn four_flows_through_5mbit(per: &str) -> shaper_tests::UdpResult {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(&lab, &router, ROUTER_TO_SERVER, &[]);
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "five",
        "5mbit",
        &["--proto", "udp", "--per", per],
    );
    let result = lab
        .udp(&Udp {
            rate: "20M",
            streams: 4,
            ..Udp::default()
        })
        .unwrap();
    assert_eq!(result.stream_l2_bps.len(), 4);
    result
}

#[test]
fn scenario02_per_flow_buckets_give_each_flow_the_rate() {
    let result = four_flows_through_5mbit("flow");
    for (index, rate) in result.stream_l2_bps.iter().enumerate() {
        assert_within(
            &format!("flow {index} of 4 at 20M, --per flow 5mbit"),
            *rate,
            5e6,
            0.05,
        );
    }
}

#[test]
fn scenario02_class_bucket_shares_the_rate() {
    let result = four_flows_through_5mbit("class");
    assert_within(
        "sum of 4 flows at 20M, --per class 5mbit",
        result.total_l2_bps(),
        5e6,
        0.03,
    );
}

/// Three UDP flows at 20 Mbit/s each, at once, through a 5 Mbit/s class with `--per
/// src` or `--per dst`: A 198.18.1.2 → 198.18.2.2, B 198.18.1.3 → 198.18.2.2 and
/// C 198.18.1.2 → 198.18.2.3 (second addresses on the client and the server). Received
/// L2 rates of A, B and C.
fn three_flows_keyed_by_address(per: &str) -> [f64; 3] {
    let mut lab = Lab::new().unwrap();
    let (client, router, server) = (lab.client.clone(), lab.router.clone(), lab.server.clone());
    client
        .run("ip", &["addr", "add", "198.18.1.3/24", "dev", "c0"])
        .unwrap();
    server
        .run("ip", &["addr", "add", "198.18.2.3/24", "dev", SERVER_DEV])
        .unwrap();
    attach(&lab, &router, ROUTER_TO_SERVER, &[]);
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "keyed",
        "5mbit",
        &["--proto", "udp", "--per", per],
    );
    let flow = |bind| Udp {
        rate: "20M",
        seconds: 4,
        bind: Some(bind),
        ..Udp::default()
    };
    let (a, b, c) = (flow("198.18.1.2"), flow("198.18.1.3"), flow("198.18.1.2"));
    let results = lab
        .udp_concurrently(&[
            (&client, &server, "198.18.2.2", &a),
            (&client, &server, "198.18.2.2", &b),
            (&client, &server, "198.18.2.3", &c),
        ])
        .unwrap();
    assert!(class_stat(&lab, &router, "keyed", "dropped_packets") > 0);
    [0, 1, 2].map(|index| results[index].total_l2_bps())
}

#[test]
fn scenario02_per_src_buckets_follow_the_source_address() {
    let [a, b, c] = three_flows_keyed_by_address("src");
    // A and C share a source, B has its own.
    assert_within("--per src: A + C (one source)", a + c, 5e6, 0.05);
    assert_within("--per src: B (another source)", b, 5e6, 0.05);
}

#[test]
fn scenario02_per_dst_buckets_follow_the_destination_address() {
    let [a, b, c] = three_flows_keyed_by_address("dst");
    // A and B share a destination, C has its own.
    assert_within("--per dst: A + B (one destination)", a + b, 5e6, 0.05);
    assert_within("--per dst: C (another destination)", c, 5e6, 0.05);
}

#[test]
fn scenario03_unmatched_traffic_is_not_limited() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(&lab, &router, ROUTER_TO_SERVER, &[]);
    // Matches UDP to port 6000 only; iperf3 uses 5202 and up.
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "other",
        "1mbit",
        &["--proto", "udp", "--dport", "6000"],
    );
    let result = lab
        .udp(&Udp {
            rate: "50M",
            ..Udp::default()
        })
        .unwrap();
    let offered_l2 = 50e6 * (1400.0 + 42.0) / 1400.0;
    let fraction = result.total_l2_bps() / offered_l2;
    println!(
        "unmatched UDP: {:.2} Mbit/s received of {:.2} offered ({:.1} %)",
        result.total_l2_bps() / 1e6,
        offered_l2 / 1e6,
        fraction * 100.0
    );
    assert!(
        fraction >= 0.90,
        "unmatched traffic got only {:.1} % of offered",
        fraction * 100.0
    );
    assert_eq!(class_stat(&lab, &router, "other", "passed_packets"), 0);
    assert_eq!(class_stat(&lab, &router, "other", "dropped_packets"), 0);
}

#[test]
fn scenario04_class_change_takes_effect_during_a_run() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(&lab, &router, ROUTER_TO_SERVER, &[]);
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "changing",
        "10mbit",
        &["--proto", "udp"],
    );
    let router_name = router.name.clone();
    let changer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(3500));
        let status = Command::new(shaper_bin())
            .args([
                "--netns",
                &router_name,
                "class",
                "change",
                "changing",
                "--dev",
                ROUTER_TO_SERVER,
                "--rate",
                "20mbit",
            ])
            .status_within_limit()
            .unwrap();
        assert!(status.success());
    });
    let result = lab
        .udp(&Udp {
            seconds: 7,
            ..Udp::default()
        })
        .unwrap();
    changer.join().unwrap();
    // The change lands about 3.4 s into the run: seconds 2-3 are before it, 5-7 after.
    assert_within(
        "before the change (1-3 s)",
        result.l2_bps_between(1.0, 3.0),
        10e6,
        0.05,
    );
    assert_within(
        "after the change to 20mbit (4-7 s)",
        result.l2_bps_between(4.0, 7.0),
        20e6,
        0.05,
    );
    let list: Value = serde_json::from_str(
        &lab.shaper_in(&router, &["class", "list", "--json"])
            .unwrap(),
    )
    .unwrap();
    assert_eq!(list[0]["rate_bps"], 20_000_000);
}

#[test]
fn scenario05_ingress_policing_on_the_server() {
    let mut lab = Lab::new().unwrap();
    let server = lab.server.clone();
    attach(&lab, &server, SERVER_DEV, &["--direction", "ingress"]);
    add_class(
        &lab,
        &server,
        SERVER_DEV,
        "in10",
        "10mbit",
        &["--direction", "ingress", "--proto", "udp"],
    );
    let result = lab.udp(&Udp::default()).unwrap();
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the server's ingress",
        result.total_l2_bps(),
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn scenario06_tcp_through_a_10mbit_class() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(&lab, &router, ROUTER_TO_SERVER, &[]);
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "tcp10",
        "10mbit",
        &["--proto", "tcp"],
    );
    let goodput = lab.tcp_series(10, "cubic", 1.0).unwrap().steady_bps();
    let dropped = class_stat(&lab, &router, "tcp10", "dropped_packets");
    println!(
        "TCP goodput through a 10mbit drop policer (default burst), after the first second: {:.3} Mbit/s ({:.1} % of the rate), {dropped} packets dropped",
        goodput / 1e6,
        goodput / TEN_MBIT * 100.0
    );
    assert_goodput_fraction("cubic at 10mbit, drop", goodput / TEN_MBIT, 0.85);
    assert!(
        dropped > 0,
        "the policer dropped nothing, so it did not limit"
    );
}

fn detach_restores(mode: &str) {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    attach(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        &["--attach-mode", mode, "--direction", "both"],
    );
    add_class(
        &lab,
        &router,
        ROUTER_TO_SERVER,
        "limit",
        "10mbit",
        &["--proto", "udp"],
    );
    let program_ids = status_program_ids(
        &lab.shaper_in(&router, &["status", "--json"]).unwrap(),
        ROUTER_TO_SERVER,
    );
    assert_eq!(program_ids.len(), 2, "one program per direction");
    let loaded = loaded_program_ids();
    assert!(program_ids.iter().all(|id| loaded.contains(id)));
    let policed = lab
        .udp(&Udp {
            rate: "50M",
            seconds: 3,
            ..Udp::default()
        })
        .unwrap();
    assert_within(
        "policed before detach",
        policed.total_l2_bps(),
        TEN_MBIT,
        0.05,
    );

    lab.shaper_in(&router, &["detach", ROUTER_TO_SERVER])
        .unwrap();
    let pins = Path::new("/sys/fs/bpf/shaper").join(format!("netns-{}", router.name));
    assert!(!pins.exists(), "pins left behind in {}", pins.display());
    assert_programs_unloaded(&format!("detach ({mode})"), &program_ids);
    for direction in ["egress", "ingress"] {
        let filters = router
            .run(
                "tc",
                &["filter", "show", "dev", ROUTER_TO_SERVER, direction],
            )
            .unwrap();
        assert!(
            filters.stdout.is_empty(),
            "tc filters left on {direction}: {}",
            String::from_utf8_lossy(&filters.stdout)
        );
    }
    let qdiscs = router
        .run("tc", &["qdisc", "show", "dev", ROUTER_TO_SERVER])
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&qdiscs.stdout).contains("clsact"),
        "clsact qdisc left behind"
    );
    let status = lab.shaper_in(&router, &["status", "--json"]).unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&status).unwrap(),
        serde_json::json!([])
    );

    let free = lab
        .udp(&Udp {
            rate: "50M",
            seconds: 3,
            ..Udp::default()
        })
        .unwrap();
    let offered_l2 = 50e6 * (1400.0 + 42.0) / 1400.0;
    println!(
        "after detach ({mode}): {:.2} Mbit/s of {:.2} offered",
        free.total_l2_bps() / 1e6,
        offered_l2 / 1e6
    );
    assert!(
        free.total_l2_bps() >= 0.9 * offered_l2,
        "traffic still limited after detach"
    );
}

#[test]
fn scenario07_detach_restores_unshaped_traffic_tcx() {
    detach_restores("tcx");
}

#[test]
fn scenario07_detach_restores_unshaped_traffic_clsact() {
    detach_restores("clsact");
}

#[test]
fn scenario08_arp_and_icmp_pass_a_udp_only_class() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    // Both directions of the router's server-facing link, with a tiny rate for UDP.
    attach(&lab, &router, ROUTER_TO_SERVER, &["--direction", "both"]);
    attach(&lab, &router, ROUTER_TO_CLIENT, &["--direction", "both"]);
    for dev in [ROUTER_TO_SERVER, ROUTER_TO_CLIENT] {
        for direction in ["egress", "ingress"] {
            add_class(
                &lab,
                &router,
                dev,
                &format!("udp-{direction}"),
                "8kbit",
                &[
                    "--direction",
                    direction,
                    "--proto",
                    "udp",
                    "--burst",
                    "1514",
                ],
            );
        }
    }
    // Forget every neighbour so the pings below need ARP (and ND) through the hooks.
    for ns in [&lab.client, &lab.router, &lab.server] {
        ns.run("ip", &["neigh", "flush", "all"]).unwrap();
    }
    let ping = lab
        .client
        .run("ping", &["-c", "5", "-i", "0.2", "-W", "2", SERVER_V4]);
    assert!(
        ping.is_ok(),
        "IPv4 ping through a UDP-only class failed: {ping:?}"
    );
    let ping6 = lab.client.run(
        "ping",
        &["-6", "-c", "5", "-i", "0.2", "-W", "2", "fd00:2::2"],
    );
    assert!(
        ping6.is_ok(),
        "IPv6 ping through a UDP-only class failed: {ping6:?}"
    );
    let stats = lab.stats(&router).unwrap();
    let touched: u64 = stats
        .iter()
        .map(|c| c["passed_packets"].as_u64().unwrap() + c["dropped_packets"].as_u64().unwrap())
        .sum();
    assert_eq!(
        touched, 0,
        "ARP/ICMP/ND were counted by a UDP-only class: {stats:?}"
    );
    // The classes are live: UDP is policed hard.
    let udp = lab
        .udp(&Udp {
            rate: "10M",
            seconds: 2,
            ..Udp::default()
        })
        .unwrap();
    assert!(
        udp.total_l2_bps() < 0.1e6,
        "UDP was not policed: {}",
        udp.total_l2_bps()
    );
    // Dropped at the first hook on the way: the router's ingress from the client.
    let dropped: u64 = lab
        .stats(&router)
        .unwrap()
        .iter()
        .map(|c| c["dropped_packets"].as_u64().unwrap())
        .sum();
    assert!(dropped > 0, "the UDP-only classes dropped nothing");
}
