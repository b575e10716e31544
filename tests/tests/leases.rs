//! Leases, slots, deadlines and the moment a paid request may leave, end to end on
//! the real stack: an executor whose wall clock is minutes ahead, a scheduler whose
//! wall clock is minutes ahead, a grant claimed after its task's deadline, a worker
//! whose lease would not hold while its request leaves, a worker whose writes fail
//! for longer than its lease after the provider answered. The fake provider's
//! ledger judges what was charged.

use std::time::Duration;

use fenceline_events::Timestamp;
use fenceline_tests::system::{Caps, System};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);

/// Charged calls at the provider, and all calls it received.
async fn calls(system: &System, provider: &str) -> (usize, usize) {
    let p = system.provider(provider);
    (p.charges().await, p.calls().await.len())
}

/// Waits until `provider` has received a call.
async fn wait_for_a_call(system: &System, provider: &str) {
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider(provider).calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no call reached {provider}:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_whose_clock_is_minutes_ahead_takes_over_no_healthy_lease_and_its_own_calls_succeed_once() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    // A's call takes 5 s: more than twice the 2 s lease, which A keeps renewing.
    system.provider("img").rule(json!({"latency_ms": 5000, "times": 1})).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a slow shoe"})).await;
    wait_for_a_call(&system, "img").await;
    // B's host clock runs five minutes ahead: by its clock every lease has expired.
    let skew = [("FENCELINE_EXECUTOR_CLOCK_SKEW_MS", "300000".to_owned())];
    system.spawn("executor-b", "executor", &skew).await;

    system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    assert_eq!(system.execution(task).await, (1, "succeeded".to_owned()), "A kept its lease: no takeover");
    assert_eq!(system.service("executor-b").lines_with("took over").len(), 0, "B took nothing over");
    assert_eq!(calls(&system, "img").await, (1, 1));

    // With A gone, B runs a task of its own: its lease holds by the database's clock.
    system.service("executor-a").kill();
    let own = system.submit("acme", "image.generate", json!({"prompt": "a skewed shoe"})).await;
    system.wait_state(own, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(own).await.expect("task");
    assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    assert_eq!(system.execution(own).await, (1, "succeeded".to_owned()), "B's own lease was never taken");
    assert_eq!(calls(&system, "img").await, (2, 2), "one charged call per task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_whose_clock_is_minutes_ahead_counts_the_live_slots_of_the_others() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    // One call at a time at img, and room for a 12 s call.
    system.set_provider_limits("img", 1, 50.0, 50.0);
    system.set_provider_field("img", "call_timeout_ms", json!(20_000));
    system.spawn("scheduler-a", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    system.provider("img").rule(json!({"latency_ms": 12_000, "times": 1})).await;
    let first = system.submit("acme", "image.generate", json!({"prompt": "a slow shoe"})).await;
    wait_for_a_call(&system, "img").await;
    let deadline = tokio::time::Instant::now() + LONG;
    // The second task is due while the first holds img's one slot.
    let second = system.submit("acme", "image.generate", json!({"prompt": "a patient shoe"})).await;
    loop {
        let taken_in: i64 = sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE task_id = $1")
            .bind(second.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("count");
        if taken_in == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the second task never arrived:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // B's host clock runs five minutes ahead: by its clock the slot A granted, which
    // lives twice the 60 s attempt budget, expired long ago.
    let skew = [("FENCELINE_SCHEDULER_CLOCK_SKEW_MS", "300000".to_owned())];
    system.spawn("scheduler-b", "scheduler", &skew).await;

    for task in [first, second] {
        system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
        let (state, reason) = system.state(task).await.expect("task");
        assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    }
    let received = system.provider("img").received_at_us().await;
    assert_eq!(received.len(), 2, "one call per task");
    // The second call waited for the first's slot: the first call took 12 s.
    let gap = Duration::from_micros(u64::try_from(received[1] - received[0]).unwrap_or(0));
    assert!(
        gap >= Duration::from_secs(11),
        "the second call left {gap:?} after the first, while it held img's one slot"
    );
}

/// A scheduler whose host clock runs two minutes ahead judges deadlines and start
/// times by the database's clock: a task due in a minute is not failed as past its
/// deadline, and a task that may not start for another eight seconds does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_whose_clock_is_minutes_ahead_neither_fails_a_task_early_nor_starts_one_early() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let skew = [("FENCELINE_SCHEDULER_CLOCK_SKEW_MS", "120000".to_owned())];
    system.spawn("scheduler", "scheduler", &skew).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let in_a_minute = Timestamp(Timestamp::now().0 + 60_000_000);
    let due = system
        .submit_with("acme", "image.generate", json!({"prompt": "due in a minute"}), |t| t.deadline = Some(in_a_minute))
        .await;
    let state = system.wait_state(due, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(state, "succeeded", "{:?}", system.state(due).await);

    let not_before = Timestamp(Timestamp::now().0 + 8_000_000);
    let later = system
        .submit_with("acme", "image.generate", json!({"prompt": "not before eight seconds"}), |t| {
            t.not_before = Some(not_before)
        })
        .await;
    let state = system.wait_state(later, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(state, "succeeded", "{:?}", system.state(later).await);
    let received = system.provider("img").received_at_us().await;
    assert_eq!(received.len(), 2, "one call per task");
    assert!(
        received[1] >= not_before.0,
        "the second call left {} µs before its start time",
        not_before.0 - received[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_claimed_after_its_tasks_deadline_makes_no_call_and_fails_saying_so() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    // Long enough for the scheduler to take the task in and grant it first.
    let due = Timestamp(Timestamp::now().0 + 15_000_000);
    let task = system
        .submit_with("acme", "image.generate", json!({"prompt": "a late shoe"}), |t| t.deadline = Some(due))
        .await;
    // Granted at once; no executor runs until the deadline has passed.
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let seen = system.state(task).await;
        if seen.as_ref().and_then(|(_, reason)| reason.as_deref()).is_some_and(|r| r.contains("granted")) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never granted: {seen:?}\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let past = u64::try_from(due.0 - Timestamp::now().0).unwrap_or(0) + 1_000_000;
    tokio::time::sleep(Duration::from_micros(past)).await;
    system.spawn("executor", "executor", &[]).await;

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "failed", "{reason:?}");
    assert!(reason.as_deref().unwrap_or_default().contains("deadline passed"), "{reason:?}");
    assert_eq!(calls(&system, "img").await, (0, 0), "no call after the deadline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_would_not_hold_while_its_request_leaves_does_not_send() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    // Every renewal fails (the call intent's write renewed the lease last), and the
    // worker is held up 1.1 s after its call intent: 0.9 s of its 2 s lease is left,
    // less than the 1 s the request may take to leave (the connect bound of a 10 s
    // call timeout) plus the margin.
    system.spawn_all(Some("executor.renew_lease=return;executor.after_call_intent=sleep(1100)")).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a short shoe"})).await;

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(calls(&system, "img").await, (0, 0), "nothing was sent: {state} {reason:?}");
    assert_eq!(state, "needs_human", "{reason:?}");
    let reason = reason.unwrap_or_default();
    assert!(reason.contains("not_sent") && reason.contains("not sent"), "{reason}");
    assert!(system.count_lines("not sent") >= 1, "the worker said why:\n{}", system.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_whose_lease_cannot_cover_a_request_leaving_refuses_to_start() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    // Two thirds of 1.5 s is less than img's 1 s send window plus the 200 ms margin.
    system.spawn_to_crash("executor", "executor", &[("FENCELINE_EXECUTOR_LEASE_MS", "1500".into())]).await;
    let exit = system.service("executor").wait_exit(Duration::from_secs(30)).await;
    let lines = system.service("executor").all_lines();
    assert!(exit.is_some(), "it started:\n{lines}");
    assert!(lines.contains("too short for provider `img`"), "it said why:\n{lines}");
}

/// The executor's processes with one worker each: in an outage of the executor's
/// database no other worker could take an execution over either.
fn one_worker() -> Vec<(&'static str, String)> {
    vec![("FENCELINE_EXECUTOR_WORKERS", "1".to_owned())]
}

/// How many executor writes into `table` waiting for its lock were cut, as a
/// database outage cuts connections.
async fn cut_writes_waiting_for(system: &System, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' \
         AND query LIKE '%INSERT INTO ' || $1 || ' %'",
    )
    .bind(table)
    .fetch_one(&system.pool)
    .await
    .expect("cut connections")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_result_whose_checkpoint_meets_a_database_outage_longer_than_the_lease_succeeds_with_one_call() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    // Renewals fail throughout, as they would in the outage: the 2 s lease lapses
    // while the worker still tries to record the result it verified.
    let mut executor = one_worker();
    executor.push(("FAILPOINTS", "executor.renew_lease=return".to_owned()));
    system.spawn("executor", "executor", &executor).await;
    // The checkpoint write waits for this lock, and every try of it is cut.
    let mut lock = system.pool.begin().await.expect("lock transaction");
    sqlx::query("LOCK TABLE executor.checkpoints IN SHARE MODE").execute(&mut *lock).await.expect("lock");
    let task = system.submit("acme", "image.generate", json!({"prompt": "an outage shoe"})).await;

    let deadline = tokio::time::Instant::now() + LONG;
    let mut cut = 0;
    let mut first_cut = None;
    while first_cut.is_none_or(|at: tokio::time::Instant| at.elapsed() < Duration::from_millis(2600)) {
        assert!(tokio::time::Instant::now() < deadline, "no checkpoint write came:\n{}", system.logs());
        let now = cut_writes_waiting_for(&system, "checkpoints").await;
        if now > 0 && first_cut.is_none() {
            first_cut = Some(tokio::time::Instant::now());
        }
        cut += now;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    lock.rollback().await.expect("end the outage");
    assert_eq!(calls(&system, "img").await, (1, 1), "the provider answered once before the outage");

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    assert!(cut >= 2, "the checkpoint write was cut {cut} times");
    assert_eq!(system.execution(task).await, (1, "succeeded".to_owned()), "the worker recorded it: no takeover");
    assert_eq!(calls(&system, "img").await, (1, 1), "one call in all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_lapses_between_the_call_intent_and_the_request_is_recorded_not_sent_and_retried_once() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    // Renewals fail and the worker is held up past its whole 2 s lease after its
    // call intent, once; the next attempt sends on its fresh lease.
    let mut executor = one_worker();
    executor.push(("FAILPOINTS", "executor.renew_lease=return;executor.after_call_intent=1*sleep(2500)".to_owned()));
    system.spawn("executor", "executor", &executor).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a lapsed shoe"})).await;

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    assert_eq!(calls(&system, "img").await, (1, 1), "one call in all");
    let attempts: Vec<(i32, String)> =
        sqlx::query_as("SELECT attempt, status FROM executor.executions WHERE task_id = $1 ORDER BY attempt")
            .bind(task.as_uuid())
            .fetch_all(&system.pool)
            .await
            .expect("executions");
    assert_eq!(attempts, vec![(1, "failed".to_owned()), (2, "succeeded".to_owned())], "attempt 1 sent nothing");
    assert!(system.count_lines("not sent") >= 1, "the worker said why:\n{}", system.logs());
    let cases: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciler.cases WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("cases");
    assert_eq!(cases, 0, "nothing was in doubt");
}
