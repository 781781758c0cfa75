//! Rates and sizes spelled exactly as tc(8) spells them (case-insensitive); CoDel's
//! durations and on/off switches.

use shaper_common::bucket::{MAX_RATE_BITS_PER_SEC, MIN_RATE_BITS_PER_SEC};

/// Rate units in bits per second, as tc's `get_rate`.
const RATE_UNITS: &[(&str, f64)] = &[
    ("bit", 1.0),
    ("kibit", 1024.0),
    ("kbit", 1000.0),
    ("mibit", 1024.0 * 1024.0),
    ("mbit", 1_000_000.0),
    ("gibit", 1024.0 * 1024.0 * 1024.0),
    ("gbit", 1_000_000_000.0),
    ("tibit", 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("tbit", 1_000_000_000_000.0),
    ("bps", 8.0),
    ("kibps", 8.0 * 1024.0),
    ("kbps", 8000.0),
    ("mibps", 8.0 * 1024.0 * 1024.0),
    ("mbps", 8_000_000.0),
    ("gibps", 8.0 * 1024.0 * 1024.0 * 1024.0),
    ("gbps", 8_000_000_000.0),
    ("tibps", 8.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("tbps", 8_000_000_000_000.0),
];

/// Size units in bytes, as tc's `get_size`.
const SIZE_UNITS: &[(&str, f64)] = &[
    ("b", 1.0),
    ("k", 1024.0),
    ("kb", 1024.0),
    ("m", 1024.0 * 1024.0),
    ("mb", 1024.0 * 1024.0),
    ("g", 1024.0 * 1024.0 * 1024.0),
    ("gb", 1024.0 * 1024.0 * 1024.0),
    ("kbit", 1024.0 / 8.0),
    ("mbit", 1024.0 * 1024.0 / 8.0),
    ("gbit", 1024.0 * 1024.0 * 1024.0 / 8.0),
];

/// The smallest burst: one full-size Ethernet frame, or nothing full-size ever passes.
pub(crate) const MIN_BURST_BYTES: u64 = 1514;
/// The largest burst accepted (4 GiB).
pub(crate) const MAX_BURST_BYTES: u64 = 1 << 32;

fn split_number(text: &str) -> Result<(f64, String), String> {
    let text = text.trim();
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(end);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("'{text}' does not start with a number"))?;
    Ok((value, unit.to_ascii_lowercase()))
}

fn scale(text: &str, units: &[(&str, f64)], bare: f64, what: &str) -> Result<f64, String> {
    let (value, unit) = split_number(text)?;
    if unit.is_empty() {
        return Ok(value * bare);
    }
    units
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, factor)| value * factor)
        .ok_or_else(|| format!("unknown {what} unit '{unit}' in '{text}'"))
}

/// Parses a rate into bits per second ("10mbit", "1.5gbit", "125kbps", bare = bit/s).
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let bits = scale(text, RATE_UNITS, 1.0, "rate")?.round();
    if bits < MIN_RATE_BITS_PER_SEC as f64 {
        return Err(format!(
            "rate '{text}' is below the minimum of 8bit (1 byte/s)"
        ));
    }
    if bits > MAX_RATE_BITS_PER_SEC as f64 {
        return Err(format!("rate '{text}' is above the maximum of 400gbit"));
    }
    Ok(bits as u64)
}

/// Parses a size into bytes ("64k", "1mb", "32kbit", bare = bytes).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bytes = scale(text, SIZE_UNITS, 1.0, "size")?.round();
    if bytes < MIN_BURST_BYTES as f64 {
        return Err(format!(
            "burst '{text}' is below {MIN_BURST_BYTES} bytes (one full-size Ethernet frame)"
        ));
    }
    if bytes > MAX_BURST_BYTES as f64 {
        return Err(format!("burst '{text}' is above the maximum of 4gb"));
    }
    Ok(bytes as u64)
}

/// Default burst when `--burst` is omitted: the larger of 128 KiB and 250 ms at the rate.
/// 128 KiB holds the largest GSO packet TCP hands the TC hook (64 KiB of payload, about
/// 68 KiB with per-segment headers) nearly twice, so one such packet never exceeds a
/// full bucket. 250 ms at the rate covers Linux's 200 ms minimum retransmission timeout:
/// a TCP flow that lost packets to the policer resumes into a bucket that refilled
/// meanwhile, which is what lets one TCP flow use ~95 % of the rate on short-RTT paths.
pub(crate) fn default_burst(rate_bits_per_sec: u64) -> u64 {
    (128 * 1024).max(rate_bits_per_sec / 8 / 4)
}

/// Formats bits per second the way tc prints rates.
pub fn format_rate(bits: u64) -> String {
    for (unit, factor) in [("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)] {
        if bits as f64 >= factor {
            return trim_float(bits as f64 / factor) + unit;
        }
    }
    format!("{bits}bit")
}

/// Formats bytes with binary units, as tc prints sizes.
pub fn format_size(bytes: u64) -> String {
    for (unit, factor) in [("Gb", 1u64 << 30), ("Mb", 1 << 20), ("Kb", 1 << 10)] {
        if bytes >= factor {
            return trim_float(bytes as f64 / factor as f64) + unit;
        }
    }
    format!("{bytes}b")
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Default burst of a shaping class: the larger of 128 KiB (a GSO packet with room to
/// spare) and 10 ms at the rate. A shaper needs no RTO-sized burst; through HTB the
/// burst lets a Cubic flow catch up after a CoDel back-off, while it sent below the rate
/// (EDT pacing has no burst). 128 KiB beat 64 KiB for one flow over 40 and 80 ms, and
/// larger bursts were worse over 80 ms (docs/CHOOSING.md, `shape`).
pub(crate) fn default_shape_burst(rate_bits_per_sec: u64) -> u64 {
    (128 * 1024).max(rate_bits_per_sec / 8 / 100)
}

/// Longest CoDel interval (and target) accepted: far above any RTT worth shaping for.
const MAX_CODEL_DURATION_NS: u64 = 10_000_000_000;

/// A CoDel duration (`5ms`, `100ms`, `1s`): above zero, at most 10 s.
pub fn parse_duration_ns(text: &str) -> Result<u64, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|e| format!("bad duration '{text}': {e} (expected e.g. 5ms, 100ms, 1s)"))?;
    let ns = duration.as_nanos();
    if ns == 0 || ns > MAX_CODEL_DURATION_NS as u128 {
        return Err(format!(
            "duration '{text}' is out of range (expected more than 0 and at most 10s)"
        ));
    }
    Ok(ns as u64)
}

/// An on/off switch: `on`/`off`, `true`/`false`, `yes`/`no`.
pub fn parse_switch(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" => Ok(true),
        "false" | "off" | "no" => Ok(false),
        _ => Err(format!("bad switch '{text}' (expected on or off)")),
    }
}

/// A rate in the shortest tc spelling that is exact.
pub fn exact_rate(bits: u64) -> String {
    for (unit, factor) in [
        ("gbit", 1_000_000_000),
        ("mbit", 1_000_000),
        ("kbit", 1_000),
    ] {
        if bits >= factor && bits.is_multiple_of(factor) {
            return format!("{}{unit}", bits / factor);
        }
    }
    format!("{bits}bit")
}

/// The spelling [`parse_duration_ns`] reads back: `5ms`, `1s 500ms`.
pub fn format_duration_ns(ns: u64) -> String {
    humantime::format_duration(std::time::Duration::from_nanos(ns)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_follow_tc() {
        assert_eq!(parse_rate("10mbit"), Ok(10_000_000));
        assert_eq!(parse_rate("10Mbit"), Ok(10_000_000));
        assert_eq!(parse_rate("1.5gbit"), Ok(1_500_000_000));
        assert_eq!(parse_rate("1kibit"), Ok(1024));
        assert_eq!(parse_rate("2mibit"), Ok(2 * 1024 * 1024));
        assert_eq!(parse_rate("125kbps"), Ok(1_000_000));
        assert_eq!(parse_rate("1mbps"), Ok(8_000_000));
        assert_eq!(parse_rate("1kibps"), Ok(8192));
        assert_eq!(parse_rate("100"), Ok(100));
        assert_eq!(parse_rate("100bit"), Ok(100));
        assert_eq!(
            parse_rate("1tbit"),
            Err("rate '1tbit' is above the maximum of 400gbit".into())
        );
        assert_eq!(parse_rate("400gbit"), Ok(400_000_000_000));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("7bit").is_err());
        assert!(parse_rate("10mbits").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("").is_err());
        assert!(parse_rate("-5mbit").is_err());
    }

    #[test]
    fn sizes_follow_tc() {
        assert_eq!(parse_size("64k"), Ok(65_536));
        assert_eq!(parse_size("64kb"), Ok(65_536));
        assert_eq!(parse_size("2m"), Ok(2 << 20));
        assert_eq!(parse_size("1mb"), Ok(1 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("256kbit"), Ok(32_768));
        assert_eq!(parse_size("1mbit"), Ok(131_072));
        assert_eq!(parse_size("3000"), Ok(3000));
        assert_eq!(parse_size("3000b"), Ok(3000));
        assert!(parse_size("100").is_err());
        assert!(parse_size("5gb").is_err());
        assert!(parse_size("64q").is_err());
    }

    #[test]
    fn default_burst_is_at_least_128k() {
        assert_eq!(default_burst(1_000_000), 131_072);
        assert_eq!(default_burst(10_000_000), 312_500);
        assert_eq!(default_burst(100_000_000), 3_125_000);
    }

    #[test]
    fn default_shape_burst_is_128k_or_10ms() {
        assert_eq!(default_shape_burst(20_000_000), 131_072);
        assert_eq!(default_shape_burst(100_000_000), 131_072);
        assert_eq!(default_shape_burst(1_000_000_000), 1_250_000);
    }

    #[test]
    fn formatting() {
        assert_eq!(format_rate(10_000_000), "10Mbit");
        assert_eq!(format_rate(1_500_000_000), "1.5Gbit");
        assert_eq!(format_rate(512), "512bit");
        assert_eq!(format_size(131_072), "128Kb");
        assert_eq!(format_size(1000), "1000b");
    }
}
