//! Scheduler: the authority on task state. Lifecycle, durable timers, concurrency slots, rate limits, backoff and fairness.

mod clock;
pub mod dispatch;
pub mod events;
pub mod health;
pub mod retention;
pub mod spend;
pub mod tasks;
#[cfg(test)]
mod test_catalog;
#[cfg(test)]
mod test_schema;

use std::sync::Arc;
use std::time::Duration;

use fenceline_config::ServiceConfig;
use fenceline_config::catalog::CatalogConfig;
use fenceline_events::topics;
use fenceline_runtime::{Error, ServiceApp};
use fenceline_telemetry::metrics::{Group, StateLabels};

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
    #[command(flatten)]
    pub catalog: CatalogConfig,
    #[command(flatten)]
    pub scheduler: SchedulerSettings,
}

/// The retry policy and the dispatcher's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedulerSettings {
    /// First retry's backoff ceiling, in milliseconds (full jitter below it).
    #[arg(long = "backoff-base-ms", env = "FENCELINE_SCHEDULER_BACKOFF_BASE_MS", default_value_t = 1_000)]
    pub backoff_base_ms: u64,

    /// Largest backoff, in milliseconds.
    #[arg(long = "backoff-cap-ms", env = "FENCELINE_SCHEDULER_BACKOFF_CAP_MS", default_value_t = 60_000)]
    pub backoff_cap_ms: u64,

    /// How long a task released as busy waits before it is granted again, in milliseconds.
    #[arg(long = "busy-wait-ms", env = "FENCELINE_SCHEDULER_BUSY_WAIT_MS", default_value_t = 2_000)]
    pub busy_wait_ms: u64,

    /// Most grants decided in one dispatch round and committed together. Every
    /// tenant's next due task comes before any tenant's second, so a tenant that
    /// arrives waits at most one round behind another's backlog.
    #[arg(long = "grants-per-round", env = "FENCELINE_SCHEDULER_GRANTS_PER_ROUND", default_value_t = 32,
          value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub grants_per_round: i64,

    /// How long a finished task (succeeded, failed, cancelled) is kept after its
    /// last change, in days, before its rows are purged. Never shorter than
    /// intake's `FENCELINE_INTAKE_TASK_RETENTION_DAYS` (docs/decisions.md, entry 13).
    #[arg(long = "task-retention-days", env = "FENCELINE_SCHEDULER_TASK_RETENTION_DAYS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub task_retention_days: u32,
}

impl SchedulerSettings {
    /// The retention of finished tasks.
    pub fn task_retention(&self) -> Duration {
        Duration::from_secs(u64::from(self.task_retention_days) * 86_400)
    }
}

/// Builds the scheduler: connects and migrates its schema, starts its outbox relay,
/// its consumer of tasks, attempts and recovery decisions, and its dispatcher.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let catalog = Arc::new(config.catalog.load()?);
    if config.scheduler.backoff_base_ms == 0 || config.scheduler.backoff_cap_ms < config.scheduler.backoff_base_ms {
        return Err(Error::Config(fenceline_config::Error(
            "backoff base must be positive and not above the cap".into(),
        )));
    }
    let task_retention = config.scheduler.task_retention();
    let accepted_remembered = config.service.consumer.dedup_window();
    let settings = Arc::new(config.scheduler);
    let mut app = ServiceApp::build(NAME, &[Group::Scheduler], &config.service, &MIGRATOR, |_| {
        |_: &mut actix_web::web::ServiceConfig| {}
    })
    .await?;
    // Commits that set a timer or free a slot notify this channel (one per schema).
    let channel: Arc<str> =
        format!("fenceline_{}_due", config.service.postgres.schema.as_deref().unwrap_or(NAME)).into();
    // Every instant the scheduler judges is the database's: anchored before the
    // first event is applied, and kept anchored while it runs.
    clock::anchor(&app.base.database.pool).await.map_err(|e| Error::Bus(e.into()))?;
    let pool = app.base.database.pool.clone();
    app.base.spawn_every(Duration::from_secs(1), move || {
        let pool = pool.clone();
        async move {
            if let Err(e) = clock::anchor(&pool).await {
                tracing::warn!(error = %e, "reading the database's clock failed; keeping the last offset");
            }
        }
    });
    let handler = events::LifecycleEvents {
        catalog: catalog.clone(),
        settings: settings.clone(),
        channel: channel.clone(),
        statuses: Default::default(),
        slots: Default::default(),
        held: Default::default(),
        ends: Default::default(),
        outcomes: Default::default(),
    };
    let pool = app.base.database.pool.clone();
    app.base.scrape.probe(move || {
        let pool = pool.clone();
        async move {
            match tasks::unfinished_by_state(&pool).await {
                Ok(counts) => {
                    let gauge = &fenceline_telemetry::metrics::global().scheduler.tasks;
                    for (state, n) in counts {
                        gauge.get_or_create(&StateLabels { state: state.as_str().into() }).set(n);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reading the tasks by state for /metrics failed"),
            }
        }
    });
    app.consume("lifecycle", &[topics::TASKS, topics::ATTEMPTS, topics::RECOVERY], handler)?;
    let dispatcher = dispatch::Dispatcher {
        pool: app.base.database.pool.clone(),
        outbox: app.base.outbox.clone(),
        catalog,
        settings,
        channel,
    };
    let shutdown = app.base.shutdown.child_token();
    app.base.spawn(dispatcher.run(shutdown));
    let pool = app.base.database.pool.clone();
    app.base.spawn_every(Duration::from_secs(60), move || {
        let pool = pool.clone();
        async move {
            // Expired by the database's clock, which wrote the expiry (docs/execution.md, "Slots").
            match sqlx::query("DELETE FROM slots WHERE expires_at_us < now_us()").execute(&pool).await {
                Ok(r) if r.rows_affected() > 0 => {
                    tracing::warn!(expired = r.rows_affected(), "slots expired without their attempt's end");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "expiring slots failed"),
            }
            // A grant's slots at its other providers go with its own slot: expired, or
            // released by a scheduler that knows only `slots` (docs/deploy.md).
            let orphans = "DELETE FROM other_provider_slots o WHERE o.expires_at_us < now_us() \
                 OR NOT EXISTS (SELECT 1 FROM slots s WHERE s.grant_id = o.grant_id)";
            if let Err(e) = sqlx::query(orphans).execute(&pool).await {
                tracing::warn!(error = %e, "expiring slots at other providers failed");
            }
            // A request kept for a task that never arrived outlives the consumer's dedup window no longer.
            let purge = "DELETE FROM early_requests WHERE received_at < now() - interval '7 days'";
            match sqlx::query(purge).execute(&pool).await {
                Ok(r) if r.rows_affected() > 0 => {
                    tracing::warn!(purged = r.rows_affected(), "requests for tasks that never arrived purged");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "purging early requests failed"),
            }
        }
    });
    let pool = app.base.database.pool.clone();
    let outbox = app.base.outbox.clone();
    app.base.spawn_every(Duration::from_secs(300), move || {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        async move {
            match retention::purge_finished_tasks(&pool, &outbox, task_retention, accepted_remembered, 500).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(purged = n, "finished tasks past their retention purged"),
                Err(e) => tracing::warn!(error = %e, "purging finished tasks failed"),
            }
        }
    });
    Ok(app)
}
