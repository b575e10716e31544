//! Spend and budgets, end to end: each call that did its work is priced as the
//! catalogue says (a price per call, and the tokens the answer reports times their
//! price) and shown on the task, in `GET /v1/spend` and in the executor's metrics;
//! a tenant whose daily budget is spent starts no new paid call, its tasks wait
//! saying why, another tenant's run, and raising the budget lets them go on. The
//! fake provider's ledger counts what was charged.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_domain::spend::BUDGET_SPENT_OPENING;
use fenceline_tests::system::{Caps, Stop, System, api_agent, http_as, http_text, submit_over_api};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// Submits a task through intake as a client would, so that intake shows it.
async fn submit(system: &System, token: &str, kind: &str, input: Value, key: &str) -> TaskId {
    let (intake, token, key) = (system.url_of("intake"), token.to_owned(), key.to_owned());
    let body = json!({"kind": kind, "input": input});
    let submitted = tokio::task::spawn_blocking(move || submit_over_api(&api_agent(), &intake, &token, &key, &body))
        .await
        .expect("the submission")
        .expect("intake answered");
    assert_eq!(submitted.status, 202, "{:?}", submitted.body);
    submitted.task_id().and_then(|id| id.parse().ok()).expect("a task id")
}

async fn get(system: &System, token: &str, path: &str) -> Value {
    let (status, body) = http_as("GET", format!("{}{path}", system.url_of("intake")), token, None).await.expect("GET");
    assert_eq!(status, 200, "GET {path}: {body:#}");
    body
}

/// Waits until intake shows the task's first step with its provider.
async fn step_shown(system: &System, token: &str, task: TaskId) -> Value {
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let task_view = get(system, token, &format!("/v1/tasks/{task}")).await;
        if task_view["steps"][0]["provider"].is_string() {
            return task_view["steps"][0].clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never showed the step: {task_view:#}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A metric's value on a service's `/metrics` page (0 before the first).
async fn metric(system: &System, service: &str, line_start: &str) -> f64 {
    let (status, page) = http_text(format!("{}/metrics", system.url_of(service)), None).await.expect("metrics");
    assert_eq!(status, 200, "{page}");
    page.lines()
        .find(|line| line.starts_with(line_start))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_call_costs_its_price_plus_its_tokens_on_the_task_in_spend_and_in_the_metrics() {
    let system = System::new(&[("llm", Caps::default())]).await;
    let entry: Value = serde_json::from_slice(
        &std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dialects/openai-chat.json"))
            .expect("the shipped entry"),
    )
    .expect("JSON");
    for field in ["dialect", "capabilities"] {
        system.set_provider_field("llm", field, entry[field].clone());
    }
    system.set_provider_field("llm", "auth_header_env", json!("FENCELINE_TEST_CHAT_AUTHORIZATION"));
    // Half a cent a call, $2.50 and $10 a million prompt and completion tokens.
    system.set_provider_field("llm", "price_per_call_minor", json!(0.5));
    system.set_provider_field("llm", "usage_prices", json!({"prompt_tokens": 0.00025, "completion_tokens": 0.001}));
    system.set_kinds(json!({
        "chat.reply": {"steps": [{"name": "draft", "provider": "llm"}], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    let mut system = system;
    system.env.push(("FENCELINE_TEST_CHAT_AUTHORIZATION", "Bearer sk-test-spend".into()));
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "chat.reply".into())]).await;
    let token = system.token("acme").await;
    system.spawn_all(None).await;

    let input = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hello"}]});
    let task = submit(&system, &token, "chat.reply", input, "spend-chat-1").await;
    assert_eq!(system.wait_state(task, &["succeeded"], LONG).await, "succeeded");

    // The fake answers 9 prompt and 4 completion tokens: 0.5 + 9 × 0.00025 + 4 × 0.001.
    let expected = 0.50625;
    let step = step_shown(&system, &token, task).await;
    assert_eq!((step["provider"].as_str(), step["cost_minor"].as_f64()), (Some("llm"), Some(expected)), "{step:#}");
    let spend = get(&system, &token, "/v1/spend").await;
    assert_eq!((spend["calls"].as_i64(), spend["cost_minor"].as_f64()), (Some(1), Some(expected)), "{spend:#}");
    assert_eq!(spend["by_day"][0]["provider"], "llm", "{spend:#}");
    assert_eq!(spend["budget"], Value::Null, "acme has no budget");
    let counted = metric(&system, "executor", "fenceline_provider_spend_total{provider=\"llm\"}").await;
    assert!((counted - expected).abs() < 1e-9, "the executor counted {counted}");
    assert_eq!(system.provider("llm").charges().await, 1);
}

/// A system whose `image.generate` renders at `img`, one call at a time, 10 (minor
/// units) a call, with tenant `acme`'s daily budget `budget`; intake runs.
async fn budgeted(budget: i64) -> (System, String, String) {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.set_provider_limits("img", 1, 50.0, 50.0);
    system.set_provider_field("img", "price_per_call_minor", json!(10));
    system.set_catalog_field("budgets", json!({"acme": {"per_day_minor": budget}}));
    system.set_kinds(json!({
        "image.generate": {"steps": [{"name": "render", "provider": "img"}], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    let acme = system.token("acme").await;
    let globex = system.token("globex").await;
    system.spawn_all(None).await;
    (system, acme, globex)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_budget_holds_the_tenants_new_calls_with_a_reason_until_it_is_raised() {
    let (mut system, acme, globex) = budgeted(25).await;
    let mut tasks = Vec::new();
    for n in 0..5 {
        tasks.push(
            submit(&system, &acme, "image.generate", json!({"prompt": format!("lamp {n}")}), &format!("b-{n}")).await,
        );
    }
    // One call at a time at 10 each: the third brings the day to 30, past 25, and
    // the other two wait.
    let deadline = tokio::time::Instant::now() + LONG;
    let waiting = loop {
        let mut waiting = Vec::new();
        let mut succeeded = 0;
        for task in &tasks {
            match system.state(*task).await {
                Some((state, _)) if state == "succeeded" => succeeded += 1,
                Some((state, Some(reason))) if state == "queued" && reason.starts_with(BUDGET_SPENT_OPENING) => {
                    waiting.push((*task, reason))
                }
                _ => {}
            }
        }
        if succeeded == 3 && waiting.len() == 2 {
            break waiting;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never 3 succeeded and 2 waiting: {succeeded}, {waiting:?}\n{}",
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(waiting[0].1.contains("tenant `acme` spent: 30 of 25 today (UTC)"), "{}", waiting[0].1);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(system.provider("img").charges().await, 3, "no paid call after the budget was spent");
    let shown = get(&system, &acme, &format!("/v1/tasks/{}", waiting[0].0)).await;
    assert_eq!(shown["state"], "queued", "{shown:#}");
    assert!(shown["reason"].as_str().is_some_and(|r| r.starts_with(BUDGET_SPENT_OPENING)), "{shown:#}");
    let spend = get(&system, &acme, "/v1/spend").await;
    assert_eq!(spend["budget"]["spent"], true, "{spend:#}");
    assert_eq!(spend["budget"]["spent_today_minor"].as_f64(), Some(30.0), "{spend:#}");

    // Another tenant, without a budget, is not held.
    let other = submit(&system, &globex, "image.generate", json!({"prompt": "globex"}), "g-1").await;
    assert_eq!(system.wait_state(other, &["succeeded"], LONG).await, "succeeded");

    // Raised, the waiting tasks run: nothing was lost.
    system.stop("scheduler", Stop::Term).await;
    system.set_catalog_field("budgets", json!({"acme": {"per_day_minor": 100}}));
    system.spawn("scheduler", "scheduler", &[]).await;
    for (task, _) in &waiting {
        assert_eq!(system.wait_state(*task, &["succeeded"], LONG).await, "succeeded");
    }
    assert_eq!(system.provider("img").charges().await, 6, "five of acme's and one of globex's");
}
