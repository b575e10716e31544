//! Intake's projections: `fenceline.status` into `task_view`, the recovery
//! decisions into cases, the attempts' outcomes into their views; one batch
//! handler of the fenced consumer for the three topics.

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{AttemptOutcome, ErrorClass, RecoveryDecision};
use fenceline_events::{Event, Timestamp, topics};
use sqlx::PgConnection;

/// Intake's one consumer of what the other services decide: the status snapshots
/// of `fenceline.status` into `task_view`, the executor's reports on
/// `fenceline.attempts` into `task_attempts` and the step outputs, and the
/// `outcome_unknown` decisions of `fenceline.recovery` into cases, with a timeline
/// line per event and one change mark per task. One group for the three topics
/// (docs/decisions.md, entry 58): a task's snapshot and reports meet in one batch,
/// one commit and one mark, instead of one each in three consumers that waited on
/// each other's marks.
#[derive(Debug, Default)]
pub struct Projections {
    batch: BatchWrites,
}

impl Handler for Projections {
    /// Clients poll `task_view` for their task's state.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        Ok(self.batch.flush(tx).await?)
    }

    fn discard(&self) {
        self.batch.discard();
    }

    async fn handle(&self, tx: &mut PgConnection, _outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        match &record.envelope.event {
            Event::TaskStatus(status) => {
                self.status(status, record);
                Ok(())
            }
            event if record.topic.ends_with(topics::STATUS) => {
                Err(HandleError::Poison(format!("{} does not belong on the status topic", event.event_type())))
            }
            Event::RecoveryDecided(decided) => self.case(tx, decided, record).await,
            _ => {
                self.report(record);
                Ok(())
            }
        }
    }

    /// A snapshot sent again: the view keeps the newest version, the timeline line
    /// is keyed by the event id, and a mark only wakes the task's pages again. Every
    /// report but an attempt's end: its timeline line is keyed by the event id and
    /// an attempt keeps its earliest start. An end is remembered, as the last end
    /// heard replaces the one before; so is a recovery decision, which opens a case.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        !matches!(
            event,
            Event::AttemptSucceeded(_)
                | Event::AttemptFailed(_)
                | Event::AttemptReleased(_)
                | Event::AttemptLost(_)
                | Event::RecoveryDecided(_)
        )
    }
}

impl Projections {
    /// A status snapshot: the task's view, kept if newest in the batch.
    fn status(&self, status: &fenceline_events::TaskStatus, record: &Inbound) {
        self.batch.views.gather(status);
        self.batch.lines.gather(record);
        self.batch.marks.mark(status.task_id, Some(&status.tenant));
    }

    /// A recovery decision: on the attempt it decided about, and as a case when
    /// the outcome is unknown.
    async fn case(
        &self,
        tx: &mut PgConnection,
        decided: &fenceline_events::RecoveryDecided,
        record: &Inbound,
    ) -> Result<(), HandleError> {
        self.batch.lines.gather(record);
        self.batch.marks.mark(decided.task_id, None);
        // A decision about an attempt whose outcome was in doubt belongs on that attempt
        // (the attempt's own event may arrive later, on another topic).
        if decided.decision != RecoveryDecision::ReissueGrant {
            sqlx::query(
                "INSERT INTO task_attempts (task_id, attempt, outcome, recovery) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (task_id, attempt) DO UPDATE SET recovery = EXCLUDED.recovery",
            )
            .bind(decided.task_id.as_uuid())
            .bind(decided.attempt)
            .bind(AttemptOutcome::Lost.as_str())
            .bind(decided.decision.as_str())
            .execute(&mut *tx)
            .await?;
        }
        let Some(case_id) = decided.case_id.as_ref().filter(|_| decided.decision == RecoveryDecision::OutcomeUnknown)
        else {
            return Ok(());
        };
        sqlx::query(
            "INSERT INTO task_cases (task_id, case_id, evidence, decided_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (task_id) DO UPDATE SET case_id = EXCLUDED.case_id, evidence = EXCLUDED.evidence, \
             decided_at = EXCLUDED.decided_at",
        )
        .bind(decided.task_id.as_uuid())
        .bind(case_id)
        .bind(sqlx::types::Json(&decided.evidence))
        .bind(decided.decided_at.to_datetime())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// One of the executor's reports: when an attempt was taken up and how it
    /// ended, and a step's output.
    fn report(&self, record: &Inbound) {
        if let Some(task_id) = self.batch.lines.gather(record) {
            self.batch.marks.mark(task_id, None);
        }
        let attempts = &self.batch.attempts;
        match &record.envelope.event {
            Event::StepCheckpointed(e) => self.batch.outputs.push(e.clone()),
            Event::AttemptClaimed(e) => attempts.started(e.task_id, e.attempt, record.envelope.headers.produced_at),
            Event::AttemptSucceeded(e) => {
                attempts.ended(e.task_id, e.attempt, Ended::at(e.finished_at, AttemptOutcome::Succeeded))
            }
            Event::AttemptFailed(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended {
                    error_class: Some(e.error_class),
                    detail: Some(e.message.clone()),
                    money_may_have_been_spent: Some(e.money_may_have_been_spent),
                    ..Ended::at(e.failed_at, AttemptOutcome::Failed)
                },
            ),
            Event::AttemptReleased(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended {
                    detail: Some(e.reason.as_str().to_owned()),
                    ..Ended::at(e.released_at, AttemptOutcome::Released)
                },
            ),
            Event::AttemptLost(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended {
                    detail: Some(format!("worker last seen after `{}`", e.last_phase.as_str())),
                    ..Ended::at(e.detected_at, AttemptOutcome::Lost)
                },
            ),
            _ => {}
        }
    }
}

/// How an attempt ended, as `task_attempts` keeps it.
#[derive(Debug, Clone)]
struct Ended {
    outcome: AttemptOutcome,
    error_class: Option<ErrorClass>,
    detail: Option<String>,
    money_may_have_been_spent: Option<bool>,
    at: Timestamp,
}

impl Ended {
    fn at(at: Timestamp, outcome: AttemptOutcome) -> Self {
        Ended { outcome, error_class: None, detail: None, money_may_have_been_spent: None, at }
    }
}

/// The attempts a batch heard of: when each was first taken up, and how it ended
/// (the last end heard wins, as when each was written at once).
#[derive(Debug, Default)]
struct Attempts(fenceline_bus::gathered::Merged<(TaskId, i32), Heard>);

/// What a batch heard of one attempt.
#[derive(Debug, Default)]
struct Heard {
    started: Option<Timestamp>,
    ended: Option<Ended>,
}

impl Attempts {
    fn started(&self, task_id: TaskId, attempt: i32, at: Timestamp) {
        self.0.merge((task_id, attempt), |heard| heard.started = Some(heard.started.map_or(at, |s| s.min(at))));
    }

    fn ended(&self, task_id: TaskId, attempt: i32, how: Ended) {
        self.0.merge((task_id, attempt), |heard| heard.ended = Some(how));
    }

    fn discard(&self) {
        self.0.discard();
    }

    /// Writes each attempt heard of: the earliest start kept, the end replaced if
    /// one was heard, in task order.
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let held = self.0.take();
        if held.is_empty() {
            return Ok(());
        }
        let (mut task_ids, mut attempts, mut outcomes, mut classes, mut details, mut money, mut starts, mut ends) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        for ((task_id, attempt), Heard { started, ended }) in held {
            task_ids.push(task_id.as_uuid());
            attempts.push(attempt);
            starts.push(started.map(Timestamp::to_datetime));
            outcomes.push(ended.as_ref().map_or(AttemptOutcome::Running, |e| e.outcome).as_str());
            classes.push(ended.as_ref().and_then(|e| e.error_class).map(ErrorClass::as_str));
            money.push(ended.as_ref().and_then(|e| e.money_may_have_been_spent));
            ends.push(ended.as_ref().map(|e| e.at.to_datetime()));
            details.push(ended.and_then(|e| e.detail));
        }
        sqlx::query(
            "INSERT INTO task_attempts (task_id, attempt, outcome, error_class, detail, money_may_have_been_spent, \
             started_at, ended_at) \
             SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::bool[], \
             $7::timestamptz[], $8::timestamptz[]) \
             ON CONFLICT (task_id, attempt) DO UPDATE SET \
             started_at = least(task_attempts.started_at, EXCLUDED.started_at), \
             outcome = CASE WHEN EXCLUDED.ended_at IS NULL THEN task_attempts.outcome ELSE EXCLUDED.outcome END, \
             error_class = CASE WHEN EXCLUDED.ended_at IS NULL THEN task_attempts.error_class \
               ELSE EXCLUDED.error_class END, \
             detail = CASE WHEN EXCLUDED.ended_at IS NULL THEN task_attempts.detail ELSE EXCLUDED.detail END, \
             money_may_have_been_spent = CASE WHEN EXCLUDED.ended_at IS NULL \
               THEN task_attempts.money_may_have_been_spent ELSE EXCLUDED.money_may_have_been_spent END, \
             ended_at = coalesce(EXCLUDED.ended_at, task_attempts.ended_at)",
        )
        .bind(task_ids)
        .bind(attempts)
        .bind(outcomes)
        .bind(classes)
        .bind(details)
        .bind(money)
        .bind(starts)
        .bind(ends)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// What the projections' consumer batch writes just before it commits
/// ([`fenceline_bus::Handler::flush`]), one statement each instead of one per
/// event, and forgets if the batch (or the event's savepoint) rolls back: the
/// newest snapshot of each task, the attempts heard of, the timeline lines, the
/// change marks. Written in that order, so a mark finds the tenant of a task seen
/// first in this batch.
#[derive(Debug, Default)]
struct BatchWrites {
    views: Views,
    attempts: Attempts,
    lines: crate::timeline::Lines,
    marks: crate::live::BatchMarks,
    /// The step outputs heard.
    outputs: fenceline_bus::gathered::All<fenceline_events::StepCheckpointed>,
}

impl BatchWrites {
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        self.views.flush(&mut *tx).await?;
        self.attempts.flush(&mut *tx).await?;
        crate::decisions::record_outputs(&mut *tx, &self.outputs.take()).await?;
        self.lines.flush(&mut *tx).await?;
        self.marks.flush(&mut *tx).await
    }

    fn discard(&self) {
        self.views.discard();
        self.attempts.discard();
        self.outputs.discard();
        self.lines.discard();
        self.marks.discard();
    }
}

/// The newest status snapshot of each task in a batch.
#[derive(Debug, Default)]
struct Views(fenceline_bus::gathered::Newest<TaskId, fenceline_events::TaskStatus>);

impl Views {
    fn gather(&self, status: &fenceline_events::TaskStatus) {
        self.0.keep(status.task_id, status.version, || status.clone());
    }

    fn discard(&self) {
        self.0.discard();
    }

    /// Writes each gathered snapshot unless `task_view` holds a version as new, in
    /// task order.
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let views = self.0.take();
        if views.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO task_view (task_id, tenant, kind, state, reason, attempt, step, phase, next_attempt_at, \
             result, case_id, updated_at, version) \
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[], \
             $7::text[], $8::text[], $9::timestamptz[], $10::jsonb[], $11::text[], $12::timestamptz[], $13::bigint[]) \
             ON CONFLICT (task_id) DO UPDATE SET state = EXCLUDED.state, reason = EXCLUDED.reason, \
             attempt = EXCLUDED.attempt, step = EXCLUDED.step, phase = EXCLUDED.phase, \
             next_attempt_at = EXCLUDED.next_attempt_at, result = EXCLUDED.result, case_id = EXCLUDED.case_id, \
             updated_at = EXCLUDED.updated_at, version = EXCLUDED.version WHERE task_view.version < EXCLUDED.version",
        )
        .bind(views.iter().map(|v| v.task_id.as_uuid()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.tenant.as_str()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.kind.as_str()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.state.as_str()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.reason.as_deref()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.attempt).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.step.as_deref()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.phase.map(|p| p.as_str())).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.next_attempt_at.map(Timestamp::to_datetime)).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.result.as_ref().map(sqlx::types::Json)).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.case_id.as_deref()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.updated_at.to_datetime()).collect::<Vec<_>>())
        .bind(views.iter().map(|v| v.version).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
