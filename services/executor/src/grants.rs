//! The executor's consumer of `fenceline.dispatch`: it only records each grant
//! (deduplicated by grant id, so a re-issued grant runs once) and each cooperative
//! cancellation. The table carries the truth; workers claim from it, the grants
//! this process recorded by their ids ([`Handed`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_events::Event;
use sqlx::PgConnection;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The grants this process recorded, in the order their batches committed, for its
/// workers to claim by id: a claim through the primary key instead of a walk of
/// the claimable executions (docs/performance.md, "Claiming by grant id"). Only a
/// hint: a grant another worker or instance claimed first is simply skipped, and
/// what is never handed (another instance's grants, expired leases, anything
/// recorded before a restart) is found by the oldest-first claim.
#[derive(Debug)]
pub struct Handed {
    grants: Mutex<VecDeque<uuid::Uuid>>,
    /// When [`Handed::next`] last answered "oldest first" while grants were handed.
    last_oldest_first: Mutex<Instant>,
}

impl Default for Handed {
    fn default() -> Self {
        Self { grants: Mutex::default(), last_oldest_first: Mutex::new(Instant::now()) }
    }
}

impl Handed {
    /// The next grant to claim by id; `None` when none is handed, and once per
    /// `oldest_first_every` while grants are, so that an expired lease or another
    /// instance's grant waits no longer for the oldest-first claim than when idle.
    pub fn next(&self, oldest_first_every: Duration) -> Option<uuid::Uuid> {
        let mut last = self.last_oldest_first.lock().unwrap_or_else(PoisonError::into_inner);
        if last.elapsed() >= oldest_first_every {
            *last = Instant::now();
            return None;
        }
        drop(last);
        self.grants.lock().unwrap_or_else(PoisonError::into_inner).pop_front()
    }

    fn extend(&self, ids: Vec<uuid::Uuid>) {
        self.grants.lock().unwrap_or_else(PoisonError::into_inner).extend(ids);
    }
}

/// Records grants and cancellations.
#[derive(Debug, Clone)]
pub struct GrantRecorder {
    /// Wakes this process's idle workers after a batch.
    pub wake: Arc<Notify>,
    /// Grants recorded by the batch in progress: handed to the workers, and as
    /// many idle workers woken, once it commits (a worker woken before the commit
    /// finds nothing to claim).
    recorded: Arc<Mutex<Vec<uuid::Uuid>>>,
    /// Where the workers of this process take grants to claim by id.
    pub handed: Arc<Handed>,
    /// Workers of this process: more are never woken.
    pub workers: usize,
}

impl GrantRecorder {
    pub fn new(wake: Arc<Notify>, handed: Arc<Handed>, workers: usize) -> Self {
        Self { wake, recorded: Arc::default(), handed, workers }
    }
}

impl Handler for GrantRecorder {
    /// A granted task waits for its claim, which follows this consumer's batch.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

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
                    self.recorded.lock().unwrap_or_else(PoisonError::into_inner).push(g.grant_id.as_uuid());
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

    /// Hands the batch's grants to the workers and wakes one idle worker per grant.
    /// (Grants of a rolled-back batch handed with the next one cost a claim that
    /// finds nothing, or claims the grant its retry recorded.)
    fn committed(&self) {
        let grants = std::mem::take(&mut *self.recorded.lock().unwrap_or_else(PoisonError::into_inner));
        let woken = grants.len().min(self.workers);
        self.handed.extend(grants);
        for _ in 0..woken {
            self.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests;
