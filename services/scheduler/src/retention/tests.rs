//! The scheduler's retention against a schema of its own: only tasks in a final
//! state whose last change is older than the retention go, with their slots and
//! early requests and a tombstone for each on the status topic; tasks still open,
//! waiting for a person, finished recently or held by another transaction stay.

use std::time::Duration;

use sqlx::PgPool;

use super::*;
use crate::test_schema;

const RETENTION: Duration = Duration::from_secs(30 * 86_400);
/// The bus's dedupe window, as configured by default.
const WINDOW: Duration = Duration::from_secs(7 * 86_400);

fn outbox() -> OutboxWriter {
    OutboxWriter::new(crate::NAME, "test.", 1)
}

/// A task in `state` accepted and last changed `age_days` ago, holding a slot at
/// two providers and an early request.
async fn task(pool: &PgPool, state: &str, age_days: i32) -> uuid::Uuid {
    accepted_earlier(pool, state, age_days, age_days).await
}

/// A task in `state` accepted `accepted_days` ago and last changed `age_days` ago,
/// holding a slot at two providers and an early request.
async fn accepted_earlier(pool: &PgPool, state: &str, age_days: i32, accepted_days: i32) -> uuid::Uuid {
    let task_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, lifecycle, state, updated_at, accepted_at) \
         VALUES ($1, 'acme', 'image.generate', '{}', 1, '{}', $2, now() - make_interval(days => $3), \
         now() - make_interval(days => $4))",
    )
    .bind(task_id)
    .bind(state)
    .bind(age_days)
    .bind(accepted_days)
    .execute(pool)
    .await
    .expect("insert a task");
    let grant_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) \
         VALUES ($1, $2, 'imagegen', 'acme', 'image.generate', now_us() + 60000000)",
    )
    .bind(grant_id)
    .bind(task_id)
    .execute(pool)
    .await
    .expect("insert a slot");
    sqlx::query(
        "INSERT INTO other_provider_slots (grant_id, task_id, provider, expires_at_us) \
         VALUES ($1, $2, 'llm', now_us() + 60000000)",
    )
    .bind(grant_id)
    .bind(task_id)
    .execute(pool)
    .await
    .expect("insert another provider's slot");
    sqlx::query("INSERT INTO early_requests (task_id, event_id, value) VALUES ($1, $2, '\\x00')")
        .bind(task_id)
        .bind(uuid::Uuid::now_v7())
        .execute(pool)
        .await
        .expect("insert an early request");
    task_id
}

/// The task ids with a row in `table`, sorted.
async fn task_ids_in(pool: &PgPool, table: &str) -> Vec<uuid::Uuid> {
    sqlx::query_scalar(&format!("SELECT DISTINCT task_id FROM {table} ORDER BY task_id"))
        .fetch_all(pool)
        .await
        .expect("read the task ids")
}

/// The keys of the tombstones in the outbox, with their topic, sorted.
async fn tombstones(pool: &PgPool) -> Vec<(String, String)> {
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT topic, record_key FROM outbox WHERE payload IS NULL AND event_type = 'Tombstone' ORDER BY record_key",
    )
    .fetch_all(pool)
    .await
    .expect("read the tombstones");
    rows.into_iter().map(|(topic, key)| (topic, String::from_utf8(key).expect("a text key"))).collect()
}

fn sorted(mut ids: Vec<uuid::Uuid>) -> Vec<uuid::Uuid> {
    ids.sort();
    ids
}

#[tokio::test]
async fn only_finished_tasks_past_the_retention_go_with_their_rows_and_a_tombstone_each() {
    let db = test_schema::fresh().await;
    let pool = &db.pool;
    let mut gone = Vec::new();
    for state in ["succeeded", "failed", "cancelled"] {
        gone.push(task(pool, state, 40).await);
    }
    let mut kept = Vec::new();
    for state in ["queued", "waiting", "running", "awaiting_approval", "outcome_unknown", "needs_human"] {
        kept.push(task(pool, state, 400).await);
    }
    kept.push(task(pool, "succeeded", 29).await);
    let (gone, kept) = (sorted(gone), sorted(kept));

    // Two per transaction: the purge goes on until a batch comes back short.
    let purged = purge_finished_tasks(pool, &outbox(), RETENTION, WINDOW, 2).await.expect("purge");
    assert_eq!(purged, 3);
    for table in ["tasks", "slots", "other_provider_slots", "early_requests"] {
        assert_eq!(task_ids_in(pool, table).await, kept, "{table} keeps the rows of the tasks kept");
    }
    let status = topics::named("test.", topics::STATUS);
    let expected: Vec<(String, String)> = gone.iter().map(|id| (status.clone(), id.to_string())).collect();
    assert_eq!(tombstones(pool).await, expected, "one tombstone per purged task, keyed by its id");

    assert_eq!(purge_finished_tasks(pool, &outbox(), RETENTION, WINDOW, 2).await.expect("purge again"), 0);
    assert_eq!(tombstones(pool).await.len(), 3, "nothing purged, nothing tombstoned");
}

#[tokio::test]
async fn a_task_another_transaction_holds_is_left_for_the_next_round() {
    let db = test_schema::fresh().await;
    let pool = &db.pool;
    let (held, free) = (task(pool, "succeeded", 40).await, task(pool, "failed", 40).await);
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE")
        .bind(held)
        .execute(&mut *holder)
        .await
        .expect("hold the task");

    assert_eq!(purge_finished_tasks(pool, &outbox(), RETENTION, WINDOW, 10).await.expect("purge"), 1);
    assert_eq!(task_ids_in(pool, "tasks").await, vec![held]);
    assert!(!task_ids_in(pool, "slots").await.contains(&free));

    holder.rollback().await.expect("release the task");
    assert_eq!(purge_finished_tasks(pool, &outbox(), RETENTION, WINDOW, 10).await.expect("purge"), 1);
    assert!(task_ids_in(pool, "tasks").await.is_empty());
}

/// A retention shorter than the dedupe window: a task finished past the retention
/// stays while its acceptance is within the window, where a copy of its
/// `TaskAccepted`, not remembered by its id, must find its row.
#[tokio::test]
async fn a_task_stays_while_its_acceptance_is_within_the_dedupe_window() {
    let db = test_schema::fresh().await;
    let pool = &db.pool;
    let one_day = Duration::from_secs(86_400);
    let recent = accepted_earlier(pool, "succeeded", 2, 3).await;
    let old = accepted_earlier(pool, "succeeded", 2, 10).await;

    assert_eq!(purge_finished_tasks(pool, &outbox(), one_day, WINDOW, 10).await.expect("purge"), 1);
    assert_eq!(task_ids_in(pool, "tasks").await, vec![recent], "{old} went, accepted before the window");
}
