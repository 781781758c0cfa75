//! `[coordination]`: how a host reaches Redis for its global classes, checked.

use super::schema::CoordinationEntry;
use crate::global::Allocate;

/// `[coordination]`: where global classes agree on their shares.
#[derive(Clone, Debug, PartialEq)]
pub struct Coordination {
    /// `redis://[user[:password]@]host:port/db` (or `rediss://`, or
    /// `redis+sentinel://[user@]host:port,.../service/db`, `rediss+sentinel://` over TLS,
    /// or a cluster's `redis+cluster://[user@]host:port,...`, `rediss+cluster://`).
    pub redis: String,
    /// A root-only file holding the password (instead of the URL's); relative: a systemd
    /// credential in `$CREDENTIALS_DIRECTORY`.
    pub password_file: Option<std::path::PathBuf>,
    /// This host's name among the hosts sharing a limit.
    pub host_id: String,
    /// How often each host reports its demand and reads its share.
    pub interval: std::time::Duration,
    /// Whether this daemon runs the fill too (`auto`: when its Redis user may).
    pub allocate: Allocate,
}

/// The shortest and longest coordination interval.
const INTERVALS: std::ops::RangeInclusive<std::time::Duration> =
    std::time::Duration::from_millis(50)..=std::time::Duration::from_secs(10);

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// `[coordination]`: a Redis URL the client accepts, a host id as a key part, an
/// interval within `INTERVALS`; each problem is given to `report` (its span, field and
/// message), and then there is no coordination.
pub(super) fn check(
    entry: &toml::Spanned<CoordinationEntry>,
    report: &mut dyn FnMut(std::ops::Range<usize>, &str, String),
) -> Option<Coordination> {
    let entry = entry.get_ref();
    let url = entry.redis.get_ref();
    let mut ok = true;
    if let Err(error) = crate::global::check_url(url) {
        report(entry.redis.span(), "redis", error);
        ok = false;
    }
    let password_file = entry.password_file.as_ref().map(|path| {
        let problem = if crate::global::url_has_password(url) {
            Some("the password is in the URL already: keep it in password_file alone".into())
        } else {
            crate::global::read_password(std::path::Path::new(path.get_ref()))
                .err()
                .map(|error| format!("{error:#}"))
        };
        if let Some(message) = problem {
            report(path.span(), "password_file", message);
            ok = false;
        }
        std::path::PathBuf::from(path.get_ref())
    });
    let host_id = match &entry.host_id {
        None => host_name(),
        Some(id) => {
            if let Some(message) = host_id_problem(id.get_ref()) {
                report(id.span(), "host_id", message);
                ok = false;
            }
            id.get_ref().clone()
        }
    };
    let interval = match entry
        .interval
        .as_ref()
        .map(|text| (text, interval_of(text.get_ref())))
    {
        None => crate::global::DEFAULT_INTERVAL,
        Some((_, Ok(interval))) => interval,
        Some((text, Err(message))) => {
            report(text.span(), "interval", message);
            ok = false;
            crate::global::DEFAULT_INTERVAL
        }
    };
    let allocate = entry
        .allocate
        .as_ref()
        .map_or(Some(Allocate::Auto), |text| {
            let known = Allocate::from_name(text.get_ref());
            if known.is_none() {
                let message = format!(
                    "unknown allocate '{}' (expected auto, always or never)",
                    text.get_ref()
                );
                report(text.span(), "allocate", message);
            }
            known
        });
    ok &= allocate.is_some();
    let allocate = allocate.unwrap_or(Allocate::Auto);
    ok.then(|| Coordination {
        redis: url.clone(),
        password_file,
        host_id,
        interval,
        allocate,
    })
}

/// Why `text` is no host id (none: it is one). Fields of the fill's hash that are not
/// hosts start with '.'; a report key ends with the host id, so no glob character.
fn host_id_problem(text: &str) -> Option<String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
    let first = text
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    (!first || text.len() > 64 || !text.chars().all(allowed)).then(|| {
        format!(
            "bad host_id '{text}' (1 to 64 letters, digits, '-', '_', '.' or ':', \
             starting with a letter or digit)"
        )
    })
}

/// An interval within `INTERVALS`, or why not.
fn interval_of(text: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(text) {
        Ok(interval) if INTERVALS.contains(&interval) => Ok(interval),
        Ok(_) => Err(format!("interval {text} is not within 50ms..=10s")),
        Err(error) => Err(format!("bad interval '{text}': {error}")),
    }
}
