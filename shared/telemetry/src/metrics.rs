//! The metrics every service exports at `GET /metrics` (docs/operations.md): one
//! registry per process, each family named here and nowhere else. Labels are
//! bounded words (topics, providers, classes, routes); no tenant, task or token
//! ever becomes a label, so the page may be served without a token.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The media type of the page [`encode`] writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Family names, as a scraper sees them (counters get `_total` appended).
/// Dashboards and alerts depend on them: do not change one without docs/operations.md.
pub mod names {
    pub const CONSUMER_LAG: &str = "fenceline_consumer_lag_records";
    pub const CONSUMER_APPLIED: &str = "fenceline_consumer_applied_events";
    pub const CONSUMER_DEAD_LETTERED: &str = "fenceline_consumer_dead_lettered_records";
    pub const CONSUMER_FENCED_BATCHES: &str = "fenceline_consumer_fenced_batches";
    pub const CONSUMER_ASSIGNED: &str = "fenceline_consumer_assigned_partitions";
    pub const CONSUMER_HALTED: &str = "fenceline_consumer_halted_partitions";
    pub const OUTBOX_BACKLOG: &str = "fenceline_outbox_backlog_rows";
    pub const OUTBOX_OLDEST_AGE: &str = "fenceline_outbox_oldest_age_seconds";
    pub const OUTBOX_PUBLISHED: &str = "fenceline_outbox_published_rows";
    pub const OUTBOX_FAILED: &str = "fenceline_outbox_failed_deliveries";
    pub const OUTBOX_REFUSED: &str = "fenceline_outbox_refused_rows";
    pub const GRANTS: &str = "fenceline_scheduler_grants";
    pub const POLICY_RESENDS: &str = "fenceline_policy_resends";
    pub const TIMER_LATENESS: &str = "fenceline_scheduler_timer_lateness_seconds";
    pub const ATTEMPTS: &str = "fenceline_executor_attempts";
    pub const LEASES_TAKEN_OVER: &str = "fenceline_executor_leases_taken_over";
    pub const PROVIDER_CALLS: &str = "fenceline_provider_calls";
    pub const PROVIDER_CHARGES: &str = "fenceline_provider_charges";
    pub const PROVIDER_SPEND: &str = "fenceline_provider_spend";
    pub const OPEN_CASES: &str = "fenceline_reconciler_open_cases";
    pub const AUDIT_FINDINGS: &str = "fenceline_audit_findings";
    pub const HTTP_DURATION: &str = "fenceline_http_request_duration_seconds";
}

/// A consumer group's partition.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabels {
    pub group: String,
    pub topic: String,
    pub partition: i32,
}

/// A consumer group.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabels {
    pub group: String,
}

/// How an attempt ended: `succeeded`, `failed` (with its error class), `released`
/// (with its reason in `error_class`) or `lost`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub outcome: String,
    pub error_class: String,
}

/// A provider and what one exchange with it came to: `done`, `accepted`,
/// `not_sent`, `timed_out`, `reset`, or `status_<code>`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderCallLabels {
    pub provider: String,
    pub request: String,
    pub outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderLabels {
    pub provider: String,
}

/// A step of a kind and the provider it calls (step names are the catalogue's, a bounded set).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabels {
    pub provider: String,
    pub step: String,
}

/// A task state that waits for evidence or a person.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FindingLabels {
    pub finding: String,
}

/// An HTTP request by its route pattern (never its path: ids stay out of labels).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every family of the process. Services update the ones that concern them; the
/// others stay at zero (a family with no label set yet prints only its header).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub consumer_lag: Family<PartitionLabels, Gauge>,
    pub consumer_applied: Family<GroupLabels, Gauge>,
    pub consumer_dead_lettered: Family<GroupLabels, Gauge>,
    pub consumer_fenced_batches: Family<GroupLabels, Gauge>,
    pub consumer_assigned: Family<GroupLabels, Gauge>,
    pub consumer_halted: Family<GroupLabels, Gauge>,
    pub outbox_backlog: Gauge,
    pub outbox_oldest_age_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub outbox_published: Gauge,
    pub outbox_failed: Gauge,
    pub outbox_refused: Gauge,
    pub grants: Counter,
    pub policy_resends: Family<StepLabels, Counter>,
    pub timer_lateness: Histogram,
    pub attempts: Family<AttemptLabels, Counter>,
    pub leases_taken_over: Counter,
    pub provider_calls: Family<ProviderCallLabels, Counter>,
    pub provider_charges: Family<ProviderLabels, Counter>,
    pub provider_spend: Family<ProviderLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub open_cases: Family<StateLabels, Gauge>,
    pub audit_findings: Family<FindingLabels, Gauge>,
    pub http_duration: Histograms<HttpLabels>,
}

fn latency_buckets() -> Histogram {
    // 1 ms to about 16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            consumer_lag: Family::default(),
            consumer_applied: Family::default(),
            consumer_dead_lettered: Family::default(),
            consumer_fenced_batches: Family::default(),
            consumer_assigned: Family::default(),
            consumer_halted: Family::default(),
            outbox_backlog: Gauge::default(),
            outbox_oldest_age_seconds: Gauge::default(),
            outbox_published: Gauge::default(),
            outbox_failed: Gauge::default(),
            outbox_refused: Gauge::default(),
            grants: Counter::default(),
            policy_resends: Family::default(),
            // 1 ms to about 65 s.
            timer_lateness: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            attempts: Family::default(),
            leases_taken_over: Counter::default(),
            provider_calls: Family::default(),
            provider_charges: Family::default(),
            provider_spend: Family::default(),
            open_cases: Family::default(),
            audit_findings: Family::default(),
            http_duration: Family::new_with_constructor(latency_buckets),
            registry: Registry::default(),
        };
        use names::*;
        let r = &mut registry;
        r.register(
            CONSUMER_LAG,
            "Records on the broker a consumer has not applied yet: the partition's high watermark minus the \
             consumer's next offset",
            m.consumer_lag.clone(),
        );
        r.register(CONSUMER_APPLIED, "Events applied by this process's consumer", m.consumer_applied.clone());
        r.register(
            CONSUMER_DEAD_LETTERED,
            "Records this process's consumer sent to the dead-letter topic",
            m.consumer_dead_lettered.clone(),
        );
        r.register(
            CONSUMER_FENCED_BATCHES,
            "Batches dropped because another instance took the partition over",
            m.consumer_fenced_batches.clone(),
        );
        r.register(CONSUMER_ASSIGNED, "Partitions this consumer holds", m.consumer_assigned.clone());
        r.register(
            CONSUMER_HALTED,
            "Partitions stopped because their stored progress lies beyond the log's end",
            m.consumer_halted.clone(),
        );
        r.register(OUTBOX_BACKLOG, "Outbox rows not yet published", m.outbox_backlog.clone());
        r.register(
            OUTBOX_OLDEST_AGE,
            "Age of the oldest unpublished outbox row, in seconds (0 when none waits)",
            m.outbox_oldest_age_seconds.clone(),
        );
        r.register(OUTBOX_PUBLISHED, "Outbox rows this process's relay published", m.outbox_published.clone());
        r.register(
            OUTBOX_FAILED,
            "Outbox deliveries that were not confirmed and are sent again",
            m.outbox_failed.clone(),
        );
        r.register(OUTBOX_REFUSED, "Outbox rows the broker can never take", m.outbox_refused.clone());
        r.register(GRANTS, "Attempts granted by this scheduler", m.grants.clone());
        r.register(
            POLICY_RESENDS,
            "New operations sent by a step's standing decision in the catalogue after an outcome nobody could \
             establish: each may be an extra charge",
            m.policy_resends.clone(),
        );
        r.register(
            TIMER_LATENESS,
            "How long after its due instant a dispatch round acted on a task, in seconds",
            m.timer_lateness.clone(),
        );
        r.register(ATTEMPTS, "Attempts this executor ended, by outcome and error class", m.attempts.clone());
        r.register(
            LEASES_TAKEN_OVER,
            "Executions claimed after another worker's lease expired",
            m.leases_taken_over.clone(),
        );
        r.register(PROVIDER_CALLS, "Requests to providers, by provider, request and outcome", m.provider_calls.clone());
        r.register(
            PROVIDER_CHARGES,
            "Operations a provider reported done: each is work it charged for",
            m.provider_charges.clone(),
        );
        r.register(
            PROVIDER_SPEND,
            "What calls that did their work cost as the catalogue prices them, in the currency's minor unit",
            m.provider_spend.clone(),
        );
        r.register(
            OPEN_CASES,
            "Tasks that wait for evidence or a person, by state (outcome_unknown, needs_human)",
            m.open_cases.clone(),
        );
        r.register(AUDIT_FINDINGS, "Tasks the last audit found wrong, by kind of finding", m.audit_findings.clone());
        r.register(
            HTTP_DURATION,
            "HTTP requests served, by method, route and status, in seconds",
            m.http_duration.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts new operations a step's standing decision sent.
    pub fn policy_resent(&self, provider: &str, step: &str, count: u64) {
        self.policy_resends.get_or_create(&StepLabels { provider: provider.into(), step: step.into() }).inc_by(count);
    }

    /// Counts an attempt's end.
    pub fn attempt_ended(&self, outcome: &str, error_class: &str) {
        self.attempts.get_or_create(&AttemptLabels { outcome: outcome.into(), error_class: error_class.into() }).inc();
    }

    /// Counts one exchange with a provider.
    pub fn provider_call(&self, provider: &str, request: &str, outcome: &str) {
        self.provider_calls
            .get_or_create(&ProviderCallLabels {
                provider: provider.into(),
                request: request.into(),
                outcome: outcome.into(),
            })
            .inc();
    }
}

/// The process's metrics.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// The process's metrics in the OpenMetrics text format (which Prometheus reads).
pub fn encode() -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &global().registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_every_family_and_counts() {
        let metrics = global();
        metrics.grants.inc();
        metrics.attempt_ended("failed", "throttled");
        let page = encode();
        assert!(page.contains("# TYPE fenceline_scheduler_grants counter"), "{page}");
        assert!(page.contains("fenceline_scheduler_grants_total "), "{page}");
        assert!(
            page.contains("fenceline_executor_attempts_total{outcome=\"failed\",error_class=\"throttled\"} "),
            "{page}"
        );
        assert!(page.ends_with("# EOF\n"), "{page}");
    }
}
