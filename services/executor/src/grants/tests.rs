//! The grant recorder against a schema of its own in the test Postgres: a grant
//! re-issued with the same id makes no second execution and is handed to the
//! workers once, and a cancellation marks only its own execution.

use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_events::{CancelAttempt, Timestamp};
use sqlx::PgPool;

use super::*;
use crate::testing;

async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

fn granted(grant_id: GrantId, input_json: &str) -> Event {
    testing::granted(grant_id, TaskId::new_v7(), input_json)
}

/// Handles `events` in one batch and commits it, as the consumer does.
async fn batch(pool: &PgPool, recorder: &GrantRecorder, events: Vec<Event>) {
    let outbox = OutboxWriter::new("executor", "test.", 1);
    let mut tx = pool.begin().await.expect("begin");
    for event in events {
        recorder
            .handle(&mut tx, &outbox, &testing::on(fenceline_events::topics::DISPATCH, event))
            .await
            .expect("handle");
    }
    recorder.flush(&mut tx, &outbox).await.expect("flush");
    tx.commit().await.expect("commit");
    recorder.committed();
}

/// Every grant handed to the workers, in order.
fn handed(recorder: &GrantRecorder) -> Vec<uuid::Uuid> {
    let mut grants = Vec::new();
    loop {
        match recorder.handed.next(Duration::from_secs(3_600)) {
            crate::grants::Next::Claim(grant) => grants.push(grant.grant_id),
            crate::grants::Next::Walk => {}
            crate::grants::Next::Rest => return grants,
        }
    }
}

/// (input, cancel requested) of each execution, by grant id.
async fn executions(pool: &PgPool) -> Vec<(uuid::Uuid, String, bool)> {
    sqlx::query_as("SELECT grant_id, input_json, cancel_requested FROM executions ORDER BY grant_id")
        .fetch_all(pool)
        .await
        .expect("read the executions")
}

#[tokio::test]
async fn a_reissued_grant_makes_no_second_execution_and_is_handed_once() {
    let pool = fresh_schema().await;
    let recorder = GrantRecorder::new(Arc::default(), Arc::default(), 4);
    let (grant, other) = (GrantId::new_v7(), GrantId::new_v7());

    batch(&pool, &recorder, vec![granted(grant, r#"{"first":true}"#)]).await;
    assert_eq!(handed(&recorder), [grant.as_uuid()]);

    // Re-issued in the next batch, and again within one batch beside another grant.
    batch(&pool, &recorder, vec![granted(grant, r#"{"again":true}"#)]).await;
    batch(&pool, &recorder, vec![granted(other, "{}"), granted(grant, "{}")]).await;
    assert_eq!(handed(&recorder), [other.as_uuid()], "only the new grant is handed");
    let mut expected =
        vec![(grant.as_uuid(), r#"{"first":true}"#.to_owned(), false), (other.as_uuid(), "{}".to_owned(), false)];
    expected.sort();
    assert_eq!(executions(&pool).await, expected, "the first recording stands");
}

#[tokio::test]
async fn a_cancellation_marks_its_own_execution_only() {
    let pool = fresh_schema().await;
    let recorder = GrantRecorder::new(Arc::default(), Arc::default(), 4);
    let (cancelled, kept) = (GrantId::new_v7(), GrantId::new_v7());
    batch(&pool, &recorder, vec![granted(cancelled, "{}"), granted(kept, "{}")]).await;

    let cancel = CancelAttempt { task_id: TaskId::new_v7(), grant_id: cancelled, requested_at: Timestamp(0) };
    batch(&pool, &recorder, vec![Event::CancelAttempt(cancel)]).await;
    // Granted and cancelled in one batch: the gathered grant is recorded cancelled.
    let at_once = GrantId::new_v7();
    let cancel = CancelAttempt { task_id: TaskId::new_v7(), grant_id: at_once, requested_at: Timestamp(0) };
    batch(&pool, &recorder, vec![granted(at_once, "{}"), Event::CancelAttempt(cancel)]).await;
    let marked: Vec<_> = executions(&pool).await.into_iter().map(|(id, _, cancel)| (id, cancel)).collect();
    let mut expected = vec![(cancelled.as_uuid(), true), (kept.as_uuid(), false), (at_once.as_uuid(), true)];
    expected.sort();
    assert_eq!(marked, expected);
}

#[test]
fn the_walk_is_taken_once_an_interval_and_again_when_nothing_is_handed_after_it_found_one() {
    let handed = Handed::default();
    let every = Duration::from_secs(3_600);
    let grant =
        |n: u128| HandedGrant { grant_id: uuid::Uuid::from_u128(n), kind: "k".into(), from_the_first_step: true };
    assert_eq!(handed.next(every), Next::Walk, "at start: grants from before it may be waiting");
    assert_eq!(handed.next(every), Next::Rest, "it found nothing, nothing is handed: rest");
    handed.extend(vec![grant(1), grant(2)]);
    handed.walk_found();
    assert_eq!(handed.next(every), Next::Claim(grant(1)), "handed grants come before a walk that is not due");
    assert_eq!(handed.next(every), Next::Claim(grant(2)));
    assert_eq!(handed.next(every), Next::Walk, "nothing handed, and the last walk found one: there may be more");
    assert_eq!(handed.next(every), Next::Rest, "that walk found nothing");
    handed.extend(vec![grant(3)]);
    assert_eq!(handed.next(Duration::ZERO), Next::Walk, "due once the interval passed, grants handed or not");
    assert_eq!(handed.next(every), Next::Claim(grant(3)));
}
