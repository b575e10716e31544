//! Opening the reconciler's case about a lost attempt: from what the executor
//! reported, what the provider can do and when the key was first sent, whether the
//! case is decided at once or asks the provider first, and the evidence it shows.

use std::time::Duration;

use crate::calls::{AfterLoss, ProviderCapabilities, after_loss, key_forgotten, key_remembered};
use crate::lifecycle::Micros;
use crate::vocabulary::{CaseState, Phase, RecoveryDecision};

/// What is known of a lost attempt when its case opens. Instants come as the
/// text they are shown in, besides the micros they are judged by.
#[derive(Debug, Clone)]
pub struct LostAttempt<'a> {
    pub provider: &'a str,
    pub capabilities: ProviderCapabilities,
    /// The executor's word on how it was lost.
    pub what: &'a str,
    pub phase: Phase,
    pub phase_at: &'a str,
    pub request_id: Option<&'a str>,
    pub operation_key: Option<&'a str>,
    /// How long the provider remembers a key, where its dialect says.
    pub key_memory: Option<Duration>,
    /// When the key was first sent, where a call under it was heard: micros, and as shown.
    pub key_first_sent: Option<(Micros, &'a str)>,
    /// Until when a request the lost worker sent could still reach the provider, as shown.
    pub in_flight_until: &'a str,
    pub now: Micros,
}

/// Who a line of evidence comes from.
pub type Source = &'static str;

/// How a case opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub state: CaseState,
    /// The decision, when it is made at once; `None` while the provider is asked.
    pub decision: Option<RecoveryDecision>,
    pub evidence: Vec<(Source, String)>,
}

/// The case a lost attempt opens ([`after_loss`], with the key's memory weighed).
pub fn open(lost: &LostAttempt<'_>) -> Opening {
    let provider = lost.provider;
    let mut evidence: Vec<(Source, String)> = vec![
        ("executor", lost.what.to_owned()),
        (
            "executor",
            format!(
                "last durable phase `{}` at {}{}",
                lost.phase,
                lost.phase_at,
                lost.request_id.map(|r| format!(", provider request id {r}")).unwrap_or_default()
            ),
        ),
    ];
    let decided = |decision, evidence| Opening { state: CaseState::Decided, decision: Some(decision), evidence };
    match after_loss(lost.phase, lost.request_id.is_some(), lost.capabilities) {
        AfterLoss::RetrySafe => {
            evidence.push(("reconciler", "no call had left; a retry spends nothing".into()));
            decided(RecoveryDecision::RetrySafe, evidence)
        }
        // The step's result was verified and checkpointed before the loss: a call
        // did leave, and the retry resumes after it without calling again.
        AfterLoss::FinishRecorded => {
            evidence.push((
                "reconciler",
                "the step's result was recorded before the worker was lost; a retry resumes after it without calling \
                 again"
                    .into(),
            ));
            decided(RecoveryDecision::RetrySafe, evidence)
        }
        AfterLoss::RetrySameKey => match (lost.key_memory, lost.key_first_sent) {
            (Some(memory), Some((first, shown))) if !key_remembered(first, lost.now, Some(memory)) => {
                evidence.push(("catalogue", key_forgotten(provider, memory, shown)));
                decided(RecoveryDecision::OutcomeUnknown, evidence)
            }
            _ => {
                evidence.push((
                    "catalogue",
                    format!(
                        "provider `{provider}` deduplicates by operation key; the retry carries the same key {}",
                        lost.operation_key.unwrap_or("?")
                    ),
                ));
                decided(RecoveryDecision::RetrySameKey, evidence)
            }
        },
        AfterLoss::AskProvider => {
            evidence.push(match lost.request_id {
                Some(request_id) => (
                    "reconciler",
                    format!(
                        "provider `{provider}` accepted the call as {request_id}: it received it, and the request id \
                         is polled until its result or the task's deadline"
                    ),
                ),
                None => ("catalogue", format!("provider `{provider}` answers look-ups by operation key")),
            });
            evidence.push((
                "reconciler",
                format!(
                    "a request the lost worker sent could still reach the provider until {} (its call timeout and \
                     registration time after the loss was reported); a look-up's \"never received\" counts only \
                     from then",
                    lost.in_flight_until
                ),
            ));
            Opening { state: CaseState::Asking, decision: None, evidence }
        }
        AfterLoss::OutcomeUnknown => {
            evidence.push((
                "catalogue",
                format!(
                    "provider `{provider}` can neither deduplicate nor look up: whether it did the work cannot be \
                     known; retrying as a new operation may be billed again"
                ),
            ));
            decided(RecoveryDecision::OutcomeUnknown, evidence)
        }
    }
}

/// Whether opening a case for `lost` weighs when its key was first sent: only a
/// retry with the same key at a provider whose memory of keys is known.
pub fn weighs_key_age(
    phase: Phase,
    request_id_known: bool,
    capabilities: ProviderCapabilities,
    memory: Option<Duration>,
) -> bool {
    memory.is_some() && after_loss(phase, request_id_known, capabilities) == AfterLoss::RetrySameKey
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Micros = 3_600_000_000;

    fn lost(phase: Phase, capabilities: ProviderCapabilities) -> LostAttempt<'static> {
        LostAttempt {
            provider: "pay",
            capabilities,
            what: "lease expired",
            phase,
            phase_at: "2026-12-04T10:00:00Z",
            request_id: None,
            operation_key: Some("k-1"),
            key_memory: None,
            key_first_sent: None,
            in_flight_until: "2026-12-04T10:00:05Z",
            now: 48 * HOUR,
        }
    }

    const DEDUPES: ProviderCapabilities = ProviderCapabilities { idempotency_keys: true, lookup: false };
    const NEITHER: ProviderCapabilities = ProviderCapabilities { idempotency_keys: false, lookup: false };
    const LOOKS_UP: ProviderCapabilities = ProviderCapabilities { idempotency_keys: false, lookup: true };

    #[test]
    fn nothing_sent_is_a_safe_retry_and_a_sent_call_nobody_can_ask_is_outcome_unknown() {
        let safe = open(&lost(Phase::StepStarted, NEITHER));
        assert_eq!((safe.state, safe.decision), (CaseState::Decided, Some(RecoveryDecision::RetrySafe)));
        let unknown = open(&lost(Phase::CallIntent, NEITHER));
        assert_eq!(unknown.decision, Some(RecoveryDecision::OutcomeUnknown));
        assert!(unknown.evidence.iter().any(|(source, line)| *source == "catalogue" && line.contains("billed again")));
        assert_eq!(unknown.evidence[1].1, "last durable phase `call_intent` at 2026-12-04T10:00:00Z");
    }

    #[test]
    fn a_key_the_provider_still_remembers_is_sent_again_and_a_forgotten_one_goes_to_a_person() {
        let mut sent = lost(Phase::CallIntent, DEDUPES);
        sent.key_memory = Some(Duration::from_secs(24 * 3600));
        sent.key_first_sent = Some((47 * HOUR, "2026-12-03T23:00:00Z"));
        assert_eq!(open(&sent).decision, Some(RecoveryDecision::RetrySameKey));
        sent.key_first_sent = Some((2 * HOUR, "2026-12-02T02:00:00Z"));
        let forgotten = open(&sent);
        assert_eq!(forgotten.decision, Some(RecoveryDecision::OutcomeUnknown));
        assert!(forgotten.evidence.last().is_some_and(|(_, line)| line.contains("2026-12-02T02:00:00Z")));
        assert!(weighs_key_age(Phase::CallIntent, false, DEDUPES, sent.key_memory));
        assert!(!weighs_key_age(Phase::CallIntent, false, DEDUPES, None));
    }

    #[test]
    fn a_provider_that_can_be_asked_is_asked_first() {
        let mut asked = lost(Phase::ProviderAccepted, LOOKS_UP);
        asked.request_id = Some("req-9");
        let opening = open(&asked);
        assert_eq!((opening.state, opening.decision), (CaseState::Asking, None));
        assert!(opening.evidence.iter().any(|(_, line)| line.contains("req-9") && line.contains("polled")));
        assert!(opening.evidence.iter().any(|(_, line)| line.contains("until 2026-12-04T10:00:05Z")));
    }
}
