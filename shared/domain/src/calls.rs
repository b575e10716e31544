//! Provider calls as pure decisions (DESIGN.md sections 1 and 6): the operation
//! key, the error class of every outcome, the decision after an attempt was lost,
//! and backoff with full jitter. The executor, scheduler and reconciler carry out
//! what these return.

use std::collections::HashMap;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::ids::TaskId;
use crate::vocabulary::{ErrorClass, Phase};

/// The identity of one provider call: `sha256(task_id:step:generation:seq)`, hex.
/// Unchanged on every retry while the previous call's outcome is unknown, so a
/// provider that dedupes by key charges once.
///
/// Do not change: providers dedupe on it, and a changed formula would make every
/// retry in flight a new, billable operation.
pub fn operation_key(task_id: TaskId, step: &str, generation: u32, seq: u32) -> String {
    hex::encode(Sha256::digest(format!("{task_id}:{step}:{generation}:{seq}").as_bytes()))
}

/// What a provider call came to, as the adapter observed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// The request never left: connection refused, DNS, TLS handshake, local
    /// validation before sending.
    NotSent,
    /// The provider answered with a status (and, for 429, perhaps `Retry-After`).
    Answered { status: u16, retry_after: Option<Duration> },
    /// Sent, and then no answer in time.
    TimedOutAfterSend,
    /// Sent, and the connection broke while the answer was arriving.
    ResetMidResponse,
}

/// The class of an outcome and what follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    pub class: ErrorClass,
    /// Honour at least this long before the next try.
    pub retry_after: Option<Duration>,
    /// Whether the provider may have done (and billed) the work.
    pub money_may_have_been_spent: bool,
    /// Whether the scheduler may try again at all (within its limits).
    pub retryable: bool,
}

/// Classifies an outcome; `None` means success (2xx). `overrides` map a status
/// code to a class for providers that use codes their own way.
pub fn classify(outcome: &CallOutcome, overrides: &HashMap<u16, ErrorClass>) -> Option<Classification> {
    let of = |class: ErrorClass, retry_after: Option<Duration>| {
        let (spent, retryable) = match class {
            ErrorClass::NotSent | ErrorClass::Throttled | ErrorClass::ProviderFailed | ErrorClass::Busy => {
                (false, true)
            }
            ErrorClass::Rejected | ErrorClass::NotAuthorised => (false, false),
            // The work may have happened: only the decision table may retry.
            ErrorClass::Ambiguous => (true, false),
            ErrorClass::ResultMismatch => (true, false),
        };
        Classification { class, retry_after, money_may_have_been_spent: spent, retryable }
    };
    match outcome {
        CallOutcome::NotSent => Some(of(ErrorClass::NotSent, None)),
        CallOutcome::TimedOutAfterSend | CallOutcome::ResetMidResponse => Some(of(ErrorClass::Ambiguous, None)),
        CallOutcome::Answered { status, retry_after } => {
            if let Some(class) = overrides.get(status) {
                return Some(of(*class, *retry_after));
            }
            match status {
                200..=299 => None,
                429 => Some(of(ErrorClass::Throttled, *retry_after)),
                401..=403 => Some(of(ErrorClass::NotAuthorised, None)),
                400..=499 => Some(of(ErrorClass::Rejected, None)),
                500..=599 => Some(of(ErrorClass::ProviderFailed, *retry_after)),
                // 1xx/3xx from a JSON API: nothing we asked for; the work may
                // or may not have started.
                _ => Some(of(ErrorClass::Ambiguous, None)),
            }
        }
    }
}

/// What a provider declares it can do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProviderCapabilities {
    pub idempotency_keys: bool,
    pub lookup: bool,
}

/// What to do with an attempt that ended without a clean result (worker died,
/// lease expired, ambiguous error), by its last durable phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterLoss {
    /// No call left: retry; no money was spent.
    RetrySafe,
    /// Retry with the same operation key; the provider dedupes.
    RetrySameKey,
    /// Ask the provider by operation key or request id before anything else.
    AskProvider,
    /// Nobody can know: stop automatic retries and wait for a person.
    OutcomeUnknown,
    /// The result is durable already: finish the attempt with it.
    FinishRecorded,
}

/// The recovery decision table of DESIGN.md section 6.
///
/// A provider that dedupes by key makes a retry with the same key safe after
/// `provider_accepted` too (the table names the case without a request id; with
/// one, the same key still returns the first call's result).
pub fn after_loss(last_phase: Phase, request_id_known: bool, provider: ProviderCapabilities) -> AfterLoss {
    match last_phase {
        Phase::Claimed | Phase::StepStarted => AfterLoss::RetrySafe,
        Phase::ResultRecorded | Phase::Finished => AfterLoss::FinishRecorded,
        Phase::CallIntent | Phase::ProviderAccepted => {
            if provider.idempotency_keys && (!request_id_known || !provider.lookup) {
                AfterLoss::RetrySameKey
            } else if provider.lookup {
                AfterLoss::AskProvider
            } else {
                AfterLoss::OutcomeUnknown
            }
        }
    }
}

/// What a provider look-up answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupAnswer {
    /// The provider has the operation (with or without its result yet).
    Found { finished: bool },
    /// The provider says it never received the operation.
    NeverReceived,
    /// No answer (timeout, 5xx): ask again later.
    NoAnswer,
}

/// What follows a look-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterLookup {
    /// Take the provider's result; no second call.
    Recover,
    /// Ask again after this long.
    AskAgainIn(Duration),
    /// Definitely nothing was done: retry as a new call (`seq` + 1).
    RetrySafe,
    /// The deadline passed without an answer.
    OutcomeUnknown,
}

/// Decides after the `asked`-th look-up (0-based), with `until_deadline` left.
pub fn after_lookup(
    answer: LookupAnswer,
    asked: u32,
    until_deadline: Duration,
    backoff: &Backoff,
    jitter: f64,
) -> AfterLookup {
    match answer {
        LookupAnswer::Found { finished: true } => AfterLookup::Recover,
        LookupAnswer::NeverReceived => AfterLookup::RetrySafe,
        LookupAnswer::Found { finished: false } | LookupAnswer::NoAnswer => {
            let wait = backoff.delay(asked, None, jitter);
            if wait < until_deadline { AfterLookup::AskAgainIn(wait) } else { AfterLookup::OutcomeUnknown }
        }
    }
}

/// Exponential backoff with full jitter, capped, honouring `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// The wait before retry number `retry` (0-based). `jitter` in `[0, 1)` is
    /// injected (a random draw in production, fixed in tests): the wait is
    /// `jitter * min(cap, base * 2^retry)`, but never less than `retry_after`.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        let exponential = self.base.saturating_mul(2u32.saturating_pow(retry.min(31)));
        let ceiling = exponential.min(self.cap);
        let jittered = ceiling.mul_f64(jitter.clamp(0.0, 1.0));
        jittered.max(retry_after.unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use uuid::Uuid;

    use super::*;

    fn answered(status: u16) -> CallOutcome {
        CallOutcome::Answered { status, retry_after: None }
    }

    #[test]
    fn the_operation_key_is_pinned() {
        let task = TaskId::from_uuid(Uuid::from_u128(0x0190_f6c8_0000_7000_8000_0000_0000_0001));
        // Do not change: sha256("0190f6c8-0000-7000-8000-000000000001:render:0:0").
        assert_eq!(
            operation_key(task, "render", 0, 0),
            "0d2639e741ed14ca50e7fbe236e4f85907d58e43b5e00c1ce7579f7a177480fc"
        );
        assert_ne!(operation_key(task, "render", 0, 1), operation_key(task, "render", 0, 0), "seq changes it");
        assert_ne!(operation_key(task, "render", 1, 0), operation_key(task, "render", 0, 0), "generation changes it");
    }

    #[test]
    fn every_row_of_the_error_class_table() {
        let none = HashMap::new();
        let class = |o: &CallOutcome| classify(o, &none).map(|c| c.class);
        assert_eq!(class(&CallOutcome::NotSent), Some(ErrorClass::NotSent));
        let throttled =
            classify(&CallOutcome::Answered { status: 429, retry_after: Some(Duration::from_secs(7)) }, &none)
                .expect("error");
        assert_eq!((throttled.class, throttled.retry_after), (ErrorClass::Throttled, Some(Duration::from_secs(7))));
        for status in [400, 404, 409, 422] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::Rejected), "{status}");
        }
        for status in [401, 402, 403] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::NotAuthorised), "{status}");
        }
        for status in [500, 502, 503, 504] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::ProviderFailed), "{status}");
        }
        assert_eq!(class(&CallOutcome::TimedOutAfterSend), Some(ErrorClass::Ambiguous));
        assert_eq!(class(&CallOutcome::ResetMidResponse), Some(ErrorClass::Ambiguous));
        assert_eq!(class(&answered(200)), None);
        assert_eq!(class(&answered(202)), None);
    }

    #[test]
    fn only_ambiguous_outcomes_may_have_cost_money_and_they_are_never_retried_blindly() {
        let none = HashMap::new();
        for outcome in [CallOutcome::NotSent, answered(429), answered(400), answered(402), answered(503)] {
            assert!(!classify(&outcome, &none).expect("error").money_may_have_been_spent, "{outcome:?}");
        }
        let ambiguous = classify(&CallOutcome::TimedOutAfterSend, &none).expect("error");
        assert!(ambiguous.money_may_have_been_spent && !ambiguous.retryable);
        assert!(!classify(&answered(422), &none).expect("error").retryable, "rejected is permanent");
        assert!(!classify(&answered(401), &none).expect("error").retryable, "not authorised is permanent");
    }

    #[test]
    fn a_provider_may_override_the_class_of_a_status() {
        let overrides = HashMap::from([(409, ErrorClass::Throttled), (200, ErrorClass::ProviderFailed)]);
        assert_eq!(classify(&answered(409), &overrides).map(|c| c.class), Some(ErrorClass::Throttled));
        assert_eq!(classify(&answered(200), &overrides).map(|c| c.class), Some(ErrorClass::ProviderFailed));
    }

    #[test]
    fn every_row_of_the_recovery_decision_table() {
        let caps = |idempotency_keys, lookup| ProviderCapabilities { idempotency_keys, lookup };
        for phase in [Phase::Claimed, Phase::StepStarted] {
            for c in [caps(false, false), caps(true, true)] {
                assert_eq!(after_loss(phase, false, c), AfterLoss::RetrySafe, "{phase:?}");
            }
        }
        assert_eq!(after_loss(Phase::CallIntent, false, caps(true, false)), AfterLoss::RetrySameKey);
        assert_eq!(after_loss(Phase::CallIntent, false, caps(true, true)), AfterLoss::RetrySameKey);
        assert_eq!(after_loss(Phase::CallIntent, false, caps(false, true)), AfterLoss::AskProvider);
        assert_eq!(after_loss(Phase::ProviderAccepted, true, caps(false, true)), AfterLoss::AskProvider);
        assert_eq!(after_loss(Phase::ProviderAccepted, true, caps(true, true)), AfterLoss::AskProvider);
        assert_eq!(after_loss(Phase::CallIntent, false, caps(false, false)), AfterLoss::OutcomeUnknown);
        assert_eq!(after_loss(Phase::ProviderAccepted, true, caps(false, false)), AfterLoss::OutcomeUnknown);
        assert_eq!(after_loss(Phase::ResultRecorded, true, caps(false, false)), AfterLoss::FinishRecorded);
    }

    #[test]
    fn look_ups_recover_retry_ask_again_or_give_up_at_the_deadline() {
        let backoff = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60) };
        let hour = Duration::from_secs(3600);
        assert_eq!(after_lookup(LookupAnswer::Found { finished: true }, 0, hour, &backoff, 0.5), AfterLookup::Recover);
        assert_eq!(after_lookup(LookupAnswer::NeverReceived, 0, hour, &backoff, 0.5), AfterLookup::RetrySafe);
        assert_eq!(
            after_lookup(LookupAnswer::NoAnswer, 2, hour, &backoff, 0.5),
            AfterLookup::AskAgainIn(Duration::from_secs(2))
        );
        assert_eq!(
            after_lookup(LookupAnswer::NoAnswer, 2, Duration::from_secs(1), &backoff, 0.5),
            AfterLookup::OutcomeUnknown
        );
    }

    proptest! {
        /// Full jitter stays within [Retry-After, max(Retry-After, min(cap, base * 2^n))].
        #[test]
        fn backoff_is_bounded_and_honours_retry_after(retry in 0u32..64, jitter in 0.0f64..1.0, after in proptest::option::of(0u64..120)) {
            let backoff = Backoff { base: Duration::from_millis(250), cap: Duration::from_secs(30) };
            let retry_after = after.map(Duration::from_secs);
            let wait = backoff.delay(retry, retry_after, jitter);
            prop_assert!(wait >= retry_after.unwrap_or_default());
            prop_assert!(wait <= backoff.cap.max(retry_after.unwrap_or_default()));
        }
    }
}
