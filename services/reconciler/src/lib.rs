//! Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides.

use fenceline_config::ServiceConfig;
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
}

/// Builds the reconciler: connects and migrates its schema, starts its outbox relay and
/// binds its HTTP listener. Tests start exactly what the binary runs.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    ServiceApp::build(NAME, &config.service, &MIGRATOR, |_| |_: &mut actix_web::web::ServiceConfig| {}).await
}
