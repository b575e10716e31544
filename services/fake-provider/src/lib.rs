//! The fake provider: a real HTTP service that speaks Fenceline's provider protocol
//! (docs/provider-protocol.md), records every call it receives and keeps a billing
//! ledger, so tests count what was charged. It misbehaves on request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use actix_web::{HttpRequest, HttpResponse, web};
use fenceline_config::HttpConfig;
use fenceline_runtime::{Error, Readiness, health_routes, serve};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const NAME: &str = "fake-provider";

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "fenceline-fake-provider")]
pub struct Config {
    #[command(flatten)]
    pub http: HttpConfig,
    #[command(flatten)]
    pub capabilities: Capabilities,
    /// How long an asynchronous operation takes to finish, in milliseconds.
    #[arg(long, env = "FAKE_PROVIDER_ASYNC_DELAY_MS", default_value_t = 200)]
    pub async_delay_ms: u64,
    /// What one charged operation costs, in cents.
    #[arg(long, env = "FAKE_PROVIDER_PRICE_CENTS", default_value_t = 4)]
    pub price_cents: u64,
}

/// What this provider instance can do; switchable at run time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct Capabilities {
    /// Deduplicate by `Idempotency-Key`: a repeated key is answered, not charged.
    #[arg(long = "idempotency-keys", env = "FAKE_PROVIDER_IDEMPOTENCY_KEYS", default_value_t = false)]
    pub idempotency_keys: bool,
    /// Answer look-ups by operation key.
    #[arg(long = "lookup", env = "FAKE_PROVIDER_LOOKUP", default_value_t = false)]
    pub lookup: bool,
    /// Accept work with `202` and finish it later, instead of answering the result.
    #[arg(long = "async-results", env = "FAKE_PROVIDER_ASYNC_RESULTS", default_value_t = false)]
    pub async_results: bool,
}

/// A scripted misbehaviour, applied to matching calls `times` times (default: always).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub operation_key: Option<String>,
    pub operation: Option<String>,
    pub latency_ms: Option<u64>,
    pub status: Option<u16>,
    pub retry_after_s: Option<u64>,
    #[serde(default)]
    pub hang: bool,
    #[serde(default)]
    pub drop_after_accept: bool,
    #[serde(default)]
    pub exit: bool,
    /// Do the work, but serve an artifact whose bytes do not match its checksum.
    #[serde(default)]
    pub corrupt_artifact: bool,
    pub times: Option<u32>,
}

impl Rule {
    fn matches(&self, operation: &str, key: Option<&str>) -> bool {
        self.operation.as_deref().is_none_or(|o| o == operation)
            && self.operation_key.as_deref().is_none_or(|k| Some(k) == key)
    }
}

/// One call as the provider received it: the truth about what happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Call {
    pub seq: u64,
    pub operation: String,
    pub operation_key: Option<String>,
    /// The input the call carried, as received.
    pub input: serde_json::Value,
    pub request_id: Option<String>,
    pub charged: bool,
    /// What was answered: `succeeded`, `accepted`, `replayed`, `status:429`, `hang`, `dropped`.
    pub outcome: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charge {
    pub request_id: String,
    pub operation_key: Option<String>,
    pub cents: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ledger {
    pub charges: Vec<Charge>,
    pub total_cents: u64,
}

#[derive(Debug, Clone)]
struct Operation {
    request_id: String,
    content: Vec<u8>,
    corrupt: bool,
    ready_at: tokio::time::Instant,
}

#[derive(Debug, Default)]
struct State {
    capabilities: Capabilities,
    calls: Vec<Call>,
    charges: Vec<Charge>,
    operations: HashMap<String, Operation>,
    by_key: HashMap<String, String>,
    rules: Vec<Rule>,
}

#[derive(Debug, Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    async_delay: Duration,
    price_cents: u64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

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

fn answer(req: &HttpRequest, op: &Operation, done: bool) -> Answer {
    let info = req.connection_info();
    Answer {
        request_id: op.request_id.clone(),
        status: if done { "succeeded" } else { "running" },
        result: done.then(|| ArtifactJson {
            uri: format!("{}://{}/artifacts/{}", info.scheme(), info.host(), op.request_id),
            sha256: hex::encode(Sha256::digest(&op.content)),
            size_bytes: op.content.len(),
        }),
    }
}

fn problem(status: u16, detail: &str) -> HttpResponse {
    HttpResponse::build(
        actix_web::http::StatusCode::from_u16(status).unwrap_or(actix_web::http::StatusCode::BAD_REQUEST),
    )
    .content_type("application/problem+json")
    .json(serde_json::json!({"type": format!("/problems/provider-{status}"), "status": status, "detail": detail}))
}

async fn start(req: HttpRequest, shared: web::Data<Shared>, body: web::Bytes) -> HttpResponse {
    let Ok(start) = serde_json::from_slice::<StartOperation>(&body) else {
        return problem(400, "body must be {\"operation\": ..., \"input\": ...}");
    };
    let key = req.headers().get("Idempotency-Key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let rule = {
        let mut state = shared.lock();
        let found = state.rules.iter().position(|r| r.matches(&start.operation, key.as_deref()));
        found.map(|i| {
            let rule = state.rules[i].clone();
            if let Some(times) = state.rules[i].times.as_mut() {
                *times = times.saturating_sub(1);
                if *times == 0 {
                    state.rules.remove(i);
                }
            }
            rule
        })
    }
    .unwrap_or_default();
    // Scripted refusals come after the latency; accepted work is registered (and
    // visible to look-ups) at once and answered after it, as a provider that is
    // still rendering would.
    let latency = rule.latency_ms.map(Duration::from_millis).unwrap_or_default();
    if rule.status.is_some() {
        tokio::time::sleep(latency).await;
    }
    if rule.exit {
        tracing::warn!("fake provider exits on a rule");
        std::process::abort();
    }
    let record = |outcome: &str, request_id: Option<String>, charged: bool| {
        let mut state = shared.lock();
        let seq = state.calls.len() as u64 + 1;
        state.calls.push(Call {
            seq,
            operation: start.operation.clone(),
            operation_key: key.clone(),
            input: start.input.clone(),
            request_id,
            charged,
            outcome: outcome.to_owned(),
        });
    };
    if let Some(status) = rule.status {
        record(&format!("status:{status}"), None, false);
        let mut response = problem(status, "scripted");
        if let Some(after) = rule.retry_after_s
            && let Ok(value) = actix_web::http::header::HeaderValue::from_str(&after.to_string())
        {
            response.headers_mut().insert(actix_web::http::header::RETRY_AFTER, value);
        }
        return response;
    }
    if rule.hang {
        record("hang", None, false);
        std::future::pending::<()>().await;
    }
    // Work, once per key when the provider dedupes.
    let (op, replayed) = {
        let mut state = shared.lock();
        let existing = match (&key, state.capabilities.idempotency_keys) {
            (Some(k), true) => state.by_key.get(k).and_then(|id| state.operations.get(id)).cloned(),
            _ => None,
        };
        match existing {
            Some(op) => (op, true),
            None => {
                let request_id = format!("req-{}", uuid::Uuid::now_v7().simple());
                let content = format!("{}:{}:{request_id}", start.operation, start.input).into_bytes();
                let delay =
                    latency + if state.capabilities.async_results { shared.async_delay } else { Duration::ZERO };
                let op = Operation {
                    request_id: request_id.clone(),
                    content,
                    corrupt: rule.corrupt_artifact,
                    ready_at: tokio::time::Instant::now() + delay,
                };
                state.operations.insert(request_id.clone(), op.clone());
                if let Some(k) = &key {
                    state.by_key.entry(k.clone()).or_insert(request_id.clone());
                }
                state.charges.push(Charge { request_id, operation_key: key.clone(), cents: shared.price_cents });
                (op, false)
            }
        }
    };
    let is_async = shared.lock().capabilities.async_results;
    // The call is in the log from the moment the work is registered: a caller
    // that stops while the provider is still rendering has been received.
    let answered_at_once = !is_async || shared.async_delay.is_zero();
    let outcome = if rule.drop_after_accept {
        "dropped"
    } else if replayed {
        "replayed"
    } else if answered_at_once {
        "succeeded"
    } else {
        "accepted"
    };
    record(outcome, Some(op.request_id.clone()), !replayed);
    if !replayed {
        tokio::time::sleep(latency).await;
    }
    if rule.drop_after_accept {
        // The work is done and charged; the caller gets a reset, not an answer.
        let stream = futures_util::stream::once(async {
            Err::<web::Bytes, std::io::Error>(std::io::Error::other("connection dropped after accepting"))
        });
        return HttpResponse::Ok().content_type("application/json").streaming(stream);
    }
    let done = tokio::time::Instant::now() >= op.ready_at;
    if is_async && !done {
        HttpResponse::Accepted().json(Answer { request_id: op.request_id.clone(), status: "accepted", result: None })
    } else {
        HttpResponse::Ok().json(answer(&req, &op, done))
    }
}

async fn poll(req: HttpRequest, shared: web::Data<Shared>, path: web::Path<String>) -> HttpResponse {
    let op = shared.lock().operations.get(path.as_str()).cloned();
    match op {
        Some(op) => {
            let done = tokio::time::Instant::now() >= op.ready_at;
            HttpResponse::Ok().json(answer(&req, &op, done))
        }
        None => problem(404, "no such request"),
    }
}

#[derive(Debug, Deserialize)]
struct KeyQuery {
    operation_key: Option<String>,
}

async fn lookup(req: HttpRequest, shared: web::Data<Shared>, query: web::Query<KeyQuery>) -> HttpResponse {
    let state = shared.lock();
    if !state.capabilities.lookup {
        return problem(501, "this provider cannot look operations up");
    }
    let Some(key) = &query.operation_key else { return problem(400, "operation_key is required") };
    match state.by_key.get(key).and_then(|id| state.operations.get(id)) {
        Some(op) => {
            let done = tokio::time::Instant::now() >= op.ready_at;
            HttpResponse::Ok().json(answer(&req, op, done))
        }
        None => HttpResponse::NotFound().json(serde_json::json!({"status": "unknown", "operation_key": key})),
    }
}

async fn artifact(shared: web::Data<Shared>, path: web::Path<String>) -> HttpResponse {
    match shared.lock().operations.get(path.as_str()) {
        Some(op) => {
            let mut bytes = op.content.clone();
            if op.corrupt {
                bytes.extend_from_slice(b" (corrupted in storage)");
            }
            HttpResponse::Ok().content_type("application/octet-stream").body(bytes)
        }
        None => problem(404, "no such artifact"),
    }
}

async fn calls(shared: web::Data<Shared>, query: web::Query<KeyQuery>) -> HttpResponse {
    let state = shared.lock();
    let calls: Vec<&Call> = state
        .calls
        .iter()
        .filter(|c| query.operation_key.as_ref().is_none_or(|k| c.operation_key.as_ref() == Some(k)))
        .collect();
    HttpResponse::Ok().json(calls)
}

async fn ledger(shared: web::Data<Shared>) -> HttpResponse {
    let state = shared.lock();
    let total_cents = state.charges.iter().map(|c| c.cents).sum();
    HttpResponse::Ok().json(Ledger { charges: state.charges.clone(), total_cents })
}

async fn set_capabilities(shared: web::Data<Shared>, body: web::Json<Capabilities>) -> HttpResponse {
    shared.lock().capabilities = body.into_inner();
    HttpResponse::NoContent().finish()
}

async fn add_rule(shared: web::Data<Shared>, body: web::Json<Rule>) -> HttpResponse {
    shared.lock().rules.push(body.into_inner());
    HttpResponse::NoContent().finish()
}

async fn clear_rules(shared: web::Data<Shared>) -> HttpResponse {
    shared.lock().rules.clear();
    HttpResponse::NoContent().finish()
}

async fn reset(shared: web::Data<Shared>) -> HttpResponse {
    let mut state = shared.lock();
    let capabilities = state.capabilities;
    *state = State { capabilities, ..State::default() };
    HttpResponse::NoContent().finish()
}

/// The running fake provider.
pub struct App {
    server: Server,
    port: u16,
    readiness: Readiness,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").field("port", &self.port).finish_non_exhaustive()
    }
}

impl App {
    pub fn build(config: Config) -> Result<Self, Error> {
        let readiness = Readiness::default();
        let shared = web::Data::new(Shared {
            state: Arc::new(Mutex::new(State { capabilities: config.capabilities, ..State::default() })),
            async_delay: Duration::from_millis(config.async_delay_ms),
            price_cents: config.price_cents,
        });
        let health = health_routes(NAME, readiness.clone(), None);
        let (server, port) = serve(&config.http, move |cfg: &mut web::ServiceConfig| {
            health(cfg);
            cfg.app_data(shared.clone())
                .route("/v1/operations", web::post().to(start))
                .route("/v1/operations", web::get().to(lookup))
                .route("/v1/operations/{request_id}", web::get().to(poll))
                .route("/artifacts/{request_id}", web::get().to(artifact))
                .route("/admin/calls", web::get().to(calls))
                .route("/admin/ledger", web::get().to(ledger))
                .route("/admin/capabilities", web::put().to(set_capabilities))
                .route("/admin/rules", web::post().to(add_rule))
                .route("/admin/rules", web::delete().to(clear_rules))
                .route("/admin/reset", web::post().to(reset));
        })?;
        tracing::info!(service = NAME, port, capabilities = ?config.capabilities, "listening");
        Ok(Self { server, port, readiness })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until `shutdown` resolves.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let handle: ServerHandle = self.server.handle();
        let server = tokio::spawn(self.server);
        self.readiness.set(true);
        shutdown.await;
        self.readiness.set(false);
        handle.stop(true).await;
        let _ = server.await;
    }
}
