//! shaper's TC classifier, read as parse → classify → bucket → act.
//!
//! One object, attached once per interface and direction. [`run`] is the packet path:
//! 1. [`parse`]: Ethernet (up to two VLAN tags), IPv4 (options) or IPv6 (bounded walk over
//!    extension headers), TCP/UDP ports. Non-IP frames pass untouched.
//! 2. [`classify`]: tuple-space search — one exact-match hash lookup per distinct rule
//!    shape (`SHAPES`), never a scan over classes; the lowest rank wins.
//! 3. [`bucket`]: GCRA (one u64 per bucket, updated by compare-and-swap) from
//!    shaper-common, per class (`CLASS_BUCKETS`, with per-CPU credit) or per flow/src/dst
//!    (`KEYED_BUCKETS`, LRU, lazily created).
//! 4. [`act`]: within the rate → pass; over it → the class's action (drop, ECN, DSCP and
//!    fwmark via [`rewrite`]). Meters ([`meter`]), shaping ([`shape`]) and classes with a
//!    parent ([`tree`]) take their own path after classification.
//!
//! The maps are in [`maps`]. On the host this crate compiles to an empty program so
//! workspace tooling works.
#![cfg_attr(
    target_arch = "bpf",
    no_std,
    no_main,
    feature(core_intrinsics, asm_experimental_arch)
)]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
mod act;
#[cfg(target_arch = "bpf")]
mod bucket;
#[cfg(target_arch = "bpf")]
mod classify;
#[cfg(target_arch = "bpf")]
mod fair;
#[cfg(target_arch = "bpf")]
mod flows;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod meter;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod rewrite;
#[cfg(target_arch = "bpf")]
mod shape;
#[cfg(target_arch = "bpf")]
mod tree;

#[cfg(target_arch = "bpf")]
mod entry {
    use crate::{
        act::act,
        bucket::charge_bucket,
        classify::classify,
        flows::judge_flow,
        maps::{CLASSES, SHAPE_PACKET, SHARES, SPLIT_TO},
        meter::meter,
        parse::{parse, Packet},
        shape::shape,
        tree::charge_tree,
    };
    use aya_ebpf::{
        bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
        helpers::{bpf_ktime_get_ns, bpf_redirect},
        macros::classifier,
        programs::TcContext,
    };
    use shaper_common::{
        meter::METER_NONE, Action, ClassConfig, SPLIT_BACK, SPLIT_EGRESS, SPLIT_MARK,
    };

    #[classifier]
    pub fn shaper(ctx: TcContext) -> i32 {
        split(run::<false, false, true>(&ctx))
    }

    /// A packet the hook lets pass goes to the attachment's splitting ifb, if it has one
    /// (`SPLIT_TO`, ingress on Ethernet only): the ifb cuts a GSO/GRO aggregate into
    /// wire-size segments and hands them back to this interface past the hook, so an
    /// egress shape class downstream judges segments, not 64 KiB at once. Every packet
    /// goes, not only aggregates, to keep each flow in order.
    #[inline(always)]
    fn split(verdict: i32) -> i32 {
        if verdict != TC_ACT_OK as i32 && verdict != TC_ACT_UNSPEC {
            return verdict;
        }
        match SPLIT_TO.get(0) {
            Some(&ifb) if ifb != 0 && ifb & SPLIT_EGRESS == 0 => unsafe {
                bpf_redirect(ifb, 0) as i32
            },
            _ => verdict,
        }
    }

    /// The egress splitter (`program_names::SPLITTER`): in the clsact hook after
    /// `shaper`, which passes it only what no class took and the packets it marked. It
    /// matches those (-1: the filter's own class, so its mirred action runs): a packet
    /// sent to be split is redirected to the ifb; one back from it (`SPLIT_BACK`) finds
    /// the action skipped by the ifb's `tc_skip_classify`, which that clears, and leaves
    /// unmarked. Anything else: no match (0).
    #[classifier]
    pub fn shaper_splitter(ctx: TcContext) -> i32 {
        let skb = ctx.skb.skb;
        match unsafe { (*skb).tc_index } {
            SPLIT_MARK => -1,
            SPLIT_BACK => {
                unsafe { (*skb).tc_index = 0 };
                -1
            }
            _ => 0,
        }
    }

    /// Where a shape class's packet stands with the egress splitter.
    #[derive(PartialEq, Eq)]
    enum Splitting {
        /// Judged here as any packet.
        No,
        /// Marked and handed on to the splitter, unjudged.
        Send,
        /// Back from the splitter's ifb: judged here.
        Back,
    }

    /// A forwarded packet (GRO on the way in, a VM's or pod's TSO make aggregates of
    /// them) in a shape class of an egress attachment whose splitter is on is marked and
    /// handed on to the splitter, which redirects it to an ifb that cuts aggregates into
    /// wire-size segments and sends them back out of this interface, where this program
    /// judges each one. A class that judges a 64 KiB aggregate whole costs the sender up
    /// to 44 segments per drop (BBR beside a flood, 0.40-0.44 of its share) and queues
    /// it at once. Single frames go too: a flow's frames overtaking its aggregates in the
    /// ifb's queue reorder it (Cubic beside a flood over 40 ms fell to 0.036 when only
    /// aggregates went).
    #[inline(always)]
    fn splitting(ctx: &TcContext, class: &ClassConfig) -> Splitting {
        let skb = ctx.skb.skb;
        let splitter = match SPLIT_TO.get(0) {
            Some(&to) if to & SPLIT_EGRESS != 0 => to & !SPLIT_EGRESS,
            _ => 0,
        };
        let from = unsafe { (*skb).ingress_ifindex };
        if unsafe { (*skb).tc_index } == SPLIT_MARK {
            // Back only from this attachment's splitter (the ifb hands it back as its
            // own); a mark from anywhere else (another host's, a veth crossed) is stale.
            unsafe { (*skb).tc_index = 0 };
            if splitter != 0 && from == splitter {
                return Splitting::Back;
            }
        }
        // Aggregates this host's sockets built are capped where they are made
        // (`gso_max_segs`); only forwarded ones come in whole.
        if splitter == 0 || from == 0 {
            return Splitting::No;
        }
        unsafe { (*skb).tc_index = SPLIT_MARK };
        // Should no splitter take it (its filter removed behind shaper's back, a program
        // or filter before it that lets it go), HTB still holds it to the class's rate.
        if class.action_arg != 0 {
            unsafe { (*skb).priority = class.action_arg };
        }
        Splitting::Send
    }

    /// A packet back from the splitter: one let pass goes on to the splitter's filter
    /// (`SPLIT_BACK`), whose skipped action clears the ifb's `tc_skip_classify`.
    #[inline(always)]
    fn back_from_splitter(ctx: &TcContext, verdict: i32) -> i32 {
        let skb = ctx.skb.skb;
        if verdict == TC_ACT_SHOT as i32 {
            unsafe { (*skb).tc_index = 0 };
            return verdict;
        }
        unsafe { (*skb).tc_index = SPLIT_BACK };
        TC_ACT_UNSPEC
    }

    /// The same for devices that carry bare IP packets (no link-layer header).
    #[classifier]
    pub fn shaper_l3(ctx: TcContext) -> i32 {
        run::<true, false, true>(&ctx)
    }

    /// The same program with the clock taken from `skb->tstamp`, so BPF_PROG_TEST_RUN can
    /// check the bucket against the host model packet by packet. Never attached.
    #[classifier]
    pub fn shaper_clocked(ctx: TcContext) -> i32 {
        run::<false, true, true>(&ctx)
    }

    /// The same program with every packet missing the verdict cache, for benchmarks (a
    /// test run repeats one frame, which the cache would serve). Never attached.
    #[classifier]
    pub fn shaper_uncached(ctx: TcContext) -> i32 {
        run::<false, false, false>(&ctx)
    }

    /// The per-packet cost floor for benchmarks: an empty classifier in the same object.
    #[classifier]
    pub fn shaper_floor(_ctx: TcContext) -> i32 {
        TC_ACT_OK as i32
    }

    /// The floor plus one read of the clock the packet path uses: what that read costs,
    /// for the benchmarks' stage-by-stage breakdown.
    #[classifier]
    pub fn shaper_floor_clock(_ctx: TcContext) -> i32 {
        core::hint::black_box(unsafe { bpf_ktime_get_ns() });
        TC_ACT_OK as i32
    }

    /// Installs a global class's floor once its share has expired (one subprogram: a
    /// global class pays for it, every other class reads one flag).
    #[inline(never)]
    fn expire_share(class_id: u32, now: u64) -> u64 {
        let (Some(share), Some(config)) =
            (SHARES.get_ptr_mut(class_id), CLASSES.get_ptr_mut(class_id))
        else {
            return 0;
        };
        let share = unsafe { &mut *share };
        if !share.expired(now) {
            return 0;
        }
        share.install_floor(unsafe { &mut *config });
        share.expires_ns = 0;
        1
    }

    /// The packet path's clock: CLOCK_MONOTONIC, or `skb->tstamp` for test runs.
    #[inline(always)]
    fn clock<const FROM_SKB: bool>(ctx: &TcContext) -> u64 {
        if FROM_SKB {
            unsafe { (*ctx.skb.skb).tstamp }
        } else {
            unsafe { bpf_ktime_get_ns() }
        }
    }

    #[inline(always)]
    fn run<const BARE_IP: bool, const CLOCK_FROM_SKB: bool, const CACHED: bool>(
        ctx: &TcContext,
    ) -> i32 {
        // The packet lives in memory, not registers: parsed into a per-CPU map slot and
        // read from there, its fields are unknown to the verifier, so the many paths out
        // of the parser (VLAN tags, families, extension headers, flags) reach the rest of
        // the program in one state, verified once rather than once per path.
        let Some(slot) = SHAPE_PACKET.get_ptr_mut(0) else {
            return TC_ACT_UNSPEC;
        };
        let packet: &mut Packet = unsafe { &mut *slot };
        parse::<BARE_IP>(ctx, packet);
        let packet: &Packet = packet;
        let Some(class_id) = classify::<CACHED>(packet) else {
            return TC_ACT_UNSPEC;
        };
        let Some(class_slot) = CLASSES.get_ptr_mut(class_id) else {
            return TC_ACT_UNSPEC;
        };
        // The clock is read only where a class needs it (about 36 ns here): never for
        // traffic no class takes, nor for a packet this CPU's credit covers.
        // A global class whose daemon stopped renewing its share falls to its floor here,
        // before anything reads the costs; it reads the clock for that, once.
        let global_now =
            if unsafe { core::ptr::read_volatile(&raw const (*class_slot).global) } != 0 {
                let now = clock::<CLOCK_FROM_SKB>(ctx);
                expire_share(class_id, now);
                now
            } else {
                0
            };
        let now = || {
            if global_now != 0 {
                global_now
            } else {
                clock::<CLOCK_FROM_SKB>(ctx)
            }
        };
        let class = unsafe { &*class_slot };
        if class.in_use == 0 {
            return TC_ACT_UNSPEC;
        }
        if class.action == Action::Shape as u8 {
            let splitting = splitting(ctx, class);
            if splitting == Splitting::Send {
                return TC_ACT_UNSPEC;
            }
            // The shape path (trees included) reads the packet from the slot; its flow's
            // entry and own queue first, each a subprogram beside `shape`, not below it.
            let now = now();
            let flow = judge_flow(class_id, class, now);
            let verdict = shape(ctx, class_id, class, now, flow);
            return match splitting {
                Splitting::Back => back_from_splitter(ctx, verdict),
                _ => verdict,
            };
        }
        if class.parent != 0 {
            // A class in a tree (policing actions): its walk reads the packet from the slot.
            return charge_tree(ctx, class_id, now());
        }
        if class.meter != METER_NONE {
            return meter(ctx, class_id, class, packet, now());
        }
        let verdict = charge_bucket(ctx, class_id, class, packet, now);
        act(ctx, class_id, class, verdict, packet)
    }
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
