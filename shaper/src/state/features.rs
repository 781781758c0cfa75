//! What the kernel must have for the programs to load, refused in one line before
//! anything is made.

use crate::error::runtime;
use anyhow::Result;

/// The oldest kernel the programs load on, and the newest helper they call: a shape
/// class sets the packet's delivery time with bpf_skb_set_tstamp (5.18), which came after
/// everything else they need (bounded loops 5.3, the log's ring buffer 5.8, atomic
/// compare-and-exchange 5.12).
pub const MINIMUM_KERNEL: &str = "5.18";

/// Refuses, in one line, a kernel whose verifier lacks what the programs use, before
/// anything is made. Probed (a two-instruction program calling the helper), not read from
/// the version, so a vendor kernel with the helper backported passes; a probe that
/// cannot run leaves the verdict to the real load.
pub fn require_kernel_features() -> Result<()> {
    let supported = aya::sys::is_helper_supported(
        aya::programs::ProgramType::SchedClassifier,
        aya::sys::BpfHelper::BPF_FUNC_skb_set_tstamp,
    );
    if matches!(supported, Ok(false)) {
        return Err(runtime(missing_kernel_feature(
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim(),
        )));
    }
    Ok(())
}

/// What [`require_kernel_features`] says on a kernel without bpf_skb_set_tstamp.
pub fn missing_kernel_feature(release: &str) -> String {
    format!(
        "this kernel ({release}) lacks the BPF helper bpf_skb_set_tstamp: shaper needs Linux \
         {MINIMUM_KERNEL} or later"
    )
}
