//! Flow isolation in a shape class (issue 50): one 10 Mbit/s `--action shape` class on the
//! router's egress toward the server, matching everything, shared by flows from the
//! client, fair by flow (the default) unless a cell says. 30 s runs, shares over the
//! steady state from 10 s. Each behaviour is asserted in one representative cell (the
//! full matrix, rates 1.5x-10x, 64 flows at 100 Mbit/s, `--fair none` and tbf beside it,
//! is `cargo xtask bench`'s `fairness` section, which holds the targets):
//! - TCP beside an unresponsive UDP flow: TCP at least 0.45 of the rate, UDP at most
//!   0.55, together at least 0.95, on the µs lab at 2x and over 40 ms at 10x (measured
//!   0.452-0.489 and 0.482-0.489);
//! - one Cubic flow beside one BBR flow: each >= 0.40 (0.448-0.481 since the egress
//!   splitter cuts forwarded aggregates; 0.36-0.52 judged whole), the median of three
//!   runs when the first is outside;
//! - BBR beside UDP at 10x on the µs lab: as TCP beside UDP above (0.465-0.477);
//! - four Cubic flows: Jain's index >= 0.98 and together >= 0.95 (measured 0.956-0.957
//!   at 10.5-11.8 ms since a flow that heeds drops passes its cap while the link is about
//!   to idle, 0.940-0.952 before; one queue read 0.947-0.957), the median of three runs
//!   when the first is outside;
//! - sixteen Cubic flows in a 100 Mbit/s class: Jain's index >= 0.97 and together >=
//!   0.95 (measured 0.955-0.957, Jain 1.000; 0.940-0.956 before; a full frame's payload
//!   is 0.956 of its wire size, and one queue reads 0.951), likewise;
//! - `--fair src`: a host with eight flows beside a host with one: the one >= 0.45
//!   (measured 0.449-0.457; by flow alone it would get 1/9), the median of three runs
//!   when the first is outside;
//! - `--fair none` keeps one queue: the UDP flow takes the class (TCP < 0.2);
//! - the bulk leaf is one bfifo on every kernel, and Cubic beside UDP keeps its RTT
//!   within CAKE's + 3 ms (`cargo xtask vm-test` runs that test in Debian's kernels too);
//! - the class's flow count, fair share and drops by cause in `stats --json`.
//!
//! `latency.rs` runs with the default too and holds one flow alone, and four at 100
//! Mbit/s, to the same goodput and delay as one queue.

use shaper_tests::{
    fairness::{add_second_client, run_cell, tcp, udp_flood, Shares, SECOND_CLIENT_V4},
    shape_to_server, Lab, Tcp,
};
use std::time::Duration;

const SECONDS: u32 = 30;
const STEADY_FROM: Duration = Duration::from_secs(10);
const RATE_BPS: f64 = 10e6;
/// Beside a TCP flow, the most an unresponsive UDP flow may take, and the least both
/// together carry (fractions of the rate).
const UDP_MOST: f64 = 0.55;
const TOGETHER_LEAST: f64 = 0.95;
/// Cubic's and BBR's least share beside each other (see `cubic_and_bbr_share_a_class`).
const BBR_CELL_LEAST: f64 = 0.40;
/// Under `--fair src`, the least share of a host's one flow beside a host's eight (0.449-
/// 0.457 measured since the share multiplier holds while the queue stands; 0.436-0.446
/// before; a full frame's payload at half the rate is 0.478).
const SRC_CELL_LEAST: f64 = 0.45;

/// A lab (with `one_way` delay each way, if any) whose router shapes everything toward
/// the server at 10 Mbit/s, with `extra` class options (fair by flow, the default,
/// unless they say).
fn shaped_lab(one_way: Option<Duration>, extra: &[&str]) -> Lab {
    let lab = match one_way {
        Some(delay) => Lab::with_delay(delay),
        None => Lab::new(),
    }
    .unwrap();
    lab.router.attach("r1", &[]).unwrap();
    let options = [&shape_to_server("10mbit")[..], extra].concat();
    lab.router.class_add("bulk", "r1", &options).unwrap();
    lab
}

/// The kind of the bulk leaf (5348:8001) of the router's first shape class, and its
/// options as `tc -j` reads them back.
fn bulk_leaf(lab: &Lab) -> (String, serde_json::Value) {
    let output = lab
        .router
        .run("tc", &["-j", "qdisc", "show", "dev", "r1"])
        .unwrap();
    let qdiscs: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let leaf = qdiscs
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["parent"] == "5348:8001")
        .unwrap_or_else(|| panic!("no bulk leaf in {qdiscs}"))
        .clone();
    (
        leaf["kind"].as_str().unwrap().to_string(),
        leaf["options"].clone(),
    )
}

fn stats(lab: &Lab) -> serde_json::Value {
    let rows = lab.router.shaper_json(&["stats", "--json"]).unwrap();
    rows[0].clone()
}

/// One `run`, or, when `within` refuses it, three, of which the median by `key` is
/// judged (`what` names the figure in the line that prints all three): one event now and
/// then costs a 20 s window a few percent, where isolation that does not hold stays out
/// in every run.
fn median_if_outside<T>(
    what: &str,
    mut run: impl FnMut() -> T,
    within: impl Fn(&T) -> bool,
    key: impl Fn(&T) -> f64,
) -> T {
    let first = run();
    if within(&first) {
        return first;
    }
    let mut runs = vec![first, run(), run()];
    let seen: Vec<String> = runs.iter().map(|r| format!("{:.3}", key(r))).collect();
    println!("{what}: outside on the first run; in three runs {seen:?}");
    runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    runs.swap_remove(1)
}

/// One run of TCP (`congestion`) beside UDP at `udp_rate`: the shares, and the class's
/// `stats` row after it.
fn tcp_beside_udp_run(
    one_way: Option<Duration>,
    congestion: &str,
    udp_rate: &'static str,
) -> (Shares, serde_json::Value) {
    let mut lab = shaped_lab(one_way, &[]);
    let flood = udp_flood(udp_rate, SECONDS);
    let shares = run_cell(
        &mut lab,
        RATE_BPS,
        &[&tcp(congestion, SECONDS)],
        &[&flood],
        STEADY_FROM,
    )
    .unwrap();
    (shares, stats(&lab))
}

/// TCP (`congestion`) beside UDP at `udp_rate`: the TCP flow's share and the UDP flow's
/// held to the bounds; the class counts its drops by cause. A first run outside
/// the bounds is run twice more and the median run by TCP share is judged: now and then
/// one 20 s window loses a few percent to one event (Cubic at 2x: 0.429 once in the
/// full suite, 0.465-0.479 in the other runs here), and isolation that does not hold
/// stays out in all three (one queue: 0.02-0.03).
fn tcp_beside_udp(
    one_way: Option<Duration>,
    congestion: &str,
    udp_rate: &'static str,
    tcp_least: f64,
) {
    let what = format!("{congestion} beside UDP at {udp_rate} (one way {one_way:?})");
    let within = |shares: &Shares| {
        shares.tcp[0] >= tcp_least && shares.udp[0] <= UDP_MOST && shares.total() >= TOGETHER_LEAST
    };
    let (shares, row) = median_if_outside(
        &format!("{what}, TCP"),
        || tcp_beside_udp_run(one_way, congestion, udp_rate),
        |(shares, _)| within(shares),
        |(shares, _)| shares.tcp[0],
    );
    println!("{what}: {shares}");
    assert_held_to_share(&what, &shares, &row, tcp_least);
}

/// The TCP flow at least `tcp_least` of the rate, the UDP flow and the two together
/// within the bounds, and the flood's excess dropped for being over its share
/// rather than by the class queue's cap.
fn assert_held_to_share(what: &str, shares: &Shares, row: &serde_json::Value, tcp_least: f64) {
    assert!(
        shares.tcp[0] >= tcp_least,
        "{what}: TCP got {:.3} of the rate",
        shares.tcp[0]
    );
    assert!(
        shares.udp[0] <= UDP_MOST,
        "{what}: UDP got {:.3} of the rate",
        shares.udp[0]
    );
    assert!(
        shares.total() >= TOGETHER_LEAST,
        "{what}: together {:.3}",
        shares.total()
    );
    let (fair, queue) = (
        row["fair_dropped_packets"].as_u64().unwrap(),
        row["queue_dropped_packets"].as_u64().unwrap(),
    );
    println!("{what}: drops over the share {fair}, by the class queue {queue}");
    assert!(
        fair > 10 * queue.max(1),
        "{what}: {fair} fair drops, {queue} queue drops"
    );
    assert_eq!(row["fair"], "flow");
}

/// A fair class's bulk leaf is one bounded FIFO on every kernel (the program alone keeps
/// the flows apart), `stats` says so, and `--fair none` and back keep it one.
fn bulk_leaf_is_one_fifo(lab: &Lab) {
    for fair in ["flow", "none", "flow"] {
        lab.router
            .shaper(&["class", "change", "bulk", "--dev", "r1", "--fair", fair])
            .unwrap();
        let (kind, options) = bulk_leaf(lab);
        println!("fair {fair}: bulk leaf {kind} {options}");
        assert_eq!(kind, "bfifo", "fair {fair}");
        assert_eq!(stats(lab)["bulk_leaf"], "fifo", "fair {fair}");
    }
}

/// Cubic beside a UDP flood at 2x on the µs path keeps half the rate and its own queue
/// short: its RTT at most CAKE's + 3 ms (CAKE 6.3-6.7 ms in Debian's 6.12; 7.2 here with
/// the egress splitter, where an fq_codel leaf read 7.6-9.0 and one FIFO with the
/// senders' aggregates whole 10.8). `cargo xtask vm-test` runs it in Debian's kernels too.
#[test]
fn cubic_keeps_half_and_its_queue_short_beside_a_udp_flood() {
    const RTT_MOST_MS: f64 = 9.5;
    bulk_leaf_is_one_fifo(&shaped_lab(None, &[]));
    let (shares, row) = median_if_outside(
        "cubic beside UDP at 2x, TCP share and RTT",
        || tcp_beside_udp_run(None, "cubic", "20M"),
        |(shares, _)| {
            shares.tcp[0] >= 0.45
                && shares.udp[0] <= UDP_MOST
                && shares.total() >= TOGETHER_LEAST
                && shares.worst_rtt_ms() <= RTT_MOST_MS
        },
        |(shares, _)| shares.tcp[0] - shares.worst_rtt_ms() / 100.0,
    );
    println!("cubic beside UDP at 2x: {shares}; {row}");
    assert_held_to_share("cubic beside UDP at 2x", &shares, &row, 0.45);
    let rtt = shares.worst_rtt_ms();
    assert!(rtt <= RTT_MOST_MS, "Cubic's RTT {rtt:.1} ms");
}

/// BBR beside a flood at 10x on the µs path, the cell forwarded aggregates cost most
/// (0.396-0.441 judged whole; 0.465-0.477 split).
#[test]
fn bbr_keeps_half_beside_a_udp_flood_at_10x() {
    tcp_beside_udp(None, "bbr", "100M", 0.45);
}

#[test]
fn cubic_keeps_half_beside_a_udp_flood_over_40ms() {
    tcp_beside_udp(Some(Duration::from_millis(20)), "cubic", "100M", 0.45);
}

/// Cubic beside BBR: each at least the 0.40 of the rate (one queue gives Cubic
/// 0.075 in every run). With the senders' aggregates whole, BBR read 0.36-0.48 (a third
/// of runs under 0.40); the egress splitter cuts them (`state::splitter`), and BBR reads
/// 0.448-0.472 since. A first run outside is run twice more and the median run by the
/// smaller share is judged, as `tcp_beside_udp`'s.
#[test]
fn cubic_and_bbr_share_a_class() {
    let run = || {
        let mut lab = shaped_lab(None, &[]);
        let flows = [tcp("cubic", SECONDS), tcp("bbr", SECONDS)];
        let flows: Vec<&Tcp> = flows.iter().collect();
        run_cell(&mut lab, RATE_BPS, &flows, &[], STEADY_FROM).unwrap()
    };
    let least = |shares: &Shares| shares.tcp.iter().copied().fold(f64::MAX, f64::min);
    let shares = median_if_outside(
        "Cubic beside BBR, the smaller share",
        run,
        |shares| least(shares) >= BBR_CELL_LEAST,
        least,
    );
    println!("Cubic beside BBR: {shares}");
    for (name, share) in ["Cubic", "BBR"].iter().zip(&shares.tcp) {
        assert!(
            *share >= BBR_CELL_LEAST,
            "{name} got {share:.3} of the rate"
        );
    }
}

#[test]
fn four_cubic_flows_get_equal_shares() {
    let mut lab = shaped_lab(None, &[]);
    let flow = tcp("cubic", SECONDS);
    // The class's flow count and fair share, read every second from 10 s on.
    let router = lab.router.clone();
    let sampler = std::thread::spawn(move || {
        std::thread::sleep(STEADY_FROM);
        (0..15)
            .map(|_| {
                std::thread::sleep(Duration::from_secs(1));
                router.shaper_json(&["stats", "--json"]).unwrap()[0].clone()
            })
            .collect::<Vec<_>>()
    });
    let mut first = Some(run_cell(&mut lab, RATE_BPS, &[&flow; 4], &[], STEADY_FROM).unwrap());
    drop(lab);
    let samples = sampler.join().unwrap();
    // Judged as the median run of three by the total when the first is outside (a fresh
    // lab each; the census above is the first run's).
    let shares = median_if_outside(
        "four Cubic flows, together",
        || {
            first.take().unwrap_or_else(|| {
                let mut lab = shaped_lab(None, &[]);
                run_cell(&mut lab, RATE_BPS, &[&flow; 4], &[], STEADY_FROM).unwrap()
            })
        },
        |shares| shares.total() >= TOGETHER_LEAST && shares.jain() >= 0.98,
        Shares::total,
    );
    println!("four Cubic flows: {shares}");
    assert!(shares.jain() >= 0.98, "Jain's index {:.3}", shares.jain());
    assert!(
        shares.total() >= TOGETHER_LEAST,
        "together {:.3}",
        shares.total()
    );
    let most_flows = samples.iter().filter_map(|row| row["flows"].as_u64()).max();
    let shares_bps: Vec<f64> = samples
        .iter()
        .filter_map(|row| row["fair_share_bps"].as_f64())
        .collect();
    let median_share = shaper_tests::median(&shares_bps);
    println!("flows counted: at most {most_flows:?}; a flow's fair share: median {median_share:.0} bit/s");
    assert_eq!(most_flows, Some(4), "{samples:?}");
    // Between an equal split of the rate (2.5 Mbit/s) and half of it: the share falls by
    // 1/16 an interval the queue empties and rises back when it stands (medians of
    // 2.67-3.56 Mbit/s measured); the whole rate (one queue's view) fails.
    assert!(
        (2.4e6..=5.0e6).contains(&median_share),
        "fair share {median_share} bit/s"
    );
}

/// Sixteen Cubic flows in a 100 Mbit/s class: each flow's window is a few packets, so a
/// cap that drops the tail of one costs a retransmission timeout (0.77-0.80 together with
/// the short cap for every flow, 45 timeouts a second).
#[test]
fn sixteen_cubic_flows_at_100mbit_keep_the_rate() {
    let mut lab = Lab::new().unwrap();
    lab.router.attach("r1", &[]).unwrap();
    lab.router
        .class_add("bulk", "r1", &shape_to_server("100mbit"))
        .unwrap();
    let flow = tcp("cubic", SECONDS);
    let shares = median_if_outside(
        "sixteen Cubic flows at 100 Mbit/s, together",
        || run_cell(&mut lab, 100e6, &[&flow; 16], &[], STEADY_FROM).unwrap(),
        |shares| shares.total() >= TOGETHER_LEAST && shares.jain() >= 0.97,
        Shares::total,
    );
    println!("sixteen Cubic flows at 100 Mbit/s: {shares}");
    assert!(shares.jain() >= 0.97, "Jain's index {:.3}", shares.jain());
    assert!(
        shares.total() >= TOGETHER_LEAST,
        "together {:.3}",
        shares.total()
    );
}

/// Host isolation: a host with eight flows and a host with one split the class by host:
/// the one flow at least the 0.45 (by flow alone it would get 1/9). A first run
/// outside is run twice more and the median run judged, as `tcp_beside_udp`'s.
#[test]
fn fair_src_shares_by_host_first() {
    let run = || {
        let mut lab = shaped_lab(None, &["--fair", "src"]);
        add_second_client(&lab).unwrap();
        let crowd = tcp("cubic", SECONDS);
        let single = Tcp {
            bind: Some(SECOND_CLIENT_V4),
            ..tcp("cubic", SECONDS)
        };
        let flows: Vec<&Tcp> = std::iter::repeat_n(&crowd, 8).chain([&single]).collect();
        run_cell(&mut lab, RATE_BPS, &flows, &[], STEADY_FROM).unwrap()
    };
    let single = |shares: &Shares| shares.tcp[8];
    let shares = median_if_outside(
        "--fair src, the single flow's host",
        run,
        |shares| single(shares) >= SRC_CELL_LEAST,
        single,
    );
    let crowd_total: f64 = shares.tcp[..8].iter().sum();
    println!(
        "--fair src: eight flows of one host {crowd_total:.3} together, one flow of another {:.3}",
        single(&shares)
    );
    assert!(
        single(&shares) >= SRC_CELL_LEAST,
        "the single flow's host got {:.3}",
        single(&shares)
    );
}

/// `--fair none` is the one queue of before: the unresponsive flow takes the class.
#[test]
fn fair_none_keeps_one_queue() {
    let mut lab = shaped_lab(None, &["--fair", "none"]);
    let flood = udp_flood("20M", 20);
    let shares: Shares = run_cell(
        &mut lab,
        RATE_BPS,
        &[&tcp("cubic", 20)],
        &[&flood],
        Duration::from_secs(8),
    )
    .unwrap();
    println!("--fair none: {shares}");
    assert!(
        shares.tcp[0] < 0.2,
        "TCP got {:.3} without isolation",
        shares.tcp[0]
    );
    let row = stats(&lab);
    assert_eq!(row["fair"], "none");
    assert_eq!(row["fair_dropped_packets"], 0);
}
