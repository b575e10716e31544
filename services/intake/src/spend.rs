//! What a tenant's paid calls cost: the store behind `GET /v1/spend`, read from the
//! checkpoints intake heard (`task_steps`: provider and cost of each call that did
//! its work), by UTC day and provider, beside the tenant's daily budget.

use fenceline_domain::spend::{Amount, Budget};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use time::{Duration, OffsetDateTime, Time};

use crate::auth::Tenant;
use crate::problem::ApiError;

/// Filters of `GET /v1/spend`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SpendQuery {
    /// Calls checkpointed at or after (RFC 3339; default: the start of the UTC day 29 days ago).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub since: Option<OffsetDateTime>,
    /// Calls checkpointed before (RFC 3339; default: now).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub until: Option<OffsetDateTime>,
}

/// What the caller's tenant spent in a window, by day and provider. Amounts are in
/// the currency's minor unit (cents), to six decimals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpendReport {
    pub tenant: String,
    #[serde(with = "time::serde::rfc3339")]
    pub since: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub until: OffsetDateTime,
    /// Calls that did their work in the window, priced or not.
    pub calls: i64,
    /// Of them, calls the catalogue gives no price: they count nothing in `cost_minor`.
    pub unpriced_calls: i64,
    #[schema(value_type = f64)]
    pub cost_minor: Amount,
    /// By UTC day, then provider.
    pub by_day: Vec<SpendRow>,
    /// The tenant's daily budget and today's spend against it; absent without a budget.
    pub budget: Option<BudgetView>,
}

/// One provider's calls on one UTC day.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpendRow {
    /// `YYYY-MM-DD`, UTC.
    pub day: String,
    pub provider: String,
    pub calls: i64,
    pub unpriced_calls: i64,
    #[schema(value_type = f64)]
    pub cost_minor: Amount,
}

/// A tenant's daily budget as intake sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BudgetView {
    #[schema(value_type = f64)]
    pub per_day_minor: Amount,
    /// What today's (UTC) calls heard so far cost.
    #[schema(value_type = f64)]
    pub spent_today_minor: Amount,
    /// Whether new paid calls wait: today's spend has reached the budget.
    pub spent: bool,
}

/// The spend of `tenant` in the query's window, with its budget.
pub async fn report(
    pool: &PgPool,
    tenant: &Tenant,
    query: SpendQuery,
    budget: Option<&Budget>,
) -> Result<SpendReport, ApiError> {
    let now = OffsetDateTime::now_utc();
    let start_of_today = now.replace_time(Time::MIDNIGHT);
    let since = query.since.unwrap_or(start_of_today - Duration::days(29));
    let until = query.until.unwrap_or(now);
    if since >= until {
        return Err(ApiError::InvalidRequest("`since` must be before `until`".into()));
    }
    let rows: Vec<(String, String, i64, i64, i64)> = sqlx::query_as(
        "SELECT to_char((s.checkpointed_at AT TIME ZONE 'UTC')::date, 'YYYY-MM-DD'), s.provider, count(*), \
                count(*) - count(s.cost_micros), coalesce(sum(s.cost_micros), 0)::bigint \
         FROM task_steps s JOIN tasks t ON t.task_id = s.task_id \
         WHERE t.tenant = $1 AND s.provider IS NOT NULL AND s.checkpointed_at >= $2 AND s.checkpointed_at < $3 \
         GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(tenant.as_str())
    .bind(since)
    .bind(until)
    .fetch_all(pool)
    .await?;
    let by_day: Vec<SpendRow> = rows
        .into_iter()
        .map(|(day, provider, calls, unpriced_calls, micros)| SpendRow {
            day,
            provider,
            calls,
            unpriced_calls,
            cost_minor: Amount::from_micros(micros),
        })
        .collect();
    let budget = match budget {
        None => None,
        Some(budget) => {
            let micros: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(s.cost_micros), 0)::bigint FROM task_steps s JOIN tasks t ON t.task_id = s.task_id \
                 WHERE t.tenant = $1 AND s.cost_micros IS NOT NULL AND s.checkpointed_at >= $2",
            )
            .bind(tenant.as_str())
            .bind(start_of_today)
            .fetch_one(pool)
            .await?;
            let spent_today = Amount::from_micros(micros);
            Some(BudgetView {
                per_day_minor: budget.per_day_minor,
                spent_today_minor: spent_today,
                spent: spent_today >= budget.per_day_minor,
            })
        }
    };
    Ok(SpendReport {
        tenant: tenant.as_str().to_owned(),
        since,
        until,
        calls: by_day.iter().map(|row| row.calls).sum(),
        unpriced_calls: by_day.iter().map(|row| row.unpriced_calls).sum(),
        cost_minor: by_day.iter().fold(Amount::ZERO, |sum, row| sum.saturating_add(row.cost_minor)),
        by_day,
        budget,
    })
}
