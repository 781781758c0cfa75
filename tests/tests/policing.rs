//! Policing end to end on the namespace lab (real veths, real TC attach, real iperf3):
//! UDP and TCP held to a class's rate (tcx and clsact, egress and ingress), the bucket
//! scopes (class, flow, source, destination), unmatched traffic left alone, a rate change
//! during a run, detach restoring unshaped traffic, ARP/ICMP/ND through a UDP-only class.
//! Rates are L2 rates measured at the server over the steady-state seconds of each run
//! (the first second, where the initial burst lands, is left out).

use shaper_tests::{
    assert_goodput_fraction, assert_programs_unloaded, assert_within, counter, loaded_program_ids,
    status_program_ids, Lab, Netns, Udp, UdpResult, CLIENT_DEV, ROUTER_TO_CLIENT, ROUTER_TO_SERVER,
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
            // Three seconds after the run's first datagram met the class.
            router
                .wait_for_class_traffic("changing", Duration::from_secs(10))
                .unwrap();
            thread::sleep(Duration::from_secs(3));
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
    // The change lands about 3 s into the run: seconds 1-3 are before it, 4-7 after.
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
        // The burst (3.125 MB) drains in 0.5 s at 50 Mbit/s over the rate: the class
        // drops from then on (bounded wait).
        let deadline = Instant::now() + Duration::from_secs(10);
        while dropped() == 0 {
            assert!(Instant::now() < deadline, "the class never dropped");
            thread::sleep(Duration::from_millis(10));
        }
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

/// A tun device of the router's, `tun0`: 198.18.9.1/24 and fd00:9::1/64 (no DAD).
fn tun_device(router: &Netns) {
    for args in [
        &["tuntap", "add", "dev", "tun0", "mode", "tun"][..],
        &["link", "set", "tun0", "up"],
        &["addr", "add", "198.18.9.1/24", "dev", "tun0"],
        &["-6", "addr", "add", "fd00:9::1/64", "dev", "tun0", "nodad"],
    ] {
        router.run("ip", args).unwrap();
    }
}

/// 1000-byte UDP payloads every 0.8 ms for 2 s (about 10 Mbit/s), sent by `send`; how
/// many, and over how long (s).
fn send_for_two_seconds(mut send: impl FnMut() -> std::io::Result<()>) -> (u64, f64) {
    use std::time::Instant;
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < Duration::from_secs(2) && sent < 10_000 {
        send().unwrap();
        sent += 1;
        thread::sleep(Duration::from_micros(800));
    }
    (sent, start.elapsed().as_secs_f64())
}

/// Class `name` (1 Mbit/s) policed what it was sent: it admits its burst plus the rate
/// (charged at L3: no link-layer header on a tun, `packet` bytes a datagram), drops the
/// rest.
fn assert_policed_at_l3(router: &Netns, name: &str, sent: u64, seconds: f64, packet: f64) {
    let row = router.stats_row(name).unwrap();
    let (passed, dropped) = (
        counter(&row, "passed_bytes") as f64,
        counter(&row, "dropped_packets"),
    );
    let burst = counter(&row, "burst_bytes") as f64;
    let allowed = burst + 1e6 / 8.0 * seconds;
    println!(
        "{name}: {sent} datagrams in {seconds:.2} s, class passed {passed} bytes (burst + rate \
         = {allowed:.0}), dropped {dropped}"
    );
    assert!(dropped > sent / 2, "{name} did not police: {row}");
    assert!(
        passed <= allowed + packet,
        "{name}: passed {passed} > {allowed}"
    );
    assert!(
        passed >= 0.9 * allowed,
        "{name}: passed {passed} of {allowed}"
    );
}

/// One UDP class of 1 Mbit/s per family on `tun0`'s `direction`, told apart by port.
fn tun_classes(router: &Netns, direction: &str) {
    for (name, port) in [("v4", "9"), ("v6", "10")] {
        router
            .class_add(
                &format!("{direction}-{name}"),
                "tun0",
                &[
                    "--direction",
                    direction,
                    "--rate",
                    "1mbit",
                    "--proto",
                    "udp",
                    "--dport",
                    port,
                ],
            )
            .unwrap();
    }
}

/// Issue 11, item 2: a tun device carries bare IP packets (no Ethernet header). UDP at
/// about 10 Mbit/s sent out of it through a 1 Mbit/s class is policed, over IPv4 and IPv6:
/// the class admits its burst plus the rate, and drops the rest. Before, the parser read
/// an "ethertype" out of the IPv4 source address, and the traffic passed unclassified.
#[test]
fn udp_out_of_a_tun_device_is_policed() {
    let lab = Lab::new().unwrap();
    let router = lab.router.clone();
    tun_device(&router);
    router.attach("tun0", &[]).unwrap();
    tun_classes(&router, "egress");
    // From the router itself out of tun0 (no reader holds the tun open, so its packets go
    // no further than the hook).
    for (family, local, peer, packet) in [
        ("v4", "198.18.9.1:0", "198.18.9.2:9", 1028.0),
        ("v6", "[fd00:9::1]:0", "[fd00:9::2]:10", 1048.0),
    ] {
        let (sent, seconds) = shaper::netns::in_namespace(&Some(router.name.clone()), || {
            let socket = std::net::UdpSocket::bind(local)?;
            Ok(send_for_two_seconds(|| {
                socket.send_to(&[0u8; 1000], peer).map(|_| ())
            }))
        })
        .unwrap();
        assert_policed_at_l3(&router, &format!("egress-{family}"), sent, seconds, packet);
    }
}

/// The IP packet of a UDP datagram of `payload` bytes to port `dport` (IPv4 with its header
/// checksum, or IPv6), as a tun's reader writes it.
fn udp_packet(ipv6: bool, dport: u16, payload: usize) -> Vec<u8> {
    let mut udp = vec![0u8; 8 + payload];
    udp[..2].copy_from_slice(&40000u16.to_be_bytes());
    udp[2..4].copy_from_slice(&dport.to_be_bytes());
    udp[4..6].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    let mut header = if ipv6 {
        let mut header = vec![0u8; 40];
        header[0] = 0x60;
        header[4..6].copy_from_slice(&(udp.len() as u16).to_be_bytes());
        header[6] = 17;
        header[7] = 64;
        header[8..24].copy_from_slice(&"fd00:9::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        header[24..40]
            .copy_from_slice(&"fd00:9::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        header
    } else {
        let mut header = vec![0u8; 20];
        header[0] = 0x45;
        header[2..4].copy_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
        header[8] = 64;
        header[9] = 17;
        header[12..16].copy_from_slice(&[198, 18, 9, 2]);
        header[16..20].copy_from_slice(&[198, 18, 9, 1]);
        let sum: u32 = header
            .chunks(2)
            .map(|word| u32::from(u16::from_be_bytes([word[0], word[1]])))
            .sum();
        let folded = (sum & 0xffff) + (sum >> 16);
        let checksum = !((folded & 0xffff) + (folded >> 16)) as u16;
        header[10..12].copy_from_slice(&checksum.to_be_bytes());
        header
    };
    header.extend_from_slice(&udp);
    header
}

/// Opens `tun0` of the calling thread's namespace as its reader (IFF_TUN, no packet
/// information): what is written to it arrives on tun0's ingress.
fn open_tun() -> std::io::Result<std::fs::File> {
    use nix::libc;
    use std::os::fd::AsRawFd as _;
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    // struct ifreq: the name (16 bytes), then the flags (a short) in the union.
    let mut request = [0u8; 40];
    request[..4].copy_from_slice(b"tun0");
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as i16;
    request[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, which `request` is big enough for.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, request.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// A tun's ingress: what its reader (a VPN daemon, a VM's userspace network) writes in.
/// UDP at about 10 Mbit/s written into tun0 through a 1 Mbit/s class on its ingress is
/// policed, over IPv4 and IPv6, charged at L3.
#[test]
fn udp_into_a_tun_device_is_policed_on_its_ingress() {
    use std::io::Write as _;
    let lab = Lab::new().unwrap();
    let router = lab.router.clone();
    tun_device(&router);
    router.attach("tun0", &["--direction", "ingress"]).unwrap();
    tun_classes(&router, "ingress");
    for (family, ipv6, dport, packet) in [("v4", false, 9, 1028.0), ("v6", true, 10, 1048.0)] {
        let datagram = udp_packet(ipv6, dport, 1000);
        assert_eq!(datagram.len() as f64, packet);
        let (sent, seconds) = shaper::netns::in_namespace(&Some(router.name.clone()), || {
            let mut tun = open_tun()?;
            Ok(send_for_two_seconds(|| tun.write_all(&datagram)))
        })
        .unwrap();
        assert_policed_at_l3(&router, &format!("ingress-{family}"), sent, seconds, packet);
    }
    // An ingress shape class queues on an ifb, an Ethernet device a bare IP packet cannot
    // be redirected to: refused with one line, and nothing made.
    let refused = router.shaper_output(&[
        "class",
        "add",
        "up",
        "--dev",
        "tun0",
        "--direction",
        "ingress",
        "--rate",
        "1mbit",
        "--action",
        "shape",
    ]);
    let stderr = shaper_tests::stderr(&refused);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("bare IP packets"), "{stderr}");
    let links =
        String::from_utf8_lossy(&router.run("ip", &["-br", "link"]).unwrap().stdout).to_string();
    assert!(!links.contains("shpq"), "an ifb was made: {links}");
    assert!(router.stats_row("up").is_err(), "the class was added");
    // Splitting aggregates goes through the same ifb: refused alike, the attachment and
    // its classes left as they were; and on egress (where nothing arrives) a usage error.
    for (direction, code, says) in [
        ("ingress", 1, "bare IP packets"),
        ("egress", 2, "--direction ingress"),
    ] {
        let refused = router.shaper_output(&[
            "attach",
            "tun0",
            "--direction",
            direction,
            "--split-aggregates",
        ]);
        let stderr = shaper_tests::stderr(&refused);
        assert_eq!(refused.status.code(), Some(code), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
    let links =
        String::from_utf8_lossy(&router.run("ip", &["-br", "link"]).unwrap().stdout).to_string();
    assert!(!links.contains("shpq"), "an ifb was made: {links}");
    assert_eq!(router.split_through("tun0").unwrap(), None, "tun0 splits");
    assert!(router.stats_row("ingress-v4").is_ok(), "a class was lost");
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

/// A UDP header past 16 KiB: an IPv6 packet with eight 2 KiB Destination Options headers
/// (16 KiB of them, on links with a 64 KiB MTU) to UDP port 9999. The classifier reads no
/// header past 16 KiB, so the datagram's ports are unknown, and it meets the first-ranked
/// UDP port class (as a non-first fragment does), `real`; a wrapped offset (the 16 KiB
/// mask the classifier had) read the ports from the sender's own option bytes instead,
/// where it wrote 5060, and sent the datagram to `sip`.
#[test]
fn a_udp_header_past_16_kib_meets_no_port_class() {
    const PACKETS: usize = 10;
    let lab = Lab::new().unwrap();
    let router = lab.router.clone();
    for (ns, dev) in [
        (&lab.client, CLIENT_DEV),
        (&router, ROUTER_TO_CLIENT),
        (&router, ROUTER_TO_SERVER),
        (&lab.server, SERVER_DEV),
    ] {
        let output = ns
            .run("ip", &["link", "set", "dev", dev, "mtu", "65535"])
            .unwrap();
        assert!(output.status.success(), "mtu on {dev}");
    }
    router.attach(ROUTER_TO_SERVER, &[]).unwrap();
    for (name, port, prio) in [("real", "9999", "1"), ("sip", "5060", "9")] {
        router
            .class_add(
                name,
                ROUTER_TO_SERVER,
                &[
                    "--rate", "100mbit", "--proto", "udp", "--dport", port, "--prio", prio,
                ],
            )
            .unwrap();
    }
    // Neighbour discovery first (it takes up to 2 s in a new lab): datagrams sent while
    // the router still resolves the server wait in a queue too short for 16 KiB each.
    let ping = lab
        .client
        .run("ping", &["-6", "-c", "1", "-W", "5", SERVER_V6])
        .unwrap();
    assert!(ping.status.success(), "the server does not answer ping");
    // Eight Destination Options headers of 2 048 bytes (header length 255), the last
    // naming UDP. Each starts with an option of type 0x13 (unknown, to be skipped) and
    // length 0xc4: read as a UDP header, its bytes 2-3 are destination port 5060. Pad1
    // options fill the rest.
    let mut packet = Vec::new();
    for index in 0..8 {
        let next = if index == 7 { 17u8 } else { 60 };
        let mut header = vec![next, 255, 0x13, 0xc4];
        header.resize(2048, 0);
        packet.extend(header);
    }
    packet.extend_from_slice(&1234u16.to_be_bytes());
    packet.extend_from_slice(&9999u16.to_be_bytes());
    packet.extend_from_slice(&[0, 24, 0, 0]);
    packet.extend_from_slice(b"16 KiB and more!");
    let sent = thread::scope(|scope| {
        scope
            .spawn(|| -> std::io::Result<usize> {
                lab.client.enter().map_err(std::io::Error::other)?;
                // A raw socket of protocol 60: the kernel writes the IPv6 header (next
                // header: Destination Options), the payload is the packet above.
                let socket =
                    unsafe { nix::libc::socket(nix::libc::AF_INET6, nix::libc::SOCK_RAW, 60) };
                if socket < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let mut address: nix::libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                address.sin6_family = nix::libc::AF_INET6 as u16;
                address.sin6_addr.s6_addr =
                    SERVER_V6.parse::<std::net::Ipv6Addr>().unwrap().octets();
                let mut sent = 0;
                for _ in 0..PACKETS {
                    let n = unsafe {
                        nix::libc::sendto(
                            socket,
                            packet.as_ptr().cast(),
                            packet.len(),
                            0,
                            (&raw const address).cast(),
                            std::mem::size_of::<nix::libc::sockaddr_in6>() as u32,
                        )
                    };
                    if n == packet.len() as isize {
                        sent += 1;
                    }
                    thread::sleep(Duration::from_millis(10));
                }
                unsafe { nix::libc::close(socket) };
                Ok(sent)
            })
            .join()
            .unwrap()
    })
    .unwrap();
    assert_eq!(sent, PACKETS);
    thread::sleep(Duration::from_millis(200));
    let packets = |class: &str| {
        let row = router.stats_row(class).unwrap();
        counter(&row, "passed_packets") + counter(&row, "dropped_packets")
    };
    let (sip, real) = (packets("sip"), packets("real"));
    println!("{PACKETS} datagrams with a UDP header at 16 438 bytes: sip {sip}, real {real}");
    assert_eq!(
        sip, 0,
        "the port class matched ports read from a wrapped offset"
    );
    assert_eq!(
        real, PACKETS as u64,
        "the datagrams did not meet the first-ranked UDP port class"
    );
}

/// Linux 6.4 made an ifb take what a BPF program redirects to it; before, it drops every
/// such packet, so an ingress shape class's traffic, or all of an interface that splits
/// aggregates, would vanish (Debian 12's 6.1: a router splitting its ingress forwarded
/// nothing). Where the kernel has it, the router's ingress splitting aggregates and then
/// an ingress shape class there carry the client's pings to the server; where it does
/// not, each is refused in one line, exit 1, no ifb is made and the attachment's class is
/// kept. Runs in the lab and in Debian's 6.1 and 6.12 guests.
#[test]
fn ifb_paths_carry_traffic_or_are_refused_where_the_kernel_drops_redirects() {
    let lab = Lab::new().unwrap();
    let router = lab.router.clone();
    router
        .attach(ROUTER_TO_CLIENT, &["--direction", "ingress"])
        .unwrap();
    let keep = [
        "--rate",
        "100mbit",
        "--direction",
        "ingress",
        "--proto",
        "udp",
        "--dport",
        "9",
    ];
    router.class_add("keep", ROUTER_TO_CLIENT, &keep).unwrap();
    let split = [
        "attach",
        ROUTER_TO_CLIENT,
        "--direction",
        "ingress",
        "--split-aggregates",
    ];
    let shape = [
        "class",
        "add",
        "in-shape",
        "--dev",
        ROUTER_TO_CLIENT,
        "--direction",
        "ingress",
        "--rate",
        "10mbit",
        "--action",
        "shape",
    ];
    let pings_answered = || {
        for ns in [&lab.client, &lab.router, &lab.server] {
            ns.run("ip", &["neigh", "flush", "all"]).unwrap();
        }
        let ping = lab
            .client
            .run("ping", &["-c", "5", "-i", "0.2", "-W", "2", SERVER_V4])
            .unwrap();
        ping.status.success()
    };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    if shaper::qdisc::ifb_redirect_works() {
        for (what, args) in [
            ("--split-aggregates", &split[..]),
            ("ingress shape", &shape),
        ] {
            let output = router.shaper_output(args);
            let stderr = shaper_tests::stderr(&output);
            assert!(output.status.success(), "{what} on {release}: {stderr}");
            assert!(
                pings_answered(),
                "{what} on {release}: pings lost through the ifb"
            );
        }
        let ifb = shaper::qdisc::ifb_name(ROUTER_TO_CLIENT);
        let crossed = router.link_stat(&ifb, "tx_packets").unwrap();
        assert!(crossed >= 10, "{crossed} packets through {ifb}");
        return;
    }
    for (what, args) in [
        ("--split-aggregates", &split[..]),
        ("an ingress shape class", &shape),
    ] {
        let output = router.shaper_output(args);
        let stderr = shaper_tests::stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{what}: {stderr}");
        assert_eq!(
            stderr.trim(),
            format!(
                "shaper: this kernel ({}) drops what a BPF program redirects to an ifb: {what} \
                 queues through one and needs Linux 6.4 or later",
                release.trim()
            ),
        );
    }
    let links =
        String::from_utf8_lossy(&router.run("ip", &["-br", "link"]).unwrap().stdout).to_string();
    assert!(!links.contains("shpq"), "an ifb was made: {links}");
    assert_eq!(router.split_through(ROUTER_TO_CLIENT).unwrap(), None);
    assert!(router.stats_row("keep").is_ok(), "the class was lost");
    assert!(
        router.stats_row("in-shape").is_err(),
        "the shape class was added"
    );
    assert!(pings_answered(), "pings lost after the refusals");
}
