//! Claims of handed grants against a schema of its own in the test Postgres: the
//! claims asked for while a statement runs are made together by the next, each
//! for its own worker, a grant asked for twice is claimed once, and one that is
//! not ready is not claimed.

use sqlx::PgPool;

use super::{ClaimWriter, HandedClaim};

const LEASE_US: i64 = 15_000_000;

async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

/// An execution of a first attempt of `image.generate` with `status`; its grant and task.
async fn execution(pool: &PgPool, status: &str) -> (uuid::Uuid, uuid::Uuid) {
    let (grant_id, task_id) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    sqlx::query(
        "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, provider, \
         lease_budget_ms, status, fencing_token, lease_expires_at_us, phase, phase_at_us) \
         VALUES ($1, $2, 'acme', 1, 0, 'image.generate', '{}', 'imagegen', 60000, $3, 0, NULL, NULL, NULL)",
    )
    .bind(grant_id)
    .bind(task_id)
    .bind(status)
    .execute(pool)
    .await
    .expect("insert an execution");
    (grant_id, task_id)
}

fn asked(worker: &str, grant_id: uuid::Uuid) -> HandedClaim {
    HandedClaim { worker: worker.to_owned(), grant_id, start: Some("draw".into()), kind: "image.generate".into() }
}

/// (transaction that last wrote it, worker, phase, fencing token) of the execution.
async fn claimed_by(pool: &PgPool, grant_id: uuid::Uuid) -> (String, Option<String>, Option<String>, i64) {
    sqlx::query_as("SELECT xmin::text, worker, phase, fencing_token FROM executions WHERE grant_id = $1")
        .bind(grant_id)
        .fetch_one(pool)
        .await
        .expect("read the execution")
}

#[tokio::test]
async fn claims_asked_for_while_a_statement_runs_are_made_together_each_for_its_own_worker() {
    let pool = fresh_schema().await;
    let claims = ClaimWriter::start(pool.clone(), LEASE_US, 1);

    // The first claim waits on its step's call sequence, which this test holds.
    let (first, first_task) = execution(&pool, "ready").await;
    sqlx::query("INSERT INTO call_sequences (task_id, generation, step) VALUES ($1, 0, 'draw')")
        .bind(first_task)
        .execute(&pool)
        .await
        .expect("a call sequence");
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM call_sequences WHERE task_id = $1 FOR UPDATE")
        .bind(first_task)
        .execute(&mut *holder)
        .await
        .expect("hold it");
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.expect("pid");
    let held = tokio::spawn({
        let claims = claims.clone();
        async move { claims.claim(asked("w-first", first)).await }
    });
    crate::waiting::until(|| crate::waiting::blocked_by(&pool, holder_pid)).await;

    let mut ready = Vec::new();
    for _ in 0..8 {
        ready.push(execution(&pool, "ready").await.0);
    }
    let (ended, _) = execution(&pool, "succeeded").await;
    // Every ready grant once, the first of them twice, and a grant that has ended.
    let asking: Vec<HandedClaim> = (ready.iter().enumerate().map(|(i, &grant)| asked(&format!("w-{i}"), grant)))
        .chain([asked("w-again", ready[0]), asked("w-ended", ended)])
        .collect();
    let handed: Vec<_> = asking
        .into_iter()
        .map(|claim| {
            let claims = claims.clone();
            tokio::spawn(async move { claims.claim(claim).await })
        })
        .collect();
    crate::waiting::until(|| async { claims.waiting() == ready.len() + 2 }).await;
    holder.commit().await.expect("let the first claim go");

    let first_row = held.await.expect("join").expect("claim").expect("the first grant is claimed");
    assert_eq!(first_row.started_seq, Some(0), "its step started, with its call seq");
    let mut answers = Vec::new();
    for claim in handed {
        answers.push(claim.await.expect("join").expect("claim"));
    }
    let (again, ended_answer) = (answers[ready.len()].is_some(), answers[ready.len() + 1].is_some());
    assert!(!ended_answer, "a grant that is not ready is not claimed");
    assert!(answers[0].is_some() && !again, "a grant asked for twice is claimed for its first asker");
    let mut together = std::collections::BTreeSet::new();
    for (i, (grant, answer)) in ready.iter().zip(&answers).enumerate() {
        let (xmin, worker, phase, token) = claimed_by(&pool, *grant).await;
        {
            let row = answer.as_ref().expect("claimed");
            assert_eq!((row.grant_id, row.fencing_token, row.started_seq), (*grant, 1, Some(0)));
            assert_eq!(worker.as_deref(), Some(format!("w-{i}").as_str()), "claimed for its own worker");
        }
        assert_eq!((phase.as_deref(), token), (Some("step_started"), 1));
        together.insert(xmin);
    }
    assert_eq!(together.len(), 1, "the claims asked for meanwhile are one transaction: {together:?}");
    assert_ne!(claimed_by(&pool, first).await.0, together.into_iter().next().expect("one"));
}
