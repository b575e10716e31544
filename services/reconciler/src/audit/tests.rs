//! The audit and the reconciler's retention against a schema of their own: a task
//! shown running with nothing live to move it on, and one queued without change for
//! too long, are found; a finding is new only the first audit that finds it, and
//! goes once the task is no longer wrong; only finished tasks past the retention
//! lose their rows.

use sqlx::PgPool;

use super::*;

/// A new schema holding the bus tables and the reconciler's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

const MINUTE: Duration = Duration::from_secs(60);
const MINUTE_US: i64 = 60_000_000;

/// A task the status topic showed in `state`, last changed `age_us` ago.
async fn task_state(pool: &PgPool, state: &str, age_us: i64) -> uuid::Uuid {
    let task_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO task_states (task_id, tenant, kind, state, version, updated_at_us) \
         VALUES ($1, 'acme', 'image.generate', $2, 4, $3)",
    )
    .bind(task_id)
    .bind(state)
    .bind(Timestamp::now().0 - age_us)
    .execute(pool)
    .await
    .expect("insert a task state");
    task_id
}

async fn grant_of(pool: &PgPool, task_id: uuid::Uuid, ended: bool) {
    sqlx::query(
        "INSERT INTO grants (grant_id, task_id, attempt, kind, provider, granted, ended, claim_deadline_us) \
         VALUES ($1, $2, 1, 'image.generate', 'img', '{}', $3, 0)",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(task_id)
    .bind(ended)
    .execute(pool)
    .await
    .expect("insert a grant");
}

async fn case_of(pool: &PgPool, task_id: uuid::Uuid, state: &str) {
    sqlx::query(
        "INSERT INTO cases (case_id, task_id, attempt, kind, last_phase, last_phase_at_us, state, ask_until_us) \
         VALUES ($1, $2, 1, 'image.generate', 'intent_recorded', 0, $3, 0)",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(task_id)
    .bind(state)
    .execute(pool)
    .await
    .expect("insert a case");
}

fn kinds(findings: &[Finding]) -> Vec<(uuid::Uuid, &str, &str)> {
    let mut kinds: Vec<_> = findings.iter().map(|f| (f.task_id, f.finding.as_str(), f.state.as_str())).collect();
    kinds.sort();
    kinds
}

#[tokio::test]
async fn the_audit_finds_what_nothing_will_move_and_a_finding_is_new_once() {
    let pool = fresh_schema().await;
    let stuck = task_state(&pool, "running", 2 * MINUTE_US).await;
    let stalled = task_state(&pool, "queued", 2 * MINUTE_US).await;
    // Running with a live grant or an open case, or only just: something will move it.
    let with_grant = task_state(&pool, "running", 2 * MINUTE_US).await;
    grant_of(&pool, with_grant, false).await;
    let with_case = task_state(&pool, "running", 2 * MINUTE_US).await;
    case_of(&pool, with_case, "asking").await;
    let just_now = task_state(&pool, "running", 1_000_000).await;
    // A grant that ended and a decided case move nothing.
    let ended = task_state(&pool, "running", 2 * MINUTE_US).await;
    grant_of(&pool, ended, true).await;
    case_of(&pool, ended, "decided").await;
    task_state(&pool, "waiting", 1_000_000).await;
    task_state(&pool, "succeeded", 60 * MINUTE_US).await;
    task_state(&pool, "needs_human", 60 * MINUTE_US).await;

    let (found, new) = run(&pool, MINUTE, MINUTE).await.expect("audit");
    let mut expected = vec![
        (stuck, "no_live_expectation", "running"),
        (ended, "no_live_expectation", "running"),
        (stalled, "no_progress", "queued"),
    ];
    expected.sort();
    assert_eq!(kinds(&found), expected, "not {with_grant}, {with_case} nor {just_now}");
    assert_eq!(new, 3);
    let stalled_detail = &found.iter().find(|f| f.task_id == stalled).expect("the stalled task").detail;
    assert!(stalled_detail.starts_with("no change for 12"), "{stalled_detail}");
    assert_eq!(kinds(&findings(&pool).await.expect("the findings")), expected, "stored as found");

    let (again, new) = run(&pool, MINUTE, MINUTE).await.expect("audit again");
    assert_eq!((kinds(&again), new), (expected.clone(), 0), "known findings are not new");

    // The stuck task gets a live grant; another stalls.
    grant_of(&pool, stuck, false).await;
    let stalled_too = task_state(&pool, "waiting", 3 * MINUTE_US).await;
    let (third, new) = run(&pool, MINUTE, MINUTE).await.expect("a third audit");
    let mut expected = vec![
        (ended, "no_live_expectation", "running"),
        (stalled, "no_progress", "queued"),
        (stalled_too, "no_progress", "waiting"),
    ];
    expected.sort();
    assert_eq!(kinds(&third), expected);
    assert_eq!(new, 1);
    assert_eq!(kinds(&findings(&pool).await.expect("the findings")), expected, "a finding no longer true is gone");
}

/// Every table of the reconciler's that holds a row of `task_id`.
async fn tables_holding(pool: &PgPool, task_id: uuid::Uuid) -> Vec<&'static str> {
    let mut holding = Vec::new();
    for table in ["grants", "calls", "cases", "fenced_results", "early_losses", "audit_findings", "task_states"] {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table} WHERE task_id = $1"))
            .bind(task_id)
            .fetch_one(pool)
            .await
            .expect("count");
        if n > 0 {
            holding.push(table);
        }
    }
    holding
}

async fn every_row_of(pool: &PgPool, task_id: uuid::Uuid) {
    grant_of(pool, task_id, true).await;
    case_of(pool, task_id, "decided").await;
    for statement in [
        "INSERT INTO calls (task_id, attempt, step, provider, operation_key, intent_at_us) \
         VALUES ($1, 1, 'render', 'img', 'op', 0)",
        "INSERT INTO fenced_results (task_id, attempt, step, operation_key, report) VALUES ($1, 1, 'render', 'op', '{}')",
        "INSERT INTO early_losses (task_id, attempt, lost) VALUES ($1, 2, '{}')",
        "INSERT INTO audit_findings (task_id, finding, state, detail) VALUES ($1, 'no_progress', 'queued', '')",
    ] {
        sqlx::query(statement).bind(task_id).execute(pool).await.expect("insert a row");
    }
}

#[tokio::test]
async fn only_finished_tasks_past_the_retention_lose_their_rows() {
    let pool = fresh_schema().await;
    let day = 24 * 60 * MINUTE_US;
    let mut gone = Vec::new();
    for state in ["succeeded", "failed", "cancelled"] {
        gone.push(task_state(&pool, state, 31 * day).await);
    }
    let mut kept = Vec::new();
    for (state, age) in
        [("running", 90 * day), ("outcome_unknown", 90 * day), ("needs_human", 90 * day), ("succeeded", 29 * day)]
    {
        kept.push(task_state(&pool, state, age).await);
    }
    for task_id in gone.iter().chain(&kept) {
        every_row_of(&pool, *task_id).await;
    }

    let purged = purge_finished(&pool, Duration::from_secs(30 * 86_400), 2).await.expect("purge");
    assert_eq!(purged, 3);
    for task_id in gone {
        assert!(tables_holding(&pool, task_id).await.is_empty(), "{task_id} is gone everywhere");
    }
    let all = ["grants", "calls", "cases", "fenced_results", "early_losses", "audit_findings", "task_states"];
    for task_id in kept {
        assert_eq!(tables_holding(&pool, task_id).await, all, "{task_id} keeps every row");
    }
    assert_eq!(purge_finished(&pool, Duration::from_secs(30 * 86_400), 2).await.expect("purge again"), 0);
}

#[tokio::test]
async fn what_was_heard_of_a_grant_that_never_arrived_goes_after_the_retention() {
    let pool = fresh_schema().await;
    let (old, recent) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    sqlx::query(
        "INSERT INTO early_grant_facts (grant_id, claimed, heard_at) \
         VALUES ($1, true, now() - interval '31 days'), ($2, true, now() - interval '29 days')",
    )
    .bind(old)
    .bind(recent)
    .execute(&pool)
    .await
    .expect("insert early facts");
    purge_finished(&pool, Duration::from_secs(30 * 86_400), 2).await.expect("purge");
    let left: Vec<uuid::Uuid> =
        sqlx::query_scalar("SELECT grant_id FROM early_grant_facts").fetch_all(&pool).await.expect("read");
    assert_eq!(left, [recent]);
}
