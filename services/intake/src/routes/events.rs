//! `/v1/events`: the caller's tenant's task changes as server-sent events.

use actix_web::{HttpRequest, HttpResponse, web};
use sqlx::PgPool;

use super::State;
use crate::auth::Caller;
use crate::problem::ApiError;
use crate::{auth, live, ui};

/// `GET /v1/events`: the caller's tenant's task changes as server-sent events
/// (docs/dashboard.md). Authenticated by the bearer token like every call (a page
/// reads it with `fetch()`), resumable with `Last-Event-ID`, a heartbeat comment
/// every 15 s. Not in the OpenAPI document: it is a stream, not a JSON answer.
pub(crate) async fn events(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
) -> Result<HttpResponse, ApiError> {
    let token = auth::bearer(&req).ok_or(ApiError::Unauthorized)?;
    let last_event_id = req
        .headers()
        .get("Last-Event-ID")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|id| *id > 0);
    let stream = live::Stream {
        pool: pool.get_ref().clone(),
        tenant: caller.0,
        token,
        last_event_id,
        changes: state.changes.subscribe(),
        stopping: state.stopping.clone(),
    };
    let (out, frames) = tokio::sync::mpsc::channel(64);
    actix_web::rt::spawn(live::run(stream, out));
    let body = futures_util::stream::unfold(frames, |mut frames| async move {
        frames.recv().await.map(|frame| (Ok::<_, std::convert::Infallible>(frame), frames))
    });
    let mut response =
        HttpResponse::Ok().content_type("text/event-stream").insert_header(("X-Accel-Buffering", "no")).streaming(body);
    ui::harden(&mut response);
    Ok(response)
}
