//! The executor's one consumer group against a schema of its own: a batch of grants
//! and final states is one transaction that writes both, and the migration that made
//! the group carries over what the two groups it replaced had got to.

use std::sync::Arc;
use std::time::Duration;

use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::TaskState;
use fenceline_events::{TaskStatus, Timestamp};
use sqlx::PgPool;

use super::*;
use crate::grants::{Handed, Next};
use crate::testing::{granted, on};

/// The version of the migration that made `executor.from_scheduler` one group.
const ONE_GROUP: i64 = 107;

fn status(task_id: TaskId, state: TaskState, version: i64) -> Event {
    Event::TaskStatus(TaskStatus {
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
        updated_at: Timestamp(version),
        version,
    })
}

/// Every grant handed to the workers, in order.
fn handed_ids(handed: &Handed) -> Vec<uuid::Uuid> {
    let mut grants = Vec::new();
    loop {
        match handed.next(Duration::from_secs(3_600)) {
            Next::Claim(grant) => grants.push(grant.grant_id),
            Next::Walk => {}
            Next::Rest => return grants,
        }
    }
}

#[tokio::test]
async fn a_batch_of_grants_and_states_records_the_grants_and_keeps_only_final_states_in_one_commit() {
    let pool: PgPool =
        fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool;
    let handed = Arc::new(Handed::default());
    let consumer = FromScheduler {
        grants: GrantRecorder::new(Arc::new(tokio::sync::Notify::new()), handed.clone(), 8),
        finals: StatusProjection::default(),
    };
    let (running, done, grant) = (TaskId::new_v7(), TaskId::new_v7(), GrantId::new_v7());
    let outbox = OutboxWriter::new("executor", "test.", 1);
    let mut tx = pool.begin().await.expect("begin");
    for record in [
        on(topics::DISPATCH, granted(grant, running, "{}")),
        on(topics::STATUS, status(running, TaskState::Running, 2)),
        on(topics::STATUS, status(done, TaskState::Running, 3)),
        on(topics::STATUS, status(done, TaskState::Succeeded, 4)),
    ] {
        consumer.handle(&mut tx, &outbox, &record).await.expect("handle");
    }
    let misplaced =
        consumer.handle(&mut tx, &outbox, &on(topics::STATUS, granted(GrantId::new_v7(), done, "{}"))).await;
    assert!(matches!(misplaced, Err(HandleError::Poison(_))), "a grant on the status topic: {misplaced:?}");
    let misplaced = consumer.handle(&mut tx, &outbox, &on(topics::DISPATCH, status(done, TaskState::Failed, 5))).await;
    assert!(matches!(misplaced, Err(HandleError::Poison(_))), "a snapshot on the dispatch topic: {misplaced:?}");
    consumer.flush(&mut tx, &outbox).await.expect("flush");
    assert_eq!(handed_ids(&handed), Vec::<uuid::Uuid>::new(), "no grant is handed before its batch commits");
    tx.commit().await.expect("commit");
    consumer.committed();

    let executions: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT task_id FROM executions").fetch_all(&pool).await.expect("executions");
    assert_eq!(executions, [running.as_uuid()], "the grant recorded");
    let states: Vec<(uuid::Uuid, String, i64)> =
        sqlx::query_as("SELECT task_id, state, version FROM task_states").fetch_all(&pool).await.expect("task_states");
    assert_eq!(states, [(done.as_uuid(), "succeeded".to_owned(), 4)], "only the final state kept");
    assert_eq!(handed_ids(&handed), [grant.as_uuid()], "the grant handed to the workers once its batch committed");
}

#[tokio::test]
async fn the_one_group_starts_where_the_two_had_got_to_and_remembers_what_they_remembered() {
    let before = fenceline_store::migrations_where(&crate::MIGRATOR, |version| version < ONE_GROUP);
    let db = fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &before]).await;
    let pool = &db.pool;
    sqlx::query(
        "INSERT INTO consumer_partitions (consumer_group, topic, partition, epoch, next_offset, owner) VALUES \
         ('p1.executor.grants', 'p1.fenceline.dispatch', 0, 3, 40, 'a'), \
         ('p1.executor.grants', 'p1.fenceline.dispatch', 1, 2, NULL, 'a'), \
         ('p1.executor.status', 'p1.fenceline.status', 2, 5, 17, 'b'), \
         ('p2.executor.grants', 'p2.fenceline.dispatch', 0, 1, 9, 'c')",
    )
    .execute(pool)
    .await
    .expect("the two groups' progress, and another prefix's");
    let (cancellation, elsewhere) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    sqlx::query(
        "INSERT INTO processed_events (consumer_group, event_id) VALUES \
         ('p1.executor.grants', $1), ('p1.reconciler.watches', $2)",
    )
    .bind(cancellation)
    .bind(elsewhere)
    .execute(pool)
    .await
    .expect("the event ids remembered");

    fenceline_store::migrations_where(&crate::MIGRATOR, |version| version >= ONE_GROUP)
        .run(pool)
        .await
        .expect("the migration");

    let progress: Vec<(String, String, i32, Option<i64>)> = sqlx::query_as(
        "SELECT consumer_group, topic, partition, next_offset FROM consumer_partitions \
         WHERE consumer_group LIKE '%from_scheduler' ORDER BY 1, 2, 3",
    )
    .fetch_all(pool)
    .await
    .expect("consumer_partitions");
    let row = |group: &str, topic: &str, partition, next| (group.to_owned(), topic.to_owned(), partition, next);
    assert_eq!(
        progress,
        [
            row("p1.executor.from_scheduler", "p1.fenceline.dispatch", 0, Some(40)),
            row("p1.executor.from_scheduler", "p1.fenceline.dispatch", 1, None),
            row("p1.executor.from_scheduler", "p1.fenceline.status", 2, Some(17)),
            row("p2.executor.from_scheduler", "p2.fenceline.dispatch", 0, Some(9)),
        ],
        "each partition where its old group had got to, under its own prefix"
    );
    let old: i64 =
        sqlx::query_scalar("SELECT count(*) FROM consumer_partitions WHERE consumer_group NOT LIKE '%from_scheduler'")
            .fetch_one(pool)
            .await
            .expect("the old groups' rows");
    assert_eq!(old, 4, "the old groups' rows stay for the previous release");
    let remembered: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT event_id FROM processed_events WHERE consumer_group = 'p1.executor.from_scheduler'")
            .fetch_all(pool)
            .await
            .expect("processed_events");
    assert_eq!(remembered, [cancellation], "what the grants' group remembered, and nothing of another service");
}
