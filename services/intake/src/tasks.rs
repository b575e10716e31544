//! Submitting and reading tasks. A submission commits the idempotency record, the
//! task and its `TaskAccepted` event in one transaction and answers at once; reads
//! come from `task_view`, intake's projection of `fenceline.status`.

use std::collections::BTreeMap;

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{Priority, RecoveryDecision, TaskState};
use fenceline_events::{ArtifactRef, Event, TaskAccepted, Timestamp, topics};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use crate::auth::Tenant;
use crate::kinds::KindCatalog;
use crate::problem::ApiError;

/// The body of `POST /v1/tasks`.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitTask {
    /// One of the kinds this intake is configured for.
    pub kind: String,
    /// The task's input, a JSON object; checked against the kind's JSON Schema if it has one.
    #[schema(value_type = Object)]
    pub input: serde_json::Value,
    /// `high`, `normal` (the default) or `low`.
    #[serde(default)]
    #[schema(value_type = Option<String>, pattern = "^(high|normal|low)$")]
    pub priority: Option<String>,
    /// No attempt starts after this instant (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub deadline: Option<OffsetDateTime>,
    /// No attempt starts before this instant (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub not_before: Option<OffsetDateTime>,
    /// At most 32; keys 1 to 64 characters, values at most 256.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A submission that passed every check.
#[derive(Debug, Clone)]
pub struct ValidTask {
    pub kind: String,
    pub input: serde_json::Value,
    pub priority: Priority,
    pub deadline: Option<OffsetDateTime>,
    pub not_before: Option<OffsetDateTime>,
    pub labels: BTreeMap<String, String>,
}

/// An `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(raw: &str) -> Result<Self, ApiError> {
        if raw.is_empty() || raw.len() > 255 || !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiError::IdempotencyKeyInvalid(
                "Idempotency-Key must be 1 to 255 visible ASCII characters".into(),
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl SubmitTask {
    /// Checks the request against the configured kinds and its own rules.
    pub fn validate(self, kinds: &KindCatalog) -> Result<ValidTask, ApiError> {
        if !self.input.is_object() {
            return Err(ApiError::InvalidRequest("input: must be a JSON object".into()));
        }
        if self.kind.contains('\0') {
            return Err(nul_refused("kind"));
        }
        storable("input", &self.input)?;
        if self.labels.iter().any(|(k, v)| k.contains('\0') || v.contains('\0')) {
            return Err(nul_refused("labels"));
        }
        kinds.check(&self.kind, &self.input)?;
        let priority = match self.priority.as_deref() {
            None => Priority::Normal,
            Some(p) => p.parse().map_err(|e: fenceline_domain::vocabulary::UnknownWord| {
                ApiError::InvalidRequest(format!("priority: {e}"))
            })?,
        };
        // Instants travel as microseconds since the epoch; none before it is meant.
        for (field, instant) in [("deadline", self.deadline), ("not_before", self.not_before)] {
            if let Some(instant) = instant
                && Timestamp::from(instant).checked().is_err()
            {
                return Err(ApiError::InvalidRequest(format!("{field}: must not be before 1970-01-01T00:00:00Z")));
            }
        }
        if let (Some(deadline), Some(not_before)) = (self.deadline, self.not_before)
            && deadline <= not_before
        {
            return Err(ApiError::InvalidRequest("deadline must be after not_before".into()));
        }
        if self.labels.len() > 32 || self.labels.iter().any(|(k, v)| k.is_empty() || k.len() > 64 || v.len() > 256) {
            return Err(ApiError::InvalidRequest(
                "labels: at most 32, keys 1 to 64 characters, values at most 256".into(),
            ));
        }
        Ok(ValidTask {
            kind: self.kind,
            input: self.input,
            priority,
            deadline: self.deadline,
            not_before: self.not_before,
            labels: self.labels,
        })
    }
}

/// Refuses JSON that Postgres cannot store: text with a NUL character (`\u0000`)
/// anywhere, in a key or a value.
pub fn storable(what: &str, value: &serde_json::Value) -> Result<(), ApiError> {
    fn has_nul(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if has_nul(value) {
        return Err(nul_refused(what));
    }
    Ok(())
}

pub(crate) fn nul_refused(what: &str) -> ApiError {
    ApiError::InvalidRequest(format!("{what}: text may not contain the NUL character (\\u0000)"))
}

impl ValidTask {
    /// The fingerprint of the canonical request: the same request, however its JSON
    /// was spelled (key order, spacing), has the same fingerprint.
    ///
    /// Do not change: stored fingerprints would stop matching their requests.
    pub fn fingerprint(&self) -> Vec<u8> {
        let canonical = serde_json::json!({
            "kind": self.kind,
            "input": self.input,
            "priority": self.priority.as_str(),
            "deadline": self.deadline.map(|t| Timestamp::from(t).0),
            "not_before": self.not_before.map(|t| Timestamp::from(t).0),
            "labels": self.labels,
        });
        // serde_json's maps are sorted by key, so the text is canonical.
        Sha256::digest(canonical.to_string().as_bytes()).to_vec()
    }
}

/// What a submission answers, first time and on every replay.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct Accepted {
    #[schema(value_type = String, format = Uuid)]
    pub task_id: TaskId,
    /// Where to read the task: `/v1/tasks/{task_id}`.
    pub status_url: String,
}

/// The outcome of a submission.
#[derive(Debug)]
pub enum Submitted {
    Created(Accepted),
    Replayed(Accepted),
}

/// Submits `task` under `key` for `tenant`, exactly once per key of `source`.
///
/// `source` (`api`, `webhook:{source}`, `topic:{source}`) is both the task's
/// recorded source and the key's namespace: the same key text from two sources
/// names two different submissions.
///
/// A concurrent request with the same key blocks on the key's unique index until
/// the first transaction ends, then replays its answer (or, if the first rolled
/// back, creates the task itself): it never gets a 409.
pub async fn submit(
    pool: &PgPool,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    key: &IdempotencyKey,
    task: ValidTask,
    source: &str,
) -> Result<Submitted, ApiError> {
    let mut tx = pool.begin().await?;
    let submitted = submit_in(&mut tx, outbox, tenant, key, task, source).await?;
    tx.commit().await?;
    // The task is accepted; the client has not heard so (a crash here loses only the answer).
    let _ = fenceline_bus::faults::drops("intake.after_accept_commit");
    if matches!(submitted, Submitted::Created(_)) {
        outbox.committed();
    }
    Ok(submitted)
}

/// The submission inside the caller's transaction (the upstream topic's consumer
/// submits inside its batch transaction). Claiming the key, storing the task, its
/// `TaskAccepted` in the outbox and the change mark are one statement, each part
/// written only if the key was new.
pub async fn submit_in(
    conn: &mut PgConnection,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    key: &IdempotencyKey,
    task: ValidTask,
    source: &str,
) -> Result<Submitted, ApiError> {
    let fingerprint = task.fingerprint();
    let task_id = TaskId::new_v7();
    let accepted_at = OffsetDateTime::now_utc();
    let event = Event::TaskAccepted(TaskAccepted {
        task_id,
        tenant: tenant.as_str().to_owned(),
        kind: task.kind.clone(),
        input_json: task.input.to_string(),
        priority: task.priority,
        deadline: task.deadline.map(Timestamp::from),
        not_before: task.not_before.map(Timestamp::from),
        labels: task.labels.clone().into_iter().collect(),
        source: source.to_owned(),
        accepted_at: Timestamp::from(accepted_at),
    });
    let row = outbox.row(topics::TASKS, &event)?;
    // The source is the key's namespace: keys of different sources never meet.
    let statement = format!(
        "WITH claimed_key AS ( \
           INSERT INTO idempotency_keys (tenant, namespace, idempotency_key, fingerprint, task_id) \
           VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING task_id, tenant), \
         accepted AS ( \
           INSERT INTO tasks (task_id, tenant, kind, input, priority, deadline, not_before, labels, source, \
             accepted_at, traceparent) \
           SELECT task_id, tenant, $6::text, $7::jsonb, $8::text, $9::timestamptz, $10::timestamptz, $11::jsonb, \
             $2::text, $12::timestamptz, {traceparent}::text FROM claimed_key RETURNING task_id, tenant), \
         {outbox}, {marked} SELECT count(*) FROM marked",
        traceparent = fenceline_bus::OutboxRow::traceparent_parameter(13),
        outbox = fenceline_bus::OutboxRow::inserted_after("accepted", 13),
        marked = crate::live::marked_from("accepted"),
    );
    let query = sqlx::query(&statement)
        .bind(tenant.as_str())
        .bind(source)
        .bind(&key.0)
        .bind(&fingerprint)
        .bind(task_id.as_uuid())
        .bind(&task.kind)
        .bind(&task.input)
        .bind(task.priority.as_str())
        .bind(task.deadline)
        .bind(task.not_before)
        .bind(sqlx::types::Json(&task.labels))
        .bind(accepted_at);
    let created: i64 = sqlx::Row::try_get(&row.bind(query).fetch_one(&mut *conn).await?, 0)?;
    if created == 0 {
        let (stored, existing): (Vec<u8>, uuid::Uuid) = sqlx::query_as(
            "SELECT fingerprint, task_id FROM idempotency_keys \
             WHERE tenant = $1 AND namespace = $2 AND idempotency_key = $3",
        )
        .bind(tenant.as_str())
        .bind(source)
        .bind(&key.0)
        .fetch_one(&mut *conn)
        .await?;
        return if stored == fingerprint {
            Ok(Submitted::Replayed(accepted(TaskId::from_uuid(existing))))
        } else {
            Err(ApiError::IdempotencyKeyReused)
        };
    }
    tracing::info!(task_id = %task_id, tenant = tenant.as_str(), kind = %task.kind, source, "task accepted");
    Ok(Submitted::Created(accepted(task_id)))
}

fn accepted(task_id: TaskId) -> Accepted {
    Accepted { task_id, status_url: format!("/v1/tasks/{task_id}") }
}

/// What `GET /v1/tasks/{id}` shows.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct TaskView {
    #[schema(value_type = String, format = Uuid)]
    pub task_id: TaskId,
    pub kind: String,
    /// The labels the task was submitted with.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(with = "time::serde::rfc3339")]
    pub accepted_at: OffsetDateTime,
    /// `queued`, `waiting`, `running`, `awaiting_approval`, `succeeded`, `failed`,
    /// `cancelled`, `outcome_unknown` or `needs_human`.
    pub state: String,
    /// Why the task is in its state, in words.
    pub reason: Option<String>,
    /// The number of the latest attempt; 0 before the first.
    pub attempt: i32,
    /// The step the latest attempt is at.
    pub step: Option<String>,
    /// The call phase of that step.
    pub phase: Option<String>,
    /// When waiting: when the next attempt may start.
    #[serde(with = "time::serde::rfc3339::option")]
    pub next_attempt_at: Option<OffsetDateTime>,
    /// The verified result, once the task succeeded.
    #[schema(value_type = Option<fenceline_events::ArtifactRef>)]
    pub result: Option<serde_json::Value>,
    pub case_id: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub updated_at: OffsetDateTime,
    /// Grows with every change the scheduler publishes.
    pub version: i64,
    /// For `outcome_unknown` and `needs_human` (single reads only): the case a
    /// resolution names, its evidence, and what each resolution would do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub case: Option<CaseView>,
    /// Single reads only: every attempt a worker took up, oldest first, with how it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Vec<AttemptView>>,
    /// Single reads only: everything intake heard about the task and what people
    /// asked of it, oldest first (docs/dashboard.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Vec<crate::timeline::TimelineEntry>>,
    /// Single reads of a task in `awaiting_approval`: the signal its step waits
    /// for (`POST /v1/tasks/{id}/signals/{name}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaiting_signal: Option<String>,
    /// Single reads only: the trace the task's first traced event belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// Single reads only: the input the task was submitted with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub input: Option<serde_json::Value>,
    /// Single reads only: what each finished step produced, in the order the steps
    /// finished (every generation's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<crate::decisions::StepOutput>>,
    /// Single reads of a task in `awaiting_approval`: the card of the wait, what
    /// an approval lets happen next and what it rests on, with the digest a
    /// decision names (`POST /v1/tasks/{id}/approve` or `/reject`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::decisions::ApprovalCard>,
    /// Single reads only: every decision people made about the task's waits,
    /// with what each was made on, oldest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decisions: Option<Vec<crate::decisions::DecisionView>>,
    /// Single reads only: every case a person resolved, oldest first, with who
    /// resolved it, their note, and the evidence they were shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_cases: Option<Vec<ResolvedCase>>,
}

/// A case a person resolved, as it stays on record after the task moved on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct ResolvedCase {
    pub case_id: String,
    /// `retry_as_new`, `accept_failed` or `attach_result`.
    pub action: String,
    pub charge_acknowledged: bool,
    #[schema(value_type = Option<Object>)]
    pub attached_result: Option<sqlx::types::Json<ArtifactRef>>,
    /// The person's name, or the token's tenant when none was given.
    pub decided_by: String,
    /// The identity of the token used; absent for resolutions recorded before it was kept.
    pub token_identity: Option<String>,
    pub note: Option<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub decided_at: OffsetDateTime,
    /// The evidence the case showed when it was resolved (empty for resolutions
    /// recorded before it was kept).
    #[schema(value_type = Vec<EvidenceView>)]
    pub evidence: sqlx::types::Json<Vec<EvidenceView>>,
}

/// One attempt as the executor reported it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct AttemptView {
    pub attempt: i32,
    /// `running`, `succeeded`, `failed`, `released` (handed back without a call:
    /// busy, waiting for a signal, cancelled, shutting down) or `lost` (its worker
    /// vanished; then `recovery` says what the evidence decided).
    pub outcome: String,
    /// For `failed`: the error class (docs/provider-protocol.md).
    pub error_class: Option<String>,
    /// The failure's message, the release reason, or the phase a lost worker was last seen in.
    pub detail: Option<String>,
    /// For `failed`: whether the provider may have charged for it.
    pub money_may_have_been_spent: Option<bool>,
    /// For `lost`: the reconciler's decision (`recovered`, `retry_safe`, `outcome_unknown`).
    pub recovery: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub started_at: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub ended_at: Option<OffsetDateTime>,
}

/// An `outcome_unknown` case as a person needs it to decide.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CaseView {
    pub case_id: String,
    pub evidence: Vec<EvidenceView>,
    /// What each resolution of `POST /v1/tasks/{id}/resolution` would do.
    pub resolutions: BTreeMap<String, String>,
}

/// One observation the decision rests on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EvidenceView {
    /// Who observed it: the executor's records, the provider's look-up, ...
    pub source: String,
    #[serde(with = "time::serde::rfc3339")]
    pub observed_at: OffsetDateTime,
    pub finding: String,
}

impl From<fenceline_events::Evidence> for EvidenceView {
    fn from(e: fenceline_events::Evidence) -> Self {
        EvidenceView { source: e.source, observed_at: e.observed_at.to_datetime(), finding: e.finding }
    }
}

impl CaseView {
    /// What each resolution does, for a case at `step` (the step in doubt, when the
    /// status names it). Only the step in doubt is called again: the steps before
    /// it keep their verified results.
    fn resolutions(step: Option<&str>) -> BTreeMap<String, String> {
        let again = match step {
            Some(step) => format!("calls step `{step}` again"),
            None => "calls the step in doubt again".to_owned(),
        };
        BTreeMap::from([
            (
                "retry_as_new".to_owned(),
                format!(
                    "{again}: at a provider that dedupes by operation key under the key in doubt, so work the \
                     earlier request did is answered without a second charge; elsewhere as a new operation with a \
                     new operation key, so the provider may bill it again (needs acknowledge_possible_charge: \
                     true); the steps before it keep their verified results \
                     and are not called or billed again, and the steps after it run for the first time"
                ),
            ),
            ("accept_failed".to_owned(), "ends the task as failed; nothing is called".to_owned()),
            ("attach_result".to_owned(), "ends the task as succeeded with a result found elsewhere".to_owned()),
        ])
    }
}

/// A task joined with its projected status; the status is absent until the
/// scheduler's first snapshot arrives.
#[derive(Debug, sqlx::FromRow)]
struct Row {
    task_id: uuid::Uuid,
    kind: String,
    labels: sqlx::types::Json<BTreeMap<String, String>>,
    accepted_at: OffsetDateTime,
    state: Option<String>,
    reason: Option<String>,
    attempt: Option<i32>,
    step: Option<String>,
    phase: Option<String>,
    next_attempt_at: Option<OffsetDateTime>,
    result: Option<serde_json::Value>,
    case_id: Option<String>,
    updated_at: Option<OffsetDateTime>,
    version: Option<i64>,
}

const SELECT_ROWS: &str = "SELECT t.task_id, t.kind, t.labels, t.accepted_at, v.state, v.reason, v.attempt, v.step, v.phase, \
     v.next_attempt_at, v.result, v.case_id, v.updated_at, v.version \
     FROM tasks t LEFT JOIN task_view v ON v.task_id = t.task_id";

impl From<Row> for TaskView {
    /// A task accepted but not yet projected reads as `queued`.
    fn from(row: Row) -> Self {
        let projected = row.state.is_some();
        TaskView {
            task_id: TaskId::from_uuid(row.task_id),
            kind: row.kind,
            labels: row.labels.0,
            accepted_at: row.accepted_at,
            state: row.state.unwrap_or_else(|| TaskState::Queued.as_str().to_owned()),
            reason: if projected { row.reason } else { Some("accepted; not yet scheduled".into()) },
            attempt: row.attempt.unwrap_or(0),
            step: row.step,
            phase: row.phase,
            next_attempt_at: row.next_attempt_at,
            result: row.result,
            case_id: row.case_id,
            updated_at: row.updated_at.unwrap_or(row.accepted_at),
            version: row.version.unwrap_or(0),
            case: None,
            attempts: None,
            timeline: None,
            awaiting_signal: None,
            trace_id: None,
            input: None,
            steps: None,
            approval: None,
            decisions: None,
            resolved_cases: None,
        }
    }
}

/// The evidence a task's open case shows in `state`: the reconciler's for
/// `outcome_unknown`, and for `needs_human` the scheduler's reason, which is why
/// it needs a person.
pub(crate) async fn case_evidence(
    conn: &mut sqlx::PgConnection,
    task_id: TaskId,
    state: &str,
) -> Result<Vec<EvidenceView>, sqlx::Error> {
    if state == TaskState::NeedsHuman.as_str() {
        let reason: Option<(Option<String>, OffsetDateTime)> =
            sqlx::query_as("SELECT reason, updated_at FROM task_view WHERE task_id = $1")
                .bind(task_id.as_uuid())
                .fetch_optional(&mut *conn)
                .await?;
        return Ok(reason
            .map(|(finding, observed_at)| EvidenceView {
                source: "scheduler".into(),
                observed_at,
                finding: finding.unwrap_or_default(),
            })
            .into_iter()
            .collect());
    }
    let evidence: Option<sqlx::types::Json<Vec<fenceline_events::Evidence>>> =
        sqlx::query_scalar("SELECT evidence FROM task_cases WHERE task_id = $1")
            .bind(task_id.as_uuid())
            .fetch_optional(&mut *conn)
            .await?;
    Ok(evidence.map(|e| e.0.into_iter().map(EvidenceView::from).collect()).unwrap_or_default())
}

/// The task as the caller's tenant sees it. Another tenant's task is not found,
/// exactly like a task that does not exist.
pub async fn read(pool: &PgPool, kinds: &KindCatalog, tenant: &Tenant, task_id: TaskId) -> Result<TaskView, ApiError> {
    let row: Option<Row> = sqlx::query_as(&format!("{SELECT_ROWS} WHERE t.task_id = $1 AND t.tenant = $2"))
        .bind(task_id.as_uuid())
        .bind(tenant.as_str())
        .fetch_optional(pool)
        .await?;
    let mut view = row.map(TaskView::from).ok_or_else(|| ApiError::TaskNotFound(task_id.to_string()))?;
    if view.state == TaskState::OutcomeUnknown.as_str() {
        let case_id: Option<String> = sqlx::query_scalar("SELECT case_id FROM task_cases WHERE task_id = $1")
            .bind(task_id.as_uuid())
            .fetch_optional(pool)
            .await?;
        if let Some(case_id) = case_id {
            let evidence = case_evidence(&mut *pool.acquire().await?, task_id, &view.state).await?;
            view.case = Some(CaseView { case_id, evidence, resolutions: CaseView::resolutions(view.step.as_deref()) });
        }
    }
    // The scheduler names the case of a task that needs a person; its reason is the evidence.
    if view.state == TaskState::NeedsHuman.as_str()
        && let Some(case_id) = view.case_id.clone()
    {
        let evidence = case_evidence(&mut *pool.acquire().await?, task_id, &view.state).await?;
        view.case = Some(CaseView { case_id, evidence, resolutions: CaseView::resolutions(view.step.as_deref()) });
    }
    view.resolved_cases = Some(
        sqlx::query_as(
            "SELECT case_id, action, charge_acknowledged, attached_result, decided_by, token_identity, note, \
             decided_at, coalesce(evidence, '[]'::jsonb) AS evidence FROM resolutions WHERE task_id = $1 \
             ORDER BY decided_at",
        )
        .bind(task_id.as_uuid())
        .fetch_all(pool)
        .await?,
    );
    view.attempts = Some(
        sqlx::query_as(
            "SELECT attempt, outcome, error_class, detail, money_may_have_been_spent, recovery, started_at, ended_at \
             FROM task_attempts WHERE task_id = $1 ORDER BY attempt",
        )
        .bind(task_id.as_uuid())
        .fetch_all(pool)
        .await?,
    );
    let timeline = crate::timeline::read(pool, task_id, TIMELINE_LIMIT).await?;
    view.trace_id = timeline.iter().find_map(|line| line.trace_id.clone());
    if view.state == TaskState::AwaitingApproval.as_str() {
        // The executor's announcement of the wait may arrive after the scheduler's
        // status: until then the catalogue says what the step waits for.
        view.awaiting_signal =
            timeline.iter().rev().find(|line| line.event == "AwaitingSignal").and_then(|l| l.signal.clone()).or_else(
                || view.step.as_deref().and_then(|step| kinds.signal_awaited_at(&view.kind, step)).map(str::to_owned),
            );
    }
    view.timeline = Some(timeline);
    let mut conn = pool.acquire().await?;
    let input: Option<serde_json::Value> = sqlx::query_scalar("SELECT input FROM tasks WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .fetch_optional(&mut *conn)
        .await?;
    view.input = input;
    let outputs = crate::decisions::outputs(&mut conn, task_id).await?;
    if let (Some(step), Some(signal)) = (view.step.clone(), view.awaiting_signal.clone()) {
        let generation = crate::decisions::generation(&mut conn, task_id).await?;
        let mut card = crate::decisions::card(kinds, &view.kind, &step, &signal, generation, &outputs);
        crate::decisions::show_request(kinds, &mut card, view.input.as_ref().unwrap_or(&serde_json::Value::Null));
        view.approval = Some(card);
    }
    view.steps = Some(outputs);
    view.decisions = Some(crate::decisions::recorded(&mut conn, task_id).await?);
    Ok(view)
}

/// The most lines a single read shows of a task's timeline.
const TIMELINE_LIMIT: i64 = 1000;

/// The task as a listing shows it, and when intake's projections last changed it
/// (the event streams' ids); `None` if the tenant has no such task.
pub async fn summary(
    pool: &PgPool,
    tenant: &Tenant,
    task_id: TaskId,
) -> Result<Option<(TaskView, Option<OffsetDateTime>)>, sqlx::Error> {
    let row: Option<Row> = sqlx::query_as(&format!("{SELECT_ROWS} WHERE t.task_id = $1 AND t.tenant = $2"))
        .bind(task_id.as_uuid())
        .bind(tenant.as_str())
        .fetch_optional(pool)
        .await?;
    let Some(row) = row else { return Ok(None) };
    let changed_at: Option<OffsetDateTime> =
        sqlx::query_scalar("SELECT changed_at FROM task_changes WHERE task_id = $1")
            .bind(task_id.as_uuid())
            .fetch_optional(pool)
            .await?;
    Ok(Some((TaskView::from(row), changed_at)))
}

/// Projects the `outcome_unknown` decisions of `fenceline.recovery` with their
/// evidence, for reads.
#[derive(Debug, Default)]
pub struct CaseProjection {
    batch: BatchWrites,
}

impl Handler for CaseProjection {
    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        Ok(self.batch.flush(tx).await?)
    }

    fn discard(&self) {
        self.batch.discard();
    }

    async fn handle(&self, tx: &mut PgConnection, _outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        let Event::RecoveryDecided(decided) = &record.envelope.event else {
            return Ok(());
        };
        self.batch.lines.gather(record);
        self.batch.marks.mark(decided.task_id, None);
        // A decision about an attempt whose outcome was in doubt belongs on that attempt
        // (the attempt's own event may arrive later, on another topic).
        if decided.decision != RecoveryDecision::ReissueGrant {
            sqlx::query(
                "INSERT INTO task_attempts (task_id, attempt, outcome, recovery) VALUES ($1, $2, 'lost', $3) \
                 ON CONFLICT (task_id, attempt) DO UPDATE SET recovery = EXCLUDED.recovery",
            )
            .bind(decided.task_id.as_uuid())
            .bind(decided.attempt)
            .bind(decided.decision.as_str())
            .execute(&mut *tx)
            .await?;
        }
        let Some(case_id) = decided.case_id.as_ref().filter(|_| decided.decision.as_str() == "outcome_unknown") else {
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
}

/// Projects the executor's reports on `fenceline.attempts` into `task_attempts`:
/// when each attempt was taken up and how it ended.
#[derive(Debug, Default)]
pub struct AttemptProjection {
    batch: BatchWrites,
}

impl Handler for AttemptProjection {
    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        Ok(self.batch.flush(tx).await?)
    }

    fn discard(&self) {
        self.batch.discard();
    }

    async fn handle(&self, tx: &mut PgConnection, _outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        if let Some(task_id) = self.batch.lines.gather(record) {
            self.batch.marks.mark(task_id, None);
        }
        let attempts = &self.batch.attempts;
        match &record.envelope.event {
            Event::StepCheckpointed(e) => crate::decisions::record_output(tx, e).await?,
            Event::AttemptClaimed(e) => attempts.started(e.task_id, e.attempt, record.envelope.headers.produced_at),
            Event::AttemptSucceeded(e) => attempts.ended(e.task_id, e.attempt, Ended::at(e.finished_at, "succeeded")),
            Event::AttemptFailed(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended {
                    error_class: Some(e.error_class.as_str()),
                    detail: Some(e.message.clone()),
                    money_may_have_been_spent: Some(e.money_may_have_been_spent),
                    ..Ended::at(e.failed_at, "failed")
                },
            ),
            Event::AttemptReleased(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended { detail: Some(e.reason.as_str().to_owned()), ..Ended::at(e.released_at, "released") },
            ),
            Event::AttemptLost(e) => attempts.ended(
                e.task_id,
                e.attempt,
                Ended {
                    detail: Some(format!("worker last seen after `{}`", e.last_phase.as_str())),
                    ..Ended::at(e.detected_at, "lost")
                },
            ),
            _ => {}
        }
        Ok(())
    }

    /// Every report but an attempt's end, sent again: its timeline line is keyed by
    /// the event id and an attempt keeps its earliest start. An end is remembered,
    /// as the last end heard replaces the one before.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        !matches!(
            event,
            Event::AttemptSucceeded(_) | Event::AttemptFailed(_) | Event::AttemptReleased(_) | Event::AttemptLost(_)
        )
    }
}

/// How an attempt ended, as `task_attempts` keeps it.
#[derive(Debug, Clone)]
struct Ended {
    outcome: &'static str,
    error_class: Option<&'static str>,
    detail: Option<String>,
    money_may_have_been_spent: Option<bool>,
    at: Timestamp,
}

impl Ended {
    fn at(at: Timestamp, outcome: &'static str) -> Self {
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
            outcomes.push(ended.as_ref().map_or("running", |e| e.outcome));
            classes.push(ended.as_ref().and_then(|e| e.error_class));
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

/// Projects `fenceline.status` into `task_view`: the newest version wins, so a
/// late or repeated snapshot never moves a task backwards.
#[derive(Debug, Default)]
pub struct StatusProjection {
    batch: BatchWrites,
}

impl Handler for StatusProjection {
    /// Clients poll this projection for their task's state.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn flush(&self, tx: &mut PgConnection, _outbox: &OutboxWriter) -> Result<(), HandleError> {
        Ok(self.batch.flush(tx).await?)
    }

    fn discard(&self) {
        self.batch.discard();
    }

    async fn handle(
        &self,
        _tx: &mut PgConnection,
        _outbox: &OutboxWriter,
        record: &Inbound,
    ) -> Result<(), HandleError> {
        let Event::TaskStatus(status) = &record.envelope.event else {
            return Err(HandleError::Poison(format!(
                "{} does not belong on the status topic",
                record.envelope.event.event_type()
            )));
        };
        self.batch.views.gather(status);
        self.batch.lines.gather(record);
        self.batch.marks.mark(status.task_id, Some(&status.tenant));
        Ok(())
    }

    /// A snapshot sent again: the view keeps the newest version, the timeline line
    /// is keyed by the event id, and a mark only wakes the task's pages again.
    fn applies_twice_harmlessly(&self, event: &Event) -> bool {
        matches!(event, Event::TaskStatus(_))
    }
}

/// What a projection's consumer batch writes just before it commits
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
}

impl BatchWrites {
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        self.views.flush(&mut *tx).await?;
        self.attempts.flush(&mut *tx).await?;
        self.lines.flush(&mut *tx).await?;
        self.marks.flush(&mut *tx).await
    }

    fn discard(&self) {
        self.views.discard();
        self.attempts.discard();
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

/// A task intake accepted that no status of the scheduler's has ever been
/// projected for: its `TaskAccepted` is stuck in the outbox or was refused on the
/// way (dead-lettered), so nothing will run it and no other audit sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Unscheduled {
    pub task_id: uuid::Uuid,
    pub tenant: String,
    #[serde(with = "time::serde::rfc3339")]
    pub accepted_at: OffsetDateTime,
}

/// The tasks accepted longer than `after` ago that never reached the scheduler
/// (no row in `task_view`), oldest first, at most `limit`; and how many there are.
pub async fn unscheduled(
    pool: &PgPool,
    after: std::time::Duration,
    limit: i64,
) -> Result<(Vec<Unscheduled>, i64), sqlx::Error> {
    let cutoff = OffsetDateTime::now_utc() - after;
    let found: Vec<Unscheduled> = sqlx::query_as(
        "SELECT t.task_id, t.tenant, t.accepted_at FROM tasks t \
         WHERE t.accepted_at < $1 AND NOT EXISTS (SELECT 1 FROM task_view v WHERE v.task_id = t.task_id) \
         ORDER BY t.accepted_at LIMIT $2",
    )
    .bind(cutoff)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let count: i64 = if (found.len() as i64) < limit {
        found.len() as i64
    } else {
        sqlx::query_scalar(
            "SELECT count(*) FROM tasks t \
             WHERE t.accepted_at < $1 AND NOT EXISTS (SELECT 1 FROM task_view v WHERE v.task_id = t.task_id)",
        )
        .bind(cutoff)
        .fetch_one(pool)
        .await?
    };
    Ok((found, count))
}

/// The states after which nothing more happens to a task.
const FINISHED: [TaskState; 3] = [TaskState::Succeeded, TaskState::Failed, TaskState::Cancelled];

/// Deletes every row of tasks that finished (by their latest status) longer than
/// `retention` ago, `batch` tasks per transaction so no delete holds locks for
/// long; returns how many tasks went. Idempotency records have their own, shorter
/// retention.
pub async fn purge_finished_tasks(
    pool: &PgPool,
    retention: std::time::Duration,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let cutoff = OffsetDateTime::now_utc() - retention;
    let finished: Vec<&str> = FINISHED.iter().map(|s| s.as_str()).collect();
    let mut purged = 0;
    loop {
        let mut tx = pool.begin().await?;
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT task_id FROM task_view WHERE state = ANY($1) AND updated_at < $2 ORDER BY updated_at LIMIT $3",
        )
        .bind(&finished)
        .bind(cutoff)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        // Children first: actions reference their task.
        for table in [
            "decisions",
            "task_steps",
            "signals",
            "cancellations",
            "resolutions",
            "task_cases",
            "task_attempts",
            "task_timeline",
            "task_changes",
            "tasks",
            "task_view",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE task_id = ANY($1)")).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        purged += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(purged);
        }
    }
}

/// Deletes idempotency records older than the retention; returns how many.
pub async fn purge_idempotency_keys(pool: &PgPool, retention_hours: u32) -> Result<u64, sqlx::Error> {
    let result = sqlx::query("DELETE FROM idempotency_keys WHERE created_at < now() - make_interval(hours => $1)")
        .bind(retention_hours as i32)
        .execute(pool)
        .await?;
    Ok(result.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> SubmitTask {
        serde_json::from_str(json).expect("valid request JSON")
    }

    fn kinds() -> KindCatalog {
        KindCatalog::load(&["image.generate".into()], None).expect("no schemas")
    }

    #[test]
    fn the_same_request_spelled_differently_has_the_same_fingerprint() {
        let a = request(r#"{"kind":"image.generate","input":{"a":1,"b":[1,2]}}"#).validate(&kinds()).expect("valid");
        let b = request(r#"{ "input": {"b":[1,2], "a":1}, "kind":"image.generate", "priority":"normal" }"#)
            .validate(&kinds())
            .expect("valid");
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = request(r#"{"kind":"image.generate","input":{"a":2,"b":[1,2]}}"#).validate(&kinds()).expect("valid");
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let unknown = request(r#"{"kind":"nope","input":{}}"#).validate(&kinds()).expect_err("unknown kind");
        assert!(matches!(unknown, ApiError::UnknownKind(_)));
        let priority =
            request(r#"{"kind":"image.generate","input":{},"priority":"urgent"}"#).validate(&kinds()).expect_err("p");
        assert!(priority.to_string().contains("priority"), "{priority}");
        let window = request(
            r#"{"kind":"image.generate","input":{},"deadline":"2026-01-01T00:00:00Z","not_before":"2026-01-02T00:00:00Z"}"#,
        )
        .validate(&kinds())
        .expect_err("window");
        assert!(window.to_string().contains("deadline"));
        let before_1970 = request(r#"{"kind":"image.generate","input":{},"not_before":"1969-12-31T23:59:59Z"}"#)
            .validate(&kinds())
            .expect_err("before 1970");
        assert!(before_1970.to_string().contains("not_before"), "{before_1970}");
        assert!(serde_json::from_str::<SubmitTask>(r#"{"kind":"x","input":{},"extra":1}"#).is_err());
    }

    #[test]
    fn idempotency_keys_are_bounded_visible_ascii() {
        assert!(IdempotencyKey::parse("order-81723/v1").is_ok());
        for bad in ["", "with space", "ü", &"k".repeat(256)] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad}");
        }
    }
}

/// Filters of `GET /v1/tasks`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only tasks in this state.
    pub state: Option<String>,
    /// Only tasks of this kind.
    pub kind: Option<String>,
    /// `key:value`, a label the task carries.
    pub label: Option<String>,
    /// Accepted at or after (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub since: Option<OffsetDateTime>,
    /// Accepted before (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
    /// Page size, 1 to 200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// One page of tasks, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Page {
    pub tasks: Vec<TaskView>,
    /// Pass as `cursor` for the next page; absent on the last one.
    pub next_cursor: Option<String>,
}

/// The filters a listing and the counts share, checked.
#[derive(Debug)]
struct Filter {
    kind: Option<String>,
    /// `{key: value}`, for `labels @>`.
    label: Option<serde_json::Value>,
    since: Option<OffsetDateTime>,
    until: Option<OffsetDateTime>,
}

impl Filter {
    fn parse(
        kind: Option<String>,
        label: Option<String>,
        since: Option<OffsetDateTime>,
        until: Option<OffsetDateTime>,
    ) -> Result<Self, ApiError> {
        // Postgres cannot compare text holding a NUL character: refused here, not a 500.
        for (name, value) in [("kind", &kind), ("label", &label)] {
            if value.as_deref().is_some_and(|v| v.contains('\0')) {
                return Err(nul_refused(name));
            }
        }
        let label = match &label {
            Some(raw) => {
                let (k, v) =
                    raw.split_once(':').ok_or_else(|| ApiError::InvalidRequest("label: expected key:value".into()))?;
                Some(serde_json::json!({ k: v }))
            }
            None => None,
        };
        Ok(Filter { kind, label, since, until })
    }
}

/// The conditions of [`Filter`] on `tasks t`, with its values at `$2` to `$5`.
const FILTERED: &str = "t.tenant = $1 \
       AND ($2::text IS NULL OR t.kind = $2) \
       AND ($3::jsonb IS NULL OR t.labels @> $3) \
       AND ($4::timestamptz IS NULL OR t.accepted_at >= $4) \
       AND ($5::timestamptz IS NULL OR t.accepted_at < $5)";

/// Lists the tenant's tasks, newest first, by keyset pagination on the task id
/// (UUIDv7, so creation order): pages stay stable while new tasks arrive.
pub async fn list(pool: &PgPool, tenant: &Tenant, query: ListQuery) -> Result<Page, ApiError> {
    let filter = Filter::parse(query.kind, query.label, query.since, query.until)?;
    if let Some(state) = &query.state {
        state.parse::<TaskState>().map_err(|e| ApiError::InvalidRequest(format!("state: {e}")))?;
    }
    let cursor = match &query.cursor {
        Some(raw) => {
            Some(raw.parse::<TaskId>().map_err(|_| ApiError::InvalidRequest("cursor: not one this API gave".into()))?)
        }
        None => None,
    };
    let limit = i64::from(query.limit.unwrap_or(50));
    if !(1..=200).contains(&limit) {
        return Err(ApiError::InvalidRequest("limit: 1 to 200".into()));
    }
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "{SELECT_ROWS} WHERE {FILTERED} \
           AND ($6::text IS NULL OR coalesce(v.state, 'queued') = $6) \
           AND ($7::uuid IS NULL OR t.task_id < $7) \
         ORDER BY t.task_id DESC LIMIT $8"
    ))
    .bind(tenant.as_str())
    .bind(&filter.kind)
    .bind(&filter.label)
    .bind(filter.since)
    .bind(filter.until)
    .bind(&query.state)
    .bind(cursor.map(|c| c.as_uuid()))
    .bind(limit + 1)
    .fetch_all(pool)
    .await?;
    let more = rows.len() as i64 > limit;
    let tasks: Vec<TaskView> = rows.into_iter().take(limit as usize).map(TaskView::from).collect();
    let next_cursor = if more { tasks.last().map(|t| t.task_id.to_string()) } else { None };
    Ok(Page { tasks, next_cursor })
}

/// Filters of `GET /v1/summary`: those of the listing but the state.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SummaryQuery {
    /// Only tasks of this kind.
    pub kind: Option<String>,
    /// `key:value`, a label the task carries.
    pub label: Option<String>,
    /// Accepted at or after (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub since: Option<OffsetDateTime>,
    /// Accepted before (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
}

/// The caller's tenant and how many of its tasks are in each state.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Summary {
    /// The tenant of the token.
    pub tenant: String,
    /// Every state, with how many of the tenant's tasks (within the filters) are in it.
    pub states: BTreeMap<String, i64>,
}

/// Counts the tenant's tasks by state within the filters.
pub async fn summarise(pool: &PgPool, tenant: &Tenant, query: SummaryQuery) -> Result<Summary, ApiError> {
    let filter = Filter::parse(query.kind, query.label, query.since, query.until)?;
    let counted: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT coalesce(v.state, 'queued'), count(*) FROM tasks t LEFT JOIN task_view v ON v.task_id = t.task_id \
         WHERE {FILTERED} GROUP BY 1"
    ))
    .bind(tenant.as_str())
    .bind(&filter.kind)
    .bind(&filter.label)
    .bind(filter.since)
    .bind(filter.until)
    .fetch_all(pool)
    .await?;
    let mut states: BTreeMap<String, i64> = TaskState::ALL.iter().map(|s| (s.as_str().to_owned(), 0)).collect();
    states.extend(counted);
    Ok(Summary { tenant: tenant.as_str().to_owned(), states })
}
