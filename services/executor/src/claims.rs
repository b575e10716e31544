//! Claims: of a handed grant by its id, group-committed (the claims a process's
//! workers ask for while one statement runs are made by the next, together, with
//! one commit), and the idle walk's claim of the oldest claimable execution.

use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use crate::lease::{Stop, answered_by_the_server};

/// At most this many claims in one statement.
const MOST_CLAIMED_TOGETHER: usize = 64;

/// One claimed execution, as the claim returned it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct ClaimRow {
    pub(crate) grant_id: uuid::Uuid,
    pub(crate) task_id: uuid::Uuid,
    pub(crate) attempt: i32,
    pub(crate) generation: i32,
    pub(crate) kind: String,
    pub(crate) input_json: String,
    pub(crate) resume_after_step: Option<String>,
    pub(crate) fencing_token: i64,
    pub(crate) lease_expires_at_us: i64,
    pub(crate) takeover: bool,
    pub(crate) first_claimed_at_us: i64,
    pub(crate) lease_budget_ms: i64,
    pub(crate) phase: String,
    pub(crate) phase_at_us: i64,
    pub(crate) step: Option<String>,
    pub(crate) operation_key: Option<String>,
    pub(crate) provider_request_id: Option<String>,
    pub(crate) cancel_requested: bool,
    pub(crate) deadline_us: Option<i64>,
    /// The database's clock when it granted the lease (micros).
    pub(crate) db_now_us: i64,
    /// The trace of the grant; the execution's span continues it.
    pub(crate) traceparent: Option<String>,
    /// The claim started the execution's step (`step`, phase `step_started`) and
    /// read its call `seq`, this one.
    pub(crate) started_seq: Option<i32>,
}

/// A claim a worker asks for: of the handed grant `grant_id` for `worker`,
/// starting `start` (chosen by the kind `kind`) if it is a first attempt of it.
#[derive(Debug, Clone)]
pub(crate) struct HandedClaim {
    pub worker: String,
    pub grant_id: uuid::Uuid,
    pub start: Option<String>,
    pub kind: String,
}

/// A claim and where its answer goes: `None`, the grant is not ready (another
/// worker claimed it, or it ended).
#[derive(Debug)]
struct Asking {
    claim: HandedClaim,
    answer: oneshot::Sender<Result<Option<ClaimRow>, Stop>>,
}

/// The handle workers claim handed grants through. Its task takes every claim
/// asked for while it made the last ones and makes them with one statement
/// ([`CLAIM_HANDED`]), which commits on its own; alone, a claim is made at once.
#[derive(Debug, Clone)]
pub(crate) struct ClaimWriter {
    /// One queue a writer; a grant's claims go to one of them.
    lanes: std::sync::Arc<[mpsc::Sender<Asking>]>,
}

impl ClaimWriter {
    /// Starts `writers` writers on the current runtime (at least one); they end
    /// when the last handle is dropped.
    pub fn start(pool: PgPool, lease_us: i64, writers: usize) -> Self {
        let lanes = (0..writers.max(1))
            .map(|_| {
                let (queue, asked) = mpsc::channel(4 * MOST_CLAIMED_TOGETHER);
                tokio::spawn(claim_while_asked(pool.clone(), lease_us, asked));
                queue
            })
            .collect();
        Self { lanes }
    }

    /// Claims `claim`'s grant once the claim is committed, alone or with others.
    pub async fn claim(&self, claim: HandedClaim) -> Result<Option<ClaimRow>, Stop> {
        let (answer, answered) = oneshot::channel();
        let lane = crate::record::lane_of(&self.lanes, claim.grant_id);
        lane.send(Asking { claim, answer }).await.map_err(|_| Stop::writer_stopped())?;
        answered.await.unwrap_or_else(|_| Err(Stop::writer_stopped()))
    }

    /// How many claims wait for the writer now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.lanes.iter().map(|queue| queue.max_capacity() - queue.capacity()).sum()
    }
}

async fn claim_while_asked(pool: PgPool, lease_us: i64, mut asked: mpsc::Receiver<Asking>) {
    let mut batch = Vec::with_capacity(MOST_CLAIMED_TOGETHER);
    while asked.recv_many(&mut batch, MOST_CLAIMED_TOGETHER).await > 0 {
        claim_together(&pool, lease_us, std::mem::take(&mut batch)).await;
    }
}

/// Makes the claims of `batch` with one statement and answers each; a grant asked
/// for twice is claimed for the first asker only. If the statement fails, each
/// claim is made alone, so that what failed one is answered for it alone. A claim
/// answered with a failure leaves its grant to the walk, once its lease expired if
/// the failed statement did claim it.
async fn claim_together(pool: &PgPool, lease_us: i64, batch: Vec<Asking>) {
    let mut seen = std::collections::HashSet::new();
    let (batch, twice): (Vec<Asking>, Vec<Asking>) = batch.into_iter().partition(|a| seen.insert(a.claim.grant_id));
    for asking in twice {
        let _ = asking.answer.send(Ok(None));
    }
    let claims: Vec<&HandedClaim> = batch.iter().map(|asking| &asking.claim).collect();
    match claimed(pool, lease_us, &claims).await {
        Ok(mut rows) => {
            for asking in batch {
                let row =
                    rows.iter().position(|row| row.grant_id == asking.claim.grant_id).map(|i| rows.swap_remove(i));
                let _ = asking.answer.send(Ok(row));
            }
        }
        Err(error) if batch.len() == 1 => {
            if let Some(asking) = batch.into_iter().next() {
                let _ = asking.answer.send(Err(error.into()));
            }
        }
        Err(error) => {
            tracing::warn!(%error, claims = batch.len(), "claims made together failed; making each alone");
            // Without the server's answer the statement may have committed: a grant
            // then found claimed may be this claim's, and is answered as the failure.
            let in_doubt = !answered_by_the_server(&error);
            for asking in batch {
                let row = match claimed(pool, lease_us, &[&asking.claim]).await {
                    Ok(rows) if rows.is_empty() && in_doubt => Err(Stop::in_doubt(&error)),
                    Ok(rows) => Ok(rows.into_iter().next()),
                    Err(error) => Err(Stop::from(error)),
                };
                let _ = asking.answer.send(row);
            }
        }
    }
}

/// The rows of the executions `claims` claimed, with one statement.
async fn claimed(pool: &PgPool, lease_us: i64, claims: &[&HandedClaim]) -> Result<Vec<ClaimRow>, sqlx::Error> {
    sqlx::query_as(CLAIM_HANDED)
        .bind(claims.iter().map(|c| c.worker.as_str()).collect::<Vec<_>>())
        .bind(lease_us)
        .bind(claims.iter().map(|c| c.grant_id).collect::<Vec<_>>())
        .bind(claims.iter().map(|c| c.start.as_deref()).collect::<Vec<_>>())
        .bind(claims.iter().map(|c| c.kind.as_str()).collect::<Vec<_>>())
        .fetch_all(pool)
        .await
}

/// What a claim sets, for the worker `$w`; `$2` the lease in micros.
macro_rules! claim_sets {
    ($w:literal) => {
        concat!(
            "fencing_token = e.fencing_token + 1, worker = ",
            $w,
            ", lease_expires_at_us = clock.now_us + $2, \
             takeover = (e.status = 'running'), status = 'running', \
             first_claimed_at_us = COALESCE(e.first_claimed_at_us, clock.now_us)"
        )
    };
}
/// What a claim returns.
macro_rules! claim_returns {
    () => {
        "e.grant_id, e.task_id, e.attempt, e.generation, e.kind, e.input_json, e.resume_after_step, \
         e.fencing_token, e.lease_expires_at_us, e.takeover, e.first_claimed_at_us, e.lease_budget_ms, \
         e.phase, e.phase_at_us, e.step, e.operation_key, e.provider_request_id, e.cancel_requested, \
         e.deadline_us, clock.now_us AS db_now_us, e.traceparent"
    };
}

/// The claim of the oldest ready execution or expired lease for the worker `$1`,
/// which keeps the phase a lease taken over had reached.
pub(crate) const CLAIM_OLDEST: &str = concat!(
    "WITH clock AS (SELECT now_us() AS now_us), next AS ( \
       SELECT grant_id FROM executions, clock \
       WHERE status = 'ready' OR (status = 'running' AND lease_expires_at_us < clock.now_us) \
       ORDER BY created_at LIMIT 1 FOR UPDATE OF executions SKIP LOCKED) \
     UPDATE executions e SET ",
    claim_sets!("$1"),
    ", phase = COALESCE(e.phase, 'claimed'), phase_at_us = COALESCE(e.phase_at_us, clock.now_us) \
     FROM next, clock WHERE e.grant_id = next.grant_id RETURNING ",
    claim_returns!(),
    ", NULL::int4 AS started_seq"
);

/// The claims of the handed grants `$3` (for the workers `$1`) that are ready,
/// through the primary key. Given the step `$4` to start and the kind `$5` it was
/// chosen by, a first attempt of that kind is claimed straight into
/// `step_started` and the step's call `seq` is read (made at 0 the first time), as
/// the step's own `step_started` write would; any other is claimed at `claimed`.
/// The rows are locked in grant order, and one locked by someone else is skipped.
const CLAIM_HANDED: &str = concat!(
    "WITH clock AS (SELECT now_us() AS now_us), \
     given AS (SELECT * FROM unnest($1::text[], $3::uuid[], $4::text[], $5::text[]) AS g(worker, grant_id, start, kind)), \
     next AS ( \
       SELECT e.grant_id, g.worker, g.start, (g.start IS NOT NULL AND e.attempt = 1 AND e.generation = 0 \
           AND e.resume_after_step IS NULL AND e.kind = g.kind) AS starts \
       FROM executions e JOIN given g ON e.grant_id = g.grant_id WHERE (e.status = 'ready') IS TRUE \
       ORDER BY e.grant_id FOR UPDATE OF e SKIP LOCKED), \
     claimed AS ( \
       UPDATE executions e SET ",
    claim_sets!("next.worker"),
    ", phase = CASE WHEN next.starts THEN 'step_started' ELSE COALESCE(e.phase, 'claimed') END, \
         phase_at_us = CASE WHEN next.starts THEN clock.now_us ELSE COALESCE(e.phase_at_us, clock.now_us) END, \
         step = CASE WHEN next.starts THEN next.start ELSE e.step END \
       FROM next, clock WHERE e.grant_id = next.grant_id RETURNING next.starts, next.start, ",
    claim_returns!(),
    "), \
     step_seq AS ( \
       INSERT INTO call_sequences (task_id, generation, step) SELECT task_id, generation, start FROM claimed \
       WHERE starts ON CONFLICT (task_id, generation, step) DO UPDATE SET seq = call_sequences.seq \
       RETURNING task_id, generation, step, seq) \
     SELECT claimed.*, s.seq AS started_seq FROM claimed \
     LEFT JOIN step_seq s ON s.task_id = claimed.task_id AND s.generation = claimed.generation AND s.step = claimed.start"
);

#[cfg(test)]
mod tests;
