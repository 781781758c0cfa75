//! An attachment's pinned maps and program: typed access to each map, and what
//! `status` reports.

use super::*;

use crate::error::runtime;
use anyhow::Result;
use aya::{
    maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::SchedClassifier,
};
use shaper_common::{
    bucket::TAT_MASK,
    codel::{sojourn_ns, CodelState, Control, FlowCensus},
    map_names, Bucket, BucketKey, ClassConfig, ClassMeta, ClassStats, CostKind, Credit,
    GlobalShare, Globals, KeyStats, RuleKey, RuleValue, Shape, CLASS_NAME_LEN, LAYOUT_VERSION,
};

/// A `--per` class's keys: held now (of them live), created since it was added, and
/// evicted by the LRU (`Attachment::key_pressure`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyPressure {
    pub held: u64,
    pub live: u64,
    pub created: u64,
    pub evicted: u64,
}

/// A class's keys in the flow table now (`Attachment::key_census`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyCensus {
    pub held: u64,
    pub live: u64,
}
use std::path::{Path, PathBuf};

/// One line on what to do with pins of a layout this shaper does not read.
pub(crate) fn layout_mismatch(location: &Location, found: Option<u32>) -> String {
    let netns = location
        .netns
        .as_ref()
        .map(|n| format!(" --netns {n}"))
        .unwrap_or_default();
    let (dev, direction) = (&location.dev, location.direction.name());
    match found {
        Some(found) if found > LAYOUT_VERSION => format!(
            "{} was attached by a newer shaper (state layout {found}; this shaper reads layout \
             {LAYOUT_VERSION}): use that shaper, or `shaper{netns} detach {dev} --direction \
             {direction}` and attach again",
            location.describe()
        ),
        Some(found) => format!(
            "{} was attached by an older shaper (state layout {found}; this shaper reads layout \
             {LAYOUT_VERSION}): run `shaper{netns} upgrade {dev}`, which keeps its classes, \
             buckets and counters and the traffic policed",
            location.describe()
        ),
        None => format!(
            "{}: the state layout stamp cannot be read (this shaper reads layout \
             {LAYOUT_VERSION}); `shaper{netns} detach {dev} --direction {direction}` and attach \
             again",
            location.describe()
        ),
    }
}

/// What `status` reports about one attachment.
pub struct AttachmentStatus {
    pub mode: AttachMode,
    pub program_id: u32,
    /// The program is still hooked to an interface with the index it was attached to.
    pub live: bool,
    /// Why it is not live: "interface gone", "interface re-created", "program unhooked",
    /// "namespace gone".
    pub problem: Option<&'static str>,
    pub flow_table_size: u32,
}

/// An attachment's pinned maps, opened for reading and writing.
pub struct Attachment {
    pub location: Location,
    dir: PathBuf,
}

fn open_map(dir: &Path, name: &str) -> Result<Map> {
    let data = MapData::from_pin(dir.join(name))
        .with_context(|| format!("cannot open pinned map {}", dir.join(name).display()))?;
    Ok(Map::from_map_data(data)?)
}

impl Attachment {
    /// Opens the attachment at `location`, or fails with a hint to attach first, or with
    /// what to do when its pins are of another layout than this shaper reads.
    pub fn open(location: &Location) -> Result<Self> {
        let attachment = Self::open_any_layout(location)?;
        match attachment.layout() {
            Some(LAYOUT_VERSION) => Ok(attachment),
            found => Err(runtime(layout_mismatch(location, found))),
        }
    }

    /// Opens the attachment whatever the layout of its pins: for `status`, which shows
    /// it, and `detach`, which removes it.
    pub fn open_any_layout(location: &Location) -> Result<Self> {
        let dir = location.dir();
        if !dir.join(map_names::GLOBALS).exists() {
            return Err(runtime(format!(
                "shaper is not attached to {}; run: shaper{} attach {} --direction {}",
                location.describe(),
                location
                    .netns
                    .as_ref()
                    .map(|n| format!(" --netns {n}"))
                    .unwrap_or_default(),
                location.dev,
                location.direction.name()
            )));
        }
        Ok(Self {
            location: location.clone(),
            dir,
        })
    }

    /// The layout version stamped at attach; 0 for pins from before the stamp, `None`
    /// when it cannot be read.
    pub fn layout(&self) -> Option<u32> {
        let path = self.dir.join(map_names::LAYOUT);
        if !path.exists() {
            return Some(0);
        }
        let layout: Array<MapData, u32> = self.map(map_names::LAYOUT).ok()?;
        layout.get(&0, 0).ok()
    }

    /// Why this shaper cannot read the attachment's pins, for `status`; `None` when it can.
    pub fn layout_problem(&self) -> Option<String> {
        match self.layout() {
            Some(LAYOUT_VERSION) => None,
            Some(found) => Some(format!(
                "state layout {found}, this shaper reads {LAYOUT_VERSION}"
            )),
            None => Some("state layout unreadable".to_string()),
        }
    }

    /// The attach mode as the pins show it, without reading `GLOBALS` (whose layout may
    /// be another shaper's): only TCX attachments pin a link.
    pub fn mode_from_pins(&self) -> AttachMode {
        if self.dir.join(LINK_PIN).exists() {
            AttachMode::Tcx
        } else {
            AttachMode::Clsact
        }
    }

    /// One pinned map of the attachment, as the typed aya map `M`.
    pub(super) fn map<M: TryFrom<Map, Error = aya::maps::MapError>>(
        &self,
        name: &str,
    ) -> Result<M> {
        Ok(M::try_from(open_map(&self.dir, name)?)?)
    }

    pub(crate) fn globals_map(&self) -> Result<Array<MapData, Globals>> {
        self.map(map_names::GLOBALS)
    }

    pub fn globals(&self) -> Result<Globals> {
        Ok(self.globals_map()?.get(&0, 0)?)
    }

    pub(crate) fn set_globals(&self, globals: Globals) -> Result<()> {
        Ok(self.globals_map()?.set(0, globals, 0)?)
    }

    /// Tells the packet path that `RULES`, `SHAPES` or the shape count changed, so the
    /// verdicts its CPUs cached before are not used again. Called after the last write
    /// (a verdict found while rules change carries the generation before), and never
    /// while a caller holds a `Globals` copy it writes back later.
    pub(crate) fn rules_changed(&self) -> Result<()> {
        let mut globals = self.globals()?;
        globals.rules_changed();
        self.set_globals(globals)
    }

    pub fn shapes(&self) -> Result<Array<MapData, Shape>> {
        self.map(map_names::SHAPES)
    }

    pub fn rules(&self) -> Result<BpfHashMap<MapData, RuleKey, RuleValue>> {
        self.map(map_names::RULES)
    }

    pub fn classes(&self) -> Result<Array<MapData, ClassConfig>> {
        self.map(map_names::CLASSES)
    }

    pub fn class_buckets(&self) -> Result<Array<MapData, Bucket>> {
        self.map(map_names::CLASS_BUCKETS)
    }

    pub fn stats(&self) -> Result<PerCpuArray<MapData, ClassStats>> {
        self.map(map_names::STATS)
    }

    pub fn key_stats(&self) -> Result<PerCpuArray<MapData, KeyStats>> {
        self.map(map_names::KEY_STATS)
    }

    /// Keys class `class_id` created in the flow table since it was added (all CPUs).
    pub fn new_keys(&self, class_id: u32) -> Result<u64> {
        let per_cpu = self.key_stats()?.get(&class_id, 0)?;
        Ok(per_cpu.iter().map(|cpu| cpu.new_keys).sum())
    }

    /// The flow table by owner, in one walk: (class id, generation) -> the keys it holds
    /// and how many of them are live (their bucket still refilling: evicted, such a key
    /// would come back with a full burst it had not earned).
    pub fn key_census(&self) -> Result<std::collections::HashMap<(u32, u32), KeyCensus>> {
        let table: BpfHashMap<MapData, BucketKey, Bucket> = self.map(map_names::KEYED_BUCKETS)?;
        let now = shaper_common::bucket::ticks(monotonic_ns());
        let mut census = std::collections::HashMap::<(u32, u32), KeyCensus>::new();
        for entry in table.iter() {
            let Ok((key, bucket)) = entry else {
                continue; // evicted while the walk went on
            };
            let owner = census.entry((key.class_id, key.generation)).or_default();
            owner.held += 1;
            if bucket.tat & TAT_MASK > now {
                owner.live += 1;
            }
        }
        Ok(census)
    }

    /// LRU pressure on class `class_id` (created as generation `generation`), from a
    /// census of the table: the keys it holds, of them live, created, and evicted
    /// (created but no longer held).
    pub fn key_pressure(
        &self,
        census: &std::collections::HashMap<(u32, u32), KeyCensus>,
        class_id: u32,
        generation: u32,
    ) -> Result<KeyPressure> {
        let held = census
            .get(&(class_id, generation))
            .copied()
            .unwrap_or_default();
        let created = self.new_keys(class_id)?;
        Ok(KeyPressure {
            held: held.held,
            live: held.live,
            created,
            evicted: created.saturating_sub(held.held),
        })
    }

    pub fn credit(&self) -> Result<PerCpuArray<MapData, Credit>> {
        self.map(map_names::CREDIT)
    }

    /// Global classes' shares (`shaper_common::GlobalShare`), by class id.
    pub fn shares(&self) -> Result<Array<MapData, GlobalShare>> {
        self.map(map_names::SHARES)
    }

    pub fn codel(&self) -> Result<Array<MapData, CodelState>> {
        self.map(map_names::CODEL)
    }

    /// Shape classes' bulk flows per CoDel interval.
    pub fn codel_flows(&self) -> Result<Array<MapData, FlowCensus>> {
        self.map(map_names::CODEL_FLOWS)
    }

    /// Element 0: the ifb this ingress attachment splits aggregates through, or 0.
    pub fn split_to(&self) -> Result<Array<MapData, u32>> {
        self.map(map_names::SPLIT_TO)
    }

    /// A shape class's virtual queue now: its predicted queueing delay (ns) and whether
    /// CoDel is in its dropping state.
    pub fn shape_queue(&self, class_id: u32) -> Result<(u64, bool)> {
        let config = self.classes()?.get(&class_id, 0)?;
        let stored = self.class_buckets()?.get(&class_id, 0)?.tat;
        let control = self.codel()?.get(&class_id, 0)?.control;
        let now = monotonic_ns();
        // As the program reads it: a shape class's word is not converted at a change.
        let tat = stored & TAT_MASK;
        let delay = sojourn_ns(
            tat,
            shaper_common::bucket::ticks(now),
            config.shape_burst_ticks(),
        );
        Ok((delay, Control::unpack(control).dropping))
    }

    /// Tokens a class-scoped bucket holds now: the shared bucket plus the CPUs' credit.
    pub(crate) fn bucket_level(
        &self,
        class_id: u32,
        rate_bits_per_sec: u64,
        burst_bytes: u64,
    ) -> Result<u64> {
        let config = self.classes()?.get(&class_id, 0)?;
        let chunk = u64::from(config.credit_chunk);
        let cpus = possible_cpus();
        let shared = shaper_common::bucket::shared_burst(burst_bytes, cpus, chunk);
        let now = monotonic_ns();
        let stored = self.class_buckets()?.get(&class_id, 0)?.tat;
        let tat = config.settle(stored, now, CostKind::Main);
        let mut level = shaper_common::bucket::level_bytes(tat, now, rate_bits_per_sec, shared);
        if chunk != 0 {
            for credit in self.credit()?.get(&class_id, 0)?.iter() {
                if credit.generation == config.generation && credit.epoch == config.credit_epoch {
                    level += credit.bytes;
                }
            }
        }
        Ok(level.min(burst_bytes))
    }

    pub fn meta(&self) -> Result<Array<MapData, ClassMeta>> {
        self.map(map_names::CLASS_META)
    }

    pub(crate) fn class_index(&self) -> Result<BpfHashMap<MapData, [u8; CLASS_NAME_LEN], u32>> {
        self.map(map_names::CLASS_INDEX)
    }

    /// The class called `name`: one hash lookup, no scan.
    pub fn find_class(&self, name: &str) -> Result<Option<(u32, ClassMeta)>> {
        let Ok(key) = encode_name(name) else {
            return Ok(None);
        };
        let id = match self.class_index()?.get(&key, 0) {
            Ok(id) => id,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let meta = self.meta()?.get(&id, 0)?;
        Ok((meta.in_use != 0 && meta.name == key).then_some((id, meta)))
    }

    /// Every class in use: (class id, description), in creation order. Walks the name
    /// index (as many entries as classes), not the 16 384 slots of the class table: the
    /// daemon reads the list at every check.
    pub fn class_list(&self) -> Result<Vec<(u32, ClassMeta)>> {
        let meta = self.meta()?;
        let mut list = Vec::new();
        for entry in self.class_index()?.iter() {
            let (name, id) = entry?;
            let entry = meta.get(&id, 0)?;
            if entry.in_use != 0 && entry.name == name {
                list.push((id, entry));
            }
        }
        list.sort_by_key(|(_, m)| m.seq);
        Ok(list)
    }

    /// Per-class counters summed over CPUs.
    pub fn class_stats(&self, class_id: u32) -> Result<ClassStats> {
        Ok(summed(&self.stats()?.get(&class_id, 0)?))
    }

    /// Where the attachment stands. Run inside the attachment's network namespace: the
    /// interface and its hooks are looked up there.
    pub fn status(&self) -> Result<AttachmentStatus> {
        let globals = self.globals()?;
        let mode = AttachMode::from_globals(globals.attach_mode);
        let program_id = self.program_id()?;
        let flow_table_size = self.flow_table_size()?;
        let dev = &self.location.dev;
        let problem = match crate::netns::ifindex(dev).ok() {
            None => Some("interface gone"),
            Some(index) if index != globals.ifindex => Some("interface re-created"),
            Some(_) if !self.hooked(mode, program_id)? => Some("program unhooked"),
            Some(_) => None,
        };
        Ok(AttachmentStatus {
            mode,
            program_id,
            live: problem.is_none(),
            problem,
            flow_table_size,
        })
    }

    /// The status of an attachment whose network namespace is gone (with its interfaces
    /// and hooks): only the pins are left; `shaper detach DEV --netns NAME` clears them.
    pub fn status_without_namespace(&self) -> Result<AttachmentStatus> {
        Ok(AttachmentStatus {
            mode: AttachMode::from_globals(self.globals()?.attach_mode),
            program_id: self.program_id()?,
            live: false,
            problem: Some("namespace gone"),
            flow_table_size: self.flow_table_size()?,
        })
    }

    /// Whether the pinned program is really in the interface's hook: a TCX link can be
    /// detached and a clsact qdisc deleted (`tc qdisc del dev X clsact`) behind our back.
    /// A hook that cannot be read is an error, never "unhooked": re-hooking on a failed
    /// read would put the program in twice.
    fn hooked(&self, mode: AttachMode, program_id: u32) -> Result<bool> {
        let (dev, direction) = (&self.location.dev, self.location.direction);
        Ok(match mode {
            AttachMode::Tcx => SchedClassifier::query_tcx(dev, direction.tc())
                .map_err(|e| {
                    runtime(format!(
                        "cannot read the TCX hook of {dev} {}: {e}",
                        direction.name()
                    ))
                })?
                .1
                .iter()
                .any(|p| p.id() == program_id),
            AttachMode::Clsact => {
                crate::qdisc::clsact_program_ids(dev, direction.name())?.contains(&program_id)
            }
        })
    }

    /// Capacity of the per-key bucket table, fixed at attach time.
    pub fn flow_table_size(&self) -> Result<u32> {
        Ok(MapData::from_pin(self.dir.join(map_names::KEYED_BUCKETS))?
            .info()?
            .max_entries())
    }

    /// The id of the pinned program.
    pub fn program_id(&self) -> Result<u32> {
        Ok(aya::programs::ProgramInfo::from_pin(self.dir.join(PROG_PIN))?.id())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A class's counters summed over CPUs.
pub fn summed(per_cpu: &aya::maps::PerCpuValues<ClassStats>) -> ClassStats {
    let mut sum = ClassStats::default();
    for cpu in per_cpu.iter() {
        sum.accumulate(cpu);
    }
    sum
}
