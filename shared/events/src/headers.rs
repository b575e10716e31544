//! The record headers every Fenceline producer sets (docs/architecture.md, "Topics and events").

use fenceline_domain::ids::EventId;

use crate::Timestamp;

/// Do not change: header names are read by every consumer and by dashboards.
pub mod header_names {
    pub const EVENT_ID: &str = "event_id";
    pub const EVENT_TYPE: &str = "event_type";
    pub const SCHEMA_FINGERPRINT: &str = "schema_fingerprint";
    pub const PRODUCER: &str = "producer";
    pub const PRODUCED_AT: &str = "produced_at";
    pub const TRACEPARENT: &str = "traceparent";
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header {0} is missing")]
    Missing(&'static str),
    #[error("header {name} is invalid: {reason}")]
    Invalid { name: &'static str, reason: String },
}

/// Headers of one record. `event_id` is the identity consumers dedupe by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    pub event_id: EventId,
    pub event_type: String,
    /// Rabin fingerprint of the writer schema, lower-case hex.
    pub schema_fingerprint: String,
    /// The service that wrote the event.
    pub producer: String,
    pub produced_at: Timestamp,
    /// W3C trace context of the span that produced the event.
    pub traceparent: Option<String>,
}

impl Headers {
    /// The headers as Kafka header pairs, in a fixed order.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        use header_names::*;
        let mut pairs = vec![
            (EVENT_ID, self.event_id.to_string()),
            (EVENT_TYPE, self.event_type.clone()),
            (SCHEMA_FINGERPRINT, self.schema_fingerprint.clone()),
            (PRODUCER, self.producer.clone()),
            (PRODUCED_AT, self.produced_at.0.to_string()),
        ];
        if let Some(tp) = &self.traceparent {
            pairs.push((TRACEPARENT, tp.clone()));
        }
        pairs
    }

    /// Parses Kafka header pairs; unknown headers are ignored.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Result<Self, HeaderError> {
        use header_names::*;
        let (mut event_id, mut event_type, mut fingerprint, mut producer, mut produced_at, mut traceparent) =
            (None, None, None, None, None, None);
        for (name, value) in pairs {
            let text = |n: &'static str| -> Result<String, HeaderError> {
                let bytes = value.ok_or(HeaderError::Invalid { name: n, reason: "null".into() })?;
                String::from_utf8(bytes.to_vec())
                    .map_err(|_| HeaderError::Invalid { name: n, reason: "not UTF-8".into() })
            };
            match name {
                EVENT_ID => {
                    let raw = text(EVENT_ID)?;
                    event_id = Some(
                        raw.parse::<EventId>()
                            .map_err(|e| HeaderError::Invalid { name: EVENT_ID, reason: e.to_string() })?,
                    );
                }
                EVENT_TYPE => event_type = Some(text(EVENT_TYPE)?),
                SCHEMA_FINGERPRINT => fingerprint = Some(text(SCHEMA_FINGERPRINT)?),
                PRODUCER => producer = Some(text(PRODUCER)?),
                PRODUCED_AT => {
                    let raw = text(PRODUCED_AT)?;
                    produced_at = Some(Timestamp(raw.parse().map_err(|_| HeaderError::Invalid {
                        name: PRODUCED_AT,
                        reason: format!("`{raw}` is not microseconds since the epoch"),
                    })?));
                }
                TRACEPARENT => traceparent = Some(text(TRACEPARENT)?),
                _ => {}
            }
        }
        Ok(Self {
            event_id: event_id.ok_or(HeaderError::Missing(EVENT_ID))?,
            event_type: event_type.ok_or(HeaderError::Missing(EVENT_TYPE))?,
            schema_fingerprint: fingerprint.ok_or(HeaderError::Missing(SCHEMA_FINGERPRINT))?,
            producer: producer.ok_or(HeaderError::Missing(PRODUCER))?,
            produced_at: produced_at.ok_or(HeaderError::Missing(PRODUCED_AT))?,
            traceparent,
        })
    }
}
