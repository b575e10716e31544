//! The vendor APIs the fake provider speaks besides its own protocol, for the
//! dialect suites: Anthropic's messages, Replicate's predictions (accepted, then
//! polled), Stripe's refunds (deduped by `Idempotency-Key`) and Twilio's messages
//! (a form). Each checks what the vendor checks (its credential header, its
//! required fields), answers in the vendor's documented shapes, errors included,
//! records every call and charges the work in the same ledger as
//! `/v1/operations`. The `start` rules apply, matched by the vendor's operation
//! name: `latency_ms`, `status` (+ `retry_after_s`, `bare`), `hang`, `exit`,
//! `drop_after_accept`, `status_after_work`, and for Stripe
//! `conflict_while_running`; `poll` rules apply to prediction polls.

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, web};
use serde_json::{Value, json};

use super::{Arrival, Operation, Rule, Serving, Shared, Target, broken, misbehave, unix_micros};

/// A vendor API the fake speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// `POST /v1/messages` (https://docs.anthropic.com/en/api/messages).
    Anthropic,
    /// `POST /v1/predictions`, `GET /v1/predictions/{id}`
    /// (https://replicate.com/docs/reference/http#predictions.create).
    Replicate,
    /// `POST /v1/refunds`, a form (https://docs.stripe.com/api/refunds/create).
    Stripe,
    /// `POST /2010-04-01/Accounts/{sid}/Messages.json`, a form
    /// (https://www.twilio.com/docs/messaging/api/message-resource).
    Twilio,
}

impl Vendor {
    /// The operation name its calls are recorded and matched by.
    pub fn operation(self) -> &'static str {
        match self {
            Vendor::Anthropic => "anthropic.messages",
            Vendor::Replicate => "replicate.predictions",
            Vendor::Stripe => "stripe.refunds",
            Vendor::Twilio => "twilio.messages",
        }
    }

    /// How its ids begin.
    fn prefix(self) -> &'static str {
        match self {
            Vendor::Anthropic => "msg",
            Vendor::Replicate => "pred",
            Vendor::Stripe => "re",
            Vendor::Twilio => "SM",
        }
    }

    /// The header its credential travels in, and how that value begins.
    fn credential(self) -> (&'static str, &'static str) {
        match self {
            Vendor::Anthropic => ("x-api-key", ""),
            Vendor::Replicate | Vendor::Stripe => ("authorization", "Bearer "),
            Vendor::Twilio => ("authorization", "Basic "),
        }
    }

    /// The request as the vendor reads it, checked as the vendor checks it; the
    /// error is the message of its `400`.
    fn input(self, req: &HttpRequest, body: &[u8]) -> Result<Value, String> {
        match self {
            Vendor::Anthropic => {
                if req.headers().get("anthropic-version").is_none() {
                    return Err("anthropic-version: header is required".to_owned());
                }
                let input: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
                require_json(&input, &[("model", Value::is_string), ("max_tokens", Value::is_u64)])?;
                match input.get("messages").and_then(Value::as_array) {
                    Some(messages) if !messages.is_empty() => Ok(input),
                    _ => Err("messages: at least one message is required".to_owned()),
                }
            }
            Vendor::Replicate => {
                let input: Value = serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
                require_json(&input, &[("version", Value::is_string), ("input", Value::is_object)])?;
                Ok(input)
            }
            Vendor::Stripe => form(body, &["charge", "payment_intent", "amount", "reason", "metadata[ticket]"], |f| {
                if !f.contains_key("charge") && !f.contains_key("payment_intent") {
                    return Err("One of the following params should be provided for this request: payment_intent \
                                or charge."
                        .to_owned());
                }
                match f.get("amount") {
                    Some(amount) if amount.as_str().is_none_or(|a| a.parse::<u64>().is_err()) => {
                        Err(format!("Invalid integer: {amount}"))
                    }
                    _ => Ok(()),
                }
            }),
            Vendor::Twilio => {
                form(body, &["To", "From", "Body", "MessagingServiceSid", "StatusCallback"], |f| {
                    match (f.get("To"), f.get("Body")) {
                        (Some(to), Some(_)) if to.as_str().is_some_and(|to| to.starts_with('+')) => Ok(()),
                        (Some(to), Some(_)) => Err(format!("The 'To' number {to} is not a valid phone number.")),
                        _ => Err("A 'To' phone number and a 'Body' are required.".to_owned()),
                    }
                })
            }
        }
    }

    /// The answer to work done (or, for a prediction, still running).
    fn answer(self, req: &HttpRequest, op: &Operation, input: &Value, done: bool) -> (StatusCode, Value) {
        let created = unix_micros() / 1_000_000;
        let id = op.request_id.as_str();
        match self {
            Vendor::Anthropic => {
                let last = input["messages"].as_array().and_then(|m| m.last()).map(|m| &m["content"]);
                let said = last.and_then(Value::as_str).unwrap_or_default();
                let message = json!({
                    "id": id, "type": "message", "role": "assistant", "model": input["model"],
                    "content": [{"type": "text", "text": format!("You said: {said}")}],
                    "stop_reason": "end_turn", "stop_sequence": null,
                    "usage": {"input_tokens": 9, "output_tokens": 4}
                });
                (StatusCode::OK, message)
            }
            Vendor::Replicate => {
                let base = format!("{}://{}", req.connection_info().scheme(), req.connection_info().host());
                let prediction = json!({
                    "id": id, "model": "fenceline/fake-sketcher", "version": input["version"],
                    "input": input["input"], "logs": "", "error": null,
                    "status": if done { "succeeded" } else { "starting" },
                    "output": if done { json!([format!("{base}/artifacts/{id}")]) } else { Value::Null },
                    "created_at": created,
                    "urls": {"get": format!("{base}/v1/predictions/{id}"),
                             "cancel": format!("{base}/v1/predictions/{id}/cancel")}
                });
                (StatusCode::CREATED, prediction)
            }
            Vendor::Stripe => {
                let refund = json!({
                    "id": id, "object": "refund", "amount": input["amount"].as_str().and_then(|a| a.parse::<u64>().ok()).unwrap_or(1000),
                    "balance_transaction": format!("txn_{id}"), "charge": input.get("charge").cloned().unwrap_or(Value::Null),
                    "created": created, "currency": "usd", "metadata": {},
                    "payment_intent": input.get("payment_intent").cloned().unwrap_or(Value::Null),
                    "reason": input.get("reason").cloned().unwrap_or(Value::Null), "receipt_number": null,
                    "source_transfer_reversal": null, "status": "succeeded", "transfer_reversal": null
                });
                (StatusCode::OK, refund)
            }
            Vendor::Twilio => {
                let account = req.match_info().get("account").unwrap_or_default();
                let message = json!({
                    "account_sid": account, "api_version": "2010-04-01", "body": input["Body"],
                    "date_created": rfc2822_now(), "date_sent": null, "date_updated": rfc2822_now(),
                    "direction": "outbound-api", "error_code": null, "error_message": null,
                    "from": input.get("From").cloned().unwrap_or(Value::Null),
                    "messaging_service_sid": input.get("MessagingServiceSid").cloned().unwrap_or(Value::Null),
                    "num_media": "0", "num_segments": "1", "price": null, "price_unit": "USD",
                    "sid": id, "status": "queued", "to": input["To"],
                    "uri": format!("/2010-04-01/Accounts/{account}/Messages/{id}.json")
                });
                (StatusCode::CREATED, message)
            }
        }
    }

    /// An error in the vendor's shape, or with `bare` the page a gateway in front
    /// of it would answer; throttling headers as the vendor sends them.
    fn error(self, rule: &Rule, status: u16, message: &str) -> HttpResponse {
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut response = if rule.bare {
            HttpResponse::build(code)
                .content_type("text/html")
                .body(format!("<html><body><h1>{status}</h1>gateway</body></html>"))
        } else {
            match self {
                Vendor::Anthropic => {
                    let kind = match status {
                        400 => "invalid_request_error",
                        401 => "authentication_error",
                        403 => "permission_error",
                        404 => "not_found_error",
                        413 => "request_too_large",
                        429 => "rate_limit_error",
                        529 => "overloaded_error",
                        _ => "api_error",
                    };
                    HttpResponse::build(code)
                        .json(json!({"type": "error", "error": {"type": kind, "message": message}}))
                }
                Vendor::Replicate => HttpResponse::build(code)
                    .content_type("application/problem+json")
                    .json(json!({"title": message, "detail": message, "status": status})),
                Vendor::Stripe => {
                    let (kind, error_code) = match status {
                        402 => ("card_error", "card_declined"),
                        409 => ("invalid_request_error", "idempotency_key_in_use"),
                        429 => ("invalid_request_error", "rate_limit"),
                        400..=499 => ("invalid_request_error", "parameter_invalid"),
                        _ => ("api_error", "api_error"),
                    };
                    let should_retry = matches!(status, 409 | 429) || status >= 500;
                    HttpResponse::build(code)
                        .insert_header(("Stripe-Should-Retry", should_retry.to_string()))
                        .json(json!({"error": {"type": kind, "code": error_code, "message": message}}))
                }
                Vendor::Twilio => {
                    let twilio_code = match status {
                        400 => 21211,
                        401 => 20003,
                        404 => 20404,
                        429 => 20429,
                        503 => 20503,
                        _ => 20500,
                    };
                    HttpResponse::build(code).json(json!({
                        "code": twilio_code, "message": message, "status": status,
                        "more_info": format!("https://www.twilio.com/docs/errors/{twilio_code}")
                    }))
                }
            }
        };
        if let Some(after) = rule.retry_after_s {
            let headers = response.headers_mut();
            if let Ok(value) = HeaderValue::from_str(&after.to_string()) {
                headers.insert(actix_web::http::header::RETRY_AFTER, value);
            }
            if self == Vendor::Anthropic {
                let at = std::time::SystemTime::now() + Duration::from_secs(after);
                let instant = rfc3339(at);
                if let Ok(value) = HeaderValue::from_str(&instant) {
                    headers.insert(HeaderName::from_static("anthropic-ratelimit-requests-reset"), value);
                }
            }
        }
        response
    }
}

/// A check of a JSON field's kind (`Value::is_string`).
type Kind = fn(&Value) -> bool;

/// Each named field of `input`, present and of its kind.
fn require_json(input: &Value, fields: &[(&str, Kind)]) -> Result<(), String> {
    for (name, kind) in fields {
        if !input.get(*name).is_some_and(kind) {
            return Err(format!("{name}: Field required"));
        }
    }
    Ok(())
}

/// A form body, refused (as Stripe and Twilio do) when it names a parameter the
/// vendor does not know, then checked by `check`.
fn form(
    body: &[u8],
    known: &[&str],
    check: impl FnOnce(&serde_json::Map<String, Value>) -> Result<(), String>,
) -> Result<Value, String> {
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_bytes(body).map_err(|e| format!("the body is not a form: {e}"))?;
    let mut fields = serde_json::Map::new();
    for (name, value) in pairs {
        if !known.contains(&name.as_str()) {
            return Err(format!("Received unknown parameter: {name}"));
        }
        fields.insert(name, Value::String(value));
    }
    check(&fields)?;
    Ok(Value::Object(fields))
}

/// Now as RFC 2822, as Twilio writes its dates.
fn rfc2822_now() -> String {
    let format = time::format_description::well_known::Rfc2822;
    time::OffsetDateTime::now_utc().format(&format).unwrap_or_default()
}

/// An instant as RFC 3339, as Anthropic says when a limit resets.
fn rfc3339(at: std::time::SystemTime) -> String {
    let format = time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from(at).format(&format).unwrap_or_default()
}

/// `POST` of a vendor's create call: the rules, the work once per key (when the
/// fake dedupes and the vendor sends a key), the vendor's answer.
pub(crate) async fn create(
    vendor: Vendor,
    req: HttpRequest,
    shared: web::Data<Shared>,
    body: web::Bytes,
) -> HttpResponse {
    let operation = vendor.operation();
    let arrival = Arrival::now(&req, operation);
    let key = arrival.key.clone();
    let record = |outcome: &str, input: &Value, request_id: Option<String>, charged: bool| {
        shared.record(&arrival, input, outcome, request_id, charged);
    };
    let (header, scheme) = vendor.credential();
    let credential = req.headers().get(header).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if credential.len() <= scheme.len() || !credential.starts_with(scheme) {
        record("status:401", &Value::Null, None, false);
        return vendor.error(&Rule::default(), 401, &format!("{header}: a credential is required"));
    }
    let input = match vendor.input(&req, &body) {
        Ok(input) => input,
        Err(why) => {
            record("status:400", &Value::String(String::from_utf8_lossy(&body).into_owned()), None, false);
            return vendor.error(&Rule::default(), 400, &why);
        }
    };
    let rule = shared.take_rule(Target::Start, operation, key.as_deref(), |state, rule| {
        rule.max_in_flight.is_none()
            && rule.max_per_second.is_none()
            && (!rule.conflict_while_running
                || key
                    .as_ref()
                    .and_then(|k| state.by_key.get(k))
                    .and_then(|id| state.operations.get(id))
                    .is_some_and(Operation::running))
    });
    if rule.conflict_while_running {
        record("conflict", &input, None, false);
        return vendor.error(&rule, 409, "There is currently another in-progress request using this Idempotency-Key");
    }
    let latency = rule.latency_ms.map(Duration::from_millis).unwrap_or_default();
    if let Some(status) = rule.status {
        tokio::time::sleep(latency).await;
        record(&format!("status:{status}"), &input, None, false);
        return vendor.error(&rule, status, "scripted");
    }
    if rule.exit {
        tracing::warn!("fake provider exits on a rule");
        std::process::abort();
    }
    if rule.hang {
        record("hang", &input, None, false);
        std::future::pending::<()>().await;
    }
    let key_sent = if vendor == Vendor::Stripe { key.as_deref() } else { None };
    let (op, replayed) = shared.work_once_per_key(
        key_sent,
        |state, request_id| {
            // A prediction runs for the fake's async delay when it answers later.
            let running = if vendor == Vendor::Replicate && state.capabilities.async_results {
                shared.async_delay
            } else {
                Duration::ZERO
            };
            Operation {
                request_id: request_id.to_owned(),
                operation: operation.to_owned(),
                key: key_sent.map(str::to_owned),
                content: format!("{operation}:{input}:{request_id}").into_bytes(),
                corrupt: false,
                serving: Serving::Here,
                ready_at: tokio::time::Instant::now() + latency + running,
            }
        },
        vendor.prefix(),
    );
    let outcome = rule.outcome_of_work(replayed, "succeeded");
    record(&outcome, &input, Some(op.request_id.clone()), !replayed);
    if !replayed {
        tokio::time::sleep(latency).await;
    }
    if rule.drop_after_accept {
        return broken("connection dropped after the work was done");
    }
    if let Some(status) = rule.status_after_work {
        return vendor.error(&rule, status, "failed after the work was done");
    }
    let answered = shared.lock().answers.get(&op.request_id).cloned();
    let (status, body) = match answered {
        // A replay answers what the first request was answered.
        Some(first) if replayed => (StatusCode::OK, first),
        _ => vendor.answer(&req, &op, &input, !op.running()),
    };
    shared.lock().answers.entry(op.request_id.clone()).or_insert_with(|| body.clone());
    let mut response = HttpResponse::build(status);
    if replayed {
        response.insert_header(("Idempotent-Replayed", "true"));
    }
    response.json(body)
}

/// `GET /v1/predictions/{id}`: the prediction as it stands.
pub(crate) async fn poll_prediction(
    req: HttpRequest,
    shared: web::Data<Shared>,
    path: web::Path<String>,
) -> HttpResponse {
    let vendor = Vendor::Replicate;
    let op = shared.lock().operations.get(path.as_str()).cloned();
    let Some(op) = op.filter(|op| op.operation == vendor.operation()) else {
        return vendor.error(&Rule::default(), 404, "Not found.");
    };
    let rule = shared.take_rule(Target::Poll, &op.operation, op.key.as_deref(), |_, _| true);
    if let Some(response) = misbehave(&rule, "connection reset while polling").await {
        return response;
    }
    // The first answer carries the prediction's version and input.
    let first = shared.lock().answers.get(&op.request_id).cloned().unwrap_or_default();
    let (_, mut prediction) = vendor.answer(&req, &op, &first, !op.running());
    if let Some(first) = prediction.as_object_mut() {
        first.insert("status".to_owned(), json!(if op.running() { "processing" } else { "succeeded" }));
    }
    HttpResponse::Ok().json(prediction)
}
