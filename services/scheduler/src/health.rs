//! Each provider's adaptive concurrency limit (docs/execution.md, "Adaptive
//! concurrency"): attempt outcomes move it (the arithmetic is
//! `fenceline_domain::limits`), the dispatcher grants no more slots than it allows.
//! One row per provider in `provider_limits`, shared by every scheduler instance.

use fenceline_config::catalog::Catalog;
use fenceline_domain::ids::GrantId;
use fenceline_domain::lifecycle::Micros;
use fenceline_domain::limits::{AdaptiveLimit, AdaptivePolicy, Change, Health};
use sqlx::PgConnection;
use sqlx::types::Json;
use tracing::{debug, info, warn};

/// Moves the limit of the provider whose slot `grant_id` holds by one attempt
/// outcome, in the caller's transaction; of an attempt that calls several
/// providers, the first one's (the grant's provider). Call it before the slot is released: an
/// outcome whose slot is gone (a stale or repeated event) says nothing new.
pub async fn observe(
    tx: &mut PgConnection,
    catalog: &Catalog,
    grant_id: GrantId,
    health: Health,
    now: Micros,
) -> Result<(), sqlx::Error> {
    // The slot's provider and its limit, read without a lock first: a healthy
    // provider at its ceiling stays there, and most outcomes then write nothing (no
    // row lock shared by every consumer).
    let found: Option<(String, Option<Json<AdaptiveLimit>>)> = sqlx::query_as(
        "SELECT s.provider, l.state FROM slots s LEFT JOIN provider_limits l ON l.provider = s.provider \
         WHERE s.grant_id = $1",
    )
    .bind(grant_id.as_uuid())
    .fetch_optional(&mut *tx)
    .await?;
    let Some((provider, policy, stored)) = found.and_then(|(name, stored)| {
        let policy = catalog.provider(&name)?.adaptive_policy()?;
        Some((name, policy, stored))
    }) else {
        return Ok(());
    };
    let seen = stored.map_or_else(|| AdaptiveLimit::full(&policy), |json| json.0);
    if seen.observe(health, now, &policy) == (seen, Change::Unchanged) {
        return Ok(());
    }
    sqlx::query("INSERT INTO provider_limits (provider, state) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(&provider)
        .bind(Json(AdaptiveLimit::full(&policy)))
        .execute(&mut *tx)
        .await?;
    let current: Json<AdaptiveLimit> =
        sqlx::query_scalar("SELECT state FROM provider_limits WHERE provider = $1 FOR UPDATE")
            .bind(&provider)
            .fetch_one(&mut *tx)
            .await?;
    let (next, change) = current.0.observe(health, now, &policy);
    if next == current.0 {
        return Ok(());
    }
    sqlx::query("UPDATE provider_limits SET state = $2, updated_at = now() WHERE provider = $1")
        .bind(&provider)
        .bind(Json(next))
        .execute(&mut *tx)
        .await?;
    let (limit, ceiling) = (next.slots(&policy), policy.ceiling);
    match change {
        Change::Decreased => warn!(
            provider = %provider,
            limit,
            ceiling,
            "provider limit reduced: {}",
            next.describe(&provider, &policy).unwrap_or_default()
        ),
        Change::Recovered => info!(provider = %provider, limit, ceiling, "provider limit back at its ceiling"),
        Change::Increased => info!(provider = %provider, limit, ceiling, "provider limit raised after successes"),
        Change::Unchanged => debug!(provider = %provider, limit, ceiling, "provider limit moved within a slot"),
    }
    Ok(())
}

/// The provider's limit now (full when no outcome has moved it yet).
pub async fn read(
    tx: &mut PgConnection,
    provider: &str,
    policy: &AdaptivePolicy,
) -> Result<AdaptiveLimit, sqlx::Error> {
    let stored: Option<Json<AdaptiveLimit>> =
        sqlx::query_scalar("SELECT state FROM provider_limits WHERE provider = $1")
            .bind(provider)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(stored.map_or_else(|| AdaptiveLimit::full(policy), |json| json.0))
}

#[cfg(test)]
mod tests;
