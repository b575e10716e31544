//! Provider calls as pure decisions (docs/execution.md, docs/provider-protocol.md):
//! the operation key, the error class of every outcome, what follows an outcome
//! that is not a result, the decision after an attempt was lost, and backoff with
//! full jitter. The executor, scheduler and reconciler carry out what these return.

use std::collections::{BTreeSet, HashMap};
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
    /// Someone answered with a status (and, for 429, perhaps `Retry-After`).
    Answered {
        status: u16,
        retry_after: Option<Duration>,
        /// The body is the provider's own problem document
        /// (`application/problem+json`). Without it the answer may come from a
        /// gateway in front of the provider, which cannot vouch for the work.
        problem_body: bool,
        /// The class the provider's own error body named (a dialect's
        /// `error_classes`, docs/catalog.md): it decides before the status, except
        /// that a 5xx the provider could not vouch for stays ambiguous.
        class_named: Option<ErrorClass>,
    },
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

impl Classification {
    fn of(class: ErrorClass, retry_after: Option<Duration>) -> Self {
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
    }
}

/// The 5xx statuses a gateway or load balancer answers after it forwarded the
/// request: the work may have been done behind it, so no provider can declare
/// them safe.
pub const GATEWAY_STATUSES: [u16; 2] = [502, 504];

/// How one provider's answers are read (docs/provider-protocol.md, "Error
/// classes"): its status overrides, the 5xx statuses it vouches for, and whether
/// it dedupes by operation key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErrorTable {
    /// Status code → class, for providers that use codes their own way.
    pub overrides: HashMap<u16, ErrorClass>,
    /// 5xx statuses the provider answers, with its problem body, only when it did
    /// no work. Every other 5xx may have done the work. Never 502 or 504.
    pub safe_5xx: BTreeSet<u16>,
    /// The provider dedupes by `Idempotency-Key`: a 409 to a keyed request says a
    /// request with the same key is still running there.
    pub dedupes: bool,
    /// The provider is sent the operation key (it dedupes or looks up by it). At one
    /// that does not dedupe, a 409 "still running" says an earlier request with
    /// the key is doing (and will bill) the work: in doubt, never "rejected".
    pub keyed: bool,
}

impl ErrorTable {
    /// Whether a 5xx answer proves that nothing was done.
    fn vouches_for(&self, status: u16, problem_body: bool) -> bool {
        problem_body && !GATEWAY_STATUSES.contains(&status) && self.safe_5xx.contains(&status)
    }

    /// Whether an answer to a start says the same key is still being worked on.
    fn in_progress(&self, outcome: &CallOutcome) -> bool {
        matches!(outcome, CallOutcome::Answered { status: 409, .. })
            && self.dedupes
            && !self.overrides.contains_key(&409)
    }
}

/// Classifies an outcome; `None` means success (2xx). A 5xx is classed by what
/// it proves: only a status the provider declared safe, answered with its own
/// problem body, says nothing was done; any other 5xx (a gateway's 502 or 504
/// always) may have done the work and is ambiguous, whatever the overrides say.
pub fn classify(outcome: &CallOutcome, table: &ErrorTable) -> Option<Classification> {
    match outcome {
        CallOutcome::NotSent => Some(Classification::of(ErrorClass::NotSent, None)),
        CallOutcome::TimedOutAfterSend | CallOutcome::ResetMidResponse => {
            Some(Classification::of(ErrorClass::Ambiguous, None))
        }
        CallOutcome::Answered { status, retry_after, problem_body, class_named } => {
            let of = Classification::of;
            if (500..=599).contains(status) && !table.vouches_for(*status, *problem_body) {
                return Some(of(ErrorClass::Ambiguous, None));
            }
            // The key was sent and a request with it may be running (and billing):
            // whatever class the body names, this request proves nothing done.
            if *status == 409 && table.keyed && !table.dedupes && !table.overrides.contains_key(&409) {
                return Some(of(ErrorClass::Ambiguous, None));
            }
            // A 429 turned the request away for its rate, not for what it asked: a
            // vendor's error type may make it a bill to pay (not authorised), never
            // a refusal that ends the task (Stripe sends its rate limits as an
            // `invalid_request_error`).
            let refusal_of_a_throttle = *status == 429 && *class_named == Some(ErrorClass::Rejected);
            if let Some(class) = class_named
                && !(200..=299).contains(status)
                && !refusal_of_a_throttle
            {
                return Some(of(*class, *retry_after));
            }
            if let Some(class) = table.overrides.get(status) {
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

/// Where a call stood when an outcome other than a result arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStage {
    /// The request was sent; the provider has named no request id.
    Sent,
    /// The provider accepted the work under a request id; the outcome is a poll's.
    Accepted,
}

/// What the executor does after an outcome that is not a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextMove {
    /// Poll the accepted operation again after this long.
    PollAgainIn(Duration),
    /// Send the same request, with the same operation key, again after this long:
    /// the provider is still running a request with this key.
    ResendIn(Duration),
    /// End the attempt. `new_key`: the provider certainly did nothing with this
    /// request, so the next try may be a new operation (`seq` + 1; the executor
    /// keeps the key anyway when another attempt sent it); otherwise it keeps this key.
    Fail { classification: Classification, new_key: bool },
}

/// Decides after the `tries`-th (0-based) outcome of one call that was not a
/// result, with `time_left` in the attempt's budget.
///
/// Once the provider accepted the work, no poll outcome means "nothing done": a
/// poll that fails (5xx, 429, 404, a refused or reset connection) is asked again
/// with backoff, and when the budget runs out the attempt fails as ambiguous with
/// the same key, so the recovery table decides. A 409 for a key still running at
/// a provider that dedupes is waited for and sent again with the same key.
pub fn after_outcome(
    stage: CallStage,
    outcome: &CallOutcome,
    table: &ErrorTable,
    tries: u32,
    time_left: Duration,
    backoff: &Backoff,
    jitter: f64,
) -> NextMove {
    let ambiguous = NextMove::Fail { classification: Classification::of(ErrorClass::Ambiguous, None), new_key: false };
    let retry_after = match outcome {
        CallOutcome::Answered { retry_after, .. } => *retry_after,
        _ => None,
    };
    let wait = backoff.delay(tries, retry_after, jitter);
    match stage {
        CallStage::Accepted if wait < time_left => NextMove::PollAgainIn(wait),
        CallStage::Accepted => ambiguous,
        CallStage::Sent if table.in_progress(outcome) => {
            if wait < time_left {
                NextMove::ResendIn(wait)
            } else {
                ambiguous
            }
        }
        CallStage::Sent => match classify(outcome, table) {
            Some(classification) => {
                NextMove::Fail { classification, new_key: !classification.money_may_have_been_spent }
            }
            // A success the adapter could not read: the work may have happened.
            None => ambiguous,
        },
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

/// The recovery decision table (docs/catalog.md, docs/execution.md).
///
/// A provider that dedupes by key makes a retry with the same key safe after
/// `provider_accepted` too (the table names the case without a request id; with
/// one, the same key still returns the first call's result). A request id the
/// provider named is asked about (polled) at any provider, whether or not it can
/// look up by key: the work it accepted is followed to its result, not given up.
pub fn after_loss(last_phase: Phase, request_id_known: bool, provider: ProviderCapabilities) -> AfterLoss {
    match last_phase {
        Phase::Claimed | Phase::StepStarted => AfterLoss::RetrySafe,
        Phase::ResultRecorded | Phase::Finished => AfterLoss::FinishRecorded,
        Phase::CallIntent | Phase::ProviderAccepted => {
            if provider.idempotency_keys && (!request_id_known || !provider.lookup) {
                AfterLoss::RetrySameKey
            } else if provider.lookup || request_id_known {
                AfterLoss::AskProvider
            } else {
                AfterLoss::OutcomeUnknown
            }
        }
    }
}

/// Whether a provider that remembers an operation key for `memory` (its
/// idempotency window; `None`: for as long as Fenceline could ask) surely still
/// remembers one first sent at `first_sent_us`, at `now_us`. A tenth of the window
/// is kept back for the request to travel and for the clocks to differ: past that,
/// the same key sent again may be taken as new work and charged again.
pub fn key_remembered(first_sent_us: i64, now_us: i64, memory: Option<Duration>) -> bool {
    let Some(memory) = memory else { return true };
    let memory_us = i64::try_from(memory.as_micros()).unwrap_or(i64::MAX);
    now_us.saturating_sub(first_sent_us) < memory_us - memory_us / 10
}

/// The evidence that a key is no longer surely remembered.
pub fn key_forgotten(provider: &str, memory: Duration, first_sent: &str) -> String {
    format!(
        "provider `{provider}` remembers an operation key for {} and this key was first sent at {first_sent}: sent \
         again now, the provider may take it as new work and charge it again",
        describe_span(memory)
    )
}

fn describe_span(span: Duration) -> String {
    let seconds = span.as_secs_f64();
    if seconds >= 3_600.0 { format!("{} h", trim(seconds / 3_600.0)) } else { format!("{} s", trim(seconds)) }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
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
/// `received`: an earlier answer showed that the provider received the request
/// (it accepted it under a request id, or a look-up found it). Evidence only moves
/// toward "it happened": after that, a "never received" (an expired job, a replica
/// that lost it, a restart) is no answer, never a safe retry.
pub fn after_lookup(
    answer: LookupAnswer,
    received: bool,
    asked: u32,
    until_deadline: Duration,
    backoff: &Backoff,
    jitter: f64,
) -> AfterLookup {
    match answer {
        LookupAnswer::Found { finished: true } => AfterLookup::Recover,
        LookupAnswer::NeverReceived if !received => AfterLookup::RetrySafe,
        LookupAnswer::Found { finished: false } | LookupAnswer::NoAnswer | LookupAnswer::NeverReceived => {
            let wait = backoff.delay(asked, None, jitter);
            if wait < until_deadline { AfterLookup::AskAgainIn(wait) } else { AfterLookup::OutcomeUnknown }
        }
    }
}

/// Where a case stands when a fenced worker's verified result reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaseStanding {
    /// Still asking the provider.
    Asking,
    /// Decided `outcome_unknown`: waiting for a person.
    OutcomeUnknown,
    /// Decided otherwise (a retry, a recovery, a person's case).
    Decided,
}

/// What a verified result a fenced worker reported does to its attempt's case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFencedResult {
    /// The result of the very call in doubt, verified: the work is done and paid
    /// for once; recover it, with no second call (as a look-up that finds it).
    Recover,
    /// The result of a step before the kind's last call: resuming from it is not
    /// automated, a person decides with the result among the evidence.
    NeedsHuman,
    /// Shown to the person the case waits for, with nothing decided by it.
    ShowThePerson,
    /// Kept among the case's evidence only: the case was decided already, or the
    /// result is of another operation than the one in doubt.
    EvidenceOnly,
}

/// The recovery table's row for a fenced worker's verified result
/// (docs/execution.md, "Reconciler: evidence, then a decision"). `same_call`: the
/// report names the case's step and operation key; `last_call`: that step is the
/// kind's last call.
pub fn after_fenced_result(standing: CaseStanding, same_call: bool, last_call: bool) -> AfterFencedResult {
    match (standing, same_call, last_call) {
        (_, false, _) | (CaseStanding::Decided, _, _) => AfterFencedResult::EvidenceOnly,
        (CaseStanding::Asking | CaseStanding::OutcomeUnknown, true, true) => AfterFencedResult::Recover,
        (CaseStanding::Asking, true, false) => AfterFencedResult::NeedsHuman,
        (CaseStanding::OutcomeUnknown, true, false) => AfterFencedResult::ShowThePerson,
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
        CallOutcome::Answered { status, retry_after: None, problem_body: true, class_named: None }
    }

    fn bare(status: u16) -> CallOutcome {
        CallOutcome::Answered { status, retry_after: None, problem_body: false, class_named: None }
    }

    fn safe(statuses: &[u16]) -> ErrorTable {
        ErrorTable { safe_5xx: statuses.iter().copied().collect(), ..ErrorTable::default() }
    }

    #[test]
    fn a_class_the_providers_own_body_names_decides_except_for_a_5xx_it_cannot_vouch_for() {
        let named = |status: u16, class: ErrorClass, problem_body: bool| CallOutcome::Answered {
            status,
            retry_after: None,
            problem_body,
            class_named: Some(class),
        };
        let class = |outcome: &CallOutcome, table: &ErrorTable| classify(outcome, table).map(|c| c.class);
        // OpenAI's `insufficient_quota` arrives as a 429: it is no throttle but a bill to pay.
        let quota = named(429, ErrorClass::NotAuthorised, true);
        assert_eq!(class(&quota, &ErrorTable::default()), Some(ErrorClass::NotAuthorised));
        // A rate limit whose body names a refusal is still a throttle, waited out.
        assert_eq!(class(&named(429, ErrorClass::Rejected, true), &ErrorTable::default()), Some(ErrorClass::Throttled));
        // A 5xx may have done the work unless declared safe: a named class does not change that.
        let server = named(500, ErrorClass::ProviderFailed, true);
        assert_eq!(class(&server, &ErrorTable::default()), Some(ErrorClass::Ambiguous));
        assert_eq!(class(&server, &safe(&[500])), Some(ErrorClass::ProviderFailed));
        assert_eq!(class(&named(504, ErrorClass::Throttled, true), &safe(&[503])), Some(ErrorClass::Ambiguous));
        // At a provider that dedupes, a 409 is the same key still running whatever
        // class its body names (Stripe's `idempotency_key_in_use` comes as an
        // `invalid_request_error`): read as "rejected", the task would end while
        // the first request pays. Only the catalogue's own override of 409 decides.
        let table = ErrorTable { dedupes: true, keyed: true, ..ErrorTable::default() };
        assert!(table.in_progress(&named(409, ErrorClass::Rejected, true)));
        assert!(table.in_progress(&answered(409)));
        // At one that is sent the key but does not dedupe, the earlier request may
        // bill: in doubt, whatever the body names.
        let keyed = ErrorTable { keyed: true, ..ErrorTable::default() };
        assert_eq!(class(&named(409, ErrorClass::Rejected, true), &keyed), Some(ErrorClass::Ambiguous));
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
    fn a_key_is_remembered_until_a_tenth_before_the_providers_window_ends() {
        let day = Some(Duration::from_secs(24 * 3_600));
        let hour_us = 3_600_000_000i64;
        assert!(key_remembered(0, 21 * hour_us, day));
        assert!(!key_remembered(0, 22 * hour_us, day), "21.6 h is the last instant a resend is sure");
        assert!(!key_remembered(0, 30 * hour_us, day));
        assert!(key_remembered(0, 1_000 * hour_us, None), "a provider without a window remembers as long as asked");
        let line = key_forgotten("stripe", Duration::from_secs(24 * 3_600), "2026-12-01T10:00:00Z");
        assert!(line.contains("remembers an operation key for 24 h"), "{line}");
        assert_eq!(describe_span(Duration::from_millis(7_200)), "7.2 s");
    }

    #[test]
    fn every_row_of_the_error_class_table() {
        let none = ErrorTable::default();
        let class = |o: &CallOutcome| classify(o, &none).map(|c| c.class);
        assert_eq!(class(&CallOutcome::NotSent), Some(ErrorClass::NotSent));
        let throttled = classify(
            &CallOutcome::Answered {
                status: 429,
                retry_after: Some(Duration::from_secs(7)),
                problem_body: true,
                class_named: None,
            },
            &none,
        )
        .expect("error");
        assert_eq!((throttled.class, throttled.retry_after), (ErrorClass::Throttled, Some(Duration::from_secs(7))));
        for status in [400, 404, 409, 422] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::Rejected), "{status}");
        }
        for status in [401, 402, 403] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::NotAuthorised), "{status}");
        }
        for status in [500, 502, 503, 504] {
            assert_eq!(class(&answered(status)), Some(ErrorClass::Ambiguous), "{status} is not declared safe");
        }
        assert_eq!(class(&CallOutcome::TimedOutAfterSend), Some(ErrorClass::Ambiguous));
        assert_eq!(class(&CallOutcome::ResetMidResponse), Some(ErrorClass::Ambiguous));
        assert_eq!(class(&answered(200)), None);
        assert_eq!(class(&answered(202)), None);
    }

    #[test]
    fn a_5xx_says_nothing_was_done_only_when_declared_safe_and_answered_by_the_provider_itself() {
        let table = safe(&[500, 503]);
        let class = |o: &CallOutcome| classify(o, &table).map(|c| (c.class, c.money_may_have_been_spent));
        assert_eq!(class(&answered(503)), Some((ErrorClass::ProviderFailed, false)), "declared, with its body");
        assert_eq!(class(&answered(500)), Some((ErrorClass::ProviderFailed, false)));
        assert_eq!(class(&bare(503)), Some((ErrorClass::Ambiguous, true)), "without its body: maybe a gateway");
        assert_eq!(class(&answered(501)), Some((ErrorClass::Ambiguous, true)), "not declared");
        // A gateway answers these after forwarding: not even a declaration makes them safe.
        let gateway = safe(&[502, 504]);
        for status in GATEWAY_STATUSES {
            assert_eq!(classify(&answered(status), &gateway).map(|c| c.class), Some(ErrorClass::Ambiguous));
        }
    }

    #[test]
    fn only_ambiguous_outcomes_may_have_cost_money_and_they_are_never_retried_blindly() {
        let table = safe(&[503]);
        for outcome in [CallOutcome::NotSent, answered(429), answered(400), answered(402), answered(503)] {
            assert!(!classify(&outcome, &table).expect("error").money_may_have_been_spent, "{outcome:?}");
        }
        for outcome in [CallOutcome::TimedOutAfterSend, bare(503), answered(504), answered(500)] {
            let ambiguous = classify(&outcome, &table).expect("error");
            assert!(ambiguous.money_may_have_been_spent && !ambiguous.retryable, "{outcome:?}");
        }
        assert!(!classify(&answered(422), &table).expect("error").retryable, "rejected is permanent");
        assert!(!classify(&answered(401), &table).expect("error").retryable, "not authorised is permanent");
    }

    #[test]
    fn a_provider_may_override_the_class_of_a_status_but_not_make_an_unsafe_5xx_safe() {
        let overrides = HashMap::from([
            (409, ErrorClass::Throttled),
            (200, ErrorClass::ProviderFailed),
            (503, ErrorClass::Throttled),
            (500, ErrorClass::Throttled),
        ]);
        let table = ErrorTable { overrides, safe_5xx: BTreeSet::from([503]), dedupes: false, keyed: false };
        let class = |o: &CallOutcome| classify(o, &table).map(|c| c.class);
        assert_eq!(class(&answered(409)), Some(ErrorClass::Throttled));
        assert_eq!(class(&answered(200)), Some(ErrorClass::ProviderFailed));
        assert_eq!(class(&answered(503)), Some(ErrorClass::Throttled), "a declared-safe 5xx takes its override");
        assert_eq!(class(&answered(500)), Some(ErrorClass::Ambiguous), "an undeclared one stays ambiguous");
    }

    #[test]
    fn a_failed_poll_of_accepted_work_is_asked_again_then_ambiguous_with_the_same_key() {
        let backoff = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };
        let table = safe(&[503]);
        let plenty = Duration::from_secs(60);
        let poll =
            |o: &CallOutcome, tries, left| after_outcome(CallStage::Accepted, o, &table, tries, left, &backoff, 0.5);
        for outcome in [
            answered(503),
            answered(500),
            bare(502),
            answered(404),
            answered(400),
            CallOutcome::NotSent,
            CallOutcome::ResetMidResponse,
            CallOutcome::TimedOutAfterSend,
        ] {
            assert_eq!(poll(&outcome, 0, plenty), NextMove::PollAgainIn(Duration::from_millis(50)), "{outcome:?}");
            assert_eq!(poll(&outcome, 3, plenty), NextMove::PollAgainIn(Duration::from_millis(400)), "{outcome:?}");
            let NextMove::Fail { classification, new_key } = poll(&outcome, 3, Duration::from_millis(300)) else {
                panic!("the budget is spent: {outcome:?}");
            };
            assert_eq!(
                (classification.class, classification.money_may_have_been_spent, new_key),
                (ErrorClass::Ambiguous, true, false)
            );
        }
        let throttled = CallOutcome::Answered {
            status: 429,
            retry_after: Some(Duration::from_secs(3)),
            problem_body: true,
            class_named: None,
        };
        assert_eq!(
            poll(&throttled, 0, plenty),
            NextMove::PollAgainIn(Duration::from_secs(3)),
            "Retry-After is a floor"
        );
    }

    #[test]
    fn a_definite_answer_to_a_start_is_a_new_key_and_a_doubtful_one_keeps_it() {
        let backoff = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };
        let table = safe(&[503]);
        let plenty = Duration::from_secs(60);
        let start = |o: &CallOutcome| match after_outcome(CallStage::Sent, o, &table, 0, plenty, &backoff, 0.5) {
            NextMove::Fail { classification, new_key } => (classification.class, new_key),
            other => panic!("{o:?} ended in {other:?}"),
        };
        assert_eq!(start(&CallOutcome::NotSent), (ErrorClass::NotSent, true));
        assert_eq!(start(&answered(429)), (ErrorClass::Throttled, true));
        assert_eq!(start(&answered(422)), (ErrorClass::Rejected, true));
        assert_eq!(start(&answered(409)), (ErrorClass::Rejected, true), "a provider that does not dedupe");
        assert_eq!(start(&answered(503)), (ErrorClass::ProviderFailed, true));
        assert_eq!(start(&bare(503)), (ErrorClass::Ambiguous, false));
        assert_eq!(start(&answered(504)), (ErrorClass::Ambiguous, false));
        assert_eq!(start(&answered(500)), (ErrorClass::Ambiguous, false));
        assert_eq!(start(&CallOutcome::TimedOutAfterSend), (ErrorClass::Ambiguous, false));
        assert_eq!(start(&answered(200)), (ErrorClass::Ambiguous, false), "a success that could not be read");
    }

    #[test]
    fn a_409_for_a_key_still_running_is_waited_for_and_sent_again_with_the_same_key() {
        let backoff = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };
        let table = ErrorTable { dedupes: true, ..ErrorTable::default() };
        let conflict = CallOutcome::Answered {
            status: 409,
            retry_after: Some(Duration::from_secs(1)),
            problem_body: true,
            class_named: None,
        };
        let start = |tries, left| after_outcome(CallStage::Sent, &conflict, &table, tries, left, &backoff, 0.5);
        assert_eq!(start(0, Duration::from_secs(60)), NextMove::ResendIn(Duration::from_secs(1)));
        assert_eq!(start(5, Duration::from_secs(60)), NextMove::ResendIn(Duration::from_secs(1)));
        let NextMove::Fail { classification, new_key } = start(0, Duration::from_millis(500)) else {
            panic!("the budget is spent");
        };
        assert_eq!((classification.class, new_key), (ErrorClass::Ambiguous, false), "still running: same key");
        // A provider that reads 409 its own way keeps its override.
        let own = ErrorTable { overrides: HashMap::from([(409, ErrorClass::Rejected)]), ..table };
        let NextMove::Fail { classification, .. } =
            after_outcome(CallStage::Sent, &conflict, &own, 0, Duration::from_secs(60), &backoff, 0.5)
        else {
            panic!("an override decides");
        };
        assert_eq!(classification.class, ErrorClass::Rejected);
    }

    #[test]
    fn a_409_at_a_provider_that_looks_up_by_key_but_does_not_dedupe_is_in_doubt() {
        let backoff = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };
        let table = ErrorTable { keyed: true, ..ErrorTable::default() };
        let NextMove::Fail { classification, new_key } =
            after_outcome(CallStage::Sent, &answered(409), &table, 0, Duration::from_secs(60), &backoff, 0.5)
        else {
            panic!("not sent again: the provider does not dedupe");
        };
        assert_eq!((classification.class, new_key), (ErrorClass::Ambiguous, false), "the earlier request may bill");
        let unkeyed = ErrorTable::default();
        assert_eq!(classify(&answered(409), &unkeyed).map(|c| c.class), Some(ErrorClass::Rejected));
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
        assert_eq!(
            after_loss(Phase::ProviderAccepted, true, caps(false, false)),
            AfterLoss::AskProvider,
            "a request id the provider named is polled, at any provider"
        );
        assert_eq!(after_loss(Phase::ProviderAccepted, true, caps(true, false)), AfterLoss::RetrySameKey);
        assert_eq!(after_loss(Phase::ResultRecorded, true, caps(false, false)), AfterLoss::FinishRecorded);
    }

    #[test]
    fn a_fenced_workers_verified_result_recovers_only_the_call_in_doubt_of_an_open_case() {
        use AfterFencedResult::*;
        use CaseStanding::*;
        assert_eq!(after_fenced_result(Asking, true, true), Recover);
        assert_eq!(after_fenced_result(OutcomeUnknown, true, true), Recover);
        assert_eq!(after_fenced_result(Asking, true, false), NeedsHuman);
        assert_eq!(after_fenced_result(OutcomeUnknown, true, false), ShowThePerson);
        for standing in [Asking, OutcomeUnknown, Decided] {
            for last in [true, false] {
                assert_eq!(after_fenced_result(standing, false, last), EvidenceOnly, "another operation's result");
                if standing == Decided {
                    assert_eq!(after_fenced_result(standing, true, last), EvidenceOnly, "decided already");
                }
            }
        }
    }

    #[test]
    fn look_ups_recover_retry_ask_again_or_give_up_at_the_deadline() {
        let backoff = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60) };
        let hour = Duration::from_secs(3600);
        let found = LookupAnswer::Found { finished: true };
        assert_eq!(after_lookup(found, false, 0, hour, &backoff, 0.5), AfterLookup::Recover);
        assert_eq!(after_lookup(LookupAnswer::NeverReceived, false, 0, hour, &backoff, 0.5), AfterLookup::RetrySafe);
        assert_eq!(
            after_lookup(LookupAnswer::NoAnswer, false, 2, hour, &backoff, 0.5),
            AfterLookup::AskAgainIn(Duration::from_secs(2))
        );
        assert_eq!(
            after_lookup(LookupAnswer::NoAnswer, false, 2, Duration::from_secs(1), &backoff, 0.5),
            AfterLookup::OutcomeUnknown
        );
    }

    proptest! {
        /// Once the provider showed it received the request, no later answer makes
        /// the work a safe retry: evidence only moves toward "it happened".
        #[test]
        fn received_work_is_never_retried_as_safe(
            answers in proptest::collection::vec(0u8..4, 1..12),
            left_s in 0u64..7200,
        ) {
            let backoff = Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60) };
            let mut received = false;
            for (asked, a) in answers.into_iter().enumerate() {
                let answer = match a {
                    0 => LookupAnswer::Found { finished: false },
                    1 => LookupAnswer::NeverReceived,
                    2 => LookupAnswer::NoAnswer,
                    _ => LookupAnswer::Found { finished: true },
                };
                let next = after_lookup(answer, received, asked as u32, Duration::from_secs(left_s), &backoff, 0.5);
                if received {
                    prop_assert_ne!(next, AfterLookup::RetrySafe);
                }
                received |= matches!(answer, LookupAnswer::Found { .. });
                if matches!(next, AfterLookup::Recover | AfterLookup::RetrySafe | AfterLookup::OutcomeUnknown) {
                    break;
                }
            }
        }
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
