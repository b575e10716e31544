//! An OpenAI-compatible chat completions endpoint (`POST /v1/chat/completions`),
//! for the dialect suites: it records the call and charges it in the same ledger
//! as `/v1/operations`, and the `start` rules apply to it (matched by the
//! operation name `chat.completions`): `latency_ms`, `status` (+ `retry_after_s`,
//! `bare`), `hang`, `exit`, `drop_after_accept` and `status_after_work`. Limit and
//! conflict rules do not.

use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;

use super::{Arrival, Operation, Rule, Serving, Shared, Target, broken, unix_micros};

/// The operation name chat completions are recorded and matched by.
pub const OPERATION: &str = "chat.completions";

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<serde_json::Value>,
}

/// An error in OpenAI's shape (https://platform.openai.com/docs/guides/error-codes),
/// or with `bare` the page a gateway in front of it would answer.
fn chat_error(rule: &Rule, status: u16, message: &str) -> HttpResponse {
    let code = actix_web::http::StatusCode::from_u16(status).unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
    let mut response = if rule.bare {
        HttpResponse::build(code)
            .content_type("text/html")
            .body(format!("<html><body><h1>{status}</h1>gateway</body></html>"))
    } else {
        let kind = match status {
            429 => "requests",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        HttpResponse::build(code)
            .json(serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": null}}))
    };
    if let Some(after) = rule.retry_after_s
        && let Ok(value) = actix_web::http::header::HeaderValue::from_str(&after.to_string())
    {
        response.headers_mut().insert(actix_web::http::header::RETRY_AFTER, value);
        if let Ok(reset) = actix_web::http::header::HeaderValue::from_str(&format!("{after}s")) {
            response
                .headers_mut()
                .insert(actix_web::http::header::HeaderName::from_static("x-ratelimit-reset-requests"), reset);
        }
    }
    response
}

/// The completion: the assistant echoes the last message's content.
fn completion(request_id: &str, chat: &ChatRequest) -> serde_json::Value {
    let last = chat.messages.last().and_then(|m| m.get("content")).and_then(|c| c.as_str()).unwrap_or_default();
    serde_json::json!({
        "id": request_id,
        "object": "chat.completion",
        "created": unix_micros() / 1_000_000,
        "model": chat.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": format!("You said: {last}"), "refusal": null},
            "logprobs": null,
            "finish_reason": "stop"
        }],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    })
}

pub(crate) async fn chat_completions(req: HttpRequest, shared: web::Data<Shared>, body: web::Bytes) -> HttpResponse {
    let Ok(chat) = serde_json::from_slice::<ChatRequest>(&body) else {
        return chat_error(&Rule::default(), 400, "the body needs `model` and `messages`");
    };
    let input = serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default();
    let arrival = Arrival::now(&req, OPERATION);
    let key = arrival.key.clone();
    let rule = shared.take_rule(Target::Start, OPERATION, key.as_deref(), |_, rule| {
        rule.max_in_flight.is_none() && rule.max_per_second.is_none() && !rule.conflict_while_running
    });
    let record = |outcome: &str, request_id: Option<String>, charged: bool| {
        shared.record(&arrival, &input, outcome, request_id, charged);
    };
    let latency = rule.latency_ms.map(Duration::from_millis).unwrap_or_default();
    if let Some(status) = rule.status {
        tokio::time::sleep(latency).await;
        record(&format!("status:{status}"), None, false);
        return chat_error(&rule, status, "scripted");
    }
    if rule.exit {
        tracing::warn!("fake provider exits on a rule");
        std::process::abort();
    }
    if rule.hang {
        record("hang", None, false);
        std::future::pending::<()>().await;
    }
    // The work, once per key when the provider dedupes.
    let (op, replayed) = shared.work_once_per_key(
        key.as_deref(),
        |_, request_id| Operation {
            request_id: request_id.to_owned(),
            operation: OPERATION.to_owned(),
            key: key.clone(),
            content: serde_json::to_vec(&completion(request_id, &chat)).unwrap_or_default(),
            corrupt: false,
            serving: Serving::Here,
            ready_at: tokio::time::Instant::now(),
        },
        "chatcmpl",
    );
    let outcome = rule.outcome_of_work(replayed, "succeeded");
    record(&outcome, Some(op.request_id.clone()), !replayed);
    if !replayed {
        tokio::time::sleep(latency).await;
    }
    if rule.drop_after_accept {
        return broken("connection dropped after the completion was made");
    }
    if let Some(status) = rule.status_after_work {
        return chat_error(&rule, status, "failed after the completion was made");
    }
    HttpResponse::Ok().content_type("application/json").body(op.content)
}
