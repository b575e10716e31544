//! A step's standing decision, made in advance by whoever owns the catalogue: on an
//! outcome nobody can establish, send a new operation (what a person's
//! `retry_as_new` does) within a number of extra charges and an amount per task,
//! and ask a person once either is spent (docs/catalog.md, "A standing decision").

use serde::{Deserialize, Serialize};

/// The catalogue's `on_unknown.send_again` of one step, with the price it charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendAgain {
    /// Extra charges the policy may make per task, at least 1.
    pub max_extra_charges: u32,
    /// What those extra charges may cost in all per task, in the currency's minor unit.
    pub max_extra_cost_minor: u64,
    /// What one call of the step costs, in the same unit.
    pub price_per_call_minor: u64,
}

/// What the policy decides about one outcome that could not be established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnUnknown {
    /// Send a new operation: the `charge`-th extra charge of the task at this step,
    /// bringing what the policy spent to `cost_minor`.
    SendAgain { charge: u32, cost_minor: u64 },
    /// A person decides, as without a policy; `why` says so when a policy was spent.
    AskAPerson { why: Option<String> },
}

/// Decides one outcome that could not be established at `step`, which the policy
/// has already sent again `made` times for this task. Without a policy a person
/// decides, always; with one, a new operation goes out only while both its limits
/// hold after that charge.
pub fn on_unknown(step: &str, policy: Option<&SendAgain>, made: u32) -> OnUnknown {
    let Some(policy) = policy else { return OnUnknown::AskAPerson { why: None } };
    let charge = made.saturating_add(1);
    let cost_minor = u64::from(charge).saturating_mul(policy.price_per_call_minor);
    if charge <= policy.max_extra_charges && cost_minor <= policy.max_extra_cost_minor {
        return OnUnknown::SendAgain { charge, cost_minor };
    }
    OnUnknown::AskAPerson {
        why: Some(format!(
            "the catalogue's policy for step `{step}` is spent ({made} extra charges made, at most {} and at most {} \
             in the currency's minor unit)",
            policy.max_extra_charges, policy.max_extra_cost_minor
        )),
    }
}

/// The evidence an extra charge leaves on the task, as its status reason and so on
/// its timeline.
///
/// Do not change: readers (tests, people searching timelines) recognise it by its opening.
pub fn evidence(step: &str, policy: &SendAgain, charge: u32, cost_minor: u64) -> String {
    format!(
        "sent again under the catalogue's policy for step `{step}`: extra charge {charge} of at most {}, \
         {cost_minor} of at most {} in the currency's minor unit ({} a call); the earlier call's outcome is \
         unknown and it may have been charged too",
        policy.max_extra_charges, policy.max_extra_cost_minor, policy.price_per_call_minor
    )
}

/// The opening of every [`evidence`] line.
pub const EVIDENCE_OPENING: &str = "sent again under the catalogue's policy for step";

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TWO: SendAgain = SendAgain { max_extra_charges: 2, max_extra_cost_minor: 20, price_per_call_minor: 10 };

    #[test]
    fn without_a_policy_a_person_decides() {
        assert_eq!(on_unknown("classify", None, 0), OnUnknown::AskAPerson { why: None });
    }

    #[test]
    fn a_policy_sends_again_until_either_limit_is_spent() {
        assert_eq!(on_unknown("classify", Some(&TWO), 0), OnUnknown::SendAgain { charge: 1, cost_minor: 10 });
        assert_eq!(on_unknown("classify", Some(&TWO), 1), OnUnknown::SendAgain { charge: 2, cost_minor: 20 });
        let OnUnknown::AskAPerson { why: Some(why) } = on_unknown("classify", Some(&TWO), 2) else {
            panic!("a spent policy asks a person")
        };
        assert!(why.contains("step `classify` is spent (2 extra charges made"), "{why}");
        let dear = SendAgain { price_per_call_minor: 15, ..TWO };
        assert_eq!(on_unknown("classify", Some(&dear), 0), OnUnknown::SendAgain { charge: 1, cost_minor: 15 });
        assert!(matches!(on_unknown("classify", Some(&dear), 1), OnUnknown::AskAPerson { why: Some(_) }));
    }

    #[test]
    fn the_evidence_names_the_step_the_charge_and_the_limits() {
        let line = evidence("classify", &TWO, 1, 10);
        assert!(line.starts_with(EVIDENCE_OPENING), "{line}");
        assert!(line.contains("step `classify`: extra charge 1 of at most 2, 10 of at most 20"), "{line}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// However many outcomes go unknown, the policy never makes more extra
        /// charges, nor spends more, than it allows, and once it stops it stays stopped.
        #[test]
        fn a_policy_never_exceeds_its_limits(
            max_extra_charges in 1u32..6,
            max_extra_cost_minor in 1u64..100,
            price_per_call_minor in 0u64..40,
            unknowns in 0usize..20,
        ) {
            let policy = SendAgain { max_extra_charges, max_extra_cost_minor, price_per_call_minor };
            let (mut made, mut spent, mut stopped) = (0u32, 0u64, false);
            for _ in 0..unknowns {
                match on_unknown("s", Some(&policy), made) {
                    OnUnknown::SendAgain { charge, cost_minor } => {
                        prop_assert!(!stopped, "sent again after a person was asked");
                        prop_assert_eq!(charge, made + 1);
                        made = charge;
                        spent += price_per_call_minor;
                        prop_assert_eq!(cost_minor, spent);
                    }
                    OnUnknown::AskAPerson { why } => {
                        prop_assert!(why.is_some(), "a spent policy says so");
                        stopped = true;
                    }
                }
                prop_assert!(made <= max_extra_charges && spent <= max_extra_cost_minor);
            }
        }

        #[test]
        fn without_a_policy_nothing_is_ever_sent_again(made in 0u32..10) {
            prop_assert_eq!(on_unknown("s", None, made), OnUnknown::AskAPerson { why: None });
        }
    }
}
