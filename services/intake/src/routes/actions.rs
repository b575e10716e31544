//! A person's actions on one task: cancel, signal, resolve its case, approve or
//! reject its wait.

use actix_web::{HttpRequest, HttpResponse, web};
use sqlx::PgPool;

use super::{State, task_id, who};
use crate::auth::Caller;
use crate::problem::{self, ApiError};
use fenceline_domain::vocabulary::ApprovalDecision;

use crate::tasks::IdempotencyKey;
use crate::{actions, decisions, tasks};

/// Asks for the task to be cancelled: at once if it waits, cooperatively if it runs.
/// A finished task is refused (`409`, naming its state) unless this repeats a cancel
/// asked before.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/cancel", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    responses(
        (status = 202, description = "Asked (`repeated` if asked before)", body = actions::ActionAccepted),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`, naming its state)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn cancel(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let accepted = actions::cancel(&pool, &state.outbox, &caller.0, task_id(&path)?, &who(&caller)).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Delivers a signal (such as an approval) to the task, once per `Idempotency-Key`
/// or, without one, per payload. A signal no step of the task's kind waits for is
/// refused (`422`, naming those it takes), as is a new signal to a finished task
/// (`409`).
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/signals/{name}", tag = "tasks",
    params(
        ("task_id" = String, Path, description = "The task's id"),
        ("name" = String, Path, description = "The signal, such as `approve`",
         pattern = "^[a-z0-9_.-]{1,64}$"),
        ("Idempotency-Key" = Option<String>, Header, description = "The signal's identity",
         min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body(content = Option<Object>, content_type = "application/json", description = "An optional JSON payload"),
    responses(
        (status = 202, description = "Delivered (`repeated` if delivered before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad name, key or payload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`, naming its state)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No step of the task's kind waits for this signal (`unknown-signal`, naming those it takes)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn signal(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<(String, String)>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let (raw_id, name) = path.into_inner();
    let name = actions::parse_signal_name(&name)?;
    let key = match req.headers().get("Idempotency-Key") {
        Some(value) => Some(IdempotencyKey::parse(value.to_str().unwrap_or_default())?),
        None => None,
    };
    // A signal may carry no body at all; a body that is there must be a JSON object.
    let payload = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("signal payload: {e}")))?
    };
    if !(payload.is_null() || payload.is_object()) {
        return Err(ApiError::InvalidRequest("signal payload: must be a JSON object".into()));
    }
    tasks::storable("signal payload", &payload)?;
    if let Some(refusal) = actions::refusal_in_payload(&payload) {
        return Err(ApiError::InvalidRequest(refusal));
    }
    let request = actions::SignalRequest { name, key: key.as_ref().map(IdempotencyKey::as_str), payload: &payload };
    let accepted = actions::signal(&pool, &state.outbox, &state.kinds, &caller.0, task_id(&raw_id)?, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Resolves the case of a task that waits for a person (`outcome_unknown` or
/// `needs_human`), naming the case read: `retry_as_new` (needs
/// `acknowledge_possible_charge: true`), `accept_failed` or `attach_result`.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/resolution", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = actions::Resolve, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad resolution", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), does not wait for a person, its case changed, or the case was already resolved otherwise", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn resolve(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<actions::Resolve>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let accepted = actions::resolve(&pool, &state.outbox, &caller.0, &caller.1, task_id(&path)?, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Approves one wait of an approval step: the one the task waits at, or, given
/// early, the wait `step` names (kept for that wait only). Records who decided
/// (`decided_by`, beside the token's identity), the note, and the card it was made
/// on; a `digest` that no longer matches the card is refused, naming what changed.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/approve", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = decisions::Decide, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded and sent (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad decision", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), the card changed since it was read (`approval-changed`, naming what changed), or the wait was already decided otherwise (`already-decided`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No such approval step or signal for the task's kind (`unknown-signal`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn approve(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
) -> Result<HttpResponse, ApiError> {
    decide(caller, state, pool, path, body, ApprovalDecision::Approve).await
}

/// Rejects one wait of an approval step, as `approve` names it: the task ends
/// `failed`, its reason saying a person rejected it, and no step after the wait
/// runs.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/reject", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = decisions::Decide, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded and sent (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad decision", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), the card changed since it was read (`approval-changed`, naming what changed), or the wait was already decided otherwise (`already-decided`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No such approval step or signal for the task's kind (`unknown-signal`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn reject(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
) -> Result<HttpResponse, ApiError> {
    decide(caller, state, pool, path, body, ApprovalDecision::Reject).await
}

pub(crate) async fn decide(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
    decision: ApprovalDecision,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let task = task_id(&path)?;
    let accepted =
        decisions::decide(&pool, &state.outbox, &state.kinds, &caller.0, &caller.1, task, decision, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}
