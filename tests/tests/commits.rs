//! What one task costs Postgres, end to end (docs/performance.md, "Where a task's
//! commits go"): a whole system (intake, scheduler, executor, reconciler) runs
//! `FENCELINE_COMMITS_TASKS` one-step tasks (200 by default) submitted through
//! intake's API, and the database's committed transactions, assigned transaction
//! ids and WAL bytes are read before and after, less what the idle system commits
//! in the same time. Each service's statements are counted from its own statement
//! log. Counts, not seconds: they hold on a busy machine. The test fails when a task
//! costs more commits than the budget, so that a change which adds some is seen.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

/// Most committed transactions a one-step task may cost across every service, the
/// idle system's own subtracted.
const COMMITS_PER_TASK_BUDGET: f64 = 14.0;

const SERVICES: [&str; 4] = ["intake", "scheduler", "executor", "reconciler"];

/// The database's counters at one moment.
#[derive(Debug, Clone, Copy)]
struct Counters {
    at: Instant,
    commits: i64,
    rollbacks: i64,
    xids: i64,
    wal_bytes: i64,
}

/// Reads the counters. Backends report their statistics at most once a second while
/// busy and within ten seconds when idle, so callers let the system settle first.
async fn counters(pool: &sqlx::PgPool) -> Counters {
    let (commits, rollbacks, xids, wal_bytes): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT xact_commit, xact_rollback, txid_snapshot_xmax(txid_current_snapshot()), \
         pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint \
         FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await
    .expect("read the database's counters");
    Counters { at: Instant::now(), commits, rollbacks, xids, wal_bytes }
}

/// Rows inserted, updated (and of those, updated in place: HOT) and deleted in each
/// service table, keyed `schema.table`.
async fn row_writes(pool: &sqlx::PgPool) -> std::collections::BTreeMap<String, [i64; 4]> {
    let rows: Vec<(String, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del \
         FROM pg_stat_user_tables WHERE schemaname = ANY($1)",
    )
    .bind(SERVICES)
    .fetch_all(pool)
    .await
    .expect("read the tables' row counters");
    rows.into_iter().map(|(table, ins, upd, hot, del)| (table, [ins, upd, hot, del])).collect()
}

/// How long a backend may hold back its statistics (PostgreSQL's idle flush interval).
const STATS_SETTLE: Duration = Duration::from_secs(11);

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn submit(intake: &str, token: &str, n: usize) -> Result<String, String> {
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .new_agent();
    let body = json!({"kind": "image.generate", "input": {"prompt": format!("shoe {n}")}});
    let mut response = agent
        .post(&format!("{intake}/v1/tasks"))
        .header("Authorization", &format!("Bearer {token}"))
        .header("Idempotency-Key", &format!("commits-{n}"))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let answer: Value =
        serde_json::from_str(&response.body_mut().read_to_string().unwrap_or_default()).unwrap_or(Value::Null);
    match (status, answer["task_id"].as_str()) {
        (202, Some(id)) => Ok(id.to_owned()),
        _ => Err(format!("submission {n} answered {status}: {answer}")),
    }
}

/// Submits tasks `from..to` from a few threads at once.
async fn submit_all(intake: String, token: String, from: usize, to: usize) {
    let next = Arc::new(AtomicUsize::new(from));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (next, intake, token) = (next.clone(), intake.clone(), token.clone());
            tokio::task::spawn_blocking(move || {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= to {
                        return;
                    }
                    submit(&intake, &token, n).expect("submitted");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("submitter");
    }
}

/// Waits until `count` tasks succeeded; returns how many times it asked.
async fn wait_succeeded(system: &System, count: i64, timeout: Duration) -> i64 {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut asked = 0;
    loop {
        asked += 1;
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded'")
            .fetch_one(&system.pool)
            .await
            .expect("count succeeded tasks");
        if done >= count {
            return asked;
        }
        assert!(tokio::time::Instant::now() < deadline, "only {done} of {count} tasks succeeded:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What one service's statement log counts.
#[derive(Debug, Clone, Default)]
struct Statements {
    /// Statements sent, with `COMMIT`s and savepoint releases (sqlx pipelines
    /// `BEGIN` and `SAVEPOINT` with the next statement and does not log them).
    logged: usize,
    commits: usize,
    savepoints: usize,
    /// Statements by their log summary (sqlx's first words of the statement).
    by_summary: std::collections::BTreeMap<String, usize>,
}

fn statements(system: &System, service: &str) -> Statements {
    let Some(proc) = system.services.get(service) else { return Statements::default() };
    let lines = proc.lines_with("\"target\":\"sqlx::query\"");
    let mut counted = Statements { logged: lines.len(), ..Statements::default() };
    for line in &lines {
        let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
        let summary = v["summary"].as_str().or(v["fields"]["summary"].as_str()).unwrap_or_default();
        *counted.by_summary.entry(summary.to_owned()).or_default() += 1;
        let summary = summary.to_ascii_uppercase();
        if summary.starts_with("COMMIT") {
            counted.commits += 1;
        } else if summary.starts_with("RELEASE SAVEPOINT") {
            counted.savepoints += 1;
        }
    }
    counted
}

// The figures are the test's output.
#[allow(clippy::print_stdout)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_step_task_costs_few_postgres_commits_end_to_end() {
    let tasks = setting("FENCELINE_COMMITS_TASKS", 100);
    let warmup = 10;
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    system.set_provider_limits("img", 64, 100_000.0, 100_000.0);
    // Every statement in each service's log, to count them per service.
    let log = ("RUST_LOG", "info,sqlx::query=trace,rdkafka=warn".to_owned());
    // Published rows deleted, as by default, not kept for the suites to read.
    let outbox = ("FENCELINE_OUTBOX_KEEP_PUBLISHED_SECONDS", "0".to_owned());
    let intake_settings = [("FENCELINE_INTAKE_KINDS", "image.generate".into()), log.clone(), outbox.clone()];
    system.spawn("intake", "intake", &intake_settings).await;
    for service in ["scheduler", "reconciler", "executor"] {
        system.spawn(service, service, &[log.clone(), outbox.clone()]).await;
    }
    let token = system.token("acme").await;
    let intake = system.url_of("intake");

    // Warm up (connections, prepared statements, partitions taken over).
    submit_all(intake.clone(), token.clone(), 0, warmup).await;
    wait_succeeded(&system, warmup as i64, Duration::from_secs(90)).await;
    tokio::time::sleep(STATS_SETTLE).await;
    let before_statements: Vec<_> = SERVICES.iter().map(|s| statements(&system, s)).collect();

    // What the idle system commits on its own (relays, periodic work).
    let idle_start = counters(&system.pool).await;
    let rows_before = row_writes(&system.pool).await;
    tokio::time::sleep(STATS_SETTLE).await;
    let idle_end = counters(&system.pool).await;
    let idle_secs = idle_end.at.duration_since(idle_start.at).as_secs_f64();
    let idle_commits_per_s = (idle_end.commits - idle_start.commits - 1) as f64 / idle_secs;
    let idle_xids_per_s = (idle_end.xids - idle_start.xids) as f64 / idle_secs;

    let started = Instant::now();
    submit_all(intake, token, warmup, warmup + tasks).await;
    let asked = wait_succeeded(&system, (warmup + tasks) as i64, Duration::from_secs(600)).await;
    let busy = started.elapsed();
    tokio::time::sleep(STATS_SETTLE).await;
    let end = counters(&system.pool).await;
    let rows_after = row_writes(&system.pool).await;

    let secs = end.at.duration_since(idle_end.at).as_secs_f64();
    // The test's own reads: its polls and this last read.
    let own = (asked + 1) as f64;
    let commits = (end.commits - idle_end.commits) as f64 - own - idle_commits_per_s * secs;
    let xids = (end.xids - idle_end.xids) as f64 - idle_xids_per_s * secs;
    let per_task = commits / tasks as f64;
    println!(
        "{tasks} one-step tasks in {:.1} s: {per_task:.2} commits per task ({:.2} rolled back), \
         {:.2} transaction ids per task, {:.0} WAL bytes per task; idle system: {idle_commits_per_s:.1} commits/s",
        busy.as_secs_f64(),
        (end.rollbacks - idle_end.rollbacks) as f64 / tasks as f64,
        xids / tasks as f64,
        (end.wal_bytes - idle_end.wal_bytes) as f64 / tasks as f64,
    );
    // Statements per service, over the warm-up, the idle window and the run together
    // less the warm-up's: the idle window's are included (relay rounds, sweeps).
    for (service, before) in SERVICES.iter().zip(before_statements) {
        let after = statements(&system, service);
        let per_task = |after: usize, before: usize| (after - before) as f64 / tasks as f64;
        println!(
            "  {service:<10} {:>6.2} statements, {:>5.2} transactions committed, {:>5.2} savepoints per task \
             (the idle window's included)",
            per_task(after.logged, before.logged),
            per_task(after.commits, before.commits),
            per_task(after.savepoints, before.savepoints),
        );
        // Which statements: the most frequent first.
        let mut by_summary: Vec<(f64, &str)> = after
            .by_summary
            .iter()
            .map(|(summary, n)| (per_task(*n, before.by_summary.get(summary).copied().unwrap_or(0)), summary.as_str()))
            .filter(|(n, _)| *n >= 0.05)
            .collect();
        by_summary.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (n, summary) in by_summary {
            println!("      {n:>5.2}  {summary}");
        }
    }
    // Row writes per table (the idle window's included): an update that changes no
    // indexed column and finds room on its page is HOT, and writes no index entry.
    for (table, after) in &rows_after {
        let before = rows_before.get(table).copied().unwrap_or_default();
        let [ins, upd, hot, del] = [0, 1, 2, 3].map(|i| after[i] - before[i]);
        if ins + upd + del == 0 {
            continue;
        }
        let per_task = |n: i64| n as f64 / tasks as f64;
        println!(
            "  {table:<34} {:>5.2} inserted, {:>5.2} updated ({:>5.2} HOT), {:>5.2} deleted per task",
            per_task(ins),
            per_task(upd),
            per_task(hot),
            per_task(del),
        );
    }
    assert!(
        per_task <= COMMITS_PER_TASK_BUDGET,
        "a one-step task costs {per_task:.2} commits, over the budget of {COMMITS_PER_TASK_BUDGET}"
    );
}

/// An idle executor looks for work once per poll interval, not once per worker: one
/// idle worker looks on a timer and the others wait until a grant or a worker that
/// found work wakes them (docs/performance.md, "Background work").
#[allow(clippy::print_stdout)] // the claims a second are the test's figure
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_executor_looks_for_work_once_per_poll_interval_not_once_per_worker() {
    const WORKERS: usize = 8;
    const POLL: Duration = Duration::from_millis(250);
    let mut system = System::new(&[("img", Caps::default())]).await;
    let settings = [
        ("RUST_LOG", "info,sqlx::query=trace,rdkafka=warn".to_owned()),
        ("FENCELINE_EXECUTOR_WORKERS", WORKERS.to_string()),
        ("FENCELINE_EXECUTOR_IDLE_POLL_MS", POLL.as_millis().to_string()),
    ];
    system.spawn("executor", "executor", &settings).await;
    // The claim statement is the only one that locks executions this way.
    let claims = |system: &System| system.services["executor"].lines_with("FOR UPDATE OF executions SKIP LOCKED").len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (before, started) = (claims(&system), Instant::now());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let per_second = (claims(&system) - before) as f64 / started.elapsed().as_secs_f64();
    println!("an idle executor with {WORKERS} workers sent {per_second:.1} claims a second (poll every {POLL:?})");
    let one_looker = 1.0 / POLL.as_secs_f64();
    assert!(
        per_second > 0.0 && per_second <= 2.0 * one_looker,
        "{per_second:.1} claims a second: more than one idle worker looks for work on a timer \
         (one would send about {one_looker:.0})"
    );
}
