//! The store of `tenant_spend`: what each tenant's paid calls cost per UTC day, added
//! up from the executor's checkpoints, which the dispatcher holds a budget against.

use fenceline_domain::spend::Amount;
use fenceline_events::Timestamp;
use sqlx::PgConnection;

/// Adds what one checkpointed call cost to its tenant's day (the checkpoint's
/// instant, in UTC). Each checkpoint is applied once: the consumer dedupes events.
pub async fn add(tx: &mut PgConnection, tenant: &str, at: Timestamp, cost: Amount) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO tenant_spend (tenant, day, cost_micros) \
         VALUES ($1, (to_timestamp($2::double precision / 1e6) AT TIME ZONE 'UTC')::date, $3) \
         ON CONFLICT (tenant, day) DO UPDATE SET cost_micros = tenant_spend.cost_micros + EXCLUDED.cost_micros",
    )
    .bind(tenant)
    .bind(at.0)
    .bind(cost.micros())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What `tenant`'s calls have cost today (UTC, by the database's clock).
pub async fn today(tx: &mut PgConnection, tenant: &str) -> Result<Amount, sqlx::Error> {
    let micros: Option<i64> = sqlx::query_scalar(
        "SELECT cost_micros FROM tenant_spend WHERE tenant = $1 AND day = (now() AT TIME ZONE 'UTC')::date",
    )
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(Amount::from_micros(micros.unwrap_or(0)))
}

#[cfg(test)]
mod tests;
