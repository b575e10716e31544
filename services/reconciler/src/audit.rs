//! The audit: compares what the status topic says of each task with the
//! reconciler's own expectations, periodically and on demand. Findings:
//!
//! - `no_live_expectation`: the task shows `running`, but no grant of it is live
//!   and no case about it is open: nothing will ever move it on.
//! - `no_progress`: the task shows `queued` or `waiting` and its status has not
//!   changed for longer than the threshold.
//!
//! Each audit replaces the findings table; new findings are logged, all are served
//! at `GET /v1/audit` (behind the audit token: it lists every tenant's tasks),
//! counted by kind at `GET /metrics` (no task named there) and listed by
//! `fenceline-reconciler audit`.

use std::time::Duration;

use fenceline_domain::vocabulary::{AuditFinding, TaskState};
use fenceline_events::Timestamp;
use fenceline_store::word::Stored;
use serde::Serialize;
use sqlx::PgPool;

/// One task the audit found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Finding {
    pub task_id: uuid::Uuid,
    #[sqlx(try_from = "String")]
    pub finding: AuditFinding,
    #[sqlx(try_from = "String")]
    pub state: TaskState,
    pub detail: String,
}

/// Runs one audit and stores its findings in place of the last one's; returns
/// them and how many are new.
pub async fn run(pool: &PgPool, no_progress: Duration, grace: Duration) -> Result<(Vec<Finding>, usize), sqlx::Error> {
    let now = Timestamp::now().0;
    let stale_before = now - i64::try_from(no_progress.as_micros()).unwrap_or(i64::MAX / 4);
    let settled_before = now - i64::try_from(grace.as_micros()).unwrap_or(i64::MAX / 4);
    let mut tx = pool.begin().await?;
    let found: Vec<Finding> = sqlx::query_as(
        "SELECT s.task_id, 'no_live_expectation' AS finding, s.state, \
                'shows running since ' || to_char(to_timestamp(s.updated_at_us / 1e6) AT TIME ZONE 'UTC', \
                'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') || ' with no live grant and no open case' AS detail \
         FROM task_states s \
         WHERE s.state = 'running' AND s.updated_at_us < $2 \
           AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.task_id = s.task_id AND NOT g.ended) \
           AND NOT EXISTS (SELECT 1 FROM cases c WHERE c.task_id = s.task_id AND c.state = 'asking') \
         UNION ALL \
         SELECT s.task_id, 'no_progress', s.state, \
                'no change for ' || ((($3 - s.updated_at_us) / 1000000)::bigint) || ' s' \
         FROM task_states s \
         WHERE s.state IN ('queued', 'waiting') AND s.updated_at_us < $1",
    )
    .bind(stale_before)
    .bind(settled_before)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    // This audit's findings take the place of the last one's in one statement,
    // which answers which were not known before; a finding still there keeps
    // when it was first detected.
    let (task_ids, findings, states, details): (Vec<_>, Vec<_>, Vec<_>, Vec<_>) =
        found.iter().map(|f| (f.task_id, f.finding.as_str(), f.state.as_str(), f.detail.as_str())).collect();
    let new: Vec<(uuid::Uuid, Stored<AuditFinding>)> = sqlx::query_as(
        "WITH found AS (SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]) \
                        AS f (task_id, finding, state, detail)), \
              gone AS (DELETE FROM audit_findings a WHERE NOT EXISTS \
                        (SELECT 1 FROM found f WHERE f.task_id = a.task_id AND f.finding = a.finding)), \
              stored AS (INSERT INTO audit_findings (task_id, finding, state, detail) SELECT * FROM found \
                         ON CONFLICT (task_id, finding) DO UPDATE SET state = EXCLUDED.state, detail = EXCLUDED.detail \
                         RETURNING task_id, finding, xmax = 0 AS inserted) \
         SELECT task_id, finding FROM stored WHERE inserted",
    )
    .bind(&task_ids)
    .bind(&findings)
    .bind(&states)
    .bind(&details)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    for f in found.iter().filter(|f| new.contains(&(f.task_id, Stored(f.finding)))) {
        tracing::warn!(task_id = %f.task_id, finding = %f.finding, state = %f.state, detail = %f.detail, "audit finding");
    }
    Ok((found, new.len()))
}

/// The findings of the last audit.
pub async fn findings(pool: &PgPool) -> Result<Vec<Finding>, sqlx::Error> {
    sqlx::query_as("SELECT task_id, finding, state, detail FROM audit_findings ORDER BY finding, task_id")
        .fetch_all(pool)
        .await
}

/// Task states that wait for evidence or a person, as `GET /metrics` counts them.
pub const OPEN_CASE_STATES: [&str; 2] = ["outcome_unknown", "needs_human"];

/// Brings the reconciler's gauges up to date from its tables: the last audit's
/// findings by kind and the tasks the status topic shows waiting for evidence or a
/// person. Run at each scrape of `/metrics`.
pub async fn refresh_gauges(pool: &PgPool) -> Result<(), sqlx::Error> {
    let metrics = &fenceline_telemetry::metrics::global().reconciler;
    let findings: Vec<(String, i64)> =
        sqlx::query_as("SELECT finding, count(*) FROM audit_findings GROUP BY finding").fetch_all(pool).await?;
    for kind in AuditFinding::ALL.iter().map(|kind| kind.as_str()) {
        let n = findings.iter().find(|(k, _)| k == kind).map_or(0, |(_, n)| *n);
        metrics
            .audit_findings
            .get_or_create(&fenceline_telemetry::metrics::FindingLabels { finding: kind.into() })
            .set(n);
    }
    let open: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM task_states WHERE state = ANY($1) GROUP BY state")
            .bind(&OPEN_CASE_STATES[..])
            .fetch_all(pool)
            .await?;
    for state in OPEN_CASE_STATES {
        let n = open.iter().find(|(k, _)| k == state).map_or(0, |(_, n)| *n);
        metrics.open_cases.get_or_create(&fenceline_telemetry::metrics::StateLabels { state: state.into() }).set(n);
    }
    Ok(())
}

/// Deletes the reconciler's rows of tasks that finished (`succeeded`, `failed`,
/// `cancelled` on the status topic) longer than `retention` ago: their grants,
/// calls, cases, findings and status, `batch` tasks per transaction, and what was
/// heard of grants that never arrived, as long ago. Returns how many tasks went.
/// Open tasks are never purged.
pub async fn purge_finished(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64, sqlx::Error> {
    let cutoff = Timestamp::now().0.saturating_sub(i64::try_from(retention.as_micros()).unwrap_or(i64::MAX));
    // What was heard of a grant that never arrived: no task's row names it.
    sqlx::query("DELETE FROM early_grant_facts WHERE heard_at < now() - make_interval(secs => $1)")
        .bind(retention.as_secs_f64())
        .execute(pool)
        .await?;
    let mut purged = 0;
    loop {
        let mut tx = pool.begin().await?;
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT task_id FROM task_states WHERE state IN ('succeeded', 'failed', 'cancelled') \
             AND updated_at_us < $1 ORDER BY updated_at_us LIMIT $2",
        )
        .bind(cutoff)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        for table in ["grants", "calls", "cases", "fenced_results", "early_losses", "audit_findings", "task_states"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE task_id = ANY($1)")).bind(&ids).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        purged += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(purged);
        }
    }
}

#[cfg(test)]
mod tests;
