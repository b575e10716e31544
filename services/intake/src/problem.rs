//! Every error intake answers is `application/problem+json` (RFC 9457) with a stable
//! `type`; this is the one place that maps errors to status codes.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// Errors an API call can end in. The `type` of each is a contract with clients.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("webhook refused: {0}")]
    BadSignature(String),
    #[error("no task {0}")]
    TaskNotFound(String),
    #[error("{0}")]
    InvalidRequest(String),
    #[error("the Idempotency-Key header is required")]
    IdempotencyKeyMissing,
    #[error("{0}")]
    IdempotencyKeyInvalid(String),
    #[error("this Idempotency-Key was used for a different request")]
    IdempotencyKeyReused,
    #[error("unknown task kind `{0}`")]
    UnknownKind(String),
    #[error("{0}")]
    NotResolvable(String),
    #[error("{0}")]
    CaseChanged(String),
    #[error("{0}")]
    AlreadyResolved(String),
    #[error("{0}")]
    TaskFinished(String),
    #[error("{0}")]
    ApprovalChanged(String),
    #[error("{0}")]
    AlreadyDecided(String),
    #[error("{0}")]
    UnknownSignal(String),
    #[error("{0}")]
    InputInvalid(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("tenant {tenant} is over its request rate; retry after {} s", retry_after_seconds(*.retry_after))]
    TooManyRequests { tenant: String, retry_after: std::time::Duration },
    #[error(
        "intake is serving as many requests as it may at once; retry after {} s",
        retry_after_seconds(crate::admission::OVERLOADED_RETRY_AFTER)
    )]
    Overloaded,
    #[error("internal error; it was logged")]
    Internal(#[from] sqlx::Error),
    #[error("internal error; it was logged")]
    Bus(#[from] fenceline_bus::Error),
}

/// An error answer (RFC 9457), always `application/problem+json`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// Stable: clients branch on it, for example `/problems/idempotency-key-reused`.
    #[serde(rename = "type")]
    #[schema(value_type = String)]
    pub problem_type: &'static str,
    #[schema(value_type = String)]
    pub title: &'static str,
    /// The HTTP status, repeated.
    pub status: u16,
    /// What was wrong with this request, in words.
    pub detail: String,
}

impl ApiError {
    /// Do not change: clients branch on these.
    fn problem_type(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "/problems/unauthorized",
            ApiError::BadSignature(_) => "/problems/bad-signature",
            ApiError::TaskNotFound(_) => "/problems/task-not-found",
            ApiError::InvalidRequest(_) => "/problems/invalid-request",
            ApiError::IdempotencyKeyMissing => "/problems/idempotency-key-missing",
            ApiError::IdempotencyKeyInvalid(_) => "/problems/idempotency-key-invalid",
            ApiError::IdempotencyKeyReused => "/problems/idempotency-key-reused",
            ApiError::UnknownKind(_) => "/problems/unknown-kind",
            ApiError::NotResolvable(_) => "/problems/not-resolvable",
            ApiError::CaseChanged(_) => "/problems/case-changed",
            ApiError::AlreadyResolved(_) => "/problems/already-resolved",
            ApiError::TaskFinished(_) => "/problems/task-finished",
            ApiError::ApprovalChanged(_) => "/problems/approval-changed",
            ApiError::AlreadyDecided(_) => "/problems/already-decided",
            ApiError::UnknownSignal(_) => "/problems/unknown-signal",
            ApiError::InputInvalid(_) => "/problems/input-invalid",
            ApiError::PayloadTooLarge(_) => "/problems/payload-too-large",
            ApiError::TooManyRequests { .. } => "/problems/too-many-requests",
            ApiError::Overloaded => "/problems/overloaded",
            ApiError::Internal(_) | ApiError::Bus(_) => "/problems/internal",
        }
    }

    /// How long the client should wait before it tries again, for the refusals
    /// that pass (`429`, `503`).
    fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            ApiError::TooManyRequests { retry_after, .. } => Some(*retry_after),
            ApiError::Overloaded => Some(crate::admission::OVERLOADED_RETRY_AFTER),
            _ => None,
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "Unauthorized",
            ApiError::BadSignature(_) => "Bad webhook signature",
            ApiError::TaskNotFound(_) => "Task not found",
            ApiError::InvalidRequest(_) => "Invalid request",
            ApiError::IdempotencyKeyMissing | ApiError::IdempotencyKeyInvalid(_) => "Invalid Idempotency-Key",
            ApiError::IdempotencyKeyReused => "Idempotency-Key reused",
            ApiError::UnknownKind(_) => "Unknown task kind",
            ApiError::NotResolvable(_) => "Task cannot be resolved",
            ApiError::CaseChanged(_) => "The task's case changed",
            ApiError::AlreadyResolved(_) => "The case was already resolved",
            ApiError::TaskFinished(_) => "The task is already finished",
            ApiError::ApprovalChanged(_) => "What the approval rests on changed",
            ApiError::AlreadyDecided(_) => "The wait was already decided",
            ApiError::UnknownSignal(_) => "The task never waits for this signal",
            ApiError::InputInvalid(_) => "Input does not fit its kind (its schema, or a request built from it)",
            ApiError::PayloadTooLarge(_) => "Payload too large",
            ApiError::TooManyRequests { .. } => "Too many requests",
            ApiError::Overloaded => "Overloaded",
            ApiError::Internal(_) | ApiError::Bus(_) => "Internal error",
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized | ApiError::BadSignature(_) => StatusCode::UNAUTHORIZED,
            ApiError::TaskNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::InvalidRequest(_) | ApiError::IdempotencyKeyMissing | ApiError::IdempotencyKeyInvalid(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::IdempotencyKeyReused
            | ApiError::UnknownKind(_)
            | ApiError::InputInvalid(_)
            | ApiError::UnknownSignal(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotResolvable(_)
            | ApiError::ApprovalChanged(_)
            | ApiError::AlreadyDecided(_)
            | ApiError::CaseChanged(_)
            | ApiError::AlreadyResolved(_)
            | ApiError::TaskFinished(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) | ApiError::Bus(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let ApiError::Internal(e) = self {
            tracing::error!(error = %e, "request failed on the database");
        }
        if let ApiError::Bus(e) = self {
            tracing::error!(error = %e, "request failed writing its event");
        }
        let mut response = answer(self.status_code(), self.problem_type(), self.title(), self.to_string());
        if let Some(wait) = self.retry_after() {
            response.headers_mut().insert(
                actix_web::http::header::RETRY_AFTER,
                actix_web::http::header::HeaderValue::from(retry_after_seconds(wait)),
            );
        }
        response
    }
}

/// Malformed JSON bodies, path values and oversized bodies answer as problems too.
pub fn json_error(err: actix_web::error::JsonPayloadError, _req: &actix_web::HttpRequest) -> actix_web::Error {
    use actix_web::error::JsonPayloadError;
    let detail = match &err {
        JsonPayloadError::OverflowKnownLength { length, limit } => {
            return payload_too_large(format!("body of {length} bytes is over the limit of {limit}"));
        }
        JsonPayloadError::Overflow { limit } => {
            return payload_too_large(format!("body is over the limit of {limit} bytes"));
        }
        JsonPayloadError::ContentType => {
            return answered(answer(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "/problems/unsupported-media-type",
                "Unsupported media type",
                "send application/json".into(),
            ));
        }
        JsonPayloadError::Deserialize(e) => e.to_string(),
        other => other.to_string(),
    };
    ApiError::InvalidRequest(detail).into()
}

fn payload_too_large(detail: String) -> actix_web::Error {
    ApiError::PayloadTooLarge(detail).into()
}

/// `Retry-After` in whole seconds, rounded up and at least 1: a client that waits
/// that long finds a token.
fn retry_after_seconds(wait: std::time::Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

/// A header over its limit (`431`, `/problems/header-too-large`).
pub fn header_too_large(detail: String) -> HttpResponse {
    answer(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "/problems/header-too-large", "Header too large", detail)
}

/// A method the resource does not take (`405`, with the `Allow` header).
pub fn method_not_allowed(allow: &'static str) -> HttpResponse {
    let mut response = answer(
        StatusCode::METHOD_NOT_ALLOWED,
        "/problems/method-not-allowed",
        "Method not allowed",
        format!("this resource takes {allow}"),
    );
    response
        .headers_mut()
        .insert(actix_web::http::header::ALLOW, actix_web::http::header::HeaderValue::from_static(allow));
    response
}

/// An error that is already its answer.
fn answered(response: HttpResponse) -> actix_web::Error {
    actix_web::error::InternalError::from_response("", response).into()
}

/// The one way a problem is written: its media type, its body, and for `401` the
/// `WWW-Authenticate` challenge.
fn answer(status: StatusCode, problem_type: &'static str, title: &'static str, detail: String) -> HttpResponse {
    let mut response = HttpResponse::build(status);
    response.content_type("application/problem+json");
    if status == StatusCode::UNAUTHORIZED {
        response.insert_header(("WWW-Authenticate", "Bearer"));
    }
    response.json(Problem { problem_type, title, status: status.as_u16(), detail })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_and_is_never_zero() {
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(300)), 1);
        assert_eq!(retry_after_seconds(Duration::from_secs(2)), 2);
        assert_eq!(retry_after_seconds(Duration::from_millis(2001)), 3);
    }

    #[test]
    fn refusals_that_pass_carry_retry_after_and_a_problem() {
        let refused = ApiError::TooManyRequests { tenant: "acme".into(), retry_after: Duration::from_millis(1500) };
        let response = refused.error_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("2"));
        assert_eq!(
            response.headers().get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/problem+json")
        );
        let overloaded = ApiError::Overloaded.error_response();
        assert_eq!(overloaded.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(overloaded.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        assert!(ApiError::TaskNotFound("x".into()).error_response().headers().get("retry-after").is_none());
    }
}
