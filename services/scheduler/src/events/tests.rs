//! The scheduler's reading of an attempt's reports: only the live attempt's, and
//! never one behind what its task already shows.

use fenceline_domain::ids::GrantId;
use fenceline_domain::lifecycle::Policy;

use super::*;

/// A task of `image.caption` whose first attempt, granted as `grant`, reported
/// `inputs` (after its grant).
fn row(grant: GrantId, inputs: Vec<Input>) -> TaskRow {
    let policy = Policy {
        max_attempts: 3,
        backoff: fenceline_domain::calls::Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60) },
        busy_wait: Duration::from_secs(2),
        send_again: Vec::new(),
    };
    let mut task = Task::accepted(0, None, None);
    for input in std::iter::once(Input::Grant { grant_id: grant }).chain(inputs) {
        task = task.apply(input, 1, &policy).task;
    }
    TaskRow {
        task_id: TaskId::new_v7(),
        tenant: "acme".into(),
        kind: "image.caption".into(),
        input_json: "{}".into(),
        lifecycle: task,
        version: 3,
        pending_signal: None,
        pending_step: None,
        traceparent: None,
        accepted_at: 0,
    }
}

#[test]
fn a_report_of_the_live_attempt_applies_unless_it_is_behind_what_the_task_shows() {
    let catalog = crate::test_catalog::draw_then_caption();
    let grant = GrantId::new_v7();
    let row = row(
        grant,
        vec![
            Input::Claimed { grant_id: grant },
            Input::Progress { grant_id: grant, step: "caption".into(), phase: Phase::CallIntent },
        ],
    );
    let applies = |attempt, step, phase| progress(&catalog, &row, attempt, step, phase).is_some();
    assert!(applies(1, "caption", Phase::ResultRecorded), "the next phase of the shown step");
    assert!(applies(1, "caption", Phase::CallIntent), "the shown phase itself, which moves nothing");
    assert!(!applies(1, "draw", Phase::ResultRecorded), "a step before the shown one, heard again");
    assert!(!applies(1, "draw", Phase::CallIntent), "the first step's intent, heard again");
    assert!(!applies(2, "caption", Phase::ResultRecorded), "another attempt's report");
    let unknown = TaskRow { kind: "gone.from.the.catalogue".into(), ..row.clone() };
    assert!(progress(&catalog, &unknown, 1, "draw", Phase::ResultRecorded).is_none(), "no order to tell by");
}

/// A batch's tasks, by its records' keys, are locked and held with one statement
/// before its first event: a key that names no task, or no task at all, is passed
/// over, and a task no record names stays free.
#[tokio::test]
async fn a_batch_locks_the_tasks_its_records_are_keyed_by_before_its_first_event() {
    let db = crate::test_schema::fresh().await;
    let insert = |task_id: TaskId| {
        sqlx::query(
            "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, lifecycle, state, version, accepted_at) \
             VALUES ($1, 'acme', 'image.caption', '{}', 1, $2, 'queued', 1, now())",
        )
        .bind(task_id.as_uuid())
        .bind(sqlx::types::Json(Task::accepted(0, None, None)))
        .execute(&db.pool)
    };
    let (named, other, free) = (TaskId::new_v7(), TaskId::new_v7(), TaskId::new_v7());
    for task_id in [named, other, free] {
        insert(task_id).await.expect("insert a task");
    }
    let held = HeldRows::default();
    let nowhere = TaskId::new_v7();
    let keys = [named.to_string(), "not a task".to_owned(), other.to_string(), nowhere.to_string()];
    let mut keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
    keys.push(keys[0]);
    let mut tx = db.pool.begin().await.expect("begin");
    held.lock_keyed(&mut tx, &keys).await.expect("lock the batch's tasks");

    let mut locked: Vec<TaskId> = held.held().rows.keys().copied().collect();
    locked.sort_by_key(|id| id.as_uuid());
    let mut expected = vec![named, other];
    expected.sort_by_key(|id| id.as_uuid());
    assert_eq!(locked, expected, "the named tasks that exist are held");
    assert!(held.unknown(nowhere) && !held.unknown(named), "a key that names no stored task is noted");
    let changed = held.take_changed();
    assert!(changed.inserted.is_empty() && changed.updated.is_empty(), "holding a row changes nothing");
    let try_lock = |task_id: TaskId| {
        let pool = db.pool.clone();
        async move {
            let mut other_tx = pool.begin().await.expect("begin");
            sqlx::query("SELECT 1 FROM tasks WHERE task_id = $1 FOR UPDATE NOWAIT")
                .bind(task_id.as_uuid())
                .execute(&mut *other_tx)
                .await
                .is_ok()
        }
    };
    held.lock_keyed(&mut tx, &keys).await.expect("lock again");
    assert!(!try_lock(named).await && !try_lock(other).await, "the batch's rows are locked until it ends");
    assert!(try_lock(free).await, "a task no record names is not");
    tx.rollback().await.expect("end the batch");
    assert!(try_lock(named).await, "and free once it ends");
}

fn lifecycle_events() -> LifecycleEvents {
    LifecycleEvents {
        catalog: Arc::new(crate::test_catalog::draw_then_caption()),
        settings: Arc::new(crate::SchedulerSettings {
            backoff_base_ms: 1_000,
            backoff_cap_ms: 60_000,
            busy_wait_ms: 2_000,
            grants_per_round: 32,
            task_retention_days: 30,
        }),
        channel: Arc::from("test_dispatch"),
        statuses: Default::default(),
        slots: Default::default(),
        held: Default::default(),
        ends: Default::default(),
        outcomes: Default::default(),
    }
}

fn accepted(task_id: TaskId) -> Inbound {
    let event = Event::TaskAccepted(TaskAccepted {
        task_id,
        tenant: "acme".into(),
        kind: "image.caption".into(),
        input_json: "{}".into(),
        priority: Priority::High,
        deadline: None,
        not_before: None,
        labels: Default::default(),
        source: "api".into(),
        accepted_at: fenceline_events::Timestamp(1_000_000),
    });
    Inbound {
        topic: "test.fenceline.tasks".into(),
        partition: 0,
        offset: 0,
        key: Some(task_id.to_string().into_bytes()),
        value: Vec::new(),
        envelope: fenceline_events::Envelope {
            headers: fenceline_events::Headers {
                event_id: fenceline_domain::ids::EventId::new_v7(),
                event_type: event.event_type().into(),
                schema_fingerprint: String::new(),
                producer: "intake".into(),
                produced_at: fenceline_events::Timestamp(0),
                traceparent: None,
            },
            event,
        },
    }
}

async fn applied_whole(
    handler: &LifecycleEvents,
    tx: &mut PgConnection,
    outbox: &OutboxWriter,
    task_ids: &[TaskId],
) -> Result<(), HandleError> {
    handler.discard();
    let keys: Vec<String> = task_ids.iter().map(TaskId::to_string).collect();
    let keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
    handler.prepare(tx, &keys).await?;
    for task_id in task_ids {
        handler.handle(tx, outbox, &accepted(*task_id)).await?;
    }
    handler.flush(tx, outbox).await
}

async fn count(tx: &mut PgConnection, statement: &str) -> i64 {
    sqlx::query_scalar(statement).fetch_one(&mut *tx).await.expect("count")
}

/// A batch's new tasks are stored with one insert when it ends, each as its events
/// left it; an acceptance heard again changes nothing; a task whose requests
/// outran it sends the batch back to be applied one event at a time, where its
/// acceptance takes them.
#[tokio::test]
async fn a_batch_inserts_the_tasks_it_accepted_together_when_it_ends() {
    let db = crate::test_schema::fresh().await;
    let (handler, outbox) = (lifecycle_events(), OutboxWriter::new(crate::NAME, "test.", 1));
    let (a, b, c) = (TaskId::new_v7(), TaskId::new_v7(), TaskId::new_v7());

    let mut tx = db.pool.begin().await.expect("begin");
    handler.discard();
    let keys = [a.to_string(), b.to_string()];
    let keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
    handler.prepare(&mut tx, &keys).await.expect("prepare");
    for task_id in [a, b] {
        handler.handle(&mut tx, &outbox, &accepted(task_id)).await.expect("accept");
    }
    assert_eq!(count(&mut tx, "SELECT count(*) FROM tasks").await, 0, "nothing is written before the batch ends");
    handler.flush(&mut tx, &outbox).await.expect("flush");
    tx.commit().await.expect("commit");
    let stored: Vec<(uuid::Uuid, String, i16, Option<String>, i64)> =
        sqlx::query_as("SELECT task_id, state, priority, provider, version FROM tasks ORDER BY task_id")
            .fetch_all(&db.pool)
            .await
            .expect("tasks");
    let mut expected = [a, b].map(|id| (id.as_uuid(), "queued".to_owned(), 0i16, Some("img".to_owned()), 1i64));
    expected.sort_by_key(|(id, ..)| *id);
    assert_eq!(stored, expected);
    let statuses: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE event_type = 'TaskStatus'")
        .fetch_one(&db.pool)
        .await
        .expect("statuses");
    assert_eq!(statuses, 2, "each new task's first status");

    // A copy of a's acceptance beside c's, whose cancellation came first.
    sqlx::query("INSERT INTO early_requests (task_id, event_id, value) VALUES ($1, $2, '\\x00')")
        .bind(c.as_uuid())
        .bind(uuid::Uuid::now_v7())
        .execute(&db.pool)
        .await
        .expect("an early request");
    let mut tx = db.pool.begin().await.expect("begin");
    let whole = applied_whole(&handler, &mut tx, &outbox, &[a, c]).await;
    assert!(matches!(whole, Err(HandleError::OneAtATime(_))), "{whole:?}");
    tx.rollback().await.expect("roll back");

    // One event at a time, as the consumer applies it then: no batch lock, no gathering.
    let mut tx = db.pool.begin().await.expect("begin");
    handler.discard();
    for task_id in [a, c] {
        handler.handle(&mut tx, &outbox, &accepted(task_id)).await.expect("accept");
        handler.flush(&mut tx, &outbox).await.expect("flush");
    }
    tx.commit().await.expect("commit");
    let (tasks, early, a_version): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM tasks), (SELECT count(*) FROM early_requests), \
           (SELECT version FROM tasks WHERE task_id = $1)",
    )
    .bind(a.as_uuid())
    .fetch_one(&db.pool)
    .await
    .expect("counts");
    assert_eq!((tasks, early, a_version), (3, 0, 1), "c stored with its early request taken, a unchanged");
}
