//! The task lifecycle as a pure state machine (DESIGN.md sections 6 and 7):
//! `(task, input, now) -> (task, effects)`. The scheduler stores the task, carries
//! out the effects and publishes a status whenever the transition says so. Inputs
//! about an attempt that is not the live one (stale, duplicated, reordered) change
//! nothing.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::calls::Backoff;
use crate::ids::GrantId;
use crate::vocabulary::{ErrorClass, Phase, RecoveryDecision, ReleaseReason, ResolutionAction, TaskState};

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
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Attempts that may fail before a person is asked (busy and throttled do not count).
    pub max_attempts: u32,
    pub backoff: Backoff,
    /// How long a released-as-busy task waits before it is granted again.
    pub busy_wait: Duration,
}

/// Everything the scheduler knows about one task's lifecycle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    pub case_id: Option<String>,
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
    },
    Resolution {
        action: ResolutionAction,
        result: Option<Artifact>,
    },
    DeadlinePassed,
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
        }
    }

    /// Succeeded, failed and cancelled never change again.
    pub fn is_final(&self) -> bool {
        matches!(self.state, TaskState::Succeeded | TaskState::Failed | TaskState::Cancelled)
    }

    fn is_live(&self, grant_id: GrantId) -> bool {
        self.live_grant == Some(grant_id)
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
            Input::Claimed { grant_id } if self.is_live(grant_id) => {
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
            }
            Input::Released { grant_id, reason, step, signal } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                match reason {
                    ReleaseReason::Cancelled => self.finish(TaskState::Cancelled, "cancelled before any call was made"),
                    _ if self.cancel_requested => self.finish(TaskState::Cancelled, "cancelled"),
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
                        self.awaiting_signal = Some(signal);
                        self.step = step;
                        self.phase = None;
                    }
                }
            }
            Input::Lost { grant_id, phase } if self.is_live(grant_id) => {
                self.end_attempt(effects);
                self.awaiting_evidence = true;
                self.state = TaskState::Running;
                self.phase = Some(phase);
                self.reason = Some(format!("the worker was lost after `{phase}`; checking with the provider"));
            }
            Input::Recovery { attempt, decision, result, case_id, jitter }
                if self.awaiting_evidence && attempt == self.attempt =>
            {
                self.recovered(decision, result, case_id, jitter, now, policy);
            }
            Input::CancelRequested => self.cancel(effects),
            Input::Signal { name }
                if self.state == TaskState::AwaitingApproval
                    && self.awaiting_signal.as_deref() == Some(name.as_str()) =>
            {
                self.awaiting_signal = None;
                self.resume_after_step = self.step.clone();
                self.wait_until(now, format!("signal `{name}` received"));
                self.state = TaskState::Queued;
            }
            Input::Resolution { action, result } if self.state == TaskState::OutcomeUnknown => match action {
                ResolutionAction::RetryAsNew => {
                    self.generation += 1;
                    self.failures = 0;
                    self.throttles = 0;
                    self.case_id = None;
                    self.resume_after_step = None;
                    self.wait_until(now, format!("retry as a new operation (generation {})", self.generation));
                    self.state = TaskState::Queued;
                }
                ResolutionAction::AcceptFailed => self.finish(TaskState::Failed, "accepted as failed by a person"),
                ResolutionAction::AttachResult => {
                    if let Some(result) = result {
                        self.result = Some(result);
                        self.finish(TaskState::Succeeded, "result attached by a person");
                    }
                }
            },
            Input::DeadlinePassed
                if self.live_grant.is_none() && matches!(self.state, TaskState::Queued | TaskState::Waiting) =>
            {
                self.finish(TaskState::Failed, "the deadline passed before the task could run");
            }
            // Stale or duplicate: about an attempt that is not the live one.
            _ => {}
        }
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
            self.finish(TaskState::NeedsHuman, &format!("attempts exhausted ({}): {why}", self.failures));
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
        if self.cancel_requested && class != ErrorClass::Ambiguous {
            return self.finish(TaskState::Cancelled, "cancelled");
        }
        let why = format!("{class}: {message}");
        match class {
            ErrorClass::Throttled | ErrorClass::Busy => {
                self.throttles += 1;
                let wait = p.backoff.delay(self.throttles - 1, retry_after, jitter);
                self.wait_until(after(now, wait), format!("{class}; not counted as a failed attempt"));
            }
            ErrorClass::NotSent | ErrorClass::ProviderFailed => self.retry_or_give_up(why, retry_after, jitter, now, p),
            ErrorClass::Rejected => self.finish(TaskState::Failed, &why),
            ErrorClass::NotAuthorised => self.finish(TaskState::NeedsHuman, &why),
            ErrorClass::ResultMismatch => {
                self.finish(TaskState::NeedsHuman, &format!("{why}; the provider was paid, no automatic retry"))
            }
            ErrorClass::Ambiguous => {
                self.awaiting_evidence = true;
                self.state = TaskState::Running;
                self.reason = Some(format!("{why}; checking with the provider"));
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
            RecoveryDecision::RetrySafe => {
                self.awaiting_evidence = false;
                if self.cancel_requested {
                    return self.finish(TaskState::Cancelled, "cancelled");
                }
                self.retry_or_give_up("the provider did not do the work".to_owned(), None, jitter, now, p);
            }
            RecoveryDecision::Recovered => {
                if let Some(result) = result {
                    self.result = Some(result);
                    self.finish(TaskState::Succeeded, "result recovered from the provider; no second call");
                }
            }
            RecoveryDecision::OutcomeUnknown => {
                self.case_id = case_id;
                self.finish(
                    TaskState::OutcomeUnknown,
                    "the provider may have done the work and cannot be asked; a retry would be a new, billable operation",
                );
            }
            RecoveryDecision::NeedsHuman => {
                self.finish(TaskState::NeedsHuman, "the reconciler could not decide");
            }
            RecoveryDecision::ReissueGrant => {}
        }
    }

    fn cancel(&mut self, effects: &mut Vec<Effect>) {
        match (self.state, self.live_grant) {
            (TaskState::OutcomeUnknown | TaskState::NeedsHuman, _) => {}
            (_, Some(grant_id)) => {
                if !self.cancel_requested {
                    self.cancel_requested = true;
                    self.reason = self.cancel_reason();
                    effects.push(Effect::CancelAttempt { grant_id });
                }
            }
            (_, None) if self.awaiting_evidence => {
                self.cancel_requested = true;
                self.reason = Some("cancellation requested; the last call's outcome is being checked".to_owned());
            }
            (_, None) => self.finish(TaskState::Cancelled, "cancelled"),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use uuid::Uuid;

    use super::*;

    const POLICY: Policy = Policy {
        max_attempts: 3,
        backoff: Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(10) },
        busy_wait: Duration::from_millis(50),
    };

    fn grant(n: u128) -> GrantId {
        GrantId::from_uuid(Uuid::from_u128(n))
    }

    fn run(task: &Task, inputs: Vec<Input>, now: Micros) -> (Task, Vec<Effect>) {
        let mut task = task.clone();
        let mut all = Vec::new();
        for input in inputs {
            let t = task.apply(input, now, &POLICY);
            task = t.task;
            all.extend(t.effects);
        }
        (task, all)
    }

    fn failed(g: GrantId, class: ErrorClass) -> Input {
        Input::Failed { grant_id: g, class, message: "x".into(), retry_after: None, jitter: 0.5 }
    }

    #[test]
    fn a_task_runs_through_one_attempt_to_success() {
        let task = Task::accepted(0, None, None);
        let art = Artifact { uri: "u".into(), sha256: "s".into(), size_bytes: 1 };
        let (task, effects) = run(
            &task,
            vec![
                Input::Grant { grant_id: grant(1) },
                Input::Claimed { grant_id: grant(1) },
                Input::Progress { grant_id: grant(1), step: "render".into(), phase: Phase::CallIntent },
                Input::Succeeded { grant_id: grant(1), result: art.clone() },
            ],
            10,
        );
        assert_eq!(task.state, TaskState::Succeeded);
        assert_eq!(task.result, Some(art));
        assert_eq!(
            effects,
            vec![
                Effect::Dispatch { grant_id: grant(1), attempt: 1, generation: 0, resume_after_step: None },
                Effect::ReleaseSlot { grant_id: grant(1) }
            ]
        );
    }

    #[test]
    fn not_before_keeps_a_task_waiting_until_it_is_due() {
        let task = Task::accepted(0, Some(1_000), None);
        assert_eq!(task.state, TaskState::Waiting);
        let early = task.apply(Input::Grant { grant_id: grant(1) }, 999, &POLICY);
        assert!(early.effects.is_empty() && !early.visible);
        let due = task.apply(Input::Grant { grant_id: grant(1) }, 1_000, &POLICY);
        assert_eq!(due.task.attempt, 1);
    }

    #[test]
    fn each_error_class_leads_where_the_design_says() {
        let granted = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 0).0;
        let after = |class| granted.apply(failed(grant(1), class), 0, &POLICY).task;
        assert_eq!(after(ErrorClass::Rejected).state, TaskState::Failed);
        assert_eq!(after(ErrorClass::NotAuthorised).state, TaskState::NeedsHuman);
        assert_eq!(after(ErrorClass::ResultMismatch).state, TaskState::NeedsHuman);
        let retried = after(ErrorClass::ProviderFailed);
        assert_eq!((retried.state, retried.failures), (TaskState::Waiting, 1));
        let throttled = after(ErrorClass::Throttled);
        assert_eq!((throttled.state, throttled.failures), (TaskState::Waiting, 0), "throttled is not a failure");
        let ambiguous = after(ErrorClass::Ambiguous);
        assert!(ambiguous.awaiting_evidence && ambiguous.due_at.is_none(), "no retry without evidence");
    }

    #[test]
    fn retry_after_is_honoured_and_exhaustion_asks_a_person() {
        let mut task = Task::accepted(0, None, None);
        for n in 1..=3u128 {
            task = run(&task, vec![Input::Grant { grant_id: grant(n) }], i64::MAX / 2).0;
            let input = Input::Failed {
                grant_id: grant(n),
                class: ErrorClass::ProviderFailed,
                message: "503".into(),
                retry_after: Some(Duration::from_secs(30)),
                jitter: 0.0,
            };
            task = task.apply(input, 0, &POLICY).task;
            if n < 3 {
                assert_eq!(task.due_at, Some(30_000_000), "Retry-After wins over a shorter backoff");
            }
        }
        assert_eq!(task.state, TaskState::NeedsHuman);
        assert!(task.reason.as_deref().unwrap_or_default().contains("attempts exhausted (3)"));
    }

    #[test]
    fn an_approval_waits_holding_nothing_and_one_signal_resumes_it() {
        let task = run(
            &Task::accepted(0, None, None),
            vec![
                Input::Grant { grant_id: grant(1) },
                Input::Released {
                    grant_id: grant(1),
                    reason: ReleaseReason::AwaitingSignal,
                    step: Some("approve".into()),
                    signal: Some("refund_approved".into()),
                },
            ],
            0,
        )
        .0;
        assert_eq!((task.state, task.live_grant), (TaskState::AwaitingApproval, None));
        let (task, effects) = run(
            &task,
            vec![
                Input::Signal { name: "wrong".into() },
                Input::Signal { name: "refund_approved".into() },
                Input::Signal { name: "refund_approved".into() },
                Input::Grant { grant_id: grant(2) },
            ],
            0,
        );
        assert_eq!(
            effects,
            vec![Effect::Dispatch {
                grant_id: grant(2),
                attempt: 2,
                generation: 0,
                resume_after_step: Some("approve".into())
            }]
        );
        assert_eq!(task.state, TaskState::Queued);
    }

    #[test]
    fn cancelling_a_running_task_is_cooperative_and_keeps_a_late_result() {
        let running = run(
            &Task::accepted(0, None, None),
            vec![Input::Grant { grant_id: grant(1) }, Input::Claimed { grant_id: grant(1) }],
            0,
        )
        .0;
        let t = running.apply(Input::CancelRequested, 0, &POLICY);
        assert_eq!(t.effects, vec![Effect::CancelAttempt { grant_id: grant(1) }]);
        assert_eq!(t.task.state, TaskState::Running);
        let art = Artifact { uri: "u".into(), sha256: "s".into(), size_bytes: 1 };
        let done = t.task.apply(Input::Succeeded { grant_id: grant(1), result: art }, 0, &POLICY).task;
        assert_eq!(done.state, TaskState::Succeeded);
        let queued = Task::accepted(0, None, None).apply(Input::CancelRequested, 0, &POLICY).task;
        assert_eq!(queued.state, TaskState::Cancelled, "a waiting task is cancelled at once");
    }

    #[test]
    fn outcome_unknown_changes_only_through_a_resolution() {
        let unknown = run(
            &Task::accepted(0, None, None),
            vec![
                Input::Grant { grant_id: grant(1) },
                Input::Lost { grant_id: grant(1), phase: Phase::CallIntent },
                Input::Recovery {
                    attempt: 1,
                    decision: RecoveryDecision::OutcomeUnknown,
                    result: None,
                    case_id: Some("c1".into()),
                    jitter: 0.0,
                },
            ],
            0,
        )
        .0;
        assert_eq!(unknown.state, TaskState::OutcomeUnknown);
        assert_eq!(unknown.case_id.as_deref(), Some("c1"));
        let same = run(&unknown, vec![Input::Grant { grant_id: grant(2) }, Input::CancelRequested], 0).0;
        assert_eq!(same, unknown);
        let again = unknown
            .apply(Input::Resolution { action: ResolutionAction::RetryAsNew, result: None }, 0, &POLICY)
            .task
            .apply(Input::Grant { grant_id: grant(2) }, 0, &POLICY);
        assert_eq!(
            again.effects,
            vec![Effect::Dispatch { grant_id: grant(2), attempt: 2, generation: 1, resume_after_step: None }]
        );
    }

    fn any_input() -> impl Strategy<Value = Input> {
        let g = (1u128..6).prop_map(grant);
        let class = prop::sample::select(ErrorClass::ALL);
        let phase = prop::sample::select(Phase::ALL);
        let art = Just(Artifact { uri: "u".into(), sha256: "s".into(), size_bytes: 1 });
        prop_oneof![
            g.clone().prop_map(|grant_id| Input::Grant { grant_id }),
            g.clone().prop_map(|grant_id| Input::Claimed { grant_id }),
            (g.clone(), phase).prop_map(|(grant_id, phase)| Input::Progress { grant_id, step: "s".into(), phase }),
            (g.clone(), art.clone()).prop_map(|(grant_id, result)| Input::Succeeded { grant_id, result }),
            (g.clone(), class, 0.0..1.0f64).prop_map(|(grant_id, class, jitter)| Input::Failed {
                grant_id,
                class,
                message: "m".into(),
                retry_after: None,
                jitter
            }),
            (g.clone(), prop::sample::select(ReleaseReason::ALL)).prop_map(|(grant_id, reason)| Input::Released {
                grant_id,
                reason,
                step: Some("approve".into()),
                signal: Some("go".into())
            }),
            (g, prop::sample::select(vec![Phase::CallIntent, Phase::ProviderAccepted]))
                .prop_map(|(grant_id, phase)| Input::Lost { grant_id, phase }),
            (0u32..6, prop::sample::select(RecoveryDecision::ALL), prop::option::of(art.clone())).prop_map(
                |(attempt, decision, result)| Input::Recovery {
                    attempt,
                    decision,
                    result,
                    case_id: Some("c".into()),
                    jitter: 0.3
                }
            ),
            Just(Input::CancelRequested),
            Just(Input::Signal { name: "go".into() }),
            (prop::sample::select(ResolutionAction::ALL), prop::option::of(art))
                .prop_map(|(action, result)| Input::Resolution { action, result }),
            Just(Input::DeadlinePassed),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Random, duplicated, reordered and stale inputs never break the invariants.
        #[test]
        fn the_lifecycle_invariants_hold_for_any_sequence(inputs in prop::collection::vec(any_input(), 1..60)) {
            let mut task = Task::accepted(0, None, Some(1_000_000));
            let mut now = 0;
            let mut last_attempt = 0;
            // Set by an ambiguous outcome; cleared only by evidence or a person.
            let mut evidence_owed = false;
            for input in inputs {
                now += 1_000_000_000;
                let before = task.clone();
                let t = task.apply(input.clone(), now, &POLICY);
                for effect in &t.effects {
                    if let Effect::Dispatch { attempt, .. } = effect {
                        prop_assert!(before.live_grant.is_none(), "a second live grant");
                        prop_assert!(*attempt > last_attempt, "attempt numbers must grow");
                        prop_assert!(!evidence_owed, "retried an ambiguous outcome without evidence");
                        last_attempt = *attempt;
                    }
                }
                if before.is_final() {
                    prop_assert_eq!(&t.task, &before, "a final state changed");
                }
                if before.state == TaskState::OutcomeUnknown && t.task.state != before.state {
                    prop_assert!(matches!(input, Input::Resolution { .. }), "outcome unknown left without a person");
                }
                let busy = matches!(input, Input::Released { reason: ReleaseReason::Busy, .. })
                    || matches!(input, Input::Failed { class: ErrorClass::Busy | ErrorClass::Throttled, .. });
                if busy {
                    prop_assert_eq!(t.task.failures, before.failures, "busy consumed an attempt");
                }
                let ambiguous_now = t.task.awaiting_evidence && !before.awaiting_evidence;
                let resolved = matches!(input, Input::Recovery { .. } | Input::Resolution { .. });
                if ambiguous_now {
                    evidence_owed = true;
                } else if resolved && !t.task.awaiting_evidence {
                    evidence_owed = false;
                }
                task = t.task;
            }
        }
    }
}
