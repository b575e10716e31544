//! Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides.

pub mod audit;
pub mod evidence;
pub mod watches;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_config::ServiceConfig;
use fenceline_config::catalog::CatalogConfig;
use fenceline_events::topics;
use fenceline_providers::HttpProvider;
use fenceline_runtime::{Error, ServiceApp};

/// The service's name: its log field, its database schema, its outbox producer.
pub const NAME: &str = "reconciler";

/// The reconciler's tables, after the bus tables.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "fenceline-reconciler",
    about = "Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides."
)]
pub struct Config {
    #[command(flatten)]
    pub service: ServiceConfig,
    #[command(flatten)]
    pub catalog: CatalogConfig,
    #[command(flatten)]
    pub reconciler: ReconcilerSettings,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What the binary does besides serving.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Runs one audit now and lists every finding (exit status 1 if there are any).
    Audit,
}

/// Watches and look-ups.
#[derive(Debug, Clone, clap::Args)]
pub struct ReconcilerSettings {
    /// A grant not claimed within this long is re-issued (same grant id), in milliseconds.
    #[arg(long = "claim-timeout-ms", env = "FENCELINE_RECONCILER_CLAIM_TIMEOUT_MS", default_value_t = 30_000)]
    pub claim_timeout_ms: u64,

    /// How long to keep asking a provider when the task has no deadline, in milliseconds.
    #[arg(long = "ask-for-ms", env = "FENCELINE_RECONCILER_ASK_FOR_MS", default_value_t = 600_000)]
    pub ask_for_ms: u64,

    /// First wait between two look-ups, in milliseconds (doubling, full jitter).
    #[arg(long = "ask-base-ms", env = "FENCELINE_RECONCILER_ASK_BASE_MS", default_value_t = 1_000)]
    pub ask_base_ms: u64,

    /// Longest wait between two look-ups, in milliseconds.
    #[arg(long = "ask-cap-ms", env = "FENCELINE_RECONCILER_ASK_CAP_MS", default_value_t = 60_000)]
    pub ask_cap_ms: u64,

    /// A queued or waiting task whose status has not changed for this long is
    /// reported by the audit, in milliseconds.
    #[arg(long = "no-progress-ms", env = "FENCELINE_RECONCILER_NO_PROGRESS_MS", default_value_t = 900_000)]
    pub no_progress_ms: u64,

    /// How often the audit runs, in milliseconds.
    #[arg(long = "audit-every-ms", env = "FENCELINE_RECONCILER_AUDIT_EVERY_MS", default_value_t = 60_000)]
    pub audit_every_ms: u64,
}

impl ReconcilerSettings {
    /// How long a running task may show no live expectation before it is reported:
    /// long enough for the events that end one attempt and start the next.
    pub fn audit_grace(&self) -> Duration {
        Duration::from_millis(self.claim_timeout_ms.max(5_000))
    }
}

/// Builds the reconciler: connects and migrates its schema, starts its outbox
/// relay, its consumer of grants and attempts, and its evidence loop.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let catalog = Arc::new(config.catalog.load()?);
    let settings = Arc::new(config.reconciler);
    let providers: HashMap<String, HttpProvider> =
        catalog.providers.iter().map(|(name, spec)| (name.clone(), HttpProvider::new(name, spec))).collect();
    let mut app = ServiceApp::build(NAME, &config.service, &MIGRATOR, |base| {
        let pool = actix_web::web::Data::new(base.database.pool.clone());
        move |cfg: &mut actix_web::web::ServiceConfig| {
            cfg.app_data(pool.clone())
                .route("/v1/audit", actix_web::web::get().to(audit_findings))
                .route("/metrics", actix_web::web::get().to(metrics));
        }
    })
    .await?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let watches = watches::Watches { catalog: catalog.clone(), settings: settings.clone(), wake: wake.clone() };
    app.consume("watches", &[topics::DISPATCH, topics::ATTEMPTS, topics::STATUS], watches)?;
    let reconciler = evidence::Reconciler {
        pool: app.base.database.pool.clone(),
        outbox: app.base.outbox.clone(),
        catalog,
        providers: Arc::new(providers),
        settings,
        wake,
    };
    let shutdown = app.base.shutdown.child_token();
    let pool = app.base.database.pool.clone();
    let audit_settings = reconciler.settings.clone();
    app.base.spawn(reconciler.run(shutdown));
    let shutdown = app.base.shutdown.child_token();
    app.base.spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(audit_settings.audit_every_ms.max(100)));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => {
                    let no_progress = Duration::from_millis(audit_settings.no_progress_ms);
                    if let Err(e) = audit::run(&pool, no_progress, audit_settings.audit_grace()).await {
                        tracing::warn!(error = %e, "the audit failed; trying again at the next round");
                    }
                }
            }
        }
    });
    Ok(app)
}

/// Runs one audit against the reconciler's schema and returns its findings.
pub async fn audit_now(config: &Config) -> anyhow::Result<Vec<audit::Finding>> {
    let database =
        fenceline_store::connect(&config.service.postgres, NAME, &[&fenceline_bus::MIGRATOR, &MIGRATOR]).await?;
    let no_progress = Duration::from_millis(config.reconciler.no_progress_ms);
    let (found, _) = audit::run(&database.pool, no_progress, config.reconciler.audit_grace()).await?;
    Ok(found)
}

async fn audit_findings(pool: actix_web::web::Data<sqlx::PgPool>) -> actix_web::HttpResponse {
    match audit::findings(&pool).await {
        Ok(found) => actix_web::HttpResponse::Ok().json(serde_json::json!({ "findings": found })),
        Err(e) => actix_web::HttpResponse::ServiceUnavailable().body(e.to_string()),
    }
}

async fn metrics(pool: actix_web::web::Data<sqlx::PgPool>) -> actix_web::HttpResponse {
    match audit::findings(&pool).await {
        Ok(found) => {
            actix_web::HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(audit::metrics(&found))
        }
        Err(e) => actix_web::HttpResponse::ServiceUnavailable().body(e.to_string()),
    }
}
