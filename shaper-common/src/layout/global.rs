//! A global class's share of a limit across hosts, as the daemon writes it.

use super::*;

/// Bytes of a global class's key kept with its share (`SHARES`).
pub const GLOBAL_KEY_LEN: usize = 48;

/// What happens to a global class's share when Redis cannot be reached.
pub mod on_loss {
    /// Keep the last share for a few intervals, then the limit over the last host count.
    pub const STATIC: u8 = 0;
    /// Fall back to the class's own rate (the whole limit, on this host alone).
    pub const OPEN: u8 = 1;
    /// Fall to the floor.
    pub const CLOSED: u8 = 2;
}

/// A global class on this host: the limit all hosts share, this host's share of it (the
/// class's costs), and the expiry past which the packet path itself installs the floor, so
/// a host whose daemon died does not keep a share the others were given meanwhile.
/// Written by the daemon; the packet path only applies and clears the expiry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalShare {
    /// `bpf_ktime_get_ns()` time past which the floor applies; 0: none pending.
    pub expires_ns: u64,
    /// The floor's costs, installed as cost version `floor_version` at expiry.
    pub floor: CostVersion,
    /// The class's next cost version when the share was written.
    pub floor_version: u32,
    /// Hosts that shared the limit at the last answer from Redis.
    pub hosts: u32,
    /// The limit across all hosts (the class's configured rate) and its burst.
    pub limit_bits_per_sec: u64,
    pub limit_burst_bytes: u64,
    /// The least this host keeps (`closed`, an expired share).
    pub floor_bits_per_sec: u64,
    /// This host's share as last set (the class's rate now, unless the floor took over).
    pub share_bits_per_sec: u64,
    /// When Redis last answered (Unix ms; 0: never).
    pub answered_unix_ms: u64,
    /// `on_loss::*`.
    pub on_loss: u8,
    pub _pad: [u8; 7],
    /// The key all hosts share for this class (NUL-padded).
    pub key: [u8; GLOBAL_KEY_LEN],
}

impl Default for GlobalShare {
    fn default() -> Self {
        Self {
            expires_ns: 0,
            floor: CostVersion::default(),
            floor_version: 0,
            hosts: 0,
            limit_bits_per_sec: 0,
            limit_burst_bytes: 0,
            floor_bits_per_sec: 0,
            share_bits_per_sec: 0,
            answered_unix_ms: 0,
            on_loss: on_loss::STATIC,
            _pad: [0; 7],
            key: [0; GLOBAL_KEY_LEN],
        }
    }
}

impl GlobalShare {
    /// Whether the share has expired at `now_ns`.
    #[inline(always)]
    pub fn expired(&self, now_ns: u64) -> bool {
        self.expires_ns != 0 && now_ns > self.expires_ns
    }

    /// Installs the floor in `config` as of the expiry: the same fixed values whichever
    /// CPU (or how many) does it, so racing CPUs agree. Per-CPU credit taken at the share
    /// is dropped and the class charges per packet from then on.
    #[inline(always)]
    pub fn install_floor(&self, config: &mut ClassConfig) {
        let version = self.floor_version % COST_VERSIONS as u32;
        if let Some(slot) = config.history.get_mut(version as usize) {
            *slot = self.floor;
        }
        config.cost = self.floor.cost;
        config.peak_cost = self.floor.peak_cost;
        config.changed_at_ns = self.expires_ns;
        config.version = version;
        config.credit_chunk = 0;
        config.credit_epoch = config.credit_epoch.wrapping_add(1);
    }
}
