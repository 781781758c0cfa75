//! Differential test of parse + classify (issue 11, item 13): random frames go through the
//! loaded program (BPF_PROG_TEST_RUN) and through a host reference written from the
//! classification rules in docs/DESIGN.md, never from the eBPF code; class and verdict must agree
//! on every frame.
//!
//! The reference parses each frame on its own terms (Ethernet, up to two 802.1Q/802.1ad
//! tags, IPv4 with options and fragments, IPv6 with up to 8 extension headers, TCP/UDP
//! ports) into what docs/DESIGN.md says a class can see, and picks the class by its rules:
//! lowest `--prio`, ties to the older class. Its bucket is `conform`, the bucket function
//! the property tests check, so a mismatch is the parser's or the classifier's.
//!
//! `SHAPER_DIFFERENTIAL_FRAMES` sets the number of frames (default 10 000 in the suite;
//! the full run is 100 000).

use super::{Harness, Lcg, DEV, PASS, SHOT};
use shaper_common::{conform, ByteCost};

// ---- the reference: what docs/DESIGN.md says a class matches ----

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proto {
    Any,
    Tcp,
    Udp,
    Icmp,
}

/// An address prefix of either family, as `--src`/`--dst` take it.
#[derive(Clone, Copy, Debug)]
struct Prefix {
    v6: bool,
    /// The address, IPv4 in the low 32 bits.
    addr: u128,
    len: u32,
}

impl Prefix {
    fn contains(&self, v6: bool, addr: u128) -> bool {
        let bits = if self.v6 { 128 } else { 32 };
        if self.v6 != v6 {
            return false;
        }
        self.len == 0 || (self.addr ^ addr) >> (bits - self.len) == 0
    }

    fn cidr(&self) -> String {
        if self.v6 {
            format!("{}/{}", std::net::Ipv6Addr::from(self.addr), self.len)
        } else {
            format!(
                "{}/{}",
                std::net::Ipv4Addr::from(self.addr as u32),
                self.len
            )
        }
    }
}

#[derive(Clone, Debug)]
struct Rule {
    src: Option<Prefix>,
    dst: Option<Prefix>,
    proto: Proto,
    sport: Option<(u16, u16)>,
    dport: Option<(u16, u16)>,
}

impl Rule {
    fn is_empty(&self) -> bool {
        self.src.is_none()
            && self.dst.is_none()
            && self.proto == Proto::Any
            && self.sport.is_none()
            && self.dport.is_none()
    }
}

/// What docs/DESIGN.md says a class can see of a frame.
#[derive(Debug)]
enum Seen {
    /// Not IPv4/IPv6 as far as the parser can tell: only classes without rules match.
    NotIp,
    Ip {
        v6: bool,
        /// `None`: the header is too short to hold them.
        addresses: Option<(u128, u128)>,
        /// `None`: the protocol cannot be determined (protocol and port rules are moot).
        proto: Option<u8>,
        /// `None`: a non-first fragment, a truncated TCP/UDP header, or no TCP/UDP.
        ports: Option<(u16, u16)>,
    },
}

/// An IP packet whose protocol cannot be determined (nor its addresses, when `None`).
fn protocol_unknown(v6: bool, addresses: Option<(u128, u128)>) -> Seen {
    Seen::Ip {
        v6,
        addresses,
        proto: None,
        ports: None,
    }
}

fn be16(frame: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]))
}

fn address(bytes: &[u8]) -> u128 {
    bytes.iter().fold(0u128, |acc, b| acc << 8 | *b as u128)
}

/// docs/DESIGN.md's parse: Ethernet, at most two VLAN tags (802.1Q 0x8100, 802.1ad 0x88a8),
/// then IPv4 or IPv6.
fn seen(frame: &[u8]) -> Seen {
    let mut at = 12;
    let mut ethertype = be16(frame, at);
    let mut tags = 0;
    while matches!(ethertype, Some(0x8100 | 0x88a8)) && tags < 2 {
        tags += 1;
        at += 4;
        ethertype = be16(frame, at);
    }
    let l3 = at + 2;
    match ethertype {
        Some(0x0800) => seen_ipv4(frame, l3),
        Some(0x86dd) => seen_ipv6(frame, l3),
        _ => Seen::NotIp,
    }
}

fn ports_at(frame: &[u8], proto: u8, l4: usize) -> Option<(u16, u16)> {
    if proto != 6 && proto != 17 {
        return None;
    }
    Some((be16(frame, l4)?, be16(frame, l4 + 2)?))
}

fn seen_ipv4(frame: &[u8], l3: usize) -> Seen {
    let Some(header) = frame.get(l3..l3 + 20) else {
        return protocol_unknown(false, None);
    };
    let addresses = Some((address(&header[12..16]), address(&header[16..20])));
    let (version, ihl) = (header[0] >> 4, (header[0] & 0x0f) as usize);
    // "an IPv4 header with IHL < 5": the protocol cannot be determined.
    if version != 4 || ihl < 5 {
        return protocol_unknown(false, addresses);
    }
    let proto = header[9];
    let first_fragment = u16::from_be_bytes([header[6], header[7]]) & 0x1fff == 0;
    Seen::Ip {
        v6: false,
        addresses,
        proto: Some(proto),
        ports: first_fragment
            .then(|| ports_at(frame, proto, l3 + ihl * 4))
            .flatten(),
    }
}

/// "an IPv6 extension chain longer than 8 headers or cut short": protocol unknown.
const IPV6_EXTENSION_HEADERS_WALKED: usize = 8;

fn seen_ipv6(frame: &[u8], l3: usize) -> Seen {
    let Some(header) = frame.get(l3..l3 + 40) else {
        return protocol_unknown(true, None);
    };
    let addresses = Some((address(&header[8..24]), address(&header[24..40])));
    let (mut next, mut at, mut first_fragment) = (header[6], l3 + 40, true);
    for walked in 0..=IPV6_EXTENSION_HEADERS_WALKED {
        let length = match next {
            0 | 43 | 60 => frame.get(at + 1).map(|len| (*len as usize + 1) * 8),
            44 => {
                let Some(offset) = be16(frame, at + 2) else {
                    return protocol_unknown(true, addresses);
                };
                first_fragment &= offset >> 3 == 0;
                Some(8)
            }
            51 => frame.get(at + 1).map(|len| (*len as usize + 2) * 4),
            proto => {
                return Seen::Ip {
                    v6: true,
                    addresses,
                    proto: Some(proto),
                    ports: first_fragment.then(|| ports_at(frame, proto, at)).flatten(),
                }
            }
        };
        if walked == IPV6_EXTENSION_HEADERS_WALKED {
            break;
        }
        let (Some(length), Some(&following)) = (length, frame.get(at)) else {
            return protocol_unknown(true, addresses);
        };
        next = following;
        at += length;
    }
    protocol_unknown(true, addresses)
}

fn matches(rule: &Rule, seen: &Seen) -> bool {
    let Seen::Ip {
        v6,
        addresses,
        proto,
        ports,
    } = seen
    else {
        return rule.is_empty();
    };
    // Addresses: an address rule pins the family. One the header is too short to hold
    // matches no address rule but a /0 one (any address of that family).
    let address_ok = |prefix: &Option<Prefix>, pick: fn((u128, u128)) -> u128| match prefix {
        None => true,
        Some(prefix) => match addresses {
            Some(pair) => prefix.contains(*v6, pick(*pair)),
            None => prefix.v6 == *v6 && prefix.len == 0,
        },
    };
    if !address_ok(&rule.src, |(src, _)| src) || !address_ok(&rule.dst, |(_, dst)| dst) {
        return false;
    }
    // Protocol unknown: the address rule alone decides.
    let Some(proto) = proto else {
        return true;
    };
    let proto_ok = match rule.proto {
        Proto::Any => true,
        Proto::Tcp => *proto == 6,
        Proto::Udp => *proto == 17,
        Proto::Icmp => *proto == if *v6 { 58 } else { 1 },
    };
    if !proto_ok {
        return false;
    }
    // Ports unknown (non-first fragment, truncated header): protocol and addresses decide.
    let in_range = |range: Option<(u16, u16)>, port: u16| {
        range.is_none_or(|(lo, hi)| (lo..=hi).contains(&port))
    };
    match ports {
        Some((sport, dport)) => in_range(rule.sport, *sport) && in_range(rule.dport, *dport),
        None => true,
    }
}

struct Class {
    name: String,
    rule: Rule,
    prio: u32,
    drop: bool,
    rate_bits: u64,
    burst: u64,
    /// The model bucket.
    tat: u64,
}

impl Class {
    fn args(&self) -> Vec<String> {
        let mut args = vec![self.name.clone()];
        let mut push = |flag: &str, value: String| {
            args.push(flag.to_string());
            args.push(value);
        };
        if let Some(src) = self.rule.src {
            push("--src", src.cidr());
        }
        if let Some(dst) = self.rule.dst {
            push("--dst", dst.cidr());
        }
        let proto = match self.rule.proto {
            Proto::Any => None,
            Proto::Tcp => Some("tcp"),
            Proto::Udp => Some("udp"),
            Proto::Icmp => Some("icmp"),
        };
        if let Some(proto) = proto {
            push("--proto", proto.into());
        }
        let range = |(lo, hi): (u16, u16)| format!("{lo}-{hi}");
        if let Some(sport) = self.rule.sport {
            push("--sport", range(sport));
        }
        if let Some(dport) = self.rule.dport {
            push("--dport", range(dport));
        }
        push("--prio", self.prio.to_string());
        push("--rate", format!("{}bit", self.rate_bits));
        push("--burst", self.burst.to_string());
        push("--action", if self.drop { "drop" } else { "pass" }.into());
        args
    }
}

// ---- random rule sets and frames ----

/// Addresses frames and rules are drawn from: close ones, so prefixes overlap.
const V4_POOL: [u32; 5] = [
    0xc612_0102, // 198.18.1.2
    0xc612_0202, // 198.18.2.2
    0xc612_024d, // 198.18.2.77
    0xc613_0001, // 198.19.0.1
    0xc612_8001, // 198.18.128.1
];
const V6_POOL: [u128; 4] = [
    0xfd00_0001_0000_0000_0000_0000_0000_0002,
    0xfd00_0002_0000_0000_0000_0000_0000_0002,
    0xfd00_0002_0000_0000_0000_0000_0000_0077,
    0xfd00_00ff_0000_0000_0000_0000_0000_0001,
];
const PORT_POOL: [u16; 8] = [0, 53, 80, 443, 1000, 1023, 40000, 65535];

fn pick<T: Copy>(dice: &mut Lcg, items: &[T]) -> T {
    items[dice.next(items.len() as u64) as usize]
}

fn random_address(dice: &mut Lcg, v6: bool) -> u128 {
    if v6 {
        pick(dice, &V6_POOL)
    } else {
        pick(dice, &V4_POOL) as u128
    }
}

fn random_prefix(dice: &mut Lcg, v6: bool) -> Prefix {
    let bits = if v6 { 128 } else { 32 };
    let len = match dice.next(6) {
        0 => 0,
        1 => bits,
        _ => [8, 15, 16, 24, 31, 48, 64, 120][dice.next(if v6 { 8 } else { 5 }) as usize],
    };
    let addr = random_address(dice, v6);
    let addr = if len == 0 {
        0
    } else {
        addr >> (bits - len) << (bits - len)
    };
    Prefix { v6, addr, len }
}

fn random_range(dice: &mut Lcg) -> (u16, u16) {
    let lo = pick(dice, &PORT_POOL);
    let width = pick(dice, &[0u16, 0, 1, 7, 100, 1000, 30000]);
    (lo, lo.saturating_add(width))
}

fn random_rule(dice: &mut Lcg) -> Rule {
    if dice.next(8) == 0 {
        return Rule {
            src: None,
            dst: None,
            proto: Proto::Any,
            sport: None,
            dport: None,
        };
    }
    let v6 = dice.next(2) == 1;
    let src = (dice.next(3) == 0).then(|| random_prefix(dice, v6));
    let dst = (dice.next(2) == 0).then(|| random_prefix(dice, v6));
    let proto = pick(dice, &[Proto::Any, Proto::Tcp, Proto::Udp, Proto::Icmp]);
    let ports = matches!(proto, Proto::Tcp | Proto::Udp);
    Rule {
        src,
        dst,
        proto,
        sport: (ports && dice.next(4) == 0).then(|| random_range(dice)),
        dport: (ports && dice.next(2) == 0).then(|| random_range(dice)),
    }
}

fn random_class(dice: &mut Lcg, index: usize) -> Class {
    // Half never refuse (400 Gbit/s); the others hold a few frames and refill slowly.
    let slow = dice.next(2) == 0;
    Class {
        name: format!("c{index}"),
        rule: random_rule(dice),
        prio: 1 + dice.next(3) as u32,
        drop: dice.next(3) != 0,
        rate_bits: if slow { 64_000 } else { 400_000_000_000 },
        burst: 1514 + dice.next(4000),
        tat: 0,
    }
}

/// A random frame: up to three tags of 802.1Q, 802.1ad or 0x9100, then IPv4 (options,
/// fragments, an odd version or IHL), IPv6 (up to 10 extension headers, fragments), ARP or
/// an unknown ethertype; TCP, UDP, ICMP or another protocol; then maybe cut short.
fn random_frame(dice: &mut Lcg) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1];
    let tags = pick(dice, &[0, 0, 0, 1, 1, 2, 3]);
    for _ in 0..tags {
        frame.extend_from_slice(&pick(dice, &[0x8100u16, 0x88a8, 0x88a8, 0x9100]).to_be_bytes());
        frame.extend_from_slice(&[0x00, 0x64]);
    }
    let kind = dice.next(20);
    let ethertype: u16 = match kind {
        0..=8 => 0x0800,
        9..=17 => 0x86dd,
        18 => 0x0806,
        _ => 0x88b5,
    };
    frame.extend_from_slice(&ethertype.to_be_bytes());
    let proto = pick(dice, &[6u8, 6, 17, 17, 1, 58, 47, 132]);
    let mut l4 = vec![0u8; pick(dice, &[8usize, 20, 40, 200])];
    for byte in l4.iter_mut() {
        *byte = dice.next(256) as u8;
    }
    l4[..2].copy_from_slice(&pick(dice, &PORT_POOL).to_be_bytes());
    l4[2..4].copy_from_slice(&pick(dice, &PORT_POOL).to_be_bytes());
    match ethertype {
        0x0800 => {
            let ihl = pick(dice, &[5usize, 5, 5, 6, 8, 15, 4]);
            let mut header = vec![0u8; ihl.max(5) * 4];
            header[0] = if dice.next(20) == 0 { 0x60 } else { 0x40 } | ihl as u8;
            let fragment: u16 = match dice.next(6) {
                0 => 0x2000, // first fragment (more follow)
                // A later one (offset in 8-byte units), with or without more to follow.
                1 => pick(dice, &[1u16, 185, 0x1fff]) | (dice.next(2) << 13) as u16,
                _ => 0,
            };
            header[6..8].copy_from_slice(&fragment.to_be_bytes());
            header[8] = 64;
            header[9] = proto;
            header[12..16].copy_from_slice(&(random_address(dice, false) as u32).to_be_bytes());
            header[16..20].copy_from_slice(&(random_address(dice, false) as u32).to_be_bytes());
            frame.extend_from_slice(&header);
        }
        0x86dd => {
            let mut header = vec![0u8; 40];
            header[0] = 0x60;
            header[7] = 64;
            header[8..24].copy_from_slice(&random_address(dice, true).to_be_bytes());
            header[24..40].copy_from_slice(&random_address(dice, true).to_be_bytes());
            let count = pick(dice, &[0usize, 0, 1, 2, 3, 7, 8, 9, 10]);
            let kinds: Vec<u8> = (0..count)
                .map(|_| pick(dice, &[0u8, 43, 44, 60, 51]))
                .collect();
            header[6] = kinds.first().copied().unwrap_or(proto);
            frame.extend_from_slice(&header);
            for (index, kind) in kinds.iter().enumerate() {
                let next = kinds.get(index + 1).copied().unwrap_or(proto);
                let extension = match kind {
                    44 => {
                        // A later fragment (offset 1 or 100), or the first (offset 0, M).
                        let offset: u16 = pick(dice, &[1u16 << 3, 100 << 3, 1, 1]);
                        let mut ext = vec![next, 0, 0, 0, 0, 0, 0, 1];
                        ext[2..4].copy_from_slice(&offset.to_be_bytes());
                        ext
                    }
                    51 => {
                        let words = pick(dice, &[1usize, 4]);
                        let mut ext = vec![0u8; (words + 2) * 4];
                        ext[0] = next;
                        ext[1] = words as u8;
                        ext
                    }
                    _ => {
                        let units = pick(dice, &[0usize, 1, 2]);
                        let mut ext = vec![0u8; (units + 1) * 8];
                        ext[0] = next;
                        ext[1] = units as u8;
                        ext
                    }
                };
                frame.extend_from_slice(&extension);
            }
        }
        _ => {}
    }
    frame.extend_from_slice(&l4);
    if dice.next(4) == 0 {
        // Cut short anywhere past the Ethernet addresses and type.
        let keep = 14 + dice.next((frame.len() - 13) as u64) as usize;
        frame.truncate(keep);
    }
    frame
}

/// The class the reference picks: the lowest prio, ties to the older (earlier) class.
fn reference_class<'a>(classes: &'a mut [Class], seen: &Seen) -> Option<&'a mut Class> {
    let mut best: Option<&'a mut Class> = None;
    for class in classes.iter_mut() {
        if matches(&class.rule, seen) && best.as_ref().is_none_or(|b| class.prio < b.prio) {
            best = Some(class);
        }
    }
    best
}

#[test]
fn random_frames_get_the_class_and_verdict_the_readme_rules_give() {
    let frames: usize = std::env::var("SHAPER_DIFFERENTIAL_FRAMES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(10_000);
    const PER_RULE_SET: usize = 500;
    // Frames of the set before, sent again first under each new set: the verdict cache
    // holds their old classes, which the new rules must replace.
    const CARRIED: usize = 100;
    // One CPU, so the per-CPU verdict cache is the one every frame meets.
    super::run_on_cpu(0);
    let mut harness = Harness::new(&[]);
    let mut carried: Vec<Vec<u8>> = Vec::new();
    let mut dice = Lcg(20261201);
    let (mut mismatches, mut refused_by_test_run, mut ran) = (Vec::new(), 0usize, 0usize);
    let mut outcomes = std::collections::HashMap::<&str, usize>::new();
    let mut now: u64 = 1_000_000_000;
    for set in 0..frames.div_ceil(PER_RULE_SET) {
        // A fresh random rule set of 2-8 classes; one that would need a 33rd rule shape
        // is refused by `class add`, and the reference leaves it out too.
        for name in harness.names.clone().into_values() {
            harness
                .lab
                .router
                .shaper(&["class", "del", &name, "--dev", DEV])
                .unwrap();
        }
        let mut classes = Vec::new();
        for index in 0..2 + dice.next(7) as usize {
            let class = random_class(&mut dice, index);
            let args = class.args();
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let added = harness.lab.router.shaper_output(
                &[&["class", "add"], &refs[..1], &["--dev", DEV], &refs[1..]].concat(),
            );
            if added.status.success() {
                classes.push(class);
            } else {
                let message = String::from_utf8_lossy(&added.stderr);
                assert!(message.contains("shape"), "class add {args:?}: {message}");
            }
        }
        harness.reload_names();
        let mut set_frames = std::mem::take(&mut carried);
        set_frames.extend(
            (0..PER_RULE_SET.min(frames - set * PER_RULE_SET)).map(|_| random_frame(&mut dice)),
        );
        carried = set_frames[set_frames.len().saturating_sub(CARRIED)..].to_vec();
        // Each frame twice: the second time its class comes from the verdict cache.
        let sends = set_frames.iter().flat_map(|frame| [frame, frame]);
        for frame in sends {
            let frame = frame.as_slice();
            now += dice.next(2_000_000);
            let seen = seen(frame);
            let Some((verdict, class)) = harness.try_run(frame, now) else {
                // BPF_PROG_TEST_RUN takes an IP frame only with its whole IP header; any
                // other refusal is a failure of the program or of the test.
                assert!(
                    matches!(
                        seen,
                        Seen::Ip {
                            addresses: None,
                            ..
                        }
                    ),
                    "BPF_PROG_TEST_RUN refused {frame:02x?} ({seen:?})"
                );
                refused_by_test_run += 1;
                continue;
            };
            ran += 1;
            let (expected_class, expected_verdict) = match reference_class(&mut classes, &seen) {
                None => (None, PASS),
                Some(reference) => {
                    let cost = ByteCost::new(reference.rate_bits, reference.burst);
                    let within = match conform(reference.tat, now, frame.len() as u64, &cost) {
                        Some(next) => {
                            reference.tat = next;
                            true
                        }
                        None => false,
                    };
                    let verdict = if within || !reference.drop {
                        PASS
                    } else {
                        SHOT
                    };
                    (Some(reference.name.clone()), verdict)
                }
            };
            let outcome = match (&expected_class, expected_verdict) {
                (None, _) => "no class",
                (Some(_), SHOT) => "dropped",
                (Some(_), _) => "passed",
            };
            *outcomes.entry(outcome).or_default() += 1;
            if (class.clone(), verdict) != (expected_class.clone(), expected_verdict) {
                mismatches.push(format!(
                    "frame {frame:02x?}\n  seen {seen:?}\n  program: {class:?} verdict {verdict}; \
                     reference: {expected_class:?} verdict {expected_verdict}\n  rules: {:?}",
                    classes
                        .iter()
                        .map(|c| (c.name.clone(), c.prio, c.rule.clone()))
                        .collect::<Vec<_>>()
                ));
                // Past a mismatch the model's buckets no longer follow the program's.
                break;
            }
        }
        if !mismatches.is_empty() {
            break;
        }
    }
    println!(
        "{ran} frames compared ({refused_by_test_run} refused by BPF_PROG_TEST_RUN itself): \
         {outcomes:?}; {} mismatches",
        mismatches.len()
    );
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    // The comparison must cover every outcome, often.
    for outcome in ["no class", "dropped", "passed"] {
        let count = outcomes.get(outcome).copied().unwrap_or(0);
        assert!(count * 20 > ran, "{outcome}: only {count} of {ran} frames");
    }
    assert!(
        refused_by_test_run * 10 < ran + refused_by_test_run,
        "{refused_by_test_run} refused"
    );
}
