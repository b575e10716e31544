//! Intake: the front door. Idempotent submission over HTTP, signed webhooks and the
//! upstream intake topic; the `task_view` read model.

mod actions;
pub mod admission;
pub mod auth;
mod decisions;
mod kinds;
pub mod live;
mod openapi;
mod problem;
mod routes;
pub mod sealing;
mod spend;
pub mod tasks;
mod timeline;
mod ui;
pub mod upstream;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use actix_web::middleware::from_fn;
use actix_web::web;
use fenceline_config::ServiceConfig;
use fenceline_runtime::{Error, ServiceApp};
use sqlx::PgPool;

use crate::problem::ApiError;

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
        let tokens = web::Data::new(auth::Tokens::default());
        let openapi = Arc::new(openapi::document(&kinds).to_string());
        let state = web::Data::new(routes::State {
            outbox: base.outbox.clone(),
            submissions: tasks::SubmissionWriter::start(base.database.pool.clone(), base.outbox.clone()),
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
                    .wrap(from_fn(routes::header_limits))
                    .wrap(from_fn(admission::guard))
                    .app_data(admission.clone())
                    .app_data(tokens.clone())
                    .app_data(pool.clone())
                    .app_data(state.clone())
                    .app_data(web::JsonConfig::default().limit(body_limit).error_handler(problem::json_error))
                    .app_data(web::PayloadConfig::new(body_limit))
                    .app_data(
                        web::QueryConfig::default()
                            .error_handler(|e, _| ApiError::InvalidRequest(e.to_string()).into()),
                    )
                    .configure(routes::api),
            );
        }
    })
    .await?;
    seal_webhook_secrets(&app.base.database.pool, sealing.as_deref()).await?;
    let pool = app.base.database.pool.clone();
    let following = app.base.shutdown.child_token();
    app.base.spawn(live::follow(pool.clone(), changes, following));

    // One group, `intake.projections`, for the three topics (docs/decisions.md, entry 58).
    app.consume(
        "projections",
        &[fenceline_events::topics::STATUS, fenceline_events::topics::ATTEMPTS, fenceline_events::topics::RECOVERY],
        tasks::Projections::default(),
    )?;
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
