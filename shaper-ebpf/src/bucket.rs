//! Bucket: the GCRA word of the class (`CLASS_BUCKETS`, with per-CPU credit) or of the
//! packet's flow, source or destination (`KEYED_BUCKETS`, created lazily), charged by
//! compare-and-swap.

use crate::{
    maps::{CLASS_BUCKETS, CREDIT, KEYED_BUCKETS, KEY_STATS},
    parse::Packet,
};
use aya_ebpf::{bindings::BPF_NOEXIST, programs::TcContext};
use aya_log_ebpf::warn;
use core::intrinsics::{atomic_cxchg, AtomicOrdering};
use shaper_common::{
    bucket::{ticks, use_credit, CreditUse, TAT_MASK},
    conform, Bucket, BucketKey, ClassConfig, CostKind, Credit, Scope,
};

/// Compare-and-swap attempts on one bucket before the packet is judged over the rate.
pub(crate) const CAS_ATTEMPTS: u32 = 16;

/// The bucket's answer for one packet.
pub(crate) enum Verdict {
    /// Within the rate; the bucket is now `occupancy` ticks deep (0 = full, tolerance = empty).
    Within { occupancy: u64 },
    /// Over the rate; the bucket is unchanged.
    Exceed,
}

#[inline(always)]
pub(crate) fn bucket_of(
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
) -> Option<*mut Bucket> {
    match Scope::try_from(class.scope) {
        Ok(Scope::Class) | Err(_) => CLASS_BUCKETS.get_ptr_mut(class_id),
        Ok(scope) => keyed_bucket(class_id, class.generation, scope, packet),
    }
}

#[inline(always)]
pub(crate) fn charge_bucket(
    ctx: &TcContext,
    class_id: u32,
    class: &ClassConfig,
    packet: &Packet,
    now: impl Fn() -> u64,
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
            now(),
            packet.wire_len,
            class,
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

/// Inlined, not a subprogram: a bpf-to-bpf call and its return cost about 8 ns here
/// (1 flow, per packet: 143 -> 135 ns), and the key fits the 512-byte stack either way.
#[inline(always)]
pub(crate) fn keyed_bucket(
    class_id: u32,
    generation: u32,
    scope: Scope,
    packet: &Packet,
) -> Option<*mut Bucket> {
    let key = bucket_key(class_id, generation, scope, packet);
    if let Some(word) = KEYED_BUCKETS.get_ptr_mut(&key) {
        return Some(word);
    }
    // A fresh bucket is full: tat = 0 is "long ago". NOEXIST keeps a racing CPU's bucket.
    // Volatile stores: plain zeroes (`default()` too) become a `memset` call, a byte loop
    // in BPF.
    let mut fresh = core::mem::MaybeUninit::<Bucket>::uninit();
    let fresh = unsafe {
        let bucket = fresh.as_mut_ptr();
        core::ptr::write_volatile(&raw mut (*bucket).tat, 0);
        core::ptr::write_volatile(&raw mut (*bucket).tat2, 0);
        fresh.assume_init_ref()
    };
    if KEYED_BUCKETS
        .insert(&key, fresh, BPF_NOEXIST as u64)
        .is_ok()
    {
        count_new_key(class_id);
    }
    KEYED_BUCKETS.get_ptr_mut(&key)
}

/// Counts a key the class created in the flow table (this CPU's slot: no atomics).
#[inline(always)]
pub(crate) fn count_new_key(class_id: u32) {
    if let Some(stats) = KEY_STATS.get_ptr_mut(class_id) {
        unsafe { (*stats).new_keys += 1 };
    }
}

/// The flow table key of a packet's flow, source or destination in a class.
#[inline(always)]
pub(crate) fn bucket_key(
    class_id: u32,
    generation: u32,
    scope: Scope,
    packet: &Packet,
) -> BucketKey {
    // Every field written, no `..Default::default()`: that zeroing is a `memset` call,
    // a byte loop in BPF (39 bytes a packet).
    let flow = !matches!(scope, Scope::Src | Scope::Dst);
    // Masks, not `[0; 4]` literals (each another `memset`).
    let src_mask = if flow || scope == Scope::Src {
        u32::MAX
    } else {
        0
    };
    let dst_mask = if flow || scope == Scope::Dst {
        u32::MAX
    } else {
        0
    };
    BucketKey {
        class_id,
        generation,
        family: packet.family,
        proto: if flow { packet.proto } else { 0 },
        _pad: 0,
        sport: if flow { packet.sport } else { 0 },
        dport: if flow { packet.dport } else { 0 },
        src: packet.src.map(|word| word & src_mask),
        dst: packet.dst.map(|word| word & dst_mask),
    }
}

/// Spends this CPU's credit, taking a chunk (or what is missing) from the shared bucket
/// when it runs short; the occupancy reported is 0 (unused by the actions that get here).
/// The clock is read only then: a packet the credit covers needs no time.
#[inline(always)]
fn charge_with_credit(
    word: *mut u64,
    credit: &mut Credit,
    class: &ClassConfig,
    now: impl Fn() -> u64,
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
            let now = now();
            let mut take = first;
            for _ in 0..2 {
                if let Verdict::Within { .. } = charge(word, now, take, class) {
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
/// never admit more than the bucket holds. A word of an older cost version is converted
/// in the same swap (and written back converted even when the packet exceeds, so the
/// bucket refills at the new rate from the change on). Only the first read can find an
/// old version: a CPU that won the race wrote the current one. (Converting on every
/// retry would double the verifier's paths per retry.)
#[inline(always)]
fn charge(word: *mut u64, now: u64, bytes: u64, class: &ClassConfig) -> Verdict {
    let mut stored = unsafe { core::ptr::read_volatile(word) };
    let mut tat = class.settle(stored, now, CostKind::Main);
    for _ in 0..CAS_ATTEMPTS {
        let Some(next) = conform(tat, now, bytes, &class.cost) else {
            if class.stale(stored) {
                swap(word, stored, class.stamp(tat));
            }
            return Verdict::Exceed;
        };
        if swap(word, stored, class.stamp(next)) {
            return Verdict::Within {
                occupancy: next - ticks(now),
            };
        }
        stored = unsafe { core::ptr::read_volatile(word) };
        tat = stored & TAT_MASK;
    }
    Verdict::Exceed
}

#[inline(always)]
pub(crate) fn swap(word: *mut u64, old: u64, new: u64) -> bool {
    let (_, swapped) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(word, old, new)
    };
    swapped
}
