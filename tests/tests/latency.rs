//! Shaping without bufferbloat: one `--action shape` class on the router's egress toward
//! the server, a bulk load from the client, and two probes from the client in the same
//! class: a 20 Hz ping (a sparse flow: it skips the bulk queue, as a neighbour's DNS or
//! SSH does) and, where named, a queue probe (irtt above the sparse threshold: it waits in
//! the bulk queue with the bulk flows, so it reads the queue CoDel keeps). Each run is
//! 30 s; figures are over the steady state from 10 s on. Asserted (issues 10 and 34):
//! goodput >= 0.93 of the rate (the queue probe's delivered payload counted with the
//! bulk flows': the class carries both), 0.85 at 80 ms base RTT with
//! `--interval 200ms` (0.70 with the defaults there: an accepted limit, see the test); the
//! bulk flows' own smoothed RTT <= base + 20 ms (µs lab), base + 25 ms (40 and 80 ms); the
//! ping's added RTT p50 <= 5 ms (6 ms with a base RTT) and p99 <= 15 ms, at most 1 % of
//! pings lost; the queue probe's added RTT p50 <= 15 ms and p99 <= 30 ms; UDP at 10x the
//! rate delivered within 1 %. Through the delay line, a run counts
//! only if the delay line kept time (p99 lateness within 1 ms). A first run under the
//! goodput target is run twice more and the median of the three is judged. The full
//! matrix, and tbf/htb side by side, is in `cargo xtask bench`.

use shaper_common::codel::SPARSE_RATE_DIVISOR;
use shaper_tests::{
    assert_goodput_fraction,
    latency::{tcp_under_probe, udp_under_probe, AddedRtt, LoadedRun},
    shape_to_server, Lab, Tcp, Udp, CLIENT_DEV, ROUTER_TO_CLIENT,
};
use std::time::Duration;

const SECONDS: u32 = 30;
const STEADY_FROM: Duration = Duration::from_secs(10);
/// The queue probe's rate over the sparse threshold (a flow below 1/16 of the class's
/// rate is sparse): 1.5 × keeps it in the bulk queue whatever its timer's jitter.
const QUEUE_PROBE_OVER_SPARSE: f64 = 1.5;
/// At most this share of the ping probes may go unanswered: it is a sparse flow, which
/// neither CoDel nor the cap should ever drop.
const PROBE_LOSS: f64 = 0.01;

fn shape_class(lab: &Lab, rate: &str, extra: &[&str]) {
    let options = [&shape_to_server(rate)[..], extra].concat();
    lab.router.class_add("bulk", "r1", &options).unwrap();
}

fn cubic(flows: u32) -> Tcp {
    Tcp {
        flows,
        ..Tcp::for_seconds(SECONDS)
    }
}

/// What one run must show.
struct Targets {
    /// Least goodput / rate (bulk flows and the queue probe's delivered payload).
    goodput: f64,
    /// Most the bulk flows' mean smoothed RTT may exceed the base RTT by (ms).
    bulk_rtt_over_base_ms: f64,
    /// The ping probe's added RTT p50 and p99 (ms).
    ping: (f64, f64),
    /// The queue probe's added RTT p50 and p99 (ms), when it runs.
    queue: Option<(f64, f64)>,
}

/// The queue probe's bounds (added RTT p50, p99; ms): its packets wait behind the bulk
/// flows' in the queue CoDel keeps near its 5 ms target, with a Cubic sawtooth's peaks
/// above it (measured p50 9.1-9.3 ms and p99 14-15 ms at 10 Mbit/s on the µs path; p50
/// 6.0-6.3 ms and p99 17-20 ms at 20 Mbit/s over 40 ms). A queue of 100 ms fails both.
const QUEUE_BOUNDS: (f64, f64) = (15.0, 30.0);

/// The queue probe's delivered payload rate (bit/s; 0 when it did not run).
fn queue_delivered_bps(run: &LoadedRun) -> f64 {
    run.queue.map_or(0.0, |queue| {
        run.queue_probe_bps * queue.samples as f64 / (queue.samples + queue.lost).max(1) as f64
    })
}

/// What the class carried over the steady state, as a share of its rate: the bulk flows'
/// goodput and the queue probe's delivered payload.
fn goodput_fraction(run: &LoadedRun, rate_bps: f64) -> f64 {
    (run.steady_goodput_bps + queue_delivered_bps(run)) / rate_bps
}

fn check(what: &str, run: &LoadedRun, rate_bps: f64, base_rtt_ms: f64, targets: &Targets) {
    let queue_delivered_bps = queue_delivered_bps(run);
    let fraction = goodput_fraction(run, rate_bps);
    let bulk_rtt = run.sender_rtt_ms.expect("iperf3 reported the sender's RTT");
    println!(
        "{what}: goodput {:.3} of the rate ({:.3} bulk + {:.3} queue probe), bulk flows' RTT \
         {bulk_rtt:.1} ms (base {base_rtt_ms:.0} ms); ping {}; queue probe {}",
        fraction,
        run.steady_goodput_bps / rate_bps,
        queue_delivered_bps / rate_bps,
        run.added,
        run.queue
            .map_or_else(|| "not run".to_string(), |queue| queue.to_string()),
    );
    println!(
        "{what}: the bulk flows' RTT per second: {}",
        run.sender_rtt_series
            .iter()
            .map(|(end, ms)| format!("{end:.0}s {ms:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert_goodput_fraction(what, fraction, targets.goodput);
    assert!(
        bulk_rtt <= base_rtt_ms + targets.bulk_rtt_over_base_ms,
        "{what}: the bulk flows' RTT {bulk_rtt:.1} ms > base {base_rtt_ms:.0} + {} ms",
        targets.bulk_rtt_over_base_ms
    );
    assert_added_rtt(&format!("{what}, ping"), &run.added, targets.ping);
    assert!(run.added.samples >= 300, "{what}: too few probes answered");
    let lost = run.added.lost as f64 / (run.added.samples + run.added.lost) as f64;
    assert!(
        lost <= PROBE_LOSS,
        "{what}: {:.1} % of the pings lost ({} of {})",
        lost * 100.0,
        run.added.lost,
        run.added.samples + run.added.lost
    );
    match (targets.queue, run.queue) {
        (Some(bounds), Some(queue)) => {
            assert_added_rtt(&format!("{what}, queue probe"), &queue, bounds);
            assert!(
                queue.samples >= 1000,
                "{what}: too few queue probes answered"
            );
        }
        (None, None) => {}
        (expected, ran) => panic!("{what}: queue probe expected {expected:?}, ran {ran:?}"),
    }
}

fn assert_added_rtt(what: &str, added: &AddedRtt, (p50, p99): (f64, f64)) {
    assert!(
        added.p50_ms <= p50,
        "{what}: added RTT p50 {:.2} ms > {p50} ms",
        added.p50_ms
    );
    assert!(
        added.p99_ms <= p99,
        "{what}: added RTT p99 {:.2} ms > {p99} ms",
        added.p99_ms
    );
}

/// A lab (with `one_way` delay each way, or the µs lab), one shape class at `rate` (with
/// `extra` options) on the router, `flows` Cubic flows under the probes (the queue probe
/// when `targets` has its bounds), sent with TSO/GSO on at the client or not; checked
/// against `targets`. A first run under the goodput target is run twice more, each in a
/// fresh lab, and the median run by goodput is checked whole: now and then one event
/// costs a 20 s window a few percent (four Cubic flows at 100 Mbit/s: 0.913 once in a
/// full suite, 0.944-0.956 in the runs after it), where a shaper that wastes the rate
/// stays under in all three.
fn run_and_check(
    what: &str,
    one_way: Option<Duration>,
    rate: &str,
    extra: &[&str],
    (flows, sender_tso): (u32, bool),
    targets: Targets,
) {
    let rate_bps = shaper::units::parse_rate(rate).unwrap() as f64;
    let one_run = || {
        let mut lab = match one_way {
            Some(delay) => Lab::with_delay(delay),
            None => Lab::new(),
        }
        .unwrap();
        if !sender_tso {
            lab.client.offloads_off(CLIENT_DEV).unwrap();
        }
        lab.router.attach("r1", &[]).unwrap();
        shape_class(&lab, rate, extra);
        let queue_probe = targets
            .queue
            .map(|_| rate_bps / SPARSE_RATE_DIVISOR as f64 * QUEUE_PROBE_OVER_SPARSE);
        let run = tcp_under_probe(&mut lab, &cubic(flows), STEADY_FROM, queue_probe).unwrap();
        (run, lab.base_rtt().as_secs_f64() * 1e3)
    };
    let first = one_run();
    let (run, base_rtt_ms) = if goodput_fraction(&first.0, rate_bps) >= targets.goodput {
        first
    } else {
        let mut runs = vec![first, one_run(), one_run()];
        runs.sort_by(|a, b| {
            goodput_fraction(&a.0, rate_bps).total_cmp(&goodput_fraction(&b.0, rate_bps))
        });
        let seen: Vec<String> = runs
            .iter()
            .map(|(run, _)| format!("{:.3}", goodput_fraction(run, rate_bps)))
            .collect();
        println!("{what}: goodput under the target on the first run; in three runs {seen:?}");
        runs.swap_remove(1)
    };
    check(what, &run, rate_bps, base_rtt_ms, &targets);
}

/// One flow on the µs path, sent in wire-size segments (TSO/GSO off at the client): its
/// window is its queue, which CoDel holds near 10 ms (9.1-10.0 ms in five runs, the queue
/// probe's p99 14-15 ms). With TSO on, the program spares most condemned 64 KiB
/// aggregates (one signal per k segments) and that queue read 16-27 ms, with seconds at
/// 40-73 ms (issue 37's case, not asserted here).
#[test]
fn shape_at_10mbit_keeps_a_cubic_flows_queue_and_neighbours_short() {
    run_and_check(
        "10 Mbit/s, 1 cubic",
        None,
        "10mbit",
        &[],
        (1, false),
        Targets {
            goodput: 0.93,
            bulk_rtt_over_base_ms: 20.0,
            ping: (5.0, 15.0),
            queue: Some(QUEUE_BOUNDS),
        },
    );
}

#[test]
fn shape_at_100mbit_with_four_cubic_flows_stays_within_5ms() {
    run_and_check(
        "100 Mbit/s, 4 cubic",
        None,
        "100mbit",
        &[],
        (4, true),
        Targets {
            goodput: 0.93,
            bulk_rtt_over_base_ms: 20.0,
            ping: (5.0, 15.0),
            queue: None,
        },
    );
}

#[test]
fn shape_at_20mbit_over_a_40ms_path_keeps_goodput_and_latency() {
    run_and_check(
        "40 ms RTT, 20 Mbit/s, 4 cubic",
        Some(Duration::from_millis(20)),
        "20mbit",
        &[],
        (4, true),
        Targets {
            goodput: 0.93,
            bulk_rtt_over_base_ms: 25.0,
            ping: (6.0, 15.0),
            queue: Some(QUEUE_BOUNDS),
        },
    );
}

/// docs/CHOOSING.md's setting for long paths: an interval of the path's RTT plus its drain
/// time (0.912-0.932 in ten runs, 0.900 once in CI; asserted 0.85). With CoDel's default
/// interval one Cubic flow over 80 ms is an accepted limit (~0.90, 0.77-0.80 in some
/// runs): the full bench reports that row.
#[test]
fn shape_with_a_200ms_interval_over_an_80ms_path_keeps_goodput_and_latency() {
    run_and_check(
        "80 ms RTT, 20 Mbit/s, 1 cubic, --interval 200ms",
        Some(Duration::from_millis(40)),
        "20mbit",
        &["--interval", "200ms"],
        (1, true),
        Targets {
            goodput: 0.85,
            bulk_rtt_over_base_ms: 25.0,
            ping: (6.0, 15.0),
            queue: None,
        },
    );
}

#[test]
fn shape_holds_a_udp_flood_to_the_rate_and_its_neighbours_within_15ms() {
    let mut lab = Lab::new().unwrap();
    lab.router.attach("r1", &[]).unwrap();
    shape_class(&lab, "10mbit", &[]);
    let (delivered, added) = udp_under_probe(
        &mut lab,
        &Udp {
            length: 1400,
            ..Udp::at("100M", 15)
        },
        Duration::from_secs(5),
    )
    .unwrap();
    println!(
        "UDP 10x through shape: delivered {:.3} of the rate; ping {added}",
        delivered / 10e6,
    );
    assert!(
        (delivered / 10e6 - 1.0).abs() <= 0.01,
        "delivered {delivered:.0} bit/s, not 10 Mbit/s within 1 %"
    );
    assert!(added.p99_ms <= 15.0, "probe p99 {:.2} ms", added.p99_ms);
    let lost = added.lost as f64 / (added.samples + added.lost) as f64;
    assert!(lost <= PROBE_LOSS, "{added}: pings lost");
    // CoDel and the cap dropped the excess in the program, not the bfifo's tail.
    let row = lab.router.stats_row("bulk").unwrap();
    assert!(shaper_tests::counter(&row, "dropped_packets") > 1000);
}

/// Issue 37, every sender at 10 Mbit/s with TSO on at the client, each run in a lab of
/// its own and all at once (the machine is far from busy at these rates):
/// - a shape class on the sending host's own egress, Cubic and BBR. Without the aggregate
///   cap TCP builds 64 KiB aggregates on a µs path (52 ms each at 10 Mbit/s): Cubic's RTT
///   read 17-38 ms and BBR got 0.76-0.79 of the rate. The class caps the device's
///   aggregates at two segments; shaper puts the device's own value back when the last
///   shape class goes;
/// - an ingress shape class queueing on an ifb (a VM's or container's upload);
/// - through the router, Cubic and BBR, with GRO on at the router's receiving interface
///   and `--split-aggregates` on its ingress: the class on the way out judges wire-size
///   segments (whole aggregates: BBR 0.81-0.89, Cubic's queue 16-27 ms);
/// - through the router with nothing but `attach r1` and `class add` (issue 54): the
///   egress splitter cuts the forwarded aggregates itself.
#[test]
fn shape_holds_every_sender_at_10mbit_own_egress_ingress_and_forwarded() {
    std::thread::scope(|scope| {
        let runs = [
            scope.spawn(|| sender_egress_run("cubic")),
            scope.spawn(|| sender_egress_run("bbr")),
            scope.spawn(ingress_ifb_run),
            scope.spawn(|| forwarded_split_run("cubic")),
            scope.spawn(|| forwarded_split_run("bbr")),
            scope.spawn(forwarded_by_default_run),
        ];
        for run in runs {
            run.join().expect("an every-sender run panicked");
        }
    });
}

const EVERY_SENDER: Targets = Targets {
    goodput: 0.93,
    bulk_rtt_over_base_ms: 20.0,
    ping: (5.0, 15.0),
    queue: None,
};

/// TSO at the client and GRO at the router's receiving veth on; the router's ingress
/// splits aggregates through its ifb, and the shape class on its way out holds `congestion`
/// at the rate. Turning splitting off takes the ifb away.
fn forwarded_split_run(congestion: &str) {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    gro_on_the_way_in(&router);
    router
        .attach(
            ROUTER_TO_CLIENT,
            &["--direction", "ingress", "--split-aggregates"],
        )
        .unwrap();
    let ifb = shaper::qdisc::ifb_name(ROUTER_TO_CLIENT);
    let through = router.split_through(ROUTER_TO_CLIENT).unwrap();
    assert_eq!(through.as_deref(), Some(ifb.as_str()), "status's SPLIT");
    router.attach("r1", &[]).unwrap();
    shape_class(&lab, "10mbit", &[]);
    let tcp = Tcp {
        congestion: congestion.to_string(),
        ..cubic(1)
    };
    let run = tcp_under_probe(&mut lab, &tcp, STEADY_FROM, None).unwrap();
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    let what = format!("10 Mbit/s through the router, aggregates split, 1 {congestion}");
    check(&what, &run, 10e6, base_rtt_ms, &EVERY_SENDER);
    assert_split_through(&router, &ifb, &what);
    router
        .attach(
            ROUTER_TO_CLIENT,
            &["--direction", "ingress", "--split-aggregates=false"],
        )
        .unwrap();
    let links = router.run("ip", &["-br", "link"]).unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains(&ifb), "splitting off left {ifb}: {links}");
}

/// TSO at the client and GRO at the router's receiving veth on, and nothing but the
/// egress attachment and its class: the splitter (its ifb, `gso_max_segs` 1, and its
/// filter after shaper's) cuts the forwarded aggregates, the class judges segments and
/// holds one BBR flow at the rate. The splitter goes with the last shape class, and the
/// clsact qdisc it made with the attachment.
fn forwarded_by_default_run() {
    let mut lab = Lab::new().unwrap();
    let router = lab.router.clone();
    gro_on_the_way_in(&router);
    router.attach("r1", &[]).unwrap();
    let ifb = shaper::qdisc::splitter_ifb_name("r1");
    let links = |router: &shaper_tests::Netns| {
        let links = router.run("ip", &["-br", "link"]).unwrap();
        String::from_utf8_lossy(&links.stdout).to_string()
    };
    assert!(
        !links(&router).contains(&ifb),
        "a splitter before any shape class"
    );
    shape_class(&lab, "10mbit", &[]);
    assert_eq!(
        router.split_through("r1").unwrap(),
        None,
        "ingress rows only"
    );
    let status = router.status_row().unwrap();
    assert_eq!(status["split_through"], ifb.as_str(), "{status}");
    assert_eq!(router.gso_max_segs(&ifb).unwrap(), 1, "the splitter's ifb");
    let bbr = Tcp {
        congestion: "bbr".to_string(),
        ..cubic(1)
    };
    let run = tcp_under_probe(&mut lab, &bbr, STEADY_FROM, None).unwrap();
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    let what = "10 Mbit/s through the router, nothing but attach and class add, 1 bbr";
    check(what, &run, 10e6, base_rtt_ms, &EVERY_SENDER);
    assert_split_through(&router, &ifb, what);
    router
        .shaper(&["class", "del", "bulk", "--dev", "r1"])
        .unwrap();
    assert!(
        !links(&router).contains(&ifb),
        "the last shape class left {ifb}"
    );
    let filters = router
        .run("tc", &["filter", "show", "dev", "r1", "egress"])
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&filters.stdout).trim(),
        "",
        "r1's clsact hook"
    );
    shape_class(&lab, "10mbit", &[]);
    assert!(
        links(&router).contains(&ifb),
        "a new shape class, a new splitter"
    );
    router.shaper(&["detach", "r1"]).unwrap();
    let qdiscs = router.run("tc", &["qdisc", "show", "dev", "r1"]).unwrap();
    let qdiscs = String::from_utf8_lossy(&qdiscs.stdout).to_string();
    assert!(
        !qdiscs.contains("clsact"),
        "detach left a clsact qdisc: {qdiscs}"
    );
    assert!(!links(&router).contains(&ifb), "detach left {ifb}");
}

/// GRO on at the router's receiving interface: its aggregates are what a class on the
/// way out meets.
fn gro_on_the_way_in(router: &shaper_tests::Netns) {
    let gro = router
        .run("ethtool", &["-K", ROUTER_TO_CLIENT, "gro", "on"])
        .unwrap();
    assert!(gro.status.success(), "GRO on {ROUTER_TO_CLIENT}: {gro:?}");
}

/// The traffic crossed `ifb`, and the router's class saw segments: its passed packets
/// average at most a wire-size frame (unsplit, in runs of this lab: 8 285 bytes).
fn assert_split_through(router: &shaper_tests::Netns, ifb: &str, what: &str) {
    let crossed = router.link_stat(ifb, "tx_packets").unwrap();
    assert!(crossed > 10_000, "{what}: {crossed} packets through {ifb}");
    let row = router.stats_row("bulk").unwrap();
    let passed = shaper_tests::counter(&row, "passed_bytes") as f64
        / shaper_tests::counter(&row, "passed_packets").max(1) as f64;
    assert!(
        passed <= 1600.0,
        "{what}: passed packets average {passed:.0} bytes"
    );
}

fn sender_egress_run(congestion: &str) {
    let mut lab = Lab::new().unwrap();
    let before = lab.client.gso_max_segs(CLIENT_DEV).unwrap();
    lab.client.attach(CLIENT_DEV, &[]).unwrap();
    let options = shape_to_server("10mbit");
    lab.client.class_add("bulk", CLIENT_DEV, &options).unwrap();
    assert_eq!(
        lab.client.gso_max_segs(CLIENT_DEV).unwrap(),
        2,
        "the class's cap"
    );
    let tcp = Tcp {
        congestion: congestion.to_string(),
        ..cubic(1)
    };
    let run = tcp_under_probe(&mut lab, &tcp, STEADY_FROM, None).unwrap();
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    let what = format!("10 Mbit/s on the sender's own egress, TSO on, 1 {congestion}");
    check(&what, &run, 10e6, base_rtt_ms, &EVERY_SENDER);
    lab.client
        .shaper(&["class", "del", "bulk", "--dev", CLIENT_DEV])
        .unwrap();
    assert_eq!(
        lab.client.gso_max_segs(CLIENT_DEV).unwrap(),
        before,
        "the device's own cap is back with the last shape class gone"
    );
}

/// Issue 37: `--direction ingress --action shape` (a VM's or container's upload, arriving
/// on the host's tap or veth) queues on an ifb shaper owns: the program redirects the
/// class's packets there, and the ifb hands them back to the interface's ingress past
/// the hook. One Cubic flow in wire-size segments >= 0.93 of the rate within base +
/// 20 ms (with TSO on at the client its 64 KiB aggregates arrive whole, as through a
/// router: 0.955 at 11-24 ms in runs of this lab, the forwarded-aggregate limit of
/// docs/DESIGN.md); UDP at 10x within 1 %; detach removes the ifb.
fn ingress_ifb_run() {
    let mut lab = Lab::new().unwrap();
    lab.client.offloads_off(CLIENT_DEV).unwrap();
    let router = lab.router.clone();
    router
        .attach(ROUTER_TO_CLIENT, &["--direction", "ingress"])
        .unwrap();
    let options = [
        "--rate",
        "10mbit",
        "--dst",
        "198.18.2.2/32",
        "--action",
        "shape",
        "--direction",
        "ingress",
    ];
    router
        .class_add("upload", ROUTER_TO_CLIENT, &options)
        .unwrap();
    let links =
        String::from_utf8_lossy(&router.run("ip", &["-br", "link"]).unwrap().stdout).to_string();
    let ifb = links
        .lines()
        .find_map(|line| {
            line.split_whitespace()
                .next()
                .filter(|n| n.starts_with("shpq"))
        })
        .expect("an ifb named shpq… in the router's namespace")
        .to_string();
    let run = tcp_under_probe(&mut lab, &cubic(1), STEADY_FROM, None).unwrap();
    let base_rtt_ms = lab.base_rtt().as_secs_f64() * 1e3;
    check(
        "10 Mbit/s ingress shape, 1 cubic",
        &run,
        10e6,
        base_rtt_ms,
        &EVERY_SENDER,
    );
    let (delivered, _) = udp_under_probe(
        &mut lab,
        &Udp {
            length: 1400,
            ..Udp::at("100M", 8)
        },
        Duration::from_secs(3),
    )
    .unwrap();
    println!(
        "UDP 10x through an ingress shape class: delivered {:.4} of the rate",
        delivered / 10e6
    );
    assert!(
        (delivered / 10e6 - 1.0).abs() <= 0.01,
        "delivered {delivered:.0} bit/s, not 10 Mbit/s within 1 %"
    );
    let row = router.stats_row("upload").unwrap();
    assert!(
        shaper_tests::counter(&row, "dropped_packets") > 1000,
        "CoDel and the cap dropped the excess"
    );
    router
        .shaper(&["detach", ROUTER_TO_CLIENT, "--direction", "ingress"])
        .unwrap();
    let links =
        String::from_utf8_lossy(&router.run("ip", &["-br", "link"]).unwrap().stdout).to_string();
    assert!(!links.contains(&ifb), "detach left {ifb}: {links}");
}
