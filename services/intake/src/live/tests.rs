//! Live changes: the frames a stream sends, and, against a schema of its own, the
//! marks a consumer's batch writes.

use super::*;

#[test]
fn a_frame_is_one_server_sent_event() {
    assert_eq!(frame("task", Some(42), r#"{"a":1}"#), Bytes::from("id: 42\nevent: task\ndata: {\"a\":1}\n\n"));
    assert_eq!(frame("reset", None, "{}"), Bytes::from("event: reset\ndata: {}\n\n"));
}

/// `count` tasks accepted, of `acme` and `globex` in turn; the first half also has
/// a status in `task_view`. Their ids, in that order.
async fn tasks_of_two_tenants(pool: &PgPool, count: i32) -> Vec<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO tasks (task_id, tenant, kind, input, priority, labels, source, accepted_at) \
         SELECT gen_random_uuid(), CASE WHEN i % 2 = 0 THEN 'acme' ELSE 'globex' END, 'image.generate', '{}', \
           'normal', '{}', 'api', now() FROM generate_series(0, $1 - 1) i ORDER BY i RETURNING task_id",
    )
    .bind(count)
    .fetch_all(pool)
    .await
    .expect("insert tasks");
    sqlx::query(
        "INSERT INTO task_view (task_id, tenant, kind, state, attempt, updated_at, version) \
         SELECT task_id, tenant, kind, 'queued', 0, now(), 1 FROM tasks WHERE task_id = ANY($1)",
    )
    .bind(&ids[..ids.len() / 2])
    .execute(pool)
    .await
    .expect("insert their statuses");
    ids
}

/// A batch marks each task with its own tenant, given or looked up by the task's
/// key (in its status or, before it has one, in the task); a task intake does not
/// know is not marked. However many tasks the batch marks, the statement reads no
/// table whole: a batch of 300 beside 2,000 tasks joined with them would.
#[tokio::test]
async fn a_batch_marks_each_task_with_its_tenant_and_reads_no_table_whole() {
    let pool =
        fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool;
    let ids = tasks_of_two_tenants(&pool, 2_000).await;
    let tenant_of = |i: usize| if i.is_multiple_of(2) { "acme" } else { "globex" };
    let marks = BatchMarks::default();
    // Every third given, the others looked up: some in `task_view`, some in `tasks`.
    let marked: Vec<usize> = (0..300).chain(1_700..1_800).collect();
    for &i in &marked {
        marks.mark(TaskId::from_uuid(ids[i]), i.is_multiple_of(3).then(|| tenant_of(i)));
    }
    let stranger = TaskId::new_v7();
    marks.mark(stranger, None);

    let mut tx = pool.begin().await.expect("begin");
    marks.flush(&mut tx).await.expect("mark");
    let read_whole: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_xact_user_tables \
         WHERE schemaname = current_schema() AND relname IN ('tasks', 'task_view')",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("the transaction's scans");
    let mut written: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT task_id, tenant FROM task_changes WHERE changed_by = pg_current_xact_id()")
            .fetch_all(&mut *tx)
            .await
            .expect("the marks");
    tx.commit().await.expect("commit");

    assert_eq!(read_whole, 0, "rows of tasks and task_view read by sequential scans");
    let mut expected: Vec<(uuid::Uuid, String)> = marked.iter().map(|&i| (ids[i], tenant_of(i).to_owned())).collect();
    expected.sort();
    written.sort();
    assert_eq!(written, expected, "each known task marked once, with its own tenant; the stranger not at all");
}
