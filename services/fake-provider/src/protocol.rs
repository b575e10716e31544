//! Fenceline's provider protocol as the fake provider serves it
//! (docs/provider-protocol.md): start an operation, poll it, look it up by key,
//! and fetch its artifact, each misbehaving as the rules say.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{Arrival, InFlight, Operation, Serving, Shared, Target, broken, misbehave, problem, scripted};

#[derive(Debug, Deserialize)]
struct StartOperation {
    operation: String,
    #[serde(default)]
    input: serde_json::Value,
}

#[derive(Debug, Serialize)]
struct Answer {
    request_id: String,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<ArtifactJson>,
}

#[derive(Debug, Serialize)]
struct ArtifactJson {
    uri: String,
    sha256: String,
    size_bytes: usize,
}

fn answer(req: &HttpRequest, shared: &Shared, op: &Operation, done: bool) -> Answer {
    let info = req.connection_info();
    let base = match op.serving {
        Serving::OtherHost => shared.other_host(req),
        Serving::Here | Serving::Redirect => format!("{}://{}", info.scheme(), info.host()),
    };
    Answer {
        request_id: op.request_id.clone(),
        status: if done { "succeeded" } else { "running" },
        result: done.then(|| ArtifactJson {
            uri: format!("{base}/artifacts/{}", op.request_id),
            sha256: hex::encode(Sha256::digest(&op.content)),
            size_bytes: op.content.len(),
        }),
    }
}

pub(crate) async fn start(req: HttpRequest, shared: web::Data<Shared>, body: web::Bytes) -> HttpResponse {
    let Ok(start) = serde_json::from_slice::<StartOperation>(&body) else {
        return problem(400, "body must be {\"operation\": ..., \"input\": ...}");
    };
    let arrival = Arrival::now(&req, &start.operation);
    let key = arrival.key.clone();
    let arrived = tokio::time::Instant::now();
    // A conflict rule applies only while an operation with this key is running, a
    // limit rule only beyond its limit. A request no limit refused counts against
    // the limits at once, under the lock that judged it, so two requests cannot
    // both take the last place.
    let rule = shared.take_rule_then(
        Target::Start,
        &start.operation,
        key.as_deref(),
        |state, rule| {
            (!rule.conflict_while_running
                || key
                    .as_ref()
                    .and_then(|k| state.by_key.get(k))
                    .and_then(|id| state.operations.get(id))
                    .is_some_and(Operation::running))
                && rule.over_limit(state, arrived)
        },
        |state, rule| {
            if rule.max_in_flight.is_none() && rule.max_per_second.is_none() {
                state.in_flight += 1;
                let window = arrived.checked_sub(Duration::from_secs(1));
                while state.started.front().is_some_and(|at| window.is_some_and(|w| *at <= w)) {
                    state.started.pop_front();
                }
                state.started.push_back(arrived);
            }
        },
    );
    let _in_flight = InFlight::counted(&shared, rule.max_in_flight.is_none() && rule.max_per_second.is_none());
    let record = |outcome: &str, request_id: Option<String>, charged: bool| {
        shared.record(&arrival, &start.input, outcome, request_id, charged);
    };
    if rule.conflict_while_running {
        record("conflict", None, false);
        return scripted(&rule, 409, "a request with this Idempotency-Key is still running; ask again later");
    }
    // Scripted refusals come after the latency; accepted work is registered (and
    // visible to look-ups) at once, or after `register_after_ms`, and answered
    // after the latency, as a provider that is still rendering would.
    let latency = rule.latency_ms.map(Duration::from_millis).unwrap_or_default();
    if rule.status.is_some() {
        tokio::time::sleep(latency).await;
    }
    if rule.exit {
        tracing::warn!("fake provider exits on a rule");
        std::process::abort();
    }
    let limited = rule.max_in_flight.is_some() || rule.max_per_second.is_some();
    if let Some(status) = rule.status.or(limited.then_some(429)) {
        record(&format!("status:{status}"), None, false);
        return scripted(&rule, status, if limited { "over the provider's limit" } else { "scripted" });
    }
    if rule.hang {
        record("hang", None, false);
        std::future::pending::<()>().await;
    }
    if let Some(delay) = rule.register_after_ms {
        // In flight, and not yet known: a look-up now says "never received".
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    // Work, once per key when the provider dedupes.
    let (op, replayed) = shared.work_once_per_key(
        key.as_deref(),
        |state, request_id| {
            let delay = latency + if state.capabilities.async_results { shared.async_delay } else { Duration::ZERO };
            Operation {
                request_id: request_id.to_owned(),
                operation: start.operation.clone(),
                key: key.clone(),
                content: format!("{}:{}:{request_id}", start.operation, start.input).into_bytes(),
                corrupt: rule.corrupt_artifact,
                serving: rule.serve_artifact.unwrap_or_default(),
                ready_at: tokio::time::Instant::now() + delay,
            }
        },
        "req",
    );
    let is_async = shared.lock().capabilities.async_results;
    // The call is in the log from the moment the work is registered: a caller
    // that stops while the provider is still rendering has been received.
    let answered_at_once = !is_async || shared.async_delay.is_zero();
    let outcome = rule.outcome_of_work(replayed, if answered_at_once { "succeeded" } else { "accepted" });
    record(&outcome, Some(op.request_id.clone()), !replayed);
    if !replayed {
        tokio::time::sleep(latency).await;
    }
    if rule.drop_after_accept {
        // The work is done and charged; the caller gets a reset, not an answer.
        return broken("connection dropped after accepting");
    }
    if let Some(status) = rule.status_after_work {
        // The work is done and charged; the answer says the provider (or a
        // gateway in front of it) failed.
        return scripted(&rule, status, "failed after the work was done");
    }
    let done = tokio::time::Instant::now() >= op.ready_at;
    if is_async && !done {
        HttpResponse::Accepted().json(Answer { request_id: op.request_id.clone(), status: "accepted", result: None })
    } else {
        HttpResponse::Ok().json(answer(&req, &shared, &op, done))
    }
}

pub(crate) async fn poll(req: HttpRequest, shared: web::Data<Shared>, path: web::Path<String>) -> HttpResponse {
    let op = shared.lock().operations.get(path.as_str()).cloned();
    match op {
        Some(op) => {
            let rule = shared.take_rule(Target::Poll, &op.operation, op.key.as_deref(), |_, _| true);
            if let Some(response) = misbehave(&rule, "connection reset while polling").await {
                return response;
            }
            HttpResponse::Ok().json(answer(&req, &shared, &op, !op.running()))
        }
        None => problem(404, "no such request"),
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct KeyQuery {
    pub(crate) operation_key: Option<String>,
}

pub(crate) async fn lookup(req: HttpRequest, shared: web::Data<Shared>, query: web::Query<KeyQuery>) -> HttpResponse {
    let Some(key) = query.operation_key.clone() else { return problem(400, "operation_key is required") };
    let (lookup, operation) = {
        let state = shared.lock();
        let operation = state.by_key.get(&key).and_then(|id| state.operations.get(id)).map(|op| op.operation.clone());
        (state.capabilities.lookup, operation)
    };
    if !lookup {
        return problem(501, "this provider cannot look operations up");
    }
    let rule = shared.take_rule(Target::Lookup, operation.as_deref().unwrap_or_default(), Some(&key), |_, _| true);
    if let Some(response) = misbehave(&rule, "connection reset while looking up").await {
        return response;
    }
    let state = shared.lock();
    match state.by_key.get(&key).and_then(|id| state.operations.get(id)) {
        Some(op) => HttpResponse::Ok().json(answer(&req, &shared, op, !op.running())),
        None => HttpResponse::NotFound().json(serde_json::json!({"status": "unknown", "operation_key": key})),
    }
}

/// An artifact at this provider's own address.
pub(crate) async fn artifact(req: HttpRequest, shared: web::Data<Shared>, path: web::Path<String>) -> HttpResponse {
    let op = shared.lock().operations.get(path.as_str()).cloned();
    match op.map(|op| (op.serving, op)) {
        Some((Serving::Here, op)) => serve_artifact(&shared, &op).await,
        Some((Serving::Redirect, op)) => HttpResponse::TemporaryRedirect()
            .insert_header((
                actix_web::http::header::LOCATION,
                format!("{}/artifacts/{}", shared.other_host(&req), op.request_id),
            ))
            .finish(),
        // Served elsewhere only: a caller that ignores the result's uri finds nothing.
        Some((Serving::OtherHost, _)) | None => problem(404, "no such artifact"),
    }
}

/// An artifact at the other host (the second port).
pub(crate) async fn artifact_elsewhere(shared: web::Data<Shared>, path: web::Path<String>) -> HttpResponse {
    let op = shared.lock().operations.get(path.as_str()).cloned();
    match op {
        Some(op) if op.serving != Serving::Here => serve_artifact(&shared, &op).await,
        _ => problem(404, "no such artifact"),
    }
}

async fn serve_artifact(shared: &Shared, op: &Operation) -> HttpResponse {
    let rule = shared.take_rule(Target::Artifact, &op.operation, op.key.as_deref(), |_, _| true);
    if let Some(response) = misbehave(&rule, "connection reset while downloading").await {
        return response;
    }
    let mut bytes = op.content.clone();
    if op.corrupt {
        bytes.extend_from_slice(b" (corrupted in storage)");
    }
    HttpResponse::Ok().content_type("application/octet-stream").body(bytes)
}
