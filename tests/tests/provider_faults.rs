//! Providers that misbehave after they accepted or did the work, end to end on the
//! real stack: a poll that fails, a gateway's 504 after the work, a 409 while the
//! same key still runs, a stale worker's definite answer. The fake provider's call
//! log and ledger judge what was charged: each of these once paid twice, or ended
//! in a state that claimed more than was known.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// Charged calls at the provider, and all calls it received.
async fn calls(system: &System, provider: &str) -> (usize, usize) {
    let p = system.provider(provider);
    (p.charges().await, p.calls().await.len())
}

/// The operation keys and outcomes of every call the provider received, in order.
async fn log(system: &System, provider: &str) -> Vec<(String, String)> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    system.provider(provider).calls().await.iter().map(|c| (text(&c["operation_key"]), text(&c["outcome"]))).collect()
}

/// Waits until the task's execution reached `phase` at the executor.
async fn wait_phase(system: &System, task: TaskId, phase: &str) {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let seen: Option<String> = sqlx::query_scalar(
            "SELECT phase FROM executor.executions WHERE task_id = $1 ORDER BY attempt DESC LIMIT 1",
        )
        .bind(task.as_uuid())
        .fetch_optional(&system.pool)
        .await
        .unwrap_or(None);
        if seen.as_deref() == Some(phase) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the execution never reached {phase}:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_that_fail_after_the_provider_accepted_are_asked_again_and_the_work_is_charged_once() {
    let mut system = System::new(&[("img", Caps { async_results: true, ..Caps::default() })]).await;
    let img = system.provider("img");
    img.rule(json!({"on": "poll", "status": 503, "times": 1})).await;
    img.rule(json!({"on": "poll", "status": 429, "retry_after_s": 1, "times": 1})).await;
    img.rule(json!({"on": "poll", "status": 404, "times": 1})).await;
    img.rule(json!({"on": "poll", "reset": true, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a red shoe"})).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let log = log(&system, "img").await;
    assert_eq!(log.len(), 1, "one operation, polled until it answered: {log:?}");
    assert_eq!(log[0].1, "accepted");
    assert_eq!(calls(&system, "img").await, (1, 1), "charged once");
    let seq: i32 = sqlx::query_scalar("SELECT seq FROM executor.call_sequences WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("sequence");
    assert_eq!(seq, 0, "no failed poll made a new operation key");
}

/// A provider that does the work and then answers a gateway's 504 (without its
/// problem body): returns the task once it settled.
async fn gateway_timeout_after_the_work(caps: Caps) -> (System, TaskId) {
    let mut system = System::new(&[("img", caps)]).await;
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a blue shoe"})).await;
    system.wait_state(task, &["succeeded"], LONG).await;
    (system, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_504_after_the_work_at_a_provider_that_dedupes_is_retried_with_the_same_key_and_charged_once() {
    let (system, _) = gateway_timeout_after_the_work(Caps { idempotency_keys: true, ..Caps::default() }).await;
    let log = log(&system, "img").await;
    assert_eq!(log.len(), 2, "the 504 and one retry: {log:?}");
    assert_eq!(log[0].0, log[1].0, "the retry carries the same operation key");
    assert_eq!((log[0].1.as_str(), log[1].1.as_str()), ("status_after_work:504", "replayed"));
    assert_eq!(system.provider("img").charges().await, 1, "charged once");
}

/// A key that may have done the work never moves: the retry of a 504 at a deduping
/// provider is refused once with a definite "nothing done" (a 429 for the retry
/// itself), and the next try still sends the key in doubt, which the provider
/// answers with the work it did the first time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definite_refusal_of_the_retry_of_a_key_in_doubt_keeps_the_key_and_charges_once() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    let img = system.provider("img");
    img.rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    img.rule(json!({"status": 429, "retry_after_s": 1, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a green shoe"})).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let log = log(&system, "img").await;
    let outcomes: Vec<&str> = log.iter().map(|(_, outcome)| outcome.as_str()).collect();
    assert_eq!(outcomes, ["status_after_work:504", "status:429", "replayed"], "the calls: {log:?}");
    assert!(log.iter().all(|(key, _)| *key == log[0].0), "every try carries the key in doubt: {log:?}");
    assert_eq!(system.provider("img").charges().await, 1, "charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_504_after_the_work_at_a_provider_that_looks_up_is_recovered_without_a_second_call() {
    let (system, task) = gateway_timeout_after_the_work(Caps { lookup: true, ..Caps::default() }).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "recovered by look-up: one call in all");
    let (_, reason) = system.state(task).await.expect("task");
    assert!(reason.is_some_and(|r| r.contains("recovered")), "the result came from the look-up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_answered_504_after_the_work_where_no_one_can_ask_is_outcome_unknown_and_charged_once() {
    let mut system = System::new(&[("payments", Caps::default())]).await;
    system.set_kinds(json!({
        "payments.refund": {"steps": [{"name": "refund", "provider": "payments", "operation": "refund"}],
                            "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    // Every refund is done and charged, and every answer is the gateway's 504.
    system.provider("payments").rule(json!({"operation": "refund", "status_after_work": 504, "bare": true})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "payments.refund", json!({"amount_cents": 1200})).await;

    system.wait_state(task, &["outcome_unknown", "needs_human", "succeeded", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "outcome_unknown", "the refund may have been paid and no one can ask: {reason:?}");
    assert!(!reason.unwrap_or_default().contains("attempts exhausted"), "it was never retried blindly");
    // Several retry periods later (backoff base 200 ms, cap 2 s): still one refund.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(calls(&system, "payments").await, (1, 1), "one refund sent and charged, no second one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_workers_definite_answer_cannot_change_the_key_the_next_try_uses() {
    let mut system = System::new(&[("llm", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    // Worker A's call waits 5 s at the provider and then answers 429: a definite
    // "nothing done", but for a worker that lost its lease meanwhile.
    system.provider("llm").rule(json!({"latency_ms": 5000, "status": 429, "times": 1})).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a green shoe"})).await;

    wait_phase(&system, task, "call_intent").await;
    system.wait_intent_published(Duration::from_secs(30)).await;
    system.service("executor-a").signal("STOP");
    // B takes the expired lease over at `call_intent`: lost; the provider dedupes,
    // so the retry carries the same key and does the work.
    system.spawn("executor-b", "executor", &[]).await;
    system.wait_state(task, &["succeeded"], LONG).await;

    system.service("executor-a").signal("CONT");
    assert!(
        system.service("executor-a").wait_for_line("write rejected: fenced", Duration::from_secs(30)).await,
        "the stale worker must be fenced:\n{}",
        system.service("executor-a").all_lines()
    );
    let seq: i32 = sqlx::query_scalar("SELECT seq FROM executor.call_sequences WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("sequence");
    assert_eq!(seq, 0, "the stale worker's 429 did not move the key of the next try");
    let log = log(&system, "llm").await;
    assert!(log.iter().all(|(key, _)| *key == log[0].0), "every call carried the one key: {log:?}");
    assert_eq!(system.provider("llm").charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_while_the_same_key_still_runs_is_waited_for_and_charged_once() {
    let mut system = System::new(&[("llm", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    let llm = system.provider("llm");
    // The first request takes 9 s; any request with its key meanwhile gets 409.
    llm.rule(json!({"latency_ms": 9000, "times": 1})).await;
    llm.rule(json!({"conflict_while_running": true, "retry_after_s": 1})).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a grey shoe"})).await;

    // The work is registered when the request arrives; then the worker dies.
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("llm").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the call never left:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    system.service("executor-a").kill();
    system.spawn("executor-b", "executor", &[]).await;

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    let log = log(&system, "llm").await;
    assert_eq!(state, "succeeded", "{reason:?}; calls {log:?}");
    assert!(log.iter().any(|(_, outcome)| outcome == "conflict"), "the retry met the running request: {log:?}");
    assert!(log.iter().all(|(key, _)| *key == log[0].0), "and asked again with the same key: {log:?}");
    assert_eq!(log.last().map(|(_, outcome)| outcome.as_str()), Some("replayed"));
    assert_eq!(system.provider("llm").charges().await, 1, "charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_on_another_host_behind_a_redirect_or_failing_once_are_verified_without_a_second_call() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let img = system.provider("img");
    img.rule(json!({"serve_artifact": "redirect", "times": 1})).await;
    img.rule(json!({"serve_artifact": "other_host", "times": 1})).await;
    img.rule(json!({"on": "artifact", "status": 503, "times": 1})).await;
    system.spawn_all(None).await;
    let first = system.submit("acme", "image.generate", json!({"prompt": "a red boot"})).await;
    system.wait_state(first, &["succeeded", "needs_human"], LONG).await;
    let second = system.submit("acme", "image.generate", json!({"prompt": "a blue boot"})).await;

    for task in [first, second] {
        system.wait_state(task, &["succeeded", "needs_human"], LONG).await;
        let (state, reason) = system.state(task).await.expect("task");
        assert_eq!(state, "succeeded", "{reason:?}");
    }
    assert_eq!(calls(&system, "img").await, (2, 2), "one charged call per task; downloads are free to repeat");
}
