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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fenceline_config::{ConsumerConfig, KafkaConfig};
use fenceline_events::{Envelope, Event};
use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use sqlx::{PgConnection, PgPool};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};

use crate::{Error, OutboxWriter};

mod dead_letters;
mod poll;
mod processor;
mod rebalance;

pub use dead_letters::{Rejected, dead_letter};
use poll::{poll_loop, subscribe_once_known};
use processor::Processor;
use rebalance::{FencedContext, STATISTICS_INTERVAL_MS, lock};

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
    /// The batch cannot be applied as a whole, only one event at a time, each in a
    /// savepoint of its own (a handler that gathered work for the batch's end met
    /// what only the event-by-event path handles): it is rolled back and applied
    /// again so; nothing is dead-lettered for it.
    #[error("one at a time: {0}")]
    OneAtATime(String),
    #[error(transparent)]
    Bus(#[from] Error),
}

impl HandleError {
    /// An error of the record itself, which the same record will meet on every try:
    /// the database refused its data (SQLSTATE class 22) or a constraint (class 23).
    fn refusal_of_the_record(&self) -> Option<String> {
        let HandleError::Transient(sqlx::Error::Database(db)) = self else { return None };
        let code = db.code()?;
        blames_the_data(&code)
            .then(|| format!("the database refused the change this record asks for (SQLSTATE {code}): {db}"))
    }

    /// Whether a retry may succeed without anything about the record changing.
    /// Every database condition is passing except the two that blame the record's
    /// own data (SQLSTATE classes 22 and 23): a read-only or demoted server (25),
    /// a deadlock or serialisation failure (40), an administrator's shutdown (57),
    /// a lost connection (08), a server short of resources (53), a lock or a
    /// privilege (55, 42) say nothing about the record, whether the handler met
    /// them or the outbox append inside it did. Anything that is not passing and
    /// fails again and again is blamed on the record (after [`POISON_AFTER`] tries).
    fn passing(&self) -> bool {
        let database = match self {
            HandleError::Transient(e) | HandleError::Bus(Error::Database(e)) => e,
            HandleError::Held(_)
            | HandleError::OneAtATime(_)
            | HandleError::Bus(Error::Kafka(_))
            | HandleError::Bus(Error::Injected(_)) => {
                return true;
            }
            HandleError::Bus(_) | HandleError::Poison(_) => return false,
        };
        match database {
            sqlx::Error::Database(db) => !db.code().is_some_and(|c| blames_the_data(&c)),
            _ => true,
        }
    }
}

/// Whether a SQLSTATE blames the data a statement carried: a data exception (22)
/// or an integrity constraint (23). The same record meets it on every try.
fn blames_the_data(code: &str) -> bool {
    code.starts_with("22") || code.starts_with("23")
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

    /// Called once per batch applied without savepoints, in its transaction, before
    /// its first record, with the record keys of the partitions it applies (some of
    /// whose records may then turn out to be copies or not the handler's): a handler
    /// that locks one row per key can lock the batch's rows with one statement instead
    /// of one per record. What it takes belongs to the batch, like what it gathers
    /// ([`Handler::discard`]). The default does nothing.
    fn prepare(&self, tx: &mut PgConnection, keys: &[&[u8]]) -> impl Future<Output = Result<(), HandleError>> + Send {
        let _ = (tx, keys);
        async { Ok(()) }
    }

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

/// The consumer: a polling thread and a batch processor.
#[derive(Debug)]
pub struct FencedConsumer;

impl FencedConsumer {
    /// Starts handling; runs until `shutdown` is cancelled. The polling thread
    /// subscribes once the broker knows every topic. Must be called from within a
    /// tokio runtime.
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
        let context = FencedContext {
            runtime: Handle::current(),
            pool,
            spec: spec.clone(),
            owned: owned.clone(),
            in_flight: Arc::new(tokio::sync::Mutex::new(())),
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

        // Room for a few batches: enough to keep the processor busy, small enough
        // that a revoked partition's queued records are few.
        let (tx, rx) = mpsc::channel::<Fetched>(config.batch_max.saturating_mul(2).max(16));
        let poller = {
            let consumer = consumer.clone();
            let shutdown = shutdown.clone();
            let group = spec.group.clone();
            let owned = owned.clone();
            let topics = spec.topics.clone();
            std::thread::Builder::new()
                .name(format!("poll-{group}"))
                .spawn(move || {
                    if subscribe_once_known(&consumer, &topics, &shutdown, &group) {
                        poll_loop(&consumer, &owned, &tx, &shutdown, &group);
                    }
                })
                .map_err(|e| Error::Kafka(KafkaError::Subscription(e.to_string())))?
        };
        let processor = Processor {
            consumer,
            outbox,
            handler,
            batch_max: config.batch_max.max(1),
            batch_wait: config.batch_wait(),
            dedup_retention_hours: config.dedup_retention_hours.max(1),
        };
        let span = info_span!("consumer", group = %spec.group);
        let processor = tokio::spawn(processor.run(rx, shutdown).instrument(span));
        Ok(ConsumerHandle { stats, processor, poller })
    }
}

#[cfg(test)]
mod tests {
    use super::dead_letters::undecodable;
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
