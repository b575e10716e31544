//! The stall watch: finds partitions of a consumer's topics that no instance of its
//! group has advanced for a while although records wait on them, and asks the
//! consumer to rejoin its group, which makes the coordinator assign every partition
//! again.
//!
//! A partition can be left without a consumer when the group coordinator keeps an
//! assignment for a member that is gone (seen with the local broker after a member
//! was killed mid-rebalance: docs/broker.md). The database, which holds each
//! partition's progress, is where that shows: records beyond `next_offset` and no
//! progress for longer than a healthy instance ever takes.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Whether this instance holds a partition now.
pub type Held = Arc<dyn Fn(&(String, i32)) -> bool + Send + Sync>;

/// A partition that waits for a consumer: its stored progress, the broker's high
/// watermark, and how long the progress has not moved.
#[derive(Debug, Clone, PartialEq)]
pub struct Stalled {
    pub topic: String,
    pub partition: i32,
    pub next_offset: i64,
    pub high_watermark: i64,
    pub idle: Duration,
}

/// Which partitions not held by this instance have waited longer than `after`:
/// held by another instance that stopped advancing them, or by none (an assignment
/// to a member that is gone). A partition this instance holds is left out: a
/// rejoin does not make its own fetching faster, and on an overloaded broker it
/// only adds a rebalance. `progress` is (next offset, time since it last moved) per
/// partition that has a stored progress; `watermarks` is (low, high) per partition;
/// `up_for` is how long this instance has been watching (the idle time of a
/// partition never consumed).
pub fn stalled(
    watermarks: &HashMap<(String, i32), (i64, i64)>,
    progress: &HashMap<(String, i32), (Option<i64>, Duration)>,
    held: &dyn Fn(&(String, i32)) -> bool,
    up_for: Duration,
    after: Duration,
) -> Vec<Stalled> {
    let mut out: Vec<Stalled> = watermarks
        .iter()
        .filter(|(key, _)| !held(key))
        .filter_map(|((topic, partition), &(low, high))| {
            let (next, idle) = match progress.get(&(topic.clone(), *partition)) {
                Some((next, idle)) => (next.unwrap_or(low).max(low), *idle),
                None => (low, up_for),
            };
            (high > next && idle > after).then(|| Stalled {
                topic: topic.clone(),
                partition: *partition,
                next_offset: next,
                high_watermark: high,
                idle,
            })
        })
        .collect();
    out.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
    out
}

/// Watches the group's partitions every third of `after` and sets `rejoin` when one
/// has stalled. After asking it waits before it asks again — `after`, then twice as
/// long each time up to eight times, until a look finds nothing stalled — so that on
/// a broker too busy to keep its group together the watch does not add a storm of
/// rebalances.
#[allow(clippy::too_many_arguments)] // the consumer's parts, each needed once
pub async fn watch<C: ConsumerContext + 'static>(
    consumer: Arc<BaseConsumer<C>>,
    pool: PgPool,
    group: String,
    topics: Vec<String>,
    held: Held,
    after: Duration,
    rejoin: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    let started = Instant::now();
    let mut every = tokio::time::interval((after / 3).max(Duration::from_secs(1)));
    let mut asked: Option<Instant> = None;
    let mut pause = after;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        if started.elapsed() < after || asked.is_some_and(|at| at.elapsed() < pause) {
            continue;
        }
        match look(&consumer, &pool, &group, &topics, held.as_ref(), started.elapsed(), after).await {
            Ok(stalled) if !stalled.is_empty() => {
                for s in &stalled {
                    warn!(
                        group,
                        topic = s.topic,
                        partition = s.partition,
                        next_offset = s.next_offset,
                        high_watermark = s.high_watermark,
                        idle_s = s.idle.as_secs(),
                        "partition stalled: records wait and no instance advanced it; rejoining the group"
                    );
                }
                rejoin.store(true, Ordering::SeqCst);
                if asked.is_some() {
                    pause = (pause * 2).min(after * 8);
                }
                asked = Some(Instant::now());
            }
            Ok(_) => {
                asked = None;
                pause = after;
            }
            Err(e) => debug!(group, error = %e, "stall watch could not look"),
        }
    }
}

async fn look<C: ConsumerContext + 'static>(
    consumer: &Arc<BaseConsumer<C>>,
    pool: &PgPool,
    group: &str,
    topics: &[String],
    held: &(dyn Fn(&(String, i32)) -> bool + Send + Sync),
    up_for: Duration,
    after: Duration,
) -> Result<Vec<Stalled>, crate::Error> {
    let rows: Vec<(String, i32, Option<i64>, f64)> = sqlx::query_as(
        "SELECT topic, partition, next_offset, extract(epoch FROM now() - updated_at)::float8 \
         FROM consumer_partitions WHERE consumer_group = $1",
    )
    .bind(group)
    .fetch_all(pool)
    .await?;
    let progress: HashMap<(String, i32), (Option<i64>, Duration)> = rows
        .into_iter()
        .map(|(topic, partition, next, idle)| ((topic, partition), (next, Duration::from_secs_f64(idle.max(0.0)))))
        .collect();
    let consumer = consumer.clone();
    let topics = topics.to_vec();
    let watermarks = tokio::task::spawn_blocking(move || -> Result<_, rdkafka::error::KafkaError> {
        let timeout = Duration::from_secs(5);
        let mut out = HashMap::new();
        for topic in &topics {
            let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
            for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
                let marks = consumer.fetch_watermarks(topic, partition.id(), timeout)?;
                out.insert((topic.clone(), partition.id()), marks);
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| crate::Error::Kafka(rdkafka::error::KafkaError::Subscription(e.to_string())))??;
    Ok(stalled(&watermarks, &progress, held, up_for, after))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(partition: i32) -> (String, i32) {
        ("t".to_owned(), partition)
    }

    #[test]
    fn only_a_partition_not_held_here_with_records_waiting_too_long_has_stalled() {
        let after = Duration::from_secs(30);
        let watermarks: HashMap<_, _> =
            [(key(0), (0, 10)), (key(1), (0, 10)), (key(2), (0, 10)), (key(3), (0, 10)), (key(4), (0, 0))].into();
        let progress: HashMap<_, _> = [
            (key(0), (Some(4), Duration::from_secs(60))),  // held by this instance
            (key(1), (Some(4), Duration::from_secs(60))),  // waits: stalled
            (key(2), (Some(10), Duration::from_secs(60))), // nothing waits
            (key(3), (Some(4), Duration::from_secs(5))),   // another instance is at it
        ]
        .into();
        let held = |k: &(String, i32)| k.1 == 0;
        let found = stalled(&watermarks, &progress, &held, Duration::from_secs(120), after);
        assert_eq!(found.iter().map(|s| s.partition).collect::<Vec<_>>(), [1]);
        assert_eq!((found[0].next_offset, found[0].high_watermark), (4, 10));
        // A partition nobody ever consumed waits as long as the watch has been up.
        let mut never: HashMap<_, _> = watermarks.clone();
        never.insert(key(5), (0, 3));
        let found = stalled(&never, &progress, &held, Duration::from_secs(10), after);
        assert_eq!(found.iter().map(|s| s.partition).collect::<Vec<_>>(), [1]);
        let found = stalled(&never, &progress, &held, Duration::from_secs(45), after);
        assert_eq!(found.iter().map(|s| s.partition).collect::<Vec<_>>(), [1, 5]);
        // Records compacted away below the stored progress do not count as waiting.
        let compacted: HashMap<_, _> = [(key(1), (12, 12))].into();
        assert!(stalled(&compacted, &progress, &|_| false, Duration::from_secs(120), after).is_empty());
    }
}
