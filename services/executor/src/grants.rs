//! The executor's consumer of `fenceline.dispatch`: it only records each grant
//! (deduplicated by grant id, so a re-issued grant runs once) and each cooperative
//! cancellation. The table carries the truth; workers claim from it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_events::Event;
use sqlx::PgConnection;
use tokio::sync::Notify;

/// Records grants and cancellations.
#[derive(Debug, Clone)]
pub struct GrantRecorder {
    /// Wakes this process's idle workers after a batch.
    pub wake: Arc<Notify>,
    /// Grants recorded by the batch in progress: as many idle workers are woken
    /// once it commits (a worker woken before the commit finds nothing to claim).
    pub recorded: Arc<AtomicUsize>,
    /// Workers of this process: more are never woken.
    pub workers: usize,
}

impl GrantRecorder {
    pub fn new(wake: Arc<Notify>, workers: usize) -> Self {
        Self { wake, recorded: Arc::new(AtomicUsize::new(0)), workers }
    }
}

impl Handler for GrantRecorder {
    async fn handle(&self, tx: &mut PgConnection, _outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        match &record.envelope.event {
            Event::AttemptGranted(g) => {
                if fenceline_bus::faults::drops("executor.drop_grant") {
                    tracing::warn!(grant_id = %g.grant_id, "fault point drops the grant");
                    return Ok(());
                }
                let inserted = sqlx::query(
                    "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, \
                     resume_after_step, provider, deadline_us, lease_budget_ms, traceparent) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (grant_id) DO NOTHING",
                )
                .bind(g.grant_id.as_uuid())
                .bind(g.task_id.as_uuid())
                .bind(&g.tenant)
                .bind(g.attempt)
                .bind(g.generation)
                .bind(&g.kind)
                .bind(&g.input_json)
                .bind(&g.resume_after_step)
                .bind(&g.provider)
                .bind(g.deadline.map(|d| d.0))
                .bind(g.lease_budget_ms)
                // The handler's span continues the grant's trace; the execution joins it.
                .bind(fenceline_telemetry::current_traceparent())
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if inserted == 0 {
                    tracing::info!(grant_id = %g.grant_id, "grant already recorded; a re-issue runs nothing twice");
                } else {
                    self.recorded.fetch_add(1, Ordering::Relaxed);
                }
            }
            Event::CancelAttempt(c) => {
                sqlx::query("UPDATE executions SET cancel_requested = true WHERE grant_id = $1")
                    .bind(c.grant_id.as_uuid())
                    .execute(&mut *tx)
                    .await?;
            }
            other => {
                return Err(HandleError::Poison(format!("the executor does not take {}", other.event_type())));
            }
        }
        Ok(())
    }

    /// One idle worker per grant the batch recorded (a rolled-back batch's count
    /// only wakes a few workers for nothing).
    fn committed(&self) {
        let grants = self.recorded.swap(0, Ordering::Relaxed);
        for _ in 0..grants.min(self.workers) {
            self.wake.notify_one();
        }
    }
}
