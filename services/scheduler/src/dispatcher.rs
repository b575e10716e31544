//! The dispatcher: fires durable timers and grants attempts. It sleeps until the
//! next task comes due or a commit wakes it (`LISTEN`), then grants in rounds:
//! every tenant's next due task before any tenant's second, the tenant granted
//! least recently first, as far as provider slots, tenant slots and rate buckets
//! allow. A round is one transaction (one commit for up to `grants_per_round`
//! grants). It row-locks each task (`SKIP LOCKED`) and takes each provider's
//! advisory lock without waiting (a provider another instance's round holds is
//! passed over), so several instances share the limits correctly and never wait
//! on each other.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::{Catalog, ProviderSpec};
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::lifecycle::{Input, Micros};
use fenceline_domain::limits::take_tokens;
use fenceline_domain::spend::{Amount, may_start_a_paid_call};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use crate::tasks::{self, Context, DB_NOW_US};
use crate::{SchedulerSettings, clock, health};

/// Longest sleep without a wake-up: bounds how late an expired slot is noticed.
const LONGEST_SLEEP: Duration = Duration::from_secs(5);

/// What one try to grant a task came to.
#[derive(Debug, Clone, PartialEq)]
enum Tried {
    Granted,
    /// A provider the attempt calls has no free slot, or another instance's round
    /// holds it: skip the tasks of that provider this round.
    ProviderFull(String),
    /// A provider's bucket is empty: skip its tasks until this many micros pass.
    RateLimited(String, Micros),
    /// The tenant's slots for the kind are all taken.
    TenantFull,
    /// The tenant's daily budget is spent.
    BudgetSpent,
    /// Someone else holds it, it is no longer due, or the lifecycle refused.
    Skipped,
}

/// How long a task that this instance's catalogue cannot grant waits before it is
/// looked at again.
const UNKNOWN_KIND_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

/// The dispatcher of one scheduler instance.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub settings: Arc<SchedulerSettings>,
    pub channel: Arc<str>,
}

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

impl Dispatcher {
    /// Runs until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut listener = None;
        let mut rate_blocked: HashMap<String, Micros> = HashMap::new();
        while !shutdown.is_cancelled() {
            if listener.is_none() {
                listener = self.listen().await;
            }
            let now = clock::now().0;
            rate_blocked.retain(|_, until| *until > now);
            let round = tracing::info_span!("dispatch round", granted = tracing::field::Empty);
            let sleep = match self.round(&mut rate_blocked).instrument(round).await {
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
            .bind(clock::now().0)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(None);
        let earliest = next.into_iter().chain(rate_blocked.values().copied()).min();
        let now = clock::now().0;
        earliest.map_or(LONGEST_SLEEP, |at| {
            Duration::from_micros(u64::try_from(at.saturating_sub(now)).unwrap_or(0)).min(LONGEST_SLEEP)
        })
    }

    /// One round: every tenant's next due task before any tenant's second, the
    /// least recently granted tenant first, at most `grants_per_round` grants in one
    /// transaction (one commit for all). Returns how many were granted.
    async fn round(&self, rate_blocked: &mut HashMap<String, Micros>) -> Result<usize, sqlx::Error> {
        let now = clock::now().0;
        let limit = self.settings.grants_per_round;
        let mut tx = self.pool.begin().await?;
        let mut round = Round::default();
        let ends = tasks::Ends::default();
        // Providers whose tasks cannot be granted this round; a full page of heads
        // for them must not hide the due tasks of other providers.
        let mut excluded: Vec<String> = rate_blocked.keys().cloned().collect();
        loop {
            let heads: Vec<(uuid::Uuid, Option<String>)> =
                sqlx::query_as(HEADS).bind(now).bind(limit).bind(&excluded).fetch_all(&mut *tx).await?;
            let whole_page = heads.len() as i64 == limit;
            for (task_id, provider) in heads {
                let provider = provider.unwrap_or_default();
                if round.passed_over.contains(&provider) || rate_blocked.contains_key(&provider) {
                    continue;
                }
                match self.try_grant(&mut tx, &mut round, &ends, TaskId::from_uuid(task_id), now).await? {
                    Tried::Granted => {}
                    Tried::ProviderFull(full) => round.passed_over.push(full),
                    Tried::RateLimited(limited, until) => {
                        rate_blocked.insert(limited, until);
                    }
                    Tried::TenantFull | Tried::BudgetSpent | Tried::Skipped => {}
                }
            }
            let newly: Vec<String> = round
                .passed_over
                .iter()
                .chain(rate_blocked.keys())
                .filter(|p| !excluded.contains(p))
                .cloned()
                .collect();
            // Each pass excludes at least one more provider, so this ends.
            if !whole_page || newly.is_empty() || round.granted as i64 >= limit {
                break;
            }
            excluded.extend(newly);
            excluded.sort();
            excluded.dedup();
        }
        // In name order, so that two instances' rounds never wait on each other in a cycle.
        round.tenants.sort();
        round.tenants.dedup();
        for tenant in &round.tenants {
            sqlx::query(
                "INSERT INTO tenant_turns (tenant, last_granted_at_us) VALUES ($1, $2) \
                 ON CONFLICT (tenant) DO UPDATE SET last_granted_at_us = EXCLUDED.last_granted_at_us",
            )
            .bind(tenant)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        for (provider, held) in &round.providers {
            if held.bucket_taken {
                let (tokens, refilled_at) = held.bucket;
                sqlx::query("UPDATE rate_buckets SET tokens = $2, refilled_at_us = $3 WHERE provider = $1")
                    .bind(provider)
                    .bind(tokens)
                    .bind(refilled_at)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        ends.observe();
        let metrics = &fenceline_telemetry::metrics::global().scheduler;
        metrics.grants.inc_by(round.granted as u64);
        tracing::Span::current().record("granted", round.granted);
        for late in &round.lateness {
            metrics.timer_lateness.observe(*late);
        }
        for granted in &round.grants {
            granted.span.in_scope(|| {
                info!(attempt = granted.attempt, grant_id = %granted.grant_id, provider = %granted.provider, "attempt granted");
            });
        }
        if round.granted > 0 {
            // Decided and committed, not yet published: the relay must carry it on.
            let _ = fenceline_bus::faults::drops("scheduler.after_grant_commit");
            self.outbox.committed();
            debug!(granted = round.granted, "granted attempts");
        }
        Ok(round.granted)
    }

    /// Tries to grant one task within the round's transaction. Nothing it checks
    /// before granting changes anything another grant of the round depends on.
    async fn try_grant(
        &self,
        tx: &mut PgConnection,
        round: &mut Round,
        ends: &tasks::Ends,
        task_id: TaskId,
        now: Micros,
    ) -> Result<Tried, sqlx::Error> {
        let Some(row) = tasks::lock_if_due(tx, task_id, now).await? else {
            return Ok(Tried::Skipped);
        };
        let lateness = row.lifecycle.due_at.map(|due| (now - due).max(0) as f64 / 1e6);
        // What the dispatcher does to a task joins the task's trace, linked to the round.
        let span = tracing::info_span!(
            "grant",
            task_id = %row.task_id,
            trace_id = tracing::field::Empty,
        );
        span.follows_from(tracing::Span::current().id());
        fenceline_telemetry::continue_trace(&span, row.traceparent.as_deref());
        fenceline_telemetry::record_trace_id(&span);
        let ctx = Context {
            outbox: &self.outbox,
            catalog: &self.catalog,
            settings: &self.settings,
            channel: &self.channel,
            statuses: None,
            ends,
        };
        if row.lifecycle.deadline.is_some_and(|d| d <= now) {
            tasks::apply(tx, ctx, &row, Input::DeadlinePassed, now).instrument(span).await.map_err(bus_error)?;
            round.lateness.extend(lateness);
            return Ok(Tried::Skipped);
        }
        let resume = row.lifecycle.resume_after_step.as_deref();
        let kind = self.catalog.kind(&row.kind);
        // Every provider the attempt calls, with its limits: all must be known here.
        let needs: Option<Vec<(&str, u32, &ProviderSpec)>> = kind.and_then(|kind| {
            let calls = kind.calls_after(resume);
            (!calls.is_empty()).then_some(())?;
            calls.into_iter().map(|(name, calls)| self.catalog.provider(name).map(|p| (name, calls, p))).collect()
        });
        let (Some(kind), Some(needs)) = (kind, needs) else {
            // Not grantable with this instance's catalogue (a kind or provider
            // removed, or not deployed here yet): looked at again later, so that it
            // never holds the head of its tenant's queue in every round.
            span.in_scope(|| {
                warn!(
                    task_id = %row.task_id,
                    kind = %row.kind,
                    "the task's kind or a provider it calls is not in this scheduler's catalogue; looked at again in \
                     {} s",
                    UNKNOWN_KIND_RETRY.as_secs()
                )
            });
            sqlx::query("UPDATE tasks SET due_at_us = $2 WHERE task_id = $1")
                .bind(task_id.as_uuid())
                .bind(now + i64::try_from(UNKNOWN_KIND_RETRY.as_micros()).unwrap_or(i64::MAX / 4))
                .execute(&mut *tx)
                .await?;
            return Ok(Tried::Skipped);
        };
        // A tenant whose budget is spent starts no new paid call: its tasks wait,
        // saying why, until the day turns or the budget is raised.
        if let Some(budget) = self.catalog.budget_of(&row.tenant) {
            let spent = match round.spent.get(&row.tenant) {
                Some(spent) => *spent,
                None => {
                    let spent = crate::spend::today(tx, &row.tenant).await?;
                    round.spent.insert(row.tenant.clone(), spent);
                    spent
                }
            };
            if let Err(reason) = may_start_a_paid_call(&row.tenant, Some(budget), spent) {
                if row.lifecycle.reason.as_ref() != Some(&reason) {
                    let held = tasks::apply(tx, ctx, &row, Input::Held { reason }, now);
                    held.instrument(span.clone()).await.map_err(bus_error)?;
                }
                return Ok(Tried::BudgetSpent);
            }
        }
        // A slot and a token per call at every provider the attempt calls, all or
        // none: nothing is taken until each of them has room.
        let mut takes: Vec<(&str, f64)> = Vec::with_capacity(needs.len());
        for (provider_name, calls, provider) in needs {
            if let Some(held_back) = self.hold(tx, round, provider_name, provider, now).await? {
                return Ok(held_back);
            }
            let Some(held) = round.providers.get(provider_name) else {
                return Ok(Tried::Skipped);
            };
            if held.slots >= held.allowed {
                // Passed over because the provider is in trouble: its reason says so. Only
                // a new reason is written (a write would wake the dispatchers again).
                let reason = held.reduced.as_ref().map(|reduced| format!("waiting for a slot: {reduced}"));
                if let Some(reason) = reason.filter(|reason| row.lifecycle.reason.as_ref() != Some(reason)) {
                    let held = tasks::apply(tx, ctx, &row, Input::Held { reason }, now);
                    held.instrument(span.clone()).await.map_err(bus_error)?;
                }
                return Ok(Tried::ProviderFull(provider_name.to_owned()));
            }
            let (tokens, refilled_at) = held.bucket;
            // One token per call the attempt will make to the provider, not one per attempt.
            let (left, wait) = take_tokens(tokens, refilled_at, provider.rate_per_second, provider.burst, now, calls);
            if let Some(wait) = wait {
                return Ok(Tried::RateLimited(provider_name.to_owned(), now + wait));
            }
            takes.push((provider_name, left));
        }
        let tenant_kind = (row.tenant.clone(), row.kind.clone());
        if kind.tenant_concurrency > 0 {
            let tenant_held = match round.tenant_slots.get(&tenant_kind) {
                Some(count) => *count,
                None => {
                    let count: i64 = sqlx::query_scalar(&format!(
                        "SELECT count(*) FROM slots WHERE tenant = $1 AND kind = $2 AND expires_at_us > {DB_NOW_US}"
                    ))
                    .bind(&row.tenant)
                    .bind(&row.kind)
                    .fetch_one(&mut *tx)
                    .await?;
                    round.tenant_slots.insert(tenant_kind.clone(), count);
                    count
                }
            };
            if tenant_held >= i64::from(kind.tenant_concurrency) {
                return Ok(Tried::TenantFull);
            }
        }
        let lifecycle = tasks::apply(tx, ctx, &row, Input::Grant { grant_id: GrantId::new_v7() }, now)
            .instrument(span.clone())
            .await
            .map_err(bus_error)?
            .lifecycle;
        if lifecycle.live_grant.is_none() || lifecycle.live_grant == row.lifecycle.live_grant {
            return Ok(Tried::Skipped);
        }
        let first = takes.first().map(|(name, _)| (*name).to_owned()).unwrap_or_default();
        for (provider_name, left) in takes {
            if let Some(held) = round.providers.get_mut(provider_name) {
                held.slots += 1;
                held.bucket = (left, now);
                held.bucket_taken = true;
            }
        }
        if kind.tenant_concurrency > 0 {
            *round.tenant_slots.entry(tenant_kind).or_default() += 1;
        }
        round.granted += 1;
        round.lateness.extend(lateness);
        if let Some(grant_id) = lifecycle.live_grant {
            round.grants.push(Granted { span, attempt: lifecycle.attempt, grant_id, provider: first });
        }
        round.tenants.push(row.tenant);
        Ok(Tried::Granted)
    }

    /// Takes `provider`'s advisory lock for the round and reads its slots, bucket
    /// and limit, once per round. The provider's slots and bucket belong to one
    /// instance's round at a time; another instance's round passes the provider
    /// over instead of waiting. `Some`: the provider cannot be granted this round.
    async fn hold(
        &self,
        tx: &mut PgConnection,
        round: &mut Round,
        provider_name: &str,
        provider: &ProviderSpec,
        now: Micros,
    ) -> Result<Option<Tried>, sqlx::Error> {
        if round.providers.contains_key(provider_name) {
            return Ok(None);
        }
        let ours: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext('fenceline.slot:' || $1))")
            .bind(provider_name)
            .fetch_one(&mut *tx)
            .await?;
        if !ours {
            return Ok(Some(Tried::ProviderFull(provider_name.to_owned())));
        }
        // Its grants' own slots and the slots other grants hold there as a further
        // provider they call, each of those only while its grant's own slot lives
        // (a scheduler that knows only `slots` releases and expires just that one).
        let slots = sqlx::query_scalar(&format!(
            "WITH clock AS (SELECT {DB_NOW_US} AS now_us) \
             SELECT (SELECT count(*) FROM slots, clock WHERE provider = $1 AND expires_at_us > clock.now_us) \
                  + (SELECT count(*) FROM other_provider_slots o, clock WHERE o.provider = $1 \
                     AND o.expires_at_us > clock.now_us \
                     AND EXISTS (SELECT 1 FROM slots s WHERE s.grant_id = o.grant_id))"
        ))
        .bind(provider_name)
        .fetch_one(&mut *tx)
        .await?;
        let bucket = read_bucket(tx, provider_name, provider.burst, now).await?;
        // The adaptive limit, when the provider's health reduced it, caps the slots.
        let (allowed, reduced) = match provider.adaptive_policy() {
            Some(policy) => {
                let limit = health::read(tx, provider_name, &policy).await?;
                (limit.slots(&policy), limit.describe(provider_name, &policy))
            }
            None => (provider.concurrency, None),
        };
        round.providers.insert(
            provider_name.to_owned(),
            Held { slots, allowed: i64::from(allowed), reduced, bucket, bucket_taken: false },
        );
        Ok(None)
    }
}

/// An attempt the round granted.
#[derive(Debug)]
struct Granted {
    span: tracing::Span,
    attempt: u32,
    grant_id: GrantId,
    provider: String,
}

/// What one round has done so far.
#[derive(Debug, Default)]
struct Round {
    granted: usize,
    /// Per task acted on, how long after its due instant, in seconds (observed
    /// only once the round committed).
    lateness: Vec<f64>,
    /// The attempts granted, logged in their task's span once the round committed.
    grants: Vec<Granted>,
    /// Tenants granted, whose turn moves to the end when the round commits.
    tenants: Vec<String>,
    /// The providers whose advisory lock this round holds, and their limits.
    providers: HashMap<String, Held>,
    /// Live attempts per (tenant, kind) where the kind limits its tenants; a kind's
    /// attempts all hold a slot at its provider, so the provider's lock guards these too.
    tenant_slots: HashMap<(String, String), i64>,
    /// Providers full or held by another instance: their tasks wait for the next round.
    passed_over: Vec<String>,
    /// What each tenant with a budget has spent today, read once per round.
    spent: HashMap<String, Amount>,
}

/// A provider's limits while a round holds its lock: read once, kept in memory,
/// the bucket written back at commit. Slots other transactions release meanwhile
/// only lower the true count, so the count kept here never grants too many.
#[derive(Debug)]
struct Held {
    slots: i64,
    /// Slots the provider may hold now: its concurrency, or less while its adaptive
    /// limit is reduced.
    allowed: i64,
    /// "imagegen limit 2 of 8, reduced after timeouts" while it is reduced.
    reduced: Option<String>,
    /// Tokens and when they were counted.
    bucket: (f64, Micros),
    bucket_taken: bool,
}

/// Reads (creating it full) and row-locks the provider's token bucket.
async fn read_bucket(
    tx: &mut PgConnection,
    provider: &str,
    burst: f64,
    now: Micros,
) -> Result<(f64, Micros), sqlx::Error> {
    sqlx::query(
        "INSERT INTO rate_buckets (provider, tokens, refilled_at_us) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(provider)
    .bind(burst)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query_as("SELECT tokens, refilled_at_us FROM rate_buckets WHERE provider = $1 FOR UPDATE")
        .bind(provider)
        .fetch_one(&mut *tx)
        .await
}

fn bus_error(e: fenceline_bus::Error) -> sqlx::Error {
    match e {
        fenceline_bus::Error::Database(e) => e,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}
