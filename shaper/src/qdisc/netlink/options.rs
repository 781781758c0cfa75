//! The options of shaper's qdiscs and HTB classes, which netlink-packet-route has no
//! types for: encoded in the layouts of `linux/pkt_sched.h`.

use netlink_packet_core::DefaultNla;
use netlink_packet_route::tc::{TcAttribute, TcOption};

/// What an HTB class is set to (rates in bits per second, bursts in bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HtbClassOptions {
    pub rate_bits_per_sec: u64,
    pub ceil_bits_per_sec: u64,
    pub burst_bytes: u64,
    pub cburst_bytes: u64,
    pub quantum: u32,
    pub prio: u32,
}

// linux/pkt_sched.h
const TCA_OPTIONS: u16 = 2;
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_INIT: u16 = 2;
const TCA_HTB_RATE64: u16 = 6;
const TCA_HTB_CEIL64: u16 = 7;
const TC_HTB_PROTOVER: u32 = 3;
const TC_LINKLAYER_ETHERNET: u8 = 1;
/// The kernel's scheduler tick is 64 ns (PSCHED_SHIFT 6) on every kernel shaper runs on.
const NANOSECONDS_PER_TICK: u128 = 64;

/// `struct tc_ratespec` at `bytes_per_sec` (the full rate goes in TCA_HTB_RATE64 above
/// 32 bits). Link layer Ethernet: the kernel then needs no rate table.
fn ratespec(bytes_per_sec: u64) -> [u8; 12] {
    let mut spec = [0u8; 12];
    spec[1] = TC_LINKLAYER_ETHERNET;
    let rate = u32::try_from(bytes_per_sec).unwrap_or(u32::MAX);
    spec[8..12].copy_from_slice(&rate.to_ne_bytes());
    spec
}

/// The time `burst_bytes` takes at `bytes_per_sec`, in scheduler ticks (tc's
/// `tc_calc_xmittime`, rounded up); the longest HTB can hold where it does not fit.
fn burst_ticks(burst_bytes: u64, bytes_per_sec: u64) -> u32 {
    let ticks = (u128::from(burst_bytes) * 1_000_000_000)
        .div_ceil(u128::from(bytes_per_sec.max(1)) * NANOSECONDS_PER_TICK);
    u32::try_from(ticks).unwrap_or(u32::MAX)
}

/// TCA_OPTIONS of an HTB class: `struct tc_htb_opt`, and the 64-bit rates where the
/// 32-bit fields cannot hold them (34 Gbit/s and up).
pub(super) fn htb_class(options: &HtbClassOptions) -> Vec<TcOption> {
    let rate = options.rate_bits_per_sec / 8;
    let ceil = options.ceil_bits_per_sec / 8;
    let mut parms = Vec::with_capacity(44);
    parms.extend_from_slice(&ratespec(rate));
    parms.extend_from_slice(&ratespec(ceil));
    let level = 0u32;
    for field in [
        burst_ticks(options.burst_bytes, rate),
        burst_ticks(options.cburst_bytes, ceil),
        options.quantum,
        level,
        options.prio,
    ] {
        parms.extend_from_slice(&field.to_ne_bytes());
    }
    let mut nested = vec![TcOption::Other(DefaultNla::new(TCA_HTB_PARMS, parms))];
    for (kind, value) in [(TCA_HTB_RATE64, rate), (TCA_HTB_CEIL64, ceil)] {
        if value > u64::from(u32::MAX) {
            nested.push(TcOption::Other(DefaultNla::new(
                kind,
                value.to_ne_bytes().to_vec(),
            )));
        }
    }
    nested
}

/// An HTB root: `struct tc_htb_glob`, version 3, quantum from rate / 10 where a class
/// gives none, and `default_class` for traffic no class claims (0: unshaped).
pub(crate) fn htb_root(default_class: u32) -> Vec<TcAttribute> {
    let mut glob = Vec::with_capacity(20);
    for field in [TC_HTB_PROTOVER, 10, default_class, 0, 0] {
        glob.extend_from_slice(&field.to_ne_bytes());
    }
    vec![
        TcAttribute::Kind("htb".into()),
        TcAttribute::Options(vec![TcOption::Other(DefaultNla::new(TCA_HTB_INIT, glob))]),
    ]
}

/// A bfifo of `limit_bytes` (`struct tc_fifo_qopt`, not nested).
pub(crate) fn bfifo(limit_bytes: u64) -> Vec<TcAttribute> {
    let limit = u32::try_from(limit_bytes).unwrap_or(u32::MAX);
    vec![
        TcAttribute::Kind("bfifo".into()),
        TcAttribute::Other(DefaultNla::new(TCA_OPTIONS, limit.to_ne_bytes().to_vec())),
    ]
}

/// A qdisc of `kind` with its defaults.
pub(crate) fn plain(kind: &str) -> Vec<TcAttribute> {
    vec![TcAttribute::Kind(kind.into())]
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::Nla as _;

    fn u32_at(bytes: &[u8], at: usize) -> u32 {
        u32::from_ne_bytes(bytes[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn a_burst_is_its_time_at_the_rate_in_64_ns_ticks_rounded_up() {
        // 128 KiB at 10 Mbit/s: 104.8576 ms, 1 638 400 ticks.
        assert_eq!(burst_ticks(131_072, 1_250_000), 1_638_400);
        // 1 MiB at 40 Gbit/s: 209 715.2 ns, 3 276.8 ticks: 3 277.
        assert_eq!(burst_ticks(1 << 20, 5_000_000_000), 3_277);
        // What does not fit is held at the longest HTB takes (tc would wrap it).
        assert_eq!(burst_ticks(131_072, 1), u32::MAX);
    }

    #[test]
    fn htb_class_options_are_tc_htb_opt_with_64_bit_rates_above_32_bits() {
        let options = HtbClassOptions {
            rate_bits_per_sec: 10_000_000,
            ceil_bits_per_sec: 40_000_000_000,
            burst_bytes: 131_072,
            cburst_bytes: 1 << 20,
            quantum: 1514,
            prio: 1,
        };
        let nested = htb_class(&options);
        let TcOption::Other(parms) = &nested[0] else {
            panic!("{nested:?}")
        };
        assert_eq!(parms.kind(), TCA_HTB_PARMS);
        let mut bytes = vec![0u8; parms.value_len()];
        parms.emit_value(&mut bytes);
        assert_eq!(bytes.len(), 44, "sizeof(struct tc_htb_opt)");
        // rate: link layer Ethernet, 1 250 000 bytes/s.
        assert_eq!((bytes[0], bytes[1]), (0, TC_LINKLAYER_ETHERNET));
        assert_eq!(u32_at(&bytes, 8), 1_250_000);
        // ceil: 5e9 bytes/s does not fit: ~0 here, the whole rate in TCA_HTB_CEIL64.
        assert_eq!(bytes[13], TC_LINKLAYER_ETHERNET);
        assert_eq!(u32_at(&bytes, 20), u32::MAX);
        assert_eq!(u32_at(&bytes, 24), 1_638_400, "buffer");
        assert_eq!(u32_at(&bytes, 28), 3_277, "cbuffer");
        assert_eq!(u32_at(&bytes, 32), 1514, "quantum");
        assert_eq!(u32_at(&bytes, 36), 0, "level");
        assert_eq!(u32_at(&bytes, 40), 1, "prio");
        assert_eq!(nested.len(), 2, "only the ceil needs 64 bits: {nested:?}");
        let TcOption::Other(ceil64) = &nested[1] else {
            panic!("{nested:?}")
        };
        assert_eq!(ceil64.kind(), TCA_HTB_CEIL64);
        let mut value = vec![0u8; 8];
        ceil64.emit_value(&mut value);
        assert_eq!(u64::from_ne_bytes(value.try_into().unwrap()), 5_000_000_000);
    }

    #[test]
    fn an_htb_root_is_version_3_with_its_default_class() {
        let attributes = htb_root(0x10);
        assert_eq!(attributes[0], TcAttribute::Kind("htb".into()));
        let TcAttribute::Options(options) = &attributes[1] else {
            panic!("{attributes:?}")
        };
        let TcOption::Other(init) = &options[0] else {
            panic!("{options:?}")
        };
        assert_eq!(init.kind(), TCA_HTB_INIT);
        let mut bytes = vec![0u8; init.value_len()];
        init.emit_value(&mut bytes);
        let fields: Vec<u32> = (0..5).map(|i| u32_at(&bytes, i * 4)).collect();
        assert_eq!(fields, [3, 10, 0x10, 0, 0]);
        // fq (the EDT root) with the kernel's defaults: its kind alone.
        assert_eq!(plain("fq"), [TcAttribute::Kind("fq".into())]);
        // A bfifo's limit is the bare struct, not nested attributes.
        let fifo = bfifo(250_000);
        assert_eq!(
            fifo[1],
            TcAttribute::Other(DefaultNla::new(
                TCA_OPTIONS,
                250_000u32.to_ne_bytes().to_vec()
            ))
        );
    }
}
