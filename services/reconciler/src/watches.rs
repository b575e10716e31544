//! The reconciler's consumer: keeps expectations from what it sees on the
//! dispatch and attempts topics (a grant must be claimed in time; an attempt that
//! ended without a clean result needs a decision) and opens a case for every
//! attempt lost or ambiguous after its call intent, to which a fenced worker's
//! verified result is added as evidence (and by which it may be decided).

use std::sync::Arc;

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_config::catalog::Catalog;
use fenceline_domain::calls::{AfterFencedResult, CaseStanding, after_fenced_result};
use fenceline_domain::cases::{self, LostAttempt, Opening, weighs_key_age};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{CaseState, ErrorClass, Phase, RecoveryDecision};
use fenceline_events::{Event, Evidence, FencedResultReported, RecoveryDecided, Timestamp, topics};
use sqlx::PgConnection;
use tokio::sync::Notify;
use tracing::Instrument as _;

use fenceline_store::word::Stored;

use crate::ReconcilerSettings;

mod batch;

pub use batch::BatchWrites;
use batch::{Heard, write_grant_facts};

/// Records grants and calls; opens cases.
#[derive(Debug)]
pub struct Watches {
    pub catalog: Arc<Catalog>,
    pub settings: Arc<ReconcilerSettings>,
    pub wake: Arc<Notify>,
    /// What a batch heard that no event of the same batch reads back, written
    /// when it commits.
    pub batch: BatchWrites,
}

/// What is known about an attempt's last call when it ended without a result.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LostCall {
    pub task_id: TaskId,
    pub attempt: i32,
    pub phase: Phase,
    pub phase_at: i64,
    pub step: Option<String>,
    pub provider: Option<String>,
    pub operation_key: Option<String>,
    pub request_id: Option<String>,
    pub what: String,
}

pub fn evidence(source: &str, finding: impl Into<String>) -> Evidence {
    Evidence { source: source.to_owned(), observed_at: Timestamp::now(), finding: finding.into() }
}

/// A decision without a case or a result; callers add what they have.
pub fn recovery(task_id: TaskId, attempt: i32, decision: RecoveryDecision, evidence: Vec<Evidence>) -> RecoveryDecided {
    RecoveryDecided { task_id, attempt, decision, case_id: None, result: None, evidence, decided_at: Timestamp::now() }
}

/// Writes a decision on the recovery topic.
pub async fn decide(
    tx: &mut PgConnection,
    outbox: &OutboxWriter,
    decided: RecoveryDecided,
) -> Result<(), fenceline_bus::Error> {
    outbox.append(tx, topics::RECOVERY, None, &Event::RecoveryDecided(decided)).await?;
    Ok(())
}

impl Watches {
    /// Opens the case of `lost` in the current span's trace (the task's), which its
    /// look-ups and the events it writes join; a loss heard before its grant waits
    /// for it instead.
    async fn open_case(&self, tx: &mut PgConnection, outbox: &OutboxWriter, lost: LostCall) -> Result<(), HandleError> {
        type GrantRow = (String, Option<i64>, String, i64);
        let grant: Option<GrantRow> = sqlx::query_as(
            "SELECT kind, deadline_us, provider, now_us() \
             FROM grants WHERE task_id = $1 AND attempt = $2",
        )
        .bind(lost.task_id.as_uuid())
        .bind(lost.attempt)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((kind, deadline, slot_provider, now)) = grant else {
            // Heard before its grant: without the kind, no step can be judged the
            // kind's last call. The case opens when the grant arrives.
            let kept = serde_json::to_value(&lost).map_err(|e| HandleError::Poison(e.to_string()))?;
            sqlx::query(
                "INSERT INTO early_losses (task_id, attempt, lost) VALUES ($1, $2, $3) \
                 ON CONFLICT (task_id, attempt) DO NOTHING",
            )
            .bind(lost.task_id.as_uuid())
            .bind(lost.attempt)
            .bind(kept)
            .execute(&mut *tx)
            .await?;
            tracing::info!(task_id = %lost.task_id, attempt = lost.attempt,
                "an attempt's loss heard before its grant: its case opens when the grant arrives");
            return Ok(());
        };
        let provider_name = lost.provider.clone().unwrap_or(slot_provider);
        let spec = self.catalog.provider(&provider_name);
        let caps = spec.map(|p| p.capabilities()).unwrap_or_default();
        let case_id = uuid::Uuid::now_v7();
        let ask_until = deadline.unwrap_or(now + i64::try_from(self.settings.ask_for_ms).unwrap_or(0) * 1_000);
        let memory = spec.and_then(|p| p.key_memory());
        let first = match &lost.operation_key {
            Some(key) if weighs_key_age(lost.phase, lost.request_id.is_some(), caps, memory) => {
                self.key_first_intent(tx, lost.task_id, key).await?
            }
            _ => None,
        };
        let first_shown = first.map(|at| Timestamp(at).to_rfc3339());
        let in_flight = spec.map(|p| p.in_flight_window()).unwrap_or_default();
        let in_flight_until =
            Timestamp(now + i64::try_from(in_flight.as_micros()).unwrap_or(i64::MAX / 4)).to_rfc3339();
        let phase_at = Timestamp(lost.phase_at).to_rfc3339();
        let Opening { state, decision: decided, evidence: lines } = cases::open(&LostAttempt {
            provider: &provider_name,
            capabilities: caps,
            what: &lost.what,
            phase: lost.phase,
            phase_at: &phase_at,
            request_id: lost.request_id.as_deref(),
            operation_key: lost.operation_key.as_deref(),
            key_memory: memory,
            key_first_sent: first.zip(first_shown.as_deref()),
            in_flight_until: &in_flight_until,
            now,
        });
        let found: Vec<Evidence> = lines.into_iter().map(|(source, line)| evidence(source, line)).collect();
        let inserted = sqlx::query(
            "INSERT INTO cases (case_id, task_id, attempt, kind, step, provider, operation_key, provider_request_id, \
             last_phase, last_phase_at_us, state, decision, next_ask_at_us, ask_until_us, evidence, decided_at, \
             never_received_counts_from_us, traceparent, received) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, \
                     CASE WHEN $11 = 'decided' THEN now() END, $16, $17, $8 IS NOT NULL) \
             ON CONFLICT (task_id, attempt) DO NOTHING",
        )
        .bind(case_id)
        .bind(lost.task_id.as_uuid())
        .bind(lost.attempt)
        .bind(&kind)
        .bind(&lost.step)
        .bind(&provider_name)
        .bind(&lost.operation_key)
        .bind(&lost.request_id)
        .bind(lost.phase.as_str())
        .bind(lost.phase_at)
        .bind(Stored(state))
        .bind(decided.map(|d| d.as_str()))
        .bind(decided.is_none().then_some(now))
        .bind(ask_until)
        .bind(sqlx::types::Json(&found))
        .bind(now + spec.map(|p| i64::try_from(p.in_flight_window().as_micros()).unwrap_or(i64::MAX / 4)).unwrap_or(0))
        .bind(fenceline_telemetry::current_traceparent())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            return Ok(());
        }
        tracing::info!(task_id = %lost.task_id, attempt = lost.attempt, phase = %lost.phase, decision = ?decided, "case opened");
        if let Some(decision) = decided {
            let case = (decision == RecoveryDecision::OutcomeUnknown).then(|| case_id.to_string());
            let decided = RecoveryDecided { case_id: case, ..recovery(lost.task_id, lost.attempt, decision, found) };
            decide(tx, outbox, decided).await?;
        } else {
            self.wake.notify_one();
        }
        // A fenced worker's report that outran the loss it follows.
        self.apply_kept_fenced_results(tx, outbox, lost.task_id, lost.attempt).await
    }
}

impl Watches {
    /// When the task's call under `key` first recorded its intent, if one was heard.
    async fn key_first_intent(
        &self,
        tx: &mut PgConnection,
        task_id: TaskId,
        key: &str,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar("SELECT min(intent_at_us) FROM calls WHERE task_id = $1 AND operation_key = $2")
            .bind(task_id.as_uuid())
            .bind(key)
            .fetch_one(&mut *tx)
            .await
    }

    /// A worker whose lease had been taken over fetched and verified its call's
    /// result, but could not record it: evidence for the attempt's case, kept once
    /// per attempt and step (a report delivered or written twice adds nothing) and
    /// applied now, or when the case opens if it is not there yet.
    async fn fenced_result(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        e: &FencedResultReported,
    ) -> Result<(), HandleError> {
        let report = serde_json::to_value(e).map_err(|e| HandleError::Poison(e.to_string()))?;
        let kept = sqlx::query(
            "INSERT INTO fenced_results (task_id, attempt, step, operation_key, report) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (task_id, attempt, step) DO NOTHING",
        )
        .bind(e.task_id.as_uuid())
        .bind(e.attempt)
        .bind(&e.step)
        .bind(&e.operation_key)
        .bind(report)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if kept == 0 {
            tracing::info!(task_id = %e.task_id, attempt = e.attempt, step = %e.step,
                "a fenced worker's verified result was heard before; nothing added");
            return Ok(());
        }
        self.apply_fenced_result(tx, outbox, e).await
    }

    /// Applies the reports kept for an attempt whose case just opened.
    async fn apply_kept_fenced_results(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        task_id: TaskId,
        attempt: i32,
    ) -> Result<(), HandleError> {
        let kept: Vec<sqlx::types::Json<FencedResultReported>> = sqlx::query_scalar(
            "SELECT report FROM fenced_results WHERE task_id = $1 AND attempt = $2 ORDER BY heard_at",
        )
        .bind(task_id.as_uuid())
        .bind(attempt)
        .fetch_all(&mut *tx)
        .await?;
        for report in kept {
            self.apply_fenced_result(tx, outbox, &report.0).await?;
        }
        Ok(())
    }

    /// Adds the report to its case's evidence and decides by the recovery table's
    /// row for it (`fenceline_domain::calls::after_fenced_result`): the verified
    /// result of the very call in doubt recovers the task with no second call,
    /// whether the case was still asking or waiting for a person as
    /// `outcome_unknown`.
    async fn apply_fenced_result(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        e: &FencedResultReported,
    ) -> Result<(), HandleError> {
        type CaseRow =
            (uuid::Uuid, String, Option<String>, Option<String>, Stored<CaseState>, Option<Stored<RecoveryDecision>>);
        let case: Option<CaseRow> = sqlx::query_as(
            "SELECT case_id, kind, step, operation_key, state, decision FROM cases \
             WHERE task_id = $1 AND attempt = $2 FOR UPDATE",
        )
        .bind(e.task_id.as_uuid())
        .bind(e.attempt)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((case_id, kind, step, operation_key, state, decision)) = case else {
            tracing::info!(task_id = %e.task_id, attempt = e.attempt,
                "a fenced worker's verified result kept until its attempt's case opens");
            return Ok(());
        };
        let standing = match (state, decision) {
            (Stored(CaseState::Asking), _) => CaseStanding::Asking,
            (_, Some(Stored(RecoveryDecision::OutcomeUnknown))) => CaseStanding::OutcomeUnknown,
            _ => CaseStanding::Decided,
        };
        let same_call = step.as_deref() == Some(e.step.as_str()) && operation_key.as_deref() == Some(&e.operation_key);
        let last_call = is_last_call(&self.catalog, &kind, Some(&e.step));
        let mut found = vec![evidence(
            "executor",
            format!(
                "a worker whose lease had been taken over (fencing token {}) received the provider's result of \
                 step `{}`, operation {}{}, and verified it against its checksum at {}: {} (sha256 {}, {} bytes)",
                e.fencing_token,
                e.step,
                e.operation_key,
                e.provider_request_id.as_deref().map(|r| format!(" (provider request id {r})")).unwrap_or_default(),
                e.verified_at.to_rfc3339(),
                e.result.uri,
                e.result.sha256,
                e.result.size_bytes,
            ),
        )];
        let (decided, result) = match after_fenced_result(standing, same_call, last_call) {
            AfterFencedResult::Recover => {
                found.push(evidence(
                    "reconciler",
                    "the verified result is of the call in doubt: the provider did that work; the task is recovered \
                     with it, with no second call",
                ));
                (Some(RecoveryDecision::Recovered), Some(e.result.clone()))
            }
            AfterFencedResult::NeedsHuman => {
                found.push(evidence(
                    "reconciler",
                    "the provider did the step's work and its result is verified, but resuming a multi-step task \
                     from a recovered step is not automated",
                ));
                (Some(RecoveryDecision::NeedsHuman), None)
            }
            AfterFencedResult::ShowThePerson => {
                found.push(evidence(
                    "reconciler",
                    format!(
                        "the provider did the work of step `{}` and its result is verified (it need not be paid for \
                         again), but the kind has later steps: attaching it as the task's result would skip them",
                        e.step
                    ),
                ));
                (Some(RecoveryDecision::OutcomeUnknown), None)
            }
            AfterFencedResult::EvidenceOnly => {
                let why = if same_call {
                    format!(
                        "the case was decided already ({}); the result is kept as evidence",
                        decision.map_or("?", |Stored(d)| d.as_str())
                    )
                } else {
                    format!(
                        "the result is of operation {} at step `{}`, not of the call in doubt ({} at `{}`); kept as \
                         evidence only",
                        e.operation_key,
                        e.step,
                        operation_key.as_deref().unwrap_or("?"),
                        step.as_deref().unwrap_or("?")
                    )
                };
                found.push(evidence("reconciler", why));
                (None, None)
            }
        };
        let all: sqlx::types::Json<Vec<Evidence>> = sqlx::query_scalar(
            "UPDATE cases SET evidence = evidence || $2, state = CASE WHEN $3::text IS NULL THEN state ELSE 'decided' \
             END, decision = coalesce($3, decision), decided_at = CASE WHEN $3::text IS NULL THEN decided_at \
             ELSE now() END WHERE case_id = $1 RETURNING evidence",
        )
        .bind(case_id)
        .bind(sqlx::types::Json(&found))
        .bind(decided.map(|d| d.as_str()))
        .fetch_one(&mut *tx)
        .await?;
        if let Some(decision) = decided {
            let decided = RecoveryDecided {
                case_id: Some(case_id.to_string()),
                result,
                ..recovery(e.task_id, e.attempt, decision, all.0)
            };
            decide(tx, outbox, decided).await?;
        }
        tracing::info!(task_id = %e.task_id, attempt = e.attempt, ?standing, ?decided,
            "a fenced worker's verified result added to its case's evidence");
        Ok(())
    }
}

/// Whether `step` is the kind's last step that calls a provider. A kind this
/// catalogue does not know is never taken as ending at `step`: a recovered result
/// would end the task and skip whatever steps it has after it, so a person decides.
pub fn is_last_call(catalog: &Catalog, kind: &str, step: Option<&str>) -> bool {
    let Some(kind) = catalog.kind(kind) else {
        return false;
    };
    kind.steps.iter().rev().find(|s| s.call().is_some()).map(|s| s.name.as_str()) == step
}

impl Handler for Watches {
    async fn flush(&self, tx: &mut PgConnection, outbox: &OutboxWriter) -> Result<(), HandleError> {
        self.write_what_is_read(tx, outbox).await?;
        Ok(self.batch.flush_facts(tx).await?)
    }

    fn discard(&self) {
        self.batch.discard();
    }

    async fn handle(&self, tx: &mut PgConnection, outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        let event = &record.envelope.event;
        if writes_or_reads_grants_or_calls(event) {
            self.write_what_is_read(tx, outbox).await?;
        }
        match event {
            // What was heard of this grant before it arrived applies when the batch's
            // grants are written; a re-issue of the grant joins the task's trace.
            Event::AttemptGranted(g) => self.batch.grants.heard(g, fenceline_telemetry::current_traceparent()),
            // A cancelled grant is never re-issued: a re-issue after the cancel would
            // start an execution that knows nothing of it.
            Event::CancelAttempt(e) => write_grant_facts(tx, vec![(e.grant_id, Heard::ENDED)]).await?,
            Event::AttemptClaimed(e) => self.batch.facts.heard(e.grant_id, Heard::CLAIMED),
            Event::CallIntentRecorded(e) => self.batch.intents.heard(e),
            Event::ProviderAccepted(e) => {
                sqlx::query("UPDATE calls SET provider_request_id = $3 WHERE task_id = $1 AND attempt = $2")
                    .bind(e.task_id.as_uuid())
                    .bind(e.attempt)
                    .bind(&e.provider_request_id)
                    .execute(&mut *tx)
                    .await?;
            }
            Event::StepCheckpointed(_) | Event::AwaitingSignal(_) => {}
            Event::TaskStatus(s) => self.batch.states.0.keep(s.task_id, s.version, || s.clone()),
            Event::AttemptSucceeded(e) => self.batch.facts.heard(e.grant_id, Heard::ENDED),
            Event::AttemptReleased(e) => self.batch.facts.heard(e.grant_id, Heard::ENDED),
            Event::AttemptFailed(e) if e.error_class != ErrorClass::Ambiguous => {
                self.batch.facts.heard(e.grant_id, Heard::ENDED);
            }
            Event::AttemptFailed(e) => {
                write_grant_facts(tx, vec![(e.grant_id, Heard::ENDED)]).await?;
                let call = self.call_of(tx, e.task_id, e.attempt).await?;
                let phase = if call.as_ref().is_some_and(|c| c.3.is_some()) {
                    Phase::ProviderAccepted
                } else {
                    Phase::CallIntent
                };
                let lost = LostCall {
                    task_id: e.task_id,
                    attempt: e.attempt,
                    phase,
                    phase_at: call.as_ref().map_or(e.failed_at.0, |c| c.4),
                    step: call.as_ref().map(|c| c.0.clone()),
                    provider: call.as_ref().map(|c| c.1.clone()),
                    operation_key: call.as_ref().map(|c| c.2.clone()),
                    request_id: call.as_ref().and_then(|c| c.3.clone()),
                    what: format!("the call's outcome is ambiguous: {}", e.message),
                };
                self.open_case(tx, outbox, lost).await?;
            }
            Event::AttemptLost(e) => {
                write_grant_facts(tx, vec![(e.grant_id, Heard::ENDED)]).await?;
                let call = self.call_of(tx, e.task_id, e.attempt).await?;
                let lost = LostCall {
                    task_id: e.task_id,
                    attempt: e.attempt,
                    phase: e.last_phase,
                    phase_at: e.last_phase_at.0,
                    step: e.step.clone(),
                    provider: call.as_ref().map(|c| c.1.clone()),
                    operation_key: e.operation_key.clone(),
                    request_id: e.provider_request_id.clone(),
                    what: format!("the worker's lease expired; a new worker took over and found `{}`", e.last_phase),
                };
                self.open_case(tx, outbox, lost).await?;
            }
            Event::FencedResultReported(e) => self.fenced_result(tx, outbox, e).await?,
            other => {
                return Err(HandleError::Poison(format!("the reconciler does not take {}", other.event_type())));
            }
        }
        Ok(())
    }

    /// What only records a fact, sent again: a grant is inserted once by its id, a
    /// snapshot writes only when newer, a claim or an end only turns a flag on, a
    /// checkpoint writes nothing. A call's intent and acceptance are remembered (a
    /// late copy would put back an earlier call's key or request id), and so is
    /// whatever may open a case.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        match event {
            Event::AttemptGranted(_)
            | Event::TaskStatus(_)
            | Event::AttemptClaimed(_)
            | Event::AttemptSucceeded(_)
            | Event::AttemptReleased(_)
            | Event::StepCheckpointed(_)
            | Event::AwaitingSignal(_) => true,
            Event::AttemptFailed(e) => e.error_class != ErrorClass::Ambiguous,
            _ => false,
        }
    }
}

/// Whether handling `event` reads or writes `grants` or `calls` itself, so that
/// the grants and intents the batch gathered before it are written first; the
/// events that are only gathered wait for the batch's end.
fn writes_or_reads_grants_or_calls(event: &Event) -> bool {
    match event {
        Event::AttemptGranted(_)
        | Event::CallIntentRecorded(_)
        | Event::AttemptClaimed(_)
        | Event::AttemptSucceeded(_)
        | Event::AttemptReleased(_)
        | Event::StepCheckpointed(_)
        | Event::AwaitingSignal(_)
        | Event::TaskStatus(_) => false,
        Event::AttemptFailed(e) => e.error_class == ErrorClass::Ambiguous,
        _ => true,
    }
}

type CallRow = (String, String, String, Option<String>, i64);

impl Watches {
    /// Writes the batch's grants and call intents gathered so far, before an event
    /// that reads them back, and opens the cases of losses heard before their grant.
    async fn write_what_is_read(&self, tx: &mut PgConnection, outbox: &OutboxWriter) -> Result<(), HandleError> {
        let claim_within_us = i64::try_from(self.settings.claim_timeout_ms).unwrap_or(0) * 1_000;
        // Outside the loss's event (at a later event or the batch's end): the case,
        // and what it decides at once, join the task's trace through its grant's.
        for early in self.batch.flush_reads(tx, claim_within_us).await? {
            let span = tracing::info_span!("open case", task_id = %early.lost.task_id, attempt = early.lost.attempt);
            fenceline_telemetry::continue_trace(&span, early.traceparent.as_deref());
            self.open_case(tx, outbox, early.lost).instrument(span).await?;
        }
        Ok(())
    }

    async fn call_of(
        &self,
        tx: &mut PgConnection,
        task_id: TaskId,
        attempt: i32,
    ) -> Result<Option<CallRow>, sqlx::Error> {
        sqlx::query_as(
            "SELECT step, provider, operation_key, provider_request_id, intent_at_us FROM calls \
             WHERE task_id = $1 AND attempt = $2",
        )
        .bind(task_id.as_uuid())
        .bind(attempt)
        .fetch_optional(&mut *tx)
        .await
    }
}
