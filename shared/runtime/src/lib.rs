//! What every service does the same way: connect to its schema and migrate it,
//! run the outbox relay, answer `/healthz`, `/readyz` and `/metrics`, trace and
//! time every HTTP request, and shut down in order (stop accepting, drain within
//! the grace period, close the pool).

mod http;
pub mod scrape;

pub use scrape::Probe;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use actix_web::dev::{Server, ServerHandle};
use actix_web::{App as ActixApp, HttpResponse, HttpServer, web};
use fenceline_bus::{ConsumerStats, OutboxWriter, Relay, RelayStats};
use fenceline_config::{HttpConfig, KafkaConfig, OutboxConfig, PostgresConfig};
use fenceline_store::Database;
use sqlx::migrate::Migrator;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] fenceline_store::Error),
    #[error(transparent)]
    Bus(#[from] fenceline_bus::Error),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] fenceline_config::Error),
    #[error(transparent)]
    Kafka(#[from] fenceline_bus::kafka::ConnectError),
}

/// Whether the service may be sent traffic: it started (its migrations ran) and is
/// not shutting down, and each of its consumers holds its assignment. `/readyz`
/// also checks the database.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    started: Arc<AtomicBool>,
    consumers: Arc<std::sync::Mutex<Vec<Arc<ConsumerStats>>>>,
}

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.started.store(ready, Ordering::Release);
    }

    /// Started, not stopping, and every consumer has been given its assignment by
    /// the group: possibly no partition at all, when other instances hold them all
    /// (that instance is a ready standby, docs/operations.md).
    pub fn get(&self) -> bool {
        self.started.load(Ordering::Acquire) && self.consumers().iter().all(|c| c.joined.load(Ordering::Acquire))
    }

    fn watch(&self, consumer: Arc<ConsumerStats>) {
        self.consumers.lock().unwrap_or_else(|p| p.into_inner()).push(consumer);
    }

    fn consumers(&self) -> Vec<Arc<ConsumerStats>> {
        self.consumers.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[derive(serde::Serialize)]
struct Health<'a> {
    service: &'a str,
    status: &'a str,
}

/// The routes every service answers: `/healthz` (the process is alive) and
/// `/readyz` (started, not shutting down, and its database answers).
pub fn health_routes(
    service: &'static str,
    readiness: Readiness,
    pool: Option<sqlx::PgPool>,
) -> impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static {
    move |cfg: &mut web::ServiceConfig| {
        cfg.app_data(web::Data::new((service, readiness.clone(), pool.clone())))
            .route("/healthz", web::get().to(healthz))
            .route("/readyz", web::get().to(readyz));
    }
}

type HealthState = web::Data<(&'static str, Readiness, Option<sqlx::PgPool>)>;

async fn healthz(state: HealthState) -> HttpResponse {
    HttpResponse::Ok().json(Health { service: state.0, status: "alive" })
}

async fn readyz(state: HealthState) -> HttpResponse {
    let database = match &state.2 {
        Some(pool) => sqlx::query("SELECT 1").execute(pool).await.is_ok(),
        None => true,
    };
    if state.1.get() && database {
        HttpResponse::Ok().json(Health { service: state.0, status: "ready" })
    } else {
        HttpResponse::ServiceUnavailable().json(Health { service: state.0, status: "not ready" })
    }
}

/// Everything a service shares with the others, running.
#[derive(Debug)]
pub struct Base {
    pub name: &'static str,
    pub database: Database,
    pub outbox: OutboxWriter,
    pub relay_stats: Arc<RelayStats>,
    pub readiness: Readiness,
    /// What `/metrics` reads from this service at each scrape.
    pub scrape: scrape::Scrape,
    pub shutdown: CancellationToken,
    /// Cancelled first when the service stops, before the HTTP server drains: a
    /// response that would otherwise never end (an event stream) ends with it.
    pub stopping: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    /// The relay stops last, so events written by work that drains at shutdown
    /// are still published.
    relay: (CancellationToken, JoinHandle<()>),
}

/// The shared settings of a service.
#[derive(Debug, Clone)]
pub struct BaseConfig<'a> {
    pub postgres: &'a PostgresConfig,
    pub kafka: &'a KafkaConfig,
    pub outbox: &'a OutboxConfig,
}

impl Base {
    /// Makes sure the brokers answer (refused credentials stop the service here,
    /// with one message), connects and migrates the service's schema (bus tables,
    /// then `migrator`) and starts the outbox relay.
    pub async fn start(name: &'static str, config: BaseConfig<'_>, migrator: &Migrator) -> Result<Self, Error> {
        fenceline_bus::kafka::check_connection(config.kafka, config.kafka.connect_timeout()).await?;
        let database = fenceline_store::connect(config.postgres, name, &[&fenceline_bus::MIGRATOR, migrator]).await?;
        let outbox = OutboxWriter::new(name, config.kafka.topic_prefix.clone(), config.outbox.shards);
        let shutdown = CancellationToken::new();
        let relay = Relay::new(
            format!("{name}-relay"),
            database.pool.clone(),
            database.options.clone(),
            config.kafka,
            config.outbox.clone(),
            &outbox,
        )?;
        let relay_stats = relay.stats();
        let scrape = scrape::Scrape::new(database.pool.clone(), relay_stats.clone());
        let relay_shutdown = CancellationToken::new();
        let relay = (relay_shutdown.clone(), tokio::spawn(relay.run(relay_shutdown)));
        Ok(Self {
            name,
            database,
            outbox,
            relay_stats,
            readiness: Readiness::default(),
            scrape,
            shutdown,
            stopping: CancellationToken::new(),
            tasks: Vec::new(),
            relay,
        })
    }

    /// Adds a task that ends when the shutdown token is cancelled.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.push(tokio::spawn(task));
    }

    /// Runs `work` every `period` (the first time at once) until the service stops:
    /// purges, expiries, reports.
    pub fn spawn_every<F, Fut>(&mut self, period: std::time::Duration, mut work: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let shutdown = self.shutdown.child_token();
        self.spawn(async move {
            let mut every = tokio::time::interval(period);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = every.tick() => work().await,
                }
            }
        });
    }

    /// Stops in order: not ready, end the long-lived responses, stop the HTTP server, cancel the background work
    /// and wait for it within `grace`, then stop the relay after a last round (what
    /// the draining work wrote is published), close the pool.
    ///
    /// Bounded whatever is stuck (a broker and a database both gone): work that
    /// overruns its share of the grace is aborted and the pool's close waits
    /// [`CLOSE_WAIT`] at most. Nothing is lost by that: what was not published
    /// stays in the outbox, and what was not committed is redelivered. A process
    /// stopped by a signal also has a deadline ([`App::run_until_signalled`]).
    pub async fn stop(self, http: ServerHandle, grace: std::time::Duration) {
        info!(service = self.name, "shutting down");
        self.readiness.set(false);
        self.stopping.cancel();
        let started = tokio::time::Instant::now();
        if tokio::time::timeout(grace, http.stop(true)).await.is_err() {
            warn!(service = self.name, "the HTTP server did not drain within the grace period");
        }
        self.shutdown.cancel();
        let left = |at_least| grace.saturating_sub(started.elapsed()).max(at_least);
        if !join_or_abort(self.tasks, left(CLOSE_WAIT)).await {
            warn!(service = self.name, "background work did not stop within the grace period; aborted");
        }
        let (relay_shutdown, relay) = self.relay;
        relay_shutdown.cancel();
        if !join_or_abort(vec![relay], left(std::time::Duration::from_secs(1))).await {
            warn!(
                service = self.name,
                "the outbox relay did not finish its last round; unconfirmed rows are sent on restart"
            );
        }
        if tokio::time::timeout(CLOSE_WAIT, self.database.pool.close()).await.is_err() {
            warn!(service = self.name, "the database pool did not close in time");
        }
        info!(service = self.name, "stopped");
    }
}

/// How long a stop waits for the database pool to close (its connections to be
/// handed back and closed).
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long after its grace period a stopping service exits, whatever is left.
pub const STOP_DEADLINE_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Exits the process `after` from now unless it has exited by then: the last
/// resort of a stop, on a thread of its own so that a blocked runtime (a client
/// library's thread that does not return, such as a consumer leaving a group whose
/// broker is gone) cannot hold it back.
fn stop_deadline(service: &'static str, after: std::time::Duration) {
    let spawned = std::thread::Builder::new().name("stop-deadline".into()).spawn(move || {
        std::thread::sleep(after);
        tracing::error!(service, after_s = after.as_secs(), "the stop did not finish in time; exiting now");
        std::process::exit(1);
    });
    if let Err(e) = spawned {
        warn!(service, error = %e, "could not start the stop's deadline");
    }
}

/// Waits for `tasks` to end within `within`; aborts those still running then and
/// returns false.
async fn join_or_abort(tasks: Vec<JoinHandle<()>>, within: std::time::Duration) -> bool {
    let aborts: Vec<_> = tasks.iter().map(JoinHandle::abort_handle).collect();
    let all = async {
        for task in tasks {
            let _ = task.await;
        }
    };
    if tokio::time::timeout(within, all).await.is_ok() {
        return true;
    }
    aborts.iter().for_each(tokio::task::AbortHandle::abort);
    false
}

/// Binds the HTTP listener (port 0 picks one) with the service's `routes`; every
/// request gets a span (a child of its `traceparent`) and is timed.
pub fn serve<F>(http: &HttpConfig, routes: F) -> Result<(Server, u16), Error>
where
    F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
{
    let server = HttpServer::new(move || {
        ActixApp::new().wrap(actix_web::middleware::from_fn(http::observe)).configure(routes.clone())
    })
    .workers(2)
    .disable_signals()
    .shutdown_timeout(http.shutdown_grace_ms.div_ceil(1000))
    .bind(http.addr)
    .map_err(|source| Error::Bind { addr: http.addr, source })?;
    let port = server.addrs().first().map(|a| a.port()).unwrap_or_default();
    Ok((server.run(), port))
}

/// Resolves on the first SIGINT or SIGTERM. A second one exits the process at once.
pub async fn shutdown_signal() {
    wait_for_signal().await;
    info!("shutdown requested; a second signal exits at once");
    tokio::spawn(async {
        wait_for_signal().await;
        warn!("second signal: exiting now");
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        _ => {
            // Without signal handlers the process can only be killed; never resolve.
            std::future::pending::<()>().await;
        }
    }
}

/// A running service: its shared base, its HTTP server and the port it listens on.
pub struct ServiceApp {
    pub base: Base,
    server: Server,
    port: u16,
    grace: std::time::Duration,
    kafka: KafkaConfig,
    consumer: fenceline_config::ConsumerConfig,
}

impl std::fmt::Debug for ServiceApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceApp").field("base", &self.base).field("port", &self.port).finish_non_exhaustive()
    }
}

impl ServiceApp {
    /// Starts the shared base and binds the HTTP listener with the health routes
    /// and the service's own, which `routes` makes from the running base (its pool,
    /// its outbox). `/metrics` shows the families every service has and those of
    /// `metrics` (the service's own). Background work is added with
    /// `app.base.spawn` before `run`.
    pub async fn build<R, F>(
        name: &'static str,
        metrics: &[fenceline_telemetry::metrics::Group],
        config: &fenceline_config::ServiceConfig,
        migrator: &Migrator,
        routes: R,
    ) -> Result<Self, Error>
    where
        R: FnOnce(&Base) -> F,
        F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
    {
        config.validate()?;
        fenceline_telemetry::metrics::install(name, metrics);
        let base = Base::start(
            name,
            BaseConfig { postgres: &config.postgres, kafka: &config.kafka, outbox: &config.outbox },
            migrator,
        )
        .await?;
        let routes = routes(&base);
        let health = health_routes(name, base.readiness.clone(), Some(base.database.pool.clone()));
        let metrics = scrape::metrics_route(base.scrape.clone());
        let (server, port) = serve(&config.http, move |cfg: &mut web::ServiceConfig| {
            health(cfg);
            metrics(cfg);
            routes(cfg);
        })?;
        info!(service = name, port, "listening");
        Ok(Self {
            base,
            server,
            port,
            grace: config.http.shutdown_grace(),
            kafka: config.kafka.clone(),
            consumer: config.consumer.clone(),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs `handler` over `topics` (contract names) in the fenced consumer, in the
    /// group `<prefix><service>.<purpose>`, stopped and drained with the service.
    pub fn consume<H: fenceline_bus::Handler>(
        &mut self,
        purpose: &str,
        topics: &[&str],
        handler: H,
    ) -> Result<(), Error> {
        let prefix = &self.kafka.topic_prefix;
        let group = format!("{prefix}{}.{purpose}", self.base.name);
        let consumer = fenceline_bus::FencedConsumer::spawn(
            fenceline_bus::ConsumerSpec {
                group: group.clone(),
                topics: topics.iter().map(|topic| fenceline_bus::topic_name(prefix, topic)).collect(),
                // For operators only (fencing is by epoch): which host and process.
                instance: format!(
                    "{}-{purpose}@{}:{}",
                    self.base.name,
                    std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into()),
                    std::process::id()
                ),
                drain_grace: self.grace,
            },
            &self.kafka,
            &self.consumer,
            self.base.database.pool.clone(),
            self.base.outbox.clone(),
            handler,
            self.base.shutdown.child_token(),
        )?;
        self.base.readiness.watch(consumer.stats());
        self.base.scrape.watch(group, consumer.stats());
        self.base.spawn(consumer.join());
        Ok(())
    }

    /// Serves until the first SIGINT or SIGTERM ([`shutdown_signal`]), then stops in
    /// order; the process exits [`STOP_DEADLINE_MARGIN`] after the grace period
    /// even if the stop, or the runtime's teardown after it, has not finished.
    pub async fn run_until_signalled(self) {
        let (name, grace) = (self.base.name, self.grace);
        self.run_until(async move {
            shutdown_signal().await;
            stop_deadline(name, grace + STOP_DEADLINE_MARGIN);
        })
        .await;
    }

    /// Serves until `shutdown` resolves, then stops in order. In-process, as tests
    /// run a service: no deadline exits the process.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let handle = self.server.handle();
        let server = tokio::spawn(self.server);
        self.base.readiness.set(true);
        shutdown.await;
        self.base.stop(handle, self.grace).await;
        let _ = server.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_once_started_and_while_every_consumer_holds_its_assignment() {
        let readiness = Readiness::default();
        let (first, second) = (Arc::new(ConsumerStats::default()), Arc::new(ConsumerStats::default()));
        readiness.watch(first.clone());
        readiness.watch(second.clone());
        assert!(!readiness.get(), "not started");
        readiness.set(true);
        assert!(!readiness.get(), "started, but no consumer has its assignment yet");
        first.joined.store(true, Ordering::Release);
        assert!(!readiness.get(), "one consumer still waits for the group");
        // An empty assignment counts: the instance is a standby (docs/decisions.md, 17).
        second.joined.store(true, Ordering::Release);
        assert!(readiness.get());
        second.joined.store(false, Ordering::Release);
        assert!(!readiness.get(), "a consumer gave its partitions up after a failed rebalance");
        second.joined.store(true, Ordering::Release);
        readiness.set(false);
        assert!(!readiness.get(), "shutting down");
    }
}
