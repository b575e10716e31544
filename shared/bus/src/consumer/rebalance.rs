//! The client context: partitions taken over under a new epoch on assignment, drained on revocation.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fenceline_domain::progress::{StartAt, start_at};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{ConsumerSpec, ConsumerStats, Ownership};

pub(super) struct FencedContext {
    pub(super) runtime: Handle,
    pub(super) pool: PgPool,
    pub(super) spec: ConsumerSpec,
    pub(super) owned: Ownership,
    /// Held by the processor for the duration of a batch; the revoke callback takes
    /// it to wait for the in-flight batch.
    pub(super) in_flight: Arc<tokio::sync::Mutex<()>>,
    pub(super) stats: Arc<ConsumerStats>,
    pub(super) grace: Duration,
    pub(super) shutdown: CancellationToken,
    /// Grows with every rebalance callback; the poll loop re-applies its pause state
    /// when it changed, without asking for the assignment on every poll.
    pub(super) assignment_changes: AtomicU64,
    /// Partitions assigned here whose stored progress lies beyond the end of the
    /// log: kept paused and not handled until an operator looks (docs/bus.md).
    pub(super) halted: Mutex<HashSet<(String, i32)>>,
    /// The client's errors, each kind logged at most once per period.
    pub(super) errors: crate::kafka::ErrorLog,
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

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
