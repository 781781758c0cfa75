//! The three-colour meters end to end: a trTCM class colours UDP by its offered load
//! (yellow remarked, red dropped, checked on captured packets), and an srTCM class spends
//! its excess burst once under overload. The kernel's meters against the RFCs packet by
//! packet are in test_run.rs.

use shaper_tests::{assert_within, counter, Capture, Lab, Udp, ROUTER_TO_SERVER, SERVER_DEV};

/// A lab with one UDP class on the router: CIR 5 Mbit/s, CBS 64k, and `meter` (the
/// options that make it a trTCM or an srTCM).
fn lab_with_a_5mbit_meter(meter: &[&str]) -> Lab {
    let common = ["--rate", "5mbit", "--burst", "64k", "--proto", "udp"];
    Lab::with_router_class(ROUTER_TO_SERVER, &[&common[..], meter].concat()).unwrap()
}

#[test]
fn trtcm_colours_match_the_offered_load() {
    // CIR 5, PIR 10 Mbit/s; 20 Mbit/s offered: a quarter green, a quarter yellow, half red.
    let mut lab = lab_with_a_5mbit_meter(&[
        "--peak-rate",
        "10mbit",
        "--peak-burst",
        "64k",
        "--exceed",
        "dscp=af12",
    ]);
    let mut capture = Capture::start(&lab.server, SERVER_DEV, "udp").unwrap();
    let result = lab.udp(&Udp::at("20M", 4)).unwrap();
    let af12 = capture
        .count("udp and dst host 198.18.2.2 and ip[1] & 0xfc = 48")
        .unwrap() as u64;
    let plain = capture
        .count("udp and dst host 198.18.2.2 and ip[1] & 0xfc = 0")
        .unwrap() as u64;
    let stats = lab.router.stats_row("c").unwrap();
    let (green, yellow, red) = (
        counter(&stats, "green_bytes"),
        counter(&stats, "yellow_bytes"),
        counter(&stats, "red_bytes"),
    );
    let total = (green + yellow + red) as f64;
    println!(
        "trTCM 5/10 Mbit/s at 20M: green {:.1} %, yellow {:.1} %, red {:.1} % of bytes; {af12} af12 and {plain} unmarked packets captured",
        green as f64 / total * 100.0,
        yellow as f64 / total * 100.0,
        red as f64 / total * 100.0
    );
    assert_eq!(stats["meter"], "trtcm");
    assert_eq!(
        af12,
        counter(&stats, "yellow_packets"),
        "every yellow packet arrives remarked"
    );
    assert_eq!(
        plain,
        counter(&stats, "green_packets"),
        "green packets arrive untouched"
    );
    assert_eq!(
        counter(&stats, "red_packets"),
        counter(&stats, "dropped_packets"),
        "red is dropped"
    );
    assert_within(
        "green + yellow received (PIR)",
        result.total_l2_bps(),
        10e6,
        0.03,
    );
    assert_within(
        "yellow share of what arrived",
        yellow as f64 / (green + yellow) as f64,
        0.5,
        0.05,
    );
}

#[test]
fn srtcm_spends_the_excess_burst_once_under_overload() {
    let mut lab = lab_with_a_5mbit_meter(&["--excess-burst", "256k"]);
    let result = lab.udp(&Udp::at("20M", 3)).unwrap();
    let stats = lab.router.stats_row("c").unwrap();
    let yellow = counter(&stats, "yellow_bytes");
    println!(
        "srTCM CIR 5 Mbit/s, CBS 64k, EBS 256k at 20M: yellow {yellow} bytes, green {} bytes, red {} bytes; {:.3} Mbit/s received",
        counter(&stats, "green_bytes"),
        counter(&stats, "red_bytes"),
        result.total_l2_bps() / 1e6
    );
    assert_eq!(stats["meter"], "srtcm");
    // C never fills under overload, so E is never refilled: yellow is the initial EBS,
    // short of it by less than one packet.
    assert!(
        yellow <= 262_144 && yellow > 262_144 - 1442,
        "yellow bytes {yellow}"
    );
    // Yellow passes by default; steady state is green only, at CIR.
    assert_within(
        "steady-state rate (green)",
        result.l2_bps_between(1.0, 3.0),
        5e6,
        0.03,
    );
}
