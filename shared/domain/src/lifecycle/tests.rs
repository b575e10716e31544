//! The lifecycle's examples of attempts, failures and recoveries, with the helpers
//! its other tests share: what people do, standing decisions, and the properties
//! (random worlds in which a task always settles and never pays twice).

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

mod people;
mod properties;
mod standing_decisions;
