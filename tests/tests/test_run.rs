//! BPF_PROG_TEST_RUN on the real, loaded program: crafted packets get the expected class
//! and verdict, and a 1000-packet sequence admits exactly what the host-side bucket
//! model (the same `conform` function) predicts.
//!
//! The classes live on a veth that is left down, so no real packet touches them; the
//! test drives `shaper_clocked` (same code, clock from `skb->tstamp`) against the very
//! maps the attached program uses.

use aya::programs::{TestRun as _, TestRunOptions};
use shaper::state::{self, Attachment, Direction, Location};
use shaper_common::{
    bucket::{credit_chunk, departure, shared_burst, ticks, use_credit, CreditUse},
    codel::{self, judge, sojourn_ns, CodelConfig, CodelState},
    conform,
    meter::{
        deficit,
        rfc::{RfcSrTcm, RfcTrTcm},
        Colour,
    },
    program_names, ByteCost, ClassConfig, ClassStats, CostKind,
};
use shaper_tests::Lab;
use std::collections::HashMap;

#[path = "test_run/differential.rs"]
mod differential;
#[path = "test_run/global.rs"]
mod global;
#[path = "test_run/marks.rs"]
mod marks;
#[path = "test_run/tree.rs"]
mod tree;

const DEV: &str = "trun0";
const PASS: u32 = u32::MAX; // TC_ACT_UNSPEC (-1): pass to the next hook/filter
const SHOT: u32 = 2;

// __sk_buff (include/uapi/linux/bpf.h) is 192 bytes; offsets of the fields set here.
const SKB_SIZE: usize = 192;
const SKB_PRIORITY: usize = 32;
const SKB_TSTAMP: usize = 152;
const SKB_WIRE_LEN: usize = 160;
const SKB_GSO_SEGS: usize = 164;
const SKB_GSO_SIZE: usize = 176;

// ---- packet builders (checksums are irrelevant to the classifier) ----

const V4_SERVER: [u8; 4] = [198, 18, 2, 2];
const V4_CLIENT: [u8; 4] = [198, 18, 1, 2];
const V4_ELSEWHERE: [u8; 4] = [198, 18, 9, 9];

fn v6(last: u8, net: u8) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[3] = net;
    a[15] = last;
    a
}

fn ethernet(tags: &[u16], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    for tpid in tags {
        frame.extend_from_slice(&tpid.to_be_bytes());
        frame.extend_from_slice(&[0x00, 0x64]); // VLAN 100
    }
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

fn l4_ports(sport: u16, dport: u16, header_len: usize, payload: usize) -> Vec<u8> {
    let mut l4 = vec![0u8; header_len + payload];
    l4[..2].copy_from_slice(&sport.to_be_bytes());
    l4[2..4].copy_from_slice(&dport.to_be_bytes());
    if header_len == 20 {
        l4[12] = 5 << 4; // TCP data offset
    }
    l4
}

fn udp(dport: u16, payload: usize) -> (u8, Vec<u8>) {
    (17, l4_ports(40000, dport, 8, payload))
}

fn tcp(dport: u16, payload: usize) -> (u8, Vec<u8>) {
    (6, l4_ports(40000, dport, 20, payload))
}

struct V4 {
    dst: [u8; 4],
    option_words: usize,
    fragment_offset: u16,
    more_fragments: bool,
}

impl Default for V4 {
    fn default() -> Self {
        Self {
            dst: V4_SERVER,
            option_words: 0,
            fragment_offset: 0,
            more_fragments: false,
        }
    }
}

fn ipv4(options: V4, (proto, l4): (u8, Vec<u8>)) -> Vec<u8> {
    let ihl = 5 + options.option_words;
    let mut header = vec![0u8; ihl * 4];
    header[0] = 0x40 | ihl as u8;
    let total = (ihl * 4 + l4.len()) as u16;
    header[2..4].copy_from_slice(&total.to_be_bytes());
    let flags =
        (options.fragment_offset & 0x1fff) | if options.more_fragments { 0x2000 } else { 0 };
    header[6..8].copy_from_slice(&flags.to_be_bytes());
    header[8] = 64;
    header[9] = proto;
    header[12..16].copy_from_slice(&V4_CLIENT);
    header[16..20].copy_from_slice(&options.dst);
    for byte in header.iter_mut().skip(20) {
        *byte = 1; // NOP options
    }
    header.extend_from_slice(&l4);
    ethernet(&[], 0x0800, &header)
}

/// IPv6 with extension headers given as (type, total length in bytes, multiple of 8).
fn ipv6(
    dst: [u8; 16],
    extensions: &[(u8, usize)],
    (proto, l4): (u8, Vec<u8>),
    fragment_offset: u16,
) -> Vec<u8> {
    let mut body = Vec::new();
    for (index, (kind, length)) in extensions.iter().enumerate() {
        let next = extensions.get(index + 1).map_or(proto, |(k, _)| *k);
        let mut ext = vec![0u8; *length];
        ext[0] = next;
        if *kind == 44 {
            ext[2..4].copy_from_slice(&(fragment_offset << 3).to_be_bytes());
        } else {
            ext[1] = (*length / 8 - 1) as u8;
        }
        body.extend_from_slice(&ext);
    }
    body.extend_from_slice(&l4);
    let mut header = vec![0u8; 40];
    header[0] = 0x60;
    header[4..6].copy_from_slice(&(body.len() as u16).to_be_bytes());
    header[6] = extensions.first().map_or(proto, |(k, _)| *k);
    header[7] = 64;
    header[8..24].copy_from_slice(&v6(2, 1));
    header[24..40].copy_from_slice(&dst);
    header.extend_from_slice(&body);
    ethernet(&[], 0x86dd, &header)
}

// ---- the harness ----

/// A `__sk_buff` context whose clock (`tstamp`, read by `shaper_clocked`) is `now_ns`.
fn skb_at(now_ns: u64) -> Vec<u8> {
    let mut ctx = vec![0u8; SKB_SIZE];
    ctx[SKB_TSTAMP..SKB_TSTAMP + 8].copy_from_slice(&now_ns.to_ne_bytes());
    ctx
}

struct Harness {
    lab: Lab,
    attachment: Attachment,
    ebpf: aya::Ebpf,
    names: HashMap<u32, String>,
}

impl Harness {
    /// A lab whose router has shaper attached to a veth that stays down, with `classes`
    /// on it: each its name, then its `class add` options.
    fn new(classes: &[&[&str]]) -> Self {
        let lab = Lab::new().unwrap();
        lab.router
            .run(
                "ip",
                &["link", "add", DEV, "type", "veth", "peer", "name", "trun1"],
            )
            .unwrap();
        lab.router.attach(DEV, &[]).unwrap();
        for class in classes {
            let (name, options) = class.split_first().expect("a class has a name");
            lab.router.class_add(name, DEV, options).unwrap();
        }
        let location = Location {
            netns: Some(lab.router.name.clone()),
            dev: DEV.into(),
            direction: Direction::Egress,
        };
        let attachment = Attachment::open(&location).unwrap();
        let names = attachment
            .class_list()
            .unwrap()
            .into_iter()
            .map(|(id, meta)| (id, state::decode_name(&meta.name)))
            .collect();
        // The pinned maps are reused: the test program shares state with the attached one.
        let mut ebpf = state::load_object(attachment.dir(), 1024).unwrap();
        state::load_program(&mut ebpf, program_names::SHAPER_CLOCKED).unwrap();
        Self {
            lab,
            attachment,
            ebpf,
            names,
        }
    }

    fn counters(&self) -> HashMap<u32, ClassStats> {
        self.names
            .keys()
            .map(|id| (*id, self.attachment.class_stats(*id).unwrap()))
            .collect()
    }

    /// Runs one packet at `now_ns`; returns the verdict and the class that counted it.
    /// `gso_segs` > 1 makes it a GSO packet of 1000-byte segments whose wire length the
    /// kernel has computed (as on egress) for 54 bytes of headers per segment.
    fn run(&mut self, frame: &[u8], now_ns: u64, gso_segs: u32) -> (u32, Option<String>) {
        if gso_segs > 1 {
            let wire_len = frame.len() as u32 + (gso_segs - 1) * 54;
            self.run_gso(frame, now_ns, gso_segs, 1000, wire_len)
        } else {
            self.run_gso(frame, now_ns, 0, 0, 0)
        }
    }

    /// [`Harness::run`] with the skb's GSO fields and the kernel's wire length as given
    /// (all 0: not GSO).
    fn run_gso(
        &mut self,
        frame: &[u8],
        now_ns: u64,
        gso_segs: u32,
        gso_size: u32,
        wire_len: u32,
    ) -> (u32, Option<String>) {
        let mut ctx = skb_at(now_ns);
        if gso_size != 0 {
            // The kernel takes a GSO context only with a wire length and a segment size.
            ctx[SKB_WIRE_LEN..SKB_WIRE_LEN + 4].copy_from_slice(&wire_len.to_ne_bytes());
            ctx[SKB_GSO_SEGS..SKB_GSO_SEGS + 4].copy_from_slice(&gso_segs.to_ne_bytes());
            ctx[SKB_GSO_SIZE..SKB_GSO_SIZE + 4].copy_from_slice(&gso_size.to_ne_bytes());
        }
        self.test_run(frame, &ctx).unwrap()
    }

    /// One frame that is not GSO at `now_ns`, or `None` when BPF_PROG_TEST_RUN refuses it
    /// (it does for an IP header cut short).
    fn try_run(&mut self, frame: &[u8], now_ns: u64) -> Option<(u32, Option<String>)> {
        self.test_run(frame, &skb_at(now_ns)).ok()
    }

    fn test_run(
        &mut self,
        frame: &[u8],
        ctx: &[u8],
    ) -> Result<(u32, Option<String>), aya::programs::ProgramError> {
        let (verdict, counted) = self.test_run_levels(frame, ctx)?;
        assert!(
            counted.len() <= 1,
            "one packet counted by several classes: {counted:?}"
        );
        Ok((verdict, counted.into_iter().next().map(|(name, _)| name)))
    }

    /// Puts shape class `id` on the EDT path (no HTB leaf): its queue's sojourn counts
    /// from the first byte (HTB's 128 KiB burst would hide a short queue).
    fn on_the_edt_path(&self, id: u32) {
        let mut classes = self.attachment.classes().unwrap();
        let mut config = classes.get(&id, 0).unwrap();
        (config.action_arg, config.sparse_priority) = (0, 0);
        classes.set(id, config, 0).unwrap();
    }

    /// Marks class `id`'s bulk leaf as a queue per flow (`fair::FAIR_FLOW_QUEUES`, what
    /// shaper 0.3 set where it made an fq_codel leaf; such a class keeps it after an
    /// upgrade until it is changed).
    fn with_flow_queues(&self, id: u32) {
        let mut classes = self.attachment.classes().unwrap();
        let mut config = classes.get(&id, 0).unwrap();
        config.codel.fair |= shaper_common::fair::FAIR_FLOW_QUEUES;
        classes.set(id, config, 0).unwrap();
    }

    /// The program the harness drives: `shaper_clocked`, "now" from `skb->tstamp`.
    fn clocked(&self) -> &aya::programs::SchedClassifier {
        self.ebpf
            .program(program_names::SHAPER_CLOCKED)
            .unwrap()
            .try_into()
            .unwrap()
    }

    /// Runs one frame; the verdict and every class that counted it, with whether it
    /// counted a pass (classes in a tree count a packet at every level it passed).
    fn test_run_levels(
        &mut self,
        frame: &[u8],
        ctx: &[u8],
    ) -> Result<(u32, Vec<(String, bool)>), aya::programs::ProgramError> {
        let before = self.counters();
        let program = self.clocked();
        let result = program.test_run(TestRunOptions {
            data_in: Some(frame),
            ctx_in: Some(ctx),
            ..TestRunOptions::default()
        })?;
        let after = self.counters();
        let mut counted: Vec<(String, bool)> = after
            .iter()
            .filter(|(id, stats)| {
                let b = before[*id];
                stats.passed_packets + stats.dropped_packets > b.passed_packets + b.dropped_packets
            })
            .map(|(id, stats)| {
                let passed = stats.passed_packets > before[id].passed_packets;
                (self.names[id].clone(), passed)
            })
            .collect();
        counted.sort();
        Ok((result.return_value, counted))
    }

    fn reload_names(&mut self) {
        self.names = self
            .attachment
            .class_list()
            .unwrap()
            .into_iter()
            .map(|(id, meta)| (id, state::decode_name(&meta.name)))
            .collect();
    }

    fn class_id(&self, name: &str) -> u32 {
        *self.names.iter().find(|(_, n)| *n == name).unwrap().0
    }
}

/// Every variant of the object passes this kernel's verifier (`cargo xtask vm-test` runs
/// this in Debian's kernels): `shaper` loaded by the attach, `shaper_clocked` by the
/// harness, the other two here; a refusal names the program and carries the verifier's
/// last lines.
#[test]
fn every_program_variant_loads() {
    let mut harness = Harness::new(&[]);
    let mut refused = Vec::new();
    for name in [program_names::SHAPER_L3, program_names::SHAPER_UNCACHED] {
        if let Err(error) = state::load_program(&mut harness.ebpf, name) {
            refused.push(format!("{error:#}"));
        }
    }
    assert!(refused.is_empty(), "{}", refused.join("\n"));
    for name in [
        program_names::SHAPER_CLOCKED,
        program_names::SHAPER_L3,
        program_names::SHAPER_UNCACHED,
    ] {
        let program: &aya::programs::SchedClassifier =
            harness.ebpf.program(name).unwrap().try_into().unwrap();
        let info = program.info();
        assert!(info.is_ok(), "{name} has no kernel program after its load");
        // How close the variant runs to the verifier's 1M-instruction budget, for anyone
        // adding to the packet path (`--nocapture` shows it).
        if let Some(count) = info.ok().and_then(|info| info.verified_instruction_count()) {
            eprintln!("{name}: {count} instructions verified");
        }
    }
}

#[test]
fn crafted_packets_get_the_expected_class_and_verdict() {
    let mut harness = Harness::new(&[
        &[
            "dns", "--proto", "udp", "--dport", "53", "--prio", "10", "--rate", "400gbit",
        ],
        &[
            "web", "--proto", "tcp", "--dport", "80", "--prio", "20", "--rate", "8kbit", "--burst",
            "1514",
        ],
        &[
            "icmp", "--proto", "icmp", "--prio", "30", "--rate", "400gbit",
        ],
        &[
            "net4",
            "--dst",
            "198.18.2.0/24",
            "--prio",
            "50",
            "--rate",
            "400gbit",
        ],
        &[
            "net6",
            "--dst",
            "fd00:2::/64",
            "--prio",
            "50",
            "--rate",
            "400gbit",
        ],
    ]);
    let server6 = v6(2, 2);
    let arp = ethernet(&[], 0x0806, &[0u8; 28]);
    let lldp = ethernet(&[], 0x88cc, &[0u8; 40]);
    let mut truncated_udp = ipv4(V4::default(), udp(53, 0));
    truncated_udp.truncate(14 + 20 + 2);
    let mut truncated_tcp = ipv4(V4::default(), tcp(80, 0));
    truncated_tcp.truncate(14 + 20 + 3);
    // (An IPv4 header cut short cannot be tested: BPF_PROG_TEST_RUN itself refuses it.)
    let mut truncated_ext = ipv6(server6, &[(0, 16)], udp(53, 8), 0);
    truncated_ext.truncate(14 + 40 + 1);
    let mut bad_ihl = ipv4(V4::default(), udp(53, 0));
    bad_ihl[14] = 0x44;
    let echo = (1u8, vec![8u8, 0, 0, 0, 0, 1, 0, 1]);
    let echo6 = (58u8, vec![128u8, 0, 0, 0, 0, 1, 0, 1]);
    let cases: Vec<(&str, Vec<u8>, u32, Option<&str>)> = vec![
        (
            "802.1Q VLAN, IPv4 UDP :53",
            ethernet(&[0x8100], 0x0800, &ipv4(V4::default(), udp(53, 32))[14..]),
            PASS,
            Some("dns"),
        ),
        (
            "QinQ 802.1ad+802.1Q, IPv4 UDP :53",
            ethernet(
                &[0x88a8, 0x8100],
                0x0800,
                &ipv4(V4::default(), udp(53, 32))[14..],
            ),
            PASS,
            Some("dns"),
        ),
        (
            "IPv4 with 8 bytes of options, UDP :53",
            ipv4(
                V4 {
                    option_words: 2,
                    ..V4::default()
                },
                udp(53, 32),
            ),
            PASS,
            Some("dns"),
        ),
        (
            "IPv6 hop-by-hop + destination options, UDP :53",
            ipv6(server6, &[(0, 8), (60, 16)], udp(53, 32), 0),
            PASS,
            Some("dns"),
        ),
        (
            "IPv6 routing header, TCP :80, 1600 bytes",
            ipv6(server6, &[(43, 24)], tcp(80, 1500), 0),
            SHOT,
            Some("web"),
        ),
        (
            "IPv4 TCP :80, small",
            ipv4(V4::default(), tcp(80, 10)),
            PASS,
            Some("web"),
        ),
        (
            "IPv4 TCP :80, 1600 bytes",
            ipv4(V4::default(), tcp(80, 1546)),
            SHOT,
            Some("web"),
        ),
        (
            "IPv4 first fragment, UDP :53",
            ipv4(
                V4 {
                    more_fragments: true,
                    ..V4::default()
                },
                udp(53, 64),
            ),
            PASS,
            Some("dns"),
        ),
        (
            "IPv4 non-first fragment, UDP",
            ipv4(
                V4 {
                    fragment_offset: 185,
                    ..V4::default()
                },
                udp(9999, 64),
            ),
            PASS,
            Some("dns"),
        ),
        (
            "IPv4 non-first fragment, TCP, 1600 bytes",
            ipv4(
                V4 {
                    fragment_offset: 185,
                    ..V4::default()
                },
                tcp(9999, 1546),
            ),
            SHOT,
            Some("web"),
        ),
        (
            "IPv6 non-first fragment, UDP",
            ipv6(server6, &[(44, 8)], udp(9999, 64), 100),
            PASS,
            Some("dns"),
        ),
        (
            "IPv4 UDP header cut after 2 bytes",
            truncated_udp,
            PASS,
            Some("dns"),
        ),
        (
            "IPv4 TCP header cut after 3 bytes",
            truncated_tcp,
            PASS,
            Some("web"),
        ),
        // Protocol unknown: caught by the best class whose address rule matches, whatever
        // its protocol and port rule ("dns" has no address rule and the best priority).
        (
            "IPv6 hop-by-hop header cut after 1 byte",
            truncated_ext,
            PASS,
            Some("dns"),
        ),
        ("IPv4 with IHL 4 (malformed)", bad_ihl, PASS, Some("dns")),
        (
            "IPv6 with 9 extension headers, UDP :53",
            ipv6(server6, &[(60, 8); 9], udp(53, 32), 0),
            PASS,
            Some("dns"),
        ),
        (
            "ICMP echo",
            ipv4(V4::default(), echo.clone()),
            PASS,
            Some("icmp"),
        ),
        (
            "ICMPv6 echo",
            ipv6(server6, &[], echo6, 0),
            PASS,
            Some("icmp"),
        ),
        (
            "IPv4 UDP :54 to 198.18.2.2",
            ipv4(V4::default(), udp(54, 32)),
            PASS,
            Some("net4"),
        ),
        (
            "IPv4 UDP :54 elsewhere",
            ipv4(
                V4 {
                    dst: V4_ELSEWHERE,
                    ..V4::default()
                },
                udp(54, 32),
            ),
            PASS,
            None,
        ),
        (
            "IPv6 UDP :54 elsewhere",
            ipv6(v6(2, 9), &[], udp(54, 32), 0),
            PASS,
            None,
        ),
        ("ARP", arp, PASS, None),
        ("LLDP", lldp, PASS, None),
    ];
    let mut failures = Vec::new();
    for (index, (what, frame, verdict, class)) in cases.iter().enumerate() {
        // Ten seconds apart: the 8kbit bucket is full again before every packet.
        let now = (index as u64 + 1) * 10_000_000_000;
        let (got_verdict, got_class) = harness.run(frame, now, 1);
        println!(
            "{what:48} verdict {:>2} class {:?}",
            got_verdict as i32, got_class
        );
        if got_verdict != *verdict || got_class.as_deref() != *class {
            failures.push(format!(
                "{what}: got ({}, {got_class:?}), expected ({}, {class:?})",
                got_verdict as i32, *verdict as i32
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Issue 11, item 3: frames no rule can look into (ARP, LLDP, a third VLAN tag, a 0x9100
/// outer tag, raw Ethernet) meet a class without rules, and no other class; with that
/// class's bucket small, a flood of them is policed (a container with CAP_NET_RAW cannot
/// flood past "cap this VM").
#[test]
fn frames_no_rule_can_read_still_meet_a_class_without_rules() {
    let mut harness = Harness::new(&[
        &[
            "dns", "--proto", "udp", "--dport", "53", "--prio", "10", "--rate", "400gbit",
        ],
        &[
            "net4",
            "--dst",
            "198.18.2.0/24",
            "--prio",
            "20",
            "--rate",
            "400gbit",
        ],
        &["everything", "--prio", "100", "--rate", "400gbit"],
    ]);
    let udp53 = ipv4(V4::default(), udp(53, 32));
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("ARP", ethernet(&[], 0x0806, &[0u8; 28]), "everything"),
        ("LLDP", ethernet(&[], 0x88cc, &[0u8; 40]), "everything"),
        (
            "raw Ethernet, ethertype 0x88b5",
            ethernet(&[], 0x88b5, &[7u8; 200]),
            "everything",
        ),
        (
            "three VLAN tags, IPv4 UDP :53",
            ethernet(&[0x88a8, 0x8100, 0x8100], 0x0800, &udp53[14..]),
            "everything",
        ),
        (
            "0x9100 outer tag, IPv4 UDP :53",
            ethernet(&[0x9100], 0x0800, &udp53[14..]),
            "everything",
        ),
        // Parsed IP still goes to its best class, not to the catch-all.
        (
            "two VLAN tags, IPv4 UDP :53",
            ethernet(&[0x88a8, 0x8100], 0x0800, &udp53[14..]),
            "dns",
        ),
        (
            "IPv4 TCP :80 to 198.18.2.2",
            ipv4(V4::default(), tcp(80, 32)),
            "net4",
        ),
    ];
    let mut failures = Vec::new();
    for (index, (what, frame, class)) in cases.iter().enumerate() {
        let (verdict, got) = harness.run(frame, (index as u64 + 1) * 1_000_000_000, 1);
        println!("{what:40} verdict {:>2} class {got:?}", verdict as i32);
        if verdict != PASS || got.as_deref() != Some(*class) {
            failures.push(format!(
                "{what}: got ({}, {got:?}), expected {class}",
                verdict as i32
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));

    // Without a class without rules, such frames still pass untouched.
    harness
        .lab
        .router
        .shaper(&["class", "del", "everything", "--dev", DEV])
        .unwrap();
    harness.reload_names();
    let arp = ethernet(&[], 0x0806, &[0u8; 28]);
    assert_eq!(harness.run(&arp, 20_000_000_000, 1), (PASS, None));

    // A 16 kbit/s class without rules against 200 raw frames at one instant: its burst
    // (3 028 bytes) lets 12 of the 242-byte frames through, the rest are dropped.
    harness
        .lab
        .router
        .class_add("capped", DEV, &["--rate", "16kbit", "--burst", "3028"])
        .unwrap();
    harness.reload_names();
    let raw = ethernet(&[], 0x88b5, &[7u8; 228]);
    let (mut passed, mut dropped) = (0, 0);
    for _ in 0..200 {
        match harness.run(&raw, 30_000_000_000, 1) {
            (PASS, Some(class)) if class == "capped" => passed += 1,
            (SHOT, Some(class)) if class == "capped" => dropped += 1,
            other => panic!("raw frame: {other:?}"),
        }
    }
    println!("200 raw frames through a 16 kbit/s class without rules: {passed} passed, {dropped} dropped");
    assert_eq!((passed, dropped), (12, 188));
}

#[test]
fn gso_packets_are_charged_their_bytes_on_the_wire() {
    let mut harness = Harness::new(&[&[
        "gso", "--proto", "tcp", "--dport", "9100", "--rate", "1gbit",
    ]]);
    // Test runs take at most about 3.5 KiB of packet data.
    let frame = ipv4(V4::default(), tcp(9100, 2000));
    let (verdict, class) = harness.run(&frame, 1_000_000_000, 4);
    assert_eq!((verdict, class.as_deref()), (PASS, Some("gso")));
    let stats = harness
        .attachment
        .class_stats(harness.class_id("gso"))
        .unwrap();
    // Three extra segments, each with its own Ethernet + IPv4 + TCP headers.
    assert_eq!(stats.passed_bytes, frame.len() as u64 + 3 * (14 + 20 + 20));
    let mut charged = stats.passed_bytes;
    let mut charge_of = |harness: &mut Harness, gso_segs, gso_size, wire_len| {
        let (verdict, class) = harness.run_gso(&frame, 2_000_000_000, gso_segs, gso_size, wire_len);
        assert_eq!((verdict, class.as_deref()), (PASS, Some("gso")));
        let total = harness
            .attachment
            .class_stats(harness.class_id("gso"))
            .unwrap()
            .passed_bytes;
        let this = total - charged;
        charged = total;
        this
    };
    // Issue 11, item 1. A VM's TSO frame (SKB_GSO_DODGY): gso_segs 0 until segmentation,
    // 100-byte segments, and a wire length nobody has sized yet (ingress: skb->len).
    // 2000 bytes of payload are 20 segments: 19 extra sets of 54 bytes of headers.
    let len = frame.len() as u32;
    let dodgy = charge_of(&mut harness, 0, 100, len);
    println!("gso_segs 0, gso_size 100: charged {dodgy} bytes for a {len}-byte skb");
    assert_eq!(dodgy, len as u64 + 19 * 54);
    // A tunnelled GSO packet whose wire length the kernel computed with the inner headers
    // too (4 segments of 104 bytes of headers): the larger figure is charged.
    let tunnelled = len + 3 * 104;
    assert_eq!(
        charge_of(&mut harness, 4, 1000, tunnelled),
        tunnelled as u64
    );
}

/// Issue 11, item 1: a tunnelled GSO packet leaves as segments that each carry the outer
/// headers, the tunnel's and the inner packet's, so each extra segment is charged all of
/// them, also where the kernel's wire length counts only the skb (ingress, or a kernel
/// that does not count inner headers). VXLAN and Geneve (UDP), GRE with a key, IPIP.
#[test]
fn tunnelled_gso_is_charged_the_inner_headers_of_every_segment() {
    let mut harness = Harness::new(&[
        &[
            "vxlan", "--proto", "udp", "--dport", "4789", "--prio", "10", "--rate", "1gbit",
        ],
        &[
            "geneve", "--proto", "udp", "--dport", "6081", "--prio", "10", "--rate", "1gbit",
        ],
        &[
            "server",
            "--dst",
            "198.18.2.2/32",
            "--prio",
            "20",
            "--rate",
            "1gbit",
        ],
    ]);
    // The inner packets: 2000 bytes of TCP payload to 9100, and 2000 of UDP over IPv6.
    let inner_tcp = ipv4(V4::default(), tcp(9100, 2000));
    let inner_udp6 = ipv6(v6(2, 2), &[], udp(9100, 2000), 0);
    let udp_to = |dport: u16, body: &[u8]| {
        let mut datagram = l4_ports(40000, dport, 8, 0);
        datagram.extend_from_slice(body);
        ipv4(V4::default(), (17, datagram))
    };
    let vxlan = udp_to(
        4789,
        &[&[0x08, 0, 0, 0, 0, 0, 0x64, 0][..], &inner_tcp].concat(),
    );
    let geneve = udp_to(
        6081,
        &[&[0, 0, 0x65, 0x58, 0, 0, 0x64, 0][..], &inner_udp6].concat(),
    );
    // GRE with a key (4 + 4 bytes), carrying IPv4.
    let gre_body = [&[0x20, 0, 0x08, 0x00, 0, 0, 0, 7][..], &inner_tcp[14..]].concat();
    let gre = ipv4(V4::default(), (47, gre_body));
    let ipip = ipv4(V4::default(), (4, inner_tcp[14..].to_vec()));
    let cases: [(&str, &Vec<u8>, &str, u64); 4] = [
        // outer Ethernet + IPv4 + UDP + VXLAN + inner Ethernet + IPv4 + TCP
        ("VXLAN", &vxlan, "vxlan", 14 + 20 + 8 + 8 + 14 + 20 + 20),
        // outer Ethernet + IPv4 + UDP + Geneve + inner Ethernet + IPv6 + UDP
        ("Geneve", &geneve, "geneve", 14 + 20 + 8 + 8 + 14 + 40 + 8),
        ("GRE", &gre, "server", 14 + 20 + 8 + 20 + 20),
        ("IPIP", &ipip, "server", 14 + 20 + 20 + 20),
    ];
    let mut charged: HashMap<String, u64> = HashMap::new();
    for (gso_segs, gso_size) in [(4, 1000), (0, 400)] {
        for (what, frame, class, headers) in &cases {
            let len = frame.len() as u32;
            // Ingress: the kernel's wire length is the skb's.
            let (verdict, counted) = harness.run_gso(frame, 1_000_000_000, gso_segs, gso_size, len);
            assert_eq!(
                (verdict, counted.as_deref()),
                (PASS, Some(*class)),
                "{what}"
            );
            let total = harness
                .attachment
                .class_stats(harness.class_id(class))
                .unwrap()
                .passed_bytes;
            let before = charged.insert(class.to_string(), total).unwrap_or(0);
            let this = total - before;
            // 2000 bytes of payload: 4 segments (gso_segs), or 5 of 400 (gso_size alone,
            // SKB_GSO_DODGY).
            let extra = if gso_segs == 4 { 3 } else { 4 };
            println!(
                "{what}, gso_segs {gso_segs}, gso_size {gso_size}: charged {this} for a \
                 {len}-byte skb ({headers} bytes of headers per segment)"
            );
            assert_eq!(this, len as u64 + extra * headers, "{what}");
        }
    }
}

/// A deterministic pseudo-random sequence (no extra crate for a test's dice).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

/// The two classes of the model tests: `shared` (UDP to 9000, one bucket) and `perflow`
/// (UDP to 9001, a bucket per flow).
const TWO_CLASSES: [&[&str]; 2] = [
    &[
        "shared", "--proto", "udp", "--dport", "9000", "--rate", "1mbit", "--burst", "3000",
    ],
    &[
        "perflow", "--proto", "udp", "--dport", "9001", "--rate", "400kbit", "--burst", "4000",
        "--per", "flow",
    ],
];

/// Packet `index` of the model tests' traffic: every other one to `shared`, the others to
/// `perflow` from one of three source ports. The frame, its bucket's key and its class.
fn two_class_packet(dice: &mut Lcg, index: usize) -> (Vec<u8>, (u16, u16), &'static str) {
    let payload = dice.next(1400) as usize;
    let (dport, sport) = if index.is_multiple_of(2) {
        (9000, 1000)
    } else {
        (9001, 1000 + dice.next(3) as u16)
    };
    let mut datagram = udp(dport, payload);
    datagram.1[..2].copy_from_slice(&sport.to_be_bytes());
    let frame = ipv4(V4::default(), datagram);
    if dport == 9000 {
        (frame, (dport, 0), "shared")
    } else {
        (frame, (dport, sport), "perflow")
    }
}

#[test]
fn a_thousand_packets_admit_exactly_what_the_model_predicts() {
    let mut harness = Harness::new(&TWO_CLASSES);
    // Each class gets about 1.9 Mbit/s: 1.9× the shared rate, and each of the three flows
    // 1.6× its own rate, so both buckets refuse packets.
    let shared_cost = ByteCost::new(1_000_000, 3000);
    let flow_cost = ByteCost::new(400_000, 4000);
    let mut model_tat: HashMap<(u16, u16), u64> = HashMap::new();
    let mut index = 0;
    let (summary, _) = against_model(&mut harness, 1000, Lcg(7), 3_000_000, |dice, now, _cpu| {
        let (frame, key, class) = two_class_packet(dice, index);
        index += 1;
        let cost = if class == "shared" {
            &shared_cost
        } else {
            &flow_cost
        };
        let tat = model_tat.entry(key).or_insert(0);
        let expected = match conform(*tat, now, frame.len() as u64, cost) {
            Some(next) => {
                *tat = next;
                PASS
            }
            None => SHOT,
        };
        (frame, expected, class)
    });
    println!("1000 packets: {summary}");
}

/// Issue 11, item 4: halfway through 1000 packets both classes are changed (`class
/// change`: the shared one raised, the per-flow one cut in rate and burst). The host model
/// converts its bucket words as the program must (`ClassConfig::settle` as of the change,
/// `stamp`, a refused packet writing the converted word back), from the class configs the
/// kernel holds after the change: every verdict and class must match, before and after.
#[test]
fn bucket_words_are_converted_at_a_rate_change_as_the_model_predicts() {
    let mut harness = Harness::new(&TWO_CLASSES);
    let router = harness.lab.router.clone();
    let configs = |attachment: &Attachment| -> HashMap<&'static str, ClassConfig> {
        let all = attachment.classes().unwrap();
        ["shared", "perflow"]
            .into_iter()
            .map(|name| {
                let (id, _) = attachment.find_class(name).unwrap().unwrap();
                (name, all.get(&id, 0).unwrap())
            })
            .collect()
    };
    let mut config = configs(&harness.attachment);
    let reader = Attachment::open(&harness.attachment.location).unwrap();
    let mut model_word: HashMap<(u16, u16), u64> = HashMap::new();
    let mut index = 0;
    let (summary, _) = against_model(&mut harness, 1000, Lcg(11), 3_000_000, |dice, now, _cpu| {
        if index == 500 {
            for (name, options) in [
                ("shared", ["--rate", "2mbit", "--burst", "3000"]),
                ("perflow", ["--rate", "200kbit", "--burst", "2000"]),
            ] {
                router
                    .shaper(&[&["class", "change", name, "--dev", DEV][..], &options[..]].concat())
                    .unwrap();
            }
            config = configs(&reader);
            assert!(
                config.values().all(|c| c.version == 1),
                "a change is a new version"
            );
        }
        let (frame, key, class) = two_class_packet(dice, index);
        index += 1;
        let class_config = &config[class];
        let word = model_word.entry(key).or_insert(0);
        let tat = class_config.settle(*word, now, CostKind::Main);
        let expected = match conform(tat, now, frame.len() as u64, &class_config.cost) {
            Some(next) => {
                *word = class_config.stamp(next);
                PASS
            }
            None => {
                if class_config.stale(*word) {
                    *word = class_config.stamp(tat);
                }
                SHOT
            }
        };
        (frame, expected, class)
    });
    println!("1000 packets, both classes changed at packet 500: {summary}");
}

/// Every CPU the per-CPU maps hold a slot for.
fn possible_cpus() -> usize {
    aya::util::nr_cpus().unwrap()
}

/// Pins the calling thread to `cpu`: BPF_PROG_TEST_RUN runs the program on the CPU it
/// is called from, so this picks the per-CPU state a packet meets.
fn run_on_cpu(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
}

/// Runs `count` packets `gap_ns` apart at most (random gaps from `dice`), each on a CPU
/// drawn at random: `next` makes each frame and says which verdict and class the host
/// model expects of it on that CPU. Every verdict and every class must match, and every
/// class must both pass and drop more than 50 packets. Returns a summary and the
/// (time, bytes) of every packet the program admitted.
fn against_model(
    harness: &mut Harness,
    count: usize,
    mut dice: Lcg,
    gap_ns: u64,
    mut next: impl FnMut(&mut Lcg, u64, usize) -> (Vec<u8>, u32, &'static str),
) -> (String, Vec<(u64, u64)>) {
    let cpus = possible_cpus();
    let mut now = 5_000_000_000u64;
    let mut verdicts: HashMap<&str, (u32, u32)> = HashMap::new();
    let (mut admitted, mut mismatches) = (Vec::new(), Vec::new());
    for index in 0..count {
        now += dice.next(gap_ns);
        let cpu = dice.next(cpus as u64) as usize;
        run_on_cpu(cpu);
        let (frame, expected, expected_class) = next(&mut dice, now, cpu);
        let (verdict, class) = harness.run(&frame, now, 1);
        let counts = verdicts.entry(expected_class).or_default();
        if verdict == PASS {
            counts.0 += 1;
            admitted.push((now, frame.len() as u64));
        } else {
            counts.1 += 1;
        }
        if verdict != expected || class.as_deref() != Some(expected_class) {
            mismatches.push(format!(
                "packet {index}: {} bytes at {now} ns on CPU {cpu}: got ({}, {class:?}), model says ({}, {expected_class})",
                frame.len(),
                verdict as i32,
                expected as i32
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    for (class, (passed, dropped)) in &verdicts {
        assert!(
            *passed > 50 && *dropped > 50,
            "class {class} must see both verdicts ({passed} admitted, {dropped} dropped)"
        );
    }
    let mut per_class: Vec<String> = verdicts
        .iter()
        .map(|(class, (passed, dropped))| format!("{class}: {passed} admitted, {dropped} dropped"))
        .collect();
    per_class.sort();
    (
        format!(
            "{}; 0 mismatches in verdict or class over {cpus} CPUs",
            per_class.join("; ")
        ),
        admitted,
    )
}

/// A class-scoped bucket spends per-CPU credit taken from the shared bucket a chunk at a
/// time. Packets on random CPUs get, packet by packet, the verdicts of a host model whose
/// per-byte cost and chunk come from the user's rate and burst (not from the kernel's
/// map), and what the program admitted stays within the user's burst + rate × t in every
/// window.
#[test]
fn per_cpu_credit_admits_exactly_what_the_model_predicts() {
    const RATE: u64 = 20_000_000;
    const BURST: u64 = 200 * 1024;
    let mut harness = Harness::new(&[&[
        "credit", "--proto", "udp", "--dport", "9300", "--rate", "20mbit", "--burst", "200k",
    ]]);
    let cpus = possible_cpus() as u64;
    let chunk = credit_chunk(RATE, BURST, cpus);
    let cost = ByteCost::new(RATE, shared_burst(BURST, cpus, chunk));
    assert!(
        chunk > 0,
        "a 20mbit, 200k class-scoped drop bucket gets per-CPU credit"
    );
    let (mut tat, mut credit) = (0u64, vec![0u64; cpus as usize]);
    // Gaps up to 100 µs: about 120 Mbit/s offered, so both verdicts occur.
    let (summary, admitted) =
        against_model(&mut harness, 1500, Lcg(11), 100_000, |dice, now, cpu| {
            let frame = ipv4(V4::default(), udp(9300, dice.next(1400) as usize));
            let size = frame.len() as u64;
            let expected = match use_credit(credit[cpu], size, chunk) {
                CreditUse::Covered { left } => {
                    credit[cpu] = left;
                    PASS
                }
                CreditUse::Take { first, fallback } => {
                    match [first, fallback]
                        .into_iter()
                        .find_map(|take| conform(tat, now, take, &cost).map(|next| (next, take)))
                    {
                        Some((next, take)) => {
                            tat = next;
                            credit[cpu] = credit[cpu] + take - size;
                            PASS
                        }
                        None => SHOT,
                    }
                }
            };
            (frame, expected, "credit")
        });
    for (first, &(start, _)) in admitted.iter().enumerate() {
        let mut bytes = 0u128;
        for &(at, size) in &admitted[first..] {
            bytes += size as u128;
            let allowed = BURST as u128 * 8_000_000_000 + RATE as u128 * (at - start) as u128;
            assert!(
                bytes * 8_000_000_000 <= allowed,
                "{bytes} B admitted in {} ns: more than 200k + 20 Mbit/s × t",
                at - start
            );
        }
    }
    println!("1500 packets through per-CPU credit (chunk {chunk} B): {summary}");
}

/// Which colour the meter gave the packet just run: the colour counter of `id` that moved.
fn colour_of_last(before: &ClassStats, after: &ClassStats) -> Colour {
    let moved = [
        (after.green_packets - before.green_packets, Colour::Green),
        (after.yellow_packets - before.yellow_packets, Colour::Yellow),
        (after.red_packets - before.red_packets, Colour::Red),
    ];
    let counted: Vec<Colour> = moved.iter().filter(|m| m.0 > 0).map(|m| m.1).collect();
    assert_eq!(counted.len(), 1, "one colour per packet: {moved:?}");
    counted[0]
}

/// Overload (gaps up to 0.4 ms) and quiet (up to 4 ms) in phases of 100 packets, so
/// every colour and every bucket level occurs (srTCM's E refills only in quiet phases).
fn meter_gap(dice: &mut Lcg, index: u64) -> u64 {
    if (index / 100).is_multiple_of(2) {
        dice.next(400_000)
    } else {
        dice.next(4_000_000)
    }
}

/// Replays random traffic through a meter class of the loaded program, one packet at a
/// time on one CPU, against the RFC's own token-count definition (`shaper_common::meter::
/// rfc`): every colour, every verdict (yellow passes, red drops) and, after every packet,
/// the kernel's two bucket words read as token counts must equal the RFC's buckets.
/// `rfc_packet` runs the RFC model for (now, bytes) and returns the colour and the two
/// token counts the kernel's words (first, second) must show.
fn meter_against_rfc(
    class: &[&str],
    mut rfc_packet: impl FnMut(u64, u64) -> (Colour, u64, u64),
    kernel_tokens: impl Fn(&shaper_common::Bucket, u64) -> (u64, u64),
) -> [u32; 3] {
    run_on_cpu(0);
    let mut harness = Harness::new(&[class]);
    let id = harness.class_id("meter");
    let buckets = harness.attachment.class_buckets().unwrap();
    let mut dice = Lcg(23);
    let mut now = 1_000_000_000u64;
    let (mut seen, mut mismatches) = ([0u32; 3], Vec::new());
    for index in 0..2000u64 {
        now += meter_gap(&mut dice, index);
        let frame = ipv4(V4::default(), udp(9400, dice.next(1437) as usize + 22));
        let bytes = frame.len() as u64;
        let before = harness.attachment.class_stats(id).unwrap();
        let (verdict, _) = harness.run(&frame, now, 1);
        let colour = colour_of_last(&before, &harness.attachment.class_stats(id).unwrap());
        let (expected, first, second) = rfc_packet(now, bytes);
        let expected_verdict = if expected == Colour::Red { SHOT } else { PASS };
        let tokens = kernel_tokens(&buckets.get(&id, 0).unwrap(), now);
        if colour != expected || verdict != expected_verdict || tokens != (first, second) {
            mismatches.push(format!(
                "packet {index} ({bytes} B at {now} ns): kernel {colour:?}, verdict {}, tokens {tokens:?}; RFC {expected:?}, tokens {:?}",
                verdict as i32,
                (first, second)
            ));
        }
        seen[expected as usize] += 1;
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches, first: {}",
        mismatches.len(),
        mismatches[..mismatches.len().min(5)].join("\n")
    );
    assert!(seen.iter().all(|n| *n > 100), "colours seen: {seen:?}");
    seen
}

/// The replayed meter for [`Harness::new`]: CIR 8 Mbit/s, CBS 6000 bytes, and `extra`.
fn meter_class<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "meter", "--proto", "udp", "--dport", "9400", "--rate", "8mbit", "--burst", "6000",
    ];
    args.extend_from_slice(extra);
    args
}

/// The kernel's trTCM (two GCRA words, compare-and-swap) against RFC 2698, packet by
/// packet. CIR 8 and PIR 16 Mbit/s give whole ticks per byte, so both sides are exact.
#[test]
fn kernel_trtcm_matches_rfc_2698_packet_by_packet() {
    let committed = ByteCost::new(8_000_000, 6_000);
    let peak = ByteCost::new(16_000_000, 12_000);
    let mut rfc = RfcTrTcm::full(&peak, &committed, 0);
    let seen = meter_against_rfc(
        &meter_class(&["--peak-rate", "16mbit", "--peak-burst", "12000"]),
        |now, bytes| {
            let colour = rfc.packet(now, peak.ticks_for(bytes), committed.ticks_for(bytes));
            (colour, rfc.tc, rfc.tp)
        },
        // Words: (C, P); tokens are the tolerance less the deficit.
        |bucket, now| {
            (
                committed.tolerance_ticks - deficit(bucket.tat, now),
                peak.tolerance_ticks - deficit(bucket.tat2, now),
            )
        },
    );
    println!("trTCM, 2000 packets: green/yellow/red {seen:?}, 0 mismatches with RFC 2698");
}

/// The kernel's srTCM (C's word and a word for the total deficit of C and E) against
/// RFC 2697, packet by packet.
#[test]
fn kernel_srtcm_matches_rfc_2697_packet_by_packet() {
    let committed = ByteCost::new(8_000_000, 6_000);
    let total = ByteCost::new(8_000_000, 6_000 + 20_000);
    let mut rfc = RfcSrTcm::full(&committed, &total, 0);
    let seen = meter_against_rfc(
        &meter_class(&["--excess-burst", "20000"]),
        |now, bytes| {
            let colour = rfc.packet(now, committed.ticks_for(bytes));
            (colour, rfc.tc, rfc.te)
        },
        // Words: (C, total); E's deficit is the total's less C's.
        |bucket, now| {
            let deficit_c = deficit(bucket.tat, now);
            let excess_burst = total.tolerance_ticks - committed.tolerance_ticks;
            (
                committed.tolerance_ticks - deficit_c,
                excess_burst - (deficit(bucket.tat2, now) - deficit_c),
            )
        },
    );
    println!("srTCM, 2000 packets: green/yellow/red {seen:?}, 0 mismatches with RFC 2697");
}

/// Priority and deletion as docs/DESIGN.md states them: the lowest `--prio` wins, ties go to
/// the older class, and deleting a class re-points its entries at the next-best class that
/// matches them.
#[test]
fn ties_go_to_the_older_class_and_deletion_falls_back_to_the_next_best() {
    let class = |name: &'static str, dport: Option<&'static str>, prio: &'static str| {
        let mut args = vec![name, "--proto", "udp", "--prio", prio];
        if let Some(port) = dport {
            args.extend(["--dport", port]);
        }
        args.extend(["--rate", "400gbit"]);
        args
    };
    let (older, younger, fallback) = (
        class("older", Some("53"), "10"),
        class("younger", Some("53"), "10"),
        class("fallback", None, "20"),
    );
    // One CPU: the per-CPU verdict cache holds the class each step found, and each
    // change of classes must replace it.
    run_on_cpu(0);
    let mut harness = Harness::new(&[&older, &younger, &fallback]);
    let dns = ipv4(V4::default(), udp(53, 32));
    let classified = |harness: &mut Harness, step: &str| {
        harness.reload_names();
        let (verdict, class) = harness.run(&dns, 1_000_000_000, 1);
        println!("{step:48} -> {class:?}");
        assert_eq!(verdict, PASS);
        class
    };
    assert_eq!(
        classified(&mut harness, "two classes of prio 10 match").as_deref(),
        Some("older")
    );
    let delete = |harness: &Harness, name: &str| {
        harness
            .lab
            .router
            .shaper(&["class", "del", name, "--dev", DEV])
            .unwrap();
    };
    delete(&harness, "older");
    assert_eq!(
        classified(&mut harness, "the older one deleted").as_deref(),
        Some("younger")
    );
    // The lowest prio wins over age.
    harness
        .lab
        .router
        .class_add(
            "urgent",
            DEV,
            &[
                "--proto", "udp", "--dport", "53", "--prio", "5", "--rate", "400gbit",
            ],
        )
        .unwrap();
    assert_eq!(
        classified(&mut harness, "a newer class of prio 5 added").as_deref(),
        Some("urgent")
    );
    delete(&harness, "urgent");
    delete(&harness, "younger");
    assert_eq!(
        classified(&mut harness, "only the prio 20 catch-all left").as_deref(),
        Some("fallback")
    );
    delete(&harness, "fallback");
    assert_eq!(classified(&mut harness, "no class left"), None);
}

/// Classification cost follows the number of rule shapes, not of classes: 200 classes
/// that differ only in their port share one shape (one hash lookup per packet), and the
/// right one still wins.
#[test]
fn two_hundred_classes_of_one_shape_cost_one_lookup() {
    use shaper::{
        classes::{self, ClassSpec},
        rules::{PortRange, Proto, Rule},
    };
    let mut harness = Harness::new(&[]);
    for index in 0..200u16 {
        let spec = ClassSpec {
            name: format!("port{index}"),
            rule: Rule {
                src: None,
                dst: None,
                proto: Proto::Udp,
                sport: PortRange::ANY,
                dport: PortRange {
                    lo: 20_000 + index,
                    hi: 20_000 + index,
                },
            },
            rate_bits_per_sec: 1_000_000_000,
            burst_bytes: 1 << 20,
            scope: shaper_common::Scope::Class,
            prio: 100,
            action: Default::default(),
            meter: Default::default(),
            exceed: Default::default(),
            codel: None,
            tree: None,
            global: None,
        };
        classes::add(&harness.attachment, &spec).unwrap();
    }
    assert_eq!(harness.attachment.globals().unwrap().shape_count, 1);
    harness.reload_names();
    for index in [0u16, 121, 199] {
        let (verdict, class) = harness.run(
            &ipv4(V4::default(), udp(20_000 + index, 64)),
            1_000_000_000,
            1,
        );
        assert_eq!((verdict, class), (PASS, Some(format!("port{index}"))));
    }
    let (_, class) = harness.run(&ipv4(V4::default(), udp(20_200, 64)), 1_000_000_000, 1);
    assert_eq!(class, None);
}

/// Two CPUs charging one bucket at once never admit more than it allows: one thread
/// pinned to each CPU runs the attached program (real clock) flat out on the same class
/// bucket. The burst is small enough that the class gets no per-CPU credit, so every
/// packet meets the shared word; the bytes passed must stay within burst + rate × the
/// span in which the kernel ran them (CLOCK_MONOTONIC, the program's own clock, read
/// around the two test runs), while a racy update would admit up to twice that.
#[test]
fn two_cpus_charging_one_bucket_never_over_admit() {
    const RATE: u64 = 1_000_000_000;
    const BURST: u64 = 8192;
    const REPEAT: u32 = 2_000_000;
    let cpus = possible_cpus();
    assert!(
        cpus >= 2,
        "the race needs two CPUs, this machine has {cpus}"
    );
    let harness = Harness::new(&[&[
        "race", "--proto", "udp", "--dport", "9200", "--rate", "1gbit", "--burst", "8k",
    ]]);
    let id = harness.class_id("race");
    assert_eq!(credit_chunk(RATE, BURST, cpus as u64), 0);
    let config = harness.attachment.classes().unwrap().get(&id, 0).unwrap();
    assert_eq!(
        config.credit_chunk, 0,
        "every packet must meet the shared word"
    );
    let frame = ipv4(V4::default(), udp(9200, 958)); // 1000 bytes on the wire
    let dir = harness.attachment.dir().to_path_buf();
    let ready = std::sync::atomic::AtomicUsize::new(0);
    let monotonic = || {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    };
    // Per thread: (monotonic ns before the run, after it, kernel run time in ns).
    let runs: Vec<(u64, u64, u64)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..2)
            .map(|cpu| {
                let (frame, dir, ready) = (&frame, &dir, &ready);
                scope.spawn(move || {
                    run_on_cpu(cpu);
                    // Each thread has its own program instance over the same pinned maps.
                    let mut ebpf = state::load_object(dir, 1024).unwrap();
                    let program = state::load_program(&mut ebpf, program_names::SHAPER).unwrap();
                    meet(ready, 2, std::time::Duration::from_secs(30));
                    let before = monotonic();
                    let result = program
                        .test_run(TestRunOptions {
                            data_in: Some(frame),
                            repeat: REPEAT,
                            ..TestRunOptions::default()
                        })
                        .unwrap();
                    let after = monotonic();
                    // The kernel reports the mean time of one run.
                    (
                        before,
                        after,
                        result.duration.as_nanos() as u64 * REPEAT as u64,
                    )
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let span = runs.iter().map(|r| r.1).max().unwrap() - runs.iter().map(|r| r.0).min().unwrap();
    let stats = harness.attachment.class_stats(id).unwrap();
    let allowed = BURST as f64 + RATE as f64 / 8.0 * span as f64 / 1e9;
    println!(
        "2 CPUs × {REPEAT} packets within {:.3} ms (kernel run time {:.3} and {:.3} ms): {} passed ({} bytes, allowed {allowed:.0}), {} dropped",
        span as f64 / 1e6,
        runs[0].2 as f64 / 1e6,
        runs[1].2 as f64 / 1e6,
        stats.passed_packets,
        stats.passed_bytes,
        stats.dropped_packets
    );
    assert_eq!(
        stats.passed_packets + stats.dropped_packets,
        2 * REPEAT as u64
    );
    // The two runs overlapped for most of the span, so the word was contended.
    for (cpu, run) in runs.iter().enumerate() {
        assert!(
            run.2 as f64 >= 0.5 * span as f64,
            "CPU {cpu} ran the program for only {} of {span} ns",
            run.2
        );
    }
    assert!(
        stats.dropped_packets > 0 && stats.passed_bytes > BURST,
        "the bucket must be contended"
    );
    assert!(
        stats.passed_bytes as f64 <= allowed,
        "over-admitted: {} > {allowed:.0}",
        stats.passed_bytes
    );
    // A correct bucket admits about the rate: far more than half of the allowance.
    assert!(
        stats.passed_bytes as f64 >= 0.5 * allowed,
        "under-admitted: {} of {allowed:.0}",
        stats.passed_bytes
    );
}

/// Waits until `parties` threads (this one included) have called `meet` on `ready`, for
/// at most `within`: a bounded barrier (a thread that panicked before it never arrives,
/// and the others fail instead of waiting for ever).
fn meet(ready: &std::sync::atomic::AtomicUsize, parties: usize, within: std::time::Duration) {
    use std::sync::atomic::Ordering;
    ready.fetch_add(1, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + within;
    while ready.load(Ordering::SeqCst) < parties {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {parties} threads got ready within {within:?}",
            ready.load(Ordering::SeqCst)
        );
        std::thread::yield_now();
    }
}

/// The shape path as the host model sees it: the class's virtual queue (GCRA word),
/// CoDel's state, and the one flow's sparseness word, stepped by the same shaper-common
/// functions the program runs.
struct ShapeModel {
    config: shaper_common::ClassConfig,
    /// HTB's burst in ticks (the sojourn starts beyond it), 0 under EDT.
    burst_ticks: u64,
    tat: u64,
    codel: CodelState,
    flow_tat: u64,
}

/// What the model says of one packet.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct ShapeVerdict {
    verdict: u32,
    /// Departure time (EDT); `now` for sparse packets.
    leave_at: Option<u64>,
    marked: bool,
    sparse: bool,
    /// Condemned by CoDel and dropped (not by the cap, not spared).
    condemned: bool,
    /// Condemned by CoDel and let through by `spare` (no signal).
    spared: bool,
}

impl ShapeModel {
    fn packet(&mut self, now: u64, bytes: u64, ect: bool) -> ShapeVerdict {
        self.packet_sparing(now, bytes, ect, || false)
    }

    /// [`ShapeModel::packet`] where `spare`, asked only for a packet CoDel condemns that
    /// would be dropped (not ECN-marked), lets it pass with no signal, as the program
    /// spares a GSO aggregate.
    fn packet_sparing(
        &mut self,
        now: u64,
        bytes: u64,
        ect: bool,
        spare: impl FnOnce() -> bool,
    ) -> ShapeVerdict {
        let sojourn = sojourn_ns(self.tat, ticks(now), self.burst_ticks);
        let (sparse_flow, flow_next) =
            codel::sparse(self.flow_tat, now, bytes, &self.config.sparse_cost);
        self.flow_tat = flow_next;
        let dropped = ShapeVerdict {
            verdict: SHOT,
            leave_at: None,
            marked: false,
            sparse: sparse_flow,
            condemned: false,
            spared: false,
        };
        if !sparse_flow && sojourn > self.config.codel.cap_ns {
            return dropped;
        }
        let mut marked = false;
        let mut spared = false;
        if !sparse_flow {
            let marks = ect && self.config.codel.ecn != 0;
            let judgement = judge(
                self.codel.control,
                self.codel.first_above,
                sojourn,
                now,
                &self.config.codel,
                1,
                || !marks && spare(),
            );
            spared = judgement.spared;
            if let Some(first_above) = judgement.first_above {
                self.codel.first_above = first_above;
            }
            if let Some(control) = judgement.control {
                self.codel.control = control;
            }
            if judgement.congested {
                if !marks {
                    return ShapeVerdict {
                        condemned: true,
                        ..dropped
                    };
                }
                marked = true;
            }
        }
        let leave_at = self.admit(now, bytes);
        ShapeVerdict {
            verdict: PASS,
            leave_at: Some(if sparse_flow { now } else { leave_at }),
            marked,
            sparse: sparse_flow,
            condemned: false,
            spared,
        }
    }

    /// The packet joins the virtual queue; its departure.
    fn admit(&mut self, now: u64, bytes: u64) -> u64 {
        let (next, leave_at) =
            departure(self.tat, now, bytes, &self.config.cost, u64::MAX).unwrap();
        self.tat = next;
        leave_at
    }
}

/// Shaping with CoDel, replayed packet by packet against [`ShapeModel`] on the EDT path
/// (the fq path, which this kernel cannot run end to end: skb->tstamp is checked here, not
/// pacing on a real fq): a new flow's first packets are sparse and leave at once, bulk
/// packets leave len / rate apart, CoDel CE-marks ECN-capable packets and drops the rest
/// once the virtual queue stood above target for an interval, and the hard cap drops.
/// Then the HTB path: bulk and sparse packets are steered to their leaves.
#[test]
fn shaping_with_codel_matches_the_model_packet_by_packet() {
    let harness = Harness::new(&[&[
        "bulk",
        "--proto",
        "udp",
        "--dport",
        "9300",
        "--rate",
        "8mbit",
        "--action",
        "shape",
        "--target",
        "5ms",
        "--interval",
        "100ms",
        // The model is one queue's CoDel (flow isolation: `fair_flows_*`).
        "--fair",
        "none",
    ]]);
    let id = harness.class_id("bulk");
    let mut classes = harness.attachment.classes().unwrap();
    let htb_config = classes.get(&id, 0).unwrap();
    assert_eq!(
        htb_config.codel,
        CodelConfig::new(5_000_000, 100_000_000, 8_000_000)
    );
    assert_ne!(
        htb_config.action_arg, 0,
        "this kernel has no fq: the class is in HTB"
    );
    assert_ne!(htb_config.sparse_priority, 0);
    // The EDT path: no HTB class.
    let mut config = htb_config;
    config.action_arg = 0;
    config.sparse_priority = 0;
    classes.set(id, config, 0).unwrap();
    let mut model = ShapeModel {
        config,
        burst_ticks: 0,
        tat: 0,
        codel: CodelState::default(),
        flow_tat: 0,
    };

    let frame = |ect: bool| {
        let mut frame = ipv4(V4::default(), udp(9300, 958)); // 1000 bytes: 1 ms at 8 Mbit/s
        if ect {
            frame[15] = 0x02; // ECT(0)
        }
        frame
    };
    let program = harness.clocked();
    let send_from = |sport: u16, now: u64, ect: bool| -> (u32, u64, u32, bool) {
        let mut data = frame(ect);
        data[34..36].copy_from_slice(&sport.to_be_bytes());
        let mut data_out = vec![0u8; data.len()];
        let ctx = skb_at(now);
        let mut ctx_out = vec![0u8; SKB_SIZE];
        let result = program
            .test_run(TestRunOptions {
                data_in: Some(&data),
                data_out: Some(&mut data_out),
                ctx_in: Some(&ctx),
                ctx_out: Some(&mut ctx_out),
                ..TestRunOptions::default()
            })
            .unwrap();
        let field = |at: usize| u32::from_ne_bytes(ctx_out[at..at + 4].try_into().unwrap());
        let tstamp = u64::from_ne_bytes(ctx_out[SKB_TSTAMP..SKB_TSTAMP + 8].try_into().unwrap());
        (
            result.return_value,
            tstamp,
            field(SKB_PRIORITY),
            data_out[15] & 3 == 3,
        )
    };
    let send = |now: u64, ect: bool| send_from(40_000, now, ect);

    let start = 7_000_000_000u64;
    // Eight packets at once: the first six fit the flow's sparseness bucket (four frames
    // at 1/16 of the rate) and leave now; the rest queue behind the six.
    for index in 0..8u64 {
        let (verdict, tstamp, _, _) = send(start, false);
        let expected = model.packet(start, 1000, false);
        assert_eq!(
            (verdict, Some(tstamp)),
            (expected.verdict, expected.leave_at)
        );
        let leave_at = if index < 6 {
            start
        } else {
            start + index * 1_000_000
        };
        assert_eq!(tstamp, leave_at, "packet {index}");
    }
    // Then 1.25 s at 1.6 times the rate (a packet every 0.625 ms), each packet checked
    // against the model; returns (passed, marked, CoDel drops, cap drops).
    let overload = |model: &mut ShapeModel, from: u64, ect: &dyn Fn(u64) -> bool| {
        let mut counts = [0u32; 4];
        for index in 0..2000u64 {
            let now = from + index * 625_000;
            let ect = ect(index);
            let sojourn = sojourn_ns(model.tat, ticks(now), 0);
            let expected = model.packet(now, 1000, ect);
            let (verdict, tstamp, _, marked) = send(now, ect);
            assert_eq!(verdict, expected.verdict, "packet {index} at {now}");
            assert_eq!(marked, expected.marked, "packet {index} at {now}");
            let kind = if verdict == PASS {
                assert_eq!(Some(tstamp), expected.leave_at, "packet {index}");
                0
            } else if sojourn > model.config.codel.cap_ns {
                3
            } else {
                2
            };
            counts[kind] += 1;
            counts[1] += marked as u32;
        }
        counts
    };
    // Every other packet ECN-capable.
    let now = start + 1_000_000;
    let [passed, marks, codel_drops, cap_drops] = overload(&mut model, now, &|i| i % 2 == 1);
    let now = now + 2000 * 625_000;
    println!(
        "EDT + CoDel: passed {passed}, marked {marks}, CoDel drops {codel_drops}, cap drops {cap_drops}"
    );
    assert!(marks > 10 && codel_drops > 10, "CoDel acted below the cap");
    assert!(
        codel::Control::unpack(model.codel.control).count > 4,
        "the drop rate sped up"
    );
    // Nothing ever waits beyond the cap.
    assert!(sojourn_ns(model.tat, ticks(now), 0) <= model.config.codel.cap_ns + 1_000_000);

    // With ECN off (`--ecn off`), ECN-capable packets are dropped, never marked.
    config.codel = config.codel.with_ecn(false);
    classes.set(id, config, 0).unwrap();
    model.config = config;
    let later = now + 10_000_000_000;
    let [_, marks, codel_drops, _] = overload(&mut model, later, &|_| true);
    println!("EDT + CoDel, ECN off: marked {marks}, CoDel drops {codel_drops}");
    assert_eq!(marks, 0);
    assert!(codel_drops > 10);
    let now = later + 2000 * 625_000;

    // The HTB path with CoDel: the class's own config again (ECN on), its virtual queue
    // starting beyond HTB's burst (HTB sends that much ahead of the rate). The same
    // overload, every other packet ECN-capable, against the model with that burst: every
    // verdict, CE mark and leaf is the model's.
    classes.set(id, htb_config, 0).unwrap();
    model.config = htb_config;
    model.burst_ticks = htb_config.shape_burst_ticks();
    assert!(model.burst_ticks > 0, "HTB's burst is in the sojourn");
    let later = now + 10_000_000_000;
    let (mut passed, mut marks, mut codel_drops) = (0u32, 0u32, 0u32);
    for index in 0..2000u64 {
        let now = later + index * 625_000;
        let ect = index % 2 == 1;
        let expected = model.packet(now, 1000, ect);
        let (verdict, _, leaf, marked) = send(now, ect);
        assert_eq!(
            (verdict, marked),
            (expected.verdict, expected.marked),
            "HTB path, packet {index} at {now}"
        );
        if verdict == PASS {
            let wanted = if expected.sparse {
                htb_config.sparse_priority
            } else {
                htb_config.action_arg
            };
            assert_eq!(leaf, wanted, "HTB path, packet {index}'s leaf");
            passed += 1;
        }
        marks += marked as u32;
        codel_drops += expected.condemned as u32;
    }
    println!("HTB + CoDel: passed {passed}, marked {marks}, CoDel drops {codel_drops}");
    assert!(
        marks > 10 && codel_drops > 10,
        "CoDel acted on the HTB path"
    );
    let now = later + 2000 * 625_000;

    // A new flow (another source port) is sparse at first and goes to the sparse leaf,
    // then to the bulk leaf.
    let later = now + 10_000_000_000;
    let leaves: Vec<u32> = (0..8).map(|_| send_from(40_001, later, false).2).collect();
    assert_eq!(
        leaves,
        [
            [htb_config.sparse_priority; 6].as_slice(),
            &[htb_config.action_arg; 2]
        ]
        .concat()
    );
}

/// CoDel on a queue N bulk flows share drops N times as often as on one flow's queue, as
/// N per-flow CoDels would together (fq_codel, CAKE). The same UDP load, 1.05 times an
/// 8 Mbit/s class for 1.5 s, comes once from one flow and once from four taking turns
/// (a sparse probe beside them each time): the class's census (`CODEL_FLOWS`) counts 1,
/// then 4 bulk flows, never the probe, and the four get at least 1.4 times the drops (with
/// the count ignored both get the same, packet for packet).
#[test]
fn codel_counts_the_bulk_flows_and_drops_as_often_as_per_flow_codels() {
    let harness = Harness::new(&[&[
        "bulk", "--proto", "udp", "--dport", "9300", "--rate", "8mbit", "--action", "shape",
        "--ecn", "off", "--fair", "none",
    ]]);
    let id = harness.class_id("bulk");
    harness.on_the_edt_path(id);
    let program = harness.clocked();
    let send = |sport: u16, now: u64| -> u32 {
        let mut data = ipv4(V4::default(), udp(9300, 958)); // 1000 bytes: 1 ms at 8 Mbit/s
        data[34..36].copy_from_slice(&sport.to_be_bytes());
        program
            .test_run(TestRunOptions {
                data_in: Some(&data),
                ctx_in: Some(&skb_at(now)),
                ..TestRunOptions::default()
            })
            .unwrap()
            .return_value
    };
    // 1575 packets 0.952 ms apart from `flows` source ports in turn, and a probe every
    // 50 ms from another; the bulk packets dropped and the census after.
    let overload = |from: u64, flows: u16| {
        let mut drops = 0;
        for index in 0..1575u64 {
            let now = from + index * 952_381;
            if index % 50 == 0 {
                assert_eq!(send(50_000, now), PASS, "the probe stays sparse");
            }
            drops += (send(40_000 + (index % flows as u64) as u16, now) == SHOT) as u32;
        }
        (
            drops,
            harness
                .attachment
                .codel_flows()
                .unwrap()
                .get(&id, 0)
                .unwrap(),
        )
    };
    let (alone, census) = overload(10_000_000_000, 1);
    assert_eq!(
        (census.counted, census.counting.min(1)),
        (1, 1),
        "{census:?}"
    );
    // Ten idle seconds: the queue drains and CoDel starts afresh.
    let (shared, census) = overload(30_000_000_000, 4);
    println!("CoDel drops of 1575 packets: one flow {alone}, four flows {shared}");
    assert_eq!(census.counted, 4, "{census:?}");
    assert!(census.counting <= 4, "{census:?}");
    assert!(alone > 10, "CoDel acted on one flow ({alone} drops)");
    assert!(
        shared * 10 >= alone * 14,
        "four flows {shared} drops against one flow's {alone}"
    );
}

/// CoDel on GSO aggregates: a drop is meant to cost the sender one segment, so an
/// aggregate of k segments CoDel condemns is dropped one time in k (dropped whole every
/// time, a TSO sender on a µs path loses up to 44 segments per signal and the class runs
/// well below its rate), and a spared one is no signal: CoDel's count stays. Two
/// identical classes get the same wire bytes at the same instants at 1.05 times the rate
/// with ECN off, one as plain 1810-byte frames, the other as 16-segment aggregates of the
/// same wire length, each against the host model: every plain verdict is the model's;
/// every aggregate verdict is too, the model being told the program's lottery for the
/// aggregates it condemns (so it also checks that a spared one leaves the count, or the
/// next decisions part). Of 200 or more condemned aggregates about a sixteenth are
/// dropped: never none, never a quarter.
#[test]
fn codel_drops_a_gso_aggregate_of_k_segments_one_time_in_k() {
    let class = |dport: &'static str| -> Vec<&'static str> {
        vec![
            "--proto",
            "tcp",
            "--dport",
            dport,
            "--rate",
            "8mbit",
            // The queue must pass the burst before CoDel sees it: 64 KiB leaves 3.7 s of
            // the run to CoDel (the default 128 KiB would leave 2.3 s, too few condemned).
            "--burst",
            "64k",
            "--action",
            "shape",
            "--target",
            "5ms",
            // Spared aggregates leave the count, so the aggregates' count grows sixteen
            // times slower than the frames' (one decision in 16 is a drop): a short
            // interval gives enough decisions in the run. The cap is then 20 ms too.
            "--interval",
            "20ms",
            "--ecn",
            "off",
            // One queue's CoDel, as the model.
            "--fair",
            "none",
        ]
    };
    let plain_class = [&["plain"][..], &class("9401")].concat();
    let gso_class = [&["gso"][..], &class("9402")].concat();
    let mut harness = Harness::new(&[&plain_class, &gso_class]);
    let model_of = |name: &str| {
        let config = harness
            .attachment
            .classes()
            .unwrap()
            .get(&harness.class_id(name), 0)
            .unwrap();
        ShapeModel {
            config,
            burst_ticks: config.shape_burst_ticks(),
            tat: 0,
            codel: CodelState::default(),
            flow_tat: 0,
        }
    };
    let (mut plain_model, mut gso_model) = (model_of("plain"), model_of("gso"));
    // The same wire length: 1000 bytes with 15 extra segments of 54 bytes of headers, or
    // one 1810-byte frame (1.81 ms at 8 Mbit/s).
    let aggregate = ipv4(V4::default(), tcp(9402, 1000 - 54));
    let plain = ipv4(V4::default(), tcp(9401, 1810 - 54));
    let wire_len = plain.len() as u64;
    assert_eq!(wire_len, aggregate.len() as u64 + 15 * 54);
    let (mut plain_condemned, mut condemned, mut spared, mut capped) = (0u32, 0u32, 0u32, 0u32);
    let codel = harness.attachment.codel().unwrap();
    let gso_id = harness.class_id("gso");
    let start = 3_000_000_000u64;
    for index in 0..3000u64 {
        let now = start + index * 1_724_000;
        let expected = plain_model.packet(now, wire_len, false);
        let (verdict, _) = harness.run(&plain, now, 0);
        assert_eq!(verdict, expected.verdict, "plain frame {index}");
        plain_condemned += expected.condemned as u32;
        // The program draws its lottery; the model is told its outcome when it condemns
        // the aggregate too, and must then agree on the verdict and on CoDel's state as
        // the program left it in the class's map (a count moved by a spared aggregate, or
        // a program that condemned nothing, shows there).
        let (verdict, _) = harness.run_gso(&aggregate, now, 16, 60, wire_len as u32);
        let expected = gso_model.packet_sparing(now, wire_len, false, || verdict == PASS);
        assert_eq!(verdict, expected.verdict, "aggregate {index}");
        let state = codel.get(&gso_id, 0).unwrap();
        assert_eq!(
            state, gso_model.codel,
            "CoDel's state after aggregate {index}"
        );
        condemned += (expected.condemned || expected.spared) as u32;
        spared += expected.spared as u32;
        capped += (expected.verdict == SHOT && !expected.condemned) as u32;
    }
    let dropped = condemned - spared;
    println!(
        "CoDel: {plain_condemned} plain frames dropped; {condemned} aggregates condemned, \
         {dropped} dropped; {capped} aggregates dropped at the cap"
    );
    assert!(plain_condemned >= 15, "CoDel dropped plain frames");
    assert!(condemned >= 200, "CoDel condemned aggregates: {condemned}");
    // Binomial(n >= 200, 1/16): none dropped has odds below 3e-6, a quarter below 1e-9.
    assert!(dropped >= 1, "no condemned aggregate was dropped");
    assert!(
        dropped * 4 < condemned,
        "{dropped} of {condemned} condemned aggregates dropped"
    );
}

/// Flow isolation (`--fair flow`, the default) on the packet path, clock driven: an 8
/// Mbit/s class (EDT path: no HTB burst) gets 1000-byte UDP packets from two flows for
/// 6 s, flow A at 1.6 times the rate and flow B at 0.3 times. B, under its share, is
/// never dropped; A, the only flow over its share, is held to what B leaves (5.6 Mbit/s
/// within 5 % over the last 3 s), not to half the rate nor the whole; most drops count
/// as fair drops (A beyond its cap), the rest are the class queue's CoDel's, on A alone.
/// Marked as having a queue per flow in its leaf (shaper 0.3's fq_codel leaf, whose CoDel
/// then judges each flow),
/// the class queue's CoDel drops nothing and B is still spared. With `--fair none` (the
/// one queue of before) B loses packets to A's queue.
#[test]
fn fair_flows_hold_the_flow_over_its_share_and_spare_the_other() {
    let run = |fair: &'static str,
               flow_queues: bool|
     -> (u64, u64, u64, shaper_common::fair::ShapeStats) {
        let harness = Harness::new(&[&[
            "bulk", "--proto", "udp", "--dport", "9300", "--rate", "8mbit", "--action", "shape",
            "--ecn", "off", "--fair", fair,
        ]]);
        let id = harness.class_id("bulk");
        harness.on_the_edt_path(id);
        if flow_queues {
            harness.with_flow_queues(id);
        }
        let program = harness.clocked();
        let send = |sport: u16, now: u64| -> bool {
            let mut data = ipv4(V4::default(), udp(9300, 958)); // 1000 bytes on the wire
            data[34..36].copy_from_slice(&sport.to_be_bytes());
            let verdict = program
                .test_run(TestRunOptions {
                    data_in: Some(&data),
                    ctx_in: Some(&skb_at(now)),
                    ..TestRunOptions::default()
                })
                .unwrap()
                .return_value;
            verdict != SHOT
        };
        // 6 s in steps of 125 µs: A sends every 5th step (1.6 x 8 Mbit/s), B every 33rd.
        let start = 10_000_000_000u64;
        let (mut a_passed_late, mut b_sent, mut b_passed) = (0u64, 0u64, 0u64);
        for step in 0..48_000u64 {
            let now = start + step * 125_000;
            let late = step >= 24_000;
            if step % 5 == 0 && send(41_000, now) && late {
                a_passed_late += 1;
            }
            if step % 33 == 0 {
                b_sent += 1;
                b_passed += send(42_000, now) as u64;
            }
        }
        let mut causes = shaper_common::fair::ShapeStats::default();
        for cpu in harness
            .attachment
            .shape_stats()
            .unwrap()
            .get(&id, 0)
            .unwrap()
            .iter()
        {
            causes.accumulate(cpu);
        }
        (a_passed_late, b_sent, b_passed, causes)
    };
    let (a_late, b_sent, b_passed, causes) = run("flow", false);
    let a_bps = a_late as f64 * 8000.0 / 3.0;
    println!(
        "fair flow: A {:.3} Mbit/s over the last 3 s, B passed {b_passed} of {b_sent}; {causes:?}",
        a_bps / 1e6
    );
    assert_eq!(b_passed, b_sent, "B, under its share, lost packets");
    // What B leaves: 8 - 8000 bits every 33 x 125 µs.
    let left_bps = 8e6 - 8000.0 / (33.0 * 125e-6);
    assert!(
        (a_bps / left_bps - 1.0).abs() <= 0.05,
        "A got {a_bps:.0} bit/s, B left {left_bps:.0}"
    );
    assert!(
        causes.fair_dropped_packets > 1000
            && causes.fair_dropped_packets > causes.queue_dropped_packets,
        "{causes:?}"
    );
    // With a queue per flow in the leaf, its CoDel judges A's own queue: the class queue's
    // CoDel drops nothing, and the cap alone holds A here (no leaf in a test run).
    let (a_late, b_sent, b_passed, causes) = run("flow", true);
    println!(
        "fair flow, a queue per flow in the leaf: A {:.3} Mbit/s, B passed {b_passed} of {b_sent}; {causes:?}",
        a_late as f64 * 8000.0 / 3.0 / 1e6
    );
    assert_eq!(b_passed, b_sent, "B, under its share, lost packets");
    assert_eq!(causes.queue_dropped_packets, 0, "{causes:?}");
    assert!(causes.fair_dropped_packets > 1000, "{causes:?}");
    let (_, b_sent, b_passed, causes) = run("none", false);
    println!("fair none: B passed {b_passed} of {b_sent}; {causes:?}");
    assert!(b_passed < b_sent, "one queue spared B");
    assert_eq!(causes.fair_dropped_packets, 0, "{causes:?}");
}
