//! Each provider's adaptive concurrency limit (docs/execution.md, "Adaptive
//! concurrency"): attempt outcomes move it (the arithmetic is
//! `fenceline_domain::limits`), the dispatcher grants no more slots than it allows.
//! One row per provider in `provider_limits`, shared by every scheduler instance.

use std::collections::{BTreeMap, HashMap};

use fenceline_config::catalog::Catalog;
use fenceline_domain::ids::GrantId;
use fenceline_domain::lifecycle::Micros;
use fenceline_domain::limits::{AdaptiveLimit, AdaptivePolicy, Change, Health};
use sqlx::PgConnection;
use sqlx::types::Json;
use tracing::{debug, info, warn};

/// One attempt outcome as the adaptive limit takes it: the grant whose slot names
/// the provider, what the outcome says of it, and when.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub grant_id: GrantId,
    pub health: Health,
    pub at: Micros,
}

/// Moves the limit of the provider whose slot `grant_id` holds by one attempt
/// outcome, in the caller's transaction ([`observe_all`]).
pub async fn observe(
    tx: &mut PgConnection,
    catalog: &Catalog,
    grant_id: GrantId,
    health: Health,
    now: Micros,
) -> Result<(), sqlx::Error> {
    observe_all(tx, catalog, &[Outcome { grant_id, health, at: now }]).await
}

/// Moves each provider's limit by the attempt outcomes of a batch, in their order,
/// in the caller's transaction: a grant's provider is its slot's (of an attempt that
/// calls several providers, the first one's, the grant's provider). Call it before
/// the slots are released: an outcome whose slot is gone (a stale or repeated event)
/// says nothing new. The slots and their providers' limits are read with one
/// statement and without a lock: a healthy provider at its ceiling stays there, and
/// most batches then write nothing (no row lock shared by every consumer).
pub async fn observe_all(tx: &mut PgConnection, catalog: &Catalog, outcomes: &[Outcome]) -> Result<(), sqlx::Error> {
    if outcomes.is_empty() {
        return Ok(());
    }
    let grants: Vec<uuid::Uuid> = outcomes.iter().map(|o| o.grant_id.as_uuid()).collect();
    let found: Vec<(uuid::Uuid, String, Option<Json<AdaptiveLimit>>)> = sqlx::query_as(
        "SELECT s.grant_id, s.provider, l.state FROM slots s LEFT JOIN provider_limits l ON l.provider = s.provider \
         WHERE s.grant_id = ANY($1)",
    )
    .bind(&grants)
    .fetch_all(&mut *tx)
    .await?;
    let mut provider_of = HashMap::new();
    let mut stored = HashMap::new();
    for (grant_id, provider, state) in found {
        stored.insert(provider.clone(), state.map(|json| json.0));
        provider_of.insert(grant_id, provider);
    }
    // Each adapting provider's outcomes, in the batch's order; providers in name order,
    // so that two batches lock their limits in one order.
    let mut by_provider: BTreeMap<&str, Vec<(Health, Micros)>> = BTreeMap::new();
    for outcome in outcomes {
        if let Some(provider) = provider_of.get(&outcome.grant_id.as_uuid()) {
            by_provider.entry(provider.as_str()).or_default().push((outcome.health, outcome.at));
        }
    }
    for (provider, seen) in by_provider {
        let Some(policy) = catalog.provider(provider).and_then(|p| p.adaptive_policy()) else {
            continue;
        };
        let read = stored.get(provider).copied().flatten().unwrap_or_else(|| AdaptiveLimit::full(&policy));
        if moves_nothing(read, &seen, &policy) {
            continue;
        }
        sqlx::query("INSERT INTO provider_limits (provider, state) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(provider)
            .bind(Json(AdaptiveLimit::full(&policy)))
            .execute(&mut *tx)
            .await?;
        let current: Json<AdaptiveLimit> =
            sqlx::query_scalar("SELECT state FROM provider_limits WHERE provider = $1 FOR UPDATE")
                .bind(provider)
                .fetch_one(&mut *tx)
                .await?;
        let mut next = current.0;
        for (health, at) in &seen {
            let (moved, change) = next.observe(*health, *at, &policy);
            if moved != next {
                log_change(provider, &moved, change, &policy);
            }
            next = moved;
        }
        if next == current.0 {
            continue;
        }
        sqlx::query("UPDATE provider_limits SET state = $2, updated_at = now() WHERE provider = $1")
            .bind(provider)
            .bind(Json(next))
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Whether no one of `outcomes`, taken in order from `limit`, changes anything.
fn moves_nothing(limit: AdaptiveLimit, outcomes: &[(Health, Micros)], policy: &AdaptivePolicy) -> bool {
    let mut now = limit;
    for (health, at) in outcomes {
        let (next, change) = now.observe(*health, *at, policy);
        if (next, change) != (now, Change::Unchanged) {
            return false;
        }
        now = next;
    }
    true
}

fn log_change(provider: &str, next: &AdaptiveLimit, change: Change, policy: &AdaptivePolicy) {
    let (limit, ceiling) = (next.slots(policy), policy.ceiling);
    match change {
        Change::Decreased => warn!(
            provider = %provider,
            limit,
            ceiling,
            "provider limit reduced: {}",
            next.describe(provider, policy).unwrap_or_default()
        ),
        Change::Recovered => info!(provider = %provider, limit, ceiling, "provider limit back at its ceiling"),
        Change::Increased => info!(provider = %provider, limit, ceiling, "provider limit raised after successes"),
        Change::Unchanged => debug!(provider = %provider, limit, ceiling, "provider limit moved within a slot"),
    }
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
