//! What a provider's protocol answer proves: a start's or a poll's answer read
//! by the error table, a look-up's `404` judged as evidence or not, and a
//! transport failure placed before or after the request left.

use std::time::Duration;

use fenceline_domain::calls::CallOutcome;
use serde::Deserialize;

use crate::{CallAnswer, Lookup, ProviderResult, tls};

#[derive(Debug, Deserialize)]
struct Answer {
    request_id: String,
    status: String,
    #[serde(default)]
    result: Option<ProviderResult>,
}

impl Answer {
    /// Whether every text the answer carries can be stored: Postgres keeps no NUL
    /// character in `text` or `jsonb`.
    fn storable(&self) -> bool {
        let texts =
            [Some(&self.request_id), self.result.as_ref().map(|r| &r.uri), self.result.as_ref().map(|r| &r.sha256)];
        texts.into_iter().flatten().all(|text| !text.contains('\0'))
    }
}

/// What an answer that arrived came to, as the error table needs it.
pub(crate) fn answer_of(mut response: ureq::http::Response<ureq::Body>) -> CallAnswer {
    let status = response.status().as_u16();
    let problem_body = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("application/problem+json"));
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = match response.body_mut().read_to_vec() {
        Ok(body) => body,
        // The status arrived and the body broke off: the provider answered, but
        // for a success we cannot know what it said.
        Err(_) if (200..300).contains(&status) => return CallAnswer::Outcome(CallOutcome::ResetMidResponse, None),
        Err(_) => Vec::new(),
    };
    if !(200..300).contains(&status) {
        // A problem document the body does not hold is no proof of who answered.
        let problem_body =
            problem_body && serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v.is_object());
        return CallAnswer::Outcome(
            CallOutcome::Answered { status, retry_after, problem_body, class_named: None },
            None,
        );
    }
    match serde_json::from_slice::<Answer>(&body) {
        // Text Postgres cannot store (a NUL character) would make every record of
        // the answer unwritable downstream: it is an answer we cannot read.
        Ok(answer) if !answer.storable() => CallAnswer::Outcome(CallOutcome::ResetMidResponse, None),
        Ok(Answer { request_id, status: s, result: Some(result) }) if s == "succeeded" => {
            CallAnswer::Done { request_id, result }
        }
        Ok(Answer { request_id, status: s, .. }) if s == "accepted" || s == "running" => {
            CallAnswer::Accepted { request_id }
        }
        // A success we cannot read: the work may have happened.
        _ => CallAnswer::Outcome(CallOutcome::ResetMidResponse, None),
    }
}

/// A look-up's `404` is "never received" only when the provider itself says so:
/// a JSON body that names the key asked about, or the provider's problem document
/// (`application/problem+json`). A bare `404` may be a gateway's or an ingress's
/// page (a route missing during a deploy) and proves nothing about the work.
pub(crate) fn never_received(mut response: ureq::http::Response<ureq::Body>, operation_key: &str) -> Lookup {
    let problem = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("application/problem+json"));
    let body = response.body_mut().with_config().limit(64 * 1024).read_to_vec().unwrap_or_default();
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(v) if v.get("operation_key").and_then(|k| k.as_str()) == Some(operation_key) => Lookup::NeverReceived,
        Ok(v) if problem && v.is_object() => Lookup::NeverReceived,
        _ => Lookup::NoAnswer("404 without the provider's own body (a gateway's page?): not evidence".to_owned()),
    }
}

/// Only failures that certainly happened before the request left are "not sent";
/// everything else may have reached the provider. A refused TLS handshake is "not
/// sent": the provider cannot read a request over a connection it did not accept.
pub(crate) fn outcome_of_error(e: &ureq::Error) -> CallOutcome {
    use ureq::Timeout;
    if tls::refused_handshake(e).is_some() {
        return CallOutcome::NotSent;
    }
    match e {
        ureq::Error::ConnectionFailed
        | ureq::Error::HostNotFound
        | ureq::Error::BadUri(_)
        | ureq::Error::Tls(_)
        | ureq::Error::Timeout(Timeout::Connect | Timeout::Resolve) => CallOutcome::NotSent,
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => CallOutcome::NotSent,
        ureq::Error::Timeout(_) => CallOutcome::TimedOutAfterSend,
        _ => CallOutcome::ResetMidResponse,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16, body: &str) -> CallAnswer {
        let body = ureq::Body::builder().mime_type("application/json").data(body.as_bytes().to_vec());
        answer_of(ureq::http::Response::builder().status(status).body(body).expect("response"))
    }

    #[test]
    fn an_answer_carrying_a_nul_character_is_not_read_as_done_or_accepted() {
        let done = r#"{"request_id": "r1", "status": "succeeded",
                       "result": {"uri": "http://p/a", "sha256": "00", "size_bytes": 1}}"#;
        assert!(matches!(answered(200, done), CallAnswer::Done { .. }));
        let nul_in_id = r#"{"request_id": "r\u00001", "status": "accepted"}"#;
        let nul_in_uri = r#"{"request_id": "r1", "status": "succeeded",
                             "result": {"uri": "http://p/\u0000", "sha256": "00", "size_bytes": 1}}"#;
        for body in [nul_in_id, nul_in_uri] {
            // The work may have happened, and nothing of the answer can be kept.
            assert_eq!(answered(200, body), CallAnswer::Outcome(CallOutcome::ResetMidResponse, None), "{body}");
        }
    }

    fn not_found(mime: &str, body: &str) -> Lookup {
        let body = ureq::Body::builder().mime_type(mime).data(body.as_bytes().to_vec());
        let response = ureq::http::Response::builder().status(404).header("content-type", mime).body(body);
        never_received(response.expect("response"), "k1")
    }

    #[test]
    fn only_the_providers_own_404_says_never_received() {
        assert_eq!(
            not_found("application/json", r#"{"status": "unknown", "operation_key": "k1"}"#),
            Lookup::NeverReceived
        );
        assert_eq!(
            not_found("application/problem+json", r#"{"status": 404, "detail": "no such"}"#),
            Lookup::NeverReceived
        );
        for (mime, body) in [
            ("text/html", "<html><body><h1>404</h1>default backend</body></html>"),
            ("application/json", r#"{"operation_key": "another"}"#),
            ("application/json", r#"{"error": "route not found"}"#),
            ("application/problem+json", "not json"),
            ("text/plain", ""),
        ] {
            assert!(matches!(not_found(mime, body), Lookup::NoAnswer(_)), "{mime} {body}");
        }
    }
}
