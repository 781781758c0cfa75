//! Types and arithmetic shared by the eBPF program and userspace.
//!
//! Everything here is `no_std` and allocation-free so the very code that runs in the
//! kernel is unit- and property-tested on the host.
#![no_std]

pub mod bucket;
pub mod codel;
pub mod fair;
pub mod hierarchy;
pub mod layout;
pub mod meter;

pub use bucket::{conform, ByteCost};
pub use layout::*;
