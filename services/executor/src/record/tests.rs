//! The fenced writes against a schema of its own in the test Postgres
//! (`deploy/local/stack test` exports the server's URL): a worker whose fencing
//! token is stale writes nothing, neither its phase nor its events nor a renewal,
//! and the worker holding the current token writes all of them.

use fenceline_domain::ids::{GrantId, TaskId};

use super::*;
use crate::lease::renew;

/// A new schema holding the bus tables and the executor's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

/// A lease of 15 s.
const LEASE_MS: u64 = 15_000;

fn recorder(pool: PgPool) -> Recorder {
    Recorder::new(
        pool,
        OutboxWriter::new("executor", "test.", 1),
        Arc::new(ExecutorSettings {
            workers: 1,
            lease_ms: LEASE_MS,
            idle_poll_ms: 250,
            poll_ms: 250,
            task_retention_days: 30,
        }),
    )
}

/// An execution claimed twice: its fencing token is 2, its phase `claimed`.
async fn claimed_twice(pool: &PgPool) -> (GrantId, TaskId) {
    let (grant_id, task_id) = (GrantId::from_uuid(uuid::Uuid::now_v7()), TaskId::from_uuid(uuid::Uuid::now_v7()));
    sqlx::query(
        "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, provider, \
         lease_budget_ms, status, fencing_token, worker, lease_expires_at_us, phase, phase_at_us) \
         VALUES ($1, $2, 'acme', 1, 0, 'image.generate', '{}', 'imagegen', 60000, 'running', 2, 'second', \
         now_us() + 15000000, 'claimed', 0)",
    )
    .bind(grant_id.as_uuid())
    .bind(task_id.as_uuid())
    .execute(pool)
    .await
    .expect("insert an execution");
    (grant_id, task_id)
}

fn lease(grant_id: GrantId, task_id: TaskId, token: i64) -> Lease {
    let now = Instant::now();
    Lease::taken(
        grant_id,
        task_id,
        1,
        0,
        token,
        Phase::Claimed,
        now + Duration::from_millis(LEASE_MS),
        now + Duration::from_secs(10),
    )
}

/// (fencing token, phase, status, step) of the execution, and the outbox's rows.
async fn written(pool: &PgPool, grant_id: GrantId) -> ((i64, String, String, Option<String>), i64) {
    let execution = sqlx::query_as("SELECT fencing_token, phase, status, step FROM executions WHERE grant_id = $1")
        .bind(grant_id.as_uuid())
        .fetch_one(pool)
        .await
        .expect("read the execution");
    let events = sqlx::query_scalar("SELECT count(*) FROM outbox").fetch_one(pool).await.expect("count the outbox");
    (execution, events)
}

#[tokio::test]
async fn a_write_with_a_stale_fencing_token_changes_nothing_and_the_current_one_writes() {
    let pool = fresh_schema().await;
    let recorder = recorder(pool.clone());
    let (grant_id, task_id) = claimed_twice(&pool).await;
    let before = ((2, "claimed".to_owned(), "running".to_owned(), None), 0);

    let mut stale = lease(grant_id, task_id, 1);
    let event = released(&stale, ReleaseReason::Busy);
    let refused = recorder.record(&mut stale, Transition::to(Phase::StepStarted).step("render"), &[event]).await;
    assert!(matches!(refused, Err(Stop::Fenced)), "{refused:?}");
    assert_eq!(stale.phase, Phase::Claimed, "a refused write moves no phase");
    assert_eq!(written(&pool, grant_id).await, before, "nor the execution, nor the outbox");

    let mut current = lease(grant_id, task_id, 2);
    let event = released(&current, ReleaseReason::Busy);
    recorder
        .record(&mut current, Transition::to(Phase::StepStarted).step("render"), &[event])
        .await
        .expect("the current token writes");
    assert_eq!(current.phase, Phase::StepStarted);
    assert_eq!(
        written(&pool, grant_id).await,
        ((2, "step_started".into(), "running".into(), Some("render".into())), 1)
    );
}

#[tokio::test]
async fn a_renewal_with_a_stale_fencing_token_is_refused_and_fences_the_worker() {
    let pool = fresh_schema().await;
    let (grant_id, task_id) = claimed_twice(&pool).await;
    let expiry = || async {
        let expiry: i64 = sqlx::query_scalar("SELECT lease_expires_at_us FROM executions WHERE grant_id = $1")
            .bind(grant_id.as_uuid())
            .fetch_one(&pool)
            .await
            .expect("read the lease");
        expiry
    };
    let granted = expiry().await;

    let stale = lease(grant_id, task_id, 1);
    assert!(!renew(&pool, LEASE_MS, &stale).await.expect("renew"), "a stale token renews nothing");
    assert!(stale.fenced(), "and learns that another worker holds the execution");
    assert_eq!(expiry().await, granted);

    let current = lease(grant_id, task_id, 2);
    assert!(renew(&pool, LEASE_MS, &current).await.expect("renew"));
    assert!(!current.fenced());
    assert!(expiry().await > granted, "the current token's renewal moves the lease");
}
