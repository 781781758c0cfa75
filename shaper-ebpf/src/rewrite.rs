//! Rewrites of the IP header: ECN CE and DSCP, with IPv4's checksum and a received
//! packet's full checksum (CHECKSUM_COMPLETE) kept right.

use crate::parse::{load, Packet};
use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};
use shaper_common::{FAMILY_V4, FAMILY_V6};

const IPV4_CHECKSUM_OFFSET: usize = 10;
const ECN_MASK: u8 = 0x03;
const ECN_CE: u8 = 0x03;

/// Sets ECN CE on an ECN-capable packet (ECT(0)/ECT(1), or already CE); false when the
/// packet is not ECN-capable.
#[inline(always)]
pub(crate) fn set_ecn_ce(ctx: &TcContext, packet: &Packet) -> bool {
    rewrite_traffic_class(ctx, packet, |tc| {
        if tc & ECN_MASK == 0 {
            None
        } else {
            Some(tc | ECN_CE)
        }
    })
}

/// Whether the packet is ECN-capable (ECT(0)/ECT(1), or already CE): what
/// [`set_ecn_ce`] would mark. Reads the header only.
#[inline(always)]
pub(crate) fn ecn_capable(ctx: &TcContext, packet: &Packet) -> bool {
    traffic_class(ctx, packet).is_some_and(|(_, tc)| tc & ECN_MASK != 0)
}

/// The IP header's first two bytes and the TOS / traffic class byte in them; `None` for
/// a frame that is not IP (a class without rules sees those too) or a header that cannot
/// be read.
#[inline(always)]
fn traffic_class(ctx: &TcContext, packet: &Packet) -> Option<([u8; 2], u8)> {
    if !packet.ip_readable || (packet.family != FAMILY_V4 && packet.family != FAMILY_V6) {
        return None;
    }
    let head = load::<[u8; 2]>(ctx, packet.l3)?;
    // IPv6: version (4 bits), then the traffic class straddling bytes 0 and 1.
    let tc = if packet.family == FAMILY_V4 {
        head[1]
    } else {
        (head[0] << 4) | (head[1] >> 4)
    };
    Some((head, tc))
}

/// Rewrites the DSCP (upper six bits of the IPv4 TOS / IPv6 traffic class), keeping ECN.
#[inline(always)]
pub(crate) fn set_dscp(ctx: &TcContext, packet: &Packet, dscp: u8) {
    rewrite_traffic_class(ctx, packet, |tc| Some((dscp << 2) | (tc & ECN_MASK)));
}

/// Applies `change` to the packet's TOS / traffic class byte; IPv4's header checksum is
/// updated incrementally. Returns false when `change` declines or the write fails.
#[inline(always)]
fn rewrite_traffic_class(
    ctx: &TcContext,
    packet: &Packet,
    change: impl Fn(u8) -> Option<u8>,
) -> bool {
    let Some((head, tc)) = traffic_class(ctx, packet) else {
        return false;
    };
    let Some(new_tc) = change(tc) else {
        return false;
    };
    if packet.family == FAMILY_V4 {
        if new_tc == tc {
            return true;
        }
        let old = u16::from_ne_bytes(head) as u64;
        let new = u16::from_ne_bytes([head[0], new_tc]) as u64;
        ctx.l3_csum_replace(packet.l3 + IPV4_CHECKSUM_OFFSET, old, new, 2)
            .is_ok()
            && ctx.store(packet.l3 + 1, &new_tc, 0).is_ok()
    } else {
        // No header checksum in IPv6, but a packet received with CHECKSUM_COMPLETE (many
        // NICs, on ingress) carries the sum of its bytes in skb->csum: the flag has the
        // helper take the old bytes out of it and the new ones in (a no-op otherwise).
        let new = [
            (head[0] & 0xf0) | (new_tc >> 4),
            (new_tc << 4) | (head[1] & 0x0f),
        ];
        ctx.store(packet.l3, &new, BPF_F_RECOMPUTE_CSUM as u64)
            .is_ok()
    }
}
