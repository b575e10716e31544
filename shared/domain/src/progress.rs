//! What a fenced consumer does with a batch of records of one partition, given the
//! progress the database holds for that partition (docs/architecture.md, "The fenced consumer").

use std::time::Duration;

/// The database's view of one partition, read under a row lock in the batch's
/// transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredProgress {
    /// Bumped by every instance that takes the partition over.
    pub epoch: i64,
    /// Offset of the next record not yet applied.
    pub next_offset: i64,
}

/// What to do with one partition's records in this batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchPlan {
    /// Another instance took the partition over (its epoch is newer than ours):
    /// write nothing, stop handling the partition.
    Fenced { mine: i64, current: i64 },
    /// Apply the records at these positions of the batch (in order), skip the rest
    /// as redelivered, and store `next_offset` as the new progress.
    Apply { apply: Vec<usize>, redelivered: usize, next_offset: i64 },
}

/// Decides what a batch may change. `offsets` are the batch's record offsets of one
/// partition, in the order the broker delivered them; records below the stored
/// `next_offset` were applied before (a redelivery after a crash or a rebalance).
///
/// Must stay true: progress never moves backwards, and a record is applied only by
/// the holder of the partition's current epoch.
pub fn plan_batch(stored: StoredProgress, my_epoch: i64, offsets: &[i64]) -> BatchPlan {
    if stored.epoch != my_epoch {
        return BatchPlan::Fenced { mine: my_epoch, current: stored.epoch };
    }
    let mut next_offset = stored.next_offset;
    let mut apply = Vec::with_capacity(offsets.len());
    let mut redelivered = 0;
    for (position, &offset) in offsets.iter().enumerate() {
        if offset >= next_offset {
            apply.push(position);
            next_offset = offset + 1;
        } else {
            redelivered += 1;
        }
    }
    BatchPlan::Apply { apply, redelivered, next_offset }
}

/// Where a consumer that was just assigned a partition starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// The partition was never handled by this consumer group: from the beginning,
    /// so nothing already on the topic is skipped.
    Beginning,
    /// The stored progress, whatever the broker's committed offset says.
    Offset(i64),
}

/// The database, not the broker, is the authority on progress.
pub fn start_at(stored_next_offset: Option<i64>) -> StartAt {
    match stored_next_offset {
        Some(offset) => StartAt::Offset(offset),
        None => StartAt::Beginning,
    }
}

/// How long a batch waits for more records once its first one is here.
///
/// A batch is one transaction, so waiting lets several records share a commit, but
/// it adds the wait to every record's way. A consumer nothing waits for always
/// waits. On a task's way the wait pays only when the consumer is behind: then the
/// first record has already waited at least as long as the wait
/// (`first_record_age`, from its timestamp to now), more are on their way, and the
/// wait adds at most as much again as the record's queueing. A fresh record on a
/// consumer that keeps up is applied at once, with whatever has already arrived.
/// Without an age (no timestamp), the configured wait holds.
pub fn batch_wait(on_a_tasks_way: bool, first_record_age: Option<Duration>, configured: Duration) -> Duration {
    match first_record_age {
        Some(age) if on_a_tasks_way && age < configured => Duration::ZERO,
        _ => configured,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn stored(epoch: i64, next_offset: i64) -> StoredProgress {
        StoredProgress { epoch, next_offset }
    }

    #[test]
    fn on_a_tasks_way_a_fresh_record_waits_for_nothing_and_one_that_queued_waits_for_company() {
        let wait = Duration::from_millis(20);
        assert_eq!(batch_wait(true, Some(Duration::from_millis(3)), wait), Duration::ZERO);
        assert_eq!(batch_wait(true, Some(Duration::from_millis(19)), wait), Duration::ZERO);
        assert_eq!(batch_wait(true, Some(Duration::from_millis(20)), wait), wait);
        assert_eq!(batch_wait(true, Some(Duration::from_secs(2)), wait), wait);
        assert_eq!(batch_wait(true, None, wait), wait, "without a timestamp the configured wait holds");
        assert_eq!(batch_wait(true, Some(Duration::from_secs(2)), Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn off_a_tasks_way_every_batch_waits() {
        let wait = Duration::from_millis(20);
        assert_eq!(batch_wait(false, Some(Duration::from_millis(3)), wait), wait);
        assert_eq!(batch_wait(false, Some(Duration::from_secs(2)), wait), wait);
        assert_eq!(batch_wait(false, None, wait), wait);
    }

    #[test]
    fn a_stale_epoch_is_fenced_and_applies_nothing() {
        assert_eq!(plan_batch(stored(3, 10), 2, &[10, 11]), BatchPlan::Fenced { mine: 2, current: 3 });
    }

    #[test]
    fn redelivered_records_are_skipped() {
        assert_eq!(
            plan_batch(stored(1, 10), 1, &[8, 9, 10, 11]),
            BatchPlan::Apply { apply: vec![2, 3], redelivered: 2, next_offset: 12 }
        );
    }

    #[test]
    fn an_all_redelivered_batch_keeps_progress() {
        assert_eq!(
            plan_batch(stored(1, 10), 1, &[7, 8]),
            BatchPlan::Apply { apply: vec![], redelivered: 2, next_offset: 10 }
        );
    }

    #[test]
    fn a_gap_in_offsets_is_applied_since_compaction_leaves_gaps() {
        assert_eq!(
            plan_batch(stored(1, 10), 1, &[10, 15]),
            BatchPlan::Apply { apply: vec![0, 1], redelivered: 0, next_offset: 16 }
        );
    }

    #[test]
    fn a_fresh_partition_starts_at_the_beginning() {
        assert_eq!(start_at(None), StartAt::Beginning);
        assert_eq!(start_at(Some(42)), StartAt::Offset(42));
    }

    proptest! {
        /// However batches are cut and redelivered, every offset is applied exactly
        /// once and progress never moves backwards.
        #[test]
        fn every_offset_applies_once_under_redelivery(
            cuts in proptest::collection::vec((0i64..40, 1usize..10), 1..30)
        ) {
            let mut progress = stored(1, 0);
            let mut applied = std::collections::BTreeMap::<i64, u32>::new();
            for (rewind, len) in cuts {
                // A redelivery starts anywhere at or before the stored progress.
                let start = (progress.next_offset - rewind).max(0);
                let offsets: Vec<i64> = (start..start + len as i64).collect();
                match plan_batch(progress, 1, &offsets) {
                    BatchPlan::Apply { apply, next_offset, .. } => {
                        prop_assert!(next_offset >= progress.next_offset);
                        for position in apply {
                            *applied.entry(offsets[position]).or_default() += 1;
                        }
                        progress.next_offset = next_offset;
                    }
                    BatchPlan::Fenced { .. } => prop_assert!(false, "same epoch is never fenced"),
                }
            }
            prop_assert!(applied.values().all(|&n| n == 1));
            let expected: Vec<i64> = (0..progress.next_offset).collect();
            prop_assert_eq!(applied.keys().copied().collect::<Vec<_>>(), expected);
        }
    }
}
