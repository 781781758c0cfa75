//! Classes with a parent: the walk of `shaper_common::hierarchy`, word by word with
//! compare-and-swap. Up from the packet's class, each level's ceiling word must take
//! the packet (else it is refused there and the ceiling words taken below are given
//! back), and the first level whose rate word takes it lends; the levels above go into
//! debt. A level that borrows must also fit its fair word at its parent's share, or it
//! refuses the packet itself. Counted per level: every level on the way passes the
//! packet, or the level that refused it counts the drop (or its action's mark).

use crate::{
    act::{apply, count_drop, count_pass, stats_of},
    bucket::{keyed_bucket, swap, CAS_ATTEMPTS},
    maps::{CLASSES, CLASS_BUCKETS, CODEL, SHAPE_PACKET},
    rewrite::set_ecn_ce,
};
use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};
use core::intrinsics::{atomic_xadd, atomic_xsub, AtomicOrdering};
use shaper_common::{
    bucket::{ticks, TAT_MASK},
    conform,
    hierarchy::{
        fair_cost, fair_share, has_room, in_debt, lending_word, share_down, share_up, MAX_LEVELS,
    },
    Action, ByteCost, ClassConfig, CostKind, Scope,
};

const MAIN: u8 = 0;
const CEILING: u8 = 1;
/// [`take_word`]'s answer when the word cannot take the packet.
const REFUSED: u64 = u64::MAX;

/// A subprogram: it reads the packet from its per-CPU slot, and the walk's four levels
/// are verified once, apart from the flat path. It keeps no per-level arrays (the stack
/// it shares with the packet path is 512 bytes): giving back and counting walk the
/// parents again.
#[inline(never)]
pub(crate) fn charge_tree(ctx: &TcContext, class_id: u32, now: u64) -> i32 {
    let Some(packet) = SHAPE_PACKET.get_ptr(0) else {
        return TC_ACT_UNSPEC;
    };
    let packet = unsafe { &*packet };
    let bytes = packet.wire_len;
    // A per-key class's word for this packet's key (its ceiling), once taken.
    let mut key_word: *mut u64 = core::ptr::null_mut();
    let (mut id, mut child_id) = (class_id, class_id);
    let mut lender = MAX_LEVELS;
    // ECN classes mark early, once the lending bucket is half drained.
    let (mut marks_early, mut half_drained) = (false, false);
    for level in 0..MAX_LEVELS {
        let Some(class) = CLASSES.get(id) else {
            return TC_ACT_UNSPEC;
        };
        if level == 0 {
            marks_early = class.action == Action::Ecn as u8;
        } else if take_fair(child_id, id, now, bytes) == REFUSED {
            // The child below borrows beyond its fair share of this class's spare: refused
            // there, with the ceilings taken up to it given back.
            give_back(class_id, level, key_word, bytes);
            let Some(child) = CLASSES.get(child_id) else {
                return TC_ACT_UNSPEC;
            };
            return refuse(ctx, child_id, child, packet);
        }
        let has_parent = class.parent != 0;
        let refused = if level == 0 && class.scope != Scope::Class as u8 {
            // A per-key class: the key's word is its ceiling; it always borrows.
            let scope = Scope::try_from(class.scope).unwrap_or(Scope::Flow);
            let Some(bucket) = keyed_bucket(id, class.generation, scope, packet) else {
                // No room for a new key (every entry busy on other CPUs): fail open.
                return pass(id, bytes, false);
            };
            let word = unsafe { &raw mut (*bucket).tat };
            let within = take(word, class, MAIN, now, bytes).is_some();
            if within && !has_parent {
                lender = level;
                break;
            }
            key_word = word;
            !within
        } else {
            let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(id) else {
                return TC_ACT_UNSPEC;
            };
            let within_ceiling = !has_parent
                || take(
                    unsafe { &raw mut (*bucket).tat2 },
                    class,
                    CEILING,
                    now,
                    bytes,
                )
                .is_some();
            if within_ceiling {
                if let Some(occupancy) =
                    take(unsafe { &raw mut (*bucket).tat }, class, MAIN, now, bytes)
                {
                    lender = level;
                    half_drained = occupancy > class.cost.tolerance_ticks / 2;
                    break;
                }
            }
            !within_ceiling || !has_parent
        };
        if refused {
            if level > 0 {
                // It refused what its child borrowed: its fair share falls.
                lower_share(id);
            }
            give_back(class_id, level, key_word, bytes);
            return refuse(ctx, id, class, packet);
        }
        child_id = id;
        id = class.parent as u32 - 1;
    }
    if lender == MAX_LEVELS {
        // A chain deeper than userspace allows: pass, as an unclassified packet.
        return TC_ACT_UNSPEC;
    }
    let marked = marks_early && half_drained && set_ecn_ce(ctx, packet);
    // Every level passes the packet; the lender's parent and up go into debt.
    let mut id = class_id;
    for level in 0..MAX_LEVELS {
        let Some(class) = CLASSES.get(id) else {
            break;
        };
        if level > lender {
            if let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(id) {
                owe(unsafe { &raw mut (*bucket).tat }, class, MAIN, now, bytes);
                if class.parent != 0 {
                    owe(
                        unsafe { &raw mut (*bucket).tat2 },
                        class,
                        CEILING,
                        now,
                        bytes,
                    );
                }
            }
        }
        pass(id, bytes, marked && level == 0);
        if class.parent == 0 {
            break;
        }
        id = class.parent as u32 - 1;
    }
    TC_ACT_UNSPEC
}

/// Takes `bytes` from `child`'s fair word at `parent`'s fair share
/// (`shaper_common::hierarchy`); `REFUSED` when it cannot, and then, if the parent had
/// more than half its burst left, the share rises. The share and the fair word live in
/// the classes' `CODEL` entries, which policing classes do not otherwise use (`control`:
/// the share a class gives its children; `first_above`: its own fair word).
#[inline(never)]
fn take_fair(child: u32, parent: u32, now: u64, bytes: u64) -> u64 {
    let (Some(config), Some(bucket), Some(parent_state), Some(child_state)) = (
        CLASSES.get(parent),
        CLASS_BUCKETS.get_ptr(parent),
        CODEL.get_ptr_mut(parent),
        CODEL.get_ptr_mut(child),
    ) else {
        return 0;
    };
    let share_word = unsafe { &raw mut (*parent_state).control };
    let stored_share = unsafe { core::ptr::read_volatile(share_word) };
    let (lending, lends): (*const u64, &ByteCost) = lending_word(
        config.parent != 0,
        (unsafe { &raw const (*bucket).tat }, &config.cost),
        (unsafe { &raw const (*bucket).tat2 }, &config.peak_cost),
    );
    let cost = fair_cost(fair_share(stored_share, lends), bytes);
    let word = unsafe { &raw mut (*child_state).first_above };
    let mut stored = unsafe { core::ptr::read_volatile(word) };
    for _ in 0..CAS_ATTEMPTS {
        let Some(next) = conform(stored, now, bytes, &cost) else {
            let parent_tat = unsafe { core::ptr::read_volatile(lending) };
            if has_room(parent_tat & TAT_MASK, now, lends) {
                let raised = share_up(stored_share, lends);
                unsafe { core::ptr::write_volatile(share_word, raised) };
            }
            return REFUSED;
        };
        if swap(word, stored, next) {
            return 0;
        }
        stored = unsafe { core::ptr::read_volatile(word) };
    }
    // Lost every race: on to the parent, whose own words still decide.
    0
}

/// `id` refused a packet its child borrowed: its fair share falls.
#[inline(never)]
fn lower_share(id: u32) {
    if let (Some(config), Some(state)) = (CLASSES.get(id), CODEL.get_ptr_mut(id)) {
        let word = unsafe { &raw mut (*state).control };
        let share = unsafe { core::ptr::read_volatile(word) };
        let lends = lending_word(config.parent != 0, &config.cost, &config.peak_cost);
        unsafe { core::ptr::write_volatile(word, share_down(share, lends)) };
    }
}

/// Gives back the ceiling words the levels below `refused_at` took (the key's word for
/// a per-key class), exactly: the same ticks subtracted that were added.
#[inline(never)]
fn give_back(class_id: u32, refused_at: usize, key_word: *mut u64, bytes: u64) {
    let mut id = class_id;
    for level in 0..MAX_LEVELS {
        if level >= refused_at {
            return;
        }
        let Some(class) = CLASSES.get(id) else {
            return;
        };
        if level == 0 && !key_word.is_null() {
            unsafe {
                atomic_xsub::<u64, u64, { AtomicOrdering::SeqCst }>(
                    key_word,
                    class.cost.ticks_for(bytes),
                )
            };
        } else if let Some(bucket) = CLASS_BUCKETS.get_ptr_mut(id) {
            unsafe {
                atomic_xsub::<u64, u64, { AtomicOrdering::SeqCst }>(
                    &raw mut (*bucket).tat2,
                    class.peak_cost.ticks_for(bytes),
                )
            };
        }
        id = class.parent as u32 - 1;
    }
}

#[inline(always)]
fn pass(id: u32, bytes: u64, marked: bool) -> i32 {
    match stats_of(id) {
        Some(stats) => count_pass(stats, bytes, marked),
        None => TC_ACT_UNSPEC,
    }
}

/// Refused at `class`: its action, counted there.
#[inline(always)]
fn refuse(ctx: &TcContext, id: u32, class: &ClassConfig, packet: &crate::parse::Packet) -> i32 {
    match apply(
        ctx,
        packet,
        class.action,
        class.action_arg,
        class.action_mask,
    ) {
        Some(marked) => pass(id, packet.wire_len, marked),
        None => match stats_of(id) {
            Some(stats) => count_drop(stats, packet.wire_len),
            // Without its counters (never, for an id userspace made) the packet passes,
            // as every other lookup failure does.
            None => TC_ACT_UNSPEC,
        },
    }
}

/// Takes `bytes` from one word of `class` (its rate word, or its ceiling word) if it
/// conforms; the word's occupancy after.
#[inline(always)]
fn take(word: *mut u64, class: &ClassConfig, kind: u8, now: u64, bytes: u64) -> Option<u64> {
    match take_word(word, class, kind, now, bytes) {
        REFUSED => None,
        occupancy => Some(occupancy),
    }
}

/// [`take`]'s word: `REFUSED` or the occupancy. A word of an older cost version is
/// converted in the same swap.
///
/// A global subprogram: the kernel verifies it once, apart from its callers (pointer
/// arguments since 5.12; they may be null to the verifier, so both are checked). Inlined,
/// its sixteen compare-and-swap attempts were walked again for every level of the walk
/// and every path into it: the whole program took 413k verified instructions on 6.18 and
/// 690k of Debian 12's 6.1's million; with this one global, 252k and 484k. The call costs
/// a three-level chain's packet about 11 ns (159 -> 170 ns); [`owe`] as a global too
/// would save 20k more instructions for 36 ns more, so it stays inlined.
#[no_mangle]
#[inline(never)]
pub extern "C" fn take_word(
    word: *mut u64,
    class: *const ClassConfig,
    kind: u8,
    now: u64,
    bytes: u64,
) -> u64 {
    if word.is_null() || class.is_null() {
        return REFUSED;
    }
    let class = unsafe { &*class };
    let (kind, cost) = cost_of(class, kind);
    let mut stored = unsafe { core::ptr::read_volatile(word) };
    let mut tat = class.settle(stored, now, kind);
    for _ in 0..CAS_ATTEMPTS {
        let Some(next) = conform(tat, now, bytes, cost) else {
            return REFUSED;
        };
        if swap(word, stored, class.stamp(next)) {
            return next - ticks(now);
        }
        stored = unsafe { core::ptr::read_volatile(word) };
        tat = stored & TAT_MASK;
    }
    REFUSED
}

/// The cost of a class's rate word (`MAIN`) or ceiling word (`CEILING`).
#[inline(always)]
fn cost_of(class: &ClassConfig, kind: u8) -> (CostKind, &ByteCost) {
    if kind == CEILING {
        (CostKind::Peak, &class.peak_cost)
    } else {
        (CostKind::Main, &class.cost)
    }
}

/// Charges `bytes` to one word of `class` whether or not it conforms (a level above the
/// lender). A word that keeps losing races is charged by a plain add, which can only
/// count the bytes later than due, never lose them.
#[inline(always)]
fn owe(word: *mut u64, class: &ClassConfig, kind: u8, now: u64, bytes: u64) {
    let (kind, cost) = cost_of(class, kind);
    let mut stored = unsafe { core::ptr::read_volatile(word) };
    let mut tat = class.settle(stored, now, kind);
    for _ in 0..CAS_ATTEMPTS {
        if swap(word, stored, class.stamp(in_debt(tat, now, bytes, cost))) {
            return;
        }
        stored = unsafe { core::ptr::read_volatile(word) };
        tat = stored & TAT_MASK;
    }
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(word, cost.ticks_for(bytes)) };
}
