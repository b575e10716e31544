//! Listing a tenant's tasks with filters and a stable cursor, and the counts by state.

use std::collections::BTreeMap;

use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::TaskState;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::auth::Tenant;
use crate::problem::ApiError;

use super::submission::nul_refused;
use super::views::{Row, SELECT_ROWS, TaskView};

/// Filters of `GET /v1/tasks`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only tasks in this state.
    pub state: Option<String>,
    /// Only tasks of this kind.
    pub kind: Option<String>,
    /// `key:value`, a label the task carries.
    pub label: Option<String>,
    /// Accepted at or after (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub since: Option<OffsetDateTime>,
    /// Accepted before (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
    /// Page size, 1 to 200 (default 50).
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// One page of tasks, newest first.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Page {
    pub tasks: Vec<TaskView>,
    /// Pass as `cursor` for the next page; absent on the last one.
    pub next_cursor: Option<String>,
}

/// The filters a listing and the counts share, checked.
#[derive(Debug)]
struct Filter {
    kind: Option<String>,
    /// `{key: value}`, for `labels @>`.
    label: Option<serde_json::Value>,
    since: Option<OffsetDateTime>,
    until: Option<OffsetDateTime>,
}

impl Filter {
    fn parse(
        kind: Option<String>,
        label: Option<String>,
        since: Option<OffsetDateTime>,
        until: Option<OffsetDateTime>,
    ) -> Result<Self, ApiError> {
        // Postgres cannot compare text holding a NUL character: refused here, not a 500.
        for (name, value) in [("kind", &kind), ("label", &label)] {
            if value.as_deref().is_some_and(|v| v.contains('\0')) {
                return Err(nul_refused(name));
            }
        }
        let label = match &label {
            Some(raw) => {
                let (k, v) =
                    raw.split_once(':').ok_or_else(|| ApiError::InvalidRequest("label: expected key:value".into()))?;
                Some(serde_json::json!({ k: v }))
            }
            None => None,
        };
        Ok(Filter { kind, label, since, until })
    }
}

/// The conditions of [`Filter`] on `tasks t`, with its values at `$2` to `$5`.
const FILTERED: &str = "t.tenant = $1 \
       AND ($2::text IS NULL OR t.kind = $2) \
       AND ($3::jsonb IS NULL OR t.labels @> $3) \
       AND ($4::timestamptz IS NULL OR t.accepted_at >= $4) \
       AND ($5::timestamptz IS NULL OR t.accepted_at < $5)";

/// Lists the tenant's tasks, newest first, by keyset pagination on the task id
/// (UUIDv7, so creation order): pages stay stable while new tasks arrive.
pub async fn list(pool: &PgPool, tenant: &Tenant, query: ListQuery) -> Result<Page, ApiError> {
    let filter = Filter::parse(query.kind, query.label, query.since, query.until)?;
    if let Some(state) = &query.state {
        state.parse::<TaskState>().map_err(|e| ApiError::InvalidRequest(format!("state: {e}")))?;
    }
    let cursor = match &query.cursor {
        Some(raw) => {
            Some(raw.parse::<TaskId>().map_err(|_| ApiError::InvalidRequest("cursor: not one this API gave".into()))?)
        }
        None => None,
    };
    let limit = i64::from(query.limit.unwrap_or(50));
    if !(1..=200).contains(&limit) {
        return Err(ApiError::InvalidRequest("limit: 1 to 200".into()));
    }
    let rows: Vec<Row> = sqlx::query_as(&format!(
        "{SELECT_ROWS} WHERE {FILTERED} \
           AND ($6::text IS NULL OR coalesce(v.state, 'queued') = $6) \
           AND ($7::uuid IS NULL OR t.task_id < $7) \
         ORDER BY t.task_id DESC LIMIT $8"
    ))
    .bind(tenant.as_str())
    .bind(&filter.kind)
    .bind(&filter.label)
    .bind(filter.since)
    .bind(filter.until)
    .bind(&query.state)
    .bind(cursor.map(|c| c.as_uuid()))
    .bind(limit + 1)
    .fetch_all(pool)
    .await?;
    let more = rows.len() as i64 > limit;
    let tasks: Vec<TaskView> = rows.into_iter().take(limit as usize).map(TaskView::from).collect();
    let next_cursor = if more { tasks.last().map(|t| t.task_id.to_string()) } else { None };
    Ok(Page { tasks, next_cursor })
}

/// Filters of `GET /v1/summary`: those of the listing but the state.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SummaryQuery {
    /// Only tasks of this kind.
    pub kind: Option<String>,
    /// `key:value`, a label the task carries.
    pub label: Option<String>,
    /// Accepted at or after (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub since: Option<OffsetDateTime>,
    /// Accepted before (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
}

/// The caller's tenant and how many of its tasks are in each state.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Summary {
    /// The tenant of the token.
    pub tenant: String,
    /// Every state, with how many of the tenant's tasks (within the filters) are in it.
    pub states: BTreeMap<String, i64>,
}

/// Counts the tenant's tasks by state within the filters.
pub async fn summarise(pool: &PgPool, tenant: &Tenant, query: SummaryQuery) -> Result<Summary, ApiError> {
    let filter = Filter::parse(query.kind, query.label, query.since, query.until)?;
    let counted: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT coalesce(v.state, 'queued'), count(*) FROM tasks t LEFT JOIN task_view v ON v.task_id = t.task_id \
         WHERE {FILTERED} GROUP BY 1"
    ))
    .bind(tenant.as_str())
    .bind(&filter.kind)
    .bind(&filter.label)
    .bind(filter.since)
    .bind(filter.until)
    .fetch_all(pool)
    .await?;
    let mut states: BTreeMap<String, i64> = TaskState::ALL.iter().map(|s| (s.as_str().to_owned(), 0)).collect();
    states.extend(counted);
    Ok(Summary { tenant: tenant.as_str().to_owned(), states })
}
