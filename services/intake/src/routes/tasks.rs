//! `/v1/tasks` and `/v1/summary`: submitting a task, listing, reading one, and the
//! counts by state.

use actix_web::{HttpRequest, HttpResponse, web};
use sqlx::PgPool;

use super::{State, task_id};
use crate::auth::Caller;
use crate::problem::{self, ApiError};
use crate::tasks::{self, IdempotencyKey, SubmitTask, Submitted};

/// Submits a task, once per `Idempotency-Key`.
///
/// Answers at once, without waiting for any other service. The same key with the
/// same request answers the first answer again (`Idempotent-Replayed: true`); with a
/// different request, `422 idempotency-key-reused`. A concurrent request with the
/// same key waits for the first to commit, then replays its answer (never `409`).
#[utoipa::path(
    post, path = "/v1/tasks", tag = "tasks",
    params(
        ("Idempotency-Key" = String, Header, description = "1 to 255 visible ASCII characters, scoped to the tenant",
         min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body(content = SubmitTask, content_type = "application/json"),
    responses(
        (status = 202, description = "Accepted (or replayed)", body = tasks::Accepted, headers(
            ("Location" = String, description = "The task's status URL"),
            ("Idempotent-Replayed" = String, description = "`true` when this answer repeats an earlier one"),
        )),
        (status = 400, description = "Malformed request or Idempotency-Key", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "Unknown kind, input failing its schema, or a key reused for another request", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn submit(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    body: web::Json<SubmitTask>,
) -> Result<HttpResponse, ApiError> {
    let key = req
        .headers()
        .get("Idempotency-Key")
        .ok_or(ApiError::IdempotencyKeyMissing)?
        .to_str()
        .map_err(|_| ApiError::IdempotencyKeyInvalid("Idempotency-Key must be visible ASCII".into()))?;
    let key = IdempotencyKey::parse(key)?;
    let task = body.into_inner().validate(&state.kinds)?;
    // Do not change: `api` is the namespace of every stored API key.
    Ok(submission_answer(state.submissions.submit(&caller.0, &key, task, "api").await?))
}

/// `202` with the task id, its status URL as `Location`, and
/// `Idempotent-Replayed: true` when the key had been used for this request before.
pub(crate) fn submission_answer(submitted: Submitted) -> HttpResponse {
    let (accepted, replayed) = match submitted {
        Submitted::Created(accepted) => (accepted, false),
        Submitted::Replayed(accepted) => (accepted, true),
    };
    let mut response = HttpResponse::Accepted();
    response.insert_header(("Location", accepted.status_url.clone()));
    if replayed {
        response.insert_header(("Idempotent-Replayed", "true"));
    }
    response.json(accepted)
}

/// Lists the caller's tasks, newest first, with filters and a stable cursor.
#[utoipa::path(
    get, path = "/v1/tasks", tag = "tasks",
    params(tasks::ListQuery),
    responses(
        (status = 200, description = "One page", body = tasks::Page),
        (status = 400, description = "A bad filter or cursor", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn list(
    caller: Caller,
    pool: web::Data<PgPool>,
    query: web::Query<tasks::ListQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::list(&pool, &caller.0, query.into_inner()).await?))
}

/// The caller's tenant and how many of its tasks are in each state, within the
/// listing's filters (but the state): the dashboard's overview.
#[utoipa::path(
    get, path = "/v1/summary", tag = "tasks",
    params(tasks::SummaryQuery),
    responses(
        (status = 200, description = "The counts", body = tasks::Summary),
        (status = 400, description = "A bad filter", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn summary(
    caller: Caller,
    pool: web::Data<PgPool>,
    query: web::Query<tasks::SummaryQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::summarise(&pool, &caller.0, query.into_inner()).await?))
}

/// Reads one task: its state and why, its attempts, its result, and for
/// `outcome_unknown` the evidence and what each resolution would do. A task accepted
/// but not yet scheduled reads as `queued`; another tenant's task is not found.
#[utoipa::path(
    get, path = "/v1/tasks/{task_id}", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    responses(
        (status = 200, description = "The task", body = tasks::TaskView),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn read(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::read(&pool, &state.kinds, &caller.0, task_id(&path)?).await?))
}
