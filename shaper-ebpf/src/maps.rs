//! Every map of an attachment. The kernel/userspace contract for their names and
//! value types is `shaper_common`; userspace pins them per interface and direction.

use crate::parse::Packet;
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use shaper_common::{
    codel::{CodelState, FlowCensus},
    fair::{FlowQueue, FlowScratch, ShapeStats},
    Bucket, BucketKey, ClassConfig, ClassMeta, ClassStats, Credit, GlobalShare, Globals, KeyStats,
    RuleKey, RuleValue, Shape, VerdictEntry, CLASS_NAME_LEN, DEFAULT_FLOW_TABLE_SIZE, MAX_CLASSES,
    MAX_RULES, MAX_SHAPES, VERDICT_CACHE_SLOTS,
};

/// Userspace only: the layout version of this state (`shaper_common::LAYOUT_VERSION`).
#[map]
pub(crate) static LAYOUT: Array<u32> = Array::with_max_entries(1, 0);
#[map]
pub(crate) static GLOBALS: Array<Globals> = Array::with_max_entries(1, 0);
#[map]
pub(crate) static SHAPES: Array<Shape> = Array::with_max_entries(MAX_SHAPES, 0);
#[map]
/// Not preallocated: memory follows the classes in use, not the 262 144-entry ceiling.
pub(crate) static RULES: HashMap<RuleKey, RuleValue> =
    HashMap::with_max_entries(MAX_RULES, BPF_F_NO_PREALLOC as u32);
#[map]
pub(crate) static CLASSES: Array<ClassConfig> = Array::with_max_entries(MAX_CLASSES, 0);
/// Class-scoped buckets: the GCRA word per class id.
#[map]
pub(crate) static CLASS_BUCKETS: Array<Bucket> = Array::with_max_entries(MAX_CLASSES, 0);
/// Flow/src/dst-scoped buckets, created on a key's first packet; userspace resizes it.
#[map]
pub(crate) static KEYED_BUCKETS: LruHashMap<BucketKey, Bucket> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);
#[map]
pub(crate) static STATS: PerCpuArray<ClassStats> = PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// Per-CPU prepaid credit on class-scoped buckets (see `shaper_common::bucket`).
#[map]
pub(crate) static CREDIT: PerCpuArray<Credit> = PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// Shape classes' CoDel state, per class id (see `shaper_common::codel`); in policing
/// trees, a class's fair share for its children and its own fair word
/// (`shaper_common::hierarchy`).
#[map]
pub(crate) static CODEL: Array<CodelState> = Array::with_max_entries(MAX_CLASSES, 0);
/// Shape classes' bulk flows per CoDel interval (`shaper_common::codel::FlowCensus`).
#[map]
pub(crate) static CODEL_FLOWS: Array<FlowCensus> = Array::with_max_entries(MAX_CLASSES, 0);
/// Keys each class created in `KEYED_BUCKETS` (per CPU): LRU pressure for userspace.
#[map]
pub(crate) static KEY_STATS: PerCpuArray<KeyStats> = PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// The packet being judged: parsed into this per-CPU slot and read from it by every stage
/// (classify, bucket, meters, actions, the shape path), never kept in registers. Values
/// in a map are unknown to the verifier, so the parser's many paths reach the rest of the
/// program in one state, verified once rather than once per path (verified instructions
/// 941 019 -> 104 487). The name is the one pinned since the shape path alone used it.
#[map]
pub(crate) static SHAPE_PACKET: PerCpuArray<Packet> = PerCpuArray::with_max_entries(1, 0);
/// Global classes: this host's share of a limit across hosts and its expiry (see
/// `shaper_common::GlobalShare`); read only for classes flagged `global`.
#[map]
pub(crate) static SHARES: Array<GlobalShare> = Array::with_max_entries(MAX_CLASSES, 0);
/// Per CPU: the class recent tuples were classified to (see `classify`). A per-CPU array
/// (lookups inlined by the verifier, no torn entries from another CPU); its stamps are
/// tied to `Globals::rules_generation`, so userspace never touches it.
#[map]
pub(crate) static VERDICT_CACHE: PerCpuArray<VerdictEntry> =
    PerCpuArray::with_max_entries(VERDICT_CACHE_SLOTS, 0);
/// Userspace bookkeeping only (names, rules); declared here so it is created and pinned
/// with the rest of the attachment's state.
#[map]
pub(crate) static CLASS_META: Array<ClassMeta> = Array::with_max_entries(MAX_CLASSES, 0);
/// Userspace only: class name → class id, so commands find a class without a scan.
#[map]
pub(crate) static CLASS_INDEX: HashMap<[u8; CLASS_NAME_LEN], u32> =
    HashMap::with_max_entries(MAX_CLASSES, BPF_F_NO_PREALLOC as u32);

/// Element 0: the ifb every packet this (ingress) attachment lets pass is handed to, which
/// splits aggregates into wire-size segments; 0 passes in place (`map_names::SPLIT_TO`).
#[map]
pub(crate) static SPLIT_TO: Array<u32> = Array::with_max_entries(1, 0);

/// Shape classes' flows (and hosts, under `--fair src|dst`): sparseness, census stamp,
/// the virtual queue at the flow's fair share and its CoDel (`shaper_common::fair`).
/// Created on a flow's first packet; userspace sizes it as the flow table.
#[map]
pub(crate) static FLOW_QUEUES: LruHashMap<BucketKey, FlowQueue> =
    LruHashMap::with_max_entries(DEFAULT_FLOW_TABLE_SIZE, 0);
/// Per shape class and CPU: drops and marks by cause (`shaper_common::fair::ShapeStats`).
#[map]
pub(crate) static SHAPE_STATS: PerCpuArray<ShapeStats> =
    PerCpuArray::with_max_entries(MAX_CLASSES, 0);
/// Per CPU: the flow table key and a new entry being built by the shape path, kept in a
/// map rather than on the stack (512 bytes over the whole chain of calls, which the
/// shape path's subprograms would exceed).
#[map]
pub(crate) static FLOW_SCRATCH: PerCpuArray<FlowScratch> = PerCpuArray::with_max_entries(1, 0);
