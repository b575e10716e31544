//! Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides.

pub mod evidence;
pub mod watches;

use std::collections::HashMap;
use std::sync::Arc;

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
}

/// Builds the reconciler: connects and migrates its schema, starts its outbox
/// relay, its consumer of grants and attempts, and its evidence loop.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let catalog = Arc::new(config.catalog.load()?);
    let settings = Arc::new(config.reconciler);
    let providers: HashMap<String, HttpProvider> =
        catalog.providers.iter().map(|(name, spec)| (name.clone(), HttpProvider::new(name, spec))).collect();
    let mut app =
        ServiceApp::build(NAME, &config.service, &MIGRATOR, |_| |_: &mut actix_web::web::ServiceConfig| {}).await?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let watches = watches::Watches { catalog: catalog.clone(), settings: settings.clone(), wake: wake.clone() };
    app.consume("watches", &[topics::DISPATCH, topics::ATTEMPTS], watches)?;
    let reconciler = evidence::Reconciler {
        pool: app.base.database.pool.clone(),
        outbox: app.base.outbox.clone(),
        catalog,
        providers: Arc::new(providers),
        settings,
        wake,
    };
    let shutdown = app.base.shutdown.child_token();
    app.base.spawn(reconciler.run(shutdown));
    Ok(app)
}
