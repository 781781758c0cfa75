//! Parse: Ethernet (up to two VLAN tags), IPv4 (options) or IPv6 (a bounded walk over
//! extension headers), TCP/UDP ports, and the bytes the packet takes on the wire.

use aya_ebpf::programs::TcContext;
use shaper_common::{
    FAMILY_V4, FAMILY_V6, KEY_NOT_IP, KEY_PORTS_UNKNOWN, KEY_PROTO_UNKNOWN, MAX_IPV6_EXT_HEADERS,
    PROTO_TCP, PROTO_UDP,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
/// IPv6 extension headers the parser walks (IANA protocol numbers).
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
const VLAN_HLEN: usize = 4;
const MAX_VLAN_TAGS: usize = 2;
/// What classification needs from a packet. Addresses are raw network-order words.
/// `repr(C)`: it is also the value of the `SHAPE_PACKET` map (64 bytes, checked by the
/// contract test).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Packet {
    pub(crate) family: u8,
    pub(crate) proto: u8,
    pub(crate) flags: u8,
    /// Never written (zero in practice): part of the tuple's first word (see
    /// [`Packet::tuple_word`]); the search never reads it, so its value could only cost
    /// cache hits, never change a class.
    pub(crate) _spare: u8,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) src: [u32; 4],
    pub(crate) dst: [u32; 4],
    /// Bytes on the wire: skb->len plus the headers of every extra GSO segment.
    pub(crate) wire_len: u64,
    /// Offset of the IP header, and whether its first bytes could be read (for rewrites).
    pub(crate) l3: usize,
    pub(crate) ip_readable: bool,
    /// Frames the packet leaves as: a GSO aggregate's segment count, else 1.
    pub(crate) segments: u32,
}

/// Words of the classification tuple: family, protocol, flags and ports, then the
/// addresses (the verdict cache's key).
pub(crate) const TUPLE_WORDS: usize = 5;

impl Packet {
    /// Word `index` (below [`TUPLE_WORDS`]) of the classification tuple, read in place
    /// (the packet is a map value, 8-aligned).
    #[inline(always)]
    pub(crate) fn tuple_word(&self, index: usize) -> u64 {
        unsafe { core::ptr::read_volatile((self as *const Packet).cast::<u64>().add(index)) }
    }
}

/// Reads a header field: straight from the linear packet data when it is there (the
/// common case, and several times cheaper than a helper call), else through
/// bpf_skb_load_bytes, which also sees non-linear data. None when the packet is shorter.
#[inline(always)]
pub(crate) fn load<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    // No header shaper reads lies beyond 16 KiB: one past it (a chain of extension
    // headers a sender made long) is not read at all, so the packet meets no class
    // rather than one the sender picked by wrapping the offset. The mask keeps the
    // bound the verifier needs.
    if offset > 0x3fff {
        return None;
    }
    let offset = offset & 0x3fff;
    // An opaque register move keeps LLVM from re-associating `data + offset + size`: the
    // verifier must see the bounds check made on the very pointer that is then read.
    // (`black_box` did the same through a stack slot: a store and a load per field, 128
    // instructions more in the program.)
    let mut field = ctx.data() + offset;
    unsafe {
        core::arch::asm!(
            "{0} = {0}",
            inout(reg) field,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    if field + core::mem::size_of::<T>() <= ctx.data_end() {
        Some(unsafe { core::ptr::read_unaligned(field as *const T) })
    } else {
        ctx.load::<T>(offset).ok()
    }
}

/// Parses the frame into `packet` (the per-CPU `SHAPE_PACKET` slot: see `main.rs`).
#[inline(always)]
pub(crate) fn parse<const BARE_IP: bool>(ctx: &TcContext, packet: &mut Packet) {
    // A device carrying bare IP (tun, wireguard, ipip, sit, ppp) has no link-layer header:
    // the protocol is `skb->protocol`. A separate program (`shaper_l3`), so each keeps
    // constant offsets and its own verifier budget.
    let (mut ethertype, mut l3) = if BARE_IP {
        (u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16), 0)
    } else {
        // A frame too short for its ethertype is as unreadable as a non-IP one.
        (load::<u16>(ctx, 12).map_or(0, u16::from_be), ETH_HLEN)
    };
    for _ in 0..MAX_VLAN_TAGS {
        if BARE_IP || (ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD) {
            break;
        }
        ethertype = load::<u16>(ctx, l3 + 2).map_or(0, u16::from_be);
        l3 += VLAN_HLEN;
    }
    let skb_len = ctx.len() as u64;
    // Field by field: a struct literal would be built on the stack and copied. The
    // zeroed words are volatile stores: LLVM merges plain ones into a `memset` call, which
    // BPF links as a byte-at-a-time loop (36 bytes, about 180 instructions a packet).
    packet.family = 0;
    packet.proto = 0;
    packet.flags = KEY_PORTS_UNKNOWN | KEY_PROTO_UNKNOWN;
    zero_words(packet);
    packet.wire_len = skb_len;
    packet.l3 = l3;
    packet.ip_readable = false;
    packet.segments = 1;
    let l4 = match ethertype {
        ETH_P_IP => parse_ipv4(ctx, l3, packet),
        ETH_P_IPV6 => parse_ipv6(ctx, l3, packet),
        // ARP, LLDP, raw Ethernet, a third VLAN tag, a 0x9100 outer tag: classes without
        // rules still match it (and charge its bytes); no other class does.
        _ => {
            packet.flags = KEY_NOT_IP;
            return;
        }
    };
    if let Some(l4) = l4 {
        parse_l4(ctx, l4, packet);
    }
    // On egress the kernel has already sized the packet for the wire (qdisc_pkt_len_init:
    // every GSO segment's headers, SKB_GSO_DODGY packets' segment count from gso_size,
    // and on recent kernels the inner headers of a tunnel): never charge less than that.
    let kernel_wire_len = unsafe { (*ctx.skb.skb).wire_len } as u64;
    if kernel_wire_len > packet.wire_len {
        packet.wire_len = kernel_wire_len;
    }
}

/// Zeroes the ports and both addresses, one 8-byte store per word (offsets 8-40 are
/// 8-aligned in the map value).
#[inline(always)]
fn zero_words(packet: &mut Packet) {
    unsafe {
        core::ptr::write_volatile(&raw mut packet.sport, 0);
        core::ptr::write_volatile(&raw mut packet.dport, 0);
        let src = (&raw mut packet.src).cast::<u64>();
        let dst = (&raw mut packet.dst).cast::<u64>();
        for word in 0..2 {
            core::ptr::write_volatile(src.add(word), 0);
            core::ptr::write_volatile(dst.add(word), 0);
        }
    }
}

/// Fills addresses and protocol; returns the L4 offset when the ports are worth reading.
#[inline(always)]
fn parse_ipv4(ctx: &TcContext, l3: usize, packet: &mut Packet) -> Option<usize> {
    packet.family = FAMILY_V4;
    // A header too short to hold both addresses keeps them zero, protocol unknown.
    let header = load::<[u32; 5]>(ctx, l3)?;
    packet.ip_readable = true;
    let bytes0 = header[0].to_ne_bytes();
    let bytes2 = header[2].to_ne_bytes();
    let bytes1 = header[1].to_ne_bytes();
    packet.src[0] = header[3];
    packet.dst[0] = header[4];
    let ihl = (bytes0[0] & 0x0f) as usize;
    if bytes0[0] >> 4 != 4 || ihl < 5 {
        return None;
    }
    packet.proto = bytes2[1];
    packet.flags = KEY_PORTS_UNKNOWN;
    let fragment_offset = u16::from_be_bytes([bytes1[2], bytes1[3]]) & 0x1fff;
    if fragment_offset != 0 {
        // Non-first fragments carry no L4 header: classified by addresses and protocol.
        return None;
    }
    Some(l3 + ihl * 4)
}

#[inline(always)]
fn parse_ipv6(ctx: &TcContext, l3: usize, packet: &mut Packet) -> Option<usize> {
    packet.family = FAMILY_V6;
    let header = load::<[u32; 10]>(ctx, l3)?;
    packet.ip_readable = true;
    packet.src = [header[2], header[3], header[4], header[5]];
    packet.dst = [header[6], header[7], header[8], header[9]];
    let mut next_header = header[1].to_ne_bytes()[2];
    let mut offset = l3 + 40;
    let mut first_fragment = true;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        match next_header {
            // Length in 8-byte units after the first 8.
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let ext = load::<[u8; 2]>(ctx, offset)?;
                next_header = ext[0];
                offset += (ext[1] as usize + 1) * 8;
            }
            // Fixed 8 bytes; a non-zero offset means no L4 header here.
            IPPROTO_FRAGMENT => {
                let ext = load::<[u8; 4]>(ctx, offset)?;
                next_header = ext[0];
                if (u16::from_be_bytes([ext[2], ext[3]]) >> 3) != 0 {
                    first_fragment = false;
                }
                offset += 8;
            }
            // Length in 4-byte units, minus 2.
            IPPROTO_AH => {
                let ext = load::<[u8; 2]>(ctx, offset)?;
                next_header = ext[0];
                offset += (ext[1] as usize + 2) * 4;
            }
            _ => return upper_layer(packet, next_header, offset, first_fragment),
        }
    }
    match next_header {
        // The chain is longer than we walk: the protocol stays unknown.
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT | IPPROTO_AH => None,
        // The last header walked names the upper layer.
        _ => upper_layer(packet, next_header, offset, first_fragment),
    }
}

/// The protocol after the IPv6 header's chain; the L4 offset when ports can be read.
#[inline(always)]
fn upper_layer(
    packet: &mut Packet,
    next_header: u8,
    offset: usize,
    first_fragment: bool,
) -> Option<usize> {
    packet.proto = next_header;
    packet.flags = KEY_PORTS_UNKNOWN;
    if first_fragment {
        Some(offset)
    } else {
        None
    }
}

#[inline(always)]
fn parse_l4(ctx: &TcContext, l4: usize, packet: &mut Packet) {
    if packet.proto == PROTO_TCP || packet.proto == PROTO_UDP {
        let Some(ports) = load::<[u16; 2]>(ctx, l4) else {
            return; // Truncated: ports stay unknown.
        };
        packet.sport = u16::from_be(ports[0]);
        packet.dport = u16::from_be(ports[1]);
    }
    // Other protocols have no ports to match.
    packet.flags = 0;
    // A GSO packet leaves as gso_segs frames, each with its own headers: charge them all.
    // Packets from a VM's tap, vhost or a packet socket with a virtio header
    // (SKB_GSO_DODGY) carry gso_segs = 0 until they are segmented: count the segments
    // from gso_size, as the kernel will.
    let (gso_segs, gso_size) = unsafe { ((*ctx.skb.skb).gso_segs, (*ctx.skb.skb).gso_size) };
    if gso_segs == 1 || (gso_segs == 0 && gso_size == 0) {
        return;
    }
    let headers = segment_headers(ctx, packet.proto, packet.dport, l4) as u64;
    let segments = if gso_segs != 0 {
        gso_segs as u64
    } else {
        // Payload / gso_size, rounded up (here gso_size > 0). `checked_div`: a plain
        // division would carry a panic path the verifier refuses.
        let payload = packet.wire_len.saturating_sub(headers);
        (payload + gso_size as u64 - 1)
            .checked_div(gso_size as u64)
            .unwrap_or(1)
    };
    if segments > 1 {
        packet.wire_len += (segments - 1) * headers;
        packet.segments = segments as u32;
    }
}

const IPPROTO_IPIP: u8 = 4;
const IPPROTO_IPV6: u8 = 41;
const IPPROTO_GRE: u8 = 47;
const VXLAN_PORT: u16 = 4789;
const GENEVE_PORT: u16 = 6081;
/// GRE's protocol for a bridged Ethernet frame (gretap, ip6gretap).
const ETH_P_TEB: u16 = 0x6558;
/// GRE flags: checksum, key and sequence number present (4 bytes each).
const GRE_CSUM: u16 = 0x8000;
const GRE_KEY: u16 = 0x2000;
const GRE_SEQ: u16 = 0x1000;

/// The bytes of headers every segment of a GSO packet carries, from the frame's start:
/// through the TCP/UDP header, and for a tunnel (VXLAN, Geneve, GRE, gretap, IPIP, SIT)
/// through the inner packet's TCP/UDP header, since each segment is encapsulated whole.
/// A header the frame does not hold ends the count where it is.
#[inline(always)]
fn segment_headers(ctx: &TcContext, proto: u8, dport: u16, l4: usize) -> usize {
    match proto {
        PROTO_UDP if dport == VXLAN_PORT => inner_ethernet(ctx, l4 + 8 + 8),
        PROTO_UDP if dport == GENEVE_PORT => {
            // Options length in 4-byte words, in the low 6 bits of the first byte.
            let options = load::<u8>(ctx, l4 + 8).map_or(0, |b| (b & 0x3f) as usize * 4);
            inner_ethernet(ctx, l4 + 8 + 8 + options)
        }
        IPPROTO_GRE => {
            let Some([flags, protocol]) = load::<[u16; 2]>(ctx, l4) else {
                return l4;
            };
            let flags = u16::from_be(flags);
            let mut inner = l4 + 4;
            for bit in [GRE_CSUM, GRE_KEY, GRE_SEQ] {
                if flags & bit != 0 {
                    inner += 4;
                }
            }
            match u16::from_be(protocol) {
                ETH_P_TEB => inner_ethernet(ctx, inner),
                ethertype => inner_ip(ctx, ethertype, inner),
            }
        }
        IPPROTO_IPIP => inner_ip(ctx, ETH_P_IP, l4),
        IPPROTO_IPV6 => inner_ip(ctx, ETH_P_IPV6, l4),
        _ => l4 + transport_header(ctx, proto, l4),
    }
}

/// TCP's header (its data offset) or UDP's; nothing for other protocols.
#[inline(always)]
fn transport_header(ctx: &TcContext, proto: u8, l4: usize) -> usize {
    match proto {
        PROTO_TCP => load::<u8>(ctx, l4 + 12).map_or(20, |b| ((b >> 4) as usize) * 4),
        PROTO_UDP => 8,
        _ => 0,
    }
}

/// Headers through the inner TCP/UDP header of a bridged frame at `at`.
#[inline(always)]
fn inner_ethernet(ctx: &TcContext, at: usize) -> usize {
    match load::<u16>(ctx, at + 12) {
        Some(ethertype) => inner_ip(ctx, u16::from_be(ethertype), at + ETH_HLEN),
        None => at,
    }
}

/// Headers through the inner TCP/UDP header of an inner IP packet at `at`.
#[inline(always)]
fn inner_ip(ctx: &TcContext, ethertype: u16, at: usize) -> usize {
    let (proto, l4) = match ethertype {
        ETH_P_IP => match load::<[u8; 10]>(ctx, at) {
            Some(header) => (header[9], at + (header[0] & 0x0f) as usize * 4),
            None => return at,
        },
        ETH_P_IPV6 => match load::<[u8; 7]>(ctx, at) {
            Some(header) => (header[6], at + 40),
            None => return at,
        },
        _ => return at,
    };
    l4 + transport_header(ctx, proto, l4)
}
