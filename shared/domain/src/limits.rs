//! Provider limits as pure arithmetic: the token bucket of rate limits, and the
//! adaptive concurrency limit (AIMD) that shrinks a provider's slots when it is in
//! trouble and grows them back as it recovers. The scheduler keeps both in rows
//! every instance shares and asks this module what they allow.

use serde::{Deserialize, Serialize};

use crate::lifecycle::Micros;
use crate::vocabulary::ErrorClass;

/// Takes one token from a bucket holding `tokens` at `refilled_at`, filling at
/// `rate` per second up to `burst`. Returns the tokens left and, when the bucket is
/// empty, how many microseconds until the next token (nothing was taken then).
pub fn take_token(tokens: f64, refilled_at: Micros, rate: f64, burst: f64, now: Micros) -> (f64, Option<Micros>) {
    take_tokens(tokens, refilled_at, rate, burst, now, 1)
}

/// As [`take_token`], for an attempt that will make `calls` calls to the provider:
/// one token per call, all or none. More calls than the burst take the whole burst
/// (a full bucket always admits the attempt, which then cannot exceed the rate by
/// more than its own calls).
pub fn take_tokens(
    tokens: f64,
    refilled_at: Micros,
    rate: f64,
    burst: f64,
    now: Micros,
    calls: u32,
) -> (f64, Option<Micros>) {
    let want = f64::from(calls.max(1)).min(burst.max(1.0));
    let elapsed = (now.saturating_sub(refilled_at)).max(0) as f64 / 1_000_000.0;
    let available = (tokens + elapsed * rate).min(burst);
    if available >= want {
        (available - want, None)
    } else {
        let wait = ((want - available) / rate * 1_000_000.0).ceil() as Micros;
        (available, Some(wait.max(1)))
    }
}

/// What the executor writes for a call that got no answer within the call timeout
/// after it was sent; [`Health::of`] reads it back to tell a timeout from a 5xx.
// Do not change: the scheduler recognises timeouts in attempt outcomes by it.
pub const TIMED_OUT_AFTER_SEND: &str = "no answer within the call timeout after sending";

/// What an attempt's outcome says about its provider's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The call succeeded.
    Healthy,
    /// The provider is in trouble: slow down.
    Trouble(Trouble),
    /// Says nothing about the provider's health (a rejected input, a refused
    /// credential, a result that did not verify).
    Neutral,
}

/// Why a provider's limit was reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trouble {
    /// Sent, and no answer within the call timeout.
    Timeouts,
    /// A 5xx (declared safe or not), or a connection that broke mid-answer.
    ServerErrors,
    /// `429`.
    Throttled,
    /// The connection could not be made.
    Unreachable,
}

impl Trouble {
    /// "reduced after …" in status reasons and logs.
    pub fn describe(self) -> &'static str {
        match self {
            Trouble::Timeouts => "timeouts",
            Trouble::ServerErrors => "server errors",
            Trouble::Throttled => "throttling (429)",
            Trouble::Unreachable => "refused connections",
        }
    }
}

impl Health {
    /// The health signal of an attempt that failed with `class` and `message`.
    pub fn of(class: ErrorClass, message: &str) -> Self {
        match class {
            ErrorClass::Throttled => Health::Trouble(Trouble::Throttled),
            ErrorClass::ProviderFailed => Health::Trouble(Trouble::ServerErrors),
            ErrorClass::NotSent => Health::Trouble(Trouble::Unreachable),
            ErrorClass::Ambiguous if message.contains(TIMED_OUT_AFTER_SEND) => Health::Trouble(Trouble::Timeouts),
            ErrorClass::Ambiguous => Health::Trouble(Trouble::ServerErrors),
            ErrorClass::Rejected | ErrorClass::NotAuthorised | ErrorClass::ResultMismatch | ErrorClass::Busy => {
                Health::Neutral
            }
        }
    }
}

/// How a provider's adaptive limit moves (the catalogue's `adaptive_concurrency`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptivePolicy {
    /// The configured concurrency: the limit never exceeds it. The floor is 1.
    pub ceiling: u32,
    /// On trouble the limit is multiplied by this (0 < factor < 1).
    pub decrease_factor: f64,
    /// At most one decrease per this many microseconds: the failures of calls that
    /// were in flight together are one signal, not several.
    pub decrease_interval: Micros,
    /// Added to the limit over `limit` successes (one per full window of calls).
    pub increase: f64,
}

/// A provider's adaptive concurrency limit. Stored as JSON in the scheduler's
/// `provider_limits` row, shared by every scheduler instance.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveLimit {
    /// The limit, fractional so that additive increase accumulates.
    pub limit: f64,
    /// Why it is below the ceiling; `None` once it is back.
    pub reduced_after: Option<Trouble>,
    /// When it was last decreased.
    pub decreased_at: Option<Micros>,
}

/// What one observation did to a limit, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Unchanged,
    Decreased,
    Increased,
    /// Back at the ceiling after a reduction.
    Recovered,
}

impl AdaptiveLimit {
    /// A provider nobody has heard trouble from: at its ceiling.
    pub fn full(policy: &AdaptivePolicy) -> Self {
        AdaptiveLimit { limit: f64::from(policy.ceiling.max(1)), reduced_after: None, decreased_at: None }
    }

    /// The slots the limit grants now: its whole part, between 1 and the ceiling
    /// (a ceiling lowered in the catalogue takes effect at once).
    pub fn slots(&self, policy: &AdaptivePolicy) -> u32 {
        let ceiling = policy.ceiling.max(1);
        if self.limit.is_finite() { (self.limit.floor() as u32).clamp(1, ceiling) } else { ceiling }
    }

    /// Applies one attempt outcome at `now`.
    pub fn observe(&self, health: Health, now: Micros, policy: &AdaptivePolicy) -> (Self, Change) {
        let ceiling = f64::from(policy.ceiling.max(1));
        let current = if self.limit.is_finite() { self.limit.clamp(1.0, ceiling) } else { ceiling };
        match health {
            Health::Neutral => (AdaptiveLimit { limit: current, ..*self }, Change::Unchanged),
            Health::Trouble(trouble) => {
                let cooling = self.decreased_at.is_some_and(|at| now.saturating_sub(at) < policy.decrease_interval);
                if cooling {
                    return (AdaptiveLimit { limit: current, ..*self }, Change::Unchanged);
                }
                let factor = policy.decrease_factor.clamp(0.0, 1.0);
                let limit = (current * factor).max(1.0);
                let change = if limit < current { Change::Decreased } else { Change::Unchanged };
                (AdaptiveLimit { limit, reduced_after: Some(trouble), decreased_at: Some(now) }, change)
            }
            Health::Healthy => {
                let limit = (current + policy.increase.max(0.0) / current).min(ceiling);
                if limit >= ceiling {
                    let change = if self.reduced_after.is_some() { Change::Recovered } else { Change::Unchanged };
                    return (AdaptiveLimit { limit: ceiling, reduced_after: None, ..*self }, change);
                }
                let change = if limit.floor() > current.floor() { Change::Increased } else { Change::Unchanged };
                (AdaptiveLimit { limit, ..*self }, change)
            }
        }
    }

    /// "imagegen limit 2 of 8, reduced after timeouts", while it is reduced.
    pub fn describe(&self, provider: &str, policy: &AdaptivePolicy) -> Option<String> {
        let trouble = self.reduced_after?;
        Some(format!(
            "{provider} limit {} of {}, reduced after {}",
            self.slots(policy),
            policy.ceiling.max(1),
            trouble.describe()
        ))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_full_bucket_allows_its_burst_then_one_per_interval() {
        let (mut tokens, mut at) = (3.0, 0);
        for _ in 0..3 {
            let (left, wait) = take_token(tokens, at, 2.0, 3.0, 0);
            assert_eq!(wait, None);
            (tokens, at) = (left, 0);
        }
        let (_, wait) = take_token(tokens, at, 2.0, 3.0, 0);
        assert_eq!(wait, Some(500_000), "at 2 per second the next token comes in 0.5 s");
        let (left, wait) = take_token(tokens, at, 2.0, 3.0, 500_000);
        assert_eq!((left, wait), (0.0, None));
    }

    #[test]
    fn an_attempt_that_calls_twice_takes_two_tokens() {
        let (left, wait) = take_tokens(3.0, 0, 2.0, 3.0, 0, 2);
        assert_eq!((left, wait), (1.0, None));
        let (kept, wait) = take_tokens(left, 0, 2.0, 3.0, 0, 2);
        assert_eq!((kept, wait), (1.0, Some(500_000)), "one token short: nothing taken, wait for one more");
        let (left, wait) = take_tokens(5.0, 0, 1.0, 5.0, 0, 9);
        assert_eq!((left, wait), (0.0, None), "more calls than the burst take the whole burst");
    }

    proptest! {
        /// However calls are spaced, no window of T seconds admits more than burst + rate * T.
        #[test]
        fn never_more_than_burst_plus_rate(gaps in prop::collection::vec(0i64..400_000, 1..300)) {
            let (rate, burst) = (5.0, 2.0);
            let (mut tokens, mut at, mut now, mut admitted) = (burst, 0i64, 0i64, 0u32);
            for gap in gaps {
                now += gap;
                let (left, wait) = take_token(tokens, at, rate, burst, now);
                tokens = left;
                at = now;
                if wait.is_none() {
                    admitted += 1;
                }
            }
            let allowed = burst + rate * now as f64 / 1_000_000.0;
            prop_assert!(f64::from(admitted) <= allowed + 1e-9, "{admitted} > {allowed}");
        }
    }

    const POLICY: AdaptivePolicy =
        AdaptivePolicy { ceiling: 8, decrease_factor: 0.5, decrease_interval: 1_000_000, increase: 1.0 };

    #[test]
    fn trouble_halves_the_limit_once_per_interval_down_to_one() {
        let timeout = Health::Trouble(Trouble::Timeouts);
        let (limit, change) = AdaptiveLimit::full(&POLICY).observe(timeout, 0, &POLICY);
        assert_eq!((limit.slots(&POLICY), change), (4, Change::Decreased));
        assert_eq!(
            limit.describe("imagegen", &POLICY).as_deref(),
            Some("imagegen limit 4 of 8, reduced after timeouts")
        );
        let (same, change) = limit.observe(timeout, 500_000, &POLICY);
        assert_eq!((same.slots(&POLICY), change), (4, Change::Unchanged), "calls in flight together are one signal");
        let mut limit = same;
        for n in 1..10 {
            limit = limit.observe(Health::Trouble(Trouble::ServerErrors), n * 1_000_000, &POLICY).0;
        }
        assert_eq!(limit.slots(&POLICY), 1, "never below one");
        assert_eq!(limit.reduced_after, Some(Trouble::ServerErrors), "the latest trouble is named");
    }

    #[test]
    fn successes_add_one_slot_per_window_of_calls_and_recover_to_the_ceiling() {
        let mut limit = AdaptiveLimit { limit: 1.0, reduced_after: Some(Trouble::Throttled), decreased_at: Some(0) };
        let mut successes = 0;
        let mut last = Change::Unchanged;
        while limit.reduced_after.is_some() {
            (limit, last) = limit.observe(Health::Healthy, 0, &POLICY);
            successes += 1;
            assert!(successes < 100, "never recovered: {limit:?}");
        }
        assert_eq!(last, Change::Recovered);
        assert_eq!(limit.slots(&POLICY), 8);
        // 1 + 2 + ... + 7 successes, give or take rounding: additive, not a jump.
        assert!((25..=32).contains(&successes), "{successes} successes to recover");
        assert_eq!(limit.describe("imagegen", &POLICY), None);
    }

    #[test]
    fn outcomes_are_read_as_health_signals() {
        assert_eq!(Health::of(ErrorClass::Ambiguous, TIMED_OUT_AFTER_SEND), Health::Trouble(Trouble::Timeouts));
        assert_eq!(
            Health::of(ErrorClass::Ambiguous, "the provider answered 500"),
            Health::Trouble(Trouble::ServerErrors)
        );
        assert_eq!(Health::of(ErrorClass::ProviderFailed, "503"), Health::Trouble(Trouble::ServerErrors));
        assert_eq!(Health::of(ErrorClass::Throttled, "429"), Health::Trouble(Trouble::Throttled));
        assert_eq!(Health::of(ErrorClass::NotSent, "refused"), Health::Trouble(Trouble::Unreachable));
        assert_eq!(Health::of(ErrorClass::Rejected, "400"), Health::Neutral);
    }

    fn health() -> impl Strategy<Value = Health> {
        prop_oneof![
            Just(Health::Healthy),
            Just(Health::Neutral),
            Just(Health::Trouble(Trouble::Timeouts)),
            Just(Health::Trouble(Trouble::Throttled)),
        ]
    }

    proptest! {
        /// Whatever happens, in whatever order: the slots stay within [1, ceiling],
        /// trouble never raises the limit and success never lowers it, and a
        /// decrease is at least the factor once the interval passed.
        #[test]
        fn the_limit_stays_within_its_bounds_and_moves_the_right_way(
            ceiling in 1u32..64,
            steps in prop::collection::vec((health(), 0i64..2_000_000), 1..300),
        ) {
            let policy = AdaptivePolicy { ceiling, ..POLICY };
            let (mut limit, mut now) = (AdaptiveLimit::full(&policy), 0i64);
            for (health, gap) in steps {
                now += gap;
                let (next, _) = limit.observe(health, now, &policy);
                prop_assert!((1..=ceiling).contains(&next.slots(&policy)));
                prop_assert!(next.limit >= 1.0 && next.limit <= f64::from(ceiling));
                match health {
                    Health::Trouble(_) => {
                        prop_assert!(next.limit <= limit.limit);
                        let cooled = limit.decreased_at.is_none_or(|at| now - at >= policy.decrease_interval);
                        if cooled {
                            prop_assert!(next.limit <= (limit.limit * policy.decrease_factor).max(1.0) + 1e-9);
                        }
                    }
                    Health::Healthy => prop_assert!(next.limit >= limit.limit),
                    Health::Neutral => prop_assert_eq!(next.limit, limit.limit),
                }
                limit = next;
            }
        }

        /// After any history, enough successes bring the limit back to the ceiling.
        #[test]
        fn successes_always_recover_the_ceiling(
            ceiling in 1u32..64,
            troubles in 0usize..20,
        ) {
            let policy = AdaptivePolicy { ceiling, ..POLICY };
            let mut limit = AdaptiveLimit::full(&policy);
            for n in 0..troubles {
                limit = limit.observe(Health::Trouble(Trouble::ServerErrors), n as i64 * 2_000_000, &policy).0;
            }
            let bound = (ceiling as usize).pow(2) + 1;
            for _ in 0..bound {
                limit = limit.observe(Health::Healthy, 0, &policy).0;
            }
            prop_assert_eq!(limit.slots(&policy), ceiling);
            prop_assert_eq!(limit.reduced_after, None);
        }
    }
}
