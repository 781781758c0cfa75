use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_ktime_get_ns, bpf_skb_set_tstamp},
    macros::{classifier, map},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::TcContext,
};
use aya_log_ebpf::warn;
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use shaper_common::{
    bucket::{departure, ticks, use_credit, CreditUse},
    conform,
    meter::{charged, srtcm, trtcm, Colour, METER_NONE, METER_TRTCM},
    Action, Bucket, BucketKey, ByteCost, ClassConfig, ClassMeta, ClassStats, Credit, Globals,
    RuleKey, RuleValue, Scope, Shape, CLASS_NAME_LEN, DEFAULT_FLOW_TABLE_SIZE, FAMILY_V4,
    FAMILY_V6, KEY_PORTS_UNKNOWN, KEY_PROTO_UNKNOWN, MAX_CLASSES, MAX_IPV6_EXT_HEADERS, MAX_RULES,
    MAX_SHAPES, PROTO_TCP, PROTO_UDP,
};

#[map]
static GLOBALS: Array<Globals> = Array::with_max_entries(1, 0);
#[map]
static SHAPES: Array<Shape> = Array::with_max_entries(MAX_SHAPES, 0);
#[map]
/// Not preallocated: memory follows the classes in use, not the 262 144-entry ceiling.
static RULES: HashMap<RuleKey, RuleValue> =
    HashMap::with_max_entries(MAX_RULES, aya_ebpf::bindings::BPF_F_NO_PREALLOC as u32);
#[map]
static CLASSES: Array<ClassConfig> = Array::with_max_entries(MAX_CLASSES, 0);
/// Class-scoped buckets: the GCRA word per class id.
#[map]
static CLASS_BUCKETS: Array<Bucket> = Array::with_max_entries(MAX_CLASSES, 0);
/// Flow/src/dst-scoped buckets, created on a key's first packet; userspace resizes it.
#[map]
static KEYED_BUCKETS: LruHashMap<BucketKey, Bucket> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);
#[map]
static STATS: PerCpuArray<ClassStats> = PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// Per-CPU prepaid credit on class-scoped buckets (see `shaper_common::bucket`).
#[map]
static CREDIT: PerCpuArray<Credit> = PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// Userspace bookkeeping only (names, rules); declared here so it is created and pinned
/// with the rest of the attachment's state.
#[map]
static CLASS_META: Array<ClassMeta> = Array::with_max_entries(MAX_CLASSES, 0);
/// Userspace only: class name → class id, so commands find a class without a scan.
#[map]
static CLASS_INDEX: HashMap<[u8; CLASS_NAME_LEN], u32> =
    HashMap::with_max_entries(MAX_CLASSES, aya_ebpf::bindings::BPF_F_NO_PREALLOC as u32);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88A8;
const VLAN_HLEN: usize = 4;
const MAX_VLAN_TAGS: usize = 2;
/// Compare-and-swap attempts on one bucket before the packet is judged over the rate.
const CAS_ATTEMPTS: u32 = 16;

/// What classification needs from a packet. Addresses are raw network-order words.
struct Packet {
    family: u8,
    proto: u8,
    flags: u8,
    sport: u16,
    dport: u16,
    src: [u32; 4],
    dst: [u32; 4],
    /// Bytes on the wire: skb->len plus the headers of every extra GSO segment.
    wire_len: u64,
    /// Offset of the IP header, and whether its first bytes could be read (for rewrites).
    l3: usize,
    ip_readable: bool,
}

/// The bucket's answer for one packet.
enum Verdict {
    /// Within the rate; the bucket is now `occupancy` ticks deep (0 = full, tolerance = empty).
    Within { occupancy: u64 },
    /// Over the rate; the bucket is unchanged.
    Exceed,
}

#[classifier]
pub fn shaper(ctx: TcContext) -> i32 {
    run(&ctx, unsafe { bpf_ktime_get_ns() })
}

/// The same program with the clock taken from `skb->tstamp`, so BPF_PROG_TEST_RUN can
/// check the bucket against the host model packet by packet. Never attached.
#[classifier]
pub fn shaper_clocked(ctx: TcContext) -> i32 {
    let now = unsafe { (*ctx.skb.skb).tstamp };
    run(&ctx, now)
}

/// The per-packet cost floor for benchmarks: an empty classifier in the same object.
#[classifier]
pub fn shaper_floor(_ctx: TcContext) -> i32 {
    TC_ACT_OK as i32
}

#[inline(always)]
fn run(ctx: &TcContext, now: u64) -> i32 {
    let Some(packet) = parse(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let Some(class_id) = classify(&packet) else {
        return TC_ACT_UNSPEC;
    };
    let Some(class) = CLASSES.get(class_id) else {
        return TC_ACT_UNSPEC;
    };
    if class.in_use == 0 {
        return TC_ACT_UNSPEC;
    }
    if class.action == Action::Shape as u8 {
        return shape(ctx, class_id, class, &packet, now);
    }
    if class.meter != METER_NONE {
        return meter(ctx, class_id, class, &packet, now);
    }
    let verdict = charge_bucket(ctx, class_id, class, &packet, now);
    act(ctx, class_id, class, verdict, &packet)
}

// ---------------------------------------------------------------------------------------
// parse

/// Reads a header field: straight from the linear packet data when it is there (the
/// common case, and several times cheaper than a helper call), else through
/// bpf_skb_load_bytes, which also sees non-linear data. None when the packet is shorter.
#[inline(always)]
fn load<T: Copy>(ctx: &TcContext, offset: usize) -> Option<T> {
    // Bounded for the verifier; no header shaper reads lies beyond 16 KiB.
    let offset = offset & 0x3fff;
    // black_box keeps LLVM from re-associating `data + offset + size`: the verifier must
    // see the bounds check made on the very pointer that is then read.
    let field = core::hint::black_box(ctx.data() + offset);
    if field + core::mem::size_of::<T>() <= ctx.data_end() {
        Some(unsafe { core::ptr::read_unaligned(field as *const T) })
    } else {
        ctx.load::<T>(offset).ok()
    }
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Packet> {
    let mut ethertype = u16::from_be(load::<u16>(ctx, 12)?);
    let mut l3 = ETH_HLEN;
    for _ in 0..MAX_VLAN_TAGS {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        ethertype = u16::from_be(load::<u16>(ctx, l3 + 2)?);
        l3 += VLAN_HLEN;
    }
    let skb_len = ctx.len() as u64;
    let mut packet = Packet {
        family: 0,
        proto: 0,
        flags: KEY_PORTS_UNKNOWN | KEY_PROTO_UNKNOWN,
        sport: 0,
        dport: 0,
        src: [0; 4],
        dst: [0; 4],
        wire_len: skb_len,
        l3,
        ip_readable: false,
    };
    let l4 = match ethertype {
        ETH_P_IP => parse_ipv4(ctx, l3, &mut packet),
        ETH_P_IPV6 => parse_ipv6(ctx, l3, &mut packet),
        _ => return None,
    };
    if let Some(l4) = l4 {
        parse_l4(ctx, l4, &mut packet);
    }
    Some(packet)
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
            // Hop-by-hop, routing, destination options: length in 8-byte units after the first 8.
            0 | 43 | 60 => {
                let ext = load::<[u8; 2]>(ctx, offset)?;
                next_header = ext[0];
                offset += (ext[1] as usize + 1) * 8;
            }
            // Fragment header: fixed 8 bytes; a non-zero offset means no L4 header here.
            44 => {
                let ext = load::<[u8; 4]>(ctx, offset)?;
                next_header = ext[0];
                if (u16::from_be_bytes([ext[2], ext[3]]) >> 3) != 0 {
                    first_fragment = false;
                }
                offset += 8;
            }
            // Authentication header: length in 4-byte units, minus 2.
            51 => {
                let ext = load::<[u8; 2]>(ctx, offset)?;
                next_header = ext[0];
                offset += (ext[1] as usize + 2) * 4;
            }
            _ => {
                packet.proto = next_header;
                packet.flags = KEY_PORTS_UNKNOWN;
                return if first_fragment { Some(offset) } else { None };
            }
        }
    }
    // The chain is longer than we walk: the protocol stays unknown.
    None
}

#[inline(always)]
fn parse_l4(ctx: &TcContext, l4: usize, packet: &mut Packet) {
    if packet.proto != PROTO_TCP && packet.proto != PROTO_UDP {
        // Other protocols have no ports to match.
        packet.flags = 0;
        return;
    }
    let Some(ports) = load::<[u16; 2]>(ctx, l4) else {
        return; // Truncated: ports stay unknown.
    };
    packet.sport = u16::from_be(ports[0]);
    packet.dport = u16::from_be(ports[1]);
    packet.flags = 0;
    // A GSO packet leaves as gso_segs frames, each with its own headers: charge them all.
    let segments = unsafe { (*ctx.skb.skb).gso_segs } as u64;
    if segments > 1 {
        let l4_header = if packet.proto == PROTO_TCP {
            load::<u8>(ctx, l4 + 12).map_or(20, |b| ((b >> 4) as usize) * 4)
        } else {
            8
        };
        packet.wire_len += (segments - 1) * (l4 + l4_header) as u64;
    }
}

// ---------------------------------------------------------------------------------------
// classify

#[inline(always)]
fn masked(value: [u32; 4], mask: [u32; 4]) -> [u32; 4] {
    [
        value[0] & mask[0],
        value[1] & mask[1],
        value[2] & mask[2],
        value[3] & mask[3],
    ]
}

#[inline(always)]
fn classify(packet: &Packet) -> Option<u32> {
    let shape_count = GLOBALS.get(0)?.shape_count;
    let mut best_class = 0u32;
    let mut best_rank = u64::MAX;
    for index in 0..MAX_SHAPES {
        if index >= shape_count {
            break;
        }
        let Some(shape) = SHAPES.get(index) else {
            break;
        };
        if shape.in_use == 0 {
            continue;
        }
        let key = RuleKey {
            shape: index as u16,
            family: if shape.match_family != 0 {
                packet.family
            } else {
                0
            },
            proto: if shape.match_proto != 0 {
                packet.proto
            } else {
                0
            },
            flags: packet.flags,
            _pad: [0; 3],
            sport: packet.sport & shape.sport_mask,
            dport: packet.dport & shape.dport_mask,
            src: masked(packet.src, shape.src_mask),
            dst: masked(packet.dst, shape.dst_mask),
        };
        if let Some(hit) = unsafe { RULES.get(&key) } {
            if hit.rank < best_rank {
                best_rank = hit.rank;
                best_class = hit.class_id;
            }
        }
    }
    if best_rank == u64::MAX {
        None
    } else {
        Some(best_class)
    }
}

// ---------------------------------------------------------------------------------------
// bucket

#[inline(always)]
fn bucket_of(class_id: u32, class: &ClassConfig, packet: &Packet) -> Option<*mut Bucket> {
    match Scope::from_u8(class.scope) {
        Some(Scope::Class) | None => CLASS_BUCKETS.get_ptr_mut(class_id),
        Some(scope) => keyed_bucket(class_id, class.generation, scope, packet),
    }
}

#[inline(always)]
fn charge_bucket(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    now: u64,
) -> Verdict {
    // Userspace sets a chunk only on class-scoped buckets that need no occupancy (not ecn).
    if class.credit_chunk != 0 {
        if let (Some(bucket), Some(credit)) = (
            CLASS_BUCKETS.get_ptr_mut(class_id),
            CREDIT.get_ptr_mut(class_id),
        ) {
            return charge_with_credit(
                unsafe { &raw mut (*bucket).tat },
                unsafe { &mut *credit },
                class,
                now,
                packet.wire_len,
            );
        }
    }
    match bucket_of(class_id, class, packet) {
        Some(bucket) => charge(
            unsafe { &raw mut (*bucket).tat },
            now,
            packet.wire_len,
            &class.cost,
        ),
        // The LRU could not hold a new bucket (every entry busy on other CPUs): fail open.
        None => {
            warn!(
                ctx,
                "class {}: no room for a new bucket in the flow table; packet passed", class_id
            );
            Verdict::Within { occupancy: 0 }
        }
    }
}

#[inline(always)]
fn keyed_bucket(
    class_id: u32,
    generation: u32,
    scope: Scope,
    packet: &Packet,
) -> Option<*mut Bucket> {
    let mut key = BucketKey {
        class_id,
        generation,
        family: packet.family,
        ..BucketKey::default()
    };
    match scope {
        Scope::Src => key.src = packet.src,
        Scope::Dst => key.dst = packet.dst,
        _ => {
            key.proto = packet.proto;
            key.sport = packet.sport;
            key.dport = packet.dport;
            key.src = packet.src;
            key.dst = packet.dst;
        }
    }
    if let Some(word) = KEYED_BUCKETS.get_ptr_mut(&key) {
        return Some(word);
    }
    // A fresh bucket is full: tat = 0 is "long ago". NOEXIST keeps a racing CPU's bucket.
    let fresh = Bucket::default();
    let _ = KEYED_BUCKETS.insert(&key, &fresh, aya_ebpf::bindings::BPF_NOEXIST as u64);
    KEYED_BUCKETS.get_ptr_mut(&key)
}

/// Spends this CPU's credit, taking a chunk (or what is missing) from the shared bucket
/// when it runs short; the occupancy reported is 0 (unused by the actions that get here).
#[inline(always)]
fn charge_with_credit(
    word: *mut u64,
    credit: &mut Credit,
    class: &ClassConfig,
    now: u64,
    bytes: u64,
) -> Verdict {
    if credit.generation != class.generation || credit.epoch != class.credit_epoch {
        // Credit of a deleted class, or taken before a rate or burst change.
        *credit = Credit {
            bytes: 0,
            generation: class.generation,
            epoch: class.credit_epoch,
        };
    }
    match use_credit(credit.bytes, bytes, class.credit_chunk as u64) {
        CreditUse::Covered { left } => {
            credit.bytes = left;
            Verdict::Within { occupancy: 0 }
        }
        CreditUse::Take { first, fallback } => {
            let mut take = first;
            for _ in 0..2 {
                if let Verdict::Within { .. } = charge(word, now, take, &class.cost) {
                    credit.bytes = credit.bytes + take - bytes;
                    return Verdict::Within { occupancy: 0 };
                }
                if take == fallback {
                    break;
                }
                take = fallback;
            }
            Verdict::Exceed
        }
    }
}

/// Applies [`conform`] to the bucket word with compare-and-swap, so concurrent CPUs
/// never admit more than the bucket holds.
#[inline(always)]
fn charge(word: *mut u64, now: u64, bytes: u64, cost: &ByteCost) -> Verdict {
    for _ in 0..CAS_ATTEMPTS {
        let tat = unsafe { core::ptr::read_volatile(word) };
        let Some(next) = conform(tat, now, bytes, cost) else {
            return Verdict::Exceed;
        };
        if swap(word, tat, next) {
            return Verdict::Within {
                occupancy: next - ticks(now),
            };
        }
    }
    Verdict::Exceed
}

// ---------------------------------------------------------------------------------------
// act

/// Applies an over-rate action; `Some(marked)` when the packet passes, `None` to drop.
#[inline(always)]
fn apply(ctx: &TcContext, packet: &Packet, action: u8, arg: u32, mask: u32) -> Option<bool> {
    if action == Action::Pass as u8 {
        Some(true)
    } else if action == Action::Dscp as u8 {
        set_dscp(ctx, packet, arg as u8);
        Some(true)
    } else if action == Action::Fwmark as u8 {
        let mark = unsafe { (*ctx.skb.skb).mark };
        ctx.set_mark((mark & !mask) | arg);
        Some(true)
    } else {
        None
    }
}

#[inline(always)]
fn count_pass(stats: &mut ClassStats, bytes: u64, marked: bool) -> i32 {
    stats.passed_packets += 1;
    stats.passed_bytes += bytes;
    if marked {
        stats.marked_packets += 1;
        stats.marked_bytes += bytes;
    }
    TC_ACT_UNSPEC
}

#[inline(always)]
fn count_drop(stats: &mut ClassStats, bytes: u64) -> i32 {
    stats.dropped_packets += 1;
    stats.dropped_bytes += bytes;
    TC_ACT_SHOT as i32
}

#[inline(always)]
fn act(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    verdict: Verdict,
    packet: &Packet,
) -> i32 {
    let Some(stats) = STATS.get_ptr_mut(class_id) else {
        return TC_ACT_UNSPEC;
    };
    let stats = unsafe { &mut *stats };
    let bytes = packet.wire_len;
    match verdict {
        // ECN: CE-mark early, once the bucket is more than half drained, so ECN-capable
        // TCP backs off before anything has to be dropped.
        Verdict::Within { occupancy } => {
            let marked = class.action == Action::Ecn as u8
                && occupancy > class.cost.tolerance_ticks / 2
                && set_ecn_ce(ctx, packet);
            count_pass(stats, bytes, marked)
        }
        // Drop, and ECN once the bucket is empty: policing stays exact.
        Verdict::Exceed => match apply(
            ctx,
            packet,
            class.action,
            class.action_arg,
            class.action_mask,
        ) {
            Some(marked) => count_pass(stats, bytes, marked),
            None => count_drop(stats, bytes),
        },
    }
}

// ---------------------------------------------------------------------------------------
// meters (RFC 2697 srTCM, RFC 2698 trTCM, colour-blind)

#[inline(always)]
fn meter(ctx: &TcContext, class_id: u32, class: &ClassConfig, packet: &Packet, now: u64) -> i32 {
    let Some(stats) = STATS.get_ptr_mut(class_id) else {
        return TC_ACT_UNSPEC;
    };
    let stats = unsafe { &mut *stats };
    let bytes = packet.wire_len;
    let colour = match bucket_of(class_id, class, packet) {
        Some(bucket) => colour_of(bucket, class, bytes, now),
        None => Colour::Green, // no room for a bucket: fail open, as for policing
    };
    let (action, arg, mask) = match colour {
        Colour::Green => {
            stats.green_packets += 1;
            stats.green_bytes += bytes;
            return count_pass(stats, bytes, false);
        }
        Colour::Yellow => {
            stats.yellow_packets += 1;
            stats.yellow_bytes += bytes;
            (class.exceed_action, class.exceed_arg, class.exceed_mask)
        }
        Colour::Red => {
            stats.red_packets += 1;
            stats.red_bytes += bytes;
            (class.action, class.action_arg, class.action_mask)
        }
    };
    // ECN on a meter colour: CE-mark ECN-capable packets, drop the rest.
    let outcome = if action == Action::Ecn as u8 {
        if set_ecn_ce(ctx, packet) {
            Some(true)
        } else {
            None
        }
    } else {
        apply(ctx, packet, action, arg, mask)
    };
    match outcome {
        Some(marked) => count_pass(stats, bytes, marked),
        None => count_drop(stats, bytes),
    }
}

/// The colour of one packet; each of the meter's two words changes by compare-and-swap.
/// Under contention a packet whose first word was charged but whose second changed
/// meanwhile keeps the lesser colour: no bucket ever admits more than it holds.
#[inline(always)]
fn colour_of(bucket: *mut Bucket, class: &ClassConfig, bytes: u64, now: u64) -> Colour {
    let first = unsafe { &raw mut (*bucket).tat };
    let second = unsafe { &raw mut (*bucket).tat2 };
    let trtcm_meter = class.meter == METER_TRTCM;
    for _ in 0..CAS_ATTEMPTS {
        let (a, b) = unsafe {
            (
                core::ptr::read_volatile(first),
                core::ptr::read_volatile(second),
            )
        };
        if trtcm_meter {
            // Words: (C, P). P decides red; C decides green.
            let (colour, new_p, new_c) = trtcm(b, a, now, bytes, &class.peak_cost, &class.cost);
            if colour == Colour::Red {
                return Colour::Red;
            }
            if !swap(second, b, new_p) {
                continue;
            }
            if colour == Colour::Green && swap(first, a, new_c) {
                return Colour::Green;
            }
            return Colour::Yellow;
        }
        // srTCM. Words: (C, total).
        let (colour, new_c, new_total) = srtcm(a, b, now, bytes, &class.cost, &class.peak_cost);
        match colour {
            Colour::Red => return Colour::Red,
            Colour::Yellow => {
                if swap(second, b, new_total) {
                    return Colour::Yellow;
                }
            }
            Colour::Green => {
                if swap(first, a, new_c) {
                    // Green always deepens the total too; retry only that word.
                    let cost = class.cost.ticks_for(bytes);
                    let mut total = b;
                    for _ in 0..CAS_ATTEMPTS {
                        if swap(second, total, charged(total, now, cost)) {
                            break;
                        }
                        total = unsafe { core::ptr::read_volatile(second) };
                    }
                    return Colour::Green;
                }
            }
        }
    }
    Colour::Red
}

#[inline(always)]
fn swap(word: *mut u64, old: u64, new: u64) -> bool {
    let (_, swapped) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(word, old, new)
    };
    swapped
}

// ---------------------------------------------------------------------------------------
// shape

const NANOS_PER_MILLI: u64 = 1_000_000;
/// BPF_SKB_TSTAMP_DELIVERY_MONO (uapi bpf.h): the tstamp is a monotonic departure time.
const SKB_TSTAMP_DELIVERY_MONO: u32 = 1;

/// `shape`: with an HTB class id in `action_arg`, steer the packet into shaper's HTB class
/// (skb->priority, so no tc filter runs); without one, pace it by earliest departure time
/// (skb->tstamp, for the fq qdisc), dropping what would leave beyond the horizon
/// (`action_mask` milliseconds).
#[inline(always)]
fn shape(ctx: &TcContext, class_id: u32, class: &ClassConfig, packet: &Packet, now: u64) -> i32 {
    let Some(stats) = STATS.get_ptr_mut(class_id) else {
        return TC_ACT_UNSPEC;
    };
    let stats = unsafe { &mut *stats };
    if class.action_arg != 0 {
        unsafe { (*ctx.skb.skb).priority = class.action_arg };
    } else {
        let horizon = ticks(class.action_mask as u64 * NANOS_PER_MILLI);
        let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(class_id) else {
            return TC_ACT_UNSPEC;
        };
        let word = unsafe { &raw mut (*bucket).tat };
        match schedule(word, now, packet.wire_len, &class.cost, horizon) {
            Some(leave_at) => unsafe {
                bpf_skb_set_tstamp(ctx.skb.skb, leave_at, SKB_TSTAMP_DELIVERY_MONO);
            },
            None => {
                warn!(
                    ctx,
                    "class {}: departure beyond the {} ms horizon; packet dropped",
                    class_id,
                    class.action_mask
                );
                stats.dropped_packets += 1;
                stats.dropped_bytes += packet.wire_len;
                return TC_ACT_SHOT as i32;
            }
        }
    }
    stats.passed_packets += 1;
    stats.passed_bytes += packet.wire_len;
    TC_ACT_UNSPEC
}

/// [`departure`] on the bucket word with compare-and-swap; the departure time in ns.
#[inline(always)]
fn schedule(word: *mut u64, now: u64, bytes: u64, cost: &ByteCost, horizon: u64) -> Option<u64> {
    for _ in 0..CAS_ATTEMPTS {
        let tat = unsafe { core::ptr::read_volatile(word) };
        let (next, leave_at) = departure(tat, now, bytes, cost, horizon)?;
        if swap(word, tat, next) {
            return Some(leave_at);
        }
    }
    None
}

const IPV4_CHECKSUM_OFFSET: usize = 10;
const ECN_MASK: u8 = 0x03;
const ECN_CE: u8 = 0x03;

/// Sets ECN CE on an ECN-capable packet (ECT(0)/ECT(1), or already CE); false when the
/// packet is not ECN-capable.
#[inline(always)]
fn set_ecn_ce(ctx: &TcContext, packet: &Packet) -> bool {
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
fn set_dscp(ctx: &TcContext, packet: &Packet, dscp: u8) {
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
