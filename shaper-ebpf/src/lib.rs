//! Empty on purpose: the eBPF program is the `shaper` binary target (src/main.rs),
//! built for bpfel-unknown-none by shaper-cli's build script.
#![no_std]
