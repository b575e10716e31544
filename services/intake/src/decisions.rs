//! A person's decision about one wait of an approval step, and what it rests on:
//! the store of `task_steps` (the step outputs intake heard from the executor) and
//! `decisions` (approve or reject, who, the note, what it was made on), the card a
//! task in `awaiting_approval` shows, and the action that records a decision. A
//! decision is bound to its wait (step and generation) and, when it names one, to
//! the digest of the card the person read (`fenceline_domain::approvals`).

use std::collections::BTreeMap;

use fenceline_bus::OutboxWriter;
use fenceline_domain::approvals::{self, Heard};
use fenceline_domain::ids::TaskId;
use fenceline_domain::spend::Amount;
use fenceline_domain::vocabulary::{ApprovalDecision, ResolutionAction, TaskState};
use fenceline_events::{Event, SignalReceived, StepCheckpointed, Timestamp, topics};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use fenceline_store::word::Stored;

use crate::actions::ActionAccepted;
use crate::auth::{Tenant, TokenIdentity};
use crate::kinds::{KindCatalog, NextStep};
use crate::problem::ApiError;

/// What one finished step produced, as intake shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct StepOutput {
    pub step: String,
    /// The generation that ran the step (`retry_as_new` resolutions before it).
    pub generation: i32,
    /// What the step produced: an inline result's JSON value, or a file result's
    /// reference (`uri`, `sha256`, `size_bytes`). Absent when it was too large to
    /// travel with its checkpoint; `output_ref` still names it.
    #[schema(value_type = Option<Object>)]
    pub output: Option<serde_json::Value>,
    /// For a file result: the link to the artifact.
    #[sqlx(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_uri: Option<String>,
    /// Where the executor checkpointed the output.
    pub output_ref: String,
    /// The provider the step called; absent for an approval step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// What the call cost as the catalogue prices it, in the currency's minor unit;
    /// absent when unpriced.
    #[sqlx(skip)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<f64>)]
    pub cost_minor: Option<Amount>,
    #[serde(skip)]
    #[schema(ignore)]
    cost_micros: Option<i64>,
    /// The sha256 of the result (of an artifact's bytes, or of an inline value's canonical JSON).
    pub sha256: String,
    #[serde(with = "time::serde::rfc3339")]
    pub checkpointed_at: OffsetDateTime,
}

impl StepOutput {
    /// The output a card shows and a digest covers: the value, or, when it did not
    /// travel, its reference and checksum.
    fn shown(&self) -> serde_json::Value {
        self.output
            .clone()
            .unwrap_or_else(|| serde_json::json!({ "output_ref": self.output_ref, "sha256": self.sha256 }))
    }
}

/// Records the step outputs announced by the executor, with one statement. A
/// repeated announcement changes nothing: a step's output within a generation is
/// fixed.
pub async fn record_outputs(tx: &mut PgConnection, heard: &[StepCheckpointed]) -> Result<(), sqlx::Error> {
    if heard.is_empty() {
        return Ok(());
    }
    let mut columns = (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    for e in heard {
        // Writers before outputs travelled name the generation only in the reference
        // (`checkpoint:<task>:<generation>:<step>`).
        let generation =
            e.generation.or_else(|| e.output_ref.split(':').nth(2).and_then(|g| g.parse().ok())).unwrap_or(0);
        let output: Option<serde_json::Value> =
            e.output_json.as_deref().and_then(|text| serde_json::from_str(text).ok());
        columns.0.push(e.task_id.as_uuid());
        columns.1.push(generation);
        columns.2.push(e.step.as_str());
        columns.3.push(output);
        columns.4.push(e.output_ref.as_str());
        columns.5.push(e.sha256.as_str());
        columns.6.push(e.checkpointed_at.to_datetime());
        columns.7.push(e.provider.as_deref());
        columns.8.push(e.cost_micros);
    }
    sqlx::query(
        "INSERT INTO task_steps (task_id, generation, step, output, output_ref, sha256, checkpointed_at, provider, \
         cost_micros) SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::jsonb[], $5::text[], $6::text[], \
         $7::timestamptz[], $8::text[], $9::bigint[]) ON CONFLICT DO NOTHING",
    )
    .bind(columns.0)
    .bind(columns.1)
    .bind(columns.2)
    .bind(columns.3)
    .bind(columns.4)
    .bind(columns.5)
    .bind(columns.6)
    .bind(columns.7)
    .bind(columns.8)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every output heard for the task, in the order the steps finished.
pub async fn outputs(conn: &mut PgConnection, task_id: TaskId) -> Result<Vec<StepOutput>, sqlx::Error> {
    let mut rows: Vec<StepOutput> = sqlx::query_as(
        "SELECT step, generation, output, output_ref, sha256, checkpointed_at, provider, cost_micros FROM task_steps \
         WHERE task_id = $1 ORDER BY checkpointed_at, generation, step",
    )
    .bind(task_id.as_uuid())
    .fetch_all(&mut *conn)
    .await?;
    for row in &mut rows {
        row.artifact_uri = artifact_uri(row.output.as_ref());
        row.cost_minor = row.cost_micros.map(Amount::from_micros);
    }
    Ok(rows)
}

/// The link of a file result: an output that is an artifact's reference.
fn artifact_uri(output: Option<&serde_json::Value>) -> Option<String> {
    let output = output?.as_object()?;
    if !(output.contains_key("sha256") && output.contains_key("size_bytes")) {
        return None;
    }
    let uri = output.get("uri")?.as_str()?;
    (!uri.starts_with(INLINE_URI_SCHEME)).then(|| uri.to_owned())
}

/// How the executor refers to an inline result (a dialect's JSON value), which is
/// no file to link to (`fenceline_providers::dialect::INLINE_URI_SCHEME`).
const INLINE_URI_SCHEME: &str = "inline:";

/// The card of an approval's wait: what the approval lets happen next, what it
/// rests on, and the digest of both that a decision names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApprovalCard {
    /// The approval step that waits.
    pub step: String,
    /// The signal it waits for.
    pub signal: String,
    /// The generation whose wait this is.
    pub generation: i32,
    /// The sha256 of what this card shows (the step and the outputs it rests on):
    /// send it as `digest` with a decision, so that a decision made on a card that
    /// has changed since is refused.
    pub digest: String,
    /// The outputs of the steps before the approval (the newest of each): what it rests on.
    pub rests_on: Vec<StepOutput>,
    /// The paid steps an approval lets run, up to the next approval.
    pub then: Vec<NextStep>,
}

/// The outputs a wait of `generation` can rest on, as the domain reads them.
fn heard_for(outputs: &[StepOutput], generation: i32) -> Vec<Heard> {
    outputs
        .iter()
        .filter(|o| o.generation <= generation)
        .map(|o| Heard { step: o.step.clone(), generation: o.generation.max(0).unsigned_abs(), output: o.shown() })
        .collect()
}

/// The steps an approval at `step` rests on: the call steps before it in the
/// catalogue; without one, every other step heard.
fn rests_on_steps(kinds: &KindCatalog, kind: &str, step: &str, outputs: &[StepOutput]) -> Vec<String> {
    let declared = kinds.rests_on(kind, step);
    if !declared.is_empty() || !kinds.approval_steps(kind).is_empty() {
        return declared;
    }
    let mut heard: Vec<String> = Vec::new();
    for o in outputs.iter().filter(|o| o.step != step) {
        if !heard.contains(&o.step) {
            heard.push(o.step.clone());
        }
    }
    heard
}

/// The card of the wait at `step` in `generation`, from the outputs heard.
pub fn card(
    kinds: &KindCatalog,
    kind: &str,
    step: &str,
    signal: &str,
    generation: i32,
    outputs: &[StepOutput],
) -> ApprovalCard {
    let names = rests_on_steps(kinds, kind, step, outputs);
    let heard = heard_for(outputs, generation);
    let digest = approvals::digest(step, &approvals::outputs_shown(&names, &heard));
    // The newest output of each step it rests on (the same the digest covers).
    let mut newest: BTreeMap<&str, &StepOutput> = BTreeMap::new();
    for o in outputs.iter().filter(|o| o.generation <= generation && names.contains(&o.step)) {
        if newest.get(o.step.as_str()).is_none_or(|seen| seen.generation <= o.generation) {
            newest.insert(o.step.as_str(), o);
        }
    }
    let rests_on: Vec<StepOutput> = names.iter().filter_map(|n| newest.get(n.as_str()).map(|o| (*o).clone())).collect();
    ApprovalCard {
        step: step.to_owned(),
        signal: signal.to_owned(),
        generation,
        digest,
        rests_on,
        then: kinds.next_after(kind, step),
    }
}

/// Adds to a card the request that the step its approval lets run at once will
/// send, rendered from the task's `input` and the outputs the card shows (later
/// steps rest on outputs not made yet). The digest need not cover it: it follows
/// from the input, which never changes, and the outputs, which the digest covers.
pub fn show_request(kinds: &KindCatalog, card: &mut ApprovalCard, input: &serde_json::Value) {
    let Some(next) = card.then.first_mut() else { return };
    let shown = card.rests_on.iter().map(|o| (o.step.clone(), o.shown())).collect();
    match kinds.request_shown(&next.provider, input, shown) {
        Some(Ok(request)) => next.request = Some(request),
        Some(Err(why)) => next.request_error = Some(why),
        None => {}
    }
}

/// The body of `POST /v1/tasks/{id}/approve` and `/reject`.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Decide {
    /// Who decides: a person's name, recorded beside the token's identity.
    #[schema(min_length = 1, max_length = 200)]
    pub decided_by: String,
    /// Why, in the person's words; kept with the decision.
    #[serde(default)]
    #[schema(max_length = 4000)]
    pub note: Option<String>,
    /// The signal the wait takes; by default the one its step waits for.
    #[serde(default)]
    #[schema(pattern = "^[a-z0-9_.-]{1,64}$")]
    pub signal: Option<String>,
    /// The approval step whose wait this decides; by default the one the task
    /// waits at, or else the kind's first approval step (taking `signal`).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 200)]
    pub step: Option<String>,
    /// The generation whose wait this decides; by default the task's current one.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub generation: Option<i32>,
    /// The `digest` of the approval card the person read. A decision whose card
    /// would show something else now is refused (`409 approval-changed`, naming
    /// what changed).
    #[serde(default)]
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub digest: Option<String>,
}

/// A decision as it is kept: what it was made on, by whom, when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema, sqlx::FromRow)]
pub struct DecisionView {
    /// The approval step whose wait it decided.
    pub step: String,
    pub generation: i32,
    pub signal: String,
    /// `approve` or `reject`.
    pub decision: String,
    /// The name the person gave.
    pub decided_by: String,
    /// The token the decision came with (its tenant, id and label; never the token).
    pub token_identity: String,
    pub note: Option<String>,
    /// The digest of the card it was made on, when it named one.
    pub digest: Option<String>,
    /// The outputs it rested on, by step, as intake held them when it was made.
    #[schema(value_type = Object)]
    pub rests_on: serde_json::Value,
    #[serde(with = "time::serde::rfc3339")]
    pub decided_at: OffsetDateTime,
}

/// Every decision made about the task's waits, oldest first.
pub async fn recorded(conn: &mut PgConnection, task_id: TaskId) -> Result<Vec<DecisionView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT step, generation, signal_name AS signal, decision, decided_by, token_identity, note, digest, \
         rests_on, decided_at FROM decisions WHERE task_id = $1 ORDER BY decided_at, step",
    )
    .bind(task_id.as_uuid())
    .fetch_all(&mut *conn)
    .await
}

/// The task's generation as intake knows it: the `retry_as_new` resolutions it
/// recorded, or the newest generation that checkpointed a step, whichever is later.
/// A catalogue's standing decision starts generations no person resolved
/// (docs/catalog.md), and the step it sent again checkpoints before any approval
/// after it waits.
pub async fn generation(conn: &mut PgConnection, task_id: TaskId) -> Result<i32, sqlx::Error> {
    let generation: i64 = sqlx::query_scalar(
        "SELECT greatest((SELECT count(*) FROM resolutions WHERE task_id = $1 AND action = $2), \
         (SELECT coalesce(max(generation), 0) FROM task_steps WHERE task_id = $1))",
    )
    .bind(task_id.as_uuid())
    .bind(ResolutionAction::RetryAsNew.as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok(i32::try_from(generation).unwrap_or(i32::MAX))
}

/// The caller's task as a decision finds it, its row locked.
#[derive(Debug, sqlx::FromRow)]
struct Locked {
    kind: String,
    state: Stored<TaskState>,
    /// The step the projected status names.
    step: Option<String>,
    /// The trace the task was accepted in.
    traceparent: Option<String>,
}

async fn lock_task(tx: &mut PgConnection, tenant: &Tenant, task_id: TaskId) -> Result<Locked, ApiError> {
    let found: Option<Locked> = sqlx::query_as(
        "SELECT t.kind, coalesce(v.state, $3) AS state, v.step, t.traceparent \
         FROM tasks t LEFT JOIN task_view v ON v.task_id = t.task_id \
         WHERE t.task_id = $1 AND t.tenant = $2 FOR UPDATE OF t",
    )
    .bind(task_id.as_uuid())
    .bind(tenant.as_str())
    .bind(TaskState::Queued.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    found.ok_or_else(|| ApiError::TaskNotFound(task_id.to_string()))
}

/// A decision already recorded for a wait.
#[derive(Debug, sqlx::FromRow)]
struct Recorded {
    decision: String,
    decided_by: String,
    digest: Option<String>,
}

/// Refuses a request whose words intake cannot keep or use.
fn check(request: &Decide) -> Result<(), ApiError> {
    let bad = |what: &str| Err(ApiError::InvalidRequest(what.to_owned()));
    let name = request.decided_by.trim();
    if name.is_empty() || name.chars().count() > 200 || name.chars().any(char::is_control) {
        return bad("decided_by: the name of the person who decides, 1 to 200 characters");
    }
    if request.note.as_ref().is_some_and(|n| n.chars().count() > 4000 || n.contains('\0')) {
        return bad("note: at most 4000 characters, without NUL");
    }
    if let Some(signal) = &request.signal {
        crate::actions::parse_signal_name(signal)?;
    }
    if request.step.as_ref().is_some_and(|s| s.is_empty() || s.len() > 200 || s.chars().any(char::is_control)) {
        return bad("step: the name of an approval step");
    }
    if request.generation.is_some_and(|g| g < 0) {
        return bad("generation: 0 or more");
    }
    let hex = |d: &String| d.len() == 64 && d.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
    if request.digest.as_ref().is_some_and(|d| !hex(d)) {
        return bad("digest: the lower-case hex sha256 the approval card shows");
    }
    Ok(())
}

/// Records a person's decision about one wait of an approval step and sends it to
/// the scheduler bound to that wait, once per wait: the same decision again
/// answers `repeated: true`, another one `409 already-decided`. A decision whose
/// card would show something else now is refused with `409 approval-changed`.
#[allow(clippy::too_many_arguments)]
pub async fn decide(
    pool: &PgPool,
    outbox: &OutboxWriter,
    kinds: &KindCatalog,
    tenant: &Tenant,
    identity: &TokenIdentity,
    task_id: TaskId,
    decision: ApprovalDecision,
    request: Decide,
) -> Result<ActionAccepted, ApiError> {
    check(&request)?;
    let mut tx = pool.begin().await?;
    let task = lock_task(&mut tx, tenant, task_id).await?;
    let Stored(state) = task.state;
    let awaiting = state == TaskState::AwaitingApproval;
    if let Some(signal) = &request.signal {
        kinds.check_signal(task_id, &task.kind, signal)?;
    }
    let approvals = kinds.approval_steps(&task.kind);
    let step = match (&request.step, awaiting, &task.step) {
        (Some(step), _, _) => step.clone(),
        (None, true, Some(step)) => step.clone(),
        (None, _, _) => approvals
            .iter()
            .find(|(_, signal)| request.signal.as_deref().is_none_or(|s| s == *signal))
            .map(|(step, _)| (*step).to_owned())
            .ok_or_else(|| {
                ApiError::UnknownSignal(format!("tasks of kind `{}` wait for no such approval", task.kind))
            })?,
    };
    let signal = match approvals.iter().find(|(s, _)| *s == step) {
        Some((_, signal)) => {
            if let Some(asked) = request.signal.as_deref().filter(|asked| asked != signal) {
                return Err(ApiError::UnknownSignal(format!(
                    "step `{step}` of task {task_id} waits for the signal `{signal}`, not `{asked}`"
                )));
            }
            (*signal).to_owned()
        }
        None if !approvals.is_empty() => {
            let steps: Vec<String> = approvals.iter().map(|(s, _)| format!("`{s}`")).collect();
            return Err(ApiError::UnknownSignal(format!(
                "task {task_id} has no approval step `{step}`; its approval steps are {}",
                steps.join(", ")
            )));
        }
        // Without a catalogue intake cannot tell which signal a step takes.
        None => request.signal.clone().ok_or_else(|| {
            ApiError::InvalidRequest("signal: name the signal the wait takes (intake has no catalogue)".into())
        })?,
    };
    let current = generation(&mut tx, task_id).await?;
    let generation = request.generation.unwrap_or(current);

    let recorded: Option<Recorded> = sqlx::query_as(
        "SELECT decision, decided_by, digest FROM decisions WHERE task_id = $1 AND step = $2 AND generation = $3",
    )
    .bind(task_id.as_uuid())
    .bind(&step)
    .bind(generation)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(recorded) = recorded {
        let same = recorded.decision == decision.as_str()
            && request.digest.as_ref().is_none_or(|d| recorded.digest.as_ref() == Some(d));
        if same {
            return Ok(ActionAccepted { task_id, action: format!("{decision}:{step}"), repeated: true });
        }
        return Err(ApiError::AlreadyDecided(format!(
            "the wait of step `{step}` (generation {generation}) of task {task_id} was already decided: {} by {}",
            recorded.decision, recorded.decided_by
        )));
    }
    if state.is_final() {
        return Err(ApiError::TaskFinished(format!("task {task_id} is already {state}; nothing to {decision}")));
    }
    if generation < current {
        return Err(ApiError::ApprovalChanged(format!(
            "the card was for generation {generation} of task {task_id}; a person's retry_as_new started generation \
             {current} since, and the steps before `{step}` may produce new outputs; read the task again before deciding"
        )));
    }
    if generation > current {
        return Err(ApiError::ApprovalChanged(format!(
            "task {task_id} has no generation {generation}; it is at generation {current}"
        )));
    }
    // Within a generation a task only moves on: a wait before the step it is at is over.
    let at = task.step.as_deref().and_then(|s| kinds.position(&task.kind, s).map(|p| (s, p)));
    if let (Some((now, at)), Some(wait)) = (at, kinds.position(&task.kind, &step))
        && at > wait
    {
        return Err(ApiError::ApprovalChanged(format!(
            "the wait of step `{step}` of task {task_id} is over: the task is at step `{now}` now"
        )));
    }
    let outputs = outputs(&mut tx, task_id).await?;
    let card = card(kinds, &task.kind, &step, &signal, generation, &outputs);
    if let Some(shown) = request.digest.as_deref().filter(|shown| *shown != card.digest) {
        let names = rests_on_steps(kinds, &task.kind, &step, &outputs);
        let why = approvals::what_changed(&step, &names, &heard_for(&outputs, generation), shown)
            .unwrap_or_else(|| format!("the card of `{step}` changed since it was read"));
        return Err(ApiError::ApprovalChanged(format!("task {task_id}: {why}")));
    }
    let rests_on: serde_json::Map<String, serde_json::Value> =
        card.rests_on.iter().map(|o| (o.step.clone(), o.shown())).collect();
    sqlx::query(
        "INSERT INTO decisions (task_id, step, generation, signal_name, decision, decided_by, token_identity, note, \
         digest, rests_on) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(task_id.as_uuid())
    .bind(&step)
    .bind(generation)
    .bind(&signal)
    .bind(decision.as_str())
    .bind(request.decided_by.trim())
    .bind(&identity.0)
    .bind(request.note.as_deref().map(str::trim).filter(|n| !n.is_empty()))
    .bind(&request.digest)
    .bind(sqlx::types::Json(&rests_on))
    .execute(&mut *tx)
    .await?;
    // Do not change: the scheduler's dedup identity of a decision, one per wait.
    let signal_id = format!("decision:{step}:{generation}");
    let event = Event::SignalReceived(SignalReceived {
        task_id,
        tenant: tenant.as_str().to_owned(),
        signal_name: signal,
        signal_id,
        payload_json: "{}".to_owned(),
        received_at: Timestamp::now(),
        step: Some(step.clone()),
        generation: Some(generation),
        decision: Some(decision),
    });
    outbox.append_in_trace(&mut tx, topics::TASKS, None, &event, crate::actions::in_trace(task.traceparent)).await?;
    crate::live::changed(&mut tx, task_id, Some(tenant.as_str())).await?;
    tx.commit().await?;
    outbox.committed();
    Ok(ActionAccepted { task_id, action: format!("{decision}:{step}"), repeated: false })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_file_result_links_its_artifact_and_an_inline_one_does_not() {
        let file = json!({"uri": "https://files.example/a.png", "sha256": "ab", "size_bytes": 3});
        assert_eq!(artifact_uri(Some(&file)).as_deref(), Some("https://files.example/a.png"));
        let inline = json!({"uri": "inline:t/0/draft", "sha256": "ab", "size_bytes": 3});
        assert_eq!(artifact_uri(Some(&inline)), None);
        assert_eq!(artifact_uri(Some(&json!({"role": "assistant", "content": "Hi"}))), None);
    }

    #[test]
    fn a_decision_names_a_person_and_a_digest_in_its_own_form() {
        let request = |body: serde_json::Value| serde_json::from_value::<Decide>(body).expect("decide");
        assert!(check(&request(json!({"decided_by": "Ana"}))).is_ok());
        for bad in [
            json!({"decided_by": "  "}),
            json!({"decided_by": "Ana", "digest": "ABC"}),
            json!({"decided_by": "Ana", "generation": -1}),
            json!({"decided_by": "Ana", "signal": "Not A Signal"}),
        ] {
            assert!(check(&request(bad.clone())).is_err(), "{bad}");
        }
    }
}
