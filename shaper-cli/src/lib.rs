//! shaper's userspace: one module per command over one loader/pinning layer (`state`).

pub mod actions;
pub mod caps;
pub mod class_input;
pub mod classes;
pub mod cli;
pub mod cni;
pub mod commands;
pub mod config;
pub mod error;
pub mod metrics;
pub mod netns;
pub mod qdisc;
pub mod rules;
pub mod state;
pub mod units;

/// The eBPF object built by build.rs from shaper-ebpf.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shaper"));
