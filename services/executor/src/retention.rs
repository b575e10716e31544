//! The executor's retention (docs/decisions.md, entry 13): a projection of each task's status, and the purge of finished tasks' rows.

use std::time::Duration;

use fenceline_bus::gathered::Newest;
use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_domain::ids::TaskId;
use fenceline_events::{Event, Timestamp};
use sqlx::{PgConnection, PgPool};

/// Keeps the final status of each task that reached one, from `fenceline.status`:
/// gathered over a consumer batch (the newest per task) and written with one
/// statement just before the batch commits, instead of one per event.
#[derive(Debug, Default)]
pub struct StatusProjection {
    finals: Newest<TaskId, FinalState>,
}

/// A task's final status as the projection keeps it.
#[derive(Debug)]
struct FinalState {
    task_id: uuid::Uuid,
    state: &'static str,
    version: i64,
    updated_at_us: i64,
}

impl Handler for StatusProjection {
    async fn handle(
        &self,
        _tx: &mut PgConnection,
        _outbox: &OutboxWriter,
        record: &Inbound,
    ) -> Result<(), HandleError> {
        let Event::TaskStatus(s) = &record.envelope.event else {
            return Err(HandleError::Poison(format!(
                "the executor's status projection does not take {}",
                record.envelope.event.event_type()
            )));
        };
        // Only a final state makes a task's rows eligible for the purge, and a final
        // state is never left (the lifecycle's property tests hold it), so the other
        // snapshots (queued, running, each phase: most of them) cost nothing.
        if s.state.is_final() {
            self.finals.keep(s.task_id, s.version, || FinalState {
                task_id: s.task_id.as_uuid(),
                state: s.state.as_str(),
                version: s.version,
                updated_at_us: s.updated_at.0,
            });
        }
        Ok(())
    }

    /// Writes the batch's final states in task order; a stored newer version stays.
    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        let finals = self.finals.take();
        if finals.is_empty() {
            return Ok(());
        }
        let ids: Vec<uuid::Uuid> = finals.iter().map(|f| f.task_id).collect();
        let states: Vec<&str> = finals.iter().map(|f| f.state).collect();
        let versions: Vec<i64> = finals.iter().map(|f| f.version).collect();
        let times: Vec<i64> = finals.iter().map(|f| f.updated_at_us).collect();
        sqlx::query(
            "INSERT INTO task_states (task_id, state, version, updated_at_us) \
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::bigint[], $4::bigint[]) \
             ON CONFLICT (task_id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version, \
             updated_at_us = EXCLUDED.updated_at_us WHERE task_states.version < EXCLUDED.version",
        )
        .bind(ids)
        .bind(states)
        .bind(versions)
        .bind(times)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    fn discard(&self) {
        self.finals.discard();
    }

    /// A snapshot sent again changes nothing: only a newer version writes.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        matches!(event, Event::TaskStatus(_))
    }
}

/// Deletes the executor's rows of tasks whose latest status is final (`succeeded`,
/// `failed`, `cancelled`) and older than `retention`: their executions,
/// checkpoints, call sequences and status, `batch` tasks per transaction. Returns
/// how many tasks went.
///
/// A grant is not remembered by its event id: its execution is what makes a copy
/// of it insert nothing (docs/decisions.md, entry 46). So a task goes only once
/// every one of its executions was recorded longer ago than `grants_remembered`
/// (the bus's dedupe window), however short the retention, and whenever its grant
/// arrived: a copy re-sent within the window always finds its execution.
///
/// `call_sequences` decide the operation key of a step's next call and a
/// `retry_as_new` reuses earlier generations' checkpoints, so a task that may run
/// again keeps them however old: one with no final status here, or with an
/// execution still ready or running, is never purged.
pub async fn purge_finished_tasks(
    pool: &PgPool,
    retention: Duration,
    grants_remembered: Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let remembered_us = i64::try_from(grants_remembered.as_micros()).unwrap_or(i64::MAX);
    let cutoff = Timestamp::now().0.saturating_sub(i64::try_from(retention.as_micros()).unwrap_or(i64::MAX));
    let mut purged = 0;
    loop {
        let mut tx = pool.begin().await?;
        // FOR UPDATE: a status arriving meanwhile waits for this transaction, and
        // then finds no row to replace, only one to create.
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT s.task_id FROM task_states s WHERE s.state IN ('succeeded', 'failed', 'cancelled') \
             AND s.updated_at_us < $1 AND NOT EXISTS (SELECT 1 FROM executions e \
             WHERE e.task_id = s.task_id AND (e.status IN ('ready', 'running') \
             OR e.created_at > now() - make_interval(secs => $3::double precision / 1e6))) \
             ORDER BY s.updated_at_us LIMIT $2 FOR UPDATE OF s SKIP LOCKED",
        )
        .bind(cutoff)
        .bind(batch)
        .bind(remembered_us)
        .fetch_all(&mut *tx)
        .await?;
        for table in ["executions", "checkpoints", "call_sequences", "task_states"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE task_id = ANY($1)")).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        purged += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(purged);
        }
    }
}
