//! The meters under racing CPUs (issue 11, item 5): several CPUs colour packets on the
//! same two words at once, their loads and compare-and-swaps interleaved in every order a
//! seeded scheduler picks, through the very function the eBPF program runs
//! (`meter::colour_of`). Whatever the interleaving, the admitted packets keep to each of
//! the meter's buckets: green ones to C (CIR, CBS), and green and yellow together to
//! srTCM's total (CIR, CBS + EBS) or trTCM's P (PIR, PBS).
//!
//! Each CPU is a thread that may touch the words only when the scheduler hands it the
//! baton, one load or swap at a time, so a run is a deterministic interleaving.

mod support;

use proptest::{
    prelude::*,
    test_runner::{RngAlgorithm, TestRng},
};
use shaper_common::{
    bucket::ticks,
    meter::{colour_of, Colour, MeterWord, MeterWords, METER_SRTCM, METER_TRTCM},
    ByteCost, ClassConfig,
};
use std::{
    cell::RefCell,
    sync::{Condvar, Mutex},
};

const CASES: u32 = 120;
/// Overrides [`CASES`]: `cargo xtask mutants` runs 40, since each case is thousands of
/// thread hand-offs (a minute on two cores for 120) and it runs the tests once per mutant.
const CASES_VARIABLE: &str = "SHAPER_RACE_CASES";

fn cases() -> u32 {
    std::env::var(CASES_VARIABLE)
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(CASES)
}
/// Swap rounds, as in the eBPF program.
const ATTEMPTS: u32 = 8;

/// The words and whose turn it is to touch them.
struct Shared {
    words: [u64; 2],
    /// The CPU allowed one operation now.
    turn: Option<usize>,
    /// CPUs blocked before their next operation.
    waiting: Vec<bool>,
    /// CPUs done with their packet.
    done: Vec<bool>,
}

struct Baton {
    shared: Mutex<Shared>,
    changed: Condvar,
}

impl Baton {
    /// CPU `cpu` performs `operation` on the words once the scheduler picks it.
    fn operate<R>(&self, cpu: usize, operation: impl FnOnce(&mut [u64; 2]) -> R) -> R {
        let mut shared = self.shared.lock().unwrap();
        shared.waiting[cpu] = true;
        self.changed.notify_all();
        while shared.turn != Some(cpu) {
            shared = self.changed.wait(shared).unwrap();
        }
        let result = operation(&mut shared.words);
        shared.waiting[cpu] = false;
        shared.turn = None;
        self.changed.notify_all();
        result
    }

    fn finish(&self, cpu: usize) {
        let mut shared = self.shared.lock().unwrap();
        shared.done[cpu] = true;
        self.changed.notify_all();
    }

    /// Hands out operations to the CPUs in an order drawn from `pick` until all are done.
    fn schedule(&self, mut pick: impl FnMut(usize) -> usize) {
        let mut shared = self.shared.lock().unwrap();
        loop {
            // Every CPU is either blocked before an operation or done.
            while shared.turn.is_some()
                || shared
                    .waiting
                    .iter()
                    .zip(&shared.done)
                    .any(|(waiting, done)| !waiting && !done)
            {
                shared = self.changed.wait(shared).unwrap();
            }
            let ready: Vec<usize> = (0..shared.waiting.len())
                .filter(|&cpu| shared.waiting[cpu])
                .collect();
            if ready.is_empty() {
                return;
            }
            shared.turn = Some(ready[pick(ready.len())]);
            self.changed.notify_all();
        }
    }
}

/// One CPU's view of the words: every access waits for its turn.
struct Cpu<'a> {
    baton: &'a Baton,
    cpu: usize,
}

fn index(word: MeterWord) -> usize {
    match word {
        MeterWord::Committed => 0,
        MeterWord::Second => 1,
    }
}

impl MeterWords for Cpu<'_> {
    fn load(&mut self, word: MeterWord) -> u64 {
        self.baton.operate(self.cpu, |words| words[index(word)])
    }

    fn swap(&mut self, word: MeterWord, current: u64, new: u64) -> bool {
        self.baton.operate(self.cpu, |words| {
            let slot = &mut words[index(word)];
            let swapped = *slot == current;
            if swapped {
                *slot = new;
            }
            swapped
        })
    }
}

/// A token bucket that admitted packets are charged to whether or not it holds them: the
/// admitted stream kept to (rate, burst) exactly when its level never goes below zero.
struct Ledger {
    cost: ByteCost,
    level: i128,
    last_ticks: u64,
}

impl Ledger {
    fn full(cost: ByteCost, now: u64) -> Self {
        Self {
            cost,
            level: cost.tolerance_ticks as i128,
            last_ticks: ticks(now),
        }
    }

    fn refill(&mut self, now: u64) {
        let dt = ticks(now) - self.last_ticks;
        self.last_ticks = ticks(now);
        self.level = (self.level + dt as i128).min(self.cost.tolerance_ticks as i128);
    }

    fn charge(&mut self, bytes: u64) {
        self.level -= self.cost.ticks_for(bytes) as i128;
    }
}

/// Packets arriving together on `cpus` CPUs, then a gap: overload phases (gaps up to
/// 0.4 ms) and quiet ones (up to 4 ms), so every colour and bucket level occurs.
#[derive(Debug, Clone)]
struct Race {
    trtcm: bool,
    committed_bits: u64,
    committed_burst: u64,
    second_bits: u64,
    second_burst: u64,
    /// (gap before the group in ns, packet sizes, one per racing CPU).
    groups: Vec<(u64, Vec<u64>)>,
}

fn race() -> impl Strategy<Value = Race> {
    (
        any::<bool>(),
        1_000_000u64..=1_000_000_000,
        1u64..=8,
        1u64..=4,
        1u64..=8,
        prop::collection::vec(
            (
                prop_oneof![0u64..400_000, 0u64..4_000_000],
                prop::collection::vec(64u64..=1500, 2..=6),
            ),
            100..300,
        ),
    )
        .prop_map(
            |(trtcm, committed_bits, cbs_frames, peak_factor, extra_frames, groups)| Race {
                trtcm,
                committed_bits,
                committed_burst: cbs_frames * 1500,
                // trTCM: PIR ≥ CIR, PBS ≥ CBS. srTCM: the total runs at CIR with
                // CBS + EBS.
                second_bits: if trtcm {
                    committed_bits * peak_factor
                } else {
                    committed_bits
                },
                second_burst: (cbs_frames + extra_frames) * 1500,
                groups,
            },
        )
}

/// Colours one group of packets on racing CPUs, in the interleaving `dice` draws.
fn colour_group(
    words: [u64; 2],
    class: &ClassConfig,
    now: u64,
    sizes: &[u64],
    dice: &mut TestRng,
) -> ([u64; 2], Vec<Colour>) {
    let baton = Baton {
        shared: Mutex::new(Shared {
            words,
            turn: None,
            waiting: vec![false; sizes.len()],
            done: vec![false; sizes.len()],
        }),
        changed: Condvar::new(),
    };
    let colours = std::thread::scope(|scope| {
        let cpus: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(cpu, &bytes)| {
                let baton = &baton;
                scope.spawn(move || {
                    let colour = colour_of(&mut Cpu { baton, cpu }, class, bytes, now, ATTEMPTS);
                    baton.finish(cpu);
                    colour
                })
            })
            .collect();
        baton.schedule(|ready| dice.random_range(0..ready));
        cpus.into_iter()
            .map(|cpu| cpu.join().unwrap())
            .collect::<Vec<_>>()
    });
    let words = baton.shared.into_inner().unwrap().words;
    (words, colours)
}

#[test]
fn racing_cpus_never_admit_more_than_a_meters_buckets_hold() {
    let cases = cases();
    let mut runner = support::deterministic_runner(cases);
    let dice = RefCell::new(TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let seen = RefCell::new([0u64; 3]);
    // Bytes admitted over all cases: (on one CPU, by racing CPUs).
    let totals = RefCell::new((0u128, 0u128));
    runner
        .run(&race(), |race| {
            let mut class = ClassConfig {
                cost: ByteCost::new(race.committed_bits, race.committed_burst),
                peak_cost: ByteCost::new(race.second_bits, race.second_burst),
                meter: if race.trtcm { METER_TRTCM } else { METER_SRTCM },
                ..ClassConfig::default()
            };
            class.start_costs();
            // Some hours of uptime: the clock is absolute.
            let mut now = 5 * 3600 * 1_000_000_000;
            let mut committed = Ledger::full(class.cost, now);
            let mut second = Ledger::full(class.peak_cost, now);
            let mut words = [0u64; 2];
            // The same arrivals on one CPU: what the meter admits without a race.
            let mut serial_words = [0u64; 2];
            let mut serial_admitted = 0u128;
            let mut admitted = 0u128;
            for (gap, sizes) in &race.groups {
                now += gap;
                let colours;
                (words, colours) = colour_group(words, &class, now, sizes, &mut dice.borrow_mut());
                committed.refill(now);
                second.refill(now);
                for (&bytes, &colour) in sizes.iter().zip(&colours) {
                    seen.borrow_mut()[colour as usize] += 1;
                    if colour != Colour::Red {
                        second.charge(bytes);
                        admitted += bytes as u128;
                    }
                    if colour == Colour::Green {
                        committed.charge(bytes);
                    }
                    let serial = colour_of(&mut Serial(&mut serial_words), &class, bytes, now, 1);
                    if serial != Colour::Red {
                        serial_admitted += bytes as u128;
                    }
                }
                prop_assert!(
                    committed.level >= 0,
                    "green packets took {} ticks more than C held",
                    -committed.level
                );
                prop_assert!(
                    second.level >= 0,
                    "green and yellow packets took {} ticks more than the {} held",
                    -second.level,
                    if race.trtcm {
                        "P bucket"
                    } else {
                        "total of C and E"
                    }
                );
            }
            let mut totals = totals.borrow_mut();
            totals.0 += serial_admitted;
            totals.1 += admitted;
            Ok(())
        })
        .unwrap();
    let (serial, racing) = totals.into_inner();
    let kept = racing as f64 / serial as f64;
    let seen = seen.into_inner();
    println!(
        "colours over all cases (green, yellow, red): {seen:?}; racing CPUs admitted {:.4} of \
         the bytes one CPU admits for the same arrivals",
        kept
    );
    // Every colour must have been reached often, or the bounds were barely checked (2 000
    // times in 120 cases).
    let often = 2_000 * u64::from(cases) / u64::from(CASES);
    assert!(seen.iter().all(|&count| count > often), "{seen:?}");
    // Losing a race may cost a packet its colour, never more than a few per cent of the
    // bytes a single CPU would have admitted.
    assert!(
        kept > 0.95,
        "racing CPUs admitted only {kept:.4} of the serial bytes"
    );
}

/// The words on one CPU: loads and swaps without a race.
struct Serial<'a>(&'a mut [u64; 2]);

impl MeterWords for Serial<'_> {
    fn load(&mut self, word: MeterWord) -> u64 {
        self.0[index(word)]
    }

    fn swap(&mut self, word: MeterWord, current: u64, new: u64) -> bool {
        let slot = &mut self.0[index(word)];
        let swapped = *slot == current;
        if swapped {
            *slot = new;
        }
        swapped
    }
}
