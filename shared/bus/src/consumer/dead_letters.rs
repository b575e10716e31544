//! Records that cannot be applied: why a record is rejected or held, and its dead letter.

use fenceline_events::{Bytes, DeadLetter, Event, OriginalHeader, Timestamp, topics};
use sqlx::PgConnection;

use crate::OutboxWriter;

use super::HandleError;

/// What to do with a record that does not decode: hold it (retry later, with an
/// ERROR) when it is a newer version of a known type and the handler holds those,
/// else reject it with the reason.
pub(super) fn undecodable(error: &fenceline_events::DecodeError, holds_newer: bool) -> Result<String, HandleError> {
    match error {
        fenceline_events::DecodeError::NewerSchema { .. } if holds_newer => Err(HandleError::Held(error.to_string())),
        other => Ok(other.to_string()),
    }
}

/// A record that could not be decoded, or that the handler refused, kept whole.
#[derive(Debug)]
pub struct Rejected<'a> {
    pub consumer_group: &'a str,
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub reason: &'a str,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub headers: Vec<(&'a str, Option<&'a [u8]>)>,
}

/// Writes `rejected` as a `DeadLetter` event to the dead-letter topic.
pub async fn dead_letter(
    tx: &mut PgConnection,
    outbox: &OutboxWriter,
    rejected: &Rejected<'_>,
) -> Result<(), HandleError> {
    let (value, cut) = rejected.value.map(crate::relay::bounded_original).unzip();
    let letter = Event::DeadLetter(DeadLetter {
        topic: rejected.topic.to_owned(),
        partition: rejected.partition,
        offset: rejected.offset,
        consumer: rejected.consumer_group.to_owned(),
        reason: format!("{}{}", rejected.reason, cut.flatten().unwrap_or_default()),
        original_key: rejected.key.map(|k| Bytes(crate::relay::bounded_original(k).0)),
        original_value: value.map(Bytes),
        original_headers: rejected
            .headers
            .iter()
            .map(|(name, value)| OriginalHeader { name: (*name).to_owned(), value: value.map(|v| Bytes(v.to_vec())) })
            .collect(),
        dead_lettered_at: Timestamp::now(),
    });
    let key = format!("{}/{}/{}", rejected.topic, rejected.partition, rejected.offset);
    outbox.append(tx, topics::DEADLETTER, Some(key.as_bytes()), &letter).await?;
    Ok(())
}
