//! The polling thread: fetches records for the processor and pauses partitions when it is behind.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::rebalance::{FencedContext, lock};
use super::{Fetched, Ownership};

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
