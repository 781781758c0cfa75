//! A global class in the packet path: its share is its rate, and when the daemon stops
//! renewing the share the program itself installs the floor at the expiry.

use super::*;
use shaper::classes::{self, ShareUpdate};

const MS: u64 = 1_000_000;

/// A global class of UDP to port 9000: a 30 Mbit/s limit, its floor 400 kbit/s.
const GLOBAL_CLASS: &[&str] = &[
    "global", "--proto", "udp", "--dport", "9000", "--rate", "30mbit", "--global", "tenant",
    "--floor", "400kbit",
];

/// The daemon's share installed: 10 Mbit/s of 3 hosts until `expiry` on the program's
/// clock; the update, for renewals.
fn install_share(harness: &Harness, expiry: u64) -> ShareUpdate {
    let update = ShareUpdate {
        share_bits_per_sec: 10_000_000,
        hosts: 3,
        answered_unix_ms: 1,
        expires_ns: expiry,
    };
    assert!(classes::set_share(&harness.attachment, "global", update).unwrap());
    update
}

/// 1000-byte frames every millisecond (8 Mbit/s) from `from` for `count` ms: the bytes
/// admitted.
fn send(harness: &mut Harness, from: u64, count: u64) -> u64 {
    let frame = ipv4(V4::default(), udp(9000, 958));
    let mut admitted = 0;
    for index in 0..count {
        let (verdict, class) = harness.run(&frame, from + index * MS, 0);
        assert_eq!(class.as_deref(), Some("global"));
        if verdict == PASS {
            admitted += frame.len() as u64;
        }
    }
    admitted
}

#[test]
fn an_expired_share_falls_to_the_floor_in_the_packet_path() {
    let mut harness = Harness::new(&[GLOBAL_CLASS]);
    let id = harness.class_id("global");
    let share = classes::share_of(&harness.attachment, id).unwrap();
    assert_eq!(
        share.share_bits_per_sec, 400_000,
        "a global class starts at its floor"
    );
    // The daemon's share: 10 Mbit/s until 2 s on the program's clock.
    let expiry = 2_000 * MS;
    let update = install_share(&harness, expiry);
    let frame_len = ipv4(V4::default(), udp(9000, 958)).len() as u64;
    // 8 Mbit/s within a 10 Mbit/s share: everything passes.
    let before = send(&mut harness, 1_000 * MS, 1000);
    assert_eq!(before, 1000 * frame_len);
    // Past the expiry the floor holds: 400 kbit/s over a second, plus its burst at most.
    let after = send(&mut harness, expiry + MS, 1000);
    let config = harness.attachment.classes().unwrap().get(&id, 0).unwrap();
    let share = classes::share_of(&harness.attachment, id).unwrap();
    assert_eq!(share.expires_ns, 0, "the expiry is taken");
    assert_eq!(config.version, share.floor_version);
    assert_eq!(config.cost, share.floor.cost);
    let floor_burst = share.floor.cost.burst_bytes;
    let most = 400_000 / 8 + floor_burst + frame_len;
    println!("admitted after the expiry: {after} bytes (the floor allows {most} at most)");
    assert!(after <= most, "{after} > {most}");
    assert!(
        after >= 400_000 / 8 - frame_len,
        "the floor still passes its rate: {after}"
    );
    // The daemon back: the share is installed again.
    let update = ShareUpdate {
        expires_ns: 10_000 * MS,
        ..update
    };
    assert!(classes::set_share(&harness.attachment, "global", update).unwrap());
    let back = send(&mut harness, 4_000 * MS, 1000);
    assert_eq!(back, 1000 * frame_len, "the share holds again");
    // Halving the limit halves every host's share at once (the daemons then re-split it).
    let router = harness.lab.router.clone();
    router
        .shaper(&[
            "class", "change", "global", "--dev", DEV, "--rate", "15mbit",
        ])
        .unwrap();
    let share = classes::share_of(&harness.attachment, id).unwrap();
    assert_eq!(share.limit_bits_per_sec, 15_000_000);
    assert_eq!(share.share_bits_per_sec, 5_000_000);
    let config = harness.attachment.classes().unwrap().get(&id, 0).unwrap();
    assert_eq!(
        config.cost,
        shaper_common::ByteCost::new(5_000_000, config.cost.burst_bytes)
    );
}

/// The daemon's renewal races the packet path's floor install: the share is read while
/// it is in force, then the floor goes in (the share expired) before the renewal is
/// written. The entry is written whole, so the write must not leave a live-looking share
/// over a floored class: it says so, the entry is marked expired again, renewing refuses,
/// and installing brings the share back. Catches a renewal that trusts what it read.
#[test]
fn a_renewal_that_loses_the_race_to_the_floor_leaves_the_share_to_install() {
    let mut harness = Harness::new(&[GLOBAL_CLASS]);
    let id = harness.class_id("global");
    let expiry = 2_000 * MS;
    let update = install_share(&harness, expiry);
    let renewed = ShareUpdate {
        expires_ns: 3_000 * MS,
        ..update
    };
    let renewal = classes::Renewal::read(&harness.attachment, "global", renewed)
        .unwrap()
        .expect("the share is in force");
    // The packet path passes the expiry between the read and the write.
    send(&mut harness, expiry + MS, 10);
    let config = harness.attachment.classes().unwrap().get(&id, 0).unwrap();
    let floored = classes::share_of(&harness.attachment, id).unwrap();
    assert_eq!(config.cost, floored.floor.cost, "the floor went in");
    assert!(
        !renewal.write(&harness.attachment).unwrap(),
        "a renewal written over a floor said it renewed"
    );
    let share = classes::share_of(&harness.attachment, id).unwrap();
    assert_eq!(share.expires_ns, 0, "the entry is marked expired again");
    assert!(!classes::renew_share(&harness.attachment, "global", renewed).unwrap());
    let installed = ShareUpdate {
        expires_ns: 10_000 * MS,
        ..update
    };
    assert!(classes::set_share(&harness.attachment, "global", installed).unwrap());
    let frame_len = ipv4(V4::default(), udp(9000, 958)).len() as u64;
    let back = send(&mut harness, 4_000 * MS, 1000);
    assert_eq!(back, 1000 * frame_len, "the share holds again");
}
