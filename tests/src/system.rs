//! The whole system as processes: fake providers, scheduler, executors and the
//! reconciler, each a real process of `fenceline-host` (fault points compiled in)
//! on a fresh database and fresh topics (on the test stack's broker, or on a broker
//! of the system's own where a test stops the broker), so a test can kill any of
//! them at a named point, restart it, and judge by the fake provider's call log.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::Priority;
use fenceline_events::{Event, TaskAccepted, Timestamp, encode_record, topics};
use serde_json::{Value, json};

use crate::process::{OwnBroker, OwnPostgres, Proc, free_port};
use crate::{PARTITIONS, fresh_database, init_telemetry, kafka_at};

/// The test binary that runs any service: beside the test executable's folder
/// (`target/<profile>/fenceline-host`).
pub fn host_binary() -> String {
    built_binary("fenceline-host", "build the tests package's binaries")
}

/// The command line `fenceline` (tools/cli), which `deploy/local/stack test` builds
/// before the suites.
pub fn cli_binary() -> String {
    built_binary("fenceline", "build it with `cargo build -p fenceline-cli`")
}

/// A workspace binary beside the test executable's folder; panics with `hint` when missing.
fn built_binary(name: &str, hint: &str) -> String {
    let exe = std::env::current_exe().expect("current executable");
    // Test executables live in target/<profile>/deps, binaries in target/<profile>.
    let found = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.exists())
        .unwrap_or_else(|| panic!("{name} is missing beside {}: {hint}", exe.display()));
    found.display().to_string()
}

/// One blocking HTTP exchange: (status, JSON body or Null).
pub async fn http(method: &str, url: String, body: Option<Value>) -> Result<(u16, Value), String> {
    exchange(method, url, None, body).await
}

/// As [`http`], with a bearer token.
pub async fn http_as(method: &str, url: String, token: &str, body: Option<Value>) -> Result<(u16, Value), String> {
    exchange(method, url, Some(format!("Bearer {token}")), body).await
}

/// As [`http`], with these request headers.
pub async fn http_with(
    method: &str,
    url: String,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    let headers = headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    exchange_with(method, url, headers, body).await
}

async fn exchange(
    method: &str,
    url: String,
    auth: Option<String>,
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    exchange_with(method, url, auth.map(|a| ("Authorization".to_owned(), a)).into_iter().collect(), body).await
}

async fn exchange_with(
    method: &str,
    url: String,
    headers: Vec<(String, String)>,
    body: Option<Value>,
) -> Result<(u16, Value), String> {
    let (status, text) = exchange_text(method, url, headers, body).await?;
    Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// A `GET` with an optional bearer token: (status, the body as text), for pages
/// that are not JSON (`/metrics`).
pub async fn http_text(url: String, token: Option<&str>) -> Result<(u16, String), String> {
    let headers = token.map(|t| ("Authorization".to_owned(), format!("Bearer {t}"))).into_iter().collect();
    exchange_text("GET", url, headers, None).await
}

async fn exchange_text(
    method: &str,
    url: String,
    headers: Vec<(String, String)>,
    body: Option<Value>,
) -> Result<(u16, String), String> {
    let method = method.to_owned();
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .new_agent();
        let mut request = ureq::http::Request::builder().method(method.as_str()).uri(&url);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = match body {
            Some(body) => agent.run(
                request.header("Content-Type", "application/json").body(body.to_string()).map_err(|e| e.to_string())?,
            ),
            None => agent.run(request.body(()).map_err(|e| e.to_string())?),
        };
        let mut response = response.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        Ok((status, response.body_mut().read_to_string().unwrap_or_default()))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// What intake answered a submission.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub status: u16,
    /// `Idempotent-Replayed: true`: the key was seen before.
    pub replayed: bool,
    pub body: Value,
}

impl Submitted {
    pub fn task_id(&self) -> Option<&str> {
        self.body["task_id"].as_str()
    }
}

/// Submits a task through intake's API as a client would (`POST /v1/tasks` with a
/// bearer token and an `Idempotency-Key`), blocking.
pub fn submit_over_api(
    agent: &ureq::Agent,
    intake: &str,
    token: &str,
    key: &str,
    body: &Value,
) -> Result<Submitted, String> {
    let mut response = agent
        .post(&format!("{intake}/v1/tasks"))
        .header("Authorization", &format!("Bearer {token}"))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .map_err(|e| e.to_string())?;
    let replayed = response.headers().get("Idempotent-Replayed").is_some_and(|v| v == "true");
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    Ok(Submitted { status, replayed, body: serde_json::from_str(&text).unwrap_or(Value::Null) })
}

/// An HTTP client that hands every status to the caller, with a 10 s limit per exchange.
pub fn api_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .new_agent()
}

/// A fake provider process and its controls.
#[derive(Debug)]
pub struct FakeProvider {
    pub base: String,
    pub proc: Proc,
}

impl FakeProvider {
    /// Every call it received, in order.
    pub async fn calls(&self) -> Vec<Value> {
        let (_, body) = http("GET", format!("{}/admin/calls", self.base), None).await.expect("calls");
        body.as_array().cloned().unwrap_or_default()
    }

    /// When it received each call, in micros since the epoch, in order.
    pub async fn received_at_us(&self) -> Vec<i64> {
        self.calls().await.iter().map(|call| call["received_at_us"].as_i64().expect("received_at_us")).collect()
    }

    /// The calls that did work (were charged).
    pub async fn charges(&self) -> usize {
        let (_, body) = http("GET", format!("{}/admin/ledger", self.base), None).await.expect("ledger");
        body["charges"].as_array().map_or(0, Vec::len)
    }

    /// Scripts a misbehaviour.
    pub async fn rule(&self, rule: Value) {
        let (status, _) = http("POST", format!("{}/admin/rules", self.base), Some(rule)).await.expect("rule");
        assert!((200..300).contains(&status), "rule refused: {status}");
    }

    /// Forgets every scripted misbehaviour: the provider behaves again.
    /// Makes the provider forget every operation key, as once its idempotency
    /// window has passed.
    pub async fn forget_keys(&self) {
        let (status, _) = http("POST", format!("{}/admin/forget-keys", self.base), None).await.expect("forget");
        assert!((200..300).contains(&status), "keys not forgotten: {status}");
    }

    pub async fn reset_rules(&self) {
        let (status, _) = http("DELETE", format!("{}/admin/rules", self.base), None).await.expect("rules");
        assert!((200..300).contains(&status), "rules not cleared: {status}");
    }
}

/// What a test's providers can do.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caps {
    pub idempotency_keys: bool,
    pub lookup: bool,
    pub async_results: bool,
}

/// A running system under test.
#[derive(Debug)]
pub struct System {
    pub url: String,
    pub prefix: String,
    pub dir: PathBuf,
    pub catalog: PathBuf,
    pub pool: sqlx::PgPool,
    pub providers: HashMap<String, FakeProvider>,
    pub services: HashMap<String, Proc>,
    /// Service processes that were replaced by a restart, kept for their log lines.
    pub retired: Vec<(String, Proc)>,
    /// Where each service process listens.
    pub urls: HashMap<String, String>,
    /// Settings every service process gets (short leases and timeouts for tests).
    pub env: Vec<(&'static str, String)>,
    /// Where the system's topics are.
    pub brokers: String,
    /// The broker of this system's own, for tests that stop and restart it.
    own_broker: Option<OwnBroker>,
    /// The Postgres cluster of this system's own, for tests that restart it.
    own_postgres: Option<OwnPostgres>,
}

impl System {
    /// Fresh database and topics, one fake provider per entry, and a catalogue with
    /// `image.generate` (one paid `render` step at the first provider) and
    /// `ticket.triage` (classify, draft, approve, refund) over them. No Fenceline
    /// service runs yet: call [`System::spawn`]. Its topics live on the test stack's
    /// broker under a prefix of their own.
    pub async fn new(providers: &[(&str, Caps)]) -> Self {
        Self::build(providers, None, None).await
    }

    /// As [`System::new`], on a broker of the system's own that the test may kill
    /// and restart ([`System::broker`]).
    pub async fn with_own_broker(providers: &[(&str, Caps)]) -> Self {
        Self::build(providers, Some(OwnBroker::start().await), None).await
    }

    /// As [`System::with_own_broker`], on a Postgres cluster of its own too, which the
    /// test may restart ([`System::postgres`]) without disturbing the tests beside it.
    pub async fn with_own_broker_and_postgres(providers: &[(&str, Caps)]) -> Self {
        let (broker, postgres) = tokio::join!(OwnBroker::start(), OwnPostgres::start());
        Self::build(providers, Some(broker), Some(postgres)).await
    }

    /// The system's own broker; panics for a system on the shared one.
    pub fn broker(&self) -> &OwnBroker {
        self.own_broker.as_ref().expect("this system shares the test stack's broker: build it with_own_broker")
    }

    /// The system's own Postgres cluster; panics for a system on the shared one.
    pub fn postgres(&self) -> &OwnPostgres {
        self.own_postgres.as_ref().expect("this system shares the test stack's Postgres: build it with its own")
    }

    async fn build(
        providers: &[(&str, Caps)],
        own_broker: Option<OwnBroker>,
        own_postgres: Option<OwnPostgres>,
    ) -> Self {
        init_telemetry();
        let url = match &own_postgres {
            Some(postgres) => postgres.url(),
            None => fresh_database().await,
        };
        let brokers = own_broker.as_ref().map(OwnBroker::brokers).unwrap_or_else(crate::brokers);
        let prefix = format!("s{}.", uuid::Uuid::now_v7().simple());
        let topics_kafka = kafka_at(&brokers, &prefix);
        let every = fenceline_bus::admin::fenceline_topics(&prefix, PARTITIONS);
        fenceline_bus::admin::ensure_topics(&topics_kafka, &every, 1).await.expect("create the system's topics");
        let scratch =
            std::env::var("FENCELINE_TEST_SCRATCH").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
        let dir = PathBuf::from(scratch).join(format!("system-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("scratch folder");
        let mut running = HashMap::new();
        let mut catalog_providers = serde_json::Map::new();
        for (name, caps) in providers {
            let port = free_port();
            let mut proc = Proc::spawn(
                &host_binary(),
                &["fake-provider"],
                &[
                    ("FENCELINE_HTTP_ADDR", format!("127.0.0.1:{port}")),
                    ("FAKE_PROVIDER_IDEMPOTENCY_KEYS", caps.idempotency_keys.to_string()),
                    ("FAKE_PROVIDER_LOOKUP", caps.lookup.to_string()),
                    ("FAKE_PROVIDER_ASYNC_RESULTS", caps.async_results.to_string()),
                    ("RUST_LOG", "warn".into()),
                ],
            );
            let base = format!("http://127.0.0.1:{port}");
            wait_ready(&format!("{base}/readyz"), &mut proc, Exit::Unexpected).await;
            catalog_providers.insert(
                (*name).to_owned(),
                json!({
                    "base_url": base,
                    "capabilities": {"idempotency_keys": caps.idempotency_keys, "lookup": caps.lookup,
                                     "async_results": caps.async_results},
                    "call_timeout_ms": 10_000, "concurrency": 4, "rate_per_second": 50, "burst": 50
                }),
            );
            running.insert((*name).to_owned(), FakeProvider { base, proc });
        }
        let first = providers.first().map(|(n, _)| *n).unwrap_or("provider");
        let last = providers.last().map(|(n, _)| *n).unwrap_or(first);
        let catalog = json!({
            "providers": catalog_providers,
            "kinds": {
                "image.generate": {"steps": [{"name": "render", "provider": first}],
                                   "max_attempts": 4, "attempt_budget_ms": 60_000},
                "ticket.triage": {"steps": [
                    {"name": "classify", "provider": first},
                    {"name": "draft", "provider": first},
                    {"name": "approve", "approval_signal": "refund_approved"},
                    {"name": "refund", "provider": last}
                ], "max_attempts": 4, "attempt_budget_ms": 60_000}
            }
        });
        let catalog_path = dir.join("catalog.json");
        std::fs::write(&catalog_path, serde_json::to_vec_pretty(&catalog).expect("json")).expect("write catalogue");
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.expect("connect");
        let env = vec![
            ("FENCELINE_DATABASE_URL", url.clone()),
            ("FENCELINE_KAFKA_BROKERS", brokers.clone()),
            ("FENCELINE_TOPIC_PREFIX", prefix.clone()),
            ("FENCELINE_CATALOG", catalog_path.display().to_string()),
            ("FENCELINE_KAFKA_SESSION_TIMEOUT_MS", "8000".into()),
            ("FENCELINE_SHUTDOWN_GRACE_MS", "3000".into()),
            ("FENCELINE_OUTBOX_IDLE_POLL_MS", "100".into()),
            // The suites read what each service published (and send it again).
            ("FENCELINE_OUTBOX_KEEP_PUBLISHED_SECONDS", "3600".into()),
            ("FENCELINE_EXECUTOR_LEASE_MS", "2000".into()),
            ("FENCELINE_EXECUTOR_IDLE_POLL_MS", "100".into()),
            ("FENCELINE_SCHEDULER_BACKOFF_BASE_MS", "200".into()),
            ("FENCELINE_SCHEDULER_BACKOFF_CAP_MS", "2000".into()),
            ("FENCELINE_RECONCILER_CLAIM_TIMEOUT_MS", "4000".into()),
            ("FENCELINE_RECONCILER_ASK_BASE_MS", "300".into()),
            ("FENCELINE_RECONCILER_ASK_CAP_MS", "2000".into()),
            ("FENCELINE_RECONCILER_ASK_FOR_MS", "20000".into()),
            // The suites offer load as fast as they can; admission has tests of its own.
            ("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND", "100000".into()),
            ("FENCELINE_INTAKE_TENANT_BURST", "100000".into()),
            ("RUST_LOG", "info,sqlx=warn,rdkafka=warn".into()),
        ];
        System {
            url,
            prefix,
            dir,
            catalog: catalog_path,
            pool,
            providers: running,
            services: HashMap::new(),
            retired: Vec::new(),
            urls: HashMap::new(),
            env,
            brokers,
            own_broker,
            own_postgres,
        }
    }

    /// Changes a provider's limits in the catalogue (before the services start).
    pub fn set_provider_limits(&self, name: &str, concurrency: u32, rate: f64, burst: f64) {
        let mut catalog: Value =
            serde_json::from_slice(&std::fs::read(&self.catalog).expect("catalogue")).expect("catalogue JSON");
        let provider = &mut catalog["providers"][name];
        provider["concurrency"] = json!(concurrency);
        provider["rate_per_second"] = json!(rate);
        provider["burst"] = json!(burst);
        std::fs::write(&self.catalog, serde_json::to_vec_pretty(&catalog).expect("json")).expect("write catalogue");
    }

    /// Sets one field of a provider's catalogue entry (before the services start).
    pub fn set_provider_field(&self, name: &str, field: &str, value: Value) {
        let mut catalog: Value =
            serde_json::from_slice(&std::fs::read(&self.catalog).expect("catalogue")).expect("catalogue JSON");
        catalog["providers"][name][field] = value;
        std::fs::write(&self.catalog, serde_json::to_vec_pretty(&catalog).expect("json")).expect("write catalogue");
    }

    /// Sets one top-level field of the catalogue (`budgets`), before the services
    /// that read it start.
    pub fn set_catalog_field(&self, field: &str, value: Value) {
        let mut catalog: Value =
            serde_json::from_slice(&std::fs::read(&self.catalog).expect("catalogue")).expect("catalogue JSON");
        catalog[field] = value;
        std::fs::write(&self.catalog, serde_json::to_vec_pretty(&catalog).expect("json")).expect("write catalogue");
    }

    /// Replaces the catalogue's kinds (before the services start).
    pub fn set_kinds(&self, kinds: Value) {
        let mut catalog: Value =
            serde_json::from_slice(&std::fs::read(&self.catalog).expect("catalogue")).expect("catalogue JSON");
        catalog["kinds"] = kinds;
        std::fs::write(&self.catalog, serde_json::to_vec_pretty(&catalog).expect("json")).expect("write catalogue");
    }

    pub fn provider(&self, name: &str) -> &FakeProvider {
        self.providers.get(name).unwrap_or_else(|| panic!("no provider {name}"))
    }

    /// Starts (or restarts) the service process `id` running `service`, with the
    /// system's settings and `extra` (for example `FAILPOINTS`), and waits until ready.
    /// A restarted service listens where it listened before, as behind a fixed address.
    pub async fn spawn(&mut self, id: &str, service: &str, extra: &[(&'static str, String)]) {
        self.start(id, service, extra, Exit::Unexpected).await;
    }

    /// Starts the service process `id` with a fault point armed to crash it: it may
    /// reach that point, and exit, before it reports ready.
    pub async fn spawn_to_crash(&mut self, id: &str, service: &str, extra: &[(&'static str, String)]) {
        self.start(id, service, extra, Exit::Expected).await;
    }

    /// Starts the service process `id` from another build's `program` (the previous
    /// release's `fenceline-scheduler`, say) with `args`, the system's settings and
    /// `extra`, and waits until ready: old and new builds side by side.
    pub async fn spawn_program(&mut self, id: &str, program: &str, args: &[&str], extra: &[(&'static str, String)]) {
        self.launch(id, program, args, extra, Exit::Unexpected).await;
    }

    async fn start(&mut self, id: &str, service: &str, extra: &[(&'static str, String)], exit: Exit) {
        self.launch(id, &host_binary(), &[service], extra, exit).await;
    }

    async fn launch(&mut self, id: &str, program: &str, args: &[&str], extra: &[(&'static str, String)], exit: Exit) {
        if let Some(mut old) = self.services.remove(id) {
            old.kill();
            self.retired.push((id.to_owned(), old));
        }
        let port = self
            .urls
            .get(id)
            .and_then(|url| url.rsplit(':').next())
            .and_then(|port| port.parse().ok())
            .unwrap_or_else(free_port);
        let mut env = self.env.clone();
        env.push(("FENCELINE_HTTP_ADDR", format!("127.0.0.1:{port}")));
        env.extend(extra.iter().cloned());
        let mut proc = Proc::spawn(program, args, &env);
        wait_ready(&format!("http://127.0.0.1:{port}/readyz"), &mut proc, exit).await;
        self.services.insert(id.to_owned(), proc);
        self.urls.insert(id.to_owned(), format!("http://127.0.0.1:{port}"));
    }

    /// The base URL of a running service.
    pub fn url_of(&self, id: &str) -> String {
        self.urls.get(id).cloned().unwrap_or_else(|| panic!("no service {id}"))
    }

    /// An API token of `tenant` in a running intake's schema.
    pub async fn token(&self, tenant: &str) -> String {
        use std::str::FromStr as _;
        let options = sqlx::postgres::PgConnectOptions::from_str(&self.url)
            .expect("database URL")
            .options([("search_path", "intake")]);
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.expect("intake");
        let tenant = fenceline_intake::auth::Tenant::parse(tenant).expect("tenant");
        let (_, token) = fenceline_intake::auth::create_token(&pool, &tenant, "test").await.expect("token");
        token
    }

    /// Starts one scheduler, one executor and the reconciler.
    pub async fn spawn_all(&mut self, executor_faults: Option<&str>) {
        self.spawn("scheduler", "scheduler", &[]).await;
        self.spawn("reconciler", "reconciler", &[]).await;
        let faults: Vec<(&'static str, String)> =
            executor_faults.map(|f| vec![("FAILPOINTS", f.to_owned())]).unwrap_or_default();
        self.spawn("executor", "executor", &faults).await;
    }

    /// Starts `count` instances of every service (intake, scheduler, executor,
    /// reconciler), named `<service>-1` .. `<service>-<count>`, each with `extra`
    /// beside the system's settings; returns their ids. Instances of a service join
    /// one consumer group and share its partitions, as replicas behind one address
    /// would.
    pub async fn spawn_instances(&mut self, count: usize, extra: &[(&'static str, String)]) -> Vec<(String, String)> {
        let mut ids = Vec::new();
        for service in ["intake", "scheduler", "executor", "reconciler"] {
            for n in 1..=count {
                let id = format!("{service}-{n}");
                self.spawn(&id, service, extra).await;
                ids.push((id, service.to_owned()));
            }
        }
        ids
    }

    /// Stops the service process `id` (SIGTERM: it drains and leaves its consumer
    /// group; SIGKILL: it vanishes mid-work) and waits until it exited; returns how
    /// long that took. [`System::spawn`] with the same id starts it again at the
    /// same address.
    pub async fn stop(&mut self, id: &str, how: Stop) -> Duration {
        let mut proc = self.services.remove(id).unwrap_or_else(|| panic!("no service {id}"));
        let started = tokio::time::Instant::now();
        match how {
            Stop::Term => {
                proc.signal("TERM");
                if proc.wait_exit(Duration::from_secs(30)).await.is_none() {
                    panic!("{id} did not exit within 30 s of SIGTERM:\n{}", proc.all_lines());
                }
            }
            Stop::Kill => proc.kill(),
        }
        let took = started.elapsed();
        self.retired.push((id.to_owned(), proc));
        took
    }

    pub fn service(&mut self, id: &str) -> &mut Proc {
        self.services.get_mut(id).unwrap_or_else(|| panic!("no service {id}"))
    }

    /// A person of tenant `acme` resolves the task's open case (the scheduler's) with
    /// `retry_as_new`, acknowledging a possible second charge, as intake publishes it.
    pub async fn a_person_retries_as_new(&self, task: TaskId) {
        let case: String = sqlx::query_scalar("SELECT lifecycle->>'case_id' FROM scheduler.tasks WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&self.pool)
            .await
            .expect("the open case");
        let decision = Event::ResolutionDecided(fenceline_events::ResolutionDecided {
            task_id: task,
            tenant: "acme".into(),
            case_id: case,
            action: fenceline_domain::vocabulary::ResolutionAction::RetryAsNew,
            charge_acknowledged: true,
            attached_result: None,
            decided_by: "test".into(),
            decided_at: Timestamp::now(),
        });
        self.publish(topics::TASKS, &decision).await;
    }

    /// Every finding in the evidence of the task's cases, as the reconciler wrote them.
    pub async fn case_findings(&self, task: TaskId) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT e->>'finding' FROM reconciler.cases, jsonb_array_elements(evidence) e WHERE task_id = $1",
        )
        .bind(task.as_uuid())
        .fetch_all(&self.pool)
        .await
        .expect("the task's cases")
    }

    /// Makes the system's database refuse writes (`default_transaction_read_only`,
    /// as a failover to a read-only node does), or take them again, and ends every
    /// other session so that each new one reads the setting.
    pub async fn refuse_writes(&self, refuse: bool) {
        let database: String =
            sqlx::query_scalar("SELECT current_database()").fetch_one(&self.pool).await.expect("database");
        let setting =
            if refuse { "SET default_transaction_read_only = on" } else { "RESET default_transaction_read_only" };
        // This session may have started read-only itself: it lifts that for its own writes.
        let mut admin = self.pool.acquire().await.expect("connection");
        sqlx::query("SET SESSION default_transaction_read_only = off").execute(&mut *admin).await.expect("set");
        sqlx::query(&format!("ALTER DATABASE \"{database}\" {setting}")).execute(&mut *admin).await.expect("alter");
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .execute(&mut *admin)
        .await
        .expect("terminate");
    }

    /// Publishes a `TaskAccepted` as intake would, and returns its task id.
    pub async fn submit(&self, tenant: &str, kind: &str, input: Value) -> TaskId {
        self.submit_with(tenant, kind, input, |_| {}).await
    }

    /// As [`System::submit`], with the event changed by `customise` first.
    pub async fn submit_with(
        &self,
        tenant: &str,
        kind: &str,
        input: Value,
        customise: impl FnOnce(&mut TaskAccepted),
    ) -> TaskId {
        let task_id = TaskId::new_v7();
        let mut accepted = TaskAccepted {
            task_id,
            tenant: tenant.to_owned(),
            kind: kind.to_owned(),
            input_json: input.to_string(),
            priority: Priority::Normal,
            deadline: None,
            not_before: None,
            labels: Default::default(),
            source: "test".to_owned(),
            accepted_at: Timestamp::now(),
        };
        customise(&mut accepted);
        self.publish(topics::TASKS, &Event::TaskAccepted(accepted)).await;
        task_id
    }

    /// Publishes `count` tasks of one tenant at once through one producer.
    pub async fn submit_many(&self, tenant: &str, kind: &str, count: usize) -> Vec<TaskId> {
        self.submit_many_with(tenant, kind, count, |_, _| {}).await
    }

    /// As [`System::submit_many`], with task `n` changed by `customise` first.
    pub async fn submit_many_with(
        &self,
        tenant: &str,
        kind: &str,
        count: usize,
        customise: impl Fn(usize, &mut TaskAccepted),
    ) -> Vec<TaskId> {
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let producer: FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.brokers)
            .set("linger.ms", "20")
            .create()
            .expect("producer");
        let topic = format!("{}{}", self.prefix, topics::TASKS);
        let mut ids = Vec::with_capacity(count);
        let mut pending = Vec::with_capacity(count);
        for n in 0..count {
            let task_id = TaskId::new_v7();
            let mut accepted = TaskAccepted {
                task_id,
                tenant: tenant.to_owned(),
                kind: kind.to_owned(),
                input_json: json!({ "n": n }).to_string(),
                priority: Priority::Normal,
                deadline: None,
                not_before: None,
                labels: Default::default(),
                source: "test".to_owned(),
                accepted_at: Timestamp::now(),
            };
            customise(n, &mut accepted);
            let event = Event::TaskAccepted(accepted);
            let (payload, headers) = encode_record(&event, "test").expect("encode");
            let pairs = headers.to_pairs();
            let kafka_headers = crate::kafka_headers(pairs.iter().map(|(k, v)| (*k, v.as_str())));
            let key = task_id.to_string();
            let record = FutureRecord::to(&topic).key(&key).payload(&payload).headers(kafka_headers);
            pending.push(producer.send_result(record).map_err(|(e, _)| e).expect("queued"));
            ids.push(task_id);
        }
        for delivery in pending {
            delivery.await.expect("not cancelled").map_err(|(e, _)| e).expect("delivered");
        }
        ids
    }

    /// Publishes an event on a contract topic, keyed by its task, with the headers.
    pub async fn publish(&self, topic: &str, event: &Event) {
        let (payload, headers) = encode_record(event, "test").expect("encode");
        let pairs = headers.to_pairs();
        let borrowed: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let key = event.task_id().map(|t| t.to_string()).unwrap_or_default();
        crate::produce_raw(&self.brokers, &format!("{}{topic}", self.prefix), key.as_bytes(), &payload, &borrowed)
            .await;
    }

    /// The fencing token and status of the task's execution (a task of one grant).
    pub async fn execution(&self, task: TaskId) -> (i64, String) {
        sqlx::query_as("SELECT fencing_token, status FROM executor.executions WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&self.pool)
            .await
            .expect("execution")
    }

    /// The scheduler's state of a task and its reason.
    pub async fn state(&self, task: TaskId) -> Option<(String, Option<String>)> {
        sqlx::query_as("SELECT state, lifecycle->>'reason' FROM scheduler.tasks WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_optional(&self.pool)
            .await
            .unwrap_or(None)
    }

    /// Waits until the task is in one of `states`; panics with what it saw otherwise.
    pub async fn wait_state(&self, task: TaskId, states: &[&str], timeout: Duration) -> String {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let seen = self.state(task).await;
            if let Some((state, _)) = &seen
                && states.contains(&state.as_str())
            {
                return state.clone();
            }
            if tokio::time::Instant::now() >= deadline {
                let states: Vec<(String, i64)> =
                    sqlx::query_as("SELECT state, count(*) FROM scheduler.tasks GROUP BY state")
                        .fetch_all(&self.pool)
                        .await
                        .unwrap_or_default();
                let slots: Vec<(String, i64)> =
                    sqlx::query_as("SELECT provider, count(*) FROM scheduler.slots GROUP BY provider")
                        .fetch_all(&self.pool)
                        .await
                        .unwrap_or_default();
                panic!(
                    "task {task} never reached {states:?}; last seen {seen:?}\nall tasks: {states:?}; slots held: {slots:?}\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until an executor's call intent is on the broker and its relay's round is
    /// over, before a test stops the executor's process: a relay stopped in the middle
    /// of a round keeps its shard until it runs again (docs/decisions.md), and the
    /// tests that stop a worker test the reconciler, not that.
    pub async fn wait_intent_published(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let published: bool = sqlx::query_scalar(
                "SELECT count(*) > 0 FROM executor.outbox \
                 WHERE event_type = 'CallIntentRecorded' AND published_at IS NOT NULL",
            )
            .fetch_one(&self.pool)
            .await
            .unwrap_or(false);
            if published {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "no call intent was published:\n{}", self.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// How many log lines of every service process so far, running or replaced,
    /// contain `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        let running = self.services.values();
        let retired = self.retired.iter().map(|(_, proc)| proc);
        running.chain(retired).map(|proc| proc.lines_with(needle).len()).sum()
    }

    /// Every line that mentions `needle`, of running and retired processes, each
    /// after its service's id: a task's story, for failure messages.
    pub fn lines_mentioning(&self, needle: &str) -> String {
        let running = self.services.iter().map(|(id, proc)| (id.as_str(), proc));
        let retired = self.retired.iter().map(|(id, proc)| (id.as_str(), proc));
        let mut out = String::new();
        for (id, proc) in running.chain(retired) {
            for line in proc.lines_with(needle) {
                out.push_str(&format!("[{id}] {line}\n"));
            }
        }
        out
    }

    /// Every service's log lines with a warning or an error, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for (id, proc) in &self.services {
            for line in proc.all_lines().lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(40) {
                out.push_str(&format!("[{id}] {line}\n"));
            }
        }
        out
    }
}

impl Drop for System {
    fn drop(&mut self) {
        for proc in self.services.values_mut() {
            proc.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How [`System::stop`] stops a service process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM: the ordered shutdown (drain, leave the group, close the pool).
    Term,
    /// SIGKILL: a crash.
    Kill,
}

/// Whether a process may exit before it reports ready.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Exit {
    Expected,
    Unexpected,
}

async fn wait_ready(url: &str, proc: &mut Proc, exit: Exit) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        if let Ok((200, _)) = http("GET", url.to_owned(), None).await {
            return;
        }
        if !proc.running() {
            assert!(exit == Exit::Expected, "{url}: the process exited before it was ready:\n{}", proc.all_lines());
            return;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    panic!("{url} did not become ready:\n{}", proc.all_lines());
}
