//! Class match rules and their compilation into tuple-space classifier entries.
//!
//! A rule (source/destination CIDR, protocol, port ranges) becomes a few exact-match
//! entries, each under a *shape* (the set of masks it uses). The packet path does one
//! hash lookup per shape in use, so its cost depends on the number of distinct shapes,
//! never on the number of classes. Port ranges split into prefix-aligned blocks.

use ipnet::IpNet;
use shaper_common::{
    RuleKey, Shape, FAMILY_ANY, FAMILY_V4, FAMILY_V6, KEY_NOT_IP, KEY_PORTS_UNKNOWN,
    KEY_PROTO_UNKNOWN, PROTO_ANY, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};
use std::net::IpAddr;

/// Protocol as the user names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Any,
    Tcp,
    Udp,
    /// ICMP for IPv4 and ICMPv6 for IPv6.
    Icmp,
}

impl std::str::FromStr for Proto {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let name = match text.to_ascii_lowercase().as_str() {
            "all" => "any".to_string(),
            other => other.to_string(),
        };
        [Self::Any, Self::Tcp, Self::Udp, Self::Icmp]
            .into_iter()
            .find(|proto| proto.name() == name)
            .ok_or_else(|| format!("unknown protocol '{text}' (expected tcp, udp, icmp or any)"))
    }
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Proto {
    pub fn name(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Icmp => "icmp",
        }
    }

    /// Stored form (the v4 protocol number; ICMP covers ICMPv6 too).
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Self::Any => PROTO_ANY,
            Self::Tcp => PROTO_TCP,
            Self::Udp => PROTO_UDP,
            Self::Icmp => PROTO_ICMP,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            PROTO_TCP => Self::Tcp,
            PROTO_UDP => Self::Udp,
            PROTO_ICMP => Self::Icmp,
            _ => Self::Any,
        }
    }
}

/// An inclusive port range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    pub const ANY: Self = Self {
        lo: 0,
        hi: u16::MAX,
    };

    /// Parses "P" or "P-Q".
    pub fn parse(text: &str) -> Result<Self, String> {
        let number = |part: &str| {
            part.trim()
                .parse::<u16>()
                .map_err(|_| format!("bad port '{part}' in '{text}' (expected 0-65535)"))
        };
        let range = match text.split_once('-') {
            Some((lo, hi)) => Self {
                lo: number(lo)?,
                hi: number(hi)?,
            },
            None => {
                let port = number(text)?;
                Self { lo: port, hi: port }
            }
        };
        if range.lo > range.hi {
            return Err(format!("port range '{text}' is empty (start above end)"));
        }
        Ok(range)
    }

    pub fn is_any(self) -> bool {
        self == Self::ANY
    }

    /// Splits the range into (value, mask) blocks aligned on powers of two.
    pub(crate) fn prefix_blocks(self) -> Vec<(u16, u16)> {
        let mut blocks = Vec::new();
        let mut start = self.lo as u32;
        let end = self.hi as u32;
        while start <= end {
            // Largest aligned block starting at `start` that stays within the range.
            let mut size = if start == 0 {
                1 << 16
            } else {
                1 << start.trailing_zeros()
            };
            while start + size - 1 > end {
                size >>= 1;
            }
            let mask = !(size - 1) as u16;
            blocks.push((start as u16, mask));
            start += size;
        }
        blocks
    }

    pub fn display(self) -> String {
        if self.lo == self.hi {
            self.lo.to_string()
        } else {
            format!("{}-{}", self.lo, self.hi)
        }
    }
}

/// Parses a CIDR or a bare address (a host route), keeping only the network bits.
pub(crate) fn parse_cidr(text: &str) -> Result<IpNet, String> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net.trunc());
    }
    text.parse::<IpAddr>()
        .map(IpNet::from)
        .map_err(|_| format!("bad CIDR '{text}' (expected e.g. 198.18.0.0/15 or fd00::/8)"))
}

/// What a class matches. Omitted fields match anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub src: Option<IpNet>,
    pub dst: Option<IpNet>,
    pub proto: Proto,
    pub sport: PortRange,
    pub dport: PortRange,
}

impl Rule {
    /// Checks the combination; on a problem, the field to change and one line for the
    /// user.
    pub(crate) fn validate(&self) -> Result<(), (&'static str, String)> {
        if let (Some(src), Some(dst)) = (self.src, self.dst) {
            if src.addr().is_ipv4() != dst.addr().is_ipv4() {
                return Err((
                    "dst",
                    format!("--src {src} and --dst {dst} are of different address families"),
                ));
            }
        }
        let has_ports = !self.sport.is_any() || !self.dport.is_any();
        if has_ports && !matches!(self.proto, Proto::Tcp | Proto::Udp) {
            return Err((
                "proto",
                "--sport/--dport need --proto tcp or --proto udp".into(),
            ));
        }
        Ok(())
    }

    fn family(&self) -> u8 {
        match self.src.or(self.dst) {
            Some(IpNet::V4(_)) => FAMILY_V4,
            Some(IpNet::V6(_)) => FAMILY_V6,
            None => FAMILY_ANY,
        }
    }

    /// The (shape, key-without-shape-index) entries that make this rule match.
    ///
    /// Besides the entries for fully parsed packets, every rule also matches packets
    /// whose ports are unknown (non-first fragments, truncated L4 headers) on addresses
    /// and protocol alone, and packets whose protocol is unknown (truncated headers, too
    /// long IPv6 extension chains) on addresses alone, so malformed traffic cannot
    /// escape a class whose address/protocol rule it matches.
    pub fn entries(&self) -> Vec<(Shape, RuleKey)> {
        let family = self.family();
        // ICMP has a different protocol number per family, so it pins the family.
        let families: Vec<(u8, u8)> = match (self.proto, family) {
            (Proto::Icmp, FAMILY_ANY) => vec![(FAMILY_V4, PROTO_ICMP), (FAMILY_V6, PROTO_ICMPV6)],
            (Proto::Icmp, FAMILY_V6) => vec![(FAMILY_V6, PROTO_ICMPV6)],
            (proto, family) => vec![(family, proto.to_u8())],
        };
        let mut entries = Vec::new();
        for (family, proto) in families {
            let (src_addr, src_mask) = address_and_mask(self.src);
            let (dst_addr, dst_mask) = address_and_mask(self.dst);
            let base_shape = Shape {
                src_mask,
                dst_mask,
                match_family: u8::from(family != FAMILY_ANY),
                match_proto: u8::from(proto != PROTO_ANY),
                in_use: 1,
                ..Shape::default()
            };
            let base_key = RuleKey {
                family,
                proto,
                src: src_addr,
                dst: dst_addr,
                ..RuleKey::default()
            };
            // Fully parsed packets: one entry per port block pair.
            for (sport, sport_mask) in port_blocks(self.sport) {
                for (dport, dport_mask) in port_blocks(self.dport) {
                    let shape = Shape {
                        sport_mask,
                        dport_mask,
                        ..base_shape
                    };
                    let key = RuleKey {
                        sport,
                        dport,
                        ..base_key
                    };
                    entries.push((shape, key));
                }
            }
            // Ports unknown: addresses and protocol decide. The packet's ports are zero
            // then, so any of this rule's port shapes can hold these entries: reusing one
            // costs no extra lookup.
            let shape = entries.last().map_or(base_shape, |(shape, _)| *shape);
            entries.push((
                shape,
                RuleKey {
                    flags: KEY_PORTS_UNKNOWN,
                    ..base_key
                },
            ));
            // Protocol unknown: addresses decide.
            entries.push((
                shape,
                RuleKey {
                    flags: KEY_PORTS_UNKNOWN | KEY_PROTO_UNKNOWN,
                    proto: 0,
                    ..base_key
                },
            ));
        }
        if self.is_empty() {
            // A class without rules matches every frame, IP or not.
            let (shape, _) = entries[0];
            entries.push((
                shape,
                RuleKey {
                    flags: KEY_NOT_IP,
                    ..RuleKey::default()
                },
            ));
        }
        entries.dedup();
        entries
    }

    /// No address, protocol or port rule: the class matches every frame.
    pub fn is_empty(&self) -> bool {
        self.src.is_none()
            && self.dst.is_none()
            && self.proto == Proto::Any
            && self.sport.is_any()
            && self.dport.is_any()
    }
}

fn port_blocks(range: PortRange) -> Vec<(u16, u16)> {
    if range.is_any() {
        vec![(0, 0)]
    } else {
        range.prefix_blocks()
    }
}

/// Network-order address words and mask words of an optional CIDR.
fn address_and_mask(net: Option<IpNet>) -> ([u32; 4], [u32; 4]) {
    let Some(net) = net else {
        return ([0; 4], [0; 4]);
    };
    let (addr, mask) = match net {
        IpNet::V4(v4) => {
            let mut addr = [0u8; 16];
            let mut mask = [0u8; 16];
            addr[..4].copy_from_slice(&v4.network().octets());
            mask[..4].copy_from_slice(&v4.netmask().octets());
            (addr, mask)
        }
        IpNet::V6(v6) => (v6.network().octets(), v6.netmask().octets()),
    };
    (words(addr), words(mask))
}

/// Packs 16 bytes into four words in memory order (as the packet path loads them).
pub fn words(bytes: [u8; 16]) -> [u32; 4] {
    let mut out = [0u32; 4];
    for (index, chunk) in bytes.chunks_exact(4).enumerate() {
        out[index] = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    out
}

/// Inverse of [`words`].
pub fn bytes(words: [u32; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (index, word) in words.iter().enumerate() {
        out[index * 4..index * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_split_into_prefixes() {
        assert_eq!(
            PortRange::parse("80").unwrap().prefix_blocks(),
            vec![(80, 0xffff)]
        );
        assert_eq!(
            PortRange::parse("1024-2047").unwrap().prefix_blocks(),
            vec![(1024, 0xfc00)]
        );
        let blocks = PortRange::parse("1000-1999").unwrap().prefix_blocks();
        // Every port in the range is covered by exactly one block, none outside.
        for port in 0..=u16::MAX {
            let hits = blocks.iter().filter(|(v, m)| port & m == *v).count();
            assert_eq!(
                hits,
                usize::from((1000..=1999).contains(&port)),
                "port {port}"
            );
        }
        assert!(blocks.len() <= 30);
        assert_eq!(
            PortRange::parse("0-65535").unwrap().prefix_blocks(),
            vec![(0, 0)]
        );
        assert!(PortRange::parse("9-8").is_err());
        assert!(PortRange::parse("70000").is_err());
        assert!(PortRange::parse("a-b").is_err());
    }

    #[test]
    fn cidrs_are_truncated_and_hosts_accepted() {
        assert_eq!(
            parse_cidr("198.18.1.7/16").unwrap().to_string(),
            "198.18.0.0/16"
        );
        assert_eq!(
            parse_cidr("198.18.1.7").unwrap().to_string(),
            "198.18.1.7/32"
        );
        assert_eq!(parse_cidr("fd00::1/8").unwrap().to_string(), "fd00::/8");
        assert!(parse_cidr("198.18.0.0/33").is_err());
        assert!(parse_cidr("nonsense").is_err());
    }

    #[test]
    fn validation_rejects_mixed_families_and_portless_protocols() {
        let mut rule = Rule {
            src: Some(parse_cidr("198.18.0.0/15").unwrap()),
            dst: Some(parse_cidr("fd00::/8").unwrap()),
            proto: Proto::Any,
            sport: PortRange::ANY,
            dport: PortRange::ANY,
        };
        assert!(rule.validate().is_err());
        rule.dst = None;
        assert!(rule.validate().is_ok());
        rule.dport = PortRange::parse("53").unwrap();
        assert!(rule.validate().is_err());
        rule.proto = Proto::Udp;
        assert!(rule.validate().is_ok());
    }

    #[test]
    fn icmp_without_address_covers_both_families() {
        let rule = Rule {
            src: None,
            dst: None,
            proto: Proto::Icmp,
            sport: PortRange::ANY,
            dport: PortRange::ANY,
        };
        let protos: Vec<(u8, u8)> = rule
            .entries()
            .iter()
            .map(|(_, k)| (k.family, k.proto))
            .collect();
        assert!(protos.contains(&(FAMILY_V4, PROTO_ICMP)));
        assert!(protos.contains(&(FAMILY_V6, PROTO_ICMPV6)));
    }
}
