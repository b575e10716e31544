//! Provider adapters: what the executor and the reconciler call. A provider
//! declares its capabilities; the HTTP adapter speaks the provider protocol of
//! `docs/provider-protocol.md`. Adapters never retry: the scheduler is the one
//! retry layer, and a retried paid call is exactly what Fenceline must not do
//! behind anyone's back.

use std::collections::HashMap;
use std::time::Duration;

use fenceline_config::catalog::ProviderSpec;
use fenceline_domain::calls::{CallOutcome, ProviderCapabilities};
use fenceline_domain::vocabulary::ErrorClass;
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// A result as the provider names it: where it is and its checksum.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ProviderResult {
    pub uri: String,
    pub sha256: String,
    pub size_bytes: i64,
}

/// What starting or polling an operation came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallAnswer {
    /// Done; the result is at the provider.
    Done { request_id: String, result: ProviderResult },
    /// Accepted; the result comes later (poll with the request id).
    Accepted { request_id: String },
    /// Anything else, as observed: an error status, nothing sent, or no answer.
    Outcome(CallOutcome),
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
    auth_header: Option<String>,
    capabilities: ProviderCapabilities,
    overrides: HashMap<u16, ErrorClass>,
    agent: ureq::Agent,
    /// Without a connection pool: for the paid call only.
    call_agent: ureq::Agent,
}

impl HttpProvider {
    /// The adapter for a catalogue entry; the auth header is read from the
    /// environment variable the entry names.
    pub fn new(name: &str, spec: &ProviderSpec) -> Self {
        let timeout = spec.call_timeout();
        let config = |pooled: bool| {
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(timeout))
                // A connect that fails is "not sent"; keep it inside the call timeout.
                .timeout_connect(Some(timeout.min(Duration::from_secs(2)) / 2))
                .max_redirects(0)
                .max_idle_connections(if pooled { 10 } else { 0 })
                .max_idle_connections_per_host(if pooled { 3 } else { 0 })
                .build()
                .new_agent()
        };
        // A paid call never rides a kept-alive connection: a write that meets a
        // connection the provider is closing fails after the connection was made,
        // which only a fresh connection can tell apart from "not sent". Look-ups
        // and verification are free to repeat and keep their connections.
        let (agent, call_agent) = (config(true), config(false));
        Self {
            name: name.to_owned(),
            base_url: spec.base_url.trim_end_matches('/').to_owned(),
            auth_header: spec.auth_header_env.as_ref().and_then(|var| std::env::var(var).ok()),
            capabilities: spec.capabilities(),
            overrides: spec.overrides(),
            agent,
            call_agent,
        }
    }

    pub fn capabilities(&self) -> ProviderCapabilities {
        self.capabilities
    }

    pub fn overrides(&self) -> &HashMap<u16, ErrorClass> {
        &self.overrides
    }

    /// Starts an operation. The operation key travels as `Idempotency-Key` when
    /// the provider dedupes or looks up by it (a look-up needs the key it was sent).
    pub async fn start(&self, operation: &str, input: serde_json::Value, operation_key: &str) -> CallAnswer {
        let this = self.clone();
        let key = operation_key.to_owned();
        let body = serde_json::json!({ "operation": operation, "input": input });
        blocking(move || {
            let mut request = this.call_agent.post(format!("{}/v1/operations", this.base_url));
            if this.capabilities.idempotency_keys || this.capabilities.lookup {
                request = request.header("Idempotency-Key", key.as_str());
            }
            if let Some(auth) = &this.auth_header {
                request = request.header("Authorization", auth.as_str());
            }
            answer_of(request.send_json(&body))
        })
        .await
    }

    /// Polls an accepted operation.
    pub async fn poll(&self, request_id: &str) -> CallAnswer {
        let this = self.clone();
        let url = format!("{}/v1/operations/{request_id}", self.base_url);
        blocking(move || answer_of(this.with_auth(this.agent.get(url)).call())).await
    }

    /// Asks whether the provider received the operation with this key.
    pub async fn lookup(&self, operation_key: &str) -> Lookup {
        if !self.capabilities.lookup {
            return Lookup::NoAnswer(format!("provider `{}` cannot look up by operation key", self.name));
        }
        let this = self.clone();
        let url = format!("{}/v1/operations?operation_key={operation_key}", self.base_url);
        blocking(move || match this.with_auth(this.agent.get(url)).call() {
            Ok(mut r) if r.status().as_u16() == 404 => {
                let _ = r.body_mut().read_to_vec();
                Lookup::NeverReceived
            }
            Ok(r) if r.status().is_success() => match answer_of(Ok(r)) {
                CallAnswer::Done { request_id, result } => Lookup::Found { request_id, result: Some(result) },
                CallAnswer::Accepted { request_id } => Lookup::Found { request_id, result: None },
                CallAnswer::Outcome(o) => Lookup::NoAnswer(format!("{o:?}")),
            },
            Ok(r) => Lookup::NoAnswer(format!("status {}", r.status())),
            Err(e) => Lookup::NoAnswer(e.to_string()),
        })
        .await
    }

    /// Fetches the artifact and checks its sha256 against what the provider said.
    pub async fn verify(&self, result: &ProviderResult) -> Result<(), VerifyError> {
        let this = self.clone();
        let uri = result.uri.clone();
        let expected = result.sha256.to_ascii_lowercase();
        blocking(move || {
            let mut response =
                this.with_auth(this.agent.get(&uri)).call().map_err(|e| VerifyError::Unreachable(e.to_string()))?;
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

    fn with_auth<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.auth_header {
            Some(auth) => request.header("Authorization", auth.as_str()),
            None => request,
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

#[derive(Debug, Deserialize)]
struct Answer {
    request_id: String,
    status: String,
    #[serde(default)]
    result: Option<ProviderResult>,
}

/// What an HTTP exchange came to, as the error table needs it.
fn answer_of(response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> CallAnswer {
    let mut response = match response {
        Ok(r) => r,
        Err(e) => return CallAnswer::Outcome(outcome_of_error(&e)),
    };
    let status = response.status().as_u16();
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
        Err(_) if (200..300).contains(&status) => return CallAnswer::Outcome(CallOutcome::ResetMidResponse),
        Err(_) => Vec::new(),
    };
    if !(200..300).contains(&status) {
        return CallAnswer::Outcome(CallOutcome::Answered { status, retry_after });
    }
    match serde_json::from_slice::<Answer>(&body) {
        Ok(Answer { request_id, status: s, result: Some(result) }) if s == "succeeded" => {
            CallAnswer::Done { request_id, result }
        }
        Ok(Answer { request_id, status: s, .. }) if s == "accepted" || s == "running" => {
            CallAnswer::Accepted { request_id }
        }
        // A success we cannot read: the work may have happened.
        _ => CallAnswer::Outcome(CallOutcome::ResetMidResponse),
    }
}

/// Only failures that certainly happened before the request left are "not sent";
/// everything else may have reached the provider.
fn outcome_of_error(e: &ureq::Error) -> CallOutcome {
    use ureq::Timeout;
    match e {
        ureq::Error::ConnectionFailed
        | ureq::Error::HostNotFound
        | ureq::Error::BadUri(_)
        | ureq::Error::Timeout(Timeout::Connect | Timeout::Resolve) => CallOutcome::NotSent,
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => CallOutcome::NotSent,
        ureq::Error::Timeout(_) => CallOutcome::TimedOutAfterSend,
        _ => CallOutcome::ResetMidResponse,
    }
}
