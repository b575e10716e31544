//! Reading one task: its view from `task_view`, its attempts, its case with the
//! evidence, its steps' outputs, its timeline and decisions.

use std::collections::BTreeMap;

use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{AttemptOutcome, ErrorClass, RecoveryDecision, TaskState};
use fenceline_events::ArtifactRef;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use time::OffsetDateTime;

use fenceline_store::word::Stored;

use crate::auth::Tenant;
use crate::kinds::KindCatalog;
use crate::problem::ApiError;

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
    #[schema(value_type = String)]
    pub state: TaskState,
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
    #[schema(value_type = String)]
    #[sqlx(try_from = "String")]
    pub outcome: AttemptOutcome,
    /// For `failed`: the error class (docs/provider-protocol.md).
    #[schema(value_type = Option<String>)]
    pub error_class: Option<Stored<ErrorClass>>,
    /// The failure's message, the release reason, or the phase a lost worker was last seen in.
    pub detail: Option<String>,
    /// For `failed`: whether the provider may have charged for it.
    pub money_may_have_been_spent: Option<bool>,
    /// For `lost`: the reconciler's decision (`recovered`, `retry_safe`, `outcome_unknown`).
    #[schema(value_type = Option<String>)]
    pub recovery: Option<Stored<RecoveryDecision>>,
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
pub(super) struct Row {
    task_id: uuid::Uuid,
    kind: String,
    labels: sqlx::types::Json<BTreeMap<String, String>>,
    accepted_at: OffsetDateTime,
    state: Option<Stored<TaskState>>,
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

pub(super) const SELECT_ROWS: &str = "SELECT t.task_id, t.kind, t.labels, t.accepted_at, v.state, v.reason, v.attempt, v.step, v.phase, \
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
            state: row.state.map_or(TaskState::Queued, |Stored(state)| state),
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
    state: TaskState,
) -> Result<Vec<EvidenceView>, sqlx::Error> {
    if state == TaskState::NeedsHuman {
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
    if view.state == TaskState::OutcomeUnknown {
        let case_id: Option<String> = sqlx::query_scalar("SELECT case_id FROM task_cases WHERE task_id = $1")
            .bind(task_id.as_uuid())
            .fetch_optional(pool)
            .await?;
        if let Some(case_id) = case_id {
            let evidence = case_evidence(&mut *pool.acquire().await?, task_id, view.state).await?;
            view.case = Some(CaseView { case_id, evidence, resolutions: CaseView::resolutions(view.step.as_deref()) });
        }
    }
    // The scheduler names the case of a task that needs a person; its reason is the evidence.
    if view.state == TaskState::NeedsHuman
        && let Some(case_id) = view.case_id.clone()
    {
        let evidence = case_evidence(&mut *pool.acquire().await?, task_id, view.state).await?;
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
    if view.state == TaskState::AwaitingApproval {
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
