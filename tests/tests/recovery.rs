//! The articles' failure windows, end to end on the real stack: scheduler,
//! executor and reconciler as processes, killed at named points, with the fake
//! provider's call log as the judge of what was charged. Every test asserts the
//! number of calls, not only the final state: a system can call twice and still end
//! in a state that looks right.

use std::time::Duration;

use fenceline_tests::system::{Caps, System};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);

/// Charged calls at the provider, and all calls it received.
async fn calls(system: &System, provider: &str) -> (usize, usize) {
    let p = system.provider(provider);
    (p.charges().await, p.calls().await.len())
}

/// Waits until the provider logged the call and the executor's call intent is
/// published (`System::wait_intent_published`).
async fn wait_until_the_call_left(system: &System) {
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("img").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the call never left:\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    system.wait_intent_published(LONG).await;
}

/// Submits an image task through intake's API with an idempotency key.
async fn submit_through_intake(intake: &str, token: &str) -> fenceline_domain::ids::TaskId {
    let url = format!("{intake}/v1/tasks");
    let body = json!({"kind": "image.generate", "input": {"prompt": "a red shoe"}});
    let (status, answer) = tokio::task::spawn_blocking({
        let token = token.to_owned();
        move || {
            let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
            let mut response = agent
                .post(&url)
                .header("Authorization", format!("Bearer {token}"))
                .header("Idempotency-Key", "resolution-test")
                .send_json(&body)
                .expect("answer");
            let status = response.status().as_u16();
            (status, response.body_mut().read_json::<serde_json::Value>().unwrap_or_default())
        }
    })
    .await
    .expect("submit");
    assert_eq!(status, 202, "{answer}");
    answer["task_id"].as_str().expect("task id").parse().expect("task id")
}

/// Kills the executor at `point` on its first task, starts a clean one, and
/// returns the task once the system has decided.
async fn crash_executor_at(system: &mut System, point: &str) -> fenceline_domain::ids::TaskId {
    system.spawn_all(Some(&format!("{point}=return(crash)"))).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a red shoe"})).await;
    let exit = system.service("executor").wait_exit(LONG).await;
    assert!(exit.is_some(), "the executor did not crash at {point}:\n{}", system.logs());
    assert!(!system.service("executor").lines_with(point).is_empty(), "it crashed elsewhere");
    system.spawn("executor", "executor", &[]).await;
    task
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_then_killed_at_a_provider_that_can_neither_dedupe_nor_look_up_is_outcome_unknown() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let task = crash_executor_at(&mut system, "executor.after_provider_answer").await;

    system.wait_state(task, &["outcome_unknown"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "the provider received and charged exactly one call");

    // Several retry periods later (backoff base 200 ms, cap 2 s): still one call.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "no automatic retry after an unknown outcome");
    let (state, _) = system.state(task).await.expect("task");
    assert_eq!(state, "outcome_unknown");
    let evidence = system.case_findings(task).await;
    assert!(evidence.iter().any(|e| e.contains("call_intent")), "the case names the last phase: {evidence:?}");
    assert!(evidence.iter().any(|e| e.contains("may be billed again")), "and what a retry would mean: {evidence:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_then_killed_at_a_provider_that_looks_up_is_recovered_without_a_second_call() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    let task = crash_executor_at(&mut system, "executor.after_provider_answer").await;

    system.wait_state(task, &["succeeded"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "recovered by look-up: one call in all");
    let sha: Option<String> =
        sqlx::query_scalar("SELECT lifecycle->'result'->>'sha256' FROM scheduler.tasks WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("result");
    assert_eq!(sha.map(|s| s.len()), Some(64), "the recovered result carries its checksum");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_then_killed_at_a_provider_that_dedupes_is_retried_with_the_same_key_and_charged_once() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    let task = crash_executor_at(&mut system, "executor.after_provider_answer").await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let log = system.provider("img").calls().await;
    assert_eq!(log.len(), 2, "the retry reached the provider: {log:?}");
    assert_eq!(log[0]["operation_key"], log[1]["operation_key"], "with the same operation key");
    assert_eq!(log[1]["outcome"], "replayed");
    assert_eq!(system.provider("img").charges().await, 1, "and was charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_call_intent_is_retried_automatically_with_one_call_in_all() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let task = crash_executor_at(&mut system, "executor.before_call_intent").await;

    system.wait_state(task, &["succeeded"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1));
    let token: i64 = sqlx::query_scalar("SELECT max(fencing_token) FROM executor.executions WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("execution");
    assert!(token >= 2, "the new executor took the lease over with a larger token ({token})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lost_between_scheduler_and_executor_is_reissued_and_runs_once() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn_all(Some("executor.drop_grant=1*return")).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a blue shoe"})).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    assert!(!system.service("executor").lines_with("fault point drops the grant").is_empty(), "the grant was dropped");
    let reissues: i32 = sqlx::query_scalar("SELECT sum(reissues)::int FROM reconciler.grants WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("grants");
    assert!(reissues >= 1, "the reconciler re-issued the grant");
    let executions: i64 = sqlx::query_scalar("SELECT count(*) FROM executor.executions WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("executions");
    assert_eq!(executions, 1, "one execution for the one grant");
    assert_eq!(calls(&system, "img").await, (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_returning_after_a_takeover_is_fenced_and_the_call_log_agrees() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    // The provider takes 4 s to answer: long enough to stop the caller mid-call.
    system.provider("img").rule(json!({"latency_ms": 4000, "times": 1})).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a green shoe"})).await;

    // Wait for the call to leave, then stop the worker's process as a long pause would.
    wait_until_the_call_left(&system).await;
    system.service("executor-a").signal("STOP");
    system.spawn("executor-b", "executor", &[]).await;

    // B takes the expired lease over, finds `call_intent` and reports the attempt
    // lost; the reconciler asks the provider and recovers the result.
    system.wait_state(task, &["succeeded"], LONG).await;
    system.service("executor-a").signal("CONT");
    assert!(
        system.service("executor-a").wait_for_line("write rejected: fenced", Duration::from_secs(30)).await,
        "the stale worker's write must be rejected:\n{}",
        system.service("executor-a").all_lines()
    );
    assert_eq!(calls(&system, "img").await, (1, 1), "one call: the stale worker's result was not a second one");
    let (worker_token, status) = system.execution(task).await;
    assert_eq!((worker_token, status.as_str()), (2, "lost"), "the taker-over's claim stands");
    let (state, _) = system.state(task).await.expect("task");
    assert_eq!(state, "succeeded", "the stale worker changed nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persons_retry_as_new_is_carried_out_once_as_a_new_operation() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate,ticket.triage".into())]).await;
    let token = system.token("acme").await;
    let intake = system.url_of("intake");
    system.spawn_all(Some("executor.after_provider_answer=return(crash)")).await;
    // Submitted through the API, as a client would.
    let task = submit_through_intake(&intake, &token).await;
    assert!(system.service("executor").wait_exit(LONG).await.is_some(), "the executor crashed after the answer");
    system.spawn("executor", "executor", &[]).await;
    system.wait_state(task, &["outcome_unknown"], LONG).await;
    let resolve = |body: serde_json::Value| {
        let url = format!("{intake}/v1/tasks/{task}/resolution");
        let token = token.clone();
        async move { fenceline_tests::system::http_as("POST", url, &token, Some(body)).await.expect("answer") }
    };

    // The task shows its case: the evidence, and what each resolution would do.
    let read = format!("{intake}/v1/tasks/{task}");
    let deadline = tokio::time::Instant::now() + LONG;
    let case = loop {
        let (_, body) = fenceline_tests::system::http_as("GET", read.clone(), &token, None).await.expect("read");
        if body["state"] == "outcome_unknown" && body["case"].is_object() {
            break body["case"].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never showed the case: {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let findings: Vec<&str> =
        case["evidence"].as_array().into_iter().flatten().filter_map(|e| e["finding"].as_str()).collect();
    assert!(findings.iter().any(|f| f.contains("call_intent")), "{case}");
    assert!(case["resolutions"]["retry_as_new"].as_str().unwrap_or_default().contains("bill"), "{case}");

    // Retrying as new needs the acknowledgement that it may be billed again.
    let case_id = case["case_id"].clone();
    let (status, body) = resolve(json!({"case_id": case_id, "action": "retry_as_new"})).await;
    assert!(status == 400 && body.to_string().contains("acknowledge_possible_charge"), "{status} {body}");
    // Intake offers the resolution once the status (with its case) is projected.
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let (status, body) =
            resolve(json!({"case_id": case_id, "action": "retry_as_new", "acknowledge_possible_charge": true})).await;
        if status == 202 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never took the resolution: {status} {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    system.wait_state(task, &["succeeded"], LONG).await;
    let log = system.provider("img").calls().await;
    assert_eq!(log.len(), 2, "one call per generation: {log:?}");
    assert_ne!(log[0]["request_id"], log[1]["request_id"], "the new generation is a new operation");
    assert_eq!(system.provider("img").charges().await, 2, "billed again, as the person acknowledged");

    // The same decision again changes nothing.
    let (again, body) =
        resolve(json!({"case_id": case_id, "action": "retry_as_new", "acknowledge_possible_charge": true})).await;
    assert_eq!((again, body["repeated"].as_bool()), (202, Some(true)), "a repeat of the recorded decision: {body}");
    let (other, body) = resolve(json!({"case_id": case_id, "action": "accept_failed"})).await;
    assert_eq!((other, body["type"].as_str()), (409, Some("/problems/already-resolved")), "{body}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("img").calls().await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_before_a_stale_request_registers_is_not_taken_as_never_received() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    // The provider registers the work 6 s after the request arrived: until then a
    // look-up by its key says "never received" although the request is there.
    system.provider("img").rule(json!({"register_after_ms": 6000, "times": 1})).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a late shoe"})).await;

    // The call left; the worker is stopped as a long pause would, and another
    // executor takes its lease over and reports the attempt lost at `call_intent`.
    system.wait_intent_published(LONG).await;
    system.service("executor-a").signal("STOP");
    system.spawn("executor-b", "executor", &[]).await;

    // The reconciler's first look-up finds nothing; it must not call that "never
    // received" before the stale request can no longer arrive, or the retry would
    // run the same work a second time at a provider that does not dedupe.
    system.wait_state(task, &["succeeded"], LONG).await;
    system.service("executor-a").signal("CONT");
    assert_eq!(calls(&system, "img").await, (1, 1), "one charge: the work was recovered, not done again");
    let evidence = system.case_findings(task).await;
    assert!(
        evidence.iter().any(|e| e.contains("could still arrive")),
        "the case says why it waited before believing \"never received\": {evidence:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_that_finds_the_work_done_with_a_bad_artifact_is_a_paid_bad_result_for_a_person() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    // Every operation is done and charged, but its artifact does not match its checksum.
    system.provider("img").rule(json!({"corrupt_artifact": true})).await;
    let task = crash_executor_at(&mut system, "executor.after_provider_answer").await;

    system.wait_state(task, &["needs_human"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "paid once, and not done again");
    let evidence = system.case_findings(task).await;
    assert!(
        evidence.iter().any(|e| e.contains("paid for") && e.contains("does not match its checksum")),
        "the case says the work was paid for and the result is bad: {evidence:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_that_finds_the_work_still_running_at_the_deadline_waits_for_its_result() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("executor-a", "executor", &[]).await;
    // The work is registered at once and takes 12 s; the task's deadline is in 6 s.
    system.provider("img").rule(json!({"latency_ms": 12_000, "times": 1})).await;
    let deadline = fenceline_events::Timestamp(fenceline_events::Timestamp::now().0 + 6_000_000);
    let task = system
        .submit_with("acme", "image.generate", json!({"prompt": "a slow shoe"}), |t| t.deadline = Some(deadline))
        .await;
    wait_until_the_call_left(&system).await;
    system.service("executor-a").signal("STOP");
    system.spawn("executor-b", "executor", &[]).await;

    // Found, still running, when the deadline passes: that is work in progress that
    // will be billed, not "no answer"; its result is recovered when it is done.
    system.wait_state(task, &["succeeded"], LONG).await;
    system.service("executor-a").signal("CONT");
    assert_eq!(calls(&system, "img").await, (1, 1), "recovered: one call in all");
}

/// Publishes the grant of a call at `provider` and what the executor says of it,
/// lost at `call_intent`.
async fn lose_a_call(system: &System, provider: &str) -> fenceline_domain::ids::TaskId {
    use fenceline_events::{AttemptGranted, AttemptLost, CallIntentRecorded, Event, Timestamp, topics};
    let task = fenceline_domain::ids::TaskId::new_v7();
    let grant = AttemptGranted { provider: provider.into(), slot: provider.into(), ..grant_of(task) };
    system.publish(topics::DISPATCH, &Event::AttemptGranted(grant.clone())).await;
    let key = format!("key-{}", uuid::Uuid::now_v7().simple());
    let intent = CallIntentRecorded {
        task_id: task,
        attempt: 1,
        step: "render".into(),
        operation_key: key.clone(),
        provider: provider.into(),
        recorded_at: Timestamp::now(),
    };
    system.publish(topics::ATTEMPTS, &Event::CallIntentRecorded(intent)).await;
    let lost = AttemptLost {
        task_id: task,
        attempt: 1,
        grant_id: grant.grant_id,
        last_phase: fenceline_domain::vocabulary::Phase::CallIntent,
        last_phase_at: Timestamp::now(),
        step: Some("render".into()),
        operation_key: Some(key),
        provider_request_id: None,
        detected_at: Timestamp::now(),
    };
    system.publish(topics::ATTEMPTS, &Event::AttemptLost(lost)).await;
    task
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_does_not_answer_look_ups_does_not_hold_up_the_cases_of_another() {
    let lookup = Caps { lookup: true, ..Caps::default() };
    let mut system = System::new(&[("stuck", lookup), ("prompt", lookup)]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    // `stuck` stops answering: each look-up there waits for its call timeout (10 s).
    system.provider("stuck").proc.signal("STOP");
    for _ in 0..8 {
        lose_a_call(&system, "stuck").await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let prompt = lose_a_call(&system, "prompt").await;

    // The case at `prompt` is asked at once, whatever waits at `stuck`.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    loop {
        let asked: bool = sqlx::query_scalar(
            "SELECT count(*) > 0 FROM reconciler.cases, jsonb_array_elements(evidence) e \
             WHERE task_id = $1 AND e->>'source' = 'provider prompt'",
        )
        .bind(prompt.as_uuid())
        .fetch_one(&system.pool)
        .await
        .unwrap_or(false);
        if asked {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the case at `prompt` was not asked within 8 s while `stuck` hung:\n{}",
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    system.provider("stuck").proc.signal("CONT");
}

/// A grant of `task` as the scheduler would publish it.
fn grant_of(task: fenceline_domain::ids::TaskId) -> fenceline_events::AttemptGranted {
    use fenceline_events::Timestamp;
    fenceline_events::AttemptGranted {
        grant_id: fenceline_domain::ids::GrantId::new_v7(),
        task_id: task,
        tenant: "acme".into(),
        attempt: 1,
        generation: 0,
        kind: "image.generate".into(),
        input_json: "{}".into(),
        resume_after_step: None,
        provider: "img".into(),
        slot: "img".into(),
        lease_budget_ms: 60_000,
        deadline: None,
        granted_at: Timestamp::now(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_or_a_cancel_heard_before_its_grant_keeps_the_grant_from_being_reissued() {
    use fenceline_events::{AttemptClaimed, CancelAttempt, Event, Timestamp, topics};
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    let (claimed, cancelled) =
        (grant_of(fenceline_domain::ids::TaskId::new_v7()), grant_of(fenceline_domain::ids::TaskId::new_v7()));
    // The claim and the cancel come first (they travel on other topics than the grant).
    let claim = AttemptClaimed {
        grant_id: claimed.grant_id,
        task_id: claimed.task_id,
        attempt: 1,
        fencing_token: 1,
        lease_expires_at: Timestamp::now(),
        worker: "executor#0".into(),
    };
    system.publish(topics::ATTEMPTS, &Event::AttemptClaimed(claim)).await;
    let cancel =
        CancelAttempt { task_id: cancelled.task_id, grant_id: cancelled.grant_id, requested_at: Timestamp::now() };
    system.publish(topics::DISPATCH, &Event::CancelAttempt(cancel)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    system.publish(topics::DISPATCH, &Event::AttemptGranted(claimed.clone())).await;
    system.publish(topics::DISPATCH, &Event::AttemptGranted(cancelled.clone())).await;

    // Past the claim timeout (4 s) and the reconciler's rounds, neither was re-issued.
    tokio::time::sleep(Duration::from_secs(9)).await;
    let rows: Vec<(uuid::Uuid, bool, bool, i32)> =
        sqlx::query_as("SELECT grant_id, claimed, ended, reissues FROM reconciler.grants ORDER BY grant_id")
            .fetch_all(&system.pool)
            .await
            .expect("grants");
    assert_eq!(rows.len(), 2, "both grants recorded: {rows:?}");
    for (grant, claimed_flag, ended, reissues) in &rows {
        assert_eq!(*reissues, 0, "grant {grant} was re-issued: {rows:?}");
        let expected = if *grant == claimed.grant_id.as_uuid() { (true, false) } else { (false, true) };
        assert_eq!((*claimed_flag, *ended), expected, "grant {grant}: {rows:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_as_new_asks_a_provider_that_can_be_asked_again_and_pays_nothing_when_the_work_was_done() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    // The work is done and charged, the answer is a gateway's 504, and the provider
    // cannot answer look-ups while the reconciler asks (20 s in tests).
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    let capabilities = format!("{}/admin/capabilities", system.provider("img").base);
    let caps = |lookup: bool| json!({"idempotency_keys": false, "lookup": lookup, "async_results": false});
    let put = |body| fenceline_tests::system::http("PUT", capabilities.clone(), Some(body));
    assert_eq!(put(caps(false)).await.expect("capabilities").0, 204);
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe in doubt"})).await;
    system.wait_state(task, &["outcome_unknown"], LONG).await;

    // The provider answers look-ups again; a person decides to retry as new.
    assert_eq!(put(caps(true)).await.expect("capabilities").0, 204);
    system.a_person_retries_as_new(task).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    assert_eq!(calls(&system, "img").await, (1, 1), "the look-up found the work done: nothing sent or paid again");
}

/// A person's `retry_as_new` at a provider that dedupes resends the key in doubt: the
/// work the earlier request may have done is answered from the provider's memory of
/// that key, and is paid once. Here a 504 after the work, then a 403 for the retry
/// of the same key, brings the task to a person.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_as_new_at_a_provider_that_dedupes_resends_the_key_in_doubt_and_pays_once() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    let img = system.provider("img");
    img.rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    img.rule(json!({"status": 403, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe a person retries"})).await;
    system.wait_state(task, &["needs_human", "outcome_unknown", "succeeded", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "needs_human", "the 403 asks for a person: {reason:?}");

    system.a_person_retries_as_new(task).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let log: Vec<(String, String)> =
        system.provider("img").calls().await.iter().map(|c| (text(&c["operation_key"]), text(&c["outcome"]))).collect();
    let outcomes: Vec<&str> = log.iter().map(|(_, outcome)| outcome.as_str()).collect();
    assert_eq!(outcomes, ["status_after_work:504", "status:403", "replayed"], "the calls: {log:?}");
    assert!(log.iter().all(|(key, _)| *key == log[0].0), "every call carries the key in doubt: {log:?}");
    assert_eq!(system.provider("img").charges().await, 1, "paid once");
}

/// A second `retry_as_new` follows the key actually in doubt through every
/// generation: the first retry sent the earlier key again (and met a 403), so the
/// key its own generation would have made never left; the second retry sends the
/// first key once more and is answered from the provider's memory of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_retry_as_new_at_a_provider_that_dedupes_sends_the_key_in_doubt_again_and_pays_once() {
    let mut system = System::new(&[("img", Caps { idempotency_keys: true, ..Caps::default() })]).await;
    let img = system.provider("img");
    img.rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    img.rule(json!({"status": 403, "times": 2})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe retried twice"})).await;
    for round in 0..2 {
        let settled = ["needs_human", "outcome_unknown", "succeeded", "failed"];
        system.wait_state(task, &settled, LONG).await;
        let (state, reason) = system.state(task).await.expect("task");
        assert_eq!(state, "needs_human", "round {round}: the 403 asks for a person: {reason:?}");
        system.a_person_retries_as_new(task).await;
        // The decision is carried out (one more call) before the task is judged again.
        let deadline = tokio::time::Instant::now() + LONG;
        while system.provider("img").calls().await.len() < 3 + round {
            assert!(tokio::time::Instant::now() < deadline, "the resolution was not carried out:\n{}", system.logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    system.wait_state(task, &["succeeded"], LONG).await;
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let log: Vec<(String, String)> =
        system.provider("img").calls().await.iter().map(|c| (text(&c["operation_key"]), text(&c["outcome"]))).collect();
    let outcomes: Vec<&str> = log.iter().map(|(_, outcome)| outcome.as_str()).collect();
    assert_eq!(outcomes, ["status_after_work:504", "status:403", "status:403", "replayed"], "the calls: {log:?}");
    assert!(log.iter().all(|(key, _)| *key == log[0].0), "every call carries the key in doubt: {log:?}");
    assert_eq!(system.provider("img").charges().await, 1, "paid once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_a_stale_worker_verified_after_a_takeover_recovers_its_outcome_unknown_case_without_a_second_charge() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    // Worker A is held up once right after the provider answered: it has the result
    // in hand, not yet verified or recorded, when its process is stopped there. The
    // hold is a blocking sleep on one of A's runtime threads, which can hold up A's
    // relay too; so the provider takes a second to answer, during which A's relay
    // publishes the call intent while A's worker awaits the answer, and A is
    // stopped inside the hold, well after it began.
    system.provider("img").rule(json!({"latency_ms": 1000, "times": 1})).await;
    let held = [("FAILPOINTS", "executor.after_provider_answer=1*sleep(5000)".to_owned())];
    system.spawn("executor-a", "executor", &held).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a stale shoe"})).await;
    wait_until_the_call_left(&system).await;
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    system.service("executor-a").signal("STOP");

    // B takes the expired lease over after `call_intent` and reports the attempt
    // lost: at a provider that can neither dedupe nor be asked, nobody knows yet.
    system.spawn("executor-b", "executor", &[]).await;
    system.wait_state(task, &["outcome_unknown", "succeeded", "failed", "needs_human"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "outcome_unknown", "{reason:?}\n{}", system.logs());

    // A comes back, verifies the result, is refused its checkpoint and reports it.
    system.service("executor-a").signal("CONT");
    assert!(
        system.service("executor-a").wait_for_line("write rejected: fenced", Duration::from_secs(30)).await,
        "the stale worker's checkpoint must be refused:\n{}",
        system.service("executor-a").all_lines()
    );
    system.wait_state(task, &["succeeded", "failed", "needs_human"], Duration::from_secs(30)).await;
    let (state, reason) = system.state(task).await.expect("task");
    let reason = reason.unwrap_or_default();
    assert_eq!(state, "succeeded", "{reason}\n{}", system.logs());
    assert!(
        reason.contains("verified") && reason.contains("no second call"),
        "the reason says what is proven: {reason}"
    );
    assert_eq!(calls(&system, "img").await, (1, 1), "the provider was called and charged once");

    // The provider's own account of the operation is the result the task ended with.
    let log = system.provider("img").calls().await;
    let request_id = log[0]["request_id"].as_str().expect("request id").to_owned();
    let (_, operation) = fenceline_tests::system::http(
        "GET",
        format!("{}/v1/operations/{request_id}", system.provider("img").base),
        None,
    )
    .await
    .expect("operation");
    let sha256 = operation["result"]["sha256"].as_str().expect("sha256").to_owned();
    let kept: Option<String> =
        sqlx::query_scalar("SELECT lifecycle->'result'->>'sha256' FROM scheduler.tasks WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("task result");
    assert_eq!(kept.as_deref(), Some(sha256.as_str()), "the task's result is the provider's");

    // The case records the evidence and the decision it led to.
    let (decision, evidence): (Option<String>, serde_json::Value) =
        sqlx::query_as("SELECT decision, evidence FROM reconciler.cases WHERE task_id = $1")
            .bind(task.as_uuid())
            .fetch_one(&system.pool)
            .await
            .expect("case");
    assert_eq!(decision.as_deref(), Some("recovered"), "{evidence}");
    let findings: Vec<&str> = evidence.as_array().into_iter().flatten().filter_map(|e| e["finding"].as_str()).collect();
    assert!(
        findings
            .iter()
            .any(|f| f.contains("lease had been taken over") && f.contains("verified") && f.contains(&sha256)),
        "the stale worker's verified result is in the case's evidence: {findings:#?}"
    );
    let (token, status) = system.execution(task).await;
    assert_eq!((token, status.as_str()), (2, "lost"), "the taker-over's claim stands; the stale worker wrote no phase");
}
