//! Fenced writes group-committed: the phase writes that a process's workers hand
//! over while one statement runs are written by the next, together, with one
//! commit, each still conditional on its own fencing token and phase.

use fenceline_bus::OutboxRow;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection as _, PgConnection, PgPool, Row as _};
use tokio::sync::{mpsc, oneshot};

use super::statement::{Shape, fenced_statement, fenced_together_statement};
use crate::lease::{Stop, answered_by_the_server};

/// At most this many writes in one statement.
const MOST_WRITTEN_TOGETHER: usize = 64;

/// Writes waiting for the writer; a worker waits for room beyond this.
const MOST_WAITING: usize = 4 * MOST_WRITTEN_TOGETHER;

/// One fenced write, owned, as a worker hands it over: the execution it names by
/// grant, fencing token and expected phase, what it writes, and its outbox rows.
#[derive(Debug, Clone)]
pub(crate) struct FencedWrite {
    pub grant_id: uuid::Uuid,
    pub token: i64,
    pub was: &'static str,
    pub phase: &'static str,
    pub step: Option<String>,
    pub status: &'static str,
    pub key: Option<String>,
    pub request_id: Option<String>,
    pub renew: bool,
    pub lease_us: i64,
    pub task_id: uuid::Uuid,
    pub generation: i32,
    pub sequence_of: Option<String>,
    pub checkpoint: Option<(String, serde_json::Value, String)>,
    pub attempt: i32,
    pub shape: Shape,
    pub rows: Vec<OutboxRow>,
}

/// What a committed fenced write read back: the cancel flag, the lease granted (by
/// a renewing write, in microseconds) and the step's call `seq`.
pub(crate) type Written = (bool, Option<i64>, Option<i32>);

/// A write and where its answer goes: `None`, another worker holds the execution.
#[derive(Debug)]
struct Waiting {
    write: FencedWrite,
    answer: oneshot::Sender<Result<Option<Written>, Stop>>,
}

/// The handle workers write through. The writer, a task of its own, takes every
/// write that queued while it wrote the last ones and writes them with one
/// statement ([`fenced_together_statement`]); each worker is answered after that
/// statement committed, so a call's request still leaves only after its intent is
/// stored. Alone, a write is written at once with its own statement
/// ([`fenced_statement`]): waiting for company is never a delay.
#[derive(Debug, Clone)]
pub(crate) struct PhaseWriter {
    queue: mpsc::Sender<Waiting>,
}

impl PhaseWriter {
    /// Starts the writer on the current runtime; it ends when the last handle is dropped.
    pub fn start(pool: PgPool) -> Self {
        let (queue, waiting) = mpsc::channel(MOST_WAITING);
        tokio::spawn(write_while_handed(pool, waiting));
        Self { queue }
    }

    /// Writes `write` once it is committed, alone or with others; `None` when its
    /// token or phase no longer matches. A writer that has stopped (the process is
    /// stopping) answers as a closed pool would: the worker's retries decide.
    pub async fn write(&self, write: FencedWrite) -> Result<Option<Written>, Stop> {
        let (answer, answered) = oneshot::channel();
        self.queue.send(Waiting { write, answer }).await.map_err(|_| Stop::writer_stopped())?;
        answered.await.unwrap_or_else(|_| Err(Stop::writer_stopped()))
    }

    /// How many writes wait for the writer now.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }
}

async fn write_while_handed(pool: PgPool, mut queue: mpsc::Receiver<Waiting>) {
    let mut conn = OwnConnection::of(&pool);
    let mut handed = Vec::with_capacity(MOST_WRITTEN_TOGETHER);
    let mut later: Vec<Waiting> = Vec::new();
    loop {
        if later.is_empty() && queue.recv_many(&mut handed, MOST_WRITTEN_TOGETHER).await == 0 {
            return;
        }
        while handed.len() + later.len() < MOST_WRITTEN_TOGETHER {
            let Ok(waiting) = queue.try_recv() else { break };
            handed.push(waiting);
        }
        let (batch, rest) = one_per_task(later.drain(..).chain(handed.drain(..)));
        later = rest;
        write_together(&mut conn, batch).await;
    }
}

/// How long a statement of the writer waits for a row or key lock before it fails:
/// every worker of the process waits behind it meanwhile, and the lease renewals
/// of the executions it holds. Its writes are then tried again by their workers.
const LOCK_TIMEOUT: &str = "2s";

/// The writer's own connection, opened with [`LOCK_TIMEOUT`] on first use and again
/// after a failure that may have broken it.
struct OwnConnection {
    options: PgConnectOptions,
    open: Option<PgConnection>,
}

impl OwnConnection {
    fn of(pool: &PgPool) -> Self {
        let options = pool.connect_options().as_ref().clone().options([("lock_timeout", LOCK_TIMEOUT)]);
        Self { options, open: None }
    }

    async fn get(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        let conn = match self.open.take() {
            Some(conn) => conn,
            None => PgConnection::connect_with(&self.options).await?,
        };
        Ok(self.open.insert(conn))
    }

    /// Runs `f` on the connection; a failure the server did not answer closes it.
    async fn with<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let result = match self.get().await {
            Ok(conn) => f(conn).await,
            Err(error) => Err(error),
        };
        if let Err(error) = &result
            && !answered_by_the_server(error)
        {
            self.open = None;
        }
        result
    }
}

/// Splits `waiting` into a batch that names each task once, in the order handed,
/// and what is left for the next one: a statement's parts never see each other's
/// writes, so two writes of one task (two grants, one of them stale) go one after
/// the other.
fn one_per_task(waiting: impl Iterator<Item = Waiting>) -> (Vec<Waiting>, Vec<Waiting>) {
    let mut seen = std::collections::HashSet::new();
    waiting.partition(|waiting| seen.insert(waiting.write.task_id))
}

/// Writes `batch` with one statement and answers each. If the statement fails, each
/// write is tried alone, so that what failed one is answered for it alone. Where
/// the failed statement may have committed (no answer from the server), a write
/// that then matches nothing is answered with the failure, not "fenced": it may be
/// the write itself, and the worker's retry settles it
/// ([`super::Recorder::record`]).
async fn write_together(conn: &mut OwnConnection, mut batch: Vec<Waiting>) {
    if let [_] = batch.as_slice() {
        let Some(Waiting { write, answer }) = batch.into_iter().next() else { return };
        let _ = answer.send(conn.with(async |conn| write_alone(conn, &write).await).await.map_err(Stop::from));
        return;
    }
    // Rows locked in one order by every instance's writer.
    batch.sort_by_key(|waiting| waiting.write.grant_id);
    match conn.with(async |conn| written_together(conn, &batch).await).await {
        Ok(written) => {
            for (waiting, written) in batch.into_iter().zip(written) {
                let _ = waiting.answer.send(Ok(written));
            }
        }
        Err(error) => {
            tracing::warn!(%error, writes = batch.len(), "fenced writes written together failed; writing each alone");
            let in_doubt = !answered_by_the_server(&error);
            for Waiting { write, answer } in batch {
                let alone = match conn.with(async |conn| write_alone(conn, &write).await).await {
                    Ok(None) if in_doubt => Err(Stop::in_doubt(&error)),
                    alone => alone.map_err(Stop::from),
                };
                let _ = answer.send(alone);
            }
        }
    }
}

/// One write with its own statement, which commits on its own.
pub(crate) async fn write_alone(conn: &mut PgConnection, write: &FencedWrite) -> Result<Option<Written>, sqlx::Error> {
    let statement = fenced_statement(write.shape);
    let row = bind_alone(sqlx::query(&statement), write).fetch_optional(&mut *conn).await?;
    row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).transpose()
}

/// Binds the parameters of [`fenced_statement`].
pub(crate) fn bind_alone<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    write: &'q FencedWrite,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let checkpoint = write.checkpoint.as_ref();
    query
        .bind(write.grant_id)
        .bind(write.token)
        .bind(write.was)
        .bind(write.phase)
        .bind(write.step.as_deref())
        .bind(write.status)
        .bind(write.key.as_deref())
        .bind(write.request_id.as_deref())
        .bind(write.renew)
        .bind(write.lease_us)
        .bind(write.task_id)
        .bind(write.generation)
        .bind(write.sequence_of.as_deref())
        .bind(checkpoint.map(|(step, _, _)| step.as_str()))
        .bind(checkpoint.map(|(_, output, _)| output))
        .bind(checkpoint.map(|(_, _, sha)| sha.as_str()))
        .bind(write.attempt)
        .bind(write.rows.as_slice())
}

/// The writes of `batch` with one statement and one commit; for each, in order,
/// what it read back, or `None` where its token or phase no longer matched.
async fn written_together(conn: &mut PgConnection, batch: &[Waiting]) -> Result<Vec<Option<Written>>, sqlx::Error> {
    let writes: Vec<&FencedWrite> = batch.iter().map(|waiting| &waiting.write).collect();
    let shape = writes.iter().fold(Shape::default(), |shape, write| shape.with(write.shape));
    let column = |f: &dyn Fn(&FencedWrite) -> Option<String>| writes.iter().map(|w| f(w)).collect::<Vec<_>>();
    let (rows, row_writes): (Vec<OutboxRow>, Vec<i32>) = writes
        .iter()
        .enumerate()
        .flat_map(|(n, write)| write.rows.iter().map(move |row| (row.clone(), n as i32 + 1)))
        .unzip();
    let statement = fenced_together_statement(shape);
    let read: Vec<(i64, bool, Option<i64>, Option<i32>)> = sqlx::query_as(&statement)
        .bind(writes.iter().map(|w| w.grant_id).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.token).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.was).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.phase).collect::<Vec<_>>())
        .bind(column(&|w| w.step.clone()))
        .bind(writes.iter().map(|w| w.status).collect::<Vec<_>>())
        .bind(column(&|w| w.key.clone()))
        .bind(column(&|w| w.request_id.clone()))
        .bind(writes.iter().map(|w| w.renew).collect::<Vec<_>>())
        .bind(writes.first().map_or(0, |w| w.lease_us))
        .bind(writes.iter().map(|w| w.task_id).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.generation).collect::<Vec<_>>())
        .bind(column(&|w| w.sequence_of.clone()))
        .bind(column(&|w| w.checkpoint.as_ref().map(|(step, _, _)| step.clone())))
        .bind(writes.iter().map(|w| w.checkpoint.as_ref().map(|(_, output, _)| output.clone())).collect::<Vec<_>>())
        .bind(column(&|w| w.checkpoint.as_ref().map(|(_, _, sha)| sha.clone())))
        .bind(writes.iter().map(|w| w.attempt).collect::<Vec<_>>())
        .bind(rows)
        .bind(row_writes)
        .fetch_all(&mut *conn)
        .await?;
    let mut answers = vec![None; writes.len()];
    for (n, cancel_requested, granted_us, seq) in read {
        if let Some(answer) = usize::try_from(n - 1).ok().and_then(|i| answers.get_mut(i)) {
            *answer = Some((cancel_requested, granted_us, seq));
        }
    }
    Ok(answers)
}

#[cfg(test)]
mod tests;
