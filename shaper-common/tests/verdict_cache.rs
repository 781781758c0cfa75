//! The verdict cache's slot function: in range, deterministic, and spread across the slots
//! for the tuples a busy link carries (flows that differ in one port or one address), so
//! a handful of flows do not evict one another.

use shaper_common::{verdict_slot, verdict_stamp, VERDICT_CACHE_SLOTS};
use std::collections::HashSet;

/// The first word of the parsed packet: family, protocol, flags, a spare byte, ports.
fn first_word(family: u8, proto: u8, sport: u16, dport: u16) -> u64 {
    u64::from_le_bytes([
        family,
        proto,
        0,
        0,
        sport.to_le_bytes()[0],
        sport.to_le_bytes()[1],
        dport.to_le_bytes()[0],
        dport.to_le_bytes()[1],
    ])
}

fn v4(src: u32, dst: u32, sport: u16, dport: u16) -> [u64; 5] {
    [
        first_word(4, 17, sport, dport),
        src as u64,
        0,
        dst as u64,
        0,
    ]
}

/// Distinct slots taken by `tuples`.
fn spread(tuples: impl Iterator<Item = [u64; 5]>) -> usize {
    tuples
        .map(|tuple| {
            let slot = verdict_slot(&tuple);
            assert!(slot < VERDICT_CACHE_SLOTS);
            slot
        })
        .collect::<HashSet<_>>()
        .len()
}

#[test]
fn tuples_differing_in_one_field_spread_over_the_slots() {
    // 1024 balls in 1024 bins fill about 1 - 1/e = 63 % of them when the hash is fair.
    let fair = (VERDICT_CACHE_SLOTS as f64 * 0.58) as usize;
    let source_ports = spread((0..1024u16).map(|port| v4(1, 2, 40_000 + port, 5201)));
    let dest_ports = spread((0..1024u16).map(|port| v4(1, 2, 40_000, port)));
    let sources = spread((0..1024u32).map(|host| v4(0xc612_0000 + host, 2, 40_000, 5201)));
    let v6_low_word = spread((0..1024u64).map(|host| {
        let mut tuple = [first_word(6, 6, 443, 40_000), 0, 0, 0, 1];
        tuple[2] = host << 32;
        tuple
    }));
    // Hosts numbered ::1, ::2, … differ in the address's last two bytes: the top of the
    // last word, as the packet holds it (network order).
    let v6_host_numbers = spread((0..1024u16).map(|host| {
        let mut tuple = [first_word(6, 6, 443, 40_000), 0, 0, 0, 1];
        tuple[4] = u64::from_le_bytes([
            0,
            0,
            0,
            0,
            0,
            0,
            host.to_be_bytes()[0],
            host.to_be_bytes()[1],
        ]);
        tuple
    }));
    println!(
        "slots taken: sport {source_ports}, dport {dest_ports}, src {sources}, v6 {v6_low_word}, v6 host numbers {v6_host_numbers}"
    );
    for taken in [
        source_ports,
        dest_ports,
        sources,
        v6_low_word,
        v6_host_numbers,
    ] {
        assert!(taken >= fair, "{taken} of {VERDICT_CACHE_SLOTS} slots");
    }
}

#[test]
fn the_slot_depends_on_the_tuple_alone_and_a_zeroed_slot_matches_no_generation() {
    let tuple = v4(7, 8, 9, 10);
    assert_eq!(verdict_slot(&tuple), verdict_slot(&tuple));
    assert_ne!(verdict_slot(&tuple), verdict_slot(&v4(7, 8, 9, 11)));
    for generation in [0, 1, u32::MAX] {
        assert_ne!(verdict_stamp(generation), 0);
    }
    assert_ne!(verdict_stamp(0), verdict_stamp(u32::MAX));
}
