//! A shape class's leaves (made in `htb`): each one bounded FIFO (the program alone keeps the flows
//! apart: DESIGN.md, flow isolation), and the counters tc keeps for them. Shaper 0.3
//! made a fair class's bulk leaf an fq_codel where the kernel had one; such a leaf is
//! still read (and the program still leaves its flows' CoDel to it) until a `class
//! change` or an `apply` makes it a FIFO.

use super::htb::{BULK_BASE, HTB_MAJOR};
use super::tc;
use anyhow::{Context as _, Result};
use serde_json::Value;
use std::collections::BTreeMap;

/// What a shape class's bulk leaf did itself: one FIFO, or a queue per flow (an fq_codel
/// shaper 0.3 made), and the packets it dropped and CE-marked (tc's counters; no bytes:
/// fq_codel keeps none).
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

#[cfg(test)]
mod tests {
    use super::super::htb::bulk_leaf;
    use super::*;

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
}
