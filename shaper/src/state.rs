//! The one loader/pinning layer every command goes through.
//!
//! State lives only in the kernel, pinned under `/sys/fs/bpf/shaper/<netns>/<dev>/<dir>/`:
//! one pin per map (named as in the object), `prog` (the attached program) and, in TCX
//! mode, `link` (the TCX link; unpinning it detaches the program). Every invocation
//! rebuilds its view from these pins. Mutations take an exclusive `flock` on
//! `/run/lock/shaper.lock`, so two invocations at once never interleave.

use crate::error::{one_line, runtime, usage};
use anyhow::{Context as _, Result};
use aya::{
    maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::{
        links::FdLink,
        tc::{NlOptions, TcAttachOptions},
        LinkOrder, SchedClassifier, TcAttachType,
    },
    Ebpf, EbpfLoader,
};
use nix::fcntl::{Flock, FlockArg};
use shaper_common::{
    map_names, program_names, Bucket, ClassConfig, ClassMeta, ClassStats, Credit, Globals, RuleKey,
    RuleValue, Shape, ATTACH_MODE_CLSACT, ATTACH_MODE_TCX, CLASS_NAME_LEN,
};
use std::{
    fs,
    path::{Path, PathBuf},
};

pub const BPFFS: &str = "/sys/fs/bpf";
pub const PIN_ROOT: &str = "/sys/fs/bpf/shaper";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const LOCK_DIR: &str = "/run/lock";
const LOCK_FILE: &str = "/run/lock/shaper.lock";
const HOST_NAMESPACE_DIR: &str = "host";
const NETNS_DIR_PREFIX: &str = "netns-";
const PROG_PIN: &str = "prog";
const LINK_PIN: &str = "link";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Egress,
    Ingress,
}

impl Direction {
    pub const BOTH: [Direction; 2] = [Direction::Egress, Direction::Ingress];

    pub fn name(self) -> &'static str {
        match self {
            Self::Egress => "egress",
            Self::Ingress => "ingress",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "egress" => Some(Self::Egress),
            "ingress" => Some(Self::Ingress),
            _ => None,
        }
    }

    fn tc(self) -> TcAttachType {
        match self {
            Self::Egress => TcAttachType::Egress,
            Self::Ingress => TcAttachType::Ingress,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Tcx,
    Clsact,
}

impl AttachMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        }
    }

    pub fn from_globals(value: u32) -> Self {
        if value == ATTACH_MODE_CLSACT {
            Self::Clsact
        } else {
            Self::Tcx
        }
    }
}

/// Where an attachment lives: an interface in the host or a named network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub netns: Option<String>,
    pub dev: String,
    pub direction: Direction,
}

impl Location {
    pub fn dir(&self) -> PathBuf {
        let ns = match &self.netns {
            None => HOST_NAMESPACE_DIR.to_string(),
            Some(name) => format!("{NETNS_DIR_PREFIX}{}", escape(name)),
        };
        Path::new(PIN_ROOT)
            .join(ns)
            .join(escape(&self.dev))
            .join(self.direction.name())
    }

    pub fn describe(&self) -> String {
        match &self.netns {
            None => format!("{} {}", self.dev, self.direction.name()),
            Some(ns) => format!("{} {} (netns {ns})", self.dev, self.direction.name()),
        }
    }
}

/// CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns().
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// bpffs reserves dots in names (EPERM), yet interface names like `eth0.100` have them.
fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('.', "%2E")
}

fn unescape(name: &str) -> String {
    name.replace("%2E", ".").replace("%25", "%")
}

/// Every attachment pinned under the root, optionally only those of one namespace.
pub fn list_locations(netns_filter: Option<&Option<String>>) -> Result<Vec<Location>> {
    let mut found = Vec::new();
    let Ok(namespaces) = fs::read_dir(PIN_ROOT) else {
        return Ok(found);
    };
    for ns_entry in namespaces.flatten() {
        let ns_name = ns_entry.file_name().to_string_lossy().to_string();
        let netns = if ns_name == HOST_NAMESPACE_DIR {
            None
        } else if let Some(name) = ns_name.strip_prefix(NETNS_DIR_PREFIX) {
            Some(unescape(name))
        } else {
            continue;
        };
        if netns_filter.is_some_and(|wanted| *wanted != netns) {
            continue;
        }
        for dev_entry in fs::read_dir(ns_entry.path())?.flatten() {
            for dir_entry in fs::read_dir(dev_entry.path())?.flatten() {
                let Some(direction) =
                    Direction::from_name(&dir_entry.file_name().to_string_lossy())
                else {
                    continue;
                };
                found.push(Location {
                    netns: netns.clone(),
                    dev: unescape(&dev_entry.file_name().to_string_lossy()),
                    direction,
                });
            }
        }
    }
    found.sort_by(|a, b| (&a.netns, &a.dev, a.direction).cmp(&(&b.netns, &b.dev, b.direction)));
    Ok(found)
}

/// Mounts bpffs at /sys/fs/bpf when it is not there yet and creates the pin root.
pub fn ensure_bpffs() -> Result<()> {
    let mounted = nix::sys::statfs::statfs(BPFFS)
        .map(|fs| fs.filesystem_type().0 == BPF_FS_MAGIC)
        .unwrap_or(false);
    if !mounted {
        fs::create_dir_all(BPFFS).with_context(|| format!("cannot create {BPFFS}"))?;
        nix::mount::mount(
            Some("bpf"),
            BPFFS,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .with_context(|| format!("cannot mount bpffs at {BPFFS}"))?;
    }
    fs::create_dir_all(PIN_ROOT).with_context(|| format!("cannot create {PIN_ROOT}"))?;
    Ok(())
}

/// Exclusive lock over all of shaper's state; released on drop.
pub struct StateLock {
    _lock: Flock<fs::File>,
}

pub fn lock() -> Result<StateLock> {
    // A lock file outside bpffs, so the pin root itself can go when the last attachment does.
    fs::create_dir_all(LOCK_DIR).with_context(|| format!("cannot create {LOCK_DIR}"))?;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .with_context(|| format!("cannot open {LOCK_FILE}"))?;
    let lock = Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, errno)| errno)
        .with_context(|| format!("cannot lock {LOCK_FILE}"))?;
    ensure_bpffs()?;
    Ok(StateLock { _lock: lock })
}

/// Loads the eBPF object with its maps pinned in `dir`: maps already pinned there are
/// reused, missing ones are created and pinned.
pub fn load_object(dir: &Path, flow_table_size: u32) -> Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(map_names::KEYED_BUCKETS, flow_table_size);
    let paths: Vec<(&str, PathBuf)> = map_names::ALL.iter().map(|n| (*n, dir.join(n))).collect();
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader.load(crate::EBPF_OBJECT).map_err(|e| {
        runtime(format!(
            "cannot load the eBPF object: {}",
            one_line(&e.to_string())
        ))
    })
}

/// Loads (verifies) one program of a loaded object.
pub fn load_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier> {
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()?;
    program.load().map_err(|e| {
        runtime(format!(
            "the kernel refused program {name}: {}",
            one_line(&format!("{e:#}"))
        ))
    })?;
    Ok(program)
}

/// Attaches a fresh program at `location` (which must not exist yet), all or nothing.
/// Returns the mode actually used.
pub fn attach_fresh(
    location: &Location,
    forced_mode: Option<AttachMode>,
    flow_table_size: u32,
) -> Result<AttachMode> {
    let final_dir = location.dir();
    let staging = final_dir.with_file_name(format!("{}-staging", location.direction.name()));
    // A crash may have left a staging directory: it never holds a live attachment.
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    let mut detach_on_failure = None;
    let result = (|| -> Result<AttachMode> {
        let mut ebpf = load_object(&staging, flow_table_size)?;
        let program = load_program(&mut ebpf, program_names::SHAPER)?;
        program.pin(staging.join(PROG_PIN))?;
        let (mode, created_clsact) = attach_program(
            program,
            location,
            forced_mode,
            &staging,
            &mut detach_on_failure,
        )?;
        let ifindex = crate::netns::ifindex(&location.dev)?;
        let mut globals: Array<_, Globals> = Array::try_from(
            ebpf.map_mut(map_names::GLOBALS)
                .context("GLOBALS map missing")?,
        )?;
        globals.set(
            0,
            Globals {
                ifindex,
                attach_mode: match mode {
                    AttachMode::Tcx => ATTACH_MODE_TCX,
                    AttachMode::Clsact => ATTACH_MODE_CLSACT,
                },
                created_clsact: u32::from(created_clsact),
                next_seq: 1,
                ..Globals::default()
            },
            0,
        )?;
        fs::rename(&staging, &final_dir)
            .with_context(|| format!("cannot move pins into {}", final_dir.display()))?;
        Ok(mode)
    })();
    if result.is_err() {
        if let Some((dev, direction, created)) = detach_on_failure {
            detach_clsact_filter(&dev, direction, created);
        }
        let _ = fs::remove_dir_all(&staging);
        remove_empty_parents(&final_dir);
    }
    result
}

fn attach_program(
    program: &mut SchedClassifier,
    location: &Location,
    forced_mode: Option<AttachMode>,
    pin_dir: &Path,
    detach_on_failure: &mut Option<(String, Direction, bool)>,
) -> Result<(AttachMode, bool)> {
    let attach_type = location.direction.tc();
    if forced_mode != Some(AttachMode::Clsact) {
        match program.attach_with_options(
            &location.dev,
            attach_type,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        ) {
            Ok(link_id) => {
                let link: FdLink = program.take_link(link_id)?.try_into()?;
                link.pin(pin_dir.join(LINK_PIN))
                    .map_err(|e| runtime(format!("cannot pin the TCX link: {e}")))?;
                return Ok((AttachMode::Tcx, false));
            }
            Err(error) if forced_mode == Some(AttachMode::Tcx) => {
                return Err(runtime(format!(
                    "TCX attach failed on {} (kernel older than 6.6?): {}",
                    location.dev,
                    one_line(&format!("{error:#}"))
                )));
            }
            Err(_) => {} // Fall back to clsact below.
        }
    }
    let created_clsact = aya::programs::tc::qdisc_add_clsact(&location.dev).is_ok();
    *detach_on_failure = Some((location.dev.clone(), location.direction, created_clsact));
    let link_id = program
        .attach_with_options(
            &location.dev,
            attach_type,
            TcAttachOptions::Netlink(NlOptions::default()),
        )
        .map_err(|e| {
            runtime(format!(
                "clsact attach failed on {}: {}",
                location.dev,
                one_line(&format!("{e:#}"))
            ))
        })?;
    // The netlink filter lives on in the kernel; dropping our handle must not remove it.
    std::mem::forget(program.take_link(link_id)?);
    Ok((AttachMode::Clsact, created_clsact))
}

/// Removes shaper's clsact filter (found by program name) and, when shaper created the
/// clsact qdisc, the qdisc too.
fn detach_clsact_filter(dev: &str, direction: Direction, remove_qdisc: bool) {
    let _ = aya::programs::tc::qdisc_detach_program(dev, direction.tc(), program_names::SHAPER);
    if remove_qdisc {
        // aya has no qdisc deletion; iproute2's tc is on every machine that has TC.
        let _ = std::process::Command::new("tc")
            .args(["qdisc", "del", "dev", dev, "clsact"])
            .stderr(std::process::Stdio::null())
            .status();
    }
}

fn remove_empty_parents(dir: &Path) {
    let mut current = dir.parent();
    while let Some(parent) = current {
        if parent == Path::new(BPFFS) || fs::remove_dir(parent).is_err() {
            break;
        }
        current = parent.parent();
    }
}

/// Hooks the pinned program of an existing attachment to its interface again (the
/// interface was re-created: a VM's tap, a container's veth), keeping every class, bucket
/// and counter.
pub fn reattach(location: &Location) -> Result<AttachMode> {
    let dir = location.dir();
    let attachment = Attachment::open(location)?;
    let mut globals = attachment.globals()?;
    let mode = AttachMode::from_globals(globals.attach_mode);
    let mut program = SchedClassifier::from_pin(dir.join(PROG_PIN))
        .map_err(|e| runtime(format!("cannot open the pinned program: {e}")))?;
    // The old link (if any) points at a vanished interface: drop it first.
    let _ = fs::remove_file(dir.join(LINK_PIN));
    let mut created = None;
    let (mode, created_clsact) =
        attach_program(&mut program, location, Some(mode), &dir, &mut created)?;
    globals.ifindex = crate::netns::ifindex(&location.dev)?;
    globals.created_clsact = u32::from(created_clsact);
    attachment.set_globals(globals)?;
    Ok(mode)
}

/// Removes the pins of an attachment whose network namespace no longer exists: its
/// interfaces, TCX links, filters and qdiscs went with the namespace.
pub fn forget(location: &Location) -> Result<()> {
    let dir = location.dir();
    fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    remove_empty_parents(&dir);
    Ok(())
}

/// Detaches the program at `location` and removes every pin it owns.
pub fn detach(location: &Location) -> Result<()> {
    let dir = location.dir();
    let globals = Attachment::open(location)?.globals()?;
    match AttachMode::from_globals(globals.attach_mode) {
        // Unpinning the link drops its last reference: the kernel detaches the program.
        AttachMode::Tcx => {
            let _ = fs::remove_file(dir.join(LINK_PIN));
        }
        AttachMode::Clsact => {
            let mut remove_qdisc = globals.created_clsact != 0;
            // Both directions share one clsact qdisc: keep it while the other uses it.
            let other = Location {
                direction: match location.direction {
                    Direction::Egress => Direction::Ingress,
                    Direction::Ingress => Direction::Egress,
                },
                ..location.clone()
            };
            if remove_qdisc && other.dir().exists() {
                if let Ok(other_attachment) = Attachment::open(&other) {
                    let mut other_globals = other_attachment.globals()?;
                    if other_globals.attach_mode == ATTACH_MODE_CLSACT {
                        other_globals.created_clsact = 1;
                        other_attachment.set_globals(other_globals)?;
                        remove_qdisc = false;
                    }
                }
            }
            detach_clsact_filter(&location.dev, location.direction, remove_qdisc);
        }
    }
    if location.direction == Direction::Egress {
        crate::qdisc::remove_htb_root(&location.dev);
    }
    fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    remove_empty_parents(&dir);
    Ok(())
}

/// What `status` reports about one attachment.
pub struct AttachmentStatus {
    pub mode: AttachMode,
    pub program_id: u32,
    /// The program is still hooked to an interface with the index it was attached to.
    pub live: bool,
    pub flow_table_size: u32,
}

/// CPUs a per-CPU map holds values for (the possible CPUs).
pub fn possible_cpus() -> u64 {
    aya::util::nr_cpus().map(|n| n as u64).unwrap_or(1).max(1)
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
    /// Opens the attachment at `location`, or fails with a hint to attach first.
    pub fn open(location: &Location) -> Result<Self> {
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

    /// One pinned map of the attachment, as the typed aya map `M`.
    fn map<M: TryFrom<Map, Error = aya::maps::MapError>>(&self, name: &str) -> Result<M> {
        Ok(M::try_from(open_map(&self.dir, name)?)?)
    }

    pub fn globals_map(&self) -> Result<Array<MapData, Globals>> {
        self.map(map_names::GLOBALS)
    }

    pub fn globals(&self) -> Result<Globals> {
        Ok(self.globals_map()?.get(&0, 0)?)
    }

    pub fn set_globals(&self, globals: Globals) -> Result<()> {
        Ok(self.globals_map()?.set(0, globals, 0)?)
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

    pub fn credit(&self) -> Result<PerCpuArray<MapData, Credit>> {
        self.map(map_names::CREDIT)
    }

    /// Tokens a class-scoped bucket holds now: the shared bucket plus the CPUs' credit.
    pub fn bucket_level(
        &self,
        class_id: u32,
        rate_bits_per_sec: u64,
        burst_bytes: u64,
    ) -> Result<u64> {
        let config = self.classes()?.get(&class_id, 0)?;
        let chunk = u64::from(config.credit_chunk);
        let cpus = possible_cpus();
        let shared = shaper_common::bucket::shared_burst(burst_bytes, cpus, chunk);
        let tat = self.class_buckets()?.get(&class_id, 0)?.tat;
        let now = monotonic_ns();
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

    pub fn class_index(&self) -> Result<BpfHashMap<MapData, [u8; CLASS_NAME_LEN], u32>> {
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

    /// Every class in use: (class id, description), in creation order.
    pub fn class_list(&self) -> Result<Vec<(u32, ClassMeta)>> {
        let meta = self.meta()?;
        let mut list = Vec::new();
        for (id, entry) in meta.iter().enumerate() {
            let entry = entry?;
            if entry.in_use != 0 {
                list.push((id as u32, entry));
            }
        }
        list.sort_by_key(|(_, m)| m.seq);
        Ok(list)
    }

    /// Per-class counters summed over CPUs.
    pub fn class_stats(&self, class_id: u32) -> Result<ClassStats> {
        let per_cpu = self.stats()?.get(&class_id, 0)?;
        let mut sum = ClassStats::default();
        for cpu in per_cpu.iter() {
            sum.accumulate(cpu);
        }
        Ok(sum)
    }

    pub fn status(&self) -> Result<AttachmentStatus> {
        let globals = self.globals()?;
        let mode = AttachMode::from_globals(globals.attach_mode);
        let program = aya::programs::ProgramInfo::from_pin(self.dir.join(PROG_PIN))?;
        let program_id = program.id();
        let flow_table_size = self.flow_table_size()?;
        let live = crate::netns::ifindex(&self.location.dev).ok() == Some(globals.ifindex)
            && match mode {
                AttachMode::Tcx => {
                    SchedClassifier::query_tcx(&self.location.dev, self.location.direction.tc())
                        .map(|(_, programs)| programs.iter().any(|p| p.id() == program_id))
                        .unwrap_or(false)
                }
                AttachMode::Clsact => true,
            };
        Ok(AttachmentStatus {
            mode,
            program_id,
            live,
            flow_table_size,
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

/// A class name as stored (NUL-padded); fails when too long.
pub fn encode_name(name: &str) -> Result<[u8; CLASS_NAME_LEN]> {
    let valid = !name.is_empty()
        && name.len() < CLASS_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
    if !valid {
        return Err(usage(format!(
            "bad class name '{name}': use 1-{} characters of letters, digits, '-', '_', '.', ':'",
            CLASS_NAME_LEN - 1
        )));
    }
    let mut out = [0u8; CLASS_NAME_LEN];
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(out)
}

pub fn decode_name(raw: &[u8; CLASS_NAME_LEN]) -> String {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).to_string()
}
