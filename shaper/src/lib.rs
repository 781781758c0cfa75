//! shaper's core library: the datapath handle (`state`: pins, loader, attachments, map
//! access; `netns`, `qdisc`, `caps`), the class model (`classes`, `rules`, `actions`,
//! `units`) with its one validator (`class_input`), the desired-state engine (`config`),
//! the daemon that keeps it applied and coordinates global classes (`daemon`, `global`),
//! metrics and the CNI plugin's logic. It never parses a command line: the `shaper` and
//! `shaper-cni` binaries (crate shaper-cli) are thin layers over it.

pub mod actions;
pub mod caps;
pub mod class_input;
pub mod classes;
pub mod cni;
pub mod config;
pub mod daemon;
pub mod error;
pub mod global;
pub mod metrics;
pub mod netns;
pub mod qdisc;
pub mod report;
pub mod rules;
pub mod state;
pub mod units;

/// The eBPF object built by build.rs from shaper-ebpf.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shaper"));
