//! The task lifecycle as a pure state machine (docs/execution.md):
//! `(task, input, now) -> (task, effects)`. The scheduler stores the task, carries
//! out the effects and publishes a status whenever the transition says so. Inputs
//! about an attempt that is not the live one (stale, duplicated) change nothing;
//! inputs that arrive before what they answer (another topic was faster) are kept
//! and applied when it arrives.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::calls::Backoff;
use crate::ids::GrantId;
use crate::standing::{self, OnUnknown, SendAgain};
use crate::vocabulary::{
    ApprovalDecision, ErrorClass, Phase, RecoveryDecision, ReleaseReason, ResolutionAction, TaskState,
};

mod people;
use people::SIGNALS_KEPT;
pub use people::{KeptSignal, REJECTED_BY_PERSON};

/// Microseconds since the Unix epoch (the wire's instant), so this module needs no clock.
pub type Micros = i64;

fn after(now: Micros, wait: Duration) -> Micros {
    now.saturating_add(i64::try_from(wait.as_micros()).unwrap_or(i64::MAX))
}

/// A verifiable result, as the lifecycle keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub uri: String,
    pub sha256: String,
    pub size_bytes: i64,
}

/// The retry policy of one kind: the one place retries are decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Attempts that may fail before a person is asked (busy and throttled do not count).
    pub max_attempts: u32,
    pub backoff: Backoff,
    /// How long a released-as-busy task waits before it is granted again.
    pub busy_wait: Duration,
    /// The steps whose catalogue entry sends a new operation after an outcome
    /// nobody could establish, by step name; every other step asks a person.
    pub send_again: Vec<(String, SendAgain)>,
}

impl Policy {
    /// The standing decision of `step`, if the catalogue made one.
    pub fn send_again_at(&self, step: &str) -> Option<&SendAgain> {
        self.send_again.iter().find(|(name, _)| name == step).map(|(_, policy)| policy)
    }
}

/// A recovery decision heard before the end of the attempt it answers: the
/// decision travels on `fenceline.recovery`, the loss on `fenceline.attempts`, and
/// nothing orders the two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EarlyDecision {
    pub attempt: u32,
    pub decision: RecoveryDecision,
    pub result: Option<Artifact>,
    pub case_id: Option<String>,
    pub jitter: f64,
}

/// Everything the scheduler knows about one task's lifecycle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub state: TaskState,
    pub reason: Option<String>,
    /// Number of the last attempt granted (0: none yet). Grows by one per grant.
    pub attempt: u32,
    /// Attempts that failed and count against `max_attempts`.
    pub failures: u32,
    /// Throttled answers in a row (for their own backoff).
    pub throttles: u32,
    /// Grows only when a person resolves `retry_as_new`.
    pub generation: u32,
    /// The one grant that may be running, if any.
    pub live_grant: Option<GrantId>,
    /// When the task may next be granted; `None` while it may not be.
    pub due_at: Option<Micros>,
    pub deadline: Option<Micros>,
    /// The attempt's call outcome is being checked; no retry until evidence arrives.
    pub awaiting_evidence: bool,
    pub cancel_requested: bool,
    /// The signal an approval step waits for.
    pub awaiting_signal: Option<String>,
    /// The last step whose completion the next attempt resumes after (an approval).
    pub resume_after_step: Option<String>,
    pub step: Option<String>,
    pub phase: Option<Phase>,
    pub result: Option<Artifact>,
    /// The case a person must decide (`outcome_unknown`, `needs_human`); a
    /// resolution names it and is ignored for any other.
    pub case_id: Option<String>,
    /// A decision for the live attempt heard before that attempt ended in doubt.
    #[serde(default)]
    pub early_decision: Option<EarlyDecision>,
    /// Signals heard before their wait began; a wait for one of them ends at once.
    #[serde(default)]
    pub kept_signals: Vec<KeptSignal>,
    /// The ids of the latest signals that ended a wait, newest last.
    #[serde(default)]
    pub consumed_signals: Vec<String>,
    /// The next try sends again an operation key whose earlier call may have done
    /// (and billed) the work, to a provider that dedupes by it: a resend, not a new
    /// operation. Until it is answered, the task cannot end as "failed before it
    /// could run", and a refusal of the resend does not say the work was not done.
    #[serde(default)]
    pub key_in_doubt: bool,
    /// The extra charges the catalogue's policy made for this task, by step: each
    /// a new operation sent after an outcome nobody could establish.
    #[serde(default)]
    pub sent_again: BTreeMap<String, u32>,
}

/// What happened, as the scheduler learned it.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The scheduler found a slot and a rate token: grant the next attempt.
    Grant {
        grant_id: GrantId,
    },
    Claimed {
        grant_id: GrantId,
    },
    Progress {
        grant_id: GrantId,
        step: String,
        phase: Phase,
    },
    Succeeded {
        grant_id: GrantId,
        result: Artifact,
    },
    Failed {
        grant_id: GrantId,
        class: ErrorClass,
        message: String,
        retry_after: Option<Duration>,
        jitter: f64,
    },
    Released {
        grant_id: GrantId,
        reason: ReleaseReason,
        step: Option<String>,
        signal: Option<String>,
    },
    Lost {
        grant_id: GrantId,
        phase: Phase,
    },
    Recovery {
        attempt: u32,
        decision: RecoveryDecision,
        result: Option<Artifact>,
        case_id: Option<String>,
        jitter: f64,
    },
    CancelRequested,
    Signal {
        name: String,
        /// The signal's identity (intake's dedupe): a signal ends one wait at most.
        signal_id: String,
        /// The approval step whose wait it answers; `None`: any wait for `name`.
        step: Option<String>,
        /// The generation whose wait it answers; `None`: any.
        generation: Option<u32>,
        /// Whether it lets the task go on or ends it.
        decision: ApprovalDecision,
    },
    Resolution {
        /// The case the person read; a resolution of any other case changes nothing.
        case_id: String,
        action: ResolutionAction,
        result: Option<Artifact>,
    },
    DeadlinePassed,
    /// The dispatcher passed over a due task because its provider's slots are
    /// full under a reduced limit: the reason says so (the state does not change).
    Held {
        reason: String,
    },
}

/// What the scheduler must do besides storing the task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Publish the grant for `attempt`.
    Dispatch { grant_id: GrantId, attempt: u32, generation: u32, resume_after_step: Option<String> },
    /// Ask the executor to stop the attempt cooperatively.
    CancelAttempt { grant_id: GrantId },
    /// The attempt ended: give its slot back.
    ReleaseSlot { grant_id: GrantId },
}

/// The outcome of one input.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub task: Task,
    pub effects: Vec<Effect>,
    /// Whether anything a user sees changed (publish a status).
    pub visible: bool,
}

impl Task {
    /// A task just accepted: queued, due at once or at `not_before`.
    pub fn accepted(now: Micros, not_before: Option<Micros>, deadline: Option<Micros>) -> Self {
        let (state, reason) = match not_before {
            Some(at) if at > now => (TaskState::Waiting, Some("not before its start time".to_owned())),
            _ => (TaskState::Queued, None),
        };
        Task {
            state,
            reason,
            attempt: 0,
            failures: 0,
            throttles: 0,
            generation: 0,
            live_grant: None,
            due_at: Some(not_before.map_or(now, |at| at.max(now))),
            deadline,
            awaiting_evidence: false,
            cancel_requested: false,
            awaiting_signal: None,
            resume_after_step: None,
            step: None,
            phase: None,
            result: None,
            case_id: None,
            early_decision: None,
            kept_signals: Vec::new(),
            consumed_signals: Vec::new(),
            key_in_doubt: false,
            sent_again: BTreeMap::new(),
        }
    }

    /// Succeeded, failed and cancelled never change again.
    pub fn is_final(&self) -> bool {
        self.state.is_final()
    }

    /// The final state `next` reached, when the change from this task to `next`
    /// is the one that finished it (a task finishes once).
    pub fn ended_in(&self, next: &Task) -> Option<TaskState> {
        (!self.is_final() && next.is_final()).then_some(next.state)
    }

    fn is_live(&self, grant_id: GrantId) -> bool {
        self.live_grant == Some(grant_id)
    }

    /// Whether a report that the live attempt reached `phase` of `step` is behind
    /// what the task already shows of it, so that applying it would move the shown
    /// step or phase back (a report heard again, after later ones). `order` places
    /// a step among its kind's steps (`None`: not one of them); a report whose place
    /// cannot be told beside the shown step's is taken for behind.
    pub fn report_is_behind(&self, order: impl Fn(&str) -> Option<usize>, step: &str, phase: Phase) -> bool {
        let Some(shown) = self.step.as_deref() else {
            return false;
        };
        let rank = |phase: Option<Phase>| phase.and_then(|p| Phase::ALL.iter().position(|q| *q == p));
        let places = if shown == step { Some((0, 0)) } else { order(shown).zip(order(step)) };
        match places {
            Some((shown_at, step_at)) => (step_at, rank(Some(phase))) < (shown_at, rank(self.phase)),
            None => true,
        }
    }

    /// Whether the task waits for a person's decision (which names `case_id`).
    pub fn awaits_a_person(&self) -> bool {
        matches!(self.state, TaskState::OutcomeUnknown | TaskState::NeedsHuman)
    }

    /// Applies one input.
    pub fn apply(&self, input: Input, now: Micros, policy: &Policy) -> Transition {
        let mut next = self.clone();
        let mut effects = Vec::new();
        next.step_in(input, now, policy, &mut effects);
        let visible = next.state != self.state
            || next.reason != self.reason
            || next.step != self.step
            || next.phase != self.phase
            || next.attempt != self.attempt
            || next.result != self.result
            || next.case_id != self.case_id;
        Transition { task: next, effects, visible }
    }

    fn step_in(&mut self, input: Input, now: Micros, policy: &Policy, effects: &mut Vec<Effect>) {
        if self.is_final() {
            return;
        }
        match input {
            Input::Grant { grant_id } => {
                let due = self.due_at.is_some_and(|at| at <= now);
                if matches!(self.state, TaskState::Queued | TaskState::Waiting) && self.live_grant.is_none() && due {
                    self.attempt += 1;
                    self.live_grant = Some(grant_id);
                    self.due_at = None;
                    // A decision kept for an earlier attempt can no longer apply.
                    self.early_decision = None;
                    self.state = TaskState::Queued;
                    self.reason = Some(format!("attempt {} granted; waiting for a worker", self.attempt));
                    self.step = None;
                    self.phase = None;
                    effects.push(Effect::Dispatch {
                        grant_id,
                        attempt: self.attempt,
                        generation: self.generation,
                        resume_after_step: self.resume_after_step.clone(),
                    });
                }
            }
            // A claim comes before any step of its attempt: one heard again after a
            // step was reported would show the attempt further back than it is.
            Input::Claimed { grant_id } if self.is_live(grant_id) && self.step.is_none() => {
                self.state = TaskState::Running;
                self.reason = self.cancel_reason();
                self.phase = Some(Phase::Claimed);
            }
            Input::Progress { grant_id, step, phase } if self.is_live(grant_id) => {
                self.state = TaskState::Running;
                self.step = Some(step);
                self.phase = Some(phase);
            }
            Input::Succeeded { grant_id, result } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                self.state = TaskState::Succeeded;
                self.reason = self.cancel_requested.then(|| "finished before the cancellation took effect".to_owned());
                self.phase = Some(Phase::Finished);
                self.result = Some(result);
            }
            Input::Failed { grant_id, class, message, retry_after, jitter } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                self.failed(class, message, retry_after, jitter, now, policy);
                self.apply_early_decision(now, policy);
            }
            Input::Released { grant_id, reason, step, signal } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                match reason {
                    // Earlier steps may have made paid calls; only this attempt's next call is known not to have left.
                    ReleaseReason::Cancelled => {
                        self.finish(TaskState::Cancelled, "cancelled; the worker stopped before its next provider call")
                    }
                    _ if self.cancel_requested => {
                        self.finish(TaskState::Cancelled, "cancelled; the worker handed the attempt back before a call")
                    }
                    ReleaseReason::Busy => {
                        self.wait_until(after(now, policy.busy_wait), "no provider or tenant slot free".to_owned());
                    }
                    ReleaseReason::ShutdownBeforeIntent => {
                        self.wait_until(now, "handed back by a stopping worker before any call".to_owned());
                        self.state = TaskState::Queued;
                    }
                    ReleaseReason::AwaitingSignal => {
                        let signal = signal.unwrap_or_default();
                        self.state = TaskState::AwaitingApproval;
                        self.reason = Some(format!("waiting for the signal `{signal}`"));
                        self.step = step;
                        self.phase = None;
                        let generation = self.generation;
                        let step = self.step.clone();
                        match self.kept_signals.iter().position(|k| k.answers(&signal, step.as_deref(), generation)) {
                            Some(at) => {
                                let kept = self.kept_signals.remove(at);
                                self.decided(
                                    &kept.name,
                                    kept.signal_id,
                                    kept.decision,
                                    now,
                                    "received before the wait began",
                                );
                            }
                            None => self.awaiting_signal = Some(signal),
                        }
                    }
                }
            }
            Input::Lost { grant_id, phase } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                self.awaiting_evidence = true;
                self.state = TaskState::Running;
                self.phase = Some(phase);
                self.reason =
                    Some(format!("the worker was lost after `{phase}`; waiting for the evidence about its call"));
                self.apply_early_decision(now, policy);
            }
            Input::Recovery { attempt, decision, result, case_id, jitter }
                if self.awaiting_evidence && attempt == self.attempt =>
            {
                self.recovered(decision, result, case_id, jitter, now, policy);
            }
            // The decision outran the loss it answers: keep it for when the loss arrives.
            // A recovery of the case kept early supersedes the case's first decision
            // (a fenced worker's verified result, after `outcome_unknown`).
            Input::Recovery { attempt, decision, result, case_id, jitter }
                if decision != RecoveryDecision::ReissueGrant
                    && attempt == self.attempt
                    && self.live_grant.is_some()
                    && self.early_decision.as_ref().is_none_or(|early| {
                        decision == RecoveryDecision::Recovered && case_id.is_some() && early.case_id == case_id
                    }) =>
            {
                self.early_decision = Some(EarlyDecision { attempt, decision, result, case_id, jitter });
            }
            // The case a person was to decide got proof after all: a verified result
            // of the call in doubt (docs/decisions.md, item 15). Nothing is called again.
            Input::Recovery {
                attempt, decision: RecoveryDecision::Recovered, result: Some(result), case_id, ..
            } if self.state == TaskState::OutcomeUnknown
                && attempt == self.attempt
                && case_id.is_some()
                && self.case_id == case_id =>
            {
                self.result = Some(result);
                self.finish(
                    TaskState::Succeeded,
                    "result recovered after the outcome was reported unknown: a result of the call in doubt, \
                     verified against its checksum, shows the provider did the work; no second call",
                );
            }
            Input::CancelRequested => self.cancel(effects),
            Input::Signal { signal_id, .. } if self.signal_seen(&signal_id) => {}
            // Bound to a generation a person's retry has left behind: no wait of it is left.
            Input::Signal { generation: Some(g), .. } if g < self.generation => {}
            Input::Signal { name, signal_id, step, generation, decision }
                if self.state == TaskState::AwaitingApproval
                    && self.awaiting_signal.as_deref() == Some(name.as_str())
                    && step.as_deref().is_none_or(|s| self.step.as_deref() == Some(s))
                    && generation.is_none_or(|g| g == self.generation) =>
            {
                self.decided(&name, signal_id, decision, now, "received");
            }
            // Early (its wait has not begun): kept, and consumed when that wait begins.
            Input::Signal { name, signal_id, step, generation, decision } if self.kept_signals.len() < SIGNALS_KEPT => {
                self.kept_signals.push(KeptSignal { name, signal_id, step, generation, decision })
            }
            Input::Resolution { case_id, action, result }
                if self.awaits_a_person() && self.case_id.as_deref() == Some(case_id.as_str()) =>
            {
                self.resolved(action, result, now)
            }
            Input::DeadlinePassed
                if self.live_grant.is_none()
                    && matches!(self.state, TaskState::Queued | TaskState::Waiting)
                    && self.key_in_doubt =>
            {
                self.needs_human(
                    "the deadline passed before the call could be sent again with the same operation key; the \
                     earlier call may have done and billed the work",
                    None,
                );
            }
            Input::DeadlinePassed
                if self.live_grant.is_none() && matches!(self.state, TaskState::Queued | TaskState::Waiting) =>
            {
                self.finish(TaskState::Failed, "the deadline passed before the task could run");
            }
            Input::Held { reason }
                if self.live_grant.is_none()
                    && matches!(self.state, TaskState::Queued | TaskState::Waiting)
                    && self.due_at.is_some_and(|at| at <= now) =>
            {
                self.reason = Some(reason);
            }
            // Stale or duplicate: about an attempt that is not the live one, or a case
            // that is not the open one.
            _ => {}
        }
    }

    /// The attempt just ended in doubt: a decision that arrived before applies now.
    fn apply_early_decision(&mut self, now: Micros, policy: &Policy) {
        if !self.awaiting_evidence {
            return;
        }
        if let Some(early) = self.early_decision.take().filter(|e| e.attempt == self.attempt) {
            self.recovered(early.decision, early.result, early.case_id, early.jitter, now, policy);
        }
    }

    /// Stops where a person must decide, under a case a resolution names.
    fn needs_human(&mut self, reason: &str, case_id: Option<String>) {
        if self.cancel_requested {
            return self.finish(TaskState::Cancelled, &format!("cancelled; it had stopped for a person: {reason}"));
        }
        self.case_id = Some(case_id.unwrap_or_else(|| format!("needs_human-g{}-a{}", self.generation, self.attempt)));
        self.finish(TaskState::NeedsHuman, reason);
    }

    fn cancel_reason(&self) -> Option<String> {
        self.cancel_requested.then(|| "cancellation requested; a call in flight cannot be recalled".to_owned())
    }

    fn end_attempt(&mut self, effects: &mut Vec<Effect>) {
        if let Some(grant_id) = self.live_grant.take() {
            effects.push(Effect::ReleaseSlot { grant_id });
        }
    }

    fn finish(&mut self, state: TaskState, reason: &str) {
        self.key_in_doubt = false;
        self.state = state;
        self.reason = Some(reason.to_owned());
        self.due_at = None;
        self.awaiting_evidence = false;
    }

    fn wait_until(&mut self, at: Micros, reason: String) {
        self.state = TaskState::Waiting;
        self.reason = Some(reason);
        self.due_at = Some(at);
        self.awaiting_evidence = false;
    }

    /// A failure that counts against the budget: retry later, or ask a person.
    fn retry_or_give_up(&mut self, why: String, retry_after: Option<Duration>, jitter: f64, now: Micros, p: &Policy) {
        self.failures += 1;
        if self.failures >= p.max_attempts {
            self.needs_human(&format!("attempts exhausted ({}): {why}", self.failures), None);
        } else {
            let wait = p.backoff.delay(self.failures - 1, retry_after, jitter);
            self.wait_until(after(now, wait), format!("retrying after: {why}"));
        }
    }

    fn failed(
        &mut self,
        class: ErrorClass,
        message: String,
        retry_after: Option<Duration>,
        jitter: f64,
        now: Micros,
        p: &Policy,
    ) {
        let why = format!("{class}: {message}");
        if self.cancel_requested && class == ErrorClass::ResultMismatch {
            let reason = format!("cancelled after a paid call whose result did not verify ({why})");
            return self.finish(TaskState::Cancelled, &reason);
        }
        if self.cancel_requested && class != ErrorClass::Ambiguous {
            return self.finish(TaskState::Cancelled, &format!("cancelled after the attempt failed ({why})"));
        }
        match class {
            ErrorClass::Throttled | ErrorClass::Busy => {
                self.throttles += 1;
                let wait = p.backoff.delay(self.throttles - 1, retry_after, jitter);
                self.wait_until(after(now, wait), format!("{class}; not counted as a failed attempt"));
            }
            ErrorClass::NotSent | ErrorClass::ProviderFailed => self.retry_or_give_up(why, retry_after, jitter, now, p),
            // A refusal of a resend speaks for the resend only: the earlier call
            // under the same key may have done the work.
            ErrorClass::Rejected if self.key_in_doubt => self.needs_human(
                &format!("{why}; the earlier call with this operation key may have done and billed the work"),
                None,
            ),
            ErrorClass::Rejected => self.finish(TaskState::Failed, &why),
            ErrorClass::NotAuthorised => self.needs_human(&why, None),
            ErrorClass::ResultMismatch => {
                self.needs_human(&format!("{why}; the provider was paid, no automatic retry"), None)
            }
            ErrorClass::Ambiguous => {
                self.awaiting_evidence = true;
                self.state = TaskState::Running;
                self.reason = Some(format!("{why}; waiting for the evidence about the call"));
            }
        }
    }

    fn recovered(
        &mut self,
        decision: RecoveryDecision,
        result: Option<Artifact>,
        case_id: Option<String>,
        jitter: f64,
        now: Micros,
        p: &Policy,
    ) {
        match decision {
            // Sent both when the call never reached the provider and when the retry
            // carries the same operation key to a provider that dedupes: say only that.
            RecoveryDecision::RetrySafe => {
                self.awaiting_evidence = false;
                if self.cancel_requested {
                    return self.finish(
                        TaskState::Cancelled,
                        "cancelled; the evidence shows the last call cannot have been charged twice",
                    );
                }
                self.key_in_doubt = false;
                let why = "the evidence shows a retry is safe: the call did not reach the provider";
                self.retry_or_give_up(why.to_owned(), None, jitter, now, p);
            }
            RecoveryDecision::RetrySameKey => {
                self.awaiting_evidence = false;
                if self.cancel_requested {
                    return self.finish(
                        TaskState::Cancelled,
                        "cancelled; the last call's outcome is unknown, and it may have been charged (the provider \
                         dedupes, so a retry would not have charged again)",
                    );
                }
                self.key_in_doubt = true;
                let why = "the call's outcome is unknown; the retry carries the same operation key to a provider \
                           that deduplicates, so it cannot be charged twice";
                self.retry_or_give_up(why.to_owned(), None, jitter, now, p);
            }
            RecoveryDecision::Recovered => {
                if let Some(result) = result {
                    self.result = Some(result);
                    self.finish(TaskState::Succeeded, "result recovered from the provider; no second call");
                }
            }
            RecoveryDecision::OutcomeUnknown => {
                self.case_id = case_id;
                let reason = "whether the provider did the work could not be established; a retry would be a new \
                              operation the provider may bill again";
                if self.cancel_requested {
                    return self.finish(TaskState::Cancelled, &format!("cancelled; {reason}"));
                }
                match self.standing_decision(now, p) {
                    Some((step, policy, OnUnknown::SendAgain { charge, cost })) => {
                        // Exactly what a person's `retry_as_new` does, decided in advance.
                        self.sent_again.insert(step.clone(), charge);
                        self.resolved(ResolutionAction::RetryAsNew, None, now);
                        self.reason = Some(standing::evidence(&step, &policy, charge, cost));
                    }
                    Some((_, _, OnUnknown::AskAPerson { why: Some(why) })) => {
                        self.finish(TaskState::OutcomeUnknown, &format!("{reason}; {why}"));
                    }
                    _ => self.finish(TaskState::OutcomeUnknown, reason),
                }
            }
            RecoveryDecision::NeedsHuman => {
                self.needs_human("the evidence about the last call needs a person's decision", case_id);
            }
            RecoveryDecision::ReissueGrant => {}
        }
    }

    /// The catalogue's standing decision for the step in doubt, with the step and
    /// its policy; `None` at a step without one. Never a new operation after the
    /// deadline: it could not be sent, and the task would end failed after a call
    /// that may have been charged.
    fn standing_decision(&self, now: Micros, p: &Policy) -> Option<(String, SendAgain, OnUnknown)> {
        let step = self.step.as_deref()?;
        let policy = *p.send_again_at(step)?;
        let decision = if self.deadline.is_some_and(|deadline| now >= deadline) {
            OnUnknown::AskAPerson {
                why: Some(format!(
                    "the task's deadline has passed, so the catalogue's policy for step `{step}` sent nothing again"
                )),
            }
        } else {
            standing::on_unknown(step, Some(&policy), self.sent_again.get(step).copied().unwrap_or(0))
        };
        Some((step.to_owned(), policy, decision))
    }

    fn cancel(&mut self, effects: &mut Vec<Effect>) {
        match (self.state, self.live_grant) {
            // A person's cancel answers the case as well as a resolution would.
            (TaskState::OutcomeUnknown, _) => {
                self.cancel_requested = true;
                self.finish(
                    TaskState::Cancelled,
                    "cancelled by a person; whether the provider did the last call's work was never established",
                );
            }
            (TaskState::NeedsHuman, _) => {
                self.cancel_requested = true;
                let why = self.reason.clone().unwrap_or_default();
                self.finish(
                    TaskState::Cancelled,
                    &format!("cancelled by a person; it had stopped for a person: {why}"),
                );
            }
            (_, Some(grant_id)) => {
                if !self.cancel_requested {
                    self.cancel_requested = true;
                    self.reason = self.cancel_reason();
                    effects.push(Effect::CancelAttempt { grant_id });
                }
            }
            (_, None) if self.awaiting_evidence => {
                self.cancel_requested = true;
                self.reason = Some("cancellation requested; waiting for the evidence about the last call".to_owned());
            }
            (_, None) if self.key_in_doubt => self.finish(
                TaskState::Cancelled,
                "cancelled before the call was sent again; the earlier call's outcome is unknown and it may have \
                 been charged",
            ),
            (_, None) => self.finish(TaskState::Cancelled, "cancelled"),
        }
    }
}

#[cfg(test)]
mod tests;
