//! Global classes' shares around the daemon's start: the classes a file names that are
//! in place, and their shares in force held while the daemon first applies its file.

use crate::{
    config::Desired,
    global::{self, HostClass},
    state::Location,
};

/// Every global class of the file `desired` that is in place now ([`global::host_classes`]).
pub(crate) fn configured_classes(desired: &Desired) -> anyhow::Result<Vec<HostClass>> {
    global::host_classes(desired.interfaces.iter().flat_map(|interface| {
        interface.classes.iter().map(|(direction, spec)| {
            let location = Location {
                netns: interface.netns.clone(),
                dev: interface.dev.clone(),
                direction: *direction,
            };
            (location, spec)
        })
    }))
}

/// Runs `work` (the daemon's first application of its file, with an upgrade that loads
/// and verifies the program: a second or more) while another thread renews every global
/// class's share in force as it is, every half interval: a daemon restarted on its host
/// keeps the share its predecessor held until its own reports take over, where the
/// share would otherwise expire to the floor three intervals after the old daemon's last
/// renewal. A share the packet path already dropped to the floor is left to the reports.
pub fn holding_shares<T>(desired: &Desired, work: impl FnOnce() -> T) -> T {
    let Some(interval) = desired.coordination.as_ref().map(|c| c.interval) else {
        return work();
    };
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let keeper = scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for class in configured_classes(desired).unwrap_or_default() {
                    let update = global::update_for(
                        class.share_bits_per_sec,
                        class.hosts,
                        class.answered_unix_ms,
                        interval,
                    );
                    let _ = global::renew(&class, update);
                }
                std::thread::park_timeout(interval / 2);
            }
        });
        let result = work();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        keeper.thread().unpark();
        result
    })
}
