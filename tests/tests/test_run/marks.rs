//! Issue 34: what the program writes into the packet and its context, read back from
//! BPF_PROG_TEST_RUN's output: where `ecn` starts marking CE (the bucket more than half
//! drained, and not before), fwmark with a mark already set and a mask, the meters' per
//! colour actions (ECN, DSCP and drop on yellow or red), and IPv6 per-key buckets that
//! tell addresses apart by every word.

use super::*;

/// `__sk_buff.mark`.
const SKB_MARK: usize = 8;
/// The IPv4 TOS byte in [`ipv4`]'s frames, and the IPv6 traffic class's two bytes.
const V4_TOS: usize = 15;
const ECT0: u8 = 0x02;
const CE: u8 = 0x03;

impl Harness {
    /// One frame with context `ctx`: the verdict, and the frame and the context as the
    /// program left them.
    fn run_out(&mut self, frame: &[u8], ctx: &[u8]) -> (u32, Vec<u8>, Vec<u8>) {
        let program = self.clocked();
        let mut data_out = vec![0u8; frame.len()];
        let mut ctx_out = vec![0u8; SKB_SIZE];
        let result = program
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut data_out),
                ctx_in: Some(ctx),
                ctx_out: Some(&mut ctx_out),
                ..TestRunOptions::default()
            })
            .unwrap();
        (result.return_value, data_out, ctx_out)
    }
}

/// A 1000-byte IPv4/UDP frame to `dport` with TOS byte `tos`.
fn frame_with_tos(dport: u16, tos: u8) -> Vec<u8> {
    let mut frame = ipv4(V4::default(), udp(dport, 1000 - 42));
    frame[V4_TOS] = tos;
    frame
}

/// `--action ecn`: while the bucket is at most half drained no packet is marked; beyond,
/// every ECN-capable packet that fits is CE-marked (and passes); once the bucket is empty,
/// packets are dropped, ECN-capable or not. 1000-byte packets at one instant against a
/// 16 000-byte burst: the program's marks must be the model's (occupancy > half the
/// tolerance, by the same `conform`), the first from the 8th or 9th packet on (8 000
/// bytes is half the burst; whole ticks decide which), 16 admitted in all.
#[test]
fn ecn_marks_only_once_the_bucket_is_more_than_half_drained() {
    let mut harness = Harness::new(&[&[
        "ecn", "--proto", "udp", "--dport", "9600", "--rate", "8mbit", "--burst", "16000",
        "--action", "ecn",
    ]]);
    let id = harness.class_id("ecn");
    let config = harness.attachment.classes().unwrap().get(&id, 0).unwrap();
    let now = 5_000_000_000u64;
    for ect in [true, false] {
        let later = if ect { now } else { now + 1_000_000_000 };
        let mut tat = 0;
        let mut seen = Vec::new();
        for index in 1..=20u32 {
            let frame = frame_with_tos(9600, if ect { ECT0 } else { 0 });
            let (verdict, out, _) = harness.run_out(&frame, &skb_at(later));
            let expected = match conform(tat, later, frame.len() as u64, &config.cost) {
                Some(next) => {
                    tat = next;
                    let occupancy = next - ticks(later);
                    let marked = ect && occupancy > config.cost.tolerance_ticks / 2;
                    (PASS, if marked { CE } else { frame[V4_TOS] })
                }
                None => (SHOT, frame[V4_TOS]),
            };
            let got = (verdict, out[V4_TOS] & 3);
            assert_eq!(
                got,
                (expected.0, expected.1 & 3),
                "packet {index}, ECT {ect}"
            );
            seen.push(match got {
                (SHOT, _) => 'x',
                (_, CE) => 'C',
                _ => '.',
            });
        }
        let seen: String = seen.into_iter().collect();
        println!("ecn class, 1000-byte packets at one instant, ECT {ect}: {seen}");
        assert_eq!(seen.chars().filter(|c| *c != 'x').count(), 16, "{seen}");
        if ect {
            let first = seen.find('C').expect("some packet was marked") + 1;
            assert!(
                (8..=9).contains(&first),
                "first CE at packet {first}: {seen}"
            );
        } else {
            assert!(
                !seen.contains('C'),
                "a packet that is not ECN-capable got CE"
            );
        }
    }
}

/// `fwmark=0x10/0xff` sets the low byte of a mark another component already set and keeps
/// the rest; `fwmark=0x20` (no mask) replaces the whole mark. Packets within the rate keep
/// the mark they came with.
#[test]
fn fwmark_keeps_the_bits_outside_its_mask() {
    let mut harness = Harness::new(&[
        &[
            "masked",
            "--proto",
            "udp",
            "--dport",
            "9601",
            "--rate",
            "8mbit",
            "--burst",
            "1600",
            "--action",
            "fwmark=0x10/0xff",
        ],
        &[
            "whole",
            "--proto",
            "udp",
            "--dport",
            "9602",
            "--rate",
            "8mbit",
            "--burst",
            "1600",
            "--action",
            "fwmark=0x20",
        ],
    ]);
    let preset: u32 = 0xab05;
    let now = 5_000_000_000u64;
    for (dport, over_rate) in [(9601u16, 0xab10u32), (9602, 0x20)] {
        let marks: Vec<(u32, u32)> = (0..3)
            .map(|_| {
                let mut ctx = skb_at(now);
                ctx[SKB_MARK..SKB_MARK + 4].copy_from_slice(&preset.to_ne_bytes());
                let (verdict, _, out) = harness.run_out(&frame_with_tos(dport, 0), &ctx);
                let mark = u32::from_ne_bytes(out[SKB_MARK..SKB_MARK + 4].try_into().unwrap());
                (verdict, mark)
            })
            .collect();
        println!("port {dport}: pre-set {preset:#x}, (verdict, mark) {marks:x?}");
        // The first 1000-byte packet fits the 1600-byte burst; the next two are over it.
        assert_eq!(
            marks,
            [(PASS, preset), (PASS, over_rate), (PASS, over_rate)],
            "port {dport}"
        );
    }
}

/// What a meter does to a packet of one colour, as the model expects it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Pass,
    Drop,
    /// CE on an ECN-capable packet (which passes), drop otherwise.
    Ecn,
    /// Passes with this DSCP (the ECN bits kept).
    Dscp(u8),
}

/// A meter class (`--rate 8mbit --burst 6000` and `extra`) replayed against its RFC
/// colours ([`meter_against_rfc`]'s traffic), half the packets ECT(0): each packet's
/// verdict and TOS byte must be what `yellow` and `red` say of its colour.
fn meter_actions(extra: &[&str], yellow: Outcome, red: Outcome) -> [u32; 3] {
    let committed = ByteCost::new(8_000_000, 6_000);
    let class = [
        &[
            "meter", "--proto", "udp", "--dport", "9400", "--rate", "8mbit", "--burst", "6000",
        ][..],
        extra,
    ]
    .concat();
    run_on_cpu(0);
    let mut harness = Harness::new(&[&class]);
    let id = harness.class_id("meter");
    let peak = extra
        .contains(&"--peak-rate")
        .then(|| ByteCost::new(16_000_000, 12_000));
    let mut trtcm = peak
        .as_ref()
        .map(|peak| RfcTrTcm::full(peak, &committed, 0));
    let total = ByteCost::new(8_000_000, 6_000 + 20_000);
    let mut srtcm = RfcSrTcm::full(&committed, &total, 0);
    let mut dice = Lcg(29);
    let mut now = 1_000_000_000u64;
    let mut seen = [0u32; 3];
    for index in 0..2000u64 {
        now += meter_gap(&mut dice, index);
        let ect = index % 2 == 0;
        let mut frame = ipv4(V4::default(), udp(9400, dice.next(1437) as usize + 22));
        frame[V4_TOS] = if ect { ECT0 } else { 0 };
        let bytes = frame.len() as u64;
        let colour = match (&mut trtcm, &peak) {
            (Some(rfc), Some(peak)) => {
                rfc.packet(now, peak.ticks_for(bytes), committed.ticks_for(bytes))
            }
            _ => srtcm.packet(now, committed.ticks_for(bytes)),
        };
        let outcome = match colour {
            Colour::Green => Outcome::Pass,
            Colour::Yellow => yellow,
            Colour::Red => red,
        };
        let expected = match outcome {
            Outcome::Pass => (PASS, frame[V4_TOS]),
            Outcome::Drop => (SHOT, frame[V4_TOS]),
            Outcome::Ecn if ect => (PASS, CE),
            Outcome::Ecn => (SHOT, frame[V4_TOS]),
            Outcome::Dscp(dscp) => (PASS, dscp << 2 | frame[V4_TOS] & 3),
        };
        let (verdict, out, _) = harness.run_out(&frame, &skb_at(now));
        let got = (
            verdict,
            if verdict == PASS {
                out[V4_TOS]
            } else {
                frame[V4_TOS]
            },
        );
        assert_eq!(
            got, expected,
            "packet {index} ({bytes} B, {colour:?}, ECT {ect})"
        );
        seen[colour as usize] += 1;
    }
    let stats = harness.attachment.class_stats(id).unwrap();
    assert!(seen.iter().all(|n| *n > 100), "colours seen: {seen:?}");
    assert_eq!(
        [stats.green_packets, stats.yellow_packets, stats.red_packets],
        seen.map(u64::from),
        "the class's colour counters"
    );
    seen
}

/// trTCM with `--exceed ecn --violate dscp=af11`: yellow ECN-capable packets get CE and
/// pass, other yellow ones are dropped; red ones pass remarked AF11 (a non-default red).
#[test]
fn a_trtcm_marks_yellow_ce_and_remarks_red() {
    let seen = meter_actions(
        &[
            "--peak-rate",
            "16mbit",
            "--peak-burst",
            "12000",
            "--exceed",
            "ecn",
            "--violate",
            "dscp=af11",
        ],
        Outcome::Ecn,
        Outcome::Dscp(10),
    );
    println!("trTCM, exceed ecn, violate dscp=af11: green/yellow/red {seen:?}");
}

/// srTCM with `--exceed dscp=af12`: yellow packets pass remarked AF12, red ones are dropped
/// (the default).
#[test]
fn an_srtcm_remarks_yellow_and_drops_red() {
    let seen = meter_actions(
        &["--excess-burst", "20000", "--exceed", "dscp=af12"],
        Outcome::Dscp(12),
        Outcome::Drop,
    );
    println!("srTCM, exceed dscp=af12: green/yellow/red {seen:?}");
}

/// A plain IPv6/UDP frame from `src` to `dst`, 1000 bytes on the wire.
fn ipv6_between(src: [u8; 16], dst: [u8; 16], dport: u16) -> Vec<u8> {
    let mut frame = ipv6(dst, &[], udp(dport, 1000 - 62), 0);
    frame[14 + 8..14 + 24].copy_from_slice(&src);
    frame
}

/// Per-key buckets over IPv6 (`--per src`, `dst` and `flow`): two addresses that differ
/// only in their last word (as the hosts of one /64 do) get a bucket each. Each class's
/// burst holds two 1000-byte packets: the third from one address at the same instant is
/// over the rate, while the other address still has its own full bucket.
#[test]
fn ipv6_keys_tell_addresses_apart_by_every_word() {
    let class = |name: &'static str, per: &'static str, dport: &'static str| -> Vec<&'static str> {
        vec![
            name, "--proto", "udp", "--dport", dport, "--per", per, "--rate", "8mbit", "--burst",
            "2000",
        ]
    };
    let mut harness = Harness::new(&[
        &class("src", "src", "9610"),
        &class("dst", "dst", "9611"),
        &class("flow", "flow", "9612"),
    ]);
    let (a, b) = (v6(2, 1), v6(3, 1));
    let other = v6(2, 2);
    let now = 5_000_000_000u64;
    for (name, dport, frames) in [
        (
            "src",
            9610u16,
            [ipv6_between(a, other, 9610), ipv6_between(b, other, 9610)],
        ),
        (
            "dst",
            9611,
            [ipv6_between(other, a, 9611), ipv6_between(other, b, 9611)],
        ),
        (
            "flow",
            9612,
            [ipv6_between(a, other, 9612), ipv6_between(b, other, 9612)],
        ),
    ] {
        let mut verdicts = Vec::new();
        for frame in &frames {
            for _ in 0..3 {
                let (verdict, counted) = harness.run(frame, now, 1);
                assert_eq!(counted.as_deref(), Some(name), "port {dport}");
                verdicts.push(verdict);
            }
        }
        println!("--per {name} over IPv6, 3 packets from each of two addresses: {verdicts:?}");
        assert_eq!(
            verdicts,
            [PASS, PASS, SHOT, PASS, PASS, SHOT],
            "--per {name}: each address its own bucket"
        );
    }
    for name in ["src", "dst", "flow"] {
        let id = harness.class_id(name);
        assert_eq!(
            harness.attachment.new_keys(id).unwrap(),
            2,
            "--per {name}: two keys"
        );
    }
}

/// A 1000-byte IPv4/UDP frame from the client's port 40000 to `dst`:`dport`.
fn ipv4_to(dst: [u8; 4], dport: u16) -> Vec<u8> {
    ipv4(
        V4 {
            dst,
            ..V4::default()
        },
        udp(dport, 1000 - 42),
    )
}

/// `--per flow` keys flows that differ only in their destination port, or only in their
/// destination address (one source port throughout): each gets its own bucket, whose
/// burst holds two 1000-byte packets at one instant.
#[test]
fn per_flow_keys_tell_destination_ports_and_addresses_apart() {
    let mut harness = Harness::new(&[
        &[
            "ports",
            "--proto",
            "udp",
            "--dport",
            "9620-9621",
            "--per",
            "flow",
            "--rate",
            "8mbit",
            "--burst",
            "2000",
        ],
        &[
            "hosts", "--proto", "udp", "--dport", "9622", "--per", "flow", "--rate", "8mbit",
            "--burst", "2000",
        ],
    ]);
    let now = 5_000_000_000u64;
    for (name, frames) in [
        (
            "ports",
            [ipv4_to(V4_SERVER, 9620), ipv4_to(V4_SERVER, 9621)],
        ),
        (
            "hosts",
            [ipv4_to(V4_SERVER, 9622), ipv4_to(V4_ELSEWHERE, 9622)],
        ),
    ] {
        let mut verdicts = Vec::new();
        for frame in &frames {
            for _ in 0..3 {
                let (verdict, counted) = harness.run(frame, now, 1);
                assert_eq!(counted.as_deref(), Some(name));
                verdicts.push(verdict);
            }
        }
        assert_eq!(
            verdicts,
            [PASS, PASS, SHOT, PASS, PASS, SHOT],
            "{name}: each flow its own bucket"
        );
        let id = harness.class_id(name);
        assert_eq!(
            harness.attachment.new_keys(id).unwrap(),
            2,
            "{name}: two keys"
        );
    }
}

/// A meter kept per flow (`--per flow` with `--peak-rate`, or with `--excess-burst`):
/// each of two flows at one instant runs through its own green, yellow and red (committed
/// burst two packets, peak or excess room for one more), where one meter for the class would turn
/// the second flow red at once.
#[test]
fn per_flow_meters_colour_each_flow_on_its_own() {
    let meter = |name: &'static str, dport: &'static str, second: [&'static str; 2]| {
        [
            vec![
                name,
                "--proto",
                "udp",
                "--dport",
                dport,
                "--per",
                "flow",
                "--rate",
                "8mbit",
                "--burst",
                "2000",
                "--exceed",
                "dscp=af12",
            ],
            second.to_vec(),
        ]
        .concat()
    };
    let trtcm = [
        meter("trtcm", "9630", ["--peak-rate", "16mbit"]),
        vec!["--peak-burst", "3000"],
    ]
    .concat();
    let srtcm = meter("srtcm", "9631", ["--excess-burst", "1514"]);
    let mut harness = Harness::new(&[&trtcm, &srtcm]);
    let now = 5_000_000_000u64;
    for (name, port) in [("trtcm", 9630u16), ("srtcm", 9631)] {
        let mut verdicts = Vec::new();
        for frame in [ipv4_to(V4_SERVER, port), ipv4_to(V4_ELSEWHERE, port)] {
            for _ in 0..4 {
                verdicts.push(harness.run(&frame, now, 1).0);
            }
        }
        // Green, green, yellow (remarked, passed), red (dropped), for each flow.
        assert_eq!(
            verdicts,
            [PASS, PASS, PASS, SHOT, PASS, PASS, PASS, SHOT],
            "{name}: a meter per flow"
        );
        let id = harness.class_id(name);
        let stats = harness.attachment.class_stats(id).unwrap();
        assert_eq!(
            [stats.green_packets, stats.yellow_packets, stats.red_packets],
            [4, 2, 2],
            "{name}: the colour counters"
        );
        assert_eq!(
            harness.attachment.new_keys(id).unwrap(),
            2,
            "{name}: two keys"
        );
    }
}
