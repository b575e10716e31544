//! The adapter for providers described by a dialect (docs/catalog.md, "Dialects"):
//! renders the request from the dialect's templates and reads the answer into the
//! same [`CallAnswer`] the protocol adapter produces, so the executor follows it
//! by the same rules. An answer that does not match the description is ambiguous,
//! never done.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use fenceline_config::dialect::{DialectSpec, ResultForm, template_environment};
use fenceline_domain::calls::CallOutcome;
use fenceline_domain::vocabulary::ErrorClass;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{CallAnswer, ProviderResult};

/// The `uri` of an inline result before the executor names it
/// (`inline:<task>/<generation>/<step>`).
pub const INLINE_URI_SCHEME: &str = "inline:";

/// A provider's dialect, its templates compiled once.
#[derive(Debug)]
pub struct Dialect {
    pub spec: DialectSpec,
    env: minijinja::Environment<'static>,
    error_classes: BTreeMap<String, ErrorClass>,
}

/// A request's body before it is encoded.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestBody {
    Json(Value),
    /// A form's fields, in the dialect's order.
    Form(Vec<(String, String)>),
}

/// A request rendered from the templates, ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedRequest {
    pub method: String,
    /// Appended to the provider's base URL.
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// The body and its content type, when there is one.
    pub body: Option<(Vec<u8>, &'static str)>,
}

/// What an answer came to, and where to poll it, when the answer names a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    pub answer: CallAnswer,
    pub poll_url: Option<String>,
}

impl Reading {
    fn of(answer: CallAnswer) -> Self {
        Reading { answer, poll_url: None }
    }

    /// An answer that does not match the dialect: the work may have happened.
    fn unreadable(why: String) -> Self {
        Reading::of(CallAnswer::Outcome(CallOutcome::ResetMidResponse, Some(why)))
    }
}

const BODY: &str = "request.body";
const PATH: &str = "request.path";
const POLL_PATH: &str = "poll.path";

impl Dialect {
    /// Compiles a dialect the catalogue already checked.
    pub fn new(spec: &DialectSpec) -> Result<Self, String> {
        let mut env = template_environment();
        for site in spec.request_templates() {
            env.add_template_owned(site.field.clone(), site.source).map_err(|e| format!("{}: {e}", site.field))?;
        }
        if let Some(path) = spec.poll.as_ref().and_then(|p| p.path.clone()) {
            env.add_template_owned(POLL_PATH, path).map_err(|e| format!("{POLL_PATH}: {e}"))?;
        }
        Ok(Dialect { spec: spec.clone(), env, error_classes: spec.error_classes() })
    }

    /// The template context: `{input, steps, task: {id}, operation_key}`, from the
    /// step envelope `{"task": <input>, "steps": {...}}` the protocol sends.
    pub fn context(envelope: &Value, task_id: &str, operation_key: &str) -> Value {
        serde_json::json!({
            "input": envelope.get("task").cloned().unwrap_or(Value::Null),
            "steps": envelope.get("steps").cloned().unwrap_or_else(|| Value::Object(Default::default())),
            "task": { "id": task_id },
            "operation_key": operation_key,
        })
    }

    fn render(&self, name: &str, context: &Value) -> Result<String, String> {
        let template = self.env.get_template(name).map_err(|e| format!("{name}: {e}"))?;
        template.render(context).map_err(|e| format!("{name}: {e}"))
    }

    /// Renders the request. An error (a name the input lacks, a body that is not
    /// JSON) means nothing is sent.
    pub fn request(&self, context: &Value, operation_key: &str) -> Result<RenderedRequest, String> {
        let request = &self.spec.request;
        let path = self.path(context)?;
        let mut headers = Vec::new();
        for name in request.headers.keys() {
            headers.push((name.clone(), self.render(&format!("request.headers.{name}"), context)?));
        }
        if let Some(header) = &self.spec.idempotency_header {
            headers.push((header.clone(), operation_key.to_owned()));
        }
        let body = self.body(context)?.map(|body| match body {
            RequestBody::Json(json) => (serde_json::to_vec(&json).unwrap_or_default(), "application/json"),
            RequestBody::Form(fields) => (form_urlencoded(&fields).into_bytes(), "application/x-www-form-urlencoded"),
        });
        Ok(RenderedRequest { method: self.method(), path, headers, body })
    }

    /// The request's method, upper case.
    pub fn method(&self) -> String {
        self.spec.request.method.to_ascii_uppercase()
    }

    /// The request's path, rendered.
    pub fn path(&self, context: &Value) -> Result<String, String> {
        self.render(PATH, context)
    }

    /// The request's body before it is encoded, rendered; `None` without one.
    pub fn body(&self, context: &Value) -> Result<Option<RequestBody>, String> {
        let request = &self.spec.request;
        if request.body.is_some() {
            let text = self.render(BODY, context)?;
            let json: Value =
                serde_json::from_str(&text).map_err(|e| format!("{BODY} did not render to JSON ({e}): {text}"))?;
            return Ok(Some(RequestBody::Json(json)));
        }
        let Some(form) = &request.form else { return Ok(None) };
        let mut fields = Vec::new();
        for name in form.keys() {
            fields.push((name.clone(), self.render(&format!("request.form.{name}"), context)?));
        }
        Ok(Some(RequestBody::Form(fields)))
    }

    /// The poll path of an accepted job, from the `poll.path` template.
    pub fn poll_path(&self, request_id: &str) -> Option<Result<String, String>> {
        self.spec.poll.as_ref()?.path.as_ref()?;
        Some(self.render(POLL_PATH, &serde_json::json!({ "request_id": request_id })))
    }

    /// Reads an answer: its status, headers and body, as the dialect describes them.
    pub fn read(&self, status: u16, headers: &ureq::http::HeaderMap, body: &[u8], now: SystemTime) -> Reading {
        let answer = &self.spec.answer;
        if !(200..=299).contains(&status) {
            let (own_body, error_type) = self.error_body(body);
            let class_named = error_type
                .as_deref()
                .and_then(|t| self.error_classes.get(t))
                .copied()
                .or_else(|| self.told_not_to_retry(status, headers).then_some(ErrorClass::Rejected));
            let retry_after = self.retry_after(headers, now);
            let outcome = CallOutcome::Answered { status, retry_after, problem_body: own_body, class_named };
            return Reading::of(CallAnswer::Outcome(outcome, error_type.map(|t| format!("error type `{t}`"))));
        }
        let done_status = answer.statuses.done.contains(&status);
        if !done_status && !answer.statuses.accepted.contains(&status) {
            return Reading::unreadable(format!("{status} is neither a done nor an accepted status of the dialect"));
        }
        let Ok(json) = serde_json::from_slice::<Value>(body) else {
            return Reading::unreadable(format!("the {status} answer is not JSON"));
        };
        let request_id = match answer.request_id.as_deref().map(|p| json.pointer(p)) {
            None => String::new(),
            Some(Some(Value::String(id))) if !id.is_empty() && !id.contains('\0') => id.clone(),
            Some(Some(Value::Number(id))) => id.to_string(),
            Some(_) => return Reading::unreadable(format!("the {status} answer names no request id")),
        };
        let finished = match answer.state.as_deref() {
            None => done_status,
            Some(pointer) => match json.pointer(pointer).and_then(Value::as_str) {
                Some(state) if answer.succeeded_states.contains(state) => true,
                Some(state) if answer.running_states.contains(state) => false,
                Some(state) if answer.failed_states.contains(state) => {
                    return Reading::unreadable(format!("the job {request_id} ended in state `{state}`"));
                }
                Some(state) => return Reading::unreadable(format!("the job state `{state}` is not in the dialect")),
                None => return Reading::unreadable(format!("the {status} answer has no job state")),
            },
        };
        if !finished {
            if self.spec.poll.is_none() {
                return Reading::unreadable(format!("{status}: accepted, but the dialect says no way to follow a job"));
            }
            if request_id.is_empty() {
                return Reading::unreadable("accepted without a request id to follow".to_owned());
            }
            let poll_url = self
                .spec
                .poll
                .as_ref()
                .and_then(|p| p.url.as_deref())
                .and_then(|p| json.pointer(p))
                .and_then(Value::as_str)
                .map(str::to_owned);
            return Reading { answer: CallAnswer::Accepted { request_id }, poll_url };
        }
        let Some(result) = json.pointer(&answer.result) else {
            return Reading::unreadable(format!("the {status} answer holds no result at `{}`", answer.result));
        };
        let read = match answer.result_form {
            ResultForm::Inline => inline_result(result, self.spec.max_inline_result_bytes),
            ResultForm::Artifact => match serde_json::from_value::<ProviderResult>(result.clone()) {
                Ok(result) if !result.uri.contains('\0') && !result.sha256.contains('\0') => Ok(result),
                _ => Err("the result is not {\"uri\", \"sha256\", \"size_bytes\"}".to_owned()),
            },
        };
        match read {
            Ok(mut result) => {
                result.usage = usage_of(&json, &answer.usage);
                Reading::of(CallAnswer::Done { request_id, result })
            }
            Err(why) => Reading::unreadable(why),
        }
    }

    /// Whether an error body is the provider's own (JSON, with the error type where
    /// the dialect says it is), and the type it names.
    fn error_body(&self, body: &[u8]) -> (bool, Option<String>) {
        let Ok(json) = serde_json::from_slice::<Value>(body) else { return (false, None) };
        if !json.is_object() {
            return (false, None);
        }
        match self.spec.answer.error_type.as_deref() {
            None => (true, None),
            Some(pointer) => match json.pointer(pointer) {
                Some(Value::String(t)) => (true, Some(t.clone())),
                Some(Value::Null) | None => (false, None),
                Some(other) => (true, Some(other.to_string())),
            },
        }
    }

    /// Whether the vendor's should-retry header says `false` on a 4xx other than
    /// a 409 (which at a provider that dedupes is the key still running).
    fn told_not_to_retry(&self, status: u16, headers: &ureq::http::HeaderMap) -> bool {
        let Some(name) = self.spec.answer.should_retry_header.as_deref() else { return false };
        (400..=499).contains(&status)
            && status != 409
            && headers.get(name).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim().eq_ignore_ascii_case("false"))
    }

    /// How long a throttled answer asks to wait: the longest of `Retry-After` (in
    /// seconds or as an HTTP date) and the dialect's reset headers.
    fn retry_after(&self, headers: &ureq::http::HeaderMap, now: SystemTime) -> Option<Duration> {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
        let throttling = &self.spec.throttling;
        let retry_after =
            text("retry-after").filter(|_| throttling.retry_after).and_then(|v| retry_after_value(v, now));
        let resets = throttling.reset_headers.iter().filter_map(|name| text(name).and_then(|v| reset_duration(v, now)));
        retry_after.into_iter().chain(resets).max()
    }
}

/// `Retry-After`: delay seconds, or an HTTP date (a date past is no wait).
pub fn retry_after_value(value: &str, now: SystemTime) -> Option<Duration> {
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// A reset header's wait: a duration as Go prints them and OpenAI sends them
/// (`1s`, `6m0s`, `20ms`, `1h2m3.5s`), a bare number of seconds, or the RFC 3339
/// instant Anthropic sends (an instant past is no wait).
pub fn reset_duration(value: &str, now: SystemTime) -> Option<Duration> {
    if let Ok(at) = time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc3339) {
        return Some(SystemTime::from(at).duration_since(now).unwrap_or(Duration::ZERO));
    }
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    if value.is_empty() {
        return None;
    }
    let mut total = 0.0;
    let mut rest = value;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).filter(|i| *i > 0)?;
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += number * scale;
        rest = &rest[unit_len..];
    }
    total.is_finite().then(|| Duration::from_secs_f64(total))
}

/// A JSON value's canonical text (object keys sorted, no whitespace): what
/// Fenceline hashes an inline result by, as it digests what a person approved.
pub use fenceline_domain::approvals::canonical_json;

/// The counts a done answer reports at the dialect's `answer.usage` pointers; a
/// count that is absent or not a whole number is left out.
fn usage_of(
    json: &Value,
    pointers: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, u64> {
    pointers.iter().filter_map(|(name, pointer)| Some((name.clone(), json.pointer(pointer)?.as_u64()?))).collect()
}

/// An inline result: the value, its size and sha256 by its canonical text. Above
/// `limit` bytes, or with text Postgres cannot store (a NUL character), it is
/// refused: the work happened, but nothing of it can be kept.
pub fn inline_result(value: &Value, limit: u64) -> Result<ProviderResult, String> {
    let text = canonical_json(value);
    if text.len() as u64 > limit {
        return Err(format!("the inline result is {} bytes, above the limit of {limit}", text.len()));
    }
    if holds_nul(value) {
        return Err("the inline result holds a NUL character, which cannot be stored".to_owned());
    }
    Ok(ProviderResult {
        uri: INLINE_URI_SCHEME.to_owned(),
        sha256: hex::encode(Sha256::digest(text.as_bytes())),
        size_bytes: i64::try_from(text.len()).unwrap_or(i64::MAX),
        inline: Some(value.clone()),
        usage: std::collections::BTreeMap::new(),
    })
}

/// Whether any text in the value, key or string, holds a NUL character.
fn holds_nul(value: &Value) -> bool {
    match value {
        Value::String(text) => text.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || holds_nul(v)),
        _ => false,
    }
}

/// `application/x-www-form-urlencoded`: unreserved bytes kept, space as `+`.
fn form_urlencoded(fields: &[(String, String)]) -> String {
    let encode = |text: &str| {
        text.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*' => (b as char).to_string(),
                b' ' => "+".to_owned(),
                other => format!("%{other:02X}"),
            })
            .collect::<String>()
    };
    fields.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect::<Vec<_>>().join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialect(spec: Value) -> Dialect {
        Dialect::new(&serde_json::from_value(spec).expect("a dialect")).expect("compiles")
    }

    /// The shipped OpenAI-compatible chat completions dialect (docs/providers.md).
    fn chat() -> Dialect {
        dialect(serde_json::json!({
            "request": {
                "path": "/v1/chat/completions",
                "body": "{\"model\": {{ input.model | tojson }}, \"messages\": {{ input.messages | tojson }}}"
            },
            "answer": {
                "request_id": "/id", "result": "/choices/0/message", "error_type": "/error/type",
                "error_classes": {"insufficient_quota": "not_authorised"},
                "usage": {"prompt_tokens": "/usage/prompt_tokens", "completion_tokens": "/usage/completion_tokens",
                          "cached_tokens": "/usage/prompt_tokens_details/cached_tokens"}
            },
            "throttling": {"reset_headers": ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"]}
        }))
    }

    fn headers(pairs: &[(&'static str, &str)]) -> ureq::http::HeaderMap {
        pairs.iter().map(|(k, v)| (ureq::http::HeaderName::from_static(k), v.parse().expect("value"))).collect()
    }

    fn now() -> SystemTime {
        httpdate::parse_http_date("Wed, 21 Oct 2026 07:28:00 GMT").expect("date")
    }

    fn read(d: &Dialect, status: u16, pairs: &[(&'static str, &str)], body: &str) -> CallAnswer {
        d.read(status, &headers(pairs), body.as_bytes(), now()).answer
    }

    fn outcome(answer: &CallAnswer) -> CallOutcome {
        match answer {
            CallAnswer::Outcome(outcome, _) => outcome.clone(),
            other => panic!("not an outcome: {other:?}"),
        }
    }

    #[test]
    fn the_request_is_rendered_from_the_task_input_and_earlier_steps() {
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/tasks/{{ task.id }}", "headers": {"X-Classified": "{{ steps.classify.label }}"},
                        "body": "{\"q\": {{ input.q | tojson }}, \"key\": {{ operation_key | tojson }}}"},
            "idempotency_header": "Idempotency-Key",
            "answer": {"result": ""}
        }));
        let envelope =
            serde_json::json!({"task": {"q": "a \"quoted\" lamp"}, "steps": {"classify": {"label": "billing"}}});
        let request = d.request(&Dialect::context(&envelope, "t1", "k1"), "k1").expect("renders");
        assert_eq!((request.method.as_str(), request.path.as_str()), ("POST", "/v1/tasks/t1"));
        assert!(request.headers.contains(&("X-Classified".to_owned(), "billing".to_owned())));
        assert!(request.headers.contains(&("Idempotency-Key".to_owned(), "k1".to_owned())));
        let (body, mime) = request.body.expect("a body");
        assert_eq!(mime, "application/json");
        let body: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body, serde_json::json!({"q": "a \"quoted\" lamp", "key": "k1"}));
        // Strict: an input without `q` sends nothing.
        let lacking =
            Dialect::context(&serde_json::json!({"task": {}, "steps": {"classify": {"label": "x"}}}), "t", "k");
        assert!(d.request(&lacking, "k").expect_err("undefined").contains("request.body"));
    }

    #[test]
    fn a_form_is_url_encoded() {
        // Stripe's refunds take a form: https://docs.stripe.com/api/refunds/create
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/refunds", "form": {"payment_intent": "{{ input.payment_intent }}",
                                                        "reason": "{{ input.reason }}"}},
            "idempotency_header": "Idempotency-Key",
            "answer": {"request_id": "/id", "result": ""}
        }));
        let envelope = serde_json::json!({"task": {"payment_intent": "pi_1", "reason": "requested by customer"}});
        let (body, mime) = d.request(&Dialect::context(&envelope, "t", "k"), "k").expect("renders").body.expect("form");
        assert_eq!(mime, "application/x-www-form-urlencoded");
        assert_eq!(String::from_utf8(body).expect("text"), "payment_intent=pi_1&reason=requested+by+customer");
    }

    #[test]
    fn an_openai_chat_completion_is_done_with_the_message_inline() {
        // https://platform.openai.com/docs/api-reference/chat/object
        let body = r#"{"id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "object": "chat.completion",
            "created": 1741569952, "model": "gpt-4.1-2025-04-14",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help?",
                         "refusal": null, "annotations": []}, "logprobs": null, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29}}"#;
        let CallAnswer::Done { request_id, result } = read(&chat(), 200, &[], body) else { panic!("done") };
        assert_eq!(request_id, "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT");
        let message = result.inline.clone().expect("inline");
        assert_eq!(message["content"], "Hello! How can I help?");
        assert_eq!(result.uri, INLINE_URI_SCHEME);
        let canonical = canonical_json(&message);
        assert_eq!(
            canonical,
            r#"{"annotations":[],"content":"Hello! How can I help?","refusal":null,"role":"assistant"}"#
        );
        assert_eq!(result.sha256, hex::encode(Sha256::digest(canonical.as_bytes())));
        let usage: Vec<(&str, u64)> = result.usage.iter().map(|(name, n)| (name.as_str(), *n)).collect();
        assert_eq!(usage, [("completion_tokens", 10), ("prompt_tokens", 19)], "a count the answer lacks is left out");
        assert_eq!(result.size_bytes, canonical.len() as i64);
    }

    #[test]
    fn an_answer_that_does_not_match_the_dialect_is_ambiguous_never_done() {
        let d = chat();
        for (status, body) in [
            (200, r#"{"id": "c1", "choices": []}"#),
            (200, r#"{"choices": [{"message": {"content": "no id"}}]}"#),
            (200, "<html>ok</html>"),
            (204, ""),
            (202, r#"{"id": "c1"}"#),
            (200, r#"{"id": "c\u00001", "choices": [{"message": {}}]}"#),
            (200, r#"{"id": "c1", "choices": [{"message": {"content": "\u0000"}}]}"#),
        ] {
            assert_eq!(outcome(&read(&d, status, &[], body)), CallOutcome::ResetMidResponse, "{status} {body}");
        }
    }

    #[test]
    fn an_inline_result_above_the_limit_is_ambiguous() {
        let mut spec: DialectSpec = serde_json::from_value(serde_json::json!({
            "request": {"path": "/x"}, "answer": {"request_id": "/id", "result": "/out"}
        }))
        .expect("spec");
        spec.max_inline_result_bytes = 16;
        let d = Dialect::new(&spec).expect("compiles");
        assert!(matches!(read(&d, 200, &[], r#"{"id": "1", "out": "short"}"#), CallAnswer::Done { .. }));
        let answer = read(&d, 200, &[], r#"{"id": "1", "out": "far longer than sixteen bytes"}"#);
        assert!(
            matches!(&answer, CallAnswer::Outcome(CallOutcome::ResetMidResponse, Some(why)) if why.contains("limit"))
        );
    }

    #[test]
    fn openai_errors_name_their_class_and_reset_headers_say_when_to_come_back() {
        // https://platform.openai.com/docs/guides/error-codes and
        // https://platform.openai.com/docs/guides/rate-limits#rate-limits-in-headers
        let d = chat();
        let limited = r#"{"error": {"message": "Rate limit reached for requests", "type": "requests",
                          "param": null, "code": "rate_limit_exceeded"}}"#;
        let resets = [("x-ratelimit-reset-requests", "6m0s"), ("x-ratelimit-reset-tokens", "1s")];
        let expected = CallOutcome::Answered {
            status: 429,
            retry_after: Some(Duration::from_secs(360)),
            problem_body: true,
            class_named: None,
        };
        assert_eq!(outcome(&read(&d, 429, &resets, limited)), expected);
        let quota = r#"{"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                        "param": null, "code": "insufficient_quota"}}"#;
        let CallOutcome::Answered { class_named, .. } = outcome(&read(&d, 429, &[], quota)) else { panic!() };
        assert_eq!(class_named, Some(ErrorClass::NotAuthorised));
        // A gateway's bare 504 is not the provider's own body.
        let bare = outcome(&read(&d, 504, &[], "<html><body><h1>504</h1>gateway</body></html>"));
        assert!(matches!(bare, CallOutcome::Answered { status: 504, problem_body: false, class_named: None, .. }));
    }

    #[test]
    fn a_replicate_prediction_is_followed_until_it_succeeds() {
        // https://replicate.com/docs/reference/http#predictions.create and
        // https://replicate.com/docs/topics/predictions/lifecycle
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/predictions", "headers": {"Prefer": "wait=5"},
                        "body": "{\"version\": {{ input.version | tojson }}, \"input\": {{ input.input | tojson }}}"},
            "answer": {"statuses": {"done": [200, 201], "accepted": [202]},
                       "request_id": "/id", "state": "/status", "result": "/output",
                       "running_states": ["starting", "processing"], "succeeded_states": ["succeeded"],
                       "failed_states": ["failed", "canceled"], "error_type": "/detail"},
            "poll": {"url": "/urls/get", "path": "/v1/predictions/{{ request_id }}"}
        }));
        let starting = r#"{"id": "gm3qorzdhgbfurvjtvhg6dckhu", "model": "replicate/hello-world", "status": "starting",
            "input": {"text": "Alice"}, "output": null, "error": null,
            "urls": {"get": "https://api.replicate.com/v1/predictions/gm3qorzdhgbfurvjtvhg6dckhu",
                     "cancel": "https://api.replicate.com/v1/predictions/gm3qorzdhgbfurvjtvhg6dckhu/cancel"}}"#;
        let reading = d.read(201, &headers(&[]), starting.as_bytes(), now());
        assert_eq!(reading.answer, CallAnswer::Accepted { request_id: "gm3qorzdhgbfurvjtvhg6dckhu".to_owned() });
        assert_eq!(
            reading.poll_url.as_deref(),
            Some("https://api.replicate.com/v1/predictions/gm3qorzdhgbfurvjtvhg6dckhu")
        );
        assert_eq!(d.poll_path("gm3").expect("a template").expect("renders"), "/v1/predictions/gm3");
        let succeeded = r#"{"id": "gm3qorzdhgbfurvjtvhg6dckhu", "status": "succeeded",
            "output": ["https://replicate.delivery/pbxt/out-0.png"], "error": null,
            "urls": {"get": "https://api.replicate.com/v1/predictions/gm3qorzdhgbfurvjtvhg6dckhu"}}"#;
        let CallAnswer::Done { result, .. } = read(&d, 200, &[], succeeded) else { panic!("done") };
        assert_eq!(result.inline, Some(serde_json::json!(["https://replicate.delivery/pbxt/out-0.png"])));
        let failed = r#"{"id": "gm3", "status": "failed", "output": null, "error": "CUDA out of memory"}"#;
        assert_eq!(outcome(&read(&d, 200, &[], failed)), CallOutcome::ResetMidResponse);
        let unknown = r#"{"id": "gm3", "status": "paused", "output": null}"#;
        assert_eq!(outcome(&read(&d, 200, &[], unknown)), CallOutcome::ResetMidResponse);
        // Throttled, with Retry-After as an HTTP date.
        let throttled = r#"{"title": "Request was throttled", "detail": "Request was throttled.", "status": 429}"#;
        let CallOutcome::Answered { retry_after, problem_body, .. } =
            outcome(&read(&d, 429, &[("retry-after", "Wed, 21 Oct 2026 07:28:07 GMT")], throttled))
        else {
            panic!()
        };
        assert_eq!((retry_after, problem_body), (Some(Duration::from_secs(7)), true));
    }

    #[test]
    fn a_stripe_refund_and_its_errors() {
        // https://docs.stripe.com/api/refunds/object, https://docs.stripe.com/api/errors and
        // https://docs.stripe.com/api/idempotent_requests (a replay carries `Idempotent-Replayed: true`)
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/refunds", "form": {"payment_intent": "{{ input.payment_intent }}"}},
            "idempotency_header": "Idempotency-Key", "idempotency_ttl_hours": 24,
            "answer": {"request_id": "/id", "state": "/status", "result": "",
                       "running_states": ["pending", "requires_action"], "succeeded_states": ["succeeded"],
                       "failed_states": ["failed", "canceled"], "error_type": "/error/type",
                       "error_classes": {"card_error": "rejected", "invalid_request_error": "rejected",
                                         "idempotency_error": "rejected", "api_error": "provider_failed"}}
        }));
        let refund = r#"{"id": "re_1Nispe2eZvKYlo2Cd31jOCgZ", "object": "refund", "amount": 1000,
            "charge": "ch_1NirD82eZvKYlo2CIvbtLWuY", "created": 1692942318, "currency": "usd",
            "payment_intent": "pi_1GszsK2eZvKYlo2CfhZyoZLp", "reason": null, "status": "succeeded"}"#;
        let replayed = [("idempotent-replayed", "true")];
        for pairs in [&[][..], &replayed[..]] {
            let CallAnswer::Done { request_id, result } = read(&d, 200, pairs, refund) else { panic!("done") };
            assert_eq!(request_id, "re_1Nispe2eZvKYlo2Cd31jOCgZ");
            assert_eq!(result.inline.expect("inline")["amount"], 1000);
        }
        let card = r#"{"error": {"type": "card_error", "code": "charge_already_refunded",
                       "message": "Charge ch_1 has already been refunded."}}"#;
        let CallOutcome::Answered { class_named, problem_body, .. } = outcome(&read(&d, 400, &[], card)) else {
            panic!()
        };
        assert_eq!((class_named, problem_body), (Some(ErrorClass::Rejected), true));
        // A 500 naming `api_error` stays ambiguous in the error table unless 500 is declared safe.
        let api = r#"{"error": {"type": "api_error", "message": "An unknown error occurred"}}"#;
        let CallOutcome::Answered { class_named, .. } = outcome(&read(&d, 500, &[], api)) else { panic!() };
        assert_eq!(class_named, Some(ErrorClass::ProviderFailed));
        let table = fenceline_domain::calls::ErrorTable::default();
        let class = fenceline_domain::calls::classify(&outcome(&read(&d, 500, &[], api)), &table).map(|c| c.class);
        assert_eq!(class, Some(ErrorClass::Ambiguous));
    }

    #[test]
    fn an_anthropic_message_is_done_with_its_content_inline_and_overload_names_its_class() {
        // https://docs.anthropic.com/en/api/messages and https://docs.anthropic.com/en/api/errors
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/messages", "headers": {"anthropic-version": "2023-06-01"},
                        "body": "{\"model\": {{ input.model | tojson }}, \"max_tokens\": 1024, \"messages\": [{\"role\": \"user\", \"content\": {{ input.prompt | tojson }}}]}"},
            "auth_header": "x-api-key",
            "answer": {"request_id": "/id", "result": "/content", "error_type": "/error/type",
                       "error_classes": {"overloaded_error": "throttled", "rate_limit_error": "throttled"}},
            "throttling": {"reset_headers": ["anthropic-ratelimit-requests-reset"]}
        }));
        let context =
            Dialect::context(&serde_json::json!({"task": {"model": "claude-test", "prompt": "hi"}}), "t", "k");
        let request = d.request(&context, "k").expect("renders");
        assert!(request.headers.contains(&("anthropic-version".to_owned(), "2023-06-01".to_owned())));
        assert!(!request.headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("Idempotency-Key")));
        let message = r#"{"id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5", "content": [{"type": "text", "text": "Hi! My name is Claude."}],
            "stop_reason": "end_turn", "stop_sequence": null, "usage": {"input_tokens": 2095, "output_tokens": 503}}"#;
        let CallAnswer::Done { request_id, result } = read(&d, 200, &[], message) else { panic!("done") };
        assert_eq!(request_id, "msg_013Zva2CMHLNnXjNJJKqJ2EF");
        assert_eq!(result.inline.expect("inline")[0]["text"], "Hi! My name is Claude.");
        let overloaded = r#"{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}"#;
        let resets = [("anthropic-ratelimit-requests-reset", "2026-10-21T07:28:20Z"), ("retry-after", "5")];
        let expected = CallOutcome::Answered {
            status: 529,
            retry_after: Some(Duration::from_secs(20)),
            problem_body: true,
            class_named: Some(ErrorClass::Throttled),
        };
        assert_eq!(outcome(&read(&d, 529, &resets, overloaded)), expected);
        // Safe only where the catalogue vouches for 529: otherwise the work may have been done.
        let table = fenceline_domain::calls::ErrorTable::default();
        let class =
            |t: &fenceline_domain::calls::ErrorTable| fenceline_domain::calls::classify(&expected, t).map(|c| c.class);
        assert_eq!(class(&table), Some(ErrorClass::Ambiguous));
        let vouched = fenceline_domain::calls::ErrorTable { safe_5xx: [529].into(), ..table };
        assert_eq!(class(&vouched), Some(ErrorClass::Throttled));
    }

    #[test]
    fn a_twilio_message_is_sent_as_a_form_and_its_errors_are_numbers() {
        // https://www.twilio.com/docs/messaging/api/message-resource#create-a-message-resource
        // and https://www.twilio.com/docs/usage/twilios-response#response-formats-exceptions
        let d = dialect(serde_json::json!({
            "request": {"path": "/2010-04-01/Accounts/{{ input.account_sid }}/Messages.json",
                        "form": {"To": "{{ input.to }}", "From": "{{ input.from }}", "Body": "{{ input.body }}"}},
            "answer": {"statuses": {"done": [200, 201]}, "request_id": "/sid", "result": "",
                       "error_type": "/code", "error_classes": {"21211": "rejected", "20003": "not_authorised"}}
        }));
        let envelope = serde_json::json!({"task": {"account_sid": "AC123", "to": "+15558675310",
                                                   "from": "+15017122661", "body": "Your refund is on its way & soon"}});
        let request = d.request(&Dialect::context(&envelope, "t", "k"), "k").expect("renders");
        assert_eq!(request.path, "/2010-04-01/Accounts/AC123/Messages.json");
        let (body, mime) = request.body.expect("a form");
        assert_eq!(mime, "application/x-www-form-urlencoded");
        assert_eq!(
            String::from_utf8(body).expect("text"),
            "Body=Your+refund+is+on+its+way+%26+soon&From=%2B15017122661&To=%2B15558675310"
        );
        let created = r#"{"account_sid": "AC123", "body": "Your refund is on its way & soon",
            "from": "+15017122661", "to": "+15558675310", "num_segments": "1", "price": null,
            "sid": "SMaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "status": "queued", "error_code": null}"#;
        let CallAnswer::Done { request_id, result } = read(&d, 201, &[], created) else { panic!("done") };
        assert_eq!(request_id, "SMaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
        assert_eq!(result.inline.expect("inline")["status"], "queued");
        let invalid = r#"{"code": 21211, "message": "The 'To' number +1555 is not a valid phone number.",
            "more_info": "https://www.twilio.com/docs/errors/21211", "status": 400}"#;
        let CallOutcome::Answered { class_named, .. } = outcome(&read(&d, 400, &[], invalid)) else { panic!() };
        assert_eq!(class_named, Some(ErrorClass::Rejected));
    }

    #[test]
    fn stripe_should_retry_false_on_a_4xx_rejects_but_never_makes_a_409_or_a_5xx_safe() {
        // https://docs.stripe.com/error-low-level#idempotency (`Stripe-Should-Retry`)
        let d = dialect(serde_json::json!({
            "request": {"path": "/v1/refunds", "form": {"charge": "{{ input.charge }}"}},
            "idempotency_header": "Idempotency-Key",
            "answer": {"request_id": "/id", "result": "", "error_type": "/error/type",
                       "should_retry_header": "Stripe-Should-Retry"}
        }));
        let body = r#"{"error": {"type": "invalid_request_error", "message": "x"}}"#;
        let class =
            |status, value: &'static str| match outcome(&read(&d, status, &[("stripe-should-retry", value)], body)) {
                CallOutcome::Answered { class_named, .. } => class_named,
                other => panic!("{other:?}"),
            };
        assert_eq!(class(400, "false"), Some(ErrorClass::Rejected));
        assert_eq!(class(429, "false"), Some(ErrorClass::Rejected));
        assert_eq!(class(429, "true"), None);
        assert_eq!(class(409, "false"), None, "at a provider that dedupes, a 409 is the key still running");
        assert_eq!(class(500, "false"), None);
    }

    #[test]
    fn retry_after_and_reset_durations_are_read_in_every_form() {
        assert_eq!(retry_after_value("120", now()), Some(Duration::from_secs(120)));
        assert_eq!(retry_after_value("Wed, 21 Oct 2026 07:29:00 GMT", now()), Some(Duration::from_secs(60)));
        assert_eq!(retry_after_value("Wed, 21 Oct 2026 07:00:00 GMT", now()), Some(Duration::ZERO));
        assert_eq!(retry_after_value("soon", now()), None);
        let reset = |value| reset_duration(value, now());
        assert_eq!(reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(reset("1h2m3.5s"), Some(Duration::from_secs_f64(3723.5)));
        assert_eq!(reset("2"), Some(Duration::from_secs(2)));
        // Anthropic's: https://docs.anthropic.com/en/api/rate-limits#response-headers
        assert_eq!(reset("2026-10-21T07:28:30Z"), Some(Duration::from_secs(30)));
        assert_eq!(reset("2026-10-21T09:28:30+02:00"), Some(Duration::from_secs(30)));
        assert_eq!(reset("2026-10-21T07:00:00Z"), Some(Duration::ZERO));
        for bad in ["", "s", "5 parsecs", "-1", "1x", "2026-10-21"] {
            assert_eq!(reset(bad), None, "{bad}");
        }
    }
}
