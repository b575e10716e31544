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

/// One submission: which tenant asks, under which key of which source, for what.
///
/// `source` (`api`, `webhook:{source}`, `topic:{source}`) is both the task's
/// recorded source and the key's namespace: the same key text from two sources
/// names two different submissions.
#[derive(Debug, Clone)]
pub struct Submission {
    pub tenant: Tenant,
    pub key: IdempotencyKey,
    pub task: ValidTask,
    pub source: String,
    /// The trace the task's work joins: the submitting request's, taken where it
    /// was made (the statement may run elsewhere, for several requests).
    pub traceparent: Option<String>,
}

impl Submission {
    /// A submission in the current span's trace.
    pub fn new(tenant: &Tenant, key: &IdempotencyKey, task: ValidTask, source: &str) -> Self {
        Submission {
            tenant: tenant.clone(),
            key: key.clone(),
            task,
            source: source.to_owned(),
            traceparent: fenceline_telemetry::current_traceparent(),
        }
    }
}

/// Submits `submission`, exactly once per key of its source, with a statement of
/// its own ([`crate::tasks::SubmissionWriter`] writes the API's and the webhooks'
/// submissions together, and each alone when that fails).
///
/// A concurrent request with the same key blocks on the key's unique index until
/// the first transaction ends, then replays its answer (or, if the first rolled
/// back, creates the task itself): it never gets a 409.
pub async fn submit(pool: &PgPool, outbox: &OutboxWriter, submission: &Submission) -> Result<Submitted, ApiError> {
    // One statement writes the whole submission, so it needs no transaction of its
    // own: no BEGIN and COMMIT round trips around it.
    let mut conn = pool.acquire().await?;
    let submitted = submit_all_in(&mut conn, outbox, std::slice::from_ref(submission)).await?;
    drop(conn);
    let submitted = submitted.into_iter().next().expect("one answer per submission");
    accepted_and_committed(outbox, std::slice::from_ref(&submitted));
    submitted
}

/// Logs a task's acceptance, in the span of the request that submitted it.
pub(crate) fn log_accepted(submitted: &Result<Submitted, ApiError>, tenant: &Tenant, kind: &str, source: &str) {
    if let Ok(Submitted::Created(accepted)) = submitted {
        tracing::info!(task_id = %accepted.task_id, tenant = tenant.as_str(), kind, source, "task accepted");
    }
}

/// What follows the commit of submissions: this process's relay is woken if any
/// was new.
pub(crate) fn accepted_and_committed(outbox: &OutboxWriter, submitted: &[Result<Submitted, ApiError>]) {
    // The tasks are accepted; the clients have not heard so (a crash here loses only the answers).
    let _ = fenceline_bus::faults::drops("intake.after_accept_commit");
    if submitted.iter().any(|s| matches!(s, Ok(Submitted::Created(_)))) {
        outbox.committed();
    }
}

/// The submission inside the caller's transaction (the upstream topic's consumer
/// submits inside its batch transaction).
pub async fn submit_in(
    conn: &mut PgConnection,
    outbox: &OutboxWriter,
    tenant: &Tenant,
    key: &IdempotencyKey,
    task: ValidTask,
    source: &str,
) -> Result<Submitted, ApiError> {
    let submission = Submission::new(tenant, key, task, source);
    let submitted =
        submit_all_in(conn, outbox, std::slice::from_ref(&submission)).await?.into_iter().next().expect("one answer");
    log_accepted(&submitted, tenant, &submission.task.kind, source);
    submitted
}

/// Submits each of `submissions` with one statement, on `conn` (inside the caller's
/// transaction, or as a transaction of its own): claiming the keys, storing the
/// tasks, their `TaskAccepted` events in the outbox and the change marks, each part
/// written only for a key that was new. The keys are claimed in (tenant, source,
/// key) order, so two such statements never wait on each other's keys in opposite
/// orders; a key given twice creates one task, and the second is answered as a
/// replay of it, or refused if its request differs.
///
/// The outer error is the statement's (nothing was written); the answers are in
/// the order of `submissions`.
pub async fn submit_all_in(
    conn: &mut PgConnection,
    outbox: &OutboxWriter,
    submissions: &[Submission],
) -> Result<Vec<Result<Submitted, ApiError>>, ApiError> {
    let mut order: Vec<usize> = (0..submissions.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&submissions[a], &submissions[b]);
        (a.tenant.as_str(), a.source.as_str(), a.key.as_str()).cmp(&(
            b.tenant.as_str(),
            b.source.as_str(),
            b.key.as_str(),
        ))
    });
    let accepted_at = OffsetDateTime::now_utc();
    let task_ids: Vec<TaskId> = submissions.iter().map(|_| TaskId::new_v7()).collect();
    let fingerprints: Vec<Vec<u8>> = submissions.iter().map(|s| s.task.fingerprint()).collect();
    let mut columns = Columns::default();
    for &i in &order {
        let Submission { tenant, key, task, source, traceparent } = &submissions[i];
        let event = Event::TaskAccepted(TaskAccepted {
            task_id: task_ids[i],
            tenant: tenant.as_str().to_owned(),
            kind: task.kind.clone(),
            input_json: task.input.to_string(),
            priority: task.priority,
            deadline: task.deadline.map(Timestamp::from),
            not_before: task.not_before.map(Timestamp::from),
            labels: task.labels.clone().into_iter().collect(),
            source: source.clone(),
            accepted_at: Timestamp::from(accepted_at),
        });
        columns.events.push(outbox.row_in_trace(topics::TASKS, None, &event, traceparent.clone())?);
        columns.traceparents.push(traceparent.as_deref());
        columns.tenants.push(tenant.as_str());
        columns.sources.push(source.as_str());
        columns.keys.push(key.as_str());
        columns.fingerprints.push(fingerprints[i].as_slice());
        columns.task_ids.push(task_ids[i].as_uuid());
        columns.kinds.push(task.kind.as_str());
        columns.inputs.push(&task.input);
        columns.priorities.push(task.priority.as_str());
        columns.deadlines.push(task.deadline);
        columns.not_befores.push(task.not_before);
        columns.labels.push(sqlx::types::Json(&task.labels));
    }
    let created: Vec<uuid::Uuid> = sqlx::query_scalar(&SUBMIT_ALL)
        .bind(columns.tenants)
        .bind(columns.sources)
        .bind(columns.keys)
        .bind(columns.fingerprints)
        .bind(columns.task_ids)
        .bind(columns.kinds)
        .bind(columns.inputs)
        .bind(columns.priorities)
        .bind(columns.deadlines)
        .bind(columns.not_befores)
        .bind(columns.labels)
        .bind(accepted_at)
        .bind(columns.traceparents)
        .bind(columns.events)
        .fetch_one(&mut *conn)
        .await?;
    let mut answers = Vec::with_capacity(submissions.len());
    for (i, submission) in submissions.iter().enumerate() {
        let task_id = task_ids[i];
        if created.contains(&task_id.as_uuid()) {
            answers.push(Ok(Submitted::Created(accepted(task_id))));
        } else {
            answers.push(replay(conn, submission, &fingerprints[i]).await?);
        }
    }
    Ok(answers)
}

/// The statement's parameters, one array per column, in key order.
#[derive(Default)]
struct Columns<'a> {
    tenants: Vec<&'a str>,
    sources: Vec<&'a str>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a [u8]>,
    task_ids: Vec<uuid::Uuid>,
    kinds: Vec<&'a str>,
    inputs: Vec<&'a serde_json::Value>,
    priorities: Vec<&'static str>,
    deadlines: Vec<Option<OffsetDateTime>>,
    not_befores: Vec<Option<OffsetDateTime>>,
    labels: Vec<sqlx::types::Json<&'a BTreeMap<String, String>>>,
    traceparents: Vec<Option<&'a str>>,
    events: Vec<fenceline_bus::OutboxRow>,
}

/// Claims the given keys in the order given, stores a task for each key that was
/// new, appends those tasks' events (`$14`, one per given row) and marks them
/// changed; returns the ids of the tasks created.
static SUBMIT_ALL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH given AS ( \
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::uuid[], $6::text[], \
             $7::jsonb[], $8::text[], $9::timestamptz[], $10::timestamptz[], $11::jsonb[], $13::text[]) \
           WITH ORDINALITY AS g (tenant, namespace, idempotency_key, fingerprint, task_id, kind, input, priority, \
             deadline, not_before, labels, traceparent, n)), \
         claimed_key AS ( \
           INSERT INTO idempotency_keys (tenant, namespace, idempotency_key, fingerprint, task_id) \
           SELECT tenant, namespace, idempotency_key, fingerprint, task_id FROM given ORDER BY n \
           ON CONFLICT DO NOTHING RETURNING task_id), \
         accepted AS ( \
           INSERT INTO tasks (task_id, tenant, kind, input, priority, deadline, not_before, labels, source, \
             accepted_at, traceparent) \
           SELECT g.task_id, g.tenant, g.kind, g.input, g.priority, g.deadline, g.not_before, g.labels, g.namespace, \
             $12::timestamptz, g.traceparent FROM given g JOIN claimed_key USING (task_id) ORDER BY g.n \
           RETURNING task_id, tenant), \
         appended AS MATERIALIZED ( \
           SELECT outbox_append(ARRAY(SELECT ($14::outbox_entry[])[g.n::int] FROM given g \
             WHERE g.task_id IN (SELECT task_id FROM accepted) ORDER BY g.n)) AS rows), \
         {marked} \
         SELECT ARRAY(SELECT task_id FROM accepted) \
         FROM (SELECT count(*) FROM marked) AS m, appended",
        marked = crate::live::marked_from("accepted"),
    )
});

/// The answer for a key that was not new: the task it names, if the request is the
/// same; refused if it differs.
async fn replay(
    conn: &mut PgConnection,
    submission: &Submission,
    fingerprint: &[u8],
) -> Result<Result<Submitted, ApiError>, ApiError> {
    let (stored, existing): (Vec<u8>, uuid::Uuid) = sqlx::query_as(
        "SELECT fingerprint, task_id FROM idempotency_keys \
         WHERE tenant = $1 AND namespace = $2 AND idempotency_key = $3",
    )
    .bind(submission.tenant.as_str())
    .bind(&submission.source)
    .bind(submission.key.as_str())
    .fetch_one(&mut *conn)
    .await?;
    Ok(if stored == fingerprint {
        Ok(Submitted::Replayed(accepted(TaskId::from_uuid(existing))))
    } else {
        Err(ApiError::IdempotencyKeyReused)
    })
}

fn accepted(task_id: TaskId) -> Accepted {
    Accepted { task_id, status_url: format!("/v1/tasks/{task_id}") }
}

#[cfg(test)]
mod tests;
