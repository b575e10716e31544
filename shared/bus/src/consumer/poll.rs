//! The polling thread: fetches records for the processor and pauses partitions when it is behind.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::rebalance::{FencedContext, lock};
use super::{Fetched, Ownership};

/// How often a consumer whose topics are not all known yet asks again.
const TOPICS_ASKED_EVERY: Duration = Duration::from_millis(200);

/// How often it says which topics it still waits for.
const TOPICS_WAITED_FOR_LOGGED_EVERY: Duration = Duration::from_secs(10);

/// Subscribes once the broker's metadata names every topic of the subscription
/// with its partitions; `false` when `shutdown` came first or the subscription
/// failed. A group joined while one of several topics is still unknown (created a
/// moment before, and not yet in the broker's metadata) is assigned the others
/// only, and the client looks again only at its periodic metadata refresh,
/// minutes later: the missing topic's records would wait that long
/// (docs/decisions.md, entry 62).
pub(super) fn subscribe_once_known(
    consumer: &BaseConsumer<FencedContext>,
    topics: &[String],
    shutdown: &CancellationToken,
    group: &str,
) -> bool {
    let started = std::time::Instant::now();
    let mut logged = started;
    loop {
        let missing: Vec<&str> = topics.iter().map(String::as_str).filter(|t| !known(consumer, t)).collect();
        if missing.is_empty() {
            break;
        }
        if shutdown.is_cancelled() {
            return false;
        }
        if logged.elapsed() >= TOPICS_WAITED_FOR_LOGGED_EVERY {
            logged = std::time::Instant::now();
            warn!(
                group,
                ?missing,
                waited_s = started.elapsed().as_secs(),
                "the broker does not name these topics yet, or cannot be reached; the consumer joins its \
                 group once it names them all (create them: docs/broker.md)"
            );
        }
        std::thread::sleep(TOPICS_ASKED_EVERY);
    }
    if started.elapsed() >= TOPICS_ASKED_EVERY {
        info!(group, waited_ms = started.elapsed().as_millis() as u64, "every topic known; joining the group");
    }
    let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
    match consumer.subscribe(&refs) {
        Ok(()) => true,
        Err(e) => {
            error!(group, error = %e, "cannot subscribe; this consumer reads nothing");
            false
        }
    }
}

/// Whether the broker's metadata names `topic` with at least one partition.
fn known(consumer: &BaseConsumer<FencedContext>, topic: &str) -> bool {
    consumer.fetch_metadata(Some(topic), Duration::from_secs(1)).is_ok_and(|metadata| {
        metadata.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
    })
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
pub(super) fn poll_loop(
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
