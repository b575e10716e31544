//! The batch processor: forms batches, applies each in one fenced transaction, retries and dead-letters.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fenceline_domain::progress::{BatchPlan, StoredProgress, batch_wait, plan_batch};
use fenceline_events::{Envelope, topics};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message, OwnedMessage};
use sqlx::{Connection, PgConnection, Postgres, Transaction};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::{OutboxWriter, fault};

use super::dead_letters::{Rejected, undecodable};
use super::rebalance::{FencedContext, lock};
use super::{Fetched, HandleError, Handler, Inbound, POISON_AFTER, forget_fenced_holding};

pub(super) struct Processor<H> {
    /// The client, whose context holds the pool, the spec, the holdings, the
    /// in-flight lock and the counters this processor shares with the callbacks.
    pub(super) consumer: Arc<BaseConsumer<FencedContext>>,
    pub(super) outbox: OutboxWriter,
    pub(super) handler: H,
    pub(super) batch_max: usize,
    pub(super) batch_wait: Duration,
    pub(super) dedup_retention_hours: u32,
}

/// A record that failed alone too often, to be dead-lettered on the next try.
#[derive(Debug)]
struct Condemned {
    at: (String, i32, i64),
    reason: String,
}

/// How long ago `message` was produced, by its timestamp; `None` without one.
fn age(message: &OwnedMessage) -> Option<Duration> {
    let produced_ms = u64::try_from(message.timestamp().to_millis()?).ok()?;
    let now_ms =
        u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()?;
    Some(Duration::from_millis(now_ms.saturating_sub(produced_ms)))
}

/// How often remembered event ids past their retention are deleted.
const DEDUP_PURGE_EVERY: Duration = Duration::from_secs(600);

/// The outcome of one batch transaction.
#[derive(Debug, Default)]
struct Applied {
    /// Per partition, the last offset now covered by the database.
    progress: Vec<(String, i32, i64)>,
    /// Events the handler applied, counted once the batch committed.
    handled: u64,
}

/// Why a batch was not applied.
enum BatchFailure {
    Failed(HandleError),
    /// Without savepoints, a handler refused an event: the batch was rolled back
    /// whole, and is applied again with a savepoint per event so that only the
    /// refused one is left out.
    RefusedWithoutSavepoints,
}

impl From<HandleError> for BatchFailure {
    fn from(e: HandleError) -> Self {
        BatchFailure::Failed(e)
    }
}

impl From<sqlx::Error> for BatchFailure {
    fn from(e: sqlx::Error) -> Self {
        BatchFailure::Failed(e.into())
    }
}

impl From<crate::faults::Injected> for BatchFailure {
    fn from(injected: crate::faults::Injected) -> Self {
        BatchFailure::Failed(injected.into())
    }
}

impl<H: Handler> Processor<H> {
    /// What the processor shares with the client's callbacks.
    fn shared(&self) -> &FencedContext {
        self.consumer.context()
    }

    pub(super) async fn run(self, mut rx: mpsc::Receiver<Fetched>, shutdown: CancellationToken) {
        let mut purge = tokio::time::interval(DEDUP_PURGE_EVERY);
        loop {
            let first = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = purge.tick() => {
                    self.purge_remembered_events().await;
                    continue;
                }
                first = rx.recv() => match first { Some(m) => m, None => break },
            };
            let wait = batch_wait(self.handler.on_a_tasks_way(), age(&first.message), self.batch_wait);
            let mut batch = vec![first];
            // A record already here is taken even when the deadline has passed.
            let deadline = tokio::time::Instant::now() + wait;
            while batch.len() < self.batch_max {
                match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(m)) => batch.push(m),
                    _ => break,
                }
            }
            let guard = self.shared().in_flight.lock().await;
            self.handle_until_done(batch, &shutdown).await;
            drop(guard);
        }
        info!("consumer stopped");
    }

    /// Forgets applied event ids older than the retention, in small deletes so that
    /// no long transaction competes with the batches.
    async fn purge_remembered_events(&self) {
        loop {
            let deleted = sqlx::query(
                "DELETE FROM processed_events WHERE ctid IN (SELECT ctid FROM processed_events \
                 WHERE consumer_group = $1 AND processed_at < now() - make_interval(hours => $2) LIMIT 5000)",
            )
            .bind(&self.shared().spec.group)
            .bind(self.dedup_retention_hours as i32)
            .execute(&self.shared().pool)
            .await;
            match deleted {
                Ok(result) if result.rows_affected() == 5000 => continue,
                Ok(result) => {
                    debug!(deleted = result.rows_affected(), "forgot old event ids");
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "purging remembered event ids failed; trying again later");
                    return;
                }
            }
        }
    }

    /// Retries a batch that failed until it is applied, fenced, or the service
    /// shuts down (then the records are redelivered later). A batch that keeps
    /// failing for a reason that is not passing is applied one record at a time, and
    /// a record that keeps failing alone is dead-lettered with the last error, so one
    /// record never stops the consumer.
    async fn handle_until_done(&self, batch: Vec<Fetched>, shutdown: &CancellationToken) {
        let mut queue: VecDeque<Fetched> = batch.into();
        let mut backoff = Duration::from_millis(50);
        let (mut one_at_a_time, mut failures) = (false, 0u32);
        let mut condemned: Option<Condemned> = None;
        // Savepoints only after a handler refused an event of this batch: most
        // batches refuse nothing, and a savepoint costs two round trips per event.
        let mut savepoints = false;
        loop {
            let owned = lock(&self.shared().owned).clone();
            // Only records fetched under the holding that is current now.
            let before = queue.len();
            queue.retain(|f| owned.get(&(f.message.topic().to_owned(), f.message.partition())) == Some(&f.epoch));
            if queue.len() < before {
                debug!(
                    stale = before - queue.len(),
                    "records fetched under an earlier holding dropped; they are read again"
                );
            }
            if queue.is_empty() {
                return;
            }
            let take = if one_at_a_time { 1 } else { queue.len() };
            let mine: Vec<&OwnedMessage> = queue.iter().take(take).map(|f| &f.message).collect();
            match self.apply_batch(&mine, &owned, condemned.as_ref(), savepoints).await {
                Ok(applied) => {
                    self.outbox.committed();
                    self.handler.committed();
                    self.shared().stats.applied.fetch_add(applied.handled, Ordering::Relaxed);
                    {
                        let mut next_offsets = lock(&self.shared().stats.next_offsets);
                        for (topic, partition, last) in &applied.progress {
                            next_offsets.insert((topic.clone(), *partition), last + 1);
                        }
                    }
                    for (topic, partition, last) in applied.progress {
                        if let Err(e) = self.consumer.store_offset(&topic, partition, last) {
                            debug!(topic, partition, error = %e, "offset not stored (partition given up?)");
                        }
                    }
                    self.shared().stats.batches.fetch_add(1, Ordering::Relaxed);
                    queue.drain(..take);
                    (failures, condemned, backoff, savepoints) = (0, None, Duration::from_millis(50), false);
                }
                Err(BatchFailure::RefusedWithoutSavepoints) => {
                    debug!(
                        records = mine.len(),
                        "a handler refused an event; applying the batch again with savepoints"
                    );
                    savepoints = true;
                }
                Err(BatchFailure::Failed(e)) => {
                    warn!(error = %e, records = mine.len(), "batch failed; it will be tried again");
                    if shutdown.is_cancelled() {
                        return;
                    }
                    if !e.passing() {
                        failures += 1;
                    }
                    if failures >= POISON_AFTER {
                        failures = 0;
                        if one_at_a_time {
                            let m = mine[0];
                            condemned = Some(Condemned {
                                at: (m.topic().to_owned(), m.partition(), m.offset()),
                                reason: format!("failed {POISON_AFTER} times on its own: {e}"),
                            });
                        } else {
                            one_at_a_time = true;
                            info!(records = mine.len(), "a batch keeps failing; applying its records one at a time");
                        }
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn apply_batch(
        &self,
        batch: &[&OwnedMessage],
        owned: &HashMap<(String, i32), i64>,
        condemned: Option<&Condemned>,
        savepoints: bool,
    ) -> Result<Applied, BatchFailure> {
        // Per partition, in delivery order.
        let mut by_partition: BTreeMap<(String, i32), Vec<&OwnedMessage>> = BTreeMap::new();
        for message in batch {
            by_partition.entry((message.topic().to_owned(), message.partition())).or_default().push(message);
        }
        // Whatever a failed try of a batch left gathered never committed.
        self.handler.discard();
        let mut tx = self.shared().pool.begin().await?;
        let mut applied = Applied::default();
        // The progress rows of every partition in the batch, locked in one statement,
        // in (topic, partition) order as the batch is applied: instances that share
        // partitions lock them in one order.
        let (topics, partitions): (Vec<&str>, Vec<i32>) =
            by_partition.keys().map(|(topic, partition)| (topic.as_str(), *partition)).unzip();
        let stored: Vec<(String, i32, i64, Option<i64>)> = sqlx::query_as(
            "SELECT c.topic, c.partition, c.epoch, c.next_offset FROM consumer_partitions c \
             JOIN unnest($2::text[], $3::int[]) AS b (topic, partition) \
               ON c.topic = b.topic AND c.partition = b.partition \
             WHERE c.consumer_group = $1 ORDER BY c.topic, c.partition FOR UPDATE OF c",
        )
        .bind(&self.shared().spec.group)
        .bind(&topics)
        .bind(&partitions)
        .fetch_all(&mut *tx)
        .await?;
        let stored: HashMap<(String, i32), StoredProgress> = stored
            .into_iter()
            .map(|(topic, partition, epoch, next)| {
                ((topic, partition), StoredProgress { epoch, next_offset: next.unwrap_or(0) })
            })
            .collect();
        if !savepoints {
            let keys: Vec<&[u8]> = (by_partition.iter())
                .filter(|(at, _)| owned.contains_key(*at) && stored.contains_key(*at))
                .flat_map(|(_, messages)| messages.iter().filter_map(|m| m.key()))
                .collect();
            self.handler.prepare(&mut tx, &keys).await?;
        }
        let mut advanced: Vec<(String, i32, i64, i64)> = Vec::new();
        for ((topic, partition), messages) in by_partition {
            let Some(&my_epoch) = owned.get(&(topic.clone(), partition)) else { continue };
            let Some(&stored) = stored.get(&(topic.clone(), partition)) else {
                warn!(topic, partition, "no progress row for an owned partition; skipping its records");
                continue;
            };
            let offsets: Vec<i64> = messages.iter().map(|m| m.offset()).collect();
            match plan_batch(stored, my_epoch, &offsets) {
                BatchPlan::Fenced { mine, current } => {
                    self.shared().stats.fenced_batches.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        topic,
                        partition,
                        my_epoch = mine,
                        current_epoch = current,
                        "write rejected: partition fenced, another instance took it over; dropping its records"
                    );
                    forget_fenced_holding(&mut lock(&self.shared().owned), (topic.clone(), partition), mine);
                }
                BatchPlan::Apply { apply, redelivered, next_offset } => {
                    self.shared().stats.redelivered.fetch_add(redelivered as u64, Ordering::Relaxed);
                    if redelivered > 0 {
                        info!(topic, partition, redelivered, "records redelivered after a restart skipped by offset");
                    }
                    let to_apply: Vec<&OwnedMessage> = apply.iter().map(|&i| messages[i]).collect();
                    applied.handled +=
                        self.apply_records(&mut tx, &topic, partition, &to_apply, condemned, savepoints).await?;
                    if !to_apply.is_empty() {
                        advanced.push((topic, partition, my_epoch, next_offset));
                    }
                }
            }
        }
        // Every partition's progress advanced in one statement, each guarded by the
        // epoch it was locked with.
        if !advanced.is_empty() {
            let (mut topics, mut partitions, mut epochs, mut next_offsets) = (vec![], vec![], vec![], vec![]);
            for (topic, partition, epoch, next_offset) in &advanced {
                topics.push(topic.as_str());
                partitions.push(*partition);
                epochs.push(*epoch);
                next_offsets.push(*next_offset);
            }
            sqlx::query(
                "UPDATE consumer_partitions c SET next_offset = a.next_offset, updated_at = now() \
                 FROM unnest($2::text[], $3::int[], $4::bigint[], $5::bigint[]) AS a (topic, partition, epoch, next_offset) \
                 WHERE c.consumer_group = $1 AND c.topic = a.topic AND c.partition = a.partition AND c.epoch = a.epoch",
            )
            .bind(&self.shared().spec.group)
            .bind(&topics)
            .bind(&partitions)
            .bind(&epochs)
            .bind(&next_offsets)
            .execute(&mut *tx)
            .await?;
            applied
                .progress
                .extend(advanced.into_iter().map(|(topic, partition, _, next)| (topic, partition, next - 1)));
        }
        if !savepoints {
            match self.handler.flush(&mut tx, &self.outbox).await {
                Ok(()) => {}
                Err(e) if applies_one_at_a_time(&e) => {
                    return Err(BatchFailure::RefusedWithoutSavepoints);
                }
                Err(other) => return Err(other.into()),
            }
        }
        fault!("consumer.before_db_commit");
        tx.commit().await?;
        fault!("consumer.after_db_commit");
        Ok(applied)
    }

    /// Decodes, dedupes and hands records to the handler; dead-letters the rest.
    /// Returns how many events the handler applied. With `savepoints`, each event
    /// is handled in a savepoint of its own, and one the handler refuses is rolled
    /// back alone and dead-lettered; without, a refusal fails the whole batch
    /// ([`BatchFailure::RefusedWithoutSavepoints`]) so that it is applied again with them.
    async fn apply_records(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        topic: &str,
        partition: i32,
        messages: &[&OwnedMessage],
        condemned: Option<&Condemned>,
        savepoints: bool,
    ) -> Result<u64, BatchFailure> {
        let mut decoded = Vec::with_capacity(messages.len());
        for message in messages {
            if message.payload().is_none() && topics::is_compacted(topic) {
                // A tombstone: the key's task was purged upstream (docs/wire.md,
                // "Tombstones on fenceline.status"). Nothing to apply, nothing to reject.
                self.shared().stats.tombstones.fetch_add(1, Ordering::Relaxed);
                debug!(topic, partition, offset = message.offset(), "tombstone skipped");
                continue;
            }
            let headers = message
                .headers()
                .map(|h| h.iter().map(|header| (header.key, header.value)).collect::<Vec<(&str, Option<&[u8]>)>>());
            match Envelope::decode(headers.unwrap_or_default(), message.payload().unwrap_or_default()) {
                Ok(envelope) => decoded.push((message, envelope)),
                Err(e) => match undecodable(&e, self.handler.holds_newer_schemas()) {
                    Ok(reason) => self.dead_letter(tx, message, &reason).await?,
                    Err(held) => {
                        // A person must act: upgrade this consumer (docs/wire.md, "Deploy order").
                        error!(
                            topic,
                            partition,
                            offset = message.offset(),
                            error = %e,
                            "holding a record this build cannot read yet; the partition waits for an upgrade"
                        );
                        return Err(held.into());
                    }
                },
            }
        }
        // One round trip dedupes the whole batch; events the handler may apply
        // twice are not remembered, and a batch of only those skips it.
        let remembered: Vec<bool> =
            decoded.iter().map(|(_, e)| !self.handler.applies_twice_harmlessly(&e.event)).collect();
        let ids: Vec<uuid::Uuid> = decoded
            .iter()
            .zip(&remembered)
            .filter(|(_, remember)| **remember)
            .map(|((_, e), _)| e.headers.event_id.as_uuid())
            .collect();
        let fresh: HashSet<uuid::Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            sqlx::query_scalar(
                "INSERT INTO processed_events (consumer_group, event_id) SELECT $1, unnest($2::uuid[]) \
                 ON CONFLICT DO NOTHING RETURNING event_id",
            )
            .bind(&self.shared().spec.group)
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?
            .into_iter()
            .collect()
        };
        let mut seen = HashSet::with_capacity(decoded.len());
        let mut handled = 0;
        for ((message, envelope), remember) in decoded.into_iter().zip(remembered) {
            let id = envelope.headers.event_id.as_uuid();
            if (remember && !fresh.contains(&id)) || !seen.insert(id) {
                self.shared().stats.duplicates.fetch_add(1, Ordering::Relaxed);
                info!(topic, partition, event_id = %id, "duplicate event skipped: applied before");
                continue;
            }
            let inbound = Inbound {
                topic: topic.to_owned(),
                partition,
                offset: message.offset(),
                key: message.key().map(<[u8]>::to_vec),
                value: message.payload().unwrap_or_default().to_vec(),
                envelope,
            };
            let span = info_span!(
                "handle",
                topic,
                partition,
                offset = inbound.offset,
                event_type = inbound.envelope.event.event_type(),
                task_id = tracing::field::Empty,
                trace_id = tracing::field::Empty,
            );
            if let Some(task_id) = inbound.envelope.event.task_id() {
                span.record("task_id", tracing::field::display(task_id));
            }
            fenceline_telemetry::continue_trace(&span, inbound.envelope.headers.traceparent.as_deref());
            let condemned_here = condemned.filter(|c| c.at == (topic.to_owned(), partition, inbound.offset));
            if !savepoints && condemned_here.is_none() {
                match self.handler.handle(tx, &self.outbox, &inbound).instrument(span.clone()).await {
                    Ok(()) => {
                        handled += 1;
                        span.in_scope(|| debug!("event handled; it commits with its batch"));
                    }
                    Err(e) if applies_one_at_a_time(&e) => {
                        return Err(BatchFailure::RefusedWithoutSavepoints);
                    }
                    Err(other) => return Err(other.into()),
                }
                continue;
            }
            // A savepoint, so that a handler refusing the event leaves nothing behind.
            let mut savepoint = Connection::begin(&mut **tx).await?;
            let handled_here =
                match self.handler.handle(&mut savepoint, &self.outbox, &inbound).instrument(span.clone()).await {
                    Ok(()) => self.handler.flush(&mut savepoint, &self.outbox).await,
                    Err(e) => Err(e),
                };
            // A record condemned for failing alone is tried once more before it is
            // dead-lettered: the condition that failed it may have passed (a database
            // that refused writes for a while), and then it applies as any other.
            let refused = match handled_here {
                Ok(()) => {
                    savepoint.commit().await?;
                    handled += 1;
                    // With the span's task and trace: at debug, a line per event.
                    span.in_scope(|| debug!("event handled; it commits with its batch"));
                    if condemned_here.is_some() {
                        info!(topic, partition, offset = message.offset(), "a record that had failed alone applied");
                    }
                    continue;
                }
                Err(HandleError::Poison(reason)) => reason,
                // A record condemned within a batch applied whole: the batch again,
                // every event in a savepoint.
                Err(HandleError::OneAtATime(_)) if !savepoints => return Err(BatchFailure::RefusedWithoutSavepoints),
                Err(other) => match (other.refusal_of_the_record(), condemned_here) {
                    (Some(reason), _) => reason,
                    (None, Some(condemned)) if !other.passing() => format!("{}; then: {other}", condemned.reason),
                    (None, _) => return Err(other.into()),
                },
            };
            savepoint.rollback().await?;
            self.handler.discard();
            self.dead_letter(tx, message, &refused).await?;
            if remember {
                // A dead letter must apply when it is replayed: its id is not kept as applied.
                self.forget(tx, id).await?;
            }
        }
        Ok(handled)
    }

    /// Forgets that the event `id` was applied, in the batch's transaction.
    async fn forget(&self, tx: &mut PgConnection, id: uuid::Uuid) -> Result<(), sqlx::Error> {
        sqlx::query("DELETE FROM processed_events WHERE consumer_group = $1 AND event_id = $2")
            .bind(&self.shared().spec.group)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    async fn dead_letter(
        &self,
        tx: &mut PgConnection,
        message: &OwnedMessage,
        reason: &str,
    ) -> Result<(), HandleError> {
        warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            reason,
            "record rejected"
        );
        let headers =
            message.headers().map(|h| h.iter().map(|header| (header.key, header.value)).collect()).unwrap_or_default();
        let rejected = Rejected {
            consumer_group: &self.shared().spec.group,
            topic: message.topic(),
            partition: message.partition(),
            offset: message.offset(),
            reason,
            key: message.key(),
            value: message.payload(),
            headers,
        };
        self.handler.reject(tx, &self.outbox, &rejected).await?;
        self.shared().stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Whether a batch applied whole must be applied again with a savepoint per event:
/// a handler refused an event, or asked for it ([`HandleError::OneAtATime`]).
fn applies_one_at_a_time(e: &HandleError) -> bool {
    matches!(e, HandleError::Poison(_) | HandleError::OneAtATime(_)) || e.refusal_of_the_record().is_some()
}
