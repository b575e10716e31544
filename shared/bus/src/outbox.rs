//! The transactional outbox (docs/architecture.md, "The outbox"). A state change and the events it
//! causes commit together; the relay publishes them with an idempotent producer in
//! outbox order per key, marks them after the broker confirmed, and re-sends what
//! was not confirmed when it (or another instance) picks the shard up again.
//! Consumers dedupe by `event_id`, so a re-send is harmless.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fenceline_config::{KafkaConfig, OutboxConfig};
use fenceline_domain::ids::EventId;
use fenceline_domain::outbox::{publishable_prefix, shard_for_key};
use fenceline_events::{Event, Headers, Timestamp, encode};
use futures_util::future::join_all;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{Error, fault};

/// Namespace of the relay's session advisory locks (first key of the two-key form).
/// Do not change: relays of different versions must contend for the same locks.
const SHARD_LOCK_NAMESPACE: i32 = 0x0F1D_0001;
/// Namespace of the per-key transaction locks writers take, so that rows of one
/// key get ids in the order their transactions commit.
const KEY_LOCK_NAMESPACE: i32 = 0x0F1D_0002;

/// Writes events into the outbox inside the caller's transaction.
#[derive(Debug, Clone)]
pub struct OutboxWriter {
    producer: &'static str,
    topic_prefix: String,
    shards: u16,
    written: Arc<Notify>,
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
        let task_key = event.task_id().map(|id| id.to_string().into_bytes());
        let key: Option<&[u8]> = task_key.as_deref().or(key);
        let (payload, fingerprint) = encode(event)?;
        let headers = Headers {
            event_id: EventId::new_v7(),
            event_type: event.event_type().to_owned(),
            schema_fingerprint: hex::encode(fingerprint),
            producer: self.producer.to_owned(),
            produced_at: Timestamp::now(),
            traceparent: fenceline_telemetry::current_traceparent(),
        };
        let shard = shard_for_key(key.unwrap_or_default(), self.shards);
        if let Some(key) = key {
            sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext(encode($2, 'escape')))")
                .bind(KEY_LOCK_NAMESPACE)
                .bind(key)
                .execute(&mut *conn)
                .await?;
        }
        sqlx::query(
            "INSERT INTO outbox (shard, topic, record_key, payload, event_id, event_type, schema_fingerprint, \
             producer, produced_at_us, traceparent) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(i16::try_from(shard).unwrap_or(i16::MAX))
        .bind(self.topic(topic))
        .bind(key)
        .bind(payload)
        .bind(headers.event_id.as_uuid())
        .bind(&headers.event_type)
        .bind(&headers.schema_fingerprint)
        .bind(&headers.producer)
        .bind(headers.produced_at.0)
        .bind(&headers.traceparent)
        .execute(&mut *conn)
        .await?;
        Ok(headers.event_id)
    }

    /// Tells this process's relay that rows were committed. Call after the commit.
    pub fn committed(&self) {
        self.written.notify_one();
    }
}

/// Counters of one relay, for tests, benchmarks and metrics.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub published: AtomicU64,
    pub failed_deliveries: AtomicU64,
    pub rounds: AtomicU64,
}

/// Publishes the outbox of one schema.
pub struct Relay {
    pool: PgPool,
    lock_options: PgConnectOptions,
    producer: FutureProducer,
    config: OutboxConfig,
    written: Arc<Notify>,
    stats: Arc<RelayStats>,
    name: String,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("name", &self.name).field("config", &self.config).finish_non_exhaustive()
    }
}

/// One unpublished outbox row.
#[derive(Debug, sqlx::FromRow)]
struct Row {
    id: i64,
    topic: String,
    record_key: Option<Vec<u8>>,
    payload: Vec<u8>,
    event_id: uuid::Uuid,
    event_type: String,
    schema_fingerprint: String,
    producer: String,
    produced_at_us: i64,
    traceparent: Option<String>,
}

impl Row {
    fn headers(&self) -> OwnedHeaders {
        let headers = Headers {
            event_id: EventId::from_uuid(self.event_id),
            event_type: self.event_type.clone(),
            schema_fingerprint: self.schema_fingerprint.clone(),
            producer: self.producer.clone(),
            produced_at: Timestamp(self.produced_at_us),
            traceparent: self.traceparent.clone(),
        };
        headers
            .to_pairs()
            .into_iter()
            .fold(OwnedHeaders::new(), |acc, (key, value)| acc.insert(Header { key, value: Some(value.as_bytes()) }))
    }
}

impl Relay {
    /// `lock_options` reach the same database as `pool`; the relay keeps one
    /// connection of its own for its shard locks.
    pub fn new(
        name: impl Into<String>,
        pool: PgPool,
        lock_options: PgConnectOptions,
        kafka: &KafkaConfig,
        config: OutboxConfig,
        writer: &OutboxWriter,
    ) -> Result<Self, Error> {
        let name = name.into();
        let producer = crate::kafka::producer_config(kafka, &name).create()?;
        Ok(Self {
            pool,
            lock_options,
            producer,
            config,
            written: writer.written.clone(),
            stats: Arc::new(RelayStats::default()),
            name,
        })
    }

    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Publishes until `shutdown`, then a last round, then flushes the producer.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut lock_conn: Option<PgConnection> = None;
        let mut backoff = Duration::from_millis(100);
        // Instances start at different shards so that they rarely contend.
        let mut next_start = usize::from(rand_start(self.config.shards));
        let mut last_purge = tokio::time::Instant::now();
        info!(relay = %self.name, shards = self.config.shards, "outbox relay started");
        while !shutdown.is_cancelled() {
            let conn = match lock_conn.as_mut() {
                Some(conn) => conn,
                None => match PgConnection::connect_with(&self.lock_options).await {
                    Ok(conn) => lock_conn.insert(conn),
                    Err(e) => {
                        warn!(relay = %self.name, error = %e, "outbox relay cannot reach the database; retrying");
                        sleep_or_cancel(&shutdown, backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                },
            };
            match self.round(conn, next_start).await {
                Ok(published) => {
                    backoff = Duration::from_millis(100);
                    self.stats.rounds.fetch_add(1, Ordering::Relaxed);
                    if published == 0 {
                        tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = self.written.notified() => {}
                            _ = tokio::time::sleep(Duration::from_millis(self.config.idle_poll_ms)) => {}
                        }
                    }
                }
                Err(e) => {
                    warn!(relay = %self.name, error = %e, "outbox relay round failed; unconfirmed rows will be sent again");
                    // The lock connection may be broken; its locks die with it.
                    lock_conn = None;
                    sleep_or_cancel(&shutdown, backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
            next_start = (next_start + 1) % usize::from(self.config.shards.max(1));
            if last_purge.elapsed() > Duration::from_secs(60) {
                last_purge = tokio::time::Instant::now();
                if let Err(e) = sqlx::query("DELETE FROM outbox WHERE published_at < now() - interval '1 hour'")
                    .execute(&self.pool)
                    .await
                {
                    warn!(relay = %self.name, error = %e, "purging published outbox rows failed");
                }
            }
        }
        // A last round for what was written while the service drained.
        if let Some(conn) = lock_conn.as_mut()
            && let Err(e) = self.round(conn, next_start).await
        {
            warn!(relay = %self.name, error = %e, "the last outbox round failed; unconfirmed rows are sent on restart");
        }
        let _ = self.producer.flush(Duration::from_secs(5));
        info!(relay = %self.name, "outbox relay stopped");
    }

    /// Visits every shard once; returns how many rows were published.
    async fn round(&self, lock_conn: &mut PgConnection, start: usize) -> Result<usize, Error> {
        let shards = usize::from(self.config.shards.max(1));
        let mut published = 0;
        for i in 0..shards {
            let shard = ((start + i) % shards) as i32;
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
                .bind(SHARD_LOCK_NAMESPACE)
                .bind(shard)
                .fetch_one(&mut *lock_conn)
                .await?;
            if !locked {
                continue;
            }
            let result = self.drain_shard(shard).await;
            sqlx::query("SELECT pg_advisory_unlock($1, $2)")
                .bind(SHARD_LOCK_NAMESPACE)
                .bind(shard)
                .execute(&mut *lock_conn)
                .await?;
            published += result?;
        }
        Ok(published)
    }

    /// Publishes the shard's unpublished rows in id order, batch after batch.
    async fn drain_shard(&self, shard: i32) -> Result<usize, Error> {
        let mut published = 0;
        loop {
            let rows: Vec<Row> = sqlx::query_as(
                "SELECT id, topic, record_key, payload, event_id, event_type, schema_fingerprint, producer, \
                 produced_at_us, traceparent FROM outbox WHERE shard = $1 AND published_at IS NULL ORDER BY id LIMIT $2",
            )
            .bind(shard as i16)
            .bind(i64::from(self.config.batch_max))
            .fetch_all(&self.pool)
            .await?;
            if rows.is_empty() {
                return Ok(published);
            }
            let full = rows.len() == self.config.batch_max as usize;
            let confirmed = self.publish(&rows).await;
            fault!("outbox.after_publish_before_mark");
            let ids: Vec<i64> = rows[..confirmed].iter().map(|r| r.id).collect();
            if !ids.is_empty() {
                sqlx::query("UPDATE outbox SET published_at = now() WHERE id = ANY($1)")
                    .bind(&ids)
                    .execute(&self.pool)
                    .await?;
            }
            published += confirmed;
            self.stats.published.fetch_add(confirmed as u64, Ordering::Relaxed);
            debug!(shard, confirmed, "outbox rows published");
            if confirmed < rows.len() {
                self.stats.failed_deliveries.fetch_add((rows.len() - confirmed) as u64, Ordering::Relaxed);
                return Err(Error::Kafka(rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::MessageTimedOut,
                )));
            }
            if !full {
                return Ok(published);
            }
        }
    }

    /// Hands every row to the producer, then waits for each delivery report.
    /// Returns how many rows from the start were confirmed without a gap.
    async fn publish(&self, rows: &[Row]) -> usize {
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in rows {
            let mut record = FutureRecord::to(&row.topic).payload(&row.payload).headers(row.headers());
            if let Some(key) = &row.record_key {
                record = record.key(key);
            }
            // Waits for room in the producer queue rather than failing the row.
            let delivery = loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => break Some(delivery),
                    Err((e, back)) => {
                        if matches!(e.rdkafka_error_code(), Some(rdkafka::types::RDKafkaErrorCode::QueueFull)) {
                            record = back;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        } else {
                            warn!(topic = %row.topic, error = %e, "producer refused an outbox row");
                            break None;
                        }
                    }
                }
            };
            match delivery {
                Some(delivery) => deliveries.push(delivery),
                None => break,
            }
        }
        let results = join_all(deliveries).await;
        let delivered: Vec<bool> = results
            .iter()
            .map(|r| match r {
                Ok(Ok(_)) => true,
                Ok(Err((e, _))) => {
                    warn!(error = %e, "delivery of an outbox row failed");
                    false
                }
                Err(_) => false,
            })
            .collect();
        publishable_prefix(&delivered)
    }
}

fn rand_start(shards: u16) -> u16 {
    // The low bits of a v7 UUID are random; good enough to spread start shards.
    (uuid::Uuid::now_v7().as_u128() as u16) % shards.max(1)
}

async fn sleep_or_cancel(shutdown: &CancellationToken, duration: Duration) {
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(duration) => {}
    }
}
