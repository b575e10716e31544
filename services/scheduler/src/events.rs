//! The scheduler's consumer: every event on `fenceline.tasks`, `fenceline.attempts`
//! and `fenceline.recovery` becomes one lifecycle input of its task, applied under
//! the task's row lock inside the fenced batch transaction. A person's request that
//! arrives before its task (per-key order can break after a delivery timeout) is
//! kept and applied when the task arrives.

use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_config::catalog::Catalog;
use fenceline_domain::ids::TaskId;
use fenceline_domain::lifecycle::{Input, Task};
use fenceline_domain::limits::Health;
use fenceline_domain::spend::Amount;
use fenceline_domain::vocabulary::{ApprovalDecision, Phase, Priority, ReleaseReason, TaskState};
use fenceline_events::{Event, TaskAccepted};
use sqlx::PgConnection;

use crate::tasks::{self, Context, TaskRow};
use crate::{SchedulerSettings, clock, health};

/// Applies task, attempt and recovery events to the lifecycle. One per consumer:
/// it gathers its batch's statuses and holds the rows its batch locked.
#[derive(Debug)]
pub struct LifecycleEvents {
    pub catalog: Arc<Catalog>,
    pub settings: Arc<SchedulerSettings>,
    pub channel: Arc<str>,
    pub statuses: tasks::StatusBatch,
    /// The slots its batch gives back, released when the batch ends.
    pub slots: tasks::slots::SlotWrites,
    pub held: HeldRows,
    /// The tasks this consumer's batch finished, timed when it commits.
    pub ends: tasks::Ends,
    /// The live attempts' outcomes its batch heard, which move their providers'
    /// adaptive limits when the batch ends, before the slots are given back.
    pub outcomes: Outcomes,
}

/// A batch's attempt outcomes, in the order heard ([`health::observe_all`]).
#[derive(Debug, Default)]
pub struct Outcomes(std::sync::Mutex<Vec<health::Outcome>>);

impl Outcomes {
    fn heard(&self) -> std::sync::MutexGuard<'_, Vec<health::Outcome>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The task rows this consumer's batch has locked, as its events left them: a
/// task's later events in the same batch (the claim, the call intent and the
/// checkpoint often come together) are applied to the held row instead of locking
/// and reading it again, and a changed row is stored once, when the batch (or an
/// event's savepoint) is flushed ([`tasks::save_all`]). The batch's transaction
/// keeps each row locked, so no one else can change or read it meanwhile;
/// forgotten when the batch or the savepoint is flushed or rolled back.
#[derive(Debug, Default)]
pub struct HeldRows(std::sync::Mutex<Holding>);

/// What a batch holds: its locked rows, and the tasks it looked for and did not find.
#[derive(Debug, Default)]
pub struct Holding {
    rows: std::collections::HashMap<TaskId, Held>,
    /// Keys of the batch that named no stored task when it locked its rows: a
    /// `TaskAccepted` for one of them is new, and its row is inserted at the flush.
    unknown: std::collections::HashSet<TaskId>,
}

/// A locked row, and whether the batch changed it since it was read.
#[derive(Debug)]
pub struct Held {
    row: TaskRow,
    changed: bool,
    /// The row is not stored yet: the batch accepted its task, and inserts it
    /// with these columns, as its events left it, when it ends.
    new: Option<tasks::NewRow>,
}

/// The rows a batch changed, to store when it ends: those it accepted, to insert,
/// and the others, to update; each in task order.
#[derive(Debug, Default)]
struct Changed {
    inserted: Vec<(TaskRow, tasks::NewRow)>,
    updated: Vec<TaskRow>,
}

impl HeldRows {
    fn held(&self) -> std::sync::MutexGuard<'_, Holding> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Holds a row the batch changed, to be stored at the flush.
    fn changed(&self, row: TaskRow) {
        let mut held = self.held();
        match held.rows.get_mut(&row.task_id) {
            Some(held) => {
                held.row = row;
                held.changed = true;
            }
            None => {
                held.rows.insert(row.task_id, Held { row, changed: true, new: None });
            }
        }
    }

    /// Holds the row of a task the batch accepted, to be inserted at the flush.
    fn accepted(&self, row: TaskRow, new: tasks::NewRow) {
        let mut held = self.held();
        held.unknown.remove(&row.task_id);
        held.rows.insert(row.task_id, Held { row, changed: true, new: Some(new) });
    }

    /// Whether the batch looked for the task when it locked its rows and found none.
    fn unknown(&self, task_id: TaskId) -> bool {
        self.held().unknown.contains(&task_id)
    }

    /// Whether the batch holds the task's row.
    fn holds(&self, task_id: TaskId) -> bool {
        self.held().rows.contains_key(&task_id)
    }

    /// Notes the signal a task's step now waits for, which its row holds too.
    fn awaiting(&self, task_id: TaskId, signal: &str, step: &str) {
        if let Some(held) = self.held().rows.get_mut(&task_id) {
            held.row.pending_signal = Some(signal.to_owned());
            held.row.pending_step = Some(step.to_owned());
        }
    }

    /// Forgets every row; returns the changed ones.
    fn take_changed(&self) -> Changed {
        let mut held = self.held();
        held.unknown.clear();
        let mut changed = Changed::default();
        for (_, held) in held.rows.drain().filter(|(_, held)| held.changed) {
            match held.new {
                Some(new) => changed.inserted.push((held.row, new)),
                None => changed.updated.push(held.row),
            }
        }
        changed.inserted.sort_by_key(|(row, _)| row.task_id.as_uuid());
        changed.updated.sort_by_key(|row| row.task_id.as_uuid());
        changed
    }

    fn clear(&self) {
        let mut held = self.held();
        held.rows.clear();
        held.unknown.clear();
    }

    /// Locks and holds, with one statement, the rows of the tasks a batch's records
    /// are keyed by (a record's key is its task's id), those not held yet; notes
    /// the keys that name no stored task.
    async fn lock_keyed(&self, tx: &mut PgConnection, keys: &[&[u8]]) -> Result<(), sqlx::Error> {
        let mut task_ids: Vec<TaskId> = {
            let held = self.held();
            (keys.iter())
                .filter_map(|key| std::str::from_utf8(key).ok()?.parse::<TaskId>().ok())
                .filter(|id| !held.rows.contains_key(id))
                .collect()
        };
        task_ids.sort_unstable_by_key(TaskId::as_uuid);
        task_ids.dedup();
        let rows = tasks::lock_all(tx, &task_ids).await?;
        let mut held = self.held();
        held.unknown.extend(task_ids);
        for row in rows {
            held.unknown.remove(&row.task_id);
            held.rows.entry(row.task_id).or_insert(Held { row, changed: false, new: None });
        }
        Ok(())
    }

    /// The task's row, locked: held by this batch already, or locked and read now
    /// (and held from then on).
    async fn lock(&self, tx: &mut PgConnection, task_id: TaskId) -> Result<Option<TaskRow>, sqlx::Error> {
        if let Some(held) = self.held().rows.get(&task_id) {
            return Ok(Some(held.row.clone()));
        }
        let row = tasks::lock(tx, task_id).await?;
        if let Some(row) = &row {
            self.held().rows.insert(task_id, Held { row: row.clone(), changed: false, new: None });
        }
        Ok(row)
    }
}

fn jitter() -> f64 {
    rand::random::<f64>()
}

impl LifecycleEvents {
    fn ctx<'a>(&'a self, outbox: &'a OutboxWriter) -> Context<'a> {
        Context {
            outbox,
            catalog: &self.catalog,
            settings: &self.settings,
            channel: &self.channel,
            statuses: Some(&self.statuses),
            ends: &self.ends,
            slots: Some(&self.slots),
        }
    }

    async fn accept(&self, tx: &mut PgConnection, outbox: &OutboxWriter, e: &TaskAccepted) -> Result<(), HandleError> {
        let now = clock::now().0;
        let mut task = Task::accepted(now, e.not_before.map(|t| t.0), e.deadline.map(|t| t.0));
        let kind = self.catalog.kind(&e.kind);
        if kind.is_none() {
            task.state = TaskState::Failed;
            task.reason = Some(format!("no kind `{}` in the scheduler's catalogue", e.kind));
            task.due_at = None;
        }
        let priority = match e.priority {
            Priority::High => 0i16,
            Priority::Normal => 1,
            Priority::Low => 2,
        };
        if self.held.holds(e.task_id) {
            // A copy: the task is stored, and the batch holds its row.
            return Ok(());
        }
        let provider = kind.and_then(|k| k.slot_provider());
        let mut row = TaskRow {
            task_id: e.task_id,
            tenant: e.tenant.clone(),
            kind: e.kind.clone(),
            input_json: e.input_json.clone(),
            lifecycle: task.clone(),
            version: 1,
            pending_signal: None,
            pending_step: None,
            // The handler's span continues the submission's trace; later work joins it.
            traceparent: fenceline_telemetry::current_traceparent(),
            accepted_at: e.accepted_at.0,
        };
        if self.held.unknown(e.task_id) {
            // New, as the batch's lock found: inserted with the batch's other new
            // tasks when it ends ([`tasks::insert_all`]), as its events leave it.
            self.announce(tx, outbox, &row, now).await?;
            let new =
                tasks::NewRow { priority, provider: provider.map(str::to_owned), deadline_us: e.deadline.map(|t| t.0) };
            self.held.accepted(row, new);
            return Ok(());
        }
        // Not looked for by the batch (it is applied one event at a time). One
        // statement: the task, the requests that outran it taken, and the
        // dispatchers woken at commit if it is due (the third column only makes
        // `woken` run). No row: the task was known.
        let inserted: Vec<(Option<i64>, Option<Vec<u8>>, i64)> = sqlx::query_as(
            "WITH inserted AS ( \
               INSERT INTO tasks (task_id, tenant, kind, input_json, priority, provider, lifecycle, state, \
                 deadline_us, traceparent, due_at_us, version, accepted_at) \
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 1, to_timestamp($13::float8 / 1000000)) \
               ON CONFLICT (task_id) DO NOTHING \
               RETURNING task_id, due_at_us), \
             early AS (DELETE FROM early_requests WHERE task_id IN (SELECT task_id FROM inserted) \
               RETURNING seq, value), \
             woken AS (SELECT pg_notify($12, '') FROM inserted WHERE due_at_us IS NOT NULL) \
             SELECT early.seq, early.value, (SELECT count(*) FROM woken) FROM inserted LEFT JOIN early ON true",
        )
        .bind(e.task_id.as_uuid())
        .bind(&e.tenant)
        .bind(&e.kind)
        .bind(&e.input_json)
        .bind(priority)
        .bind(provider)
        .bind(sqlx::types::Json(&task))
        .bind(task.state.as_str())
        .bind(e.deadline.map(|t| t.0))
        .bind(&row.traceparent)
        .bind(tasks::due_at(&task))
        .bind(&*self.channel)
        .bind(e.accepted_at.0)
        .fetch_all(&mut *tx)
        .await?;
        if inserted.is_empty() {
            return Ok(());
        }
        let early =
            early_inputs(e.task_id, inserted.into_iter().filter_map(|(seq, value, _)| seq.zip(value)).collect());
        self.announce(tx, outbox, &row, now).await?;
        let changed = !early.is_empty();
        for input in early {
            row = tasks::apply(tx, self.ctx(outbox), &row, input, now).await?;
        }
        self.held.held().rows.insert(row.task_id, Held { row, changed, new: None });
        Ok(())
    }

    /// What a new task's acceptance tells: its first status, and its end if it
    /// ended at once (a kind the catalogue does not have).
    async fn announce(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        row: &TaskRow,
        now: i64,
    ) -> Result<(), HandleError> {
        let task = &row.lifecycle;
        if task.is_final() {
            self.ends.keep(&self.catalog, &row.kind, task.state, row.accepted_at, now);
        }
        self.ctx(outbox).publish_status(tx, tasks::status_of(row, task, 1, now)).await?;
        Ok(())
    }
}

/// The lifecycle input of a person's request on `fenceline.tasks`, which needs
/// nothing but the event.
fn request_input(event: &Event) -> Option<Input> {
    match event {
        Event::CancelRequested(_) => Some(Input::CancelRequested),
        Event::SignalReceived(e) => Some(Input::Signal {
            name: e.signal_name.clone(),
            signal_id: e.signal_id.clone(),
            step: e.step.clone(),
            generation: e.generation.and_then(|g| u32::try_from(g).ok()),
            decision: e.decision.unwrap_or(ApprovalDecision::Approve),
        }),
        Event::ResolutionDecided(e) => Some(Input::Resolution {
            case_id: e.case_id.clone(),
            action: e.action,
            result: e.attached_result.as_ref().map(tasks::artifact),
        }),
        _ => None,
    }
}

/// Keeps a request for a task this scheduler has not heard of yet.
async fn keep_early(tx: &mut PgConnection, task_id: TaskId, record: &Inbound) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO early_requests (task_id, event_id, value) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
        .bind(task_id.as_uuid())
        .bind(record.envelope.headers.event_id.as_uuid())
        .bind(&record.value)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// The requests kept for a task that has just arrived (its insert took them), in
/// the order they came.
fn early_inputs(task_id: TaskId, mut kept: Vec<(i64, Vec<u8>)>) -> Vec<Input> {
    kept.sort_by_key(|(seq, _)| *seq);
    let mut inputs = Vec::with_capacity(kept.len());
    for (_, value) in kept {
        // The bytes decoded when they were kept; this binary reads what it wrote.
        match fenceline_events::decode(&value) {
            Ok(event) => inputs.extend(request_input(&event)),
            Err(e) => tracing::error!(%task_id, error = %e, "a kept request no longer decodes; dropped"),
        }
    }
    inputs
}

/// How far the live attempt got; `None` (nothing to apply) for any other attempt,
/// and for a report behind what the task already shows (one heard again).
fn progress(catalog: &Catalog, row: &TaskRow, attempt: i32, step: &str, phase: Phase) -> Option<Input> {
    let current = i64::from(row.lifecycle.attempt) == i64::from(attempt);
    let grant_id = row.lifecycle.live_grant.filter(|_| current)?;
    let kind = catalog.kind(&row.kind);
    let order = |name: &str| kind.and_then(|kind| kind.step_index(name));
    if row.lifecycle.report_is_behind(order, step, phase) {
        return None;
    }
    Some(Input::Progress { grant_id, step: step.to_owned(), phase })
}

impl Handler for LifecycleEvents {
    /// A submitted task waits for its grant, and an ended attempt for its next step.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn flush(&self, tx: &mut PgConnection, outbox: &OutboxWriter) -> Result<(), HandleError> {
        let changed = self.held.take_changed();
        if !tasks::insert_all(tx, self.ctx(outbox), &changed.inserted).await? {
            // A task of the batch had requests that outran it: the batch is applied
            // again one event at a time, where its acceptance applies them in order.
            return Err(HandleError::OneAtATime(
                "a task the batch accepted has requests kept from before it arrived".into(),
            ));
        }
        tasks::save_all(tx, self.ctx(outbox), &changed.updated).await?;
        let outcomes = std::mem::take(&mut *self.outcomes.heard());
        health::observe_all(tx, &self.catalog, &outcomes).await?;
        self.slots.flush(tx, &self.channel).await?;
        Ok(self.statuses.flush(tx, outbox).await?)
    }

    /// The batch's task rows, locked in task order with one statement: each record
    /// then finds its row held, as a task's second record in a batch always did.
    async fn prepare(&self, tx: &mut PgConnection, keys: &[&[u8]]) -> Result<(), HandleError> {
        Ok(self.held.lock_keyed(tx, keys).await?)
    }

    fn discard(&self) {
        self.held.clear();
        self.outcomes.heard().clear();
        self.slots.discard();
        self.statuses.discard();
        self.ends.discard();
    }

    fn committed(&self) {
        self.ends.observe();
    }

    async fn handle(&self, tx: &mut PgConnection, outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        let event = &record.envelope.event;
        if let Event::TaskAccepted(e) = event {
            return self.accept(tx, outbox, e).await;
        }
        // Evidence for the reconciler's case: the task's state does not move by it.
        if let Event::FencedResultReported(_) = event {
            return Ok(());
        }
        let Some(task_id) = event.task_id() else {
            return Err(HandleError::Poison(format!("{} is not about a task", event.event_type())));
        };
        let Some(row) = self.held.lock(tx, task_id).await? else {
            if request_input(event).is_some() {
                // A request that outran its task's TaskAccepted: applied when the task arrives.
                tracing::info!(%task_id, event_type = event.event_type(), "request for a task not yet accepted kept");
                keep_early(tx, task_id, record).await?;
                return Ok(());
            }
            // Attempt and recovery events follow the scheduler's own grants, so they
            // cannot precede the task; anything else is a record from elsewhere.
            tracing::warn!(%task_id, event_type = event.event_type(), "event for an unknown task ignored");
            return Ok(());
        };
        let input = match event {
            Event::CancelRequested(_) | Event::SignalReceived(_) | Event::ResolutionDecided(_) => {
                match request_input(event) {
                    Some(input) => input,
                    None => return Ok(()),
                }
            }
            Event::AttemptClaimed(e) => Input::Claimed { grant_id: e.grant_id },
            Event::CallIntentRecorded(e) => {
                match progress(&self.catalog, &row, e.attempt, &e.step, Phase::CallIntent) {
                    Some(input) => input,
                    None => return Ok(()),
                }
            }
            Event::ProviderAccepted(e) => {
                match progress(&self.catalog, &row, e.attempt, &e.step, Phase::ProviderAccepted) {
                    Some(input) => input,
                    None => return Ok(()),
                }
            }
            Event::StepCheckpointed(e) => {
                // A call that did its work cost money whatever became of its attempt.
                if let Some(cost) = e.cost_micros {
                    crate::spend::add(tx, &row.tenant, e.checkpointed_at, Amount::from_micros(cost)).await?;
                }
                match progress(&self.catalog, &row, e.attempt, &e.step, Phase::ResultRecorded) {
                    Some(input) => input,
                    None => return Ok(()),
                }
            }
            Event::AwaitingSignal(e) => {
                sqlx::query("UPDATE tasks SET pending_signal = $2, pending_step = $3 WHERE task_id = $1")
                    .bind(task_id.as_uuid())
                    .bind(&e.signal_name)
                    .bind(&e.step)
                    .execute(&mut *tx)
                    .await?;
                self.held.awaiting(task_id, &e.signal_name, &e.step);
                return Ok(());
            }
            Event::AttemptSucceeded(e) => Input::Succeeded { grant_id: e.grant_id, result: tasks::artifact(&e.result) },
            Event::AttemptFailed(e) => Input::Failed {
                grant_id: e.grant_id,
                class: e.error_class,
                message: e.message.clone(),
                retry_after: e.retry_after_ms.and_then(|ms| u64::try_from(ms).ok()).map(Duration::from_millis),
                jitter: jitter(),
            },
            Event::AttemptReleased(e) => {
                let waiting = e.reason == ReleaseReason::AwaitingSignal;
                Input::Released {
                    grant_id: e.grant_id,
                    reason: e.reason,
                    step: waiting.then(|| row.pending_step.clone()).flatten(),
                    signal: waiting.then(|| row.pending_signal.clone()).flatten(),
                }
            }
            Event::AttemptLost(e) => Input::Lost { grant_id: e.grant_id, phase: e.last_phase },
            Event::RecoveryDecided(e) => Input::Recovery {
                attempt: u32::try_from(e.attempt).unwrap_or_default(),
                decision: e.decision,
                result: e.result.as_ref().map(tasks::artifact),
                case_id: e.case_id.clone(),
                jitter: jitter(),
            },
            other => return Err(HandleError::Poison(format!("the scheduler does not take {}", other.event_type()))),
        };
        let now = clock::now().0;
        // The live attempt's outcome moves its provider's adaptive limit (its slot
        // names the provider) when the batch ends, before the slot is given back.
        let health = match event {
            Event::AttemptSucceeded(e) => Some((e.grant_id, Health::Healthy)),
            Event::AttemptFailed(e) => Some((e.grant_id, Health::of(e.error_class, &e.message))),
            _ => None,
        };
        if let Some((grant_id, health)) = health.filter(|(grant_id, _)| row.lifecycle.live_grant == Some(*grant_id)) {
            self.outcomes.heard().push(health::Outcome { grant_id, health, at: now });
        }
        let applied = tasks::apply(tx, self.ctx(outbox), &row, input, now).await?;
        // An input that moved nothing (a stale or repeated report) stores nothing.
        if applied.lifecycle != row.lifecycle || applied.version != row.version {
            self.held.changed(applied);
        }
        Ok(())
    }

    /// Events whose copy moves nothing, stores nothing and publishes nothing:
    /// - an attempt's end: the lifecycle takes an end only from its task's live
    ///   grant, and the first copy ended that grant (its health and its slot are read
    ///   only for the live grant too);
    /// - a claim or a call's intent or acceptance: the lifecycle takes a claim only
    ///   before its attempt reported a step, and a report only if it is not behind
    ///   what the task shows ([`progress`]);
    /// - a task's acceptance: its row is kept at least the dedupe window after it was
    ///   accepted ([`crate::retention::purge_finished_tasks`]), so a copy sent within
    ///   the window finds it and inserts nothing, as the remembered id would have.
    ///
    /// Remembered: a checkpoint (its cost would be counted twice), a wait for a
    /// signal (a copy would set a wait that ended back), a person's request and the
    /// reconciler's decisions.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        matches!(
            event,
            Event::AttemptSucceeded(_)
                | Event::AttemptFailed(_)
                | Event::AttemptReleased(_)
                | Event::AttemptLost(_)
                | Event::AttemptClaimed(_)
                | Event::CallIntentRecorded(_)
                | Event::ProviderAccepted(_)
                | Event::TaskAccepted(_)
        )
    }
}

#[cfg(test)]
mod tests;
