//! Policing end to end on the namespace lab (real veths, real TC attach, real iperf3):
//! UDP and TCP held to a class's rate (tcx and clsact, egress and ingress), the bucket
//! scopes (class, flow, source, destination), unmatched traffic left alone, a rate change
//! during a run, detach restoring unshaped traffic, ARP/ICMP/ND through a UDP-only class.
//! Rates are L2 rates measured at the server over the steady-state seconds of each run
//! (the first second, where the initial burst lands, is left out).

use shaper_tests::{
    assert_goodput_fraction, assert_programs_unloaded, assert_within, counter, loaded_program_ids,
    status_program_ids, Lab, Udp, UdpResult, CLIENT_DEV, ROUTER_TO_CLIENT, ROUTER_TO_SERVER,
    SERVER_DEV, SERVER_V4, SERVER_V6,
};
use std::{path::Path, thread, time::Duration};

const TEN_MBIT: f64 = 10e6;

fn udp_through_router(mode: &str, ipv6: bool) -> f64 {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router
        .attach(ROUTER_TO_SERVER, &["--attach-mode", mode])
        .unwrap();
    let status = router.shaper_json(&["status", "--json"]).unwrap();
    assert_eq!(
        status[0]["attach_mode"], mode,
        "status reports the forced mode"
    );
    router
        .class_add(
            "udp10",
            ROUTER_TO_SERVER,
            &["--rate", "10mbit", "--proto", "udp"],
        )
        .unwrap();
    let result = lab
        .udp(&Udp {
            ipv6,
            ..Udp::default()
        })
        .unwrap();
    assert!(counter(&router.stats_row("udp10").unwrap(), "dropped_packets") > 0);
    result.total_l2_bps()
}

#[test]
fn udp_ipv4_is_policed_to_10mbit_on_the_router() {
    let rate = udp_through_router("tcx", false);
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the router (tcx)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn udp_ipv6_is_policed_to_10mbit_on_the_router() {
    let rate = udp_through_router("tcx", true);
    assert_within(
        "UDP/IPv6, 100M offered, 10mbit class on the router (tcx)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn udp_is_policed_to_10mbit_in_clsact_mode() {
    let rate = udp_through_router("clsact", false);
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the router (clsact)",
        rate,
        TEN_MBIT,
        0.03,
    );
}

/// Four UDP flows at 20 Mbit/s each through a 5 Mbit/s class with the given scope.
fn four_flows_through_5mbit(per: &str) -> UdpResult {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "five",
            ROUTER_TO_SERVER,
            &["--rate", "5mbit", "--proto", "udp", "--per", per],
        )
        .unwrap();
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
fn per_flow_buckets_give_each_flow_the_rate() {
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
fn a_class_bucket_shares_the_rate_among_all_flows() {
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
        .run("ip", &["addr", "add", "198.18.1.3/24", "dev", CLIENT_DEV])
        .unwrap();
    server
        .run("ip", &["addr", "add", "198.18.2.3/24", "dev", SERVER_DEV])
        .unwrap();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "keyed",
            ROUTER_TO_SERVER,
            &["--rate", "5mbit", "--proto", "udp", "--per", per],
        )
        .unwrap();
    let flow = |bind| Udp {
        bind: Some(bind),
        ..Udp::at("20M", 4)
    };
    let (a, b, c) = (flow("198.18.1.2"), flow("198.18.1.3"), flow("198.18.1.2"));
    let results = lab
        .udp_concurrently(&[
            (&client, &server, "198.18.2.2", &a),
            (&client, &server, "198.18.2.2", &b),
            (&client, &server, "198.18.2.3", &c),
        ])
        .unwrap();
    assert!(counter(&router.stats_row("keyed").unwrap(), "dropped_packets") > 0);
    [0, 1, 2].map(|index| results[index].total_l2_bps())
}

#[test]
fn per_src_buckets_follow_the_source_address() {
    let [a, b, c] = three_flows_keyed_by_address("src");
    // A and C share a source, B has its own.
    assert_within("--per src: A + C (one source)", a + c, 5e6, 0.05);
    assert_within("--per src: B (another source)", b, 5e6, 0.05);
}

#[test]
fn per_dst_buckets_follow_the_destination_address() {
    let [a, b, c] = three_flows_keyed_by_address("dst");
    // A and B share a destination, C has its own.
    assert_within("--per dst: A + B (one destination)", a + b, 5e6, 0.05);
    assert_within("--per dst: C (another destination)", c, 5e6, 0.05);
}

#[test]
fn unmatched_traffic_is_not_limited() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    // Matches UDP to port 6000 only; iperf3 uses 5202 and up.
    router
        .class_add(
            "other",
            ROUTER_TO_SERVER,
            &["--rate", "1mbit", "--proto", "udp", "--dport", "6000"],
        )
        .unwrap();
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
    let other = router.stats_row("other").unwrap();
    assert_eq!(counter(&other, "passed_packets"), 0);
    assert_eq!(counter(&other, "dropped_packets"), 0);
}

#[test]
fn class_change_takes_effect_during_a_run() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "changing",
            ROUTER_TO_SERVER,
            &["--rate", "10mbit", "--proto", "udp"],
        )
        .unwrap();
    let changer = thread::spawn({
        let router = router.clone();
        move || {
            thread::sleep(Duration::from_millis(3500));
            router
                .shaper(&[
                    "class",
                    "change",
                    "changing",
                    "--dev",
                    ROUTER_TO_SERVER,
                    "--rate",
                    "20mbit",
                ])
                .unwrap();
        }
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
    let list = router.shaper_json(&["class", "list", "--json"]).unwrap();
    assert_eq!(list[0]["rate_bps"], 20_000_000);
}

/// Issue 11, item 4: a class drained by UDP at 150 Mbit/s through 100 Mbit/s, raised to
/// 200 Mbit/s (above the offered load): its drop counter, sampled every 10 ms, stops
/// within 20 ms of the change. Before the bucket was converted at a change, the debt
/// (250 ms of burst at the old rate) kept dropping for (burst/rate)(1 - rate/new) = 125 ms.
#[test]
fn raising_a_drained_class_above_its_load_stops_the_drops_at_once() {
    use shaper::state::{Attachment, Direction, Location};
    use std::time::Instant;
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "raised",
            ROUTER_TO_SERVER,
            &["--rate", "100mbit", "--proto", "udp"],
        )
        .unwrap();
    let attachment = Attachment::open(&Location {
        netns: Some(router.name.clone()),
        dev: ROUTER_TO_SERVER.into(),
        direction: Direction::Egress,
    })
    .unwrap();
    let (id, _) = attachment.find_class("raised").unwrap().unwrap();
    let dropped = || attachment.class_stats(id).unwrap().dropped_packets;
    let (samples, changed) = thread::scope(|scope| {
        let traffic = scope.spawn(|| lab.udp(&Udp::at("150M", 4)));
        // The burst (3.125 MB) drains in 0.5 s at 50 Mbit/s over the rate.
        thread::sleep(Duration::from_millis(2000));
        let start = Instant::now();
        let mut samples = Vec::new();
        let mut changed = None;
        while start.elapsed() < Duration::from_millis(800) {
            samples.push((start.elapsed(), dropped()));
            if changed.is_none() && start.elapsed() >= Duration::from_millis(300) {
                router
                    .shaper(&[
                        "class",
                        "change",
                        "raised",
                        "--dev",
                        ROUTER_TO_SERVER,
                        "--rate",
                        "200mbit",
                    ])
                    .unwrap();
                changed = Some(start.elapsed());
            }
            thread::sleep(Duration::from_millis(10));
        }
        traffic.join().unwrap().unwrap();
        (samples, changed.unwrap())
    });
    let before: Vec<_> = samples.iter().filter(|(t, _)| *t < changed).collect();
    assert!(
        before.last().unwrap().1 > before.first().unwrap().1 + 100,
        "the class was not dropping before the change: {before:?}"
    );
    let last_drop = samples
        .windows(2)
        .filter(|pair| pair[1].1 > pair[0].1)
        .map(|pair| pair[1].0)
        .max()
        .unwrap();
    let after = last_drop.saturating_sub(changed);
    println!(
        "change returned at {changed:?}; the last drop was seen at {last_drop:?}: {after:?} \
         after it ({} samples)",
        samples.len()
    );
    assert!(
        after <= Duration::from_millis(20),
        "drops went on for {after:?} after the raise"
    );
}

/// Issue 11, item 2: a tun device carries bare IP packets (no Ethernet header). UDP at
/// about 10 Mbit/s sent out of it through a 1 Mbit/s class is policed: the class admits its
/// burst plus the rate, and drops the rest. Before, the parser read an "ethertype" out of
/// the IPv4 source address, and the traffic passed unclassified.
#[test]
fn udp_out_of_a_tun_device_is_policed() {
    use std::time::Instant;
    let lab = Lab::new().unwrap();
    let router = lab.router.clone();
    for args in [
        &["tuntap", "add", "dev", "tun0", "mode", "tun"][..],
        &["link", "set", "tun0", "up"],
        &["addr", "add", "198.18.9.1/24", "dev", "tun0"],
    ] {
        router.run("ip", args).unwrap();
    }
    router.attach("tun0", &[]).unwrap();
    router
        .class_add("tunudp", "tun0", &["--rate", "1mbit", "--proto", "udp"])
        .unwrap();
    // 1000-byte datagrams every 0.8 ms for 2 s, from the router itself out of tun0 (no
    // reader holds the tun open, so its packets go no further than the hook).
    let (sent, seconds) = shaper::netns::in_namespace(&Some(router.name.clone()), || {
        let socket = std::net::UdpSocket::bind("198.18.9.1:0")?;
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < Duration::from_secs(2) && sent < 10_000 {
            socket.send_to(&[0u8; 1000], "198.18.9.2:9")?;
            sent += 1;
            thread::sleep(Duration::from_micros(800));
        }
        Ok((sent, start.elapsed().as_secs_f64()))
    })
    .unwrap();
    let row = router.stats_row("tunudp").unwrap();
    let (passed, dropped) = (
        counter(&row, "passed_bytes") as f64,
        counter(&row, "dropped_packets"),
    );
    let burst = counter(&row, "burst_bytes") as f64;
    // Charged at L3 (no link-layer header on a tun): 1028 bytes per datagram.
    let allowed = burst + 1e6 / 8.0 * seconds;
    println!(
        "tun0: {sent} datagrams in {seconds:.2} s, class passed {passed} bytes (burst + rate = \
         {allowed:.0}), dropped {dropped}"
    );
    assert!(dropped > sent / 2, "the class did not police: {row}");
    assert!(passed <= allowed + 1028.0, "passed {passed} > {allowed}");
    assert!(passed >= 0.9 * allowed, "passed {passed} of {allowed}");
}

#[test]
fn udp_is_policed_to_10mbit_on_the_servers_ingress() {
    let mut lab = Lab::new().unwrap();
    let server = lab.server.clone();
    server
        .attach(SERVER_DEV, &["--direction", "ingress"])
        .unwrap();
    server
        .class_add(
            "in10",
            SERVER_DEV,
            &[
                "--rate",
                "10mbit",
                "--direction",
                "ingress",
                "--proto",
                "udp",
            ],
        )
        .unwrap();
    let result = lab.udp(&Udp::default()).unwrap();
    assert_within(
        "UDP/IPv4, 100M offered, 10mbit class on the server's ingress",
        result.total_l2_bps(),
        TEN_MBIT,
        0.03,
    );
}

#[test]
fn tcp_is_policed_to_10mbit_through_a_drop_class() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    router
        .class_add(
            "tcp10",
            ROUTER_TO_SERVER,
            &["--rate", "10mbit", "--proto", "tcp"],
        )
        .unwrap();
    let goodput = lab.tcp_series(10, "cubic", 1.0).unwrap().steady_bps();
    let dropped = counter(&router.stats_row("tcp10").unwrap(), "dropped_packets");
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
    router
        .attach(
            ROUTER_TO_SERVER,
            &["--attach-mode", mode, "--direction", "both"],
        )
        .unwrap();
    router
        .class_add(
            "limit",
            ROUTER_TO_SERVER,
            &["--rate", "10mbit", "--proto", "udp"],
        )
        .unwrap();
    let program_ids = status_program_ids(
        &router.shaper(&["status", "--json"]).unwrap(),
        ROUTER_TO_SERVER,
    );
    assert_eq!(program_ids.len(), 2, "one program per direction");
    let loaded = loaded_program_ids();
    assert!(program_ids.iter().all(|id| loaded.contains(id)));
    let policed = lab.udp(&Udp::at("50M", 3)).unwrap();
    assert_within(
        "policed before detach",
        policed.total_l2_bps(),
        TEN_MBIT,
        0.05,
    );

    router.shaper(&["detach", ROUTER_TO_SERVER]).unwrap();
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
    assert_eq!(
        router.shaper_json(&["status", "--json"]).unwrap(),
        serde_json::json!([])
    );

    let free = lab.udp(&Udp::at("50M", 3)).unwrap();
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
fn detach_restores_unshaped_traffic_tcx() {
    detach_restores("tcx");
}

#[test]
fn detach_restores_unshaped_traffic_clsact() {
    detach_restores("clsact");
}

#[test]
fn arp_icmp_and_nd_pass_a_udp_only_class() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    // Both directions of the router's server-facing link, with a tiny rate for UDP.
    for dev in [ROUTER_TO_SERVER, ROUTER_TO_CLIENT] {
        router.attach(dev, &["--direction", "both"]).unwrap();
    }
    for dev in [ROUTER_TO_SERVER, ROUTER_TO_CLIENT] {
        for direction in ["egress", "ingress"] {
            router
                .class_add(
                    &format!("udp-{direction}"),
                    dev,
                    &[
                        "--rate",
                        "8kbit",
                        "--direction",
                        direction,
                        "--proto",
                        "udp",
                        "--burst",
                        "1514",
                    ],
                )
                .unwrap();
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
        &["-6", "-c", "5", "-i", "0.2", "-W", "2", SERVER_V6],
    );
    assert!(
        ping6.is_ok(),
        "IPv6 ping through a UDP-only class failed: {ping6:?}"
    );
    let stats = router.stats().unwrap();
    let touched: u64 = stats
        .iter()
        .map(|c| counter(c, "passed_packets") + counter(c, "dropped_packets"))
        .sum();
    assert_eq!(
        touched, 0,
        "ARP/ICMP/ND were counted by a UDP-only class: {stats:?}"
    );
    // The classes are live: UDP is policed hard.
    let udp = lab.udp(&Udp::at("10M", 2)).unwrap();
    assert!(
        udp.total_l2_bps() < 0.1e6,
        "UDP was not policed: {}",
        udp.total_l2_bps()
    );
    // Dropped at the first hook on the way: the router's ingress from the client.
    let dropped: u64 = router
        .stats()
        .unwrap()
        .iter()
        .map(|c| counter(c, "dropped_packets"))
        .sum();
    assert!(dropped > 0, "the UDP-only classes dropped nothing");
}
