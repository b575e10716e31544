//! The executor's one consumer of what the scheduler publishes: grants and
//! cancellations from `fenceline.dispatch`, final states from `fenceline.status`.

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_events::{Event, topics};
use sqlx::PgConnection;

use crate::grants::GrantRecorder;
use crate::retention::StatusProjection;

/// Everything the executor hears, in one consumer group (`executor.from_scheduler`;
/// docs/decisions.md, entry 59): the grants it records for its workers, and the
/// final states its retention reads. Two groups applied them in two transactions
/// per batch, with a Kafka consumer each; in one, a batch's grants and final
/// states are one commit.
#[derive(Debug)]
pub struct FromScheduler {
    pub grants: GrantRecorder,
    pub finals: StatusProjection,
}

impl Handler for FromScheduler {
    /// A granted task waits for its claim, which follows this consumer's batch.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn handle(&self, tx: &mut PgConnection, outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        match (&record.envelope.event, record.topic.ends_with(topics::STATUS)) {
            (Event::TaskStatus(_), true) => self.finals.handle(tx, outbox, record).await,
            (event, true) => {
                Err(HandleError::Poison(format!("{} does not belong on the status topic", event.event_type())))
            }
            // The grant recorder refuses what does not belong on the dispatch topic.
            (_, false) => self.grants.handle(tx, outbox, record).await,
        }
    }

    /// The grants first: the workers wait for them; the final states only let a
    /// purge run later.
    async fn flush(&self, tx: &mut PgConnection, outbox: &OutboxWriter) -> Result<(), HandleError> {
        self.grants.flush(tx, outbox).await?;
        self.finals.flush(tx, outbox).await
    }

    fn discard(&self) {
        self.grants.discard();
        self.finals.discard();
    }

    fn committed(&self) {
        self.grants.committed();
        self.finals.committed();
    }

    /// As each part says: a grant is kept by its id, a snapshot writes only when
    /// newer; a cancellation is remembered.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        match event {
            Event::TaskStatus(_) => self.finals.applies_twice_harmlessly(event),
            _ => self.grants.applies_twice_harmlessly(event),
        }
    }
}

#[cfg(test)]
mod tests;
