//! What people do to a task: approve or reject a wait, cancel, resolve a case.

use super::*;

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
