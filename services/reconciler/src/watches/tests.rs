//! The reconciler's batch writes against a schema of its own in the test Postgres
//! (`deploy/local/stack test` exports the server's URL): what was heard of grants
//! only ever adds to what is known, a grant not recorded yet keeps its facts until
//! it arrives, and a task's state only moves to a newer version.

use fenceline_domain::vocabulary::TaskState;
use fenceline_events::TaskStatus;
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
