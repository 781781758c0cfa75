//! Flow isolation in a shape class (issue 50): exploratory runs.

use shaper_tests::{shape_to_server, Lab, Tcp, Udp};

const SECONDS: u32 = 20;
const FROM: f64 = 8.0;

fn cubic() -> Tcp {
    Tcp::for_seconds(SECONDS)
}

fn bbr() -> Tcp {
    Tcp {
        congestion: "bbr".into(),
        ..Tcp::for_seconds(SECONDS)
    }
}

fn lab(extra: &[&str]) -> Lab {
    let lab = Lab::new().unwrap();
    lab.router.attach("r1", &[]).unwrap();
    let options = [&shape_to_server("10mbit")[..], extra].concat();
    lab.router.class_add("bulk", "r1", &options).unwrap();
    lab
}

#[test]
#[ignore]
fn explore_tcp_beside_udp() {
    for udp_rate in ["20M", "100M"] {
        let mut lab = lab(&[]);
        let udp = Udp {
            length: 1400,
            ..Udp::at(udp_rate, SECONDS)
        };
        let (tcp, udp) = lab.mixed(&[&cubic()], &[&udp]).unwrap();
        let t = tcp[0].steady_bps_from(FROM) / 10e6;
        let u = udp[0].l2_bps_between(FROM, SECONDS as f64) / 10e6;
        println!(
            "udp {udp_rate}: tcp {t:.3} udp {u:.3} total {:.3} rtt {:?}",
            t + u,
            tcp[0].steady_rtt_ms_from(FROM)
        );
        println!("{}", lab.router.shaper(&["stats"]).unwrap());
    }
}

#[test]
#[ignore]
fn explore_cubic_beside_bbr() {
    let mut lab = lab(&[]);
    let (tcp, _) = lab.mixed(&[&cubic(), &bbr()], &[]).unwrap();
    let c = tcp[0].steady_bps_from(FROM) / 10e6;
    let b = tcp[1].steady_bps_from(FROM) / 10e6;
    println!(
        "cubic {c:.3} bbr {b:.3} rtt {:?} {:?}",
        tcp[0].steady_rtt_ms_from(FROM),
        tcp[1].steady_rtt_ms_from(FROM)
    );
    println!("{}", lab.router.shaper(&["stats"]).unwrap());
}

#[test]
#[ignore]
fn explore_four_cubic() {
    let mut lab = lab(&[]);
    let c = cubic();
    let (tcp, _) = lab.mixed(&[&c, &c, &c, &c], &[]).unwrap();
    let rates: Vec<f64> = tcp.iter().map(|t| t.steady_bps_from(FROM) / 1e6).collect();
    let sum: f64 = rates.iter().sum();
    let sq: f64 = rates.iter().map(|r| r * r).sum();
    println!(
        "four cubic {rates:?} jain {:.3} total {:.3}",
        sum * sum / (4.0 * sq),
        sum / 10.0
    );
}

#[test]
#[ignore]
fn explore_watch() {
    let mut lab = lab(&[]);
    let udp = Udp {
        length: 1400,
        ..Udp::at("20M", SECONDS)
    };
    let router = lab.router.clone();
    let watcher = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for _ in 0..(SECONDS * 5) {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if let Ok(v) = router.shaper_json(&["stats", "--json"]) {
                let r = &v[0];
                lines.push(format!(
                    "q {} flows {} over {} share {} drops {}/{}",
                    r["queue_delay_us"],
                    r["flows"],
                    r["flows_over_share"],
                    r["fair_share_bps"],
                    r["queue_dropped_packets"],
                    r["fair_dropped_packets"]
                ));
            }
        }
        lines
    });
    let (tcp, udp) = lab.mixed(&[&cubic()], &[&udp]).unwrap();
    for line in watcher.join().unwrap() {
        println!("{line}");
    }
    let t = tcp[0].steady_bps_from(FROM) / 10e6;
    let u = udp[0].l2_bps_between(FROM, SECONDS as f64) / 10e6;
    println!(
        "tcp {t:.3} udp {u:.3} rtt {:?}",
        tcp[0].steady_rtt_ms_from(FROM)
    );
}
