//! The map layout's small arithmetic, value by value (issue 34: cargo-mutants found these
//! only reached by the lab): stats summed over CPUs, a global share's expiry and floor,
//! a word's version, the HTB burst in a shape class's sojourn, the rules generation, and
//! a word converted from an older cost version as of the change.

use shaper_common::{
    bucket::{rescale, tagged, ticks},
    settle_older, ByteCost, ClassConfig, ClassStats, CostKind, CostVersion, GlobalShare, Globals,
};

#[test]
fn stats_of_cpus_add_up_field_by_field() {
    // Distinct values per field, so a field added twice, not at all or into another shows.
    let mut fields = [0u64; 12];
    for (index, field) in fields.iter_mut().enumerate() {
        *field = 3 << index;
    }
    let stats = |f: [u64; 12]| ClassStats {
        passed_packets: f[0],
        passed_bytes: f[1],
        dropped_packets: f[2],
        dropped_bytes: f[3],
        marked_packets: f[4],
        marked_bytes: f[5],
        green_packets: f[6],
        green_bytes: f[7],
        yellow_packets: f[8],
        yellow_bytes: f[9],
        red_packets: f[10],
        red_bytes: f[11],
    };
    let mut sum = stats(fields);
    sum.accumulate(&stats(fields.map(|value| value * 5)));
    assert_eq!(sum, stats(fields.map(|value| value * 6)));
}

#[test]
fn a_share_expires_after_its_time_and_never_without_one() {
    let share = GlobalShare {
        expires_ns: 1_000,
        ..GlobalShare::default()
    };
    assert!(!share.expired(999));
    assert!(!share.expired(1_000), "at its time it still holds");
    assert!(share.expired(1_001));
    let none = GlobalShare::default();
    assert!(!none.expired(u64::MAX), "0: no expiry pending");
}

#[test]
fn the_floor_is_installed_as_its_version_as_of_the_expiry() {
    let mut config = ClassConfig {
        cost: ByteCost::new(30_000_000, 100_000),
        ..ClassConfig::default()
    };
    config.start_costs();
    let floor = CostVersion {
        cost: ByteCost::new(300_000, 10_000),
        peak_cost: ByteCost::new(600_000, 20_000),
    };
    // Version 6 of four slots: slot 2.
    let share = GlobalShare {
        expires_ns: 7_000,
        floor,
        floor_version: 6,
        ..GlobalShare::default()
    };
    share.install_floor(&mut config);
    assert_eq!(
        (config.cost, config.peak_cost),
        (floor.cost, floor.peak_cost)
    );
    assert_eq!(config.history[2], floor);
    assert_eq!(config.history[0].cost, ByteCost::new(30_000_000, 100_000));
    assert_eq!(config.changed_at_ns, 7_000);
    assert_eq!(config.version, 2);
}

#[test]
fn a_word_of_another_version_is_stale() {
    let mut config = ClassConfig::default();
    config.start_costs();
    config.set_costs(
        CostVersion {
            cost: ByteCost::new(1_000_000, 10_000),
            ..config.costs()
        },
        5,
    );
    assert_eq!(config.version, 1);
    assert!(!config.stale(tagged(123, 1)));
    assert!(config.stale(tagged(123, 0)));
    assert!(config.stale(tagged(123, 3)));
}

#[test]
fn htb_burst_is_in_the_sojourn_only_on_the_htb_path() {
    let cost = ByteCost::new(8_000_000, 128 * 1024);
    let htb = ClassConfig {
        cost,
        action_arg: 0x5348_0002,
        ..ClassConfig::default()
    };
    assert_eq!(htb.shape_burst_ticks(), cost.tolerance_ticks);
    let edt = ClassConfig {
        action_arg: 0,
        ..htb
    };
    assert_eq!(edt.shape_burst_ticks(), 0);
}

#[test]
fn every_rules_change_moves_the_generation_wrapping() {
    let mut globals = Globals {
        rules_generation: u32::MAX - 1,
        ..Globals::default()
    };
    globals.rules_changed();
    assert_eq!(globals.rules_generation, u32::MAX);
    globals.rules_changed();
    assert_eq!(globals.rules_generation, 0);
}

#[test]
fn an_older_word_converts_as_of_the_change_or_of_now_if_earlier() {
    let old = CostVersion {
        cost: ByteCost::new(10_000_000, 100_000),
        peak_cost: ByteCost::new(20_000_000, 200_000),
    };
    let mut config = ClassConfig {
        cost: old.cost,
        peak_cost: old.peak_cost,
        ..ClassConfig::default()
    };
    config.start_costs();
    let new = CostVersion {
        cost: ByteCost::new(40_000_000, 100_000),
        peak_cost: ByteCost::new(80_000_000, 200_000),
    };
    let changed = 10_000_000_000;
    config.set_costs(new, changed);
    // A word owing 40 µs at the old rate as of the change.
    let tat = ticks(changed) + ticks(40_000);
    let word = tagged(tat, 0);
    for (kind, from, to) in [
        (CostKind::Main, &old.cost, &new.cost),
        (CostKind::Peak, &old.peak_cost, &new.peak_cost),
    ] {
        // After the change: converted as of the change.
        assert_eq!(
            settle_older(&config, word, changed + 5_000, kind),
            rescale(tat, changed, from, to)
        );
        // A CPU's clock a hair behind the change: as of its now.
        assert_eq!(
            settle_older(&config, word, changed - 5_000, kind),
            rescale(tat, changed - 5_000, from, to)
        );
        assert_ne!(
            rescale(tat, changed - 5_000, from, to),
            rescale(tat, changed, from, to),
            "the two instants give two answers, so the test tells them apart"
        );
    }
}
