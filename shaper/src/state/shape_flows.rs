//! What a shape class's flow isolation shows: its flows now and its drops by cause.

use super::{monotonic_ns, Attachment};
use anyhow::Result;
use aya::maps::{MapData, PerCpuArray};
use shaper_common::{
    fair::{ShapeStats, SHARE_ONE},
    map_names,
};

impl Attachment {
    /// Shape classes' drops and marks by cause, per CPU.
    pub fn shape_stats(&self) -> Result<PerCpuArray<MapData, ShapeStats>> {
        self.map(map_names::SHAPE_STATS)
    }

    /// A shape class's flows and what its queues dropped and marked, by cause.
    pub fn shape_flows(&self, class_id: u32) -> Result<ShapeFlows> {
        let census = self.codel_flows()?.get(&class_id, 0)?;
        let interval = self.classes()?.get(&class_id, 0)?.codel.interval_ns;
        let mut stats = ShapeStats::default();
        for cpu in self.shape_stats()?.get(&class_id, 0)?.iter() {
            stats.accumulate(cpu);
        }
        // The census moves with packets: one that has seen none for an interval is idle.
        let idle = monotonic_ns() >= census.interval_end.saturating_add(interval);
        let (flows, over_share) = if idle {
            (0, 0)
        } else {
            (
                census.counted.max(census.counting),
                census.over_share_counted.max(census.over_share_counting),
            )
        };
        let share = if idle || census.share == 0 {
            SHARE_ONE
        } else {
            census.share
        };
        Ok(ShapeFlows {
            flows,
            over_share,
            share,
            stats,
        })
    }
}
/// A shape class's flows now (its census) and its drops and marks by cause.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShapeFlows {
    /// Bulk flows in the last CoDel interval (0 when the class has been idle that long).
    pub flows: u64,
    /// Of those, flows over their fair share (flow isolation only).
    pub over_share: u64,
    /// The share multiplier its flows are charged with now (`fair::SHARE_ONE`: 1).
    pub share: u64,
    pub stats: ShapeStats,
}
