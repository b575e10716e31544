//! The dispatch round's store: the only code of the round that speaks SQL. It reads
//! the due heads, a provider's room under the provider's lock, a tenant's slots, and
//! writes back the turns and buckets a round moved, each as one whole statement.

use fenceline_config::catalog::ProviderSpec;
use fenceline_domain::admission::Room;
use fenceline_domain::ids::TaskId;
use fenceline_domain::lifecycle::Micros;
use sqlx::{PgConnection, PgPool};

use crate::health;

/// The next due tasks to try, at most `$2`: each tenant's first by priority and
/// age before any tenant's second, the tenant granted least recently first, none
/// of the providers in `$3` (a task without a provider always). A tenant's first
/// `$2` are among the first `$2` of each of its providers, so each (tenant,
/// provider) pair with due work is found by a skip over `tasks_due_by_provider`
/// and read for at most `$2` entries: a round costs the pairs, not the due tasks
/// (a provider at its limit may hold a hundred thousand of them).
pub const HEADS: &str = "WITH RECURSIVE pairs AS ( \
         (SELECT tenant, coalesce(provider, '') AS provider FROM tasks WHERE due_at_us IS NOT NULL \
          ORDER BY tenant, coalesce(provider, '') LIMIT 1) \
         UNION ALL \
         SELECT next.tenant, next.provider FROM pairs CROSS JOIN LATERAL ( \
             SELECT t.tenant, coalesce(t.provider, '') AS provider FROM tasks t \
             WHERE t.due_at_us IS NOT NULL AND (t.tenant, coalesce(t.provider, '')) > (pairs.tenant, pairs.provider) \
             ORDER BY t.tenant, coalesce(t.provider, '') LIMIT 1) next \
     ), heads AS ( \
         SELECT p.tenant, c.task_id, c.provider, \
                row_number() OVER (PARTITION BY p.tenant ORDER BY c.priority, c.due_at_us) AS place \
         FROM pairs p CROSS JOIN LATERAL ( \
             SELECT t.task_id, t.provider, t.priority, t.due_at_us FROM tasks t \
             WHERE t.tenant = p.tenant AND coalesce(t.provider, '') = p.provider \
             AND t.due_at_us IS NOT NULL AND t.due_at_us <= $1 \
             ORDER BY t.priority, t.due_at_us LIMIT $2) c \
         WHERE p.provider <> ALL($3) \
     ) \
     SELECT h.task_id, h.provider FROM heads h LEFT JOIN tenant_turns t ON t.tenant = h.tenant \
     WHERE h.place <= $2 ORDER BY h.place, t.last_granted_at_us NULLS FIRST, h.tenant LIMIT $2";

/// A due task at the head of its tenant's queue, and the provider its next step calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub task_id: TaskId,
    /// Empty for a task whose next step calls no provider.
    pub provider: String,
}

/// The heads due at `now` in turn order ([`HEADS`]), at most `limit`, none of `excluded`'s.
pub async fn heads(
    tx: &mut PgConnection,
    now: Micros,
    limit: i64,
    excluded: &[String],
) -> Result<Vec<Head>, sqlx::Error> {
    let rows: Vec<(uuid::Uuid, Option<String>)> =
        sqlx::query_as(HEADS).bind(now).bind(limit).bind(excluded).fetch_all(&mut *tx).await?;
    Ok(rows
        .into_iter()
        .map(|(task_id, provider)| Head { task_id: TaskId::from_uuid(task_id), provider: provider.unwrap_or_default() })
        .collect())
}

/// When the next task not yet due falls due.
pub async fn next_due_after(pool: &PgPool, now: Micros) -> Result<Option<Micros>, sqlx::Error> {
    sqlx::query_scalar("SELECT min(due_at_us) FROM tasks WHERE due_at_us > $1").bind(now).fetch_one(pool).await
}

/// Takes `name`'s advisory lock for the rest of the transaction without waiting and
/// reads its room: its slots, its bucket (created full) and its limit. `None`:
/// another instance's round holds the provider.
pub async fn lock_provider(
    tx: &mut PgConnection,
    name: &str,
    provider: &ProviderSpec,
    now: Micros,
) -> Result<Option<Room>, sqlx::Error> {
    let ours: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext('fenceline.slot:' || $1))")
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    if !ours {
        return Ok(None);
    }
    // Its grants' own slots and the slots other grants hold there as a further
    // provider they call, each of those only while its grant's own slot lives (a
    // scheduler that knows only `slots` releases and expires just that one). The
    // bucket is created full the first time and row-locked.
    // (The provider's lock is held, so no other round creates the bucket meanwhile:
    // the insert and the locking read, which cannot see each other, find one row.)
    let (slots, tokens, counted_at): (i64, f64, Micros) = sqlx::query_as(
        "WITH clock AS (SELECT now_us() AS now_us), \
         created AS ( \
             INSERT INTO rate_buckets (provider, tokens, refilled_at_us) VALUES ($1, $2, $3) \
             ON CONFLICT (provider) DO NOTHING RETURNING tokens, refilled_at_us), \
         kept AS (SELECT tokens, refilled_at_us FROM rate_buckets WHERE provider = $1 FOR UPDATE), \
         bucket AS (SELECT * FROM created UNION ALL SELECT * FROM kept) \
         SELECT (SELECT count(*) FROM slots, clock WHERE provider = $1 AND expires_at_us > clock.now_us) \
              + (SELECT count(*) FROM other_provider_slots o, clock WHERE o.provider = $1 \
                 AND o.expires_at_us > clock.now_us \
                 AND EXISTS (SELECT 1 FROM slots s WHERE s.grant_id = o.grant_id)), \
                bucket.tokens, bucket.refilled_at_us \
         FROM bucket",
    )
    .bind(name)
    .bind(provider.burst)
    .bind(now)
    .fetch_one(&mut *tx)
    .await?;
    // The adaptive limit, when the provider's health reduced it, caps the slots.
    let (allowed, reduced) = match provider.adaptive_policy() {
        Some(policy) => {
            let limit = health::read(tx, name, &policy).await?;
            (limit.slots(&policy), limit.describe(name, &policy))
        }
        None => (provider.concurrency, None),
    };
    Ok(Some(Room { slots, allowed: i64::from(allowed), reduced, tokens, counted_at }))
}

/// How many live attempts of `kind` `tenant` runs: a kind's attempts all hold a
/// slot at its provider, so the provider's lock guards this count too.
pub async fn tenant_slots(tx: &mut PgConnection, tenant: &str, kind: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM slots WHERE tenant = $1 AND kind = $2 AND expires_at_us > now_us()")
        .bind(tenant)
        .bind(kind)
        .fetch_one(&mut *tx)
        .await
}

/// Moves a task this instance cannot grant out of the heads until `until`.
pub async fn postpone(tx: &mut PgConnection, task_id: TaskId, until: Micros) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE tasks SET due_at_us = $2 WHERE task_id = $1")
        .bind(task_id.as_uuid())
        .bind(until)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Moves each of `tenants` (in name order, so that two rounds never wait on each
/// other in a cycle) to the end of the turns, at `now`.
pub async fn move_turns(tx: &mut PgConnection, tenants: &[&str], now: Micros) -> Result<(), sqlx::Error> {
    if tenants.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO tenant_turns (tenant, last_granted_at_us) SELECT tenant, $2 FROM unnest($1::text[]) AS tenant \
         ON CONFLICT (tenant) DO UPDATE SET last_granted_at_us = EXCLUDED.last_granted_at_us",
    )
    .bind(tenants)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Writes back the buckets a round took from: (provider, tokens, counted at).
pub async fn write_buckets(tx: &mut PgConnection, buckets: &[(&str, f64, Micros)]) -> Result<(), sqlx::Error> {
    if buckets.is_empty() {
        return Ok(());
    }
    let providers: Vec<&str> = buckets.iter().map(|(p, _, _)| *p).collect();
    let tokens: Vec<f64> = buckets.iter().map(|(_, t, _)| *t).collect();
    let counted_at: Vec<Micros> = buckets.iter().map(|(_, _, at)| *at).collect();
    sqlx::query(
        "UPDATE rate_buckets b SET tokens = w.tokens, refilled_at_us = w.counted_at \
         FROM unnest($1::text[], $2::float8[], $3::bigint[]) AS w (provider, tokens, counted_at) \
         WHERE b.provider = w.provider",
    )
    .bind(providers)
    .bind(tokens)
    .bind(counted_at)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests;
