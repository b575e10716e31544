//! Live changes for the dashboard (docs/dashboard.md). Every projection write marks
//! its task changed in `task_changes` in the same transaction, with the id of the
//! transaction that wrote the mark. Each intake instance follows that table by
//! transaction ([`follow`]): every [`POLL_EVERY`] it reads the marks whose writers
//! its previous read's snapshot could not yet see, and fans them out to its event
//! streams (`GET /v1/events`). So a stream hears every change, whichever instance's
//! consumer projected it, even one whose transaction commits long after it wrote
//! its mark; and no commit waits on Postgres' one notification lock.

use std::time::Duration;

use actix_web::web::Bytes;
use fenceline_domain::ids::TaskId;
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::auth::Tenant;
use crate::tasks;

/// How often each instance reads what changed, while it has a stream open; the
/// most a stream waits to hear a committed change.
pub const POLL_EVERY: Duration = Duration::from_millis(100);
/// How often a quiet stream sends a comment line (and checks its token again).
pub const HEARTBEAT: Duration = Duration::from_secs(15);
/// A resumed stream replays changes from this long before its last event id: a
/// transaction that stamped its change earlier may have committed later.
pub const RESUME_MARGIN: Duration = Duration::from_secs(10);
/// More changes than this to replay, and the stream asks the page to reload instead.
pub const REPLAY_LIMIT: i64 = 1000;

/// Marks `task_id` changed; the streams hear of it once the transaction commits.
/// The tenant comes from the status snapshot if given, else from what intake
/// already knows of the task; a task intake knows nothing of is not announced
/// (its first status snapshot announces it).
pub async fn changed(tx: &mut PgConnection, task_id: TaskId, tenant: Option<&str>) -> Result<(), sqlx::Error> {
    mark(tx, &[task_id.as_uuid()], &[tenant.map(str::to_owned)]).await
}

/// Marks `ids` changed (each with its tenant, if known), in task order. A tenant
/// not given is looked up by the task's key, and only then: a join would read
/// `task_view` and `tasks` whole wherever the planner judges a batch large
/// beside them.
async fn mark(tx: &mut PgConnection, ids: &[uuid::Uuid], tenants: &[Option<String>]) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "WITH given AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS g (task_id, tenant)), \
         found AS ( \
           SELECT g.task_id, coalesce(g.tenant, \
             (SELECT v.tenant FROM task_view v WHERE v.task_id = g.task_id), \
             (SELECT t.tenant FROM tasks t WHERE t.task_id = g.task_id)) AS tenant FROM given g), \
         owner AS (SELECT task_id, tenant FROM found WHERE tenant IS NOT NULL), \
         {marked} SELECT count(*) FROM marked",
        marked = marked_from("owner"),
    ))
    .bind(ids)
    .bind(tenants)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A common table expression `marked` that marks changed, in task order, each task
/// `rows` (a `FROM` item with `task_id` and `tenant`) yields, stamped with the time
/// (a resumed stream's replay) and the transaction (what [`follow`] reads by).
pub fn marked_from(rows: &str) -> String {
    format!(
        "marked AS (INSERT INTO task_changes (task_id, tenant, changed_at, changed_by) \
         SELECT task_id, tenant, clock_timestamp(), pg_current_xact_id() FROM {rows} ORDER BY task_id \
         ON CONFLICT (task_id) DO UPDATE SET changed_at = greatest(task_changes.changed_at, EXCLUDED.changed_at), \
         changed_by = EXCLUDED.changed_by \
         RETURNING task_id, tenant)"
    )
}

/// The tasks one consumer's batch changed, marked with one statement just before
/// the batch commits ([`fenceline_bus::Handler::flush`]) instead of one per event:
/// a task's several events in a batch are one change to the streams, and marking
/// in task order keeps two consumers' batches from waiting on each other's marks
/// in opposite orders.
#[derive(Debug, Default)]
pub struct BatchMarks(fenceline_bus::gathered::Merged<TaskId, Option<String>>);

impl BatchMarks {
    /// Marks `task_id` changed when the batch commits; `tenant` as for [`changed`].
    pub fn mark(&self, task_id: TaskId, tenant: Option<&str>) {
        self.0.merge(task_id, |known| {
            if known.is_none() {
                *known = tenant.map(str::to_owned);
            }
        });
    }

    /// Forgets the marks of a batch that was rolled back.
    pub fn discard(&self) {
        self.0.discard();
    }

    /// Writes the gathered marks in `tx`.
    pub async fn flush(&self, tx: &mut PgConnection) -> Result<(), sqlx::Error> {
        let marks = self.0.take();
        if marks.is_empty() {
            return Ok(());
        }
        let (ids, tenants): (Vec<uuid::Uuid>, Vec<Option<String>>) =
            marks.into_iter().map(|(id, tenant)| (id.as_uuid(), tenant)).unzip();
        mark(tx, &ids, &tenants).await
    }
}

/// A change [`follow`] read: a task of `tenant` changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub tenant: String,
    pub task_id: TaskId,
}

/// The fan-out from the one follower of this instance to its streams.
#[derive(Debug, Clone)]
pub struct Changes(broadcast::Sender<Change>);

impl Default for Changes {
    fn default() -> Self {
        Self(broadcast::channel(1024).0)
    }
}

impl Changes {
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.0.subscribe()
    }
}

/// Follows `task_changes` until `shutdown`, telling this instance's streams of
/// every committed mark.
///
/// Each read takes the statement's snapshot S and returns the marks visible in S
/// whose writing transaction was not visible in the previous read's snapshot P.
/// Any transaction that P could not see has an id of at least `xmax(P)` or is
/// listed in-progress in P, so the read probes the index for exactly those ids:
/// a transaction that stamped its mark before others committed, and commits after
/// a read, is heard by the next read, and a transaction that stays open for long
/// costs one probe per read. A task changed several times between two reads is
/// heard once. Nothing is lost when the database is away: the next read starts
/// from the same P. With no stream open, a read only takes its snapshot.
pub async fn follow(pool: PgPool, changes: Changes, shutdown: CancellationToken) {
    let mut previous: Option<String> = None;
    let mut failing = false;
    let mut every = tokio::time::interval(POLL_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {}
        }
        let streams_open = changes.0.receiver_count() > 0;
        match read_changes(&pool, previous.as_deref().filter(|_| streams_open)).await {
            Ok((snapshot, changed)) => {
                if failing {
                    tracing::info!("the dashboard's change follower reads again");
                    failing = false;
                }
                previous = Some(snapshot);
                for change in changed {
                    // No stream listening is not an error.
                    let _ = changes.0.send(change);
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "the dashboard's change follower cannot read; retrying");
                    failing = true;
                }
            }
        }
    }
}

/// The current snapshot (as text) and, given the `previous` read's snapshot, the
/// marks whose writers it could not see, in task order.
async fn read_changes(pool: &PgPool, previous: Option<&str>) -> Result<(String, Vec<Change>), sqlx::Error> {
    let Some(previous) = previous else {
        return Ok((sqlx::query_scalar("SELECT pg_current_snapshot()::text").fetch_one(pool).await?, Vec::new()));
    };
    let (snapshot, ids, tenants): (String, Vec<uuid::Uuid>, Vec<String>) = sqlx::query_as(
        "SELECT pg_current_snapshot()::text, coalesce(array_agg(task_id ORDER BY task_id), '{}'), \
           coalesce(array_agg(tenant ORDER BY task_id), '{}') \
         FROM task_changes \
         WHERE (changed_by >= pg_snapshot_xmax($1::text::pg_snapshot) \
             OR changed_by = ANY (ARRAY(SELECT pg_snapshot_xip($1::text::pg_snapshot)))) \
           AND NOT pg_visible_in_snapshot(changed_by, $1::text::pg_snapshot)",
    )
    .bind(previous)
    .fetch_one(pool)
    .await?;
    let changed =
        ids.into_iter().zip(tenants).map(|(id, tenant)| Change { tenant, task_id: TaskId::from_uuid(id) }).collect();
    Ok((snapshot, changed))
}

/// An event id: the change's time in microseconds since the epoch.
fn event_id(at: OffsetDateTime) -> i64 {
    (at.unix_timestamp_nanos() / 1000) as i64
}

/// One server-sent event.
fn frame(event: &str, id: Option<i64>, data: &str) -> Bytes {
    let mut text = String::with_capacity(data.len() + 48);
    if let Some(id) = id {
        text.push_str(&format!("id: {id}\n"));
    }
    text.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    Bytes::from(text)
}

/// The `task` event of one task, if the tenant still has it.
async fn task_frame(pool: &PgPool, tenant: &Tenant, task_id: TaskId) -> Result<Option<Bytes>, sqlx::Error> {
    let Some((view, changed_at)) = tasks::summary(pool, tenant, task_id).await? else {
        return Ok(None);
    };
    let data = serde_json::to_string(&view).unwrap_or_default();
    Ok(Some(frame("task", changed_at.map(event_id), &data)))
}

/// What a stream needs to run.
#[derive(Debug)]
pub struct Stream {
    pub pool: PgPool,
    pub tenant: Tenant,
    /// The bearer token, checked again at every heartbeat: a revoked token's stream ends.
    pub token: String,
    pub last_event_id: Option<i64>,
    pub changes: broadcast::Receiver<Change>,
    pub stopping: CancellationToken,
}

/// Runs one stream into `out` until the client goes, its token is revoked, or the
/// service stops. It starts with the changes since `last_event_id` (or a `ready`
/// event carrying the current id), then sends each change of the tenant's tasks as
/// it is heard; `reset` asks the page to reload everything.
pub async fn run(stream: Stream, out: mpsc::Sender<Bytes>) {
    let Stream { pool, tenant, token, last_event_id, mut changes, stopping } = stream;
    if let Err(e) = replay(&pool, &tenant, last_event_id, &out).await {
        tracing::warn!(error = %e, "an event stream could not replay; it asks for a reload");
        let _ = out.send(frame("reset", None, "{}")).await;
    }
    let mut heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
    loop {
        let sent = tokio::select! {
            _ = stopping.cancelled() => return,
            _ = out.closed() => return,
            _ = heartbeat.tick() => {
                match crate::auth::tenant_of(&pool, &token).await {
                    Ok(Some(now)) if now == tenant => out.send(Bytes::from_static(b": heartbeat\n\n")).await,
                    Ok(_) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "an event stream could not check its token");
                        out.send(Bytes::from_static(b": heartbeat\n\n")).await
                    }
                }
            }
            change = changes.recv() => match change {
                Ok(Change { tenant: owner, task_id }) if owner == tenant.as_str() => {
                    match task_frame(&pool, &tenant, task_id).await {
                        Ok(Some(frame)) => out.send(frame).await,
                        Ok(None) => Ok(()),
                        Err(e) => {
                            tracing::warn!(error = %e, "an event stream could not read a task; it asks for a reload");
                            out.send(frame("reset", None, "{}")).await
                        }
                    }
                }
                Ok(Change { .. }) => Ok(()),
                Err(broadcast::error::RecvError::Lagged(_)) => out.send(frame("reset", None, "{}")).await,
                Err(broadcast::error::RecvError::Closed) => return,
            },
        };
        if sent.is_err() {
            return;
        }
    }
}

/// The start of a stream: the tenant's changes since `last_event_id` (less the
/// margin), or, for a new stream, `ready` with the id to resume from.
async fn replay(
    pool: &PgPool,
    tenant: &Tenant,
    last_event_id: Option<i64>,
    out: &mpsc::Sender<Bytes>,
) -> Result<(), sqlx::Error> {
    let now = event_id(OffsetDateTime::now_utc());
    let Some(last) = last_event_id else {
        let _ = out.send(frame("ready", Some(now), "{}")).await;
        return Ok(());
    };
    let since = OffsetDateTime::from_unix_timestamp_nanos(i128::from(last) * 1000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH)
        - RESUME_MARGIN;
    let changed: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT task_id FROM task_changes WHERE tenant = $1 AND changed_at > $2 ORDER BY changed_at LIMIT $3",
    )
    .bind(tenant.as_str())
    .bind(since)
    .bind(REPLAY_LIMIT + 1)
    .fetch_all(pool)
    .await?;
    if changed.len() as i64 > REPLAY_LIMIT {
        let _ = out.send(frame("reset", Some(now), "{}")).await;
        return Ok(());
    }
    for task_id in changed {
        if let Some(frame) = task_frame(pool, tenant, TaskId::from_uuid(task_id)).await?
            && out.send(frame).await.is_err()
        {
            return Ok(());
        }
    }
    let _ = out.send(frame("ready", None, "{}")).await;
    Ok(())
}

#[cfg(test)]
mod tests;
