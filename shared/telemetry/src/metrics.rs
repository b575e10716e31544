//! The metrics a service exports at `GET /metrics` (docs/operations.md): each
//! family named here and nowhere else, and each service's page made of the
//! families every service has and the groups of its own ([`Group`]). Labels are
//! bounded words (topics, providers, kinds, states, classes, routes); no tenant,
//! task or token ever becomes a label, so the page may be served without a token.

use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The media type of the page [`encode`] writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Family names, as registered: a scraper sees a counter's samples with `_total`
/// appended, a histogram's as `_bucket`, `_sum` and `_count`. Dashboards and alerts
/// (deploy/observability) depend on them: do not change one without
/// docs/operations.md and those files.
pub mod names {
    pub const BUILD_INFO: &str = "fenceline_build_info";
    pub const HTTP_DURATION: &str = "fenceline_http_request_duration_seconds";
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
    pub const TASKS: &str = "fenceline_scheduler_tasks";
    pub const TASK_DURATION: &str = "fenceline_task_duration_seconds";
    pub const ATTEMPTS: &str = "fenceline_executor_attempts";
    pub const LEASES_TAKEN_OVER: &str = "fenceline_executor_leases_taken_over";
    pub const PROVIDER_CALLS: &str = "fenceline_provider_calls";
    pub const PROVIDER_CALL_DURATION: &str = "fenceline_provider_call_duration_seconds";
    pub const PROVIDER_CHARGES: &str = "fenceline_provider_charges";
    pub const PROVIDER_SPEND: &str = "fenceline_provider_spend";
    pub const OPEN_CASES: &str = "fenceline_reconciler_open_cases";
    pub const AUDIT_FINDINGS: &str = "fenceline_audit_findings";
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

/// Which service this is, and which build.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub service: String,
    pub version: String,
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

/// A provider, a request and the class of its answer ([`answer_class`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProviderAnswerLabels {
    pub provider: String,
    pub request: String,
    pub class: String,
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

/// A task state.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: String,
}

/// A kind of task (the catalogue's, a bounded set) and the final state it reached.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindStateLabels {
    pub kind: String,
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

/// The groups of families that only the services that emit them export. Every
/// service exports the HTTP, consumer, outbox, `process_*` and build families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Grants, timers, tasks by state, and the time from submission to a final state.
    Scheduler,
    /// Attempts and lease takeovers.
    Executor,
    /// Exchanges with providers: the executor's calls and the reconciler's look-ups.
    ProviderCalls,
    /// Open cases and audit findings.
    Reconciler,
}

/// The families of the process's HTTP server.
#[derive(Debug)]
pub struct HttpFamilies {
    pub duration: Histograms<HttpLabels>,
}

/// The fenced consumer's and the outbox relay's families. The running counts are
/// brought up to the bus's own counts at each scrape (`shared/runtime`'s scrape).
#[derive(Debug)]
pub struct BusFamilies {
    pub consumer_lag: Family<PartitionLabels, Gauge>,
    pub consumer_applied: Family<GroupLabels, Counter>,
    pub consumer_dead_lettered: Family<GroupLabels, Counter>,
    pub consumer_fenced_batches: Family<GroupLabels, Counter>,
    pub consumer_assigned: Family<GroupLabels, Gauge>,
    pub consumer_halted: Family<GroupLabels, Gauge>,
    pub outbox_backlog: Gauge,
    pub outbox_oldest_age_seconds: Gauge<f64, AtomicU64>,
    pub outbox_published: Counter,
    pub outbox_failed: Counter,
    pub outbox_refused: Counter,
}

/// The scheduler's families.
#[derive(Debug)]
pub struct SchedulerFamilies {
    pub grants: Counter,
    pub policy_resends: Family<StepLabels, Counter>,
    pub timer_lateness: Histogram,
    /// Unfinished tasks by state, read from the scheduler's table at each scrape.
    pub tasks: Family<StateLabels, Gauge>,
    /// From a task's submission to its final state, by kind and that state.
    pub task_duration: Histograms<KindStateLabels>,
}

/// The executor's families.
#[derive(Debug)]
pub struct ExecutorFamilies {
    pub attempts: Family<AttemptLabels, Counter>,
    pub leases_taken_over: Counter,
    pub provider_charges: Family<ProviderLabels, Counter>,
    /// What those charges cost as the catalogue prices them, in the minor unit.
    pub provider_spend: Family<ProviderLabels, Counter<f64, AtomicU64>>,
}

/// Exchanges with providers, wherever they are made.
#[derive(Debug)]
pub struct ProviderFamilies {
    pub calls: Family<ProviderCallLabels, Counter>,
    pub call_duration: Histograms<ProviderAnswerLabels>,
}

/// The reconciler's families, read from its tables at each scrape.
#[derive(Debug)]
pub struct ReconcilerFamilies {
    pub open_cases: Family<StateLabels, Gauge>,
    pub audit_findings: Family<FindingLabels, Gauge>,
}

/// Every family a service may update. Updating one that the process does not
/// export (another service's) is harmless: only the registered ones are encoded.
#[derive(Debug)]
pub struct Metrics {
    pub http: HttpFamilies,
    pub bus: BusFamilies,
    pub scheduler: SchedulerFamilies,
    pub executor: ExecutorFamilies,
    pub providers: ProviderFamilies,
    pub reconciler: ReconcilerFamilies,
}

fn http_buckets() -> Histogram {
    // 1 ms to about 16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

fn provider_call_buckets() -> Histogram {
    // 5 ms to about 82 s: a provider's call timeout lies within.
    Histogram::new(exponential_buckets(0.005, 2.0, 15))
}

fn task_duration_buckets() -> Histogram {
    // A task that runs at once ends within seconds; one that waits for a backoff,
    // a provider's slots or a person, within minutes to days.
    Histogram::new([0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14_400.0, 86_400.0])
}

impl Metrics {
    fn new() -> Self {
        Metrics {
            http: HttpFamilies { duration: Family::new_with_constructor(http_buckets) },
            bus: BusFamilies {
                consumer_lag: Family::default(),
                consumer_applied: Family::default(),
                consumer_dead_lettered: Family::default(),
                consumer_fenced_batches: Family::default(),
                consumer_assigned: Family::default(),
                consumer_halted: Family::default(),
                outbox_backlog: Gauge::default(),
                outbox_oldest_age_seconds: Gauge::default(),
                outbox_published: Counter::default(),
                outbox_failed: Counter::default(),
                outbox_refused: Counter::default(),
            },
            scheduler: SchedulerFamilies {
                grants: Counter::default(),
                policy_resends: Family::default(),
                // 1 ms to about 65 s.
                timer_lateness: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
                tasks: Family::default(),
                task_duration: Family::new_with_constructor(task_duration_buckets),
            },
            executor: ExecutorFamilies {
                attempts: Family::default(),
                leases_taken_over: Counter::default(),
                provider_charges: Family::default(),
                provider_spend: Family::default(),
            },
            providers: ProviderFamilies {
                calls: Family::default(),
                call_duration: Family::new_with_constructor(provider_call_buckets),
            },
            reconciler: ReconcilerFamilies { open_cases: Family::default(), audit_findings: Family::default() },
        }
    }

    /// A registry of the families `service` exports: those every service has and
    /// those of its `groups`.
    fn registry(&self, service: &str, groups: &[Group]) -> Registry {
        use names::*;
        let mut registry = Registry::default();
        let r = &mut registry;
        let build = Family::<BuildLabels, Gauge>::default();
        build.get_or_create(&BuildLabels { service: service.into(), version: env!("CARGO_PKG_VERSION").into() }).set(1);
        r.register(BUILD_INFO, "The service and its version; always 1", build);
        r.register_collector(Box::new(crate::process::Collector));
        r.register(
            HTTP_DURATION,
            "HTTP requests served, by method, route and status, in seconds",
            self.http.duration.clone(),
        );
        let bus = &self.bus;
        r.register(
            CONSUMER_LAG,
            "Records on the broker a consumer has not applied yet: the partition's high watermark minus the \
             consumer's next offset",
            bus.consumer_lag.clone(),
        );
        r.register(CONSUMER_APPLIED, "Events applied by this process's consumer", bus.consumer_applied.clone());
        r.register(
            CONSUMER_DEAD_LETTERED,
            "Records this process's consumer sent to the dead-letter topic",
            bus.consumer_dead_lettered.clone(),
        );
        r.register(
            CONSUMER_FENCED_BATCHES,
            "Batches dropped because another instance took the partition over",
            bus.consumer_fenced_batches.clone(),
        );
        r.register(CONSUMER_ASSIGNED, "Partitions this consumer holds", bus.consumer_assigned.clone());
        r.register(
            CONSUMER_HALTED,
            "Partitions stopped because their stored progress lies beyond the log's end",
            bus.consumer_halted.clone(),
        );
        r.register(OUTBOX_BACKLOG, "Outbox rows not yet published", bus.outbox_backlog.clone());
        r.register(
            OUTBOX_OLDEST_AGE,
            "Age of the oldest unpublished outbox row, in seconds (0 when none waits)",
            bus.outbox_oldest_age_seconds.clone(),
        );
        r.register(OUTBOX_PUBLISHED, "Outbox rows this process's relay published", bus.outbox_published.clone());
        r.register(
            OUTBOX_FAILED,
            "Outbox deliveries that were not confirmed and are sent again",
            bus.outbox_failed.clone(),
        );
        r.register(OUTBOX_REFUSED, "Outbox rows the broker can never take", bus.outbox_refused.clone());
        for group in groups {
            match group {
                Group::Scheduler => self.register_scheduler(r),
                Group::Executor => self.register_executor(r),
                Group::ProviderCalls => self.register_provider_calls(r),
                Group::Reconciler => self.register_reconciler(r),
            }
        }
        registry
    }

    fn register_scheduler(&self, r: &mut Registry) {
        use names::*;
        let s = &self.scheduler;
        r.register(GRANTS, "Attempts granted by this scheduler", s.grants.clone());
        r.register(
            POLICY_RESENDS,
            "New operations sent by a step's standing decision in the catalogue after an outcome nobody could \
             establish: each may be an extra charge",
            s.policy_resends.clone(),
        );
        r.register(
            TIMER_LATENESS,
            "How long after its due instant a dispatch round acted on a task, in seconds",
            s.timer_lateness.clone(),
        );
        r.register(TASKS, "Unfinished tasks, by state", s.tasks.clone());
        r.register(
            TASK_DURATION,
            "From a task's submission to its final state, by kind and final state, in seconds",
            s.task_duration.clone(),
        );
    }

    fn register_executor(&self, r: &mut Registry) {
        use names::*;
        let e = &self.executor;
        r.register(ATTEMPTS, "Attempts this executor ended, by outcome and error class", e.attempts.clone());
        r.register(
            LEASES_TAKEN_OVER,
            "Executions claimed after another worker's lease expired",
            e.leases_taken_over.clone(),
        );
        r.register(
            PROVIDER_CHARGES,
            "Operations a provider reported done: each is work it charged for",
            e.provider_charges.clone(),
        );
        r.register(
            PROVIDER_SPEND,
            "What calls that did their work cost as the catalogue prices them, in the currency's minor unit",
            e.provider_spend.clone(),
        );
    }

    fn register_provider_calls(&self, r: &mut Registry) {
        use names::*;
        let p = &self.providers;
        r.register(PROVIDER_CALLS, "Requests to providers, by provider, request and outcome", p.calls.clone());
        r.register(
            PROVIDER_CALL_DURATION,
            "Requests to providers, by provider, request and class of answer, in seconds",
            p.call_duration.clone(),
        );
    }

    fn register_reconciler(&self, r: &mut Registry) {
        use names::*;
        let c = &self.reconciler;
        r.register(
            OPEN_CASES,
            "Tasks that wait for evidence or a person, by state (outcome_unknown, needs_human)",
            c.open_cases.clone(),
        );
        r.register(AUDIT_FINDINGS, "Tasks the last audit found wrong, by kind of finding", c.audit_findings.clone());
    }
}

impl SchedulerFamilies {
    /// Counts new operations a step's standing decision sent.
    pub fn policy_resent(&self, provider: &str, step: &str, count: u64) {
        self.policy_resends.get_or_create(&StepLabels { provider: provider.into(), step: step.into() }).inc_by(count);
    }

    /// Times a task from its submission to the final state it reached.
    pub fn task_ended(&self, kind: &str, state: &str, seconds: f64) {
        self.task_duration.get_or_create(&KindStateLabels { kind: kind.into(), state: state.into() }).observe(seconds);
    }
}

impl ExecutorFamilies {
    /// Counts an attempt's end.
    pub fn attempt_ended(&self, outcome: &str, error_class: &str) {
        self.attempts.get_or_create(&AttemptLabels { outcome: outcome.into(), error_class: error_class.into() }).inc();
    }
}

impl ProviderFamilies {
    /// Counts and times one exchange with a provider.
    pub fn call(&self, provider: &str, request: &str, outcome: &str, seconds: f64) {
        self.calls
            .get_or_create(&ProviderCallLabels {
                provider: provider.into(),
                request: request.into(),
                outcome: outcome.into(),
            })
            .inc();
        self.call_duration
            .get_or_create(&ProviderAnswerLabels {
                provider: provider.into(),
                request: request.into(),
                class: answer_class(outcome),
            })
            .observe(seconds);
    }
}

/// Moves `counter` up to `count`, a running count kept elsewhere (the bus's) that
/// only grows: the page shows a counter that never goes back.
pub fn catch_up(counter: &Counter, count: u64) {
    counter.inc_by(count.saturating_sub(counter.get()));
}

/// The class of an exchange's outcome, for its latency: the outcome itself, but a
/// status by its hundred (`status_503` is `status_5xx`), so a histogram keeps few series.
pub fn answer_class(outcome: &str) -> String {
    match outcome.strip_prefix("status_").and_then(|code| code.chars().next()) {
        Some(hundred) if hundred.is_ascii_digit() => format!("status_{hundred}xx"),
        _ => outcome.to_owned(),
    }
}

/// The process's families.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// Makes this process's page: the families every service exports and those of
/// `groups`, `service` named in `fenceline_build_info`. Called once at start; a
/// later call (a test that starts a service twice) keeps the first page.
pub fn install(service: &str, groups: &[Group]) {
    REGISTRY.get_or_init(|| global().registry(service, groups));
}

/// The process's page in the OpenMetrics text format (which Prometheus reads):
/// empty but for its end before [`install`].
pub fn encode() -> String {
    let mut out = String::new();
    match REGISTRY.get() {
        // Writing into a String cannot fail.
        Some(registry) => {
            let _ = prometheus_client::encoding::text::encode(&mut out, registry);
        }
        None => out.push_str("# EOF\n"),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(service: &str, groups: &[Group]) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &global().registry(service, groups)).expect("encode");
        out
    }

    /// The family names a page declares, from its `# TYPE` lines.
    fn families(page: &str) -> Vec<String> {
        page.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .map(String::from)
            .collect()
    }

    #[test]
    fn the_page_names_every_family_and_counts() {
        let metrics = global();
        metrics.scheduler.grants.inc();
        metrics.executor.attempt_ended("failed", "throttled");
        let page = page("scheduler", &[Group::Scheduler, Group::Executor]);
        assert!(page.contains("# TYPE fenceline_scheduler_grants counter"), "{page}");
        assert!(page.contains("fenceline_scheduler_grants_total "), "{page}");
        assert!(
            page.contains("fenceline_executor_attempts_total{outcome=\"failed\",error_class=\"throttled\"} "),
            "{page}"
        );
        assert!(page.ends_with("# EOF\n"), "{page}");
    }

    /// A family shows on the page once it holds a series: the bus's hold one per
    /// consumer group from the first scrape on.
    fn one_consumer_group() {
        let bus = &global().bus;
        let group = GroupLabels { group: "fenceline.intake.status".into() };
        for family in [&bus.consumer_applied, &bus.consumer_dead_lettered, &bus.consumer_fenced_batches] {
            catch_up(&family.get_or_create(&group), 0);
        }
        let http = HttpLabels { method: "GET".into(), route: "/healthz".into(), status: 200 };
        global().http.duration.get_or_create(&http).observe(0.001);
    }

    #[test]
    fn running_counts_are_counters_and_every_service_says_what_it_is() {
        one_consumer_group();
        let page = page("intake", &[]);
        for counter in [
            names::CONSUMER_APPLIED,
            names::CONSUMER_DEAD_LETTERED,
            names::CONSUMER_FENCED_BATCHES,
            names::OUTBOX_PUBLISHED,
            names::OUTBOX_FAILED,
            names::OUTBOX_REFUSED,
        ] {
            assert!(page.contains(&format!("# TYPE {counter} counter")), "{counter}: {page}");
        }
        let version = env!("CARGO_PKG_VERSION");
        assert!(
            page.contains(&format!("fenceline_build_info{{service=\"intake\",version=\"{version}\"}} 1")),
            "{page}"
        );
        if cfg!(target_os = "linux") {
            for name in ["process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"] {
                assert!(families(&page).iter().any(|f| f == name), "{name}: {page}");
            }
        }
    }

    #[test]
    fn a_service_exports_only_its_own_groups() {
        one_consumer_group();
        // A family shows once it holds a series: one call, timed.
        global().providers.call("img", "start", "done", 0.1);
        let intake = families(&page("intake", &[]));
        let executor = families(&page("executor", &[Group::Executor, Group::ProviderCalls]));
        for foreign in [names::GRANTS, names::TASKS, names::ATTEMPTS, names::PROVIDER_CALLS, names::OPEN_CASES] {
            assert!(!intake.iter().any(|f| f == foreign), "intake exports {foreign}");
        }
        assert!(executor.iter().any(|f| f == names::PROVIDER_CALL_DURATION));
        assert!(!executor.iter().any(|f| f == names::TASK_DURATION || f == names::AUDIT_FINDINGS));
        assert!(intake.iter().any(|f| f == names::OUTBOX_BACKLOG) && intake.iter().any(|f| f == names::HTTP_DURATION));
    }

    #[test]
    fn a_running_count_kept_elsewhere_is_caught_up_and_never_goes_back() {
        let counter = Counter::default();
        catch_up(&counter, 5);
        catch_up(&counter, 7);
        assert_eq!(counter.get(), 7);
        catch_up(&counter, 3);
        assert_eq!(counter.get(), 7, "a counter never goes back");
    }

    #[test]
    fn a_provider_call_is_timed_by_the_class_of_its_answer() {
        assert_eq!(answer_class("status_503"), "status_5xx");
        assert_eq!(answer_class("status_429"), "status_4xx");
        assert_eq!(answer_class("done"), "done");
        assert_eq!(answer_class("timed_out"), "timed_out");
        global().providers.call("img", "start", "status_503", 0.2);
        let page = page("executor", &[Group::ProviderCalls]);
        assert!(
            page.contains(
                "fenceline_provider_call_duration_seconds_count{provider=\"img\",request=\"start\",class=\"status_5xx\"} "
            ),
            "{page}"
        );
    }
}
