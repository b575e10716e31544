//! `/v1/webhooks/{source}`: a signed delivery from a configured source becomes a task.

use actix_web::{HttpRequest, HttpResponse, web};
use sqlx::PgPool;

use super::State;
use super::tasks::submission_answer;
use crate::problem::{self, ApiError};
use crate::tasks::{self, IdempotencyKey, SubmitTask};
use crate::{admission, webhooks};

/// A signed delivery from a configured source becomes a task, once per event id.
/// The signature covers the timestamp, the event id and the body, so a captured
/// delivery re-sent under a new event id is refused. Every refusal (unknown
/// source, missing or stale timestamp, missing or bad event id, bad or old-style
/// signature) answers 401 alike, so a prober learns nothing about which sources exist.
#[utoipa::path(
    post, path = "/v1/webhooks/{source}", tag = "webhooks", security(()),
    params(
        ("source" = String, Path, description = "The configured sender"),
        ("Fenceline-Timestamp" = String, Header, description = "Unix seconds; within the tolerance of now"),
        ("Fenceline-Signature" = String, Header, description = "`v2=` and the hex HMAC-SHA256 of `timestamp.event_id.body`"),
        ("Fenceline-Event-Id" = String, Header, description = "The sender's event id, signed; a redelivery makes no second task",
         min_length = 1, max_length = 200, pattern = "^[!-\\-/-~]{1,200}$"),
    ),
    request_body(content = Object, content_type = "application/json", description = "The event: the task's input"),
    responses(
        (status = 202, description = "Accepted (or replayed)", body = tasks::Accepted, headers(
            ("Location" = String, description = "The task's status URL"),
            ("Idempotent-Replayed" = String, description = "`true` for a redelivery"),
        )),
        (status = 400, description = "A body that is not a JSON object", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Unknown source, or a missing, bad, old-style or stale signature or event id", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "The input fails the kind's schema", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn webhook(
    req: HttpRequest,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    admission: web::Data<admission::Admission>,
    path: web::Path<String>,
    body: Result<web::Bytes, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let body = body.map_err(|e| match e.as_response_error().status_code() {
        actix_web::http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(e.to_string()),
        _ => ApiError::InvalidRequest(format!("body: {e}")),
    })?;
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let refused = |e: webhooks::SignatureError| ApiError::BadSignature(e.to_string());
    let source = webhooks::source(&pool, &path, state.sealing.as_deref())
        .await?
        .ok_or_else(|| refused(webhooks::SignatureError::NoMatch))?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let event_id = webhooks::verify(
        &source.secrets,
        header(webhooks::headers::TIMESTAMP),
        header(webhooks::headers::EVENT_ID),
        header(webhooks::headers::SIGNATURE),
        &body,
        now,
        state.webhook_tolerance_seconds,
    )
    .map_err(refused)?;
    admission.admit(&source.tenant)?;
    let input: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("body: {e}")))?;
    let key =
        IdempotencyKey::parse(&source.dedupe_key(path.as_str(), &event_id, &input).map_err(ApiError::InvalidRequest)?)?;
    let task = SubmitTask {
        kind: source.kind.clone(),
        input,
        priority: None,
        deadline: None,
        not_before: None,
        labels: [("webhook_source".to_owned(), path.to_string())].into(),
    }
    .validate(&state.kinds)?;
    // Do not change: the source is the namespace of its stored idempotency keys.
    let source_label = format!("webhook:{}", path.as_str());
    Ok(submission_answer(state.submissions.submit(&source.tenant, &key, task, &source_label).await?))
}
