//! `/v1/spend`: what the caller's tenant's paid calls cost.

use actix_web::{HttpResponse, web};
use sqlx::PgPool;

use super::State;
use crate::auth::Caller;
use crate::problem::{self, ApiError};
use crate::spend;

/// What the caller's tenant's paid calls cost, by UTC day and provider, and its
/// daily budget (docs/catalog.md, "Prices, spend and budgets").
#[utoipa::path(
    get, path = "/v1/spend", tag = "tasks",
    params(spend::SpendQuery),
    responses(
        (status = 200, description = "The spend in the window", body = spend::SpendReport),
        (status = 400, description = "A bad window", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or bad token", body = problem::Problem, content_type = "application/problem+json"),
        (status = 431, description = "A header over its limit", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its request rate", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds until the tenant's next request is admitted"))),
        (status = 503, description = "Intake serves as many requests as it may at once", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds to wait before trying again"))),
    ),
)]
pub(crate) async fn spend(
    caller: Caller,
    state: web::Data<State>,
    pool: web::Data<PgPool>,
    query: web::Query<spend::SpendQuery>,
) -> Result<HttpResponse, ApiError> {
    let budget = state.kinds.budget_of(caller.0.as_str());
    Ok(HttpResponse::Ok().json(spend::report(&pool, &caller.0, query.into_inner(), budget).await?))
}
