//! Map keys and values shared by the eBPF program and userspace, by concern: the
//! classifier (`rules`), stored enums (`codes`), classes, buckets and counters, global
//! shares and the verdict cache; map and program names and the packet-path globals here.
//!
//! Every struct is `#[repr(C)]` with explicit padding so both sides agree byte for byte.

use crate::{
    bucket::{rescale, tagged, word_version, ByteCost, COST_VERSIONS, TAT_MASK},
    codel::CodelConfig,
};

mod buckets;
mod class;
mod codes;
mod global;
mod rules;
mod verdict;

pub use buckets::*;
pub use class::*;
pub use codes::*;
pub use global::*;
pub use rules::*;
pub use verdict::*;

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
/// layout 6 `CODEL_FLOWS`, layout 7 shape classes on ingress (`ClassConfig::action_mask`:
/// the ifb's ifindex, which an older program would not redirect to), layout 8 `SPLIT_TO`
/// (an older program would not split), layout 9 flow isolation in shape classes
/// (`CodelConfig::fair` and `ClassMeta::fair` in former padding, `FLOW_QUEUES`,
/// `SHAPE_STATS`, `FLOW_SCRATCH`, and a larger `CODEL_FLOWS` value, which the upgrade makes anew).
pub const LAYOUT_VERSION: u32 = 10;

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
    /// Element 0: the ifindex of the ifb an ingress attachment hands every packet it lets
    /// pass to, which splits GSO/GRO aggregates into wire-size segments and gives them
    /// back to the interface (`shaper attach --split-aggregates`); 0: pass in place. On
    /// an egress attachment, the splitter's ifb with [`super::SPLIT_EGRESS`] set: shape
    /// classes' forwarded aggregates go there (`super::program_names::SPLITTER`).
    pub const SPLIT_TO: &str = "SPLIT_TO";
    /// Shape classes: per flow (and per host under `--fair src|dst`), the flow's
    /// sparseness, census stamp, virtual queue at its fair share and CoDel
    /// (`fair::FlowQueue`); sized as the flow table.
    pub const FLOW_QUEUES: &str = "FLOW_QUEUES";
    /// Per shape class and CPU: drops and marks by cause (`fair::ShapeStats`).
    pub const SHAPE_STATS: &str = "SHAPE_STATS";
    /// Packet-path scratch (one per-CPU slot: a flow key and entry), never read by
    /// userspace.
    pub const FLOW_SCRATCH: &str = "FLOW_SCRATCH";
    /// Every map of the object, in the order userspace pins them.
    pub const ALL: [&str; 21] = [
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
        SPLIT_TO,
        FLOW_QUEUES,
        SHAPE_STATS,
        FLOW_SCRATCH,
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
    /// The egress splitter: a classic (not direct-action) classifier after `shaper` in
    /// the clsact hook, matching the aggregates `shaper` marked with
    /// [`super::SPLIT_MARK`]; its mirred action hands them to the splitter's ifb.
    pub const SPLITTER: &str = "shaper_splitter";
}

/// `SPLIT_TO`'s flag for an egress attachment: the ifindex below it is the splitter's
/// ifb, which forwarded aggregates of shape classes go to (through the splitter's mirred
/// action, which sets what an ifb needs to hand them back to the interface's egress).
pub const SPLIT_EGRESS: u32 = 1 << 31;
/// The `tc_index` the program gives a packet it sends to the splitter; its segments come
/// back with it.
pub const SPLIT_MARK: u32 = 0x5348;
/// The `tc_index` of a packet back from the splitter that the program let pass: handed
/// on to the splitter's filter once more, whose action sees the ifb's `tc_skip_classify`
/// and clears it (without it the packet would skip the packet taps and tc hooks of
/// every device it reaches next: a veth peer's tcpdump, AF_PACKET, ingress filters) and
/// does not redirect; the splitter clears the mark.
pub const SPLIT_BACK: u32 = 0x5349;

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
    unsafe impl aya::Pod for crate::fair::FlowQueue {}
    unsafe impl aya::Pod for crate::fair::ShapeStats {}
    unsafe impl aya::Pod for crate::fair::FlowScratch {}
}
