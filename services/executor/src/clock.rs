//! The executor's wall clock, for the instants it writes into events. Leases and
//! deadlines are never judged by it (docs/execution.md, "Executor"): those use the
//! database's clock and the monotonic clock. Builds with the `faults` feature read
//! `FENCELINE_EXECUTOR_CLOCK_SKEW_MS` (signed milliseconds added to every reading),
//! so a test can run an executor whose host clock is wrong.

use fenceline_events::Timestamp;

/// Now, by this host's wall clock (skewed in test builds when asked to).
pub(crate) fn now() -> Timestamp {
    static SKEW_US: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    Timestamp(
        Timestamp::now().0
            + *SKEW_US.get_or_init(|| fenceline_bus::faults::clock_skew_us("FENCELINE_EXECUTOR_CLOCK_SKEW_MS")),
    )
}
