//! A slow provider does not make itself slower: while a provider's latency climbs
//! past its call timeout and half of its calls fail, the scheduler's adaptive
//! limit (docs/execution.md, "Adaptive concurrency") sends it fewer calls per
//! second than before the fault instead of a storm of retries; nothing is charged
//! twice, the reasons of waiting tasks name the reduced limit, and the limit comes
//! back to the configured concurrency once the provider is healthy again. The
//! fake provider's call log is the truth about what it received and when.

#![allow(clippy::print_stdout)] // the call rates are the figures of this test

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

/// Tasks submitted per second, before, during and after the fault.
const RATE: usize = 6;
const CEILING: u32 = 8;

fn epoch_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Calls the provider received per second between two instants (ms since the epoch).
fn calls_per_second(calls: &[Value], from: u64, to: u64) -> f64 {
    let count =
        calls.iter().filter(|c| c["received_at_ms"].as_u64().is_some_and(|at| (from..to).contains(&at))).count();
    count as f64 * 1_000.0 / (to - from) as f64
}

/// The provider's limit as the scheduler keeps it: (slots, reduced after).
async fn limit(system: &System) -> Option<(f64, Option<String>)> {
    sqlx::query_as("SELECT (state->>'limit')::float8, state->>'reduced_after' FROM scheduler.provider_limits WHERE provider = 'img'")
        .fetch_optional(&system.pool)
        .await
        .unwrap_or(None)
}

/// Submits `RATE` tasks a second for `how_long`, numbering them from `first`.
async fn submit_for(system: &System, how_long: Duration, first: usize, ids: &mut Vec<uuid::Uuid>) {
    let started = Instant::now();
    let mut n = first;
    while started.elapsed() < how_long {
        let batch = RATE / 2;
        let base = n;
        let sent = system
            .submit_many_with("acme", "image.generate", batch, |i, task| {
                task.input_json = json!({"n": base + i}).to_string();
            })
            .await;
        ids.extend(sent.iter().map(|id| id.as_uuid()));
        n += batch;
        let due = started + Duration::from_millis(500 * ((n - first) / batch) as u64);
        tokio::time::sleep_until(due.into()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_in_trouble_gets_fewer_calls_and_its_limit_recovers() {
    let test_started = Instant::now();
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.set_provider_limits("img", CEILING, 100.0, 100.0);
    // 503 is the provider's own "nothing done"; a call past 2 s times out (ambiguous:
    // the work may have been done, and a look-up settles it).
    system.set_provider_field("img", "safe_5xx", json!([503]));
    system.set_provider_field("img", "call_timeout_ms", json!(2_000));
    system.set_provider_field("img", "registration_ms", json!(200));
    system.set_kinds(json!({
        "image.generate": {"steps": [{"name": "render", "provider": "img"}],
                           "max_attempts": 30, "attempt_budget_ms": 30_000}
    }));
    let img = system.provider("img");
    img.rule(json!({"latency_ms": 50})).await;
    system.spawn_all(None).await;

    let mut ids = Vec::new();
    let healthy_from = epoch_ms();
    submit_for(&system, Duration::from_secs(5), 0, &mut ids).await;
    let fault_from = epoch_ms();

    // The fault: every second call fails at once with 503, and the others take
    // longer and longer (past the call timeout after ~35 calls).
    let img = system.provider("img");
    let (status, _) =
        fenceline_tests::system::http("DELETE", format!("{}/admin/rules", img.base), None).await.expect("clear rules");
    assert!((200..300).contains(&status));
    img.rule(json!({"status": 503, "share": 0.5})).await;
    img.rule(json!({"latency_ms": 600, "latency_step_ms": 40, "latency_max_ms": 3_000})).await;
    let first = ids.len();
    submit_for(&system, Duration::from_secs(10), first, &mut ids).await;
    let fault_to = epoch_ms();
    let reduced = limit(&system).await;
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM scheduler.tasks WHERE lifecycle->>'reason' LIKE 'waiting for a slot: img limit % of 8, reduced after %'",
    )
    .fetch_one(&system.pool)
    .await
    .unwrap_or(0);

    // Healthy again.
    let (status, _) =
        fenceline_tests::system::http("DELETE", format!("{}/admin/rules", img.base), None).await.expect("clear rules");
    assert!((200..300).contains(&status));
    img.rule(json!({"latency_ms": 50})).await;
    let first = ids.len();
    submit_for(&system, Duration::from_secs(3), first, &mut ids).await;

    // Every task succeeds, and the limit is back at the ceiling.
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let done: i64 =
            sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded' AND task_id = ANY($1)")
                .bind(&ids)
                .fetch_one(&system.pool)
                .await
                .unwrap_or(0);
        if done == ids.len() as i64 {
            break;
        }
        if Instant::now() >= deadline {
            let states: Vec<(String, i64)> =
                sqlx::query_as("SELECT state, count(*) FROM scheduler.tasks WHERE task_id = ANY($1) GROUP BY state")
                    .bind(&ids)
                    .fetch_all(&system.pool)
                    .await
                    .unwrap_or_default();
            panic!(
                "{done} of {} tasks succeeded: {states:?}; limit {:?}, raised {} times\n{}",
                ids.len(),
                limit(&system).await,
                system.count_lines("provider limit raised"),
                system.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let recovered = limit(&system).await;

    let calls = system.provider("img").calls().await;
    let before = calls_per_second(&calls, healthy_from + 1_000, fault_from);
    let during = calls_per_second(&calls, fault_from, fault_to);
    // Once the limit has adapted (its first decreases take a few seconds).
    let adapted = calls_per_second(&calls, fault_from + 4_000, fault_to);
    println!(
        "calls/s at the provider: before {before:.2}, during the fault {during:.2} (after the first 4 s: {adapted:.2}); \
         limit at the fault's end {reduced:?}, after it {recovered:?}; {held} tasks waiting on the reduced limit; \
         {} tasks, {} calls, {:.1} s",
        ids.len(),
        calls.len(),
        test_started.elapsed().as_secs_f64()
    );
    // Once the limit has come down, the provider in trouble gets fewer calls than
    // when it was healthy; over the whole fault, not many more (the first failures
    // arrive at the full limit).
    assert!(
        adapted < before,
        "the provider in trouble got more calls per second ({adapted:.2}) than before ({before:.2})"
    );
    assert!(during < before * 1.5, "the fault brought a storm of calls: {during:.2} a second, {before:.2} before");
    let reduced_limit = reduced.as_ref().map_or(f64::from(CEILING), |(limit, _)| *limit);
    assert!(reduced_limit < f64::from(CEILING), "the limit was reduced during the fault: {reduced:?}");
    assert!(held > 0, "waiting tasks name the reduced limit in their reason");
    assert!(system.count_lines("provider limit reduced") > 0, "the reduction is logged");
    assert_eq!(recovered.as_ref().map(|(limit, after)| (*limit, after.clone())), Some((f64::from(CEILING), None)));
    assert!(system.count_lines("provider limit back at its ceiling") > 0, "the recovery is logged");

    // Nothing charged twice: one charge per task.
    let mut charges: HashMap<u64, usize> = HashMap::new();
    for call in &calls {
        if call["charged"] == true
            && let Some(n) = call["input"]["task"]["n"].as_u64()
        {
            *charges.entry(n).or_default() += 1;
        }
    }
    let twice: Vec<_> = charges.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "charged twice (task number, charges): {twice:?}");
    assert_eq!(charges.len(), ids.len(), "every task charged once");
}
