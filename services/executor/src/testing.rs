//! Events as the executor's consumer receives them, for the crate's tests.

use fenceline_bus::Inbound;
use fenceline_domain::ids::{EventId, GrantId, TaskId};
use fenceline_events::{AttemptGranted, Envelope, Event, Headers, Timestamp};

/// A first attempt's grant of `task_id` with `input_json`.
pub(crate) fn granted(grant_id: GrantId, task_id: TaskId, input_json: &str) -> Event {
    Event::AttemptGranted(AttemptGranted {
        grant_id,
        task_id,
        tenant: "acme".into(),
        attempt: 1,
        generation: 0,
        kind: "image.generate".into(),
        input_json: input_json.into(),
        resume_after_step: None,
        provider: "imagegen".into(),
        slot: "imagegen".into(),
        lease_budget_ms: 60_000,
        deadline: None,
        granted_at: Timestamp(0),
    })
}

/// `event` as the scheduler published it on `topic` (a name without the prefix).
pub(crate) fn on(topic: &str, event: Event) -> Inbound {
    Inbound {
        topic: format!("test.{topic}"),
        partition: 0,
        offset: 0,
        key: None,
        value: Vec::new(),
        envelope: Envelope {
            headers: Headers {
                event_id: EventId::new_v7(),
                event_type: event.event_type().into(),
                schema_fingerprint: String::new(),
                producer: "scheduler".into(),
                produced_at: Timestamp(0),
                traceparent: None,
            },
            event,
        },
    }
}
