//! Intake's retention: finished tasks and idempotency keys purged after their time,
//! open tasks kept, and tasks that never reached the scheduler reported.

use std::time::Duration;

use crate::intake_fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_accepted_long_ago_that_never_reached_the_scheduler_are_reported() {
    use fenceline_intake::tasks::unscheduled;
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let mut ids = Vec::new();
    for key in ["lost", "scheduled", "fresh"] {
        let answer = call("POST", url.clone(), Some(intake.acme.clone()), Some(key), Some(image(key))).await;
        ids.push(answer.body["task_id"].as_str().expect("task id").to_owned());
    }
    // The first two were accepted 20 minutes ago; only the second reached the scheduler.
    sqlx::query("UPDATE tasks SET accepted_at = now() - interval '20 minutes' WHERE task_id = ANY($1)")
        .bind(ids[..2].iter().map(|id| uuid::Uuid::parse_str(id).expect("uuid")).collect::<Vec<_>>())
        .execute(&intake.pool)
        .await
        .expect("age");
    project(&intake, &ids[1], "running", "", 1).await;

    let ten_minutes = Duration::from_secs(600);
    let (found, count) = unscheduled(&intake.pool, ten_minutes, 20).await.expect("unscheduled");
    let found: Vec<String> = found.iter().map(|t| t.task_id.to_string()).collect();
    assert_eq!((found, count), (vec![ids[0].clone()], 1), "only the old task the scheduler never saw");
    let (_, count) = unscheduled(&intake.pool, Duration::from_secs(1800), 20).await.expect("unscheduled");
    assert_eq!(count, 0, "20 minutes is within a 30-minute threshold");

    project(&intake, &ids[0], "queued", "", 1).await;
    assert_eq!(unscheduled(&intake.pool, ten_minutes, 20).await.expect("unscheduled").1, 0, "cleared once it arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_tasks_past_their_retention_are_purged_in_small_batches_and_open_ones_kept() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let mut ids = Vec::new();
    for key in ["old-1", "old-2", "old-3", "open", "recent"] {
        let answer = call("POST", url.clone(), Some(intake.acme.clone()), Some(key), Some(image(key))).await;
        ids.push(answer.body["task_id"].as_str().expect("task id").to_owned());
    }
    let cancel = call("POST", format!("{url}/{}/cancel", ids[0]), Some(intake.acme.clone()), None, None).await;
    assert_eq!(cancel.status, 202);
    for (id, state) in ids.iter().zip(["cancelled", "succeeded", "failed", "running", "succeeded"]) {
        project(&intake, id, state, "", 1).await;
    }
    sqlx::query("UPDATE task_view SET updated_at = now() - interval '31 days' WHERE task_id = ANY($1)")
        .bind(ids[..4].iter().map(|id| uuid::Uuid::parse_str(id).expect("uuid")).collect::<Vec<_>>())
        .execute(&intake.pool)
        .await
        .expect("age");
    let thirty_days = Duration::from_secs(30 * 86_400);
    let purged = fenceline_intake::tasks::purge_finished_tasks(&intake.pool, thirty_days, 2).await.expect("purge");
    assert_eq!(purged, 3, "the three finished 31 days ago, two at a time");
    let left: Vec<String> = sqlx::query_scalar("SELECT task_id::text FROM tasks ORDER BY task_id")
        .fetch_all(&intake.pool)
        .await
        .expect("left");
    assert_eq!(left, vec![ids[3].clone(), ids[4].clone()], "the running one and the recent one stay");
    let cancellations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM cancellations").fetch_one(&intake.pool).await.expect("count");
    assert_eq!(cancellations, 0, "with their rows");
    let read = call("GET", format!("{url}/{}", ids[1]), Some(intake.acme.clone()), None, None).await;
    assert_eq!(read.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_past_their_retention_are_purged_and_then_start_afresh() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let first = call("POST", url.clone(), Some(intake.acme.clone()), Some("old-key"), Some(image("x"))).await;
    // Age the key past the 24 h retention, as if a day had passed.
    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '25 hours'")
        .execute(&intake.pool)
        .await
        .expect("age");
    let purged = fenceline_intake::tasks::purge_idempotency_keys(&intake.pool, 24).await.expect("purge");
    assert_eq!(purged, 1);
    let again = call("POST", url, Some(intake.acme.clone()), Some("old-key"), Some(image("x"))).await;
    assert_eq!((again.status, again.replayed), (202, false), "a purged key is a new submission");
    assert_ne!(again.body["task_id"], first.body["task_id"]);
}
