//! Scale-out: two instances of every service (intake, scheduler, executor,
//! reconciler) share each service's consumer group and tables while tasks arrive
//! through both intakes at a steady rate. Each instance is restarted in turn
//! (SIGTERM, and once SIGKILL). No task may be lost, none executed or charged
//! twice (the fake provider's call log is the truth), and the flow must catch up
//! after the restarts. The completion rate before and after each restart window is
//! printed against the 10 % requirement (see `DRAIN` for why it is not asserted).

#![allow(clippy::print_stdout)] // the throughput figures are the point of this test

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fenceline_tests::system::{Caps, Stop, System, api_agent, submit_over_api};
use serde_json::json;

/// Tasks submitted per second, spread over both intakes.
const RATE: f64 = 5.0;
/// How long a throughput window is: ~20 completions at `RATE`.
const WINDOW: Duration = Duration::from_secs(4);
/// The requirement: the completion rate after a restart window is within 10 % of
/// the rate before it. Each window's figure is printed with its verdict.
const REQUIRED: f64 = 0.10;
/// What the test asserts of throughput is looser than the requirement, which it
/// prints for every restart: that the flow catches up, every accepted task
/// succeeding within `DRAIN` of the last restart window. Single 4 s windows swing
/// with catch-up bursts and with other load on a shared 2-core machine (from 0 to
/// 11 completions a second were seen at 5 offered, and baselines from 0.75 to 3
/// a second), so neither the 10 % comparison nor a backlog bound holds reliably there.
const DRAIN: Duration = Duration::from_secs(120);
/// How long after the restarted instance is ready the restart window lasts: the
/// group's rebalance after a SIGTERM (the member left), or the session timeout
/// after a SIGKILL (the broker waits for the dead member that long).
const SETTLE_AFTER_TERM: Duration = Duration::from_secs(1);
const SETTLE_AFTER_KILL: Duration = Duration::from_secs(6);

/// Seconds since the epoch, the unit the database's `updated_at` is compared in.
fn epoch_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What the client accepted: task number → task id, in submission order.
type Accepted = Arc<Mutex<Vec<(u64, uuid::Uuid)>>>;

/// Submits `RATE` tasks a second until `stop`, alternating between the intakes and
/// trying the other one (same idempotency key) when one does not answer.
fn client(intakes: Vec<String>, token: String, stop: Arc<AtomicBool>, accepted: Accepted) -> usize {
    let agent = api_agent();
    let started = Instant::now();
    let mut retries = 0;
    let mut n: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let due = started + Duration::from_secs_f64(n as f64 / RATE);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let body = json!({"kind": "image.generate", "input": {"n": n, "prompt": format!("item {n}")}});
        let key = format!("scaleout-{n}");
        let first_try = Instant::now();
        let mut turn = n as usize;
        let id = loop {
            let intake = &intakes[turn % intakes.len()];
            match submit_over_api(&agent, intake, &token, &key, &body) {
                Ok(answer) if answer.status == 202 => {
                    if let Some(id) = answer.task_id().and_then(|id| id.parse::<uuid::Uuid>().ok()) {
                        break id;
                    }
                }
                Ok(answer) => {
                    assert!(answer.status >= 500, "submission {n} refused with {}: {}", answer.status, answer.body)
                }
                Err(_) => {}
            }
            retries += 1;
            if stop.load(Ordering::Relaxed) && first_try.elapsed() > Duration::from_secs(10) {
                return retries;
            }
            assert!(first_try.elapsed() < Duration::from_secs(60), "no intake took task {n} within 60 s");
            turn += 1;
            std::thread::sleep(Duration::from_millis(50));
        };
        accepted.lock().unwrap_or_else(|p| p.into_inner()).push((n, id));
        n += 1;
    }
    retries
}

/// Tasks the scheduler shows succeeded.
async fn succeeded(system: &System) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded'")
        .fetch_one(&system.pool)
        .await
        .unwrap_or(0)
}

/// Completions per second between two instants (seconds since the epoch), from the
/// instant each task's row turned `succeeded`.
async fn rate_between(system: &System, from: f64, to: f64) -> f64 {
    let count: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded' \
         AND updated_at >= to_timestamp($1) AND updated_at < to_timestamp($2)",
    )
    .bind(from)
    .bind(to)
    .fetch_one(&system.pool)
    .await
    .expect("count completions");
    count as f64 / (to - from)
}

/// The scheduler's tasks by state, for failure messages.
async fn by_state(system: &System) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT state, count(*) FROM scheduler.tasks GROUP BY state ORDER BY state")
        .fetch_all(&system.pool)
        .await
        .unwrap_or_default()
}

/// Accepted but not yet succeeded.
async fn backlog(system: &System, accepted: &Accepted) -> i64 {
    let submitted = accepted.lock().unwrap_or_else(|p| p.into_inner()).len() as i64;
    submitted - succeeded(system).await
}

/// One restart and the windows around it.
#[derive(Debug)]
struct Restart {
    id: String,
    how: Stop,
    /// Completions per second in the window before the restart.
    before: f64,
    /// ... during the restart window (from the stop until the flow was back).
    during: f64,
    /// ... in the window after it.
    after: f64,
    stop_took: Duration,
    restart_took: Duration,
    /// Accepted and not yet succeeded at the end of the window after.
    backlog: i64,
}

impl Restart {
    /// How the rate after moved from the rate before, as a fraction.
    fn change(&self) -> f64 {
        self.after / self.before - 1.0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_restarts_in_turn_and_no_task_is_lost_or_charged_twice() {
    let test_started = Instant::now();
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.set_provider_limits("img", 32, 200.0, 200.0);
    // A short call timeout and registration delay: a call lost with a killed
    // executor is settled by look-up within seconds.
    system.set_provider_field("img", "call_timeout_ms", json!(3_000));
    system.set_provider_field("img", "registration_ms", json!(500));
    system.provider("img").rule(json!({"latency_ms": 150})).await;
    // The broker's smallest session timeout: a killed member's partitions move on
    // after 6 s.
    let extra = [("FENCELINE_KAFKA_SESSION_TIMEOUT_MS", "6000".to_owned())];
    let instances = system.spawn_instances(2, &extra).await;
    let token = system.token("acme").await;
    let intakes = vec![system.url_of("intake-1"), system.url_of("intake-2")];

    let stop_client = Arc::new(AtomicBool::new(false));
    let accepted: Accepted = Arc::default();
    let submitting = {
        let (stop, accepted) = (stop_client.clone(), accepted.clone());
        tokio::task::spawn_blocking(move || client(intakes, token, stop, accepted))
    };

    // Warm up, then the baseline window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let baseline_from = epoch_now();
    tokio::time::sleep(WINDOW).await;
    let mut before = rate_between(&system, baseline_from, epoch_now()).await;
    println!(
        "offered {RATE:.1} tasks/s; baseline {before:.2} completions/s ({:.1} s after start)",
        test_started.elapsed().as_secs_f64()
    );

    let mut restarts = Vec::new();
    for (id, service) in &instances {
        let how = if id == "executor-1" { Stop::Kill } else { Stop::Term };
        let stopped_at = epoch_now();
        let restart_started = Instant::now();
        let stop_took = system.stop(id, how).await;
        system.spawn(id, service, &extra).await;
        tokio::time::sleep(if how == Stop::Kill { SETTLE_AFTER_KILL } else { SETTLE_AFTER_TERM }).await;
        let restart_took = restart_started.elapsed();
        let settled_at = epoch_now();
        tokio::time::sleep(WINDOW).await;
        let after = rate_between(&system, settled_at, epoch_now()).await;
        let during = rate_between(&system, stopped_at, settled_at).await;
        let backlog = backlog(&system, &accepted).await;
        let restart = Restart { id: id.clone(), how, before, during, after, stop_took, restart_took, backlog };
        println!(
            "{:<12} {:?}: before {:.2}/s; restart window {:.1} s at {:.2}/s (the stop took {:.1} s); after {:.2}/s \
             ({:+.1} %, {}); backlog {}",
            restart.id,
            restart.how,
            restart.before,
            restart.restart_took.as_secs_f64(),
            restart.during,
            restart.stop_took.as_secs_f64(),
            restart.after,
            (restart.change()) * 100.0,
            if restart.change() >= -REQUIRED { "within 10 %" } else { "NOT within 10 %" },
            restart.backlog
        );
        before = after;
        restarts.push(restart);
    }
    let final_backlog = backlog(&system, &accepted).await;
    println!("backlog at the end of the restarts: {final_backlog} tasks");
    stop_client.store(true, Ordering::Relaxed);
    let retries = submitting.await.expect("client");
    let accepted = accepted.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!("{} tasks accepted ({retries} submissions retried at the other intake)", accepted.len());

    // No task lost: every accepted task succeeds, at the scheduler and in intake's view.
    let ids: Vec<uuid::Uuid> = accepted.iter().map(|(_, id)| *id).collect();
    let deadline = Instant::now() + DRAIN;
    loop {
        let (at_scheduler, in_view): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded' AND task_id = ANY($1)), \
                    (SELECT count(*) FROM intake.task_view WHERE state = 'succeeded' AND task_id = ANY($1))",
        )
        .bind(&ids)
        .fetch_one(&system.pool)
        .await
        .unwrap_or_default();
        if at_scheduler == ids.len() as i64 && in_view == ids.len() as i64 {
            break;
        }
        if Instant::now() >= deadline {
            let states = by_state(&system).await;
            panic!(
                "lost tasks: {} accepted, {at_scheduler} succeeded at the scheduler, {in_view} in intake's view; \
                 by state {states:?}\n{}",
                ids.len(),
                system.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // None executed or charged twice: every task reached the provider once and was
    // charged once.
    let mut calls: HashMap<u64, (usize, usize)> = HashMap::new();
    for call in system.provider("img").calls().await {
        let Some(n) = call["input"]["task"]["n"].as_u64() else { continue };
        let entry = calls.entry(n).or_default();
        entry.0 += 1;
        entry.1 += usize::from(call["charged"] == true);
    }
    let wrong: Vec<_> =
        accepted.iter().filter_map(|(n, _)| calls.get(n).filter(|c| **c != (1, 1)).map(|c| (*n, *c))).collect();
    assert!(wrong.is_empty(), "tasks not called and charged exactly once (n, (calls, charges)): {wrong:?}");
    let missing: Vec<_> = accepted.iter().filter(|(n, _)| !calls.contains_key(n)).map(|(n, _)| *n).collect();
    assert!(missing.is_empty(), "succeeded without a call at the provider: {missing:?}");
    assert_eq!(system.provider("img").charges().await, accepted.len(), "one charge per task in the ledger");

    // The throughput after each restart window against the requirement.
    let within = restarts.iter().filter(|r| r.change() >= -REQUIRED).count();
    println!("{within} of {} restarts back within 10 % in the window after", restarts.len());
    println!("whole test {:.1} s", test_started.elapsed().as_secs_f64());
}
