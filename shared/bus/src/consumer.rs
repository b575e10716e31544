//! The fenced consumer (docs/architecture.md, "The fenced consumer"). One implementation for every service:
//! a service plugs in a [`Handler`] and never writes a poll loop of its own.
//!
//! - On assignment an instance bumps the partition's epoch in the database and
//!   starts reading at the database's `next_offset`; the broker's committed offset
//!   is only a hint.
//! - Records are handled in batches, one transaction per batch: the transaction
//!   locks the batch's partition rows, applies only what [`plan_batch`] allows
//!   (nothing if another instance took the partition over), dedupes by `event_id`
//!   all but the events its handler applies twice harmlessly, lets the handler
//!   change the projection and write outbox rows, dead-letters
//!   what cannot be read, and advances `next_offset`. The broker offset is stored
//!   only after the commit.
//! - On revocation the in-flight batch is drained before the partitions are given up.
//!
//! Polling runs on a thread of its own, so rebalance callbacks can wait for the
//! database while the async side keeps handling.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fenceline_config::{ConsumerConfig, KafkaConfig};
use fenceline_domain::progress::{BatchPlan, StartAt, StoredProgress, batch_wait, plan_batch, start_at};
use fenceline_events::{Bytes, DeadLetter, Envelope, Event, OriginalHeader, Timestamp, topics};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message, OwnedMessage};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::{Error, OutboxWriter, fault};

/// A record handed to a handler: where it came from and what it says.
#[derive(Debug, Clone)]
pub struct Inbound {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    /// The record's value as it arrived, for answers that must quote it.
    pub value: Vec<u8>,
    pub envelope: Envelope,
}

/// Why a handler did not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum HandleError {
    /// The event can never be applied (it contradicts the projection's rules); it
    /// goes to the dead-letter topic and the partition moves on.
    #[error("{0}")]
    Poison(String),
    /// Applying failed for a reason that may pass (database unavailable); the whole
    /// batch is rolled back and tried again.
    #[error("database: {0}")]
    Transient(#[from] sqlx::Error),
    /// A record this build cannot read yet (written with a newer schema): the batch
    /// is tried again until a build that reads it is deployed; never dead-lettered.
    #[error("held: {0}")]
    Held(String),
    #[error(transparent)]
    Bus(#[from] Error),
}

impl HandleError {
    /// An error of the record itself, which the same record will meet on every try:
    /// the database refused its data (SQLSTATE class 22) or a constraint (class 23).
    fn refusal_of_the_record(&self) -> Option<String> {
        let HandleError::Transient(sqlx::Error::Database(db)) = self else { return None };
        let code = db.code()?;
        (code.starts_with("22") || code.starts_with("23"))
            .then(|| format!("the database refused the change this record asks for (SQLSTATE {code}): {db}"))
    }

    /// Whether a retry may succeed without anything about the record changing: the
    /// connection, a pool timeout, a serialisation failure or deadlock, a server
    /// short of resources or being shut down. Anything else that fails again and
    /// again is blamed on the record (after [`POISON_AFTER`] tries).
    fn passing(&self) -> bool {
        match self {
            HandleError::Transient(sqlx::Error::Database(db)) => {
                db.code().is_some_and(|c| ["08", "40", "53", "55", "57", "58"].iter().any(|class| c.starts_with(class)))
            }
            HandleError::Transient(_) | HandleError::Held(_) => true,
            HandleError::Bus(Error::Database(sqlx::Error::Database(_))) => false,
            HandleError::Bus(Error::Database(_)) | HandleError::Bus(Error::Kafka(_)) => true,
            HandleError::Bus(Error::Injected(_)) => true,
            HandleError::Bus(_) | HandleError::Poison(_) => false,
        }
    }
}

/// How often a batch may fail for a reason that is not passing before its records
/// are applied one at a time, and a single record before it is dead-lettered.
const POISON_AFTER: u32 = 5;

impl From<crate::faults::Injected> for HandleError {
    fn from(injected: crate::faults::Injected) -> Self {
        Self::Bus(Error::Injected(injected))
    }
}

/// A service's projection logic. It runs inside the batch transaction and must not
/// wait on anything but that transaction.
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        record: &Inbound,
    ) -> impl Future<Output = Result<(), HandleError>> + Send;

    /// Where a record this consumer cannot use goes, in the batch transaction. The
    /// default is a `DeadLetter` on `fenceline.deadletter`; a front door that owes
    /// its producers an answer (intake's upstream topic) answers on its own topic.
    fn reject(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        rejected: &Rejected<'_>,
    ) -> impl Future<Output = Result<(), HandleError>> + Send {
        dead_letter(tx, outbox, rejected)
    }

    /// Whether a record of a known type written with a schema this build does not
    /// know (a newer producer) is held, retried until this consumer is upgraded,
    /// rather than rejected. The default holds: between Fenceline's services a
    /// producer deployed first must not lose events. A front door for outside
    /// producers answers them instead, so that no outsider can stall it.
    fn holds_newer_schemas(&self) -> bool {
        true
    }

    /// Called after each batch this consumer applied has committed, for what must
    /// wait until the batch's rows are visible to others (waking workers that read
    /// them). The default does nothing.
    fn committed(&self) {}

    /// Writes what the handler gathered over the batch's events instead of writing
    /// it per event (the newest status of each task, one change mark per task), in
    /// the batch's transaction, after its last event and before it commits. After a
    /// refused event, when each event has a savepoint of its own, it is called after
    /// every event, inside that event's savepoint. A handler that gathers keeps its
    /// gatherings per consumer (each consumer owns its handler, and applies one batch
    /// at a time). The default writes nothing.
    fn flush(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
    ) -> impl Future<Output = Result<(), HandleError>> + Send {
        let _ = (tx, outbox);
        async { Ok(()) }
    }

    /// Forgets what the handler gathered and has not flushed: the transaction or
    /// savepoint it belonged to was rolled back. Called before each batch too.
    fn discard(&self) {}

    /// Whether applying `event` a second time (a relay re-sent it: the same event
    /// id at a later offset, possibly after newer events) leaves this handler's
    /// tables as applying it once did, and writes no outbox row. Such an event is
    /// not remembered by its id (docs/bus.md, "Events applied twice on purpose"):
    /// one row fewer per consumed record, the largest share of a task's rows. Say
    /// yes only for what is so by construction (a versioned snapshot, a row keyed
    /// by the event, a flag that only ever turns on) and prove it with a test that
    /// sends the event again. The default says no: every event is remembered.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        let _ = event;
        false
    }

    /// Whether a task's way waits for what this consumer applies (the scheduler
    /// hearing of a submission, the executor of a grant, intake of a status its
    /// clients poll for). Such a consumer applies a fresh record at once, and waits
    /// for a batch to fill only when it is behind
    /// ([`fenceline_domain::progress::batch_wait`], docs/bus.md item 2); every other consumer always
    /// waits the configured time, since fewer, larger batches cost less and nothing
    /// waits for it. The default says no.
    fn on_a_tasks_way(&self) -> bool {
        false
    }
}

/// What to do with a record that does not decode: hold it (retry later, with an
/// ERROR) when it is a newer version of a known type and the handler holds those,
/// else reject it with the reason.
fn undecodable(error: &fenceline_events::DecodeError, holds_newer: bool) -> Result<String, HandleError> {
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
    let (value, cut) = rejected.value.map(crate::outbox::bounded_original).unzip();
    let letter = Event::DeadLetter(DeadLetter {
        topic: rejected.topic.to_owned(),
        partition: rejected.partition,
        offset: rejected.offset,
        consumer: rejected.consumer_group.to_owned(),
        reason: format!("{}{}", rejected.reason, cut.flatten().unwrap_or_default()),
        original_key: rejected.key.map(|k| Bytes(crate::outbox::bounded_original(k).0)),
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

/// What to consume, as whom.
#[derive(Debug, Clone)]
pub struct ConsumerSpec {
    /// Consumer group, and the progress namespace in `consumer_partitions`.
    pub group: String,
    /// Topics, already prefixed.
    pub topics: Vec<String>,
    /// This instance's name, in logs and in `consumer_partitions.owner`.
    pub instance: String,
    /// How long a revocation waits for the batch in flight; shorter than the
    /// session timeout.
    pub drain_grace: Duration,
}

/// Counters of one consumer, for tests, benchmarks and metrics.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    pub applied: AtomicU64,
    pub redelivered: AtomicU64,
    pub duplicates: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Tombstones (null values on a compacted topic) skipped.
    pub tombstones: AtomicU64,
    pub fenced_batches: AtomicU64,
    pub batches: AtomicU64,
    pub assigned_partitions: AtomicUsize,
    /// Partitions stopped because their stored progress lies beyond the log's end.
    pub halted_partitions: AtomicUsize,
    /// Whether the group has given this instance its assignment (possibly empty:
    /// other instances may hold every partition); cleared when a rebalance failed
    /// and the instance gave everything up, until the next assignment.
    pub joined: std::sync::atomic::AtomicBool,
    /// Per held partition, records on the broker not applied yet: the high
    /// watermark the client last heard minus the next offset to apply. Refreshed
    /// by the polling thread about once a second.
    pub lag: Mutex<HashMap<(String, i32), i64>>,
    /// Per held partition, the next offset to apply, as of the last commit.
    next_offsets: Mutex<HashMap<(String, i32), i64>>,
}

impl ConsumerStats {
    /// The lag of every held partition, as of the last refresh.
    pub fn lag(&self) -> Vec<((String, i32), i64)> {
        lock(&self.lag).iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// The running consumer.
#[derive(Debug)]
pub struct ConsumerHandle {
    stats: Arc<ConsumerStats>,
    processor: tokio::task::JoinHandle<()>,
    poller: std::thread::JoinHandle<()>,
}

impl ConsumerHandle {
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Waits until both halves stopped (after the shutdown token was cancelled).
    pub async fn join(self) {
        let _ = self.processor.await;
        let _ = tokio::task::spawn_blocking(move || self.poller.join()).await;
    }
}

/// Partitions this instance holds, with the epoch it holds them under.
type Ownership = Arc<Mutex<HashMap<(String, i32), i64>>>;

/// Forgets the holding a batch was fenced under, and only that one: the partition
/// may have come back to this instance meanwhile, under a newer epoch whose
/// records are not to be dropped.
fn forget_fenced_holding(owned: &mut HashMap<(String, i32), i64>, partition: (String, i32), fenced_epoch: i64) {
    if owned.get(&partition) == Some(&fenced_epoch) {
        owned.remove(&partition);
    }
}

/// A record and the epoch its partition was held under when it was fetched. A
/// record fetched under an earlier holding is never applied: after a revocation
/// and a reassignment the partition is read again from the stored progress, and
/// applying records queued from the earlier holding first would move the progress
/// past records that were dropped in between (they would then be skipped as
/// redelivered, that is lost).
struct Fetched {
    epoch: i64,
    message: OwnedMessage,
}

struct FencedContext {
    runtime: Handle,
    pool: PgPool,
    spec: ConsumerSpec,
    owned: Ownership,
    /// Held by the processor for the duration of a batch; the revoke callback takes
    /// it to wait for the in-flight batch.
    in_flight: Arc<tokio::sync::Mutex<()>>,
    stats: Arc<ConsumerStats>,
    grace: Duration,
    shutdown: CancellationToken,
    /// Grows with every rebalance callback; the poll loop re-applies its pause state
    /// when it changed, without asking for the assignment on every poll.
    assignment_changes: AtomicU64,
    /// Partitions assigned here whose stored progress lies beyond the end of the
    /// log: kept paused and not handled until an operator looks (docs/bus.md).
    halted: Mutex<HashSet<(String, i32)>>,
    /// The client's errors, each kind logged at most once per period.
    errors: crate::kafka::ErrorLog,
}

/// How often the client reports its statistics, from which the lag is measured.
pub(crate) const STATISTICS_INTERVAL_MS: &str = "1000";

impl ClientContext for FencedContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.errors.report(&self.spec.group, &error, reason);
    }

    /// Lag per held partition: the log's end as the client last heard it (the last
    /// stable offset, which a `read_committed` consumer reads up to) minus the next
    /// offset the database has applied; for a partition this group never applied
    /// anything from, the log's start (it is read from the beginning). Runs inside
    /// `poll`, about once a second; asks the broker nothing.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let held: Vec<(String, i32)> = lock(&self.owned).keys().cloned().collect();
        let mut next_offsets = lock(&self.stats.next_offsets);
        next_offsets.retain(|k, _| held.contains(k));
        let mut lag = HashMap::with_capacity(held.len());
        for (topic, partition) in held {
            let Some(p) = statistics.topics.get(&topic).and_then(|t| t.partitions.get(&partition)) else { continue };
            let end = if p.ls_offset >= 0 { p.ls_offset } else { p.hi_offset };
            // Never the client's fetch position: records fetched but not applied
            // are lag too.
            let next =
                next_offsets.get(&(topic.clone(), partition)).copied().or((p.lo_offset >= 0).then_some(p.lo_offset));
            if let Some(next) = next
                && end >= 0
            {
                lag.insert((topic, partition), (end - next).max(0));
            }
        }
        drop(next_offsets);
        *lock(&self.stats.lag) = lag;
    }
}

impl ConsumerContext for FencedContext {
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.on_assign(consumer, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.on_revoke(consumer, tpl),
            other => {
                warn!(group = %self.spec.group, error = ?other, "rebalance failed; giving up every partition");
                self.forget_all();
                let _ = match (consumer.rebalance_protocol(), consumer.assignment()) {
                    (RebalanceProtocol::Cooperative, Ok(current)) => consumer.incremental_unassign(&current),
                    _ => consumer.unassign(),
                };
            }
        }
        self.assignment_changes.fetch_add(1, Ordering::Relaxed);
    }
}

impl FencedContext {
    fn on_assign(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let partitions: Vec<(String, i32)> =
            tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
        let mut backoff = Duration::from_millis(100);
        let acquired = loop {
            match self.runtime.block_on(acquire(&self.pool, &self.spec, &partitions)) {
                Ok(acquired) => break acquired,
                Err(e) if !self.shutdown.is_cancelled() => {
                    warn!(group = %self.spec.group, error = %e, "cannot take partitions over yet; retrying");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(_) => {
                    let _ = consumer.unassign();
                    return;
                }
            }
        };
        {
            let mut owned = lock(&self.owned);
            let mut halted = lock(&self.halted);
            for ((topic, partition), epoch, start) in &acquired {
                if let StartAt::Offset(next) = start
                    && let Some(end) = self.log_end(consumer, topic, *partition)
                    && *next > end
                {
                    error!(
                        group = %self.spec.group,
                        topic,
                        partition,
                        stored_next_offset = next,
                        log_end = end,
                        "stored progress lies beyond the end of the log (the topic was re-created, or records \
                         were lost); this partition is stopped here rather than skipped: an operator must set \
                         consumer_partitions.next_offset (docs/bus.md)"
                    );
                    halted.insert((topic.clone(), *partition));
                    continue;
                }
                halted.remove(&(topic.clone(), *partition));
                owned.insert((topic.clone(), *partition), *epoch);
                let offset = match start {
                    StartAt::Beginning => Offset::Beginning,
                    StartAt::Offset(o) => Offset::Offset(*o),
                };
                if let Err(e) = tpl.set_partition_offset(topic, *partition, offset) {
                    error!(topic, partition, error = %e, "cannot set start offset");
                }
                info!(group = %self.spec.group, topic, partition, epoch, start = ?start, "partition taken over");
            }
            self.stats.assigned_partitions.store(owned.len(), Ordering::Relaxed);
            self.stats.halted_partitions.store(halted.len(), Ordering::Relaxed);
            let mut next_offsets = lock(&self.stats.next_offsets);
            for ((topic, partition), _, start) in &acquired {
                if let StartAt::Offset(next) = start {
                    next_offsets.insert((topic.clone(), *partition), *next);
                }
            }
        }
        self.stats.joined.store(true, std::sync::atomic::Ordering::Release);
        let assigned = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_assign(tpl),
            _ => consumer.assign(tpl),
        };
        if let Err(e) = assigned {
            error!(group = %self.spec.group, error = %e, "assign failed");
        }
    }

    /// The partition's high watermark; None when the broker does not say in time
    /// (the check is then skipped, as before it existed).
    fn log_end(&self, consumer: &BaseConsumer<Self>, topic: &str, partition: i32) -> Option<i64> {
        match consumer.fetch_watermarks(topic, partition, Duration::from_secs(5)) {
            Ok((_, high)) => Some(high),
            Err(e) => {
                warn!(group = %self.spec.group, topic, partition, error = %e, "cannot read the log end to check the stored progress");
                None
            }
        }
    }

    fn on_revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        {
            let mut owned = lock(&self.owned);
            let mut halted = lock(&self.halted);
            for element in tpl.elements() {
                owned.remove(&(element.topic().to_owned(), element.partition()));
                halted.remove(&(element.topic().to_owned(), element.partition()));
            }
            self.stats.halted_partitions.store(halted.len(), Ordering::Relaxed);
            self.stats.assigned_partitions.store(owned.len(), Ordering::Relaxed);
        }
        // Let the batch in flight finish (it may include revoked partitions; it is
        // still fenced by epoch if it outlives the grace period).
        let drained =
            self.runtime.block_on(async { tokio::time::timeout(self.grace, self.in_flight.lock()).await.is_ok() });
        if !drained {
            warn!(group = %self.spec.group, "batch still in flight at revocation; its epoch check decides");
        }
        info!(group = %self.spec.group, partitions = tpl.count(), "partitions given up");
        let _ = match consumer.rebalance_protocol() {
            RebalanceProtocol::Cooperative => consumer.incremental_unassign(tpl),
            _ => consumer.unassign(),
        };
    }

    fn forget_all(&self) {
        lock(&self.owned).clear();
        lock(&self.halted).clear();
        self.stats.assigned_partitions.store(0, Ordering::Relaxed);
        self.stats.joined.store(false, std::sync::atomic::Ordering::Release);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the map leaves it consistent (single inserts/removes).
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Bumps the epoch of every partition in one transaction, in a fixed order.
async fn acquire(
    pool: &PgPool,
    spec: &ConsumerSpec,
    partitions: &[(String, i32)],
) -> Result<Vec<((String, i32), i64, StartAt)>, sqlx::Error> {
    let mut sorted = partitions.to_vec();
    sorted.sort();
    let mut tx = pool.begin().await?;
    let mut out = Vec::with_capacity(sorted.len());
    for (topic, partition) in sorted {
        let (epoch, next_offset): (i64, Option<i64>) = sqlx::query_as(
            "INSERT INTO consumer_partitions (consumer_group, topic, partition, epoch, next_offset, owner) \
             VALUES ($1, $2, $3, 1, NULL, $4) \
             ON CONFLICT (consumer_group, topic, partition) DO UPDATE \
             SET epoch = consumer_partitions.epoch + 1, owner = EXCLUDED.owner, updated_at = now() \
             RETURNING epoch, next_offset",
        )
        .bind(&spec.group)
        .bind(&topic)
        .bind(partition)
        .bind(&spec.instance)
        .fetch_one(&mut *tx)
        .await?;
        out.push(((topic, partition), epoch, start_at(next_offset)));
    }
    tx.commit().await?;
    Ok(out)
}

/// The consumer: a polling thread and a batch processor.
#[derive(Debug)]
pub struct FencedConsumer;

impl FencedConsumer {
    /// Subscribes and starts handling; runs until `shutdown` is cancelled. Must be
    /// called from within a tokio runtime.
    pub fn spawn<H: Handler>(
        spec: ConsumerSpec,
        kafka: &KafkaConfig,
        config: &ConsumerConfig,
        pool: PgPool,
        outbox: OutboxWriter,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<ConsumerHandle, Error> {
        let stats = Arc::new(ConsumerStats::default());
        let owned: Ownership = Arc::default();
        let in_flight = Arc::new(tokio::sync::Mutex::new(()));
        let context = FencedContext {
            runtime: Handle::current(),
            pool: pool.clone(),
            spec: spec.clone(),
            owned: owned.clone(),
            in_flight: in_flight.clone(),
            stats: stats.clone(),
            grace: spec.drain_grace,
            shutdown: shutdown.clone(),
            assignment_changes: AtomicU64::new(0),
            halted: Mutex::default(),
            errors: crate::kafka::ErrorLog::default(),
        };
        let consumer: Arc<BaseConsumer<FencedContext>> = Arc::new(
            crate::kafka::consumer_config(kafka, &spec.instance, &spec.group)
                .set("statistics.interval.ms", STATISTICS_INTERVAL_MS)
                .create_with_context(context)?,
        );
        let topic_refs: Vec<&str> = spec.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topic_refs)?;

        // Room for a few batches: enough to keep the processor busy, small enough
        // that a revoked partition's queued records are few.
        let (tx, rx) = mpsc::channel::<Fetched>(config.batch_max.saturating_mul(2).max(16));
        let poller = {
            let consumer = consumer.clone();
            let shutdown = shutdown.clone();
            let group = spec.group.clone();
            let owned = owned.clone();
            std::thread::Builder::new()
                .name(format!("poll-{group}"))
                .spawn(move || poll_loop(&consumer, &owned, &tx, &shutdown, &group))
                .map_err(|e| Error::Kafka(KafkaError::Subscription(e.to_string())))?
        };
        let processor = Processor {
            consumer,
            pool,
            outbox,
            handler,
            spec,
            owned,
            in_flight,
            stats: stats.clone(),
            batch_max: config.batch_max.max(1),
            batch_wait: config.batch_wait(),
            dedup_retention_hours: config.dedup_retention_hours.max(1),
        };
        let span = info_span!("consumer", group = %processor.spec.group);
        let processor = tokio::spawn(processor.run(rx, shutdown).instrument(span));
        Ok(ConsumerHandle { stats, processor, poller })
    }
}

/// Polls without ever blocking on the processor: when its queue is full the
/// assigned partitions are paused (and resumed once there is room), so rebalance
/// callbacks and group membership are served however slow a batch is.
///
/// The wanted state is applied to the whole assignment again whenever the
/// assignment changes: librdkafka keeps an application's pause on a partition
/// across its revocation and reassignment (only its own pause is reset), so a
/// partition paused, revoked and assigned back would otherwise never be fetched
/// again.
fn poll_loop(
    consumer: &BaseConsumer<FencedContext>,
    owned: &Ownership,
    tx: &mpsc::Sender<Fetched>,
    shutdown: &CancellationToken,
    group: &str,
) {
    let mut pending: VecDeque<Fetched> = VecDeque::new();
    // The pause state last applied, and to which assignment (by its change count).
    let mut applied: Option<(bool, u64)> = None;
    while !shutdown.is_cancelled() {
        while let Some(message) = pending.pop_front() {
            match tx.try_send(message) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(message)) => {
                    pending.push_front(message);
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
        let wanted = (!pending.is_empty(), consumer.context().assignment_changes.load(Ordering::Relaxed));
        if applied != Some(wanted)
            && let Ok(assignment) = consumer.assignment()
        {
            let result = if wanted.0 {
                consumer.pause(&assignment)
            } else {
                consumer.resume(&assignment).and_then(|()| {
                    // Halted partitions stay paused whatever the queue does.
                    let mut halted = TopicPartitionList::new();
                    for (topic, partition) in lock(&consumer.context().halted).iter() {
                        halted.add_partition(topic, *partition);
                    }
                    if halted.count() > 0 { consumer.pause(&halted) } else { Ok(()) }
                })
            };
            match result {
                Ok(()) => applied = Some(wanted),
                Err(e) => debug!(group, error = %e, "pause/resume failed"),
            }
        }
        let wait = if pending.is_empty() { Duration::from_millis(100) } else { Duration::from_millis(10) };
        match consumer.poll(wait) {
            None => {}
            Some(Ok(message)) => {
                // Rebalance callbacks run inside poll, so the holding is current here.
                let held = lock(owned).get(&(message.topic().to_owned(), message.partition())).copied();
                match held {
                    Some(epoch) => pending.push_back(Fetched { epoch, message: message.detach() }),
                    None => debug!(
                        group,
                        topic = message.topic(),
                        partition = message.partition(),
                        "record of a partition not held dropped"
                    ),
                }
            }
            // The same error keeps coming while the brokers are down: logged once
            // in a while with the client's own, not on every poll.
            Some(Err(e)) => consumer.context().errors.report(group, &e, "from poll"),
        }
    }
    // Leave the group cleanly: the revoke callback drains the last batch.
    consumer.unsubscribe();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < deadline && !consumer.assignment().map(|a| a.count() == 0).unwrap_or(true) {
        let _ = consumer.poll(Duration::from_millis(50));
    }
    debug!(group, "poll loop stopped");
}

struct Processor<H> {
    consumer: Arc<BaseConsumer<FencedContext>>,
    pool: PgPool,
    outbox: OutboxWriter,
    handler: H,
    spec: ConsumerSpec,
    owned: Ownership,
    in_flight: Arc<tokio::sync::Mutex<()>>,
    stats: Arc<ConsumerStats>,
    batch_max: usize,
    batch_wait: Duration,
    dedup_retention_hours: u32,
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
    async fn run(self, mut rx: mpsc::Receiver<Fetched>, shutdown: CancellationToken) {
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
            let guard = self.in_flight.lock().await;
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
            .bind(&self.spec.group)
            .bind(self.dedup_retention_hours as i32)
            .execute(&self.pool)
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
            let owned = lock(&self.owned).clone();
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
                    self.stats.applied.fetch_add(applied.handled, Ordering::Relaxed);
                    {
                        let mut next_offsets = lock(&self.stats.next_offsets);
                        for (topic, partition, last) in &applied.progress {
                            next_offsets.insert((topic.clone(), *partition), last + 1);
                        }
                    }
                    for (topic, partition, last) in applied.progress {
                        if let Err(e) = self.consumer.store_offset(&topic, partition, last) {
                            debug!(topic, partition, error = %e, "offset not stored (partition given up?)");
                        }
                    }
                    self.stats.batches.fetch_add(1, Ordering::Relaxed);
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
        let mut tx = self.pool.begin().await?;
        let mut applied = Applied::default();
        for ((topic, partition), messages) in by_partition {
            let Some(&my_epoch) = owned.get(&(topic.clone(), partition)) else { continue };
            let stored: Option<(i64, Option<i64>)> = sqlx::query_as(
                "SELECT epoch, next_offset FROM consumer_partitions \
                 WHERE consumer_group = $1 AND topic = $2 AND partition = $3 FOR UPDATE",
            )
            .bind(&self.spec.group)
            .bind(&topic)
            .bind(partition)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((epoch, next_offset)) = stored else {
                warn!(topic, partition, "no progress row for an owned partition; skipping its records");
                continue;
            };
            let stored = StoredProgress { epoch, next_offset: next_offset.unwrap_or(0) };
            let offsets: Vec<i64> = messages.iter().map(|m| m.offset()).collect();
            match plan_batch(stored, my_epoch, &offsets) {
                BatchPlan::Fenced { mine, current } => {
                    self.stats.fenced_batches.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        topic,
                        partition,
                        my_epoch = mine,
                        current_epoch = current,
                        "write rejected: partition fenced, another instance took it over; dropping its records"
                    );
                    forget_fenced_holding(&mut lock(&self.owned), (topic.clone(), partition), mine);
                }
                BatchPlan::Apply { apply, redelivered, next_offset } => {
                    self.stats.redelivered.fetch_add(redelivered as u64, Ordering::Relaxed);
                    if redelivered > 0 {
                        info!(topic, partition, redelivered, "records redelivered after a restart skipped by offset");
                    }
                    let to_apply: Vec<&OwnedMessage> = apply.iter().map(|&i| messages[i]).collect();
                    applied.handled +=
                        self.apply_records(&mut tx, &topic, partition, &to_apply, condemned, savepoints).await?;
                    if !to_apply.is_empty() {
                        sqlx::query(
                            "UPDATE consumer_partitions SET next_offset = $5, updated_at = now() \
                             WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND epoch = $4",
                        )
                        .bind(&self.spec.group)
                        .bind(&topic)
                        .bind(partition)
                        .bind(my_epoch)
                        .bind(next_offset)
                        .execute(&mut *tx)
                        .await?;
                        applied.progress.push((topic, partition, next_offset - 1));
                    }
                }
            }
        }
        if !savepoints {
            match self.handler.flush(&mut tx, &self.outbox).await {
                Ok(()) => {}
                Err(e) if matches!(e, HandleError::Poison(_)) || e.refusal_of_the_record().is_some() => {
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
                self.stats.tombstones.fetch_add(1, Ordering::Relaxed);
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
            .bind(&self.spec.group)
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
                self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
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
            if let Some(condemned) = condemned.filter(|c| c.at == (topic.to_owned(), partition, inbound.offset)) {
                self.dead_letter(tx, message, &condemned.reason).await?;
                continue;
            }
            if !savepoints {
                match self.handler.handle(tx, &self.outbox, &inbound).instrument(span.clone()).await {
                    Ok(()) => {
                        handled += 1;
                        span.in_scope(|| debug!("event handled; it commits with its batch"));
                    }
                    Err(e) if matches!(e, HandleError::Poison(_)) || e.refusal_of_the_record().is_some() => {
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
            match handled_here {
                Ok(()) => {
                    savepoint.commit().await?;
                    handled += 1;
                    // With the span's task and trace: at debug, a line per event.
                    span.in_scope(|| debug!("event handled; it commits with its batch"));
                }
                Err(HandleError::Poison(reason)) => {
                    savepoint.rollback().await?;
                    self.handler.discard();
                    self.dead_letter(tx, message, &reason).await?;
                }
                Err(other) => match other.refusal_of_the_record() {
                    Some(reason) => {
                        savepoint.rollback().await?;
                        self.handler.discard();
                        self.dead_letter(tx, message, &reason).await?;
                    }
                    None => return Err(other.into()),
                },
            }
        }
        Ok(handled)
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
            consumer_group: &self.spec.group,
            topic: message.topic(),
            partition: message.partition(),
            offset: message.offset(),
            reason,
            key: message.key(),
            value: message.payload(),
            headers,
        };
        self.handler.reject(tx, &self.outbox, &rejected).await?;
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use fenceline_domain::ids::TaskId;
    use fenceline_events::{CancelRequested, Envelope, Event, Timestamp, encode_record};

    use super::*;

    #[test]
    fn a_fenced_batch_forgets_only_the_holding_it_was_fenced_under() {
        let partition = ("fenceline.attempts".to_owned(), 2);
        let mut owned = HashMap::from([(partition.clone(), 7)]);
        // The partition came back under epoch 7 while a batch fetched under epoch 5
        // was being fenced: the new holding stays.
        forget_fenced_holding(&mut owned, partition.clone(), 5);
        assert_eq!(owned.get(&partition), Some(&7), "a partition held again is not dropped");
        forget_fenced_holding(&mut owned, partition.clone(), 7);
        assert!(owned.is_empty(), "the holding the batch was fenced under is forgotten");
    }

    /// A record as a producer with a newer `CancelRequested` schema writes it: the
    /// same bytes under a fingerprint this build does not know, named in the headers.
    fn newer_record(header_says_newer: bool) -> (Vec<u8>, Vec<(&'static str, String)>) {
        let event = Event::CancelRequested(CancelRequested {
            task_id: TaskId::new_v7(),
            tenant: "acme".into(),
            requested_by: "tenant:acme".into(),
            requested_at: Timestamp(1),
        });
        let (mut value, mut headers) = encode_record(&event, "intake").expect("encode");
        value[2..10].copy_from_slice(&[0xAB; 8]);
        if header_says_newer {
            headers.schema_fingerprint = "abababababababab".into();
        }
        (value, headers.to_pairs())
    }

    fn decoded(value: &[u8], pairs: &[(&'static str, String)]) -> fenceline_events::DecodeError {
        let headers = pairs.iter().map(|(k, v)| (*k, Some(v.as_bytes())));
        Envelope::decode(headers, value).expect_err("not readable by this build")
    }

    #[test]
    fn a_record_from_a_newer_producer_is_held_and_retried_never_dead_lettered() {
        let (value, pairs) = newer_record(true);
        let e = decoded(&value, &pairs);
        let held = undecodable(&e, true).expect_err("held");
        assert!(matches!(held, HandleError::Held(_)), "{held}");
        assert!(held.passing(), "retried with backoff, never condemned as poison");
        assert!(held.to_string().contains("abababababababab"), "names the fingerprint: {held}");
        assert!(held.to_string().contains("CancelRequested"), "{held}");
    }

    #[test]
    fn a_front_door_and_a_record_whose_headers_disagree_still_reject() {
        let (value, pairs) = newer_record(true);
        let reason = undecodable(&decoded(&value, &pairs), false).expect("rejected by a front door");
        assert!(reason.contains("abababababababab"), "{reason}");
        // The headers name the known fingerprint, the value another: a broken record.
        let (value, pairs) = newer_record(false);
        let reason = undecodable(&decoded(&value, &pairs), true).expect("rejected");
        assert_eq!(reason, "unknown schema fingerprint abababababababab");
    }
}
