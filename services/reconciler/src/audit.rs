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

use fenceline_events::Timestamp;
use serde::Serialize;
use sqlx::PgPool;

/// One task the audit found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Finding {
    pub task_id: uuid::Uuid,
    pub finding: String,
    pub state: String,
    pub detail: String,
}

/// Runs one audit and stores its findings; returns them and how many are new.
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
    let known: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT task_id, finding FROM audit_findings").fetch_all(&mut *tx).await?;
    sqlx::query("DELETE FROM audit_findings").execute(&mut *tx).await?;
    let mut new = 0;
    for f in &found {
        if !known.iter().any(|(t, k)| *t == f.task_id && *k == f.finding) {
            new += 1;
            tracing::warn!(task_id = %f.task_id, finding = %f.finding, state = %f.state, detail = %f.detail, "audit finding");
        }
        sqlx::query("INSERT INTO audit_findings (task_id, finding, state, detail) VALUES ($1, $2, $3, $4)")
            .bind(f.task_id)
            .bind(&f.finding)
            .bind(&f.state)
            .bind(&f.detail)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok((found, new))
}

/// The findings of the last audit.
pub async fn findings(pool: &PgPool) -> Result<Vec<Finding>, sqlx::Error> {
    sqlx::query_as("SELECT task_id, finding, state, detail FROM audit_findings ORDER BY finding, task_id")
        .fetch_all(pool)
        .await
}

/// Kinds of finding, as `GET /metrics` counts them.
pub const FINDINGS: [&str; 2] = ["no_live_expectation", "no_progress"];

/// Task states that wait for evidence or a person, as `GET /metrics` counts them.
pub const OPEN_CASE_STATES: [&str; 2] = ["outcome_unknown", "needs_human"];

/// Brings the reconciler's gauges up to date from its tables: the last audit's
/// findings by kind and the tasks the status topic shows waiting for evidence or a
/// person. Run at each scrape of `/metrics`.
pub async fn refresh_gauges(pool: &PgPool) -> Result<(), sqlx::Error> {
    let metrics = &fenceline_telemetry::metrics::global().reconciler;
    let findings: Vec<(String, i64)> =
        sqlx::query_as("SELECT finding, count(*) FROM audit_findings GROUP BY finding").fetch_all(pool).await?;
    for kind in FINDINGS {
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
/// calls, cases, findings and status, `batch` tasks per transaction. Returns how
/// many tasks went. Open tasks are never purged.
pub async fn purge_finished(pool: &PgPool, retention: Duration, batch: i64) -> Result<u64, sqlx::Error> {
    let cutoff = Timestamp::now().0.saturating_sub(i64::try_from(retention.as_micros()).unwrap_or(i64::MAX));
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
