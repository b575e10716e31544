//! The dispatcher: fires durable timers and grants attempts. It sleeps until the
//! next task comes due or a commit wakes it (`LISTEN`), then grants in rounds:
//! every tenant's next due task before any tenant's second, the tenant granted
//! least recently first, as far as provider slots, tenant slots, rate buckets and
//! budgets allow. A round is one transaction (one commit for up to
//! `grants_per_round` grants). It row-locks each page of due heads with one
//! statement (`SKIP LOCKED`) and takes each
//! provider's advisory lock without waiting (a provider another instance's round
//! holds is passed over), so several instances share the limits correctly and never
//! wait on each other. What may be granted is decided by
//! [`fenceline_domain::admission`]; [`store`] reads and writes what it weighs.

pub mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_config::catalog::Catalog;
use fenceline_domain::admission::{Call, Candidate, Fact, HeldBack, Learnt, Round, Verdict};
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::lifecycle::{Input, Micros};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use self::store::Head;
use crate::tasks::{self, Context, TaskRow};
use crate::{SchedulerSettings, clock};

/// Longest sleep without a wake-up: bounds how late an expired slot is noticed.
const LONGEST_SLEEP: Duration = Duration::from_secs(5);

/// How long a task that this instance's catalogue cannot grant waits before it is
/// looked at again.
const UNKNOWN_KIND_RETRY: Duration = Duration::from_secs(60);

/// The dispatcher of one scheduler instance.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub catalog: Arc<Catalog>,
    pub settings: Arc<SchedulerSettings>,
    pub channel: Arc<str>,
}

/// What one try to grant a head came to, for the round's loop.
#[derive(Debug, Clone)]
enum Tried {
    Granted(Granted),
    HeldBack(HeldBack),
    /// Someone else holds it, it is no longer due, it was postponed or the lifecycle refused.
    Skipped,
}

/// An attempt the round granted, logged in its task's span once the round committed.
#[derive(Debug, Clone)]
struct Granted {
    span: tracing::Span,
    attempt: u32,
    grant_id: GrantId,
    provider: String,
}

/// What a round leaves to do once it committed.
#[derive(Debug, Default)]
struct Committed {
    grants: Vec<Granted>,
    /// Per task acted on, how long after its due instant, in seconds.
    lateness: Vec<f64>,
    /// The rows the round changed, locked until it commits and stored once before
    /// then ([`tasks::save_all`]): until that, the table still shows each as due,
    /// so a later page of heads must pass over them.
    changed: Vec<TaskRow>,
}

impl Committed {
    fn changed(&self, task_id: TaskId) -> bool {
        self.changed.iter().any(|row| row.task_id == task_id)
    }
}

/// Whether the round passes over `head` without trying it: its provider is full or
/// out of tokens, or the round changed its task already.
fn passed_over(
    head: &Head,
    excluded: &[String],
    rate_blocked: &HashMap<String, Micros>,
    committed: &Committed,
) -> bool {
    excluded.contains(&head.provider) || rate_blocked.contains_key(&head.provider) || committed.changed(head.task_id)
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
        let next = store::next_due_after(&self.pool, clock::now().0).await.unwrap_or(None);
        let earliest = next.into_iter().chain(rate_blocked.values().copied()).min();
        let now = clock::now().0;
        earliest.map_or(LONGEST_SLEEP, |at| {
            Duration::from_micros(u64::try_from(at.saturating_sub(now)).unwrap_or(0)).min(LONGEST_SLEEP)
        })
    }

    /// One round: every tenant's next due task before any tenant's second, the
    /// least recently granted tenant first, at most `grants_per_round` grants in one
    /// transaction (one commit for all). Returns how many were granted.
    async fn round(&self, rate_blocked: &mut HashMap<String, Micros>) -> Result<usize, fenceline_bus::Error> {
        let now = clock::now().0;
        let limit = self.settings.grants_per_round;
        let mut tx = self.pool.begin().await?;
        let mut round = Round::at(now);
        let mut committed = Committed::default();
        let ends = tasks::Ends::default();
        let statuses = tasks::StatusBatch::default();
        let slots = tasks::slots::SlotWrites::default();
        // Providers whose tasks cannot be granted this round; a full page of heads
        // for them must not hide the due tasks of other providers.
        let mut excluded: Vec<String> = rate_blocked.keys().cloned().collect();
        loop {
            let heads = store::heads(&mut tx, now, limit, &excluded).await?;
            let whole_page = heads.len() as i64 == limit;
            let excluded_before = excluded.len();
            // The page's heads that may be tried, locked with one statement if still
            // due and no other instance holds them; one passed over later in the page
            // (its provider filled up) stays locked until the round commits.
            let wanted: Vec<TaskId> = heads
                .iter()
                .filter(|h| !passed_over(h, &excluded, rate_blocked, &committed))
                .map(|h| h.task_id)
                .collect();
            let mut locked = tasks::lock_if_due(&mut tx, &wanted, now).await?;
            for head in heads {
                if passed_over(&head, &excluded, rate_blocked, &committed) {
                    continue;
                }
                let Some(row) = locked.remove(&head.task_id) else {
                    continue;
                };
                match self.try_grant(&mut tx, &mut round, (&ends, &statuses, &slots), row, &mut committed).await? {
                    Tried::Granted(granted) => committed.grants.push(granted),
                    Tried::HeldBack(HeldBack::ProviderFull(full)) => excluded.push(full),
                    Tried::HeldBack(HeldBack::RateLimited(limited, until)) => {
                        rate_blocked.insert(limited, until);
                    }
                    Tried::HeldBack(HeldBack::TenantFull | HeldBack::BudgetSpent) | Tried::Skipped => {}
                }
            }
            excluded.extend(round.full_providers().map(str::to_owned));
            excluded.extend(rate_blocked.keys().cloned());
            excluded.sort();
            excluded.dedup();
            // Each further pass excludes at least one more provider, so this ends.
            if !whole_page || excluded.len() == excluded_before || round.granted() as i64 >= limit {
                break;
            }
        }
        let tenants: Vec<&str> = round.tenants_granted().collect();
        store::move_turns(&mut tx, &tenants, now).await?;
        let buckets: Vec<(&str, f64, Micros)> = round.buckets_taken().collect();
        store::write_buckets(&mut tx, &buckets).await?;
        tasks::save_all(&mut tx, self.context(&ends, &statuses, &slots), &committed.changed).await?;
        statuses.flush(&mut tx, &self.outbox).await?;
        slots.flush(&mut tx, &self.channel).await?;
        tx.commit().await?;
        ends.observe();
        let metrics = &fenceline_telemetry::metrics::global().scheduler;
        metrics.grants.inc_by(round.granted() as u64);
        tracing::Span::current().record("granted", round.granted());
        for late in &committed.lateness {
            metrics.timer_lateness.observe(*late);
        }
        for granted in &committed.grants {
            granted.span.in_scope(|| {
                info!(attempt = granted.attempt, grant_id = %granted.grant_id, provider = %granted.provider, "attempt granted");
            });
        }
        if round.granted() > 0 {
            // Decided and committed, not yet published: the relay must carry it on.
            let _ = fenceline_bus::faults::drops("scheduler.after_grant_commit");
            self.outbox.committed();
            debug!(granted = round.granted(), "granted attempts");
        }
        Ok(round.granted())
    }

    /// Tries to grant one head, locked and due, within the round's transaction: ends
    /// it if its deadline passed, asks admission, reads what admission needs, and
    /// applies the lifecycle's grant or hold.
    async fn try_grant(
        &self,
        tx: &mut PgConnection,
        round: &mut Round,
        (ends, statuses, slots): (&tasks::Ends, &tasks::StatusBatch, &tasks::slots::SlotWrites),
        row: TaskRow,
        committed: &mut Committed,
    ) -> Result<Tried, fenceline_bus::Error> {
        let now = round.now();
        let late = row.lifecycle.due_at.map(|due| (now - due).max(0) as f64 / 1e6);
        // What the dispatcher does to a task joins the task's trace, linked to the round.
        let span = tracing::info_span!("grant", task_id = %row.task_id, trace_id = tracing::field::Empty);
        span.follows_from(tracing::Span::current().id());
        fenceline_telemetry::continue_trace(&span, row.traceparent.as_deref());
        fenceline_telemetry::record_trace_id(&span);
        let ctx = self.context(ends, statuses, slots);
        if row.lifecycle.deadline.is_some_and(|d| d <= now) {
            committed.changed.push(tasks::apply(tx, ctx, &row, Input::DeadlinePassed, now).instrument(span).await?);
            committed.lateness.extend(late);
            return Ok(Tried::Skipped);
        }
        let Some(candidate) = self.candidate(&row) else {
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
            let later = now + i64::try_from(UNKNOWN_KIND_RETRY.as_micros()).unwrap_or(i64::MAX / 4);
            store::postpone(tx, row.task_id, later).await?;
            return Ok(Tried::Skipped);
        };
        let takes = loop {
            match round.admit(&candidate) {
                Verdict::Needs(fact) => {
                    let learnt = self.read(tx, &fact, now).await?;
                    round.learn(fact, learnt);
                }
                Verdict::Grant(takes) => break takes,
                Verdict::Hold { why, reason } => {
                    if let Some(reason) = reason {
                        let held = tasks::apply(tx, ctx, &row, Input::Held { reason }, now);
                        committed.changed.push(held.instrument(span).await?);
                    }
                    return Ok(Tried::HeldBack(why));
                }
            }
        };
        let granted = tasks::apply(tx, ctx, &row, Input::Grant { grant_id: GrantId::new_v7() }, now)
            .instrument(span.clone())
            .await?;
        let lifecycle = granted.lifecycle.clone();
        committed.changed.push(granted);
        let Some(grant_id) = lifecycle.live_grant.filter(|live| Some(*live) != row.lifecycle.live_grant) else {
            return Ok(Tried::Skipped);
        };
        round.book(&candidate, takes);
        committed.lateness.extend(late);
        let provider = candidate.calls.first().map(|call| call.provider.to_owned()).unwrap_or_default();
        Ok(Tried::Granted(Granted { span, attempt: lifecycle.attempt, grant_id, provider }))
    }

    /// What a round's transaction applies the lifecycle with: its statuses gathered,
    /// one per task, and the slots it takes and gives back, written when it ends.
    fn context<'a>(
        &'a self,
        ends: &'a tasks::Ends,
        statuses: &'a tasks::StatusBatch,
        slots: &'a tasks::slots::SlotWrites,
    ) -> Context<'a> {
        Context {
            outbox: &self.outbox,
            catalog: &self.catalog,
            settings: &self.settings,
            channel: &self.channel,
            statuses: Some(statuses),
            ends,
            slots: Some(slots),
        }
    }

    /// The task as admission sees it, or `None` where this instance's catalogue does
    /// not know its kind or a provider its next calls need.
    fn candidate<'a>(&'a self, row: &'a TaskRow) -> Option<Candidate<'a>> {
        let kind = self.catalog.kind(&row.kind)?;
        let calls = kind.calls_after(row.lifecycle.resume_after_step.as_deref());
        if calls.is_empty() {
            return None;
        }
        let calls = calls
            .into_iter()
            .map(|(name, calls)| {
                let provider = self.catalog.provider(name)?;
                Some(Call { provider: name, calls, rate_per_second: provider.rate_per_second, burst: provider.burst })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Candidate {
            tenant: &row.tenant,
            kind: &row.kind,
            reason: row.lifecycle.reason.as_deref(),
            calls,
            tenant_concurrency: kind.tenant_concurrency,
            budget: self.catalog.budget_of(&row.tenant),
        })
    }

    /// Reads a fact admission asked for.
    async fn read(&self, tx: &mut PgConnection, fact: &Fact, now: Micros) -> Result<Learnt, sqlx::Error> {
        Ok(match fact {
            Fact::Spent { tenant } => Learnt::Spent(crate::spend::today(tx, tenant).await?),
            Fact::Provider { name } => match self.catalog.provider(name) {
                Some(provider) => Learnt::Provider(store::lock_provider(tx, name, provider, now).await?),
                None => Learnt::Provider(None),
            },
            Fact::TenantSlots { tenant, kind } => Learnt::TenantSlots(store::tenant_slots(tx, tenant, kind).await?),
        })
    }
}
