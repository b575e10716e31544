//! The reconciler's retention, against the real Postgres: rows of finished tasks go
//! after the retention, in small batches; open tasks' rows stay however old.

use std::time::Duration;

use fenceline_tests::*;

const DAY_US: i64 = 86_400_000_000;

async fn reconciler_database() -> sqlx::PgPool {
    let url = fresh_database().await;
    let database = fenceline_store::connect(
        &postgres(&url, fenceline_reconciler::NAME),
        fenceline_reconciler::NAME,
        &[&fenceline_bus::MIGRATOR, &fenceline_reconciler::MIGRATOR],
    )
    .await
    .expect("reconciler schema");
    database.pool
}

/// A task in `state`, last changed `age_days` ago, with one grant, call and case.
async fn task(pool: &sqlx::PgPool, state: &str, age_days: i64) -> uuid::Uuid {
    let id = uuid::Uuid::now_v7();
    let updated = fenceline_events::Timestamp::now().0 - age_days * DAY_US;
    sqlx::query(
        "INSERT INTO task_states (task_id, tenant, kind, state, version, updated_at_us) \
         VALUES ($1, 'acme', 'image.generate', $2, 3, $3)",
    )
    .bind(id)
    .bind(state)
    .bind(updated)
    .execute(pool)
    .await
    .expect("status");
    sqlx::query(
        "INSERT INTO grants (grant_id, task_id, attempt, kind, provider, granted, claim_deadline_us) \
         VALUES ($1, $2, 1, 'image.generate', 'img', '{}', 0)",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(id)
    .execute(pool)
    .await
    .expect("grant");
    sqlx::query(
        "INSERT INTO calls (task_id, attempt, step, provider, operation_key, intent_at_us) \
         VALUES ($1, 1, 'render', 'img', 'op', 0)",
    )
    .bind(id)
    .execute(pool)
    .await
    .expect("call");
    sqlx::query(
        "INSERT INTO cases (case_id, task_id, attempt, kind, last_phase, last_phase_at_us, state, ask_until_us) \
         VALUES ($1, $2, 1, 'image.generate', 'intent_recorded', 0, 'decided', 0)",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(id)
    .execute(pool)
    .await
    .expect("case");
    id
}

async fn rows_of(pool: &sqlx::PgPool, id: uuid::Uuid) -> i64 {
    let mut total = 0;
    for table in ["task_states", "grants", "calls", "cases"] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE task_id = $1"))
            .bind(id)
            .fetch_one(pool)
            .await
            .expect("count");
        total += n;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_purges_finished_tasks_past_their_retention_and_keeps_open_ones() {
    let pool = reconciler_database().await;
    let old: Vec<uuid::Uuid> =
        vec![task(&pool, "succeeded", 31).await, task(&pool, "failed", 40).await, task(&pool, "cancelled", 31).await];
    let open_old = task(&pool, "outcome_unknown", 90).await;
    let recent = task(&pool, "succeeded", 2).await;

    let thirty_days = Duration::from_secs(30 * 86_400);
    let purged = fenceline_reconciler::audit::purge_finished(&pool, thirty_days, 2).await.expect("purge");
    assert_eq!(purged, 3, "the three finished over 30 days ago, two at a time");
    for id in old {
        assert_eq!(rows_of(&pool, id).await, 0, "every row of {id} went");
    }
    assert_eq!(rows_of(&pool, open_old).await, 4, "a task waiting for a person is never purged");
    assert_eq!(rows_of(&pool, recent).await, 4);
    assert_eq!(fenceline_reconciler::audit::purge_finished(&pool, thirty_days, 2).await.expect("again"), 0);
}
