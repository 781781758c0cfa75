//! shaper's TC classifier: parse → classify → bucket → act.
//!
//! One object, attached once per interface and direction. The packet path:
//! 1. parse: Ethernet (up to two VLAN tags), IPv4 (options) or IPv6 (bounded walk over
//!    extension headers), TCP/UDP ports. Non-IP frames pass untouched.
//! 2. classify: tuple-space search — one exact-match hash lookup per distinct rule shape
//!    (`SHAPES`), never a scan over classes; the lowest rank wins.
//! 3. bucket: GCRA (one u64 per bucket, updated by compare-and-swap) from shaper-common,
//!    per class (`CLASS_BUCKETS`) or per flow/src/dst (`KEYED_BUCKETS`, LRU, lazily created).
//! 4. act: within the rate → pass; over it → the class's action (drop for now).
//!
//! On the host this crate compiles to an empty program so workspace tooling works.
#![cfg_attr(target_arch = "bpf", no_std, no_main, feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
mod program;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
