//! The network-namespace lab the end-to-end tests and the bench run on: client → router →
//! server joined by veth pairs, real traffic, real TC attach.
//!
//! | module | what it holds |
//! | --- | --- |
//! | [`topology`] | the namespaces ([`Netns`], [`Lab`]), their addresses and interfaces |
//! | [`delay`] | the delay line of a lab with a base RTT ([`Lab::with_delay`], [`DelayLine`]) |
//! | [`traffic`] | UDP and TCP runs through the lab ([`Udp`], [`UdpResult`], [`Tcp`], [`TcpResult`]) |
//! | [`fairness`] | flows sharing one shape class: cells run at once, shares, Jain's index ([`fairness::Shares`]) |
//! | [`latency`] | idle RTT, a ping probe beside the traffic, the RTT it adds ([`LatencyProbe`], [`AddedRtt`]) |
//! | [`iperf`] | how iperf3 is run (both peers bounded) and read |
//! | [`capture`] | packet captures ([`Capture`]) |
//! | [`cli`] | shaper commands: [`Netns::shaper`], [`Netns::class_add`], [`Netns::stats_row`] |
//! | [`assertions`] | rates within a tolerance, TCP goodput bounds, programs unloaded |
//! | [`process`] | bounded waits on every child ([`wait_bounded`], [`output_bounded`]), [`shaper_bin`], [`delay_line_bin`] |
//! | [`state_lock`] | holding shaper's state lock from outside ([`StateLockHolder`]) |
//! | [`cni`] | what CNI plugin runs leave behind ([`CniLeftovers`]) |
//! | [`global`] | hosts with their own daemons sharing a global class through Redis ([`GlobalLab`]) |
//! | [`redis`] | a real redis-server on a loopback port, stopped on drop ([`RedisServer`]) |
//! | [`cleanup`] | removing a lab on drop, and what crashed runs left ([`Lab::new`] sweeps it) |
//!
//! Everything a test needs is re-exported here: `use shaper_tests::{Lab, Udp, …}`.

pub mod assertions;
pub mod capture;
pub mod cleanup;
pub mod cli;
pub mod cni;
pub mod daemon;
pub mod delay;
pub mod fairness;
pub mod global;
pub mod iperf;
pub mod latency;
pub mod monitoring;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod redis_cluster;
pub mod sentinel;
pub mod state_lock;
pub mod topology;
pub mod traffic;
pub mod web;

pub use assertions::{
    assert_goodput_fraction, assert_programs_unloaded, assert_within, loaded_program_ids,
    status_program_ids,
};
pub use capture::Capture;
pub use cli::{
    counter, man_page_names, shape_to_server, shaper, stderr, stdout, CLASS_COMMANDS, COMMANDS,
};
pub use cni::{
    cni_record_path, CniLeftovers, CNI_IPAM_PREFIX, CNI_RECORD_DIR, CNI_TEST_CONTAINER_PREFIXES,
};
pub use delay::{
    describe_counters, CpuTime, DelayLine, DelayLineLate, LatenessReading, Timekeeping,
    DELAY_LINE_TRIES, DELAY_TO_ROUTER, DELAY_TO_SERVER, LATENESS_P99_LIMIT_US,
};
pub use global::{median, GlobalClass, GlobalLab};
pub use iperf::{parse_iperf_rate, IPERF_GRACE};
pub use latency::{
    idle_rtt_ms, parse_ping_reply, percentile, AddedRtt, LatencyProbe, PingReply, ProbeSamples,
    PROBE_LIMIT,
};
pub use process::{
    delay_line_bin, dies_with_parent, output_bounded, shaper_bin, wait_bounded, wait_listening,
    wait_with_output_bounded, BoundedCommand, Transport, COMMAND_LIMIT,
};
pub use redis::{RedisServer, Role};
pub use state_lock::{StateLockHolder, STATE_LOCK_FILE};
pub use topology::{
    Lab, Netns, CLIENT_DEV, CLIENT_V4, CLIENT_V6, ROUTER_TO_CLIENT, ROUTER_TO_SERVER, SERVER_DEV,
    SERVER_V4, SERVER_V6,
};
pub use traffic::{
    udp_port_churn, Tcp, TcpResult, Udp, UdpResult, UDP_V4_OVERHEAD, UDP_V6_OVERHEAD,
};
