//! What happens around every HTTP request a service serves: a span that continues
//! the caller's `traceparent` (so an API submission starts, or joins, the task's
//! trace) and the request's duration by route and status.

use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::Method;
use actix_web::middleware::Next;
use fenceline_telemetry::metrics::{HttpLabels, global};
use tracing::Instrument as _;

/// Routes probed by machines every few seconds: timed, never traced.
const UNTRACED: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

pub(crate) async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let started = Instant::now();
    // Any token is a method to HTTP: those outside the standard set count as one,
    // so that no client can grow the label set.
    let method = match *req.method() {
        Method::GET | Method::HEAD | Method::POST | Method::PUT | Method::DELETE | Method::PATCH | Method::OPTIONS => {
            req.method().as_str().to_owned()
        }
        _ => "other".to_owned(),
    };
    // The route's pattern, never its path: ids stay out of span names and labels.
    let route = req.match_pattern().unwrap_or_else(|| "unmatched".to_owned());
    let span = if UNTRACED.contains(&route.as_str()) {
        tracing::Span::none()
    } else {
        let span = tracing::info_span!(
            "http request",
            otel.name = format!("{method} {route}"),
            otel.kind = "server",
            http.request.method = %method,
            http.route = %route,
            http.response.status_code = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        );
        let traceparent = req.headers().get("traceparent").and_then(|v| v.to_str().ok());
        fenceline_telemetry::continue_trace(&span, traceparent);
        fenceline_telemetry::record_trace_id(&span);
        span
    };
    let result = next.call(req).instrument(span.clone()).await;
    let status = match &result {
        Ok(response) => response.status().as_u16(),
        Err(e) => e.as_response_error().status_code().as_u16(),
    };
    span.record("http.response.status_code", status);
    global()
        .http
        .duration
        .get_or_create(&HttpLabels { method, route, status })
        .observe(started.elapsed().as_secs_f64());
    result
}
