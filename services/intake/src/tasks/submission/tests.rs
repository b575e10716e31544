//! Submitting a task: requests are checked and fingerprinted whatever their
//! spelling; against a schema of its own, the same key twice gives one task, one
//! idempotency record and one `TaskAccepted`, a different request under a used key
//! is refused, and keys of other sources or tenants name other submissions.

use super::*;

fn request(json: &str) -> SubmitTask {
    serde_json::from_str(json).expect("valid request JSON")
}

fn kinds() -> KindCatalog {
    KindCatalog::load(&["image.generate".into()], None).expect("no schemas")
}

#[test]
fn the_same_request_spelled_differently_has_the_same_fingerprint() {
    let a = request(r#"{"kind":"image.generate","input":{"a":1,"b":[1,2]}}"#).validate(&kinds()).expect("valid");
    let b = request(r#"{ "input": {"b":[1,2], "a":1}, "kind":"image.generate", "priority":"normal" }"#)
        .validate(&kinds())
        .expect("valid");
    assert_eq!(a.fingerprint(), b.fingerprint());
    let c = request(r#"{"kind":"image.generate","input":{"a":2,"b":[1,2]}}"#).validate(&kinds()).expect("valid");
    assert_ne!(a.fingerprint(), c.fingerprint());
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let unknown = request(r#"{"kind":"nope","input":{}}"#).validate(&kinds()).expect_err("unknown kind");
    assert!(matches!(unknown, ApiError::UnknownKind(_)));
    let priority =
        request(r#"{"kind":"image.generate","input":{},"priority":"urgent"}"#).validate(&kinds()).expect_err("p");
    assert!(priority.to_string().contains("priority"), "{priority}");
    let window = request(
        r#"{"kind":"image.generate","input":{},"deadline":"2026-01-01T00:00:00Z","not_before":"2026-01-02T00:00:00Z"}"#,
    )
    .validate(&kinds())
    .expect_err("window");
    assert!(window.to_string().contains("deadline"));
    let before_1970 = request(r#"{"kind":"image.generate","input":{},"not_before":"1969-12-31T23:59:59Z"}"#)
        .validate(&kinds())
        .expect_err("before 1970");
    assert!(before_1970.to_string().contains("not_before"), "{before_1970}");
    assert!(serde_json::from_str::<SubmitTask>(r#"{"kind":"x","input":{},"extra":1}"#).is_err());
}

#[test]
fn idempotency_keys_are_bounded_visible_ascii() {
    assert!(IdempotencyKey::parse("order-81723/v1").is_ok());
    for bad in ["", "with space", "ü", &"k".repeat(256)] {
        assert!(IdempotencyKey::parse(bad).is_err(), "{bad}");
    }
}

/// A new schema holding the bus tables and intake's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

fn outbox() -> OutboxWriter {
    OutboxWriter::new(crate::NAME, "test.", 1)
}

fn tenant(name: &str) -> Tenant {
    Tenant::parse(name).expect("a tenant name")
}

fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::parse(text).expect("a key")
}

fn valid(input: serde_json::Value) -> ValidTask {
    ValidTask {
        kind: "image.generate".into(),
        input,
        priority: Priority::High,
        deadline: None,
        not_before: None,
        labels: BTreeMap::from([("order".to_owned(), "81723".to_owned())]),
    }
}

fn created(submitted: Submitted) -> Accepted {
    match submitted {
        Submitted::Created(accepted) => accepted,
        Submitted::Replayed(accepted) => panic!("replayed {accepted:?}, expected a new task"),
    }
}

async fn count(pool: &PgPool, statement: &str) -> i64 {
    sqlx::query_scalar(statement).fetch_one(pool).await.expect("count")
}

#[tokio::test]
async fn the_same_key_twice_gives_one_task_and_replays_its_answer() {
    let pool = fresh_schema().await;
    let (outbox, acme) = (outbox(), tenant("acme"));
    let first =
        submit(&pool, &outbox, &Submission::new(&acme, &key("order-81723"), valid(serde_json::json!({"a": 1})), "api"))
            .await
            .expect("submit");
    let first = created(first);
    assert_eq!(first.status_url, format!("/v1/tasks/{}", first.task_id));
    let again =
        submit(&pool, &outbox, &Submission::new(&acme, &key("order-81723"), valid(serde_json::json!({"a": 1})), "api"))
            .await
            .expect("submit again");
    match again {
        Submitted::Replayed(replayed) => assert_eq!(replayed, first, "the first answer, replayed"),
        Submitted::Created(c) => panic!("a second task {c:?}"),
    }

    let stored: (uuid::Uuid, String, String, serde_json::Value, String, serde_json::Value, String) =
        sqlx::query_as("SELECT task_id, tenant, kind, input, priority, labels, source FROM tasks")
            .fetch_one(&pool)
            .await
            .expect("one task");
    assert_eq!(
        stored,
        (
            first.task_id.as_uuid(),
            "acme".to_owned(),
            "image.generate".to_owned(),
            serde_json::json!({"a": 1}),
            "high".to_owned(),
            serde_json::json!({"order": "81723"}),
            "api".to_owned()
        )
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM idempotency_keys").await, 1);
    let events: Vec<(String, Option<Vec<u8>>)> =
        sqlx::query_as("SELECT event_type, record_key FROM outbox ORDER BY id").fetch_all(&pool).await.expect("outbox");
    assert_eq!(events, [("TaskAccepted".to_owned(), Some(first.task_id.to_string().into_bytes()))]);
    let marked: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT task_id FROM task_changes").fetch_all(&pool).await.expect("changes");
    assert_eq!(marked, [first.task_id.as_uuid()], "the new task is marked changed for the live views");
}

#[tokio::test]
async fn a_used_key_refuses_another_request_and_other_sources_and_tenants_have_keys_of_their_own() {
    let pool = fresh_schema().await;
    let (outbox, acme) = (outbox(), tenant("acme"));
    let first = created(
        submit(&pool, &outbox, &Submission::new(&acme, &key("k"), valid(serde_json::json!({"a": 1})), "api"))
            .await
            .expect("submit"),
    );
    let refused =
        submit(&pool, &outbox, &Submission::new(&acme, &key("k"), valid(serde_json::json!({"a": 2})), "api")).await;
    assert!(matches!(refused, Err(ApiError::IdempotencyKeyReused)), "{refused:?}");

    let from_webhook = created(
        submit(&pool, &outbox, &Submission::new(&acme, &key("k"), valid(serde_json::json!({"a": 1})), "webhook:shop"))
            .await
            .expect("submit from a webhook"),
    );
    let for_globex = created(
        submit(
            &pool,
            &outbox,
            &Submission::new(&tenant("globex"), &key("k"), valid(serde_json::json!({"a": 1})), "api"),
        )
        .await
        .expect("submit for another tenant"),
    );
    let ids = [first.task_id, from_webhook.task_id, for_globex.task_id];
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2], "three submissions: {ids:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM tasks").await, 3);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox WHERE event_type = 'TaskAccepted'").await, 3);
    let sources: Vec<(String, String)> =
        sqlx::query_as("SELECT tenant, namespace FROM idempotency_keys ORDER BY tenant, namespace")
            .fetch_all(&pool)
            .await
            .expect("keys");
    assert_eq!(
        sources,
        [("acme".into(), "api".into()), ("acme".into(), "webhook:shop".into()), ("globex".into(), "api".into())]
    );
}

#[tokio::test]
async fn a_concurrent_submission_with_the_same_key_waits_and_replays() {
    let pool = fresh_schema().await;
    let (outbox, acme) = (outbox(), tenant("acme"));
    let mut first_tx = pool.begin().await.expect("begin");
    let first =
        submit_in(&mut first_tx, &outbox, &acme, &key("k"), valid(serde_json::json!({})), "api").await.expect("submit");
    let first = created(first);
    let second = tokio::spawn({
        let (pool, outbox, acme) = (pool.clone(), outbox.clone(), acme.clone());
        async move { submit(&pool, &outbox, &Submission::new(&acme, &key("k"), valid(serde_json::json!({})), "api")).await }
    });
    // The second blocks on the key until the first commits.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(!second.is_finished(), "the second waits for the first's transaction");
    first_tx.commit().await.expect("commit");
    match second.await.expect("joined").expect("submit") {
        Submitted::Replayed(replayed) => assert_eq!(replayed, first),
        Submitted::Created(c) => panic!("a second task {c:?}"),
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM tasks").await, 1);
}
