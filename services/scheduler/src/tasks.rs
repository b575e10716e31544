//! The scheduler's task rows: load one under its row lock, apply a lifecycle input,
//! store the result, carry out the effects (grants, cancellations, slot releases)
//! and publish the status, all in the caller's transaction.

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::Catalog;
use fenceline_domain::calls::Backoff;
use fenceline_domain::ids::TaskId;
use fenceline_domain::lifecycle::{Artifact, Effect, Input, Micros, Policy, Task};
use fenceline_domain::vocabulary::TaskState;
use fenceline_events::{ArtifactRef, AttemptGranted, CancelAttempt, Event, TaskStatus, Timestamp, topics};
use sqlx::PgConnection;
use std::collections::HashMap;
use std::time::Duration;

use self::slots::{GrantWrite, SlotWrites};
use crate::SchedulerSettings;

pub mod slots;

/// A task row as the scheduler keeps it.
#[derive(Debug, Clone)]
pub struct TaskRow {
    pub task_id: TaskId,
    pub tenant: String,
    pub kind: String,
    pub input_json: String,
    pub lifecycle: Task,
    pub version: i64,
    pub pending_signal: Option<String>,
    pub pending_step: Option<String>,
    /// The trace the task's work joins (its TaskAccepted's, as handled here).
    pub traceparent: Option<String>,
    /// When intake accepted the task (its submission), in micros since the epoch.
    pub accepted_at: Micros,
}

type RawRow = (
    uuid::Uuid,
    String,
    String,
    String,
    sqlx::types::Json<Task>,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
    i64,
);

impl From<RawRow> for TaskRow {
    fn from(r: RawRow) -> Self {
        TaskRow {
            task_id: TaskId::from_uuid(r.0),
            tenant: r.1,
            kind: r.2,
            input_json: r.3,
            lifecycle: r.4.0,
            version: r.5,
            pending_signal: r.6,
            pending_step: r.7,
            traceparent: r.8,
            accepted_at: r.9,
        }
    }
}

const SELECT: &str = "SELECT task_id, tenant, kind, input_json, lifecycle, version, pending_signal, pending_step, \
     traceparent, (extract(epoch FROM accepted_at) * 1000000)::bigint FROM tasks";

/// Loads and row-locks a task.
pub async fn lock(tx: &mut PgConnection, task_id: TaskId) -> Result<Option<TaskRow>, sqlx::Error> {
    let row: Option<RawRow> = sqlx::query_as(&format!("{SELECT} WHERE task_id = $1 FOR UPDATE"))
        .bind(task_id.as_uuid())
        .fetch_optional(&mut *tx)
        .await?;
    Ok(row.map(TaskRow::from))
}

/// Loads and row-locks, with one statement, those of `task_ids` that exist, in task
/// order (every batch locks its rows in one order, so two never wait on each other).
pub async fn lock_all(tx: &mut PgConnection, task_ids: &[TaskId]) -> Result<Vec<TaskRow>, sqlx::Error> {
    if task_ids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = task_ids.iter().map(|id| id.as_uuid()).collect();
    let rows: Vec<RawRow> = sqlx::query_as(&format!("{SELECT} WHERE task_id = ANY($1) ORDER BY task_id FOR UPDATE"))
        .bind(ids)
        .fetch_all(&mut *tx)
        .await?;
    Ok(rows.into_iter().map(TaskRow::from).collect())
}

/// Loads and row-locks, with one statement, those of `task_ids` that are due and
/// that no other instance holds.
pub async fn lock_if_due(
    tx: &mut PgConnection,
    task_ids: &[TaskId],
    now: Micros,
) -> Result<HashMap<TaskId, TaskRow>, sqlx::Error> {
    if task_ids.is_empty() {
        return Ok(HashMap::new());
    }
    let ids: Vec<uuid::Uuid> = task_ids.iter().map(|id| id.as_uuid()).collect();
    let rows: Vec<RawRow> =
        sqlx::query_as(&format!("{SELECT} WHERE task_id = ANY($1) AND due_at_us <= $2 FOR UPDATE SKIP LOCKED"))
            .bind(ids)
            .bind(now)
            .fetch_all(&mut *tx)
            .await?;
    Ok(rows.into_iter().map(TaskRow::from).map(|row| (row.task_id, row)).collect())
}

/// The policy of a kind, from the catalogue and the scheduler's settings.
pub fn policy(catalog: &Catalog, kind: &str, settings: &SchedulerSettings) -> Policy {
    Policy {
        max_attempts: catalog.kind(kind).map_or(1, |k| k.max_attempts),
        backoff: Backoff {
            base: Duration::from_millis(settings.backoff_base_ms),
            cap: Duration::from_millis(settings.backoff_cap_ms),
        },
        busy_wait: Duration::from_millis(settings.busy_wait_ms),
        send_again: catalog.send_again(kind),
    }
}

/// Everything applying an input needs besides the transaction.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub outbox: &'a OutboxWriter,
    pub catalog: &'a Catalog,
    pub settings: &'a SchedulerSettings,
    pub channel: &'a str,
    /// Where the transaction gathers its statuses, one per task, when it applies
    /// several inputs (a consumer's batch); `None` appends each status at once.
    pub statuses: Option<&'a StatusBatch>,
    /// Where the transaction keeps the tasks it finishes, timed once it commits.
    pub ends: &'a Ends,
    /// Where the transaction gathers the slots it takes and gives back, written
    /// when it ends; `None` writes each at once.
    pub slots: Option<&'a SlotWrites>,
}

impl Context<'_> {
    /// Publishes `status` with the transaction: gathered if the transaction gathers
    /// its statuses, else appended to the outbox now.
    pub async fn publish_status(&self, tx: &mut PgConnection, status: Event) -> Result<(), fenceline_bus::Error> {
        match self.statuses {
            Some(batch) => batch.keep(status),
            None => {
                self.outbox.append(tx, topics::STATUS, None, &status).await?;
            }
        }
        Ok(())
    }
}

/// The newest status of each task a consumer's batch moved, appended when the
/// batch ends instead of one per input. `fenceline.status` promises each task's
/// latest state (it is compacted; docs/architecture.md, "Status snapshots"): a
/// snapshot that a later one of the same transaction replaces was never a
/// committed state of its own, so it is not published. Appending in task order
/// also takes the outbox's key locks in one order in every batch.
#[derive(Debug, Default)]
pub struct StatusBatch(fenceline_bus::gathered::Newest<TaskId, Kept>);

/// A gathered status and the trace of the event that decided it.
#[derive(Debug)]
struct Kept {
    status: Event,
    traceparent: Option<String>,
}

impl StatusBatch {
    /// Keeps `status`, in the current span's trace, unless the batch holds a newer
    /// one of its task.
    pub fn keep(&self, status: Event) {
        let Event::TaskStatus(new) = &status else { return };
        let (task_id, version) = (new.task_id, new.version);
        self.0.keep(task_id, version, || Kept { status, traceparent: fenceline_telemetry::current_traceparent() });
    }

    /// Forgets what a rolled-back batch gathered.
    pub fn discard(&self) {
        self.0.discard();
    }

    /// Appends the gathered statuses to the outbox in `tx`, in task order, with one statement.
    pub async fn flush(&self, tx: &mut PgConnection, outbox: &OutboxWriter) -> Result<(), fenceline_bus::Error> {
        let rows = self
            .0
            .take()
            .into_iter()
            .map(|Kept { status, traceparent }| outbox.row_in_trace(topics::STATUS, None, &status, traceparent))
            .collect::<Result<Vec<_>, _>>()?;
        fenceline_bus::OutboxRow::insert_all(rows, tx).await
    }
}

/// The tasks a transaction finished, each by kind and final state with the time
/// from its submission: observed (`fenceline_task_duration_seconds`) only once the
/// transaction committed, so a batch that rolls back and is applied again times
/// its tasks once. A consumer's batch that falls back to a savepoint per event
/// forgets, with the refused event, the ends its earlier events kept: a task may
/// go untimed then, never timed twice.
#[derive(Debug, Default)]
pub struct Ends(std::sync::Mutex<Vec<(String, TaskState, f64)>>);

impl Ends {
    fn kept(&self) -> std::sync::MutexGuard<'_, Vec<(String, TaskState, f64)>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps a task of `kind` that reached `state` at `now`, submitted at `accepted_at`.
    /// A kind the catalogue does not know counts as `other`: labels stay a bounded set.
    pub fn keep(&self, catalog: &Catalog, kind: &str, state: TaskState, accepted_at: Micros, now: Micros) {
        let kind = if catalog.kind(kind).is_some() { kind } else { "other" };
        let seconds = (now - accepted_at).max(0) as f64 / 1e6;
        self.kept().push((kind.to_owned(), state, seconds));
    }

    /// Forgets what a rolled-back transaction kept.
    pub fn discard(&self) {
        self.kept().clear();
    }

    /// Times the kept tasks, once their transaction committed.
    pub fn observe(&self) {
        let metrics = &fenceline_telemetry::metrics::global().scheduler;
        for (kind, state, seconds) in self.kept().drain(..) {
            metrics.task_ended(&kind, state.as_str(), seconds);
        }
    }
}

/// Unfinished tasks by state, every unfinished state named (0 when none is in it):
/// `fenceline_scheduler_tasks`, read at each scrape through `tasks_by_state`.
pub async fn unfinished_by_state(pool: &sqlx::PgPool) -> Result<Vec<(TaskState, i64)>, sqlx::Error> {
    let unfinished: Vec<&str> = TaskState::ALL.iter().filter(|s| !s.is_final()).map(|s| s.as_str()).collect();
    let counted: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM tasks WHERE state = ANY($1) GROUP BY state")
            .bind(&unfinished)
            .fetch_all(pool)
            .await?;
    Ok(TaskState::ALL
        .iter()
        .filter(|s| !s.is_final())
        .map(|s| (*s, counted.iter().find(|(k, _)| k == s.as_str()).map_or(0, |(_, n)| *n)))
        .collect())
}

/// Applies `input` to a locked row, carries out the effects and publishes the
/// status if anything visible changed. Returns the row as it now stands, for the
/// caller to store before its transaction commits ([`save_all`]): a batch or a
/// round stores each task once, however many inputs it applied.
pub async fn apply(
    tx: &mut PgConnection,
    ctx: Context<'_>,
    row: &TaskRow,
    input: Input,
    now: Micros,
) -> Result<TaskRow, fenceline_bus::Error> {
    let policy = policy(ctx.catalog, &row.kind, ctx.settings);
    let transition = row.lifecycle.apply(input, now, &policy);
    count_policy_resends(ctx.catalog, row, &transition.task);
    if let Some(state) = row.lifecycle.ended_in(&transition.task) {
        ctx.ends.keep(ctx.catalog, &row.kind, state, row.accepted_at, now);
    }
    let mut version = row.version;
    for effect in &transition.effects {
        carry_out(tx, ctx, row, &transition.task, effect, now).await?;
    }
    if transition.visible {
        version += 1;
        ctx.publish_status(tx, status_of(row, &transition.task, version, now)).await?;
    }
    Ok(TaskRow { lifecycle: transition.task, version, ..row.clone() })
}

/// Counts the new operations the catalogue's standing decision sent in this
/// transition, by provider and step (`fenceline_policy_resends_total`). A batch
/// that rolls back counts them again when it is applied again: the counter may
/// run ahead of the extra charges, never behind them.
fn count_policy_resends(catalog: &Catalog, row: &TaskRow, task: &Task) {
    for (step, made) in &task.sent_again {
        let before = row.lifecycle.sent_again.get(step).copied().unwrap_or(0);
        if *made > before {
            let provider = catalog
                .kind(&row.kind)
                .and_then(|k| k.steps.iter().find(|s| &s.name == step))
                .and_then(|s| s.call())
                .map_or("", |(provider, _)| provider);
            fenceline_telemetry::metrics::global().scheduler.policy_resent(provider, step, u64::from(made - before));
        }
    }
}

/// Stores the lifecycles of `rows`, each locked by this transaction, with one
/// statement; a due time among them wakes the dispatchers when it commits.
pub async fn save_all(tx: &mut PgConnection, ctx: Context<'_>, rows: &[TaskRow]) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let (mut ids, mut lifecycles, mut states, mut due, mut versions, mut providers) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for row in rows {
        let task = &row.lifecycle;
        ids.push(row.task_id.as_uuid());
        lifecycles.push(sqlx::types::Json(task));
        states.push(task.state.as_str());
        due.push(due_at(task));
        versions.push(row.version);
        providers
            .push(ctx.catalog.kind(&row.kind).and_then(|k| k.slot_provider_after(task.resume_after_step.as_deref())));
    }
    sqlx::query(
        "WITH saved AS (UPDATE tasks t SET lifecycle = u.lifecycle, state = u.state, due_at_us = u.due_at_us, \
           version = u.version, provider = coalesce(u.provider, t.provider), updated_at = now() \
           FROM unnest($1::uuid[], $2::jsonb[], $3::text[], $4::bigint[], $5::bigint[], $6::text[]) \
             AS u (task_id, lifecycle, state, due_at_us, version, provider) \
           WHERE t.task_id = u.task_id RETURNING t.due_at_us) \
         SELECT pg_notify($7, '') FROM (SELECT 1 FROM saved WHERE due_at_us IS NOT NULL LIMIT 1) AS due",
    )
    .bind(ids)
    .bind(lifecycles)
    .bind(states)
    .bind(due)
    .bind(versions)
    .bind(providers)
    .bind(ctx.channel)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The columns a task's first insert stores beside its [`TaskRow`].
#[derive(Debug, Clone)]
pub struct NewRow {
    /// 0 high, 1 normal, 2 low.
    pub priority: i16,
    /// The provider of its first slot, if its kind calls one.
    pub provider: Option<String>,
    pub deadline_us: Option<Micros>,
}

/// Inserts, with one statement, the rows of tasks a consumer batch accepted, as
/// the batch's events left them, and wakes the dispatchers at commit if one is
/// due. A task with requests kept from before it arrived (`early_requests`), or
/// one stored meanwhile, is not inserted: `false` then, and the caller applies its
/// batch again one event at a time, where its acceptance takes those requests.
pub async fn insert_all(
    tx: &mut PgConnection,
    ctx: Context<'_>,
    rows: &[(TaskRow, NewRow)],
) -> Result<bool, sqlx::Error> {
    if rows.is_empty() {
        return Ok(true);
    }
    let mut columns = NewColumns::default();
    for (row, new) in rows {
        let task = &row.lifecycle;
        columns.ids.push(row.task_id.as_uuid());
        columns.tenants.push(row.tenant.as_str());
        columns.kinds.push(row.kind.as_str());
        columns.inputs.push(row.input_json.as_str());
        columns.priorities.push(new.priority);
        columns.providers.push(new.provider.as_deref());
        columns.lifecycles.push(sqlx::types::Json(task));
        columns.states.push(task.state.as_str());
        columns.deadlines.push(new.deadline_us);
        columns.traceparents.push(row.traceparent.as_deref());
        columns.due.push(due_at(task));
        columns.versions.push(row.version);
        columns.accepted_at.push(row.accepted_at);
        columns.pending_signals.push(row.pending_signal.as_deref());
        columns.pending_steps.push(row.pending_step.as_deref());
    }
    let (inserted, _woken): (i64, i64) = sqlx::query_as(
        "WITH given AS (SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int2[], $6::text[], \
             $7::jsonb[], $8::text[], $9::int8[], $10::text[], $11::int8[], $12::int8[], $13::int8[], $14::text[], \
             $15::text[]) \
           AS g (task_id, tenant, kind, input_json, priority, provider, lifecycle, state, deadline_us, traceparent, \
             due_at_us, version, accepted_at_us, pending_signal, pending_step)), \
         inserted AS ( \
           INSERT INTO tasks (task_id, tenant, kind, input_json, priority, provider, lifecycle, state, deadline_us, \
             traceparent, due_at_us, version, accepted_at, pending_signal, pending_step) \
           SELECT task_id, tenant, kind, input_json, priority, provider, lifecycle, state, deadline_us, traceparent, \
             due_at_us, version, to_timestamp(accepted_at_us::float8 / 1000000), pending_signal, pending_step \
           FROM given g WHERE NOT EXISTS (SELECT 1 FROM early_requests e WHERE e.task_id = g.task_id) \
           ORDER BY task_id \
           ON CONFLICT (task_id) DO NOTHING RETURNING due_at_us) \
         SELECT (SELECT count(*) FROM inserted), \
           (SELECT count(*) FROM (SELECT pg_notify($16, '') FROM (SELECT 1 FROM inserted WHERE due_at_us IS NOT NULL \
             LIMIT 1) AS due) AS woken)",
    )
    .bind(columns.ids)
    .bind(columns.tenants)
    .bind(columns.kinds)
    .bind(columns.inputs)
    .bind(columns.priorities)
    .bind(columns.providers)
    .bind(columns.lifecycles)
    .bind(columns.states)
    .bind(columns.deadlines)
    .bind(columns.traceparents)
    .bind(columns.due)
    .bind(columns.versions)
    .bind(columns.accepted_at)
    .bind(columns.pending_signals)
    .bind(columns.pending_steps)
    .bind(ctx.channel)
    .fetch_one(&mut *tx)
    .await?;
    Ok(usize::try_from(inserted).is_ok_and(|n| n == rows.len()))
}

/// [`insert_all`]'s parameters, one array per column.
#[derive(Default)]
struct NewColumns<'a> {
    ids: Vec<uuid::Uuid>,
    tenants: Vec<&'a str>,
    kinds: Vec<&'a str>,
    inputs: Vec<&'a str>,
    priorities: Vec<i16>,
    providers: Vec<Option<&'a str>>,
    lifecycles: Vec<sqlx::types::Json<&'a Task>>,
    states: Vec<&'a str>,
    deadlines: Vec<Option<Micros>>,
    traceparents: Vec<Option<&'a str>>,
    due: Vec<Option<Micros>>,
    versions: Vec<i64>,
    accepted_at: Vec<Micros>,
    pending_signals: Vec<Option<&'a str>>,
    pending_steps: Vec<Option<&'a str>>,
}

/// When the task next needs the dispatcher: its timer, or its deadline if that
/// comes first (the deadline is a timer too).
pub fn due_at(task: &Task) -> Option<Micros> {
    match (task.due_at, task.deadline) {
        (Some(due), Some(deadline)) => Some(due.min(deadline)),
        (due, _) => due,
    }
}

async fn carry_out(
    tx: &mut PgConnection,
    ctx: Context<'_>,
    row: &TaskRow,
    task: &Task,
    effect: &Effect,
    now: Micros,
) -> Result<(), fenceline_bus::Error> {
    match effect {
        Effect::Dispatch { grant_id, attempt, generation, resume_after_step } => {
            let kind = ctx.catalog.kind(&row.kind);
            // A slot at every provider the attempt calls: the first names the grant and
            // its slot is the grant's row in `slots`; the others' go to
            // `other_provider_slots`, which only this release knows (docs/execution.md, "Slots").
            let calls = kind.map(|k| k.calls_after(resume_after_step.as_deref())).unwrap_or_default();
            let provider = calls.first().map(|(name, _)| (*name).to_owned()).unwrap_or_default();
            let budget = kind.map_or(60_000, |k| k.attempt_budget_ms);
            let event = Event::AttemptGranted(AttemptGranted {
                grant_id: *grant_id,
                task_id: row.task_id,
                tenant: row.tenant.clone(),
                attempt: i32::try_from(*attempt).unwrap_or(i32::MAX),
                generation: i32::try_from(*generation).unwrap_or(i32::MAX),
                kind: row.kind.clone(),
                input_json: row.input_json.clone(),
                resume_after_step: resume_after_step.clone(),
                provider: provider.clone(),
                slot: format!("{provider}/{}", row.tenant),
                lease_budget_ms: i64::try_from(budget).unwrap_or(i64::MAX),
                deadline: task.deadline.map(Timestamp),
                granted_at: Timestamp(now),
            });
            let grant = GrantWrite {
                grant_id: grant_id.as_uuid(),
                task_id: row.task_id.as_uuid(),
                provider,
                tenant: row.tenant.clone(),
                kind: row.kind.clone(),
                // A slot whose end is never heard expires after twice the attempt budget.
                lifetime_us: i64::try_from(budget.saturating_mul(2_000)).unwrap_or(i64::MAX / 2),
                other_providers: calls.iter().skip(1).map(|(name, _)| (*name).to_owned()).collect(),
                announced: ctx.outbox.row(topics::DISPATCH, &event)?,
            };
            match ctx.slots {
                Some(batch) => batch.grant(grant),
                None => slots::write(tx, vec![grant]).await?,
            }
        }
        Effect::CancelAttempt { grant_id } => {
            let event = Event::CancelAttempt(CancelAttempt {
                task_id: row.task_id,
                grant_id: *grant_id,
                requested_at: Timestamp(now),
            });
            ctx.outbox.append(tx, topics::DISPATCH, None, &event).await?;
        }
        Effect::ReleaseSlot { grant_id } => match ctx.slots {
            Some(batch) => batch.release(*grant_id),
            None => slots::release(tx, ctx.channel, &[grant_id.as_uuid()]).await?,
        },
    }
    Ok(())
}

/// The snapshot users see, as published on `fenceline.status`.
pub fn status_of(row: &TaskRow, task: &Task, version: i64, now: Micros) -> Event {
    Event::TaskStatus(TaskStatus {
        task_id: row.task_id,
        tenant: row.tenant.clone(),
        kind: row.kind.clone(),
        state: task.state,
        reason: task.reason.clone(),
        attempt: i32::try_from(task.attempt).unwrap_or(i32::MAX),
        step: task.step.clone(),
        phase: task.phase,
        next_attempt_at: if task.state == TaskState::Waiting { task.due_at.map(Timestamp) } else { None },
        result: task.result.as_ref().map(artifact_ref),
        case_id: task.case_id.clone(),
        updated_at: Timestamp(now),
        version,
    })
}

pub fn artifact_ref(a: &Artifact) -> ArtifactRef {
    ArtifactRef { uri: a.uri.clone(), sha256: a.sha256.clone(), size_bytes: a.size_bytes }
}

pub fn artifact(a: &ArtifactRef) -> Artifact {
    Artifact { uri: a.uri.clone(), sha256: a.sha256.clone(), size_bytes: a.size_bytes }
}

#[cfg(test)]
mod tests;
