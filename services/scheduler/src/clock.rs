//! The scheduler's wall clock: the instants of its lifecycle decisions, timers, rate
//! buckets and events. Slot expiry is never judged by it (docs/execution.md,
//! "Slots"): that uses the database's clock. Builds with the `faults` feature read
//! `FENCELINE_SCHEDULER_CLOCK_SKEW_MS` (signed milliseconds added to every reading),
//! so a test can run a scheduler whose host clock is wrong.

use fenceline_events::Timestamp;

/// Now, by this host's wall clock (skewed in test builds when asked to).
pub(crate) fn now() -> Timestamp {
    static SKEW_US: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    Timestamp(
        Timestamp::now().0
            + *SKEW_US.get_or_init(|| fenceline_bus::faults::clock_skew_us("FENCELINE_SCHEDULER_CLOCK_SKEW_MS")),
    )
}
