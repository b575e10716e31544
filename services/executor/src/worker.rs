//! Workers: claim an execution with a lease and a fencing token, keep the lease
//! alive by heartbeat, and walk the kind's steps through the recorded phases
//! `claimed → step_started → call_intent → provider_accepted → result_recorded →
//! finished`. Each phase is its own short transaction, conditional on the fencing
//! token and the expected phase; no transaction or pooled connection is held while
//! the provider is called. A takeover after `call_intent` reports `AttemptLost` and
//! does nothing else: the reconciler decides.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::{OutboxWriter, fault};
use fenceline_config::catalog::{Catalog, StepSpec};
use fenceline_domain::calls::{CallOutcome, classify, operation_key};
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::{ErrorClass, Phase, ReleaseReason};
use fenceline_events::{
    ArtifactRef, AttemptClaimed, AttemptFailed, AttemptLost, AttemptReleased, AttemptSucceeded, AwaitingSignal,
    CallIntentRecorded, Event, ProviderAccepted, StepCheckpointed, Timestamp, topics,
};
use fenceline_providers::{CallAnswer, HttpProvider, ProviderResult};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::ExecutorSettings;

/// Why a worker stopped an execution early.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// A conditional write matched no row: another worker holds the execution now.
    #[error("write rejected: fenced (another worker holds this execution)")]
    Fenced,
    /// The lease may have expired (the process was paused, renewals failed): a
    /// call must not leave on a lease someone else may hold.
    #[error("the lease lapsed before the call left; not sending")]
    LeaseLapsed,
    #[error(transparent)]
    Bus(#[from] fenceline_bus::Error),
}

impl From<sqlx::Error> for Stop {
    fn from(e: sqlx::Error) -> Self {
        Stop::Bus(e.into())
    }
}

impl From<fenceline_bus::faults::Injected> for Stop {
    fn from(e: fenceline_bus::faults::Injected) -> Self {
        Stop::Bus(fenceline_bus::Error::Injected(e))
    }
}

/// One claimed execution, as the claim returned it.
#[derive(Debug, Clone, sqlx::FromRow)]
struct ClaimRow {
    grant_id: uuid::Uuid,
    task_id: uuid::Uuid,
    attempt: i32,
    generation: i32,
    kind: String,
    input_json: String,
    resume_after_step: Option<String>,
    fencing_token: i64,
    lease_expires_at_us: i64,
    takeover: bool,
    first_claimed_at_us: i64,
    lease_budget_ms: i64,
    phase: String,
    phase_at_us: i64,
    step: Option<String>,
    operation_key: Option<String>,
    provider_request_id: Option<String>,
    cancel_requested: bool,
}

/// What every worker of a process shares.
#[derive(Debug, Clone)]
pub struct Workers {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub providers: Arc<HashMap<String, HttpProvider>>,
    pub settings: Arc<ExecutorSettings>,
    pub wake: Arc<Notify>,
    /// This process's name in leases.
    pub name: String,
}

/// A worker's hold on one execution.
#[derive(Debug, Clone)]
struct Lease {
    grant_id: GrantId,
    task_id: TaskId,
    attempt: i32,
    generation: i32,
    token: i64,
    /// The phase this worker last wrote (the expected phase of its next write).
    phase: Phase,
    /// Until when the lease surely holds (micros), as of the last renewal.
    valid_until: Arc<std::sync::atomic::AtomicI64>,
}

impl Lease {
    fn holds(&self) -> bool {
        Timestamp::now().0 < self.valid_until.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Workers {
    /// Runs one worker until `shutdown`: claim, run, repeat; sleep when idle.
    pub async fn run(self, index: usize, shutdown: CancellationToken) {
        let worker = format!("{}#{index}", self.name);
        while !shutdown.is_cancelled() {
            match self.claim(&worker).await {
                Ok(Some(claim)) => {
                    if let Err(e) = self.execute(claim, &shutdown).await {
                        match e {
                            Stop::Fenced => warn!(%worker, "write rejected: fenced; this worker stops the execution"),
                            Stop::LeaseLapsed => warn!(%worker, "{e}"),
                            Stop::Bus(e) => warn!(%worker, error = %e, "execution interrupted; its lease will expire"),
                        }
                    }
                }
                Ok(None) => {
                    let idle = Duration::from_millis(self.settings.idle_poll_ms);
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = self.wake.notified() => {}
                        _ = tokio::time::sleep(idle) => {}
                    }
                }
                Err(e) => {
                    warn!(%worker, error = %e, "claiming failed; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Claims the oldest ready execution, or one whose lease expired, with a
    /// larger fencing token. A takeover after `call_intent` is reported lost here.
    async fn claim(&self, worker: &str) -> Result<Option<ClaimRow>, Stop> {
        let now = Timestamp::now().0;
        let lease_us = i64::try_from(self.settings.lease_ms).unwrap_or(i64::MAX / 4) * 1_000;
        let mut tx = self.pool.begin().await?;
        let claimed: Option<ClaimRow> = sqlx::query_as(
            "WITH next AS ( \
                 SELECT grant_id FROM executions \
                 WHERE status = 'ready' OR (status = 'running' AND lease_expires_at_us < $1) \
                 ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
             UPDATE executions e SET fencing_token = e.fencing_token + 1, worker = $2, \
                 lease_expires_at_us = $1 + $3, takeover = (e.status = 'running'), status = 'running', \
                 first_claimed_at_us = COALESCE(e.first_claimed_at_us, $1), \
                 phase = COALESCE(e.phase, 'claimed'), phase_at_us = COALESCE(e.phase_at_us, $1) \
             FROM next WHERE e.grant_id = next.grant_id \
             RETURNING e.grant_id, e.task_id, e.attempt, e.generation, e.kind, e.input_json, e.resume_after_step, \
                 e.fencing_token, e.lease_expires_at_us, e.takeover, e.first_claimed_at_us, e.lease_budget_ms, \
                 e.phase, e.phase_at_us, e.step, e.operation_key, e.provider_request_id, e.cancel_requested",
        )
        .bind(now)
        .bind(worker)
        .bind(lease_us)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(claim) = claimed else {
            return Ok(None);
        };
        let phase: Phase = claim.phase.parse().unwrap_or(Phase::Claimed);
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
                detected_at: Timestamp(now),
            });
            self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
            tx.commit().await?;
            self.outbox.committed();
            warn!(%task_id, %grant_id, %phase, "took over a lease after the call intent: attempt reported lost");
            return Ok(None);
        }
        let event = Event::AttemptClaimed(AttemptClaimed {
            grant_id,
            task_id,
            attempt: claim.attempt,
            fencing_token: claim.fencing_token,
            lease_expires_at: Timestamp(claim.lease_expires_at_us),
            worker: worker.to_owned(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
        tx.commit().await?;
        self.outbox.committed();
        if claim.takeover {
            info!(%task_id, %grant_id, %phase, token = claim.fencing_token, "took over an expired lease before any call");
        }
        Ok(Some(claim))
    }

    async fn execute(&self, claim: ClaimRow, shutdown: &CancellationToken) -> Result<(), Stop> {
        let mut lease = Lease {
            grant_id: GrantId::from_uuid(claim.grant_id),
            task_id: TaskId::from_uuid(claim.task_id),
            attempt: claim.attempt,
            generation: claim.generation,
            token: claim.fencing_token,
            phase: claim.phase.parse().unwrap_or(Phase::Claimed),
            valid_until: Arc::new(std::sync::atomic::AtomicI64::new(claim.lease_expires_at_us)),
        };
        let fenced = CancellationToken::new();
        let heartbeat = tokio::spawn(self.clone().heartbeat(lease.clone(), fenced.clone()));
        let result = self.steps(&claim, &mut lease, shutdown, &fenced).await;
        heartbeat.abort();
        result
    }

    /// Renews the lease every third of its length; a renewal that matches no row
    /// means another worker took over.
    async fn heartbeat(self, lease: Lease, fenced: CancellationToken) {
        let every = Duration::from_millis(self.settings.lease_ms / 3);
        let lease_us = i64::try_from(self.settings.lease_ms).unwrap_or(i64::MAX / 4) * 1_000;
        loop {
            tokio::time::sleep(every).await;
            let now = Timestamp::now().0;
            let renewed = sqlx::query(
                "UPDATE executions SET lease_expires_at_us = $3 + $4 \
                 WHERE grant_id = $1 AND fencing_token = $2 AND status = 'running'",
            )
            .bind(lease.grant_id.as_uuid())
            .bind(lease.token)
            .bind(now)
            .bind(lease_us)
            .execute(&self.pool)
            .await;
            match renewed {
                Ok(r) if r.rows_affected() == 0 => {
                    fenced.cancel();
                    return;
                }
                Ok(_) => lease.valid_until.store(now + lease_us, std::sync::atomic::Ordering::Release),
                Err(e) => warn!(error = %e, "renewing a lease failed; trying again"),
            }
        }
    }

    async fn steps(
        &self,
        claim: &ClaimRow,
        lease: &mut Lease,
        shutdown: &CancellationToken,
        fenced: &CancellationToken,
    ) -> Result<(), Stop> {
        let Some(kind) = self.catalog.kind(&claim.kind) else {
            return self
                .fail(lease, ErrorClass::Rejected, &format!("no kind `{}` in the catalogue", claim.kind), None, false)
                .await;
        };
        if claim.cancel_requested {
            return self.release(lease, ReleaseReason::Cancelled).await;
        }
        let input: serde_json::Value = serde_json::from_str(&claim.input_json).unwrap_or(serde_json::Value::Null);
        let done = self.checkpoints(lease).await?;
        let deadline_us = claim.first_claimed_at_us + claim.lease_budget_ms * 1_000;
        let mut outputs = serde_json::Map::new();
        let mut last: Option<ArtifactRef> = None;
        for step in &kind.steps {
            if let Some(output) = done.get(&step.name) {
                if let Ok(artifact) = serde_json::from_value::<ArtifactRef>(output.clone()) {
                    last = Some(artifact);
                }
                outputs.insert(step.name.clone(), output.clone());
                continue;
            }
            if fenced.is_cancelled() {
                return Err(Stop::Fenced);
            }
            match step.approval_signal.as_deref() {
                Some(signal) if claim.resume_after_step.as_deref() == Some(step.name.as_str()) => {
                    let output = serde_json::json!({ "approved_by_signal": signal });
                    self.checkpoint(lease, &step.name, &output, None).await?;
                    outputs.insert(step.name.clone(), output);
                }
                Some(signal) => return self.await_signal(lease, &step.name, signal).await,
                None => {
                    let call_input = serde_json::json!({ "task": input, "steps": outputs });
                    match self.call_step(step, lease, call_input, shutdown, deadline_us).await? {
                        Some(result) => {
                            outputs.insert(step.name.clone(), serde_json::to_value(&result).unwrap_or_default());
                            last = Some(result);
                        }
                        None => return Ok(()),
                    }
                }
            }
        }
        let Some(result) = last else {
            return self.fail(lease, ErrorClass::Rejected, "the kind produced no result", None, false).await;
        };
        let mut tx = self.pool.begin().await?;
        self.advance(&mut tx, lease, Phase::Finished, None, "succeeded").await?;
        let event = Event::AttemptSucceeded(AttemptSucceeded {
            task_id: lease.task_id,
            attempt: lease.attempt,
            grant_id: lease.grant_id,
            result,
            finished_at: Timestamp::now(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
        tx.commit().await?;
        self.outbox.committed();
        Ok(())
    }

    /// One paid step. `Ok(Some(result))`: checkpointed; `Ok(None)`: the attempt
    /// ended here (failed, released) and its event is written.
    async fn call_step(
        &self,
        step: &StepSpec,
        lease: &mut Lease,
        input: serde_json::Value,
        shutdown: &CancellationToken,
        deadline_us: i64,
    ) -> Result<Option<ArtifactRef>, Stop> {
        let Some((provider_name, operation)) = step.call() else {
            return Ok(None);
        };
        let Some(provider) = self.providers.get(provider_name) else {
            self.fail(lease, ErrorClass::Rejected, &format!("no provider `{provider_name}`"), None, false).await?;
            return Ok(None);
        };
        // Before the intent, cancellation and shutdown still cost nothing.
        let mut tx = self.pool.begin().await?;
        self.advance(&mut tx, lease, Phase::StepStarted, Some(&step.name), "running").await?;
        let cancelled: bool = sqlx::query_scalar("SELECT cancel_requested FROM executions WHERE grant_id = $1")
            .bind(lease.grant_id.as_uuid())
            .fetch_one(&mut *tx)
            .await?;
        let seq: i32 = sqlx::query_scalar(
            "INSERT INTO call_sequences (task_id, generation, step) VALUES ($1, $2, $3) \
             ON CONFLICT (task_id, generation, step) DO UPDATE SET seq = call_sequences.seq RETURNING seq",
        )
        .bind(lease.task_id.as_uuid())
        .bind(lease.generation)
        .bind(&step.name)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        if cancelled || shutdown.is_cancelled() {
            let reason = if cancelled { ReleaseReason::Cancelled } else { ReleaseReason::ShutdownBeforeIntent };
            self.release(lease, reason).await?;
            return Ok(None);
        }
        fault!("executor.before_call_intent");
        let key = operation_key(
            lease.task_id,
            &step.name,
            u32::try_from(lease.generation).unwrap_or_default(),
            u32::try_from(seq).unwrap_or_default(),
        );
        let mut tx = self.pool.begin().await?;
        self.advance_call(&mut tx, lease, Phase::CallIntent, &key, None).await?;
        let event = Event::CallIntentRecorded(CallIntentRecorded {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.name.clone(),
            operation_key: key.clone(),
            provider: provider_name.to_owned(),
            recorded_at: Timestamp::now(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
        tx.commit().await?;
        self.outbox.committed();
        fault!("executor.after_call_intent");
        if !lease.holds() {
            return Err(Stop::LeaseLapsed);
        }

        let mut answer = provider.start(operation, input, &key).await;
        fault!("executor.after_provider_answer");
        loop {
            match answer {
                CallAnswer::Accepted { request_id } => {
                    if lease.phase != Phase::ProviderAccepted {
                        let mut tx = self.pool.begin().await?;
                        self.advance_call(&mut tx, lease, Phase::ProviderAccepted, &key, Some(&request_id)).await?;
                        let event = Event::ProviderAccepted(ProviderAccepted {
                            task_id: lease.task_id,
                            attempt: lease.attempt,
                            step: step.name.clone(),
                            operation_key: key.clone(),
                            provider_request_id: request_id.clone(),
                            accepted_at: Timestamp::now(),
                        });
                        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
                        tx.commit().await?;
                        self.outbox.committed();
                    }
                    if Timestamp::now().0 >= deadline_us {
                        let message = format!("accepted as {request_id}, no result within the attempt budget");
                        self.fail(lease, ErrorClass::Ambiguous, &message, None, true).await?;
                        return Ok(None);
                    }
                    tokio::time::sleep(Duration::from_millis(self.settings.poll_ms)).await;
                    answer = provider.poll(&request_id).await;
                }
                CallAnswer::Done { request_id, result } => {
                    return self.record_result(lease, &step.name, provider, &request_id, result).await;
                }
                CallAnswer::Outcome(outcome) => {
                    let class = classify(&outcome, provider.overrides());
                    let Some(class) = class else {
                        self.fail(lease, ErrorClass::Ambiguous, "a success without a readable answer", None, true)
                            .await?;
                        return Ok(None);
                    };
                    let message = describe(&outcome);
                    if !class.money_may_have_been_spent {
                        // A definite "nothing was done": the next try is a new operation.
                        sqlx::query(
                            "UPDATE call_sequences SET seq = seq + 1 WHERE task_id = $1 AND generation = $2 AND step = $3",
                        )
                        .bind(lease.task_id.as_uuid())
                        .bind(lease.generation)
                        .bind(&step.name)
                        .execute(&self.pool)
                        .await?;
                    }
                    self.fail(lease, class.class, &message, class.retry_after, class.money_may_have_been_spent).await?;
                    return Ok(None);
                }
            }
        }
    }

    async fn record_result(
        &self,
        lease: &mut Lease,
        step: &str,
        provider: &HttpProvider,
        request_id: &str,
        result: ProviderResult,
    ) -> Result<Option<ArtifactRef>, Stop> {
        // A result that cannot be fetched is as unverified as one that does not match.
        if let Err(e) = provider.verify(&result).await {
            self.fail(lease, ErrorClass::ResultMismatch, &format!("{request_id}: {e}"), None, true).await?;
            return Ok(None);
        }
        let artifact = ArtifactRef { uri: result.uri, sha256: result.sha256, size_bytes: result.size_bytes };
        let output = serde_json::to_value(&artifact).unwrap_or_default();
        self.checkpoint(lease, step, &output, Some(&artifact.sha256)).await?;
        fault!("executor.after_result_recorded");
        Ok(Some(artifact))
    }

    /// Records a finished step (`result_recorded`) with its output and announces it.
    async fn checkpoint(
        &self,
        lease: &mut Lease,
        step: &str,
        output: &serde_json::Value,
        sha256: Option<&str>,
    ) -> Result<(), Stop> {
        let sha = sha256.map_or_else(|| hex_sha(output), str::to_owned);
        let mut tx = self.pool.begin().await?;
        self.advance(&mut tx, lease, Phase::ResultRecorded, Some(step), "running").await?;
        sqlx::query(
            "INSERT INTO checkpoints (task_id, generation, step, output, sha256, attempt) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(lease.task_id.as_uuid())
        .bind(lease.generation)
        .bind(step)
        .bind(output)
        .bind(&sha)
        .bind(lease.attempt)
        .execute(&mut *tx)
        .await?;
        let event = Event::StepCheckpointed(StepCheckpointed {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.to_owned(),
            output_ref: format!("checkpoint:{}:{}:{step}", lease.task_id, lease.generation),
            sha256: sha,
            checkpointed_at: Timestamp::now(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
        tx.commit().await?;
        self.outbox.committed();
        Ok(())
    }

    async fn checkpoints(&self, lease: &Lease) -> Result<HashMap<String, serde_json::Value>, Stop> {
        let rows: Vec<(String, serde_json::Value)> =
            sqlx::query_as("SELECT step, output FROM checkpoints WHERE task_id = $1 AND generation = $2")
                .bind(lease.task_id.as_uuid())
                .bind(lease.generation)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.into_iter().collect())
    }

    /// An approval: announce the wait and give the grant back; nothing is held.
    async fn await_signal(&self, lease: &mut Lease, step: &str, signal: &str) -> Result<(), Stop> {
        let mut tx = self.pool.begin().await?;
        self.advance(&mut tx, lease, Phase::StepStarted, Some(step), "released").await?;
        let waiting = Event::AwaitingSignal(AwaitingSignal {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.to_owned(),
            signal_name: signal.to_owned(),
            since: Timestamp::now(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &waiting).await?;
        self.outbox
            .append(&mut tx, topics::ATTEMPTS, None, &self.released(lease, ReleaseReason::AwaitingSignal))
            .await?;
        tx.commit().await?;
        self.outbox.committed();
        Ok(())
    }

    fn released(&self, lease: &Lease, reason: ReleaseReason) -> Event {
        Event::AttemptReleased(AttemptReleased {
            task_id: lease.task_id,
            attempt: lease.attempt,
            grant_id: lease.grant_id,
            reason,
            released_at: Timestamp::now(),
        })
    }

    async fn release(&self, lease: &mut Lease, reason: ReleaseReason) -> Result<(), Stop> {
        let mut tx = self.pool.begin().await?;
        let phase = lease.phase;
        self.advance(&mut tx, lease, phase, None, "released").await?;
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &self.released(lease, reason)).await?;
        tx.commit().await?;
        self.outbox.committed();
        info!(task_id = %lease.task_id, %reason, "attempt released before any call");
        Ok(())
    }

    async fn fail(
        &self,
        lease: &mut Lease,
        class: ErrorClass,
        message: &str,
        retry_after: Option<Duration>,
        spent: bool,
    ) -> Result<(), Stop> {
        let mut tx = self.pool.begin().await?;
        let phase = lease.phase;
        self.advance(&mut tx, lease, phase, None, "failed").await?;
        let event = Event::AttemptFailed(AttemptFailed {
            task_id: lease.task_id,
            attempt: lease.attempt,
            grant_id: lease.grant_id,
            error_class: class,
            message: message.to_owned(),
            retry_after_ms: retry_after.and_then(|d| i64::try_from(d.as_millis()).ok()),
            money_may_have_been_spent: spent,
            failed_at: Timestamp::now(),
        });
        self.outbox.append(&mut tx, topics::ATTEMPTS, None, &event).await?;
        tx.commit().await?;
        self.outbox.committed();
        info!(task_id = %lease.task_id, %class, message, "attempt failed");
        Ok(())
    }

    /// Moves to `phase` (and `status`) if this worker still holds the execution at
    /// the phase it last wrote.
    async fn advance(
        &self,
        tx: &mut PgConnection,
        lease: &mut Lease,
        phase: Phase,
        step: Option<&str>,
        status: &str,
    ) -> Result<(), Stop> {
        let updated = sqlx::query(
            "UPDATE executions SET phase = $4, phase_at_us = $5, step = COALESCE($6, step), status = $7 \
             WHERE grant_id = $1 AND fencing_token = $2 AND phase = $3 AND status = 'running'",
        )
        .bind(lease.grant_id.as_uuid())
        .bind(lease.token)
        .bind(lease.phase.as_str())
        .bind(phase.as_str())
        .bind(Timestamp::now().0)
        .bind(step)
        .bind(status)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if updated == 0 {
            return Err(Stop::Fenced);
        }
        lease.phase = phase;
        Ok(())
    }

    async fn advance_call(
        &self,
        tx: &mut PgConnection,
        lease: &mut Lease,
        phase: Phase,
        key: &str,
        request_id: Option<&str>,
    ) -> Result<(), Stop> {
        self.advance(tx, lease, phase, None, "running").await?;
        sqlx::query(
            "UPDATE executions SET operation_key = $2, provider_request_id = COALESCE($3, provider_request_id) \
             WHERE grant_id = $1",
        )
        .bind(lease.grant_id.as_uuid())
        .bind(key)
        .bind(request_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

fn hex_sha(value: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(value.to_string().as_bytes()))
}

fn describe(outcome: &CallOutcome) -> String {
    match outcome {
        CallOutcome::NotSent => "the request was not sent".to_owned(),
        CallOutcome::Answered { status, .. } => format!("the provider answered {status}"),
        CallOutcome::TimedOutAfterSend => "no answer within the call timeout after sending".to_owned(),
        CallOutcome::ResetMidResponse => "the connection broke before the answer was read".to_owned(),
    }
}
