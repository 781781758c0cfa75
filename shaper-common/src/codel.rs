//! CoDel (RFC 8289) on a shaping class's virtual queue.
//!
//! A shape class keeps a GCRA word at the class rate next to its real queue (an HTB class,
//! or fq's per-flow queues under EDT). For the bytes already admitted, `tat - now` is how
//! long they take to drain at the class rate: the queueing delay the next packet will see.
//! CoDel runs on that *predicted* sojourn time when the packet arrives, before it is queued,
//! so the program can drop (or CE-mark) it without a qdisc of its own:
//!
//! - below `target` (or with at most one frame queued) the queue is good: forget the timer;
//! - above `target` for a whole `interval`: drop one packet and enter the dropping state,
//!   then drop the next at `interval / sqrt(count)` after the previous one, so the drop rate
//!   rises until the standing queue is gone;
//! - re-entering soon after leaving resumes near the previous drop rate (the Linux rule).
//!
//! A hard cap drops anything that would wait longer than [`CodelConfig::cap_ns`], so a
//! sender that ignores both drops and marks cannot build a queue beyond it.
//!
//! **State and concurrency.** Everything CoDel decides on is one 64-bit control word
//! (`drop_next` as 32 bits of 1.024 µs with wrap-around comparisons, as Linux's
//! `codel_time_t`; `count`, `lastcount`, `dropping`), changed only by compare-and-swap, so of
//! several CPUs racing for one drop slot exactly one drops. The start of the above-target
//! period is a second word; it only ever moves between 0 and one deadline, and a lost race
//! there shifts the deadline by the few nanoseconds between two CPUs' clocks.

/// Default target: the acceptable standing queue (RFC 8289, fq_codel, CAKE).
pub const DEFAULT_TARGET_NS: u64 = 5_000_000;
/// Default interval: about the path's RTT plus the time a sender's answer takes to drain
/// the queue.
pub const DEFAULT_INTERVAL_NS: u64 = 100_000_000;
/// One full Ethernet frame: the queue CoDel never drops from, and the unit of the low-rate
/// target (1.5 frame times, as CAKE).
pub const FRAME_BYTES: u64 = 1514;
/// `drop_next` is kept in units of 2^10 ns (1.024 µs).
const TIME_SHIFT: u32 = 10;
/// `count` and `lastcount` saturate here (15 bits each): interval / 181.
const COUNT_MAX: u64 = (1 << 15) - 1;

/// A flow of a shape class is *sparse* while it stays within 1/16 of the class rate with
/// bursts of at most four frames (fq_codel's and CAKE's sparse flows): its packets skip the
/// class's bulk queue (an HTB leaf of higher priority, or departure now under EDT) and
/// CoDel, since they build no queue. They still advance the class's virtual queue.
pub const SPARSE_RATE_DIVISOR: u64 = 16;
pub const SPARSE_BURST_FRAMES: u64 = 4;

/// The per-flow sparseness bucket of a class of `rate_bits_per_sec`. Userspace only.
pub fn sparse_cost(rate_bits_per_sec: u64) -> crate::ByteCost {
    crate::ByteCost::new(
        (rate_bits_per_sec / SPARSE_RATE_DIVISOR).max(crate::bucket::MIN_RATE_BITS_PER_SEC),
        SPARSE_BURST_FRAMES * FRAME_BYTES,
    )
}

/// Whether a flow's packet is sparse, given its sparseness bucket word `tat`; and the
/// word's next value. Unlike a policer's bucket, every packet advances the word, so a
/// bulk flow runs far ahead and does not flip back to sparse (which would reorder it)
/// until it has been quiet for a long while.
#[inline(always)]
pub fn sparse(tat: u64, now_ns: u64, bytes: u64, cost: &crate::ByteCost) -> (bool, u64) {
    // A class's own flows at a share of one: the rule a fair class scales by its share.
    crate::fair::sparse_at_share(tat, now_ns, bytes, cost, crate::fair::SHARE_ONE)
}

/// CoDel's parameters for one class, precomputed by userspace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodelConfig {
    /// Effective target: the user's target, raised to 1.5 frame times at low rates.
    pub target_ns: u64,
    pub interval_ns: u64,
    /// Hard cap on the predicted sojourn: `max(interval, 4 × target)`.
    pub cap_ns: u64,
    /// One frame at the class rate: with at most this much queued, nothing is dropped.
    pub frame_ns: u64,
    /// 1: CE-mark ECN-capable packets instead of dropping them (the default, as fq_codel).
    pub ecn: u32,
    /// How the class shares its rate among its flows (`fair::FAIR_*`; 0, none, in pins
    /// from before layout 9, where this was padding).
    pub fair: u32,
}

impl CodelConfig {
    /// The config for a class of `rate_bits_per_sec` (> 0) with the user's `target_ns` and
    /// `interval_ns`. Userspace only: it divides.
    pub fn new(target_ns: u64, interval_ns: u64, rate_bits_per_sec: u64) -> Self {
        let rate = rate_bits_per_sec.max(1) as u128;
        let frame_ns = (FRAME_BYTES as u128 * 8 * 1_000_000_000).div_ceil(rate) as u64;
        let target_ns = target_ns.max(frame_ns + frame_ns / 2);
        Self {
            target_ns,
            interval_ns,
            cap_ns: interval_ns.max(4 * target_ns),
            frame_ns,
            ecn: 1,
            fair: crate::fair::FAIR_NONE,
        }
    }

    /// The same with flow isolation `fair` (`fair::FAIR_*`).
    pub fn with_fair(self, fair: u32) -> Self {
        Self { fair, ..self }
    }

    /// The same with ECN marking on or off.
    pub fn with_ecn(self, ecn: bool) -> Self {
        Self {
            ecn: ecn as u32,
            ..self
        }
    }
}

/// CoDel's per-class state (one map value per class).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodelState {
    /// `drop_next << 32 | count << 17 | lastcount << 2 | dropping << 1` (see [`Control`]).
    pub control: u64,
    /// When the predicted sojourn first went above target, plus one interval (ns); 0 while
    /// it is below.
    pub first_above: u64,
}

/// A shape class's bulk flows per CoDel interval (one map value per class): CoDel on a
/// queue that N bulk flows share spaces its drops N times closer, as N per-flow CoDels
/// (fq_codel, CAKE) would together. A flow is counted once an interval by the interval's
/// end stamped in its flow-table entry (`Bucket::tat2`). The control law's count is the
/// shared queue's (every flow's signals), so past the first drops the spacing runs up to
/// about √N closer than N independent CoDels' would; measured with four Cubic flows at
/// 20 Mbit/s over 40 ms, goodput stayed 0.956 and the queue fell from 10.4 to 7.6 ms.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCensus {
    /// When the interval being counted ends (ns).
    pub interval_end: u64,
    /// Bulk flows seen so far in it.
    pub counting: u64,
    /// Bulk flows seen in the interval before.
    pub counted: u64,
    /// Flow isolation (`fair`): the share multiplier this interval's flows are charged
    /// with (`fair::next_share` at the end of the interval before; 0 reads as 1).
    pub share: u64,
    /// Flow isolation, counted through the interval: the weights of its bulk flows and
    /// of those found over their share, the least delay the class's queue showed
    /// (`u64::MAX`, or 0 in a fresh census, until a packet is judged), and the flows
    /// found over their share (that count's value for the interval before, last).
    pub weight: u64,
    pub over_share_weight: u64,
    pub least_delay_ns: u64,
    /// Flow isolation: the bytes of every packet not found over its flow's share this
    /// interval (sparse flows' included).
    pub spare_bytes: u64,
    pub over_share_counting: u64,
    /// Flow isolation: the bulk flows' weights in the interval before (`weight`'s last
    /// value): the share's bound is the larger of the two, so a flow silent for one
    /// interval (a TCP timeout) is not left out of the split.
    pub last_weight: u64,
    pub over_share_counted: u64,
}

/// The control word, unpacked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    /// Next drop time in units of 1.024 µs (wraps every 73 minutes).
    pub drop_next: u32,
    pub count: u64,
    pub lastcount: u64,
    pub dropping: bool,
}

impl Control {
    #[inline(always)]
    pub fn unpack(word: u64) -> Self {
        Self {
            drop_next: (word >> 32) as u32,
            count: (word >> 17) & COUNT_MAX,
            lastcount: (word >> 2) & COUNT_MAX,
            dropping: (word >> 1) & 1 == 1,
        }
    }

    #[inline(always)]
    pub fn pack(&self) -> u64 {
        ((self.drop_next as u64) << 32)
            | ((self.count & COUNT_MAX) << 17)
            | ((self.lastcount & COUNT_MAX) << 2)
            | ((self.dropping as u64) << 1)
    }
}

/// What CoDel makes of one arriving packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judgement {
    /// Drop it (or CE-mark it when it is ECN-capable).
    pub congested: bool,
    /// The new control word, when it changes (to be installed by compare-and-swap; a lost
    /// race means another CPU moved the state first, and the packet is judged again).
    pub control: Option<u64>,
    /// The new `first_above`, when it changes.
    pub first_above: Option<u64>,
    /// This packet starts a dropping state (a rare event worth a log record).
    pub entered: bool,
    /// CoDel condemned the packet but the caller's `spare` let it pass (a GSO aggregate,
    /// dropped one time in k): no signal reached the sender, so the control law's count
    /// is left as it was (at an entry: one short of the entry's count).
    pub spared: bool,
}

/// `a` is at or after `b` on the wrapping 32-bit clock.
#[inline(always)]
fn at_or_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

#[inline(always)]
fn coarse(ns: u64) -> u32 {
    (ns >> TIME_SHIFT) as u32
}

/// `floor(sqrt(value))`, bit by bit. Compile time only (it builds [`INV_SQRT_Q24`]): a
/// branch per bit would make the eBPF verifier walk 2^32 paths.
pub const fn isqrt(value: u64) -> u64 {
    let mut rest = value;
    let mut root = 0u64;
    let mut bit = 1u64 << 62;
    while bit != 0 {
        if rest >= root + bit {
            rest -= root + bit;
            root = (root >> 1) + bit;
        } else {
            root >>= 1;
        }
        bit >>= 2;
    }
    root
}

/// The control law's counts: beyond this the drop spacing stays at interval / 32.
pub const CONTROL_LAW_COUNTS: usize = 1024;

/// `2^24 / sqrt(count)` for every count below [`CONTROL_LAW_COUNTS`] (entry 0 as 1), built
/// at compile time: the packet path has no floating point, and a table read is one
/// bounded load where a square root would be a loop.
pub static INV_SQRT_Q24: [u32; CONTROL_LAW_COUNTS] = inv_sqrt_table();

const fn inv_sqrt_table() -> [u32; CONTROL_LAW_COUNTS] {
    let mut table = [0u32; CONTROL_LAW_COUNTS];
    let mut count = 0;
    while count < CONTROL_LAW_COUNTS {
        let divisor = if count == 0 { 1 } else { count as u64 };
        // floor(sqrt(floor(x))) == floor(sqrt(x)): exact 2^24 / sqrt(count), rounded down.
        table[count] = isqrt((1u64 << 48) / divisor) as u32;
        count += 1;
    }
    table
}

/// `interval / sqrt(count)` in ns: the interval times `2^24 / sqrt(count)` from the table,
/// shifted back (in that order, so the fraction survives: 1/sqrt(2) is not 1; a known
/// public eBPF CoDel writes `interval << 16 / sqrt(count)`, which C parses as a shift by
/// `16 / sqrt(count)`, and never speeds up). No overflow for intervals below 2^40 ns.
#[inline(always)]
pub fn drop_spacing_ns(interval_ns: u64, count: u64) -> u64 {
    let index = if count < CONTROL_LAW_COUNTS as u64 {
        count as usize
    } else {
        CONTROL_LAW_COUNTS - 1
    };
    match INV_SQRT_Q24.get(index) {
        Some(&factor) => (interval_ns * factor as u64) >> 24,
        None => interval_ns,
    }
}

/// One arriving packet with predicted sojourn `sojourn_ns` at `now_ns`, given the class's
/// current `control` word and `first_above`.
///
/// `spare` is asked only when CoDel condemns the packet: true lets it pass with no signal
/// (a GSO aggregate the caller drops one time in k). RFC 8289's `count` counts signals
/// the sender saw, so a spared packet leaves it as it was and the next decision comes one
/// spacing of that count later; counting it too would make the count grow k times faster
/// than the signals (the drops about √k times faster). A spared packet that starts the
/// dropping state starts it one signal short of the entry's count (0 on a fresh entry, or
/// the re-entry rule's less one), so the first real drop is the entry's step.
#[inline(always)]
pub fn judge(
    control: u64,
    first_above: u64,
    sojourn_ns: u64,
    now_ns: u64,
    config: &CodelConfig,
    flows: u64,
    spare: impl FnOnce() -> bool,
) -> Judgement {
    // RFC 8289 `dodequeue`: is the queue persistently above target?
    let mut new_first_above = None;
    let mut ok_to_drop = false;
    if sojourn_ns < config.target_ns || sojourn_ns <= config.frame_ns {
        if first_above != 0 {
            new_first_above = Some(0);
        }
    } else if first_above == 0 {
        new_first_above = Some(now_ns + config.interval_ns);
    } else if now_ns >= first_above {
        ok_to_drop = true;
    }

    let mut state = Control::unpack(control);
    let now = coarse(now_ns);
    let mut congested = false;
    let mut changed = false;
    let mut entered = false;
    let mut spared = false;
    if state.dropping {
        if !ok_to_drop {
            state.dropping = false;
            changed = true;
        } else if at_or_after(now, state.drop_next) {
            spared = spare();
            congested = !spared;
            if !spared && state.count < COUNT_MAX {
                state.count += 1;
            }
            let next_ns = ((state.drop_next as u64) << TIME_SHIFT)
                + drop_spacing_ns(config.interval_ns, state.count) / flows.max(1);
            state.drop_next = coarse(next_ns);
            changed = true;
        }
    } else if ok_to_drop {
        // Entering: a spared packet still starts the dropping state (the queue has stood
        // above target for an interval), one signal short of the count the re-entry rule
        // gives. Counted as a signal, the first real drop would come at count 2 and the
        // next decision 0.7 interval after it, before a sender 80 ms away has drained the
        // queue: a second cut of its window every epoch (see docs/CHOOSING.md, `shape`).
        spared = spare();
        congested = !spared;
        // Signals since the last entry; a spared entry with no real drop since is 0.
        let delta = state.count.saturating_sub(state.lastcount);
        // Linux's `codel_time_before(now - drop_next, 16 * interval)`: a drop_next still in
        // the future counts as recent.
        let since_last = now.wrapping_sub(state.drop_next);
        let recent = (since_last.wrapping_sub(coarse(16 * config.interval_ns)) as i32) < 0;
        let count = if delta > 1 && recent { delta } else { 1 };
        state.count = count - spared as u64;
        state.drop_next =
            coarse(now_ns + drop_spacing_ns(config.interval_ns, state.count) / flows.max(1));
        // As if the entry had dropped, so the next re-entry counts this episode's signals
        // alike whether or not its entry was spared.
        state.lastcount = count;
        state.dropping = true;
        changed = true;
        entered = true;
    }
    Judgement {
        congested,
        control: if changed { Some(state.pack()) } else { None },
        first_above: new_first_above,
        entered,
        spared,
    }
}

/// The predicted sojourn (ns) of a packet arriving at `now_ticks` behind a virtual queue
/// whose GCRA word is `tat`, drained by a token bucket of `burst_ticks` (HTB's burst: it
/// sends that much ahead of the rate after an idle spell; 0 for EDT pacing, which has no
/// burst). All in bucket ticks.
#[inline(always)]
pub fn sojourn_ns(tat: u64, now_ticks: u64, burst_ticks: u64) -> u64 {
    let ahead = now_ticks + burst_ticks;
    if tat > ahead {
        (tat - ahead) >> crate::bucket::TICK_BITS
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::{vec, vec::Vec};

    const MS: u64 = 1_000_000;

    #[test]
    fn isqrt_is_exact() {
        let mut values = vec![0u64, 1, 2, 3, 4, 8, 15, 16, 17, 1 << 32, (1 << 47) + 12345];
        values.extend([u64::MAX, u64::MAX - 1, (1 << 62) - 1, 1 << 62]);
        // Every count CoDel can hold, as the control law uses it, and squares around.
        values.extend((1..1u64 << 15).map(|count| count << 40));
        values.extend((1..100_000u64).map(|r| r * r - 1));
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push(x >> (x % 64));
        }
        for value in values {
            let root = isqrt(value) as u128;
            assert!(root * root <= value as u128, "{value}");
            assert!((root + 1) * (root + 1) > value as u128, "{value}");
        }
    }

    #[test]
    fn drop_spacing_speeds_up_as_interval_over_sqrt_count() {
        // The precedence bug (`interval << 16 / sqrt`) would give 100 ms for every count.
        for count in 1..2000u64 {
            let exact = 100e6 / (count.min(CONTROL_LAW_COUNTS as u64 - 1) as f64).sqrt();
            let spacing = drop_spacing_ns(100 * MS, count) as f64;
            // The table's 2^-24 resolution: one unit of the factor, relative.
            let resolution =
                (count.min(CONTROL_LAW_COUNTS as u64 - 1) as f64).sqrt() / 16_777_216.0;
            assert!(
                spacing <= exact && exact - spacing <= resolution * exact + 1.0,
                "{count}: {spacing} vs {exact}"
            );
        }
        assert_eq!(drop_spacing_ns(100 * MS, 1), 100 * MS);
        assert_eq!(drop_spacing_ns(100 * MS, 4), 50 * MS);
        assert_eq!(drop_spacing_ns(100 * MS, 16), 25 * MS);
        assert!(drop_spacing_ns(100 * MS, 100) / 1000 == 9999);
    }

    #[test]
    fn target_is_raised_to_one_and_a_half_frames_at_low_rates() {
        let fast = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        assert_eq!(fast.target_ns, 5 * MS);
        assert_eq!(fast.cap_ns, 100 * MS);
        assert_eq!(fast.frame_ns, 121_120);
        // 1 Mbit/s: a frame takes 12.1 ms, so the target is 18.2 ms and the cap 72.7 ms
        // is below the interval: the interval wins.
        let slow = CodelConfig::new(5 * MS, 100 * MS, 1_000_000);
        assert_eq!(slow.frame_ns, 12_112_000);
        assert_eq!(slow.target_ns, 18_168_000);
        assert_eq!(slow.cap_ns, 100 * MS);
        let short = CodelConfig::new(20 * MS, 40 * MS, 100_000_000);
        assert_eq!(short.cap_ns, 80 * MS);
    }

    /// Feeds one packet; installs what the judgement changes (as one CPU would).
    fn feed(state: &mut CodelState, sojourn: u64, now: u64, config: &CodelConfig) -> bool {
        feed_sparing(state, sojourn, now, config, || false)
    }

    /// [`feed`] with a `spare` for the packet.
    fn feed_sparing(
        state: &mut CodelState,
        sojourn: u64,
        now: u64,
        config: &CodelConfig,
        spare: impl FnOnce() -> bool,
    ) -> bool {
        let judgement = judge(
            state.control,
            state.first_above,
            sojourn,
            now,
            config,
            1,
            spare,
        );
        if let Some(control) = judgement.control {
            state.control = control;
        }
        if let Some(first_above) = judgement.first_above {
            state.first_above = first_above;
        }
        judgement.congested
    }

    #[test]
    fn drops_only_after_an_interval_above_target_then_faster_and_stops_below() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let mut state = CodelState::default();
        let start = 1_000 * MS;
        // Below target: nothing, however long.
        for step in 0..1000 {
            assert!(!feed(&mut state, 4 * MS, start + step * MS, &config));
        }
        assert_eq!(state.first_above, 0);
        // Above target, one packet a millisecond: the first drop comes after 100 ms.
        let above = start + 1000 * MS;
        let mut drops = Vec::new();
        for step in 0..=600 {
            if feed(&mut state, 20 * MS, above + step * MS, &config) {
                drops.push(step);
            }
        }
        assert_eq!(drops[0], 100);
        // Then at 100 ms / sqrt(count) after the previous drop (ms resolution here).
        let gaps: Vec<u64> = drops.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..5], &[100, 71, 58, 50, 45]);
        assert!(gaps.windows(2).all(|w| w[1] <= w[0]), "{gaps:?}");
        // Below target again: the dropping state ends at once.
        let below = above + 601 * MS;
        assert!(!feed(&mut state, MS, below, &config));
        assert!(!Control::unpack(state.control).dropping);
        assert_eq!(state.first_above, 0);
    }

    #[test]
    fn never_drops_with_at_most_one_frame_queued() {
        // A user target below a frame time is raised; and a sojourn of one frame is good.
        let config = CodelConfig {
            target_ns: 1,
            interval_ns: 100 * MS,
            cap_ns: 100 * MS,
            frame_ns: 2 * MS,
            ..CodelConfig::default()
        };
        let mut state = CodelState::default();
        for step in 0..1000 {
            assert!(!feed(&mut state, 2 * MS, 1000 * MS + step * MS, &config));
        }
    }

    #[test]
    fn a_spared_packet_is_no_signal_and_leaves_the_count() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let start = 1_000 * MS;
        // Every condemned packet spared: the decisions keep the spacing of count 1.
        let mut state = CodelState::default();
        let mut decisions = Vec::new();
        for step in 0..=1000 {
            let dropped = feed_sparing(&mut state, 20 * MS, start + step * MS, &config, || {
                decisions.push(step);
                true
            });
            assert!(!dropped, "a spared packet passes");
        }
        assert_eq!(
            decisions,
            [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
        );
        let control = Control::unpack(state.control);
        assert!(control.dropping);
        assert_eq!(control.count, 0, "no signal yet");
        // Every other decision spared: the count is the number of real drops, and the
        // spacing follows it.
        let every_other = |spare_first: bool| {
            let mut state = CodelState::default();
            let (mut decisions, mut drops) = (Vec::new(), 0u64);
            for step in 0..=1000 {
                let index = decisions.len();
                drops += feed_sparing(&mut state, 20 * MS, start + step * MS, &config, || {
                    decisions.push(step);
                    (index % 2 == 0) == spare_first
                }) as u64;
            }
            assert_eq!(Control::unpack(state.control).count, drops);
            decisions
        };
        // Dropped at 100 (count 1), spared at 200 (count still 1: 100 ms on), dropped at
        // 300 (count 2), spared 70.7 ms later.
        assert_eq!(&every_other(false)[..4], &[100, 200, 300, 371]);
        // The entry spared (count 0), so the first real drop, at 200, is count 1 and the
        // next decision a whole interval later, not 70.7 ms: a sender gets an interval to
        // answer its first signal before a second one can cut its window again.
        assert_eq!(&every_other(true)[..5], &[100, 200, 300, 400, 471]);
    }

    /// A state entering the dropping state at `now`, its last episode having left
    /// `count` signals and its last drop due `ago_ns` before now.
    fn entering(config: &CodelConfig, now: u64, count: u64, ago_ns: u64) -> Control {
        let control = Control {
            drop_next: coarse(now).wrapping_sub(coarse(ago_ns)),
            count,
            lastcount: 1,
            dropping: false,
        };
        let judgement = judge(control.pack(), now - 1, 20 * MS, now, config, 1, || false);
        assert!(judgement.congested, "the entry drops");
        Control::unpack(judgement.control.expect("the state changed"))
    }

    #[test]
    fn a_re_entry_counts_as_recent_below_sixteen_intervals_exactly() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let now = 100_000 * MS;
        // Five intervals after the last drop: recent, the count resumes at count - lastcount.
        assert_eq!(entering(&config, now, 4, 500 * MS).count, 3);
        // Twenty intervals after: a fresh start at 1.
        assert_eq!(entering(&config, now, 4, 2000 * MS).count, 1);
        // Exactly sixteen (in the control word's units): no longer recent.
        assert_eq!(entering(&config, now, 4, 1600 * MS).count, 1);
        assert_eq!(entering(&config, now, 4, 1599 * MS).count, 3);
    }

    #[test]
    fn a_sojourn_of_exactly_the_target_is_above_it() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let below = judge(0, 0, 5 * MS - 1, 1_000 * MS, &config, 1, || false);
        assert_eq!(below.first_above, None);
        let at = judge(0, 0, 5 * MS, 1_000 * MS, &config, 1, || false);
        assert_eq!(
            at.first_above,
            Some(1_100 * MS),
            "RFC 8289: below means less than"
        );
    }

    #[test]
    fn the_count_saturates_at_its_largest_value() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let now = 100_000 * MS;
        let control = Control {
            drop_next: coarse(now),
            count: COUNT_MAX,
            lastcount: 1,
            dropping: true,
        };
        let judgement = judge(control.pack(), now - 1, 20 * MS, now, &config, 1, || false);
        assert!(judgement.congested);
        let after = Control::unpack(judgement.control.expect("a drop moves the state"));
        assert_eq!(after.count, COUNT_MAX, "the count does not wrap");
        assert!(after.dropping);
    }

    #[test]
    fn ecn_is_switched_alone() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 10_000_000);
        assert_eq!(config.ecn, 1);
        let off = config.with_ecn(false);
        assert_eq!(off, CodelConfig { ecn: 0, ..config });
        assert_eq!(off.with_ecn(true), config);
    }

    #[test]
    fn n_bulk_flows_bring_the_drops_n_times_closer() {
        // The instants (ms after the first drop) of the first `drops` drops of a queue
        // standing at 20 ms, `flows` bulk flows sharing it.
        let instants = |flows: u64, drops: usize| {
            let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
            let (mut control, mut first_above) = (0, 0);
            let mut at = Vec::new();
            let mut now = 1_000 * MS;
            while at.len() < drops {
                now += MS / 4;
                let judgement = judge(control, first_above, 20 * MS, now, &config, flows, || false);
                first_above = judgement.first_above.unwrap_or(first_above);
                control = judgement.control.unwrap_or(control);
                if judgement.congested {
                    at.push(now);
                }
            }
            at.iter()
                .map(|t| (t - at[0]) / (MS / 4))
                .collect::<Vec<_>>()
        };
        // One flow: RFC 8289's law, interval / sqrt(count) after each drop (100, 70.7,
        // 57.7 ms), in the 1.024 µs units of the control word, seen every 0.25 ms.
        assert_eq!(instants(1, 4), [0, 400, 683, 914]);
        // Four: a quarter of each gap, as four per-flow CoDels would drop together.
        assert_eq!(instants(4, 4), [0, 100, 171, 229]);
        // The entry is the same instant whatever the count: only the spacing changes.
        assert_eq!(instants(0, 2), instants(1, 2), "no flows counts as one");
    }

    #[test]
    fn re_entering_soon_resumes_near_the_last_drop_rate() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        let mut state = CodelState::default();
        let mut now = 1_000 * MS;
        let mut drops = 0;
        for _ in 0..600 {
            now += MS;
            drops += feed(&mut state, 20 * MS, now, &config) as u64;
        }
        let count = Control::unpack(state.control).count;
        assert!(count >= 8, "{count}");
        // A short dip below target, then above again: after the next interval the count
        // restarts at count - lastcount (> 1), not at 1.
        now += MS;
        feed(&mut state, 0, now, &config);
        for _ in 0..101 {
            now += MS;
            drops += feed(&mut state, 20 * MS, now, &config) as u64;
        }
        let resumed = Control::unpack(state.control);
        assert!(resumed.dropping);
        assert_eq!(resumed.count, count - 1, "delta = count - lastcount(1)");
        assert!(drops > count);
    }

    #[test]
    fn a_spared_entry_counts_its_episode_as_a_dropped_one_would() {
        let config = CodelConfig::new(5 * MS, 100 * MS, 100_000_000);
        // `steps` ms above target from `now`, sparing the first `spared` decisions; then a
        // dip below target. The state before the dip.
        let episode = |state: &mut CodelState, now: &mut u64, steps: u32, mut spared: u32| {
            for _ in 0..steps {
                *now += MS;
                feed_sparing(state, 20 * MS, *now, &config, || {
                    let spare = spared > 0;
                    spared = spared.saturating_sub(1);
                    spare
                });
            }
            let control = Control::unpack(state.control);
            *now += MS;
            feed(state, 0, *now, &config);
            control
        };
        // A spared entry, then real drops: a re-entry resumes at the signals since the
        // entry less one, as after a dropped entry.
        let (mut state, mut now) = (CodelState::default(), 1_000 * MS);
        let first = episode(&mut state, &mut now, 600, 1);
        assert!(first.count >= 7, "{}", first.count);
        let resumed = episode(&mut state, &mut now, 101, 0);
        assert!(resumed.dropping);
        assert_eq!(resumed.count, first.count - 1);
        // The re-entry spared too: one short of that.
        let (mut state, mut now) = (CodelState::default(), 1_000 * MS);
        episode(&mut state, &mut now, 600, 1);
        assert_eq!(episode(&mut state, &mut now, 101, 1).count, first.count - 2);
        // A spared entry and no real drop: a re-entry soon after starts afresh (count 1),
        // not at a count wrapped below zero.
        let (mut state, mut now) = (CodelState::default(), 1_000 * MS);
        assert_eq!(episode(&mut state, &mut now, 150, 10).count, 0);
        assert_eq!(episode(&mut state, &mut now, 101, 0).count, 1);
    }

    #[test]
    fn sojourn_is_the_virtual_backlog_in_ns() {
        assert_eq!(sojourn_ns(0, 1000, 0), 0);
        assert_eq!(sojourn_ns(16 * 5_000_000 + 1600, 1600, 0), 5_000_000);
        // A burst of 1 ms is sent ahead: only what lies beyond it waits.
        assert_eq!(
            sojourn_ns(16 * 5_000_000 + 1600, 1600, 16 * 1_000_000),
            4_000_000
        );
        assert_eq!(sojourn_ns(16 * 5_000_000, 0, 16 * 6_000_000), 0);
    }

    #[test]
    fn pings_are_sparse_and_a_bulk_flow_is_not_even_after_a_pause() {
        let cost = sparse_cost(10_000_000);
        let mut now = 1_000 * MS;
        // A ping every 50 ms: always sparse.
        let mut tat = 0;
        for _ in 0..100 {
            let (is_sparse, next) = sparse(tat, now, 98, &cost);
            assert!(is_sparse);
            tat = next;
            now += 50 * MS;
        }
        // A flow at the class rate: its first four frames are sparse, then none.
        let mut tat = 0;
        let mut sparse_frames = 0;
        for _ in 0..1000 {
            let (is_sparse, next) = sparse(tat, now, 1514, &cost);
            sparse_frames += is_sparse as u32;
            tat = next;
            now += 1_211_200; // 1514 bytes at 10 Mbit/s
        }
        assert_eq!(sparse_frames, 4);
        // A 100 ms pause does not make it sparse again.
        assert!(!sparse(tat, now + 100 * MS, 1514, &cost).0);
    }

    #[test]
    fn control_word_round_trips() {
        let control = Control {
            drop_next: 0xdead_beef,
            count: COUNT_MAX,
            lastcount: 12_345,
            dropping: true,
        };
        assert_eq!(Control::unpack(control.pack()), control);
    }
}
