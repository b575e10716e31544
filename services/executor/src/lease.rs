//! A worker's lease on one execution: the hold itself (its fencing token, the
//! phase it last wrote, until when it surely holds), why a worker stops, the
//! database clock leases are measured by, and the renewal that extends a lease.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::Phase;
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why a worker stopped an execution early.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    /// A conditional write matched no row: another worker holds the execution now.
    #[error("write rejected: fenced (another worker holds this execution)")]
    Fenced,
    /// The lease may have expired (the process was paused, renewals failed): a
    /// call must not leave on a lease someone else may hold.
    #[error("the lease lapsed before the call left; not sending")]
    LeaseLapsed,
    #[error(transparent)]
    Bus(#[from] fenceline_bus::Error),
}

impl From<sqlx::Error> for Stop {
    fn from(e: sqlx::Error) -> Self {
        Stop::Bus(e.into())
    }
}

impl Stop {
    /// A writer of the process that stopped (the process is stopping): answered
    /// as a closed pool would be, and the worker's retries decide.
    pub(crate) fn writer_stopped() -> Self {
        sqlx::Error::PoolClosed.into()
    }

    /// A write made with others whose statement failed without the server's
    /// answer: it may have committed, so what the write finds alone afterwards is
    /// no proof that another worker holds the execution.
    pub(crate) fn in_doubt(error: &sqlx::Error) -> Self {
        sqlx::Error::Protocol(format!("the statement written together failed ({error}); it may have committed")).into()
    }
}

/// Whether the server answered `error`: a statement that commits on its own was
/// then rolled back. Any other failure (the connection lost, a timeout) leaves open
/// whether it committed.
pub(crate) fn answered_by_the_server(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(_))
}

impl From<fenceline_bus::faults::Injected> for Stop {
    fn from(e: fenceline_bus::faults::Injected) -> Self {
        Stop::Bus(fenceline_bus::Error::Injected(e))
    }
}

/// Taken off every lease this worker believes it holds: the hop from a check to
/// the request's first byte (the blocking pool, a busy runtime) and any drift of
/// this host's monotonic clock from the database's over one lease.
pub(crate) const LEASE_MARGIN: Duration = Duration::from_millis(200);

/// `status = 'running'`, written so that the planner cannot match it to the
/// partial index `executions_claimable` (ready and running executions): a write
/// that names its execution by grant id must find it through the primary key.
/// Statistics taken while no execution was ready or running make that index look
/// empty, and the planner then scanned it whole, dead entries included, on every
/// fenced write: hundreds of entries and a quarter of a millisecond per write
/// under load (docs/performance.md, "A partial index that looked empty").
pub(crate) const STILL_RUNNING: &str = "(status = 'running') IS TRUE";

/// A worker's hold on one execution.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub grant_id: GrantId,
    pub task_id: TaskId,
    pub attempt: i32,
    pub generation: i32,
    pub token: i64,
    /// The phase this worker last wrote (the expected phase of its next write).
    pub phase: Phase,
    /// Until when the lease surely holds, by the monotonic clock: the instant the
    /// latest renewal was sent plus the length the database granted.
    valid_until: Arc<Mutex<Instant>>,
    /// Cancelled when a renewal found that another worker holds the execution.
    pub fenced: CancellationToken,
    /// Until when a write that met a database error is tried again (the attempt
    /// budget's end): every write is fenced, so a retry after the lease lapsed
    /// either records what this worker knows or is rejected, never both.
    pub(crate) writes_until: Instant,
    /// Events of the lease itself not yet written (the claim's `AttemptClaimed`):
    /// the next fenced write carries them ahead of its own.
    pub(crate) unannounced: Vec<fenceline_events::Event>,
}

impl Lease {
    /// Whether the lease surely holds for `span` more, with the margin.
    pub fn holds_for(&self, span: Duration) -> bool {
        let until = *self.valid_until.lock().unwrap_or_else(PoisonError::into_inner);
        Instant::now() + span + LEASE_MARGIN <= until
    }

    /// A renewal sent at `sent` was granted `granted`; renewals may answer out of order.
    pub(crate) fn extend(&self, sent: Instant, granted: Duration) {
        let mut until = self.valid_until.lock().unwrap_or_else(PoisonError::into_inner);
        *until = (*until).max(sent + granted);
    }

    /// Whether another worker is known to hold the execution now.
    pub fn fenced(&self) -> bool {
        self.fenced.is_cancelled()
    }
}

impl Lease {
    /// A lease taken at `sent` for `granted`, by the claim that returned `token`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn taken(
        grant_id: GrantId,
        task_id: TaskId,
        attempt: i32,
        generation: i32,
        token: i64,
        phase: Phase,
        valid_until: Instant,
        writes_until: Instant,
    ) -> Self {
        Lease {
            grant_id,
            task_id,
            attempt,
            generation,
            token,
            phase,
            valid_until: Arc::new(Mutex::new(valid_until)),
            fenced: CancellationToken::new(),
            writes_until,
            unannounced: Vec::new(),
        }
    }
}

/// Renews the lease by the database's clock. `Ok(false)`: another worker
/// holds the execution now (the lease is marked fenced).
pub(crate) async fn renew(pool: &PgPool, lease_ms: u64, lease: &Lease) -> Result<bool, Stop> {
    fenceline_bus::fault!("executor.renew_lease");
    let lease_us = i64::try_from(lease_ms).unwrap_or(i64::MAX / 4) * 1_000;
    let sent = Instant::now();
    let granted: Option<i64> = sqlx::query_scalar(&format!(
        "WITH clock AS (SELECT now_us() AS now_us) \
         UPDATE executions SET lease_expires_at_us = clock.now_us + $3 FROM clock \
         WHERE grant_id = $1 AND fencing_token = $2 AND {STILL_RUNNING} \
         RETURNING lease_expires_at_us - clock.now_us"
    ))
    .bind(lease.grant_id.as_uuid())
    .bind(lease.token)
    .bind(lease_us)
    .fetch_optional(pool)
    .await?;
    match granted {
        Some(us) => {
            lease.extend(sent, Duration::from_micros(u64::try_from(us).unwrap_or(0)));
            Ok(true)
        }
        None => {
            lease.fenced.cancel();
            Ok(false)
        }
    }
}

/// A draw in `[0, 1)` for full jitter; unpredictable enough to spread workers
/// apart, and without a dependency of its own.
pub(crate) fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher
        .write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}
