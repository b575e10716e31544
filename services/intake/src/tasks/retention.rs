//! What intake keeps and for how long: tasks that never reached the scheduler,
//! finished tasks past their retention, expired idempotency keys.

use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;

/// A task intake accepted that no status of the scheduler's has ever been
/// projected for: its `TaskAccepted` is stuck in the outbox or was refused on the
/// way (dead-lettered), so nothing will run it and no other audit sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Unscheduled {
    pub task_id: uuid::Uuid,
    pub tenant: String,
    #[serde(with = "time::serde::rfc3339")]
    pub accepted_at: OffsetDateTime,
}

/// The tasks accepted longer than `after` ago that never reached the scheduler
/// (no row in `task_view`), oldest first, at most `limit`; and how many there are.
pub async fn unscheduled(
    pool: &PgPool,
    after: std::time::Duration,
    limit: i64,
) -> Result<(Vec<Unscheduled>, i64), sqlx::Error> {
    let cutoff = OffsetDateTime::now_utc() - after;
    let found: Vec<Unscheduled> = sqlx::query_as(
        "SELECT t.task_id, t.tenant, t.accepted_at FROM tasks t \
         WHERE t.accepted_at < $1 AND NOT EXISTS (SELECT 1 FROM task_view v WHERE v.task_id = t.task_id) \
         ORDER BY t.accepted_at LIMIT $2",
    )
    .bind(cutoff)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let count: i64 = if (found.len() as i64) < limit {
        found.len() as i64
    } else {
        sqlx::query_scalar(
            "SELECT count(*) FROM tasks t \
             WHERE t.accepted_at < $1 AND NOT EXISTS (SELECT 1 FROM task_view v WHERE v.task_id = t.task_id)",
        )
        .bind(cutoff)
        .fetch_one(pool)
        .await?
    };
    Ok((found, count))
}

/// Deletes every row of tasks that finished (by their latest status) longer than
/// `retention` ago (`task_view.finished_at`, the time of the snapshot that made the
/// task final, set only while it is: docs/decisions.md, entry 47), `batch` tasks per
/// transaction so no delete holds locks for long; returns how many tasks went. Idempotency records have their own, shorter
/// retention.
pub async fn purge_finished_tasks(
    pool: &PgPool,
    retention: std::time::Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let cutoff = OffsetDateTime::now_utc() - retention;
    let mut purged = 0;
    loop {
        let mut tx = pool.begin().await?;
        // SKIP LOCKED: a task whose view a projection is writing is left for the
        // next round, as the scheduler's purge leaves a task a consumer holds.
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT task_id FROM task_view WHERE finished_at < $1 ORDER BY finished_at LIMIT $2 \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(cutoff)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        // Children first: actions reference their task.
        for table in [
            "decisions",
            "task_steps",
            "signals",
            "cancellations",
            "resolutions",
            "task_cases",
            "task_attempts",
            "task_timeline",
            "task_changes",
            "tasks",
            "task_view",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE task_id = ANY($1)")).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        purged += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(purged);
        }
    }
}

/// Deletes idempotency records older than the retention; returns how many.
pub async fn purge_idempotency_keys(pool: &PgPool, retention_hours: u32) -> Result<u64, sqlx::Error> {
    let result = sqlx::query("DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(hours => $1)")
        .bind(retention_hours as i32)
        .execute(pool)
        .await?;
    Ok(result.rows_affected())
}

#[cfg(test)]
mod tests;
