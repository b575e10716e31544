//! The whole system under faults. Intake, two schedulers, two executors and the
//! reconciler run as processes against four fake providers with different
//! capabilities and scripted misbehaviour (latency, 429, 5xx, hangs, dropped
//! answers, a gateway's 404 on the look-up route, slow polls of long jobs). While
//! 1,000 tasks arrive through intake's API (some submitted twice), every service is
//! SIGKILLed at random moments or crashed at a named fault point, the broker is
//! restarted once, Postgres once, and the database refuses writes once for 40 s,
//! longer than the consumers' backoff (all the run's own, so other suites run beside it).
//! While it drains, a person resolves the cases at providers that dedupe with
//! `retry_as_new`, twice if the retry stops again. The run is judged by the
//! providers' own logs.
//!
//! Each run prints its seed; `FENCELINE_CHAOS_SEED=<seed>` replays the same choices
//! (the timing of the machine is not replayed). `FENCELINE_CHAOS_SOAK=1` runs longer
//! with more tasks; `FENCELINE_CHAOS_TASKS` and `FENCELINE_CHAOS_SECONDS` set them.

#![allow(clippy::print_stdout)] // the figures of the run are the point of this test

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use fenceline_domain::ids::TaskId;
use fenceline_events::{Event, Timestamp, topics};
use fenceline_tests::system::{Caps, System, api_agent, submit_over_api};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// The service processes: (id, service).
const SERVICES: &[(&str, &str)] = &[
    ("intake", "intake"),
    ("scheduler-a", "scheduler"),
    ("scheduler-b", "scheduler"),
    ("executor-a", "executor"),
    ("executor-b", "executor"),
    ("reconciler", "reconciler"),
];

/// Kinds, the provider of their paid step, and how often they are submitted.
const KINDS: &[(&str, &str, &str, u32)] = &[
    ("image.generate", "render", "imagegen", 40),
    ("image.sketch", "sketch", "sketcher", 25),
    ("ticket.reply", "draft", "llm", 30),
    ("ticket.triage", "classify", "llm", 5),
];

const TENANTS: &[&str] = &["acme", "globex", "initech"];

/// The fake providers, by name.
const PROVIDERS: &[&str] = &["imagegen", "sketcher", "llm", "payments"];

/// States a task may end the run in.
const SETTLED: &[&str] = &["succeeded", "failed", "cancelled", "needs_human", "outcome_unknown", "awaiting_approval"];

/// The named places a service can be crashed at.
fn fault_points(service: &str) -> &'static [&'static str] {
    match service {
        "executor" => &[
            "executor.before_call_intent",
            "executor.after_call_intent",
            "executor.after_provider_answer",
            "executor.after_result_recorded",
            "consumer.after_db_commit",
            "outbox.after_publish_before_mark",
        ],
        "scheduler" => &[
            "scheduler.after_grant_commit",
            "consumer.before_db_commit",
            "consumer.after_db_commit",
            "outbox.after_publish_before_mark",
        ],
        "intake" => &["intake.after_accept_commit", "consumer.after_db_commit", "outbox.after_publish_before_mark"],
        _ => &["reconciler.after_lookup_answer", "consumer.after_db_commit", "outbox.after_publish_before_mark"],
    }
}

/// What this run does, from the environment.
#[derive(Debug, Clone, Copy)]
struct Plan {
    seed: u64,
    tasks: usize,
    chaos: Duration,
    drain: Duration,
}

impl Plan {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let soak = std::env::var("FENCELINE_CHAOS_SOAK").is_ok_and(|v| v == "1");
        let seed = var("FENCELINE_CHAOS_SEED").unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
        });
        let tasks = var("FENCELINE_CHAOS_TASKS").unwrap_or(if soak { 5_000 } else { 1_000 }) as usize;
        let chaos = Duration::from_secs(var("FENCELINE_CHAOS_SECONDS").unwrap_or(if soak { 900 } else { 90 }));
        let drain = Duration::from_secs(if soak { 1_200 } else { 600 });
        Plan { seed, tasks, chaos, drain }
    }
}

/// Everything the run counts.
#[derive(Debug, Default)]
struct Figures {
    resubmitted: usize,
    replayed: usize,
    submit_retries: usize,
    kills: BTreeMap<String, usize>,
    crashes: BTreeMap<String, usize>,
    died_on_their_own: usize,
    broker_restarts: usize,
    postgres_restarts: usize,
    /// Times the database refused writes (read-only for a while).
    read_only_spells: usize,
    /// When an executor died (killed, crashed at a point, found dead) or Postgres
    /// was restarted, in microseconds since the epoch: the moments a call intent
    /// can be left with nobody to say whether its request left.
    deaths: Vec<i64>,
}

/// One submission through intake's API: (status, replayed, task id).
fn submit(intake: &str, token: &str, key: &str, body: &Value) -> Result<(u16, bool, Option<String>), String> {
    let answer = submit_over_api(&api_agent(), intake, token, key, body)?;
    Ok((answer.status, answer.replayed, answer.task_id().map(str::to_owned)))
}

/// The client: submits every task with its idempotency key, retrying the same key
/// until intake answers (it may be down), and sends some a second time.
/// Returns the accepted task ids by task number, and the figures.
async fn client(intake: String, tokens: Vec<String>, plan: Plan) -> (HashMap<usize, String>, Figures) {
    tokio::task::spawn_blocking(move || {
        let mut rng = StdRng::seed_from_u64(plan.seed ^ 0x5eed);
        let mut accepted = HashMap::new();
        let mut figures = Figures::default();
        let total: u32 = KINDS.iter().map(|k| k.3).sum();
        // Spread over most of the chaos window.
        let pace = plan.chaos.mul_f64(0.6).div_f64(plan.tasks as f64);
        for n in 0..plan.tasks {
            let mut pick = rng.random_range(0..total);
            let mut kind = KINDS[0].0;
            for (name, _, _, weight) in KINDS {
                if pick < *weight {
                    kind = name;
                    break;
                }
                pick -= weight;
            }
            let tenant = rng.random_range(0..TENANTS.len());
            let body = json!({"kind": kind, "input": {"n": n, "prompt": format!("item {n}")}});
            let key = format!("chaos-{n}");
            let sends = if rng.random_bool(0.05) { 2 } else { 1 };
            for send in 0..sends {
                let started = Instant::now();
                loop {
                    match submit(&intake, &tokens[tenant], &key, &body) {
                        Ok((202, replayed, Some(id))) => {
                            if let Some(first) = accepted.insert(n, id.clone()) {
                                assert_eq!(first, id, "the same key answered two task ids");
                            }
                            figures.replayed += usize::from(replayed);
                            break;
                        }
                        Ok((status, _, _)) if status < 500 => panic!("submission {n} refused with {status}"),
                        _ => {
                            figures.submit_retries += 1;
                            assert!(started.elapsed() < Duration::from_secs(180), "intake never took task {n}");
                            std::thread::sleep(Duration::from_millis(250));
                        }
                    }
                }
                if send == 1 {
                    figures.resubmitted += 1;
                }
            }
            std::thread::sleep(pace);
        }
        (accepted, figures)
    })
    .await
    .expect("client thread")
}

/// The services' environment beyond the system's.
fn extra(service: &str) -> Vec<(&'static str, String)> {
    match service {
        "intake" => vec![("FENCELINE_INTAKE_KINDS", KINDS.iter().map(|k| k.0).collect::<Vec<_>>().join(","))],
        _ => vec![],
    }
}

/// Restarts any service that is not running (one that died on its own).
async fn revive(system: &mut System, figures: &mut Figures) {
    for (id, service) in SERVICES {
        if !system.service(id).running() {
            figures.died_on_their_own += 1;
            if *service == "executor" {
                figures.deaths.push(Timestamp::now().0);
            }
            system.spawn(id, service, &extra(service)).await;
        }
    }
}

/// One chaos action on a random service: a SIGKILL and a restart after a pause, or
/// a restart with a named fault point armed that crashes it when reached.
async fn strike(system: &mut System, rng: &mut StdRng, figures: &mut Figures) {
    let (id, service) = SERVICES[rng.random_range(0..SERVICES.len())];
    if rng.random_bool(0.5) {
        system.service(id).kill();
        if service == "executor" {
            figures.deaths.push(Timestamp::now().0);
        }
        *figures.kills.entry(id.to_owned()).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(rng.random_range(300..2_500))).await;
        system.spawn(id, service, &extra(service)).await;
        return;
    }
    let points = fault_points(service);
    let point = points[rng.random_range(0..points.len())];
    let mut env = extra(service);
    env.push(("FAILPOINTS", format!("{point}=return(crash)")));
    // Starting the armed process kills the running one first: a death too, at this
    // instant, whenever the armed one reaches its point.
    if service == "executor" {
        figures.deaths.push(Timestamp::now().0);
    }
    system.spawn_to_crash(id, service, &env).await;
    if system.service(id).wait_exit(Duration::from_secs(15)).await.is_some() {
        *figures.crashes.entry(format!("{id} at {point}")).or_default() += 1;
    } else {
        // Not reached in time: stop it anyway.
        *figures.kills.entry(id.to_owned()).or_default() += 1;
    }
    if service == "executor" {
        figures.deaths.push(Timestamp::now().0);
    }
    system.spawn(id, service, &extra(service)).await;
}

/// The scheduler's state and generation of each task.
async fn scheduler_states(system: &System) -> HashMap<uuid::Uuid, (String, i64)> {
    sqlx::query_as::<_, (uuid::Uuid, String, i64)>(
        "SELECT task_id, state, coalesce((lifecycle->>'generation')::bigint, 0) FROM scheduler.tasks",
    )
    .fetch_all(&system.pool)
    .await
    .unwrap_or_default()
    .into_iter()
    .map(|(id, state, generation)| (id, (state, generation)))
    .collect()
}

/// What every service knows of the tasks that did not settle, and how far each
/// consumer and relay got: the picture a stuck drain is diagnosed from.
async fn where_they_stand(system: &System, tasks: &[uuid::Uuid]) -> String {
    let mut out = String::new();
    for schema in ["intake", "scheduler", "executor", "reconciler"] {
        let lag = format!(
            "SELECT to_jsonb(p) FROM (SELECT consumer_group, topic, partition, next_offset, owner, updated_at \
             FROM {schema}.consumer_partitions ORDER BY 1, 2, 3) p"
        );
        let unpublished = format!(
            "SELECT jsonb_build_object('unpublished', count(*), 'oldest', min(created_at)) \
             FROM {schema}.outbox WHERE published_at IS NULL"
        );
        out.push_str(&format!("{schema}: consumers and outbox\n"));
        for sql in [lag, unpublished] {
            out.push_str(&json_rows(system, &sql, None).await);
        }
    }
    out.push_str("slots held\n");
    let held = "SELECT jsonb_build_object('provider', provider, 'held', count(*), 'expires', max(expires_at_us)) \
                FROM scheduler.slots GROUP BY provider";
    out.push_str(&json_rows(system, held, None).await);
    for task in tasks {
        out.push_str(&format!("task {task}\n"));
        for sql in [
            "SELECT jsonb_build_object('scheduler', state, 'due_at_us', due_at_us, 'provider', provider, \
             'lifecycle', lifecycle, 'now_us', (extract(epoch from clock_timestamp()) * 1e6)::bigint) \
             FROM scheduler.tasks WHERE task_id = $1",
            "SELECT to_jsonb(s) FROM scheduler.slots s WHERE task_id = $1",
            "SELECT jsonb_build_object('execution', status, 'attempt', attempt, 'worker', worker, 'phase', phase, \
             'lease_expires_at_us', lease_expires_at_us, 'fencing_token', fencing_token) \
             FROM executor.executions WHERE task_id = $1 ORDER BY attempt",
            "SELECT to_jsonb(g) - 'granted' FROM reconciler.grants g WHERE task_id = $1 ORDER BY attempt",
            "SELECT to_jsonb(c) FROM reconciler.cases c WHERE task_id = $1",
        ] {
            out.push_str(&json_rows(system, sql, Some(*task)).await);
        }
    }
    out
}

/// The rows of a query that selects one JSON value per row, one per line.
async fn json_rows(system: &System, sql: &str, task: Option<uuid::Uuid>) -> String {
    let query = sqlx::query_scalar::<_, Value>(sql);
    let query = if let Some(task) = task { query.bind(task) } else { query };
    match query.fetch_all(&system.pool).await {
        Ok(rows) => rows.iter().map(|r| format!("    {r}\n")).collect(),
        Err(error) => format!("    ({error})\n"),
    }
}

/// Sends the approval a triage task waits for through intake's API, as a person of
/// the task's tenant would; whether intake took it.
async fn approve(system: &System, tokens: &HashMap<String, String>, task: uuid::Uuid) -> bool {
    let tenant: Option<String> = sqlx::query_scalar("SELECT tenant FROM intake.tasks WHERE task_id = $1")
        .bind(task)
        .fetch_optional(&system.pool)
        .await
        .unwrap_or(None);
    let Some(token) = tenant.and_then(|t| tokens.get(&t)) else { return false };
    let url = format!("{}/v1/tasks/{task}/signals/refund_approved", system.url_of("intake"));
    let answer = fenceline_tests::system::http_as("POST", url, token, Some(json!({"approved_by": "chaos"}))).await;
    matches!(answer, Ok((202, _)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_lost_or_paid_twice_while_every_service_dies_at_random() {
    let plan = Plan::from_env();
    println!(
        "chaos seed {} ({} tasks, {} s of faults); replay with FENCELINE_CHAOS_SEED={}",
        plan.seed,
        plan.tasks,
        plan.chaos.as_secs(),
        plan.seed
    );
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let (mut system, tokens) = start_a_misbehaving_system(plan).await;

    let started = Instant::now();
    let (accepted, client_figures, mut figures) =
        faults_while_the_tasks_arrive(&mut system, &mut rng, &tokens, plan, started).await;
    let last_fault = Instant::now();
    revive(&mut system, &mut figures).await;

    let drained = drain(&mut system, &mut figures, &tokens, &accepted, plan).await;
    let drained_in = last_fault.elapsed();

    let by_state = assert_none_lost(&system, &accepted, &drained, plan).await;
    let charges = assert_charged_at_most_once_per_task_and_step(&system, &accepted, &drained, plan).await;
    let doubts = assert_every_outcome_unknown_is_in_doubt(&system, &drained, &charges, &figures, plan).await;
    let takeovers = assert_one_live_lease_at_a_time(&system, plan).await;

    let kills: usize = figures.kills.values().sum();
    let crashes: usize = figures.crashes.values().sum();
    print_figures(
        &system,
        &Verdict {
            plan,
            accepted: accepted.len(),
            client: &client_figures,
            faults: &figures,
            by_state: &by_state,
            drained: &drained,
            drained_in,
            charges: &charges,
            doubts: &doubts,
            takeovers,
            started,
        },
    );
    assert!(kills + crashes >= 5, "the run had faults: {kills} kills, {crashes} crashes");
}

/// Starts the run's own broker, Postgres, misbehaving providers and services; the tenants' tokens.
async fn start_a_misbehaving_system(plan: Plan) -> (System, Vec<String>) {
    // A broker and a Postgres of the run's own: it restarts both, and the other suites
    // run beside it on the test stack's.
    let mut system = System::with_own_broker_and_postgres(&[
        // Accepts with 202 and is polled, so failed polls and artifact fetches are in the mix.
        ("imagegen", Caps { lookup: true, async_results: true, ..Caps::default() }),
        // Accepts with 202 too, and can neither dedupe nor be asked: a worker lost
        // while it polls leaves a request id only the reconciler's polls can follow.
        ("sketcher", Caps { async_results: true, ..Caps::default() }),
        ("llm", Caps { idempotency_keys: true, ..Caps::default() }),
        ("payments", Caps { idempotency_keys: true, lookup: true, ..Caps::default() }),
    ])
    .await;
    let budget = |steps: Value| json!({"steps": steps, "max_attempts": 6, "attempt_budget_ms": 60_000});
    system.set_kinds(json!({
        "image.generate": budget(json!([{"name": "render", "provider": "imagegen"}])),
        "image.sketch": budget(json!([{"name": "sketch", "provider": "sketcher"}])),
        "ticket.reply": budget(json!([{"name": "draft", "provider": "llm"}])),
        "ticket.triage": budget(json!([
            {"name": "classify", "provider": "llm"},
            {"name": "approve", "approval_signal": "refund_approved"},
            {"name": "refund", "provider": "payments"}
        ])),
    }));
    // sketcher answers 503 only when it did nothing, and says so in the catalogue:
    // those retries need no one to decide.
    system.set_provider_field("sketcher", "safe_5xx", json!([503]));
    let share = |per_thousand: usize| (plan.tasks * per_thousand / 1_000).max(1);
    let rules = [
        ("imagegen", json!({"status": 429, "retry_after_s": 1, "times": share(20)})),
        ("imagegen", json!({"status": 503, "times": share(10)})),
        ("imagegen", json!({"drop_after_accept": true, "times": share(10)})),
        // A gateway's 504 after the work ran behind it; a look-up settles it.
        ("imagegen", json!({"status_after_work": 504, "bare": true, "times": share(10)})),
        // Registered a while after it arrived: an early look-up finds nothing.
        ("imagegen", json!({"register_after_ms": 1_500, "times": share(5)})),
        ("imagegen", json!({"hang": true, "times": 2})),
        // After the provider accepted: a poll that fails never means "nothing done".
        ("imagegen", json!({"on": "poll", "status": 503, "times": share(10)})),
        ("imagegen", json!({"on": "poll", "reset": true, "times": share(5)})),
        // The artifact behind a redirect, or failing to download once.
        ("imagegen", json!({"serve_artifact": "redirect", "times": share(10)})),
        ("imagegen", json!({"on": "artifact", "status": 503, "times": share(5)})),
        // A gateway in front of the look-up route answers its own 404 page: no answer.
        ("imagegen", json!({"on": "lookup", "status": 404, "bare": true, "times": share(10)})),
        ("imagegen", json!({"latency_ms": 100})),
        ("sketcher", json!({"drop_after_accept": true, "times": share(5)})),
        ("sketcher", json!({"status": 503, "times": share(10)})),
        ("sketcher", json!({"hang": true, "times": 2})),
        // Long jobs: polls take a while, so executors are often killed while polling.
        ("sketcher", json!({"on": "poll", "latency_ms": 1_500, "times": share(100)})),
        ("sketcher", json!({"latency_ms": 150})),
        ("llm", json!({"status": 429, "retry_after_s": 1, "times": share(20)})),
        // Refused for a while: a person is asked, and resolves with retry_as_new.
        ("llm", json!({"status": 403, "times": share(8)})),
        ("llm", json!({"drop_after_accept": true, "times": share(10)})),
        // A 5xx after charging: the retry must carry the same key.
        ("llm", json!({"status_after_work": 500, "times": share(10)})),
        // A retry that arrives while the same key still runs is told to ask again.
        ("llm", json!({"conflict_while_running": true, "retry_after_s": 1})),
        ("llm", json!({"latency_ms": 80})),
        ("payments", json!({"status_after_work": 502, "bare": true, "times": share(5)})),
        ("payments", json!({"latency_ms": 100})),
    ];
    for (provider, rule) in rules {
        system.provider(provider).rule(rule).await;
    }
    for (id, service) in SERVICES {
        system.spawn(id, service, &extra(service)).await;
    }
    let mut tokens = Vec::new();
    for tenant in TENANTS {
        tokens.push(system.token(tenant).await);
    }
    (system, tokens)
}

/// Submits every task while services die and the broker, Postgres and writes fail once each.
async fn faults_while_the_tasks_arrive(
    system: &mut System,
    rng: &mut StdRng,
    tokens: &[String],
    plan: Plan,
    started: Instant,
) -> (HashMap<usize, String>, Figures, Figures) {
    let submitting = tokio::spawn(client(system.url_of("intake"), tokens.to_vec(), plan));
    let mut figures = Figures::default();
    let (broker_at, read_only_at, postgres_at) =
        (plan.chaos.mul_f64(0.4), plan.chaos.mul_f64(0.55), plan.chaos.mul_f64(0.7));
    // At least five service faults, however slowly a loaded machine restarts them:
    // the window stretches (to three times its length at most) until they happened.
    let faults = |f: &Figures| f.kills.values().sum::<usize>() + f.crashes.values().sum::<usize>();
    while started.elapsed() < plan.chaos || (faults(&figures) < 5 && started.elapsed() < plan.chaos * 3) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(2_000..5_000))).await;
        revive(system, &mut figures).await;
        if figures.broker_restarts == 0 && started.elapsed() >= broker_at {
            system.broker().kill();
            tokio::time::sleep(Duration::from_secs(2)).await;
            system.broker().restart().await;
            figures.broker_restarts += 1;
            continue;
        }
        if figures.read_only_spells == 0 && started.elapsed() >= read_only_at {
            // A failover to a read-only node, longer than the consumers' backoff.
            system.refuse_writes(true).await;
            // Longer than the ten tries with backoff (about 32 s) that condemn a record.
            tokio::time::sleep(Duration::from_secs(40)).await;
            system.refuse_writes(false).await;
            figures.read_only_spells += 1;
            continue;
        }
        if figures.postgres_restarts == 0 && started.elapsed() >= postgres_at {
            figures.deaths.push(Timestamp::now().0);
            system.postgres().restart_as_after_a_crash().await;
            figures.deaths.push(Timestamp::now().0);
            figures.postgres_restarts += 1;
            continue;
        }
        strike(system, rng, &mut figures).await;
    }
    let (accepted, client_figures) = submitting.await.expect("client");
    (accepted, client_figures, figures)
}

/// What the drain left: the scheduler's states, the accepted tasks, a person's resolutions.
#[derive(Debug)]
struct Drained {
    states: HashMap<uuid::Uuid, (String, i64)>,
    accepted_ids: HashSet<uuid::Uuid>,
    /// Cases a person resolved with retry_as_new, by task: at most twice each.
    resolved: HashMap<uuid::Uuid, u32>,
    unsettled_at_last_fault: Option<usize>,
}

/// Waits for every task to settle, approving and resolving as a person would, within the drain.
async fn drain(
    system: &mut System,
    figures: &mut Figures,
    tokens: &[String],
    accepted: &HashMap<usize, String>,
    plan: Plan,
) -> Drained {
    let by_tenant: HashMap<String, String> =
        TENANTS.iter().map(|t| (*t).to_owned()).zip(tokens.iter().cloned()).collect();
    let accepted_ids: HashSet<uuid::Uuid> =
        accepted.values().map(|id| id.parse::<TaskId>().expect("task id").as_uuid()).collect();
    let mut approved = HashSet::new();
    // Cases a person resolved with retry_as_new, by task: at most twice each.
    let mut resolved: HashMap<uuid::Uuid, u32> = HashMap::new();
    let deadline = Instant::now() + plan.drain;
    let mut unsettled_at_last_fault = None;
    let states = loop {
        let states = scheduler_states(system).await;
        let kinds = task_kinds(system).await;
        let resolvable = |task: &uuid::Uuid| kinds.get(task).is_some_and(|k| k == RESOLVED_KIND);
        for (task, (state, generation)) in &states {
            if state == "awaiting_approval" && !approved.contains(task) && approve(system, &by_tenant, *task).await {
                approved.insert(*task);
            }
            let times = resolved.get(task).copied().unwrap_or(0);
            if awaits_a_person(state)
                && resolvable(task)
                && *generation == i64::from(times)
                && times < 2
                && resolve_as_new(system, &by_tenant, *task).await
            {
                resolved.insert(*task, times + 1);
            }
        }
        let unsettled: Vec<_> = accepted_ids
            .iter()
            .filter(|id| {
                states.get(id).is_none_or(|(s, generation)| {
                    !SETTLED.contains(&s.as_str())
                        || s == "awaiting_approval"
                        // A resolution sent and not yet applied, or one more still to send.
                        || (awaits_a_person(s) && resolvable(id) && *generation < 2)
                })
            })
            .collect();
        unsettled_at_last_fault.get_or_insert(unsettled.len());
        if unsettled.is_empty() {
            break states;
        }
        if Instant::now() >= deadline {
            let mut by_state: BTreeMap<String, usize> = BTreeMap::new();
            for id in &unsettled {
                *by_state.entry(states.get(id).map_or("missing".into(), |s| s.0.clone())).or_default() += 1;
            }
            let sample: Vec<uuid::Uuid> = unsettled.iter().take(6).map(|id| **id).collect();
            panic!(
                "{} tasks did not settle within {:?} of the last fault: {by_state:?} (seed {})\n{}\n{}",
                unsettled.len(),
                plan.drain,
                plan.seed,
                where_they_stand(system, &sample).await,
                system.logs()
            );
        }
        revive(system, figures).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    Drained { states, accepted_ids, resolved, unsettled_at_last_fault }
}

/// 1. None lost: every accepted task is in intake and at the scheduler, settled; tasks by state.
async fn assert_none_lost<'a>(
    system: &System,
    accepted: &HashMap<usize, String>,
    drained: &'a Drained,
    plan: Plan,
) -> BTreeMap<&'a str, usize> {
    let Drained { states, accepted_ids, .. } = drained;
    let in_intake: HashSet<uuid::Uuid> = sqlx::query_scalar::<_, uuid::Uuid>("SELECT task_id FROM intake.tasks")
        .fetch_all(&system.pool)
        .await
        .expect("intake tasks")
        .into_iter()
        .collect();
    assert_eq!(accepted.len(), plan.tasks, "every submission was accepted");
    assert!(accepted_ids.is_subset(&in_intake), "an accepted task is missing from intake");
    assert_eq!(in_intake.len(), accepted_ids.len(), "a submission twice with one key made a second task");
    let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
    for id in accepted_ids {
        *by_state.entry(states[id].0.as_str()).or_default() += 1;
    }
    by_state
}

/// The charges the providers' own logs show.
#[derive(Debug)]
struct Charges {
    /// Each accepted task's number, by task id.
    numbers: HashMap<uuid::Uuid, usize>,
    /// The task numbers some provider received a call of.
    received: HashSet<u64>,
    by_provider: BTreeMap<&'static str, usize>,
}

/// 2. Charges: at most one per task and step at every provider, by the providers' own logs.
async fn assert_charged_at_most_once_per_task_and_step(
    system: &System,
    accepted: &HashMap<usize, String>,
    drained: &Drained,
    plan: Plan,
) -> Charges {
    let Drained { states, resolved, .. } = drained;
    // Only generation 0 unless a person resolved the task's case.
    let mut numbers = HashMap::new();
    for (n, id) in accepted {
        numbers.insert(id.parse::<TaskId>().expect("id").as_uuid(), *n);
    }
    let mut charges: HashMap<(&str, u64, String), usize> = HashMap::new();
    // The task numbers some provider received a call of.
    let mut received: HashSet<u64> = HashSet::new();
    let mut charges_by_provider: BTreeMap<&str, usize> = BTreeMap::new();
    for provider in PROVIDERS.iter().copied() {
        for call in system.provider(provider).calls().await {
            let Some(n) = call["input"]["task"]["n"].as_u64() else { continue };
            received.insert(n);
            if call["charged"] == true {
                let operation = call["operation"].as_str().unwrap_or_default().to_owned();
                *charges.entry((provider, n, operation)).or_default() += 1;
                *charges_by_provider.entry(provider).or_default() += 1;
            }
        }
    }
    let twice: Vec<_> = charges.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "charged more than once for one task and step: {twice:?} (seed {})", plan.seed);
    let new_generations: Vec<_> = states
        .iter()
        .filter(|(id, (_, generation))| *generation > i64::from(resolved.get(id).copied().unwrap_or(0)))
        .collect();
    assert!(new_generations.is_empty(), "a new generation without a person's resolution: {new_generations:?}");
    // A database that refused writes condemned no record.
    let condemned: Vec<String> = system
        .logs()
        .lines()
        .filter(|l| l.contains("record rejected") && (l.contains("25006") || l.contains("read-only")))
        .map(str::to_owned)
        .collect();
    assert!(condemned.is_empty(), "records dead-lettered while the database refused writes: {condemned:#?}");
    Charges { numbers, received, by_provider: charges_by_provider }
}

/// The tasks left in doubt: by reason, and those whose provider never received the call.
#[derive(Debug)]
struct Doubts {
    by_reason: BTreeMap<String, usize>,
    at_intent: usize,
}

/// 3. Every outcome_unknown is genuinely in doubt: the call arrived, or its executor died at the intent.
async fn assert_every_outcome_unknown_is_in_doubt(
    system: &System,
    drained: &Drained,
    charges: &Charges,
    figures: &Figures,
    plan: Plan,
) -> Doubts {
    let Drained { states, accepted_ids, .. } = drained;
    let Charges { numbers, received, .. } = charges;
    // The one window no record can tell from "sent, answer lost" is an executor that died
    // between committing the call intent and the request leaving: docs/architecture.md,
    // "Recovery after a lost call", makes it unknown at a provider that can neither dedupe
    // nor be asked. Every other task its provider never received was retried.
    let mut unknown_reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut unknown_at_intent = 0;
    for (id, (state, _)) in states.iter().filter(|(id, _)| accepted_ids.contains(id)) {
        let n = numbers[id] as u64;
        if state != "outcome_unknown" {
            continue;
        }
        // Only a provider that can neither dedupe nor be asked leaves a doubt that
        // no one can settle: `sketcher`, behind image.sketch.
        let (kind, reason): (String, Option<String>) =
            sqlx::query_as("SELECT kind, lifecycle->>'reason' FROM scheduler.tasks WHERE task_id = $1")
                .bind(id)
                .fetch_one(&system.pool)
                .await
                .expect("kind and reason");
        assert_eq!(kind, "image.sketch", "task {n} left in doubt at a provider that could settle it");
        *unknown_reasons.entry(reason.unwrap_or_default().chars().take(90).collect()).or_default() += 1;
        if !received.contains(&n) {
            let case: Option<(String, i64)> = sqlx::query_as(
                "SELECT last_phase, last_phase_at_us FROM reconciler.cases WHERE task_id = $1 \
                 ORDER BY attempt DESC LIMIT 1",
            )
            .bind(id)
            .fetch_optional(&system.pool)
            .await
            .expect("case");
            // Unknowable only if the worker died (or lost its database) right after
            // committing the intent: a live worker that knows it did not send says so.
            let died_there = case.as_ref().is_some_and(|(phase, at)| {
                phase == "call_intent" && figures.deaths.iter().any(|d| (*at - 1_000_000..=*at + 5_000_000).contains(d))
            });
            if !died_there {
                panic!(
                    "task {n} is outcome_unknown and its provider never received it, yet no executor died (nor \
                     Postgres restarted) between its call intent and the request leaving: {case:?} (seed {}); \
                     executor deaths and Postgres restarts (µs): {:?}\n{}\nits log lines:\n{}",
                    plan.seed,
                    figures.deaths,
                    where_they_stand(system, &[*id]).await,
                    system.lines_mentioning(&id.to_string())
                );
            }
            unknown_at_intent += 1;
        }
    }
    Doubts { by_reason: unknown_reasons, at_intent: unknown_at_intent }
}

/// 4. One live lease at a time, by fenceline.attempts and the executions; the takeovers counted.
async fn assert_one_live_lease_at_a_time(system: &System, plan: Plan) -> usize {
    // In each task's own order on fenceline.attempts, a grant is claimed only after the
    // previous one ended, and a takeover of the same grant carries a larger fencing token;
    // no two executions run at the end.
    let brokers = system.brokers.clone();
    let topic = topics::named(&system.prefix, topics::ATTEMPTS);
    let records = tokio::task::spawn_blocking(move || {
        fenceline_tests::read_until_quiet(&brokers, &topic, Duration::from_secs(5), Duration::from_secs(120))
    })
    .await
    .expect("reader");
    let mut live: HashMap<TaskId, (fenceline_domain::ids::GrantId, i64)> = HashMap::new();
    let (mut overlaps, mut takeovers, mut seen) = (Vec::new(), 0usize, HashSet::new());
    for record in &records {
        use rdkafka::message::{Headers as _, Message as _};
        let headers: Vec<(&str, Option<&[u8]>)> =
            record.headers().map(|h| h.iter().map(|h| (h.key, h.value)).collect()).unwrap_or_default();
        let Ok(envelope) = fenceline_events::Envelope::decode(headers, record.payload().unwrap_or_default()) else {
            continue;
        };
        // A relay that crashed before marking its rows sends them again: same event id.
        if !seen.insert(envelope.headers.event_id.as_uuid()) {
            continue;
        }
        match envelope.event {
            Event::AttemptClaimed(c) => match live.get(&c.task_id) {
                Some((grant, _)) if *grant != c.grant_id => overlaps.push((c.task_id, *grant, c.grant_id)),
                Some((_, token_before)) if c.fencing_token <= *token_before => {
                    overlaps.push((c.task_id, c.grant_id, c.grant_id))
                }
                Some(_) => {
                    takeovers += 1;
                    live.insert(c.task_id, (c.grant_id, c.fencing_token));
                }
                None => {
                    live.insert(c.task_id, (c.grant_id, c.fencing_token));
                }
            },
            Event::AttemptSucceeded(e) => ended(&mut live, e.task_id, e.grant_id),
            Event::AttemptFailed(e) => ended(&mut live, e.task_id, e.grant_id),
            Event::AttemptReleased(e) => ended(&mut live, e.task_id, e.grant_id),
            Event::AttemptLost(e) => ended(&mut live, e.task_id, e.grant_id),
            _ => {}
        }
    }
    assert!(overlaps.is_empty(), "two live leases on one task: {overlaps:?} (seed {})", plan.seed);
    let running_twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT task_id FROM executor.executions WHERE status = 'running' \
         GROUP BY task_id HAVING count(*) > 1) t",
    )
    .fetch_one(&system.pool)
    .await
    .expect("executions");
    assert_eq!(running_twice, 0, "a task with two running executions");
    takeovers
}

/// What the run's figures are printed from.
#[derive(Debug)]
struct Verdict<'a> {
    plan: Plan,
    accepted: usize,
    client: &'a Figures,
    faults: &'a Figures,
    by_state: &'a BTreeMap<&'a str, usize>,
    drained: &'a Drained,
    drained_in: Duration,
    charges: &'a Charges,
    doubts: &'a Doubts,
    takeovers: usize,
    started: Instant,
}

/// 5. The figures of the run.
fn print_figures(system: &System, verdict: &Verdict<'_>) {
    let Verdict {
        plan,
        accepted,
        client: client_figures,
        faults: figures,
        by_state,
        drained,
        drained_in,
        charges,
        doubts,
        takeovers,
        started,
    } = verdict;
    let (resolved, charges_by_provider) = (&drained.resolved, &charges.by_provider);
    let (unknown_reasons, unknown_at_intent) = (&doubts.by_reason, doubts.at_intent);
    let unsettled_at_last_fault = drained.unsettled_at_last_fault;
    let fenced = system.count_lines("write rejected: fenced");
    let redelivered = system.count_lines("records redelivered after a restart");
    let duplicates = system.count_lines("duplicate event skipped");
    let kills: usize = figures.kills.values().sum();
    let crashes: usize = figures.crashes.values().sum();
    println!("== chaos run, seed {} ==", plan.seed);
    println!(
        "tasks {} (submitted twice {}, replayed answers {}, client retries while intake was down {})",
        accepted, client_figures.resubmitted, client_figures.replayed, client_figures.submit_retries
    );
    println!("final states {by_state:?}");
    println!("SIGKILLs {kills} {:?}", figures.kills);
    println!("crashes at named points {crashes} {:?}", figures.crashes);
    println!(
        "broker restarts {}, Postgres restarts {}, spells of a read-only database {}, services that died on \
         their own {}",
        figures.broker_restarts, figures.postgres_restarts, figures.read_only_spells, figures.died_on_their_own
    );
    println!(
        "cases a person resolved with retry_as_new: {} tasks, {} resolutions (at providers that dedupe)",
        resolved.len(),
        resolved.values().sum::<u32>()
    );
    println!(
        "redelivery batches skipped by offset {redelivered}, duplicate events skipped {duplicates}, \
         fenced writes rejected {fenced}, grants claimed again after their lease expired {takeovers}"
    );
    println!("charges {charges_by_provider:?} for {} tasks; at most one per task and step", accepted);
    println!("outcome_unknown by reason {unknown_reasons:?}");
    println!(
        "outcome_unknown though the provider never received it (the executor died between the call intent \
         and sending): {unknown_at_intent}"
    );
    let drained_tasks = unsettled_at_last_fault.unwrap_or_default();
    println!(
        "drained {:.1} s after the last fault ({drained_tasks} tasks then unsettled, {:.1} tasks/s while draining); \
         whole run {:.1} s",
        drained_in.as_secs_f64(),
        drained_tasks as f64 / drained_in.as_secs_f64().max(0.001),
        started.elapsed().as_secs_f64()
    );
}

/// Whether the task waits for a person.
fn awaits_a_person(state: &str) -> bool {
    state == "needs_human" || state == "outcome_unknown"
}

/// The kind whose cases the person of this run resolves: its paid step is at a
/// provider that dedupes (`llm`), where `retry_as_new` sends the key in doubt again
/// and can never be charged twice.
const RESOLVED_KIND: &str = "ticket.reply";

/// Every task's kind, at the scheduler.
async fn task_kinds(system: &System) -> HashMap<uuid::Uuid, String> {
    sqlx::query_as::<_, (uuid::Uuid, String)>("SELECT task_id, kind FROM scheduler.tasks")
        .fetch_all(&system.pool)
        .await
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// Resolves the task's open case with `retry_as_new` through intake's API, as a
/// person of its tenant would; whether intake took it.
async fn resolve_as_new(system: &System, tokens: &HashMap<String, String>, task: uuid::Uuid) -> bool {
    let row: Option<(String, Option<String>)> = sqlx::query_as(
        "SELECT i.tenant, s.lifecycle->>'case_id' FROM intake.tasks i \
         JOIN scheduler.tasks s ON s.task_id = i.task_id WHERE i.task_id = $1",
    )
    .bind(task)
    .fetch_optional(&system.pool)
    .await
    .unwrap_or(None);
    let Some((tenant, Some(case_id))) = row else { return false };
    let Some(token) = tokens.get(&tenant) else { return false };
    let url = format!("{}/v1/tasks/{task}/resolution", system.url_of("intake"));
    let body = json!({"case_id": case_id, "action": "retry_as_new", "acknowledge_possible_charge": true});
    matches!(fenceline_tests::system::http_as("POST", url, token, Some(body)).await, Ok((202, _)))
}

/// The grant's attempt ended: no lease of it is live any more.
fn ended(
    live: &mut HashMap<TaskId, (fenceline_domain::ids::GrantId, i64)>,
    task: TaskId,
    grant: fenceline_domain::ids::GrantId,
) {
    if live.get(&task).is_some_and(|(g, _)| *g == grant) {
        live.remove(&task);
    }
}
