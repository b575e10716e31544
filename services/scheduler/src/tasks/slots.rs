//! The writes that take and give back slots: a grant's slot at each provider it
//! calls with its `AttemptGranted`, and an ended attempt's release, gathered over a
//! dispatch round or a consumer batch and written with a statement or two when it
//! ends instead of two or three a grant and one a release.

use fenceline_bus::OutboxRow;
use fenceline_bus::gathered::All;
use fenceline_domain::ids::GrantId;
use sqlx::PgConnection;

/// One grant's writes.
#[derive(Debug)]
pub struct GrantWrite {
    pub grant_id: uuid::Uuid,
    pub task_id: uuid::Uuid,
    /// The first provider the attempt calls: the grant's own row in `slots`.
    pub provider: String,
    pub tenant: String,
    pub kind: String,
    /// How long the slot lives if its end is never heard, by the database's clock.
    pub lifetime_us: i64,
    /// The other providers the attempt calls, each a row in `other_provider_slots`
    /// with the very expiry of the grant's own slot (docs/execution.md, "Slots").
    pub other_providers: Vec<String>,
    /// The grant's `AttemptGranted`, made in the grant's trace.
    pub announced: OutboxRow,
}

/// The slots a dispatch round or a consumer batch takes and gives back, written
/// just before it commits (and forgotten if it rolls back). Admission learns every
/// provider's and tenant's slots a candidate needs before it grants, then books
/// each grant in memory ([`fenceline_domain::admission::Round`]), so nothing in a
/// round reads the slots its own grants will take. A release waits for the end of
/// the batch: the batch's attempt outcomes read their slots first
/// ([`crate::health::observe_all`]), and a later outcome of the same grant is no
/// longer its task's live one.
#[derive(Debug, Default)]
pub struct SlotWrites {
    granted: All<GrantWrite>,
    released: All<uuid::Uuid>,
}

impl SlotWrites {
    pub fn grant(&self, grant: GrantWrite) {
        self.granted.push(grant);
    }

    pub fn release(&self, grant_id: GrantId) {
        self.released.push(grant_id.as_uuid());
    }

    /// Forgets what a rolled-back batch (or savepoint) gathered.
    pub fn discard(&self) {
        self.granted.discard();
        self.released.discard();
    }

    /// Writes what was gathered in `tx`; a release wakes the dispatchers at commit.
    pub async fn flush(&self, tx: &mut PgConnection, channel: &str) -> Result<(), fenceline_bus::Error> {
        write(tx, self.granted.take()).await?;
        release(tx, channel, &self.released.take()).await?;
        Ok(())
    }
}

/// Gives the slots of `grants` back, at every provider each holds one, and wakes the
/// dispatchers at commit; one statement.
pub async fn release(tx: &mut PgConnection, channel: &str, grants: &[uuid::Uuid]) -> Result<(), sqlx::Error> {
    if grants.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "WITH own AS (DELETE FROM slots WHERE grant_id = ANY($1)), \
         others AS (DELETE FROM other_provider_slots WHERE grant_id = ANY($1)) SELECT pg_notify($2, '')",
    )
    .bind(grants)
    .bind(channel)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Writes `grants`' slots (one statement, and one more when some call a second
/// provider) and their outbox rows (one append, in the order given).
pub async fn write(tx: &mut PgConnection, grants: Vec<GrantWrite>) -> Result<(), fenceline_bus::Error> {
    if grants.is_empty() {
        return Ok(());
    }
    let mut columns = (vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut others_of, mut other_providers) = (vec![], vec![]);
    let mut rows = Vec::with_capacity(grants.len());
    for grant in grants {
        columns.0.push(grant.grant_id);
        columns.1.push(grant.task_id);
        columns.2.push(grant.provider);
        columns.3.push(grant.tenant);
        columns.4.push(grant.kind);
        columns.5.push(grant.lifetime_us);
        for provider in grant.other_providers {
            others_of.push(grant.grant_id);
            other_providers.push(provider);
        }
        rows.push(grant.announced);
    }
    sqlx::query(
        "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) \
         SELECT g, t, p, n, k, now_us() + l \
         FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::bigint[]) AS s (g, t, p, n, k, l) \
         ON CONFLICT DO NOTHING",
    )
    .bind(columns.0)
    .bind(columns.1)
    .bind(columns.2)
    .bind(columns.3)
    .bind(columns.4)
    .bind(columns.5)
    .execute(&mut *tx)
    .await?;
    if !others_of.is_empty() {
        sqlx::query(
            "INSERT INTO other_provider_slots (grant_id, task_id, provider, expires_at_us) \
             SELECT s.grant_id, s.task_id, o.provider, s.expires_at_us \
             FROM unnest($1::uuid[], $2::text[]) AS o (grant_id, provider) JOIN slots s ON s.grant_id = o.grant_id \
             ON CONFLICT DO NOTHING",
        )
        .bind(others_of)
        .bind(other_providers)
        .execute(&mut *tx)
        .await?;
    }
    OutboxRow::insert_all(rows, tx).await
}
