//! Scheduler and executor together on the real stack: multi-step kinds with
//! checkpoints and approvals, cancellation, verification of results, a pool of one
//! connection, graceful shutdown, a scheduler killed between deciding and
//! publishing, and inputs that arrive before what they answer (a decision before
//! its loss, an approval before its wait, a cancel before its task), and the limits
//! of every provider an attempt calls. The fake provider's call log is the judge.

use std::time::Duration;

use fenceline_domain::ids::GrantId;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{Phase, RecoveryDecision, ResolutionAction};
use fenceline_events::{
    AttemptLost, CancelRequested, Event, RecoveryDecided, ResolutionDecided, SignalReceived, Timestamp, topics,
};
use fenceline_tests::system::{Caps, System};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);

async fn signal(system: &System, task: TaskId, name: &str, signal_id: &str) {
    let event = Event::SignalReceived(SignalReceived {
        task_id: task,
        tenant: "acme".into(),
        signal_name: name.into(),
        signal_id: signal_id.into(),
        payload_json: "{}".into(),
        received_at: Timestamp::now(),
        step: None,
        generation: None,
        decision: None,
    });
    system.publish(topics::TASKS, &event).await;
}

async fn cancel(system: &System, task: TaskId) {
    let event = Event::CancelRequested(CancelRequested {
        task_id: task,
        tenant: "acme".into(),
        requested_by: "test".into(),
        requested_at: Timestamp::now(),
    });
    system.publish(topics::TASKS, &event).await;
}

async fn scalar_i64(system: &System, sql: &str, task: TaskId) -> i64 {
    sqlx::query_scalar(sql).bind(task.as_uuid()).fetch_one(&system.pool).await.expect(sql)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_step_task_waits_for_approval_holding_nothing_and_resumes_after_its_checkpoints() {
    let dedupe = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = System::new(&[("llm", dedupe), ("pay", dedupe)]).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "ticket.triage", json!({"ticket": "refund please"})).await;

    system.wait_state(task, &["awaiting_approval"], LONG).await;
    assert_eq!(system.provider("llm").calls().await.len(), 2, "classify and draft ran once each");
    let live = scalar_i64(&system, "SELECT count(*) FROM scheduler.slots WHERE task_id = $1", task).await;
    let running =
        scalar_i64(&system, "SELECT count(*) FROM executor.executions WHERE task_id = $1 AND status = 'running'", task)
            .await;
    assert_eq!((live, running), (0, 0), "waiting for a person holds no slot and no lease");

    // The approval resumes the task on an executor that dies at the refund's call.
    system.spawn("executor", "executor", &[("FAILPOINTS", "executor.before_call_intent=return(crash)".into())]).await;
    signal(&system, task, "refund_approved", "approval-1").await;
    assert!(system.service("executor").wait_exit(LONG).await.is_some(), "crashed in the refund step");
    system.spawn("executor", "executor", &[]).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let llm = system.provider("llm").calls().await;
    assert_eq!(llm.len(), 2, "steps 1 and 2 were not called again after the crash in step 4: {llm:?}");
    assert_eq!(system.provider("pay").calls().await.len(), 1, "the refund was made once");

    // A second, identical approval changes nothing.
    let version = scalar_i64(&system, "SELECT version FROM scheduler.tasks WHERE task_id = $1", task).await;
    signal(&system, task, "refund_approved", "approval-1").await;
    signal(&system, task, "refund_approved", "approval-2").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(scalar_i64(&system, "SELECT version FROM scheduler.tasks WHERE task_id = $1", task).await, version);
    assert_eq!(system.provider("pay").calls().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_is_immediate_for_a_waiting_task_and_cooperative_during_a_call() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn_all(None).await;

    // Waiting (not before an hour from now): cancelled at once, nothing called.
    let later = system
        .submit_with("acme", "image.generate", json!({"p": 1}), |t| {
            t.not_before = Some(Timestamp(Timestamp::now().0 + 3_600_000_000));
        })
        .await;
    system.wait_state(later, &["waiting"], LONG).await;
    cancel(&system, later).await;
    system.wait_state(later, &["cancelled"], LONG).await;

    // Running, mid-call: the call cannot be recalled, so its result is kept.
    system.provider("img").rule(json!({"latency_ms": 3000, "times": 1})).await;
    let running = system.submit("acme", "image.generate", json!({"p": 2})).await;
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("img").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the call never left");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel(&system, running).await;
    system.wait_state(running, &["succeeded"], LONG).await;
    let reason: Option<String> =
        sqlx::query_scalar("SELECT lifecycle->>'reason' FROM scheduler.tasks WHERE task_id = $1")
            .bind(running.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("task");
    assert_eq!(reason.as_deref(), Some("finished before the cancellation took effect"));
    assert_eq!(system.provider("img").calls().await.len(), 1, "only the running task called the provider");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_whose_checksum_does_not_match_fails_with_its_own_class_and_is_not_retried() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn_all(None).await;
    system.provider("img").rule(json!({"corrupt_artifact": true, "times": 1})).await;
    let task = system.submit("acme", "image.generate", json!({"p": 1})).await;

    system.wait_state(task, &["needs_human"], LONG).await;
    let (_, reason) = system.state(task).await.expect("task");
    assert!(reason.unwrap_or_default().contains("result_mismatch"), "the reason names the class");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("img").calls().await.len(), 1, "a paid call with a bad result is not retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_pool_of_one_connection_a_hanging_call_does_not_stop_other_executions() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor", "executor", &[("FENCELINE_DATABASE_MAX_CONNECTIONS", "1".into())]).await;
    system.provider("img").rule(json!({"hang": true, "times": 1})).await;
    let stuck = system.submit("acme", "image.generate", json!({"p": "first"})).await;
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("img").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the first call never left");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = tokio::time::Instant::now();
    let mut others = Vec::new();
    for n in 0..3 {
        others.push(system.submit("acme", "image.generate", json!({"p": n})).await);
    }
    for task in &others {
        system.wait_state(*task, &["succeeded"], LONG).await;
    }
    let (stuck_state, _) = system.state(stuck).await.expect("task");
    assert_eq!(stuck_state, "running", "the hanging call is still in flight");
    assert!(started.elapsed() < Duration::from_secs(9), "the others finished while it hung ({:?})", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_killed_between_deciding_and_publishing_loses_no_grant_and_issues_no_second() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system
        .spawn("scheduler", "scheduler", &[("FAILPOINTS", "scheduler.after_grant_commit=return(crash)".into())])
        .await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let task = system.submit("acme", "image.generate", json!({"p": 1})).await;
    assert!(system.service("scheduler").wait_exit(LONG).await.is_some(), "the scheduler crashed after its grant");
    let granted = scalar_i64(&system, "SELECT count(*) FROM scheduler.slots WHERE task_id = $1", task).await;
    assert_eq!(granted, 1, "the grant was committed before the crash");
    system.spawn("scheduler", "scheduler", &[]).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let grants =
        scalar_i64(&system, "SELECT count(DISTINCT grant_id) FROM executor.executions WHERE task_id = $1", task).await;
    assert_eq!(grants, 1, "one grant, published by the restarted relay");
    assert_eq!(system.provider("img").calls().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_executor_finishes_its_call_and_hands_unstarted_work_back() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn_all(None).await;
    system.provider("img").rule(json!({"latency_ms": 2000, "times": 1})).await;
    let first = system.submit("acme", "image.generate", json!({"p": 1})).await;
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("img").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the call never left");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    system.service("executor").signal("TERM");
    let exit = system.service("executor").wait_exit(Duration::from_secs(20)).await;
    assert!(exit.is_some_and(|s| s.success()), "a clean exit within the grace period");
    system.wait_state(first, &["succeeded"], LONG).await;

    let second = system.submit("acme", "image.generate", json!({"p": 2})).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("img").calls().await.len(), 1, "no executor, no call");
    system.spawn("executor", "executor", &[]).await;
    system.wait_state(second, &["succeeded"], LONG).await;
    assert_eq!(system.provider("img").calls().await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_scheduler_joining_mid_stream_keeps_every_invariant() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.provider("img").rule(json!({"latency_ms": 100})).await;
    system.spawn("scheduler-a", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    system.spawn("executor-b", "executor", &[]).await;
    let mut tasks = system.submit_many("acme", "image.generate", 100).await;
    tasks.extend(system.submit_many("globex", "image.generate", 100).await);

    let count_done = || async {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded'")
            .fetch_one(&system.pool)
            .await
            .expect("count");
        done
    };
    let deadline = tokio::time::Instant::now() + LONG;
    while count_done().await < 60 {
        assert!(tokio::time::Instant::now() < deadline, "progress stalled:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A second scheduler joins mid-stream: the partitions are split between the two
    // (each takeover bumps the epoch), and both dispatchers grant from then on.
    system.spawn("scheduler-b", "scheduler", &[]).await;

    for task in &tasks {
        system.wait_state(*task, &["succeeded"], Duration::from_secs(180)).await;
    }
    let calls = system.provider("img").calls().await;
    assert_eq!(calls.len(), tasks.len(), "one call per task");
    let per_task: Vec<i64> =
        sqlx::query_scalar("SELECT count(*) FROM executor.executions GROUP BY task_id HAVING count(*) <> 1")
            .fetch_all(&system.pool)
            .await
            .expect("executions");
    assert!(per_task.is_empty(), "some task was granted twice: {per_task:?}");
    let leftover: i64 =
        sqlx::query_scalar("SELECT count(*) FROM scheduler.slots").fetch_one(&system.pool).await.expect("slots");
    assert_eq!(leftover, 0, "every slot was given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_rate_limit_spaces_the_calls_of_every_executor() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    // Two calls a second, a burst of one, slots to spare: the bucket is the limit.
    system.set_provider_limits("img", 50, 2.0, 1.0);
    system.spawn_all(None).await;
    system.spawn("executor-b", "executor", &[]).await;
    let started = std::time::Instant::now();
    let tasks = system.submit_many("acme", "image.generate", 10).await;
    for task in &tasks {
        system.wait_state(*task, &["succeeded"], LONG).await;
    }
    let took = started.elapsed();
    // 10 grants from a bucket of 1 refilled at 2/s need at least 4.5 s.
    assert!(took >= Duration::from_millis(4_500), "10 calls in {took:?}: faster than the rate allows");
    assert_eq!(system.provider("img").calls().await.len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_calls_two_providers_keeps_the_rate_limit_of_the_second() {
    let mut system = System::new(&[("llm", Caps::default()), ("pay", Caps::default())]).await;
    // Each attempt drafts at llm (room to spare) and then charges at pay, which
    // takes two calls a second with a burst of one.
    system.set_provider_limits("pay", 50, 2.0, 1.0);
    system.set_kinds(json!({
        "ticket.settle": {"steps": [{"name": "draft", "provider": "llm"}, {"name": "charge", "provider": "pay"}],
                          "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.spawn_all(None).await;
    let tasks = system.submit_many("acme", "ticket.settle", 10).await;
    for task in &tasks {
        system.wait_state(*task, &["succeeded"], LONG).await;
    }
    let charged = system.provider("pay").received_at_us().await;
    assert_eq!(charged.len(), 10, "one charge per task");
    assert_eq!(system.provider("llm").calls().await.len(), 10, "one draft per task");
    // The tokens are taken when the attempt is granted: ten grants from a bucket of
    // one refilled at two a second span at least 4.5 s. Each charge follows its
    // grant after a draft whose length varies, which may bring the first and the
    // last charge up to a second closer (seen: 0.22 s under load); an attempt that
    // took no token at pay charged six times in 1.12 s.
    let span = Duration::from_micros(u64::try_from(charged[9] - charged[0]).unwrap_or(0));
    assert!(span >= Duration::from_millis(3_500), "pay took 10 calls in {span:?}: faster than its rate allows");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_reports_a_task_without_progress_and_clears_once_it_moves() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    let audit_env = [
        ("FENCELINE_RECONCILER_NO_PROGRESS_MS", "2000".to_owned()),
        ("FENCELINE_RECONCILER_AUDIT_EVERY_MS", "500".to_owned()),
    ];
    system.spawn("reconciler", "reconciler", &audit_env).await;
    // No executor: the task is granted and nothing moves it on.
    let task = system.submit("acme", "image.generate", json!({"p": 1})).await;
    let audit = format!("{}/v1/audit", system.url_of("reconciler"));
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let (_, body) = fenceline_tests::system::http("GET", audit.clone(), None).await.expect("audit");
        let findings = body["findings"].as_array().cloned().unwrap_or_default();
        if findings.iter().any(|f| f["task_id"] == task.to_string() && f["finding"] == "no_progress") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the audit never reported the stuck task: {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let metrics = format!("{}/metrics", system.url_of("reconciler"));
    let text = tokio::task::spawn_blocking(move || {
        ureq::get(&metrics).call().expect("metrics").body_mut().read_to_string().expect("text")
    })
    .await
    .expect("metrics");
    assert!(text.contains("fenceline_audit_findings{finding=\"no_progress\"} 1"), "{text}");

    system.spawn("executor", "executor", &[]).await;
    system.wait_state(task, &["succeeded"], LONG).await;
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let (_, body) = fenceline_tests::system::http("GET", audit.clone(), None).await.expect("audit");
        if body["findings"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the finding never cleared: {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Waits until `sql` (about `task`) answers true.
async fn wait_until(system: &System, sql: &str, task: TaskId, what: &str) {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let done: Option<bool> =
            sqlx::query_scalar(sql).bind(task.as_uuid()).fetch_optional(&system.pool).await.unwrap_or(None);
        if done == Some(true) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what} never happened:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_decision_heard_before_the_loss_it_answers_is_applied_when_the_loss_arrives() {
    // The scheduler alone: the test plays the executor and the reconciler, in the
    // order no topic guarantees against (the decision first).
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    let task = system.submit("acme", "image.generate", json!({"p": 1})).await;
    wait_until(&system, "SELECT count(*) = 1 FROM scheduler.slots WHERE task_id = $1", task, "the grant").await;
    let grant: uuid::Uuid = sqlx::query_scalar("SELECT grant_id FROM scheduler.slots WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("grant");

    let decided = Event::RecoveryDecided(RecoveryDecided {
        task_id: task,
        attempt: 1,
        decision: RecoveryDecision::OutcomeUnknown,
        case_id: Some("case-early".into()),
        result: None,
        evidence: Vec::new(),
        decided_at: Timestamp::now(),
    });
    system.publish(topics::RECOVERY, &decided).await;
    let kept = "SELECT lifecycle->'early_decision'->>'case_id' = 'case-early' FROM scheduler.tasks WHERE task_id = $1";
    wait_until(&system, kept, task, "keeping the early decision").await;
    let (state, _) = system.state(task).await.expect("task");
    assert_eq!(state, "queued", "a decision alone does not end an attempt nobody reported lost");

    let lost = Event::AttemptLost(AttemptLost {
        task_id: task,
        attempt: 1,
        grant_id: GrantId::from_uuid(grant),
        last_phase: Phase::CallIntent,
        last_phase_at: Timestamp::now(),
        step: Some("render".into()),
        operation_key: None,
        provider_request_id: None,
        detected_at: Timestamp::now(),
    });
    system.publish(topics::ATTEMPTS, &lost).await;
    system.wait_state(task, &["outcome_unknown"], LONG).await;
    let case: Option<String> =
        sqlx::query_scalar("SELECT lifecycle->>'case_id' FROM scheduler.tasks WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("case");
    assert_eq!(case.as_deref(), Some("case-early"));

    // A person's cancel in outcome_unknown is applied, never lost.
    cancel(&system, task).await;
    system.wait_state(task, &["cancelled"], LONG).await;
    let (_, reason) = system.state(task).await.expect("task");
    assert!(reason.unwrap_or_default().contains("never established"), "the reason keeps what is unknown");
    assert!(system.provider("img").calls().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_given_before_its_step_waits_is_kept_and_ends_the_wait_when_it_begins() {
    let dedupe = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = System::new(&[("llm", dedupe), ("pay", dedupe)]).await;
    // Slow first steps, so the approval surely arrives before the approval step waits.
    system.provider("llm").rule(json!({"latency_ms": 1500, "times": 2})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "ticket.triage", json!({"ticket": "refund please"})).await;
    signal(&system, task, "refund_approved", "pre-approval").await;
    let kept = "SELECT jsonb_array_length(lifecycle->'kept_signals') = 1 FROM scheduler.tasks WHERE task_id = $1";
    wait_until(&system, kept, task, "keeping the early approval").await;
    assert!(system.provider("pay").calls().await.is_empty(), "kept, not acted on before its step");

    system.wait_state(task, &["succeeded"], LONG).await;
    assert_eq!(system.provider("llm").calls().await.len(), 2);
    assert_eq!(system.provider("pay").calls().await.len(), 1, "the refund ran once, on the early approval");
    // The same signal again cannot approve anything else.
    signal(&system, task, "refund_approved", "pre-approval").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("pay").calls().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_heard_before_its_task_is_kept_and_cancels_the_task_when_it_arrives() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn_all(None).await;
    let task = TaskId::new_v7();
    cancel(&system, task).await;
    wait_until(&system, "SELECT count(*) = 1 FROM scheduler.early_requests WHERE task_id = $1", task, "keeping").await;
    system.submit_with("acme", "image.generate", json!({"p": 1}), |t| t.task_id = task).await;
    system.wait_state(task, &["cancelled"], LONG).await;
    wait_until(&system, "SELECT count(*) = 0 FROM scheduler.early_requests WHERE task_id = $1", task, "clearing").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(system.provider("img").calls().await.is_empty(), "a cancelled task makes no call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_after_an_approval_takes_a_slot_of_the_provider_it_calls() {
    let mut system = System::new(&[("llm", Caps::default()), ("pay", Caps::default())]).await;
    // One llm call at a time, and that one slot is about to be held for long.
    system.set_provider_limits("llm", 1, 50.0, 50.0);
    system.spawn_all(None).await;
    let task = system.submit("acme", "ticket.triage", json!({"ticket": "refund please"})).await;
    system.wait_state(task, &["awaiting_approval"], LONG).await;

    // Another task's draft now holds the only llm slot for 30 s.
    system.provider("llm").rule(json!({"latency_ms": 30_000})).await;
    let busy = system.submit("acme", "ticket.triage", json!({"ticket": "slow"})).await;
    system.wait_state(busy, &["running"], LONG).await;

    // The refund calls only `pay`: it needs no llm slot and runs at once, well before
    // the held call's 10 s timeout would free the llm slot.
    signal(&system, task, "refund_approved", "approval-1").await;
    system.wait_state(task, &["succeeded"], Duration::from_secs(7)).await;
    assert_eq!(system.provider("pay").charges().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_as_new_calls_only_the_step_in_doubt_again_and_keeps_the_verified_steps_and_the_approval() {
    // Neither provider can dedupe or be asked: a refund answered 504 after the work
    // is a case for a person.
    let mut system = System::new(&[("llm", Caps::default()), ("pay", Caps::default())]).await;
    system.provider("pay").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "ticket.triage", json!({"ticket": "refund please"})).await;
    system.wait_state(task, &["awaiting_approval"], LONG).await;
    signal(&system, task, "refund_approved", "approval-1").await;
    system.wait_state(task, &["outcome_unknown"], LONG).await;
    assert_eq!((system.provider("llm").calls().await.len(), system.provider("pay").charges().await), (2, 1));

    let case: String = sqlx::query_scalar("SELECT lifecycle->>'case_id' FROM scheduler.tasks WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("the open case");
    let decision = Event::ResolutionDecided(ResolutionDecided {
        task_id: task,
        tenant: "acme".into(),
        case_id: case,
        action: ResolutionAction::RetryAsNew,
        charge_acknowledged: true,
        attached_result: None,
        decided_by: "test".into(),
        decided_at: Timestamp::now(),
    });
    system.publish(topics::TASKS, &decision).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let llm = system.provider("llm").calls().await;
    assert_eq!(llm.len(), 2, "classify and draft were verified: not called or billed again: {llm:?}");
    let pay = system.provider("pay").calls().await;
    assert_eq!(pay.len(), 2, "only the refund in doubt was called again: {pay:?}");
    assert_ne!(pay[0]["request_id"], pay[1]["request_id"], "as a new operation");
    let waits: i64 = scalar_i64(
        &system,
        "SELECT count(*) FROM executor.executions WHERE task_id = $1 AND status = 'released'",
        task,
    )
    .await;
    assert_eq!(waits, 1, "the approval given before the doubt was not asked for again");
}
