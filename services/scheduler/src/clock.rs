//! The scheduler's wall clock: the instants of its lifecycle decisions, timers, rate
//! buckets and events. Slot expiry is never judged by it (docs/execution.md,
//! "Slots"): that uses the database's clock. Builds with the `faults` feature read
//! `FENCELINE_SCHEDULER_CLOCK_SKEW_MS` (signed milliseconds added to every reading),
//! so a test can run a scheduler whose host clock is wrong.

use fenceline_events::Timestamp;

/// Now, by this host's wall clock (skewed in test builds when asked to).
pub(crate) fn now() -> Timestamp {
    Timestamp(Timestamp::now().0 + skew_us())
}

#[cfg(feature = "faults")]
fn skew_us() -> i64 {
    static SKEW: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *SKEW.get_or_init(|| {
        std::env::var("FENCELINE_SCHEDULER_CLOCK_SKEW_MS").ok().and_then(|v| v.parse::<i64>().ok()).unwrap_or(0) * 1_000
    })
}

#[cfg(not(feature = "faults"))]
fn skew_us() -> i64 {
    0
}
