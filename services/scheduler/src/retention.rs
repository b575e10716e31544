//! The scheduler's retention (docs/decisions.md, entry 13): tasks that finished long ago go, with every row they left.

use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;
use fenceline_events::topics;
use sqlx::PgPool;

/// Deletes the scheduler's rows of tasks in a final state (`succeeded`, `failed`,
/// `cancelled`) whose last change is older than `retention` (`finished_at`, that
/// change's time, set only while the task is final: docs/decisions.md, entry 47): the task, its slots
/// in both tables (a final task holds none, but a slot whose release was never
/// heard may remain until it expires) and its early requests, `batch` tasks per transaction so no
/// delete holds locks for long; and in the same transaction a tombstone for the
/// task's key on `fenceline.status`, so that compaction drops its snapshot too
/// (docs/wire.md, "Tombstones on fenceline.status"). Returns how many tasks went.
/// A task waiting for a person (`outcome_unknown`, `needs_human`) or anything open
/// is never purged.
///
/// A task's acceptance is not remembered by its event id: its row is what makes a
/// copy insert nothing (`events::LifecycleEvents::applies_twice_harmlessly`). So a
/// task goes only once it was accepted longer ago than `accepted_remembered` (the
/// bus's dedupe window), however short the retention: a copy sent within the
/// window always finds its row.
pub async fn purge_finished_tasks(
    pool: &PgPool,
    outbox: &OutboxWriter,
    retention: Duration,
    accepted_remembered: Duration,
    batch: i64,
) -> Result<u64, fenceline_bus::Error> {
    let retention_us = i64::try_from(retention.as_micros()).unwrap_or(i64::MAX);
    let remembered_us = i64::try_from(accepted_remembered.as_micros()).unwrap_or(i64::MAX);
    let mut purged = 0;
    loop {
        let mut tx = pool.begin().await?;
        // SKIP LOCKED: a task a consumer or the dispatcher holds is left for the next round.
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT task_id FROM tasks \
             WHERE finished_at < now() - make_interval(secs => $1::double precision / 1e6) \
             AND accepted_at < now() - make_interval(secs => $3::double precision / 1e6) \
             ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(retention_us)
        .bind(batch)
        .bind(remembered_us)
        .fetch_all(&mut *tx)
        .await?;
        for table in ["slots", "other_provider_slots", "early_requests", "tasks"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE task_id = ANY($1)")).bind(&ids).execute(&mut *tx).await?;
        }
        for id in &ids {
            // The key every status of the task was published under.
            let key = TaskId::from_uuid(*id).to_string();
            outbox.append_tombstone(&mut tx, topics::STATUS, key.as_bytes()).await?;
        }
        tx.commit().await?;
        if !ids.is_empty() {
            outbox.committed();
        }
        purged += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(purged);
        }
    }
}

#[cfg(test)]
mod tests;
