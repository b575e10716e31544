//! Scheduler: the authority on task state. Lifecycle, durable timers, concurrency slots, rate limits, backoff and fairness.

use fenceline_config::ServiceConfig;
use fenceline_runtime::{Error, ServiceApp};

/// The service's name: its log field, its database schema, its outbox producer.
pub const NAME: &str = "scheduler";

/// The scheduler's tables, after the bus tables.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "fenceline-scheduler",
    about = "Scheduler: the authority on task state. Lifecycle, durable timers, concurrency slots, rate limits, backoff and fairness."
)]
pub struct Config {
    #[command(flatten)]
    pub service: ServiceConfig,
}

/// Builds the scheduler: connects and migrates its schema, starts its outbox relay and
/// binds its HTTP listener. Tests start exactly what the binary runs.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    ServiceApp::build(NAME, &config.service, &MIGRATOR, |_| |_: &mut actix_web::web::ServiceConfig| {}).await
}
