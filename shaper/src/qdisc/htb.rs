//! A shape class's HTB classes: an inner class at the class's rate and burst (and
//! ceiling, under its parent's inner class in a tree), and under it the sparse leaf
//! (priority 0) and the bulk leaf (priority 1), each borrowing up to the class's ceiling
//! and each with a bounded bfifo. Child classes' inner classes hang beside the two
//! leaves, as in any HTB tree.

use super::netlink::{self, HtbClassOptions, Request};
use crate::netns::ifindex;
use anyhow::Result;
use shaper_common::codel::SPARSE_RATE_DIVISOR;

/// "SH": the major handle of shaper's HTB root.
pub(crate) const HTB_MAJOR: u32 = 0x5348;
/// Minor-number blocks of shaper's HTB tree: shape class `id` is the inner class
/// `id + 1` with two leaves, sparse `SPARSE_BASE + id + 1` and bulk `BULK_BASE + id + 1`
/// (16 384 classes fit each block of the 16-bit minor space).
const SPARSE_BASE: u32 = 0x4000;
pub(super) const BULK_BASE: u32 = 0x8000;

/// The inner HTB class of shape class `class_id`: it holds the class's rate and burst.
pub(crate) fn class_handle(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (class_id + 1)
}

/// The leaf bulk flows queue in (`action_arg`).
pub(crate) fn bulk_leaf(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (BULK_BASE + class_id + 1)
}

/// The leaf sparse flows queue in, served first (`sparse_priority`).
pub(crate) fn sparse_leaf(class_id: u32) -> u32 {
    (HTB_MAJOR << 16) | (SPARSE_BASE + class_id + 1)
}

/// What shaper's HTB class for one shape class is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HtbClass {
    /// The parent shape class's id in a tree (its HTB class is this one's parent).
    pub parent: Option<u32>,
    pub rate_bits_per_sec: u64,
    pub burst_bytes: u64,
    /// What the class may borrow up to (htb's ceil and cburst); the rate at the top.
    pub ceil_bits_per_sec: u64,
    pub cburst_bytes: u64,
    /// What the class's own two leaves are guaranteed: its rate less its children's.
    pub own_rate_bits_per_sec: u64,
    /// The leaf bfifo's limit (bytes): never the 1000-packet default.
    pub leaf_limit_bytes: u64,
}

/// Creates (all or nothing) or changes the HTB classes of shape class `class_id`, in one
/// send. A new class's inner class is asked for alone first: a handle someone else holds
/// fails there, before anything is made under their class or theirs is taken back.
pub(crate) fn set_class(dev: &str, class_id: u32, class: &HtbClass, create: bool) -> Result<()> {
    let ifindex = ifindex(dev)?;
    let requests = requests(dev, ifindex, class_id, class, create);
    if !create {
        return netlink::run(&requests);
    }
    netlink::run(&requests[..1])?;
    let made = netlink::run(&requests[1..]);
    if made.is_err() {
        let _ = delete_class(dev, class_id);
    }
    made
}

fn options(class: &HtbClass, rate: u64, prio: u32) -> HtbClassOptions {
    HtbClassOptions {
        rate_bits_per_sec: rate,
        ceil_bits_per_sec: class.ceil_bits_per_sec,
        burst_bytes: class.burst_bytes,
        cburst_bytes: class.cburst_bytes,
        quantum: 1514,
        prio,
    }
}

/// The inner class, then each leaf and its FIFO.
fn requests(
    dev: &str,
    ifindex: u32,
    class_id: u32,
    class: &HtbClass,
    create: bool,
) -> Vec<Request> {
    let parent = class.parent.map_or(HTB_MAJOR << 16, class_handle);
    let inner = class_handle(class_id);
    let own = options(class, class.rate_bits_per_sec, 0);
    let mut requests = vec![Request::htb_class(
        dev,
        ifindex,
        (parent, inner),
        &own,
        create,
    )];
    // Guarantees split 1:15, as the sparse bucket's rate; either borrows the rest.
    let own_rate = class.own_rate_bits_per_sec;
    let sparse_rate = (own_rate / SPARSE_RATE_DIVISOR).max(8);
    let bulk_rate = own_rate.saturating_sub(sparse_rate).max(8);
    for (leaf, rate, prio) in [
        (sparse_leaf(class_id), sparse_rate, 0),
        (bulk_leaf(class_id), bulk_rate, 1),
    ] {
        let options = options(class, rate, prio);
        requests.push(Request::htb_class(
            dev,
            ifindex,
            (inner, leaf),
            &options,
            create,
        ));
        // Bounds the real queue (HTB's default leaf is a txqueuelen-long pfifo). One of
        // the same kind is changed in place, keeping its queue (a global class's share
        // moves every few seconds); one of another kind (an fq_codel leaf shaper 0.3
        // made) is replaced.
        let fifo = netlink::bfifo(class.leaf_limit_bytes);
        requests.push(Request::replace_qdisc(dev, ifindex, (leaf, 0), fifo));
    }
    requests
}

/// Deletes the class's HTB classes, leaves first (HTB refuses to delete a parent). A
/// device that is gone (an ifb someone deleted) took them with it; one made again never
/// had them; a leaf never made (a failed add) is not an error.
pub(crate) fn delete_class(dev: &str, class_id: u32) -> Result<()> {
    delete_classes(dev, &[class_id])
}

/// [`delete_class`] for many classes (children before their parents), as many per send
/// as fit.
pub(crate) fn delete_classes(dev: &str, class_ids: &[u32]) -> Result<()> {
    let Ok(ifindex) = ifindex(dev) else {
        return Ok(());
    };
    let requests: Vec<Request> = class_ids
        .iter()
        .flat_map(|&id| [sparse_leaf(id), bulk_leaf(id), class_handle(id)])
        .map(|classid| Request::delete_class(dev, ifindex, classid))
        .collect();
    netlink::run(&requests)
}

/// Whether `dev` exists and has the class's HTB class (a class the kernel cannot be asked
/// about counts as yes: the caller then tries, and says what failed).
pub(crate) fn has_class(dev: &str, class_id: u32) -> bool {
    ifindex(dev).is_ok_and(|ifindex| {
        let request = Request::get_class(dev, ifindex, class_handle(class_id));
        !matches!(netlink::get(request), Ok(None))
    })
}
