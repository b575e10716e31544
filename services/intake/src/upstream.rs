//! The upstream intake topic: `TaskRequest` records from other systems become
//! tasks under the same idempotency rules as the API (the key is the source and
//! its event id), and every record that cannot become a task is answered on
//! `fenceline.intake.rejected` with the reason and its original bytes. A record is
//! taken only from a source configured for its tenant (`add-upstream-source`).

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter, Rejected};
use fenceline_events::{Bytes, Event, RequestRejected, TaskRequest, Timestamp, topics};
use sqlx::{PgConnection, PgPool};

use crate::auth::Tenant;
use crate::problem::ApiError;
use crate::tasks::{self, IdempotencyKey, SubmitTask};

/// The consumer of `fenceline.intake.requests`.
#[derive(Debug, Clone)]
pub struct UpstreamRequests {
    pub kinds: std::sync::Arc<crate::kinds::KindCatalog>,
}

/// Why a request cannot become a task: a stable problem type and a reason.
struct Refusal {
    problem_type: &'static str,
    reason: String,
}

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        let problem_type = match &e {
            ApiError::UnknownKind(_) => "unknown-kind",
            ApiError::InputInvalid(_) => "input-invalid",
            ApiError::IdempotencyKeyReused => "idempotency-key-reused",
            ApiError::IdempotencyKeyInvalid(_) | ApiError::IdempotencyKeyMissing => "invalid-source-event-id",
            _ => "invalid-request",
        };
        Self { problem_type, reason: e.to_string() }
    }
}

impl UpstreamRequests {
    async fn accept(&self, tx: &mut PgConnection, outbox: &OutboxWriter, request: &TaskRequest) -> Result<(), Refusal> {
        let tenant =
            Tenant::parse(&request.tenant).map_err(|reason| Refusal { problem_type: "unknown-tenant", reason })?;
        let known: Option<i32> = sqlx::query_scalar("SELECT 1 FROM tenants WHERE tenant = $1")
            .bind(tenant.as_str())
            .fetch_optional(&mut *tx)
            .await
            .map_err(ApiError::from)?;
        if known.is_none() {
            return Err(Refusal { problem_type: "unknown-tenant", reason: format!("no tenant `{}`", tenant.as_str()) });
        }
        // Anyone allowed to produce to the topic could name any tenant: only a source
        // configured for the record's tenant creates its (billable) tasks.
        let allowed: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM upstream_sources WHERE source = $1 AND tenant = $2")
                .bind(&request.source)
                .bind(tenant.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(ApiError::from)?;
        if allowed.is_none() {
            return Err(Refusal {
                problem_type: "unknown-source",
                reason: format!("source `{}` is not configured for tenant `{}`", request.source, tenant.as_str()),
            });
        }
        let input = serde_json::from_str(&request.input_json)
            .map_err(|e| Refusal { problem_type: "invalid-request", reason: format!("input_json: {e}") })?;
        let instant = |field: &str, value: Option<Timestamp>| {
            value
                .map(Timestamp::checked)
                .transpose()
                .map_err(|e| Refusal { problem_type: "invalid-request", reason: format!("{field}: {e}") })
        };
        let task = SubmitTask {
            kind: request.kind.clone(),
            input,
            priority: Some(request.priority.as_str().to_owned()),
            deadline: instant("deadline", request.deadline)?,
            not_before: instant("not_before", request.not_before)?,
            labels: request.labels.clone(),
        }
        .validate(&self.kinds)?;
        let key = IdempotencyKey::parse(&format!("{}:{}", request.source, request.source_event_id))?;
        // A redelivered or re-sent request replays: no second task. Do not change:
        // the source is the namespace of its stored idempotency keys.
        tasks::submit_in(tx, outbox, &tenant, &key, task, &format!("topic:{}", request.source)).await?;
        Ok(())
    }
}

impl Handler for UpstreamRequests {
    /// A request on the upstream topic becomes a task here.
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn handle(&self, tx: &mut PgConnection, outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        let Event::TaskRequest(request) = &record.envelope.event else {
            return Err(HandleError::Poison(format!("{} is not a TaskRequest", record.envelope.event.event_type())));
        };
        match self.accept(tx, outbox, request).await {
            Ok(()) => Ok(()),
            Err(refusal) => {
                let event = Event::RequestRejected(RequestRejected {
                    source: Some(request.source.clone()),
                    source_event_id: Some(request.source_event_id.clone()),
                    tenant: Some(request.tenant.clone()),
                    problem_type: refusal.problem_type.to_owned(),
                    reason: refusal.reason,
                    original: Bytes(record.value.clone()),
                    rejected_at: Timestamp::now(),
                });
                let key = format!("{}:{}", request.source, request.source_event_id);
                outbox.append(tx, topics::INTAKE_REJECTED, Some(key.as_bytes()), &event).await?;
                Ok(())
            }
        }
    }

    /// Outside producers are answered, never waited for: a record in a schema
    /// this build does not know is refused as `invalid-record`.
    fn holds_newer_schemas(&self) -> bool {
        false
    }

    async fn reject(
        &self,
        tx: &mut PgConnection,
        outbox: &OutboxWriter,
        rejected: &Rejected<'_>,
    ) -> Result<(), HandleError> {
        let event = Event::RequestRejected(RequestRejected {
            source: None,
            source_event_id: None,
            tenant: None,
            problem_type: "invalid-record".to_owned(),
            reason: rejected.reason.to_owned(),
            original: Bytes(rejected.value.unwrap_or_default().to_vec()),
            rejected_at: Timestamp::now(),
        });
        let key = format!("{}/{}/{}", rejected.topic, rejected.partition, rejected.offset);
        outbox.append(tx, topics::INTAKE_REJECTED, Some(key.as_bytes()), &event).await?;
        Ok(())
    }
}

/// Configures `source` to submit tasks for `tenant` through the upstream topic
/// (creating the tenant if needed). Returns whether it was new.
pub async fn add_source(pool: &PgPool, source: &str, tenant: &Tenant) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO tenants (tenant) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(tenant.as_str())
        .execute(&mut *tx)
        .await?;
    let added = sqlx::query("INSERT INTO upstream_sources (source, tenant) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(source)
        .bind(tenant.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    tx.commit().await?;
    Ok(added)
}

/// Stops `source` submitting for `tenant`; its later records are refused. Returns
/// whether it had been configured.
pub async fn remove_source(pool: &PgPool, source: &str, tenant: &Tenant) -> Result<bool, sqlx::Error> {
    let removed = sqlx::query("DELETE FROM upstream_sources WHERE source = $1 AND tenant = $2")
        .bind(source)
        .bind(tenant.as_str())
        .execute(pool)
        .await?
        .rows_affected();
    Ok(removed == 1)
}
