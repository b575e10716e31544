//! The lifecycle's examples and properties: every input in every state, and
//! random worlds in which a task always settles and never pays twice.

use proptest::prelude::*;
use uuid::Uuid;

use super::*;

const POLICY: Policy = Policy {
    max_attempts: 3,
    backoff: Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(10) },
    busy_wait: Duration::from_millis(50),
    send_again: Vec::new(),
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
fn a_task_ends_once_in_the_state_that_finished_it() {
    let accepted = Task::accepted(0, None, None);
    let granted = accepted.apply(Input::Grant { grant_id: grant(1) }, 1, &POLICY).task;
    assert_eq!(accepted.ended_in(&granted), None, "granted is not an end");
    let cancelled = granted.apply(Input::CancelRequested, 2, &POLICY).task;
    let cancelled = match cancelled.state {
        TaskState::Cancelled => cancelled,
        // A running attempt is cancelled first; its release ends the task.
        _ => {
            cancelled
                .apply(
                    Input::Released { grant_id: grant(1), reason: ReleaseReason::Cancelled, step: None, signal: None },
                    3,
                    &POLICY,
                )
                .task
        }
    };
    assert_eq!(granted.ended_in(&cancelled), Some(TaskState::Cancelled));
    let again = cancelled.apply(Input::CancelRequested, 4, &POLICY).task;
    assert_eq!(cancelled.ended_in(&again), None, "a finished task does not end again");
}

/// A report heard again after later ones, as a relay sends after a crash, leaves
/// what the task shows where the later ones put it.
#[test]
fn a_report_heard_again_never_moves_the_shown_step_back() {
    let steps = ["classify", "draft", "send"];
    let order = |name: &str| steps.iter().position(|s| *s == name);
    let (task, _) = run(
        &Task::accepted(0, None, None),
        vec![
            Input::Grant { grant_id: grant(1) },
            Input::Claimed { grant_id: grant(1) },
            Input::Progress { grant_id: grant(1), step: "draft".into(), phase: Phase::ProviderAccepted },
        ],
        10,
    );
    assert!(task.report_is_behind(order, "classify", Phase::ResultRecorded), "an earlier step");
    assert!(task.report_is_behind(order, "draft", Phase::CallIntent), "an earlier phase of the shown step");
    assert!(!task.report_is_behind(order, "draft", Phase::ProviderAccepted), "the shown phase itself moves nothing");
    assert!(!task.report_is_behind(order, "draft", Phase::ResultRecorded), "a later phase");
    assert!(!task.report_is_behind(order, "send", Phase::CallIntent), "a later step");
    assert!(task.report_is_behind(|_| None, "send", Phase::CallIntent), "a step the kind does not name");
    let claimed = task.apply(Input::Claimed { grant_id: grant(1) }, 11, &POLICY).task;
    assert_eq!(claimed, task, "the claim heard again moves nothing once a step was reported");

    let fresh = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 10).0;
    assert!(!fresh.report_is_behind(|_| None, "classify", Phase::CallIntent), "nothing shown yet");
    let claimed = fresh.apply(Input::Claimed { grant_id: grant(1) }, 11, &POLICY).task;
    assert_eq!(claimed.phase, Some(Phase::Claimed));
    assert_eq!(claimed.apply(Input::Claimed { grant_id: grant(1) }, 12, &POLICY).task, claimed);
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
            signal("wrong", "w"),
            signal("refund_approved", "a"),
            signal("refund_approved", "a"),
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
    let other_case = Input::Resolution { case_id: "c0".into(), action: ResolutionAction::AcceptFailed, result: None };
    let same = run(&unknown, vec![Input::Grant { grant_id: grant(2) }, other_case], 0).0;
    assert_eq!(same, unknown, "neither a grant nor a resolution of another case moves it");
    let again = unknown
        .apply(
            Input::Resolution { case_id: "c1".into(), action: ResolutionAction::RetryAsNew, result: None },
            0,
            &POLICY,
        )
        .task
        .apply(Input::Grant { grant_id: grant(2) }, 0, &POLICY);
    assert_eq!(
        again.effects,
        vec![Effect::Dispatch { grant_id: grant(2), attempt: 2, generation: 1, resume_after_step: None }]
    );
}

fn recovery(attempt: u32, decision: RecoveryDecision, case_id: Option<&str>) -> Input {
    Input::Recovery { attempt, decision, result: None, case_id: case_id.map(str::to_owned), jitter: 0.0 }
}

#[test]
fn a_decision_heard_before_the_loss_it_answers_is_applied_when_the_loss_arrives() {
    let granted = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 0).0;
    let early = recovery(1, RecoveryDecision::OutcomeUnknown, Some("c1"));
    let (task, _) = run(&granted, vec![early, Input::Lost { grant_id: grant(1), phase: Phase::CallIntent }], 0);
    assert_eq!((task.state, task.case_id.as_deref()), (TaskState::OutcomeUnknown, Some("c1")));
    assert!(!task.awaiting_evidence && task.early_decision.is_none());

    // The same for an ambiguous failure, and a reissue decision is not mistaken for evidence.
    let safe = vec![
        recovery(1, RecoveryDecision::ReissueGrant, None),
        recovery(1, RecoveryDecision::RetrySameKey, None),
        failed(grant(1), ErrorClass::Ambiguous),
    ];
    let task = run(&granted, safe, 0).0;
    assert_eq!((task.state, task.failures, task.awaiting_evidence), (TaskState::Waiting, 1, false));
    assert!(task.reason.as_deref().unwrap_or_default().contains("the same operation key"), "{:?}", task.reason);

    // A decision about an earlier attempt is stale, kept or not.
    let later = run(&task, vec![Input::Grant { grant_id: grant(2) }], i64::MAX / 2).0;
    let stale = run(&later, vec![recovery(1, RecoveryDecision::Recovered, None)], 0).0;
    assert_eq!(stale, later);
}

#[test]
fn a_verified_result_for_the_open_case_ends_outcome_unknown_as_succeeded_and_nothing_else_does() {
    let art = Artifact { uri: "u".into(), sha256: "s".into(), size_bytes: 1 };
    let recovered = |case: &str| Input::Recovery {
        attempt: 1,
        decision: RecoveryDecision::Recovered,
        result: Some(art.clone()),
        case_id: Some(case.to_owned()),
        jitter: 0.0,
    };
    let lost = Input::Lost { grant_id: grant(1), phase: Phase::ProviderAccepted };
    let unknown = run(
        &Task::accepted(0, None, None),
        vec![
            Input::Grant { grant_id: grant(1) },
            lost.clone(),
            recovery(1, RecoveryDecision::OutcomeUnknown, Some("c1")),
        ],
        0,
    )
    .0;
    assert_eq!(unknown.state, TaskState::OutcomeUnknown);

    let (task, effects) = run(&unknown, vec![recovered("c1")], 0);
    assert_eq!((task.state, task.result.as_ref()), (TaskState::Succeeded, Some(&art)));
    assert!(effects.is_empty(), "nothing is dispatched again: {effects:?}");
    assert!(task.reason.as_deref().unwrap_or_default().contains("no second call"), "{:?}", task.reason);

    // Another case's recovery, or one without a result, moves nothing; nor does
    // one that arrives after a person already chose a new operation.
    assert_eq!(run(&unknown, vec![recovered("c0")], 0).0, unknown);
    let no_result = Input::Recovery {
        attempt: 1,
        decision: RecoveryDecision::Recovered,
        result: None,
        case_id: Some("c1".into()),
        jitter: 0.0,
    };
    assert_eq!(run(&unknown, vec![no_result], 0).0, unknown);
    let retried = run(
        &unknown,
        vec![Input::Resolution { case_id: "c1".into(), action: ResolutionAction::RetryAsNew, result: None }],
        0,
    )
    .0;
    assert_eq!(run(&retried, vec![recovered("c1")], 0).0, retried);

    // Both decisions heard before the loss: the recovery supersedes the first.
    let granted = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 0).0;
    let early = vec![recovery(1, RecoveryDecision::OutcomeUnknown, Some("c1")), recovered("c1"), lost];
    let task = run(&granted, early, 0).0;
    assert_eq!((task.state, task.result.as_ref()), (TaskState::Succeeded, Some(&art)));
}

/// An approval of any wait for `name` (a signal sent without naming its wait).
fn signal(name: &str, id: &str) -> Input {
    Input::Signal {
        name: name.into(),
        signal_id: id.into(),
        step: None,
        generation: None,
        decision: ApprovalDecision::Approve,
    }
}

/// A person's decision about the wait at `step` in `generation`.
fn decision(decision: ApprovalDecision, step: &str, generation: u32, id: &str) -> Input {
    Input::Signal {
        name: "refund_approved".into(),
        signal_id: id.into(),
        step: Some(step.into()),
        generation: Some(generation),
        decision,
    }
}

#[test]
fn a_rejection_ends_the_wait_failed_and_nothing_runs_after_it() {
    let waiting = waiting_for_approval(vec![]);
    let t = waiting.apply(decision(ApprovalDecision::Reject, "approve", 0, "r1"), 0, &POLICY);
    assert_eq!(t.task.state, TaskState::Failed);
    assert!(t.task.reason.as_deref().is_some_and(|r| r.starts_with(REJECTED_BY_PERSON)), "{:?}", t.task.reason);
    assert!(t.effects.is_empty() && t.visible);
    // An approval after it changes nothing: the task is final.
    let later = t.task.apply(decision(ApprovalDecision::Approve, "approve", 0, "a1"), 0, &POLICY);
    assert_eq!(later.task, t.task);
    // Given before the wait, the rejection ends the wait as soon as it begins.
    let early = waiting_for_approval(vec![decision(ApprovalDecision::Reject, "approve", 0, "r1")]);
    assert_eq!(early.state, TaskState::Failed);
    assert_eq!(early.apply(Input::Grant { grant_id: grant(9) }, 0, &POLICY).effects, vec![]);
}

#[test]
fn a_decision_bound_to_a_wait_answers_that_wait_only() {
    // Sent before the wait, for another step or another generation: kept, and the wait still waits.
    for other in [
        decision(ApprovalDecision::Approve, "second_approval", 0, "a1"),
        decision(ApprovalDecision::Reject, "second_approval", 0, "r1"),
        decision(ApprovalDecision::Approve, "approve", 1, "a2"),
    ] {
        let task = waiting_for_approval(vec![other.clone()]);
        assert_eq!(task.state, TaskState::AwaitingApproval, "{other:?}");
        // Nor does it end the wait when it arrives during it.
        let during = waiting_for_approval(vec![]).apply(other.clone(), 0, &POLICY).task;
        assert_eq!(during.state, TaskState::AwaitingApproval, "{other:?}");
    }
    // Its own wait takes it.
    let task = waiting_for_approval(vec![decision(ApprovalDecision::Approve, "approve", 0, "a1")]);
    assert_eq!((task.state, task.resume_after_step.as_deref()), (TaskState::Queued, Some("approve")));
    // A decision for a generation a retry left behind is dropped, not kept.
    let mut later = waiting_for_approval(vec![]);
    later.generation = 2;
    let t = later.apply(decision(ApprovalDecision::Reject, "approve", 1, "r9"), 0, &POLICY);
    assert_eq!(t.task, later);
}

fn waiting_for_approval(signals_first: Vec<Input>) -> Task {
    let mut inputs = vec![Input::Grant { grant_id: grant(1) }];
    inputs.extend(signals_first);
    inputs.push(Input::Released {
        grant_id: grant(1),
        reason: ReleaseReason::AwaitingSignal,
        step: Some("approve".into()),
        signal: Some("refund_approved".into()),
    });
    run(&Task::accepted(0, None, None), inputs, 0).0
}

#[test]
fn an_approval_given_before_the_wait_began_ends_the_wait_at_once_and_only_once() {
    let approve = |id: &str| signal("refund_approved", id);
    let task = waiting_for_approval(vec![approve("a1"), approve("a1")]);
    assert_eq!((task.state, task.resume_after_step.as_deref()), (TaskState::Queued, Some("approve")));
    assert!(task.kept_signals.is_empty());
    // The same signal again cannot approve a later wait of the same name.
    let again = run(&task, vec![approve("a1"), Input::Grant { grant_id: grant(2) }], 0).0;
    let waits = again.apply(
        Input::Released {
            grant_id: grant(2),
            reason: ReleaseReason::AwaitingSignal,
            step: Some("approve".into()),
            signal: Some("refund_approved".into()),
        },
        0,
        &POLICY,
    );
    assert_eq!(waits.task.state, TaskState::AwaitingApproval);
    assert_eq!(waiting_for_approval(vec![]).state, TaskState::AwaitingApproval);
}

#[test]
fn a_person_can_cancel_or_resolve_what_waits_for_a_person() {
    let unknown = run(
        &Task::accepted(0, None, None),
        vec![
            Input::Grant { grant_id: grant(1) },
            Input::Lost { grant_id: grant(1), phase: Phase::CallIntent },
            recovery(1, RecoveryDecision::OutcomeUnknown, Some("c1")),
        ],
        0,
    )
    .0;
    let cancelled = unknown.apply(Input::CancelRequested, 0, &POLICY).task;
    assert_eq!(cancelled.state, TaskState::Cancelled);
    assert!(cancelled.reason.as_deref().unwrap_or_default().contains("never established"));

    let granted = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 0).0;
    let stuck = granted.apply(failed(grant(1), ErrorClass::NotAuthorised), 0, &POLICY).task;
    assert_eq!(stuck.state, TaskState::NeedsHuman);
    let case = stuck.case_id.clone().expect("needs_human has a case to name");
    assert_eq!(stuck.apply(Input::CancelRequested, 0, &POLICY).task.state, TaskState::Cancelled);
    let retry = Input::Resolution { case_id: case, action: ResolutionAction::RetryAsNew, result: None };
    let again = stuck.apply(retry, 0, &POLICY).task;
    assert_eq!((again.state, again.generation, again.case_id.clone()), (TaskState::Queued, 1, None));

    // A cancel heard while the evidence was awaited is applied when it arrives.
    let doubtful = granted.apply(failed(grant(1), ErrorClass::Ambiguous), 0, &POLICY).task;
    let asked = doubtful.apply(Input::CancelRequested, 0, &POLICY).task;
    let decided = asked.apply(recovery(1, RecoveryDecision::OutcomeUnknown, Some("c2")), 0, &POLICY).task;
    assert_eq!((decided.state, decided.case_id.as_deref()), (TaskState::Cancelled, Some("c2")));
}

#[test]
fn a_cancel_does_not_hide_that_a_paid_call_returned_a_bad_result() {
    let granted = run(&Task::accepted(0, None, None), vec![Input::Grant { grant_id: grant(1) }], 0).0;
    let asked = granted.apply(Input::CancelRequested, 0, &POLICY).task;
    let done = asked.apply(failed(grant(1), ErrorClass::ResultMismatch), 0, &POLICY).task;
    assert_eq!(done.state, TaskState::Cancelled);
    assert!(done.reason.as_deref().unwrap_or_default().contains("paid call"), "{:?}", done.reason);
}

#[test]
fn a_task_held_by_a_reduced_limit_says_so_and_nothing_else_changes() {
    let queued = Task::accepted(0, None, None);
    let held = queued.apply(Input::Held { reason: "waiting for a slot: img limit 1 of 4".into() }, 0, &POLICY);
    assert!(held.visible && held.effects.is_empty());
    assert_eq!(
        (held.task.state, held.task.reason.as_deref()),
        (TaskState::Queued, Some("waiting for a slot: img limit 1 of 4"))
    );
    assert_eq!(held.task.due_at, queued.due_at, "still due");
    let again = held.task.apply(Input::Held { reason: "waiting for a slot: img limit 1 of 4".into() }, 0, &POLICY);
    assert!(!again.visible, "the same reason is no new status");
    let granted = run(&queued, vec![Input::Grant { grant_id: grant(1) }], 0).0;
    let ignored = granted.apply(Input::Held { reason: "x".into() }, 0, &POLICY);
    assert_eq!(ignored.task, granted, "a granted task is not held");
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

fn with_policy(step: &str, policy: SendAgain) -> Policy {
    Policy { send_again: vec![(step.to_owned(), policy)], ..POLICY }
}

/// One attempt that calls `step` and ends in doubt, and the reconciler's
/// `outcome_unknown` for it under case `c{n}`.
fn ends_unknown(task: &Task, n: u128, step: &str, now: Micros, p: &Policy) -> Task {
    let inputs = vec![
        Input::Grant { grant_id: grant(n) },
        Input::Progress { grant_id: grant(n), step: step.into(), phase: Phase::CallIntent },
        failed(grant(n), ErrorClass::Ambiguous),
        Input::Recovery {
            attempt: task.attempt + 1,
            decision: RecoveryDecision::OutcomeUnknown,
            result: None,
            case_id: Some(format!("c{n}")),
            jitter: 0.0,
        },
    ];
    inputs.into_iter().fold(task.clone(), |task, input| task.apply(input, now, p).task)
}

const TWO_EXTRA: SendAgain = SendAgain {
    max_extra_charges: 2,
    max_extra_cost: crate::spend::Amount::from_minor(20),
    price_per_call: crate::spend::Amount::from_minor(10),
};

#[test]
fn a_standing_decision_sends_again_twice_then_asks_a_person() {
    let policy = with_policy("classify", TWO_EXTRA);
    let first = ends_unknown(&Task::accepted(0, None, None), 1, "classify", 0, &policy);
    assert_eq!((first.state, first.generation, first.case_id.as_deref()), (TaskState::Queued, 1, None));
    let reason = first.reason.clone().unwrap_or_default();
    assert!(
        reason.starts_with("sent again under the catalogue's policy for step `classify`: extra charge 1 of at most 2"),
        "{reason}"
    );
    let granted = first.apply(Input::Grant { grant_id: grant(2) }, 0, &policy);
    assert_eq!(
        granted.effects,
        vec![Effect::Dispatch { grant_id: grant(2), attempt: 2, generation: 1, resume_after_step: None }],
        "the new operation goes out as a person's retry_as_new does"
    );
    let second = ends_unknown(&first, 2, "classify", 0, &policy);
    assert_eq!((second.state, second.generation), (TaskState::Queued, 2));
    assert!(second.reason.as_deref().is_some_and(|r| r.contains("extra charge 2 of at most 2, 20 of at most 20")));
    let third = ends_unknown(&second, 3, "classify", 0, &policy);
    assert_eq!((third.state, third.generation, third.case_id.as_deref()), (TaskState::OutcomeUnknown, 2, Some("c3")));
    assert!(third.reason.as_deref().is_some_and(|r| r.contains("policy for step `classify` is spent")), "{third:?}");
    // A person may still send it again; the policy stays spent.
    let resolution = Input::Resolution { case_id: "c3".into(), action: ResolutionAction::RetryAsNew, result: None };
    let retried = third.apply(resolution, 0, &policy).task;
    assert_eq!((retried.state, retried.generation), (TaskState::Queued, 3));
    assert_eq!(ends_unknown(&retried, 4, "classify", 0, &policy).state, TaskState::OutcomeUnknown);
}

#[test]
fn a_standing_decision_applies_only_to_its_own_step_before_the_deadline_and_never_after_a_cancel() {
    let policy = with_policy("classify", TWO_EXTRA);
    let other = ends_unknown(&Task::accepted(0, None, None), 1, "draft", 0, &policy);
    assert_eq!((other.state, other.generation), (TaskState::OutcomeUnknown, 0), "no policy at `draft`");
    assert!(other.reason.as_deref().is_some_and(|r| !r.contains("policy")));
    let late = ends_unknown(&Task::accepted(0, None, Some(10)), 1, "classify", 10, &policy);
    assert_eq!((late.state, late.generation), (TaskState::OutcomeUnknown, 0), "the deadline passed");
    assert!(late.reason.as_deref().is_some_and(|r| r.contains("deadline has passed")));
    let mut cancelled = Task::accepted(0, None, None);
    for input in [
        Input::Grant { grant_id: grant(1) },
        Input::Progress { grant_id: grant(1), step: "classify".into(), phase: Phase::CallIntent },
        Input::CancelRequested,
        failed(grant(1), ErrorClass::Ambiguous),
        recovery(1, RecoveryDecision::OutcomeUnknown, Some("c1")),
    ] {
        cancelled = cancelled.apply(input, 0, &policy).task;
    }
    assert_eq!((cancelled.state, cancelled.generation), (TaskState::Cancelled, 0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// With a standing decision at one step, outcomes nobody could establish
    /// there are sent again as new operations, never more often nor for more
    /// than the policy allows, never at a step without one; and a task whose
    /// policy is spent waits for a person under its case.
    #[test]
    fn a_standing_decision_never_exceeds_its_limits_and_a_spent_one_asks_a_person(
        max_extra_charges in 1u32..5,
        max_extra_cost_minor in 1u64..60,
        price_per_call_minor in 0u64..25,
        at_policy_step in prop::collection::vec(any::<bool>(), 1..12),
        person_retries in any::<bool>(),
    ) {
        let policy = SendAgain {
            max_extra_charges,
            max_extra_cost: crate::spend::Amount::from_minor(max_extra_cost_minor as i64),
            price_per_call: crate::spend::Amount::from_minor(price_per_call_minor as i64),
        };
        let p = with_policy("classify", policy);
        let mut task = Task::accepted(0, None, None);
        let (mut by_policy, mut spent) = (0u32, 0u64);
        for (n, at_policy) in at_policy_step.iter().enumerate() {
            let step = if *at_policy { "classify" } else { "draft" };
            let before = task.clone();
            task = ends_unknown(&task, n as u128 + 1, step, 0, &p);
            if task.generation > before.generation {
                prop_assert!(*at_policy, "sent again at a step without a policy");
                by_policy += 1;
                spent += price_per_call_minor;
                prop_assert!(task.reason.as_deref().is_some_and(|r| r.starts_with(standing::EVIDENCE_OPENING)));
            }
            prop_assert!(by_policy <= max_extra_charges, "more extra charges than the policy allows");
            prop_assert!(spent <= max_extra_cost_minor, "spent more than the policy allows");
            prop_assert_eq!(task.sent_again.get("classify").copied().unwrap_or(0), by_policy);
            if task.state == TaskState::OutcomeUnknown {
                prop_assert!(task.case_id.is_some(), "a person is asked without a case to name");
                if *at_policy {
                    // Spent: one more would break a limit.
                    let next = by_policy + 1;
                    prop_assert!(next > max_extra_charges || u64::from(next) * price_per_call_minor > max_extra_cost_minor);
                    prop_assert!(task.reason.as_deref().is_some_and(|r| r.contains("is spent")));
                }
                if !person_retries {
                    break;
                }
                let case_id = task.case_id.clone().unwrap_or_default();
                task = task.apply(Input::Resolution { case_id, action: ResolutionAction::RetryAsNew, result: None }, 0, &p).task;
            }
        }
    }

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
