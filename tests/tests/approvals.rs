//! A person's decisions about approvals on the real stack: what a task shows them
//! (its input, its steps' outputs, the card of the wait), approve and reject bound
//! to one wait and to the digest of the card, and the record kept afterwards. The
//! fake payments provider's call log says whether a refund was paid.

use std::collections::BTreeMap;
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System, http_as};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// Intake, the scheduler and the executor over an `llm` and a `payments`
/// provider: `ticket.triage` classifies and drafts at `llm`, waits for
/// `refund_approved` and refunds at `payments`. Returns the system and a token.
async fn deciding_system(kinds: Option<Value>) -> (System, String) {
    let mut system = System::new(&[("llm", Caps::default()), ("payments", Caps::default())]).await;
    if let Some(kinds) = kinds {
        system.set_kinds(kinds);
    }
    system.spawn("intake", "intake", &[]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let token = system.token("acme").await;
    (system, token)
}

async fn submit(system: &System, token: &str, input: Value) -> TaskId {
    let url = format!("{}/v1/tasks", system.url_of("intake"));
    let key = uuid::Uuid::now_v7().to_string();
    let (status, body) = fenceline_tests::system::http_with(
        "POST",
        url,
        &[("Authorization", &format!("Bearer {token}")), ("Idempotency-Key", &key)],
        Some(json!({"kind": "ticket.triage", "input": input})),
    )
    .await
    .expect("submit");
    assert_eq!(status, 202, "{body}");
    body["task_id"].as_str().and_then(|id| id.parse().ok()).expect("a task id")
}

async fn read(system: &System, token: &str, task: TaskId) -> Value {
    let (status, body) =
        http_as("GET", format!("{}/v1/tasks/{task}", system.url_of("intake")), token, None).await.expect("read");
    assert_eq!(status, 200, "{body}");
    body
}

/// Reads the task until intake shows it in `state` (and `check` holds).
async fn read_until(system: &System, token: &str, task: TaskId, state: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let body = read(system, token, task).await;
        if body["state"] == state && check(&body) {
            return body;
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never showed {state}: {body:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn decide(system: &System, token: &str, task: TaskId, decision: &str, body: Value) -> (u16, Value) {
    let url = format!("{}/v1/tasks/{task}/{decision}", system.url_of("intake"));
    http_as("POST", url, token, Some(body)).await.expect("decide")
}

/// Waits until intake shows the wait's card with the outputs it rests on.
async fn waiting_card(system: &System, token: &str, task: TaskId) -> Value {
    read_until(system, token, task, "awaiting_approval", |b| {
        b["approval"]["rests_on"].as_array().is_some_and(|r| r.len() == 2)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_shows_its_input_its_steps_outputs_and_the_card_of_its_wait() {
    let (system, token) = deciding_system(None).await;
    let input = json!({"ticket": "T-81723", "amount_cents": 1250, "note": "<script>alert(1)</script>"});
    let task = submit(&system, &token, input.clone()).await;
    let shown = waiting_card(&system, &token, task).await;

    assert_eq!(shown["input"], input, "the input as submitted");
    let steps = shown["steps"].as_array().expect("steps");
    let names: Vec<&str> = steps.iter().filter_map(|s| s["step"].as_str()).collect();
    assert_eq!(names, ["classify", "draft"], "{shown:#}");
    for step in steps {
        // The fake provider returns files: their reference, and a link to each.
        assert!(step["output"]["uri"].is_string() && step["output"]["sha256"].is_string(), "{step}");
        assert_eq!(step["artifact_uri"], step["output"]["uri"], "{step}");
    }
    let card = &shown["approval"];
    assert_eq!((card["step"].as_str(), card["signal"].as_str()), (Some("approve"), Some("refund_approved")));
    assert_eq!(card["generation"], 0);
    assert_eq!(card["then"], json!([{"step": "refund", "provider": "payments", "operation": "refund"}]));
    let rests_on: Vec<&str> =
        card["rests_on"].as_array().expect("rests on").iter().filter_map(|s| s["step"].as_str()).collect();
    assert_eq!(rests_on, ["classify", "draft"]);
    // The digest is the domain's, of the outputs shown.
    let outputs: BTreeMap<&str, &Value> =
        steps.iter().map(|s| (s["step"].as_str().expect("name"), &s["output"])).collect();
    assert_eq!(card["digest"].as_str(), Some(fenceline_domain::approvals::digest("approve", &outputs).as_str()));
    assert!(shown["decisions"].as_array().is_some_and(Vec::is_empty));
    assert_eq!(system.provider("payments").calls().await.len(), 0, "nothing paid while waiting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_of_the_card_read_runs_the_refund_once_and_stays_on_record() {
    let (system, token) = deciding_system(None).await;
    let task = submit(&system, &token, json!({"ticket": "T-1"})).await;
    let card = waiting_card(&system, &token, task).await["approval"].clone();
    let approval = json!({"decided_by": "Ana Lima", "note": "customer verified by phone",
                          "step": "approve", "generation": 0, "digest": card["digest"]});

    let (status, body) = decide(&system, &token, task, "approve", approval.clone()).await;
    assert_eq!((status, body["repeated"].as_bool()), (202, Some(false)), "{body}");
    let done = read_until(&system, &token, task, "succeeded", |_| true).await;
    let calls = system.provider("payments").calls().await;
    assert_eq!(calls.len(), 1, "the approved refund was sent once: {calls:?}");
    assert_eq!(system.provider("payments").charges().await, 1, "and charged once");

    // The same decision again is the one recorded; another one is refused.
    let (status, body) = decide(&system, &token, task, "approve", approval).await;
    assert_eq!((status, body["repeated"].as_bool()), (202, Some(true)), "{body}");
    let (status, body) = decide(&system, &token, task, "reject", json!({"decided_by": "Bo", "step": "approve"})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/already-decided")), "{body}");
    assert!(body["detail"].as_str().is_some_and(|d| d.contains("approve by Ana Lima")), "{body}");

    // After the task moved on, the decision is on record with what it was made on.
    let decisions = done["decisions"].as_array().expect("decisions");
    assert_eq!(decisions.len(), 1, "{done:#}");
    let d = &decisions[0];
    assert_eq!((d["decision"].as_str(), d["decided_by"].as_str()), (Some("approve"), Some("Ana Lima")));
    assert_eq!(d["note"], "customer verified by phone");
    assert_eq!((d["step"].as_str(), d["generation"].as_i64()), (Some("approve"), Some(0)));
    assert_eq!(d["digest"], card["digest"]);
    assert!(d["token_identity"].as_str().is_some_and(|t| t.starts_with("tenant:acme token:")), "{d}");
    assert!(d["decided_at"].is_string());
    let rested: Vec<&String> = d["rests_on"].as_object().expect("rests on").keys().collect();
    assert_eq!(rested, ["classify", "draft"]);
    assert_eq!(d["rests_on"]["draft"], card["rests_on"][1]["output"]);
    assert!(done["timeline"].as_array().is_some_and(|t| t.iter().any(|l| l["event"] == "ApprovalDecided")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_ends_the_task_with_its_reason_and_nothing_is_paid() {
    let (system, token) = deciding_system(None).await;
    let task = submit(&system, &token, json!({"ticket": "T-2"})).await;
    let card = waiting_card(&system, &token, task).await["approval"].clone();

    let rejection = json!({"decided_by": "Ana Lima", "note": "duplicate ticket", "digest": card["digest"]});
    let (status, body) = decide(&system, &token, task, "reject", rejection).await;
    assert_eq!(status, 202, "{body}");
    system.wait_state(task, &["failed"], LONG).await;
    let shown = read_until(&system, &token, task, "failed", |_| true).await;
    let reason = shown["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with(fenceline_domain::lifecycle::REJECTED_BY_PERSON), "{reason}");
    assert!(reason.contains("`approve`"), "{reason}");
    assert_eq!(shown["decisions"][0]["decision"], "reject");

    // Nothing after the wait runs, now or later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("payments").calls().await.len(), 0, "no refund was sent");
    let (status, body) = decide(&system, &token, task, "approve", json!({"decided_by": "Bo"})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/already-decided")), "{body}");

    // Listings show the state and its reason too.
    let (_, listed) =
        http_as("GET", format!("{}/v1/tasks?state=failed", system.url_of("intake")), &token, None).await.expect("list");
    assert!(listed["tasks"][0]["reason"].as_str().is_some_and(|r| r.starts_with("rejected by a person")), "{listed}");
}

/// Two approvals with the same signal: a check of the ticket before the draft, and
/// the refund's approval after it.
fn two_approvals() -> Value {
    json!({
        "ticket.triage": {"steps": [
            {"name": "classify", "provider": "llm"},
            {"name": "check", "approval_signal": "refund_approved"},
            {"name": "draft", "provider": "llm"},
            {"name": "approve", "approval_signal": "refund_approved"},
            {"name": "refund", "provider": "payments"}
        ], "max_attempts": 4, "attempt_budget_ms": 60_000}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_the_task_passed_takes_no_decision_and_the_next_one_can_be_rejected() {
    let (system, token) = deciding_system(Some(two_approvals())).await;
    let task = submit(&system, &token, json!({"ticket": "T-5"})).await;
    read_until(&system, &token, task, "awaiting_approval", |b| b["step"] == "check").await;
    // A bare signal approves the wait the task is at.
    let url = format!("{}/v1/tasks/{task}/signals/refund_approved", system.url_of("intake"));
    let (status, body) = http_as("POST", url, &token, Some(json!({}))).await.expect("signal");
    assert_eq!(status, 202, "{body}");
    let second = read_until(&system, &token, task, "awaiting_approval", |b| b["step"] == "approve").await;
    assert_eq!(second["approval"]["then"], json!([{"step": "refund", "provider": "payments", "operation": "refund"}]));

    let (status, body) = decide(&system, &token, task, "approve", json!({"decided_by": "Ana", "step": "check"})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/approval-changed")), "{body}");
    assert!(body["detail"].as_str().is_some_and(|d| d.contains("is over")), "{body}");

    let rejection = json!({"decided_by": "Ana", "digest": second["approval"]["digest"]});
    let (status, body) = decide(&system, &token, task, "reject", rejection).await;
    assert_eq!(status, 202, "{body}");
    read_until(&system, &token, task, "failed", |_| true).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(system.provider("payments").calls().await.len(), 0, "no refund after the rejection");
    assert_eq!(system.provider("llm").calls().await.len(), 2, "classify and draft ran once each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_sent_before_its_wait_applies_to_that_wait_only() {
    let kinds = two_approvals();
    let (system, token) = deciding_system(Some(kinds)).await;
    let task = submit(&system, &token, json!({"ticket": "T-3"})).await;
    // At once, before any wait: approve the refund's wait (generation 0) ahead.
    let (status, body) =
        decide(&system, &token, task, "approve", json!({"decided_by": "Ana", "step": "approve", "generation": 0}))
            .await;
    assert_eq!(status, 202, "{body}");

    // The first wait is another one: it still waits, and nothing was paid.
    let first = read_until(&system, &token, task, "awaiting_approval", |b| b["step"] == "check").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let still = read(&system, &token, task).await;
    assert_eq!((still["state"].as_str(), still["step"].as_str()), (Some("awaiting_approval"), Some("check")));
    assert_eq!(system.provider("payments").calls().await.len(), 0);
    assert_eq!(system.provider("llm").calls().await.len(), 1, "the draft waits for the check");

    // The check's own approval lets it go on; the early approval ends the second wait.
    let card = &first["approval"];
    assert_eq!(card["then"], json!([{"step": "draft", "provider": "llm", "operation": "draft"}]));
    let (status, body) =
        decide(&system, &token, task, "approve", json!({"decided_by": "Bo", "digest": card["digest"]})).await;
    assert_eq!(status, 202, "{body}");
    read_until(&system, &token, task, "succeeded", |_| true).await;
    assert_eq!(system.provider("payments").calls().await.len(), 1, "the refund ran once");
    // Nothing is left to decide: a wait the task has passed is refused, not kept.
    let (status, body) = decide(&system, &token, task, "reject", json!({"decided_by": "Cy", "step": "check"})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/already-decided")), "{body}");
    let decisions: Vec<(String, String)> = read(&system, &token, task).await["decisions"]
        .as_array()
        .expect("decisions")
        .iter()
        .map(|d| {
            (d["step"].as_str().unwrap_or_default().to_owned(), d["decided_by"].as_str().unwrap_or_default().to_owned())
        })
        .collect();
    assert_eq!(decisions, [("approve".to_owned(), "Ana".to_owned()), ("check".to_owned(), "Bo".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_on_a_card_that_changed_is_refused_naming_what_changed() {
    let (system, token) = deciding_system(None).await;
    let task = submit(&system, &token, json!({"ticket": "T-4"})).await;
    let shown = waiting_card(&system, &token, task).await;
    // The card as a person read it before the draft was there.
    let classify = &shown["steps"][0]["output"];
    let earlier = fenceline_domain::approvals::digest("approve", &BTreeMap::from([("classify", classify)]));

    let (status, body) =
        decide(&system, &token, task, "approve", json!({"decided_by": "Ana", "digest": earlier})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/approval-changed")), "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("step `draft` produced its output"), "{detail}");
    assert!(!detail.contains("classify"), "only what changed: {detail}");

    let (status, body) =
        decide(&system, &token, task, "approve", json!({"decided_by": "Ana", "digest": "0".repeat(64)})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/approval-changed")), "{body}");
    let (status, body) = decide(&system, &token, task, "approve", json!({"decided_by": "Ana", "generation": 1})).await;
    assert_eq!((status, body["type"].as_str()), (409, Some("/problems/approval-changed")), "{body}");
    let (status, body) = decide(&system, &token, task, "approve", json!({"decided_by": ""})).await;
    assert_eq!(status, 400, "{body}");

    // Nothing refused was recorded or sent: the task still waits, nothing was paid.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = read(&system, &token, task).await;
    assert_eq!(still["state"], "awaiting_approval");
    assert!(still["decisions"].as_array().is_some_and(Vec::is_empty));
    assert_eq!(system.provider("payments").calls().await.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dialects_inline_result_is_shown_as_its_value_and_the_approval_rests_on_it() {
    let mut system = System::new(&[("llm", Caps::default()), ("payments", Caps::default())]).await;
    system.set_provider_field("llm", "dialect", crate::dialects::chat_dialect("{{ input.prompt | tojson }}"));
    system.set_provider_field("llm", "auth_header_env", json!("FENCELINE_TEST_CHAT_AUTHORIZATION"));
    system.env.push(("FENCELINE_TEST_CHAT_AUTHORIZATION", "Bearer sk-test-approvals".into()));
    system.set_kinds(json!({
        "ticket.triage": {"steps": [
            {"name": "draft", "provider": "llm"},
            {"name": "approve", "approval_signal": "refund_approved"},
            {"name": "refund", "provider": "payments"}
        ], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.spawn("intake", "intake", &[]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let token = system.token("acme").await;
    let task = submit(&system, &token, json!({"model": "gpt-test", "prompt": "refund 12.50 EUR for T-9"})).await;
    let shown = read_until(&system, &token, task, "awaiting_approval", |b| {
        b["approval"]["rests_on"].as_array().is_some_and(|r| r.len() == 1)
    })
    .await;

    // The draft is the completion itself, not a reference to it.
    let draft = &shown["approval"]["rests_on"][0];
    assert_eq!(draft["step"], "draft");
    assert_eq!(
        draft["output"],
        json!({"role": "assistant", "content": "You said: refund 12.50 EUR for T-9", "refusal": null})
    );
    assert!(draft.get("artifact_uri").is_none(), "an inline result links to no file: {draft}");
    assert_eq!(shown["steps"][0]["output"], draft["output"]);

    let approval = json!({"decided_by": "Ana", "digest": shown["approval"]["digest"]});
    let (status, body) = decide(&system, &token, task, "approve", approval).await;
    assert_eq!(status, 202, "{body}");
    let done = read_until(&system, &token, task, "succeeded", |_| true).await;
    assert_eq!(system.provider("payments").calls().await.len(), 1, "the refund ran once");
    assert_eq!(done["decisions"][0]["rests_on"]["draft"]["content"], "You said: refund 12.50 EUR for T-9");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_card_shows_the_refund_request_it_lets_run_with_its_amount_and_reference() {
    let stripe = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = System::new(&[("llm", Caps::default()), ("payments", stripe)]).await;
    let entry: Value = serde_json::from_slice(
        &std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dialects/stripe-refunds.json"))
            .expect("the shipped entry"),
    )
    .expect("JSON");
    for field in ["dialect", "capabilities"] {
        system.set_provider_field("payments", field, entry[field].clone());
    }
    system.set_provider_field("payments", "auth_header_env", json!("FENCELINE_TEST_STRIPE_AUTHORIZATION"));
    system.env.push(("FENCELINE_TEST_STRIPE_AUTHORIZATION", "Bearer sk_test_approvals".into()));
    system.set_kinds(json!({
        "ticket.triage": {"steps": [
            {"name": "draft", "provider": "llm"},
            {"name": "approve", "approval_signal": "refund_approved"},
            {"name": "refund", "provider": "payments"}
        ], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.spawn("intake", "intake", &[]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let token = system.token("acme").await;
    let task = submit(&system, &token, json!({"payment_intent": "pi_3MtwBwLkdIwHu7ix28a3tqPa", "amount": 1250})).await;
    let shown = read_until(&system, &token, task, "awaiting_approval", |b| {
        b["approval"]["rests_on"].as_array().is_some_and(|r| r.len() == 1)
    })
    .await;
    let card = &shown["approval"];

    // What the approval lets happen, as Stripe will be sent it (its key made when the call is).
    let refund = &card["then"][0];
    assert_eq!((refund["step"].as_str(), refund["provider"].as_str()), (Some("refund"), Some("payments")));
    assert_eq!(
        refund["request"],
        json!({"method": "POST", "path": "/v1/refunds",
               "body": {"payment_intent": "pi_3MtwBwLkdIwHu7ix28a3tqPa", "amount": "1250"}}),
        "{card:#}"
    );
    assert!(refund.get("request_error").is_none(), "{card:#}");
    assert!(system.provider("payments").calls().await.is_empty(), "nothing is paid before the approval");

    let approval = json!({"decided_by": "Ana", "digest": card["digest"]});
    let (status, body) = decide(&system, &token, task, "approve", approval).await;
    assert_eq!(status, 202, "{body}");
    read_until(&system, &token, task, "succeeded", |_| true).await;
    let calls = system.provider("payments").calls().await;
    assert_eq!(calls.len(), 1, "the refund ran once");
    assert_eq!(calls[0]["input"], refund["request"]["body"], "what was shown is what was sent");
}
