//! Each task's timeline (docs/dashboard.md): every event about it that intake's
//! projections consume — status snapshots, the executor's reports with their phases
//! and checkpoints, the reconciler's decisions — with the trace each belongs to,
//! and what people asked of it, oldest first.

use fenceline_bus::Inbound;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::Phase;
use fenceline_events::{Event, Timestamp};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

/// One line of a task's timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct TimelineEntry {
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Who said it: `intake`, `scheduler`, `executor`, `reconciler`, or `person`
    /// (a signal, cancel or resolution asked through the API).
    pub source: String,
    /// The event type (`TaskStatus`, `AttemptClaimed`, `StepCheckpointed`, ...).
    pub event: String,
    pub attempt: Option<i32>,
    pub step: Option<String>,
    /// The call phase the event reports.
    pub phase: Option<String>,
    /// For `AwaitingSignal` and `SignalReceived`: the signal's name.
    pub signal: Option<String>,
    /// What happened, in words.
    pub detail: Option<String>,
    /// The W3C trace id of the span that produced the event.
    pub trace_id: Option<String>,
}

/// What one consumed event adds to its task's timeline.
#[derive(Debug)]
struct Line {
    task_id: TaskId,
    at: Timestamp,
    attempt: Option<i32>,
    step: Option<String>,
    phase: Option<String>,
    signal: Option<String>,
    detail: String,
}

/// The timeline line of an event, if it is about a task.
fn line(event: &Event, produced_at: Timestamp) -> Option<Line> {
    let line = |task_id, at, attempt, step: Option<&str>, detail: String| Line {
        task_id,
        at,
        attempt,
        step: step.map(str::to_owned),
        phase: None,
        signal: None,
        detail,
    };
    Some(match event {
        Event::TaskStatus(e) => Line {
            phase: e.phase.map(|p| p.as_str().to_owned()),
            ..line(
                e.task_id,
                e.updated_at,
                Some(e.attempt),
                e.step.as_deref(),
                match &e.reason {
                    Some(reason) => format!("{}: {reason}", e.state.as_str()),
                    None => e.state.as_str().to_owned(),
                },
            )
        },
        Event::AttemptClaimed(e) => line(
            e.task_id,
            produced_at,
            Some(e.attempt),
            None,
            format!("claimed by {} with fencing token {}", e.worker, e.fencing_token),
        ),
        Event::CallIntentRecorded(e) => Line {
            phase: Some(Phase::CallIntent.as_str().to_owned()),
            ..line(
                e.task_id,
                e.recorded_at,
                Some(e.attempt),
                Some(&e.step),
                format!("about to call {} with operation key {}", e.provider, e.operation_key),
            )
        },
        Event::ProviderAccepted(e) => Line {
            phase: Some(Phase::ProviderAccepted.as_str().to_owned()),
            ..line(
                e.task_id,
                e.accepted_at,
                Some(e.attempt),
                Some(&e.step),
                format!("the provider accepted operation {} as {}", e.operation_key, e.provider_request_id),
            )
        },
        Event::StepCheckpointed(e) => Line {
            phase: Some("checkpointed".into()),
            ..line(
                e.task_id,
                e.checkpointed_at,
                Some(e.attempt),
                Some(&e.step),
                format!("checkpoint {} (sha256 {})", e.output_ref, e.sha256),
            )
        },
        Event::AwaitingSignal(e) => Line {
            signal: Some(e.signal_name.clone()),
            ..line(
                e.task_id,
                e.since,
                Some(e.attempt),
                Some(&e.step),
                format!("waiting for the signal {}", e.signal_name),
            )
        },
        Event::AttemptSucceeded(e) => line(
            e.task_id,
            e.finished_at,
            Some(e.attempt),
            None,
            format!("succeeded with {} ({} bytes, sha256 {})", e.result.uri, e.result.size_bytes, e.result.sha256),
        ),
        Event::AttemptFailed(e) => line(
            e.task_id,
            e.failed_at,
            Some(e.attempt),
            None,
            format!(
                "failed ({}): {}{}",
                e.error_class.as_str(),
                e.message,
                if e.money_may_have_been_spent { "; money may have been spent" } else { "" }
            ),
        ),
        Event::AttemptReleased(e) => {
            line(e.task_id, e.released_at, Some(e.attempt), None, format!("released: {}", e.reason.as_str()))
        }
        Event::AttemptLost(e) => Line {
            phase: Some(e.last_phase.as_str().to_owned()),
            ..line(
                e.task_id,
                e.detected_at,
                Some(e.attempt),
                e.step.as_deref(),
                format!("lost: its worker was last seen after {}", e.last_phase.as_str()),
            )
        },
        Event::FencedResultReported(e) => line(
            e.task_id,
            e.verified_at,
            Some(e.attempt),
            Some(&e.step),
            format!(
                "a worker whose lease had been taken over verified the provider's result of operation {} (sha256 \
                 {}); reported to its case as evidence",
                e.operation_key, e.result.sha256
            ),
        ),
        Event::RecoveryDecided(e) => {
            let findings: Vec<&str> = e.evidence.iter().map(|ev| ev.finding.as_str()).collect();
            let mut detail = format!("decided {}", e.decision.as_str());
            if let Some(case) = &e.case_id {
                detail.push_str(&format!(" (case {case})"));
            }
            if !findings.is_empty() {
                detail.push_str(&format!(": {}", findings.join("; ")));
            }
            line(e.task_id, e.decided_at, Some(e.attempt), None, detail)
        }
        _ => return None,
    })
}

/// The trace id of a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`), if it is one.
pub fn trace_id(traceparent: &str) -> Option<String> {
    let id = traceparent.split('-').nth(1)?;
    let valid = id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) && id.bytes().any(|b| b != b'0');
    valid.then(|| id.to_ascii_lowercase())
}

/// The timeline lines of one consumer batch, written with one statement just
/// before the batch commits ([`fenceline_bus::Handler::flush`]) instead of one per
/// event; forgotten with the batch if it rolls back.
#[derive(Debug, Default)]
pub struct Lines(fenceline_bus::gathered::All<Row>);

/// A line as it is stored.
#[derive(Debug)]
struct Row {
    line: Line,
    event_id: String,
    source: String,
    event_type: &'static str,
    trace_id: Option<String>,
}

impl Lines {
    /// Gathers the record's line, if its event is about a task; returns the task.
    pub fn gather(&self, record: &Inbound) -> Option<TaskId> {
        let headers = &record.envelope.headers;
        let line = line(&record.envelope.event, headers.produced_at)?;
        let task_id = line.task_id;
        let row = Row {
            line,
            event_id: headers.event_id.to_string(),
            source: headers.producer.clone(),
            event_type: record.envelope.event.event_type(),
            trace_id: headers.traceparent.as_deref().and_then(trace_id),
        };
        self.0.push(row);
        Some(task_id)
    }

    /// Forgets the lines of a batch that was rolled back.
    pub fn discard(&self) {
        self.0.discard();
    }

    /// Adds the gathered lines to their timelines in `tx`, once per event id.
    pub async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let rows = self.0.take();
        if rows.is_empty() {
            return Ok(());
        }
        let mut columns = Columns::default();
        for row in rows {
            columns.push(row);
        }
        sqlx::query(
            "INSERT INTO task_timeline (task_id, event_id, at, source, event_type, attempt, step, phase, \
             signal_name, detail, trace_id) \
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::timestamptz[], $4::text[], $5::text[], $6::int[], \
             $7::text[], $8::text[], $9::text[], $10::text[], $11::text[]) ON CONFLICT DO NOTHING",
        )
        .bind(columns.task_id)
        .bind(columns.event_id)
        .bind(columns.at)
        .bind(columns.source)
        .bind(columns.event_type)
        .bind(columns.attempt)
        .bind(columns.step)
        .bind(columns.phase)
        .bind(columns.signal)
        .bind(columns.detail)
        .bind(columns.trace_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// The gathered lines column by column, as `unnest` takes them.
#[derive(Default)]
struct Columns {
    task_id: Vec<uuid::Uuid>,
    event_id: Vec<String>,
    at: Vec<OffsetDateTime>,
    source: Vec<String>,
    event_type: Vec<&'static str>,
    attempt: Vec<Option<i32>>,
    step: Vec<Option<String>>,
    phase: Vec<Option<String>>,
    signal: Vec<Option<String>>,
    detail: Vec<String>,
    trace_id: Vec<Option<String>>,
}

impl Columns {
    fn push(&mut self, row: Row) {
        self.task_id.push(row.line.task_id.as_uuid());
        self.event_id.push(row.event_id);
        self.at.push(row.line.at.to_datetime());
        self.source.push(row.source);
        self.event_type.push(row.event_type);
        self.attempt.push(row.line.attempt);
        self.step.push(row.line.step);
        self.phase.push(row.line.phase);
        self.signal.push(row.line.signal);
        self.detail.push(row.line.detail);
        self.trace_id.push(row.trace_id);
    }
}

/// The task's timeline, oldest first: the projected events and what people asked
/// through the API (signals, cancels, resolutions), at most `limit` lines.
pub async fn read(pool: &PgPool, task_id: TaskId, limit: i64) -> Result<Vec<TimelineEntry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT * FROM ( \
           SELECT at, source, event_type AS event, attempt, step, phase, signal_name AS signal, detail, trace_id \
             FROM task_timeline WHERE task_id = $1 \
           UNION ALL SELECT accepted_at, 'intake', 'TaskAccepted', NULL, NULL, NULL, NULL, \
             'accepted through ' || source, NULL FROM tasks WHERE task_id = $1 \
           UNION ALL SELECT received_at, 'person', 'SignalReceived', NULL, NULL, NULL, signal_name, \
             'signal ' || signal_name || ' received', NULL FROM signals WHERE task_id = $1 \
           UNION ALL SELECT requested_at, 'person', 'CancelRequested', NULL, NULL, NULL, NULL, \
             'cancel asked by ' || requested_by, NULL FROM cancellations WHERE task_id = $1 \
           UNION ALL SELECT decided_at, 'person', 'ResolutionDecided', NULL, NULL, NULL, NULL, \
             'case ' || case_id || ' resolved with ' || action || ' by ' || decided_by \
             || CASE WHEN charge_acknowledged THEN ' (a second charge acknowledged)' ELSE '' END, NULL \
             FROM resolutions WHERE task_id = $1 \
           UNION ALL SELECT decided_at, 'person', 'ApprovalDecided', NULL, step, NULL, signal_name, \
             'the wait of step ' || step || ' (generation ' || generation || ') ' \
             || CASE WHEN decision = $3 THEN 'rejected' ELSE 'approved' END || ' by ' || decided_by, NULL \
             FROM decisions WHERE task_id = $1 \
         ) lines ORDER BY at, event LIMIT $2",
    )
    .bind(task_id.as_uuid())
    .bind(limit)
    .bind(fenceline_domain::vocabulary::ApprovalDecision::Reject.as_str())
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_gives_its_trace_id_and_anything_else_none() {
        assert_eq!(
            trace_id("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in ["", "00", "00-xyz-00f067aa0ba902b7-01", "00-00000000000000000000000000000000-00f067aa0ba902b7-01"] {
            assert_eq!(trace_id(bad), None, "{bad}");
        }
    }
}
