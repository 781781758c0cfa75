use super::*;

const WINDOW: u64 = 125_000;

#[test]
fn contending_flows_split_the_rate_among_them() {
    let two = 2 * SHARE_ONE;
    // Two flows over their share and a standing queue: at once to two.
    assert_eq!(next_share(SHARE_ONE, true, (two, two), 0, WINDOW), two);
    // Four bulk flows, three over their share: a quarter at a time past three.
    let four = 4 * SHARE_ONE;
    let three = 3 * SHARE_ONE;
    assert_eq!(
        next_share(three, true, (four, three), 0, WINDOW),
        three * 5 / 4
    );
    // Never past the bulk flows: an equal split among them.
    assert_eq!(next_share(four, true, (two, two), 0, WINDOW), two);
}

#[test]
fn a_flow_alone_over_its_share_gets_what_the_others_leave() {
    let two = 2 * SHARE_ONE;
    // A flow beside a probe sending 1/10 of the window: 1 / 0.9.
    let m = next_share(SHARE_ONE, true, (two, SHARE_ONE), WINDOW / 10, WINDOW);
    assert!((m as i64 - (SHARE_ONE * 10 / 9) as i64).abs() <= 2, "{m}");
    // A flood beside a flow using 0.4 of the rate: the flood gets 0.6.
    let m = next_share(SHARE_ONE, true, (two, SHARE_ONE), WINDOW * 4 / 10, WINDOW);
    assert!((m as i64 - (SHARE_ONE * 10 / 6) as i64).abs() <= 2, "{m}");
    // ... but never while the queue stands (the rate was all used), and once it empties
    // by 1/16 an interval, not at once.
    let m = next_share(two, true, (two, SHARE_ONE), WINDOW * 4 / 10, WINDOW);
    assert_eq!(m, two);
    let m = next_share(two, false, (two, SHARE_ONE), WINDOW * 4 / 10, WINDOW);
    assert_eq!(m, two - two / 16);
    // Spare bytes beyond the window: held to 15/16.
    let m = next_share(
        SHARE_ONE,
        false,
        (32 * SHARE_ONE, SHARE_ONE),
        10 * WINDOW,
        WINDOW,
    );
    assert!(m.abs_diff(16 * SHARE_ONE) <= 16 * SHARE_ONE / 1000, "{m}");
}

#[test]
fn an_idle_moment_lowers_the_share_of_contending_flows_slowly() {
    let two = 2 * SHARE_ONE;
    assert_eq!(
        next_share(two, false, (two, two), 0, WINDOW),
        two - two / 16
    );
    // No flow over its share: falls by 1/16 whatever the spare bytes say ...
    assert_eq!(
        next_share(two, false, (two, 0), WINDOW / 2, WINDOW),
        two - two / 16
    );
    // ... unless the queue stood: then the shares were too large, and it rises.
    let four = 4 * SHARE_ONE;
    assert_eq!(
        next_share(two, true, (four, 0), WINDOW / 2, WINDOW),
        two + two / 4
    );
    // A fresh census (share 0) reads as one.
    assert_eq!(next_share(0, false, (two, 0), 0, WINDOW), SHARE_ONE);
}

#[test]
fn hosts_share_first_then_their_flows() {
    // Host A's eight flows and host B's one, all over their shares: weight 2.
    let weight = 8 * flow_weight(8) + flow_weight(1);
    let m = next_share(SHARE_ONE, true, (weight, weight), 0, WINDOW);
    assert_eq!(m, 2 * SHARE_ONE);
    let cost = 1_000_000;
    // A's flows pay 16 times the class cost (1/16 each, 1/2 together); B's twice.
    assert_eq!(flow_ticks(cost, m, 8), 16 * cost);
    assert_eq!(flow_ticks(cost, m, 1), 2 * cost);
}

#[test]
fn charges_keep_their_precision_and_saturate() {
    // 1500 bytes at 100 Gbit/s is 1920 ticks: times 3/2 exactly.
    assert_eq!(flow_ticks(1920, SHARE_ONE * 3 / 2, 1), 2880);
    assert_eq!(flow_ticks(u64::MAX, MAX_SHARE, MAX_SHARE), 1 << 62);
    assert_eq!(flow_ticks(1 << 45, SHARE_ONE, 4), 1 << 47);
    assert_eq!(flow_ticks(1 << 46, SHARE_ONE, 4), 1 << 62);
    assert_eq!(flow_ticks(7, 0, 0), 7, "below one: the class rate");
}

#[test]
fn a_flow_is_over_its_share_only_with_more_than_its_packet_queued() {
    assert!(!over_share(0, 1_000, 100, 50));
    assert!(!over_share(1_100, 1_000, 100, 50));
    assert!(over_share(1_101, 1_000, 100, 50));
    // Small packets: over once more than a full-size frame waits.
    assert!(!over_share(1_300, 1_000, 100, 300));
    assert!(over_share(1_301, 1_000, 100, 300));
}

#[test]
fn a_flow_queue_is_capped_at_four_targets_or_four_frames_at_its_share() {
    assert_eq!(flow_cap_ns(5_000_000, 1_200_000, 1_200_000), 20_000_000);
    // A 64 KiB aggregate at 25 Mbit/s (21 ms): two of them.
    assert_eq!(flow_cap_ns(5_000_000, 484_000, 21_000_000), 42_000_000);
    // 64 flows at 10 Mbit/s: a frame takes 77 ms at a share.
    assert_eq!(flow_cap_ns(5_000_000, 77_000_000, 77_000_000), 308_000_000);
}

#[test]
fn a_flow_is_sparse_below_a_sixteenth_of_its_share() {
    let cost = crate::codel::sparse_cost(10_000_000);
    // At a share of one this is the class's own rule.
    for bytes in [64, 1514] {
        assert_eq!(
            sparse_at_share(0, 1_000_000, bytes, &cost, SHARE_ONE),
            crate::codel::sparse(0, 1_000_000, bytes, &cost)
        );
    }
    // A steady flow at 1/20 of the class rate is sparse alone, bulk among 4 sharing it.
    let gap_ns = 1514 * 8 * 1_000_000_000 / (10_000_000 / 20);
    let mut words = (0, 0);
    let mut verdicts = (true, true);
    for packet in 1..200u64 {
        let now = packet * gap_ns;
        let alone = sparse_at_share(words.0, now, 1514, &cost, SHARE_ONE);
        let shared = sparse_at_share(words.1, now, 1514, &cost, 4 * SHARE_ONE);
        words = (alone.1, shared.1);
        verdicts = (alone.0, shared.0);
    }
    assert_eq!(verdicts, (true, false));
}

#[test]
fn only_what_a_flow_sent_within_the_burst_is_credited() {
    // Within the burst: credited, up to the burst.
    assert_eq!(burst_credit(0, false, true, 100, 1_000), 100);
    assert_eq!(burst_credit(950, false, true, 100, 1_000), 1_000);
    // Behind a real queue: kept as it was, not grown.
    assert_eq!(burst_credit(300, false, false, 100, 1_000), 300);
    // A drained queue starts over.
    assert_eq!(burst_credit(300, true, false, 100, 1_000), 0);
    assert_eq!(burst_credit(300, true, true, 100, 1_000), 100);
}

#[test]
fn a_host_counts_at_least_one_flow() {
    let host = FlowQueue::default();
    assert_eq!(host_flows(&host), 1);
    let host = FlowQueue {
        sparse: 3,
        over_share_in: 5,
        ..FlowQueue::default()
    };
    assert_eq!(host_flows(&host), 5);
    assert_eq!(flow_weight(0), SHARE_ONE);
    assert_eq!(flow_weight(4), SHARE_ONE / 4);
}

#[test]
fn a_flow_contends_in_the_interval_it_was_over_its_share_and_the_next() {
    const INTERVAL: u64 = 100_000_000;
    let flagged_at = 5 * INTERVAL;
    assert!(
        contending(flagged_at, flagged_at, INTERVAL),
        "this interval"
    );
    assert!(
        contending(flagged_at, flagged_at + INTERVAL, INTERVAL),
        "the next"
    );
    // Intervals roll on a packet, so the next one may end a little late.
    assert!(contending(flagged_at, flagged_at + 2 * INTERVAL, INTERVAL));
    assert!(
        !contending(flagged_at, flagged_at + 2 * INTERVAL + 1, INTERVAL),
        "then no more"
    );
    assert!(!contending(0, INTERVAL, INTERVAL), "never over its share");
}

#[test]
fn spare_bytes_taken_back_past_zero_are_none() {
    assert_eq!(settle_spare(1_500), 1_500);
    let added = 3_000u64;
    let taken_back = added.wrapping_sub(4_500);
    assert_eq!(settle_spare(taken_back), 0);
}

#[test]
fn a_flow_queue_is_served_at_the_whole_rate_while_the_link_idles() {
    // 3 000 ticks of backlog, 1 000 ticks idle at the flow's share: 2 000 left.
    assert_eq!(served_from(13_000, 10_000, 1_000), 12_000);
    // Idle longer than its backlog: drained, from now.
    assert_eq!(served_from(13_000, 10_000, 5_000), 10_000);
    // Drained already: from now, whatever the idle time.
    assert_eq!(served_from(9_000, 10_000, 0), 10_000);
    // A busy link forgives nothing.
    assert_eq!(served_from(13_000, 10_000, 0), 13_000);
}

#[test]
fn a_flow_that_lost_a_quarter_to_its_cap_three_intervals_running_is_held() {
    let streak = |intervals: u64| intervals << 56;
    // TCP losing one aggregate of its interval is not lossy; a flood losing a third is:
    // lossy intervals add up, held from the third on.
    assert_eq!(roll_cap_drops(streak(2) | 64_000, 312_000), 0);
    assert_eq!(roll_cap_drops(100_000, 300_000), streak(1));
    assert_eq!(roll_cap_drops(streak(1) | 100_000, 300_000), streak(2));
    assert_eq!(
        roll_cap_drops(streak(2) | 100_000, 300_000),
        streak(3) | HELD
    );
    assert_eq!(
        roll_cap_drops(streak(3) | HELD | 4_000, 8_000),
        streak(4) | HELD
    );
    // Exactly a quarter is lossy, a byte less is not, and ends the streak: let go.
    assert_eq!(roll_cap_drops(streak(2) | 2_000, 8_000), streak(3) | HELD);
    assert_eq!(roll_cap_drops(streak(5) | HELD | 1_999, 8_000), 0);
    // Nothing lost, or nothing judged: not lossy.
    assert_eq!(roll_cap_drops(streak(2), 8_000), 0);
    assert_eq!(roll_cap_drops(0, 0), 0);
    // The streak stops counting at 63.
    assert_eq!(
        roll_cap_drops(streak(63) | HELD | 8_000, 8_000),
        streak(63) | HELD
    );
}

#[test]
fn the_long_cap_is_two_intervals_within_a_part_of_the_class_queue() {
    const MS: u64 = 1_000_000;
    let one = SHARE_ONE;
    // A sixth of a 100 ms class cap for a flow on its own, a quarter under hosts.
    let alone = long_cap_budget_ns(100 * MS, false);
    let by_host = long_cap_budget_ns(100 * MS, true);
    assert_eq!(by_host, 25 * MS);
    assert_eq!(alone, 100 * MS / 6);
    let long =
        |budget: u64, share: u64, hosts: u64| cap_for_ns(0, 5 * MS, 100 * MS, budget, share, hosts);
    // Sixteen flows: two intervals of a flow's time are 12.5 ms of the class's.
    assert_eq!(long(alone, 16 * one, 1), 200 * MS);
    // Alone: a sixth of the class's cap (to the tick).
    assert!(
        long(alone, one, 1).abs_diff(100 * MS / 6) < 1_000,
        "{}",
        long(alone, one, 1)
    );
    // Four flows: 67 ms of their time; one of two hosts' two flows: 100 ms.
    assert!(long(alone, 4 * one, 1).abs_diff(400 * MS / 6) < 4_000);
    assert_eq!(long(by_host, 2 * one, 2), 100 * MS);
    // Never below the short cap; held: the short one.
    assert_eq!(cap_for_ns(0, 80 * MS, 100 * MS, by_host, one, 1), 80 * MS);
    assert_eq!(
        cap_for_ns(HELD, 20 * MS, 100 * MS, by_host, 16 * one, 1),
        20 * MS
    );
    assert_eq!(
        cap_for_ns(HELD | 2, 20 * MS, 100 * MS, by_host, 16 * one, 1),
        20 * MS
    );
}

#[test]
fn only_a_flow_that_heeds_drops_passes_its_cap_while_the_link_idles() {
    // Fair by flow, the real queue at most a frame, a flow not held: it passes.
    assert!(passes_beyond_cap(true, 0, false));
    // Some bytes lost to its cap this interval but not held: still a responsive flow.
    assert!(passes_beyond_cap(true, 3_000, false));
    // The real queue longer than a frame: the cap holds.
    assert!(!passes_beyond_cap(false, 0, false));
    // A flood held to the short cap never passes.
    assert!(!passes_beyond_cap(true, HELD, false));
    // Under --fair src|dst the flows' caps hold.
    assert!(!passes_beyond_cap(true, 0, true));
}
