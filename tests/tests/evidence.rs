//! Evidence only moves toward "it happened", and a database that blinks loses
//! nothing: the provider's own "never received" after proof of receipt, a gateway's
//! `404` on the look-up route, a request id nobody polled after a lost worker, a
//! retry that follows an earlier operation, a loss heard before its grant, a
//! same-key retry that meets the deadline, and a database that refuses writes for
//! longer than the consumers' backoff. Each test counts the fake provider's charges.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, Stop, System};
use serde_json::json;

const LONG: Duration = Duration::from_secs(120);

/// Charged calls at the provider, and all calls it received.
async fn calls(system: &System, provider: &str) -> (usize, usize) {
    let p = system.provider(provider);
    (p.charges().await, p.calls().await.len())
}

/// The one image kind with a short attempt budget, so that an executor gives up
/// polling within seconds; the provider's call timeout shorter still.
fn short_budget(system: &System, budget_ms: u64) {
    system.set_provider_field("img", "call_timeout_ms", json!(budget_ms / 2));
    system.set_kinds(json!({
        "image.generate": {"steps": [{"name": "render", "provider": "img"}],
                           "max_attempts": 4, "attempt_budget_ms": budget_ms}
    }));
}

/// Waits until the task's execution has recorded `phase`.
async fn wait_phase(system: &System, task: TaskId, phase: &str) {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let phases: Vec<Option<String>> =
            sqlx::query_scalar("SELECT phase FROM executor.executions WHERE task_id = $1")
                .bind(task.as_uuid())
                .fetch_all(&system.pool)
                .await
                .unwrap_or_default();
        if phases.iter().any(|p| p.as_deref() == Some(phase)) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the execution never reached {phase}:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The provider accepted the work under a request id; its polls fail until the
/// executor's budget runs out, and its key index says "never received" (with its
/// own body, as a provider whose index holds only finished jobs would). The
/// acceptance is proof of receipt: the reconciler polls the request id, and the key
/// is never sent again to a provider that does not dedupe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_work_a_look_up_later_says_it_never_received_is_polled_not_sent_again() {
    let mut system = System::new(&[("img", Caps { lookup: true, async_results: true, ..Caps::default() })]).await;
    short_budget(&system, 3_000);
    let img = system.provider("img");
    img.rule(json!({"on": "poll", "status": 503, "times": 12})).await;
    img.rule(json!({"on": "lookup", "status": 404})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "an accepted shoe"})).await;

    let state = system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "one request, one charge:\n{}", system.logs());
    assert_eq!(state, "succeeded", "the request id was polled to its result: {:?}", system.state(task).await);
}

/// A gateway in front of the look-up route answers a bare `404` (an HTML page):
/// that is no answer, and the key is not sent again to a provider that does not
/// dedupe. Once the route is back, the look-up finds the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_404_on_the_look_up_route_is_no_answer() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    let img = system.provider("img");
    img.rule(json!({"drop_after_accept": true, "times": 1})).await;
    img.rule(json!({"on": "lookup", "status": 404, "bare": true, "times": 4})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe behind a gateway"})).await;

    let state = system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "one request, one charge:\n{}", system.logs());
    assert_eq!(state, "succeeded", "recovered once the look-up route answered: {:?}", system.state(task).await);
    let findings = system.case_findings(task).await;
    assert!(
        findings.iter().any(|f| f.contains("without the provider's own body")),
        "the gateway's page is kept as what it is: {findings:#?}"
    );
}

/// An executor killed while it polls work a provider accepted, at a provider that
/// can neither dedupe nor be asked by key: the request id is known, so the
/// reconciler polls it and recovers the result instead of calling it unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_known_after_a_lost_worker_is_polled_at_a_provider_without_look_up_or_dedupe() {
    let mut system = System::new(&[("img", Caps { async_results: true, ..Caps::default() })]).await;
    // The first poll takes a while: the worker is killed while it waits.
    system.provider("img").rule(json!({"on": "poll", "latency_ms": 5_000, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a long render"})).await;
    wait_phase(&system, task, "provider_accepted").await;
    system.stop("executor", Stop::Kill).await;
    system.spawn("executor", "executor", &[]).await;

    let state = system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    assert_eq!(state, "succeeded", "{:?}\n{}", system.state(task).await, system.logs());
    assert_eq!(calls(&system, "img").await, (1, 1), "recovered by polling the request id: one call in all");
}

/// A person's `retry_as_new` finds the operation in doubt still running at a
/// provider that can be asked, and follows it: the attempt records its call intent
/// under the key in doubt, so that when the polls run out the case is about that key
/// and that step's provider, not a case with nothing to ask about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_as_new_that_follows_the_operation_in_doubt_keeps_its_key_in_the_case() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    short_budget(&system, 4_000);
    let img = system.provider("img");
    // Registered at once and still running for a minute: the client gives up after
    // its call timeout (2 s), and the look-ups fail until the case is unknown.
    img.rule(json!({"latency_ms": 60_000, "times": 1})).await;
    img.rule(json!({"on": "lookup", "status": 503, "times": 1_000})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe still rendering"})).await;
    system.wait_state(task, &["outcome_unknown", "succeeded", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "outcome_unknown", "{reason:?}");
    let key_in_doubt = system.provider("img").calls().await[0]["operation_key"].as_str().expect("key").to_owned();

    // Look-ups answer again (the work is still running); polls of it fail.
    system.provider("img").reset_rules().await;
    system.provider("img").rule(json!({"on": "poll", "status": 503})).await;
    system.a_person_retries_as_new(task).await;

    // The retry's attempt ends in doubt; its case is about the key in doubt.
    let deadline = tokio::time::Instant::now() + LONG;
    let (provider, key) = loop {
        let row: Option<(Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT provider, operation_key FROM reconciler.cases WHERE task_id = $1 AND attempt > 1 \
             ORDER BY attempt DESC LIMIT 1",
        )
        .bind(task.as_uuid())
        .fetch_optional(&system.pool)
        .await
        .expect("cases");
        if let Some(row) = row {
            break row;
        }
        assert!(tokio::time::Instant::now() < deadline, "no case for the retry:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(key.as_deref(), Some(key_in_doubt.as_str()), "the case is about the key in doubt");
    assert_eq!(provider.as_deref(), Some("img"));
    assert_eq!(system.provider("img").charges().await, 1, "the running operation was followed, not paid again");
}

/// A loss heard before its grant (the two travel on topics with no order between
/// them) waits for the grant: the case is opened with the grant's kind, so that no
/// step of a multi-step kind is mistaken for its last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_heard_before_its_grant_opens_its_case_with_the_grants_kind() {
    use fenceline_domain::vocabulary::Phase;
    use fenceline_events::{AttemptGranted, AttemptLost, Event, Timestamp, topics};
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    let task = TaskId::new_v7();
    let grant = AttemptGranted {
        grant_id: fenceline_domain::ids::GrantId::new_v7(),
        task_id: task,
        tenant: "acme".into(),
        attempt: 1,
        generation: 0,
        kind: "ticket.triage".into(),
        input_json: "{}".into(),
        resume_after_step: None,
        provider: "img".into(),
        slot: "img".into(),
        lease_budget_ms: 60_000,
        deadline: None,
        granted_at: Timestamp::now(),
    };
    let lost = AttemptLost {
        task_id: task,
        attempt: 1,
        grant_id: grant.grant_id,
        last_phase: Phase::CallIntent,
        last_phase_at: Timestamp::now(),
        step: Some("classify".into()),
        operation_key: Some(fenceline_domain::calls::operation_key(task, "classify", 0, 0)),
        provider_request_id: None,
        detected_at: Timestamp::now(),
    };
    system.publish(topics::ATTEMPTS, &Event::AttemptLost(lost)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let early: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciler.cases WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("cases");
    assert_eq!(early, 0, "no case without the grant's kind:\n{}", system.logs());

    system.publish(topics::DISPATCH, &Event::AttemptGranted(grant)).await;
    let deadline = tokio::time::Instant::now() + LONG;
    let kind = loop {
        let kind: Option<String> = sqlx::query_scalar("SELECT kind FROM reconciler.cases WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_optional(&system.pool)
            .await
            .expect("cases");
        if let Some(kind) = kind {
            break kind;
        }
        assert!(tokio::time::Instant::now() < deadline, "the case never opened:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(kind, "ticket.triage");
}

/// A same-key retry decided for a provider that dedupes cannot run before the
/// deadline: the first call may have done and billed the work, so the task stops
/// for a person instead of ending "failed before it could run".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_key_retry_the_deadline_overtakes_asks_a_person_and_never_says_failed() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    // The work is done and charged; the answer is a gateway's 504, six seconds later.
    system.provider("img").rule(json!({"latency_ms": 6_000, "status_after_work": 504, "bare": true})).await;
    system.spawn_all(None).await;
    let deadline = fenceline_events::Timestamp(fenceline_events::Timestamp::now().0 + 5_000_000);
    let task = system
        .submit_with("acme", "image.generate", json!({"prompt": "a refund near its deadline"}), |t| {
            t.deadline = Some(deadline);
        })
        .await;
    let state = system.wait_state(task, &["failed", "needs_human", "outcome_unknown", "succeeded"], LONG).await;
    let (_, reason) = system.state(task).await.expect("task");
    assert_ne!(state, "failed", "the first call may have been charged: {reason:?}");
    assert_eq!(state, "needs_human", "{reason:?}");
    assert!(reason.unwrap_or_default().contains("may have done and billed"), "the reason says what is known");
    assert_eq!(system.provider("img").charges().await, 1);
}

/// The database refuses writes for longer than the consumers' backoff (a failover
/// to a read-only node, a demoted writer): nothing is dead-lettered, every task
/// settles once writes work again, and each is charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_refuses_writes_for_a_while_loses_nothing() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, lookup: true, ..Caps::default() })]).await;
    system.spawn_all(None).await;
    let mut tasks = system.submit_many("acme", "image.generate", 20).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    system.refuse_writes(true).await;
    // Records keep arriving while no write can commit.
    tasks.extend(system.submit_many("acme", "image.generate", 20).await);
    // Longer than the ten tries with backoff (about 32 s) after which a record that
    // keeps failing alone is condemned.
    tokio::time::sleep(Duration::from_secs(45)).await;
    system.refuse_writes(false).await;

    for task in &tasks {
        let state = system.wait_state(*task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
        assert_eq!(state, "succeeded", "{:?}", system.state(*task).await);
    }
    assert_eq!(system.count_lines("record rejected"), 0, "nothing was dead-lettered:\n{}", system.logs());
    let charges = system.provider("img").charges().await;
    assert_eq!(charges, tasks.len(), "one charge per task");
}
