//! The transactional outbox's writing side (docs/architecture.md, "The outbox"): a
//! state change and the events it causes commit together, as rows of the service's
//! `outbox` table in commit order per key; [`crate::relay`] publishes them.

use std::sync::Arc;

use fenceline_domain::ids::EventId;
use fenceline_domain::outbox::shard_for_key;
use fenceline_events::{Event, Timestamp, encode};
use sqlx::PgConnection;
use tokio::sync::Notify;

use crate::Error;

/// The `event_type` header of a tombstone. Do not change: dashboards may match it
/// (docs/wire.md, "Tombstones on fenceline.status").
pub const TOMBSTONE: &str = "Tombstone";

/// Writes events into the outbox inside the caller's transaction.
#[derive(Debug, Clone)]
pub struct OutboxWriter {
    producer: &'static str,
    topic_prefix: String,
    shards: u16,
    /// Wakes this process's relay ([`OutboxWriter::committed`]).
    pub(crate) written: Arc<Notify>,
}

impl OutboxWriter {
    pub fn new(producer: &'static str, topic_prefix: impl Into<String>, shards: u16) -> Self {
        Self { producer, topic_prefix: topic_prefix.into(), shards: shards.max(1), written: Arc::new(Notify::new()) }
    }

    /// The name of the service that writes.
    pub fn producer(&self) -> &'static str {
        self.producer
    }

    /// `topic` (a contract name from `fenceline_events::topics`) behind the prefix.
    pub fn topic(&self, topic: &str) -> String {
        fenceline_events::topics::named(&self.topic_prefix, topic)
    }

    /// Appends `event` for `topic`, keyed by its task (or by `key` when it has none).
    /// Rows of one key are ordered by commit: the append takes a transaction lock on
    /// the key, so a second writer of the same key waits for the first to commit.
    pub async fn append(
        &self,
        conn: &mut PgConnection,
        topic: &str,
        key: Option<&[u8]>,
        event: &Event,
    ) -> Result<EventId, Error> {
        self.append_in_trace(conn, topic, key, event, fenceline_telemetry::current_traceparent()).await
    }

    /// As [`OutboxWriter::append`], in the trace of `traceparent` rather than the
    /// current span's: for an event decided under one span and written under
    /// another (a consumer's batch writes what its events gathered when it ends).
    pub async fn append_in_trace(
        &self,
        conn: &mut PgConnection,
        topic: &str,
        key: Option<&[u8]>,
        event: &Event,
        traceparent: Option<String>,
    ) -> Result<EventId, Error> {
        let row = self.row_in_trace(topic, key, event, traceparent)?;
        let event_id = row.event_id();
        OutboxRow::insert_all(vec![row], conn).await?;
        Ok(event_id)
    }

    /// `event` encoded as the row that carries it, keyed as [`OutboxWriter::append`]
    /// keys it, in the current span's trace: for a writer that appends it within a
    /// statement of its own ([`OutboxRow`]).
    pub fn row(&self, topic: &str, event: &Event) -> Result<OutboxRow, Error> {
        self.row_in_trace(topic, None, event, fenceline_telemetry::current_traceparent())
    }

    /// As [`OutboxWriter::row`], in the trace of `traceparent`.
    pub fn row_in_trace(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        event: &Event,
        traceparent: Option<String>,
    ) -> Result<OutboxRow, Error> {
        let key = event.task_id().map(|id| id.to_string().into_bytes()).or_else(|| key.map(<[u8]>::to_vec));
        let (payload, fingerprint) = encode(event)?;
        let shard = shard_for_key(key.as_deref().unwrap_or_default(), self.shards);
        Ok(OutboxRow {
            shard: i16::try_from(shard).unwrap_or(i16::MAX),
            topic: self.topic(topic),
            record_key: key,
            payload: Some(payload),
            event_id: EventId::new_v7().as_uuid(),
            event_type: event.event_type().to_owned(),
            schema_fingerprint: hex::encode(fingerprint),
            producer: self.producer.to_owned(),
            produced_at_us: Timestamp::now().0,
            traceparent,
        })
    }

    /// Appends a tombstone for `key` on `topic`, a compacted topic: a record with a
    /// null value, after which compaction drops every record of the key (docs/wire.md,
    /// "Tombstones on fenceline.status"). It is ordered after the key's earlier rows
    /// like any append; its headers carry an `event_id` and `event_type` [`TOMBSTONE`].
    pub async fn append_tombstone(&self, conn: &mut PgConnection, topic: &str, key: &[u8]) -> Result<EventId, Error> {
        let row = OutboxRow {
            shard: i16::try_from(shard_for_key(key, self.shards)).unwrap_or(i16::MAX),
            topic: self.topic(topic),
            record_key: Some(key.to_vec()),
            payload: None,
            event_id: EventId::new_v7().as_uuid(),
            event_type: TOMBSTONE.to_owned(),
            schema_fingerprint: String::new(),
            producer: self.producer.to_owned(),
            produced_at_us: Timestamp::now().0,
            traceparent: fenceline_telemetry::current_traceparent(),
        };
        let event_id = row.event_id();
        OutboxRow::insert_all(vec![row], conn).await?;
        Ok(event_id)
    }

    /// Tells this process's relay that rows were committed. Call after the commit.
    pub fn committed(&self) {
        self.written.notify_one();
    }
}

/// An event encoded as the outbox row that carries it ([`OutboxWriter::row`]). A
/// statement binds a `Vec<OutboxRow>` as one parameter and passes it to the schema's
/// `outbox_append($n::outbox_entry[])` (`shared/bus/migrations/0004_outbox_append.sql`),
/// which takes each key's transaction lock before drawing the first id, so rows of
/// one key get ids in commit order.
#[derive(Debug, Clone, sqlx::Type)]
#[sqlx(type_name = "outbox_entry")]
pub struct OutboxRow {
    shard: i16,
    topic: String,
    record_key: Option<Vec<u8>>,
    /// `None` for a tombstone.
    payload: Option<Vec<u8>>,
    event_id: uuid::Uuid,
    event_type: String,
    schema_fingerprint: String,
    producer: String,
    produced_at_us: i64,
    traceparent: Option<String>,
}

/// The statement that appends the rows bound to `$1` ([`OutboxRow::insert_all`]).
const APPEND: &str = "SELECT outbox_append($1::outbox_entry[])";

impl OutboxRow {
    /// The event id the row carries.
    pub fn event_id(&self) -> EventId {
        EventId::from_uuid(self.event_id)
    }

    /// The trace the row's record carries (W3C `traceparent`): a statement that
    /// stores the trace beside the row (the task it starts) binds it from here.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }

    /// Appends `rows` with one statement, in the order given, each under its key's
    /// lock.
    pub async fn insert_all(rows: Vec<OutboxRow>, conn: &mut PgConnection) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        sqlx::query(APPEND).bind(rows).execute(&mut *conn).await?;
        Ok(())
    }
}
