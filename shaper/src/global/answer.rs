//! A host's answer from the last fill, as Redis holds it (pure, tested on the host).

use super::*;

/// Whether a host's report key, as read (`DEMAND CURRENT INSTANCE`), was written by
/// another daemon than `instance` (which, its report not yet expired, holds the host id).
pub(super) fn held_by_another(held: Option<&str>, instance: &str) -> bool {
    held.and_then(|text| text.split(' ').nth(2))
        .is_some_and(|owner| !owner.is_empty() && owner != instance)
}

/// Redis `TIME` as milliseconds.
pub(super) fn redis_time_ms(value: &redis::Value) -> Option<u64> {
    let (seconds, micros): (u64, u64) = redis::from_redis_value_ref(value).ok()?;
    Some(seconds * 1000 + micros / 1000)
}

/// One class's answer from the last fill's fields (`HMGET shares HOST .hosts .epoch
/// .filled .limit .version .interval`) at Redis's `now_ms`: its share (what it holds
/// when the fill does not know it yet), or an error when there is no fill, or none for
/// three intervals (no allocator runs): `on_coordinator_loss` decides then.
pub(super) fn answer_of(
    fields: &[Option<String>],
    now_ms: Option<u64>,
    report: &Report,
    interval: Duration,
    dropped: u64,
) -> redis::RedisResult<Answer> {
    let whole = |i: usize| {
        fields
            .get(i)
            .and_then(|field| field.as_deref())
            .and_then(|text| text.parse::<u64>().ok())
    };
    let stale = |why: String| -> redis::RedisResult<Answer> {
        Err((redis::ErrorKind::Client, "no fill", why).into())
    };
    let Some(filled) = whole(3) else {
        return stale(format!(
            "no fill of '{}' yet: no allocator runs (shaper global allocate, or a daemon whose Redis user may run the fill)",
            report.key
        ));
    };
    let interval_ms = whole(6).unwrap_or(interval.as_millis() as u64).max(1);
    if let Some(now) = now_ms {
        let age = now.saturating_sub(filled);
        if age > REPORT_INTERVALS as u64 * interval_ms.max(interval.as_millis() as u64) {
            return stale(format!(
                "the last fill of '{}' is {age} ms old: no allocator runs (shaper global allocate, or a daemon whose Redis user may run the fill)",
                report.key
            ));
        }
    }
    let limit = whole(4).unwrap_or(report.limit_bits_per_sec).max(1);
    Ok(Answer {
        share_bits_per_sec: whole(0).map_or(report.applied, |share| share.min(limit)),
        hosts: whole(1).unwrap_or(1).clamp(1, u32::MAX as u64) as u32,
        epoch_ms: whole(2).unwrap_or(0),
        limits: Limits {
            limit_bits_per_sec: limit,
            version: whole(5).unwrap_or(0),
            interval_ms,
        },
        dropped_fields: dropped.min(u32::MAX as u64) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            key: "k".into(),
            demand: 5,
            applied: 7_000,
            limit_bits_per_sec: 30_000,
            floor_bits_per_sec: 300,
        }
    }

    fn fields(values: [Option<&str>; 7]) -> Vec<Option<String>> {
        values.iter().map(|v| v.map(str::to_string)).collect()
    }

    #[test]
    fn a_host_reads_its_share_from_a_fresh_fill() {
        let answer = answer_of(
            &fields([
                Some("12000"),
                Some("3"),
                Some("500"),
                Some("10000"),
                Some("30000"),
                Some("2"),
                Some("250"),
            ]),
            Some(10_100),
            &report(),
            Duration::from_millis(250),
            1,
        )
        .unwrap();
        assert_eq!(answer.share_bits_per_sec, 12_000);
        assert_eq!(answer.hosts, 3);
        assert_eq!(answer.epoch_ms, 500);
        assert_eq!(answer.limits.version, 2);
        assert_eq!(answer.dropped_fields, 1);
    }

    #[test]
    fn a_host_the_fill_does_not_know_keeps_what_it_holds_and_a_share_is_within_the_limit() {
        let unknown = fields([
            None,
            Some("3"),
            Some("500"),
            Some("10000"),
            None,
            None,
            None,
        ]);
        let answer = answer_of(
            &unknown,
            Some(10_000),
            &report(),
            Duration::from_millis(250),
            0,
        );
        assert_eq!(answer.unwrap().share_bits_per_sec, 7_000);
        let above = fields([
            Some("99999999"),
            None,
            None,
            Some("10000"),
            Some("30000"),
            None,
            None,
        ]);
        let answer = answer_of(
            &above,
            Some(10_000),
            &report(),
            Duration::from_millis(250),
            0,
        );
        assert_eq!(answer.unwrap().share_bits_per_sec, 30_000);
    }

    #[test]
    fn no_fill_or_an_old_one_is_no_answer() {
        let none = fields([None; 7]);
        assert!(answer_of(&none, Some(1), &report(), Duration::from_millis(250), 0).is_err());
        let old = fields([
            Some("1"),
            None,
            None,
            Some("10000"),
            None,
            None,
            Some("250"),
        ]);
        let interval = Duration::from_millis(250);
        assert!(answer_of(&old, Some(10_750), &report(), interval, 0).is_ok());
        assert!(answer_of(&old, Some(10_751), &report(), interval, 0).is_err());
    }

    #[test]
    fn a_report_written_by_another_daemon_holds_the_host_id() {
        assert!(held_by_another(Some("1 2 abc"), "def"));
        assert!(!held_by_another(Some("1 2 abc"), "abc"));
        assert!(!held_by_another(Some("1 2"), "abc"));
        assert!(!held_by_another(None, "abc"));
    }
}
