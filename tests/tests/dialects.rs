//! Providers described by a dialect rather than speaking Fenceline's protocol, end
//! to end on the real stack: an OpenAI-compatible chat completions API whose
//! completion is the step's result, read by a later step's template, and the same
//! API behind a gateway that answers 504 after the work. The fake provider's
//! ledger judges what was charged.

use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// The chat completions dialect of docs/providers.md; `content` is the template
/// of the one user message.
pub(crate) fn chat_dialect(content: &str) -> Value {
    json!({
        "request": {
            "method": "POST",
            "path": "/v1/chat/completions",
            "body": format!(
                "{{\"model\": {{{{ input.model | tojson }}}}, \"messages\": [{{\"role\": \"user\", \"content\": {content}}}]}}"
            )
        },
        "answer": {
            "request_id": "/id",
            "result": "/choices/0/message",
            "error_type": "/error/type",
            "error_classes": {"insufficient_quota": "not_authorised"}
        },
        "throttling": {"reset_headers": ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"]}
    })
}

/// A system whose providers `llm` (and `editor`) are chat completions APIs
/// reached through the dialect, with a bearer credential from the environment.
async fn chat_system(kinds: Value, providers: &[&str]) -> System {
    let caps: Vec<(&str, Caps)> = providers.iter().map(|name| (*name, Caps::default())).collect();
    let mut system = System::new(&caps).await;
    system.set_provider_field("llm", "dialect", chat_dialect("{{ input.prompt | tojson }}"));
    if providers.contains(&"editor") {
        system.set_provider_field("editor", "dialect", chat_dialect("{{ steps.draft.content | tojson }}"));
    }
    for name in providers {
        system.set_provider_field(name, "auth_header_env", json!("FENCELINE_TEST_CHAT_AUTHORIZATION"));
    }
    system.env.push(("FENCELINE_TEST_CHAT_AUTHORIZATION", "Bearer sk-test-dialects".into()));
    system.set_kinds(kinds);
    system
}

/// The output a step checkpointed, and its sha256.
async fn checkpoint(system: &System, task: TaskId, step: &str) -> (Value, String) {
    sqlx::query_as("SELECT output, sha256 FROM executor.checkpoints WHERE task_id = $1 AND step = $2")
        .bind(task.as_uuid())
        .bind(step)
        .fetch_one(&system.pool)
        .await
        .expect("a checkpoint")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_completion_is_the_steps_result_and_the_next_steps_template_reads_it() {
    let mut system = chat_system(
        json!({
            "chat.reply": {"steps": [{"name": "draft", "provider": "llm"}, {"name": "polish", "provider": "editor"}],
                           "max_attempts": 4, "attempt_budget_ms": 60_000}
        }),
        &["llm", "editor"],
    )
    .await;
    system.spawn_all(None).await;
    let task = system.submit("acme", "chat.reply", json!({"model": "gpt-test", "prompt": "hello"})).await;

    system.wait_state(task, &["succeeded"], LONG).await;
    let (draft, _) = checkpoint(&system, task, "draft").await;
    assert_eq!(draft, json!({"role": "assistant", "content": "You said: hello", "refusal": null}));
    let (polished, sha256) = checkpoint(&system, task, "polish").await;
    assert_eq!(polished["content"], "You said: You said: hello", "the second call was built from the first's result");
    use sha2::Digest;
    let canonical = fenceline_providers::dialect::canonical_json(&polished);
    assert_eq!(sha256, hex::encode(sha2::Sha256::digest(canonical.as_bytes())), "hashed by Fenceline");
    for provider in ["llm", "editor"] {
        let calls = system.provider(provider).calls().await;
        assert_eq!(calls.len(), 1, "{provider}: {calls:?}");
        assert_eq!(calls[0]["operation"], "chat.completions");
        assert_eq!(system.provider(provider).charges().await, 1, "{provider} charged once");
    }
    let sent = &system.provider("editor").calls().await[0]["input"];
    assert_eq!(sent, &json!({"model": "gpt-test", "messages": [{"role": "user", "content": "You said: hello"}]}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_bare_504_after_a_completion_where_no_one_can_ask_is_outcome_unknown_and_charged_once() {
    let system = chat_system(
        json!({
            "chat.reply": {"steps": [{"name": "draft", "provider": "llm"}], "max_attempts": 4,
                           "attempt_budget_ms": 60_000}
        }),
        &["llm"],
    )
    .await;
    system.provider("llm").rule(json!({"status_after_work": 504, "bare": true})).await;
    let mut system = system;
    system.spawn_all(None).await;
    let task = system.submit("acme", "chat.reply", json!({"model": "gpt-test", "prompt": "hello"})).await;

    system.wait_state(task, &["outcome_unknown", "needs_human", "succeeded", "failed"], LONG).await;
    let (state, reason) = system.state(task).await.expect("task");
    assert_eq!(state, "outcome_unknown", "the completion may have been made and billed: {reason:?}");
    // Several retry periods later (backoff base 200 ms, cap 2 s): still one completion.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let llm = system.provider("llm");
    assert_eq!((llm.charges().await, llm.calls().await.len()), (1, 1), "one completion sent and charged");
}
