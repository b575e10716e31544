//! `GET /metrics`: the process's metrics ([`fenceline_telemetry::metrics`]), with
//! what is read rather than counted brought up to date at each scrape: consumer
//! lag and partitions, the bus's running counts, the outbox backlog, and whatever
//! the service adds as a [`Probe`] (the scheduler's tasks by state, the
//! reconciler's open cases and audit findings).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use actix_web::{HttpResponse, web};
use fenceline_bus::{ConsumerStats, RelayStats};
use fenceline_telemetry::metrics::{self, GroupLabels, PartitionLabels, catch_up, global};

/// A service's own refresh of gauges it reads from its tables, run at each scrape.
pub type Probe = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What a scrape reads from one service.
#[derive(Clone)]
pub struct Scrape(Arc<Inner>);

struct Inner {
    pool: sqlx::PgPool,
    relay: Arc<RelayStats>,
    consumers: Mutex<Vec<(String, Arc<ConsumerStats>)>>,
    probes: Mutex<Vec<Probe>>,
    /// One refresh at a time, so that two scrapes never clear each other's series.
    serial: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scrape").finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Scrape {
    pub(crate) fn new(pool: sqlx::PgPool, relay: Arc<RelayStats>) -> Self {
        Self(Arc::new(Inner {
            pool,
            relay,
            consumers: Mutex::default(),
            probes: Mutex::default(),
            serial: tokio::sync::Mutex::new(()),
        }))
    }

    pub(crate) fn watch(&self, group: String, stats: Arc<ConsumerStats>) {
        lock(&self.0.consumers).push((group, stats));
    }

    /// Adds a refresh that runs before each scrape is answered.
    pub fn probe<F, Fut>(&self, probe: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        lock(&self.0.probes).push(Arc::new(move || Box::pin(probe())));
    }

    async fn refresh(&self) {
        let _one = self.0.serial.lock().await;
        let m = &global().bus;
        let consumers = lock(&self.0.consumers).clone();
        m.consumer_lag.clear();
        for (group, stats) in &consumers {
            let labels = GroupLabels { group: group.clone() };
            catch_up(&m.consumer_applied.get_or_create(&labels), stats.applied.load(Ordering::Relaxed));
            catch_up(&m.consumer_dead_lettered.get_or_create(&labels), stats.dead_lettered.load(Ordering::Relaxed));
            catch_up(&m.consumer_fenced_batches.get_or_create(&labels), stats.fenced_batches.load(Ordering::Relaxed));
            let count =
                |n: &std::sync::atomic::AtomicUsize| i64::try_from(n.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
            m.consumer_assigned.get_or_create(&labels).set(count(&stats.assigned_partitions));
            m.consumer_halted.get_or_create(&labels).set(count(&stats.halted_partitions));
            for ((topic, partition), lag) in stats.lag() {
                m.consumer_lag.get_or_create(&PartitionLabels { group: group.clone(), topic, partition }).set(lag);
            }
        }
        let relay = &self.0.relay;
        catch_up(&m.outbox_published, relay.published.load(Ordering::Relaxed));
        catch_up(&m.outbox_failed, relay.failed_deliveries.load(Ordering::Relaxed));
        catch_up(&m.outbox_refused, relay.refused.load(Ordering::Relaxed));
        let backlog: Result<(i64, f64), sqlx::Error> = sqlx::query_as(
            "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 \
             FROM outbox WHERE published_at IS NULL AND refused_at IS NULL",
        )
        .fetch_one(&self.0.pool)
        .await;
        match backlog {
            Ok((rows, age)) => {
                m.outbox_backlog.set(rows);
                m.outbox_oldest_age_seconds.set(age.max(0.0));
            }
            Err(e) => tracing::warn!(error = %e, "reading the outbox backlog for /metrics failed"),
        }
        let probes = lock(&self.0.probes).clone();
        for probe in probes {
            probe().await;
        }
    }
}

/// The `/metrics` route, served on the service's port without a token: the page
/// holds counts by bounded labels and never a tenant, a task or a secret
/// (docs/decisions.md).
pub fn metrics_route(scrape: Scrape) -> impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static {
    move |cfg: &mut web::ServiceConfig| {
        cfg.app_data(web::Data::new(scrape.clone())).route("/metrics", web::get().to(page));
    }
}

async fn page(scrape: web::Data<Scrape>) -> HttpResponse {
    scrape.refresh().await;
    HttpResponse::Ok().content_type(metrics::CONTENT_TYPE).body(metrics::encode())
}
