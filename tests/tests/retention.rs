//! Every service's retention, against the real Postgres (and the real broker for
//! the executor's view of task status): rows of finished tasks go after the
//! retention, in small batches; open tasks' rows stay however old.

use std::sync::atomic::Ordering;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::TaskState;
use fenceline_events::{Event, Timestamp, topics};
use fenceline_tests::*;
use rdkafka::message::Message;
use tokio_util::sync::CancellationToken;

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

const RECONCILER_TABLES: [&str; 4] = ["task_states", "grants", "calls", "cases"];

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
        assert_eq!(count_rows(&pool, &RECONCILER_TABLES, id).await, 0, "every row of {id} went");
    }
    assert_eq!(count_rows(&pool, &RECONCILER_TABLES, open_old).await, 4, "a task waiting for a person is never purged");
    assert_eq!(count_rows(&pool, &RECONCILER_TABLES, recent).await, 4);
    assert_eq!(fenceline_reconciler::audit::purge_finished(&pool, thirty_days, 2).await.expect("again"), 0);
}

const THIRTY_DAYS: Duration = Duration::from_secs(30 * 86_400);

async fn service_database(
    url: &str,
    name: &str,
    migrator: &'static sqlx::migrate::Migrator,
) -> fenceline_store::Database {
    fenceline_store::connect(&postgres(url, name), name, &[&fenceline_bus::MIGRATOR, migrator]).await.expect("schema")
}

/// A scheduler task in `state`, accepted and last changed `age_days` ago, with a
/// slot at each of two providers and an early request.
async fn scheduler_task(pool: &sqlx::PgPool, state: &str, age_days: i32) -> uuid::Uuid {
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, lifecycle, state, updated_at, accepted_at) \
         VALUES ($1, 'acme', 'image.generate', '{}', 1, '{}', $2, now() - make_interval(days => $3), \
         now() - make_interval(days => $3))",
    )
    .bind(id)
    .bind(state)
    .bind(age_days)
    .execute(pool)
    .await
    .expect("task");
    let grant = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) \
         VALUES ($1, $2, 'img', 'acme', 'image.generate', 0)",
    )
    .bind(grant)
    .bind(id)
    .execute(pool)
    .await
    .expect("slot");
    sqlx::query(
        "INSERT INTO other_provider_slots (grant_id, task_id, provider, expires_at_us) VALUES ($1, $2, 'pay', 0)",
    )
    .bind(grant)
    .bind(id)
    .execute(pool)
    .await
    .expect("slot at another provider");
    sqlx::query("INSERT INTO early_requests (task_id, event_id, value) VALUES ($1, $2, '')")
        .bind(id)
        .bind(uuid::Uuid::now_v7())
        .execute(pool)
        .await
        .expect("early request");
    id
}

async fn count_rows(pool: &sqlx::PgPool, tables: &[&str], id: uuid::Uuid) -> i64 {
    let mut total = 0;
    for table in tables {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE task_id = $1"))
            .bind(id)
            .fetch_one(pool)
            .await
            .expect("count");
        total += n;
    }
    total
}

const SCHEDULER_TABLES: [&str; 4] = ["tasks", "slots", "other_provider_slots", "early_requests"];

/// Purges the scheduler's finished tasks past 30 days (accepted before the
/// seven-day dedupe window), `batch` per transaction.
async fn scheduler_purge(pool: &sqlx::PgPool, prefix: &str, batch: i64) -> u64 {
    let outbox = OutboxWriter::new(fenceline_scheduler::NAME, prefix, outbox_config().shards);
    fenceline_scheduler::retention::purge_finished_tasks(pool, &outbox, THIRTY_DAYS, SEVEN_DAYS, batch)
        .await
        .expect("purge")
}

/// The tombstones waiting in `pool`'s outbox for the status key of `id`.
async fn tombstones_in_outbox(pool: &sqlx::PgPool, id: uuid::Uuid) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE payload IS NULL AND record_key = $1 AND topic LIKE '%fenceline.status'",
    )
    .bind(id.to_string().into_bytes())
    .fetch_one(pool)
    .await
    .expect("count tombstones")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_purges_finished_tasks_past_their_retention_and_keeps_open_ones() {
    let url = fresh_database().await;
    let pool = service_database(&url, fenceline_scheduler::NAME, &fenceline_scheduler::MIGRATOR).await.pool;
    let old = vec![
        scheduler_task(&pool, "succeeded", 31).await,
        scheduler_task(&pool, "failed", 40).await,
        scheduler_task(&pool, "cancelled", 31).await,
    ];
    let mut kept = Vec::new();
    for open in ["outcome_unknown", "needs_human", "waiting", "queued", "running"] {
        kept.push(scheduler_task(&pool, open, 90).await);
    }
    kept.push(scheduler_task(&pool, "succeeded", 2).await);

    assert_eq!(scheduler_purge(&pool, "", 2).await, 3, "the three finished over 30 days ago, two at a time");
    for id in old {
        assert_eq!(count_rows(&pool, &SCHEDULER_TABLES, id).await, 0, "every row of {id} went");
        assert_eq!(tombstones_in_outbox(&pool, id).await, 1, "the purge of {id} tombstones its status key");
    }
    for id in kept {
        assert_eq!(count_rows(&pool, &SCHEDULER_TABLES, id).await, 4, "an open or recent task keeps its rows");
        assert_eq!(tombstones_in_outbox(&pool, id).await, 0);
    }
    assert_eq!(scheduler_purge(&pool, "", 2).await, 0);
}

const EXECUTOR_TABLES: [&str; 3] = ["executions", "checkpoints", "call_sequences"];

/// How long the executor's consumers remember an event id (the bus's dedupe window).
const SEVEN_DAYS: Duration = Duration::from_secs(7 * 86_400);

/// An executed task in the executor's tables: one execution in `execution_status`,
/// recorded (its grant applied) `recorded_days_ago`, a checkpoint and a call sequence.
async fn executed_task(pool: &sqlx::PgPool, execution_status: &str, recorded_days_ago: i32) -> TaskId {
    let id = TaskId::new_v7();
    sqlx::query(
        "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, provider, \
         lease_budget_ms, status, created_at) VALUES ($1, $2, 'acme', 1, 0, 'image.generate', '{}', 'img', 1000, $3, \
         now() - make_interval(days => $4))",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(id.as_uuid())
    .bind(execution_status)
    .bind(recorded_days_ago)
    .execute(pool)
    .await
    .expect("execution");
    sqlx::query(
        "INSERT INTO checkpoints (task_id, generation, step, output, sha256, attempt) VALUES ($1, 0, 'render', '{}', '', 1)",
    )
    .bind(id.as_uuid())
    .execute(pool)
    .await
    .expect("checkpoint");
    sqlx::query("INSERT INTO call_sequences (task_id, generation, step, seq) VALUES ($1, 0, 'render', 2)")
        .bind(id.as_uuid())
        .execute(pool)
        .await
        .expect("call sequence");
    id
}

/// The scheduler's status of `task`: `state` at `version`, changed `age_days` ago.
fn status(task: TaskId, state: TaskState, version: i64, age_days: i64) -> Event {
    let Event::TaskStatus(mut s) = status_event(task, version) else { unreachable!("a status event") };
    s.state = state;
    s.updated_at = Timestamp(Timestamp::now().0 - age_days * DAY_US);
    Event::TaskStatus(s)
}

/// Waits until `stats` counts `applied` events applied (and fails the test if
/// any was dead-lettered).
async fn wait_consumed(stats: &fenceline_bus::ConsumerStats, applied: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stats.applied.load(Ordering::Relaxed) < applied {
        assert!(tokio::time::Instant::now() < deadline, "the status events were not all applied in 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(stats.dead_lettered.load(Ordering::Relaxed), 0, "no status event is dead-lettered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_purges_only_tasks_whose_status_is_final_past_the_retention() {
    let url = fresh_database().await;
    let prefix = fresh_topics().await;
    let executor = service_database(&url, fenceline_executor::NAME, &fenceline_executor::MIGRATOR).await;
    let scheduler = service_database(&url, fenceline_scheduler::NAME, &fenceline_scheduler::MIGRATOR).await;
    let pool = &executor.pool;

    let finished_old = executed_task(pool, "succeeded", 45).await;
    let never_final = executed_task(pool, "lost", 90).await;
    let no_status = executed_task(pool, "failed", 60).await;
    let finished_recent = executed_task(pool, "succeeded", 4).await;
    let still_running = executed_task(pool, "running", 60).await;
    // Its grant was applied after its status was final (a consumer far behind): a
    // copy of the grant re-sent within the dedupe window must find the execution.
    let granted_late = executed_task(pool, "succeeded", 2).await;
    let events = vec![
        status(finished_old, TaskState::Running, 1, 45),
        status(finished_old, TaskState::Succeeded, 2, 40),
        status(never_final, TaskState::OutcomeUnknown, 3, 90),
        // An earlier version arriving late changes nothing.
        status(finished_old, TaskState::Running, 1, 45),
        status(finished_recent, TaskState::Cancelled, 2, 3),
        status(still_running, TaskState::Failed, 2, 60),
        status(granted_late, TaskState::Cancelled, 2, 40),
    ];
    let shutdown = CancellationToken::new();
    let _guard = shutdown.clone().drop_guard();
    let writer = OutboxWriter::new(fenceline_scheduler::NAME, &prefix, outbox_config().shards);
    start_relay("scheduler-relay", &scheduler, &kafka(&prefix), &writer, &shutdown);
    write_outbox(&scheduler.pool, &writer, topics::STATUS, &events, 1).await;
    let consumer =
        status_consumer(&executor, &prefix, fenceline_executor::retention::StatusProjection::default(), &shutdown);
    wait_consumed(&consumer.stats(), events.len() as u64).await;

    let purged =
        fenceline_executor::retention::purge_finished_tasks(pool, THIRTY_DAYS, SEVEN_DAYS, 1).await.expect("purge");
    assert_eq!(purged, 1, "only the task final for over 30 days, with nothing left to run");
    assert_eq!(
        count_rows(pool, &EXECUTOR_TABLES, finished_old.as_uuid()).await,
        0,
        "every row of the finished task went"
    );
    assert_eq!(count_rows(pool, &["task_states"], finished_old.as_uuid()).await, 0);
    // A final state is never left, so only final snapshots are kept: the others cost no row.
    assert_eq!(count_rows(pool, &["task_states"], never_final.as_uuid()).await, 0);
    for (kept, why) in [
        (never_final, "a task waiting for a person keeps its call sequences however old"),
        (no_status, "a task whose status never arrived keeps them"),
        (finished_recent, "a task final for less than the retention keeps them"),
        (still_running, "a task with an execution still running keeps them"),
        (granted_late, "a task with a grant applied within the dedupe window keeps them"),
    ] {
        assert_eq!(count_rows(pool, &EXECUTOR_TABLES, kept.as_uuid()).await, 3, "{why}");
    }
}

/// A consumer of the status topic with `handler`, as the service runs it.
fn status_consumer<H: fenceline_bus::Handler>(
    db: &fenceline_store::Database,
    prefix: &str,
    handler: H,
    shutdown: &CancellationToken,
) -> fenceline_bus::ConsumerHandle {
    let writer = OutboxWriter::new("consumer", prefix, outbox_config().shards);
    fenceline_bus::FencedConsumer::spawn(
        fenceline_bus::ConsumerSpec {
            group: fresh_group(),
            topics: vec![topics::named(prefix, topics::STATUS)],
            instance: "status".into(),
            drain_grace: Duration::from_secs(5),
        },
        &kafka(prefix),
        &consumer_config(),
        db.pool.clone(),
        writer,
        handler,
        shutdown.clone(),
    )
    .expect("consumer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_task_gets_a_tombstone_on_the_status_topic_that_every_consumer_skips() {
    let url = fresh_database().await;
    let prefix = fresh_topics().await;
    let scheduler = service_database(&url, fenceline_scheduler::NAME, &fenceline_scheduler::MIGRATOR).await;
    let executor = service_database(&url, fenceline_executor::NAME, &fenceline_executor::MIGRATOR).await;
    let intake = service_database(&url, fenceline_intake::NAME, &fenceline_intake::MIGRATOR).await;
    let shutdown = CancellationToken::new();
    let _guard = shutdown.clone().drop_guard();
    let writer = OutboxWriter::new(fenceline_scheduler::NAME, &prefix, outbox_config().shards);
    start_relay("scheduler-relay", &scheduler, &kafka(&prefix), &writer, &shutdown);

    let purged = scheduler_task(&scheduler.pool, "succeeded", 40).await;
    let task = TaskId::from_uuid(purged);
    write_outbox(&scheduler.pool, &writer, topics::STATUS, &[status(task, TaskState::Succeeded, 7, 40)], 1).await;
    assert_eq!(scheduler_purge(&scheduler.pool, &prefix, 500).await, 1);
    writer.committed();

    let records = read_topic(&brokers(), &topics::named(&prefix, topics::STATUS), 2, Duration::from_secs(20));
    let of_task: Vec<_> = records.iter().filter(|m| m.key() == Some(task.to_string().as_bytes())).collect();
    assert_eq!(of_task.len(), 2, "the snapshot, then the tombstone, under the task's key");
    assert!(of_task[0].payload().is_some(), "the snapshot first");
    assert_eq!(of_task[1].payload(), None, "then a record with a null value");

    let consumers = [
        status_consumer(&executor, &prefix, fenceline_executor::retention::StatusProjection::default(), &shutdown),
        status_consumer(&intake, &prefix, fenceline_intake::tasks::Projections::default(), &shutdown),
    ];
    for consumer in &consumers {
        let stats = consumer.stats();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        // The snapshot counts as applied once its batch committed; the tombstone is
        // counted when it is read, which may be before that commit.
        while stats.tombstones.load(Ordering::Relaxed) < 1 || stats.applied.load(Ordering::Relaxed) < 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the snapshot and the tombstone were not both read in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(stats.applied.load(Ordering::Relaxed), 1, "the snapshot is applied");
        assert_eq!(stats.dead_lettered.load(Ordering::Relaxed), 0, "the tombstone is not dead-lettered");
    }
}

/// How many rows of `table` this transaction updated, and how many of those in
/// place (HOT: no new index entry).
async fn updated_in_place(tx: &mut sqlx::PgConnection, table: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated($1::regclass), pg_stat_get_xact_tuples_hot_updated($1::regclass)",
    )
    .bind(table)
    .fetch_one(tx)
    .await
    .expect("the transaction's update counts")
}

/// What the retention finds finished rows by is set once, when a row becomes final:
/// a save of an open task, which sets `updated_at`, is written in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_of_open_tasks_are_written_in_place_and_only_the_final_one_is_indexed() {
    let url = fresh_database().await;
    let scheduler = service_database(&url, fenceline_scheduler::NAME, &fenceline_scheduler::MIGRATOR).await;
    let intake = service_database(&url, fenceline_intake::NAME, &fenceline_intake::MIGRATOR).await;
    let task = scheduler_task(&scheduler.pool, "running", 0).await;

    // The scheduler's saves of a running task: its lifecycle, version and time.
    let mut tx = scheduler.pool.begin().await.expect("begin");
    for version in 1..=5 {
        sqlx::query(
            "UPDATE tasks SET lifecycle = jsonb_build_object('v', $2), version = $2, \
             updated_at = now() + make_interval(secs => $2) WHERE task_id = $1",
        )
        .bind(task)
        .bind(version)
        .execute(&mut *tx)
        .await
        .expect("save");
    }
    assert_eq!(updated_in_place(&mut tx, "tasks").await, (5, 5), "every save of an open task is in place");
    sqlx::query(
        "UPDATE tasks SET state = 'succeeded', version = 6, updated_at = now() + interval '6 s' WHERE task_id = $1",
    )
    .bind(task)
    .execute(&mut *tx)
    .await
    .expect("final save");
    tx.commit().await.expect("commit");
    let finished: bool = sqlx::query_scalar("SELECT finished_at = updated_at FROM tasks WHERE task_id = $1")
        .bind(task)
        .fetch_one(&scheduler.pool)
        .await
        .expect("finished_at");
    assert!(finished, "the final save sets the time the retention goes by");

    // Intake's read model: each newer snapshot of an open task, its state and phase too.
    let mut tx = intake.pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO task_view (task_id, tenant, kind, state, attempt, updated_at, version) \
         VALUES ($1, 'acme', 'image.generate', 'queued', 0, now(), 1)",
    )
    .bind(task)
    .execute(&mut *tx)
    .await
    .expect("snapshot");
    for (version, state, phase) in [(2, "running", "claimed"), (3, "running", "calling"), (4, "waiting", "retrying")] {
        sqlx::query(
            "UPDATE task_view SET state = $2, phase = $3, attempt = 1, version = $4, \
             updated_at = now() + make_interval(secs => $4) WHERE task_id = $1",
        )
        .bind(task)
        .bind(state)
        .bind(phase)
        .bind(version)
        .execute(&mut *tx)
        .await
        .expect("newer snapshot");
    }
    assert_eq!(updated_in_place(&mut tx, "task_view").await, (3, 3), "every snapshot of an open task is in place");
}
