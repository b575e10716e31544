//! A step's standing decision in the catalogue, end to end: at a provider that can
//! neither dedupe nor be asked, an ambiguous outcome (the work done and charged,
//! then a gateway's 504) is sent again as a new operation within the policy's
//! limits, says so on the task's timeline, and then asks a person. Judged by the
//! fake provider's ledger.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_domain::standing::EVIDENCE_OPENING;
use fenceline_tests::system::{Caps, System, api_agent, http_as, http_text, submit_over_api};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// A system whose `image.generate` renders at `img`, 10 (minor units) a call,
/// with `on_unknown` on the step when given; intake runs so the task can be read.
async fn system_with(on_unknown: Option<Value>) -> (System, String) {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.set_provider_field("img", "price_per_call_minor", json!(10));
    let mut render = json!({"name": "render", "provider": "img"});
    if let Some(policy) = on_unknown {
        render["on_unknown"] = policy;
    }
    system.set_kinds(json!({
        "image.generate": {"steps": [render], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    let token = system.token("acme").await;
    system.spawn_all(None).await;
    (system, token)
}

/// Submits an `image.generate` task through intake, as a client would, so that intake shows it.
async fn submit(system: &System, token: &str, prompt: &str) -> TaskId {
    let (intake, token) = (system.url_of("intake"), token.to_owned());
    let body = json!({"kind": "image.generate", "input": {"prompt": prompt}});
    let key = format!("policy-{}", prompt.replace(' ', "-"));
    let submitted = tokio::task::spawn_blocking(move || submit_over_api(&api_agent(), &intake, &token, &key, &body))
        .await
        .expect("the submission")
        .expect("intake answered");
    assert_eq!(submitted.status, 202, "{:?}", submitted.body);
    submitted.task_id().and_then(|id| id.parse().ok()).expect("a task id")
}

/// The scheduler's `fenceline_policy_resends_total` for `img`'s `render` step (0 before the first).
async fn resends_counted(system: &System) -> u64 {
    let (status, page) = http_text(format!("{}/metrics", system.url_of("scheduler")), None).await.expect("metrics");
    assert_eq!(status, 200, "{page}");
    page.lines()
        .find(|line| line.starts_with("fenceline_policy_resends_total{") && line.contains("step=\"render\""))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

fn two_extra_charges() -> Value {
    json!({"send_again": {"max_extra_charges": 2, "max_extra_cost_minor": 20}})
}

/// The task as intake shows it, once its timeline holds `lines` lines that say `needle`.
async fn shown_with(system: &System, token: &str, task: TaskId, needle: &str, lines: usize) -> Value {
    let url = format!("{}/v1/tasks/{task}", system.url_of("intake"));
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let (status, body) = http_as("GET", url.clone(), token, None).await.expect("read the task");
        if status == 200 && evidence_lines(&body, needle).len() >= lines {
            return body;
        }
        assert!(tokio::time::Instant::now() < deadline, "the timeline never said `{needle}` {lines} times: {body:#}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn evidence_lines<'a>(task: &'a Value, needle: &str) -> Vec<&'a str> {
    task["timeline"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|line| line["detail"].as_str())
        .filter(|detail| detail.contains(needle))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_sends_an_ambiguous_call_again_once_and_the_task_succeeds_with_the_evidence_shown() {
    let (system, token) = system_with(Some(two_extra_charges())).await;
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    let task = submit(&system, &token, "a cheap shoe").await;

    system.wait_state(task, &["succeeded", "outcome_unknown", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("the task");
    assert_eq!(state, "succeeded", "{reason:?}\n{}", system.logs());
    let img = system.provider("img");
    assert_eq!((img.charges().await, img.calls().await.len()), (2, 2), "the call in doubt and the one sent again");

    let shown = shown_with(&system, &token, task, EVIDENCE_OPENING, 1).await;
    let lines = evidence_lines(&shown, EVIDENCE_OPENING);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("step `render`: extra charge 1 of at most 2, 10 of at most 20"), "{}", lines[0]);
    assert_eq!(resends_counted(&system).await, 1, "the scheduler counts the extra charge");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_spent_by_ambiguous_calls_leaves_the_task_to_a_person_after_exactly_its_extra_charges() {
    let (system, token) = system_with(Some(two_extra_charges())).await;
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true})).await;
    let task = submit(&system, &token, "a shoe never answered").await;

    system.wait_state(task, &["outcome_unknown", "succeeded", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("the task");
    assert_eq!(state, "outcome_unknown", "{reason:?}\n{}", system.logs());
    assert!(reason.as_deref().is_some_and(|r| r.contains("policy for step `render` is spent")), "{reason:?}");
    // Nothing more goes out while a person decides.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let img = system.provider("img");
    assert_eq!((img.charges().await, img.calls().await.len()), (3, 3), "one call and two extra charges, no more");

    let shown = shown_with(&system, &token, task, EVIDENCE_OPENING, 2).await;
    let lines = evidence_lines(&shown, EVIDENCE_OPENING);
    assert!(lines.iter().any(|l| l.contains("extra charge 2 of at most 2, 20 of at most 20")), "{lines:?}");
    assert_eq!(shown["state"], "outcome_unknown", "{shown:#}");
    assert_eq!(resends_counted(&system).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_policy_an_ambiguous_call_waits_for_a_person_after_one_charge() {
    let (system, _token) = system_with(None).await;
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true})).await;
    let task = system.submit("acme", "image.generate", json!({"prompt": "a shoe for a person"})).await;

    system.wait_state(task, &["outcome_unknown", "succeeded", "needs_human", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("the task");
    assert_eq!(state, "outcome_unknown", "{reason:?}\n{}", system.logs());
    assert!(reason.as_deref().is_some_and(|r| !r.contains("policy")), "{reason:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let img = system.provider("img");
    assert_eq!((img.charges().await, img.calls().await.len()), (1, 1), "nothing is sent again without a policy");
    assert_eq!(resends_counted(&system).await, 0);
}

/// After the policy sent `classify` again, the task runs as generation 1: the
/// approval card intake shows names that generation, so the person's decision
/// answers the wait the scheduler holds, and the refund is paid once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_after_a_policys_resend_is_bound_to_the_generation_that_runs() {
    let mut system = System::new(&[("llm", Caps::default()), ("payments", Caps::default())]).await;
    system.set_provider_field("llm", "price_per_call_minor", json!(10));
    system.set_kinds(json!({"ticket.triage": {"steps": [
        {"name": "classify", "provider": "llm", "on_unknown": two_extra_charges()},
        {"name": "draft", "provider": "llm"},
        {"name": "approve", "approval_signal": "refund_approved"},
        {"name": "refund", "provider": "payments"}
    ], "max_attempts": 4, "attempt_budget_ms": 60_000}}));
    system.spawn("intake", "intake", &[]).await;
    let token = system.token("acme").await;
    system.spawn_all(None).await;
    system.provider("llm").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    let (intake, submit_token) = (system.url_of("intake"), token.clone());
    let body = json!({"kind": "ticket.triage", "input": {"ticket": "T-1"}});
    let submitted =
        tokio::task::spawn_blocking(move || submit_over_api(&api_agent(), &intake, &submit_token, "policy-T-1", &body))
            .await
            .expect("the submission")
            .expect("intake answered");
    assert_eq!(submitted.status, 202, "{:?}", submitted.body);
    let task: TaskId = submitted.task_id().and_then(|id| id.parse().ok()).expect("a task id");

    system.wait_state(task, &["awaiting_approval", "outcome_unknown", "needs_human", "failed"], LONG).await;
    let url = format!("{}/v1/tasks/{task}", system.url_of("intake"));
    let deadline = tokio::time::Instant::now() + LONG;
    let card = loop {
        let (_, shown) = http_as("GET", url.clone(), &token, None).await.expect("read the task");
        let card = &shown["approval"];
        if shown["state"] == "awaiting_approval" && card["rests_on"].as_array().is_some_and(|r| r.len() == 2) {
            break card.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never showed the card: {shown:#}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(card["generation"], 1, "{card:#}");
    let approval = json!({"decided_by": "Ana Lima", "digest": card["digest"]});
    let (status, answer) = http_as("POST", format!("{url}/approve"), &token, Some(approval)).await.expect("approve");
    assert_eq!(status, 202, "{answer}");

    system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(system.state(task).await.map(|(state, _)| state).as_deref(), Some("succeeded"));
    assert_eq!(system.provider("llm").charges().await, 3, "classify twice (once under the policy) and draft once");
    assert_eq!(system.provider("payments").charges().await, 1, "the refund once");
}
