//! The reconciler's batch writes against a schema of its own in the test Postgres
//! (`deploy/local/stack test` exports the server's URL): what was heard of grants
//! only ever adds to what is known, a grant not recorded yet keeps its facts until
//! it arrives, and a task's state only moves to a newer version.

use fenceline_domain::vocabulary::{Phase, TaskState};
use fenceline_events::{TaskStatus, Timestamp};
use sqlx::PgPool;

use super::*;

/// A new schema holding the bus tables and the reconciler's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

async fn record_grant(pool: &PgPool, grant_id: GrantId) {
    sqlx::query(
        "INSERT INTO grants (grant_id, task_id, attempt, kind, provider, granted, claim_deadline_us) \
         VALUES ($1, $2, 1, 'image.generate', 'imagegen', '{}', 0)",
    )
    .bind(grant_id.as_uuid())
    .bind(uuid::Uuid::now_v7())
    .execute(pool)
    .await
    .expect("insert a grant");
}

async fn write_facts(pool: &PgPool, facts: Vec<(GrantId, Heard)>) {
    let mut tx = pool.begin().await.expect("begin");
    write_grant_facts(&mut tx, facts).await.expect("write the facts");
    tx.commit().await.expect("commit");
}

/// (claimed, ended) of `grant_id` in `table`, if it has a row there.
async fn facts_in(pool: &PgPool, table: &str, grant_id: GrantId) -> Option<(bool, bool)> {
    sqlx::query_as(&format!("SELECT claimed, ended FROM {table} WHERE grant_id = $1"))
        .bind(grant_id.as_uuid())
        .fetch_optional(pool)
        .await
        .expect("read the facts")
}

#[tokio::test]
async fn facts_heard_of_a_grant_add_up_and_a_grant_not_recorded_yet_keeps_them_aside() {
    let pool = fresh_schema().await;
    let (recorded, early) = (GrantId::from_uuid(uuid::Uuid::now_v7()), GrantId::from_uuid(uuid::Uuid::now_v7()));
    record_grant(&pool, recorded).await;

    write_facts(&pool, vec![(recorded, Heard::CLAIMED), (early, Heard::ENDED)]).await;
    assert_eq!(facts_in(&pool, "grants", recorded).await, Some((true, false)));
    assert_eq!(facts_in(&pool, "early_grant_facts", recorded).await, None, "a recorded grant keeps nothing aside");
    assert_eq!(facts_in(&pool, "early_grant_facts", early).await, Some((false, true)));

    // A later batch that heard only the other fact adds it and forgets nothing.
    write_facts(&pool, vec![(recorded, Heard::ENDED), (early, Heard::CLAIMED)]).await;
    write_facts(&pool, vec![]).await;
    assert_eq!(facts_in(&pool, "grants", recorded).await, Some((true, true)));
    assert_eq!(facts_in(&pool, "early_grant_facts", early).await, Some((true, true)));
    assert_eq!(facts_in(&pool, "grants", early).await, None, "facts make no grant");
}

fn status(task_id: TaskId, state: TaskState, version: i64) -> TaskStatus {
    TaskStatus {
        task_id,
        tenant: "acme".into(),
        kind: "image.generate".into(),
        state,
        reason: None,
        attempt: 1,
        step: None,
        phase: None,
        next_attempt_at: None,
        result: None,
        case_id: None,
        updated_at: Timestamp(version * 1_000),
        version,
    }
}

async fn flush_states(pool: &PgPool, statuses: &[TaskStatus]) {
    let states = TaskStates::default();
    for status in statuses {
        states.0.keep(status.task_id, status.version, || status.clone());
    }
    let mut tx = pool.begin().await.expect("begin");
    states.flush(&mut tx).await.expect("write the states");
    tx.commit().await.expect("commit");
}

async fn state_of(pool: &PgPool, task_id: TaskId) -> (String, i64) {
    sqlx::query_as("SELECT state, version FROM task_states WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .fetch_one(pool)
        .await
        .expect("read the task's state")
}

#[tokio::test]
async fn a_tasks_state_moves_only_to_a_newer_version() {
    let pool = fresh_schema().await;
    let (moved, kept) = (TaskId::from_uuid(uuid::Uuid::now_v7()), TaskId::from_uuid(uuid::Uuid::now_v7()));
    flush_states(&pool, &[status(moved, TaskState::Queued, 1), status(kept, TaskState::Succeeded, 5)]).await;
    flush_states(&pool, &[status(moved, TaskState::Running, 2), status(kept, TaskState::Running, 4)]).await;
    assert_eq!(state_of(&pool, moved).await, ("running".into(), 2));
    assert_eq!(state_of(&pool, kept).await, ("succeeded".into(), 5), "an older snapshot arriving late changes nothing");
}

fn granted(grant_id: GrantId, task_id: TaskId) -> AttemptGranted {
    AttemptGranted {
        grant_id,
        task_id,
        tenant: "acme".into(),
        attempt: 1,
        generation: 0,
        kind: "image.generate".into(),
        input_json: "{}".into(),
        resume_after_step: None,
        provider: "imagegen".into(),
        slot: "imagegen".into(),
        lease_budget_ms: 30_000,
        deadline: None,
        granted_at: Timestamp(1),
    }
}

async fn flush_grants(pool: &PgPool, batch: &BatchWrites) -> Vec<EarlyLoss> {
    let mut tx = pool.begin().await.expect("begin");
    let early = batch.flush_reads(&mut tx, 5_000_000).await.expect("write the grants");
    tx.commit().await.expect("commit");
    early
}

#[tokio::test]
async fn a_batchs_grants_are_recorded_once_each_taking_what_was_heard_before_them() {
    let pool = fresh_schema().await;
    let (early, plain) = (GrantId::from_uuid(uuid::Uuid::now_v7()), GrantId::from_uuid(uuid::Uuid::now_v7()));
    let (early_task, plain_task) = (TaskId::from_uuid(uuid::Uuid::now_v7()), TaskId::from_uuid(uuid::Uuid::now_v7()));
    write_facts(&pool, vec![(early, Heard::CLAIMED)]).await;
    let lost = LostCall {
        task_id: early_task,
        attempt: 1,
        phase: Phase::CallIntent,
        phase_at: 7,
        step: Some("generate".into()),
        provider: Some("imagegen".into()),
        operation_key: Some("key-1".into()),
        request_id: None,
        what: "lost before its grant was heard".into(),
    };
    sqlx::query("INSERT INTO early_losses (task_id, attempt, lost) VALUES ($1, 1, $2)")
        .bind(early_task.as_uuid())
        .bind(serde_json::to_value(&lost).expect("json"))
        .execute(&pool)
        .await
        .expect("an early loss");

    let batch = BatchWrites::default();
    for grant in [granted(early, early_task), granted(plain, plain_task), granted(early, early_task)] {
        batch.grants.heard(&grant, Some("00-trace".into()));
    }
    let opened = flush_grants(&pool, &batch).await;
    assert_eq!(opened.len(), 1, "the loss heard before its grant is handed back to open its case");
    assert_eq!((opened[0].lost.task_id, opened[0].lost.operation_key.as_deref()), (early_task, Some("key-1")));
    // Its case opens outside the loss's event: it joins the task's trace through the grant's.
    assert_eq!(opened[0].traceparent.as_deref(), Some("00-trace"));
    assert_eq!(facts_in(&pool, "grants", early).await, Some((true, false)), "the early claim applies");
    assert_eq!(facts_in(&pool, "grants", plain).await, Some((false, false)));
    assert_eq!(facts_in(&pool, "early_grant_facts", early).await, None, "the grant took its early facts");
    let (grants, losses): (i64, i64) =
        sqlx::query_as("SELECT (SELECT count(*) FROM grants), (SELECT count(*) FROM early_losses)")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!((grants, losses), (2, 0), "a grant heard twice in a batch is one row");

    // Sent again in a later batch, after its end: nothing is inserted or undone.
    write_facts(&pool, vec![(plain, Heard::ENDED)]).await;
    batch.grants.heard(&granted(plain, plain_task), None);
    assert!(flush_grants(&pool, &batch).await.is_empty());
    assert_eq!(facts_in(&pool, "grants", plain).await, Some((false, true)), "a grant sent again changes nothing");
}

fn intent(task_id: TaskId, key: &str, at: i64) -> CallIntentRecorded {
    CallIntentRecorded {
        task_id,
        attempt: 1,
        step: "generate".into(),
        operation_key: key.into(),
        provider: "imagegen".into(),
        recorded_at: Timestamp(at),
    }
}

#[tokio::test]
async fn an_attempts_last_intent_in_a_batch_is_its_call_and_forgets_the_request_id() {
    let pool = fresh_schema().await;
    let task = TaskId::from_uuid(uuid::Uuid::now_v7());
    let call = || async {
        sqlx::query_as::<_, (String, Option<String>, i64)>(
            "SELECT operation_key, provider_request_id, intent_at_us FROM calls WHERE task_id = $1 AND attempt = 1",
        )
        .bind(task.as_uuid())
        .fetch_one(&pool)
        .await
        .expect("the call")
    };
    let batch = BatchWrites::default();
    batch.intents.heard(&intent(task, "key-1", 1));
    batch.intents.heard(&intent(task, "key-2", 2));
    flush_grants(&pool, &batch).await;
    assert_eq!(call().await, ("key-2".into(), None, 2), "the later intent of the batch is the call");

    sqlx::query("UPDATE calls SET provider_request_id = 'req-1' WHERE task_id = $1")
        .bind(task.as_uuid())
        .execute(&pool)
        .await
        .expect("accepted");
    batch.intents.heard(&intent(task, "key-3", 3));
    flush_grants(&pool, &batch).await;
    assert_eq!(call().await, ("key-3".into(), None, 3), "a new intent replaces the call and its request id");
}
