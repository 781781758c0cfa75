//! Global classes: one limit across hosts. Each host keeps enforcing locally in eBPF at
//! its share of the limit; every interval its daemon writes the class's demand into its
//! own report key in Redis and reads back its share from the last max-min fill of the
//! limit over the hosts whose reports are there (`fill.lua`, run by an allocator: a
//! daemon whose Redis user may, or `shaper global allocate`). Redis is never on
//! the packet path: when it cannot be reached the share follows the class's
//! `on_coordinator_loss`, and when the daemon stops renewing it the packet path itself
//! falls to the floor at the share's expiry.
//!
//! `tracker.rs`: [`Tracker`], the per-class decision (pure, tested on the host);
//! `host.rs`: the classes as this host runs them and their shares in the maps;
//! `coordinator.rs`: [`Coordinator`], the Redis side. The daemon's loop over them is
//! `crate::daemon::coordinate`.

use crate::{
    classes::{self, OnLoss, ShareUpdate},
    state::{self, Attachment, Location},
};
use std::time::Duration;

mod allocator;
mod answer;
mod coordinator;
mod host;
mod instance;
mod publish;
mod target;
mod tracker;

pub use allocator::allocate;
pub use coordinator::{
    fill, is_refused, Allocate, Coordinator, FillArgs, Filled, Reply, Report, FILL_FIELDS,
};
pub use host::{host_classes, install, renew, update_for, HostClass, ShareView};
pub use publish::{key_limits, publish, KeyLimits, Published};
pub use tracker::{demand, Answer, Event, Limits, Tracker, Usage};

/// Intervals a host's report lasts unless written again: a host silent that long is
/// left out of the next fill.
pub const REPORT_INTERVALS: u32 = 3;

/// How often hosts report and re-read their shares unless `[coordination] interval` says.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
/// Parts per million of the limit the fill leaves free: shares that move between two
/// reports never add up above the limit.
pub const HEADROOM_PPM: u64 = 20_000;
/// Intervals a `static` host keeps its last share without Redis, before it falls to the
/// limit over the last host count.
pub const STATIC_HOLD_INTERVALS: u32 = 3;
/// A share written into the packet path lasts this many intervals unless renewed: a host
/// whose daemon died falls to its floor when the others (which forget a host silent for
/// three intervals, then rise an interval later) may already take its share.
pub const EXPIRY_INTERVALS: u32 = 3;

/// A host's reported demand falls to no less than 1/`DEMAND_FALL` per interval.
pub const DEMAND_FALL: u64 = 3;
/// After a host squeezed below a quarter of an equal part asked for more and was given it,
/// it keeps asking for at least that much this long: a TCP sender that met the floor may
/// sit in retransmission backoff (0.2 + 0.4 + 0.8 + 1.6 s) before it sends again; judged
/// idle meanwhile, it would lose the share before it could use it and stay at the floor.
pub const RAMP_GRACE: Duration = Duration::from_secs(3);

/// The fill script (see its header), run by allocators.
pub const FILL: &str = include_str!("fill.lua");

/// The Redis keys of global key `key`: its last fill's shares, the set where hosts new to
/// it announce themselves, and its published limits, hash-tagged so a Redis Cluster
/// keeps a class's state in one slot. Hosts read the first and third and only add their
/// own name to the second; each writes only its own report ([`Keys::of`]).
pub fn redis_keys(key: &str) -> [String; 3] {
    [
        format!("shaper:{{{key}}}:shares"),
        format!("shaper:{{{key}}}:hosts"),
        format!("shaper:{{{key}}}:limits"),
    ]
}

/// The keys one host uses for one global key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    pub shares: String,
    pub announce: String,
    pub limits: String,
    /// `shaper:{KEY}:r:HOST`, this host's report: the one key its ACL lets it write
    /// (`%RW~shaper:{*}:r:HOST`).
    pub report: String,
}

impl Keys {
    pub fn of(key: &str, host: &str) -> Self {
        let [shares, announce, limits] = redis_keys(key);
        Self {
            shares,
            announce,
            limits,
            report: format!("shaper:{{{key}}}:r:{host}"),
        }
    }
}

/// Whether the Redis client accepts `url` (`redis://`, `rediss://`, `redis+unix://`,
/// `redis+sentinel://`, `rediss+sentinel://`, `redis+cluster://`, `rediss+cluster://`);
/// the message names the URL without its password.
pub fn check_url(url: &str) -> Result<(), String> {
    target::Target::new(url, None)
        .map(|_| ())
        .map_err(|error| format!("{error:#}"))
}

/// A Redis URL without its password, for messages and the log.
pub fn redacted(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((login, host)) => match login.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => format!("{scheme}://{login}@{host}"),
            },
            None => url.to_string(),
        },
        None => "(not a URL)".to_string(),
    }
}

/// Whether `url` carries a password (`redis://user:password@host`).
pub fn url_has_password(url: &str) -> bool {
    url.split_once("://")
        .and_then(|(_, rest)| rest.rsplit_once('@'))
        .is_some_and(|(login, _)| login.contains(':'))
}

/// The Redis password in `path`: its first line. A relative path names a systemd
/// credential (the file `LoadCredential=` put in `$CREDENTIALS_DIRECTORY`). Refused when
/// anyone but its owner may read it.
pub fn read_password(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use std::os::unix::fs::PermissionsExt as _;
    let path = if path.is_relative() {
        let dir = std::env::var_os("CREDENTIALS_DIRECTORY").with_context(|| {
            format!(
                "password_file '{}' is relative, so a systemd credential, but $CREDENTIALS_DIRECTORY is not set (LoadCredential=)",
                path.display()
            )
        })?;
        std::path::PathBuf::from(dir).join(path)
    } else {
        path.to_path_buf()
    };
    let metadata = std::fs::metadata(&path)
        .with_context(|| format!("cannot read password_file {}", path.display()))?;
    anyhow::ensure!(
        metadata.permissions().mode() & 0o077 == 0,
        "password_file {} may be read by others than its owner: chmod 600 it",
        path.display()
    );
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read password_file {}", path.display()))?;
    let password = text.lines().next().unwrap_or_default();
    anyhow::ensure!(
        !password.is_empty(),
        "password_file {} is empty",
        path.display()
    );
    Ok(password.to_string())
}
