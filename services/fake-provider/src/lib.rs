//! The fake provider: a real HTTP service that speaks Fenceline's provider protocol
//! (docs/provider-protocol.md), records every call it receives and keeps a billing
//! ledger, so tests count what was charged. It misbehaves on request. It also
//! speaks the vendor APIs the shipped dialects call (`chat.rs`, `vendors.rs`).
//! This file holds what they share: the rules, the state and the app.

mod admin;
mod chat;
mod protocol;
pub mod vendors;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::dev::{Server, ServerHandle};
use actix_web::{HttpRequest, HttpResponse, web};
use fenceline_config::HttpConfig;
use fenceline_runtime::{Error, Readiness, health_routes, serve};
use serde::{Deserialize, Serialize};
use vendors::Vendor;

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
    #[command(flatten)]
    pub tls: TlsListener,
}

/// Serving over TLS instead of plain HTTP, both the protocol's port and the
/// artifacts' "other host": for tests of the adapter's certificate checks.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsListener {
    /// PEM file of the server certificate (and its chain); with the key, the
    /// provider answers `https://` only.
    #[arg(long = "tls-certificate-file", env = "FAKE_PROVIDER_TLS_CERTIFICATE_FILE", requires = "key_file")]
    pub certificate_file: Option<PathBuf>,
    /// PEM file of its private key.
    #[arg(long = "tls-key-file", env = "FAKE_PROVIDER_TLS_KEY_FILE", requires = "certificate_file")]
    pub key_file: Option<PathBuf>,
    /// PEM file of the CA that client certificates must chain to; set, a client
    /// without such a certificate is refused during the handshake.
    #[arg(long = "tls-client-ca-file", env = "FAKE_PROVIDER_TLS_CLIENT_CA_FILE", requires = "certificate_file")]
    pub client_ca_file: Option<PathBuf>,
}

impl TlsListener {
    /// The server's TLS settings, when it serves TLS.
    fn server_config(&self) -> Result<Option<Arc<rustls::ServerConfig>>, Error> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let (Some(certificate_file), Some(key_file)) = (&self.certificate_file, &self.key_file) else {
            return Ok(None);
        };
        let bad = |what: &Path, e: &dyn std::fmt::Display| {
            Error::Config(fenceline_config::Error(format!("TLS listener: {}: {e}", what.display())))
        };
        let certs = CertificateDer::pem_file_iter(certificate_file)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| bad(certificate_file, &e))?;
        let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| bad(key_file, &e))?;
        let crypto = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(crypto.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(certificate_file, &e))?;
        let builder = match &self.client_ca_file {
            Some(ca_file) => {
                let mut roots = rustls::RootCertStore::empty();
                for ca in CertificateDer::pem_file_iter(ca_file).map_err(|e| bad(ca_file, &e))? {
                    roots.add(ca.map_err(|e| bad(ca_file, &e))?).map_err(|e| bad(ca_file, &e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), crypto)
                    .build()
                    .map_err(|e| bad(ca_file, &e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder.with_single_cert(certs, key).map_err(|e| bad(key_file, &e))?;
        Ok(Some(Arc::new(config)))
    }
}

/// Binds a listener, over TLS when `tls` is given.
fn listen<F>(http: &HttpConfig, tls: Option<&Arc<rustls::ServerConfig>>, routes: F) -> Result<(Server, u16), Error>
where
    F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
{
    let Some(tls) = tls else {
        return serve(http, routes);
    };
    let server = actix_web::HttpServer::new(move || actix_web::App::new().configure(routes.clone()))
        .workers(2)
        .disable_signals()
        .shutdown_timeout(http.shutdown_grace_ms.div_ceil(1000))
        .bind_rustls_0_23(http.addr, (**tls).clone())
        .map_err(|source| Error::Bind { addr: http.addr, source })?;
    let port = server.addrs().first().map(|a| a.port()).unwrap_or_default();
    Ok((server.run(), port))
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

/// Which request of the protocol a rule applies to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// `POST /v1/operations`.
    #[default]
    Start,
    /// `GET /v1/operations/{request_id}`, matched by the polled operation's name and key.
    Poll,
    /// `GET /artifacts/{request_id}`, matched likewise.
    Artifact,
    /// `GET /v1/operations?operation_key=K`, matched by the key asked about (and the
    /// operation's name when the provider has it).
    Lookup,
}

/// Where a finished operation's artifact is served from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Serving {
    /// At this provider's own address.
    #[default]
    Here,
    /// At another host (this process's second port): the result's `uri` names it.
    OtherHost,
    /// At this provider's address, which redirects (`307`) to the other host.
    Redirect,
}

/// A scripted misbehaviour, applied to matching calls `times` times (default: always).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    #[serde(default)]
    pub on: Target,
    pub operation_key: Option<String>,
    pub operation: Option<String>,
    pub latency_ms: Option<u64>,
    /// Answer this status and do nothing (after the latency).
    pub status: Option<u16>,
    pub retry_after_s: Option<u64>,
    /// Answer a status without the provider's problem body, as a gateway would.
    #[serde(default)]
    pub bare: bool,
    #[serde(default)]
    pub hang: bool,
    /// Close the connection without an answer (polls and artifacts).
    #[serde(default)]
    pub reset: bool,
    #[serde(default)]
    pub drop_after_accept: bool,
    #[serde(default)]
    pub exit: bool,
    /// Do the work, but serve an artifact whose bytes do not match its checksum.
    #[serde(default)]
    pub corrupt_artifact: bool,
    /// Do the work (and charge it), then answer this status.
    pub status_after_work: Option<u16>,
    /// Answer `409` while an operation with the request's key is still running;
    /// applies only then.
    #[serde(default)]
    pub conflict_while_running: bool,
    /// Register the work only this long after the request arrived: meanwhile a
    /// look-up says "never received".
    pub register_after_ms: Option<u64>,
    /// Where the operation's artifact is served from.
    pub serve_artifact: Option<Serving>,
    /// Applies to this share of the matching requests, evenly spread (0.5: every
    /// second one); the others go on to the next rule. Default: every one.
    pub share: Option<f64>,
    /// Each time the rule applies, its `latency_ms` grows by this much (a provider
    /// getting slower), up to `latency_max_ms`.
    pub latency_step_ms: Option<u64>,
    pub latency_max_ms: Option<u64>,
    /// A limit on work running at once: the rule applies only to a request that
    /// arrives while this many operations are being answered (see `latency_ms`).
    pub max_in_flight: Option<u32>,
    /// A limit on work started per second (a sliding window of one second): the
    /// rule applies only to a request beyond it.
    pub max_per_second: Option<u32>,
    pub times: Option<u32>,
    /// Matching requests seen, for `share`.
    #[serde(skip)]
    seen: u64,
}

impl Rule {
    /// What a call that did the work is logged as, by this rule: `dropped`, a
    /// status after the work, `replayed`, or `done` (`succeeded`, `accepted`).
    fn outcome_of_work(&self, replayed: bool, done: &str) -> String {
        match (self.status_after_work, self.drop_after_accept, replayed) {
            (_, true, _) => "dropped".to_owned(),
            (Some(status), _, _) => format!("status_after_work:{status}"),
            (None, _, true) => "replayed".to_owned(),
            (None, _, false) => done.to_owned(),
        }
    }

    fn matches(&self, on: Target, operation: &str, key: Option<&str>) -> bool {
        self.on == on
            && self.operation.as_deref().is_none_or(|o| o == operation)
            && self.operation_key.as_deref().is_none_or(|k| Some(k) == key)
    }

    /// Whether a limit rule applies: the request would exceed one of its limits.
    /// A rule without limits is not a limit rule and always applies.
    fn over_limit(&self, state: &State, now: tokio::time::Instant) -> bool {
        if self.max_in_flight.is_none() && self.max_per_second.is_none() {
            return true;
        }
        let busy = self.max_in_flight.is_some_and(|limit| state.in_flight >= limit);
        let window = now.checked_sub(Duration::from_secs(1));
        let started = state.started.iter().filter(|at| window.is_none_or(|w| **at > w)).count();
        busy || self.max_per_second.is_some_and(|limit| started >= limit as usize)
    }
}

/// One call as the provider received it: the truth about what happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Call {
    pub seq: u64,
    /// When the request arrived, in microseconds since the Unix epoch.
    pub received_at_us: i64,
    pub operation: String,
    pub operation_key: Option<String>,
    /// The input the call carried, as received.
    pub input: serde_json::Value,
    pub request_id: Option<String>,
    pub charged: bool,
    /// What was answered: `succeeded`, `accepted`, `replayed`, `status:429`, `hang`,
    /// `dropped`, `conflict`, `status_after_work:504`.
    pub outcome: String,
    /// When the call arrived, in milliseconds since the Unix epoch.
    pub received_at_ms: u64,
    /// The W3C trace context the call arrived with, if any.
    #[serde(default)]
    pub traceparent: Option<String>,
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
    operation: String,
    key: Option<String>,
    content: Vec<u8>,
    corrupt: bool,
    serving: Serving,
    ready_at: tokio::time::Instant,
}

impl Operation {
    fn running(&self) -> bool {
        tokio::time::Instant::now() < self.ready_at
    }
}

#[derive(Debug, Default)]
struct State {
    capabilities: Capabilities,
    calls: Vec<Call>,
    charges: Vec<Charge>,
    operations: HashMap<String, Operation>,
    /// A vendor API's first answer to each request id, which a replay repeats.
    answers: HashMap<String, serde_json::Value>,
    by_key: HashMap<String, String>,
    rules: Vec<Rule>,
    /// Operations being answered now (registered, answer not yet sent).
    in_flight: u32,
    /// When work was last started, the last second's worth (for `max_per_second`).
    started: std::collections::VecDeque<tokio::time::Instant>,
}

/// A request counted in flight (when `counted`), until dropped: answered or abandoned.
struct InFlight(Option<Shared>);

impl InFlight {
    fn counted(shared: &Shared, counted: bool) -> Self {
        Self(counted.then(|| shared.clone()))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(shared) = &self.0 {
            let mut state = shared.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
        }
    }
}

/// What a request carried when it arrived, for its entry in the call log.
#[derive(Debug, Clone)]
struct Arrival {
    received_at_us: i64,
    operation: String,
    key: Option<String>,
    traceparent: Option<String>,
}

impl Arrival {
    /// A request to `operation` arriving now, with its key and trace context.
    fn now(req: &HttpRequest, operation: &str) -> Self {
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Arrival {
            received_at_us: unix_micros(),
            operation: operation.to_owned(),
            key: header("Idempotency-Key"),
            traceparent: header("traceparent"),
        }
    }
}

#[derive(Debug, Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    async_delay: Duration,
    price_cents: u64,
    /// The second port, where artifacts served from "another host" live.
    artifact_port: Arc<AtomicU16>,
}

impl Shared {
    /// Logs one call: what arrived, the input it carried, and what it came to.
    fn record(
        &self,
        arrival: &Arrival,
        input: &serde_json::Value,
        outcome: &str,
        request_id: Option<String>,
        charged: bool,
    ) {
        let mut state = self.lock();
        let seq = state.calls.len() as u64 + 1;
        state.calls.push(Call {
            seq,
            received_at_us: arrival.received_at_us,
            operation: arrival.operation.clone(),
            operation_key: arrival.key.clone(),
            input: input.clone(),
            request_id,
            charged,
            outcome: outcome.to_owned(),
            received_at_ms: u64::try_from(arrival.received_at_us / 1_000).unwrap_or(0),
            traceparent: arrival.traceparent.clone(),
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the first rule for `on` that matches and `applies`, counting it down.
    /// The operation under `key` when the provider dedupes and has one (a replay,
    /// `true`); else a new operation `make` builds under a fresh request id with
    /// `prefix`, registered, visible to look-ups by its key, and charged.
    fn work_once_per_key(
        &self,
        key: Option<&str>,
        make: impl FnOnce(&State, &str) -> Operation,
        prefix: &str,
    ) -> (Operation, bool) {
        let mut state = self.lock();
        if state.capabilities.idempotency_keys
            && let Some(op) = key.and_then(|k| state.by_key.get(k)).and_then(|id| state.operations.get(id))
        {
            return (op.clone(), true);
        }
        let request_id = format!("{prefix}-{}", uuid::Uuid::now_v7().simple());
        let op = make(&state, &request_id);
        state.operations.insert(request_id.clone(), op.clone());
        if let Some(k) = key {
            state.by_key.entry(k.to_owned()).or_insert(request_id.clone());
        }
        state.charges.push(Charge { request_id, operation_key: key.map(str::to_owned), cents: self.price_cents });
        (op, false)
    }

    fn take_rule(
        &self,
        on: Target,
        operation: &str,
        key: Option<&str>,
        applies: impl Fn(&State, &Rule) -> bool,
    ) -> Rule {
        self.take_rule_then(on, operation, key, applies, |_, _| {})
    }

    /// As [`Shared::take_rule`], then `then` with the rule taken, under the same lock.
    fn take_rule_then(
        &self,
        on: Target,
        operation: &str,
        key: Option<&str>,
        applies: impl Fn(&State, &Rule) -> bool,
        then: impl FnOnce(&mut State, &Rule),
    ) -> Rule {
        let mut state = self.lock();
        let mut found = None;
        for i in 0..state.rules.len() {
            if !(state.rules[i].matches(on, operation, key) && applies(&state, &state.rules[i])) {
                continue;
            }
            let rule = &mut state.rules[i];
            if let Some(share) = rule.share {
                // Applies when `seen × share` crosses a whole number: evenly spread.
                rule.seen += 1;
                let crossed = (rule.seen as f64 * share).floor() > ((rule.seen - 1) as f64 * share).floor();
                if !crossed {
                    continue;
                }
            }
            found = Some(i);
            break;
        }
        let rule = found
            .map(|i| {
                let rule = state.rules[i].clone();
                if let Some(step) = rule.latency_step_ms {
                    let next = rule.latency_ms.unwrap_or(0).saturating_add(step);
                    state.rules[i].latency_ms = Some(rule.latency_max_ms.map_or(next, |max| next.min(max)));
                }
                if let Some(times) = state.rules[i].times.as_mut() {
                    *times = times.saturating_sub(1);
                    if *times == 0 {
                        state.rules.remove(i);
                    }
                }
                rule
            })
            .unwrap_or_default();
        then(&mut state, &rule);
        rule
    }

    /// The base URL of the other host, as a caller that reached `req` names it.
    fn other_host(&self, req: &HttpRequest) -> String {
        let info = req.connection_info();
        let host = info.host();
        // Strip the port, minding IPv6 literals (`[::1]:80`).
        let name = match host.rfind(':') {
            Some(i) if !host[i..].contains(']') => &host[..i],
            _ => host,
        };
        format!("{}://{name}:{}", info.scheme(), self.artifact_port.load(Ordering::Acquire))
    }
}

fn problem(status: u16, detail: &str) -> HttpResponse {
    HttpResponse::build(
        actix_web::http::StatusCode::from_u16(status).unwrap_or(actix_web::http::StatusCode::BAD_REQUEST),
    )
    .content_type("application/problem+json")
    .json(serde_json::json!({"type": format!("/problems/provider-{status}"), "status": status, "detail": detail}))
}

/// A scripted status: the provider's problem document, or with `bare` the page a
/// gateway in front of it would answer; `Retry-After` when the rule has one.
fn scripted(rule: &Rule, status: u16, detail: &str) -> HttpResponse {
    let mut response = if rule.bare {
        HttpResponse::build(
            actix_web::http::StatusCode::from_u16(status).unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY),
        )
        .content_type("text/html")
        .body(format!("<html><body><h1>{status}</h1>gateway</body></html>"))
    } else {
        problem(status, detail)
    };
    if let Some(after) = rule.retry_after_s
        && let Ok(value) = actix_web::http::header::HeaderValue::from_str(&after.to_string())
    {
        response.headers_mut().insert(actix_web::http::header::RETRY_AFTER, value);
    }
    response
}

/// An answer whose connection breaks before the body: the caller gets no answer.
fn broken(why: &'static str) -> HttpResponse {
    let stream =
        futures_util::stream::once(async move { Err::<web::Bytes, std::io::Error>(std::io::Error::other(why)) });
    HttpResponse::Ok().content_type("application/json").streaming(stream)
}

/// Now, in microseconds since the Unix epoch.
fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// What a poll or artifact rule scripts before the normal answer, if anything.
async fn misbehave(rule: &Rule, detail: &'static str) -> Option<HttpResponse> {
    if let Some(latency) = rule.latency_ms {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    if rule.hang {
        std::future::pending::<()>().await;
    }
    if rule.reset {
        return Some(broken(detail));
    }
    rule.status.map(|status| scripted(rule, status, "scripted"))
}

/// The running fake provider: the protocol on its port, and artifacts served from
/// "another host" on a second port of the same address.
pub struct App {
    server: Server,
    artifact_server: Server,
    port: u16,
    artifact_port: u16,
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
            artifact_port: Arc::new(AtomicU16::new(0)),
        });
        let tls = config.tls.server_config()?;
        let elsewhere = HttpConfig { addr: SocketAddr::new(config.http.addr.ip(), 0), ..config.http.clone() };
        let (artifact_server, artifact_port) = listen(&elsewhere, tls.as_ref(), {
            let shared = shared.clone();
            move |cfg: &mut web::ServiceConfig| {
                cfg.app_data(shared.clone())
                    .route("/artifacts/{request_id}", web::get().to(protocol::artifact_elsewhere));
            }
        })?;
        shared.artifact_port.store(artifact_port, Ordering::Release);
        let health = health_routes(NAME, readiness.clone(), None);
        let (server, port) = listen(&config.http, tls.as_ref(), move |cfg: &mut web::ServiceConfig| {
            health(cfg);
            cfg.app_data(shared.clone())
                .route("/v1/operations", web::post().to(protocol::start))
                .route("/v1/operations", web::get().to(protocol::lookup))
                .route("/v1/operations/{request_id}", web::get().to(protocol::poll))
                .route("/v1/chat/completions", web::post().to(chat::chat_completions))
                .route("/v1/messages", web::post().to(|r, s, b| vendors::create(Vendor::Anthropic, r, s, b)))
                .route("/v1/predictions", web::post().to(|r, s, b| vendors::create(Vendor::Replicate, r, s, b)))
                .route("/v1/predictions/{request_id}", web::get().to(vendors::poll_prediction))
                .route("/v1/refunds", web::post().to(|r, s, b| vendors::create(Vendor::Stripe, r, s, b)))
                .route(
                    "/2010-04-01/Accounts/{account}/Messages.json",
                    web::post().to(|r, s, b| vendors::create(Vendor::Twilio, r, s, b)),
                )
                .route("/artifacts/{request_id}", web::get().to(protocol::artifact))
                .route("/admin/calls", web::get().to(admin::calls))
                .route("/admin/ledger", web::get().to(admin::ledger))
                .route("/admin/capabilities", web::put().to(admin::set_capabilities))
                .route("/admin/rules", web::post().to(admin::add_rule))
                .route("/admin/rules", web::delete().to(admin::clear_rules))
                .route("/admin/forget-keys", web::post().to(admin::forget_keys))
                .route("/admin/reset", web::post().to(admin::reset));
        })?;
        tracing::info!(service = NAME, port, artifact_port, tls = tls.is_some(), capabilities = ?config.capabilities, "listening");
        Ok(Self { server, artifact_server, port, artifact_port, readiness })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The second port, where artifacts served from another host live.
    pub fn artifact_port(&self) -> u16 {
        self.artifact_port
    }

    /// Serves until `shutdown` resolves.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let handle: ServerHandle = self.server.handle();
        let artifact_handle: ServerHandle = self.artifact_server.handle();
        let server = tokio::spawn(self.server);
        let artifact_server = tokio::spawn(self.artifact_server);
        self.readiness.set(true);
        shutdown.await;
        self.readiness.set(false);
        handle.stop(true).await;
        artifact_handle.stop(true).await;
        let _ = server.await;
        let _ = artifact_server.await;
    }
}
