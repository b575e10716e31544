//! The HTTP client: one blocking agent, the bearer token (never printed), and every
//! answer that is not a success turned into a typed error carrying intake's problem
//! (docs/intake.md, `application/problem+json`).

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

use crate::Error;

/// A service's base URL and the token its calls carry.
#[derive(Debug)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    token: Option<SecretString>,
}

/// A successful answer: its status, whether it replays an earlier one
/// (`Idempotent-Replayed: true`), and its body as received.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub text: String,
}

impl Answer {
    /// The body, read as `T`.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_str(&self.text).map_err(|e| Error::BadAnswer(format!("{e} in {}", excerpt(&self.text))))
    }
}

/// A problem answer (RFC 9457), or what stood in its place when the body was not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: u16,
    /// The stable `type`, such as `/problems/task-not-found`; absent when the
    /// answer was not `application/problem+json`.
    pub problem_type: Option<String>,
    pub title: String,
    pub detail: Option<String>,
}

impl Problem {
    /// Reads an error answer: intake's problem JSON, else the status and the body's start.
    pub fn from_answer(status: u16, text: &str) -> Self {
        let parsed: Option<Value> = serde_json::from_str(text).ok();
        let field = |name: &str| parsed.as_ref().and_then(|v| v[name].as_str()).map(str::to_owned);
        match field("title") {
            Some(title) => Problem { status, problem_type: field("type"), title, detail: field("detail") },
            None => Problem {
                status,
                problem_type: None,
                title: ureq::http::StatusCode::from_u16(status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("Error")
                    .to_owned(),
                detail: (!text.trim().is_empty()).then(|| excerpt(text)),
            },
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (HTTP {}", self.title, self.status)?;
        if let Some(problem_type) = &self.problem_type {
            write!(f, ", {problem_type}")?;
        }
        f.write_str(")")?;
        if let Some(detail) = &self.detail {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

/// The first 300 characters of a body, for messages.
fn excerpt(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(300) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

impl Client {
    /// A client of the service at `base` (`http://` or `https://`, checked against
    /// the system's certificate roots), each exchange limited to `timeout`.
    pub fn new(base: &str, token: Option<SecretString>, timeout: Duration) -> Result<Self, Error> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::Usage(format!("`{base}` is not an http:// or https:// URL")));
        }
        let tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::NativeTls)
            .root_certs(ureq::tls::RootCerts::PlatformVerifier)
            .build();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .tls_config(tls)
            .user_agent(concat!("fenceline/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Ok(Client { agent, base: base.trim_end_matches('/').to_owned(), token })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Adds the token, when there is one.
    fn authorized<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(token) => request.header("Authorization", format!("Bearer {}", token.expose_secret())),
            None => request,
        }
    }

    /// `GET path?query`.
    pub fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Answer, Error> {
        let url = self.url(path);
        let request = self
            .authorized(self.agent.get(&url))
            .header("Accept", "application/json")
            .query_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        finish(&url, request.call())
    }

    /// `GET path` as a stream that never times out as a whole (the server's
    /// heartbeats keep it alive): its body as a reader, or the error that stands for
    /// an answer that is not a 2xx.
    pub fn stream(&self, path: &str) -> Result<ureq::BodyReader<'static>, Error> {
        let url = self.url(path);
        let request = self
            .authorized(self.agent.get(&url))
            .header("Accept", "text/event-stream")
            .config()
            .timeout_global(None)
            .build();
        let mut response =
            request.call().map_err(|e| Error::Unreachable { url: url.clone(), reason: e.to_string() })?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            let text = response.body_mut().read_to_string().unwrap_or_default();
            return Err(Error::Problem(Problem::from_answer(status, &text)));
        }
        Ok(response.into_body().into_reader())
    }

    /// `POST path` with a JSON body (or none) and extra headers.
    pub fn post(&self, path: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> Result<Answer, Error> {
        let url = self.url(path);
        let mut request = self.authorized(self.agent.post(&url)).header("Accept", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let sent = match body {
            Some(body) => request.header("Content-Type", "application/json").send(body.to_string()),
            None => request.send_empty(),
        };
        finish(&url, sent)
    }
}

/// A 2xx answer, or the error that stands for anything else.
fn finish(url: &str, sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<Answer, Error> {
    let mut response = sent.map_err(|e| Error::Unreachable { url: url.to_owned(), reason: e.to_string() })?;
    let status = response.status().as_u16();
    let replayed = response.headers().get("Idempotent-Replayed").is_some_and(|v| v.as_bytes() == b"true");
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| Error::Unreachable { url: url.to_owned(), reason: format!("reading the answer: {e}") })?;
    if (200..300).contains(&status) {
        Ok(Answer { status, replayed, text })
    } else {
        Err(Error::Problem(Problem::from_answer(status, &text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_answer_keeps_its_type_title_and_detail() {
        let body = r#"{"type":"/problems/task-not-found","title":"Task not found","status":404,"detail":"no task x"}"#;
        let problem = Problem::from_answer(404, body);
        assert_eq!(problem.problem_type.as_deref(), Some("/problems/task-not-found"));
        assert_eq!(problem.to_string(), "Task not found (HTTP 404, /problems/task-not-found): no task x");
    }

    #[test]
    fn an_answer_that_is_not_a_problem_still_says_what_came_back() {
        let problem = Problem::from_answer(503, "database unavailable\n");
        assert_eq!(problem.to_string(), "Service Unavailable (HTTP 503): database unavailable");
        assert_eq!(Problem::from_answer(502, "").detail, None);
        let long = "x".repeat(1000);
        assert_eq!(Problem::from_answer(500, &long).detail.map(|d| d.chars().count()), Some(301));
    }

    #[test]
    fn the_token_does_not_show_in_the_clients_debug_form() {
        let client = Client::new("http://127.0.0.1:1", Some(SecretString::from("fl_secret")), Duration::from_secs(1))
            .expect("client");
        assert!(!format!("{client:?}").contains("fl_secret"));
    }
}
