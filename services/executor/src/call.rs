//! One paid step: the call intent, the request, and what follows its answer
//! (docs/provider-protocol.md, "Error classes"). Once the provider accepted the
//! work, no poll outcome is "nothing done": failed polls are asked again with
//! backoff within the attempt budget, then the attempt fails as ambiguous with the
//! same operation key. The key changes only after a definite "nothing was done",
//! in the same fenced write that ends the attempt.
//!
//! A paid request starts only while the task's deadline has not passed and the
//! lease, freshly renewed, surely holds for its send window plus the lease margin
//! (docs/execution.md, "Executor"; docs/decisions.md, entries 11 and 35, on why the
//! lease need not cover the whole call, nor a slow connection).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::fault;
use fenceline_config::catalog::{Catalog, StepSpec};
use fenceline_domain::calls::{
    Backoff, CallOutcome, CallStage, NextMove, after_outcome, key_forgotten, key_remembered, operation_key,
};
use fenceline_domain::spend::{self, Amount};
use fenceline_domain::vocabulary::{AttemptOutcome, ErrorClass, Phase, ReleaseReason};
use fenceline_events::{
    ArtifactRef, AttemptSucceeded, CallIntentRecorded, Event, FencedResultReported, ProviderAccepted, Timestamp,
};
use fenceline_providers::{CallAnswer, HttpProvider, Lookup, ProviderResult, VerifyError};
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::ExecutorSettings;
use crate::lease::{LEASE_MARGIN, Lease, Stop, jitter};
use crate::output::{StepResult, hex_sha, shown_output, step_output};
use crate::record::{Checkpoint, NewKey, Recorder, Transition};

/// The longest wait between two polls or two sends of one call, whatever the backoff says.
const CALL_BACKOFF_CAP: Duration = Duration::from_secs(5);

/// When an attempt must stop, by the monotonic clock (converted from the
/// database's instants at the claim).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ends {
    /// The attempt budget runs out: first claim plus the grant's `lease_budget_ms`.
    pub budget: Instant,
    /// The task's deadline: no paid call starts after it.
    pub deadline: Option<Instant>,
}

/// What the lease must surely cover when a paid request starts: half the call
/// timeout, at most 1 s. The connection may take longer (the connect bound in
/// `shared/providers`, up to 5 s, a TLS handshake included); such a request is
/// counted in flight for the whole call timeout (docs/decisions.md, entry 35).
pub(crate) fn send_window(call_timeout: Duration) -> Duration {
    call_timeout.min(Duration::from_secs(2)) / 2
}

/// The provider calls of a process's workers: each step's call, its result
/// followed and verified, and its checkpoint, recorded through [`Recorder`].
#[derive(Debug, Clone)]
pub struct Calls {
    pub pool: PgPool,
    pub catalog: Arc<Catalog>,
    pub providers: Arc<HashMap<String, HttpProvider>>,
    pub settings: Arc<ExecutorSettings>,
    pub recorder: Recorder,
}

impl Calls {
    /// One paid step. `Ok(Some(result))`: checkpointed; `Ok(None)`: the attempt
    /// ended here (failed, released) and its event is written. `begun`: the claim
    /// already wrote the step's `step_started`, and read this call `seq` (its cancel
    /// flag was read there too, and answered before any step).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn call_step(
        &self,
        step: &StepSpec,
        lease: &mut Lease,
        input: serde_json::Value,
        shutdown: &CancellationToken,
        ends: Ends,
        finishes: bool,
        begun: Option<i32>,
    ) -> Result<Option<StepResult>, Stop> {
        let Some((provider_name, operation)) = step.call() else {
            return Ok(None);
        };
        let Some(provider) = self.providers.get(provider_name) else {
            let message = format!("no provider `{provider_name}`");
            self.recorder.fail(lease, ErrorClass::Rejected, &message, None, false, None).await?;
            return Ok(None);
        };
        // Before the intent, cancellation and shutdown still cost nothing.
        let (seq, cancel_requested) = match begun {
            Some(seq) => (seq, false),
            None => {
                let start = Transition::to(Phase::StepStarted).step(&step.name).sequence_of(&step.name);
                let started = self.recorder.record(lease, start, &[]).await?;
                let seq = match started.seq {
                    Some(seq) => seq,
                    // A retry found the write committed before; the seq is read on its own.
                    None => crate::record::sequence(&mut *self.pool.acquire().await?, lease, &step.name).await?,
                };
                (seq, started.cancel_requested)
            }
        };
        if cancel_requested || shutdown.is_cancelled() {
            let reason = if cancel_requested { ReleaseReason::Cancelled } else { ReleaseReason::ShutdownBeforeIntent };
            self.recorder.release(lease, reason).await?;
            return Ok(None);
        }
        let past_deadline = format!(
            "the task's deadline passed before step `{}` could call `{provider_name}`; nothing was sent",
            step.name
        );
        // A new generation's first call of the step in doubt: a provider that can be
        // asked is asked about the earlier key, and one that dedupes is sent it again.
        let capabilities = provider.capabilities();
        let doubt = if capabilities.lookup || capabilities.idempotency_keys {
            self.key_of_the_doubt(lease, &step.name, seq).await?
        } else {
            None
        };
        if let Some((earlier_key, earlier_seq)) = doubt.as_ref().filter(|_| capabilities.lookup) {
            let window = self.send_window_of(provider_name);
            let earlier = Call {
                step: &step.name,
                provider,
                operation,
                key: earlier_key,
                seq: *earlier_seq,
                window,
                budget_ends: ends.budget,
                finishes,
                prices: self.prices_of(step),
            };
            if let Some(settled) = self.ask_about_the_doubt(lease, &earlier, &input).await? {
                return Ok(settled);
            }
        }
        fault!("executor.before_call_intent");
        // Whatever the earlier request under the key in doubt did, a provider that
        // dedupes answers from its memory of that key.
        let resend = doubt.filter(|_| capabilities.idempotency_keys);
        let fresh = || {
            let generation = u32::try_from(lease.generation).unwrap_or_default();
            (operation_key(lease.task_id, &step.name, generation, u32::try_from(seq).unwrap_or_default()), seq)
        };
        let (mut key, mut seq) = resend.clone().unwrap_or_else(fresh);
        // A provider that remembers keys for a while may take a key it forgot as
        // new work: past its window a key is never sent again.
        let memory = self.catalog.provider(provider_name).and_then(|p| p.key_memory());
        let mut forgotten = None;
        if let (Some(memory), true) = (memory, capabilities.idempotency_keys) {
            let (first, now) =
                crate::record::key_first_sent(&mut *self.pool.acquire().await?, lease, &step.name, &key).await?;
            if let Some(first) = first.filter(|first| !key_remembered(*first, now, Some(memory))) {
                let why = key_forgotten(provider_name, memory, &Timestamp(first).to_rfc3339());
                if resend.is_some() {
                    // A person's retry_as_new acknowledged a second charge: a new operation.
                    warn!(task_id = %lease.task_id, step = %step.name, "{why}; a new operation is sent instead");
                    (key, seq) = fresh();
                } else {
                    forgotten = Some(why);
                }
            }
        }
        // No new paid call starts after the deadline. A key an earlier call sent
        // is no new call: sent again, a provider that dedupes answers from its
        // memory of the work that call may have done.
        if self.past_deadline_for(lease, ends, &key).await? {
            self.recorder.fail(lease, ErrorClass::Rejected, &past_deadline, None, false, None).await?;
            return Ok(None);
        }
        let intent = Event::CallIntentRecorded(CallIntentRecorded {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.name.clone(),
            operation_key: key.clone(),
            provider: provider_name.to_owned(),
            recorded_at: crate::clock::now(),
        });
        let intended = self
            .recorder
            .record(lease, Transition::to(Phase::CallIntent).step(&step.name).call(&key, None).renewing(), &[intent])
            .await?;
        fault!("executor.after_call_intent");
        if let Some(why) = forgotten {
            // Not sent: the earlier request under this key may have done the work,
            // and the provider may no longer know it. The reconciler asks a person.
            self.recorder
                .fail(lease, ErrorClass::Ambiguous, &format!("{why}; not sent again"), None, true, None)
                .await?;
            return Ok(None);
        }
        // Nothing has left yet. If the call may not start, say so with a fenced
        // write, so that no one has to wonder whether a call was made.
        if self.past_deadline_for(lease, ends, &key).await? {
            self.recorder.fail(lease, ErrorClass::Rejected, &past_deadline, None, false, None).await?;
            return Ok(None);
        }
        let window = self.send_window_of(provider_name);
        // The intent's write renewed the lease by the database's clock; only a write
        // found committed on a retry (which renewed nothing here) renews again.
        let holds = if intended.renewed { lease.holds_for(window) } else { self.may_send(lease, window).await? };
        if !holds {
            let message = format!(
                "the lease would not surely hold until the request had left ({} ms and the {} ms margin); not sent",
                window.as_millis(),
                LEASE_MARGIN.as_millis()
            );
            self.recorder.fail(lease, ErrorClass::NotSent, &message, None, false, None).await?;
            warn!(task_id = %lease.task_id, "{message}");
            return Ok(None);
        }
        let call = Call {
            step: &step.name,
            provider,
            operation,
            key: &key,
            seq,
            window,
            budget_ends: ends.budget,
            finishes,
            prices: self.prices_of(step),
        };
        let answer = provider.start_task(&lease.task_id.to_string(), operation, input.clone(), &key).await;
        fault!("executor.after_provider_answer");
        self.follow(lease, &call, input, answer).await
    }

    /// Before a new generation (a person's `retry_as_new`) pays again for the step
    /// that was in doubt, a provider that can be asked is asked once more about the
    /// operation in doubt: evidence may have come in since the case was opened.
    /// Done, or still running: it is followed to its end under its own key, and no
    /// second operation starts. Never received, or no answer: the new operation
    /// goes ahead, as the person decided. `Some`: the step was settled here.
    /// `earlier`: the call under the key in doubt ([`Workers::key_of_the_doubt`]).
    async fn ask_about_the_doubt(
        &self,
        lease: &mut Lease,
        earlier: &Call<'_>,
        input: &serde_json::Value,
    ) -> Result<Option<Option<StepResult>>, Stop> {
        let answer = match earlier.provider.lookup(earlier.key).await {
            Lookup::Found { request_id, result: Some(result) } => CallAnswer::Done { request_id, result },
            Lookup::Found { request_id, result: None } => CallAnswer::Accepted { request_id },
            Lookup::NeverReceived => {
                info!(task_id = %lease.task_id, step = earlier.step, "the operation in doubt was never received; \
                    starting the new one");
                return Ok(None);
            }
            Lookup::NoAnswer(why) => {
                warn!(task_id = %lease.task_id, step = earlier.step, why, "the provider could not say what became of \
                    the operation in doubt; starting the new one, as a person decided");
                return Ok(None);
            }
        };
        info!(task_id = %lease.task_id, step = earlier.step, "the provider received the operation in doubt after all; \
            following it instead of paying again");
        // The call this attempt follows is the earlier one: its intent names that key,
        // so that a loss from here on opens a case on the key in doubt (and a later
        // generation follows the same key), with this step's provider.
        let intent = Event::CallIntentRecorded(CallIntentRecorded {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: earlier.step.to_owned(),
            operation_key: earlier.key.to_owned(),
            provider: earlier.provider.name().to_owned(),
            recorded_at: crate::clock::now(),
        });
        let following = Transition::to(Phase::CallIntent).step(earlier.step).call(earlier.key, None);
        self.recorder.record(lease, following, &[intent]).await?;
        self.follow(lease, earlier, input.clone(), answer).await.map(Some)
    }

    /// The operation key of the call in doubt that a person's `retry_as_new` answers,
    /// with its `seq`: the key the latest earlier generation that sent one actually
    /// sent for `step` (which may be a still earlier generation's key that it sent
    /// again or followed), when this is a new generation's first call of the step
    /// (`seq` 0). `None` otherwise.
    async fn key_of_the_doubt(&self, lease: &Lease, step: &str, seq: i32) -> Result<Option<(String, i32)>, Stop> {
        if lease.generation == 0 || seq != 0 {
            return Ok(None);
        }
        let earlier: Option<(String, i32)> = sqlx::query_as(
            "SELECT sent_key, seq FROM call_sequences WHERE task_id = $1 AND step = $2 AND generation < $3 \
             AND sent_key IS NOT NULL ORDER BY generation DESC LIMIT 1",
        )
        .bind(lease.task_id.as_uuid())
        .bind(step)
        .bind(lease.generation)
        .fetch_optional(&self.pool)
        .await?;
        Ok(earlier)
    }

    /// Follows an answer to the end of the call: polls what was accepted, waits
    /// for a key still running, records a result, or fails the attempt.
    async fn follow(
        &self,
        lease: &mut Lease,
        call: &Call<'_>,
        input: serde_json::Value,
        mut answer: CallAnswer,
    ) -> Result<Option<StepResult>, Stop> {
        let backoff = Backoff {
            base: Duration::from_millis(self.settings.poll_ms.max(1)),
            cap: CALL_BACKOFF_CAP.max(Duration::from_millis(self.settings.poll_ms)),
        };
        let mut accepted: Option<String> = None;
        let mut tries = 0u32;
        loop {
            // A worker that lost the execution stops asking: the new holder decides.
            // A result already in hand is still verified: it cannot be recorded,
            // but it is reported as evidence (`record_result`).
            if lease.fenced() && !matches!(answer, CallAnswer::Done { .. }) {
                return Err(Stop::Fenced);
            }
            match answer {
                CallAnswer::Done { request_id, result } => {
                    return self.record_result(lease, call, &request_id, result).await;
                }
                CallAnswer::Accepted { request_id } => {
                    if lease.phase != Phase::ProviderAccepted {
                        let event = Event::ProviderAccepted(ProviderAccepted {
                            task_id: lease.task_id,
                            attempt: lease.attempt,
                            step: call.step.to_owned(),
                            operation_key: call.key.to_owned(),
                            provider_request_id: request_id.clone(),
                            accepted_at: crate::clock::now(),
                        });
                        let transition = Transition::to(Phase::ProviderAccepted).call(call.key, Some(&request_id));
                        self.recorder.record(lease, transition, &[event]).await?;
                    }
                    if Instant::now() >= call.budget_ends {
                        let message = format!("accepted as {request_id}, no result within the attempt budget");
                        self.recorder.fail(lease, ErrorClass::Ambiguous, &message, None, true, None).await?;
                        return Ok(None);
                    }
                    tries = 0;
                    pause(lease, Duration::from_millis(self.settings.poll_ms)).await?;
                    answer = call.provider.poll(&request_id).await;
                    accepted = Some(request_id);
                }
                CallAnswer::Outcome(outcome, detail) => {
                    let stage = if accepted.is_some() { CallStage::Accepted } else { CallStage::Sent };
                    let left = call.budget_ends.saturating_duration_since(Instant::now());
                    let next = after_outcome(stage, &outcome, call.provider.errors(), tries, left, &backoff, jitter());
                    tries += 1;
                    match (next, &accepted) {
                        (NextMove::PollAgainIn(wait), Some(request_id)) => {
                            warn!(task_id = %lease.task_id, request_id, ?wait, "polling failed ({}); asking again",
                                describe(&outcome, detail.as_deref()));
                            pause(lease, wait).await?;
                            answer = call.provider.poll(request_id).await;
                        }
                        (NextMove::ResendIn(wait), _) => {
                            info!(task_id = %lease.task_id, ?wait,
                                "the provider still runs a request with this key; sending it again later");
                            pause(lease, wait).await?;
                            if !self.may_send(lease, call.window).await? {
                                return Err(Stop::LeaseLapsed);
                            }
                            let task_id = lease.task_id.to_string();
                            answer = call.provider.start_task(&task_id, call.operation, input.clone(), call.key).await;
                        }
                        (NextMove::Fail { classification: c, new_key }, _) => {
                            let new_key =
                                new_key.then_some(NewKey { step: call.step, used_seq: call.seq, key: call.key });
                            let message = describe(&outcome, detail.as_deref());
                            self.recorder
                                .fail(lease, c.class, &message, c.retry_after, c.money_may_have_been_spent, new_key)
                                .await?;
                            return Ok(None);
                        }
                        (NextMove::PollAgainIn(_), None) => {
                            // Polling needs a request id; without one the outcome stays in doubt.
                            let message = describe(&outcome, detail.as_deref());
                            self.recorder.fail(lease, ErrorClass::Ambiguous, &message, None, true, None).await?;
                            return Ok(None);
                        }
                    }
                }
            }
        }
    }

    /// Verifies and checkpoints a result. A download that fails is tried again
    /// within the attempt budget (it is free); bytes that do not match end the
    /// attempt as `result_mismatch`, and so does an artifact that stays unreachable.
    /// A worker fenced meanwhile reports the verified result instead
    /// (docs/decisions.md, item 15).
    async fn record_result(
        &self,
        lease: &mut Lease,
        call: &Call<'_>,
        request_id: &str,
        result: ProviderResult,
    ) -> Result<Option<StepResult>, Stop> {
        // The provider did the work: it charges for it, whatever the verification finds.
        fenceline_telemetry::metrics::global()
            .executor
            .provider_charges
            .get_or_create(&fenceline_telemetry::metrics::ProviderLabels { provider: call.provider.name().to_owned() })
            .inc();
        let backoff = Backoff { base: Duration::from_millis(self.settings.poll_ms.max(1)), cap: CALL_BACKOFF_CAP };
        let mut tries = 0u32;
        loop {
            match call.provider.verify(&result).await {
                Ok(()) => break,
                Err(VerifyError::Unreachable(why)) => {
                    let wait = backoff.delay(tries, None, 0.5 + jitter() / 2.0);
                    tries += 1;
                    if Instant::now() + wait < call.budget_ends {
                        warn!(task_id = %lease.task_id, request_id, error = %why, ?wait,
                            "the artifact could not be fetched; trying again");
                        pause(lease, wait).await?;
                        continue;
                    }
                    let message = format!("{request_id}: {}", VerifyError::Unreachable(why));
                    self.recorder.fail(lease, ErrorClass::ResultMismatch, &message, None, true, None).await?;
                    return Ok(None);
                }
                Err(e) => {
                    self.recorder
                        .fail(lease, ErrorClass::ResultMismatch, &format!("{request_id}: {e}"), None, true, None)
                        .await?;
                    return Ok(None);
                }
            }
        }
        let result_usage = result.usage.clone();
        let (artifact, output) = step_output(lease.task_id, lease.generation, call.step, result);
        let finishing = call.finishes.then_some(&artifact);
        let cost = spend::cost(call.prices.per_call, call.prices.usage, &result_usage);
        if let Some(unread) = cost.as_ref().map(|cost| &cost.unread).filter(|unread| !unread.is_empty()) {
            warn!(task_id = %lease.task_id, step = call.step, ?unread,
                "the answer reported none of these priced counts; the call's cost counts none of them");
        }
        let charged = Charged { provider: call.provider.name(), cost: cost.map(|cost| cost.amount) };
        match self.checkpoint(lease, call.step, &output, Some(&artifact.sha256), finishing, Some(charged)).await {
            Ok(()) => {}
            Err(Stop::Fenced) => {
                // Another worker holds the execution and the reconciler has the case:
                // the verified result goes there as evidence, not into the checkpoints.
                let report = FencedResultReported {
                    task_id: lease.task_id,
                    attempt: lease.attempt,
                    grant_id: lease.grant_id,
                    fencing_token: lease.token,
                    step: call.step.to_owned(),
                    operation_key: call.key.to_owned(),
                    provider_request_id: Some(request_id.to_owned()),
                    result: artifact,
                    verified_at: crate::clock::now(),
                };
                self.recorder.report(lease, &Event::FencedResultReported(report)).await;
                return Err(Stop::Fenced);
            }
            Err(e) => return Err(e),
        }
        fault!("executor.after_result_recorded");
        Ok(Some(StepResult { artifact, output }))
    }

    /// Whether the task's deadline has passed for a call with `key`: never for a
    /// key another attempt of the task sent already (a resend is not a new call).
    async fn past_deadline_for(&self, lease: &Lease, ends: Ends, key: &str) -> Result<bool, Stop> {
        if ends.deadline.is_none_or(|d| Instant::now() < d) {
            return Ok(false);
        }
        let sent_before: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM executions WHERE task_id = $1 AND operation_key = $2 AND grant_id <> $3)",
        )
        .bind(lease.task_id.as_uuid())
        .bind(key)
        .bind(lease.grant_id.as_uuid())
        .fetch_one(&self.pool)
        .await?;
        Ok(!sent_before)
    }

    /// Renews the lease and answers whether it surely holds for `window` more (with
    /// the margin). A renewal that fails leaves the lease as the last one granted.
    async fn may_send(&self, lease: &Lease, window: Duration) -> Result<bool, Stop> {
        match crate::lease::renew(&self.pool, self.settings.lease_ms, lease).await {
            Ok(true) => {}
            Ok(false) => return Err(Stop::Fenced),
            Err(e) => warn!(task_id = %lease.task_id, error = %e, "renewing the lease before a call failed"),
        }
        Ok(lease.holds_for(window))
    }

    /// What a call of `step` is priced by: its price per call and its provider's usage prices.
    fn prices_of<'a>(&'a self, step: &StepSpec) -> Prices<'a> {
        static NONE: std::sync::LazyLock<BTreeMap<String, Amount>> = std::sync::LazyLock::new(BTreeMap::new);
        let provider = step.call().and_then(|(provider, _)| self.catalog.provider(provider));
        Prices {
            per_call: self.catalog.price_per_call_minor(step),
            usage: provider.map_or(&*NONE, |provider| &provider.usage_prices),
        }
    }

    fn send_window_of(&self, provider: &str) -> Duration {
        self.catalog.providers.get(provider).map_or(Duration::from_secs(1), |spec| send_window(spec.call_timeout()))
    }

    /// Records a finished step (`result_recorded`) with its output and announces it.
    /// Given `finishing`, the attempt's result, the same write also finishes the
    /// attempt (`finished`, `succeeded`) and announces that after the checkpoint:
    /// nothing is left to do between the last step's checkpoint and the attempt's
    /// end, so they need not be two commits.
    pub(crate) async fn checkpoint(
        &self,
        lease: &mut Lease,
        step: &str,
        output: &serde_json::Value,
        sha256: Option<&str>,
        finishing: Option<&ArtifactRef>,
        charged: Option<Charged<'_>>,
    ) -> Result<(), Stop> {
        let sha = sha256.map_or_else(|| hex_sha(output), str::to_owned);
        let checkpointed = Event::StepCheckpointed(fenceline_events::StepCheckpointed {
            task_id: lease.task_id,
            attempt: lease.attempt,
            step: step.to_owned(),
            output_ref: format!("checkpoint:{}:{}:{step}", lease.task_id, lease.generation),
            sha256: sha.clone(),
            checkpointed_at: crate::clock::now(),
            generation: Some(lease.generation),
            output_json: shown_output(output),
            provider: charged.as_ref().map(|charged| charged.provider.to_owned()),
            cost_micros: charged.as_ref().and_then(|charged| charged.cost).map(Amount::micros),
        });
        let mut transition = Transition {
            checkpoint: Some(Checkpoint { step, output, sha256: &sha }),
            ..Transition::to(Phase::ResultRecorded).step(step)
        };
        let mut events = vec![checkpointed];
        if let Some(result) = finishing {
            transition = Transition { phase: Phase::Finished, ..transition.status(AttemptOutcome::Succeeded) };
            events.push(succeeded(lease, result.clone()));
        }
        self.recorder.record(lease, transition, &events).await?;
        if let Some(Charged { provider, cost: Some(cost) }) = charged {
            fenceline_telemetry::metrics::global()
                .executor
                .provider_spend
                .get_or_create(&fenceline_telemetry::metrics::ProviderLabels { provider: provider.to_owned() })
                .inc_by(cost.as_minor_f64());
        }
        Ok(())
    }
}

/// What a call that did its work is priced by.
#[derive(Debug, Clone, Copy)]
struct Prices<'a> {
    per_call: Option<Amount>,
    usage: &'a BTreeMap<String, Amount>,
}

/// The provider a checkpointed call charged, and what it cost (`None`: unpriced).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Charged<'a> {
    provider: &'a str,
    cost: Option<Amount>,
}

/// One call in progress: what a retry of the same request needs.
struct Call<'a> {
    step: &'a str,
    provider: &'a HttpProvider,
    operation: &'a str,
    key: &'a str,
    /// The `seq` the key was made with.
    seq: i32,
    /// How long the request may take to leave ([`send_window`]).
    window: Duration,
    budget_ends: Instant,
    /// The kind's last step: its checkpoint also finishes the attempt.
    finishes: bool,
    prices: Prices<'a>,
}

/// Sleeps, unless the worker is fenced meanwhile.
async fn pause(lease: &Lease, wait: Duration) -> Result<(), Stop> {
    tokio::select! {
        _ = lease.fenced.cancelled() => Err(Stop::Fenced),
        _ = tokio::time::sleep(wait) => Ok(()),
    }
}

/// An outcome in words, with what the transport said when it failed.
fn describe(outcome: &CallOutcome, detail: Option<&str>) -> String {
    let said = match outcome {
        CallOutcome::NotSent => "the request was not sent".to_owned(),
        CallOutcome::Answered { status, problem_body: true, .. } => format!("the provider answered {status}"),
        CallOutcome::Answered { status, problem_body: false, .. } => {
            format!("{status} without the provider's problem body (a gateway's answer?)")
        }
        // The scheduler reads timeouts in attempt outcomes by this phrase.
        CallOutcome::TimedOutAfterSend => fenceline_domain::limits::TIMED_OUT_AFTER_SEND.to_owned(),
        CallOutcome::ResetMidResponse => "the connection broke before the answer was read".to_owned(),
    };
    match detail {
        Some(detail) => format!("{said}: {detail}"),
        None => said,
    }
}

/// The attempt's success, with the result of its last step.
pub(crate) fn succeeded(lease: &Lease, result: ArtifactRef) -> Event {
    Event::AttemptSucceeded(AttemptSucceeded {
        task_id: lease.task_id,
        attempt: lease.attempt,
        grant_id: lease.grant_id,
        result,
        finished_at: crate::clock::now(),
    })
}
