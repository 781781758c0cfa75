//! One global class's share on this host: demand and the decision from Redis's answer
//! (or its absence), pure and tested on the host.

use super::*;

/// A class's counters at one moment (bytes since the class was added).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub passed_bytes: u64,
    pub dropped_bytes: u64,
    pub marked_bytes: u64,
    /// A shape class's queue stands (its virtual queue above CoDel's target, or CoDel
    /// dropping) at this moment: it holds back traffic that would go now.
    pub backlogged: bool,
}

/// What this host asks for, from the class's counters over the last interval. A host
/// that was held back (its shape queue stands, it dropped or marked more than 1 % of
/// what it offered, or it sent 95 % of its share) could use more: it asks for what it was offered, at least a quarter
/// above its share and at least `fair_bits_per_sec` (the limit over the hosts last
/// counted), so a host squeezed to a small share by elastic traffic elsewhere gets an
/// equal part back at once instead of growing a quarter per interval. Any other host asks
/// for what it sent and a tenth more (so a steady sender below its share is never held
/// back by its own demand).
pub fn demand(
    before: &Usage,
    after: &Usage,
    elapsed: Duration,
    share_bits_per_sec: u64,
    fair_bits_per_sec: u64,
) -> u64 {
    let seconds = elapsed.as_secs_f64().max(1e-3);
    let rate = |bytes: u64| bytes as f64 * 8.0 / seconds;
    let passed = after.passed_bytes.saturating_sub(before.passed_bytes);
    let dropped = after.dropped_bytes.saturating_sub(before.dropped_bytes);
    let marked = after.marked_bytes.saturating_sub(before.marked_bytes);
    let offered = passed + dropped;
    let share = share_bits_per_sec as f64;
    let held_back = after.backlogged
        || (dropped + marked) * 100 > offered
        || rate(passed) >= 0.95 * share && share > 0.0;
    let wanted = if held_back {
        rate(offered)
            .max(1.25 * share)
            .max(fair_bits_per_sec as f64)
    } else {
        1.1 * rate(passed)
    };
    wanted as u64
}

/// Redis's answer for one class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub share_bits_per_sec: u64,
    pub hosts: u32,
    /// When the class's state in Redis began (ms): a new one means Redis lost it.
    pub epoch_ms: u64,
    /// The limit the fill used.
    pub limits: Limits,
    /// Host fields that did not parse, removed by this call's fill (someone with the
    /// hosts' ACL wrote them).
    pub dropped_fields: u32,
}

/// The limit Redis filled with: the published one (`version` ≥ 1, written by
/// `shaper global publish`) or, with none published, the caller's own (`version` 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub limit_bits_per_sec: u64,
    pub version: u64,
    /// The interval the fill used (the published one, or the caller's).
    pub interval_ms: u64,
}

/// One global class's share on this host, from one tick to the next.
#[derive(Clone, Debug)]
pub struct Tracker {
    pub limit_bits_per_sec: u64,
    pub floor_bits_per_sec: u64,
    pub on_loss: OnLoss,
    /// The share in force on this host.
    pub applied: u64,
    /// The last answer's share: a higher share is applied only when two answers in a row
    /// allow it, so a host never rises before the others have lowered.
    last_answer: Option<u64>,
    /// Hosts at the last answer.
    pub hosts: u32,
    /// Ticks in a row without an answer.
    pub missed: u32,
    /// The demand last reported (see [`Tracker::report_demand`]).
    pub demand: u64,
    /// No demand reported yet: the first is at least the share in force.
    first_report: bool,
    pub epoch_ms: Option<u64>,
    /// The limit Redis last filled with (published or this host's own).
    pub filled_with: Option<Limits>,
    /// [`RAMP_GRACE`] in ticks.
    ramp_ticks: u32,
    /// Ticks left in which the reported demand stays at least `ramp_share`.
    ramp_left: u32,
    ramp_share: u64,
}

/// What a tick changed, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Steady,
    /// Redis answered with a state younger than the one this host knew.
    Relearning,
    /// The first tick without Redis.
    Lost,
    /// The first answer after a loss.
    Back,
}

impl Tracker {
    pub fn new(limit: u64, floor: u64, on_loss: OnLoss, applied: u64, interval: Duration) -> Self {
        let interval_ms = interval.as_millis().max(1);
        Self {
            limit_bits_per_sec: limit,
            floor_bits_per_sec: floor,
            on_loss,
            applied: applied.clamp(floor, limit),
            last_answer: None,
            hosts: 0,
            missed: 0,
            // Until a whole interval is measured, the host wants what it holds: a daemon
            // restarted on a busy host must not report it idle (its first interval is a
            // few microseconds long) and hand its share to the others.
            demand: applied.clamp(floor, limit),
            first_report: true,
            epoch_ms: None,
            filled_with: None,
            // At least two ticks: a rise is applied an answer after it is allowed.
            ramp_ticks: RAMP_GRACE.as_millis().div_ceil(interval_ms).max(2) as u32,
            ramp_left: 0,
            ramp_share: 0,
        }
    }

    /// The demand to report from this interval's `measured` one: it rises at once but
    /// falls to no less than a third per interval. An elastic sender (TCP) needs a few
    /// round trips to grow into a share it was just given; judged by one interval it
    /// would look idle, lose the share, collapse and ask again, never settling. A host
    /// that stopped still gives its share up within a few intervals (10 Mbit/s to under
    /// 0.4 in three). A share it asked for and was just given is kept asked for during
    /// [`RAMP_GRACE`].
    pub fn report_demand(&mut self, measured: u64) -> u64 {
        let fall = if std::mem::take(&mut self.first_report) {
            1
        } else {
            DEMAND_FALL
        };
        let mut demand = measured.max(self.demand / fall);
        if self.ramp_left > 0 {
            self.ramp_left -= 1;
            demand = demand.max(self.ramp_share);
        }
        self.demand = demand;
        self.demand
    }

    /// An equal part of the limit among the hosts last counted (the whole limit before
    /// any answer).
    pub fn fair_share(&self) -> u64 {
        self.fill_limit() / u64::from(self.hosts.max(1))
    }

    /// The limit the hosts share: the one Redis last filled with (a published limit
    /// wins over this host's file), this host's own before any answer.
    pub fn fill_limit(&self) -> u64 {
        self.filled_with
            .map_or(self.limit_bits_per_sec, |limits| limits.limit_bits_per_sec)
    }

    /// Redis answered: lower at once, rise an answer later.
    pub fn answered(&mut self, answer: Answer) -> Event {
        let share = answer
            .share_bits_per_sec
            .clamp(self.floor_bits_per_sec, self.limit_bits_per_sec);
        let event = if self.missed > 0 {
            Event::Back
        } else if self.epoch_ms.is_some_and(|known| known != answer.epoch_ms) {
            Event::Relearning
        } else {
            Event::Steady
        };
        let allowed = self.last_answer.unwrap_or(self.applied);
        let before = self.applied;
        self.applied = share.min(allowed);
        // Only a host climbing out of a squeeze: one near its part asks and rises often
        // and must still give its share up at once when it stops.
        if self.applied > before && self.demand > before && before < self.fair_share() / 4 {
            self.ramp_left = self.ramp_ticks;
            self.ramp_share = self.applied.min(self.demand);
        }
        self.last_answer = Some(share);
        self.hosts = answer.hosts;
        self.missed = 0;
        self.epoch_ms = Some(answer.epoch_ms);
        self.filled_with = Some(answer.limits);
        event
    }

    /// No answer this tick: `static` holds the share, then takes the limit (less the
    /// headroom) over the last host count; `open` the limit; `closed` the floor.
    pub fn lost(&mut self) -> Event {
        self.missed += 1;
        self.last_answer = None;
        self.applied = match self.on_loss {
            // A host that never had an answer knows no host count: it keeps its floor.
            OnLoss::Static if self.missed <= STATIC_HOLD_INTERVALS || self.hosts == 0 => {
                self.applied
            }
            OnLoss::Static => {
                let limit = self.fill_limit();
                let budget = limit - limit * HEADROOM_PPM / 1_000_000;
                (budget / self.hosts.max(1) as u64)
                    .clamp(self.floor_bits_per_sec, self.limit_bits_per_sec)
            }
            OnLoss::Open => self.limit_bits_per_sec,
            OnLoss::Closed => self.floor_bits_per_sec,
        };
        if self.missed == 1 {
            Event::Lost
        } else {
            Event::Steady
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MBIT: u64 = 1_000_000;

    fn usage(passed: u64, dropped: u64) -> Usage {
        Usage {
            passed_bytes: passed,
            dropped_bytes: dropped,
            marked_bytes: 0,
            backlogged: false,
        }
    }

    /// Redis's answer: `share` among 3 hosts, in a state begun at 7 ms.
    fn answer(share: u64) -> Answer {
        Answer {
            share_bits_per_sec: share,
            hosts: 3,
            epoch_ms: 7,
            limits: Limits {
                limit_bits_per_sec: 30 * MBIT,
                version: 0,
                interval_ms: 250,
            },
            dropped_fields: 0,
        }
    }

    #[test]
    fn a_held_back_host_asks_for_what_it_was_offered() {
        let fair = 10 * MBIT;
        // One second from zero counters: `passed` and `dropped` in bit/s.
        let ask = |passed: u64, dropped: u64, share: u64| {
            let after = usage(passed / 8, dropped / 8);
            demand(&usage(0, 0), &after, Duration::from_secs(1), share, fair)
        };
        // 10 Mbit/s passed, 20 dropped, share 10: offered 30.
        assert_eq!(ask(10 * MBIT, 20 * MBIT, 10 * MBIT), 30 * MBIT);
        // An elastic sender using its whole share asks for a quarter more.
        assert_eq!(ask(10 * MBIT, 0, 10 * MBIT), 12_500_000);
        // ... and one squeezed to 1 Mbit/s asks for an equal part at once.
        assert_eq!(ask(MBIT, 0, MBIT), fair);
        // A steady 5 Mbit/s sender with a share of 10 asks for 5.5 ...
        assert_eq!(ask(5 * MBIT, 0, 10 * MBIT), 5_500_000);
        // ... and keeps it at its own share of 5.5: 5 is below 95 % of it.
        assert_eq!(ask(5 * MBIT, 0, 5_500_000), 5_500_000);
        // A shape class whose queue stands is held back, whatever it sent.
        let standing = Usage {
            backlogged: true,
            ..usage(MBIT / 8, 0)
        };
        let second = Duration::from_secs(1);
        assert_eq!(
            demand(&usage(0, 0), &standing, second, 5 * MBIT, fair),
            fair
        );
    }

    #[test]
    fn a_higher_share_waits_an_answer_a_lower_one_does_not() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        tracker.answered(answer(10 * MBIT));
        assert_eq!(tracker.applied, MBIT, "the first answer does not raise");
        tracker.answered(answer(12 * MBIT));
        assert_eq!(
            tracker.applied,
            10 * MBIT,
            "raised to the lower of two answers"
        );
        tracker.answered(answer(4 * MBIT));
        assert_eq!(tracker.applied, 4 * MBIT, "lowered at once");
        assert_eq!(tracker.answered(answer(40 * MBIT)), Event::Steady);
        assert_eq!(tracker.applied, 4 * MBIT);
        tracker.answered(answer(40 * MBIT));
        assert_eq!(tracker.applied, 30 * MBIT, "never above the limit");
        let mut restarted = answer(10 * MBIT);
        restarted.epoch_ms = 8;
        assert_eq!(tracker.answered(restarted), Event::Relearning);
    }

    #[test]
    fn demand_rises_at_once_and_falls_to_a_third_at_most_per_interval() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        assert_eq!(tracker.report_demand(27 * MBIT), 27 * MBIT);
        assert_eq!(tracker.report_demand(MBIT), 9 * MBIT);
        assert_eq!(tracker.report_demand(0), 3 * MBIT);
        assert_eq!(tracker.report_demand(8 * MBIT), 8 * MBIT);
    }

    #[test]
    fn a_new_tracker_first_reports_at_least_the_share_in_force() {
        // A restarted daemon's first interval is a few microseconds: measured as idle.
        let mut tracker =
            Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 10 * MBIT, DEFAULT_INTERVAL);
        assert_eq!(tracker.report_demand(0), 10 * MBIT);
        assert_eq!(
            tracker.report_demand(0),
            10 * MBIT / 3,
            "then falls as before"
        );
        let mut tracker =
            Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 10 * MBIT, DEFAULT_INTERVAL);
        assert_eq!(tracker.report_demand(20 * MBIT), 20 * MBIT);
    }

    #[test]
    fn a_share_given_to_a_host_that_asked_is_kept_asked_for_while_it_ramps() {
        let mut tracker = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        // Held back at the floor: it asks for an equal part and gets it an answer later.
        tracker.report_demand(10 * MBIT);
        tracker.answered(answer(10 * MBIT));
        tracker.report_demand(10 * MBIT);
        tracker.answered(answer(10 * MBIT));
        assert_eq!(tracker.applied, 10 * MBIT);
        // Its TCP sender sits in retransmission backoff: nothing sent for the grace...
        let grace_ticks = RAMP_GRACE.as_millis() / DEFAULT_INTERVAL.as_millis();
        for tick in 0..grace_ticks {
            assert_eq!(tracker.report_demand(0), 10 * MBIT, "tick {tick}");
        }
        // ... then the demand falls as any other.
        assert_eq!(tracker.report_demand(0), 10 * MBIT / DEMAND_FALL);
        // A share that rose without being asked for (spare spread evenly) is not held.
        let mut idle = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        idle.report_demand(0);
        idle.answered(answer(10 * MBIT));
        idle.report_demand(0);
        idle.answered(answer(10 * MBIT));
        assert_eq!(idle.applied, 10 * MBIT);
        // (Its first report was the floor it held; from there it falls.)
        assert_eq!(idle.report_demand(0), MBIT / 9);
        // Nor one that rose from near its part: it gives the share up at once on stopping.
        let mut near = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 5 * MBIT, DEFAULT_INTERVAL);
        near.hosts = 3;
        near.report_demand(10 * MBIT);
        near.answered(answer(10 * MBIT));
        near.report_demand(10 * MBIT);
        near.answered(answer(10 * MBIT));
        assert_eq!(near.applied, 10 * MBIT);
        assert_eq!(near.report_demand(0), 10 * MBIT / DEMAND_FALL);
    }

    #[test]
    fn without_redis_each_mode_falls_where_it_says() {
        let mut held = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 5 * MBIT, DEFAULT_INTERVAL);
        held.hosts = 3;
        for _ in 0..STATIC_HOLD_INTERVALS {
            held.lost();
            assert_eq!(held.applied, 5 * MBIT);
        }
        held.lost();
        assert_eq!(held.applied, 9_800_000, "(30 less 2 %) / 3");
        let mut open = Tracker::new(30 * MBIT, MBIT, OnLoss::Open, 5 * MBIT, DEFAULT_INTERVAL);
        assert_eq!(open.lost(), Event::Lost);
        assert_eq!(open.applied, 30 * MBIT);
        let mut closed = Tracker::new(30 * MBIT, MBIT, OnLoss::Closed, 5 * MBIT, DEFAULT_INTERVAL);
        closed.lost();
        assert_eq!(closed.applied, MBIT);
        let back = Answer {
            epoch_ms: 1,
            ..answer(10 * MBIT)
        };
        assert_eq!(closed.answered(back), Event::Back);
        assert_eq!(
            closed.applied, MBIT,
            "back from a loss, it rises an answer later"
        );
    }

    #[test]
    fn a_published_limit_is_what_static_falls_back_to() {
        // This host's file says 30 Mbit/s; the allocator filled with a published 15.
        let mut held = Tracker::new(30 * MBIT, MBIT, OnLoss::Static, 5 * MBIT, DEFAULT_INTERVAL);
        held.answered(Answer {
            limits: Limits {
                limit_bits_per_sec: 15 * MBIT,
                version: 2,
                interval_ms: 250,
            },
            ..answer(5 * MBIT)
        });
        assert_eq!(held.fair_share(), 5 * MBIT, "15 over 3 hosts");
        for _ in 0..=STATIC_HOLD_INTERVALS {
            held.lost();
        }
        assert_eq!(
            held.applied, 4_900_000,
            "(15 less 2 %) / 3, not (30 less 2 %) / 3"
        );
        // A published limit above this host's rate: the host's own rate still caps it.
        let mut capped = Tracker::new(3 * MBIT, MBIT, OnLoss::Static, MBIT, DEFAULT_INTERVAL);
        capped.answered(Answer {
            hosts: 1,
            limits: Limits {
                limit_bits_per_sec: 30 * MBIT,
                version: 1,
                interval_ms: 250,
            },
            ..answer(3 * MBIT)
        });
        for _ in 0..=STATIC_HOLD_INTERVALS {
            capped.lost();
        }
        assert_eq!(capped.applied, 3 * MBIT);
    }
}
