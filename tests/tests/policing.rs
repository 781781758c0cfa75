//! End-to-end scenarios on the namespace lab: real veths, real TC attach, real iperf3.
//! Rates are L2 rates measured at the server over the steady-state seconds of each run.

use shaper_tests::{assert_within, Lab, Udp, ROUTER_TO_SERVER, SERVER_DEV};

const TEN_MBIT: f64 = 10e6;

fn police_udp_on_router(lab: &mut Lab, mode: &str, ipv6: bool) -> f64 {
    let router = lab.router.clone();
    lab.shaper_in(&router, &["attach", ROUTER_TO_SERVER, "--attach-mode", mode]).unwrap();
    lab.shaper_in(&router, &["class", "add", "udp10", "--dev", ROUTER_TO_SERVER, "--rate", "10mbit", "--proto", "udp"]).unwrap();
    let result = lab.udp(&Udp { rate: "100M", ipv6, ..Udp::default() }).unwrap();
    result.total_l2_bps()
}

#[test]
fn scenario01_udp_v4_policed_to_10mbit_tcx() {
    let mut lab = Lab::new().unwrap();
    let rate = police_udp_on_router(&mut lab, "tcx", false);
    assert_within("UDP/IPv4 100M offered through a 10mbit class (tcx)", rate, TEN_MBIT, 0.03);
}
