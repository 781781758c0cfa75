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

/// An IPv4 address as the parsed packet holds it: the header's bytes read as one word.
fn v4_addr(octets: [u8; 4]) -> u32 {
    u32::from_le_bytes(octets)
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

/// An IPv6 address's two tuple words, as the parsed packet holds them.
fn v6_words(address: std::net::Ipv6Addr) -> [u64; 2] {
    let bytes = address.octets();
    let word = |half: usize| {
        u64::from_le_bytes(bytes[8 * half..8 * half + 8].try_into().expect("8 bytes"))
    };
    [word(0), word(1)]
}

fn v6(src: std::net::Ipv6Addr, dst: std::net::Ipv6Addr) -> [u64; 5] {
    let ([src0, src1], [dst0, dst1]) = (v6_words(src), v6_words(dst));
    [first_word(6, 6, 443, 40_000), src0, src1, dst0, dst1]
}

/// `fd00::` with the given group (16 bits) at `index` of the eight.
fn fd00(index: usize, group: u16) -> std::net::Ipv6Addr {
    let mut groups = [0xfd00, 0, 0, 0, 0, 0, 0, 0];
    groups[index] = group;
    if index != 7 {
        groups[7] = 1;
    }
    std::net::Ipv6Addr::from(groups)
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
fn tuples_differing_in_ports_hosts_or_subnets_spread_over_the_slots() {
    // 1024 balls in 1024 bins fill about 1 - 1/e = 63 % of them when the hash is fair.
    let fair = (VERDICT_CACHE_SLOTS as f64 * 0.58) as usize;
    let server = v4_addr([198, 18, 2, 2]);
    let client = v4_addr([198, 18, 0, 2]);
    let cases = [
        (
            "source ports",
            spread((0..1024u16).map(|port| v4(client, server, 40_000 + port, 5201))),
        ),
        (
            "destination ports",
            spread((0..1024u16).map(|port| v4(client, server, 40_000, port))),
        ),
        (
            "source x destination ports",
            spread(
                (0..1024u16).map(|pair| v4(client, server, 40_000 + pair / 32, 5201 + pair % 32)),
            ),
        ),
        // Hosts of a /22: in network order their last byte is the top of the word.
        (
            "IPv4 sources of a /22",
            spread((0..1024u16).map(|host| {
                let [high, low] = host.to_be_bytes();
                v4(v4_addr([198, 18, high, low]), server, 40_000, 5201)
            })),
        ),
        (
            "IPv4 sources x destinations, last bytes",
            spread((0..1024u16).map(|pair| {
                let (src, dst) = ((pair / 32) as u8, (pair % 32) as u8);
                v4(
                    v4_addr([198, 18, 0, src]),
                    v4_addr([198, 18, 1, dst]),
                    40_000,
                    5201,
                )
            })),
        ),
        (
            "IPv6 sources ::1 to ::400",
            spread((0..1024u16).map(|host| v6(fd00(7, host + 1), fd00(7, 1)))),
        ),
        (
            "IPv6 destinations ::1 to ::400",
            spread((0..1024u16).map(|host| v6(fd00(7, 1), fd00(7, host + 1)))),
        ),
        (
            "IPv6 sources x destinations, last bytes",
            spread((0..1024u16).map(|pair| v6(fd00(7, pair / 32 + 1), fd00(7, pair % 32 + 1)))),
        ),
        (
            "IPv6 sources in 1024 subnets (/64)",
            spread((0..1024u16).map(|subnet| v6(fd00(3, subnet), fd00(7, 1)))),
        ),
        (
            "IPv6 interface identifiers, high group",
            spread((0..1024u16).map(|id| v6(fd00(4, id), fd00(7, 1)))),
        ),
    ];
    for (what, taken) in cases {
        println!("{what}: {taken} of {VERDICT_CACHE_SLOTS} slots");
        assert!(
            taken >= fair,
            "{what}: {taken} of {VERDICT_CACHE_SLOTS} slots"
        );
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
