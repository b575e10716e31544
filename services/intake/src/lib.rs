//! Intake: the front door. Idempotent submission over HTTP, signed webhooks and the
//! upstream intake topic; the `task_view` read model.

pub mod actions;
pub mod auth;
pub mod kinds;
pub mod problem;
pub mod tasks;
pub mod upstream;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use fenceline_bus::OutboxWriter;
use fenceline_config::ServiceConfig;
use fenceline_domain::ids::TaskId;
use fenceline_runtime::{Error, ServiceApp};
use sqlx::PgPool;

use crate::auth::Caller;
use crate::problem::ApiError;
use crate::tasks::{IdempotencyKey, SubmitTask, Submitted};

/// The service's name: its log field, its database schema, its outbox producer.
pub const NAME: &str = "intake";

/// The intake's tables, after the bus tables.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "fenceline-intake", about = "Fenceline intake: the task API")]
pub struct Config {
    #[command(flatten)]
    pub service: ServiceConfig,
    #[command(flatten)]
    pub intake: IntakeConfig,
}

/// Intake's own settings.
#[derive(Debug, Clone, clap::Args)]
pub struct IntakeConfig {
    /// Task kinds clients may submit, comma separated.
    #[arg(
        long = "kinds",
        env = "FENCELINE_INTAKE_KINDS",
        value_delimiter = ',',
        default_value = "image.generate,ticket.triage"
    )]
    pub kinds: Vec<String>,

    /// Folder of JSON Schemas for task inputs, one `<kind>.json` per kind that has
    /// one; kinds without a file take any input.
    #[arg(long = "kind-schemas", env = "FENCELINE_INTAKE_KIND_SCHEMAS")]
    pub kind_schemas: Option<std::path::PathBuf>,

    /// How long an Idempotency-Key is remembered, in hours.
    #[arg(
        long = "idempotency-retention-hours",
        env = "FENCELINE_INTAKE_IDEMPOTENCY_RETENTION_HOURS",
        default_value_t = 24
    )]
    pub idempotency_retention_hours: u32,

    /// How far a webhook's timestamp may be from now, in seconds (replay window).
    #[arg(
        long = "webhook-tolerance-seconds",
        env = "FENCELINE_INTAKE_WEBHOOK_TOLERANCE_SECONDS",
        default_value_t = 300
    )]
    pub webhook_tolerance_seconds: i64,

    /// Largest request body, in bytes.
    #[arg(long = "body-limit-bytes", env = "FENCELINE_INTAKE_BODY_LIMIT_BYTES", default_value_t = 256 * 1024)]
    pub body_limit_bytes: usize,
}

/// Shared state of the handlers.
#[derive(Debug, Clone)]
struct State {
    outbox: OutboxWriter,
    kinds: Arc<kinds::KindCatalog>,
    webhook_tolerance_seconds: i64,
}

/// Builds intake: connects and migrates its schema, starts its outbox relay, its
/// status projection and the idempotency purge, and binds its HTTP listener.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let kinds = Arc::new(
        kinds::KindCatalog::load(&config.intake.kinds, config.intake.kind_schemas.as_deref())
            .map_err(|e| Error::Config(fenceline_config::Error(e.to_string())))?,
    );
    let upstream_kinds = kinds.clone();
    let body_limit = config.intake.body_limit_bytes;
    let webhook_tolerance_seconds = config.intake.webhook_tolerance_seconds;
    let mut app = ServiceApp::build(NAME, &config.service, &MIGRATOR, |base| {
        let pool = web::Data::new(base.database.pool.clone());
        let state = web::Data::new(State { outbox: base.outbox.clone(), kinds, webhook_tolerance_seconds });
        move |cfg: &mut web::ServiceConfig| {
            cfg.app_data(pool.clone())
                .app_data(state.clone())
                .app_data(web::JsonConfig::default().limit(body_limit).error_handler(problem::json_error))
                .app_data(web::PayloadConfig::new(body_limit))
                .app_data(
                    web::QueryConfig::default().error_handler(|e, _| ApiError::InvalidRequest(e.to_string()).into()),
                )
                .route("/v1/tasks", web::post().to(submit))
                .route("/v1/tasks", web::get().to(list))
                .route("/v1/tasks/{task_id}", web::get().to(read))
                .route("/v1/tasks/{task_id}/cancel", web::post().to(cancel))
                .route("/v1/tasks/{task_id}/signals/{name}", web::post().to(signal))
                .route("/v1/tasks/{task_id}/resolution", web::post().to(resolve))
                .route("/v1/webhooks/{source}", web::post().to(webhook));
        }
    })
    .await?;
    let pool = app.base.database.pool.clone();

    app.consume("status", &[fenceline_events::topics::STATUS], tasks::StatusProjection)?;
    app.consume("cases", &[fenceline_events::topics::RECOVERY], tasks::CaseProjection)?;
    app.consume(
        "requests",
        &[fenceline_events::topics::INTAKE_REQUESTS],
        upstream::UpstreamRequests { kinds: upstream_kinds },
    )?;

    let retention = config.intake.idempotency_retention_hours;
    let shutdown = app.base.shutdown.child_token();
    app.base.spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(300));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => match tasks::purge_idempotency_keys(&pool, retention).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(purged = n, "expired idempotency keys purged"),
                    Err(e) => tracing::warn!(error = %e, "purging idempotency keys failed"),
                },
            }
        }
    });
    Ok(app)
}

async fn submit(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    body: web::Json<SubmitTask>,
) -> Result<HttpResponse, ApiError> {
    let key = req
        .headers()
        .get("Idempotency-Key")
        .ok_or(ApiError::IdempotencyKeyMissing)?
        .to_str()
        .map_err(|_| ApiError::IdempotencyKeyInvalid("Idempotency-Key must be visible ASCII".into()))?;
    let key = IdempotencyKey::parse(key)?;
    let task = body.into_inner().validate(&state.kinds)?;
    Ok(submission_answer(tasks::submit(&pool, &state.outbox, &caller.0, &key, task, "api").await?))
}

/// `202` with the task id, its status URL as `Location`, and
/// `Idempotent-Replayed: true` when the key had been used for this request before.
fn submission_answer(submitted: Submitted) -> HttpResponse {
    let (accepted, replayed) = match submitted {
        Submitted::Created(accepted) => (accepted, false),
        Submitted::Replayed(accepted) => (accepted, true),
    };
    let mut response = HttpResponse::Accepted();
    response.insert_header(("Location", accepted.status_url.clone()));
    if replayed {
        response.insert_header(("Idempotent-Replayed", "true"));
    }
    response.json(accepted)
}

/// A task id from the path; anything else names no task.
fn task_id(raw: &str) -> Result<TaskId, ApiError> {
    raw.parse().map_err(|_| ApiError::TaskNotFound(raw.to_owned()))
}

/// Who asked, for the audit trail: the tenant, never the token itself.
fn who(caller: &Caller) -> String {
    format!("tenant:{}", caller.0.as_str())
}

async fn list(
    caller: Caller,
    pool: web::Data<PgPool>,
    query: web::Query<tasks::ListQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::list(&pool, &caller.0, query.into_inner()).await?))
}

async fn read(caller: Caller, pool: web::Data<PgPool>, path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::read(&pool, &caller.0, task_id(&path)?).await?))
}

async fn cancel(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let accepted = actions::cancel(&pool, &state.outbox, &caller.0, task_id(&path)?, &who(&caller)).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

async fn signal(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<(String, String)>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let (raw_id, name) = path.into_inner();
    let name = actions::parse_signal_name(&name)?;
    let key = match req.headers().get("Idempotency-Key") {
        Some(value) => Some(IdempotencyKey::parse(value.to_str().unwrap_or_default())?),
        None => None,
    };
    // A signal may carry no body at all; a body that is there must be JSON.
    let payload = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("signal payload: {e}")))?
    };
    let key = key.as_ref().map(IdempotencyKey::as_str);
    let accepted = actions::signal(&pool, &state.outbox, &caller.0, task_id(&raw_id)?, name, key, &payload).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

async fn resolve(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<actions::Resolve>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let accepted = actions::resolve(&pool, &state.outbox, &caller.0, task_id(&path)?, &who(&caller), request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// A signed delivery from a configured source becomes a task, once per event id.
/// Every refusal (unknown source, missing or stale timestamp, bad signature)
/// answers 401 alike, so a prober learns nothing about which sources exist.
async fn webhook(
    req: HttpRequest,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let refused = |e: webhooks::SignatureError| ApiError::BadSignature(e.to_string());
    let source = webhooks::source(&pool, &path).await?.ok_or_else(|| refused(webhooks::SignatureError::NoMatch))?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    webhooks::verify(
        &source.secrets,
        header(webhooks::headers::TIMESTAMP),
        header(webhooks::headers::SIGNATURE),
        &body,
        now,
        state.webhook_tolerance_seconds,
    )
    .map_err(refused)?;
    let event_id = header(webhooks::headers::EVENT_ID)
        .ok_or_else(|| ApiError::InvalidRequest(format!("the {} header is missing", webhooks::headers::EVENT_ID)))?;
    let key = IdempotencyKey::parse(&format!("webhook:{}:{event_id}", path.as_str()))?;
    let input: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("body: {e}")))?;
    let task = SubmitTask {
        kind: source.kind.clone(),
        input,
        priority: None,
        deadline: None,
        not_before: None,
        labels: [("webhook_source".to_owned(), path.to_string())].into(),
    }
    .validate(&state.kinds)?;
    let source_label = format!("webhook:{}", path.as_str());
    Ok(submission_answer(tasks::submit(&pool, &state.outbox, &source.tenant, &key, task, &source_label).await?))
}
