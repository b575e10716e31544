//! Fenced phase transitions: every write a worker makes to its execution is one
//! transaction, conditional on the worker's fencing token and the phase it last
//! wrote, carrying the events that announce it and, where a step ends, its
//! checkpoint or the operation key's `seq` bump; a transition with no key to move
//! is a single statement. Zero rows means another worker holds the execution. A
//! transient database error is retried until the attempt budget ends, also after
//! the lease lapsed (renewals fail in the same outage): the write stays
//! conditional on the token, so a worker that knows the outcome records it unless
//! another worker took the execution over meanwhile.

use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_domain::calls::Backoff;
use fenceline_domain::vocabulary::{AttemptOutcome, ErrorClass, Phase, ReleaseReason};
use fenceline_events::{AttemptFailed, AttemptReleased, Event, topics};
use sqlx::{PgConnection, PgPool, Row as _};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::ExecutorSettings;
use crate::lease::{Lease, Stop, jitter};
use statement::{Shape, fenced_statement};
use writer::{FencedWrite, PhaseWriter};

/// What the execution row becomes in one fenced write.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Transition<'a> {
    pub phase: Phase,
    /// The execution's status after the write.
    pub status: AttemptOutcome,
    pub step: Option<&'a str>,
    /// The operation key of the call, and the provider's request id once known.
    pub call: Option<(&'a str, Option<&'a str>)>,
    /// A definite "nothing was done" for this step's key: the next try of the
    /// step uses a new operation key, unless another attempt sent this one.
    pub new_key: Option<NewKey<'a>>,
    /// A finished step's output, stored with the phase.
    pub checkpoint: Option<Checkpoint<'a>>,
    /// The step whose call `seq` is read (made at 0 the first time) in the same
    /// transaction, so that starting a step costs one commit.
    pub sequence_of: Option<&'a str>,
    /// Renew the lease in the same conditional write, by the database's clock, as
    /// [`Workers::renew`] does: the renewal right before a request leaves rides on
    /// the call intent's commit.
    pub renew_lease: bool,
}

/// The `seq` the call used: the bump applies only if it is still the current one,
/// so neither a repeated nor a stale write can move the key twice; and only if no
/// other attempt ever recorded an intent with `key`, so a key that may have done
/// the work (an earlier attempt's answer was in doubt) is never left behind.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewKey<'a> {
    pub step: &'a str,
    pub used_seq: i32,
    /// The operation key the call sent.
    pub key: &'a str,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Checkpoint<'a> {
    pub step: &'a str,
    pub output: &'a serde_json::Value,
    pub sha256: &'a str,
}

impl<'a> Transition<'a> {
    /// To `phase`, still running.
    pub fn to(phase: Phase) -> Self {
        Transition {
            phase,
            status: AttemptOutcome::Running,
            step: None,
            call: None,
            new_key: None,
            checkpoint: None,
            sequence_of: None,
            renew_lease: false,
        }
    }

    /// The attempt ends at the phase it reached, with `status`.
    pub fn end(lease: &Lease, status: AttemptOutcome) -> Self {
        Transition { status, ..Transition::to(lease.phase) }
    }

    pub fn step(self, step: &'a str) -> Self {
        Transition { step: Some(step), ..self }
    }

    pub fn status(self, status: AttemptOutcome) -> Self {
        Transition { status, ..self }
    }

    pub fn call(self, key: &'a str, request_id: Option<&'a str>) -> Self {
        Transition { call: Some((key, request_id)), ..self }
    }

    /// Also reads the call `seq` of `step` ([`Recorded::seq`]).
    pub fn sequence_of(self, step: &'a str) -> Self {
        Transition { sequence_of: Some(step), ..self }
    }

    /// Also renews the lease ([`Recorded::renewed`]).
    pub fn renewing(self) -> Self {
        Transition { renew_lease: true, ..self }
    }
}

/// What a fenced write read back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Recorded {
    /// Whether a cancellation was requested by the time of the write.
    pub cancel_requested: bool,
    /// The step's call `seq`, when the transition asked for it and this write (not
    /// an earlier one found on a retry) committed it.
    pub seq: Option<i32>,
    /// Whether this write renewed the lease (the worker's lease is extended).
    pub renewed: bool,
}

/// Waits between tries of a write that met a database error.
const WRITE_RETRY: Backoff = Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(2) };

/// The fenced writes of one process's workers: each phase and status an execution
/// reaches, with its events, written only under the lease's fencing token.
#[derive(Debug, Clone)]
pub struct Recorder {
    pub pool: PgPool,
    pub outbox: OutboxWriter,
    pub settings: Arc<ExecutorSettings>,
    writers: Arc<[PhaseWriter]>,
}

/// How many workers share a [`PhaseWriter`] (and a claims writer): enough writers
/// that a write seldom waits behind a statement in flight at a light load, few
/// enough that writes are written together under a heavy one.
const WORKERS_A_WRITER: usize = 2;

/// How many writers (of phases, and of claims) `workers` workers share.
pub(crate) fn writers_for(workers: usize) -> usize {
    workers.div_ceil(WORKERS_A_WRITER).max(1)
}

/// The writer of `lanes` that every write keyed by `key` goes to.
pub(crate) fn lane_of<T>(lanes: &[T], key: uuid::Uuid) -> &T {
    &lanes[(key.as_u128() % lanes.len() as u128) as usize]
}

impl Recorder {
    /// A recorder whose writes go through the [`PhaseWriter`]s it starts on the
    /// current runtime, one for every [`WORKERS_A_WRITER`] workers: a write waits
    /// only for the statement in flight in its own writer, and an execution's
    /// writes all go through one writer.
    pub fn new(pool: PgPool, outbox: OutboxWriter, settings: Arc<ExecutorSettings>) -> Self {
        let writers = (0..writers_for(settings.workers)).map(|_| PhaseWriter::start(pool.clone())).collect();
        Self { pool, outbox, settings, writers }
    }

    /// The writer of `lease`'s execution.
    fn writer(&self, lease: &Lease) -> &PhaseWriter {
        lane_of(&self.writers, lease.task_id.as_uuid())
    }

    /// Writes `transition` and `events` (after the lease's unannounced ones) in one
    /// fenced transaction. A database
    /// error is tried again with backoff until the attempt budget ends, while no
    /// other worker is known to hold the execution; a retry
    /// that finds its own earlier commit (the answer to the commit was lost) counts
    /// as done.
    pub(crate) async fn record(
        &self,
        lease: &mut Lease,
        transition: Transition<'_>,
        events: &[Event],
    ) -> Result<Recorded, Stop> {
        let mut tries = 0u32;
        loop {
            let outcome = self.try_record(lease, &transition, events).await;
            match outcome {
                Ok(recorded) => {
                    lease.phase = transition.phase;
                    lease.unannounced.clear();
                    count_ends(events);
                    return Ok(recorded);
                }
                Err(Stop::Fenced) if tries > 0 && self.already_recorded(lease, &transition).await => {
                    lease.phase = transition.phase;
                    lease.unannounced.clear();
                    count_ends(events);
                    return Ok(Recorded { cancel_requested: false, seq: None, renewed: false });
                }
                Err(Stop::Bus(fenceline_bus::Error::Database(e)))
                    if !lease.fenced() && Instant::now() < lease.writes_until =>
                {
                    let wait = WRITE_RETRY.delay(tries, None, 0.5 + jitter() / 2.0);
                    warn!(task_id = %lease.task_id, error = %e, phase = %transition.phase, ?wait,
                        "a fenced write failed; trying again");
                    tokio::time::sleep(wait).await;
                    tries += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One try of a fenced write: handed to the process's [`PhaseWriter`], which
    /// writes it with one statement that commits on its own or together with the
    /// writes other workers handed over meanwhile, unless the transition moves an
    /// operation key, which adds [`bump_seq`] in a transaction of its own around
    /// it. Either way the conditional update on the fencing token guards
    /// everything written: a fenced worker's write changes nothing.
    async fn try_record(&self, lease: &Lease, t: &Transition<'_>, events: &[Event]) -> Result<Recorded, Stop> {
        // Before the write is handed over: the lease it renews holds at least this long.
        let sent = tokio::time::Instant::now();
        let rows = (lease.unannounced.iter().chain(events))
            .map(|event| self.outbox.row(topics::ATTEMPTS, event))
            .collect::<Result<Vec<_>, _>>()?;
        let write = self.fenced_write(lease, t, rows);
        let written = match t.new_key {
            None => self.writer(lease).write(write).await?,
            Some(new_key) => {
                let mut tx = self.pool.begin().await?;
                let statement = fenced_statement(write.shape);
                let row = writer::bind_alone(sqlx::query(&statement), &write).fetch_optional(&mut *tx).await?;
                // Dropping the transaction rolls back: nothing below happens for a fenced worker.
                let Some(row) = row else { return Err(Stop::Fenced) };
                if !bump_seq(&mut tx, lease, new_key).await? {
                    info!(task_id = %lease.task_id, step = new_key.step, key = new_key.key,
                        "the operation key stays: another attempt sent it (its outcome may be in doubt) or a write moved it already");
                }
                tx.commit().await?;
                Some((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))
            }
        };
        let (cancel_requested, granted_us, seq) = written.ok_or(Stop::Fenced)?;
        self.outbox.committed();
        if let Some(us) = granted_us {
            lease.extend(sent, Duration::from_micros(u64::try_from(us).unwrap_or(0)));
        }
        Ok(Recorded { cancel_requested, seq, renewed: granted_us.is_some() })
    }

    /// `t` written by `lease`'s worker, with `rows`, as the writer takes it.
    fn fenced_write(&self, lease: &Lease, t: &Transition<'_>, rows: Vec<fenceline_bus::OutboxRow>) -> FencedWrite {
        let (key, request_id) = t.call.unzip();
        FencedWrite {
            grant_id: lease.grant_id.as_uuid(),
            token: lease.token,
            was: lease.phase.as_str(),
            phase: t.phase.as_str(),
            step: t.step.map(str::to_owned),
            status: t.status.as_str(),
            key: key.map(str::to_owned),
            request_id: request_id.flatten().map(str::to_owned),
            renew: t.renew_lease,
            lease_us: self.settings.lease_us(),
            task_id: lease.task_id.as_uuid(),
            generation: lease.generation,
            sequence_of: t.sequence_of.map(str::to_owned),
            checkpoint: t.checkpoint.map(|c| (c.step.to_owned(), c.output.clone(), c.sha256.to_owned())),
            attempt: lease.attempt,
            shape: Shape {
                sequence: t.sequence_of.is_some(),
                checkpoint: t.checkpoint.is_some(),
                // A call intent names the key this generation's call of the step sends.
                sent: t.phase == Phase::CallIntent && t.call.is_some() && t.step.is_some(),
            },
            rows,
        }
    }

    /// Whether the execution already shows `t` written under this worker's token.
    async fn already_recorded(&self, lease: &Lease, t: &Transition<'_>) -> bool {
        let row: Result<Option<(i64, String, String)>, _> =
            sqlx::query_as("SELECT fencing_token, phase, status FROM executions WHERE grant_id = $1")
                .bind(lease.grant_id.as_uuid())
                .fetch_optional(&self.pool)
                .await;
        matches!(row, Ok(Some((token, phase, status)))
            if token == lease.token && phase == t.phase.as_str() && status == t.status.as_str())
    }

    /// Publishes what a fenced worker knows (an evidence event, no phase): the
    /// execution is another worker's, so nothing but the outbox row is written.
    /// Tried again on a database error until the attempt budget ends; given up
    /// then with a warning, as the case keeps the evidence it has.
    pub(crate) async fn report(&self, lease: &Lease, event: &Event) {
        let mut tries = 0u32;
        loop {
            let written: Result<(), Stop> = async {
                let mut tx = self.pool.begin().await?;
                self.outbox.append(&mut tx, topics::ATTEMPTS, None, event).await?;
                tx.commit().await?;
                Ok(())
            }
            .await;
            match written {
                Ok(()) => {
                    self.outbox.committed();
                    info!(task_id = %lease.task_id, event_type = event.event_type(), "a fenced worker reported what it knows");
                    return;
                }
                Err(e) if Instant::now() < lease.writes_until => {
                    let wait = WRITE_RETRY.delay(tries, None, 0.5 + jitter() / 2.0);
                    warn!(task_id = %lease.task_id, error = %e, ?wait, "a fenced worker's report failed; trying again");
                    tokio::time::sleep(wait).await;
                    tries += 1;
                }
                Err(e) => {
                    warn!(task_id = %lease.task_id, error = %e, "a fenced worker's report could not be written");
                    return;
                }
            }
        }
    }

    /// Ends the attempt as failed with `class`. `new_key`: the provider certainly
    /// did nothing with the request this call sent, so the next try gets a new key,
    /// unless another attempt sent the same key ([`NewKey`]).
    pub(crate) async fn fail(
        &self,
        lease: &mut Lease,
        class: ErrorClass,
        message: &str,
        retry_after: Option<Duration>,
        spent: bool,
        new_key: Option<NewKey<'_>>,
    ) -> Result<(), Stop> {
        let event = Event::AttemptFailed(AttemptFailed {
            task_id: lease.task_id,
            attempt: lease.attempt,
            grant_id: lease.grant_id,
            error_class: class,
            message: message.to_owned(),
            retry_after_ms: retry_after.and_then(|d| i64::try_from(d.as_millis()).ok()),
            money_may_have_been_spent: spent,
            failed_at: crate::clock::now(),
        });
        let transition = Transition { new_key, ..Transition::end(lease, AttemptOutcome::Failed) };
        self.record(lease, transition, &[event]).await?;
        info!(task_id = %lease.task_id, %class, message, "attempt failed");
        Ok(())
    }

    /// Gives the grant back before any call.
    pub(crate) async fn release(&self, lease: &mut Lease, reason: ReleaseReason) -> Result<(), Stop> {
        let event = released(lease, reason);
        self.record(lease, Transition::end(lease, AttemptOutcome::Released), &[event]).await?;
        info!(task_id = %lease.task_id, %reason, "attempt released before any call");
        Ok(())
    }
}

/// Counts the attempts `events` end, once they are committed.
fn count_ends(events: &[Event]) {
    let metrics = &fenceline_telemetry::metrics::global().executor;
    for event in events {
        match event {
            Event::AttemptSucceeded(_) => metrics.attempt_ended(AttemptOutcome::Succeeded.as_str(), "none"),
            Event::AttemptFailed(e) => metrics.attempt_ended(AttemptOutcome::Failed.as_str(), e.error_class.as_str()),
            Event::AttemptReleased(e) => metrics.attempt_ended(AttemptOutcome::Released.as_str(), e.reason.as_str()),
            _ => {}
        }
    }
}

pub(crate) fn released(lease: &Lease, reason: ReleaseReason) -> Event {
    Event::AttemptReleased(AttemptReleased {
        task_id: lease.task_id,
        attempt: lease.attempt,
        grant_id: lease.grant_id,
        reason,
        released_at: crate::clock::now(),
    })
}

/// The step's call `seq` (0 the first time): with the generation and the step it
/// makes the operation key. Written in the caller's transaction.
pub(crate) async fn sequence(tx: &mut PgConnection, lease: &Lease, step: &str) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO call_sequences (task_id, generation, step) VALUES ($1, $2, $3) \
         ON CONFLICT (task_id, generation, step) DO UPDATE SET seq = call_sequences.seq RETURNING seq",
    )
    .bind(lease.task_id.as_uuid())
    .bind(lease.generation)
    .bind(step)
    .fetch_one(&mut *tx)
    .await
}

/// When `key` was first sent for the task's `step` (its first call intent), if it
/// was, and the database's clock now, in microseconds.
pub(crate) async fn key_first_sent(
    conn: &mut PgConnection,
    lease: &Lease,
    step: &str,
    key: &str,
) -> Result<(Option<i64>, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT min(sent_key_first_at_us), now_us() \
         FROM call_sequences WHERE task_id = $1 AND step = $2 AND sent_key = $3",
    )
    .bind(lease.task_id.as_uuid())
    .bind(step)
    .bind(key)
    .fetch_one(&mut *conn)
    .await
}

/// Moves the step's `seq` past the one the call used, inside the fenced write,
/// unless another attempt recorded an intent with the same key: a definite "nothing
/// done" speaks only for this request, and an earlier request under the key may
/// have done the work (its answer was in doubt, or its worker was lost), so the
/// next try must send that key again, where a deduping provider answers with the
/// work already done (docs/provider-protocol.md, "Error classes").
async fn bump_seq(tx: &mut PgConnection, lease: &Lease, new_key: NewKey<'_>) -> Result<bool, Stop> {
    let bumped = sqlx::query(
        "UPDATE call_sequences SET seq = seq + 1 WHERE task_id = $1 AND generation = $2 AND step = $3 AND seq = $4 \
         AND NOT EXISTS (SELECT 1 FROM executions \
             WHERE task_id = $1 AND operation_key = $5 AND grant_id <> $6)",
    )
    .bind(lease.task_id.as_uuid())
    .bind(lease.generation)
    .bind(new_key.step)
    .bind(new_key.used_seq)
    .bind(new_key.key)
    .bind(lease.grant_id.as_uuid())
    .execute(&mut *tx)
    .await?;
    Ok(bumped.rows_affected() == 1)
}

mod statement;
#[cfg(test)]
mod tests;
mod writer;
