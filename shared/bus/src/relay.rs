//! The outbox relay (docs/architecture.md, "The outbox"): publishes a schema's
//! outbox rows with an idempotent producer in outbox order per key, deletes them (or
//! marks them, where they are kept a while) after the broker confirmed, and re-sends
//! what was not confirmed when it (or another instance) picks the shard up again.
//! Consumers dedupe by `event_id`, so a re-send is harmless.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fenceline_config::{KafkaConfig, OutboxConfig};
use fenceline_domain::ids::EventId;
use fenceline_domain::outbox::publishable_prefix;
use fenceline_events::{Bytes, DeadLetter, Event, Headers, OriginalHeader, Timestamp, topics};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::{Error, OutboxWriter, fault};

/// Tries, in one statement, the relay's session advisory locks on the shards in
/// `$1` (in that order); returns those taken. A shard's lock is
/// `hashtextextended(current_schema() || ':outbox-shard:' || shard::text, 0)`, scoped
/// to the service's schema: services share a database, and one service's relays
/// must not skip another's shards. Do not change the expression (here and in
/// [`SHARD_UNLOCK_ALL`]): relays of different versions must contend for the same locks.
pub const SHARD_TRY_LOCK_ALL: &str = "SELECT s FROM unnest($1::int[]) WITH ORDINALITY AS w(s, n) \
     WHERE pg_try_advisory_lock(hashtextextended(current_schema() || ':outbox-shard:' || s::text, 0)) ORDER BY n";
/// Releases the locks of the shards in `$1` in one statement.
const SHARD_UNLOCK_ALL: &str = "SELECT pg_advisory_unlock(hashtextextended(current_schema() || ':outbox-shard:' \
     || s::text, 0)) FROM unnest($1::int[]) AS s";
/// Marks a batch of rows, by id, published, where published rows are kept a while.
const MARK_PUBLISHED: &str = "UPDATE outbox SET published_at = now() WHERE id = ANY($1)";
/// Deletes a batch of published rows, by id: a deleted row costs the table less than
/// a marked one (no new row version, no index entries) and leaves nothing to purge.
const DELETE_PUBLISHED: &str = "DELETE FROM outbox WHERE id = ANY($1)";
/// Deletes rows kept past their time: published ones past
/// `FENCELINE_OUTBOX_KEEP_PUBLISHED_SECONDS` (`$1`), refused ones after 7 days.
const PURGE_KEPT: &str = "DELETE FROM outbox WHERE published_at < now() - make_interval(secs => $1) \
     OR refused_at < now() - interval '7 days'";

/// Longest a relay keeps its shards across busy rounds before it lets them go and
/// takes them afresh, giving another instance's relay a turn.
pub const HOLD_AT_MOST: Duration = Duration::from_secs(1);

/// How long a busy relay waits before its next round, so that what its service
/// writes meanwhile leaves in one batch, and reaches the consumers downstream as
/// one (docs/decisions.md, entry 63). With the producer's 1 ms linger, a busy
/// relay's rounds are as far apart as they were when the producer lingered 5 ms
/// and the relay never waited.
pub const PACE_WHEN_BUSY: Duration = Duration::from_millis(4);

/// What a relay does after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRound {
    /// Nothing was published: wait for a commit of its service or the idle poll.
    Rest,
    /// The next round at once: the first round after a rest published, and what
    /// was written while it ran leaves without waiting.
    Again,
    /// [`PACE_WHEN_BUSY`], then the next round: two rounds in a row published, so
    /// the service writes faster than single rows are worth a round each.
    PaceThenAgain,
}

/// The pacing rule, as the consumers wait for a batch only when behind
/// (docs/decisions.md, entries 29 and 63): a lone record leaves at once; a relay
/// that keeps finding rows waits a little between rounds.
pub fn after_round(published: usize, the_round_before_published: bool) -> AfterRound {
    match (published, the_round_before_published) {
        (0, _) => AfterRound::Rest,
        (_, false) => AfterRound::Again,
        (_, true) => AfterRound::PaceThenAgain,
    }
}

/// The shards a relay holds across rounds while they keep it busy, and since when.
#[derive(Debug)]
struct Held {
    shards: Vec<i32>,
    since: tokio::time::Instant,
}

/// Counters of one relay, for tests, benchmarks and metrics.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub published: AtomicU64,
    pub failed_deliveries: AtomicU64,
    /// Rows the broker can never take, kept as refused and announced as dead letters.
    pub refused: AtomicU64,
    pub rounds: AtomicU64,
}

/// Publishes the outbox of one schema.
pub struct Relay {
    pool: PgPool,
    lock_options: PgConnectOptions,
    producer: FutureProducer<crate::kafka::ProducerLog>,
    config: OutboxConfig,
    /// The schema's writer: dead letters of refused rows go through the outbox too.
    writer: OutboxWriter,
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
    /// None: a tombstone.
    payload: Option<Vec<u8>>,
    event_id: uuid::Uuid,
    event_type: String,
    schema_fingerprint: String,
    producer: String,
    produced_at_us: i64,
    traceparent: Option<String>,
}

/// What became of one row handed to the producer.
#[derive(Debug)]
enum Sent {
    Delivered,
    /// The broker can never take it; retrying cannot help.
    Refused(String),
    /// Not confirmed (timed out, broker away): sent again later.
    Failed,
}

/// Producer errors that no retry can cure: the record itself is wrong for the broker.
fn refused_for_good(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// Most bytes of an original record a dead letter carries; the rest is named by its
/// size and sha256 in the reason, so a dead letter always fits where its original did not.
pub const DEAD_LETTER_ORIGINAL_MAX: usize = 64 * 1024;

/// What a dead letter's reason says when its original value was cut.
pub const CUT_MARK: &str = "original value cut";

/// `original` cut to [`DEAD_LETTER_ORIGINAL_MAX`], and what the reason must add when it was cut.
pub fn bounded_original(original: &[u8]) -> (Vec<u8>, Option<String>) {
    if original.len() <= DEAD_LETTER_ORIGINAL_MAX {
        return (original.to_vec(), None);
    }
    use sha2::Digest as _;
    let digest = hex::encode(sha2::Sha256::digest(original));
    let note =
        format!("; {CUT_MARK} to its first {DEAD_LETTER_ORIGINAL_MAX} of {} bytes, sha256 {digest}", original.len());
    (original[..DEAD_LETTER_ORIGINAL_MAX].to_vec(), Some(note))
}

impl Row {
    fn header_values(&self) -> Headers {
        Headers {
            event_id: EventId::from_uuid(self.event_id),
            event_type: self.event_type.clone(),
            schema_fingerprint: self.schema_fingerprint.clone(),
            producer: self.producer.clone(),
            produced_at: Timestamp(self.produced_at_us),
            traceparent: self.traceparent.clone(),
        }
    }

    fn headers(&self) -> OwnedHeaders {
        self.header_values()
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
        let producer = crate::kafka::producer_config(kafka, &name)
            .create_with_context(crate::kafka::ProducerLog::new(name.clone()))?;
        Ok(Self {
            pool,
            lock_options,
            producer,
            config,
            writer: writer.clone(),
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
        let mut held: Option<Held> = None;
        let mut backoff = Duration::from_millis(100);
        // Instances start at different shards so that they rarely contend.
        let mut next_start = usize::from(rand_start(self.config.shards));
        let mut last_purge = tokio::time::Instant::now();
        let mut the_round_before_published = false;
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
            match self.round(conn, next_start, &mut held).await {
                Ok(published) => {
                    backoff = Duration::from_millis(100);
                    self.stats.rounds.fetch_add(1, Ordering::Relaxed);
                    match after_round(published, the_round_before_published) {
                        AfterRound::Rest => tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = self.writer.written.notified() => {}
                            _ = tokio::time::sleep(Duration::from_millis(self.config.idle_poll_ms)) => {}
                        },
                        AfterRound::Again => {}
                        AfterRound::PaceThenAgain => sleep_or_cancel(&shutdown, PACE_WHEN_BUSY).await,
                    }
                    the_round_before_published = published > 0;
                }
                Err(e) => {
                    warn!(relay = %self.name, error = %e, "outbox relay round failed; unconfirmed rows will be sent again");
                    // The lock connection may be broken; its locks die with it.
                    lock_conn = None;
                    held = None;
                    the_round_before_published = false;
                    sleep_or_cancel(&shutdown, backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
            next_start = (next_start + 1) % usize::from(self.config.shards.max(1));
            if last_purge.elapsed() > Duration::from_secs(60) {
                last_purge = tokio::time::Instant::now();
                let keep = self.config.keep_published_seconds as f64;
                if let Err(e) = sqlx::query(PURGE_KEPT).bind(keep).execute(&self.pool).await {
                    warn!(relay = %self.name, error = %e, "purging published outbox rows failed");
                }
            }
        }
        // A last round for what was written while the service drained.
        if let Some(conn) = lock_conn.as_mut()
            && let Err(e) = self.round(conn, next_start, &mut held).await
        {
            warn!(relay = %self.name, error = %e, "the last outbox round failed; unconfirmed rows are sent on restart");
        }
        let _ = self.producer.flush(Duration::from_secs(5));
        info!(relay = %self.name, "outbox relay stopped");
    }

    /// Publishes what waits in the shards this relay holds, or can take; returns
    /// how many rows were published. An idle relay holds no shard: its round is one
    /// statement that finds the shards with rows waiting. When some are waiting it
    /// takes every shard it can in one statement (from its start shard on, so that
    /// instances rarely contend), and keeps them for the rounds that follow while
    /// each publishes something, up to [`HOLD_AT_MOST`]: a busy round is then only
    /// the batch's read and its delete. A round that finds nothing (or holds past
    /// [`HOLD_AT_MOST`], or fails) lets the shards go in one statement, so a relay
    /// paused between rounds while idle (a long GC, a stopped VM) blocks no shard.
    async fn round(&self, lock_conn: &mut PgConnection, start: usize, held: &mut Option<Held>) -> Result<usize, Error> {
        let taken = match held.take() {
            Some(taken) => taken,
            None => {
                let shards = i32::from(self.config.shards.max(1));
                let waiting: Vec<i32> = sqlx::query_scalar(
                    "SELECT s FROM generate_series(0, $1 - 1) s WHERE EXISTS \
                     (SELECT 1 FROM outbox WHERE shard = s AND published_at IS NULL AND refused_at IS NULL)",
                )
                .bind(shards)
                .fetch_all(&self.pool)
                .await?;
                if waiting.is_empty() {
                    return Ok(0);
                }
                // Every shard, not only those waiting: rows written to any of them
                // while this relay holds them are published without another look.
                let start = start as i32 % shards;
                let every: Vec<i32> = (0..shards).map(|n| (start + n) % shards).collect();
                let locked: Vec<i32> =
                    sqlx::query_scalar(SHARD_TRY_LOCK_ALL).bind(&every).fetch_all(&mut *lock_conn).await?;
                if locked.is_empty() {
                    return Ok(0);
                }
                Held { shards: locked, since: tokio::time::Instant::now() }
            }
        };
        let result = self.drain_shards(&taken.shards).await;
        if matches!(result, Ok(published) if published > 0) && taken.since.elapsed() < HOLD_AT_MOST {
            *held = Some(taken);
        } else {
            sqlx::query(SHARD_UNLOCK_ALL).bind(&taken.shards).execute(&mut *lock_conn).await?;
        }
        result
    }

    /// Publishes the unpublished rows of `shards` (locked by this relay) in id
    /// order, batch after batch; rows of one key share a shard, so id order is
    /// their written order.
    async fn drain_shards(&self, shards: &[i32]) -> Result<usize, Error> {
        let shards: Vec<i16> = shards.iter().map(|&s| s as i16).collect();
        let settle = if self.config.keep_published_seconds == 0 { DELETE_PUBLISHED } else { MARK_PUBLISHED };
        let mut published = 0;
        loop {
            let rows: Vec<Row> = sqlx::query_as(
                "SELECT id, topic, record_key, payload, event_id, event_type, schema_fingerprint, producer, \
                 produced_at_us, traceparent FROM outbox \
                 WHERE shard = ANY($1) AND published_at IS NULL AND refused_at IS NULL ORDER BY id LIMIT $2",
            )
            .bind(&shards)
            .bind(i64::from(self.config.batch_max))
            .fetch_all(&self.pool)
            .await?;
            if rows.is_empty() {
                return Ok(published);
            }
            let full = rows.len() == self.config.batch_max as usize;
            let sent = self.publish(&rows).await;
            fault!("outbox.after_publish_before_mark");
            let settled: Vec<bool> = sent.iter().map(|s| !matches!(s, Sent::Failed)).collect();
            let handled = publishable_prefix(&settled);
            let ids: Vec<i64> = rows[..handled]
                .iter()
                .zip(&sent)
                .filter(|(_, s)| matches!(s, Sent::Delivered))
                .map(|(r, _)| r.id)
                .collect();
            let refused: Vec<(&Row, &str)> = rows[..handled]
                .iter()
                .zip(&sent)
                .filter_map(|(r, s)| match s {
                    Sent::Refused(reason) => Some((r, reason.as_str())),
                    _ => None,
                })
                .collect();
            if !refused.is_empty() {
                let mut tx = self.pool.begin().await?;
                sqlx::query(settle).bind(&ids).execute(&mut *tx).await?;
                for (row, reason) in &refused {
                    self.refuse(&mut tx, row, reason).await?;
                }
                tx.commit().await?;
                self.writer.committed();
            } else if !ids.is_empty() {
                // One statement, one commit, for the whole batch.
                sqlx::query(settle).bind(&ids).execute(&self.pool).await?;
            }
            let confirmed = ids.len();
            published += confirmed;
            self.stats.published.fetch_add(confirmed as u64, Ordering::Relaxed);
            self.stats.refused.fetch_add(refused.len() as u64, Ordering::Relaxed);
            debug!(?shards, confirmed, refused = refused.len(), "outbox rows published");
            if handled < rows.len() {
                self.stats.failed_deliveries.fetch_add((rows.len() - handled) as u64, Ordering::Relaxed);
                return Err(Error::Kafka(rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::MessageTimedOut,
                )));
            }
            if !full {
                return Ok(published);
            }
        }
    }

    /// Keeps a row the broker can never take out of the relay's way, with its
    /// reason, and announces it on the dead-letter topic (a dead letter's own
    /// refusal is only kept: its original is bounded, so that cannot repeat).
    async fn refuse(&self, tx: &mut PgConnection, row: &Row, reason: &str) -> Result<(), Error> {
        error!(
            relay = %self.name,
            topic = %row.topic,
            outbox_id = row.id,
            event_type = %row.event_type,
            bytes = row.payload.as_ref().map_or(0, Vec::len),
            reason,
            "the broker can never take this outbox row; kept as refused and sent on as a dead letter"
        );
        sqlx::query("UPDATE outbox SET refused_at = now(), refused_reason = $2 WHERE id = $1")
            .bind(row.id)
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        if row.event_type == "DeadLetter" {
            return Ok(());
        }
        let (original, cut) = bounded_original(row.payload.as_deref().unwrap_or_default());
        let letter = Event::DeadLetter(DeadLetter {
            topic: row.topic.clone(),
            partition: -1,
            offset: row.id,
            consumer: format!("{} (outbox relay)", self.name),
            reason: format!("the broker refused outbox row {}: {reason}{}", row.id, cut.unwrap_or_default()),
            original_key: row.record_key.clone().map(Bytes),
            original_value: Some(Bytes(original)),
            original_headers: row
                .header_values()
                .to_pairs()
                .into_iter()
                .map(|(name, value)| OriginalHeader { name: name.to_owned(), value: Some(Bytes(value.into_bytes())) })
                .collect(),
            dead_lettered_at: Timestamp::now(),
        });
        let key = format!("outbox/{}", row.id);
        self.writer.append(tx, topics::DEADLETTER, Some(key.as_bytes()), &letter).await?;
        Ok(())
    }

    /// Hands every row to the producer, then waits for each delivery report.
    /// Returns what became of each row, in order; rows after the first that was
    /// neither delivered nor refused were not handed over.
    async fn publish(&self, rows: &[Row]) -> Vec<Sent> {
        // Per row: a pending delivery, or what is already known of it.
        let mut handed = Vec::with_capacity(rows.len());
        for row in rows {
            let mut record: FutureRecord<'_, Vec<u8>, Vec<u8>> = FutureRecord::to(&row.topic).headers(row.headers());
            if let Some(payload) = &row.payload {
                record = record.payload(payload);
            }
            if let Some(key) = &row.record_key {
                record = record.key(key);
            }
            // Waits for room in the producer queue rather than failing the row.
            let outcome = loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => break Ok(delivery),
                    Err((e, back)) => {
                        if matches!(e.rdkafka_error_code(), Some(RDKafkaErrorCode::QueueFull)) {
                            record = back;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        } else if refused_for_good(e.rdkafka_error_code()) {
                            break Err(Sent::Refused(e.to_string()));
                        } else {
                            warn!(topic = %row.topic, error = %e, "producer refused an outbox row; it is sent again later");
                            break Err(Sent::Failed);
                        }
                    }
                }
            };
            let stop = matches!(outcome, Err(Sent::Failed));
            handed.push(outcome);
            if stop {
                break;
            }
        }
        let mut sent = Vec::with_capacity(handed.len());
        // One line for a round's failed deliveries: while the broker is away they
        // are every row of the round.
        let (mut failed, mut first_error) = (0usize, None);
        for outcome in handed {
            sent.push(match outcome {
                Err(known) => known,
                Ok(delivery) => match delivery.await {
                    Ok(Ok(_)) => Sent::Delivered,
                    Ok(Err((e, _))) if refused_for_good(e.rdkafka_error_code()) => Sent::Refused(e.to_string()),
                    Ok(Err((e, _))) => {
                        failed += 1;
                        first_error.get_or_insert(e);
                        Sent::Failed
                    }
                    Err(_) => Sent::Failed,
                },
            });
        }
        if let Some(error) = first_error {
            warn!(relay = %self.name, failed, error = %error, "deliveries of outbox rows failed; they are sent again later");
        }
        sent
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

#[cfg(test)]
mod tests {
    use super::{AfterRound, after_round};

    #[test]
    fn a_lone_record_leaves_at_once_and_only_a_relay_that_keeps_finding_rows_waits() {
        // Idle: rest until a commit wakes the relay.
        assert_eq!(after_round(0, false), AfterRound::Rest);
        assert_eq!(after_round(0, true), AfterRound::Rest);
        // The first round after a rest published: look again at once, no wait.
        assert_eq!(after_round(1, false), AfterRound::Again);
        assert_eq!(after_round(500, false), AfterRound::Again);
        // It found rows again: it is behind what its service writes, so it paces.
        assert_eq!(after_round(1, true), AfterRound::PaceThenAgain);
    }
}
