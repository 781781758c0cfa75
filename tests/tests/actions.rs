//! Actions on packets over the rate, checked on the wire: DSCP and ECN bits on packets
//! captured in the server namespace, fwmark with a counting nftables rule in the router,
//! pass (monitor), shape (HTB), and TCP goodput through `drop` and `ecn` classes (Cubic
//! and BBR) and through a drop class on the sender's own egress. The meters are in
//! meters.rs.

use serde_json::Value;
use shaper_tests::{
    assert_goodput_fraction, assert_within, counter, median, stderr, Capture, Lab, Udp, CLIENT_DEV,
    ROUTER_TO_CLIENT, ROUTER_TO_SERVER, SERVER_DEV, UDP_V4_OVERHEAD,
};
use std::{thread, time::Duration};

#[test]
fn dscp_remarks_over_rate_packets_ipv4_and_ipv6() {
    for ipv6 in [false, true] {
        let mut lab = Lab::with_router_class(
            ROUTER_TO_SERVER,
            &["--rate", "5mbit", "--proto", "udp", "--action", "dscp=af11"],
        )
        .unwrap();
        let mut capture = Capture::start(&lab.server, SERVER_DEV, "udp").unwrap();
        // ECT(0) datagrams: the rewrite must keep the ECN bits.
        let result = lab
            .udp(&Udp {
                rate: "20M",
                seconds: 3,
                ipv6,
                tos: Some(2),
                ..Udp::default()
            })
            .unwrap();
        let (af11, af11_ect0, all) = if ipv6 {
            // Traffic class is bits 4-11 of the first 16-bit word: DSCP its upper six,
            // ECN its lower two.
            (
                capture
                    .count("udp and (ip6[0:2] >> 6) & 0x3f = 10")
                    .unwrap(),
                capture
                    .count("udp and (ip6[0:2] >> 6) & 0x3f = 10 and (ip6[0:2] >> 4) & 3 = 2")
                    .unwrap(),
                capture.count("udp").unwrap(),
            )
        } else {
            (
                capture.count("udp and ip[1] & 0xfc = 40").unwrap(),
                capture.count("udp and ip[1] = 42").unwrap(),
                capture.count("udp").unwrap(),
            )
        };
        assert_eq!(
            af11_ect0, af11,
            "every remarked packet keeps its ECT(0) bits"
        );
        let bad_checksums = capture
            .lines("udp")
            .unwrap()
            .iter()
            .filter(|l| l.contains("bad cksum"))
            .count();
        let stats = lab.router.stats_row("c").unwrap();
        println!(
            "tcpdump: {}; server s0 received {} packets",
            capture.report.trim().replace('\n', "; "),
            lab.server.link_stat(SERVER_DEV, "rx_packets").unwrap()
        );
        let fraction = af11 as f64 / all as f64;
        println!(
            "dscp=af11 ({}): {af11} of {all} captured packets remarked ({:.1} %), stats marked {}, dropped {}, received {:.2} Mbit/s",
            if ipv6 { "IPv6" } else { "IPv4" },
            fraction * 100.0,
            counter(&stats, "marked_packets"),
            counter(&stats, "dropped_packets"),
            result.total_l2_bps() / 1e6
        );
        assert_eq!(counter(&stats, "dropped_packets"), 0, "dscp must not drop");
        assert_eq!(bad_checksums, 0, "IPv4 header checksums must be fixed");
        // 20 Mbit/s offered over a 5 Mbit/s profile: about three quarters are out of profile.
        assert!(
            (0.65..=0.80).contains(&fraction),
            "remarked fraction {fraction:.3}"
        );
        assert_eq!(
            af11 as u64,
            counter(&stats, "marked_packets"),
            "every marked packet arrives remarked"
        );
        assert!(
            result.total_l2_bps() > 0.9 * 20e6,
            "remarked traffic must pass"
        );
    }
}

/// ECT(0) UDP through an `ecn` class: never marked while the bucket is at most half
/// drained (at 0.8 of the rate, no CE at all); offered at twice the rate, the packets that
/// pass before the first CE are those that arrive while the burst's first half drains
/// (within 20 %: marking at 15/16 of the burst would pass almost twice as many); then CE
/// on what passes, and over the rate drops. Not ECN-capable: never marked, policed.
#[test]
fn ecn_marks_capable_packets_and_drops_the_rest() {
    let mut lab = Lab::with_router_class(
        ROUTER_TO_SERVER,
        &["--rate", "5mbit", "--proto", "udp", "--action", "ecn"],
    )
    .unwrap();
    let ect = |rate| Udp {
        tos: Some(2),
        ..Udp::at(rate, 3)
    };
    // Below the rate: the bucket never drains past half.
    let mut capture = Capture::start(&lab.server, SERVER_DEV, "udp").unwrap();
    let below = lab.udp(&ect("4M")).unwrap();
    let (all, ce) = (
        capture.count("udp").unwrap(),
        capture.count("udp and ip[1] & 3 = 3").unwrap(),
    );
    println!(
        "ecn, ECT(0) UDP at 4M through 5mbit: {:.3} Mbit/s, {ce} of {all} packets CE",
        below.total_l2_bps() / 1e6
    );
    assert!(all > 500, "only {all} packets captured");
    assert_eq!(ce, 0, "CE before the bucket was half drained");
    drop(capture);
    // A second's rest refills the bucket, then twice the rate.
    thread::sleep(Duration::from_secs(1));
    let before = lab.router.stats_row("c").unwrap();
    let mut capture = Capture::start(&lab.server, SERVER_DEV, "udp").unwrap();
    let over = lab.udp(&ect("10M")).unwrap();
    let lines = capture.lines("udp").unwrap();
    let ce = lines.iter().filter(|line| line.contains(",CE")).count();
    let unmarked_first = lines
        .iter()
        .position(|line| line.contains(",CE"))
        .expect("some packet got CE");
    let bad = lines.iter().filter(|l| l.contains("bad cksum")).count();
    let stats = lab.router.stats_row("c").unwrap();
    let marked = counter(&stats, "marked_packets") - counter(&before, "marked_packets");
    // Packets that arrive while half the burst drains at (offered − rate).
    let frame = 1400.0 + UDP_V4_OVERHEAD as f64;
    let offered = 10e6 * frame / 1400.0;
    let half_burst = counter(&stats, "burst_bytes") as f64 / 2.0;
    let expected_first = half_burst * offered / (offered - 5e6) / frame;
    println!(
        "ecn, ECT(0) UDP at 10M through 5mbit: {:.3} Mbit/s, {ce} CE packets captured ({} \
         passed before the first, {expected_first:.0} expected), stats marked {marked}",
        over.total_l2_bps() / 1e6,
        unmarked_first,
    );
    assert_eq!(bad, 0, "IPv4 header checksums must be fixed");
    assert_eq!(ce as u64, marked, "every marked packet arrives CE");
    assert!(
        (unmarked_first as f64 - expected_first).abs() <= 0.2 * expected_first,
        "{unmarked_first} packets passed before the first CE, {expected_first:.0} expected"
    );
    assert!(
        ce + 5 >= lines.len() - unmarked_first,
        "after the first CE nearly every packet that passes is marked: {ce} of {}",
        lines.len() - unmarked_first
    );
    assert_within(
        "ECT UDP through an ecn class",
        over.total_l2_bps(),
        5e6,
        0.03,
    );
    // Not ECN-capable: never marked, policed to the rate (UDP at 10× the rate: ±3 %).
    drop(capture);
    let mut capture = Capture::start(&lab.server, SERVER_DEV, "udp").unwrap();
    let plain = lab.udp(&Udp::at("50M", 5)).unwrap();
    assert_eq!(capture.count("udp and ip[1] & 3 != 0").unwrap(), 0);
    assert_within(
        "non-ECT UDP at 10× the rate through an ecn class",
        plain.total_l2_bps(),
        5e6,
        0.03,
    );
}

#[test]
fn fwmark_is_set_on_over_rate_packets() {
    // On the router's ingress, so the router's own nftables sees the mark when forwarding.
    let mut lab = Lab::with_router_class(
        ROUTER_TO_CLIENT,
        &[
            "--direction",
            "ingress",
            "--rate",
            "5mbit",
            "--proto",
            "udp",
            "--action",
            "fwmark=0x10/0xff",
        ],
    )
    .unwrap();
    for command in [
        "add table inet shaper_test",
        "add chain inet shaper_test forward { type filter hook forward priority 0 ; }",
        "add rule inet shaper_test forward udp dport != 0 meta mark & 0xff == 0x10 counter",
        "add rule inet shaper_test forward udp dport != 0 meta mark & 0xff != 0x10 counter",
    ] {
        lab.router.run("nft", &[command]).unwrap();
    }
    let result = lab.udp(&Udp::at("20M", 3)).unwrap();
    let listing = String::from_utf8_lossy(
        &lab.router
            .run("nft", &["-j", "list", "table", "inet", "shaper_test"])
            .unwrap()
            .stdout,
    )
    .to_string();
    let json: Value = serde_json::from_str(&listing).unwrap();
    let counters: Vec<u64> = json["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|item| item["rule"]["expr"].as_array())
        .map(|expr| {
            expr.iter()
                .find_map(|e| e["counter"]["packets"].as_u64())
                .unwrap()
        })
        .collect();
    let stats = lab.router.stats_row("c").unwrap();
    println!(
        "fwmark: nftables counted {} marked and {} unmarked forwarded packets; stats marked {} passed {}; {:.2} Mbit/s received",
        counters[0], counters[1], counter(&stats, "marked_packets"), counter(&stats, "passed_packets"), result.total_l2_bps() / 1e6
    );
    assert_eq!(
        counters[0],
        counter(&stats, "marked_packets"),
        "every marked packet seen by nftables"
    );
    assert!(counters[0] > 1000 && counters[1] > 1000);
    assert_eq!(counter(&stats, "dropped_packets"), 0);
}

#[test]
fn pass_counts_without_enforcing() {
    let mut lab = Lab::with_router_class(
        ROUTER_TO_SERVER,
        &["--rate", "5mbit", "--proto", "udp", "--action", "pass"],
    )
    .unwrap();
    let result = lab.udp(&Udp::at("20M", 3)).unwrap();
    let stats = lab.router.stats_row("c").unwrap();
    let over = counter(&stats, "marked_bytes") as f64 / counter(&stats, "passed_bytes") as f64;
    println!(
        "pass: {:.2} Mbit/s received, {:.1} % of bytes over the rate (counted, not dropped)",
        result.total_l2_bps() / 1e6,
        over * 100.0
    );
    assert!(result.total_l2_bps() > 0.9 * 20e6 * 1442.0 / 1400.0);
    assert_eq!(counter(&stats, "dropped_packets"), 0);
    assert!((0.65..=0.80).contains(&over), "over-rate share {over:.3}");
}

fn tcp_goodput(rate: &str, rate_bps: f64, action: &str, congestion: &str) -> (f64, Value) {
    let mut lab =
        Lab::with_router_class(ROUTER_TO_SERVER, &["--rate", rate, "--action", action]).unwrap();
    if action == "ecn" {
        lab.client
            .run("sysctl", &["-qw", "net.ipv4.tcp_ecn=1"])
            .unwrap();
    }
    let run = lab.tcp_series(10, congestion, 1.0).unwrap();
    let goodput = run.steady_bps();
    let stats = lab.router.stats_row("c").unwrap();
    println!(
        "TCP {congestion} through a {rate} {action} class (default burst): {:.3} Mbit/s over the run, {:.3} Mbit/s = {:.1} % of the rate after the first second; {} of {} packets dropped, {} CE-marked",
        run.goodput_bps / 1e6,
        goodput / 1e6,
        goodput / rate_bps * 100.0,
        counter(&stats, "dropped_packets"),
        counter(&stats, "passed_packets") + counter(&stats, "dropped_packets"),
        counter(&stats, "marked_packets")
    );
    (goodput / rate_bps, stats)
}

/// The goodput fraction of one run, or of the median of three when that run lands
/// outside `lower`–0.99: now and then one 10 s run loses 5 % to a single event (BBR
/// through a 10 Mbit/s ecn class: 89.9 % once in CI, 94.1–95.0 % in the other runs here),
/// and a policer that is wrong stays out of bounds in all three. The stats are the last
/// run's.
fn judged_goodput(
    rate: &str,
    rate_bps: f64,
    action: &str,
    congestion: &str,
    lower: f64,
) -> (f64, Value) {
    let (fraction, stats) = tcp_goodput(rate, rate_bps, action, congestion);
    if (lower..=0.99).contains(&fraction) {
        return (fraction, stats);
    }
    let mut fractions = vec![fraction];
    let mut last = stats;
    for _ in 0..2 {
        let (fraction, stats) = tcp_goodput(rate, rate_bps, action, congestion);
        fractions.push(fraction);
        last = stats;
    }
    println!(
        "{congestion} at {rate}, {action}: outside on the first run, three runs {fractions:.3?}"
    );
    (median(&fractions), last)
}

#[test]
fn tcp_through_drop_reaches_85_percent() {
    for (rate, bps) in [("10mbit", 10e6), ("100mbit", 100e6)] {
        for congestion in ["cubic", "bbr"] {
            let (fraction, stats) = judged_goodput(rate, bps, "drop", congestion, 0.85);
            assert_goodput_fraction(&format!("{congestion} at {rate}, drop"), fraction, 0.85);
            assert!(
                counter(&stats, "dropped_packets") > 0,
                "{congestion} at {rate}: the drop class dropped nothing, so it did not limit"
            );
        }
    }
}

#[test]
fn tcp_through_ecn_reaches_90_percent() {
    for (rate, bps) in [("10mbit", 10e6), ("100mbit", 100e6)] {
        for congestion in ["cubic", "bbr"] {
            let (fraction, stats) = judged_goodput(rate, bps, "ecn", congestion, 0.90);
            assert_goodput_fraction(&format!("{congestion} at {rate}, ecn"), fraction, 0.90);
            assert!(
                counter(&stats, "marked_packets") > 0,
                "ECN was negotiated, so packets get CE"
            );
        }
    }
}

fn root_qdisc(lab: &Lab) -> String {
    String::from_utf8_lossy(
        &lab.router
            .run("tc", &["qdisc", "show", "dev", ROUTER_TO_SERVER, "root"])
            .unwrap()
            .stdout,
    )
    .to_string()
}

/// A 10 Mbit/s shape class on the router's egress, on `path` (its label) with shaper's root
/// of `root_kind` there: Cubic gets at least 0.93 of the rate and 100 Mbit/s of UDP is held
/// to it within 3 %.
fn shape_holds_tcp_and_udp_at_10mbit(lab: &mut Lab, path: &str, root_kind: &str) {
    assert!(
        root_qdisc(lab).contains(&format!("{root_kind} 5348:")),
        "shaper installs its {root_kind} root: {}",
        root_qdisc(lab)
    );
    // Steady state from 1 s: Cubic's slow start overshoots the 100 ms cap and waits out
    // one retransmission timeout there in most runs (TcpExtTCPTimeouts 1 in 7 of 8),
    // 0.6-1.3 % of a 10 s run, and a second timeout later costs 2 % more (whole run
    // 93.5-95.6 %, 92.9 % once in CI; from 1 s 94.3-96.0 %).
    let goodput = lab.tcp_series(10, "cubic", 1.0).unwrap().steady_bps();
    println!(
        "TCP cubic through a 10mbit shape class ({path}): {:.3} Mbit/s = {:.1} % of the rate",
        goodput / 1e6,
        goodput / 1e7 * 100.0
    );
    // In steady state CoDel's short queue costs no goodput: about 95.6 % is the
    // payload's share of a 1514-byte frame, and the rate counts frames (a 1 s interval's
    // edges move a few packets either way). The shaping target is 0.93.
    assert_goodput_fraction(
        &format!("cubic at 10mbit, shape ({path})"),
        goodput / 10e6,
        0.93,
    );
    let udp = lab
        .udp(&Udp {
            seconds: 5,
            ..Udp::default()
        })
        .unwrap();
    assert_within(
        &format!("UDP 100M through a 10mbit shape class ({path})"),
        udp.total_l2_bps(),
        10e6,
        0.03,
    );
}

/// `shaper detach` on the router's egress removes shaper's root of `root_kind`.
fn detach_removes_the_root(lab: &Lab, root_kind: &str) {
    lab.router.shaper(&["detach", ROUTER_TO_SERVER]).unwrap();
    assert!(
        !root_qdisc(lab).contains(root_kind),
        "detach removes shaper's {root_kind}: {}",
        root_qdisc(lab)
    );
}

#[test]
fn shape_through_htb_keeps_tcp_and_udp_at_the_rate() {
    let mut lab =
        Lab::with_router_class(ROUTER_TO_SERVER, &["--rate", "10mbit", "--action", "shape"])
            .unwrap();
    shape_holds_tcp_and_udp_at_10mbit(&mut lab, "HTB", "htb");
    // A rate change reaches the HTB class.
    lab.router
        .shaper(&[
            "class",
            "change",
            "c",
            "--dev",
            ROUTER_TO_SERVER,
            "--rate",
            "20mbit",
        ])
        .unwrap();
    let udp = lab
        .udp(&Udp {
            seconds: 4,
            ..Udp::default()
        })
        .unwrap();
    assert_within(
        "UDP 100M after class change to 20mbit (HTB)",
        udp.total_l2_bps(),
        20e6,
        0.03,
    );
    detach_removes_the_root(&lab, "htb");
}

/// `shaper class add c --action shape` at 10 Mbit/s on the router with shape's backend
/// picked by `SHAPER_SHAPE_BACKEND=backend` (`htb` is the default said explicitly); the
/// command's output.
fn add_shape_class_with_backend(lab: &Lab, backend: &str) -> std::process::Output {
    lab.router.shaper_output_with(
        &[("SHAPER_SHAPE_BACKEND", backend)],
        &[
            "class",
            "add",
            "c",
            "--dev",
            ROUTER_TO_SERVER,
            "--rate",
            "10mbit",
            "--action",
            "shape",
        ],
    )
}

/// The EDT + fq path, asked for with `SHAPER_SHAPE_BACKEND=edt`: shaper's root is fq, the
/// program paces by departure time with the same CoDel, TCP and UDP are held at the rate
/// and detach removes the root. Needs a kernel with fq (the lab's has none): `cargo xtask
/// vm-test` runs it in Debian's 6.1 and 6.12.
#[test]
#[ignore = "needs the fq qdisc: cargo xtask vm-test runs it in Debian's kernels"]
fn shape_on_the_edt_path_keeps_tcp_and_udp_at_the_rate() {
    let mut lab = Lab::new().unwrap();
    lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    let added = add_shape_class_with_backend(&lab, "edt");
    assert!(added.status.success(), "{}", stderr(&added));
    shape_holds_tcp_and_udp_at_10mbit(&mut lab, "EDT + fq", "fq");
    detach_removes_the_root(&lab, "fq");
}

/// A backend the kernel cannot give (EDT without fq, as on the lab's kernel) or a name
/// shaper does not know: one line, exit 1, no root qdisc made and no class added.
#[test]
fn a_shape_backend_that_cannot_be_had_is_refused_in_one_line() {
    let lab = Lab::new().unwrap();
    lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    let has_fq = lab
        .router
        .run(
            "tc",
            &["qdisc", "add", "dev", "lo", "root", "handle", "7:", "fq"],
        )
        .is_ok();
    let mut refused = vec![("hfsc", "expected htb (the default) or edt")];
    if !has_fq {
        refused.push(("edt", "needs the fq qdisc"));
    }
    for (backend, says) in refused {
        let output = add_shape_class_with_backend(&lab, backend);
        let message = stderr(&output);
        println!("SHAPER_SHAPE_BACKEND={backend}: {}", message.trim());
        assert_eq!(output.status.code(), Some(1), "{message}");
        assert!(
            message.contains(says) && message.trim().lines().count() == 1,
            "{message}"
        );
        assert!(
            !root_qdisc(&lab).contains("5348:"),
            "no root of shaper's is left: {}",
            root_qdisc(&lab)
        );
        assert_eq!(
            lab.router
                .shaper_json(&["class", "list", "--json"])
                .unwrap(),
            serde_json::json!([])
        );
    }
}

#[test]
fn shape_refuses_to_replace_a_root_qdisc_it_did_not_create() {
    let lab = Lab::new().unwrap();
    lab.router
        .run(
            "tc",
            &[
                "qdisc",
                "add",
                "dev",
                ROUTER_TO_SERVER,
                "root",
                "tbf",
                "rate",
                "50mbit",
                "burst",
                "64k",
                "latency",
                "50ms",
            ],
        )
        .unwrap();
    lab.router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    let output = add_shape_class_with_backend(&lab, "htb");
    let message = stderr(&output);
    println!("{}", message.trim());
    assert_eq!(output.status.code(), Some(1));
    assert!(message.contains("tbf") && message.lines().count() == 1);
    assert!(
        root_qdisc(&lab).contains("tbf"),
        "the user's qdisc is untouched"
    );
    assert_eq!(
        lab.router
            .shaper_json(&["class", "list", "--json"])
            .unwrap(),
        serde_json::json!([])
    );
}

/// The policer on the sending host's own egress: drops are reported to the socket, not
/// lost in the network; with the default burst TCP still keeps well above 70 %.
#[test]
fn tcp_policed_on_the_senders_own_egress() {
    let mut lab = Lab::new().unwrap();
    let client = lab.client.clone();
    client.attach(CLIENT_DEV, &[]).unwrap();
    client
        .class_add("c", CLIENT_DEV, &["--rate", "10mbit"])
        .unwrap();
    let goodput = lab.tcp_series(10, "cubic", 1.0).unwrap().steady_bps();
    println!(
        "TCP cubic, 10mbit drop class on the sender's own egress, after the first second: {:.3} Mbit/s = {:.1} %",
        goodput / 1e6,
        goodput / 1e5
    );
    assert_goodput_fraction(
        "cubic at 10mbit, drop on the sender's egress",
        goodput / 10e6,
        0.70,
    );
    let dropped = counter(&client.stats_row("c").unwrap(), "dropped_packets");
    assert!(dropped > 0, "the sender's own policer dropped nothing");
}
