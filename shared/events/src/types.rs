//! One Rust type per Avro schema; field names and order follow `schemas/*.avsc`.
//! Sets of words are typed (`fenceline_domain::vocabulary`), identities too.

use std::collections::BTreeMap;

use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::{
    ApprovalDecision, ErrorClass, Phase, Priority, RecoveryDecision, ReleaseReason, ResolutionAction, TaskState,
};
use serde::{Deserialize, Serialize};

use crate::Timestamp;

/// A result that can be verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ArtifactRef {
    pub uri: String,
    /// Lower-case hex.
    pub sha256: String,
    pub size_bytes: i64,
}

/// One observation a recovery decision rests on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    pub source: String,
    pub observed_at: Timestamp,
    pub finding: String,
}

/// A header of a dead-lettered record, kept byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OriginalHeader {
    pub name: String,
    pub value: Option<Bytes>,
}

/// Bytes that travel as Avro `bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
                let mut out = Vec::new();
                while let Some(byte) = seq.next_element::<u8>()? {
                    out.push(byte);
                }
                Ok(Bytes(out))
            }
        }
        deserializer.deserialize_bytes(Visitor)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRequest {
    pub source: String,
    pub source_event_id: String,
    pub tenant: String,
    pub kind: String,
    pub input_json: String,
    pub priority: Priority,
    pub deadline: Option<Timestamp>,
    pub not_before: Option<Timestamp>,
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRejected {
    pub source: Option<String>,
    pub source_event_id: Option<String>,
    /// The tenant the record named (v2); `None` for bytes that did not decode.
    #[serde(default)]
    pub tenant: Option<String>,
    pub problem_type: String,
    pub reason: String,
    pub original: Bytes,
    pub rejected_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskAccepted {
    pub task_id: TaskId,
    pub tenant: String,
    pub kind: String,
    pub input_json: String,
    pub priority: Priority,
    pub deadline: Option<Timestamp>,
    pub not_before: Option<Timestamp>,
    pub labels: BTreeMap<String, String>,
    pub source: String,
    pub accepted_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelRequested {
    pub task_id: TaskId,
    pub tenant: String,
    pub requested_by: String,
    pub requested_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignalReceived {
    pub task_id: TaskId,
    pub tenant: String,
    pub signal_name: String,
    pub signal_id: String,
    pub payload_json: String,
    pub received_at: Timestamp,
    /// The approval step whose wait it answers; `None`: any wait for the name.
    pub step: Option<String>,
    /// The generation whose wait it answers; `None`: any.
    pub generation: Option<i32>,
    /// `None`: an approval (what every signal was before decisions).
    pub decision: Option<ApprovalDecision>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResolutionDecided {
    pub task_id: TaskId,
    pub tenant: String,
    pub case_id: String,
    pub action: ResolutionAction,
    pub charge_acknowledged: bool,
    pub attached_result: Option<ArtifactRef>,
    pub decided_by: String,
    pub decided_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptGranted {
    pub grant_id: GrantId,
    pub task_id: TaskId,
    pub tenant: String,
    pub attempt: i32,
    pub generation: i32,
    pub kind: String,
    pub input_json: String,
    pub resume_after_step: Option<String>,
    pub provider: String,
    pub slot: String,
    pub lease_budget_ms: i64,
    pub deadline: Option<Timestamp>,
    pub granted_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelAttempt {
    pub task_id: TaskId,
    pub grant_id: GrantId,
    pub requested_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptClaimed {
    pub grant_id: GrantId,
    pub task_id: TaskId,
    pub attempt: i32,
    pub fencing_token: i64,
    pub lease_expires_at: Timestamp,
    pub worker: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallIntentRecorded {
    pub task_id: TaskId,
    pub attempt: i32,
    pub step: String,
    pub operation_key: String,
    pub provider: String,
    pub recorded_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProviderAccepted {
    pub task_id: TaskId,
    pub attempt: i32,
    pub step: String,
    pub operation_key: String,
    pub provider_request_id: String,
    pub accepted_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepCheckpointed {
    pub task_id: TaskId,
    pub attempt: i32,
    pub step: String,
    pub output_ref: String,
    pub sha256: String,
    pub checkpointed_at: Timestamp,
    pub generation: Option<i32>,
    /// The step's output as JSON text; `None` from writers before it was sent.
    pub output_json: Option<String>,
    /// The provider the step called; `None` from writers before it was sent.
    pub provider: Option<String>,
    /// What the call cost as the catalogue prices it, in millionths of the
    /// currency's minor unit (`fenceline_domain::spend::Amount`); `None` unpriced.
    pub cost_micros: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AwaitingSignal {
    pub task_id: TaskId,
    pub attempt: i32,
    pub step: String,
    pub signal_name: String,
    pub since: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptSucceeded {
    pub task_id: TaskId,
    pub attempt: i32,
    pub grant_id: GrantId,
    pub result: ArtifactRef,
    pub finished_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptFailed {
    pub task_id: TaskId,
    pub attempt: i32,
    pub grant_id: GrantId,
    pub error_class: ErrorClass,
    pub message: String,
    pub retry_after_ms: Option<i64>,
    pub money_may_have_been_spent: bool,
    pub failed_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptReleased {
    pub task_id: TaskId,
    pub attempt: i32,
    pub grant_id: GrantId,
    pub reason: ReleaseReason,
    pub released_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptLost {
    pub task_id: TaskId,
    pub attempt: i32,
    pub grant_id: GrantId,
    pub last_phase: Phase,
    pub last_phase_at: Timestamp,
    pub step: Option<String>,
    pub operation_key: Option<String>,
    pub provider_request_id: Option<String>,
    pub detected_at: Timestamp,
}

/// A worker that lost its lease had already fetched and verified its call's
/// result: it may not record it, so it hands it to the reconciler as evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FencedResultReported {
    pub task_id: TaskId,
    pub attempt: i32,
    pub grant_id: GrantId,
    pub fencing_token: i64,
    pub step: String,
    pub operation_key: String,
    pub provider_request_id: Option<String>,
    pub result: ArtifactRef,
    pub verified_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryDecided {
    pub task_id: TaskId,
    pub attempt: i32,
    pub decision: RecoveryDecision,
    pub case_id: Option<String>,
    pub result: Option<ArtifactRef>,
    pub evidence: Vec<Evidence>,
    pub decided_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskStatus {
    pub task_id: TaskId,
    pub tenant: String,
    pub kind: String,
    pub state: TaskState,
    pub reason: Option<String>,
    pub attempt: i32,
    pub step: Option<String>,
    pub phase: Option<Phase>,
    pub next_attempt_at: Option<Timestamp>,
    pub result: Option<ArtifactRef>,
    pub case_id: Option<String>,
    pub updated_at: Timestamp,
    pub version: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub consumer: String,
    pub reason: String,
    pub original_key: Option<Bytes>,
    pub original_value: Option<Bytes>,
    pub original_headers: Vec<OriginalHeader>,
    pub dead_lettered_at: Timestamp,
}

macro_rules! events {
    ($($name:ident),+ $(,)?) => {
        /// Every event Fenceline sends.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Event { $($name($name)),+ }

        impl Event {
            /// The event type: the schema's name and the `event_type` header.
            pub fn event_type(&self) -> &'static str {
                match self { $(Event::$name(_) => stringify!($name)),+ }
            }
        }

        /// Serialises the event's own fields (not its type), as JSON views need.
        impl Serialize for Event {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                match self { $(Event::$name(inner) => inner.serialize(serializer)),+ }
            }
        }

        $(impl From<$name> for Event {
            fn from(value: $name) -> Self { Event::$name(value) }
        })+

        pub(crate) fn to_avro_value(event: &Event) -> Result<apache_avro::types::Value, apache_avro::Error> {
            match event { $(Event::$name(inner) => apache_avro::to_value(inner)),+ }
        }

        pub(crate) fn from_avro_value(event_type: &str, value: &apache_avro::types::Value) -> Option<Result<Event, apache_avro::Error>> {
            match event_type {
                $(stringify!($name) => Some(apache_avro::from_value::<$name>(value).map(Event::$name)),)+
                _ => None,
            }
        }

        /// Names of every event type, as in `schemas/`.
        pub const EVENT_TYPES: &[&str] = &[$(stringify!($name)),+];
    };
}

events!(
    TaskRequest,
    RequestRejected,
    TaskAccepted,
    CancelRequested,
    SignalReceived,
    ResolutionDecided,
    AttemptGranted,
    CancelAttempt,
    AttemptClaimed,
    CallIntentRecorded,
    ProviderAccepted,
    StepCheckpointed,
    AwaitingSignal,
    AttemptSucceeded,
    AttemptFailed,
    AttemptReleased,
    AttemptLost,
    FencedResultReported,
    RecoveryDecided,
    TaskStatus,
    DeadLetter,
);

impl Event {
    /// The task an event is about, which is its record key on task-keyed topics.
    pub fn task_id(&self) -> Option<TaskId> {
        Some(match self {
            Event::TaskRequest(_) | Event::RequestRejected(_) | Event::DeadLetter(_) => {
                return None;
            }
            Event::TaskAccepted(e) => e.task_id,
            Event::CancelRequested(e) => e.task_id,
            Event::SignalReceived(e) => e.task_id,
            Event::ResolutionDecided(e) => e.task_id,
            Event::AttemptGranted(e) => e.task_id,
            Event::CancelAttempt(e) => e.task_id,
            Event::AttemptClaimed(e) => e.task_id,
            Event::CallIntentRecorded(e) => e.task_id,
            Event::ProviderAccepted(e) => e.task_id,
            Event::StepCheckpointed(e) => e.task_id,
            Event::AwaitingSignal(e) => e.task_id,
            Event::AttemptSucceeded(e) => e.task_id,
            Event::AttemptFailed(e) => e.task_id,
            Event::AttemptReleased(e) => e.task_id,
            Event::AttemptLost(e) => e.task_id,
            Event::FencedResultReported(e) => e.task_id,
            Event::RecoveryDecided(e) => e.task_id,
            Event::TaskStatus(e) => e.task_id,
        })
    }
}
