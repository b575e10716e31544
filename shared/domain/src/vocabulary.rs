//! The closed sets of words Fenceline's events and API use (docs/architecture.md,
//! "Running a provider call" and "Task states"), each a typed enum that travels as its snake_case name.

use std::fmt;
use std::str::FromStr;

/// A word is not one of the set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not a known {what}; expected one of: {}", expected.trim_end_matches(", "))]
pub struct UnknownWord {
    pub what: &'static str,
    pub value: String,
    pub expected: &'static str,
}

/// One of a closed set of words: spelled one way on the wire and in the rows.
pub trait Word: Copy + FromStr<Err = UnknownWord> + Send + Sync + 'static {
    /// Do not change: the text is the wire form.
    fn as_str(self) -> &'static str;
}

macro_rules! word_set {
    ($(#[$doc:meta])* $name:ident, $what:literal { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vdoc])* $variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// Do not change: the text is the wire form.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl Word for $name {
            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownWord { what: $what, value: s.to_owned(), expected: concat!($($text, ", "),+) }),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = UnknownWord;
            fn try_from(text: String) -> Result<Self, Self::Error> {
                text.parse()
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = String::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

word_set!(
    /// How urgent a task is relative to the same tenant's others.
    Priority, "priority" { High => "high", Normal => "normal", Low => "low" }
);

word_set!(
    /// What a user sees of a task (docs/architecture.md, "Task states").
    TaskState, "task state" {
        Queued => "queued",
        Waiting => "waiting",
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        Cancelled => "cancelled",
        AwaitingApproval => "awaiting_approval",
        OutcomeUnknown => "outcome_unknown",
        NeedsHuman => "needs_human",
    }
);

impl TaskState {
    /// The states a task never leaves, and the only ones.
    pub const FINAL: [TaskState; 3] = [TaskState::Succeeded, TaskState::Failed, TaskState::Cancelled];

    /// Succeeded, failed and cancelled: a task in one of them never changes again.
    pub fn is_final(self) -> bool {
        Self::FINAL.contains(&self)
    }
}

word_set!(
    /// Where the reconciler's case about a lost attempt is: still asking the
    /// provider, or decided (by the evidence, or left to a person).
    CaseState, "case state" { Asking => "asking", Decided => "decided" }
);

word_set!(
    /// How far one execution got; each is written durably before the next begins.
    Phase, "phase" {
        Claimed => "claimed",
        StepStarted => "step_started",
        CallIntent => "call_intent",
        ProviderAccepted => "provider_accepted",
        ResultRecorded => "result_recorded",
        Finished => "finished",
    }
);

word_set!(
    /// Where one attempt stands: `running` until it ends in one of the other four.
    /// An execution's row is also `ready` before a worker first claims it.
    AttemptOutcome, "attempt outcome" {
        Running => "running",
        Succeeded => "succeeded",
        Failed => "failed",
        /// Handed back without a call: busy, waiting for a signal, cancelled, shutting down.
        Released => "released",
        /// Its worker vanished after a call may have left: the reconciler decides.
        Lost => "lost",
    }
);

word_set!(
    /// The error classes of docs/architecture.md, "Error classes".
    ErrorClass, "error class" {
        NotSent => "not_sent",
        Throttled => "throttled",
        Rejected => "rejected",
        NotAuthorised => "not_authorised",
        ProviderFailed => "provider_failed",
        Ambiguous => "ambiguous",
        Busy => "busy",
        ResultMismatch => "result_mismatch",
    }
);

word_set!(
    /// Why an attempt gave its grant back without spending anything.
    ReleaseReason, "release reason" {
        Busy => "busy",
        Cancelled => "cancelled",
        ShutdownBeforeIntent => "shutdown_before_intent",
        AwaitingSignal => "awaiting_signal",
    }
);

word_set!(
    /// The reconciler's decisions.
    RecoveryDecision, "recovery decision" {
        RetrySafe => "retry_safe",
        RetrySameKey => "retry_same_key",
        Recovered => "recovered",
        OutcomeUnknown => "outcome_unknown",
        ReissueGrant => "reissue_grant",
        NeedsHuman => "needs_human",
    }
);

word_set!(
    /// What a person may decide about an `outcome_unknown` case.
    ResolutionAction, "resolution action" {
        RetryAsNew => "retry_as_new",
        AcceptFailed => "accept_failed",
        AttachResult => "attach_result",
    }
);

word_set!(
    /// What a person decided about one wait of an approval step.
    ApprovalDecision, "approval decision" {
        Approve => "approve",
        Reject => "reject",
    }
);

word_set!(
    /// What the reconciler's audit finds wrong with a task's status.
    AuditFinding, "audit finding" {
        /// Shows `running`, but no grant of it is live and no case about it is open.
        NoLiveExpectation => "no_live_expectation",
        /// Shows `queued` or `waiting` and has not changed for longer than the threshold.
        NoProgress => "no_progress",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_parses_back_to_itself() {
        for state in TaskState::ALL {
            assert_eq!(state.as_str().parse::<TaskState>().expect("round trip"), *state);
        }
        for class in ErrorClass::ALL {
            assert_eq!(class.as_str().parse::<ErrorClass>().expect("round trip"), *class);
        }
        for state in CaseState::ALL {
            assert_eq!(state.as_str().parse::<CaseState>().expect("round trip"), *state);
        }
        for outcome in AttemptOutcome::ALL {
            assert_eq!(AttemptOutcome::try_from(outcome.as_str().to_owned()).expect("round trip"), *outcome);
        }
        for finding in AuditFinding::ALL {
            assert_eq!(finding.as_str().parse::<AuditFinding>().expect("round trip"), *finding);
        }
    }

    #[test]
    fn the_final_states_are_the_ones_no_task_leaves() {
        let finals: Vec<&str> = TaskState::ALL.iter().filter(|s| s.is_final()).map(|s| s.as_str()).collect();
        assert_eq!(finals, ["succeeded", "failed", "cancelled"]);
        assert_eq!(TaskState::FINAL.map(TaskState::as_str), ["succeeded", "failed", "cancelled"]);
    }

    #[test]
    fn an_unknown_word_names_what_was_expected() {
        let err = "urgent".parse::<Priority>().expect_err("not a priority");
        assert_eq!(err.to_string(), "`urgent` is not a known priority; expected one of: high, normal, low");
    }
}
