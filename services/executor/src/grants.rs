//! The executor's consumer of `fenceline.dispatch`: it only records each grant
//! (deduplicated by grant id, so a re-issued grant runs once) and each cooperative
//! cancellation. The table carries the truth; workers claim from it, the grants
//! this process recorded by their ids ([`Handed`]).
//!
//! A batch's grants are gathered and inserted by one statement before it commits
//! ([`Handler::flush`]). A grant is not remembered by its event id: its execution,
//! keyed by the grant id, is the memory, and the retention keeps it for at least
//! the bus's dedupe window after it was recorded (docs/decisions.md, entry 46).

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
    grants: Mutex<VecDeque<HandedGrant>>,
    walk: Mutex<Walk>,
}

/// When the oldest-first walk is taken.
#[derive(Debug)]
struct Walk {
    /// When it was last taken; `None` at start.
    last: Option<Instant>,
    /// The last walk found an execution (to claim or to report lost): there may be
    /// more, so a worker that finds nothing handed walks again.
    found: bool,
}

impl Default for Handed {
    fn default() -> Self {
        // At start, executions recorded before it may wait: walk until none is found.
        Self { grants: Mutex::default(), walk: Mutex::new(Walk { last: None, found: true }) }
    }
}

/// What a worker looking for work does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Claims this grant by its id.
    Claim(HandedGrant),
    /// Claims the oldest claimable execution: a grant recorded by another instance
    /// or before a restart, or a lease that expired.
    Walk,
    /// Waits to be woken: nothing is handed and the walk is not due.
    Rest,
}

/// A grant handed to the workers: its id, and what its claim needs to start the
/// first step in the same statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedGrant {
    pub grant_id: uuid::Uuid,
    pub kind: String,
    /// The task's first attempt, of its first generation, resuming after no
    /// step: nothing can be checkpointed, so the kind's first step is the one to run.
    pub from_the_first_step: bool,
}

impl HandedGrant {
    fn of(grant: &fenceline_events::AttemptGranted) -> Self {
        HandedGrant {
            grant_id: grant.grant_id.as_uuid(),
            kind: grant.kind.clone(),
            from_the_first_step: grant.attempt == 1 && grant.generation == 0 && grant.resume_after_step.is_none(),
        }
    }
}

impl Handed {
    /// The oldest-first walk when it is due (once per `walk_every`, whether or not
    /// grants are handed, so that an expired lease or another instance's grant
    /// waits no longer than on an idle executor), else the next grant handed, else
    /// the walk again if the last one found an execution, else rest: a worker that
    /// finds nothing handed does not walk only to find nothing.
    pub fn next(&self, walk_every: Duration) -> Next {
        let mut walk = self.walk.lock().unwrap_or_else(PoisonError::into_inner);
        let due = walk.last.is_none_or(|last| last.elapsed() >= walk_every);
        if !due && let Some(grant) = self.grants.lock().unwrap_or_else(PoisonError::into_inner).pop_front() {
            return Next::Claim(grant);
        }
        if due || walk.found {
            *walk = Walk { last: Some(Instant::now()), found: false };
            return Next::Walk;
        }
        Next::Rest
    }

    /// The walk found an execution to claim or to report lost: a worker with
    /// nothing handed walks again, so that the executions a stopped instance left
    /// are taken over one after another, not one per interval.
    pub fn walk_found(&self) {
        self.walk.lock().unwrap_or_else(PoisonError::into_inner).found = true;
    }

    fn extend(&self, grants: Vec<HandedGrant>) {
        self.grants.lock().unwrap_or_else(PoisonError::into_inner).extend(grants);
    }
}

/// One grant gathered for the batch's insert.
#[derive(Debug)]
struct Gathered {
    grant: fenceline_events::AttemptGranted,
    /// The trace of the handler's span, which the execution joins.
    traceparent: Option<String>,
    /// A cancellation of the grant came later in the same batch.
    cancel_requested: bool,
}

/// Records grants and cancellations.
#[derive(Debug, Clone)]
pub struct GrantRecorder {
    /// Wakes this process's idle workers after a batch.
    pub wake: Arc<Notify>,
    /// Grants recorded by the batch in progress: handed to the workers, and as
    /// many idle workers woken, once it commits (a worker woken before the commit
    /// finds nothing to claim).
    recorded: Arc<Mutex<Vec<HandedGrant>>>,
    /// Grants of the batch (or of the event's savepoint) not yet inserted, in the
    /// order they came, each grant id once.
    gathered: Arc<Mutex<Vec<Gathered>>>,
    /// Where the workers of this process take grants to claim by id.
    pub handed: Arc<Handed>,
    /// Workers of this process: more are never woken.
    pub workers: usize,
}

impl GrantRecorder {
    pub fn new(wake: Arc<Notify>, handed: Arc<Handed>, workers: usize) -> Self {
        Self { wake, recorded: Arc::default(), gathered: Arc::default(), handed, workers }
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
                let mut gathered = self.gathered.lock().unwrap_or_else(PoisonError::into_inner);
                if gathered.iter().any(|k| k.grant.grant_id == g.grant_id) {
                    tracing::info!(grant_id = %g.grant_id, "grant sent twice in one batch; recorded once");
                } else {
                    // The handler's span continues the grant's trace; the execution joins it.
                    let traceparent = fenceline_telemetry::current_traceparent();
                    gathered.push(Gathered { grant: g.clone(), traceparent, cancel_requested: false });
                }
            }
            Event::CancelAttempt(c) => {
                // A grant of this batch is not inserted yet: it is inserted cancelled.
                for k in self.gathered.lock().unwrap_or_else(PoisonError::into_inner).iter_mut() {
                    if k.grant.grant_id == c.grant_id {
                        k.cancel_requested = true;
                    }
                }
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

    /// A grant sent again finds its execution by the grant id and inserts nothing,
    /// as long as the execution is kept: the retention keeps it for at least the
    /// dedupe window after it was recorded (`retention::purge_finished_tasks`), the
    /// window in which its event id would have been remembered. A cancellation only
    /// turns a flag on, but stays remembered: it is rare, and no copy of it is
    /// proven harmless by the resends test.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        matches!(event, Event::AttemptGranted(_))
    }

    /// Inserts the batch's grants in one statement; a grant already recorded (sent
    /// again) inserts nothing and is not handed to the workers.
    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        let gathered = std::mem::take(&mut *self.gathered.lock().unwrap_or_else(PoisonError::into_inner));
        if gathered.is_empty() {
            return Ok(());
        }
        let text = |f: fn(&Gathered) -> &str| gathered.iter().map(f).collect::<Vec<_>>();
        let inserted: Vec<uuid::Uuid> = sqlx::query_scalar(
            "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, \
             resume_after_step, provider, deadline_us, lease_budget_ms, traceparent, cancel_requested) \
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::int4[], $5::int4[], $6::text[], \
             $7::text[], $8::text[], $9::text[], $10::int8[], $11::int8[], $12::text[], $13::bool[]) \
             ON CONFLICT (grant_id) DO NOTHING RETURNING grant_id",
        )
        .bind(gathered.iter().map(|k| k.grant.grant_id.as_uuid()).collect::<Vec<_>>())
        .bind(gathered.iter().map(|k| k.grant.task_id.as_uuid()).collect::<Vec<_>>())
        .bind(text(|k| &k.grant.tenant))
        .bind(gathered.iter().map(|k| k.grant.attempt).collect::<Vec<_>>())
        .bind(gathered.iter().map(|k| k.grant.generation).collect::<Vec<_>>())
        .bind(text(|k| &k.grant.kind))
        .bind(text(|k| &k.grant.input_json))
        .bind(gathered.iter().map(|k| k.grant.resume_after_step.as_deref()).collect::<Vec<_>>())
        .bind(text(|k| &k.grant.provider))
        .bind(gathered.iter().map(|k| k.grant.deadline.map(|d| d.0)).collect::<Vec<_>>())
        .bind(gathered.iter().map(|k| k.grant.lease_budget_ms).collect::<Vec<_>>())
        .bind(gathered.iter().map(|k| k.traceparent.as_deref()).collect::<Vec<_>>())
        .bind(gathered.iter().map(|k| k.cancel_requested).collect::<Vec<_>>())
        .fetch_all(&mut *tx)
        .await?;
        let mut recorded = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
        for k in &gathered {
            if inserted.contains(&k.grant.grant_id.as_uuid()) {
                recorded.push(HandedGrant::of(&k.grant));
            } else {
                tracing::info!(grant_id = %k.grant.grant_id, "grant already recorded; a re-issue runs nothing twice");
            }
        }
        Ok(())
    }

    /// Forgets the grants of a batch or savepoint that rolled back.
    fn discard(&self) {
        self.gathered.lock().unwrap_or_else(PoisonError::into_inner).clear();
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
