//! The benchmark's scenarios, each on systems of its own: sustained throughput,
//! latency at fixed offered loads, executor instances, the pgqueuer peer, the
//! support tickets against a limited provider, and a large backlog.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fenceline_events::{TaskAccepted, Timestamp};
use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

use crate::load::{self, Pace, Submission, Target};
use crate::probe::{self, Watched, round};
use crate::way;
use crate::{list_setting, median_of, setting};

/// The one-step kind and the three-step kind every system's catalogue holds.
pub const ONE_STEP: &str = "image.generate";
pub const THREE_STEP: &str = "ticket.reply";
const PROVIDER: &str = "gen";
const TENANT: &str = "bench";

/// Every setting, from the environment (docs/performance.md lists them).
#[derive(Debug, Clone)]
pub struct Settings {
    pub runs: u64,
    pub seconds: u64,
    pub window: u64,
    pub clients: u64,
    pub load_seconds: u64,
    pub loads: Vec<u64>,
    pub executors: Vec<u64>,
    pub executor_seconds: u64,
    pub drain_seconds: u64,
    pub warmup_seconds: u64,
    /// Saturated load carried once, before the first scenario ([`warm_the_broker`]).
    pub broker_warmup_seconds: u64,
    /// Whether the warm-up ends with `ANALYZE` of every service's tables.
    pub analyze_after_warmup: bool,
    pub tickets: u64,
    pub ticket_concurrency: Vec<u64>,
    pub ticket_latency_ms: u64,
    pub ticket_provider_in_flight: u64,
    pub ticket_provider_per_second: u64,
    pub backlog_waiting: u64,
    pub backlog_finished: u64,
    pub backlog_seconds: u64,
    pub admission_rate: u64,
    pub admission_burst: u64,
    pub admission_offered: u64,
    pub admission_seconds: u64,
}

impl Settings {
    pub fn from_env() -> Self {
        Self {
            runs: setting("BENCH_RUNS", 3).max(1),
            seconds: setting("BENCH_SECONDS", 60).max(4),
            window: setting("BENCH_WINDOW", 400).max(1),
            clients: setting("BENCH_CLIENTS", 32).max(1),
            load_seconds: setting("BENCH_LOAD_SECONDS", 10).max(2),
            loads: list_setting("BENCH_LOADS", &[50, 200, 500, 1000]),
            executors: list_setting("BENCH_EXECUTORS", &[1, 2, 4]),
            executor_seconds: setting("BENCH_EXECUTOR_SECONDS", 20).max(4),
            drain_seconds: setting("BENCH_DRAIN_SECONDS", 30),
            warmup_seconds: setting("BENCH_WARMUP_SECONDS", 20),
            broker_warmup_seconds: setting("BENCH_BROKER_WARMUP_SECONDS", 60),
            analyze_after_warmup: setting("BENCH_ANALYZE_AFTER_WARMUP", 1) != 0,
            tickets: setting("BENCH_TICKETS", 30).max(1),
            ticket_concurrency: list_setting("BENCH_TICKET_CONCURRENCY", &[2, 8]),
            ticket_latency_ms: setting("BENCH_TICKET_LATENCY_MS", 500),
            ticket_provider_in_flight: setting("BENCH_TICKET_PROVIDER_IN_FLIGHT", 2),
            ticket_provider_per_second: setting("BENCH_TICKET_PROVIDER_PER_SECOND", 5),
            backlog_waiting: setting("BENCH_BACKLOG_WAITING", 10_000),
            backlog_finished: setting("BENCH_BACKLOG_FINISHED", 100_000),
            backlog_seconds: setting("BENCH_BACKLOG_SECONDS", 20).max(4),
            // A tenant's rate is sized below what the whole stack carries on this
            // machine (docs/performance.md), and ten times that is offered.
            admission_rate: setting("BENCH_ADMISSION_RATE", 10).max(1),
            admission_burst: setting("BENCH_ADMISSION_BURST", 10).max(1),
            admission_offered: setting("BENCH_ADMISSION_OFFERED", 100).max(1),
            admission_seconds: setting("BENCH_ADMISSION_SECONDS", 10).max(2),
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "BENCH_RUNS": self.runs, "BENCH_SECONDS": self.seconds, "BENCH_WINDOW": self.window,
            "BENCH_CLIENTS": self.clients, "BENCH_LOAD_SECONDS": self.load_seconds, "BENCH_LOADS": self.loads,
            "BENCH_EXECUTORS": self.executors, "BENCH_EXECUTOR_SECONDS": self.executor_seconds,
            "BENCH_DRAIN_SECONDS": self.drain_seconds, "BENCH_WARMUP_SECONDS": self.warmup_seconds,
            "BENCH_BROKER_WARMUP_SECONDS": self.broker_warmup_seconds,
            "BENCH_ANALYZE_AFTER_WARMUP": u8::from(self.analyze_after_warmup),
            "BENCH_TICKETS": self.tickets,
            "BENCH_TICKET_CONCURRENCY": self.ticket_concurrency, "BENCH_TICKET_LATENCY_MS": self.ticket_latency_ms,
            "BENCH_TICKET_PROVIDER_IN_FLIGHT": self.ticket_provider_in_flight,
            "BENCH_TICKET_PROVIDER_PER_SECOND": self.ticket_provider_per_second,
            "BENCH_BACKLOG_WAITING": self.backlog_waiting, "BENCH_BACKLOG_FINISHED": self.backlog_finished,
            "BENCH_BACKLOG_SECONDS": self.backlog_seconds,
            "BENCH_ADMISSION_RATE": self.admission_rate, "BENCH_ADMISSION_BURST": self.admission_burst,
            "BENCH_ADMISSION_OFFERED": self.admission_offered, "BENCH_ADMISSION_SECONDS": self.admission_seconds,
        })
    }
}

/// The services, each of which the benchmark gives a database of its own on the
/// same server (they never read each other's schemas), so that Postgres counts the
/// commits of each apart.
const SERVICES: [&str; 4] = ["intake", "scheduler", "executor", "reconciler"];

/// A running system for the benchmark: intake, scheduler, reconciler and
/// `executors` executors as processes, with the services' documented defaults (not
/// the test suites' short timings), and a token of the benchmark's tenant.
struct Bench {
    system: System,
    token: String,
    /// A connection to the server's maintenance database, to read statistics
    /// without committing in the measured ones.
    admin: sqlx::PgPool,
    /// Each service's database (name, pool); intake's is the system's own.
    databases: HashMap<&'static str, (String, sqlx::PgPool)>,
    /// Whether the system has carried load before ([`warm_up`]).
    warmed: bool,
}

/// Intake's admission settings in the scenarios that measure the rest of the
/// system: no tenant rate the offered load could reach.
fn unlimited_admission() -> Vec<(&'static str, String)> {
    vec![
        ("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND", "1000000".into()),
        ("FENCELINE_INTAKE_TENANT_BURST", "1000000".into()),
        ("FENCELINE_INTAKE_MAX_IN_FLIGHT", "100000".into()),
    ]
}

impl Bench {
    async fn start(executors: u64, caps: Caps, limits: (u32, f64)) -> Self {
        Self::start_admitting(executors, caps, limits, unlimited_admission()).await
    }

    /// As [`Bench::start`], with intake's admission settings `admission`.
    async fn start_admitting(
        executors: u64,
        caps: Caps,
        limits: (u32, f64),
        admission: Vec<(&'static str, String)>,
    ) -> Self {
        let mut system = System::new(&[(PROVIDER, caps)]).await;
        system.set_kinds(json!({
            ONE_STEP: {"steps": [{"name": "render", "provider": PROVIDER}],
                       "max_attempts": 4, "attempt_budget_ms": 120_000},
            THREE_STEP: {"steps": [{"name": "classify", "provider": PROVIDER},
                                   {"name": "draft", "provider": PROVIDER},
                                   {"name": "reply", "provider": PROVIDER}],
                         "max_attempts": 4, "attempt_budget_ms": 120_000}
        }));
        system.set_provider_limits(PROVIDER, limits.0, limits.1, limits.1);
        // The documented defaults, not the suites' short leases and polls.
        system.env.retain(|(name, _)| {
            matches!(
                *name,
                "FENCELINE_DATABASE_URL" | "FENCELINE_KAFKA_BROKERS" | "FENCELINE_TOPIC_PREFIX" | "FENCELINE_CATALOG"
            )
        });
        system.env.push(("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())));
        // A service setting to try against the defaults: `BENCH_ENV_<NAME>=value`
        // gives every service `<NAME>=value`.
        for (name, value) in std::env::vars() {
            if let Some(name) = name.strip_prefix("BENCH_ENV_") {
                system.env.push((Box::leak(name.to_owned().into_boxed_str()), value));
            }
        }
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&fenceline_tests::admin_database_url())
            .await
            .expect("the maintenance database");
        let (server, intake_db) = system.url.rsplit_once('/').map(|(a, b)| (a.to_owned(), b.to_owned())).expect("URL");
        let mut databases = HashMap::new();
        for service in SERVICES {
            let name = if service == "intake" { intake_db.clone() } else { format!("{intake_db}_{service}") };
            if service != "intake" {
                sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.expect("a service's database");
            }
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(3)
                .connect(&format!("{server}/{name}"))
                .await
                .expect("a service's database");
            databases.insert(service, (name, pool));
        }
        let url_of = |service: &str| ("FENCELINE_DATABASE_URL", format!("{server}/{}", databases[service].0));
        let mut intake = vec![url_of("intake"), ("FENCELINE_INTAKE_KINDS", format!("{ONE_STEP},{THREE_STEP}"))];
        intake.extend(admission);
        system.spawn("intake", "intake", &intake).await;
        system.spawn("scheduler", "scheduler", &[url_of("scheduler")]).await;
        system.spawn("reconciler", "reconciler", &[url_of("reconciler")]).await;
        for n in 1..=executors {
            system.spawn(&format!("executor-{n}"), "executor", &[url_of("executor")]).await;
        }
        let token = system.token(TENANT).await;
        Self { system, token, admin, databases, warmed: false }
    }

    /// The pool of a service's database.
    fn pool(&self, service: &str) -> &sqlx::PgPool {
        &self.databases[service].1
    }

    /// A system whose provider answers at once, without limits in the catalogue.
    async fn unlimited(executors: u64) -> Self {
        Self::start(executors, Caps::default(), (1_000_000, 1_000_000.0)).await
    }

    /// As [`Bench::unlimited`], every service given `settings` besides.
    async fn unlimited_with(executors: u64, settings: &[(&'static str, String)]) -> Self {
        let mut env = unlimited_admission();
        env.extend(settings.iter().cloned());
        Self::start_admitting(executors, Caps::default(), (1_000_000, 1_000_000.0), env).await
    }

    fn target(&self, kind: &str) -> Target {
        Target {
            base: self.system.url_of("intake"),
            token: self.token.clone(),
            kind: kind.to_owned(),
            tag: uuid::Uuid::now_v7().simple().to_string(),
        }
    }

    fn watched(&mut self) -> Vec<Watched> {
        let mut watched: Vec<Watched> = self
            .system
            .services
            .iter()
            .map(|(name, proc)| Watched {
                name: name.clone(),
                pid: proc.pid(),
                with_children: false,
                postgres_client: true,
            })
            .collect();
        for (name, provider) in &self.system.providers {
            watched.push(Watched {
                name: format!("fake-provider {name}"),
                pid: provider.proc.pid(),
                with_children: false,
                postgres_client: false,
            });
        }
        watched.extend(probe::infrastructure());
        watched
    }

    async fn snapshot(&self) -> Snapshot {
        let mut commits = HashMap::new();
        let mut rows = HashMap::new();
        let mut scanned = HashMap::new();
        for service in SERVICES {
            let (name, pool) = &self.databases[service];
            commits.insert(service, probe::commits(&self.admin, name).await);
            let (written, read) = probe::row_counts(pool, service).await;
            rows.insert(service, written);
            scanned.insert(service, read);
        }
        Snapshot {
            at_us: load::unix_us(),
            commits,
            kafka: probe::kafka_records(self.system.brokers.clone(), self.system.prefix.clone()).await,
            rows,
            scanned,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Snapshot {
    at_us: i64,
    /// Per service: transactions committed in its database.
    commits: HashMap<&'static str, i64>,
    /// Records written to the system's topics and delivered to its groups.
    kafka: probe::KafkaRecords,
    /// Per service: rows written in its schema.
    rows: HashMap<&'static str, i64>,
    /// Per service: rows its sequential scans read.
    scanned: HashMap<&'static str, i64>,
}

/// p50, p99 and p99.9 of `values` (milliseconds) and how many there were.
fn percentiles(mut values: Vec<f64>) -> Value {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        if values.is_empty() {
            Value::Null
        } else {
            json!(round(values[(((values.len() - 1) as f64) * q).round() as usize], 2))
        }
    };
    json!({"p50": at(0.50), "p99": at(0.99), "p99_9": at(0.999), "n": values.len()})
}

/// One measured period on a running system, and what it showed.
async fn measure(bench: &mut Bench, kind: &str, pace: PaceSpec, seconds: u64, settings: &Settings) -> Value {
    if !bench.warmed {
        warm_up(bench, kind, settings).await;
    }
    let target = bench.target(kind);
    let finished = Arc::new(AtomicU64::new(0));
    let monitor_queries = Arc::new(AtomicU64::new(0));
    let stop_counting = tokio_util::sync::CancellationToken::new();
    let (told, accepted) = tokio::sync::mpsc::unbounded_channel();
    let counter = tokio::spawn(load::count_finished(
        bench.pool("intake").clone(),
        accepted,
        finished.clone(),
        monitor_queries.clone(),
        stop_counting.clone(),
    ));
    let pace = match pace {
        PaceSpec::Open(rate) => Pace::Open { rate: rate as f64 },
        PaceSpec::Window(in_flight) => Pace::Window { in_flight, finished: finished.clone() },
    };
    // The first part of the period warms up; throughput and the grant rate come from
    // the rest. Costs per task (commits, records, rows, CPU) come from the whole run,
    // from before the first submission until every task finished (or the drain
    // limit), divided by the tasks that finished: a window shorter than a task's way
    // through the system would count work on tasks it does not see finish.
    let warmup = (seconds as f64 / 4.0).min(5.0);
    let clients = match pace {
        Pace::Open { rate } => (rate / 10.0).clamp(4.0, settings.clients as f64) as usize,
        Pace::Window { .. } => settings.clients as usize,
    };
    let counting_statements = probe::reset_statements(&bench.admin).await;
    let whole_first = bench.snapshot().await;
    let queries_whole_first = monitor_queries.load(Ordering::Relaxed);
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn(probe::sample_until(bench.watched(), probe::postgres_port(), stop_sampling.clone()));
    let driving = {
        let (target, pace) = (target.clone(), pace.clone());
        tokio::task::spawn_blocking(move || load::drive(&target, &pace, seconds as f64, u64::MAX, clients, Some(told)))
    };
    tokio::time::sleep(Duration::from_secs_f64(warmup)).await;
    let first = bench.snapshot().await;
    let submissions: Vec<Submission> = driving.await.unwrap_or_default();
    let last = bench.snapshot().await;
    let accepted = submissions.iter().filter(|s| s.accepted).count() as u64;
    // Drain: wait until every accepted task succeeded, within the limit.
    let drain_until = tokio::time::Instant::now() + Duration::from_secs(settings.drain_seconds);
    while finished.load(Ordering::Relaxed) < accepted && tokio::time::Instant::now() < drain_until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop_counting.cancel();
    let _ = counter.await;
    // Busy backends report their counts about every second.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let whole_last = bench.snapshot().await;
    let own_queries = monitor_queries.load(Ordering::Relaxed) - queries_whole_first;
    let mut statements = HashMap::new();
    if counting_statements {
        for service in SERVICES {
            statements.insert(service, probe::statements(&bench.admin, &bench.databases[service].0, 10).await);
        }
    }
    stop_sampling.cancel();
    let usage = sampler.await.unwrap_or_default();
    let whole = Whole { first: &whole_first, last: &whole_last, own_queries, usage: &usage };
    let mut figures = figures(bench, &target, &submissions, &first, &last, &whole).await;
    // The statements each service ran, per finished task: all of them, and those
    // that took the most of the server's time (calls and milliseconds per task).
    let tasks = figures["finished"].as_f64().unwrap_or(0.0).max(1.0);
    let mut top = serde_json::Map::new();
    let mut totals = serde_json::Map::new();
    let mut trips = serde_json::Map::new();
    let mut without_statement = serde_json::Map::new();
    for (service, mut ran) in statements {
        // The benchmark's own counting queries run in intake's database.
        if service == "intake" {
            ran.calls -= own_queries as i64;
        }
        // Round trips counted at the service's own connections (every instance's),
        // less the statements its database ran: what is left is mostly the pool's
        // pings (sqlx's `Sync` on every checkout and release), which no server
        // counter sees.
        let sent: Option<u64> = usage
            .iter()
            .filter(|(name, _)| service_of(name) == Some(service))
            .map(|(_, u)| u.postgres_round_trips)
            .sum();
        if let Some(sent) = sent {
            trips.insert(service.to_owned(), json!(round(sent as f64 / tasks, 2)));
            without_statement
                .insert(service.to_owned(), json!(round((sent as f64 - ran.calls as f64).max(0.0) / tasks, 2)));
        }
        let listed: Vec<Value> = ran
            .top
            .into_iter()
            .map(|(calls, ms, query)| json!([round(calls as f64 / tasks, 2), round(ms / tasks, 4), query]))
            .collect();
        top.insert(service.to_owned(), Value::Array(listed));
        totals.insert(
            service.to_owned(),
            json!({"calls": round(ran.calls as f64 / tasks, 1), "exec_ms": round(ran.exec_ms / tasks, 3)}),
        );
    }
    figures["statements_per_task"] = Value::Object(totals);
    if !trips.is_empty() {
        figures["postgres_round_trips_per_task"] = Value::Object(trips);
        figures["postgres_round_trips_without_statement_per_task"] = Value::Object(without_statement);
    }
    figures["top_statements_per_task"] = Value::Object(top);
    figures
}

/// The service a watched process is an instance of (`executor-2` is an executor).
fn service_of(process: &str) -> Option<&'static str> {
    SERVICES.into_iter().find(|s| process == *s || process.strip_prefix(s).is_some_and(|rest| rest.starts_with('-')))
}

/// The whole run's counts, for the costs per task.
struct Whole<'a> {
    first: &'a Snapshot,
    last: &'a Snapshot,
    /// The benchmark's own counting queries in intake's database meanwhile.
    own_queries: u64,
    usage: &'a HashMap<String, probe::Usage>,
}

#[derive(Debug, Clone, Copy)]
enum PaceSpec {
    Open(u64),
    Window(u64),
}

async fn figures(
    bench: &Bench,
    target: &Target,
    submissions: &[Submission],
    first: &Snapshot,
    last: &Snapshot,
    whole: &Whole<'_>,
) -> Value {
    let grants = probe::grants(bench.pool("reconciler")).await;
    let succeeded = probe::succeeded(bench.pool("intake")).await;
    let mut first_call: HashMap<String, i64> = HashMap::new();
    for call in probe::calls(bench.system.provider(PROVIDER)).await {
        let at = first_call.entry(call.tag).or_insert(i64::MAX);
        *at = (*at).min(call.received_at_us);
    }
    let (mut answered, mut granted, mut called, mut done) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut ways = Vec::new();
    let mut in_window = 0u64;
    let mut unfinished = 0u64;
    for s in submissions.iter().filter(|s| s.accepted) {
        let ms = |at: i64| (at - s.due_us) as f64 / 1e3;
        answered.push(ms(s.answered_us));
        let id = s.task_id.clone().unwrap_or_default();
        if let Some(at) = grants.get(&id) {
            granted.push(ms(*at));
        }
        let call = first_call.get(&format!("{}-{}", target.tag, s.index)).copied();
        if let Some(at) = call {
            called.push(ms(at));
        }
        ways.push((id.clone(), s.due_us, call));
        match succeeded.get(&id) {
            Some(at) => {
                done.push(ms(*at));
                if (first.at_us..=last.at_us).contains(at) {
                    in_window += 1;
                }
            }
            None => unfinished += 1,
        }
    }
    let grants_in_window = submissions
        .iter()
        .filter_map(|s| grants.get(s.task_id.as_deref().unwrap_or_default()))
        .filter(|at| (first.at_us..=last.at_us).contains(*at))
        .count();
    let mut instants = way::instants(
        grants,
        |service| bench.pool(service).clone(),
        bench.system.brokers.clone(),
        bench.system.prefix.clone(),
    )
    .await;
    if target.kind != ONE_STEP {
        // The reconciler keeps an attempt's last call intent, not its first step's.
        instants.remove("intent");
    }
    let hops = way::hops(&ways, &instants, percentiles);
    let window_s = (last.at_us - first.at_us) as f64 / 1e6;
    let finished = done.len() as u64;
    let per_task = |value: f64| if finished == 0 { Value::Null } else { json!(round(value / finished as f64, 2)) };
    let whole_s = (whole.last.at_us - whole.first.at_us) as f64 / 1e6;
    let mut rows = serde_json::Map::new();
    let mut scanned = serde_json::Map::new();
    let mut commits = serde_json::Map::new();
    let mut all_commits = 0.0;
    for service in SERVICES {
        let delta = |before: &HashMap<&'static str, i64>, after: &HashMap<&'static str, i64>| {
            (after.get(service).copied().unwrap_or(0) - before.get(service).copied().unwrap_or(0)) as f64
        };
        rows.insert(service.to_owned(), per_task(delta(&whole.first.rows, &whole.last.rows)));
        scanned.insert(service.to_owned(), per_task(delta(&whole.first.scanned, &whole.last.scanned)));
        // The benchmark's own counting queries run in intake's database.
        let own = if service == "intake" { whole.own_queries as f64 } else { 0.0 };
        let committed = delta(&whole.first.commits, &whole.last.commits) - own;
        all_commits += committed;
        commits.insert(service.to_owned(), per_task(committed));
    }
    json!({
        "accepted": submissions.iter().filter(|s| s.accepted).count(),
        "refused": submissions.iter().filter(|s| !s.accepted).count(),
        "unfinished": unfinished,
        "submitted_per_s": round(
            submissions.len() as f64 / ((submissions.last().map_or(0, |s| s.due_us) - submissions.first().map_or(0, |s| s.due_us)) as f64 / 1e6).max(1e-9), 1),
        "throughput_per_s": round(in_window as f64 / window_s.max(1e-9), 1),
        "grants_per_s": round(grants_in_window as f64 / window_s.max(1e-9), 1),
        "latency_ms": {
            "submit_answered": percentiles(answered),
            "submit_to_grant": percentiles(granted),
            "submit_to_provider_call": percentiles(called),
            "submit_to_succeeded": percentiles(done),
        },
        "hops_ms": hops,
        "postgres_commits_per_task": per_task(all_commits),
        "postgres_commits_per_task_by_service": commits,
        "kafka_records_per_task": per_task((whole.last.kafka.written - whole.first.kafka.written) as f64),
        "kafka_records_delivered_per_task": per_task((whole.last.kafka.delivered - whole.first.kafka.delivered) as f64),
        "row_writes_per_task": rows,
        "rows_read_by_sequential_scans_per_task": scanned,
        "processes": probe::usage_json(whole.usage, whole_s, finished),
        "finished": finished,
        "window_s": round(window_s, 1),
        "whole_run_s": round(whole_s, 1),
        "load_average": crate::load_average(),
    })
}

fn line(label: &str, f: &Value) {
    let l = &f["latency_ms"];
    let p = |stage: &str, q: &str| l[stage][q].as_f64().map_or("-".to_owned(), |v| format!("{v:.1}"));
    println!(
        "  {label:<24} {:>7} tasks/s  submit p50/p99/p99.9 {}/{}/{} ms  grant {}/{}/{}  call {}/{}/{}  succeeded {}/{}/{}  \
         commits/task {}  records/task {}  unfinished {}",
        f["throughput_per_s"],
        p("submit_answered", "p50"),
        p("submit_answered", "p99"),
        p("submit_answered", "p99_9"),
        p("submit_to_grant", "p50"),
        p("submit_to_grant", "p99"),
        p("submit_to_grant", "p99_9"),
        p("submit_to_provider_call", "p50"),
        p("submit_to_provider_call", "p99"),
        p("submit_to_provider_call", "p99_9"),
        p("submit_to_succeeded", "p50"),
        p("submit_to_succeeded", "p99"),
        p("submit_to_succeeded", "p99_9"),
        f["postgres_commits_per_task"],
        f["kafka_records_per_task"],
        f["unfinished"],
    );
    println!("    hops p50 (p99) ms: {}", way::line(&f["hops_ms"]));
    costs(f);
}

/// What a finished task cost, counted (docs/performance.md, "What a task costs,
/// counted"): Postgres statements, round trips, commits and row writes, Kafka
/// records, and per process the CPU, voluntary context switches and threads.
fn costs(f: &Value) {
    let sum = |field: &str, part: Option<&str>| {
        f[field].as_object().map_or("-".to_owned(), |by_service| {
            let total: f64 = by_service.values().filter_map(|v| part.map_or(v, |p| &v[p]).as_f64()).sum();
            format!("{total:.1}")
        })
    };
    let number = |v: &Value| v.as_f64().map_or("-".to_owned(), |v| format!("{v}"));
    println!(
        "    per task: statements {}  round trips {} ({} without a statement)  commits {}  row writes {}  \
         records written {} delivered {}",
        sum("statements_per_task", Some("calls")),
        sum("postgres_round_trips_per_task", None),
        sum("postgres_round_trips_without_statement_per_task", None),
        number(&f["postgres_commits_per_task"]),
        sum("row_writes_per_task", None),
        number(&f["kafka_records_per_task"]),
        number(&f["kafka_records_delivered_per_task"]),
    );
    let Some(processes) = f["processes"].as_object() else { return };
    let each = |field: &str| {
        processes.iter().map(|(name, p)| format!("{name} {}", number(&p[field]))).collect::<Vec<_>>().join(", ")
    };
    println!("    CPU ms per task: {}", each("cpu_ms_per_task"));
    println!("    voluntary context switches per task: {}", each("voluntary_ctx_switches_per_task"));
    println!("    threads (peak): {}", each("peak_threads"));
}

/// Runs `one` `settings.runs` times, printing each run and the median.
async fn repeated<F, Fut>(label: &str, settings: &Settings, mut one: F) -> Value
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Value>,
{
    let mut runs = Vec::new();
    for run in 1..=settings.runs {
        let figures = one(run).await;
        line(&format!("{label} run {run}"), &figures);
        runs.push(figures);
    }
    summarised(label, runs)
}

/// The runs and their median, printed.
fn summarised(label: &str, runs: Vec<Value>) -> Value {
    let median = median_of(&runs);
    line(&format!("{label} median"), &median);
    json!({"median": median, "runs": runs})
}

/// Sustained end-to-end throughput of each kind: a closed loop holding
/// `BENCH_WINDOW` tasks between submit and `succeeded` for `BENCH_SECONDS`.
pub async fn throughput(settings: &Settings) -> Value {
    let mut out = serde_json::Map::new();
    for kind in [ONE_STEP, THREE_STEP] {
        let figures = repeated(kind, settings, |_| async {
            let mut bench = Bench::unlimited(1).await;
            measure(&mut bench, kind, PaceSpec::Window(settings.window), settings.seconds, settings).await
        })
        .await;
        out.insert(kind.to_owned(), figures);
    }
    Value::Object(out)
}

/// Service settings against the defaults, in the same run: the closed loop of
/// [`throughput`] for each kind, runs alternating between the defaults and the
/// settings of `BENCH_TRY` (`NAME=value` pairs separated by spaces), so that the
/// machine's drift touches both alike; prints both medians and their ratio.
pub async fn settings_tried(settings: &Settings) -> Value {
    let tried: Vec<(&'static str, String)> = std::env::var("BENCH_TRY")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(name, value)| (&*Box::leak(name.to_owned().into_boxed_str()), value.to_owned()))
        .collect();
    if tried.is_empty() {
        println!("  BENCH_TRY names no setting (NAME=value ...); nothing to compare");
        return Value::Null;
    }
    let mut out = serde_json::Map::new();
    out.insert("tried".into(), json!(tried.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>()));
    for kind in [ONE_STEP, THREE_STEP] {
        let (mut defaults, mut with) = (Vec::new(), Vec::new());
        for run in 1..=settings.runs {
            // Which goes first alternates too.
            for tried_now in if run % 2 == 1 { [false, true] } else { [true, false] } {
                let mut bench = Bench::unlimited_with(1, if tried_now { &tried } else { &[] }).await;
                let figures =
                    measure(&mut bench, kind, PaceSpec::Window(settings.window), settings.seconds, settings).await;
                let label = if tried_now { "tried" } else { "defaults" };
                line(&format!("{kind} {label} run {run}"), &figures);
                if tried_now { with.push(figures) } else { defaults.push(figures) }
            }
        }
        let (defaults, with) =
            (summarised(&format!("{kind} defaults"), defaults), summarised(&format!("{kind} tried"), with));
        let rate = |v: &Value| v["median"]["throughput_per_s"].as_f64().unwrap_or(0.0);
        let ratio = round(rate(&with) / rate(&defaults).max(1e-9), 3);
        println!("  {kind}: tried / defaults = {ratio}");
        out.insert(kind.to_owned(), json!({"defaults": defaults, "tried": with, "throughput_ratio": ratio}));
    }
    Value::Object(out)
}

/// Latency at fixed offered loads (open loop) of the one-step kind, and at
/// saturation (the closed loop of [`throughput`]).
pub async fn loads(settings: &Settings) -> Value {
    let mut out = serde_json::Map::new();
    for rate in &settings.loads {
        let figures = repeated(&format!("{rate} tasks/s"), settings, |_| async {
            let mut bench = Bench::unlimited(1).await;
            measure(&mut bench, ONE_STEP, PaceSpec::Open(*rate), settings.load_seconds, settings).await
        })
        .await;
        out.insert(rate.to_string(), figures);
    }
    let figures = repeated("saturation", settings, |_| async {
        let mut bench = Bench::unlimited(1).await;
        measure(&mut bench, ONE_STEP, PaceSpec::Window(settings.window), settings.load_seconds, settings).await
    })
    .await;
    out.insert("saturation".into(), figures);
    Value::Object(out)
}

/// Throughput with 1, 2 and 4 executor processes.
pub async fn executors(settings: &Settings) -> Value {
    let mut out = serde_json::Map::new();
    for count in &settings.executors {
        let figures = repeated(&format!("{count} executor(s)"), settings, |_| async {
            let mut bench = Bench::unlimited(*count).await;
            measure(&mut bench, ONE_STEP, PaceSpec::Window(settings.window), settings.executor_seconds, settings).await
        })
        .await;
        out.insert(count.to_string(), figures);
    }
    Value::Object(out)
}

/// The peers, each on the same machine in the same run, runs of each alternating
/// so that the machine's drift touches them alike (`BENCH_PEERS`, by default all
/// three): pgqueuer on the same Postgres server (a database of its own) doing the
/// same no-op work with the same window of jobs in flight; and the durable execution
/// engines a user would pick instead of Fenceline, doing its one-step job against a
/// fake provider of their own that dedupes by `Idempotency-Key`: DBOS Transact (its
/// system database on the same server) and Temporal's development server (SQLite).
/// Each is run by its script under tests/python/bench/ in the venv the stack script
/// manages. pgqueuer's figures stay at the top (`median`, `runs`), each engine's
/// under its name.
pub async fn peer(settings: &Settings) -> Value {
    let Ok(python) = std::env::var("FENCELINE_BENCH_PYTHON") else {
        println!("  FENCELINE_BENCH_PYTHON is not set: run through deploy/local/stack bench");
        return Value::Null;
    };
    let peers: Vec<String> = std::env::var("BENCH_PEERS")
        .unwrap_or_else(|_| PEERS.join(","))
        .split(',')
        .map(|p| p.trim().to_owned())
        .filter(|p| PEERS.contains(&p.as_str()))
        .collect();
    let mut runs: HashMap<&str, Vec<Value>> = HashMap::new();
    for run in 1..=settings.runs {
        for peer in PEERS.into_iter().filter(|p| peers.iter().any(|wanted| wanted.as_str() == *p)) {
            let figures = if peer == "pgqueuer" {
                pgqueuer_run(&python, settings).await
            } else {
                durable_peer_run(&python, peer, settings).await
            };
            let Some(figures) = figures else { continue };
            if peer == "pgqueuer" {
                pgqueuer_line(run, &figures);
            } else {
                durable_peer_line(&format!("{peer} run {run}"), &figures);
            }
            runs.entry(peer).or_default().push(figures);
        }
    }
    let mut out = serde_json::Map::new();
    for peer in PEERS {
        let Some(runs) = runs.remove(peer) else { continue };
        let median = median_of(&runs);
        if peer == "pgqueuer" {
            println!("  pgqueuer median: {:.1} jobs/s", median["sustained_per_s"].as_f64().unwrap_or(0.0));
            out.insert("median".into(), median);
            out.insert("runs".into(), Value::Array(runs));
        } else {
            durable_peer_line(&format!("{peer} median"), &median);
            out.insert(peer.to_owned(), json!({"median": median, "runs": runs}));
        }
    }
    if out.is_empty() { Value::Null } else { Value::Object(out) }
}

/// The peers the `peer` scenario knows, in the order each round runs them.
pub const PEERS: [&str; 3] = ["pgqueuer", "dbos", "temporal"];

/// One run of pgqueuer on a database of its own.
async fn pgqueuer_run(python: &str, settings: &Settings) -> Option<Value> {
    let dsn = fenceline_tests::fresh_database().await;
    let args = vec![
        "--dsn".to_owned(),
        dsn,
        "--seconds".into(),
        settings.seconds.to_string(),
        "--clients".into(),
        settings.clients.min(16).to_string(),
        "--window".into(),
        settings.window.to_string(),
    ];
    let mut watched = probe::infrastructure();
    watched.retain(|w| w.name == "postgres");
    peer_script(python, "pgqueuer", "pgqueuer (clients and worker)", &args, watched, settings).await
}

/// One run of a durable engine (`dbos` or `temporal`) doing the one-step job against
/// a fake provider of its own that dedupes by `Idempotency-Key`.
async fn durable_peer_run(python: &str, peer: &str, settings: &Settings) -> Option<Value> {
    let port = fenceline_tests::process::free_port();
    let provider = fenceline_tests::process::Proc::spawn(
        &fenceline_tests::system::host_binary(),
        &["fake-provider"],
        &[
            ("FENCELINE_HTTP_ADDR", format!("127.0.0.1:{port}")),
            ("FAKE_PROVIDER_IDEMPOTENCY_KEYS", "true".into()),
            ("RUST_LOG", "warn".into()),
        ],
    );
    let mut args = vec![
        "--provider".to_owned(),
        format!("http://127.0.0.1:{port}"),
        "--seconds".into(),
        settings.seconds.to_string(),
        "--clients".into(),
        settings.clients.min(16).to_string(),
        "--window".into(),
        settings.window.to_string(),
    ];
    let mut watched = vec![Watched {
        name: format!("fake-provider {peer}"),
        pid: provider.pid(),
        with_children: false,
        postgres_client: false,
    }];
    if peer == "dbos" {
        // Its system database: a database of its own on the benchmark's Postgres.
        args.extend(["--dsn".to_owned(), fenceline_tests::fresh_database().await]);
        watched.extend(probe::infrastructure().into_iter().filter(|w| w.name == "postgres"));
    }
    let label = if peer == "dbos" { "dbos (clients and workers)" } else { "temporal (server, clients and worker)" };
    let figures = peer_script(python, peer, label, &args, watched, settings).await;
    drop(provider);
    figures
}

/// Runs tests/python/bench/<peer>_peer.py with `args`, sampling `watched` and the
/// script's own process tree (as `label`); its figures are the last JSON line it
/// printed, with the processes' usage per task and the load average added.
async fn peer_script(
    python: &str,
    peer: &str,
    label: &str,
    args: &[String],
    mut watched: Vec<Watched>,
    settings: &Settings,
) -> Option<Value> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("python/bench/{peer}_peer.py"));
    let child = tokio::process::Command::new(python)
        .arg(&script)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn();
    let Ok(child) = child else {
        println!("  {python} did not start");
        return None;
    };
    if let Some(pid) = child.id() {
        watched.push(Watched { name: label.into(), pid, with_children: true, postgres_client: peer != "temporal" });
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let sampler = tokio::spawn(probe::sample_until(watched, probe::postgres_port(), stop.clone()));
    let output = child.wait_with_output().await;
    stop.cancel();
    let usage = sampler.await.unwrap_or_default();
    let output = output.ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let Some(mut figures) = text.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok()) else {
        println!("  {peer} printed no figures: {text}");
        return None;
    };
    let done = figures["done"].as_u64().unwrap_or(0);
    figures["processes"] = probe::usage_json(&usage, settings.seconds as f64, done);
    figures["load_average"] = json!(crate::load_average());
    Some(figures)
}

fn pgqueuer_line(run: u64, figures: &Value) {
    println!(
        "  pgqueuer run {run}: {:.1} jobs/s  enqueue p50/p99 {}/{} ms  end to end p50/p99/p99.9 {}/{}/{} ms  commits/job {:.2}",
        figures["sustained_per_s"].as_f64().unwrap_or(0.0),
        figures["enqueue_ms"]["p50"],
        figures["enqueue_ms"]["p99"],
        figures["end_to_end_ms"]["p50"],
        figures["end_to_end_ms"]["p99"],
        figures["end_to_end_ms"]["p999"],
        figures["commits_per_job"].as_f64().unwrap_or(0.0),
    );
}

/// A durable engine's line: tasks a second, p50/p99 from submission to the provider's
/// call and to the final state, and the settings it ran with.
pub fn durable_peer_line(label: &str, f: &Value) {
    let l = &f["latency_ms"];
    let p = |stage: &str, q: &str| l[stage][q].as_f64().map_or("-".to_owned(), |v| format!("{v:.0}"));
    println!(
        "  {label:<16} {:>6.1} tasks/s  submit to provider call p50/p99 {}/{} ms  to final state p50/p99 {}/{} ms  \
         unfinished {:.0}  [{}]",
        f["sustained_per_s"].as_f64().unwrap_or(0.0),
        p("submit_to_provider_call", "p50"),
        p("submit_to_provider_call", "p99"),
        p("submit_to_final_state", "p50"),
        p("submit_to_final_state", "p99"),
        f["unfinished"].as_f64().unwrap_or(0.0),
        f["settings"].as_str().unwrap_or("?"),
    );
}

/// 30 support tickets through the three-step kind against a provider that lets 2
/// calls run at once and a few start per second (answering 429 beyond), with the
/// catalogue offering it 2 and then 8 calls at once: the 429s its log shows, the
/// time to finish them all, and that none was lost or charged twice.
pub async fn tickets(settings: &Settings) -> Value {
    let mut out = serde_json::Map::new();
    for concurrency in &settings.ticket_concurrency {
        let mut runs = Vec::new();
        for run in 1..=settings.runs {
            let caps = Caps { idempotency_keys: true, lookup: true, async_results: false };
            // The catalogue's rate is generous: only its concurrency is being compared.
            let bench = Bench::start(1, caps, (*concurrency as u32, 50.0)).await;
            let provider = bench.system.provider(PROVIDER);
            provider
                .rule(json!({"max_in_flight": settings.ticket_provider_in_flight,
                             "max_per_second": settings.ticket_provider_per_second, "retry_after_s": 1}))
                .await;
            provider.rule(json!({"latency_ms": settings.ticket_latency_ms})).await;
            let target = bench.target(THREE_STEP);
            let count = settings.tickets;
            let submitted = {
                let target = target.clone();
                tokio::task::spawn_blocking(move || {
                    load::drive(&target, &Pace::Open { rate: 1000.0 }, 10.0, count, 4, None)
                })
                .await
                .unwrap_or_default()
            };
            let started = submitted.first().map_or(load::unix_us(), |s| s.due_us);
            let ids: Vec<String> = submitted.iter().filter_map(|s| s.task_id.clone()).collect();
            let until = tokio::time::Instant::now() + Duration::from_secs(settings.drain_seconds.max(180));
            let mut finished = HashMap::new();
            while tokio::time::Instant::now() < until {
                let succeeded = probe::succeeded(bench.pool("intake")).await;
                finished = ids.iter().filter_map(|id| succeeded.get(id).map(|at| (id.clone(), *at))).collect();
                if finished.len() == ids.len() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let calls = probe::calls(provider).await;
            let throttled = calls.iter().filter(|c| c.outcome == "status:429").count();
            let mut charges: HashMap<(String, String), u32> = HashMap::new();
            for call in calls.iter().filter(|c| c.charged) {
                *charges.entry((call.tag.clone(), call.operation.clone())).or_default() += 1;
            }
            let charged_twice = charges.values().filter(|n| **n > 1).count();
            let steps_charged = charges.len();
            let last = finished.values().copied().max().unwrap_or(started);
            let figures = json!({
                "tickets": count,
                "accepted": ids.len(),
                "succeeded": finished.len(),
                "lost": ids.len() - finished.len() + (count as usize - ids.len()),
                "provider_calls": calls.len(),
                "responses_429": throttled,
                "steps_charged": steps_charged,
                "steps_charged_twice": charged_twice,
                "completion_s": round((last - started) as f64 / 1e6, 2),
                "load_average": crate::load_average(),
            });
            println!(
                "  concurrency {concurrency} run {run}: {} of {} succeeded in {} s; {} calls, {} answered 429; \
                 {} steps charged, {} charged twice",
                figures["succeeded"],
                count,
                figures["completion_s"],
                figures["provider_calls"],
                throttled,
                steps_charged,
                charged_twice
            );
            runs.push(figures);
        }
        let median = median_of(&runs);
        println!(
            "  concurrency {concurrency} median: {} s, {} answered 429",
            median["completion_s"], median["responses_429"]
        );
        out.insert(concurrency.to_string(), json!({"median": median, "runs": runs}));
    }
    json!({
        "provider": {"max_in_flight": settings.ticket_provider_in_flight,
                     "max_per_second": settings.ticket_provider_per_second,
                     "latency_ms": settings.ticket_latency_ms, "retry_after_s": 1},
        "by_catalogue_concurrency": out,
    })
}

/// Submit latency and the grant rate at saturation on an empty system and on one
/// holding a backlog: `BENCH_BACKLOG_WAITING` tasks waiting (not due for a day,
/// taken in by the scheduler from the tasks topic) and `BENCH_BACKLOG_FINISHED`
/// finished tasks in every service's tables (rows of real finished tasks, copied
/// under new ids with SQL).
pub async fn backlog(settings: &Settings) -> Value {
    let empty = repeated("empty", settings, |_| async {
        let mut bench = Bench::unlimited(1).await;
        measure(&mut bench, ONE_STEP, PaceSpec::Window(settings.window), settings.backlog_seconds, settings).await
    })
    .await;
    let mut bench = Bench::unlimited(1).await;
    let began = std::time::Instant::now();
    let filled = fill_backlog(&bench, settings).await;
    println!("  backlog filled in {:.0} s: {filled}", began.elapsed().as_secs_f64());
    // The runs share the filled system (filling it again each time would take long).
    let mut runs = Vec::new();
    for run in 1..=settings.runs {
        let figures =
            measure(&mut bench, ONE_STEP, PaceSpec::Window(settings.window), settings.backlog_seconds, settings).await;
        line(&format!("backlog run {run}"), &figures);
        runs.push(figures);
    }
    let with_backlog = summarised("backlog", runs);
    json!({"empty": empty, "backlog": with_backlog, "filled": filled})
}

/// Carries `BENCH_BROKER_WARMUP_SECONDS` of saturated one-step load through a
/// system of its own, unmeasured, before the first scenario. The broker outlives
/// every system of a benchmark, and a fresh broker's JVM goes on compiling its hot
/// paths for minutes under load: 40 s into a first run its compiler thread took 8 %
/// of the machine, and over four runs of one build the broker's CPU a task fell from
/// 5.3 to 1.6 ms. A broker that has run for days has compiled them.
pub async fn warm_the_broker(settings: &Settings) {
    if settings.broker_warmup_seconds == 0 {
        return;
    }
    let mut bench = Bench::unlimited(1).await;
    // This system is thrown away: its own warm-up would only add time.
    bench.warmed = true;
    let figures =
        measure(&mut bench, ONE_STEP, PaceSpec::Window(settings.window), settings.broker_warmup_seconds, settings)
            .await;
    line("broker warm-up, not counted", &figures);
}

/// Runs `BENCH_WARMUP_SECONDS` of load (100 tasks/s offered) through a system
/// that has carried none, unmeasured, and waits until those tasks finished: a fresh
/// broker's JVM compiles its hot paths and a fresh Postgres fills its caches under
/// the first load, which would otherwise count in the first measurement's figures.
async fn warm_up(bench: &mut Bench, kind: &str, settings: &Settings) {
    bench.warmed = true;
    if settings.warmup_seconds == 0 {
        return;
    }
    let target = bench.target(kind);
    let seconds = settings.warmup_seconds as f64;
    let ids = submitted_ids(
        tokio::task::spawn_blocking(move || {
            load::drive(&target, &Pace::Open { rate: 100.0 }, seconds, u64::MAX, 10, None)
        })
        .await,
    );
    let finished = ["succeeded", "failed", "cancelled"];
    let limit = Duration::from_secs(settings.drain_seconds);
    wait_until_in(bench.pool("intake"), &ids, &finished, limit, Duration::from_millis(500)).await;
    // Statistics as a system that has been running has them. Tables created empty
    // a minute ago have grown a hundredfold since autovacuum last analyzed them (it
    // visits each database once a minute), and the services' prepared statements
    // keep plans made for a few hundred rows: sequential scans where an index would
    // read one row. `ANALYZE` invalidates those plans.
    if settings.analyze_after_warmup {
        analyze(bench).await;
    }
    println!("  warmed up: {} tasks in {seconds:.0} s", ids.len());
}

/// The ids of the tasks intake accepted, from what the load generator's thread
/// handed back (nothing if it panicked).
fn submitted_ids(driven: Result<Vec<Submission>, tokio::task::JoinError>) -> Vec<uuid::Uuid> {
    driven.unwrap_or_default().iter().filter_map(|s| s.task_id.as_deref()?.parse().ok()).collect()
}

/// Waits, polling every `poll`, until every task of `ids` is in one of `states` in
/// intake's read model, or `limit` passed.
async fn wait_until_in(intake: &sqlx::PgPool, ids: &[uuid::Uuid], states: &[&str], limit: Duration, poll: Duration) {
    let states: Vec<String> = states.iter().map(|s| (*s).to_owned()).collect();
    let until = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < until {
        let done: Result<i64, _> =
            sqlx::query_scalar("SELECT count(*) FROM intake.task_view WHERE state = ANY($2) AND task_id = ANY($1)")
                .bind(ids)
                .bind(&states)
                .fetch_one(intake)
                .await;
        if done.is_ok_and(|n| n >= ids.len() as i64) {
            return;
        }
        tokio::time::sleep(poll).await;
    }
}

/// Gathers fresh statistics of every service's tables.
async fn analyze(bench: &Bench) {
    for service in SERVICES {
        if let Err(e) = sqlx::query("ANALYZE").execute(bench.pool(service)).await {
            eprintln!("  ANALYZE of {service}'s database failed: {e}");
        }
    }
}

/// Fills a running system's tables with a backlog; returns what it wrote.
async fn fill_backlog(bench: &Bench, settings: &Settings) -> Value {
    let pool = bench.pool("intake");
    // Real finished tasks as templates, run through the whole system.
    let templates = 10u64;
    let template_target = bench.target(ONE_STEP);
    let ids = submitted_ids(
        tokio::task::spawn_blocking(move || {
            load::drive(&template_target, &Pace::Open { rate: 100.0 }, 5.0, templates, 2, None)
        })
        .await,
    );
    wait_until_in(pool, &ids, &["succeeded"], Duration::from_secs(60), Duration::from_millis(200)).await;
    // Let the reconciler and intake hear the last statuses.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let copies = (settings.backlog_finished / ids.len().max(1) as u64).max(1);
    let mut tables = serde_json::Map::new();
    for service in SERVICES {
        let pool = bench.pool(service);
        let owned: Vec<String> = sqlx::query_scalar(
            "SELECT c.table_name::text FROM information_schema.columns c \
             JOIN information_schema.tables t USING (table_schema, table_name) \
             WHERE c.column_name = 'task_id' AND t.table_type = 'BASE TABLE' AND c.table_schema = $1 \
               AND c.table_name <> 'outbox' ORDER BY 1",
        )
        .bind(service)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        for table in owned {
            let written = copy_rows(pool, service, &table, &ids, copies).await;
            tables.insert(format!("{service}.{table}"), written);
        }
    }
    // The waiting tasks come the way tasks come: through the tasks topic.
    let waiting = settings.backlog_waiting as usize;
    let later = Timestamp::now().0 + 86_400_000_000;
    bench
        .system
        .submit_many_with(TENANT, ONE_STEP, waiting, |_, accepted: &mut TaskAccepted| {
            accepted.not_before = Some(Timestamp(later));
        })
        .await;
    let until = tokio::time::Instant::now() + Duration::from_secs(600);
    let mut held = 0;
    while tokio::time::Instant::now() < until {
        held = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM scheduler.tasks WHERE due_at_us > $1")
            .bind(later - 1_000_000)
            .fetch_one(bench.pool("scheduler"))
            .await
            .unwrap_or(0);
        if held as usize >= waiting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // As autovacuum would, eventually.
    analyze(bench).await;
    json!({"finished_copies_of_each_template": copies, "templates": ids.len(), "rows": tables,
           "waiting_held_by_scheduler": held})
}

/// Copies the rows of `templates` in `schema.table` `copies` times under new ids:
/// every uuid becomes `md5(old || ':' || n)` (the same in every table, so a copied
/// task's rows still belong together), text in a unique index gets `:n` appended,
/// columns with a sequence default take the next value. Returns rows written, or
/// the error.
async fn copy_rows(pool: &sqlx::PgPool, schema: &str, table: &str, templates: &[uuid::Uuid], copies: u64) -> Value {
    let columns: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text, column_default::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = $2 AND is_generated = 'NEVER' ORDER BY ordinal_position",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let unique: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT a.attname::text FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
         WHERE i.indrelid = format('%I.%I', $1::text, $2::text)::regclass AND i.indisunique",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let mut names = Vec::new();
    let mut values = Vec::new();
    for (name, data_type, default) in &columns {
        if default.as_deref().is_some_and(|d| d.starts_with("nextval(")) {
            continue;
        }
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        let value = if data_type == "uuid" {
            format!("md5({quoted}::text || ':' || n)::uuid")
        } else if unique.contains(name) && (data_type == "text" || data_type == "character varying") {
            format!("{quoted} || ':' || n")
        } else {
            quoted.clone()
        };
        names.push(quoted);
        values.push(value);
    }
    let sql = format!(
        "INSERT INTO \"{schema}\".\"{table}\" ({}) SELECT {} FROM \"{schema}\".\"{table}\", generate_series(1, $2) AS n \
         WHERE task_id = ANY($1)",
        names.join(", "),
        values.join(", ")
    );
    match sqlx::query(&sql).bind(templates).bind(copies as i64).execute(pool).await {
        Ok(done) => json!(done.rows_affected()),
        Err(e) => json!(format!("not copied: {e}")),
    }
}

/// Load above a tenant's admitted rate: `BENCH_ADMISSION_OFFERED` submissions a
/// second (open loop) for `BENCH_ADMISSION_SECONDS` against intake limiting the
/// tenant to `BENCH_ADMISSION_RATE` a second with a bucket of
/// `BENCH_ADMISSION_BURST`. Counts what was admitted, refused (`429`, `503`) and
/// failed (`5xx`, no answer), the answer latency of each, and whether every
/// admitted task succeeded.
pub async fn admission(settings: &Settings) -> Value {
    let mut runs = Vec::new();
    for run in 1..=settings.runs {
        let limits = vec![
            ("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND", settings.admission_rate.to_string()),
            ("FENCELINE_INTAKE_TENANT_BURST", settings.admission_burst.to_string()),
        ];
        let bench = Bench::start_admitting(1, Caps::default(), (1_000_000, 1_000_000.0), limits).await;
        let target = bench.target(ONE_STEP);
        let pace = Pace::Open { rate: settings.admission_offered as f64 };
        let clients = (settings.admission_offered as f64 / 10.0).clamp(4.0, settings.clients as f64) as usize;
        let seconds = settings.admission_seconds as f64;
        let submissions =
            tokio::task::spawn_blocking(move || load::drive(&target, &pace, seconds, u64::MAX, clients, None))
                .await
                .unwrap_or_default();
        let latency = |wanted: &dyn Fn(u16) -> bool| {
            percentiles(
                submissions
                    .iter()
                    .filter(|s| wanted(s.status))
                    .map(|s| (s.answered_us - s.due_us) as f64 / 1e3)
                    .collect(),
            )
        };
        let count = |wanted: &dyn Fn(u16) -> bool| submissions.iter().filter(|s| wanted(s.status)).count();
        let admitted = count(&|s| s == 202);
        let ids: Vec<String> = submissions.iter().filter_map(|s| s.task_id.clone()).collect();
        // Every admitted task runs to the end.
        let drain_until = tokio::time::Instant::now() + Duration::from_secs(settings.drain_seconds);
        let mut succeeded = 0;
        while tokio::time::Instant::now() < drain_until {
            let done = probe::succeeded(bench.pool("intake")).await;
            succeeded = ids.iter().filter(|id| done.contains_key(*id)).count();
            if succeeded == ids.len() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let figures = json!({
            "offered": submissions.len(),
            "offered_per_s": round(submissions.len() as f64 / seconds, 1),
            "admitted": admitted,
            "admitted_per_s": round(admitted as f64 / seconds, 1),
            "refused_429": count(&|s| s == 429),
            "refused_503": count(&|s| s == 503),
            "server_errors_5xx": count(&|s| s >= 500 && s != 503),
            "no_answer": count(&|s| s == 0),
            "other": count(&|s| s != 0 && s != 202 && s != 429 && s < 500),
            "admitted_succeeded": succeeded,
            "latency_ms": {"admitted": latency(&|s| s == 202), "refused": latency(&|s| s == 429 || s == 503)},
            "load_average": crate::load_average(),
        });
        let l = &figures["latency_ms"];
        println!(
            "  run {run}: offered {} ({}/s), admitted {} ({}/s), refused 429 {} 503 {}, 5xx {}, no answer {}, \
             admitted p50/p99/p99.9 {}/{}/{} ms, refused p50/p99 {}/{} ms, admitted tasks succeeded {}/{}",
            figures["offered"],
            figures["offered_per_s"],
            admitted,
            figures["admitted_per_s"],
            figures["refused_429"],
            figures["refused_503"],
            figures["server_errors_5xx"],
            figures["no_answer"],
            l["admitted"]["p50"],
            l["admitted"]["p99"],
            l["admitted"]["p99_9"],
            l["refused"]["p50"],
            l["refused"]["p99"],
            succeeded,
            admitted,
        );
        runs.push(figures);
    }
    let median = median_of(&runs);
    println!("  median: {median}");
    json!({"median": median, "runs": runs})
}

/// Fenceline's one-step kind and every peer as this run measured them (medians), one
/// line each: tasks a second, and p50/p99 from submission to the provider's call and
/// to the final state.
pub fn side_by_side(report: &Value) {
    println!("\n== side by side: medians of this run (load average now {})", crate::load_average());
    let fenceline = &report["throughput"][ONE_STEP]["median"];
    if let Some(rate) = fenceline["throughput_per_s"].as_f64() {
        let l = &fenceline["latency_ms"];
        let p = |stage: &str, q: &str| l[stage][q].as_f64().map_or("-".to_owned(), |v| format!("{v:.0}"));
        println!(
            "  fenceline        {rate:>6.1} tasks/s  submit to provider call p50/p99 {}/{} ms  to final state p50/p99 \
             {}/{} ms  unfinished {:.0}  [Fenceline, 1 executor, {} tasks in flight]",
            p("submit_to_provider_call", "p50"),
            p("submit_to_provider_call", "p99"),
            p("submit_to_succeeded", "p50"),
            p("submit_to_succeeded", "p99"),
            fenceline["unfinished"].as_f64().unwrap_or(0.0),
            report["settings"]["BENCH_WINDOW"],
        );
    }
    let peer = &report["peer"];
    if let Some(rate) = peer["median"]["sustained_per_s"].as_f64() {
        let l = &peer["median"]["end_to_end_ms"];
        let p = |q: &str| l[q].as_f64().map_or("-".to_owned(), |v| format!("{v:.0}"));
        println!(
            "  pgqueuer         {rate:>6.1} jobs/s   no provider call (a no-op job)  to done p50/p99 {}/{} ms  \
             [pgqueuer 1.6.0, one worker process]",
            p("p50"),
            p("p99"),
        );
    }
    for name in PEERS.into_iter().skip(1) {
        if peer[name]["median"].is_object() {
            durable_peer_line(name, &peer[name]["median"]);
        }
    }
}
