//! What intake keeps, against a schema of its own: only tasks whose latest status
//! is final and older than the retention lose their rows, children included; a
//! task that never reached the scheduler is listed, never purged; idempotency
//! records go after their own retention.

use std::time::Duration;

use super::*;

/// A new schema holding the bus tables and intake's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

const DAY: Duration = Duration::from_secs(86_400);

/// A task accepted `age_days` ago with a cancellation request and a change mark,
/// and, if `state` is given, its latest status in that state from `age_days` ago.
async fn task(pool: &PgPool, state: Option<&str>, age_days: i32) -> uuid::Uuid {
    let task_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tasks (task_id, tenant, kind, input, priority, labels, source, accepted_at) \
         VALUES ($1, 'acme', 'image.generate', '{}', 'normal', '{}', 'api', now() - make_interval(days => $2))",
    )
    .bind(task_id)
    .bind(age_days)
    .execute(pool)
    .await
    .expect("insert a task");
    sqlx::query("INSERT INTO cancellations (task_id, requested_by) VALUES ($1, 'someone')")
        .bind(task_id)
        .execute(pool)
        .await
        .expect("insert a cancellation");
    sqlx::query("INSERT INTO task_changes (task_id, tenant, changed_at) VALUES ($1, 'acme', now())")
        .bind(task_id)
        .execute(pool)
        .await
        .expect("insert a change mark");
    if let Some(state) = state {
        sqlx::query(
            "INSERT INTO task_view (task_id, tenant, kind, state, attempt, updated_at, version) \
             VALUES ($1, 'acme', 'image.generate', $2, 1, now() - make_interval(days => $3), 3)",
        )
        .bind(task_id)
        .bind(state)
        .bind(age_days)
        .execute(pool)
        .await
        .expect("insert a status");
    }
    task_id
}

async fn ids_in(pool: &PgPool, table: &str) -> Vec<uuid::Uuid> {
    sqlx::query_scalar(&format!("SELECT task_id FROM {table} ORDER BY task_id"))
        .fetch_all(pool)
        .await
        .expect("read the task ids")
}

#[tokio::test]
async fn only_finished_tasks_past_the_retention_lose_their_rows() {
    let pool = fresh_schema().await;
    for state in ["succeeded", "failed", "cancelled"] {
        task(&pool, Some(state), 40).await;
    }
    let mut kept = Vec::new();
    for (state, age) in [
        (Some("running"), 400),
        (Some("outcome_unknown"), 400),
        (Some("needs_human"), 400),
        (Some("succeeded"), 29),
        (None, 400),
    ] {
        kept.push(task(&pool, state, age).await);
    }
    kept.sort();

    assert_eq!(purge_finished_tasks(&pool, 30 * DAY, 2).await.expect("purge"), 3);
    assert_eq!(ids_in(&pool, "tasks").await, kept);
    assert_eq!(ids_in(&pool, "cancellations").await, kept);
    assert_eq!(ids_in(&pool, "task_changes").await, kept);
    assert_eq!(ids_in(&pool, "task_view").await.len(), 4, "the statuses of the tasks kept");
    assert_eq!(purge_finished_tasks(&pool, 30 * DAY, 2).await.expect("purge again"), 0);
}

#[tokio::test]
async fn a_task_that_never_reached_the_scheduler_is_listed_oldest_first() {
    let pool = fresh_schema().await;
    let oldest = task(&pool, None, 3).await;
    let older = task(&pool, None, 2).await;
    let _too_recent = task(&pool, None, 0).await;
    let _scheduled = task(&pool, Some("queued"), 5).await;

    let (listed, count) = unscheduled(&pool, DAY, 10).await.expect("list");
    assert_eq!(listed.iter().map(|u| u.task_id).collect::<Vec<_>>(), [oldest, older]);
    assert_eq!(count, 2);
    let (first_only, count) = unscheduled(&pool, DAY, 1).await.expect("list one");
    assert_eq!((first_only.len(), first_only[0].task_id, count), (1, oldest, 2), "the count is of them all");
}

#[tokio::test]
async fn idempotency_records_go_after_their_own_retention() {
    let pool = fresh_schema().await;
    for (key, age_hours) in [("old", 25), ("older", 100), ("new", 23)] {
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant, namespace, idempotency_key, fingerprint, task_id, created_at) \
             VALUES ('acme', 'api', $1, '\\x00', $2, now() - make_interval(hours => $3))",
        )
        .bind(key)
        .bind(uuid::Uuid::now_v7())
        .bind(age_hours)
        .execute(&pool)
        .await
        .expect("insert a key");
    }
    assert_eq!(purge_idempotency_keys(&pool, 24).await.expect("purge"), 2);
    let left: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM idempotency_keys").fetch_all(&pool).await.expect("keys");
    assert_eq!(left, ["new"]);
}
