//! Group commit of submissions, against Postgres: submissions queued while one
//! statement runs are committed by the next in one transaction; a key given twice
//! in it is one task; a statement that fails is retried submission by submission.

use std::collections::BTreeMap;
use std::time::Duration;

use fenceline_domain::vocabulary::Priority;

use super::*;
use crate::tasks::{Accepted, submit_in};

async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

fn outbox() -> OutboxWriter {
    OutboxWriter::new(crate::NAME, "test.", 1)
}

fn acme() -> Tenant {
    Tenant::parse("acme").expect("a tenant name")
}

fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::parse(text).expect("a key")
}

fn task(kind: &str, input: serde_json::Value) -> ValidTask {
    ValidTask {
        kind: kind.into(),
        input,
        priority: Priority::Normal,
        deadline: None,
        not_before: None,
        labels: BTreeMap::new(),
    }
}

/// The writer's next statement waits on the key `held` until the returned
/// transaction ends: the submissions that queue meanwhile are written together after it.
async fn hold_the_writer(
    pool: &PgPool,
    writer: &SubmissionWriter,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, tokio::task::JoinHandle<Result<Submitted, ApiError>>) {
    let mut holding = pool.begin().await.expect("begin");
    submit_in(&mut holding, &outbox(), &acme(), &key("held"), task("image.generate", serde_json::json!({})), "api")
        .await
        .expect("hold the key");
    let blocked = tokio::spawn({
        let writer = writer.clone();
        async move { writer.submit(&acme(), &key("held"), task("image.generate", serde_json::json!({})), "api").await }
    });
    wait_until(|| writer.waiting() == 0).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!blocked.is_finished(), "the writer waits on the held key");
    (holding, blocked)
}

/// Submits each of `submissions` from a task of its own and returns once all are queued.
async fn queue(
    writer: &SubmissionWriter,
    submissions: Vec<(&str, ValidTask)>,
) -> Vec<tokio::task::JoinHandle<Result<Submitted, ApiError>>> {
    let count = submissions.len();
    let answers = submissions
        .into_iter()
        .map(|(text, task)| {
            let (writer, key) = (writer.clone(), key(text));
            tokio::spawn(async move { writer.submit(&acme(), &key, task, "api").await })
        })
        .collect();
    wait_until(|| writer.waiting() == count).await;
    answers
}

async fn wait_until(done: impl Fn() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("not reached within 5 s");
}

async fn answers(
    handles: Vec<tokio::task::JoinHandle<Result<Submitted, ApiError>>>,
) -> Vec<Result<Submitted, ApiError>> {
    let mut answers = Vec::new();
    for handle in handles {
        answers.push(handle.await.expect("joined"));
    }
    answers
}

fn created(submitted: &Result<Submitted, ApiError>) -> Option<&Accepted> {
    match submitted {
        Ok(Submitted::Created(accepted)) => Some(accepted),
        _ => None,
    }
}

/// The distinct transactions that wrote the tasks `ids`.
async fn writing_transactions(pool: &PgPool, ids: &[uuid::Uuid]) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM tasks WHERE task_id = ANY($1)")
        .bind(ids)
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn submissions_queued_while_one_is_written_are_committed_together() {
    let pool = fresh_schema().await;
    let writer = SubmissionWriter::start(pool.clone(), outbox());
    let (holding, blocked) = hold_the_writer(&pool, &writer).await;
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    let queued = queue(
        &writer,
        keys.iter()
            .enumerate()
            .map(|(i, k)| (k.as_str(), task("image.generate", serde_json::json!({ "n": i }))))
            .collect(),
    )
    .await;
    holding.commit().await.expect("commit");
    assert!(matches!(blocked.await.expect("joined"), Ok(Submitted::Replayed(_))), "the held key replays");

    let answers = answers(queued).await;
    let ids: Vec<uuid::Uuid> = answers.iter().filter_map(created).map(|a| a.task_id.as_uuid()).collect();
    assert_eq!(ids.len(), 20, "every submission created its task: {answers:?}");
    assert_eq!(writing_transactions(&pool, &ids).await, 1, "one transaction wrote all twenty");
    let (events, keys, marks): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox WHERE event_type = 'TaskAccepted' AND xmin = t.xmin), \
                (SELECT count(*) FROM idempotency_keys WHERE task_id = ANY($1)), \
                (SELECT count(*) FROM task_changes WHERE task_id = ANY($1)) \
         FROM tasks t WHERE t.task_id = $2",
    )
    .bind(&ids)
    .bind(ids[0])
    .fetch_one(&pool)
    .await
    .expect("counts");
    assert_eq!((events, keys, marks), (20, 20, 20), "each task's event, key and change mark, in the same commit");
}

#[tokio::test]
async fn a_key_given_twice_in_one_statement_is_one_task_replayed_or_refused() {
    let pool = fresh_schema().await;
    let writer = SubmissionWriter::start(pool.clone(), outbox());
    let (holding, blocked) = hold_the_writer(&pool, &writer).await;
    let same = || task("image.generate", serde_json::json!({ "a": 1 }));
    let queued = queue(
        &writer,
        vec![
            ("twice", same()),
            ("twice", same()),
            ("reused", same()),
            ("reused", task("image.generate", serde_json::json!({ "a": 2 }))),
        ],
    )
    .await;
    holding.commit().await.expect("commit");
    blocked.await.expect("joined").expect("the held key");

    let answers = answers(queued).await;
    let (twice, reused) = answers.split_at(2);
    let first = twice.iter().find_map(created).expect("one of the two created the task");
    let replayed: Vec<&Accepted> = twice
        .iter()
        .filter_map(|a| match a {
            Ok(Submitted::Replayed(accepted)) => Some(accepted),
            _ => None,
        })
        .collect();
    assert_eq!(replayed, [first], "the other replays the same task: {twice:?}");
    assert_eq!(reused.iter().filter_map(created).count(), 1, "{reused:?}");
    assert_eq!(
        reused.iter().filter(|a| matches!(a, Err(ApiError::IdempotencyKeyReused))).count(),
        1,
        "the other request under the same key is refused: {reused:?}"
    );
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM tasks").fetch_one(&pool).await.expect("count");
    assert_eq!(tasks, 3, "held, twice and reused: one task each");
}

#[tokio::test]
async fn a_statement_that_fails_is_retried_one_submission_at_a_time() {
    let pool = fresh_schema().await;
    // A kind the schema refuses fails whatever statement carries it.
    sqlx::query("ALTER TABLE tasks ADD CONSTRAINT refuses_poison CHECK (kind <> 'poison')")
        .execute(&pool)
        .await
        .expect("constraint");
    let writer = SubmissionWriter::start(pool.clone(), outbox());
    let (holding, blocked) = hold_the_writer(&pool, &writer).await;
    let queued = queue(
        &writer,
        vec![
            ("before", task("image.generate", serde_json::json!({}))),
            ("poisoned", task("poison", serde_json::json!({}))),
            ("after", task("image.generate", serde_json::json!({}))),
        ],
    )
    .await;
    holding.commit().await.expect("commit");
    blocked.await.expect("joined").expect("the held key");

    let answers = answers(queued).await;
    assert!(created(&answers[0]).is_some() && created(&answers[2]).is_some(), "{answers:?}");
    assert!(matches!(answers[1], Err(ApiError::Internal(_))), "{:?}", answers[1]);
    let ids = [&answers[0], &answers[2]].map(|a| created(a).expect("created").task_id.as_uuid());
    assert_eq!(writing_transactions(&pool, &ids).await, 2, "written alone, each");
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'poisoned'")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(keys, 0, "the refused submission left no key behind");
}
