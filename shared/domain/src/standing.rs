//! A step's standing decision, made in advance by whoever owns the catalogue: on an
//! outcome nobody can establish, send a new operation (what a person's
//! `retry_as_new` does) within a number of extra charges and an amount per task,
//! and ask a person once either is spent (docs/catalog.md, "A standing decision").

use serde::{Deserialize, Serialize};

use crate::spend::Amount;

/// The catalogue's `on_unknown.send_again` of one step, with the price it charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendAgain {
    /// Extra charges the policy may make per task, at least 1.
    pub max_extra_charges: u32,
    /// What those extra charges may cost in all per task.
    pub max_extra_cost: Amount,
    /// What one call of the step costs.
    pub price_per_call: Amount,
}

/// What the policy decides about one outcome that could not be established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnUnknown {
    /// Send a new operation: the `charge`-th extra charge of the task at this step,
    /// bringing what the policy spent to `cost`.
    SendAgain { charge: u32, cost: Amount },
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
    let cost = policy.price_per_call.saturating_mul(u64::from(charge));
    if charge <= policy.max_extra_charges && cost <= policy.max_extra_cost {
        return OnUnknown::SendAgain { charge, cost };
    }
    OnUnknown::AskAPerson {
        why: Some(format!(
            "the catalogue's policy for step `{step}` is spent ({made} extra charges made, at most {} and at most {} \
             in the currency's minor unit)",
            policy.max_extra_charges, policy.max_extra_cost
        )),
    }
}

/// The evidence an extra charge leaves on the task, as its status reason and so on
/// its timeline.
///
/// Do not change: readers (tests, people searching timelines) recognise it by its opening.
pub fn evidence(step: &str, policy: &SendAgain, charge: u32, cost: Amount) -> String {
    format!(
        "sent again under the catalogue's policy for step `{step}`: extra charge {charge} of at most {}, \
         {cost} of at most {} in the currency's minor unit ({} a call); the earlier call's outcome is \
         unknown and it may have been charged too",
        policy.max_extra_charges, policy.max_extra_cost, policy.price_per_call
    )
}

/// The opening of every [`evidence`] line.
pub const EVIDENCE_OPENING: &str = "sent again under the catalogue's policy for step";

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TWO: SendAgain = SendAgain {
        max_extra_charges: 2,
        max_extra_cost: Amount::from_minor(20),
        price_per_call: Amount::from_minor(10),
    };

    #[test]
    fn without_a_policy_a_person_decides() {
        assert_eq!(on_unknown("classify", None, 0), OnUnknown::AskAPerson { why: None });
    }

    #[test]
    fn a_policy_sends_again_until_either_limit_is_spent() {
        assert_eq!(
            on_unknown("classify", Some(&TWO), 0),
            OnUnknown::SendAgain { charge: 1, cost: Amount::from_minor(10) }
        );
        assert_eq!(
            on_unknown("classify", Some(&TWO), 1),
            OnUnknown::SendAgain { charge: 2, cost: Amount::from_minor(20) }
        );
        let OnUnknown::AskAPerson { why: Some(why) } = on_unknown("classify", Some(&TWO), 2) else {
            panic!("a spent policy asks a person")
        };
        assert!(why.contains("step `classify` is spent (2 extra charges made"), "{why}");
        let dear = SendAgain { price_per_call: Amount::from_minor(15), ..TWO };
        assert_eq!(
            on_unknown("classify", Some(&dear), 0),
            OnUnknown::SendAgain { charge: 1, cost: Amount::from_minor(15) }
        );
        assert!(matches!(on_unknown("classify", Some(&dear), 1), OnUnknown::AskAPerson { why: Some(_) }));
    }

    #[test]
    fn the_evidence_names_the_step_the_charge_and_the_limits() {
        let line = evidence("classify", &TWO, 1, Amount::from_minor(10));
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
            max_extra_cost_micros in 1i64..100_000_000,
            price_per_call_micros in 0i64..40_000_000,
            unknowns in 0usize..20,
        ) {
            let (max_extra_cost, price_per_call) =
                (Amount::from_micros(max_extra_cost_micros), Amount::from_micros(price_per_call_micros));
            let policy = SendAgain { max_extra_charges, max_extra_cost, price_per_call };
            let (mut made, mut spent, mut stopped) = (0u32, Amount::ZERO, false);
            for _ in 0..unknowns {
                match on_unknown("s", Some(&policy), made) {
                    OnUnknown::SendAgain { charge, cost } => {
                        prop_assert!(!stopped, "sent again after a person was asked");
                        prop_assert_eq!(charge, made + 1);
                        made = charge;
                        spent = spent.saturating_add(price_per_call);
                        prop_assert_eq!(cost, spent);
                    }
                    OnUnknown::AskAPerson { why } => {
                        prop_assert!(why.is_some(), "a spent policy says so");
                        stopped = true;
                    }
                }
                prop_assert!(made <= max_extra_charges && spent <= max_extra_cost);
            }
        }

        #[test]
        fn without_a_policy_nothing_is_ever_sent_again(made in 0u32..10) {
            prop_assert_eq!(on_unknown("s", None, made), OnUnknown::AskAPerson { why: None });
        }
    }
}
