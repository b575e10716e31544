//! The shipped provider dialects against what the vendors publish, not only against
//! Fenceline's own fake: the OpenAI chat completions entry of deploy/dialects
//! through Prism serving OpenAI's OpenAPI description (tests/vendor/openai-openapi)
//! as a validating proxy in front of the fake provider, and the Stripe refunds
//! dialect against Stripe's stripe-mock. A request the vendor's description
//! refuses, or an answer it does not describe, fails these tests.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System};
use fenceline_tests::vendors::{Prism, StripeMock, openai_description, server_path};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// A catalogue entry as deploy/dialects ships it for users to copy.
fn shipped(file: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dialects").join(file);
    serde_json::from_slice(&std::fs::read(&path).expect("a shipped entry")).expect("JSON")
}

/// The OpenAI-compatible chat completions provider exactly as shipped.
fn shipped_chat_entry() -> Value {
    shipped("openai-chat.json")
}

/// The output a step checkpointed.
async fn checkpoint(system: &System, task: TaskId, step: &str) -> Value {
    sqlx::query_scalar("SELECT output FROM executor.checkpoints WHERE task_id = $1 AND step = $2")
        .bind(task.as_uuid())
        .bind(step)
        .fetch_one(&system.pool)
        .await
        .expect("a checkpoint")
}

/// A system whose provider `llm` is the shipped chat entry (its dialect, with
/// `body` when given instead of the shipped one), reached through Prism in front of
/// the fake provider, and a kind `chat.reply` of one step calling it.
async fn chat_through_prism(body: Option<&str>) -> (System, Prism) {
    let system = System::new(&[("llm", Caps::default())]).await;
    let prism = Prism::proxy(&openai_description(), &system.provider("llm").base).await;
    let mut entry = shipped_chat_entry();
    if let Some(body) = body {
        entry["dialect"]["request"]["body"] = json!(body);
    }
    for field in ["dialect", "capabilities"] {
        system.set_provider_field("llm", field, entry[field].clone());
    }
    system.set_provider_field("llm", "base_url", json!(prism.url));
    system.set_provider_field("llm", "auth_header_env", json!("FENCELINE_TEST_CHAT_AUTHORIZATION"));
    system.set_kinds(json!({
        "chat.reply": {"steps": [{"name": "draft", "provider": "llm"}], "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    let mut system = system;
    system.env.push(("FENCELINE_TEST_CHAT_AUTHORIZATION", "Bearer sk-test-conformance".into()));
    system.spawn_all(None).await;
    (system, prism)
}

#[test]
fn the_shipped_chat_entry_calls_the_url_openai_describes() {
    let entry = shipped_chat_entry();
    let description: Value =
        serde_json::from_slice(&std::fs::read(openai_description()).expect("the vendored description")).expect("JSON");
    let server = description["servers"][0]["url"].as_str().expect("a server URL");
    let path = entry["dialect"]["request"]["path"].as_str().expect("a path");
    let operation = path.strip_prefix(&server_path(&description)).expect("the path is under the server's");
    assert_eq!(format!("{}{path}", entry["base_url"].as_str().expect("base_url")), format!("{server}{operation}"));
    // `POST` unless the entry says otherwise, as the catalogue reads it.
    let method = entry["dialect"]["request"]["method"].as_str().unwrap_or("POST").to_lowercase();
    assert_eq!(description["paths"][operation][&method]["operationId"], "createChatCompletion");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_chat_completions_dialect_speaks_openais_published_description() {
    let (system, prism) = chat_through_prism(None).await;
    let input = json!({"model": "gpt-4o-mini", "messages": [
        {"role": "developer", "content": "Answer in one sentence."},
        {"role": "user", "content": "hello"}
    ]});
    let task = system.submit("acme", "chat.reply", input).await;

    let state = system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(state, "succeeded", "{:?}\nPrism:\n{}\n{}", system.state(task).await, prism.log_tail(), system.logs());
    assert_eq!(prism.violations(), Vec::<String>::new(), "Prism found the exchange off OpenAI's description");
    assert_eq!(prism.forwarded(), 1, "one request, forwarded once:\n{}", prism.log_tail());
    let message = checkpoint(&system, task, "draft").await;
    assert_eq!(message, json!({"role": "assistant", "content": "You said: hello", "refusal": null}));
    let llm = system.provider("llm");
    assert_eq!((llm.calls().await.len(), llm.charges().await), (1, 1), "one completion, charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_openais_description_refuses_is_refused_by_prism_and_never_succeeds() {
    // `messages` must be an array of messages; this body sends the prompt's text.
    let malformed = "{\"model\": {{ input.model | tojson }}, \"messages\": {{ input.prompt | tojson }}}";
    let (system, prism) = chat_through_prism(Some(malformed)).await;
    let task = system.submit("acme", "chat.reply", json!({"model": "gpt-4o-mini", "prompt": "hello"})).await;

    let state = system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(state, "failed", "a 422 is rejected, not retried: {:?}", system.state(task).await);
    let violations = prism.violations();
    assert!(
        violations.iter().any(|line| line.contains("UNPROCESSABLE_ENTITY")),
        "Prism answered 422 for the body: {violations:?}\n{}",
        prism.log_tail()
    );
    assert_eq!(prism.forwarded(), 0, "the refused request never reached the provider");
    assert!(system.provider("llm").calls().await.is_empty(), "nothing was sent, nothing charged");
}

/// Stripe's refunds as deploy/dialects ships them, with `form` instead of the
/// shipped form when given.
fn stripe_refunds(form: Option<Value>) -> Value {
    let mut dialect = shipped("stripe-refunds.json")["dialect"].clone();
    if let Some(form) = form {
        dialect["request"]["form"] = form;
    }
    dialect
}

/// A system whose provider `payments` is stripe-mock reached through the refunds
/// dialect (with `form` when given), with a test-mode secret key, and a kind `refund.issue`.
async fn refunds_at_stripe_mock(form: Option<Value>) -> (System, StripeMock) {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    let system = System::new(&[("payments", caps)]).await;
    let stripe = StripeMock::start().await;
    system.set_provider_field("payments", "base_url", json!(stripe.url));
    system.set_provider_field("payments", "dialect", stripe_refunds(form));
    system.set_provider_field("payments", "auth_header_env", json!("FENCELINE_TEST_STRIPE_AUTHORIZATION"));
    system.set_kinds(json!({
        "refund.issue": {"steps": [{"name": "refund", "provider": "payments"}], "max_attempts": 4,
                         "attempt_budget_ms": 60_000}
    }));
    let mut system = system;
    system.env.push(("FENCELINE_TEST_STRIPE_AUTHORIZATION", "Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc".into()));
    system.spawn_all(None).await;
    (system, stripe)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stripe_refund_through_the_dialect_is_stripe_mocks_refund_object() {
    let (system, stripe) = refunds_at_stripe_mock(None).await;
    let input = json!({"payment_intent": "pi_3MtwBwLkdIwHu7ix28a3tqPa", "amount": 1500});
    let task = system.submit("acme", "refund.issue", input).await;

    let state = system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(
        state,
        "succeeded",
        "{:?}\nstripe-mock:\n{}\n{}",
        system.state(task).await,
        stripe.log_tail(),
        system.logs()
    );
    let refund = checkpoint(&system, task, "refund").await;
    assert_eq!(refund["object"], "refund", "{refund}");
    assert!(refund["id"].as_str().is_some_and(|id| id.starts_with("re_")), "{refund}");
    assert_eq!(refund["payment_intent"], "pi_3MtwBwLkdIwHu7ix28a3tqPa", "stripe-mock reflects what was sent");
    assert_eq!(refund["amount"], 1500, "{refund}");
    assert_eq!(stripe.requests("POST /v1/refunds"), 1, "one refund request:\n{}", stripe.log_tail());
    assert_eq!(stripe.refusals(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_request_stripe_refuses_ends_the_task_without_success_and_is_not_sent_again() {
    // Stripe knows no refund parameter `flavour`: stripe-mock answers 400 invalid_request_error.
    let form = json!({"payment_intent": "{{ input.payment_intent }}", "flavour": "vanilla"});
    let (system, stripe) = refunds_at_stripe_mock(Some(form)).await;
    let task = system.submit("acme", "refund.issue", json!({"payment_intent": "pi_3MtwBwLkdIwHu7ix28a3tqPa"})).await;

    let state = system.wait_state(task, &["succeeded", "failed", "needs_human", "outcome_unknown"], LONG).await;
    assert_eq!(state, "failed", "{:?}\nstripe-mock:\n{}", system.state(task).await, stripe.log_tail());
    assert_eq!(stripe.refusals().len(), 1, "stripe-mock refused the request:\n{}", stripe.log_tail());
    // Several retry periods later (backoff base 200 ms, cap 2 s): still the one request.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(stripe.requests("POST /v1/refunds"), 1, "never sent again:\n{}", stripe.log_tail());
}
