//! What the property tests share.

use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// A runner of `cases` deterministic cases, so a failure (and every count a test
/// reports) reproduces.
pub fn deterministic_runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    )
}
