//! The lifecycle's properties: random, duplicated and reordered inputs never break
//! its invariants, and in a random world of executors, reconcilers and people
//! every task settles and never pays twice.

use proptest::prelude::*;

use super::*;

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
        (
            0u8..3,
            prop::option::of(prop::sample::select(vec!["approve", "other"])),
            prop::option::of(0u32..2),
            prop::sample::select(ApprovalDecision::ALL)
        )
            .prop_map(|(n, step, generation, decision)| Input::Signal {
                name: "go".into(),
                signal_id: format!("s{n}"),
                step: step.map(str::to_owned),
                generation,
                decision,
            }),
        (prop::sample::select(vec!["c", "other"]), prop::sample::select(ResolutionAction::ALL), prop::option::of(art))
            .prop_map(|(case_id, action, result)| Input::Resolution { case_id: case_id.into(), action, result }),
        Just(Input::DeadlinePassed),
        Just(Input::Held { reason: "waiting for a slot".into() }),
    ]
}

/// What the world does with one attempt: the executor's reports and, for an
/// attempt that ends in doubt, the reconciler's decision.
#[derive(Debug, Clone)]
enum Script {
    Succeed,
    /// A clean failure of this class (never ambiguous).
    Fail(ErrorClass),
    /// Lost at `call_intent` (`lost`) or failed as ambiguous; then this decision.
    Doubt {
        lost: bool,
        decision: RecoveryDecision,
    },
    /// Waits for the `go` signal, which a person sends bound to the wait (perhaps
    /// before the wait began); a rejection ends the task.
    AwaitApproval {
        reject: bool,
    },
    Busy,
}

fn any_script() -> impl Strategy<Value = Script> {
    let clean = prop::sample::select(vec![
        ErrorClass::NotSent,
        ErrorClass::Throttled,
        ErrorClass::Rejected,
        ErrorClass::NotAuthorised,
        ErrorClass::ProviderFailed,
        ErrorClass::ResultMismatch,
    ]);
    let decision = prop::sample::select(vec![
        RecoveryDecision::RetrySafe,
        RecoveryDecision::RetrySameKey,
        RecoveryDecision::Recovered,
        RecoveryDecision::OutcomeUnknown,
        RecoveryDecision::NeedsHuman,
    ]);
    prop_oneof![
        Just(Script::Succeed),
        clean.prop_map(Script::Fail),
        (any::<bool>(), decision).prop_map(|(lost, decision)| Script::Doubt { lost, decision }),
        any::<bool>().prop_map(|reject| Script::AwaitApproval { reject }),
        Just(Script::Busy),
    ]
}

/// One scripted run: what each attempt does, when a person cancels, how people
/// resolve, and the order in which the scheduler hears it all.
#[derive(Debug, Clone)]
struct Run {
    attempts: Vec<Script>,
    /// Whether a reissued grant's `reissue_grant` decision also travels, per attempt.
    reissue_noise: bool,
    /// After how many deliveries a person asks to cancel, if at all.
    cancel_after: Option<usize>,
    /// What people choose, in turn, for each case they are shown.
    resolutions: Vec<ResolutionAction>,
    /// The scheduler's choices: which waiting input comes next, a duplicate, or a dispatcher tick.
    order: Vec<(u8, usize)>,
}

fn any_run() -> impl Strategy<Value = Run> {
    (
        prop::collection::vec(any_script(), 1..6),
        any::<bool>(),
        prop::option::of(0usize..40),
        prop::collection::vec(prop::sample::select(ResolutionAction::ALL), 1..4),
        prop::collection::vec((0u8..10, any::<usize>()), 0..80),
    )
        .prop_map(|(attempts, reissue_noise, cancel_after, resolutions, order)| Run {
            attempts,
            reissue_noise,
            cancel_after,
            resolutions,
            order,
        })
}

/// A person names the case they read (a task in `needs_human` always has one).
fn resolution(action: ResolutionAction, result: Option<Artifact>, case_id: Option<String>) -> Input {
    Input::Resolution { case_id: case_id.unwrap_or_default(), action, result }
}

/// The world around one task: the executor, the reconciler and people produce
/// inputs; the scheduler hears them in the run's order, with duplicates.
struct World {
    run: Run,
    task: Task,
    now: Micros,
    pending: Vec<Input>,
    heard: Vec<Input>,
    next_grant: u128,
    resolved: usize,
    /// The case (or the state, for a case without an id) people were last shown.
    shown: Option<(TaskState, Option<String>)>,
    cancel_heard: bool,
    /// Distinct signals people sent, and waits that ended.
    signals_sent: usize,
    waits_ended: usize,
    /// A person's rejection ended a wait.
    rejected: bool,
    /// The decision scripted for each attempt that ended in doubt, until it shows.
    owed: Vec<(u32, RecoveryDecision)>,
}

fn art() -> Artifact {
    Artifact { uri: "u".into(), sha256: "s".into(), size_bytes: 1 }
}

impl World {
    fn new(run: Run) -> Self {
        World {
            run,
            task: Task::accepted(0, None, None),
            now: 0,
            pending: Vec::new(),
            heard: Vec::new(),
            next_grant: 1,
            resolved: 0,
            shown: None,
            cancel_heard: false,
            signals_sent: 0,
            waits_ended: 0,
            rejected: false,
            owed: Vec::new(),
        }
    }

    /// The executor runs a granted attempt at once; the reconciler decides a
    /// doubtful end at once too. The scheduler may hear any of it in any order.
    fn executor(&mut self, grant_id: GrantId, attempt: u32, generation: u32) {
        let script = self.run.attempts.get(attempt as usize - 1).cloned().unwrap_or(Script::Succeed);
        self.pending.push(Input::Claimed { grant_id });
        self.pending.push(Input::Progress { grant_id, step: "s".into(), phase: Phase::CallIntent });
        let failed = |class| Input::Failed { grant_id, class, message: "m".into(), retry_after: None, jitter: 0.5 };
        if self.run.reissue_noise {
            self.pending.push(Input::Recovery {
                attempt,
                decision: RecoveryDecision::ReissueGrant,
                result: None,
                case_id: None,
                jitter: 0.5,
            });
        }
        match script {
            Script::Succeed => self.pending.push(Input::Succeeded { grant_id, result: art() }),
            Script::Fail(class) => self.pending.push(failed(class)),
            Script::Doubt { lost, decision } => {
                self.pending.push(if lost {
                    Input::Lost { grant_id, phase: Phase::CallIntent }
                } else {
                    failed(ErrorClass::Ambiguous)
                });
                let case_id = (decision == RecoveryDecision::OutcomeUnknown).then(|| format!("case-{attempt}"));
                let result = (decision == RecoveryDecision::Recovered).then(art);
                self.pending.push(Input::Recovery { attempt, decision, result, case_id, jitter: 0.5 });
                self.owed.push((attempt, decision));
            }
            Script::AwaitApproval { reject } => {
                self.pending.push(Input::Released {
                    grant_id,
                    reason: ReleaseReason::AwaitingSignal,
                    step: Some("approve".into()),
                    signal: Some("go".into()),
                });
                self.pending.push(Input::Signal {
                    name: "go".into(),
                    signal_id: format!("go-{attempt}"),
                    step: Some("approve".into()),
                    generation: Some(generation),
                    decision: if reject { ApprovalDecision::Reject } else { ApprovalDecision::Approve },
                });
                self.signals_sent += 1;
            }
            Script::Busy => {
                self.pending.push(Input::Released { grant_id, reason: ReleaseReason::Busy, step: None, signal: None })
            }
        }
    }

    /// The scheduler applies one input; the world reacts to its effects.
    fn hear(&mut self, input: Input) -> Result<(), TestCaseError> {
        let before = self.task.clone();
        let t = before.apply(input.clone(), self.now, &POLICY);
        // Grants are the scheduler's own decisions, each with a fresh id: only events are redelivered.
        if !matches!(input, Input::Grant { .. }) {
            self.heard.push(input.clone());
        }
        if matches!(input, Input::CancelRequested) && !before.is_final() {
            self.cancel_heard = true;
        }
        for effect in &t.effects {
            if let Effect::Dispatch { grant_id, attempt, generation, .. } = effect {
                prop_assert!(!self.cancel_heard, "a new attempt after a cancel was heard: the cancel was lost");
                prop_assert!(!self.rejected, "a new attempt after a person rejected the wait");
                self.executor(*grant_id, *attempt, *generation);
            }
        }
        // A wait ends with a signal: one heard now, or one kept from before it began.
        let waited = before.state == TaskState::AwaitingApproval
            || matches!(input, Input::Released { reason: ReleaseReason::AwaitingSignal, grant_id, .. }
                if before.live_grant == Some(grant_id));
        if waited && t.task.state == TaskState::Queued {
            self.waits_ended += 1;
            prop_assert!(self.waits_ended <= self.signals_sent, "a wait ended without a signal of its own");
        }
        if t.task.reason.as_deref().is_some_and(|r| r.starts_with(REJECTED_BY_PERSON)) && !before.is_final() {
            prop_assert!(waited, "rejected outside a wait");
            prop_assert_eq!(t.task.state, TaskState::Failed);
            self.rejected = true;
        }
        // The doubtful attempt's decision shows once it is applied.
        if before.attempt == t.task.attempt
            && !t.task.awaiting_evidence
            && let Some(at) = self.owed.iter().position(|(n, _)| *n == t.task.attempt)
        {
            let ended = before.awaiting_evidence
                || matches!(&input, Input::Lost { grant_id, .. } | Input::Failed { grant_id, .. }
                    if before.live_grant == Some(*grant_id));
            if ended {
                let (_, decision) = self.owed.remove(at);
                let state = t.task.state;
                let fits = match decision {
                    RecoveryDecision::RetrySafe | RecoveryDecision::RetrySameKey => {
                        matches!(state, TaskState::Waiting | TaskState::NeedsHuman | TaskState::Cancelled)
                    }
                    RecoveryDecision::Recovered => state == TaskState::Succeeded,
                    RecoveryDecision::OutcomeUnknown => {
                        matches!(state, TaskState::OutcomeUnknown | TaskState::Cancelled)
                    }
                    _ => matches!(state, TaskState::NeedsHuman | TaskState::Cancelled),
                };
                prop_assert!(fits, "attempt ended in doubt; decision {decision:?} but the task is {state:?}");
            }
        }
        self.task = t.task;
        // A person reads each new case (or each new needs_human) and answers it once.
        let shown = (self.task.state, self.task.case_id.clone());
        if matches!(self.task.state, TaskState::OutcomeUnknown | TaskState::NeedsHuman)
            && self.shown.as_ref() != Some(&shown)
        {
            self.shown = Some(shown);
            let mut action = self.run.resolutions[self.resolved % self.run.resolutions.len()];
            if self.resolved >= 2 {
                action = ResolutionAction::AcceptFailed;
            }
            self.resolved += 1;
            let result = (action == ResolutionAction::AttachResult).then(art);
            self.pending.push(resolution(action, result, self.task.case_id.clone()));
        }
        Ok(())
    }

    fn tick(&mut self, by: Micros) -> Result<(), TestCaseError> {
        self.now += by;
        let grant_id = grant(1_000 + self.next_grant);
        self.next_grant += 1;
        self.hear(Input::Grant { grant_id })
    }

    fn play(&mut self) -> Result<(), TestCaseError> {
        let order = self.run.order.clone();
        for (n, (what, pick)) in order.into_iter().enumerate() {
            if self.run.cancel_after == Some(n) {
                self.pending.push(Input::CancelRequested);
            }
            match what {
                0 | 1 => self.tick(i64::try_from(pick % 20_000_000).unwrap_or(0))?,
                2 if !self.heard.is_empty() => {
                    let again = self.heard[pick % self.heard.len()].clone();
                    self.hear(again)?;
                }
                _ if !self.pending.is_empty() => {
                    let input = self.pending.remove(pick % self.pending.len());
                    self.hear(input)?;
                }
                _ => self.tick(1_000)?,
            }
        }
        if self.run.cancel_after.is_some_and(|n| n >= self.run.order.len()) {
            self.pending.push(Input::CancelRequested);
        }
        // Then everything still on its way arrives, and timers fire, until nothing moves.
        for _ in 0..500 {
            if !self.pending.is_empty() {
                let input = self.pending.remove(0);
                self.hear(input)?;
            } else if let Some(due) = self.task.due_at.filter(|_| self.task.live_grant.is_none()) {
                self.now = self.now.max(due);
                self.tick(0)?;
            } else {
                break;
            }
        }
        Ok(())
    }
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
        // Attempts some evidence (a recovery decision) was heard for.
        let mut decided: Vec<u32> = Vec::new();
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
            // Without a standing decision in the catalogue, only a person sends a new operation.
            if t.task.generation != before.generation {
                prop_assert!(
                    matches!(input, Input::Resolution { action: ResolutionAction::RetryAsNew, .. }),
                    "a new operation without a person's decision: {:?}", input
                );
            }
            // A decision bound to another wait never ends this one.
            if let Input::Signal { step, generation, .. } = &input
                && before.state == TaskState::AwaitingApproval
                && (step.as_ref().is_some_and(|s| before.step.as_ref() != Some(s))
                    || generation.is_some_and(|g| g != before.generation))
            {
                prop_assert_eq!(t.task.state, TaskState::AwaitingApproval, "a decision for another wait ended it");
            }
            // Only a person's rejection of a wait ends a task as rejected.
            if t.task.reason.as_deref().is_some_and(|r| r.starts_with(REJECTED_BY_PERSON)) && !before.is_final() {
                let rejection = matches!(&input, Input::Signal { decision: ApprovalDecision::Reject, .. })
                    || matches!(&input, Input::Released { reason: ReleaseReason::AwaitingSignal, .. });
                prop_assert!(rejection, "rejected without a rejection: {:?}", input);
                prop_assert_eq!(t.task.state, TaskState::Failed);
                prop_assert!(t.effects.iter().all(|e| !matches!(e, Effect::Dispatch { .. })), "ran after a rejection");
            }
            if before.state == TaskState::OutcomeUnknown && t.task.state != before.state {
                // Only a person leaves it, or proof for its own case: a verified
                // result of the call in doubt (docs/decisions.md, item 15).
                let proof_for_its_case = matches!(&input, Input::Recovery {
                    attempt, decision: RecoveryDecision::Recovered, result: Some(_), case_id, ..
                } if *attempt == before.attempt && case_id.is_some() && *case_id == before.case_id);
                prop_assert!(
                    matches!(input, Input::Resolution { .. } | Input::CancelRequested) || proof_for_its_case,
                    "outcome unknown left without a person or proof for its case"
                );
                if proof_for_its_case {
                    prop_assert_eq!(t.task.state, TaskState::Succeeded, "proof ends it succeeded");
                    prop_assert!(t.effects.iter().all(|e| !matches!(e, Effect::Dispatch { .. })), "no second call");
                }
            }
            if let Input::Resolution { case_id, .. } = &input
                && before.case_id.as_deref() != Some(case_id.as_str())
            {
                prop_assert_eq!(&t.task, &before, "a resolution of another case changed the task");
            }
            if t.task.awaits_a_person() {
                prop_assert!(t.task.case_id.is_some(), "a person is asked without a case to name");
            }
            // A resend of a key whose first call may have done the work never ends
            // "failed" on its own: only a person may accept that, or end the task by
            // refusing an approval it reached.
            if before.key_in_doubt && t.task.state == TaskState::Failed {
                let refused_by_a_person = t.task.reason.as_deref().is_some_and(|r| r.starts_with(REJECTED_BY_PERSON));
                prop_assert!(
                    matches!(input, Input::Resolution { action: ResolutionAction::AcceptFailed, .. })
                        || refused_by_a_person,
                    "a call in doubt ended failed without a person: {:?}", t.task.reason
                );
            }
            let busy = matches!(input, Input::Released { reason: ReleaseReason::Busy, .. })
                || matches!(input, Input::Failed { class: ErrorClass::Busy | ErrorClass::Throttled, .. });
            if busy {
                prop_assert_eq!(t.task.failures, before.failures, "busy consumed an attempt");
            }
            if let Input::Recovery { attempt, decision, .. } = &input
                && *decision != RecoveryDecision::ReissueGrant
            {
                decided.push(*attempt);
            }
            // The live attempt just ended in doubt; a decision heard earlier may settle it at once.
            let ended_in_doubt = before.live_grant.is_some_and(|g| match &input {
                Input::Lost { grant_id, .. } => *grant_id == g,
                Input::Failed { grant_id, class: ErrorClass::Ambiguous, .. } => *grant_id == g,
                _ => false,
            });
            if ended_in_doubt && !t.task.awaiting_evidence {
                prop_assert!(decided.contains(&before.attempt), "an ambiguous end settled without evidence");
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

    /// Liveness under any order of the same inputs (duplicates, reorders across
    /// and within topics): every attempt that ended in doubt gets its decision
    /// applied, a cancel is never lost, and every task ends where a person or the
    /// system moves it on, so once people answer what they are shown it is final.
    #[test]
    fn every_task_settles_whatever_order_its_inputs_arrive_in(run in any_run()) {
        let mut world = World::new(run);
        world.play()?;
        let task = &world.task;
        prop_assert!(!task.awaiting_evidence, "still waiting for a decision that was sent: {task:?}");
        prop_assert!(world.owed.is_empty(), "decisions never applied: {:?}", world.owed);
        prop_assert!(task.is_final(), "the task never settled: {task:?}\nheard: {:?}", world.heard);
    }
}
