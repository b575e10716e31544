//! Provider adapters: what the executor and the reconciler call. A provider
//! declares its capabilities; the HTTP adapter speaks the provider protocol of
//! `docs/provider-protocol.md`. Adapters never retry: the scheduler is the one
//! retry layer, and a retried paid call is exactly what Fenceline must not do
//! behind anyone's back.

mod answers;
pub mod dialect;
mod resolver;
mod tls;

use std::time::Duration;
use tracing::Instrument as _;

pub use tls::Error;

use answers::{answer_of, never_received, outcome_of_error};

use std::collections::HashMap;

use fenceline_config::catalog::{Catalog, ProviderSpec};
use fenceline_config::{ExposeSecret, Secret};
use fenceline_domain::calls::{CallOutcome, ErrorTable, ProviderCapabilities};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A result as the provider names it: where it is and its checksum.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProviderResult {
    pub uri: String,
    pub sha256: String,
    pub size_bytes: i64,
    /// A result that is a JSON value rather than an artifact (a dialect's inline
    /// result): `sha256` and `size_bytes` are of its canonical JSON text, and it
    /// needs no download.
    #[serde(skip)]
    pub inline: Option<serde_json::Value>,
    /// What the answer reported it used, by the names the dialect's `answer.usage`
    /// gives (tokens); empty for the protocol.
    #[serde(skip)]
    pub usage: std::collections::BTreeMap<String, u64>,
}

/// What starting or polling an operation came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallAnswer {
    /// Done; the result is at the provider.
    Done { request_id: String, result: ProviderResult },
    /// Accepted; the result comes later (poll with the request id).
    Accepted { request_id: String },
    /// Anything else, as observed: an error status, nothing sent, or no answer;
    /// with what the transport said, when it failed.
    Outcome(CallOutcome, Option<String>),
}

/// What a look-up by operation key answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Found {
        request_id: String,
        result: Option<ProviderResult>,
    },
    NeverReceived,
    /// The provider cannot look up (it did not declare it) or did not answer.
    NoAnswer(String),
}

/// Why an artifact could not be verified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("the artifact could not be fetched: {0}")]
    Unreachable(String),
    #[error("the artifact's sha256 is {actual}, the provider said {expected}")]
    Mismatch { expected: String, actual: String },
}

/// The HTTP adapter of one configured provider.
#[derive(Debug, Clone)]
pub struct HttpProvider {
    pub name: String,
    base_url: String,
    /// The `Authorization` header value: a credential, never printed.
    auth_header: Option<Secret>,
    capabilities: ProviderCapabilities,
    errors: ErrorTable,
    agent: ureq::Agent,
    /// Without a connection pool: for the paid call only.
    call_agent: ureq::Agent,
    /// For artifacts, which may be served from another host or behind redirects;
    /// with the same TLS settings as the provider's own calls.
    artifact_agent: ureq::Agent,
    /// What the provider's certificate is checked against, for error messages.
    roots: std::sync::Arc<str>,
    /// How to speak to a provider that does not speak the protocol; `None`: the protocol.
    dialect: Option<std::sync::Arc<dialect::Dialect>>,
    /// Poll URLs accepting answers named, by request id (a dialect's `poll.url`).
    poll_urls: std::sync::Arc<std::sync::Mutex<HashMap<String, String>>>,
}

/// How many redirects an artifact download follows.
const ARTIFACT_REDIRECTS: u32 = 5;

impl HttpProvider {
    /// The adapter for a catalogue entry; the auth header is read from the
    /// environment variable the entry names (or from the file its `_FILE` variant
    /// names), and the TLS files it names are read and checked now.
    pub fn new(name: &str, spec: &ProviderSpec) -> Result<Self, Error> {
        let credential = match &spec.auth_header_env {
            Some(var) => fenceline_config::secret_from_env(var)
                .map_err(|e| Error::Credential { provider: name.to_owned(), reason: e.to_string() })?,
            None => None,
        };
        Self::with_credential(name, spec, credential)
    }

    /// As [`HttpProvider::new`], with the `Authorization` value given.
    pub fn with_credential(name: &str, spec: &ProviderSpec, credential: Option<Secret>) -> Result<Self, Error> {
        let timeout = spec.call_timeout();
        let tls = tls::settings(name, &spec.tls)?;
        let config = |pooled: bool, redirects: u32| {
            let settings = ureq::Agent::config_builder()
                .tls_config(tls.config.clone())
                .http_status_as_error(false)
                .timeout_global(Some(timeout))
                // A connect that fails is "not sent"; keep it inside the call timeout.
                // It includes the TLS handshake, which a busy host (or the first
                // use of the system's roots) can hold up for a second or more.
                .timeout_connect(Some(timeout.min(Duration::from_secs(10)) / 2))
                .max_redirects(redirects)
                // A redirect to another host gets no credentials.
                .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
                .max_idle_connections(if pooled { 10 } else { 0 })
                .max_idle_connections_per_host(if pooled { 3 } else { 0 })
                .build();
            // An address written as an IP is connected to without a lookup.
            ureq::Agent::with_parts(
                settings,
                ureq::unversioned::transport::DefaultConnector::new(),
                resolver::LiteralOrLookup::default(),
            )
        };
        // A paid call never rides a kept-alive connection: a write that meets a
        // connection the provider is closing fails after the connection was made,
        // which only a fresh connection can tell apart from "not sent". Look-ups
        // and verification are free to repeat and keep their connections. The
        // protocol's own calls follow no redirect; an artifact may live elsewhere.
        let (agent, call_agent, artifact_agent) = (config(true, 0), config(false, 0), config(true, ARTIFACT_REDIRECTS));
        let dialect = match &spec.dialect {
            Some(spec) => Some(std::sync::Arc::new(
                dialect::Dialect::new(spec).map_err(|reason| Error::Dialect { provider: name.to_owned(), reason })?,
            )),
            None => None,
        };
        Ok(Self {
            name: name.to_owned(),
            base_url: spec.base_url.trim_end_matches('/').to_owned(),
            auth_header: credential,
            capabilities: spec.capabilities(),
            errors: spec.error_table(),
            agent,
            call_agent,
            artifact_agent,
            roots: tls.roots.into(),
            dialect,
            poll_urls: Default::default(),
        })
    }

    /// The adapters of every provider in the catalogue, by name.
    pub fn all_of(catalog: &Catalog) -> Result<HashMap<String, HttpProvider>, Error> {
        catalog.providers.iter().map(|(name, spec)| Ok((name.clone(), HttpProvider::new(name, spec)?))).collect()
    }

    pub fn capabilities(&self) -> ProviderCapabilities {
        self.capabilities
    }

    /// The provider's name in the catalogue.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A span for one exchange with the provider, a child of the caller's (so of
    /// the task's trace), the `traceparent` that carries it to the provider, and
    /// the instant the exchange began (for its latency).
    fn exchange_span(&self, request: &'static str) -> (tracing::Span, Option<String>, std::time::Instant) {
        let span = tracing::info_span!(
            "provider call",
            otel.name = format!("{request} {}", self.name),
            otel.kind = "client",
            provider = %self.name,
            request,
            outcome = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        );
        fenceline_telemetry::record_trace_id(&span);
        let traceparent = span.in_scope(fenceline_telemetry::current_traceparent);
        (span, traceparent, std::time::Instant::now())
    }

    /// Counts and times an exchange by what it came to, and notes it on its span.
    fn observed(&self, span: &tracing::Span, request: &'static str, started: std::time::Instant, answer: &CallAnswer) {
        let outcome = match answer {
            CallAnswer::Done { .. } => "done".to_owned(),
            CallAnswer::Accepted { .. } => "accepted".to_owned(),
            CallAnswer::Outcome(CallOutcome::NotSent, _) => "not_sent".to_owned(),
            CallAnswer::Outcome(CallOutcome::TimedOutAfterSend, _) => "timed_out".to_owned(),
            CallAnswer::Outcome(CallOutcome::ResetMidResponse, _) => "reset".to_owned(),
            CallAnswer::Outcome(CallOutcome::Answered { status, .. }, _) => format!("status_{status}"),
        };
        span.record("outcome", outcome.as_str());
        let seconds = started.elapsed().as_secs_f64();
        fenceline_telemetry::metrics::global().providers.call(&self.name, request, &outcome, seconds);
    }

    /// How this provider's answers are read.
    pub fn errors(&self) -> &ErrorTable {
        &self.errors
    }

    /// Starts an operation. The operation key travels as `Idempotency-Key` when
    /// the provider dedupes or looks up by it (a look-up needs the key it was sent).
    pub async fn start(&self, operation: &str, input: serde_json::Value, operation_key: &str) -> CallAnswer {
        self.start_task("", operation, input, operation_key).await
    }

    /// Starts an operation of task `task_id`: by the protocol, with `envelope` (the
    /// step envelope `{"task": <input>, "steps": {...}}`) as its input; or by the
    /// provider's dialect, with the envelope as its templates' context.
    pub async fn start_task(
        &self,
        task_id: &str,
        operation: &str,
        envelope: serde_json::Value,
        operation_key: &str,
    ) -> CallAnswer {
        if let Some(dialect) = self.dialect.clone() {
            return self.start_dialect(&dialect, task_id, envelope, operation_key).await;
        }
        let input = envelope;
        let this = self.clone();
        let key = operation_key.to_owned();
        let body = serde_json::json!({ "operation": operation, "input": input });
        let (span, traceparent, started) = self.exchange_span("start");
        let answer = blocking(move || {
            let mut request = this.call_agent.post(format!("{}/v1/operations", this.base_url));
            if this.capabilities.idempotency_keys || this.capabilities.lookup {
                request = request.header("Idempotency-Key", key.as_str());
            }
            if let Some(auth) = &this.auth_header {
                request = request.header("Authorization", auth.expose_secret());
            }
            if let Some(traceparent) = &traceparent {
                request = request.header(TRACEPARENT, traceparent.as_str());
            }
            this.answer_of(request.send_json(&body))
        })
        .instrument(span.clone())
        .await;
        self.observed(&span, "start", started, &answer);
        answer
    }

    /// Starts an operation at a dialect provider: renders its request (a template
    /// that fails sends nothing) and reads the answer by the dialect.
    async fn start_dialect(
        &self,
        dialect: &std::sync::Arc<dialect::Dialect>,
        task_id: &str,
        envelope: serde_json::Value,
        operation_key: &str,
    ) -> CallAnswer {
        let context = dialect::Dialect::context(&envelope, task_id, operation_key);
        let request = match dialect.request(&context, operation_key) {
            Ok(request) => request,
            Err(why) => {
                let detail = format!("the request could not be built from the dialect of `{}`: {why}", self.name);
                return CallAnswer::Outcome(CallOutcome::NotSent, Some(detail));
            }
        };
        let (span, traceparent, started) = self.exchange_span("start");
        let this = self.clone();
        let dialect = dialect.clone();
        let reading = blocking(move || {
            let url = format!("{}{}", this.base_url, request.path);
            let mut builder = ureq::http::Request::builder().method(request.method.as_str()).uri(url);
            for (name, value) in &request.headers {
                builder = builder.header(name.as_str(), value.as_str());
            }
            if let Some(auth) = &this.auth_header {
                builder = builder.header(dialect.spec.auth_header.as_str(), auth.expose_secret());
            }
            if let Some(traceparent) = &traceparent {
                builder = builder.header(TRACEPARENT, traceparent.as_str());
            }
            let sent = match request.body {
                Some((body, mime)) => match builder.header("Content-Type", mime).body(body) {
                    Ok(request) => this.call_agent.run(request),
                    Err(e) => return dialect_not_sent(&e),
                },
                None => match builder.body(()) {
                    Ok(request) => this.call_agent.run(request),
                    Err(e) => return dialect_not_sent(&e),
                },
            };
            this.reading_of(&dialect, sent)
        })
        .instrument(span.clone())
        .await;
        self.remember_poll_url(&reading);
        self.observed(&span, "start", started, &reading.answer);
        reading.answer
    }

    /// A poll URL the answer named, kept for polling that request.
    fn remember_poll_url(&self, reading: &dialect::Reading) {
        if let (CallAnswer::Accepted { request_id }, Some(url)) = (&reading.answer, &reading.poll_url) {
            let mut urls = self.poll_urls.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            urls.insert(request_id.clone(), url.clone());
        }
    }

    /// What a dialect exchange came to.
    fn reading_of(
        &self,
        dialect: &dialect::Dialect,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> dialect::Reading {
        let mut response = match response {
            Ok(response) => response,
            Err(e) => {
                let answer = CallAnswer::Outcome(outcome_of_error(&e), Some(self.describe(&e)));
                return dialect::Reading { answer, poll_url: None };
            }
        };
        let status = response.status().as_u16();
        let limit = dialect.spec.max_inline_result_bytes.saturating_mul(4).saturating_add(1024 * 1024);
        let body = match response.body_mut().with_config().limit(limit).read_to_vec() {
            Ok(body) => body,
            Err(e) if (200..300).contains(&status) => {
                let answer = CallAnswer::Outcome(CallOutcome::ResetMidResponse, Some(e.to_string()));
                return dialect::Reading { answer, poll_url: None };
            }
            Err(_) => Vec::new(),
        };
        dialect.read(status, response.headers(), &body, std::time::SystemTime::now())
    }

    /// Polls an accepted job at a dialect provider: at the URL its answer named,
    /// or at the dialect's poll path. Without either there is nothing to ask, which
    /// is no answer.
    async fn poll_dialect(&self, dialect: &std::sync::Arc<dialect::Dialect>, request_id: &str) -> CallAnswer {
        let named = self.poll_urls.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(request_id).cloned();
        let url = match (named, dialect.poll_path(request_id)) {
            (Some(url), _) => url,
            (None, Some(Ok(path))) => format!("{}{path}", self.base_url),
            (None, Some(Err(why))) => return CallAnswer::Outcome(CallOutcome::NotSent, Some(why)),
            (None, None) => {
                let why = format!("the dialect of `{}` says no way to follow an accepted job", self.name);
                return CallAnswer::Outcome(CallOutcome::NotSent, Some(why));
            }
        };
        let (span, traceparent, started) = self.exchange_span("poll");
        let this = self.clone();
        let dialect = dialect.clone();
        let reading = blocking(move || {
            let request = this.agent.get(&url);
            // The provider's credentials go only to its own origin.
            let request = if same_origin(&this.base_url, &url) { this.with_auth(request) } else { request };
            this.reading_of(&dialect, with_trace(request, traceparent).call())
        })
        .instrument(span.clone())
        .await;
        self.remember_poll_url(&reading);
        self.observed(&span, "poll", started, &reading.answer);
        reading.answer
    }

    /// Polls an accepted operation.
    pub async fn poll(&self, request_id: &str) -> CallAnswer {
        if let Some(dialect) = self.dialect.clone() {
            return self.poll_dialect(&dialect, request_id).await;
        }
        let this = self.clone();
        let url = format!("{}/v1/operations/{request_id}", self.base_url);
        let (span, traceparent, started) = self.exchange_span("poll");
        let answer =
            blocking(move || this.answer_of(with_trace(this.with_auth(this.agent.get(url)), traceparent).call()))
                .instrument(span.clone())
                .await;
        self.observed(&span, "poll", started, &answer);
        answer
    }

    /// Asks whether the provider received the operation with this key.
    pub async fn lookup(&self, operation_key: &str) -> Lookup {
        if !self.capabilities.lookup {
            return Lookup::NoAnswer(format!("provider `{}` cannot look up by operation key", self.name));
        }
        let this = self.clone();
        let url = format!("{}/v1/operations?operation_key={operation_key}", self.base_url);
        let (span, traceparent, started) = self.exchange_span("lookup");
        let key = operation_key.to_owned();
        let found = blocking(move || match with_trace(this.with_auth(this.agent.get(url)), traceparent).call() {
            Ok(r) if r.status().as_u16() == 404 => never_received(r, &key),
            Ok(r) if r.status().is_success() => match this.answer_of(Ok(r)) {
                CallAnswer::Done { request_id, result } => Lookup::Found { request_id, result: Some(result) },
                CallAnswer::Accepted { request_id } => Lookup::Found { request_id, result: None },
                CallAnswer::Outcome(o, _) => Lookup::NoAnswer(format!("{o:?}")),
            },
            Ok(r) => Lookup::NoAnswer(format!("status {}", r.status())),
            Err(e) => Lookup::NoAnswer(this.describe(&e)),
        })
        .instrument(span.clone())
        .await;
        let outcome = match &found {
            Lookup::Found { .. } => "found",
            Lookup::NeverReceived => "never_received",
            Lookup::NoAnswer(_) => "no_answer",
        };
        span.record("outcome", outcome);
        let seconds = started.elapsed().as_secs_f64();
        fenceline_telemetry::metrics::global().providers.call(&self.name, "lookup", outcome, seconds);
        found
    }

    /// Fetches the artifact and checks its sha256 against what the provider said.
    /// The provider's credentials go only to the provider's own origin: an
    /// artifact on another host (a storage bucket, a CDN) gets none.
    pub async fn verify(&self, result: &ProviderResult) -> Result<(), VerifyError> {
        if let Some(value) = &result.inline {
            // Hashed by Fenceline from the answer itself: nothing to download.
            let actual = hex::encode(Sha256::digest(dialect::canonical_json(value).as_bytes()));
            let expected = result.sha256.to_ascii_lowercase();
            return if actual == expected { Ok(()) } else { Err(VerifyError::Mismatch { expected, actual }) };
        }
        let this = self.clone();
        let uri = result.uri.clone();
        let expected = result.sha256.to_ascii_lowercase();
        blocking(move || {
            let request = this.artifact_agent.get(&uri);
            let request = if same_origin(&this.base_url, &uri) { this.with_auth(request) } else { request };
            let mut response = request.call().map_err(|e| VerifyError::Unreachable(this.describe(&e)))?;
            if !response.status().is_success() {
                return Err(VerifyError::Unreachable(format!("status {}", response.status())));
            }
            let bytes = response
                .body_mut()
                .with_config()
                .limit(256 * 1024 * 1024)
                .read_to_vec()
                .map_err(|e| VerifyError::Unreachable(e.to_string()))?;
            let actual = hex::encode(Sha256::digest(&bytes));
            if actual == expected { Ok(()) } else { Err(VerifyError::Mismatch { expected, actual }) }
        })
        .await
    }

    /// What a failed exchange came to, in words; a refused TLS handshake says
    /// which certificate problem and what the certificate was checked against.
    fn describe(&self, e: &ureq::Error) -> String {
        match tls::refused_handshake(e) {
            Some(tls) => format!(
                "the TLS handshake with provider `{}` failed: {tls} (its certificate is checked against {})",
                self.name, self.roots
            ),
            None => e.to_string(),
        }
    }

    /// What an HTTP exchange came to, as the error table needs it.
    fn answer_of(&self, response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> CallAnswer {
        match response {
            Ok(response) => answer_of(response),
            Err(e) => CallAnswer::Outcome(outcome_of_error(&e), Some(self.describe(&e))),
        }
    }

    fn with_auth<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        let header = self.dialect.as_ref().map_or("Authorization", |d| d.spec.auth_header.as_str());
        match &self.auth_header {
            Some(auth) => request.header(header, auth.expose_secret()),
            None => request,
        }
    }
}

/// A request that could not even be put together: nothing left.
fn dialect_not_sent(e: &ureq::http::Error) -> dialect::Reading {
    let answer = CallAnswer::Outcome(CallOutcome::NotSent, Some(format!("the request could not be built: {e}")));
    dialect::Reading { answer, poll_url: None }
}

/// The W3C trace context header every request to a provider carries.
const TRACEPARENT: &str = "traceparent";

fn with_trace<B>(request: ureq::RequestBuilder<B>, traceparent: Option<String>) -> ureq::RequestBuilder<B> {
    match traceparent {
        Some(traceparent) => request.header(TRACEPARENT, traceparent),
        None => request,
    }
}

/// Whether `uri` is on the origin (scheme, host and port) of `base_url`.
fn same_origin(base_url: &str, uri: &str) -> bool {
    let origin = |u: &str| {
        let (scheme, rest) = u.split_once("://")?;
        let authority = rest.split(['/', '?', '#']).next()?;
        Some((scheme.to_ascii_lowercase(), authority.to_ascii_lowercase()))
    };
    origin(base_url).is_some_and(|o| Some(o) == origin(uri))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_credential_never_prints() {
        let spec: ProviderSpec = serde_json::from_value(serde_json::json!({
            "base_url": "http://127.0.0.1:9", "auth_header_env": "FENCELINE_PROVIDER_IMG_AUTHORIZATION",
            "capabilities": {}, "call_timeout_ms": 1000, "concurrency": 1, "rate_per_second": 1, "burst": 1
        }))
        .expect("spec");
        let provider =
            HttpProvider::with_credential("img", &spec, Some(Secret::from("Bearer sk-live-6b1e".to_owned())))
                .expect("adapter");
        let printed = format!("{provider:?}");
        assert!(printed.contains("img") && !printed.contains("sk-live-6b1e"), "{printed}");
    }

    #[test]
    fn credentials_go_only_to_the_providers_own_origin() {
        let base = "http://127.0.0.1:8080";
        assert!(same_origin(base, "http://127.0.0.1:8080/artifacts/r1"));
        assert!(same_origin("HTTP://Example.com/", "http://example.com/a?b"));
        assert!(!same_origin(base, "http://127.0.0.1:8081/artifacts/r1"), "another port is another host");
        assert!(!same_origin(base, "https://127.0.0.1:8080/artifacts/r1"));
        assert!(!same_origin(base, "http://127.0.0.1:8080.evil.example/x"));
        assert!(!same_origin(base, "not a uri"));
    }
}
