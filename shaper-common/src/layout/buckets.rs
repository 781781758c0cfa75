//! Bucket words, their keys in the flow table, prepaid credit and the counters.

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
