//! Rewrites of the IP header: ECN CE and DSCP, with IPv4's checksum kept right.

use crate::parse::{load, Packet};
use aya_ebpf::programs::TcContext;
use shaper_common::{FAMILY_V4, FAMILY_V6};

const IPV4_CHECKSUM_OFFSET: usize = 10;
const ECN_MASK: u8 = 0x03;
const ECN_CE: u8 = 0x03;

/// Sets ECN CE on an ECN-capable packet (ECT(0)/ECT(1), or already CE); false when the
/// packet is not ECN-capable.
#[inline(always)]
pub(crate) fn set_ecn_ce(ctx: &TcContext, packet: &Packet) -> bool {
    if !packet.ip_readable {
        return false;
    }
    rewrite_traffic_class(ctx, packet, |tc| {
        if tc & ECN_MASK == 0 {
            None
        } else {
            Some(tc | ECN_CE)
        }
    })
}

/// Rewrites the DSCP (upper six bits of the IPv4 TOS / IPv6 traffic class), keeping ECN.
#[inline(always)]
pub(crate) fn set_dscp(ctx: &TcContext, packet: &Packet, dscp: u8) {
    if packet.ip_readable {
        rewrite_traffic_class(ctx, packet, |tc| Some((dscp << 2) | (tc & ECN_MASK)));
    }
}

/// Applies `change` to the packet's TOS / traffic class byte; IPv4's header checksum is
/// updated incrementally. Returns false when `change` declines or the write fails.
#[inline(always)]
fn rewrite_traffic_class(
    ctx: &TcContext,
    packet: &Packet,
    change: impl Fn(u8) -> Option<u8>,
) -> bool {
    // A frame that is not IP (a class without rules sees those too) has no such field.
    if packet.family != FAMILY_V4 && packet.family != FAMILY_V6 {
        return false;
    }
    let Some(head) = load::<[u8; 2]>(ctx, packet.l3) else {
        return false;
    };
    if packet.family == FAMILY_V4 {
        let Some(tos) = change(head[1]) else {
            return false;
        };
        if tos == head[1] {
            return true;
        }
        let old = u16::from_ne_bytes(head) as u64;
        let new = u16::from_ne_bytes([head[0], tos]) as u64;
        ctx.l3_csum_replace(packet.l3 + IPV4_CHECKSUM_OFFSET, old, new, 2)
            .is_ok()
            && ctx.store(packet.l3 + 1, &tos, 0).is_ok()
    } else {
        // Version (4 bits), traffic class (8 bits) straddling bytes 0 and 1; no checksum.
        let tc = (head[0] << 4) | (head[1] >> 4);
        let Some(new_tc) = change(tc) else {
            return false;
        };
        let new = [
            (head[0] & 0xf0) | (new_tc >> 4),
            (new_tc << 4) | (head[1] & 0x0f),
        ];
        ctx.store(packet.l3, &new, 0).is_ok()
    }
}
