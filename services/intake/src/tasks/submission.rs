//! Submitting a task: the request checked against its kind, the idempotency key,
//! and one transaction for the idempotency record, the task and its `TaskAccepted`
//! event; the answer comes at once.

use std::collections::BTreeMap;

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::Priority;
use fenceline_events::{Event, TaskAccepted, Timestamp, topics};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use time::OffsetDateTime;

use crate::auth::Tenant;
use crate::kinds::KindCatalog;
use crate::problem::ApiError;

/// The body of `POST /v1/tasks`.
#[derive(Debug, Clone, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitTask {
    /// One of the kinds this intake is configured for.
    pub kind: String,
    /// The task's input, a JSON object; checked against the kind's JSON Schema if it has one.
    #[schema(value_type = Object)]
    pub input: serde_json::Value,
    /// `high`, `normal` (the default) or `low`.
    #[serde(default)]
    #[schema(value_type = Option<String>, pattern = "^(high|normal|low)$")]
    pub priority: Option<String>,
    /// No attempt starts after this instant (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub deadline: Option<OffsetDateTime>,
    /// No attempt starts before this instant (RFC 3339).
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub not_before: Option<OffsetDateTime>,
    /// At most 32; keys 1 to 64 characters, values at most 256.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A submission that passed every check.
#[derive(Debug, Clone)]
pub struct ValidTask {
    pub kind: String,
    pub input: serde_json::Value,
    pub priority: Priority,
    pub deadline: Option<OffsetDateTime>,
    pub not_before: Option<OffsetDateTime>,
    pub labels: BTreeMap<String, String>,
}

/// An `Idempotency-Key`: 1 to 255 visible ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(raw: &str) -> Result<Self, ApiError> {
        if raw.is_empty() || raw.len() > 255 || !raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiError::IdempotencyKeyInvalid(
                "Idempotency-Key must be 1 to 255 visible ASCII characters".into(),
            ));
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl SubmitTask {
    /// Checks the request against the configured kinds and its own rules.
    pub fn validate(self, kinds: &KindCatalog) -> Result<ValidTask, ApiError> {
        if !self.input.is_object() {
            return Err(ApiError::InvalidRequest("input: must be a JSON object".into()));
        }
        if self.kind.contains('\0') {
            return Err(nul_refused("kind"));
        }
        storable("input", &self.input)?;
        if self.labels.iter().any(|(k, v)| k.contains('\0') || v.contains('\0')) {
            return Err(nul_refused("labels"));
        }
        kinds.check(&self.kind, &self.input)?;
        let priority = match self.priority.as_deref() {
            None => Priority::Normal,
            Some(p) => p.parse().map_err(|e: fenceline_domain::vocabulary::UnknownWord| {
                ApiError::InvalidRequest(format!("priority: {e}"))
            })?,
        };
        // Instants travel as microseconds since the epoch; none before it is meant.
        for (field, instant) in [("deadline", self.deadline), ("not_before", self.not_before)] {
            if let Some(instant) = instant
                && Timestamp::from(instant).checked().is_err()
            {
                return Err(ApiError::InvalidRequest(format!("{field}: must not be before 1970-01-01T00:00:00Z")));
            }
        }
        if let (Some(deadline), Some(not_before)) = (self.deadline, self.not_before)
            && deadline <= not_before
        {
            return Err(ApiError::InvalidRequest("deadline must be after not_before".into()));
        }
        if self.labels.len() > 32 || self.labels.iter().any(|(k, v)| k.is_empty() || k.len() > 64 || v.len() > 256) {
            return Err(ApiError::InvalidRequest(
                "labels: at most 32, keys 1 to 64 characters, values at most 256".into(),
            ));
        }
        Ok(ValidTask {
            kind: self.kind,
            input: self.input,
            priority,
            deadline: self.deadline,
            not_before: self.not_before,
            labels: self.labels,
        })
    }
}

/// Refuses JSON that Postgres cannot store: text with a NUL character (`\u0000`)
/// anywhere, in a key or a value.
pub fn storable(what: &str, value: &serde_json::Value) -> Result<(), ApiError> {
    fn has_nul(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::String(s) => s.contains('\0'),
            serde_json::Value::Array(items) => items.iter().any(has_nul),
            serde_json::Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if has_nul(value) {
        return Err(nul_refused(what));
    }
    Ok(())
}

pub(crate) fn nul_refused(what: &str) -> ApiError {
    ApiError::InvalidRequest(format!("{what}: text may not contain the NUL character (\\u0000)"))
}

impl ValidTask {
    /// The fingerprint of the canonical request: the same request, however its JSON
    /// was spelled (key order, spacing), has the same fingerprint.
    ///
    /// Do not change: stored fingerprints would stop matching their requests.
    pub fn fingerprint(&self) -> Vec<u8> {
        let canonical = serde_json::json!({
            "kind": self.kind,
            "input": self.input,
            "priority": self.priority.as_str(),
            "deadline": self.deadline.map(|t| Timestamp::from(t).0),
            "not_before": self.not_before.map(|t| Timestamp::from(t).0),
            "labels": self.labels,
        });
        // serde_json's maps are sorted by key, so the text is canonical.
        Sha256::digest(canonical.to_string().as_bytes()).to_vec()
    }
}

/// What a submission answers, first time and on every replay.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct Accepted {
    #[schema(value_type = String, format = Uuid)]
    pub task_id: TaskId,
    /// Where to read the task: `/v1/tasks/{task_id}`.
    pub status_url: String,
}

/// The outcome of a submission.
#[derive(Debug)]
pub enum Submitted {
    Created(Accepted),
    Replayed(Accepted),
}

/// Submits `task` under `key` for `tenant`, exactly once per key of `source`.
///
/// `source` (`api`, `webhook:{source}`, `topic:{source}`) is both the task's
/// recorded source and the key's namespace: the same key text from two sources
/// names two different submissions.
///
/// A concurrent request with the same key blocks on the key's unique index until
/// the first transaction ends, then replays its answer (or, if the first rolled
/// back, creates the task itself): it never gets a 409.
pub async fn submit(
    pool: &PgPool,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    key: &IdempotencyKey,
    task: ValidTask,
    source: &str,
) -> Result<Submitted, ApiError> {
    // One statement writes the whole submission, so it needs no transaction of its
    // own: no BEGIN and COMMIT round trips around it.
    let mut conn = pool.acquire().await?;
    let submitted = submit_in(&mut conn, outbox, tenant, key, task, source).await?;
    drop(conn);
    // The task is accepted; the client has not heard so (a crash here loses only the answer).
    let _ = fenceline_bus::faults::drops("intake.after_accept_commit");
    if matches!(submitted, Submitted::Created(_)) {
        outbox.committed();
    }
    Ok(submitted)
}

/// The submission inside the caller's transaction (the upstream topic's consumer
/// submits inside its batch transaction). Claiming the key, storing the task, its
/// `TaskAccepted` in the outbox and the change mark are one statement, each part
/// written only if the key was new.
pub async fn submit_in(
    conn: &mut PgConnection,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    key: &IdempotencyKey,
    task: ValidTask,
    source: &str,
) -> Result<Submitted, ApiError> {
    let fingerprint = task.fingerprint();
    let task_id = TaskId::new_v7();
    let accepted_at = OffsetDateTime::now_utc();
    let event = Event::TaskAccepted(TaskAccepted {
        task_id,
        tenant: tenant.as_str().to_owned(),
        kind: task.kind.clone(),
        input_json: task.input.to_string(),
        priority: task.priority,
        deadline: task.deadline.map(Timestamp::from),
        not_before: task.not_before.map(Timestamp::from),
        labels: task.labels.clone().into_iter().collect(),
        source: source.to_owned(),
        accepted_at: Timestamp::from(accepted_at),
    });
    let row = outbox.row(topics::TASKS, &event)?;
    let traceparent = row.traceparent().map(str::to_owned);
    // The source is the key's namespace: keys of different sources never meet.
    let statement = format!(
        "WITH claimed_key AS ( \
           INSERT INTO idempotency_keys (tenant, namespace, idempotency_key, fingerprint, task_id) \
           VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING RETURNING task_id, tenant), \
         accepted AS ( \
           INSERT INTO tasks (task_id, tenant, kind, input, priority, deadline, not_before, labels, source, \
             accepted_at, traceparent) \
           SELECT task_id, tenant, $6::text, $7::jsonb, $8::text, $9::timestamptz, $10::timestamptz, $11::jsonb, \
             $2::text, $12::timestamptz, $13::text FROM claimed_key RETURNING task_id, tenant), \
         appended AS MATERIALIZED (SELECT outbox_append($14::outbox_entry[]) AS rows FROM accepted), \
         {marked} SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM appended)",
        marked = crate::live::marked_from("accepted"),
    );
    let query = sqlx::query(&statement)
        .bind(tenant.as_str())
        .bind(source)
        .bind(&key.0)
        .bind(&fingerprint)
        .bind(task_id.as_uuid())
        .bind(&task.kind)
        .bind(&task.input)
        .bind(task.priority.as_str())
        .bind(task.deadline)
        .bind(task.not_before)
        .bind(sqlx::types::Json(&task.labels))
        .bind(accepted_at)
        .bind(traceparent)
        .bind(vec![row]);
    let created: i64 = sqlx::Row::try_get(&query.fetch_one(&mut *conn).await?, 0)?;
    if created == 0 {
        let (stored, existing): (Vec<u8>, uuid::Uuid) = sqlx::query_as(
            "SELECT fingerprint, task_id FROM idempotency_keys \
             WHERE tenant = $1 AND namespace = $2 AND idempotency_key = $3",
        )
        .bind(tenant.as_str())
        .bind(source)
        .bind(&key.0)
        .fetch_one(&mut *conn)
        .await?;
        return if stored == fingerprint {
            Ok(Submitted::Replayed(accepted(TaskId::from_uuid(existing))))
        } else {
            Err(ApiError::IdempotencyKeyReused)
        };
    }
    tracing::info!(task_id = %task_id, tenant = tenant.as_str(), kind = %task.kind, source, "task accepted");
    Ok(Submitted::Created(accepted(task_id)))
}

fn accepted(task_id: TaskId) -> Accepted {
    Accepted { task_id, status_url: format!("/v1/tasks/{task_id}") }
}

#[cfg(test)]
mod tests;
