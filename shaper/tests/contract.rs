//! The kernel/userspace contract, checked on the host without root: the eBPF object that
//! is embedded in the binary declares exactly the maps and programs `shaper_common`
//! names, each with the key and value sizes userspace reads and writes, and the
//! capacities userspace assumes. Key and value types are compiled for two targets
//! (bpfel-unknown-none and the host); a layout that differs between them would corrupt
//! every map access silently, and fails here first.

use shaper_common::{
    codel::{CodelState, FlowCensus},
    fair::{FlowQueue, FlowScratch, ShapeStats},
    map_names, program_names, Bucket, BucketKey, ClassConfig, ClassMeta, ClassStats, Credit,
    GlobalShare, Globals, KeyStats, RuleKey, RuleValue, Shape, VerdictEntry, CLASS_NAME_LEN,
    DEFAULT_FLOW_TABLE_SIZE, LAYOUT_VERSION, MAX_CLASSES, MAX_RULES, MAX_SHAPES,
    VERDICT_CACHE_SLOTS,
};
use std::mem::size_of;

// Map types (include/uapi/linux/bpf.h).
const HASH: u32 = 1;
const ARRAY: u32 = 2;
const PERCPU_ARRAY: u32 = 6;
const LRU_HASH: u32 = 9;

/// How userspace uses one map: its type, key and value sizes, and capacity.
struct Expected {
    name: &'static str,
    map_type: u32,
    key: usize,
    value: usize,
    entries: u32,
}

const fn map(
    name: &'static str,
    map_type: u32,
    key: usize,
    value: usize,
    entries: u32,
) -> Expected {
    Expected {
        name,
        map_type,
        key,
        value,
        entries,
    }
}

const U32: usize = size_of::<u32>();

const EXPECTED: [Expected; 21] = [
    map(map_names::LAYOUT, ARRAY, U32, U32, 1),
    map(map_names::GLOBALS, ARRAY, U32, size_of::<Globals>(), 1),
    map(
        map_names::SHAPES,
        ARRAY,
        U32,
        size_of::<Shape>(),
        MAX_SHAPES,
    ),
    map(
        map_names::RULES,
        HASH,
        size_of::<RuleKey>(),
        size_of::<RuleValue>(),
        MAX_RULES,
    ),
    map(
        map_names::CLASSES,
        ARRAY,
        U32,
        size_of::<ClassConfig>(),
        MAX_CLASSES,
    ),
    map(
        map_names::CLASS_BUCKETS,
        ARRAY,
        U32,
        size_of::<Bucket>(),
        MAX_CLASSES,
    ),
    map(
        map_names::KEYED_BUCKETS,
        LRU_HASH,
        size_of::<BucketKey>(),
        size_of::<Bucket>(),
        DEFAULT_FLOW_TABLE_SIZE,
    ),
    map(
        map_names::STATS,
        PERCPU_ARRAY,
        U32,
        size_of::<ClassStats>(),
        MAX_CLASSES,
    ),
    map(
        map_names::CLASS_META,
        ARRAY,
        U32,
        size_of::<ClassMeta>(),
        MAX_CLASSES,
    ),
    map(
        map_names::CLASS_INDEX,
        HASH,
        CLASS_NAME_LEN,
        U32,
        MAX_CLASSES,
    ),
    map(
        map_names::CREDIT,
        PERCPU_ARRAY,
        U32,
        size_of::<Credit>(),
        MAX_CLASSES,
    ),
    map(
        map_names::CODEL,
        ARRAY,
        U32,
        size_of::<CodelState>(),
        MAX_CLASSES,
    ),
    map(
        map_names::KEY_STATS,
        PERCPU_ARRAY,
        U32,
        size_of::<KeyStats>(),
        MAX_CLASSES,
    ),
    // The packet path's own scratch (shaper-ebpf's `repr(C)` Packet); userspace only pins it.
    map(map_names::SHAPE_PACKET, PERCPU_ARRAY, U32, 64, 1),
    // Global classes' shares, expiries and floors (layout 4).
    map(
        map_names::SHARES,
        ARRAY,
        U32,
        size_of::<GlobalShare>(),
        MAX_CLASSES,
    ),
    // The per-CPU verdict cache (layout 5); userspace only pins it.
    map(
        map_names::VERDICT_CACHE,
        PERCPU_ARRAY,
        U32,
        size_of::<VerdictEntry>(),
        VERDICT_CACHE_SLOTS,
    ),
    // Shape classes' bulk flows per CoDel interval (layout 6).
    map(
        map_names::CODEL_FLOWS,
        ARRAY,
        U32,
        size_of::<FlowCensus>(),
        MAX_CLASSES,
    ),
    // The ifb an ingress attachment splits aggregates through (layout 8).
    map(map_names::SPLIT_TO, ARRAY, U32, U32, 1),
    // Flow isolation (layout 9): shape classes' flows, their drops by cause, and the
    // packet path's scratch for a flow key and entry (userspace only pins it).
    map(
        map_names::FLOW_QUEUES,
        LRU_HASH,
        size_of::<BucketKey>(),
        size_of::<FlowQueue>(),
        DEFAULT_FLOW_TABLE_SIZE,
    ),
    map(
        map_names::SHAPE_STATS,
        PERCPU_ARRAY,
        U32,
        size_of::<ShapeStats>(),
        MAX_CLASSES,
    ),
    map(
        map_names::FLOW_SCRATCH,
        PERCPU_ARRAY,
        U32,
        size_of::<FlowScratch>(),
        1,
    ),
];

fn object() -> aya_obj::Object {
    aya_obj::Object::parse(shaper::EBPF_OBJECT).expect("the embedded eBPF object parses")
}

#[test]
fn the_ebpf_object_declares_the_maps_userspace_expects() {
    let object = object();
    let mut problems = Vec::new();
    for expected in &EXPECTED {
        let Some(declared) = object.maps.get(expected.name) else {
            problems.push(format!("map {} is missing from the object", expected.name));
            continue;
        };
        let found = (
            declared.map_type(),
            declared.key_size() as usize,
            declared.value_size() as usize,
            declared.max_entries(),
        );
        let wanted = (
            expected.map_type,
            expected.key,
            expected.value,
            expected.entries,
        );
        if found != wanted {
            problems.push(format!(
                "map {}: the object has (type, key, value, entries) {found:?}, userspace expects {wanted:?}",
                expected.name
            ));
        }
    }
    // aya-log's own maps and the object's data sections (.rodata, ...) aside, nothing the
    // contract does not name.
    for name in object.maps.keys() {
        let ours = !name.starts_with("AYA_LOG") && !name.starts_with('.');
        if ours && !map_names::ALL.contains(&name.as_str()) {
            problems.push(format!("map {name} is not in shaper_common::map_names"));
        }
    }
    let checked: Vec<&str> = EXPECTED.iter().map(|e| e.name).collect();
    assert_eq!(
        checked,
        map_names::ALL,
        "every named map is checked, in order"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The (key, value) sizes of every map at the layout version they were recorded for. A
/// change of any pinned type changes them: the test then asks for a new layout version
/// (with the migration `shaper upgrade` needs), so pins of the old layout are never read
/// as the new one.
const RECORDED_LAYOUT: (u32, [(&str, usize, usize); 21]) = (
    10,
    [
        ("LAYOUT", 4, 4),
        ("GLOBALS", 4, 32),
        ("SHAPES", 4, 40),
        ("RULES", 44, 16),
        ("CLASSES", 4, 448),
        ("CLASS_BUCKETS", 4, 16),
        ("KEYED_BUCKETS", 48, 16),
        ("STATS", 4, 96),
        ("CLASS_META", 4, 168),
        ("CLASS_INDEX", 48, 4),
        ("CREDIT", 4, 16),
        ("CODEL", 4, 16),
        ("KEY_STATS", 4, 8),
        ("SHAPE_PACKET", 4, 64),
        ("SHARES", 4, 176),
        ("VERDICT_CACHE", 4, 56),
        ("CODEL_FLOWS", 4, 88),
        ("SPLIT_TO", 4, 4),
        ("FLOW_QUEUES", 48, 56),
        ("SHAPE_STATS", 4, 48),
        ("FLOW_SCRATCH", 4, 104),
    ],
);

#[test]
fn a_changed_map_layout_comes_with_a_new_layout_version() {
    let sizes: Vec<(&str, usize, usize)> = EXPECTED
        .iter()
        .map(|map| (map.name, map.key, map.value))
        .collect();
    let (version, recorded) = RECORDED_LAYOUT;
    assert_eq!(
        (LAYOUT_VERSION, sizes.as_slice()),
        (version, recorded.as_slice()),
        "the pinned maps' layout changed: bump shaper_common::LAYOUT_VERSION, record the new \
         sizes here, and teach `shaper upgrade` to migrate pins of the old layout"
    );
}

#[test]
fn the_ebpf_object_has_the_programs_userspace_loads() {
    let object = object();
    for name in [
        program_names::SHAPER,
        program_names::SHAPER_L3,
        program_names::SHAPER_CLOCKED,
        program_names::SHAPER_UNCACHED,
        program_names::FLOOR,
        program_names::FLOOR_CLOCK,
    ] {
        assert!(
            object.programs.contains_key(name),
            "program {name} missing; the object has {:?}",
            object.programs.keys().collect::<Vec<_>>()
        );
    }
}

/// BPF has no memset/memcpy/memcmp instructions: LLVM calls the linked-in ones, which are
/// byte-at-a-time loops (zeroing the parsed packet and the flow key that way cost about
/// 200 instructions a packet). The packet path builds its structs field by field; only
/// a global class's expiry (once per lapse, not per packet) may copy with one.
#[test]
fn the_packet_path_calls_no_byte_loop_library_function() {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget};
    let file = object::File::parse(shaper::EBPF_OBJECT).expect("the embedded object parses");
    let functions: Vec<(object::SectionIndex, u64, u64, String)> = file
        .symbols()
        .filter(|symbol| symbol.kind() == object::SymbolKind::Text)
        .filter_map(|symbol| {
            Some((
                symbol.section_index()?,
                symbol.address(),
                symbol.size(),
                symbol.name().ok()?.to_string(),
            ))
        })
        .collect();
    let library = ["memset", "memcpy", "memmove", "memcmp", "bcmp"];
    let mut calls = Vec::new();
    for section in file.sections() {
        for (offset, relocation) in section.relocations() {
            let RelocationTarget::Symbol(target) = relocation.target() else {
                continue;
            };
            let target = file.symbol_by_index(target).expect("relocation symbol");
            let Ok(name) = target.name() else { continue };
            if !library.contains(&name) {
                continue;
            }
            let caller = functions
                .iter()
                .find(|(index, start, size, _)| {
                    *index == section.index() && (*start..start + size).contains(&offset)
                })
                .map_or("?", |(_, _, _, caller)| caller.as_str());
            calls.push(format!("{caller} -> {name}"));
        }
    }
    let per_packet: Vec<&String> = calls
        .iter()
        .filter(|call| !call.contains("expire_share"))
        .collect();
    assert!(
        per_packet.is_empty(),
        "library calls on the packet path: {per_packet:?}"
    );
}
