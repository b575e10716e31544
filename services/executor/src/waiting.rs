//! What the tests of the writers wait for: a statement blocked by a lock a test
//! holds, and a condition that comes true within seconds.

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

/// Whether a statement waits for a lock the backend `holder` holds.
pub(crate) async fn blocked_by(pool: &PgPool, holder: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))")
        .bind(holder)
        .fetch_one(pool)
        .await
        .expect("read the activity")
}

/// Waits until `done`, failing the test after ten seconds.
pub(crate) async fn until<F: std::future::Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while !done().await {
        assert!(Instant::now() < give_up, "gave up waiting");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
