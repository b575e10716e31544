//! What a client may ask of an accepted task: cancel it, signal it (an approval),
//! resolve the case of a task that waits for a person (`outcome_unknown`,
//! `needs_human`). Each request becomes one event on `fenceline.tasks` for the
//! scheduler, the authority on task state; a repeated request finds its earlier row
//! and sends nothing again. A new request on a finished task, and a signal no step
//! of the task's kind waits for, are refused: nothing could come of them.

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{ResolutionAction, TaskState};
use fenceline_events::{ArtifactRef, CancelRequested, Event, ResolutionDecided, SignalReceived, Timestamp, topics};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use fenceline_store::word::Stored;

use crate::auth::{Tenant, TokenIdentity};
use crate::kinds::KindCatalog;
use crate::problem::ApiError;

/// The answer to every action: what was asked, and whether this request repeated
/// an earlier one (then nothing new was sent).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct ActionAccepted {
    #[schema(value_type = String, format = Uuid)]
    pub task_id: TaskId,
    pub action: String,
    pub repeated: bool,
}

/// The caller's task as an action finds it, its row locked.
#[derive(Debug, sqlx::FromRow)]
struct Locked {
    kind: String,
    /// The projected state; `queued` until the scheduler's first status arrives.
    /// Advisory: the scheduler decides.
    state: Stored<TaskState>,
    /// The case the projected status names, if any.
    case_id: Option<String>,
    /// The trace the task was accepted in: what is asked about it continues it.
    traceparent: Option<String>,
}

/// Locks the caller's task row and reads it with its projected status, or answers
/// 404 exactly as for a task that does not exist.
async fn lock_task(tx: &mut sqlx::PgConnection, tenant: &Tenant, task_id: TaskId) -> Result<Locked, ApiError> {
    let found: Option<Locked> = sqlx::query_as(
        "SELECT t.kind, coalesce(v.state, 'queued') AS state, v.case_id, t.traceparent \
         FROM tasks t LEFT JOIN task_view v ON v.task_id = t.task_id \
         WHERE t.task_id = $1 AND t.tenant = $2 FOR UPDATE OF t",
    )
    .bind(task_id.as_uuid())
    .bind(tenant.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    found.ok_or_else(|| ApiError::TaskNotFound(task_id.to_string()))
}

/// The trace an event about a task goes out in: the task's own, and the request's
/// only for a task accepted before its trace was kept.
pub(crate) fn in_trace(task: Option<String>) -> Option<String> {
    task.or_else(fenceline_telemetry::current_traceparent)
}

/// Refuses a new request (`what`: signal, cancel, resolve) on a task in a final
/// state, naming it: nothing happens to such a task any more.
fn unless_finished(task_id: TaskId, state: TaskState, what: &str) -> Result<(), ApiError> {
    if state.is_final() {
        return Err(ApiError::TaskFinished(format!("task {task_id} is already {state}; nothing to {what}")));
    }
    Ok(())
}

/// Carries out one request (`what`) on the caller's task exactly once: `dedup`
/// inserts the request's identity (and does nothing if it is there already); only a
/// fresh insert sends `event`, and only if the task has not finished. Returns
/// whether it was fresh.
async fn once(
    pool: &PgPool,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    task_id: TaskId,
    what: &str,
    dedup: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    event: impl FnOnce() -> Event,
) -> Result<bool, ApiError> {
    let mut tx = pool.begin().await?;
    let task = lock_task(&mut tx, tenant, task_id).await?;
    let fresh = dedup.execute(&mut *tx).await?.rows_affected() == 1;
    if fresh {
        // Dropping the transaction takes the insert back.
        unless_finished(task_id, task.state.0, what)?;
        outbox.append_in_trace(&mut tx, topics::TASKS, None, &event(), in_trace(task.traceparent)).await?;
        crate::live::changed(&mut tx, task_id, Some(tenant.as_str())).await?;
    }
    tx.commit().await?;
    if fresh {
        outbox.committed();
    }
    Ok(fresh)
}

/// Asks for the task to be cancelled (cooperatively, if it runs).
pub async fn cancel(
    pool: &PgPool,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    task_id: TaskId,
    who: &str,
) -> Result<ActionAccepted, ApiError> {
    let dedup = sqlx::query("INSERT INTO cancellations (task_id, requested_by) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(task_id.as_uuid())
        .bind(who);
    let fresh = once(pool, outbox, tenant, task_id, "cancel", dedup, || {
        Event::CancelRequested(CancelRequested {
            task_id,
            tenant: tenant.as_str().to_owned(),
            requested_by: who.to_owned(),
            requested_at: Timestamp::now(),
        })
    })
    .await?;
    Ok(ActionAccepted { task_id, action: "cancel".into(), repeated: !fresh })
}

/// A signal name: what a step waits for, such as `approve`.
pub fn parse_signal_name(name: &str) -> Result<&str, ApiError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-' || c == '.');
    if valid { Ok(name) } else { Err(ApiError::InvalidRequest(format!("`{name}` is not a valid signal name"))) }
}

/// Why a signal's payload cannot be sent: it says no (`"approved": false`, or a
/// `decision` of `reject`), while a signal only approves the wait it answers. Sent
/// anyway, it would approve what its sender refused.
pub fn refusal_in_payload(payload: &serde_json::Value) -> Option<String> {
    let says_no = payload.get("approved").is_some_and(|v| v == false || v == "false")
        || payload
            .get("decision")
            .and_then(|v| v.as_str())
            .is_some_and(|d| ["reject", "rejected", "deny", "denied", "no"].contains(&d.to_ascii_lowercase().as_str()));
    says_no.then(|| {
        "signal payload: it says no, and a signal only approves the wait it answers; nothing was sent. To say \
         no, reject the wait (POST /v1/tasks/{id}/reject); to stop the task, cancel it"
            .to_owned()
    })
}

/// The identity of a signal sent without an `Idempotency-Key`: the payload's
/// sha256, scoped to the task's generation (as [`crate::decisions::generation`]
/// counts it), so the same approval sent twice is one signal while a new generation, which
/// runs its approval steps again, takes the same approval anew.
///
/// Do not change: it is the dedup identity of stored signals, here and at the scheduler.
pub fn payload_signal_id(payload: &serde_json::Value, generation: i64) -> String {
    let hash = hex::encode(Sha256::digest(payload.to_string().as_bytes()));
    if generation == 0 { hash } else { format!("{hash}:generation-{generation}") }
}

/// A signal as the client sent it.
#[derive(Debug, Clone, Copy)]
pub struct SignalRequest<'a> {
    /// What a step waits for, such as `refund_approved` ([`parse_signal_name`]).
    pub name: &'a str,
    /// The `Idempotency-Key`, if one was sent.
    pub key: Option<&'a str>,
    /// The JSON payload; `null` for none.
    pub payload: &'a serde_json::Value,
}

/// Delivers a signal that a step of the task's kind waits for. Its identity is the
/// `Idempotency-Key` if given, else the payload within the task's generation
/// ([`payload_signal_id`]). The scheduler keeps a signal that arrives before its
/// wait begins, so an approval given early is not lost.
pub async fn signal(
    pool: &PgPool,
    outbox: &OutboxWriter,
    kinds: &KindCatalog,
    tenant: &Tenant,
    task_id: TaskId,
    request: SignalRequest<'_>,
) -> Result<ActionAccepted, ApiError> {
    let SignalRequest { name, key, payload } = request;
    let mut tx = pool.begin().await?;
    let task = lock_task(&mut tx, tenant, task_id).await?;
    kinds.check_signal(task_id, &task.kind, name)?;
    let signal_id = match key {
        Some(key) => key.to_owned(),
        None => {
            let generation = crate::decisions::generation(&mut tx, task_id).await?;
            payload_signal_id(payload, i64::from(generation))
        }
    };
    let fresh = sqlx::query(
        "INSERT INTO signals (task_id, signal_name, signal_id, payload) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
    )
    .bind(task_id.as_uuid())
    .bind(name)
    .bind(&signal_id)
    .bind(payload)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if fresh {
        unless_finished(task_id, task.state.0, "signal")?;
        let event = Event::SignalReceived(SignalReceived {
            task_id,
            tenant: tenant.as_str().to_owned(),
            signal_name: name.to_owned(),
            signal_id,
            payload_json: payload.to_string(),
            received_at: Timestamp::now(),
            // A bare signal approves whichever wait for its name comes first.
            step: None,
            generation: None,
            decision: None,
        });
        outbox.append_in_trace(&mut tx, topics::TASKS, None, &event, in_trace(task.traceparent)).await?;
        crate::live::changed(&mut tx, task_id, Some(tenant.as_str())).await?;
    }
    tx.commit().await?;
    if fresh {
        outbox.committed();
    }
    Ok(ActionAccepted { task_id, action: format!("signal:{name}"), repeated: !fresh })
}

/// The body of `POST /v1/tasks/{id}/resolution`.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Resolve {
    /// The case the person read (`case_id` of `GET /v1/tasks/{id}`); refused with
    /// `409 case-changed` if the task's case is another one by now.
    #[schema(min_length = 1)]
    pub case_id: String,
    /// `retry_as_new`, `accept_failed` or `attach_result`.
    #[schema(pattern = "^(retry_as_new|accept_failed|attach_result)$")]
    pub action: String,
    /// Must be `true` for `retry_as_new`: the new operation may be billed again.
    #[serde(default)]
    pub acknowledge_possible_charge: bool,
    /// For `attach_result`: the result found elsewhere.
    #[serde(default)]
    pub result: Option<AttachedResult>,
    /// Who decides: a person's name, recorded beside the token's identity
    /// (default: the token's identity alone).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 200)]
    pub decided_by: Option<String>,
    /// Why, in the person's words; kept with the resolution.
    #[serde(default)]
    #[schema(max_length = 4000)]
    pub note: Option<String>,
}

/// A result found elsewhere, for `attach_result`.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttachedResult {
    #[schema(min_length = 1)]
    pub uri: String,
    /// Lower-case hex.
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub sha256: String,
    #[schema(minimum = 0)]
    pub size_bytes: i64,
}

/// Records a person's resolution of the case of a task that waits for a person
/// (`outcome_unknown` or `needs_human`), once per case. The same resolution again
/// answers `repeated: true`; a different one for a case already resolved, or one
/// naming a case that is no longer the task's, is refused with a `409`.
pub async fn resolve(
    pool: &PgPool,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    identity: &TokenIdentity,
    task_id: TaskId,
    request: Resolve,
) -> Result<ActionAccepted, ApiError> {
    let who = match request.decided_by.as_deref().map(str::trim) {
        None => format!("tenant:{}", tenant.as_str()),
        Some(name) if (1..=200).contains(&name.chars().count()) && !name.contains('\0') => name.to_owned(),
        Some(_) => {
            return Err(ApiError::InvalidRequest(
                "decided_by: the name of the person who decides, 1 to 200 characters".into(),
            ));
        }
    };
    if request.note.as_ref().is_some_and(|note| note.chars().count() > 4000 || note.contains('\0')) {
        return Err(ApiError::InvalidRequest("note: at most 4,000 characters of text".into()));
    }
    let action: ResolutionAction =
        request.action.parse().map_err(|e| ApiError::InvalidRequest(format!("action: {e}")))?;
    if request.case_id.is_empty() || request.case_id.contains('\0') {
        return Err(ApiError::InvalidRequest("case_id: the case_id the task shows".into()));
    }
    if action == ResolutionAction::RetryAsNew && !request.acknowledge_possible_charge {
        return Err(ApiError::InvalidRequest(
            "retry_as_new starts a new operation that the provider may bill again; \
             send acknowledge_possible_charge: true to confirm"
                .into(),
        ));
    }
    let attached = match (action, request.result) {
        (ResolutionAction::AttachResult, Some(r)) => {
            let hex_ok =
                r.sha256.len() == 64 && r.sha256.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase());
            if r.uri.contains('\0') {
                return Err(crate::tasks::nul_refused("result.uri"));
            }
            if !hex_ok || r.size_bytes < 0 || r.uri.is_empty() {
                return Err(ApiError::InvalidRequest("result needs a uri, a lower-case hex sha256 and a size".into()));
            }
            Some(ArtifactRef { uri: r.uri, sha256: r.sha256, size_bytes: r.size_bytes })
        }
        (ResolutionAction::AttachResult, None) => {
            return Err(ApiError::InvalidRequest("attach_result needs a result".into()));
        }
        (_, Some(_)) => return Err(ApiError::InvalidRequest("only attach_result takes a result".into())),
        (_, None) => None,
    };
    let mut tx = pool.begin().await?;
    // Another tenant's task is not found, before anything about its state is said.
    // The projected state is advisory (the scheduler decides, and applies a
    // resolution only to the case it names); it turns away resolutions of tasks
    // that plainly do not wait for a person, and of cases that were replaced.
    let Locked { state: Stored(state), case_id: current, traceparent, .. } =
        lock_task(&mut tx, tenant, task_id).await?;
    let waits = [TaskState::OutcomeUnknown, TaskState::NeedsHuman].contains(&state);
    // A case already resolved answers for itself even after the task moved on.
    let recorded: Option<(String, bool, Option<sqlx::types::Json<ArtifactRef>>)> = sqlx::query_as(
        "SELECT action, charge_acknowledged, attached_result FROM resolutions WHERE task_id = $1 AND case_id = $2",
    )
    .bind(task_id.as_uuid())
    .bind(&request.case_id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((recorded_action, acknowledged, result)) = recorded {
        let same = recorded_action == action.as_str()
            && acknowledged == request.acknowledge_possible_charge
            && result.map(|r| r.0) == attached;
        if same {
            return Ok(ActionAccepted { task_id, action: action.as_str().to_owned(), repeated: true });
        }
        return Err(ApiError::AlreadyResolved(format!(
            "case {} of task {task_id} was already resolved with {recorded_action}",
            request.case_id
        )));
    }
    unless_finished(task_id, state, "resolve")?;
    let current = match (waits, current) {
        (true, Some(case)) => case,
        _ => {
            return Err(ApiError::NotResolvable(format!(
                "task {task_id} is {state}; only a task in outcome_unknown or needs_human can be resolved"
            )));
        }
    };
    if current != request.case_id {
        return Err(ApiError::CaseChanged(format!(
            "task {task_id} now shows case {current}, not {}; read it again before deciding",
            request.case_id
        )));
    }
    // What the person was shown: the case's evidence (the reconciler's, or the
    // scheduler's reason for a task that needs a person), kept with the decision.
    let evidence = crate::tasks::case_evidence(&mut tx, task_id, state).await?;
    // The primary key (task, case) serialises two people deciding at once: the
    // second waits for the first and then finds its row.
    let inserted = sqlx::query(
        "INSERT INTO resolutions (task_id, case_id, action, charge_acknowledged, attached_result, decided_by, \
         token_identity, note, evidence) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
    )
    .bind(task_id.as_uuid())
    .bind(&current)
    .bind(action.as_str())
    .bind(request.acknowledge_possible_charge)
    .bind(attached.clone().map(sqlx::types::Json))
    .bind(&who)
    .bind(&identity.0)
    .bind(request.note.as_deref())
    .bind(sqlx::types::Json(&evidence))
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        return Err(ApiError::AlreadyResolved(format!("case {current} of task {task_id} was resolved meanwhile")));
    }
    let event = Event::ResolutionDecided(ResolutionDecided {
        task_id,
        tenant: tenant.as_str().to_owned(),
        case_id: current,
        action,
        charge_acknowledged: request.acknowledge_possible_charge,
        attached_result: attached,
        decided_by: who,
        decided_at: Timestamp::now(),
    });
    outbox.append_in_trace(&mut tx, topics::TASKS, None, &event, in_trace(traceparent)).await?;
    crate::live::changed(&mut tx, task_id, Some(tenant.as_str())).await?;
    tx.commit().await?;
    outbox.committed();
    Ok(ActionAccepted { task_id, action: action.as_str().to_owned(), repeated: false })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::refusal_in_payload;

    #[test]
    fn a_payload_that_says_no_is_never_sent_as_an_approval() {
        for no in [
            json!({"approved": false}),
            json!({"approved": "false", "note": "amount too high"}),
            json!({"decision": "Reject"}),
            json!({"decision": "denied"}),
        ] {
            assert!(refusal_in_payload(&no).is_some(), "{no}");
        }
        for yes in [json!(null), json!({}), json!({"approved": true}), json!({"approved_by": "ana"})] {
            assert!(refusal_in_payload(&yes).is_none(), "{yes}");
        }
    }
}
