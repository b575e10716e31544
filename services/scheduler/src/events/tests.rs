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
    let keys = [named.to_string(), "not a task".to_owned(), other.to_string(), TaskId::new_v7().to_string()];
    let mut keys: Vec<&[u8]> = keys.iter().map(|key| key.as_bytes()).collect();
    keys.push(keys[0]);
    let mut tx = db.pool.begin().await.expect("begin");
    held.lock_keyed(&mut tx, &keys).await.expect("lock the batch's tasks");

    let mut locked: Vec<TaskId> = held.held().keys().copied().collect();
    locked.sort_by_key(|id| id.as_uuid());
    let mut expected = vec![named, other];
    expected.sort_by_key(|id| id.as_uuid());
    assert_eq!(locked, expected, "the named tasks that exist are held");
    assert!(held.take_changed().is_empty(), "holding a row changes nothing");
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
