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
    let found: HashMap<uuid::Uuid, (String, Option<AdaptiveLimit>)> =
        found.into_iter().map(|(grant_id, provider, state)| (grant_id, (provider, state.map(|json| json.0)))).collect();
    // Each provider's limit as read and its outcomes, in the batch's order; providers
    // in name order, so that two batches lock their limits in one order.
    let mut by_provider: BTreeMap<&str, Heard> = BTreeMap::new();
    for outcome in outcomes {
        if let Some((provider, stored)) = found.get(&outcome.grant_id.as_uuid()) {
            by_provider.entry(provider.as_str()).or_insert((*stored, Vec::new())).1.push((outcome.health, outcome.at));
        }
    }
    for (provider, (stored, seen)) in by_provider {
        let Some(policy) = catalog.provider(provider).and_then(|p| p.adaptive_policy()) else {
            continue;
        };
        let read = stored.unwrap_or_else(|| AdaptiveLimit::full(&policy));
        if moves(read, &seen, &policy)
            .iter()
            .all(|(before, after, change)| after == before && *change == Change::Unchanged)
        {
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
        let steps = moves(current.0, &seen, &policy);
        for (before, after, change) in &steps {
            if after != before {
                log_change(provider, after, *change, &policy);
            }
        }
        let next = steps.last().map_or(current.0, |(_, after, _)| *after);
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

/// A provider's limit as a batch read it (none: never moved), and the batch's
/// outcomes at that provider in the order heard.
type Heard = (Option<AdaptiveLimit>, Vec<(Health, Micros)>);

/// Each outcome's move of the limit, in order from `limit`: the limit before it,
/// after it, and the change.
fn moves(
    limit: AdaptiveLimit,
    outcomes: &[(Health, Micros)],
    policy: &AdaptivePolicy,
) -> Vec<(AdaptiveLimit, AdaptiveLimit, Change)> {
    let mut now = limit;
    (outcomes.iter())
        .map(|(health, at)| {
            let (next, change) = now.observe(*health, *at, policy);
            let step = (now, next, change);
            now = next;
            step
        })
        .collect()
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
