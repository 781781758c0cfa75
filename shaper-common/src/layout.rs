//! Map keys and values shared by the eBPF program and userspace.
//!
//! Every struct is `#[repr(C)]` with explicit padding so both sides agree byte for byte.

use crate::{
    bucket::{rescale, tagged, word_version, ByteCost, COST_VERSIONS, TAT_MASK},
    codel::CodelConfig,
};

/// Capacity of the per-attachment class tables (class ids are `0..MAX_CLASSES`).
pub const MAX_CLASSES: u32 = 16_384;
/// Distinct rule shapes (masks) per attachment; the packet path does one hash lookup per
/// shape, so this bounds the classification cost whatever the number of classes.
pub const MAX_SHAPES: u32 = 32;
/// Classification entries (one class expands to a few: port ranges split into prefixes).
pub const MAX_RULES: u32 = 262_144;
/// Default number of per-flow/src/dst buckets (LRU); `shaper attach --flow-table-size`.
pub const DEFAULT_FLOW_TABLE_SIZE: u32 = 65_536;
/// Bounded walk over IPv6 extension headers.
pub const MAX_IPV6_EXT_HEADERS: u32 = 8;

/// The layout of an attachment's pinned state: every map's name, key and value types and
/// their meaning. Bump it with any change to them; it is stamped in the `LAYOUT` map at
/// attach, and every command refuses pins of another layout with a clear message (0: pins
/// from before the stamp). Layout 2 gave classes parents (`ClassConfig::parent`, the
/// ceiling in `peak_cost`) in the sizes of layout 1; layout 3 added `KEY_STATS`, layout 4
/// `SHARES`, layout 5 `VERDICT_CACHE` and `Globals::rules_generation` (a spare word),
/// layout 6 `CODEL_FLOWS`.
pub const LAYOUT_VERSION: u32 = 6;

/// Slots of the per-CPU verdict cache (`VERDICT_CACHE`): 56 bytes each, 56 KiB a CPU.
pub const VERDICT_CACHE_SLOTS: u32 = 1024;
// `verdict_slot` takes the top bits of a hash: a power of two, at least two slots.
const _: () = assert!(VERDICT_CACHE_SLOTS.is_power_of_two() && VERDICT_CACHE_SLOTS > 1);
/// A verdict cache entry's class for "no class matches" (traffic shaper leaves alone).
pub const NO_CLASS: u32 = u32::MAX;

/// Map names, as declared in the eBPF object and pinned by userspace.
pub mod map_names {
    /// `LAYOUT_VERSION` of the shaper that attached (element 0): its own one-`u32` layout
    /// never changes.
    pub const LAYOUT: &str = "LAYOUT";
    pub const GLOBALS: &str = "GLOBALS";
    pub const SHAPES: &str = "SHAPES";
    pub const RULES: &str = "RULES";
    pub const CLASSES: &str = "CLASSES";
    pub const CLASS_BUCKETS: &str = "CLASS_BUCKETS";
    pub const KEYED_BUCKETS: &str = "KEYED_BUCKETS";
    pub const STATS: &str = "STATS";
    pub const CLASS_META: &str = "CLASS_META";
    pub const CLASS_INDEX: &str = "CLASS_INDEX";
    pub const CREDIT: &str = "CREDIT";
    pub const CODEL: &str = "CODEL";
    /// Per class and CPU: keys the class's packets created in the flow table.
    pub const KEY_STATS: &str = "KEY_STATS";
    /// Packet-path scratch (one per-CPU slot), never read by userspace.
    pub const SHAPE_PACKET: &str = "SHAPE_PACKET";
    /// Per class: a global class's share of its limit across hosts, and its expiry.
    pub const SHARES: &str = "SHARES";
    /// Per CPU: the class the packet path last found for a few recent tuples
    /// (`VerdictEntry`), never read by userspace.
    pub const VERDICT_CACHE: &str = "VERDICT_CACHE";
    /// Per shape class: its bulk flows in the last CoDel interval (`codel::FlowCensus`).
    pub const CODEL_FLOWS: &str = "CODEL_FLOWS";
    /// Every map of the object, in the order userspace pins them.
    pub const ALL: [&str; 17] = [
        LAYOUT,
        GLOBALS,
        SHAPES,
        RULES,
        CLASSES,
        CLASS_BUCKETS,
        KEYED_BUCKETS,
        STATS,
        CLASS_META,
        CLASS_INDEX,
        CREDIT,
        CODEL,
        KEY_STATS,
        SHAPE_PACKET,
        SHARES,
        VERDICT_CACHE,
        CODEL_FLOWS,
    ];
}

/// Program names in the eBPF object.
pub mod program_names {
    /// The classifier attached to interfaces.
    pub const SHAPER: &str = "shaper";
    /// The same classifier for devices that carry bare IP packets (tun, wireguard, ipip,
    /// sit, ppp): it parses from the IP header, with the protocol from `skb->protocol`.
    pub const SHAPER_L3: &str = "shaper_l3";
    /// Same code, but "now" is taken from `skb->tstamp` so BPF_PROG_TEST_RUN can drive
    /// the clock; never attached.
    pub const SHAPER_CLOCKED: &str = "shaper_clocked";
    /// Same code with the verdict cache never hit: the classification search's cost in
    /// benchmarks; never attached.
    pub const SHAPER_UNCACHED: &str = "shaper_uncached";
    /// An empty classifier: the floor for per-packet cost benchmarks.
    pub const FLOOR: &str = "shaper_floor";
    /// The floor plus one clock read (`bpf_ktime_get_ns`), for benchmarks.
    pub const FLOOR_CLOCK: &str = "shaper_floor_clock";
}

/// Packet-path globals, element 0 of the `GLOBALS` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Globals {
    /// Shapes `0..shape_count` of `SHAPES` are looked up for every packet.
    pub shape_count: u32,
    /// The rest is userspace bookkeeping: interface index at attach time,
    pub ifindex: u32,
    /// ATTACH_MODE_*,
    pub attach_mode: u32,
    /// 1 when shaper created the clsact qdisc (and so removes it on detach),
    pub created_clsact: u32,
    /// and the counter behind class creation sequences and bucket generations.
    pub next_seq: u64,
    /// Bytes of link-layer header before the IP header: 14 on Ethernet, 0 on devices that
    /// carry bare IP packets (tun, wireguard, ipip, sit, ppp), which get the `shaper_l3`
    /// program. Userspace bookkeeping, found at attach from the device's link type.
    pub link_header_len: u32,
    /// Moves (wrapping) after every change to `RULES`, `SHAPES` or `shape_count`, last:
    /// verdicts cached under another generation are not used (see `VerdictEntry`).
    pub rules_generation: u32,
}

impl Globals {
    /// Moves `rules_generation` on (wrapping): see the field.
    pub fn rules_changed(&mut self) {
        self.rules_generation = self.rules_generation.wrapping_add(1);
    }
}

pub const ATTACH_MODE_TCX: u32 = 1;
pub const ATTACH_MODE_CLSACT: u32 = 2;

/// Address family as stored in keys (0 = wildcard).
pub const FAMILY_ANY: u8 = 0;
pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// L4 protocol numbers used by the classifier (0 = wildcard).
pub const PROTO_ANY: u8 = 0;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

/// `RuleKey::flags`: the packet's ports could not be read (non-first fragment, truncated
/// L4 header). Such packets match on addresses and protocol alone.
pub const KEY_PORTS_UNKNOWN: u8 = 1;
/// `RuleKey::flags`: the packet's L4 protocol could not be determined (truncated or too
/// long IPv6 extension chain, truncated IPv4 header). Such packets match on addresses alone.
pub const KEY_PROTO_UNKNOWN: u8 = 2;
/// `RuleKey::flags`: the frame is not IPv4 or IPv6 as far as the parser can tell (ARP,
/// LLDP, raw Ethernet, more VLAN tags than it walks, a 0x9100 outer tag): only classes
/// without any rule match it, so "cap this VM" cannot be bypassed with raw frames.
pub const KEY_NOT_IP: u8 = 4;

/// One mask of the tuple-space classifier: which bits of a packet's fields a group of
/// rules looks at. Addresses are in network byte order, as read from the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shape {
    pub src_mask: [u32; 4],
    pub dst_mask: [u32; 4],
    /// Port masks in host byte order.
    pub sport_mask: u16,
    pub dport_mask: u16,
    /// 1 when the family is part of the key (the rule has an address), else 0.
    pub match_family: u8,
    /// 1 when the protocol is part of the key, else 0.
    pub match_proto: u8,
    /// 1 when the slot is in use (userspace bookkeeping; unused slots never match).
    pub in_use: u8,
    pub _pad: u8,
}

/// Exact-match key of the tuple-space classifier: a packet's fields masked by a shape.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleKey {
    pub shape: u16,
    pub family: u8,
    pub proto: u8,
    pub flags: u8,
    /// Two fields, not `[u8; 3]`: BPF builds an array's zeroes with a `memset` call.
    pub _pad: u8,
    pub _pad_word: u16,
    pub sport: u16,
    pub dport: u16,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// What a classification entry points to. `rank` orders classes: lower wins
/// (`prio << 32 | creation sequence`, so equal priorities go to the older class).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleValue {
    pub class_id: u32,
    pub _pad: u32,
    pub rank: u64,
}

/// Defines an enum stored in the maps as a `u8`, with its kernel code and its user-facing
/// name side by side, once: `TryFrom<u8>` decodes the code, `name`/`from_name` and
/// `Display` spell it, `ALL` lists every variant (for "expected ..." messages).
macro_rules! named_codes {
    (
        $(#[$meta:meta])*
        pub enum $ty:ident {
            $($(#[$vmeta:meta])* $variant:ident = $code:literal, $name:literal;)*
        }
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $ty {
            $($(#[$vmeta])* $variant = $code,)*
        }

        impl $ty {
            /// Every variant, in code order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),*];

            /// The name users write.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($ty::$variant),)*
                    _ => None,
                }
            }
        }

        impl TryFrom<u8> for $ty {
            /// The unknown code.
            type Error = u8;

            #[inline(always)]
            fn try_from(code: u8) -> Result<Self, u8> {
                match code {
                    $($code => Ok($ty::$variant),)*
                    other => Err(other),
                }
            }
        }

        impl core::fmt::Display for $ty {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_codes! {
    /// Bucket scope: which packets share one bucket within a class.
    pub enum Scope {
        Class = 0, "class";
        Flow = 1, "flow";
        Src = 2, "src";
        Dst = 3, "dst";
    }
}

named_codes! {
    /// What happens to packets over the rate. Packets within the rate always pass
    /// untouched. `action_arg`/`action_mask` carry the parameter (DSCP value, fwmark and
    /// mask) so marking and shaping need no new map layout.
    pub enum Action {
        /// Police: drop (`TC_ACT_SHOT`).
        Drop = 0, "drop";
        /// Count only (monitor mode).
        Pass = 1, "pass";
        /// Set ECN CE on ECN-capable packets, drop the rest.
        Ecn = 2, "ecn";
        /// Rewrite DSCP to `action_arg` and pass.
        Dscp = 3, "dscp";
        /// Set `skb->mark = (mark & !action_mask) | action_arg` and pass.
        Fwmark = 4, "fwmark";
        /// Delay instead of drop: queue in shaper's HTB class (`action_arg` is its handle)
        /// or, with `action_arg` 0, pace by earliest departure time for fq; CoDel on the
        /// class's virtual queue drops or CE-marks before the queue stands.
        Shape = 5, "shape";
    }
}

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

/// One CPU's prepaid credit on a class-scoped bucket: bytes already charged to the
/// shared bucket that this CPU may still send. Valid for one class generation and epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Credit {
    pub bytes: u64,
    pub generation: u32,
    pub epoch: u32,
}

/// A bucket: one GCRA word, two for meters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub tat: u64,
    pub tat2: u64,
}

/// Key of the per-flow/src/dst bucket table. Fields a scope ignores are zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BucketKey {
    pub class_id: u32,
    pub generation: u32,
    pub family: u8,
    pub proto: u8,
    pub _pad: u16,
    pub sport: u16,
    pub dport: u16,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

/// Per-class, per-CPU counters.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    pub passed_packets: u64,
    pub passed_bytes: u64,
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    pub marked_packets: u64,
    pub marked_bytes: u64,
    /// Meters only: packets and bytes per colour.
    pub green_packets: u64,
    pub green_bytes: u64,
    pub yellow_packets: u64,
    pub yellow_bytes: u64,
    pub red_packets: u64,
    pub red_bytes: u64,
}

/// A class's keys in the flow table, per CPU: every key its packets created. Keys it
/// holds are counted in the table itself, so the ones the LRU evicted are the difference.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStats {
    pub new_keys: u64,
}

impl ClassStats {
    /// Adds another CPU's counters.
    pub fn accumulate(&mut self, other: &ClassStats) {
        self.passed_packets += other.passed_packets;
        self.passed_bytes += other.passed_bytes;
        self.dropped_packets += other.dropped_packets;
        self.dropped_bytes += other.dropped_bytes;
        self.marked_packets += other.marked_packets;
        self.marked_bytes += other.marked_bytes;
        self.green_packets += other.green_packets;
        self.green_bytes += other.green_bytes;
        self.yellow_packets += other.yellow_packets;
        self.yellow_bytes += other.yellow_bytes;
        self.red_packets += other.red_packets;
        self.red_bytes += other.red_bytes;
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
    pub _pad: [u8; 5],
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
            _pad: [0; 5],
            codel_target_ns: 0,
            codel_interval_ns: 0,
        }
    }
}

/// One slot of the per-CPU verdict cache: a packet's classification tuple (the first 40
/// bytes of the packet path's parsed packet: family, protocol, flags, ports, addresses)
/// and the class the rules gave it, `NO_CLASS` included. The cache only saves the search:
/// the class's state and bucket are read for every packet as before.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerdictEntry {
    pub tuple: [u64; 5],
    /// `verdict_stamp` of the rules generation the class was found under; 0 never matches.
    pub stamp: u64,
    pub class_id: u32,
    pub _pad: u32,
}

/// The stamp of verdicts found under `rules_generation`: never 0, the zeroed slot's.
pub const fn verdict_stamp(rules_generation: u32) -> u64 {
    rules_generation as u64 + 1
}

/// The cache slot of a tuple: each word folded (its upper half into its lower) and
/// multiplied by its own odd constant, the products summed, folded and mixed once more;
/// the top bits pick one of `VERDICT_CACHE_SLOTS`. The five products are independent,
/// so they run side by side; the fold used before mixed word after word and waited for
/// five multiplies in a row. The folds matter: a product carries a word's top bits only
/// into its own top few, and the fields that tell flows apart often sit there (the
/// destination port; a host number, the last byte of an address in network order).
#[inline(always)]
pub const fn verdict_slot(tuple: &[u64; 5]) -> u32 {
    const KEYS: [u64; 5] = [
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
        0xd6e8_feb8_6659_fd93,
        0xff51_afd7_ed55_8ccd,
    ];
    #[inline(always)]
    const fn term(word: u64, key: u64) -> u64 {
        (word ^ (word >> 32)).wrapping_mul(key)
    }
    let hash = term(tuple[0], KEYS[0])
        .wrapping_add(term(tuple[1], KEYS[1]))
        .wrapping_add(term(tuple[2], KEYS[2]))
        .wrapping_add(term(tuple[3], KEYS[3]))
        .wrapping_add(term(tuple[4], KEYS[4]));
    let mixed = term(hash, KEYS[0]);
    (mixed >> (64 - VERDICT_CACHE_SLOTS.trailing_zeros())) as u32
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for Globals {}
    unsafe impl aya::Pod for Shape {}
    unsafe impl aya::Pod for RuleKey {}
    unsafe impl aya::Pod for RuleValue {}
    unsafe impl aya::Pod for ClassConfig {}
    unsafe impl aya::Pod for Bucket {}
    unsafe impl aya::Pod for BucketKey {}
    unsafe impl aya::Pod for ClassStats {}
    unsafe impl aya::Pod for KeyStats {}
    unsafe impl aya::Pod for ClassMeta {}
    unsafe impl aya::Pod for Credit {}
    unsafe impl aya::Pod for GlobalShare {}
    unsafe impl aya::Pod for VerdictEntry {}
    unsafe impl aya::Pod for crate::codel::CodelState {}
    unsafe impl aya::Pod for crate::codel::FlowCensus {}
}
