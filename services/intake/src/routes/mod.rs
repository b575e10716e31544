//! Intake's HTTP routes under `/v1`: the route table, the state handlers share,
//! and what every route does alike (the header limits, `405` with `Allow`, the task
//! id from the path). One file per resource beside it, each handler with its
//! OpenAPI description.

pub(crate) mod actions;
pub(crate) mod events;
pub(crate) mod spend;
pub(crate) mod tasks;
pub(crate) mod webhooks;

use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{HttpResponse, web};
use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;

use crate::auth::Caller;
use crate::problem::{self, ApiError};
use crate::{HEADER_VALUE_LIMIT, HEADERS_LIMIT, kinds, live, sealing};

/// Shared state of the handlers.
#[derive(Debug, Clone)]
pub(crate) struct State {
    pub(crate) outbox: OutboxWriter,
    /// Writes the API's and the webhooks' submissions, together when they arrive together.
    pub(crate) submissions: crate::tasks::SubmissionWriter,
    pub(crate) kinds: Arc<kinds::KindCatalog>,
    pub(crate) webhook_tolerance_seconds: i64,
    /// The keys that open sealed webhook secrets; `None`: secrets are in clear.
    pub(crate) sealing: Option<Arc<sealing::SealingKeys>>,
    /// The OpenAPI document, rendered once.
    pub(crate) openapi: Arc<String>,
    /// The changes this instance's follower reads, for the event streams.
    pub(crate) changes: live::Changes,
    /// Cancelled when the service begins to stop: the event streams end.
    pub(crate) stopping: tokio_util::sync::CancellationToken,
}

/// The routes under `/v1`.
pub(crate) fn api(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/openapi.json", "GET").route(web::get().to(openapi_document)));
    cfg.service(resource("/tasks", "GET, POST").route(web::post().to(tasks::submit)).route(web::get().to(tasks::list)));
    cfg.service(resource("/tasks/{task_id}", "GET").route(web::get().to(tasks::read)));
    cfg.service(resource("/tasks/{task_id}/cancel", "POST").route(web::post().to(actions::cancel)));
    cfg.service(resource("/tasks/{task_id}/signals/{name}", "POST").route(web::post().to(actions::signal)));
    cfg.service(resource("/tasks/{task_id}/resolution", "POST").route(web::post().to(actions::resolve)));
    cfg.service(resource("/tasks/{task_id}/approve", "POST").route(web::post().to(actions::approve)));
    cfg.service(resource("/tasks/{task_id}/reject", "POST").route(web::post().to(actions::reject)));
    cfg.service(resource("/summary", "GET").route(web::get().to(tasks::summary)));
    cfg.service(resource("/spend", "GET").route(web::get().to(spend::spend)));
    cfg.service(resource("/events", "GET").route(web::get().to(events::events)));
    cfg.service(resource("/webhooks/{source}", "POST").route(web::post().to(webhooks::webhook)));
}

/// A resource that answers `405` with `Allow: allow` to any other method.
pub(crate) fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move || async move { problem::method_not_allowed(allow) }))
}

/// Answers `431` (a problem) for a header value over [`HEADER_VALUE_LIMIT`] or headers
/// over [`HEADERS_LIMIT`] in all, before any handler reads them.
pub(crate) async fn header_limits(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let mut total = 0;
    for (name, value) in request.headers() {
        let size = name.as_str().len() + value.len();
        total += size;
        let refused = if value.len() > HEADER_VALUE_LIMIT {
            Some(format!("header {name} is {} bytes; the limit is {HEADER_VALUE_LIMIT}", value.len()))
        } else if total > HEADERS_LIMIT {
            Some(format!("the headers are over {HEADERS_LIMIT} bytes in all"))
        } else {
            None
        };
        if let Some(detail) = refused {
            return Ok(request.into_response(problem::header_too_large(detail)).map_into_right_body());
        }
    }
    next.call(request).await.map(ServiceResponse::map_into_left_body)
}

/// The OpenAPI document of this API.
pub(crate) async fn openapi_document(state: web::Data<State>) -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body(state.openapi.as_str().to_owned())
}

/// A task id from the path; anything else names no task.
pub(crate) fn task_id(raw: &str) -> Result<TaskId, ApiError> {
    raw.parse().map_err(|_| ApiError::TaskNotFound(raw.to_owned()))
}

/// Who asked, for the audit trail: the tenant, never the token itself.
pub(crate) fn who(caller: &Caller) -> String {
    format!("tenant:{}", caller.0.as_str())
}
