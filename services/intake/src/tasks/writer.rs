//! Submissions group-committed: whatever the API and the webhooks submit while one
//! statement runs is written by the next, together, with one commit.

use fenceline_bus::OutboxWriter;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use super::submission::{Submission, Submitted, accepted_and_committed, log_accepted, submit, submit_all_in};
use crate::auth::Tenant;
use crate::problem::ApiError;
use crate::tasks::{IdempotencyKey, ValidTask};

/// At most this many submissions in one statement.
const MOST_WRITTEN_TOGETHER: usize = 128;

/// Submissions waiting for the writer; a request waits for room beyond this.
const MOST_WAITING: usize = 4 * MOST_WRITTEN_TOGETHER;

/// The handle requests submit through. The writer, a task of its own, takes every
/// submission that queued while it wrote the last ones and writes them with one
/// statement ([`submit_all_in`]); each request is answered after that statement
/// committed, so a `202` still means the task is stored. With one request at a
/// time a statement holds one submission: waiting for company is never a delay.
#[derive(Debug, Clone)]
pub struct SubmissionWriter {
    queue: mpsc::Sender<Waiting>,
}

/// A submission and where its answer goes.
#[derive(Debug)]
struct Waiting {
    submission: Submission,
    answer: oneshot::Sender<Result<Submitted, ApiError>>,
}

impl SubmissionWriter {
    /// Starts the writer on the current runtime; it ends when the last handle is dropped.
    pub fn start(pool: PgPool, outbox: OutboxWriter) -> Self {
        let (queue, waiting) = mpsc::channel(MOST_WAITING);
        tokio::spawn(write_while_submitted(pool, outbox, waiting));
        Self { queue }
    }

    /// Submits `task` under `key` for `tenant` from `source`, exactly once per key of
    /// `source`, as [`submit`] does, and answers once it is committed. A writer that
    /// has stopped (the service is stopping) answers `503`: the client retries with
    /// the same key and hears the outcome either way.
    pub async fn submit(
        &self,
        tenant: &Tenant,
        key: &IdempotencyKey,
        task: ValidTask,
        source: &str,
    ) -> Result<Submitted, ApiError> {
        let kind = task.kind.clone();
        // In the request's trace, which the writer's task is not.
        let submission = Submission::new(tenant, key, task, source);
        let (answer, answered) = oneshot::channel();
        self.queue.send(Waiting { submission, answer }).await.map_err(|_| ApiError::Overloaded)?;
        let submitted = answered.await.unwrap_or(Err(ApiError::Overloaded));
        log_accepted(&submitted, tenant, &kind, source);
        submitted
    }

    /// How many submissions wait for the writer now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.queue.max_capacity() - self.queue.capacity()
    }
}

async fn write_while_submitted(pool: PgPool, outbox: OutboxWriter, mut queue: mpsc::Receiver<Waiting>) {
    let mut batch = Vec::with_capacity(MOST_WRITTEN_TOGETHER);
    while queue.recv_many(&mut batch, MOST_WRITTEN_TOGETHER).await > 0 {
        write_together(&pool, &outbox, std::mem::take(&mut batch)).await;
    }
}

/// Writes `batch` with one statement and answers each. If the statement fails, each
/// submission is written alone, so that what failed one (a key another instance
/// holds in the opposite order, a lost connection) is answered for it alone; a
/// key the failed statement did commit is then answered as a replay of its task.
async fn write_together(pool: &PgPool, outbox: &OutboxWriter, batch: Vec<Waiting>) {
    let (submissions, answers): (Vec<Submission>, Vec<_>) =
        batch.into_iter().map(|waiting| (waiting.submission, waiting.answer)).unzip();
    let written = match pool.acquire().await {
        Ok(mut conn) => submit_all_in(&mut conn, outbox, &submissions).await,
        Err(error) => Err(error.into()),
    };
    match written {
        Ok(submitted) => {
            accepted_and_committed(outbox, &submitted);
            for (answer, submitted) in answers.into_iter().zip(submitted) {
                let _ = answer.send(submitted);
            }
        }
        Err(error) if submissions.len() == 1 => {
            let _ = answers.into_iter().next().map(|answer| answer.send(Err(error)));
        }
        Err(error) => {
            tracing::warn!(%error, submissions = submissions.len(), "submissions written together failed; writing each alone");
            for (answer, submission) in answers.into_iter().zip(submissions) {
                let _ = answer.send(submit(pool, outbox, &submission).await);
            }
        }
    }
}

#[cfg(test)]
mod tests;
