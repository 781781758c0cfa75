//! Whether this kernel's ifb takes what a TC program redirects to it. Before Linux 6.4
//! (`bpf: Set skb redirect and from_ingress info in __bpf_tx_skb`) `bpf_redirect` left a
//! packet unmarked as redirected, and an ifb drops every such packet: an ingress shape
//! class's traffic, or everything arriving on an interface that splits aggregates, would
//! vanish (Debian 12's 6.1: a router splitting its ingress forwarded nothing).

use crate::error::runtime;
use anyhow::Result;

/// The first release whose ifb takes packets a BPF program redirects.
pub const IFB_REDIRECT_KERNEL: (u32, u32) = (6, 4);

/// Refuses, in one line and before anything is made, what would queue or split through
/// an ifb (`what`: "an ingress shape class", "--split-aggregates") on a kernel older than
/// [`IFB_REDIRECT_KERNEL`]. A release that does not read as `MAJOR.MINOR…` is let through.
pub(crate) fn require_ifb_redirect(what: &str) -> Result<()> {
    match ifb_redirect_refusal(&kernel_release(), what) {
        Some(message) => Err(runtime(message)),
        None => Ok(()),
    }
}

/// Whether this kernel's ifb takes redirected packets (for callers that skip, not fail).
pub fn ifb_redirect_works() -> bool {
    !predates_ifb_redirect(&kernel_release())
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Whether `release` reads as older than [`IFB_REDIRECT_KERNEL`] (unreadable: no).
fn predates_ifb_redirect(release: &str) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) < IFB_REDIRECT_KERNEL,
        _ => false,
    }
}

/// The refusal for `release`, if it is older than [`IFB_REDIRECT_KERNEL`].
fn ifb_redirect_refusal(release: &str, what: &str) -> Option<String> {
    let (major, minor) = IFB_REDIRECT_KERNEL;
    predates_ifb_redirect(release).then(|| {
        format!(
            "this kernel ({release}) drops what a BPF program redirects to an ifb: {what} \
             queues through one and needs Linux {major}.{minor} or later"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_before_6_4_are_refused_by_release() {
        let refusal = ifb_redirect_refusal("6.1.0-57-cloud-amd64", "--split-aggregates");
        assert_eq!(
            refusal.as_deref(),
            Some(
                "this kernel (6.1.0-57-cloud-amd64) drops what a BPF program redirects to an \
                 ifb: --split-aggregates queues through one and needs Linux 6.4 or later"
            )
        );
        assert!(ifb_redirect_refusal("5.18.0", "x").is_some());
        assert!(ifb_redirect_refusal("6.3.13", "x").is_some());
        for works in ["6.4.0", "6.12.118+deb12-cloud-amd64", "6.18.2", "7.0"] {
            assert_eq!(ifb_redirect_refusal(works, "x"), None, "{works}");
        }
        // Unreadable: left to the kernel.
        assert_eq!(ifb_redirect_refusal("", "x"), None);
        assert_eq!(ifb_redirect_refusal("custom", "x"), None);
    }
}
