//! The dispatcher: fires durable timers and grants attempts. It sleeps until the
//! next task comes due or a commit wakes it (`LISTEN`), then grants, one task per
//! tenant per round, the tenant granted least recently first, as far as provider
//! slots, tenant slots and rate buckets allow. Every grant is one transaction that
//! row-locks the task (`SKIP LOCKED`: instances never wait on each other) and
//! serialises per provider on an advisory lock, so several instances share the
//! limits correctly.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::Catalog;
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::lifecycle::{Input, Micros};
use fenceline_events::Timestamp;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::SchedulerSettings;
use crate::tasks::{self, Context};

/// Longest sleep without a wake-up: bounds how late an expired slot is noticed.
const LONGEST_SLEEP: Duration = Duration::from_secs(5);

/// What one try to grant a task came to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tried {
    Granted,
    /// The provider has no free slot: skip its tasks this round.
    ProviderFull,
    /// The provider's bucket is empty: skip its tasks until this many micros pass.
    RateLimited(Micros),
    /// The tenant's slots for the kind are all taken.
    TenantFull,
    /// Someone else holds it, it is no longer due, or the lifecycle refused.
    Skipped,
}

/// The dispatcher of one scheduler instance.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub settings: Arc<SchedulerSettings>,
    pub channel: Arc<str>,
}

impl Dispatcher {
    /// Runs until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut listener = None;
        let mut rate_blocked: HashMap<String, Micros> = HashMap::new();
        while !shutdown.is_cancelled() {
            if listener.is_none() {
                listener = self.listen().await;
            }
            let now = Timestamp::now().0;
            rate_blocked.retain(|_, until| *until > now);
            let sleep = match self.round(&mut rate_blocked).await {
                Ok(granted) if granted > 0 => continue,
                Ok(_) => self.until_next_due(&rate_blocked).await,
                Err(e) => {
                    warn!(error = %e, "dispatch round failed; trying again");
                    Duration::from_millis(500)
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(sleep) => {}
                woken = async {
                    match listener.as_mut() {
                        Some(l) => l.recv().await.map(|_| ()),
                        None => std::future::pending().await,
                    }
                } => {
                    if let Err(e) = woken {
                        warn!(error = %e, "lost the database notification channel; reconnecting");
                        listener = None;
                    }
                }
            }
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        let mut listener = PgListener::connect_with(&self.pool).await.ok()?;
        listener.listen(&self.channel).await.ok()?;
        Some(listener)
    }

    /// How long until the next timer falls due, at most [`LONGEST_SLEEP`]. Tasks
    /// already due but blocked by full slots wait for the notification of a freed
    /// slot (or a rate bucket's refill), not for a timer: no busy loop.
    async fn until_next_due(&self, rate_blocked: &HashMap<String, Micros>) -> Duration {
        let next: Option<i64> = sqlx::query_scalar("SELECT min(due_at_us) FROM tasks WHERE due_at_us > $1")
            .bind(Timestamp::now().0)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(None);
        let earliest = next.into_iter().chain(rate_blocked.values().copied()).min();
        let now = Timestamp::now().0;
        earliest.map_or(LONGEST_SLEEP, |at| {
            Duration::from_micros(u64::try_from(at.saturating_sub(now)).unwrap_or(0)).min(LONGEST_SLEEP)
        })
    }

    /// One round: the next due task of every tenant, the least recently granted
    /// tenant first. Returns how many were granted.
    async fn round(&self, rate_blocked: &mut HashMap<String, Micros>) -> Result<usize, sqlx::Error> {
        let now = Timestamp::now().0;
        let heads: Vec<(uuid::Uuid, Option<String>)> = sqlx::query_as(
            "SELECT h.task_id, h.provider FROM ( \
                 SELECT DISTINCT ON (tenant) task_id, tenant, provider FROM tasks \
                 WHERE due_at_us IS NOT NULL AND due_at_us <= $1 ORDER BY tenant, priority, due_at_us \
             ) h LEFT JOIN tenant_turns t ON t.tenant = h.tenant \
             ORDER BY t.last_granted_at_us NULLS FIRST LIMIT $2",
        )
        .bind(now)
        .bind(self.settings.tenants_per_round)
        .fetch_all(&self.pool)
        .await?;
        let mut granted = 0;
        let mut full: Vec<String> = Vec::new();
        for (task_id, provider) in heads {
            let provider = provider.unwrap_or_default();
            if full.contains(&provider) || rate_blocked.contains_key(&provider) {
                continue;
            }
            match self.try_grant(TaskId::from_uuid(task_id), now).await? {
                Tried::Granted => granted += 1,
                Tried::ProviderFull => full.push(provider),
                Tried::RateLimited(until) => {
                    rate_blocked.insert(provider, until);
                }
                Tried::TenantFull | Tried::Skipped => {}
            }
        }
        if granted > 0 {
            self.outbox.committed();
            debug!(granted, "granted attempts");
        }
        Ok(granted)
    }

    async fn try_grant(&self, task_id: TaskId, now: Micros) -> Result<Tried, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let Some(row) = tasks::lock_if_due(&mut tx, task_id, now).await? else {
            return Ok(Tried::Skipped);
        };
        let ctx =
            Context { outbox: &self.outbox, catalog: &self.catalog, settings: &self.settings, channel: &self.channel };
        if row.lifecycle.deadline.is_some_and(|d| d <= now) {
            tasks::apply(&mut tx, ctx, &row, Input::DeadlinePassed, now).await.map_err(bus_error)?;
            tx.commit().await?;
            return Ok(Tried::Skipped);
        }
        let Some(kind) = self.catalog.kind(&row.kind) else {
            return Ok(Tried::Skipped);
        };
        let Some(provider_name) = kind.slot_provider() else {
            return Ok(Tried::Skipped);
        };
        let Some(provider) = self.catalog.provider(provider_name) else {
            return Ok(Tried::Skipped);
        };
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('fenceline.slot:' || $1))")
            .bind(provider_name)
            .execute(&mut *tx)
            .await?;
        let held: i64 = sqlx::query_scalar("SELECT count(*) FROM slots WHERE provider = $1 AND expires_at_us > $2")
            .bind(provider_name)
            .bind(now)
            .fetch_one(&mut *tx)
            .await?;
        if held >= i64::from(provider.concurrency) {
            return Ok(Tried::ProviderFull);
        }
        if kind.tenant_concurrency > 0 {
            let tenant_held: i64 =
                sqlx::query_scalar("SELECT count(*) FROM slots WHERE tenant = $1 AND kind = $2 AND expires_at_us > $3")
                    .bind(&row.tenant)
                    .bind(&row.kind)
                    .bind(now)
                    .fetch_one(&mut *tx)
                    .await?;
            if tenant_held >= i64::from(kind.tenant_concurrency) {
                return Ok(Tried::TenantFull);
            }
        }
        if let Some(until) = take_token(&mut tx, provider_name, provider.rate_per_second, provider.burst, now).await? {
            return Ok(Tried::RateLimited(until));
        }
        let lifecycle = tasks::apply(&mut tx, ctx, &row, Input::Grant { grant_id: GrantId::new_v7() }, now)
            .await
            .map_err(bus_error)?;
        tx.commit().await?;
        // Decided and committed, not yet published: the relay must carry it on.
        let _ = fenceline_bus::faults::drops("scheduler.after_grant_commit");
        Ok(if lifecycle.live_grant.is_some() && lifecycle.live_grant != row.lifecycle.live_grant {
            Tried::Granted
        } else {
            Tried::Skipped
        })
    }
}

/// Takes one token from the provider's bucket. `Some(t)`: empty until `t`.
async fn take_token(
    tx: &mut PgConnection,
    provider: &str,
    rate: f64,
    burst: f64,
    now: Micros,
) -> Result<Option<Micros>, sqlx::Error> {
    sqlx::query(
        "INSERT INTO rate_buckets (provider, tokens, refilled_at_us) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(provider)
    .bind(burst)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    let (tokens, refilled): (f64, i64) =
        sqlx::query_as("SELECT tokens, refilled_at_us FROM rate_buckets WHERE provider = $1 FOR UPDATE")
            .bind(provider)
            .fetch_one(&mut *tx)
            .await?;
    let (left, wait) = fenceline_domain::limits::take_token(tokens, refilled, rate, burst, now);
    if let Some(wait) = wait {
        return Ok(Some(now + wait));
    }
    sqlx::query("UPDATE rate_buckets SET tokens = $2, refilled_at_us = $3 WHERE provider = $1")
        .bind(provider)
        .bind(left)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    Ok(None)
}

fn bus_error(e: fenceline_bus::Error) -> sqlx::Error {
    match e {
        fenceline_bus::Error::Database(e) => e,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}
