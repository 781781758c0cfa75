//! The class model: what defines a class ([`ClassSpec`], [`Meter`]), how it is stored
//! ([`encode`](mod@encode)), the rule shapes its entries use ([`shapes`](mod@shapes)), and
//! adding, changing and deleting classes ([`table`](mod@table)).

use crate::{actions::ActionSpec, rules::Rule, state::encode_name};
use anyhow::Result;
use shaper_common::{
    codel::{CodelConfig, DEFAULT_INTERVAL_NS, DEFAULT_TARGET_NS, FRAME_BYTES},
    meter::{METER_NONE, METER_SRTCM, METER_TRTCM},
    ByteCost, ClassMeta, ClassStats, Scope,
};

mod add;
mod change;
mod encode;
mod renewal;
mod replace;
mod requeue;
mod shapes;
mod share;
mod split;
mod table;
mod tree;

pub use add::{add, add_many};
pub(crate) use change::same_class;
pub use change::{change, Change};
pub(crate) use encode::bucket_cost;
pub use encode::{read_class, read_classes};
pub use renewal::{renew_share, set_share, share_of, Renewal, ShareUpdate};
pub use replace::replace;
pub use requeue::{requeue, stale_queues};
pub use split::{
    check_split, refresh_split, set_split, shape_classes_changed, split_needs_ingress, split_state,
    Split,
};
pub use table::{delete, delete_many, find};

/// Everything that defines a class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassSpec {
    pub name: String,
    pub rule: Rule,
    pub rate_bits_per_sec: u64,
    pub burst_bytes: u64,
    pub scope: Scope,
    pub prio: u32,
    /// Over the rate; with a meter, on red packets.
    pub action: ActionSpec,
    pub meter: Meter,
    /// Meters: on yellow packets.
    pub exceed: ActionSpec,
    /// Shape classes: CoDel on the virtual queue; `None` for every other action.
    pub codel: Option<Codel>,
    /// A class with a parent; `None` for a top-level class.
    pub tree: Option<Tree>,
    /// A limit shared with other hosts (`rate` and `burst` are the limit for all of them
    /// together); `None` for a class of this host alone.
    pub global: Option<Global>,
}

/// A class whose rate is a limit across hosts: each host enforces its share, which the
/// daemons agree on through Redis (`shaper::global`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Global {
    /// The key all hosts share for this class.
    pub key: String,
    pub on_loss: OnLoss,
    /// The least this host keeps: its start, `closed`, an expired share.
    pub floor_bits_per_sec: u64,
}

/// What a global class's share becomes when Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnLoss {
    /// The last share for a few intervals, then the limit over the last host count.
    #[default]
    Static,
    /// The class's own rate: the whole limit, on this host alone.
    Open,
    /// The floor.
    Closed,
}

impl OnLoss {
    pub const ALL: [OnLoss; 3] = [OnLoss::Static, OnLoss::Open, OnLoss::Closed];

    pub fn name(self) -> &'static str {
        match self {
            OnLoss::Static => "static",
            OnLoss::Open => "open",
            OnLoss::Closed => "closed",
        }
    }

    pub fn from_name(text: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.name() == text)
            .ok_or_else(|| {
                format!(
                    "unknown on_coordinator_loss '{text}' (expected {})",
                    expected(Self::ALL.iter().map(|m| m.name()))
                )
            })
    }

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            OnLoss::Static => shaper_common::on_loss::STATIC,
            OnLoss::Open => shaper_common::on_loss::OPEN,
            OnLoss::Closed => shaper_common::on_loss::CLOSED,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            shaper_common::on_loss::OPEN => OnLoss::Open,
            shaper_common::on_loss::CLOSED => OnLoss::Closed,
            _ => OnLoss::Static,
        }
    }
}

/// The default floor of a global class: a hundredth of its limit, at least 64 kbit/s
/// (a host keeps a trickle: ARP-sized control traffic, a TCP connection's keepalives).
pub fn default_floor(limit_bits_per_sec: u64) -> u64 {
    (limit_bits_per_sec / 100)
        .max(64_000)
        .min(limit_bits_per_sec)
}

/// A share's burst: the limit's burst split in proportion to the share, but never below
/// `minimum` (the action's default burst at the share: what TCP needs to keep its rate
/// through a policer, or to catch up after a back-off through HTB) unless the limit's own
/// burst is smaller.
pub fn share_burst(
    limit_bits_per_sec: u64,
    limit_burst_bytes: u64,
    share_bits_per_sec: u64,
    minimum: u64,
) -> u64 {
    let split = (limit_burst_bytes as u128 * share_bits_per_sec as u128
        / limit_bits_per_sec.max(1) as u128) as u64;
    split
        .max(minimum.min(limit_burst_bytes))
        .max(2 * FRAME_BYTES)
}

/// A class's place under a parent (`shaper_common::hierarchy`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    pub parent: String,
    /// What the class may borrow up to; `None`: its rate (it never borrows).
    pub ceil_bits_per_sec: Option<u64>,
    /// The ceiling's burst; `None`: the class's burst.
    pub cburst_bytes: Option<u64>,
}

impl ClassSpec {
    /// The rate and burst a shape class's virtual queue drains at: its ceiling in a tree
    /// (the fastest HTB lets it send, exact while its siblings are idle; the ancestors'
    /// queues cover the busy case), its rate otherwise. Every other class: its rate.
    pub(crate) fn drain(&self) -> (u64, u64) {
        match &self.tree {
            Some(tree) if self.action.action == shaper_common::Action::Shape => (
                tree.ceil(self.rate_bits_per_sec),
                tree.cburst(self.burst_bytes),
            ),
            _ => (self.rate_bits_per_sec, self.burst_bytes),
        }
    }
}

impl Tree {
    pub fn ceil(&self, rate_bits_per_sec: u64) -> u64 {
        self.ceil_bits_per_sec.unwrap_or(rate_bits_per_sec)
    }

    pub fn cburst(&self, burst_bytes: u64) -> u64 {
        self.cburst_bytes.unwrap_or(burst_bytes)
    }
}

/// CoDel's knobs on a shape class (RFC 8289 names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Codel {
    /// The standing queue delay to keep (raised to 1.5 frame times at low rates).
    pub target_ns: u64,
    /// How long the delay may stay above target before drops start; about the path's RTT
    /// plus the time a sender's answer takes to drain the queue.
    pub interval_ns: u64,
    /// CE-mark ECN-capable packets instead of dropping them.
    pub ecn: bool,
    /// How the class shares its rate among its flows.
    pub fair: Fair,
}

impl Default for Codel {
    fn default() -> Self {
        Self {
            target_ns: DEFAULT_TARGET_NS,
            interval_ns: DEFAULT_INTERVAL_NS,
            ecn: true,
            fair: Fair::Flow,
        }
    }
}

/// Flow isolation in a shape class (`shaper_common::fair`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fair {
    /// One queue for every flow (no isolation).
    None,
    /// Each flow its fair share: the default.
    #[default]
    Flow,
    /// Each source host its share, then each of its flows.
    Src,
    /// Each destination host its share, then each of its flows.
    Dst,
}

impl Fair {
    pub const ALL: [Fair; 4] = [Fair::Flow, Fair::Src, Fair::Dst, Fair::None];

    pub fn name(self) -> &'static str {
        match self {
            Fair::None => "none",
            Fair::Flow => "flow",
            Fair::Src => "src",
            Fair::Dst => "dst",
        }
    }

    pub fn from_name(text: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == text)
            .ok_or_else(|| format!("bad fair '{text}' (flow, src, dst or none)"))
    }

    /// The packet path's code (`shaper_common::fair::FAIR_*`).
    pub fn code(self) -> u32 {
        use shaper_common::fair::*;
        match self {
            Fair::None => FAIR_NONE,
            Fair::Flow => FAIR_FLOW,
            Fair::Src => FAIR_SRC,
            Fair::Dst => FAIR_DST,
        }
    }

    /// From the packet path's code; an unknown one reads as none.
    pub fn from_code(code: u32) -> Self {
        Self::ALL
            .into_iter()
            .find(|f| f.code() == code)
            .unwrap_or(Fair::None)
    }
}

impl Codel {
    /// The packet path's parameters at `rate_bits_per_sec`.
    pub(crate) fn config(self, rate_bits_per_sec: u64) -> CodelConfig {
        CodelConfig::new(self.target_ns, self.interval_ns, rate_bits_per_sec)
            .with_ecn(self.ecn)
            .with_fair(self.fair.code())
    }

    /// The HTB leaf's limit: a bounded bfifo of the bytes the class sends in CoDel's hard
    /// cap (at least four frames), so even a wrong estimate cannot stand a second of queue;
    /// at most what bfifo's 32-bit limit holds (4 GiB: 100 ms from 344 Gbit/s on, where tc
    /// refused the class outright).
    pub(crate) fn leaf_limit_bytes(self, rate_bits_per_sec: u64) -> u64 {
        let cap_ns = self.config(rate_bits_per_sec).cap_ns as u128;
        let bytes = cap_ns * rate_bits_per_sec as u128 / 8 / 1_000_000_000;
        (bytes.min(u32::MAX as u128) as u64).max(4 * FRAME_BYTES)
    }
}

/// A three-colour meter on top of the class's rate (CIR) and burst (CBS).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Meter {
    #[default]
    None,
    /// RFC 2697: excess burst size (bytes).
    SrTcm { excess_burst_bytes: u64 },
    /// RFC 2698: peak rate (bit/s) and peak burst size (bytes).
    TrTcm {
        peak_rate_bits_per_sec: u64,
        peak_burst_bytes: u64,
    },
}

impl Meter {
    /// srTCM's excess burst size (bytes).
    pub fn excess_burst(self) -> Option<u64> {
        match self {
            Meter::SrTcm { excess_burst_bytes } => Some(excess_burst_bytes),
            _ => None,
        }
    }

    /// trTCM's peak rate (bit/s).
    pub fn peak_rate(self) -> Option<u64> {
        match self {
            Meter::TrTcm {
                peak_rate_bits_per_sec,
                ..
            } => Some(peak_rate_bits_per_sec),
            _ => None,
        }
    }

    /// trTCM's peak burst size (bytes).
    pub fn peak_burst(self) -> Option<u64> {
        match self {
            Meter::TrTcm {
                peak_burst_bytes, ..
            } => Some(peak_burst_bytes),
            _ => None,
        }
    }

    pub fn name(self) -> Option<&'static str> {
        match self {
            Meter::None => None,
            Meter::SrTcm { .. } => Some("srtcm"),
            Meter::TrTcm { .. } => Some("trtcm"),
        }
    }

    fn from_meta(meta: &ClassMeta, kind: u8) -> Self {
        match kind {
            METER_SRTCM => Meter::SrTcm {
                excess_burst_bytes: meta.excess_burst_bytes,
            },
            METER_TRTCM => Meter::TrTcm {
                peak_rate_bits_per_sec: meta.peak_rate_bits_per_sec,
                peak_burst_bytes: meta.peak_burst_bytes,
            },
            _ => Meter::None,
        }
    }

    /// The meter's second word: (PIR, PBS) or (CIR, CBS + EBS).
    fn second_cost(self, rate_bits_per_sec: u64, burst_bytes: u64) -> (u8, ByteCost) {
        match self {
            Meter::None => (METER_NONE, ByteCost::default()),
            Meter::SrTcm { excess_burst_bytes } => (
                METER_SRTCM,
                ByteCost::new(rate_bits_per_sec, burst_bytes + excess_burst_bytes),
            ),
            Meter::TrTcm {
                peak_rate_bits_per_sec,
                peak_burst_bytes,
            } => (
                METER_TRTCM,
                ByteCost::new(peak_rate_bits_per_sec, peak_burst_bytes),
            ),
        }
    }
}

pub(crate) fn parse_scope(text: &str) -> Result<Scope, String> {
    Scope::from_name(text).ok_or_else(|| {
        format!(
            "unknown bucket scope '{text}' (expected {})",
            expected(Scope::ALL.iter().map(|scope| scope.name()))
        )
    })
}

/// "a, b or c": the names a message lists as expected.
pub fn expected<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// A class as read back from the kernel.
#[derive(Clone, Debug)]
pub struct ClassView {
    pub id: u32,
    pub spec: ClassSpec,
    pub seq: u64,
    pub stats: ClassStats,
}

/// Validates a class name without touching state.
pub(crate) fn check_name(name: &str) -> Result<()> {
    encode_name(name).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_holds_the_cap_at_the_rate_within_what_bfifo_takes() {
        let codel = Codel::default();
        // 100 ms at 10 Mbit/s.
        assert_eq!(codel.leaf_limit_bytes(10_000_000), 125_000);
        assert!(codel.leaf_limit_bytes(8) >= 4 * FRAME_BYTES);
        assert_eq!(codel.leaf_limit_bytes(400_000_000_000), u32::MAX as u64);
    }
}
