//! The scheduler's clock: the database's, read through this host's. Deadlines,
//! `not_before`, backoff timers and rate buckets are judged by it, so that
//! scheduler instances on hosts whose clocks disagree by minutes decide alike: the
//! offset between this host's wall clock and the database's `clock_timestamp()` is
//! measured at start and every second after. Builds with the `faults` feature read
//! `FENCELINE_SCHEDULER_CLOCK_SKEW_MS` (signed milliseconds added to every reading
//! of the host's clock), so a test can run a scheduler whose host clock is wrong.

use std::sync::atomic::{AtomicI64, Ordering};

use fenceline_events::Timestamp;

/// The database's clock minus this host's, in microseconds, as last measured.
static OFFSET_US: AtomicI64 = AtomicI64::new(0);

/// This host's wall clock (skewed in test builds when asked to).
fn host_now_us() -> i64 {
    static SKEW_US: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    Timestamp::now().0
        + *SKEW_US.get_or_init(|| fenceline_bus::faults::clock_skew_us("FENCELINE_SCHEDULER_CLOCK_SKEW_MS"))
}

/// Now, by the database's clock as last measured.
pub(crate) fn now() -> Timestamp {
    Timestamp(host_now_us() + OFFSET_US.load(Ordering::Relaxed))
}

/// Measures the offset to the database's clock (half the round trip is the error).
pub(crate) async fn anchor(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
    let before = host_now_us();
    let database: i64 = sqlx::query_scalar("SELECT now_us()").fetch_one(pool).await?;
    let after = host_now_us();
    OFFSET_US.store(database - before / 2 - after / 2, Ordering::Relaxed);
    Ok(())
}
