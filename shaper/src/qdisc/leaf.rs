//! A shape class's bulk leaf: one bounded FIFO, or a queue per flow (fq_codel) where the
//! kernel has one, and the counters tc keeps for it.

use super::{tc, HtbClass, BULK_BASE, HTB_MAJOR};
use anyhow::{Context as _, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

/// The bulk leaf's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BulkQueue {
    /// One FIFO: `--fair none`, and every fair class on a kernel without fq_codel.
    Fifo,
    /// A queue per flow served in turn (fq_codel's deficit round robin), so one flow's
    /// backlog never stands in front of another's packets (a FIFO made a Cubic flow beside
    /// a UDP flood wait behind the flood's admitted share), each judged by a CoDel of its
    /// own at the class's settings (`fair::FAIR_FLOW_QUEUES`: the program's CoDel then
    /// judges no flow of the class's own queue; its fair caps still hold a flood).
    PerFlow(FlowQueues),
}

/// A per-flow leaf's CoDel: the class's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FlowQueues {
    pub target_ns: u64,
    pub interval_ns: u64,
    pub ecn: bool,
}

/// Whether the kernel lacks fq_codel (learnt once: tc's error on the first per-flow leaf).
static NO_FLOW_QUEUES: AtomicBool = AtomicBool::new(false);
/// Whether a per-flow leaf was made (or changed) by this process.
static FLOW_QUEUES_MADE: AtomicBool = AtomicBool::new(false);

/// `shaper_common::fair::FAIR_FLOW_QUEUES` for the config of a class of fair mode `fair`
/// whose HTB class was just made or changed (`set_class`): set when its bulk leaf is a
/// queue per flow, so the program leaves each flow's CoDel to the leaf.
pub(crate) fn flow_queues_flag(fair: u32) -> u32 {
    // Made once means the kernel has fq_codel: every fair class's leaf is one.
    if fair != shaper_common::fair::FAIR_NONE && FLOW_QUEUES_MADE.load(Ordering::Relaxed) {
        shaper_common::fair::FAIR_FLOW_QUEUES
    } else {
        0
    }
}

/// Makes (or changes) `leaf`'s qdisc. An existing one is changed in place: replacing it
/// would drop its queue, a burst of losses at every rate change (a global class's share
/// moves every few seconds); one of another kind is replaced.
pub(super) fn set_leaf_qdisc(
    dev: &str,
    leaf: &str,
    kind_and_options: &[&str],
    create: bool,
) -> Result<()> {
    let qdisc = |verb: &str| {
        let mut args = vec!["qdisc", verb, "dev", dev, "parent", leaf];
        args.extend_from_slice(kind_and_options);
        tc(&args)
    };
    if create || qdisc("change").is_err() {
        qdisc("replace")?;
    }
    Ok(())
}

/// The bulk leaf as a queue per flow (`BulkQueue::PerFlow`); false where the kernel has
/// no fq_codel (the leaf is then a FIFO, and the program alone keeps the flows apart).
pub(super) fn set_flow_queues(
    dev: &str,
    leaf: &str,
    class: &HtbClass,
    queues: FlowQueues,
    create: bool,
) -> Result<bool> {
    if NO_FLOW_QUEUES.load(Ordering::Relaxed) {
        return Ok(false);
    }
    let options = flow_queue_options(class.leaf_limit_bytes, queues);
    let mut args = vec!["fq_codel"];
    args.extend(options.iter().map(String::as_str));
    match set_leaf_qdisc(dev, leaf, &args, create) {
        Ok(()) => {
            FLOW_QUEUES_MADE.store(true, Ordering::Relaxed);
            Ok(true)
        }
        Err(error) if unknown_kind(&error.to_string()) => {
            NO_FLOW_QUEUES.store(true, Ordering::Relaxed);
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// fq_codel's options for a per-flow bulk leaf: its CoDel at the class's target, interval
/// and ECN; its memory bounded to four times the bytes the class sends in its hard cap
/// (an skb's truesize runs up to twice its length), its packet limit fq_codel's default.
fn flow_queue_options(leaf_limit_bytes: u64, queues: FlowQueues) -> Vec<String> {
    let FlowQueues {
        target_ns,
        interval_ns,
        ecn,
    } = queues;
    let micros = |ns: u64| format!("{}us", ns.div_ceil(1000).max(1));
    vec![
        "limit".into(),
        "10240".into(),
        "memory_limit".into(),
        leaf_limit_bytes
            .saturating_mul(4)
            .min(u32::MAX as u64)
            .to_string(),
        "target".into(),
        micros(target_ns),
        "interval".into(),
        micros(interval_ns),
        if ecn { "ecn" } else { "noecn" }.into(),
    ]
}

/// What a shape class's bulk leaf did itself: a queue per flow (fq_codel) or one FIFO,
/// and the packets it dropped and CE-marked (tc's counters; no bytes: fq_codel keeps none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeafCounts {
    pub per_flow: bool,
    pub dropped_packets: u64,
    pub marked_packets: u64,
}

/// The bulk leaves' counters on `dev`, by leaf handle (one `tc -s -j` for the device).
pub(crate) fn bulk_leaf_counts(dev: &str) -> Result<BTreeMap<u32, LeafCounts>> {
    let text = tc(&["-s", "-j", "qdisc", "show", "dev", dev])?;
    let json: Value = serde_json::from_str(text.trim())
        .with_context(|| format!("cannot read the qdiscs of {dev}: tc -s -j printed no JSON"))?;
    Ok(leaf_counts_of(&json))
}

fn leaf_counts_of(qdiscs: &Value) -> BTreeMap<u32, LeafCounts> {
    let handle = |text: &str| {
        let (major, minor) = text.split_once(':')?;
        let (major, minor) = (
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        );
        (major == HTB_MAJOR && minor > BULK_BASE).then_some(major << 16 | minor)
    };
    let count = |q: &Value, name: &str| q[name].as_u64().unwrap_or(0);
    qdiscs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| {
            let leaf = handle(q["parent"].as_str()?)?;
            let counts = LeafCounts {
                per_flow: q["kind"] == "fq_codel",
                dropped_packets: count(q, "drops"),
                marked_packets: count(q, "ecn_mark"),
            };
            Some((leaf, counts))
        })
        .collect()
}

/// Whether tc's error says the kernel has no such qdisc kind (extack's text, or the
/// ENOENT an older tc prints).
fn unknown_kind(error: &str) -> bool {
    error.contains("kind is unknown") || error.contains("No such file or directory")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qdisc::bulk_leaf;

    #[test]
    fn a_per_flow_leaf_holds_its_codel_back_to_the_cap_and_bounds_its_memory() {
        let queue = |target_ns, ecn| FlowQueues {
            target_ns,
            interval_ns: 100_000_000,
            ecn,
        };
        let options = flow_queue_options(125_000, queue(5_000_000, false));
        assert_eq!(
            options.join(" "),
            "limit 10240 memory_limit 500000 target 5000us interval 100000us noecn"
        );
        // A target of a fraction of a microsecond still names one.
        let options = flow_queue_options(6_000, queue(400, true));
        assert_eq!((options[5].as_str(), options[8].as_str()), ("1us", "ecn"));
    }

    #[test]
    fn bulk_leaves_counters_are_read_from_tc_by_handle() {
        // As `tc -s -j qdisc show` prints them (iproute2 6.x), trimmed.
        let json = serde_json::json!([
            {"kind": "htb", "handle": "5348:", "root": true, "drops": 9},
            {"kind": "bfifo", "handle": "8002:", "parent": "5348:4001", "drops": 7},
            {"kind": "fq_codel", "handle": "8003:", "parent": "5348:8001", "drops": 12,
             "ecn_mark": 3, "new_flow_count": 4},
            {"kind": "bfifo", "handle": "8004:", "parent": "5348:8002", "drops": 1},
        ]);
        let counts = leaf_counts_of(&json);
        assert_eq!(counts.len(), 2, "{counts:?}");
        assert_eq!(
            counts[&bulk_leaf(0)],
            LeafCounts {
                per_flow: true,
                dropped_packets: 12,
                marked_packets: 3
            }
        );
        assert_eq!(
            counts[&bulk_leaf(1)],
            LeafCounts {
                per_flow: false,
                dropped_packets: 1,
                marked_packets: 0
            }
        );
    }

    #[test]
    fn only_a_missing_kind_makes_the_bulk_leaf_a_fifo() {
        assert!(unknown_kind(
            "tc qdisc replace dev d0 parent 5348:8001 fq_codel failed: Error: Specified qdisc kind is unknown."
        ));
        assert!(!unknown_kind(
            "tc qdisc change failed: Error: Qdisc not found. To create specify NLM_F_CREATE flag."
        ));
    }
}
