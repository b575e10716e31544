//! Submission benchmark: intake's `POST /v1/tasks` at a fixed offered load, against a
//! baseline of `GET /healthz` (same server, no database) measured in the same run.
//! Prints each run and the medians. Settings: `BENCH_RATE` (requests per second,
//! default 200), `BENCH_SECONDS` (per measurement, default 10), `BENCH_RUNS`
//! (default 3). Run through `deploy/local/stack bench`.
//!
//! Latency is measured from the moment a request was due, not from when it was
//! sent, so a stalled server is not hidden by a client that waited for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fenceline_events::topics;
use fenceline_intake::auth::{Tenant, create_token};
use fenceline_tests::*;

/// Sends request number `i` with an agent; true if it was answered as expected.
type Request = Arc<dyn Fn(&ureq::Agent, u64) -> bool + Send + Sync>;

#[derive(Debug, Clone, Copy)]
struct Figures {
    achieved_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Offers `rate` requests per second for `seconds` from `workers` threads.
fn offer(rate: u64, seconds: u64, workers: usize, request: Request) -> Figures {
    let total = rate * seconds;
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now() + Duration::from_millis(100);
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (next, errors, request) = (next.clone(), errors.clone(), request.clone());
            std::thread::spawn(move || {
                let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        return latencies;
                    }
                    let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    if !request(&agent, i) {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    latencies.push(due.elapsed());
                }
            })
        })
        .collect();
    let mut latencies: Vec<Duration> = handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect();
    let elapsed = start.elapsed().as_secs_f64();
    latencies.sort();
    let at = |q: f64| latencies.get(((latencies.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default();
    Figures {
        achieved_per_s: latencies.len() as f64 / elapsed,
        p50_ms: at(0.50).as_secs_f64() * 1e3,
        p99_ms: at(0.99).as_secs_f64() * 1e3,
        errors: errors.load(Ordering::Relaxed),
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[allow(clippy::print_stdout)]
fn report(name: &str, runs: &[Figures]) {
    for (i, f) in runs.iter().enumerate() {
        println!(
            "{name:<10} run {}: {:>7.1} req/s  p50 {:>7.2} ms  p99 {:>7.2} ms  errors {}",
            i + 1,
            f.achieved_per_s,
            f.p50_ms,
            f.p99_ms,
            f.errors
        );
    }
    let pick = |f: fn(&Figures) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
    println!(
        "{name:<10} median: {:>7.1} req/s  p50 {:>7.2} ms  p99 {:>7.2} ms",
        pick(|f| f.achieved_per_s),
        pick(|f| f.p50_ms),
        pick(|f| f.p99_ms)
    );
}

#[allow(clippy::print_stdout)]
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (rate, seconds, runs) = (setting("BENCH_RATE", 200), setting("BENCH_SECONDS", 10), setting("BENCH_RUNS", 3));
    let url = fresh_database().await;
    let prefix = fresh_topics_with(&[
        topics::TASKS,
        topics::STATUS,
        topics::ATTEMPTS,
        topics::RECOVERY,
        topics::DEADLETTER,
        topics::INTAKE_REQUESTS,
    ])
    .await;
    let config = intake_config(&url, &prefix, vec!["image.generate".into()]);
    let app = fenceline_intake::build(config).await.expect("intake starts");
    let pool = app.base.database.pool.clone();
    let base = format!("http://127.0.0.1:{}", app.port());
    tokio::spawn(app.run_until(std::future::pending()));
    let (_, token) = create_token(&pool, &Tenant::parse("bench").expect("tenant"), "bench").await.expect("token");
    println!(
        "offered load {rate} req/s for {seconds} s, {runs} runs; intake and the client share this machine's 2 cores"
    );

    let health_url = format!("{base}/healthz");
    let health: Request = Arc::new(move |agent, _| agent.get(&health_url).call().is_ok_and(|r| r.status() == 200));
    let submit_url = format!("{base}/v1/tasks");
    let run_id = uuid::Uuid::now_v7().simple().to_string();
    let submit: Request = Arc::new(move |agent, i| {
        agent
            .post(&submit_url)
            .header("Authorization", format!("Bearer {token}"))
            .header("Idempotency-Key", format!("{run_id}-{i}"))
            .header("Content-Type", "application/json")
            .send(format!(r#"{{"kind":"image.generate","input":{{"prompt":"shoe {i}"}}}}"#))
            .is_ok_and(|r| r.status() == 202)
    });

    let (mut baseline, mut submissions) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let (h, s) = (health.clone(), submit.clone());
        let b = tokio::task::spawn_blocking(move || offer(rate, seconds, 32, h)).await.expect("baseline");
        let m = tokio::task::spawn_blocking(move || {
            // Keys must be unique across runs: shift the index space per run.
            let shifted: Request = Arc::new(move |agent, i| s(agent, i + run * 1_000_000_000));
            offer(rate, seconds, 32, shifted)
        })
        .await
        .expect("submit");
        baseline.push(b);
        submissions.push(m);
    }
    report("healthz", &baseline);
    report("submit", &submissions);
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks").fetch_one(&pool).await.expect("count");
    println!("tasks created: {tasks}");
}
