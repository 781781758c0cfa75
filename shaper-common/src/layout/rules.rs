//! The tuple-space classifier's keys and values: address families, protocols, the
//! key's flags, a rule shape (mask), an exact-match key and what it points to.

/// Address family as stored in keys (0 = wildcard).
pub const FAMILY_ANY: u8 = 0;
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// L4 protocol numbers used by the classifier (0 = wildcard).
pub const PROTO_ANY: u8 = 0;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

/// `RuleKey::flags`: the packet's ports could not be read (non-first fragment, truncated
/// L4 header). Such packets match on addresses and protocol alone.
pub const KEY_PORTS_UNKNOWN: u8 = 1;
/// `RuleKey::flags`: the packet's L4 protocol could not be determined (truncated or too
/// long IPv6 extension chain, truncated IPv4 header). Such packets match on addresses alone.
pub const KEY_PROTO_UNKNOWN: u8 = 2;
/// `RuleKey::flags`: the frame is not IPv4 or IPv6 as far as the parser can tell (ARP,
/// LLDP, raw Ethernet, more VLAN tags than it walks, a 0x9100 outer tag): only classes
/// without any rule match it, so "cap this VM" cannot be bypassed with raw frames.
pub const KEY_NOT_IP: u8 = 4;

/// One mask of the tuple-space classifier: which bits of a packet's fields a group of
/// rules looks at. Addresses are in network byte order, as read from the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    pub src_mask: [u32; 4],
    pub dst_mask: [u32; 4],
    /// Port masks in host byte order.
    pub sport_mask: u16,
    pub dport_mask: u16,
    /// 1 when the family is part of the key (the rule has an address), else 0.
    pub match_family: u8,
    /// 1 when the protocol is part of the key, else 0.
    pub match_proto: u8,
    /// 1 when the slot is in use (userspace bookkeeping; unused slots never match).
    pub in_use: u8,
    pub _pad: u8,
}

/// Exact-match key of the tuple-space classifier: a packet's fields masked by a shape.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleKey {
    pub shape: u16,
    pub family: u8,
    pub proto: u8,
    pub flags: u8,
    /// Two fields, not `[u8; 3]`: BPF builds an array's zeroes with a `memset` call.
    pub _pad: u8,
    pub _pad_word: u16,
    pub sport: u16,
    pub dport: u16,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// What a classification entry points to. `rank` orders classes: lower wins
/// (`prio << 32 | creation sequence`, so equal priorities go to the older class).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleValue {
    pub class_id: u32,
    pub _pad: u32,
    pub rank: u64,
}

/// A `RuleValue::rank`: the lowest prio, then the deepest in a tree (a child before its
/// ancestors: a catch-all parent takes what its children do not), then the oldest (the
/// creation sequence's low 30 bits).
pub fn rank(prio: u32, depth: usize, seq: u64) -> u64 {
    let below_deepest = (crate::hierarchy::MAX_LEVELS - 1).saturating_sub(depth) as u64;
    (u64::from(prio) << 32) | (below_deepest << 30) | (seq & 0x3fff_ffff)
}
