//! Executor: where money is spent. Leases with fencing tokens, recorded call phases, provider adapters and step checkpoints.

mod call;
mod claims;
mod clock;
pub mod from_scheduler;
pub mod grants;
mod lease;
mod output;
mod record;
pub mod retention;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod waiting;
pub mod worker;

use std::sync::Arc;

use fenceline_config::ServiceConfig;
use fenceline_config::catalog::CatalogConfig;
use fenceline_events::topics;
use fenceline_providers::HttpProvider;
use fenceline_runtime::{Error, ServiceApp};
use fenceline_telemetry::metrics::Group;

/// The service's name: its log field, its database schema, its outbox producer.
pub const NAME: &str = "executor";

/// The executor's tables, after the bus tables.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "fenceline-executor",
    about = "Executor: where money is spent. Leases with fencing tokens, recorded call phases, provider adapters and step checkpoints."
)]
pub struct Config {
    #[command(flatten)]
    pub service: ServiceConfig,
    #[command(flatten)]
    pub catalog: CatalogConfig,
    #[command(flatten)]
    pub executor: ExecutorSettings,
}

/// Workers, leases and polling.
#[derive(Debug, Clone, clap::Args)]
pub struct ExecutorSettings {
    /// Executions this process runs at once.
    #[arg(long = "workers", env = "FENCELINE_EXECUTOR_WORKERS", default_value_t = 8)]
    pub workers: usize,

    /// Lease length, in milliseconds; renewed every third of it, and right before
    /// each paid request. A worker that stops renewing is taken over this long
    /// after its last renewal (by the database's clock). Two thirds of it must
    /// cover every provider's send window plus 200 ms, or the service refuses to start.
    #[arg(long = "lease-ms", env = "FENCELINE_EXECUTOR_LEASE_MS", default_value_t = 15_000)]
    pub lease_ms: u64,

    /// How often one idle worker of this process looks for work another instance
    /// recorded or a lease that expired, in milliseconds; the other idle workers
    /// wait to be woken.
    #[arg(long = "idle-poll-ms", env = "FENCELINE_EXECUTOR_IDLE_POLL_MS", default_value_t = 250)]
    pub idle_poll_ms: u64,

    /// How often an accepted asynchronous operation is polled, in milliseconds.
    #[arg(long = "poll-ms", env = "FENCELINE_EXECUTOR_POLL_MS", default_value_t = 250)]
    pub poll_ms: u64,

    /// How long a task's executions, checkpoints and call sequences are kept after
    /// its status became final (succeeded, failed, cancelled), in days. A task whose
    /// status is not final keeps them however old (docs/decisions.md, entry 13), and
    /// none goes before every grant of the task was recorded longer ago than the
    /// consumers' dedupe window (`FENCELINE_CONSUMER_DEDUP_RETENTION_HOURS`; entry 46).
    #[arg(long = "task-retention-days", env = "FENCELINE_EXECUTOR_TASK_RETENTION_DAYS", default_value_t = 30,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub task_retention_days: u32,
}

impl ExecutorSettings {
    /// The lease's length in microseconds, as statements bind it.
    pub fn lease_us(&self) -> i64 {
        i64::try_from(self.lease_ms).unwrap_or(i64::MAX / 4) * 1_000
    }

    /// The retention of finished tasks' rows.
    pub fn task_retention(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(self.task_retention_days) * 86_400)
    }
}

/// Refuses a lease too short for a paid request to leave safely: just before a
/// renewal is due two thirds of it are left, and that must cover the request's
/// send window plus the lease margin at every provider, or a healthy worker would
/// refuse its own calls (docs/execution.md, "Executor").
fn check_lease(catalog: &fenceline_config::catalog::Catalog, lease_ms: u64) -> Result<(), String> {
    let lease = std::time::Duration::from_millis(lease_ms);
    for (name, spec) in &catalog.providers {
        let needed = call::send_window(spec.call_timeout()) + lease::LEASE_MARGIN;
        if lease * 2 / 3 < needed {
            return Err(format!(
                "a lease of {lease_ms} ms (FENCELINE_EXECUTOR_LEASE_MS) is too short for provider `{name}`: two thirds \
                 of it, what is left just before a renewal, must cover the {} ms its request may take to leave plus \
                 the {} ms margin; use at least {} ms",
                call::send_window(spec.call_timeout()).as_millis(),
                lease::LEASE_MARGIN.as_millis(),
                (needed * 3).as_millis().div_ceil(2),
            ));
        }
    }
    Ok(())
}

/// Builds the executor: connects and migrates its schema, starts its outbox relay,
/// its consumer of grants and final states, and its workers.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let catalog = Arc::new(config.catalog.load()?);
    let settings = Arc::new(config.executor);
    if settings.workers == 0 || settings.lease_ms < 300 {
        return Err(Error::Config(fenceline_config::Error("at least one worker and a lease of 300 ms or more".into())));
    }
    check_lease(&catalog, settings.lease_ms).map_err(|e| Error::Config(fenceline_config::Error(e)))?;
    let providers =
        HttpProvider::all_of(&catalog).map_err(|e| Error::Config(fenceline_config::Error(e.to_string())))?;
    let mut app = ServiceApp::build(NAME, &[Group::Executor, Group::ProviderCalls], &config.service, &MIGRATOR, |_| {
        |_: &mut actix_web::web::ServiceConfig| {}
    })
    .await?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let handed = Arc::new(grants::Handed::default());
    app.consume(
        "from_scheduler",
        &[topics::DISPATCH, topics::STATUS],
        from_scheduler::FromScheduler {
            grants: grants::GrantRecorder::new(wake.clone(), handed.clone(), settings.workers),
            finals: retention::StatusProjection::default(),
        },
    )?;
    let recorder = record::Recorder::new(app.base.database.pool.clone(), app.base.outbox.clone(), settings.clone());
    let calls = call::Calls {
        pool: app.base.database.pool.clone(),
        catalog: catalog.clone(),
        providers: Arc::new(providers),
        settings: settings.clone(),
        recorder,
    };
    let workers = worker::Workers {
        pool: app.base.database.pool.clone(),
        outbox: app.base.outbox.clone(),
        catalog,
        settings: settings.clone(),
        calls,
        wake,
        handed,
        idle_looker: Arc::new(tokio::sync::Mutex::new(())),
        name: format!("{}:{}", std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()), std::process::id()),
        claims: claims::ClaimWriter::start(
            app.base.database.pool.clone(),
            settings.lease_us(),
            record::writers_for(settings.workers),
        ),
    };
    for index in 0..settings.workers {
        // Stopping claims at shutdown; an execution in flight finishes within the
        // grace period, one not yet at its call intent is handed back.
        let shutdown = app.base.shutdown.child_token();
        app.base.spawn(workers.clone().run(index, shutdown));
    }
    let pool = app.base.database.pool.clone();
    let task_retention = settings.task_retention();
    let grants_remembered = config.service.consumer.dedup_window();
    app.base.spawn_every(std::time::Duration::from_secs(300), move || {
        let pool = pool.clone();
        async move {
            match retention::purge_finished_tasks(&pool, task_retention, grants_remembered, 500).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(purged = n, "finished tasks past their retention purged"),
                Err(e) => tracing::warn!(error = %e, "purging finished tasks failed"),
            }
        }
    });
    Ok(app)
}
