//! Workers: claim an execution with a lease and a fencing token, keep the lease
//! alive by heartbeat, and walk the kind's steps through the recorded phases
//! `claimed → step_started → call_intent → provider_accepted → result_recorded →
//! finished`; a first attempt's claim may start its first paid step in the same
//! statement. Each phase is its own short fenced transaction ([`crate::record`]); no
//! transaction or pooled connection is held while the provider is called
//! ([`crate::call`]). A takeover after `call_intent` reports `AttemptLost` and does
//! nothing else: the reconciler decides. The parts call each other in one
//! direction: workers use calls, calls use the recorder, and all of them hold
//! leases ([`crate::lease`]).
//!
//! Leases are judged by one clock. The database's (`now_us()`, its migration 0105) sets and
//! compares every expiry, in the statement that claims or renews; a worker knows
//! how long its own lease holds from the monotonic instant it sent the renewal plus
//! the length the database granted, minus [`crate::lease::LEASE_MARGIN`]. No host's wall clock
//! decides whether a lease expired (docs/execution.md, "Executor").

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::Catalog;
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::{AttemptOutcome, ErrorClass, Phase, ReleaseReason};
use fenceline_events::{ArtifactRef, AttemptClaimed, AttemptLost, AwaitingSignal, Event, Timestamp, topics};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, info, warn};

use crate::ExecutorSettings;
use crate::call::{Calls, Ends, succeeded};
use crate::claims::{CLAIM_OLDEST, ClaimRow, ClaimWriter, HandedClaim};
use crate::grants::{HandedGrant, Next};
use crate::lease::{Lease, Stop};
use crate::output::checkpointed_result;
use crate::record::{Transition, released};

/// The outputs of the steps already checkpointed, by step name, with the
/// generation that checkpointed each.
type Checkpoints = HashMap<String, (serde_json::Value, i32)>;

/// What every worker of a process shares.
#[derive(Debug, Clone)]
pub struct Workers {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub settings: Arc<ExecutorSettings>,
    pub wake: Arc<Notify>,
    /// The grants this process recorded, claimed by id ([`crate::grants::Handed`]).
    pub handed: Arc<crate::grants::Handed>,
    /// Held by the one idle worker that looks for work on a timer (leases that
    /// expired, grants another instance recorded); the other idle workers wait to
    /// be woken, so an idle executor sends one claim per poll interval, not one per
    /// worker.
    pub idle_looker: Arc<tokio::sync::Mutex<()>>,
    /// This process's name in leases.
    pub name: String,
    /// The calls the workers make, and the records they keep.
    pub calls: Calls,
    /// Where the workers claim handed grants, together.
    pub(crate) claims: ClaimWriter,
}

/// A claimed execution, ready to run.
struct Claimed {
    claim: ClaimRow,
    /// When the claim's statement was sent (monotonic): the lease holds from then.
    sent: Instant,
    /// The steps already checkpointed.
    done: Checkpoints,
    /// The claim's `AttemptClaimed`, when the claim did not write it: the
    /// execution's first fenced write carries it.
    announce: Option<Event>,
    /// The execution's span, a child of the grant's trace.
    span: tracing::Span,
}

impl Workers {
    /// Runs one worker until `shutdown`: claim, run, repeat; sleep when idle.
    pub async fn run(self, index: usize, shutdown: CancellationToken) {
        let worker = format!("{}#{index}", self.name);
        while !shutdown.is_cancelled() {
            match self.claim(&worker).await {
                Ok(Some(Claimed { claim, sent, done, announce, span })) => {
                    // There may be more: another worker looks while this one works.
                    self.wake.notify_one();
                    if let Err(e) = self.execute(claim, sent, done, announce, &shutdown).instrument(span).await {
                        match e {
                            Stop::Fenced => warn!(%worker, "write rejected: fenced; this worker stops the execution"),
                            Stop::LeaseLapsed => warn!(%worker, "{e}"),
                            Stop::Bus(e) => warn!(%worker, error = %e, "execution interrupted; its lease will expire"),
                        }
                    }
                }
                Ok(None) => {
                    let idle = Duration::from_millis(self.settings.idle_poll_ms);
                    let looker = self.idle_looker.clone().try_lock_owned().ok();
                    let timer = async {
                        match looker {
                            Some(_) => tokio::time::sleep(idle).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = self.wake.notified() => {}
                        _ = timer => {}
                    }
                }
                Err(e) => {
                    warn!(%worker, error = %e, "claiming failed; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Claims a grant this process recorded, by its id, or the oldest ready
    /// execution or one whose lease expired when that walk is due ([`Next`]: once
    /// per `idle_poll_ms` in the process, and when nothing is handed after a walk
    /// that found one), with a larger fencing token; `None` when neither is there. A takeover after
    /// `call_intent` is reported lost here. Expiry is judged by the database's clock
    /// in the same statement; the instant returned with the claim is when the
    /// statement was sent (monotonic), and with it the steps already checkpointed,
    /// read in the claim's transaction.
    async fn claim(&self, worker: &str) -> Result<Option<Claimed>, Stop> {
        loop {
            let handed = match self.handed.next(Duration::from_millis(self.settings.idle_poll_ms)) {
                Next::Claim(grant) => grant,
                Next::Walk => return self.claim_next(worker, None).await,
                Next::Rest => return Ok(None),
            };
            // A handed grant someone else claimed first: the next one.
            if let Some(claimed) = self.claim_next(worker, Some(handed)).await? {
                return Ok(Some(claimed));
            }
        }
    }

    /// One claim: of the ready execution of grant `handed` (through the primary
    /// key, made with the claims other workers asked for meanwhile, [`ClaimWriter`]),
    /// or, without it, of the oldest claimable one.
    ///
    /// A handed grant is ready, never a takeover: its claim commits with nothing
    /// else of the worker's, and `AttemptClaimed` rides on the execution's first fenced
    /// write ([`Lease::unannounced`]), where it comes first. A task's first attempt
    /// whose kind begins with a paid step also starts that step in the claim's
    /// statement ([`first_paid_step`]): the `step_started` write, with the step's
    /// call `seq`, costs no statement of its own. A worker lost before its first
    /// fenced write leaves a running execution whose lease expires: the takeover
    /// announces its own claim. The walk may take a lease over, so it claims,
    /// announces or reports the attempt lost, and reads the checkpoints in one
    /// transaction.
    async fn claim_next(&self, worker: &str, handed: Option<HandedGrant>) -> Result<Option<Claimed>, Stop> {
        if let Some(handed) = handed {
            let start = first_paid_step(&self.catalog, &handed);
            let sent = Instant::now();
            let claim = HandedClaim {
                worker: worker.to_owned(),
                grant_id: handed.grant_id,
                start: start.map(str::to_owned),
                kind: handed.kind.clone(),
            };
            let claimed = self.claims.claim(claim).await?;
            let Some(claim) = claimed else {
                return Ok(None);
            };
            let span = execution_span(&claim);
            let done = if nothing_checkpointed(&claim) {
                Checkpoints::new()
            } else {
                checkpoints(&mut *self.pool.acquire().await?, &claim).instrument(span.clone()).await?
            };
            let announce = Some(claimed_event(&claim, worker));
            return Ok(Some(Claimed { claim, sent, done, announce, span }));
        }
        let mut tx = self.pool.begin().await?;
        let sent = Instant::now();
        let claimed: Option<ClaimRow> =
            sqlx::query_as(CLAIM_OLDEST).bind(worker).bind(self.settings.lease_us()).fetch_optional(&mut *tx).await?;
        let Some(claim) = claimed else {
            return Ok(None);
        };
        self.handed.walk_found();
        let span = execution_span(&claim);
        let claimed = self.claimed(tx, claim, worker).instrument(span.clone()).await?;
        Ok(claimed.map(|(claim, done)| Claimed { claim, sent, done, announce: None, span }))
    }

    /// Writes what the walk's claim found: the attempt lost (a takeover after the
    /// call intent) or claimed, in the claim's transaction.
    async fn claimed(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        claim: ClaimRow,
        worker: &str,
    ) -> Result<Option<(ClaimRow, Checkpoints)>, Stop> {
        let phase = read_phase(&claim.phase);
        let task_id = TaskId::from_uuid(claim.task_id);
        let grant_id = GrantId::from_uuid(claim.grant_id);
        if claim.takeover && matches!(phase, Phase::CallIntent | Phase::ProviderAccepted) {
            // A call may have left: whoever decides next needs evidence, not a guess.
            sqlx::query("UPDATE executions SET status = 'lost' WHERE grant_id = $1")
                .bind(claim.grant_id)
                .execute(&mut *tx)
                .await?;
            let event = Event::AttemptLost(AttemptLost {
                task_id,
                attempt: claim.attempt,
                grant_id,
                last_phase: phase,
                last_phase_at: Timestamp(claim.phase_at_us),
                step: claim.step.clone(),
                operation_key: claim.operation_key.clone(),
                provider_request_id: claim.provider_request_id.clone(),
                detected_at: Timestamp(claim.db_now_us),
            });
            self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
            tx.commit().await?;
            self.outbox.committed();
            let metrics = &fenceline_telemetry::metrics::global().executor;
            metrics.leases_taken_over.inc();
            metrics.attempt_ended(AttemptOutcome::Lost.as_str(), "none");
            warn!(%task_id, %grant_id, %phase, "took over a lease after the call intent: attempt reported lost");
            return Ok(None);
        }
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &claimed_event(&claim, worker)).await?;
        let done = if nothing_checkpointed(&claim) { Checkpoints::new() } else { checkpoints(&mut tx, &claim).await? };
        tx.commit().await?;
        self.outbox.committed();
        if claim.takeover {
            fenceline_telemetry::metrics::global().executor.leases_taken_over.inc();
            info!(%task_id, %grant_id, %phase, token = claim.fencing_token, "took over an expired lease before any call");
        }
        Ok(Some((claim, done)))
    }

    async fn execute(
        &self,
        claim: ClaimRow,
        sent: Instant,
        done: Checkpoints,
        announce: Option<Event>,
        shutdown: &CancellationToken,
    ) -> Result<(), Stop> {
        let granted = Duration::from_micros(u64::try_from(claim.lease_expires_at_us - claim.db_now_us).unwrap_or(0));
        // The attempt budget and the task's deadline, as monotonic instants: a
        // database instant `at` lies `at - db_now` after the claim was sent (or
        // earlier, never later).
        let at = |us: i64| match u64::try_from(us - claim.db_now_us) {
            Ok(ahead) => sent + Duration::from_micros(ahead),
            Err(_) => sent.checked_sub(Duration::from_micros((us - claim.db_now_us).unsigned_abs())).unwrap_or(sent),
        };
        let ends = Ends {
            budget: at(claim.first_claimed_at_us.saturating_add(claim.lease_budget_ms.saturating_mul(1_000))),
            deadline: claim.deadline_us.map(at),
        };
        let mut lease = Lease::taken(
            GrantId::from_uuid(claim.grant_id),
            TaskId::from_uuid(claim.task_id),
            claim.attempt,
            claim.generation,
            claim.fencing_token,
            read_phase(&claim.phase),
            sent + granted,
            ends.budget,
        );
        lease.unannounced.extend(announce);
        let heartbeat = tokio::spawn(self.clone().heartbeat(lease.clone()));
        let result = self.steps(&claim, done, &mut lease, shutdown, ends).await;
        heartbeat.abort();
        result
    }

    /// Renews the lease every third of its length; a renewal that matches no row
    /// means another worker took over.
    async fn heartbeat(self, lease: Lease) {
        let every = Duration::from_millis(self.settings.lease_ms / 3);
        loop {
            tokio::time::sleep(every).await;
            match crate::lease::renew(&self.pool, self.settings.lease_ms, &lease).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => warn!(error = %e, "renewing a lease failed; trying again"),
            }
        }
    }

    async fn steps(
        &self,
        claim: &ClaimRow,
        done: Checkpoints,
        lease: &mut Lease,
        shutdown: &CancellationToken,
        ends: Ends,
    ) -> Result<(), Stop> {
        let Some(kind) = self.catalog.kind(&claim.kind) else {
            let message = format!("no kind `{}` in the catalogue", claim.kind);
            return self.calls.recorder.fail(lease, ErrorClass::Rejected, &message, None, false, None).await;
        };
        if claim.cancel_requested {
            return self.calls.recorder.release(lease, ReleaseReason::Cancelled).await;
        }
        let input: serde_json::Value = serde_json::from_str(&claim.input_json).unwrap_or(serde_json::Value::Null);
        let mut outputs = serde_json::Map::new();
        let mut last: Option<ArtifactRef> = None;
        // The step the claim started, with its call `seq`.
        let mut begun = claim.started_seq.zip(claim.step.as_deref());
        for (index, step) in kind.steps.iter().enumerate() {
            if let Some((output, generation)) = done.get(&step.name) {
                if step.call().is_some() {
                    last = Some(checkpointed_result(lease.task_id, *generation, &step.name, output));
                }
                outputs.insert(step.name.clone(), output.clone());
                continue;
            }
            if lease.fenced() {
                return Err(Stop::Fenced);
            }
            match step.approval_signal.as_deref() {
                Some(signal) if claim.resume_after_step.as_deref() == Some(step.name.as_str()) => {
                    let output = serde_json::json!({ "approved_by_signal": signal });
                    self.calls.checkpoint(lease, &step.name, &output, None, None, None).await?;
                    outputs.insert(step.name.clone(), output);
                }
                Some(signal) => return self.await_signal(lease, &step.name, signal).await,
                None => {
                    let call_input = serde_json::json!({ "task": input, "steps": outputs });
                    // The last step's checkpoint finishes the attempt in the same write.
                    let finishes = index + 1 == kind.steps.len();
                    let begun = begun.take().filter(|(_, name)| *name == step.name).map(|(seq, _)| seq);
                    match self.calls.call_step(step, lease, call_input, shutdown, ends, finishes, begun).await? {
                        Some(_) if finishes => {
                            info!(task_id = %lease.task_id, "attempt succeeded");
                            return Ok(());
                        }
                        Some(result) => {
                            outputs.insert(step.name.clone(), result.output);
                            last = Some(result.artifact);
                        }
                        None => return Ok(()),
                    }
                }
            }
        }
        let Some(result) = last else {
            return self
                .calls
                .recorder
                .fail(lease, ErrorClass::Rejected, "the kind produced no result", None, false, None)
                .await;
        };
        self.calls
            .recorder
            .record(
                lease,
                Transition::to(Phase::Finished).status(AttemptOutcome::Succeeded),
                &[succeeded(lease, result)],
            )
            .await?;
        info!(task_id = %lease.task_id, "attempt succeeded");
        Ok(())
    }

    /// An approval: announce the wait and give the grant back; nothing is held.
    async fn await_signal(&self, lease: &mut Lease, step: &str, signal: &str) -> Result<(), Stop> {
        let waiting = Event::AwaitingSignal(AwaitingSignal {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.to_owned(),
            signal_name: signal.to_owned(),
            since: crate::clock::now(),
        });
        let events = [waiting, released(lease, ReleaseReason::AwaitingSignal)];
        let transition = Transition::to(Phase::StepStarted).step(step).status(AttemptOutcome::Released);
        self.calls.recorder.record(lease, transition, &events).await?;
        Ok(())
    }
}

/// One span per execution, a child of the grant's trace: every event it writes and
/// every call it makes carries that trace on.
fn execution_span(claim: &ClaimRow) -> tracing::Span {
    let span = tracing::info_span!(
        "execution",
        task_id = %claim.task_id,
        attempt = claim.attempt,
        grant_id = %claim.grant_id,
        trace_id = tracing::field::Empty,
    );
    fenceline_telemetry::continue_trace(&span, claim.traceparent.as_deref());
    fenceline_telemetry::record_trace_id(&span);
    span
}

fn claimed_event(claim: &ClaimRow, worker: &str) -> Event {
    Event::AttemptClaimed(AttemptClaimed {
        grant_id: GrantId::from_uuid(claim.grant_id),
        task_id: TaskId::from_uuid(claim.task_id),
        attempt: claim.attempt,
        fencing_token: claim.fencing_token,
        lease_expires_at: Timestamp(claim.lease_expires_at_us),
        worker: worker.to_owned(),
    })
}

/// The step a handed grant's claim starts: the kind's first step, when the grant is
/// the task's first attempt and that step is a paid call (not an approval).
fn first_paid_step<'a>(catalog: &'a Catalog, handed: &HandedGrant) -> Option<&'a str> {
    let first = catalog.kind(&handed.kind)?.steps.first()?;
    (handed.from_the_first_step && first.approval_signal.is_none() && first.call().is_some())
        .then_some(first.name.as_str())
}

/// The verified results of the task's steps, of this generation or an earlier one.
/// A person's `retry_as_new` starts a new generation for the step in doubt: the
/// steps before it were checkpointed only after their results were verified (an
/// approval only after it was given), so they are kept, not paid for again. Steps
/// run in order, so no earlier generation holds a step after the doubt. Every
/// earlier attempt had ended before this one was granted, so whatever they
/// checkpointed is committed.
async fn checkpoints(conn: &mut sqlx::PgConnection, claim: &ClaimRow) -> Result<Checkpoints, sqlx::Error> {
    let done: Vec<(String, serde_json::Value, i32)> = sqlx::query_as(
        "SELECT DISTINCT ON (step) step, output, generation FROM checkpoints \
         WHERE task_id = $1 AND generation <= $2 ORDER BY step, generation DESC",
    )
    .bind(claim.task_id)
    .bind(claim.generation)
    .fetch_all(&mut *conn)
    .await?;
    Ok(done.into_iter().map(|(step, output, generation)| (step, (output, generation))).collect())
}

/// A task's first attempt, claimed fresh, has nothing checkpointed: no worker ran it
/// before, and no earlier attempt or generation exists.
fn nothing_checkpointed(claim: &ClaimRow) -> bool {
    !claim.takeover && claim.attempt == 1 && claim.generation == 0 && claim.resume_after_step.is_none()
}

/// A stored phase, read in the safe direction: one that cannot be read is taken
/// for `call_intent` (a call may have left), never for "nothing was sent".
fn read_phase(stored: &str) -> Phase {
    stored.parse().unwrap_or(Phase::CallIntent)
}

#[cfg(test)]
mod tests;
