//! The dialects Fenceline ships in `deploy/dialects`, each end to end on the real
//! stack as a user copies it, against the fake provider speaking that vendor's API
//! (its credential header, its required fields, its answers and errors): the
//! answer kept as the step's result, and the faults that set the vendors apart.
//! The fake provider's ledger judges what was charged.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, Stop, System};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);
const FINAL: [&str; 5] = ["succeeded", "failed", "outcome_unknown", "needs_human", "cancelled"];

/// A shipped catalogue entry, as a user copies it.
fn shipped(file: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/dialects").join(file);
    serde_json::from_slice(&std::fs::read(&path).expect("a shipped dialect")).expect("JSON")
}

/// A system whose provider `name` is the shipped entry `file`, pointed at a fake
/// provider (at `path_prefix` under it: Twilio's account lives in its base URL),
/// with the credential the entry's variable names, and one kind `kind` of one
/// step calling it.
async fn vendor_system(file: &str, name: &str, caps: Caps, path_prefix: &str, credential: &str) -> System {
    let mut system = System::new(&[(name, caps)]).await;
    let entry = shipped(file);
    let base = format!("{}{path_prefix}", system.provider(name).base);
    for (field, value) in entry.as_object().expect("an entry") {
        let value = if field == "base_url" { json!(base) } else { value.clone() };
        system.set_provider_field(name, field, value);
    }
    let variable: &'static str = entry["auth_header_env"].as_str().expect("a credential variable").to_owned().leak();
    system.env.push((variable, credential.to_owned()));
    system.set_kinds(json!({
        "vendor.call": {"steps": [{"name": "call", "provider": name}], "max_attempts": 4, "attempt_budget_ms": 120_000}
    }));
    system
}

/// The output the step checkpointed.
async fn result(system: &System, task: TaskId) -> Value {
    sqlx::query_scalar("SELECT output FROM executor.checkpoints WHERE task_id = $1 AND step = 'call'")
        .bind(task.as_uuid())
        .fetch_one(&system.pool)
        .await
        .expect("a checkpoint")
}

async fn ends(system: &System, task: TaskId) -> String {
    system.wait_state(task, &FINAL, LONG).await
}

/// Calls and charges at the fake provider, once a few retry periods have passed
/// (backoff base 200 ms, cap 2 s) so that a second call would have been made.
async fn settled(system: &System, name: &str) -> (usize, usize) {
    tokio::time::sleep(Duration::from_secs(4)).await;
    let provider = system.provider(name);
    (provider.calls().await.len(), provider.charges().await)
}

fn anthropic_input() -> Value {
    json!({"model": "claude-test", "max_tokens": 256, "messages": [{"role": "user", "content": "hello"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_a_message_is_the_result_and_an_overload_is_waited_out_then_paid_once() {
    let mut system = vendor_system("anthropic-messages.json", "anthropic", Caps::default(), "", "sk-ant-test").await;
    system.provider("anthropic").rule(json!({"status": 529, "retry_after_s": 1, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", anthropic_input()).await;

    assert_eq!(ends(&system, task).await, "succeeded", "{:?}", system.state(task).await);
    assert_eq!(result(&system, task).await, json!([{"type": "text", "text": "You said: hello"}]));
    let calls = system.provider("anthropic").calls().await;
    let outcomes: Vec<&str> = calls.iter().map(|c| c["outcome"].as_str().unwrap_or_default()).collect();
    assert_eq!(outcomes, ["status:529", "succeeded"], "the overload, declared safe, was sent again");
    assert_eq!(settled(&system, "anthropic").await, (2, 1), "one message paid");
}

fn prediction_input() -> Value {
    json!({"version": "5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa",
           "input": {"prompt": "a lamp"}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicate_a_prediction_is_followed_through_failing_polls_to_its_output() {
    let caps = Caps { async_results: true, ..Caps::default() };
    let mut system = vendor_system("replicate-predictions.json", "replicate", caps, "", "Bearer r8_test").await;
    system.provider("replicate").rule(json!({"on": "poll", "status": 503, "times": 2})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", prediction_input()).await;

    assert_eq!(ends(&system, task).await, "succeeded", "{:?}", system.state(task).await);
    let calls = system.provider("replicate").calls().await;
    let id = calls[0]["request_id"].as_str().expect("the prediction's id");
    let output = result(&system, task).await;
    let urls = output.as_array().expect("a list of output URLs");
    assert!(urls.len() == 1 && urls[0].as_str().is_some_and(|u| u.ends_with(&format!("/artifacts/{id}"))), "{output}");
    assert_eq!(calls[0]["input"], prediction_input(), "the body the vendor documents");
    assert_eq!(settled(&system, "replicate").await, (1, 1), "one prediction, followed, never made again");
}

fn refund_input() -> Value {
    json!({"payment_intent": "pi_1GszsK2eZvKYlo2CfhZyoZLp", "amount": 1500})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_a_refund_whose_answer_a_gateway_lost_is_sent_again_with_its_key_and_paid_once() {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = vendor_system("stripe-refunds.json", "stripe", caps, "", "Bearer sk_test_fenceline").await;
    system.provider("stripe").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", refund_input()).await;

    assert_eq!(ends(&system, task).await, "succeeded", "{:?}", system.state(task).await);
    let refund = result(&system, task).await;
    assert_eq!((refund["object"].as_str(), refund["amount"].as_u64()), (Some("refund"), Some(1500)));
    let calls = system.provider("stripe").calls().await;
    let outcomes: Vec<&str> = calls.iter().map(|c| c["outcome"].as_str().unwrap_or_default()).collect();
    assert_eq!(outcomes, ["status_after_work:504", "replayed"]);
    assert_eq!(calls[0]["operation_key"], calls[1]["operation_key"], "the same Idempotency-Key");
    assert_eq!(calls[0]["input"], json!({"payment_intent": "pi_1GszsK2eZvKYlo2CfhZyoZLp", "amount": "1500"}));
    assert_eq!(settled(&system, "stripe").await, (2, 1), "one refund");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_a_key_past_the_providers_memory_is_never_sent_again_and_a_person_decides() {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = vendor_system("stripe-refunds.json", "stripe", caps, "", "Bearer sk_test_fenceline").await;
    // Stripe remembers a key for 24 h; here for 6 s, and the first answer, lost by a
    // gateway, comes after 7 s: by then Stripe may have forgotten the key.
    let mut dialect = shipped("stripe-refunds.json")["dialect"].clone();
    dialect["idempotency_ttl_hours"] = json!(6.0 / 3_600.0);
    system.set_provider_field("stripe", "dialect", dialect);
    let stripe = system.provider("stripe");
    stripe.rule(json!({"status_after_work": 504, "bare": true, "latency_ms": 7_000, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", refund_input()).await;
    let deadline = tokio::time::Instant::now() + LONG;
    while system.provider("stripe").calls().await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the refund was never sent");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    system.provider("stripe").forget_keys().await;

    assert_eq!(ends(&system, task).await, "outcome_unknown", "{:?}", system.state(task).await);
    assert_eq!(settled(&system, "stripe").await, (1, 1), "the key was not sent again");
    let findings = system.case_findings(task).await;
    assert!(findings.iter().any(|f| f.contains("remembers an operation key for 6 s")), "{findings:#?}");

    // A person who acknowledges a second charge sends a new operation, under a new key.
    system.a_person_retries_as_new(task).await;
    assert_eq!(system.wait_state(task, &FINAL, LONG).await, "succeeded");
    let calls = system.provider("stripe").calls().await;
    assert_eq!(calls.len(), 2, "{calls:#?}");
    assert_ne!(calls[0]["operation_key"], calls[1]["operation_key"], "a new key, not the forgotten one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_a_resend_while_the_first_request_runs_is_answered_409_and_waited_for_not_failed() {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = vendor_system("stripe-refunds.json", "stripe", caps, "", "Bearer sk_test_fenceline").await;
    // The first request outlives the call timeout; resends meet it still running.
    system.set_provider_field("stripe", "call_timeout_ms", json!(1_500));
    let stripe = system.provider("stripe");
    stripe.rule(json!({"conflict_while_running": true})).await;
    stripe.rule(json!({"latency_ms": 15_000, "times": 1})).await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", refund_input()).await;

    assert_eq!(ends(&system, task).await, "succeeded", "{:?}", system.state(task).await);
    let calls = system.provider("stripe").calls().await;
    let outcomes: Vec<&str> = calls.iter().map(|c| c["outcome"].as_str().unwrap_or_default()).collect();
    assert!(outcomes.contains(&"conflict"), "a resend met the running request: {outcomes:?}");
    assert_eq!(outcomes.last(), Some(&"replayed"), "{outcomes:?}");
    assert_eq!(system.provider("stripe").charges().await, 1, "one refund");
}

fn message_input(to: &str) -> Value {
    json!({"to": to, "from": "+15017122661", "body": "Your refund of $15.00 is on its way"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twilio_a_message_is_a_form_and_a_lost_answer_is_outcome_unknown_and_paid_once() {
    let account = "/2010-04-01/Accounts/AC00000000000000000000000000000000";
    let mut system =
        vendor_system("twilio-messages.json", "twilio", Caps::default(), account, "Basic QUMwMDA6dG9rZW4=").await;
    system.spawn_all(None).await;
    let sent = system.submit("acme", "vendor.call", message_input("+15558675310")).await;
    assert_eq!(ends(&system, sent).await, "succeeded", "{:?}", system.state(sent).await);
    let receipt = result(&system, sent).await;
    assert_eq!((receipt["status"].as_str(), receipt["to"].as_str()), (Some("queued"), Some("+15558675310")));
    let calls = system.provider("twilio").calls().await;
    assert_eq!(
        calls[0]["input"],
        json!({"To": "+15558675310", "From": "+15017122661", "Body": "Your refund of $15.00 is on its way"})
    );

    system.provider("twilio").rule(json!({"drop_after_accept": true})).await;
    let lost = system.submit("acme", "vendor.call", message_input("+15558675311")).await;
    assert_eq!(ends(&system, lost).await, "outcome_unknown", "the text may have gone out");
    assert_eq!(settled(&system, "twilio").await, (2, 2), "one text each, none sent twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twilio_a_number_the_vendor_refuses_fails_the_task_and_costs_nothing() {
    let account = "/2010-04-01/Accounts/AC00000000000000000000000000000000";
    let mut system =
        vendor_system("twilio-messages.json", "twilio", Caps::default(), account, "Basic QUMwMDA6dG9rZW4=").await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "vendor.call", message_input("5551234")).await;

    assert_eq!(ends(&system, task).await, "failed", "error 21211 is the vendor's refusal");
    let (_, reason) = system.state(task).await.expect("the task");
    assert!(reason.as_deref().is_some_and(|r| r.contains("rejected")), "{reason:?}");
    assert_eq!(settled(&system, "twilio").await, (1, 0), "refused, not sent again, not charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_cannot_fill_the_vendors_request_is_refused_at_submission_and_nothing_is_sent() {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = vendor_system("stripe-refunds.json", "stripe", caps, "", "Bearer sk_test_fenceline").await;
    system.env.push(("FENCELINE_INTAKE_KINDS", "vendor.call".into()));
    system.spawn("intake", "intake", &[]).await;
    system.spawn_all(None).await;
    let token = system.token("acme").await;
    let submit = |input: Value| {
        let url = format!("{}/v1/tasks", system.url_of("intake"));
        let key = uuid::Uuid::now_v7().to_string();
        let token = token.clone();
        async move {
            fenceline_tests::system::http_with(
                "POST",
                url,
                &[("Authorization", &format!("Bearer {token}")), ("Idempotency-Key", &key)],
                Some(json!({"kind": "vendor.call", "input": input})),
            )
            .await
            .expect("intake answers")
        }
    };

    let (status, problem) = submit(json!({"payment_intent": "pi_1GszsK2eZvKYlo2CfhZyoZLp"})).await;
    assert_eq!((status, problem["type"].as_str()), (422, Some("/problems/input-invalid")), "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("input.amount: required") && detail.contains("request.form.amount"), "{problem}");
    let (status, problem) = submit(json!({"payment_intent": {"id": "pi_1"}, "amount": 1500})).await;
    assert_eq!(status, 422, "an object cannot be a form field: {problem}");
    let (status, accepted) = submit(refund_input()).await;
    assert_eq!(status, 202, "{accepted}");
    let task: TaskId = accepted["task_id"].as_str().and_then(|id| id.parse().ok()).expect("a task id");
    assert_eq!(ends(&system, task).await, "succeeded");
    assert_eq!(settled(&system, "stripe").await, (1, 1), "only the task that could be built was sent");
}

/// One fault the fake provider is told to make once, and what it must come to at
/// a provider of each kind: the task's final state and the charges it made.
struct Fault {
    name: &'static str,
    rule: Value,
    /// At a provider that dedupes by key.
    dedupes: (&'static str, usize),
    /// At one that neither dedupes nor can be asked.
    neither: (&'static str, usize),
}

/// The misbehaviours every dialect is run through: a throttle with the vendor's
/// headers, a 5xx before any work, the answer lost after the work, a gateway's
/// 504 after the work.
fn faults() -> Vec<Fault> {
    vec![
        Fault {
            name: "throttled",
            rule: json!({"status": 429, "retry_after_s": 1, "times": 1}),
            dedupes: ("succeeded", 1),
            neither: ("succeeded", 1),
        },
        Fault {
            name: "a 5xx before any work",
            rule: json!({"status": 500, "times": 1}),
            dedupes: ("succeeded", 1),
            neither: ("outcome_unknown", 0),
        },
        Fault {
            name: "the answer lost after the work",
            rule: json!({"drop_after_accept": true, "times": 1}),
            dedupes: ("succeeded", 1),
            neither: ("outcome_unknown", 1),
        },
        Fault {
            name: "a gateway's 504 after the work",
            rule: json!({"status_after_work": 504, "bare": true, "times": 1}),
            dedupes: ("succeeded", 1),
            neither: ("outcome_unknown", 1),
        },
    ]
}

/// Runs every fault, one task each, through the shipped entry `file` as it is,
/// then loses the worker after the provider answered, and checks each task's end
/// and charges, then that nothing more was charged once the retry periods passed.
async fn every_fault_through(file: &str, name: &str, caps: Caps, prefix: &str, credential: &str, input: Value) {
    let mut system = vendor_system(file, name, caps, prefix, credential).await;
    system.spawn_all(None).await;
    let mut expected_charges = 0;
    for fault in faults() {
        system.provider(name).rule(fault.rule.clone()).await;
        let before = system.provider(name).charges().await;
        let task = system.submit("acme", "vendor.call", input.clone()).await;
        let (state, charges) = if caps.idempotency_keys { fault.dedupes } else { fault.neither };
        assert_eq!(ends(&system, task).await, state, "{file}, {}: {:?}", fault.name, system.state(task).await);
        let charged = system.provider(name).charges().await - before;
        assert_eq!(charged, charges, "{file}, {}: charges", fault.name);
        expected_charges += charges;
        system.provider(name).reset_rules().await;
    }
    // The recovery table: the worker is lost once the provider answered (the work
    // done and charged). A provider that dedupes is sent the same key again; at one
    // that can neither dedupe nor be asked, a person decides.
    system.stop("executor", Stop::Term).await;
    let crash = [("FAILPOINTS", "executor.after_provider_answer=return(crash)".to_owned())];
    system.spawn_to_crash("executor", "executor", &crash).await;
    let before = system.provider(name).charges().await;
    let task = system.submit("acme", "vendor.call", input.clone()).await;
    assert!(system.service("executor").wait_exit(LONG).await.is_some(), "{file}: the worker was not lost");
    system.spawn("executor", "executor", &[]).await;
    let state = if caps.idempotency_keys { "succeeded" } else { "outcome_unknown" };
    assert_eq!(ends(&system, task).await, state, "{file}, the worker lost: {:?}", system.state(task).await);
    assert_eq!(system.provider(name).charges().await - before, 1, "{file}, the worker lost: charges");
    expected_charges += 1;
    assert_eq!(settled(&system, name).await.1, expected_charges, "{file}: nothing charged after the ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_through_the_openai_chat_entry() {
    let input = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hello"}]});
    every_fault_through("openai-chat.json", "openai", Caps::default(), "", "Bearer sk-test", input).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_through_the_anthropic_messages_entry() {
    every_fault_through("anthropic-messages.json", "anthropic", Caps::default(), "", "sk-ant-test", anthropic_input())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_through_the_replicate_predictions_entry() {
    let caps = Caps { async_results: true, ..Caps::default() };
    every_fault_through("replicate-predictions.json", "replicate", caps, "", "Bearer r8_test", prediction_input())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_through_the_stripe_refunds_entry() {
    let caps = Caps { idempotency_keys: true, ..Caps::default() };
    every_fault_through("stripe-refunds.json", "stripe", caps, "", "Bearer sk_test_fenceline", refund_input()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_through_the_twilio_messages_entry() {
    let account = "/2010-04-01/Accounts/AC00000000000000000000000000000000";
    let input = message_input("+15558675310");
    every_fault_through("twilio-messages.json", "twilio", Caps::default(), account, "Basic QUMwMDA6dG9rZW4=", input)
        .await;
}
