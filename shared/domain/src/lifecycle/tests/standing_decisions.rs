//! Standing decisions: a step's outcomes nobody could establish sent again as new
//! operations within the policy's limits, then a person asked.

use proptest::prelude::*;

use super::*;

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
}
