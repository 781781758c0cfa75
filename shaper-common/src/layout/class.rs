//! A class as the packet path reads it (`ClassConfig`, its cost versions) and as
//! userspace describes it (`ClassMeta`).

use super::*;

/// Per-class configuration read by the packet path, indexed by class id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassConfig {
    /// The bucket (rate, burst); for meters CIR and CBS.
    pub cost: ByteCost,
    /// The meter's second word: (PIR, PBS) for trTCM, (CIR, CBS + EBS) for srTCM. A class
    /// with a parent: its ceiling (ceil, cburst), charged to `Bucket::tat2`.
    pub peak_cost: ByteCost,
    /// Per-key buckets are keyed with this, so a re-created class id starts afresh.
    pub generation: u32,
    pub scope: u8,
    /// Action over the rate (for meters: on red packets).
    pub action: u8,
    /// 1 while the class exists.
    pub in_use: u8,
    /// `meter::METER_*`.
    pub meter: u8,
    pub action_arg: u32,
    pub action_mask: u32,
    /// Meters: action on yellow packets.
    pub exceed_action: u8,
    /// 1: a global class (its costs are this host's share; `SHARES` holds the expiry past
    /// which the packet path installs the floor itself).
    pub global: u8,
    /// The parent class's id + 1 (0: a top-level class); see `hierarchy`.
    pub parent: u16,
    pub exceed_arg: u32,
    pub exceed_mask: u32,
    /// Bytes a CPU takes from the class bucket at once into its per-CPU credit
    /// (`bucket::credit_chunk`); 0 charges the bucket per packet.
    pub credit_chunk: u32,
    /// Changed by userspace with the rate or burst, so credit taken before is dropped.
    pub credit_epoch: u32,
    /// Shape classes: CoDel on the class's virtual queue (`CODEL` holds its state).
    pub codel: CodelConfig,
    /// Shape classes: a flow whose own bucket of this cost (`codel::sparse_cost`) keeps
    /// up is sparse (a ping, a DNS query, ACKs) and skips the bulk queue.
    pub sparse_cost: ByteCost,
    /// Shape classes under HTB: the handle of the class's sparse leaf (0 = none).
    pub sparse_priority: u32,
    /// The version of the costs above (`bucket::tagged` stamps it on every word written);
    /// `class change` moves it on by one (mod [`COST_VERSIONS`]).
    pub version: u32,
    /// When the current version took over (`bpf_ktime_get_ns()` time): a word of an
    /// older version is converted as of then, and refills at the new rate since.
    pub changed_at_ns: u64,
    /// The costs of the last versions, by version (`history[version]` is the current one):
    /// a word still in an older version is converted from these.
    pub history: [CostVersion; COST_VERSIONS],
}

/// [`ClassConfig::settle`] of a word of an older version. Not inlined: in the eBPF program
/// it is one subprogram, where inlined at every bucket its divisions and branches
/// multiply the paths beyond the verifier's limit.
#[inline(never)]
pub fn settle_older(config: &ClassConfig, word: u64, now_ns: u64, kind: CostKind) -> u64 {
    let tat = word & TAT_MASK;
    match config.history.get(word_version(word) as usize) {
        // As of the change; a packet from before it (a CPU's clock a hair behind) converts
        // as of now.
        Some(old) => {
            let at = if now_ns < config.changed_at_ns {
                now_ns
            } else {
                config.changed_at_ns
            };
            let new = match kind {
                CostKind::Main => &config.cost,
                CostKind::Peak => &config.peak_cost,
            };
            rescale(tat, at, old.of(kind), new)
        }
        None => tat,
    }
}

/// A class's bucket costs as of one version (a shape class's per-flow sparseness words
/// are not converted at a change, so its sparseness cost is not kept).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostVersion {
    pub cost: ByteCost,
    pub peak_cost: ByteCost,
}

impl CostVersion {
    #[inline(always)]
    fn of(&self, kind: CostKind) -> &ByteCost {
        match kind {
            CostKind::Main => &self.cost,
            CostKind::Peak => &self.peak_cost,
        }
    }
}

/// Which of a class's costs a bucket word runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostKind {
    /// `cost`: the class's or key's bucket, a meter's first word.
    Main,
    /// `peak_cost`: a meter's second word.
    Peak,
}

impl ClassConfig {
    /// The costs as they are now.
    pub fn costs(&self) -> CostVersion {
        CostVersion {
            cost: self.cost,
            peak_cost: self.peak_cost,
        }
    }

    /// A stored word's `tat` in the current costs: as stored when it is of the current
    /// version, else converted from its version's costs (see `bucket::rescale`).
    #[inline(always)]
    pub fn settle(&self, word: u64, now_ns: u64, kind: CostKind) -> u64 {
        if word_version(word) == self.version {
            return word & TAT_MASK;
        }
        settle_older(self, word, now_ns, kind)
    }

    /// `tat` as a word to store: stamped with the current version.
    #[inline(always)]
    pub fn stamp(&self, tat: u64) -> u64 {
        tagged(tat, self.version)
    }

    /// Whether a stored word is of an older version (to be converted and written back
    /// even when the packet that found it does not conform).
    #[inline(always)]
    pub fn stale(&self, word: u64) -> bool {
        word_version(word) != self.version
    }

    /// A new class's first costs: version 0. Userspace only.
    pub fn start_costs(&mut self) {
        self.version = 0;
        self.history = [CostVersion::default(); COST_VERSIONS];
        self.history[0] = self.costs();
    }

    /// Installs `next` as the current costs at `now_ns` (CLOCK_MONOTONIC, the program's
    /// clock): a new version when any cost differs (its slot in `history` gets them),
    /// nothing when none does. Userspace only.
    pub fn set_costs(&mut self, next: CostVersion, now_ns: u64) {
        if next == self.costs() {
            return;
        }
        self.changed_at_ns = now_ns;
        self.version = (self.version + 1) % COST_VERSIONS as u32;
        self.history[self.version as usize] = next;
        self.cost = next.cost;
        self.peak_cost = next.peak_cost;
    }

    /// A shape class's queue drains through HTB's token bucket, which sends the class's
    /// burst ahead of the rate (its virtual queue starts beyond it); EDT pacing has no
    /// burst. In bucket ticks.
    #[inline(always)]
    pub fn shape_burst_ticks(&self) -> u64 {
        if self.action_arg != 0 {
            self.cost.tolerance_ticks
        } else {
            0
        }
    }
}

/// Length of a class name, NUL-padded.
pub const CLASS_NAME_LEN: usize = 48;

/// Userspace-only description of a class, kept in a pinned map next to the packet-path
/// maps so every CLI invocation rebuilds its view from the kernel. Never read by the
/// packet path.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassMeta {
    pub name: [u8; CLASS_NAME_LEN],
    /// Creation sequence (tie-break between equal priorities).
    pub seq: u64,
    pub rate_bits_per_sec: u64,
    pub burst_bytes: u64,
    /// Meters: trTCM peak rate and burst, srTCM excess burst (0 when unused).
    pub peak_rate_bits_per_sec: u64,
    pub peak_burst_bytes: u64,
    pub excess_burst_bytes: u64,
    pub src_addr: [u32; 4],
    pub dst_addr: [u32; 4],
    pub prio: u32,
    pub sport_lo: u16,
    pub sport_hi: u16,
    pub dport_lo: u16,
    pub dport_hi: u16,
    /// FAMILY_* of the source/destination CIDR (FAMILY_ANY = no address rule).
    pub src_family: u8,
    pub src_prefix: u8,
    pub dst_family: u8,
    pub dst_prefix: u8,
    pub proto: u8,
    pub in_use: u8,
    /// Shape classes: 1 when CoDel drops ECN-capable packets too (`ecn = false`).
    pub codel_no_ecn: u8,
    /// Shape classes: how the class shares its rate among its flows (`fair::FAIR_*`).
    pub fair: u8,
    pub _pad: [u8; 4],
    /// Shape classes: CoDel's target and interval as the user gave them (ns).
    pub codel_target_ns: u64,
    pub codel_interval_ns: u64,
}

impl Default for ClassMeta {
    fn default() -> Self {
        Self {
            name: [0; CLASS_NAME_LEN],
            seq: 0,
            rate_bits_per_sec: 0,
            burst_bytes: 0,
            peak_rate_bits_per_sec: 0,
            peak_burst_bytes: 0,
            excess_burst_bytes: 0,
            src_addr: [0; 4],
            dst_addr: [0; 4],
            prio: 0,
            sport_lo: 0,
            sport_hi: 0,
            dport_lo: 0,
            dport_hi: 0,
            src_family: 0,
            src_prefix: 0,
            dst_family: 0,
            dst_prefix: 0,
            proto: 0,
            in_use: 0,
            codel_no_ecn: 0,
            fair: 0,
            _pad: [0; 4],
            codel_target_ns: 0,
            codel_interval_ns: 0,
        }
    }
}
