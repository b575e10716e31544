//! Intake: the front door. Idempotent submission over HTTP, signed webhooks and the
//! upstream intake topic; the `task_view` read model.

pub mod actions;
pub mod admission;
pub mod auth;
pub mod decisions;
pub mod kinds;
pub mod live;
pub mod openapi;
pub mod problem;
pub mod sealing;
mod spend;
pub mod tasks;
pub mod timeline;
pub mod ui;
pub mod upstream;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::{Next, from_fn};
use actix_web::{HttpRequest, HttpResponse, web};
use fenceline_bus::OutboxWriter;
use fenceline_config::ServiceConfig;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::ApprovalDecision;
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
    /// Task kinds clients may submit, comma separated; each should be one the
    /// catalogue declares.
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

    /// A task accepted this long ago whose status never arrived from the scheduler
    /// is reported (ERROR, and by `fenceline-intake unscheduled`), in minutes.
    #[arg(
        long = "unscheduled-after-minutes",
        env = "FENCELINE_INTAKE_UNSCHEDULED_AFTER_MINUTES",
        default_value_t = 10
    )]
    pub unscheduled_after_minutes: u64,

    /// Finished tasks (succeeded, failed, cancelled) are deleted with all their rows
    /// this long after their last status, in days.
    #[arg(long = "task-retention-days", env = "FENCELINE_INTAKE_TASK_RETENTION_DAYS", default_value_t = 30)]
    pub task_retention_days: u32,

    /// Largest request body, in bytes.
    #[arg(long = "body-limit-bytes", env = "FENCELINE_INTAKE_BODY_LIMIT_BYTES", default_value_t = 256 * 1024)]
    pub body_limit_bytes: usize,

    /// Keys that seal webhook signing secrets at rest: 64 hex digits each (32
    /// bytes, as `openssl rand -hex 32` prints), separated by commas or new lines.
    /// The first seals, every one opens, so keys rotate (docs/deploy.md, "Sealing
    /// webhook secrets"). Never printed. Unset: the secrets are stored in clear.
    #[arg(
        long = "webhook-sealing-keys",
        env = "FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS",
        hide_env_values = true,
        value_parser = fenceline_config::parse_secret,
        conflicts_with = "webhook_sealing_keys_file"
    )]
    pub webhook_sealing_keys: Option<fenceline_config::Secret>,

    /// A file holding the sealing keys, one a line or comma separated, as a mounted Secret.
    #[arg(
        long = "webhook-sealing-keys-file",
        env = "FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS_FILE",
        value_parser = fenceline_config::read_secret_file
    )]
    pub webhook_sealing_keys_file: Option<fenceline_config::Secret>,

    #[command(flatten)]
    pub admission: admission::AdmissionConfig,

    /// The catalogue the other services read (`FENCELINE_CATALOG`): the signals each
    /// kind's approval steps wait for. Without it every well-formed signal name is
    /// taken.
    #[command(flatten)]
    pub catalog: fenceline_config::catalog::OptionalCatalogConfig,
}

/// The longest value of one request header, in bytes.
pub const HEADER_VALUE_LIMIT: usize = 8 * 1024;
/// The most bytes all of a request's headers may take together.
pub const HEADERS_LIMIT: usize = 32 * 1024;

/// Shared state of the handlers.
#[derive(Debug, Clone)]
struct State {
    outbox: OutboxWriter,
    kinds: Arc<kinds::KindCatalog>,
    webhook_tolerance_seconds: i64,
    /// The keys that open sealed webhook secrets; `None`: secrets are in clear.
    sealing: Option<Arc<sealing::SealingKeys>>,
    /// The OpenAPI document, rendered once.
    openapi: Arc<String>,
    /// The changes this instance's follower reads, for the event streams.
    changes: live::Changes,
    /// Cancelled when the service begins to stop: the event streams end.
    stopping: tokio_util::sync::CancellationToken,
}

/// Builds intake: connects and migrates its schema, starts its outbox relay, its
/// status projection and the idempotency purge, and binds its HTTP listener.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let kinds = kinds::KindCatalog::load(&config.intake.kinds, config.intake.kind_schemas.as_deref())
        .map_err(|e| Error::Config(fenceline_config::Error(e.to_string())))?;
    let kinds = Arc::new(match config.intake.catalog.load()? {
        Some(catalog) => {
            let undeclared = kinds.undeclared_in(&catalog);
            if !undeclared.is_empty() {
                tracing::warn!(
                    kinds = %undeclared.join(","),
                    "FENCELINE_INTAKE_KINDS names kinds the catalogue does not declare: nothing runs their tasks"
                );
            }
            kinds.with_signals_from(&catalog)
        }
        None => {
            tracing::warn!(
                "no catalogue (FENCELINE_CATALOG): signals are taken without knowing which ones a task waits for"
            );
            kinds
        }
    });
    let upstream_kinds = kinds.clone();
    let body_limit = config.intake.body_limit_bytes;
    let admission = admission::Admission::new(&config.intake.admission, body_limit)
        .map_err(|e| Error::Config(fenceline_config::Error(e)))?;
    let idle_buckets = admission.clone();
    let webhook_tolerance_seconds = config.intake.webhook_tolerance_seconds;
    let sealing = config.intake.sealing_keys()?.map(Arc::new);
    let opening = sealing.clone();
    let changes = live::Changes::default();
    let streams = changes.clone();
    let mut app = ServiceApp::build(NAME, &[], &config.service, &MIGRATOR, |base| {
        let pool = web::Data::new(base.database.pool.clone());
        let admission = web::Data::new(admission);
        let openapi = Arc::new(openapi::document(&kinds).to_string());
        let state = web::Data::new(State {
            outbox: base.outbox.clone(),
            kinds,
            webhook_tolerance_seconds,
            sealing: opening,
            openapi,
            changes: streams,
            stopping: base.stopping.clone(),
        });
        move |cfg: &mut web::ServiceConfig| {
            cfg.configure(ui::routes);
            cfg.service(
                web::scope("/v1")
                    .wrap(from_fn(header_limits))
                    .wrap(from_fn(admission::guard))
                    .app_data(admission.clone())
                    .app_data(pool.clone())
                    .app_data(state.clone())
                    .app_data(web::JsonConfig::default().limit(body_limit).error_handler(problem::json_error))
                    .app_data(web::PayloadConfig::new(body_limit))
                    .app_data(
                        web::QueryConfig::default()
                            .error_handler(|e, _| ApiError::InvalidRequest(e.to_string()).into()),
                    )
                    .service(resource("/openapi.json", "GET").route(web::get().to(openapi_document)))
                    .service(resource("/tasks", "GET, POST").route(web::post().to(submit)).route(web::get().to(list)))
                    .service(resource("/tasks/{task_id}", "GET").route(web::get().to(read)))
                    .service(resource("/tasks/{task_id}/cancel", "POST").route(web::post().to(cancel)))
                    .service(resource("/tasks/{task_id}/signals/{name}", "POST").route(web::post().to(signal)))
                    .service(resource("/tasks/{task_id}/resolution", "POST").route(web::post().to(resolve)))
                    .service(resource("/tasks/{task_id}/approve", "POST").route(web::post().to(approve)))
                    .service(resource("/tasks/{task_id}/reject", "POST").route(web::post().to(reject)))
                    .service(resource("/summary", "GET").route(web::get().to(summary)))
                    .service(resource("/spend", "GET").route(web::get().to(spend)))
                    .service(resource("/events", "GET").route(web::get().to(events)))
                    .service(resource("/webhooks/{source}", "POST").route(web::post().to(webhook))),
            );
        }
    })
    .await?;
    seal_webhook_secrets(&app.base.database.pool, sealing.as_deref()).await?;
    let pool = app.base.database.pool.clone();
    let following = app.base.shutdown.child_token();
    app.base.spawn(live::follow(pool.clone(), changes, following));

    app.consume("status", &[fenceline_events::topics::STATUS], tasks::StatusProjection::default())?;
    app.consume("cases", &[fenceline_events::topics::RECOVERY], tasks::CaseProjection::default())?;
    app.consume("attempts", &[fenceline_events::topics::ATTEMPTS], tasks::AttemptProjection::default())?;
    app.consume(
        "requests",
        &[fenceline_events::topics::INTAKE_REQUESTS],
        upstream::UpstreamRequests { kinds: upstream_kinds },
    )?;

    let retention = config.intake.idempotency_retention_hours;
    let task_retention = Duration::from_secs(u64::from(config.intake.task_retention_days) * 86_400);
    app.base.spawn_every(Duration::from_secs(300), move || {
        let pool = pool.clone();
        async move {
            match tasks::purge_idempotency_keys(&pool, retention).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(purged = n, "expired idempotency keys purged"),
                Err(e) => tracing::warn!(error = %e, "purging idempotency keys failed"),
            }
            match tasks::purge_finished_tasks(&pool, task_retention, 500).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(purged = n, "finished tasks past their retention purged"),
                Err(e) => tracing::warn!(error = %e, "purging finished tasks failed"),
            }
        }
    });
    app.base.spawn_every(Duration::from_secs(60), move || {
        idle_buckets.forget_idle_tenants();
        async {}
    });
    let pool = app.base.database.pool.clone();
    let after = config.intake.unscheduled_after();
    app.base.spawn_every(Duration::from_secs(60), move || {
        let pool = pool.clone();
        async move { report_unscheduled(&pool, after).await }
    });
    Ok(app)
}

impl IntakeConfig {
    /// The webhook sealing keys, from the variable or the file; `None` when neither
    /// is set. A malformed key is refused without being repeated.
    pub fn sealing_keys(&self) -> Result<Option<sealing::SealingKeys>, fenceline_config::Error> {
        let Some(text) = self.webhook_sealing_keys.as_ref().or(self.webhook_sealing_keys_file.as_ref()) else {
            return Ok(None);
        };
        sealing::SealingKeys::parse(text)
            .map(Some)
            .map_err(|e| fenceline_config::Error(format!("FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS: {e}")))
    }

    /// How old an accepted task may be before it must have reached the scheduler.
    pub fn unscheduled_after(&self) -> Duration {
        Duration::from_secs(self.unscheduled_after_minutes.saturating_mul(60))
    }
}

/// At start: refuses sealed rows whose key is not configured; with keys, seals every
/// row still in clear or sealed with a key other than the first; without, warns once
/// that the secrets are stored in clear (docs/deploy.md, "Sealing webhook secrets").
async fn seal_webhook_secrets(pool: &PgPool, keys: Option<&sealing::SealingKeys>) -> Result<(), Error> {
    let failed = |e: webhooks::SealingError| Error::Config(fenceline_config::Error(e.to_string()));
    webhooks::check_keys(pool, keys).await.map_err(failed)?;
    let Some(keys) = keys else {
        tracing::warn!(
            "webhook signing secrets are stored in clear: set FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS to seal them"
        );
        return Ok(());
    };
    let done = webhooks::seal_stored(pool, keys).await.map_err(|e| failed(e.into()))?;
    tracing::info!(
        sealed = done.sealed,
        resealed = done.resealed,
        unopened = done.unopened,
        sealing_key_id = keys.sealing_id(),
        "webhook signing secrets sealed at rest"
    );
    Ok(())
}

/// Logs the tasks that never reached the scheduler: ERROR, because nothing runs
/// them and only a person can (see the outbox's and the dead-letter topic's alarms).
async fn report_unscheduled(pool: &PgPool, after: Duration) {
    match tasks::unscheduled(pool, after, 20).await {
        Ok((_, 0)) => {}
        Ok((found, count)) => {
            let ids: Vec<String> = found.iter().map(|t| t.task_id.to_string()).collect();
            tracing::error!(
                count,
                oldest = ?found.first().map(|t| t.accepted_at),
                task_ids = %ids.join(","),
                "tasks accepted more than {} minutes ago never reached the scheduler",
                after.as_secs() / 60
            );
        }
        Err(e) => tracing::warn!(error = %e, "looking for tasks that never reached the scheduler failed"),
    }
}

/// A resource that answers `405` with `Allow: allow` to any other method.
pub(crate) fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move || async move { problem::method_not_allowed(allow) }))
}

/// Answers `431` (a problem) for a header value over [`HEADER_VALUE_LIMIT`] or headers
/// over [`HEADERS_LIMIT`] in all, before any handler reads them.
async fn header_limits(
    request: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let mut total = 0;
    for (name, value) in request.headers() {
        let size = name.as_str().len() + value.len();
        total += size;
        let refused = if value.len() > HEADER_VALUE_LIMIT {
            Some(format!("header {name} is {} bytes; the limit is {HEADER_VALUE_LIMIT}", value.len()))
        } else if total > HEADERS_LIMIT {
            Some(format!("the headers are over {HEADERS_LIMIT} bytes in all"))
        } else {
            None
        };
        if let Some(detail) = refused {
            return Ok(request.into_response(problem::header_too_large(detail)).map_into_right_body());
        }
    }
    next.call(request).await.map(ServiceResponse::map_into_left_body)
}

/// The OpenAPI document of this API.
async fn openapi_document(state: web::Data<State>) -> HttpResponse {
    HttpResponse::Ok().content_type("application/json").body(state.openapi.as_str().to_owned())
}

/// Submits a task, once per `Idempotency-Key`.
///
/// Answers at once, without waiting for any other service. The same key with the
/// same request answers the first answer again (`Idempotent-Replayed: true`); with a
/// different request, `422 idempotency-key-reused`. A concurrent request with the
/// same key waits for the first to commit, then replays its answer (never `409`).
#[utoipa::path(
    post, path = "/v1/tasks", tag = "tasks",
    params(
        ("Idempotency-Key" = String, Header, description = "1 to 255 visible ASCII characters, scoped to the tenant",
         min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body(content = SubmitTask, content_type = "application/json"),
    responses(
        (status = 202, description = "Accepted (or replayed)", body = tasks::Accepted, headers(
            ("Location" = String, description = "The task's status URL"),
            ("Idempotent-Replayed" = String, description = "`true` when this answer repeats an earlier one"),
        )),
        (status = 400, description = "Malformed request or Idempotency-Key", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "Unknown kind, input failing its schema, or a key reused for another request", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
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
    // Do not change: `api` is the namespace of every stored API key.
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

/// Lists the caller's tasks, newest first, with filters and a stable cursor.
#[utoipa::path(
    get, path = "/v1/tasks", tag = "tasks",
    params(tasks::ListQuery),
    responses(
        (status = 200, description = "One page", body = tasks::Page),
        (status = 400, description = "A bad filter or cursor", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn list(
    caller: Caller,
    pool: web::Data<PgPool>,
    query: web::Query<tasks::ListQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::list(&pool, &caller.0, query.into_inner()).await?))
}

/// The caller's tenant and how many of its tasks are in each state, within the
/// listing's filters (but the state): the dashboard's overview.
#[utoipa::path(
    get, path = "/v1/summary", tag = "tasks",
    params(tasks::SummaryQuery),
    responses(
        (status = 200, description = "The counts", body = tasks::Summary),
        (status = 400, description = "A bad filter", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn summary(
    caller: Caller,
    pool: web::Data<PgPool>,
    query: web::Query<tasks::SummaryQuery>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::summarise(&pool, &caller.0, query.into_inner()).await?))
}

/// What the caller's tenant's paid calls cost, by UTC day and provider, and its
/// daily budget (docs/catalog.md, "Prices, spend and budgets").
#[utoipa::path(
    get, path = "/v1/spend", tag = "tasks",
    params(spend::SpendQuery),
    responses(
        (status = 200, description = "The spend in the window", body = spend::SpendReport),
        (status = 400, description = "A bad window", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn spend(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    query: web::Query<spend::SpendQuery>,
) -> Result<HttpResponse, ApiError> {
    let budget = state.kinds.budget_of(caller.0.as_str());
    Ok(HttpResponse::Ok().json(spend::report(&pool, &caller.0, query.into_inner(), budget).await?))
}

/// `GET /v1/events`: the caller's tenant's task changes as server-sent events
/// (docs/dashboard.md). Authenticated by the bearer token like every call (a page
/// reads it with `fetch()`), resumable with `Last-Event-ID`, a heartbeat comment
/// every 15 s. Not in the OpenAPI document: it is a stream, not a JSON answer.
async fn events(
    req: HttpRequest,
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
) -> Result<HttpResponse, ApiError> {
    let token = auth::bearer(&req).ok_or(ApiError::Unauthorized)?;
    let last_event_id = req
        .headers()
        .get("Last-Event-ID")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|id| *id > 0);
    let stream = live::Stream {
        pool: pool.get_ref().clone(),
        tenant: caller.0,
        token,
        last_event_id,
        changes: state.changes.subscribe(),
        stopping: state.stopping.clone(),
    };
    let (out, frames) = tokio::sync::mpsc::channel(64);
    actix_web::rt::spawn(live::run(stream, out));
    let body = futures_util::stream::unfold(frames, |mut frames| async move {
        frames.recv().await.map(|frame| (Ok::<_, std::convert::Infallible>(frame), frames))
    });
    let mut response =
        HttpResponse::Ok().content_type("text/event-stream").insert_header(("X-Accel-Buffering", "no")).streaming(body);
    ui::harden(&mut response);
    Ok(response)
}

/// Reads one task: its state and why, its attempts, its result, and for
/// `outcome_unknown` the evidence and what each resolution would do. A task accepted
/// but not yet scheduled reads as `queued`; another tenant's task is not found.
#[utoipa::path(
    get, path = "/v1/tasks/{task_id}", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    responses(
        (status = 200, description = "The task", body = tasks::TaskView),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn read(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(tasks::read(&pool, &state.kinds, &caller.0, task_id(&path)?).await?))
}

/// Asks for the task to be cancelled: at once if it waits, cooperatively if it runs.
/// A finished task is refused (`409`, naming its state) unless this repeats a cancel
/// asked before.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/cancel", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    responses(
        (status = 202, description = "Asked (`repeated` if asked before)", body = actions::ActionAccepted),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`, naming its state)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn cancel(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let accepted = actions::cancel(&pool, &state.outbox, &caller.0, task_id(&path)?, &who(&caller)).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Delivers a signal (such as an approval) to the task, once per `Idempotency-Key`
/// or, without one, per payload. A signal no step of the task's kind waits for is
/// refused (`422`, naming those it takes), as is a new signal to a finished task
/// (`409`).
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/signals/{name}", tag = "tasks",
    params(
        ("task_id" = String, Path, description = "The task's id"),
        ("name" = String, Path, description = "The signal, such as `approve`",
         pattern = "^[a-z0-9_.-]{1,64}$"),
        ("Idempotency-Key" = Option<String>, Header, description = "The signal's identity",
         min_length = 1, max_length = 255, pattern = "^[!-~]{1,255}$"),
    ),
    request_body(content = Option<Object>, content_type = "application/json", description = "An optional JSON payload"),
    responses(
        (status = 202, description = "Delivered (`repeated` if delivered before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad name, key or payload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`, naming its state)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No step of the task's kind waits for this signal (`unknown-signal`, naming those it takes)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
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
    // A signal may carry no body at all; a body that is there must be a JSON object.
    let payload = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("signal payload: {e}")))?
    };
    if !(payload.is_null() || payload.is_object()) {
        return Err(ApiError::InvalidRequest("signal payload: must be a JSON object".into()));
    }
    tasks::storable("signal payload", &payload)?;
    if let Some(refusal) = actions::refusal_in_payload(&payload) {
        return Err(ApiError::InvalidRequest(refusal));
    }
    let request = actions::SignalRequest { name, key: key.as_ref().map(IdempotencyKey::as_str), payload: &payload };
    let accepted = actions::signal(&pool, &state.outbox, &state.kinds, &caller.0, task_id(&raw_id)?, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Resolves the case of a task that waits for a person (`outcome_unknown` or
/// `needs_human`), naming the case read: `retry_as_new` (needs
/// `acknowledge_possible_charge: true`), `accept_failed` or `attach_result`.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/resolution", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = actions::Resolve, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad resolution", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), does not wait for a person, its case changed, or the case was already resolved otherwise", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn resolve(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<actions::Resolve>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let accepted = actions::resolve(&pool, &state.outbox, &caller.0, &caller.1, task_id(&path)?, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// Approves one wait of an approval step: the one the task waits at, or, given
/// early, the wait `step` names (kept for that wait only). Records who decided
/// (`decided_by`, beside the token's identity), the note, and the card it was made
/// on; a `digest` that no longer matches the card is refused, naming what changed.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/approve", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = decisions::Decide, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded and sent (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad decision", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), the card changed since it was read (`approval-changed`, naming what changed), or the wait was already decided otherwise (`already-decided`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No such approval step or signal for the task's kind (`unknown-signal`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn approve(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
) -> Result<HttpResponse, ApiError> {
    decide(caller, state, pool, path, body, ApprovalDecision::Approve).await
}

/// Rejects one wait of an approval step, as `approve` names it: the task ends
/// `failed`, its reason saying a person rejected it, and no step after the wait
/// runs.
#[utoipa::path(
    post, path = "/v1/tasks/{task_id}/reject", tag = "tasks",
    params(("task_id" = String, Path, description = "The task's id")),
    request_body(content = decisions::Decide, content_type = "application/json"),
    responses(
        (status = 202, description = "Recorded and sent (`repeated` if recorded before)", body = actions::ActionAccepted),
        (status = 400, description = "A bad decision", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task is already finished (`task-finished`), the card changed since it was read (`approval-changed`, naming what changed), or the wait was already decided otherwise (`already-decided`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not application/json", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "No such approval step or signal for the task's kind (`unknown-signal`)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn reject(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
) -> Result<HttpResponse, ApiError> {
    decide(caller, state, pool, path, body, ApprovalDecision::Reject).await
}

async fn decide(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    path: web::Path<String>,
    body: web::Json<decisions::Decide>,
    decision: ApprovalDecision,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let task = task_id(&path)?;
    let accepted =
        decisions::decide(&pool, &state.outbox, &state.kinds, &caller.0, &caller.1, task, decision, request).await?;
    Ok(HttpResponse::Accepted().json(accepted))
}

/// A signed delivery from a configured source becomes a task, once per event id.
/// The signature covers the timestamp, the event id and the body, so a captured
/// delivery re-sent under a new event id is refused. Every refusal (unknown
/// source, missing or stale timestamp, missing or bad event id, bad or old-style
/// signature) answers 401 alike, so a prober learns nothing about which sources exist.
#[utoipa::path(
    post, path = "/v1/webhooks/{source}", tag = "webhooks", security(()),
    params(
        ("source" = String, Path, description = "The configured sender"),
        ("Fenceline-Timestamp" = String, Header, description = "Unix seconds; within the tolerance of now"),
        ("Fenceline-Signature" = String, Header, description = "`v2=` and the hex HMAC-SHA256 of `timestamp.event_id.body`"),
        ("Fenceline-Event-Id" = String, Header, description = "The sender's event id, signed; a redelivery makes no second task",
         min_length = 1, max_length = 200, pattern = "^[!-\\-/-~]{1,200}$"),
    ),
    request_body(content = Object, content_type = "application/json", description = "The event: the task's input"),
    responses(
        (status = 202, description = "Accepted (or replayed)", body = tasks::Accepted, headers(
            ("Location" = String, description = "The task's status URL"),
            ("Idempotent-Replayed" = String, description = "`true` for a redelivery"),
        )),
        (status = 400, description = "A body that is not a JSON object", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Unknown source, or a missing, bad, old-style or stale signature or event id", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "The input fails the kind's schema", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
async fn webhook(
    req: HttpRequest,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    admission: web::Data<admission::Admission>,
    path: web::Path<String>,
    body: Result<web::Bytes, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let body = body.map_err(|e| match e.as_response_error().status_code() {
        actix_web::http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(e.to_string()),
        _ => ApiError::InvalidRequest(format!("body: {e}")),
    })?;
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let refused = |e: webhooks::SignatureError| ApiError::BadSignature(e.to_string());
    let source = webhooks::source(&pool, &path, state.sealing.as_deref())
        .await?
        .ok_or_else(|| refused(webhooks::SignatureError::NoMatch))?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let event_id = webhooks::verify(
        &source.secrets,
        header(webhooks::headers::TIMESTAMP),
        header(webhooks::headers::EVENT_ID),
        header(webhooks::headers::SIGNATURE),
        &body,
        now,
        state.webhook_tolerance_seconds,
    )
    .map_err(refused)?;
    admission.admit(&source.tenant)?;
    let input: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::InvalidRequest(format!("body: {e}")))?;
    let key =
        IdempotencyKey::parse(&source.dedupe_key(path.as_str(), &event_id, &input).map_err(ApiError::InvalidRequest)?)?;
    let task = SubmitTask {
        kind: source.kind.clone(),
        input,
        priority: None,
        deadline: None,
        not_before: None,
        labels: [("webhook_source".to_owned(), path.to_string())].into(),
    }
    .validate(&state.kinds)?;
    // Do not change: the source is the namespace of its stored idempotency keys.
    let source_label = format!("webhook:{}", path.as_str());
    Ok(submission_answer(tasks::submit(&pool, &state.outbox, &source.tenant, &key, task, &source_label).await?))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    const KEY: &str = "3c9a0e7d51b2f4a6c8e0d2b4f6a8c0e2d4b6f8a0c2e4d6b8f0a2c4e6d8b0f2a4";

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from([&["fenceline-intake", "--database-url", "postgres://x/y"], args].concat())
    }

    #[test]
    fn sealing_keys_come_from_the_flag_or_a_file_and_never_print() {
        let config = parse(&["--webhook-sealing-keys", KEY]).expect("parses");
        let keys = config.intake.sealing_keys().expect("valid").expect("set");
        assert!(!format!("{config:?}").contains(&KEY[..16]) && !format!("{keys:?}").contains(&KEY[..16]));

        let file = std::env::temp_dir().join(format!("fenceline-sealing-keys-{}", std::process::id()));
        std::fs::write(&file, format!("{KEY}\n")).expect("write");
        let from_file = parse(&["--webhook-sealing-keys-file", &file.display().to_string()]).expect("parses");
        let _ = std::fs::remove_file(&file);
        assert_eq!(from_file.intake.sealing_keys().expect("valid").expect("set").ids(), keys.ids());

        assert!(parse(&[]).expect("parses").intake.sealing_keys().expect("unset").is_none());
        let both = ["--webhook-sealing-keys", KEY, "--webhook-sealing-keys-file", "/k"];
        assert!(parse(&both).is_err(), "one or the other");
        let short = parse(&["--webhook-sealing-keys", &KEY[..60]]).expect("parses");
        let refused = short.intake.sealing_keys().expect_err("too short").to_string();
        assert!(refused.contains("60 characters") && !refused.contains(&KEY[..16]), "{refused}");
    }
}
