//! The reconciler's own loops: one re-issues grants nobody claimed in time (same
//! grant id, so the executor runs them once); the other asks providers about open
//! cases, a few at a time per provider, with backoff until the task's deadline: found, the result is verified and recovered;
//! never received, a retry is safe; no answer in time, the outcome is unknown.
//! Provider calls happen outside any transaction; each decision is one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::Catalog;
use fenceline_domain::calls::{AfterLookup, Backoff, LookupAnswer, after_lookup};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::RecoveryDecision;
use fenceline_events::{ArtifactRef, AttemptGranted, Event, Evidence, Timestamp, topics};
use fenceline_providers::{CallAnswer, HttpProvider, Lookup, VerifyError};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, info, warn};

use crate::ReconcilerSettings;
use crate::watches::{decide, evidence, recovery};

/// Longest sleep between two looks at the watches.
const LONGEST_SLEEP: Duration = Duration::from_secs(2);

#[derive(Debug, Clone)]
pub struct Reconciler {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub providers: Arc<HashMap<String, HttpProvider>>,
    pub settings: Arc<ReconcilerSettings>,
    pub wake: Arc<Notify>,
}

#[derive(Debug, sqlx::FromRow)]
struct AskRow {
    case_id: uuid::Uuid,
    task_id: uuid::Uuid,
    attempt: i32,
    kind: String,
    step: Option<String>,
    provider: Option<String>,
    operation_key: Option<String>,
    /// The request id the provider named when it accepted the call, if it did.
    provider_request_id: Option<String>,
    /// Whether any answer showed the provider received the call.
    received: bool,
    asked: i32,
    ask_until_us: i64,
    never_received_counts_from_us: i64,
    /// The database's clock when the case was claimed: every window of a case is
    /// set and judged by it, whichever host asks.
    now_us: i64,
    /// The trace of the task, as the event that opened the case carried it.
    traceparent: Option<String>,
}

/// A span for the reconciler's own work on a task, in the task's trace.
fn task_span(name: &'static str, task_id: uuid::Uuid, attempt: i32, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        "reconcile",
        otel.name = name,
        task_id = %task_id,
        attempt,
        trace_id = tracing::field::Empty,
    );
    fenceline_telemetry::continue_trace(&span, traceparent);
    span
}

/// Look-ups in flight at once at one provider: a provider that answers slowly (or
/// not at all) takes this many cases' turns, never every other provider's.
pub const LOOKUPS_PER_PROVIDER: usize = 4;

impl Reconciler {
    /// Runs the two loops until `shutdown`: re-issuing unclaimed grants, and asking
    /// providers about open cases. They are apart so that a slow look-up never delays
    /// a re-issue.
    pub async fn run(self, shutdown: CancellationToken) {
        let reissues = tokio::spawn(self.clone().reissue_loop(shutdown.clone()));
        self.ask_loop(shutdown).await;
        let _ = reissues.await;
    }

    async fn reissue_loop(self, shutdown: CancellationToken) {
        let every = LONGEST_SLEEP.min(Duration::from_millis(self.settings.claim_timeout_ms));
        while !shutdown.is_cancelled() {
            if let Err(e) = self.reissue_unclaimed().await {
                warn!(error = %e, "re-issuing grants failed; trying again");
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    /// Claims due cases and asks about them concurrently, at most
    /// [`LOOKUPS_PER_PROVIDER`] at a time per provider. A case whose look-up is cut
    /// short by shutdown keeps its claim, which lapses after 30 s: it is asked again.
    async fn ask_loop(self, shutdown: CancellationToken) {
        let mut asking: tokio::task::JoinSet<()> = tokio::task::JoinSet::new();
        // Which provider each look-up in flight counts against, by its task's id, so
        // that a look-up that panicked gives its turn back as one that returned does.
        let mut of_task: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut busy: HashMap<String, usize> = HashMap::new();
        let release = |busy: &mut HashMap<String, usize>,
                       of_task: &mut HashMap<tokio::task::Id, String>,
                       done: Result<(tokio::task::Id, ()), tokio::task::JoinError>| {
            let id = match done {
                Ok((id, ())) => id,
                Err(e) => {
                    warn!(error = %e, "a look-up ended abnormally");
                    e.id()
                }
            };
            if let Some(provider) = of_task.remove(&id)
                && let Some(n) = busy.get_mut(&provider)
            {
                *n = n.saturating_sub(1);
            }
        };
        while !shutdown.is_cancelled() {
            while let Some(done) = asking.try_join_next_with_id() {
                release(&mut busy, &mut of_task, done);
            }
            let full: Vec<String> =
                busy.iter().filter(|(_, n)| **n >= LOOKUPS_PER_PROVIDER).map(|(p, _)| p.clone()).collect();
            match self.claim_due(&full).await {
                Ok(Some(case)) => {
                    let provider = case.provider.clone().unwrap_or_default();
                    *busy.entry(provider.clone()).or_default() += 1;
                    let this = self.clone();
                    let span = task_span("ask", case.task_id, case.attempt, case.traceparent.as_deref());
                    let handle = asking.spawn(
                        async move {
                            if let Err(e) = this.ask(case).await {
                                warn!(error = %e, "asking a provider failed; trying again");
                            }
                        }
                        .instrument(span),
                    );
                    of_task.insert(handle.id(), provider);
                    continue;
                }
                Ok(None) => {}
                Err(e) => warn!(error = %e, "claiming a case to ask about failed; trying again"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.wake.notified() => {}
                Some(done) = asking.join_next_with_id(), if !asking.is_empty() => {
                    release(&mut busy, &mut of_task, done);
                }
                _ = tokio::time::sleep(LONGEST_SLEEP) => {}
            }
        }
        asking.abort_all();
    }

    /// Re-publishes grants not claimed within the claim timeout.
    async fn reissue_unclaimed(&self) -> Result<(), fenceline_bus::Error> {
        let mut tx = self.pool.begin().await?;
        let due: Vec<(uuid::Uuid, sqlx::types::Json<AttemptGranted>, i32, Option<String>)> = sqlx::query_as(
            "SELECT grant_id, granted, reissues, traceparent FROM grants \
             WHERE NOT claimed AND NOT ended AND claim_deadline_us < now_us() \
             ORDER BY claim_deadline_us LIMIT 100 FOR UPDATE SKIP LOCKED",
        )
        .fetch_all(&mut *tx)
        .await?;
        if due.is_empty() {
            return Ok(());
        }
        for (grant_id, granted, reissues, traceparent) in &due {
            let grant = granted.0.clone();
            let span = task_span("reissue", grant.task_id.as_uuid(), grant.attempt, traceparent.as_deref());
            // Each re-issue waits longer, so a stopped executor fleet is not flooded.
            let wait_ms = self.settings.claim_timeout_ms.saturating_mul(1 << (*reissues).clamp(0, 5));
            sqlx::query(
                "UPDATE grants SET reissues = reissues + 1, claim_deadline_us = now_us() + $2 WHERE grant_id = $1",
            )
            .bind(grant_id)
            .bind(i64::try_from(wait_ms).unwrap_or(i64::MAX / 4) * 1_000)
            .execute(&mut *tx)
            .await?;
            let found = vec![evidence(
                "reconciler",
                format!(
                    "grant {grant_id} was not claimed within {} ms; re-issued with the same grant id",
                    self.settings.claim_timeout_ms
                ),
            )];
            // The decision and the grant published again carry the task's trace.
            async {
                decide(
                    &mut tx,
                    &self.outbox,
                    recovery(grant.task_id, grant.attempt, RecoveryDecision::ReissueGrant, found),
                )
                .await?;
                self.outbox.append(&mut tx, topics::DISPATCH, None, &Event::AttemptGranted(grant.clone())).await?;
                warn!(%grant_id, reissues = reissues + 1, "grant not claimed in time: re-issued");
                Ok::<(), fenceline_bus::Error>(())
            }
            .instrument(span)
            .await?;
        }
        tx.commit().await?;
        self.outbox.committed();
        Ok(())
    }

    /// Claims the next open case that is due, of a provider not in `full`, for a
    /// while (its next ask moves 30 s on), so that it is asked outside a transaction.
    async fn claim_due(&self, full: &[String]) -> Result<Option<AskRow>, fenceline_bus::Error> {
        let case: Option<AskRow> = sqlx::query_as(
            "WITH clock AS (SELECT now_us() AS now_us) \
             UPDATE cases SET next_ask_at_us = clock.now_us + 30000000 FROM clock WHERE case_id = ( \
                 SELECT case_id FROM cases, clock WHERE state = 'asking' AND next_ask_at_us <= clock.now_us \
                 AND NOT (coalesce(provider, '') = ANY($1)) \
                 ORDER BY next_ask_at_us LIMIT 1 FOR UPDATE OF cases SKIP LOCKED) \
             RETURNING case_id, task_id, attempt, kind, step, provider, operation_key, provider_request_id, \
                       received, asked, ask_until_us, never_received_counts_from_us, clock.now_us, traceparent",
        )
        .bind(full)
        .fetch_optional(&self.pool)
        .await?;
        Ok(case)
    }

    /// Asks the provider about one claimed case and decides, or sets its next ask.
    async fn ask(&self, case: AskRow) -> Result<(), fenceline_bus::Error> {
        let provider = case.provider.as_deref().and_then(|p| self.providers.get(p));
        let (answer, mut found) = match (provider, case.provider_request_id.as_deref(), case.operation_key.as_deref()) {
            // The provider named a request id for the call: it is polled, at any
            // provider, and no answer to a poll is "never received".
            (Some(provider), Some(request_id), _) => {
                let polled = provider.poll(request_id).await;
                let _ = fenceline_bus::faults::drops("reconciler.after_lookup_answer");
                self.judge(provider, polled_as_lookup(polled)).await
            }
            (Some(provider), None, Some(key)) => {
                let lookup = provider.lookup(key).await;
                // The provider answered; nothing of its answer is saved yet.
                let _ = fenceline_bus::faults::drops("reconciler.after_lookup_answer");
                self.judge(provider, lookup).await
            }
            _ => (Judged::NoAnswer, evidence("reconciler", "no provider or operation key to ask with")),
        };
        found.observed_at = Timestamp::now();
        // Only what this look-up found is appended: a fenced worker's report may
        // have reached the case while the provider was asked.
        let mut all = vec![found];
        let backoff = Backoff {
            base: Duration::from_millis(self.settings.ask_base_ms),
            cap: Duration::from_millis(self.settings.ask_cap_ms),
        };
        let mut until = Duration::from_micros(u64::try_from(case.ask_until_us - case.now_us).unwrap_or(0));
        if matches!(answer, Judged::NotFinished) {
            // The provider has the work and is doing it: its result is worth waiting
            // for past the task's deadline (no new attempt starts; a paid result is
            // recovered), for as long again as a case without a deadline is asked.
            until += Duration::from_millis(self.settings.ask_for_ms);
        }
        let domain_answer = match &answer {
            Judged::Recovered(_) | Judged::BadResult => LookupAnswer::Found { finished: true },
            Judged::NotFinished => LookupAnswer::Found { finished: false },
            Judged::NeverReceived => LookupAnswer::NeverReceived,
            Judged::NoAnswer | Judged::DoneUnreachable => LookupAnswer::NoAnswer,
        };
        let settles_in =
            Duration::from_micros(u64::try_from(case.never_received_counts_from_us - case.now_us).unwrap_or(0));
        let received = case.received
            || matches!(domain_answer, LookupAnswer::Found { .. })
            || matches!(answer, Judged::DoneUnreachable);
        let next = match domain_answer {
            LookupAnswer::NeverReceived if case.received => {
                all.push(evidence(
                    "reconciler",
                    "the provider had received this call (an earlier answer showed it); a later \"never received\" \
                     cannot undo that, and is taken as no answer",
                ));
                after_lookup(
                    domain_answer,
                    true,
                    u32::try_from(case.asked).unwrap_or(0),
                    until,
                    &backoff,
                    rand::random(),
                )
            }
            // The lost worker's request may still be on its way: not yet evidence
            // that nothing was done. Ask again once it can no longer arrive.
            LookupAnswer::NeverReceived if !settles_in.is_zero() => {
                all.push(evidence(
                    "reconciler",
                    "the provider has no record of it yet, but a request of the lost worker could still arrive; \
                     asking again once it cannot",
                ));
                AfterLookup::AskAgainIn(settles_in)
            }
            answer => after_lookup(
                answer,
                case.received,
                u32::try_from(case.asked).unwrap_or(0),
                until,
                &backoff,
                rand::random(),
            ),
        };
        let task_id = TaskId::from_uuid(case.task_id);
        let mut tx = self.pool.begin().await?;
        let (decision, result, case_ref) = match (next, answer) {
            (AfterLookup::Recover, Judged::Recovered(result)) => {
                if self.is_last_call(&case.kind, case.step.as_deref()) {
                    (Some(RecoveryDecision::Recovered), Some(result), None)
                } else {
                    all.push(evidence(
                        "reconciler",
                        "the provider has the step's result, but resuming a multi-step task from a recovered \
                         step is not automated",
                    ));
                    (Some(RecoveryDecision::NeedsHuman), None, None)
                }
            }
            (AfterLookup::Recover, Judged::BadResult) => {
                all.push(evidence(
                    "reconciler",
                    "the provider did the work (it is paid for), but its artifact does not match its checksum: a \
                     person decides whether to accept it, attach a good one, or pay for the work again",
                ));
                (Some(RecoveryDecision::NeedsHuman), None, Some(case.case_id.to_string()))
            }
            (AfterLookup::RetrySafe, _) => (Some(RecoveryDecision::RetrySafe), None, None),
            (AfterLookup::OutcomeUnknown, Judged::NotFinished) => {
                all.push(evidence(
                    "reconciler",
                    "the provider has the work and was still doing it when Fenceline stopped asking; it may still \
                     finish it and bill it",
                ));
                (Some(RecoveryDecision::OutcomeUnknown), None, Some(case.case_id.to_string()))
            }
            (AfterLookup::OutcomeUnknown, Judged::DoneUnreachable) => {
                all.push(evidence(
                    "reconciler",
                    "the provider did the work (it is paid for), but its artifact could not be fetched before the \
                     task's deadline: a person decides whether to fetch and attach it, or to pay for the work again",
                ));
                (Some(RecoveryDecision::NeedsHuman), None, Some(case.case_id.to_string()))
            }
            (AfterLookup::OutcomeUnknown, _) => {
                all.push(evidence("reconciler", "no answer from the provider before the task's deadline"));
                (Some(RecoveryDecision::OutcomeUnknown), None, Some(case.case_id.to_string()))
            }
            (AfterLookup::AskAgainIn(wait), _) => {
                sqlx::query(
                    "UPDATE cases SET asked = asked + 1, \
                     next_ask_at_us = now_us() + $2, \
                     evidence = evidence || $3, received = received OR $4 \
                     WHERE case_id = $1 AND state = 'asking'",
                )
                .bind(case.case_id)
                .bind(i64::try_from(wait.as_micros()).unwrap_or(i64::MAX / 4))
                .bind(sqlx::types::Json(&all))
                .bind(received)
                .execute(&mut *tx)
                .await?;
                (None, None, None)
            }
            (AfterLookup::Recover, _) => (None, None, None),
        };
        if let Some(decision) = decision {
            let updated: Option<sqlx::types::Json<Vec<Evidence>>> = sqlx::query_scalar(
                "UPDATE cases SET state = 'decided', decision = $2, evidence = evidence || $3, decided_at = now(), \
                 received = received OR $4 WHERE case_id = $1 AND state = 'asking' RETURNING evidence",
            )
            .bind(case.case_id)
            .bind(decision.as_str())
            .bind(sqlx::types::Json(&all))
            .bind(received)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(all) = updated {
                let decided = fenceline_events::RecoveryDecided {
                    case_id: case_ref,
                    result,
                    ..recovery(task_id, case.attempt, decision, all.0)
                };
                decide(&mut tx, &self.outbox, decided).await?;
                info!(%task_id, attempt = case.attempt, %decision, "case decided on the provider's evidence");
            }
        }
        tx.commit().await?;
        self.outbox.committed();
        Ok(())
    }

    fn is_last_call(&self, kind: &str, step: Option<&str>) -> bool {
        crate::watches::is_last_call(&self.catalog, kind, step)
    }

    async fn judge(&self, provider: &HttpProvider, lookup: Lookup) -> (Judged, Evidence) {
        let source = format!("provider {}", provider.name);
        match lookup {
            Lookup::NeverReceived => {
                (Judged::NeverReceived, evidence(&source, "look-up: never received this operation"))
            }
            Lookup::NoAnswer(why) => (Judged::NoAnswer, evidence(&source, format!("look-up: no answer ({why})"))),
            Lookup::Found { request_id, result: None } => {
                (Judged::NotFinished, evidence(&source, format!("look-up: received as {request_id}, not finished yet")))
            }
            Lookup::Found { request_id, result: Some(result) } => match provider.verify(&result).await {
                Ok(()) => (
                    Judged::Recovered(ArtifactRef {
                        uri: result.uri,
                        sha256: result.sha256,
                        size_bytes: result.size_bytes,
                    }),
                    evidence(&source, format!("look-up: done as {request_id}; artifact checksum verified")),
                ),
                Err(e @ VerifyError::Mismatch { .. }) => {
                    (Judged::BadResult, evidence(&source, format!("look-up: done as {request_id}, but {e}")))
                }
                Err(e) => (
                    Judged::DoneUnreachable,
                    evidence(
                        &source,
                        format!("look-up: done as {request_id}, but its artifact could not be fetched: {e}"),
                    ),
                ),
            },
        }
    }
}

/// A poll of the request id the provider named, read as a look-up's answer. The
/// provider received the call, so no poll outcome (a `404` of an expired job, a
/// gateway's page, a refused connection) is "never received": it is no answer.
fn polled_as_lookup(polled: CallAnswer) -> Lookup {
    match polled {
        CallAnswer::Done { request_id, result } => Lookup::Found { request_id, result: Some(result) },
        CallAnswer::Accepted { request_id } => Lookup::Found { request_id, result: None },
        CallAnswer::Outcome(outcome, detail) => Lookup::NoAnswer(format!(
            "polling the request id: {outcome:?}{}",
            detail.map(|d| format!(" ({d})")).unwrap_or_default()
        )),
    }
}

#[derive(Debug)]
enum Judged {
    Recovered(ArtifactRef),
    /// Done and paid for, but the artifact does not match its checksum.
    BadResult,
    /// Received, still being done: in progress, not "no answer".
    NotFinished,
    /// Done (and paid for), but its artifact could not be fetched: asked again, and
    /// a person's case (not "unknown") if it stays so.
    DoneUnreachable,
    NeverReceived,
    NoAnswer,
}

#[cfg(test)]
mod tests;
