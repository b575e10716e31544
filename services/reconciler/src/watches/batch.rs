//! What the reconciler's consumer gathers over a batch and writes with one
//! statement per table: grants, call intents, claims and ends, status snapshots.
//! A grant or an intent is written before any event of the same batch reads it
//! back ([`BatchWrites::flush_reads`]), so gathering changes no answer.

use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_events::{AttemptGranted, CallIntentRecorded};
use sqlx::PgConnection;

use super::LostCall;

/// What [`Watches`] gathers over a consumer batch, one statement each at its end.
#[derive(Debug, Default)]
pub struct BatchWrites {
    pub(crate) grants: Grants,
    pub(crate) intents: Intents,
    pub(crate) states: TaskStates,
    pub(crate) facts: GrantFacts,
}

impl BatchWrites {
    /// Writes the grants and call intents gathered so far, which what comes next
    /// reads (a case opening reads its grant and call; an acceptance updates its
    /// call); returns the losses heard before their grant, whose cases open now.
    pub(crate) async fn flush_reads(
        &self,
        tx: &mut PgConnection,
        claim_within_us: i64,
    ) -> Result<Vec<EarlyLoss>, sqlx::Error> {
        let early_losses = self.grants.flush(tx, claim_within_us).await?;
        self.intents.flush(tx).await?;
        Ok(early_losses)
    }

    /// Writes the claims, ends and status snapshots gathered, after the grants.
    pub(crate) async fn flush_facts(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        self.states.flush(tx).await?;
        self.facts.flush(tx).await
    }

    /// Forgets what a rolled-back batch gathered.
    pub(crate) fn discard(&self) {
        self.grants.discard();
        self.intents.discard();
        self.states.0.discard();
        self.facts.0.discard();
    }
}

/// Grants claimed or ended in a batch, written when it ends: the claims and the
/// ends that lead to nothing else. An end that opens a case, and a cancel (which
/// must keep the grant from being re-issued), is written at once, as the re-issue
/// loop does its own: the grant's row first, then the task's outbox key, so the
/// two never wait on each other in opposite orders.
#[derive(Debug, Default)]
pub(crate) struct GrantFacts(fenceline_bus::gathered::Merged<GrantId, Heard>);

/// What was heard of one grant.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Heard {
    claimed: bool,
    ended: bool,
}

impl Heard {
    pub(crate) const CLAIMED: Heard = Heard { claimed: true, ended: false };
    pub(crate) const ENDED: Heard = Heard { claimed: false, ended: true };
}

impl GrantFacts {
    pub(crate) fn heard(&self, grant_id: GrantId, fact: Heard) {
        self.0.merge(grant_id, |heard| {
            heard.claimed |= fact.claimed;
            heard.ended |= fact.ended;
        });
    }

    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        write_grant_facts(tx, self.0.take()).await
    }
}

/// Records that grants were claimed or ended, in grant order. A grant not recorded
/// yet (its `AttemptGranted` comes later, on another topic) has its facts kept in
/// `early_grant_facts`, which the grant takes when it arrives.
pub(crate) async fn write_grant_facts(tx: &mut PgConnection, facts: Vec<(GrantId, Heard)>) -> Result<(), sqlx::Error> {
    if facts.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "WITH given AS (SELECT * FROM unnest($1::uuid[], $2::bool[], $3::bool[]) AS g (grant_id, claimed, ended)), \
         updated AS (UPDATE grants SET claimed = grants.claimed OR given.claimed, \
           ended = grants.ended OR given.ended FROM given WHERE grants.grant_id = given.grant_id \
           RETURNING grants.grant_id) \
         INSERT INTO early_grant_facts (grant_id, claimed, ended) \
         SELECT grant_id, claimed, ended FROM given WHERE grant_id NOT IN (SELECT grant_id FROM updated) \
         ON CONFLICT (grant_id) DO UPDATE SET claimed = early_grant_facts.claimed OR EXCLUDED.claimed, \
         ended = early_grant_facts.ended OR EXCLUDED.ended",
    )
    .bind(facts.iter().map(|(id, _)| id.as_uuid()).collect::<Vec<_>>())
    .bind(facts.iter().map(|(_, heard)| heard.claimed).collect::<Vec<_>>())
    .bind(facts.iter().map(|(_, heard)| heard.ended).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The newest status snapshot of each task in a consumer batch, for
/// `task_states` (which only the audit reads, between batches): one statement
/// per batch instead of one per snapshot.
#[derive(Debug, Default)]
pub struct TaskStates(pub(crate) fenceline_bus::gathered::Newest<TaskId, fenceline_events::TaskStatus>);

impl TaskStates {
    /// Writes each gathered snapshot unless `task_states` holds a version as new,
    /// in task order.
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let states = self.0.take();
        if states.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO task_states (task_id, tenant, kind, state, reason, version, updated_at_us) \
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], \
             $7::bigint[]) ON CONFLICT (task_id) DO UPDATE SET \
             state = EXCLUDED.state, reason = EXCLUDED.reason, version = EXCLUDED.version, \
             updated_at_us = EXCLUDED.updated_at_us WHERE task_states.version < EXCLUDED.version",
        )
        .bind(states.iter().map(|s| s.task_id.as_uuid()).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.tenant.as_str()).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.kind.as_str()).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.state.as_str()).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.reason.as_deref()).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.version).collect::<Vec<_>>())
        .bind(states.iter().map(|s| s.updated_at.0).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// A loss heard before its grant, handed back when the grant is written, with the
/// grant's trace: its case opens now, outside the loss's own event, and joins the
/// task's trace through it.
#[derive(Debug, Clone)]
pub(crate) struct EarlyLoss {
    pub lost: LostCall,
    pub traceparent: Option<String>,
}

/// The grants a batch heard, in the order heard, each with the trace it joins.
#[derive(Debug, Default)]
pub(crate) struct Grants(fenceline_bus::gathered::All<(AttemptGranted, Option<String>)>);

impl Grants {
    pub(crate) fn heard(&self, grant: &AttemptGranted, traceparent: Option<String>) {
        self.0.push((grant.clone(), traceparent));
    }

    /// Records the gathered grants, in grant order, each taking what was heard of
    /// it before it arrived (`early_grant_facts`), and a grant sent again inserts
    /// nothing; returns the losses heard before their grant (`early_losses`), whose
    /// cases open now.
    async fn flush(&self, tx: &mut PgConnection, claim_within_us: i64) -> Result<Vec<EarlyLoss>, sqlx::Error> {
        let mut grants = self.0.take();
        if grants.is_empty() {
            return Ok(Vec::new());
        }
        grants.sort_by_key(|(g, _)| g.grant_id.as_uuid());
        grants.dedup_by_key(|(g, _)| g.grant_id.as_uuid());
        let granted = grants
            .iter()
            .map(|(g, _)| serde_json::to_string(g))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        let lost: Vec<(sqlx::types::Json<LostCall>, Option<String>)> = sqlx::query_as(
            "WITH given AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::text[], \
               $6::bigint[], $7::text[], $8::text[]) \
               AS g (grant_id, task_id, attempt, kind, provider, deadline_us, granted, traceparent)), \
             early AS (DELETE FROM early_grant_facts e USING given WHERE e.grant_id = given.grant_id \
               RETURNING e.grant_id, e.claimed, e.ended), \
             recorded AS (INSERT INTO grants (grant_id, task_id, attempt, kind, provider, deadline_us, granted, \
               claim_deadline_us, claimed, ended, traceparent) \
               SELECT g.grant_id, g.task_id, g.attempt, g.kind, g.provider, g.deadline_us, g.granted::jsonb, \
               now_us() + $9::bigint, coalesce(early.claimed, false), coalesce(early.ended, false), g.traceparent \
               FROM given g LEFT JOIN early ON early.grant_id = g.grant_id ORDER BY g.grant_id \
               ON CONFLICT (grant_id) DO NOTHING) \
             DELETE FROM early_losses l USING given \
             WHERE l.task_id = given.task_id AND l.attempt = given.attempt RETURNING l.lost, given.traceparent",
        )
        .bind(grants.iter().map(|(g, _)| g.grant_id.as_uuid()).collect::<Vec<_>>())
        .bind(grants.iter().map(|(g, _)| g.task_id.as_uuid()).collect::<Vec<_>>())
        .bind(grants.iter().map(|(g, _)| g.attempt).collect::<Vec<_>>())
        .bind(grants.iter().map(|(g, _)| g.kind.as_str()).collect::<Vec<_>>())
        .bind(grants.iter().map(|(g, _)| g.provider.as_str()).collect::<Vec<_>>())
        .bind(grants.iter().map(|(g, _)| g.deadline.map(|d| d.0)).collect::<Vec<_>>())
        .bind(granted)
        .bind(grants.iter().map(|(_, trace)| trace.as_deref()).collect::<Vec<_>>())
        .bind(claim_within_us)
        .fetch_all(&mut *tx)
        .await?;
        Ok(lost.into_iter().map(|(lost, traceparent)| EarlyLoss { lost: lost.0, traceparent }).collect())
    }

    fn discard(&self) {
        self.0.discard();
    }
}

/// The call intents a batch heard: the last one of each attempt, as one upsert.
#[derive(Debug, Default)]
pub(crate) struct Intents(fenceline_bus::gathered::Merged<(TaskId, i32), Option<CallIntentRecorded>>);

impl Intents {
    pub(crate) fn heard(&self, intent: &CallIntentRecorded) {
        self.0.merge((intent.task_id, intent.attempt), |last| *last = Some(intent.clone()));
    }

    /// Records each attempt's call, in task order; an intent replaces the
    /// attempt's earlier call and forgets its request id.
    async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let intents: Vec<CallIntentRecorded> = self.0.take().into_iter().filter_map(|(_, i)| i).collect();
        if intents.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO calls (task_id, attempt, step, provider, operation_key, intent_at_us) \
             SELECT * FROM unnest($1::uuid[], $2::int[], $3::text[], $4::text[], $5::text[], $6::bigint[]) \
             ON CONFLICT (task_id, attempt) DO UPDATE SET \
             step = EXCLUDED.step, provider = EXCLUDED.provider, operation_key = EXCLUDED.operation_key, \
             provider_request_id = NULL, intent_at_us = EXCLUDED.intent_at_us",
        )
        .bind(intents.iter().map(|i| i.task_id.as_uuid()).collect::<Vec<_>>())
        .bind(intents.iter().map(|i| i.attempt).collect::<Vec<_>>())
        .bind(intents.iter().map(|i| i.step.as_str()).collect::<Vec<_>>())
        .bind(intents.iter().map(|i| i.provider.as_str()).collect::<Vec<_>>())
        .bind(intents.iter().map(|i| i.operation_key.as_str()).collect::<Vec<_>>())
        .bind(intents.iter().map(|i| i.recorded_at.0).collect::<Vec<_>>())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    fn discard(&self) {
        self.0.discard();
    }
}

#[cfg(test)]
mod tests;
