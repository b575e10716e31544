//! The scheduler's task rows against a schema of its own: a row reads back as
//! stored, only a due task nobody holds is locked for dispatch, a saved lifecycle
//! writes its state, timer, version and provider and wakes the dispatchers, a grant
//! takes a slot at every provider its attempt calls and its end gives them back,
//! and the unfinished tasks are counted by state; a batch publishes each task's
//! newest status only.

use fenceline_domain::lifecycle::Input;
use sqlx::PgPool;
use sqlx::postgres::PgListener;

use super::*;
use crate::test_schema;
use fenceline_domain::ids::GrantId;

fn status(task_id: TaskId, version: i64) -> Event {
    let row = TaskRow {
        task_id,
        tenant: "t".into(),
        kind: "k".into(),
        input_json: "{}".into(),
        lifecycle: Task::accepted(0, None, None),
        version,
        pending_signal: None,
        pending_step: None,
        traceparent: None,
        accepted_at: 0,
    };
    status_of(&row, &row.lifecycle, version, 0)
}

fn taken_versions(batch: &StatusBatch) -> Vec<(TaskId, i64)> {
    batch
        .0
        .take()
        .into_iter()
        .map(|kept| match kept.status {
            Event::TaskStatus(s) => (s.task_id, s.version),
            _ => unreachable!("only statuses are kept"),
        })
        .collect()
}

#[test]
fn a_batch_keeps_the_newest_status_of_each_task_and_forgets_on_discard() {
    let (a, b) = (TaskId::new_v7(), TaskId::new_v7());
    let batch = StatusBatch::default();
    for event in [status(a, 2), status(b, 1), status(a, 3), status(a, 1), status(b, 2)] {
        batch.keep(event);
    }
    let mut expected = vec![(a, 3), (b, 2)];
    expected.sort();
    assert_eq!(taken_versions(&batch), expected, "one status per task, the newest, in task order");
    batch.keep(status(a, 4));
    batch.discard();
    assert!(taken_versions(&batch).is_empty(), "a rolled-back batch publishes nothing it gathered");
}

/// 2030-01-01T00:00:00Z, in microseconds.
const ACCEPTED_AT: Micros = 1_893_456_000_000_000;

fn settings() -> SchedulerSettings {
    SchedulerSettings {
        backoff_base_ms: 1_000,
        backoff_cap_ms: 60_000,
        busy_wait_ms: 2_000,
        grants_per_round: 32,
        task_retention_days: 30,
    }
}

/// A channel of this test's own: channels are the server's, not the schema's.
fn channel() -> String {
    format!("wake_{}", uuid::Uuid::now_v7().simple())
}

/// A task of `kind` in `lifecycle`'s state, accepted at [`ACCEPTED_AT`], at version 3.
async fn insert_task(pool: &PgPool, kind: &str, lifecycle: &Task) -> TaskId {
    let task_id = TaskId::new_v7();
    sqlx::query(
        "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, lifecycle, state, due_at_us, version, \
         pending_signal, traceparent, accepted_at) \
         VALUES ($1, 'acme', $2, '{\"prompt\":\"a fence\"}', 1, $3, $4, $5, 3, 'approve', \
         '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', to_timestamp($6::double precision / 1e6))",
    )
    .bind(task_id.as_uuid())
    .bind(kind)
    .bind(sqlx::types::Json(lifecycle))
    .bind(lifecycle.state.as_str())
    .bind(due_at(lifecycle))
    .bind(ACCEPTED_AT)
    .execute(pool)
    .await
    .expect("insert a task");
    task_id
}

/// (state, due_at_us, version, provider) of a task as stored.
async fn stored(pool: &PgPool, task_id: TaskId) -> (String, Option<i64>, i64, Option<String>) {
    sqlx::query_as("SELECT state, due_at_us, version, provider FROM tasks WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .fetch_one(pool)
        .await
        .expect("read the task")
}

/// (topic, event type) of every row in the outbox, in the order written.
async fn outbox_rows(pool: &PgPool) -> Vec<(String, String)> {
    sqlx::query_as("SELECT topic, event_type FROM outbox ORDER BY id").fetch_all(pool).await.expect("read the outbox")
}

/// (grant, provider) of every slot a task holds, in both tables, sorted.
async fn slots_of(pool: &PgPool, task_id: TaskId) -> Vec<(uuid::Uuid, String)> {
    sqlx::query_as(
        "SELECT grant_id, provider FROM slots WHERE task_id = $1 \
         UNION ALL SELECT grant_id, provider FROM other_provider_slots WHERE task_id = $1 ORDER BY 2",
    )
    .bind(task_id.as_uuid())
    .fetch_all(pool)
    .await
    .expect("read the slots")
}

#[tokio::test]
async fn a_locked_row_reads_back_as_stored() {
    let db = test_schema::fresh().await;
    let lifecycle = Task::accepted(ACCEPTED_AT, None, Some(ACCEPTED_AT + 60_000_000));
    let task_id = insert_task(&db.pool, "image.caption", &lifecycle).await;
    let mut tx = db.pool.begin().await.expect("begin");
    let row = lock(&mut tx, task_id).await.expect("lock").expect("the task exists");
    assert_eq!(row.task_id, task_id);
    assert_eq!((row.tenant.as_str(), row.kind.as_str()), ("acme", "image.caption"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&row.input_json).expect("JSON"),
        serde_json::json!({"prompt": "a fence"})
    );
    assert_eq!(row.version, 3);
    assert_eq!(row.pending_signal.as_deref(), Some("approve"));
    assert_eq!(row.pending_step, None);
    assert_eq!(row.traceparent.as_deref(), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
    assert_eq!(row.accepted_at, ACCEPTED_AT, "accepted_at in micros since the epoch");
    assert_eq!(row.lifecycle.state, TaskState::Queued);
    assert_eq!(row.lifecycle.deadline, Some(ACCEPTED_AT + 60_000_000));
    assert!(lock(&mut tx, TaskId::new_v7()).await.expect("lock").is_none(), "no row, no task");
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn only_a_due_task_nobody_holds_is_locked_for_dispatch() {
    let db = test_schema::fresh().await;
    let due = ACCEPTED_AT + 5_000_000;
    let task_id = insert_task(&db.pool, "image.caption", &Task::accepted(ACCEPTED_AT, Some(due), None)).await;
    let later = insert_task(&db.pool, "image.caption", &Task::accepted(ACCEPTED_AT, Some(due + 1), None)).await;
    let both = [task_id, later];
    let mut tx = db.pool.begin().await.expect("begin");
    assert!(lock_if_due(&mut tx, &both, due - 1).await.expect("lock").is_empty(), "neither due yet");
    let locked = lock_if_due(&mut tx, &both, due).await.expect("lock");
    assert_eq!(locked.keys().copied().collect::<Vec<_>>(), vec![task_id], "only the one due at its timer");
    assert_eq!(locked[&task_id].task_id, task_id);
    // Another instance looking at the same moment passes over it rather than waiting.
    let mut other = db.pool.begin().await.expect("begin");
    assert!(lock_if_due(&mut other, &both, due).await.expect("lock").is_empty(), "held by the first");
    tx.rollback().await.expect("release");
    assert_eq!(lock_if_due(&mut other, &both, due + 1).await.expect("lock").len(), 2, "both free and due");
    other.commit().await.expect("commit");
}

/// What the lifecycle is applied with: the test catalogue and settings, an outbox
/// of its own and a notification channel of its own.
struct Setting {
    catalog: Catalog,
    settings: SchedulerSettings,
    outbox: OutboxWriter,
    channel: String,
    ends: Ends,
}

impl Setting {
    fn new() -> Self {
        Setting {
            catalog: crate::test_catalog::draw_then_caption(),
            settings: settings(),
            outbox: OutboxWriter::new(crate::NAME, "test.", 1),
            channel: channel(),
            ends: Ends::default(),
        }
    }

    fn ctx(&self) -> Context<'_> {
        Context {
            outbox: &self.outbox,
            catalog: &self.catalog,
            settings: &self.settings,
            channel: &self.channel,
            statuses: None,
            ends: &self.ends,
            slots: None,
        }
    }
}

#[tokio::test]
async fn a_saved_lifecycle_writes_its_state_timer_version_and_provider_and_wakes_the_dispatchers() {
    let db = test_schema::fresh().await;
    let setting = Setting::new();
    let (ctx, channel) = (setting.ctx(), &setting.channel);
    let mut listener = PgListener::connect_with(&db.pool).await.expect("listen");
    listener.listen(channel).await.expect("listen to the channel");

    // Waiting with a timer later than its deadline: due at its deadline.
    let (timer, deadline) = (ACCEPTED_AT + 9_000_000, ACCEPTED_AT + 7_000_000);
    let task_id = insert_task(&db.pool, "image.caption", &Task::accepted(ACCEPTED_AT, None, None)).await;
    let mut waiting = Task::accepted(ACCEPTED_AT, Some(timer), Some(deadline));
    waiting.state = TaskState::Waiting;
    let mut tx = db.pool.begin().await.expect("begin");
    let row = lock(&mut tx, task_id).await.expect("lock").expect("the task");
    save_all(&mut tx, ctx, &[TaskRow { lifecycle: waiting.clone(), version: 4, ..row }]).await.expect("save");
    tx.commit().await.expect("commit");
    assert_eq!(stored(&db.pool, task_id).await, ("waiting".into(), Some(deadline), 4, Some("img".into())));
    let woken = tokio::time::timeout(std::time::Duration::from_secs(5), listener.recv()).await;
    assert_eq!(woken.expect("woken at commit").expect("a notification").channel(), channel);

    // A kind the catalogue does not know keeps the provider the row had; no timer, no wake.
    sqlx::query("UPDATE tasks SET kind = 'gone.kind' WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .execute(&db.pool)
        .await
        .expect("change the kind");
    let mut done = waiting.clone();
    (done.state, done.due_at, done.deadline) = (TaskState::Failed, None, None);
    let mut tx = db.pool.begin().await.expect("begin");
    let row = lock(&mut tx, task_id).await.expect("lock").expect("the task");
    save_all(&mut tx, ctx, &[TaskRow { lifecycle: done, version: 5, ..row }]).await.expect("save");
    tx.commit().await.expect("commit");
    assert_eq!(stored(&db.pool, task_id).await, ("failed".into(), None, 5, Some("img".into())));
    let lifecycle: sqlx::types::Json<Task> = sqlx::query_scalar("SELECT lifecycle FROM tasks WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .fetch_one(&db.pool)
        .await
        .expect("read the lifecycle");
    assert_eq!(lifecycle.0.state, TaskState::Failed);
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(200), listener.recv()).await;
    assert!(quiet.is_err(), "a task without a timer wakes nobody");
}

#[tokio::test]
async fn a_grant_takes_a_slot_at_every_provider_it_calls_and_its_end_gives_them_back() {
    let db = test_schema::fresh().await;
    let setting = Setting::new();
    let (ctx, ends) = (setting.ctx(), &setting.ends);
    let task_id = insert_task(&db.pool, "image.caption", &Task::accepted(ACCEPTED_AT, None, None)).await;
    let grant_id = GrantId::from_uuid(uuid::Uuid::now_v7());
    let now = ACCEPTED_AT + 1_000_000;

    let mut tx = db.pool.begin().await.expect("begin");
    let row = lock(&mut tx, task_id).await.expect("lock").expect("the task");
    let granted = apply(&mut tx, ctx, &row, Input::Grant { grant_id }, now).await.expect("grant");
    save_all(&mut tx, ctx, std::slice::from_ref(&granted)).await.expect("save");
    tx.commit().await.expect("commit");
    assert_eq!((granted.lifecycle.attempt, granted.lifecycle.live_grant), (1, Some(grant_id)));
    assert_eq!(granted.version, 4, "a visible change publishes a new version");
    assert_eq!(stored(&db.pool, task_id).await, ("queued".into(), None, 4, Some("img".into())));
    assert_eq!(
        slots_of(&db.pool, task_id).await,
        vec![(grant_id.as_uuid(), "img".to_owned()), (grant_id.as_uuid(), "llm".to_owned())],
        "the grant's own slot and one at the other provider it calls"
    );
    let (dispatch, status) = (topics::named("test.", topics::DISPATCH), topics::named("test.", topics::STATUS));
    assert_eq!(
        outbox_rows(&db.pool).await,
        vec![(dispatch.clone(), "AttemptGranted".to_owned()), (status.clone(), "TaskStatus".to_owned())]
    );

    let result = Artifact { uri: "mem://a".into(), sha256: "00".repeat(32), size_bytes: 1 };
    let mut tx = db.pool.begin().await.expect("begin");
    let row = lock(&mut tx, task_id).await.expect("lock").expect("the task");
    let done = apply(&mut tx, ctx, &row, Input::Succeeded { grant_id, result }, now + 1_000_000).await.expect("end");
    save_all(&mut tx, ctx, std::slice::from_ref(&done)).await.expect("save");
    tx.commit().await.expect("commit");
    assert_eq!(done.lifecycle.state, TaskState::Succeeded);
    assert_eq!(stored(&db.pool, task_id).await, ("succeeded".into(), None, 5, Some("img".into())));
    assert!(slots_of(&db.pool, task_id).await.is_empty(), "an ended attempt holds no slot anywhere");
    assert_eq!(outbox_rows(&db.pool).await.last(), Some(&(status, "TaskStatus".to_owned())));
    assert_eq!(ends.kept().len(), 1, "the finished task is kept to be timed once committed");
    ends.discard();
}

#[tokio::test]
async fn releasing_a_slot_frees_only_that_grants_rows() {
    let db = test_schema::fresh().await;
    let (mine, other) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    for grant_id in [mine, other] {
        sqlx::query(
            "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) \
             VALUES ($1, $2, 'img', 'acme', 'image.caption', now_us() + 60000000)",
        )
        .bind(grant_id)
        .bind(uuid::Uuid::now_v7())
        .execute(&db.pool)
        .await
        .expect("insert a slot");
        sqlx::query(
            "INSERT INTO other_provider_slots (grant_id, task_id, provider, expires_at_us) \
             SELECT grant_id, task_id, 'llm', expires_at_us FROM slots WHERE grant_id = $1",
        )
        .bind(grant_id)
        .execute(&db.pool)
        .await
        .expect("insert another provider's slot");
    }
    let mut tx = db.pool.begin().await.expect("begin");
    super::slots::release(&mut tx, &channel(), &[mine]).await.expect("release");
    tx.commit().await.expect("commit");
    let left: Vec<(uuid::Uuid, String)> = sqlx::query_as(
        "SELECT grant_id, provider FROM slots UNION ALL SELECT grant_id, provider FROM other_provider_slots ORDER BY 2",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read the slots");
    assert_eq!(left, vec![(other, "img".to_owned()), (other, "llm".to_owned())]);
}

#[tokio::test]
async fn unfinished_tasks_are_counted_by_state_with_every_unfinished_state_named() {
    let db = test_schema::fresh().await;
    for state in [TaskState::Queued, TaskState::Queued, TaskState::NeedsHuman, TaskState::Succeeded, TaskState::Failed]
    {
        let mut lifecycle = Task::accepted(ACCEPTED_AT, None, None);
        lifecycle.state = state;
        insert_task(&db.pool, "image.caption", &lifecycle).await;
    }
    let counted = unfinished_by_state(&db.pool).await.expect("count");
    let expected: Vec<(TaskState, i64)> = TaskState::ALL
        .iter()
        .filter(|s| !s.is_final())
        .map(|s| {
            (
                *s,
                match s {
                    TaskState::Queued => 2,
                    TaskState::NeedsHuman => 1,
                    _ => 0,
                },
            )
        })
        .collect();
    assert_eq!(counted, expected);
    assert_eq!(counted.len(), 6, "queued, waiting, running, awaiting_approval, outcome_unknown, needs_human");
}
