//! A running intake for the intake suites, on a fresh database and fresh topics, with
//! two tenants' tokens, and the requests, task inputs and webhook deliveries they send.

use std::time::Duration;

use fenceline_config::ExposeSecret;
use fenceline_events::topics;
use fenceline_intake::auth::{Tenant, create_token};
use fenceline_tests::*;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A running intake and two tenants' tokens.
pub(crate) struct Intake {
    pub(crate) base: String,
    /// The database it runs on, for another intake beside it.
    pub(crate) url: String,
    pub(crate) pool: sqlx::PgPool,
    pub(crate) prefix: String,
    pub(crate) acme: String,
    pub(crate) globex: String,
    pub(crate) shutdown: CancellationToken,
}

impl Drop for Intake {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) async fn start_intake() -> Intake {
    start_intake_with(&[], vec!["image.generate".into(), "ticket.triage".into()], |_| {}).await
}

/// An intake with the tasks, status and dead-letter topics and `more_topics`, the
/// given kinds, and `customise` applied to its configuration.
pub(crate) async fn start_intake_with(
    more_topics: &[&str],
    kinds: Vec<String>,
    customise: impl FnOnce(&mut fenceline_intake::Config),
) -> Intake {
    let url = fresh_database().await;
    let wanted =
        [&[topics::TASKS, topics::STATUS, topics::ATTEMPTS, topics::RECOVERY, topics::DEADLETTER][..], more_topics]
            .concat();
    let prefix = fresh_topics_with(&wanted).await;
    let mut config = intake_config(&url, &prefix, kinds);
    customise(&mut config);
    launch(config).await.expect("intake starts")
}

/// Starts an intake with `config`; the error if it refuses to start.
pub(crate) async fn launch(config: fenceline_intake::Config) -> Result<Intake, fenceline_runtime::Error> {
    let url = config.service.postgres.database_url().expect("url").expose_secret().to_owned();
    let prefix = config.service.kafka.topic_prefix.clone();
    let app = fenceline_intake::build(config).await?;
    let pool = app.base.database.pool.clone();
    let base = format!("http://127.0.0.1:{}", app.port());
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(app.run_until(async move { stop.cancelled().await }));
    let (_, acme) = create_token(&pool, &Tenant::parse("acme").expect("tenant"), "test").await.expect("token");
    let (_, globex) = create_token(&pool, &Tenant::parse("globex").expect("tenant"), "test").await.expect("token");
    Ok(Intake { base, url, pool, prefix, acme, globex, shutdown })
}

/// (status, headers we look at, body) of one request.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) content_type: String,
    pub(crate) location: Option<String>,
    pub(crate) replayed: bool,
    pub(crate) body: Value,
}

pub(crate) async fn call(
    method: &str,
    url: String,
    token: Option<String>,
    key: Option<&str>,
    body: Option<String>,
) -> Answer {
    let method = method.to_owned();
    let key = key.map(str::to_owned);
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let mut request = ureq::http::Request::builder().method(method.as_str()).uri(&url);
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = match body {
            Some(body) => agent
                .run(request.header("Content-Type", "application/json").body(body).expect("request"))
                .expect("answer"),
            None => agent.run(request.body(()).expect("request")).expect("answer"),
        };
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (status, content_type, location, replayed) = (
            response.status().as_u16(),
            header("content-type").unwrap_or_default(),
            header("location"),
            header("idempotent-replayed").as_deref() == Some("true"),
        );
        let text = response.into_body().read_to_string().unwrap_or_default();
        Answer { status, content_type, location, replayed, body: serde_json::from_str(&text).unwrap_or(Value::Null) }
    })
    .await
    .expect("client thread")
}

pub(crate) fn image(prompt: &str) -> String {
    json!({"kind": "image.generate", "input": {"prompt": prompt}, "labels": {"shop": "42"}}).to_string()
}

pub(crate) async fn task_rows(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tasks").fetch_one(pool).await.expect("count")
}

/// Puts a task's projected status where the scheduler would have put it.
pub(crate) async fn project(intake: &Intake, task_id: &str, state: &str, case_id: &str, version: i64) {
    sqlx::query(
        "INSERT INTO task_view (task_id, tenant, kind, state, reason, attempt, case_id, updated_at, version) \
         VALUES ($1, 'acme', 'image.generate', $2, 'attempts exhausted (3): not_authorised: 401', 3, $3, now(), $4) \
         ON CONFLICT (task_id) DO UPDATE SET state = EXCLUDED.state, case_id = EXCLUDED.case_id, \
         version = EXCLUDED.version",
    )
    .bind(uuid::Uuid::parse_str(task_id).expect("uuid"))
    .bind(state)
    .bind(case_id)
    .bind(version)
    .execute(&intake.pool)
    .await
    .expect("view row");
}

/// A webhook delivery with its signature headers.
pub(crate) async fn deliver(
    intake: &Intake,
    source: &str,
    event_id: &str,
    timestamp: i64,
    signature: &str,
    body: &str,
) -> Answer {
    let (url, body) = (format!("{}/v1/webhooks/{source}", intake.base), body.to_owned());
    let (event_id, signature) = (event_id.to_owned(), signature.to_owned());
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let started = std::time::Instant::now();
        let response = agent
            .post(&url)
            .header("Content-Type", "application/json")
            .header("Fenceline-Timestamp", timestamp.to_string())
            .header("Fenceline-Signature", signature)
            .header("Fenceline-Event-Id", event_id)
            .send(body)
            .expect("answer");
        let elapsed = started.elapsed();
        assert!(elapsed < Duration::from_secs(2), "a webhook is answered at once, not after the work ({elapsed:?})");
        let status = response.status().as_u16();
        let replayed = response.headers().get("idempotent-replayed").is_some();
        let text = response.into_body().read_to_string().unwrap_or_default();
        Answer {
            status,
            content_type: String::new(),
            location: None,
            replayed,
            body: serde_json::from_str(&text).unwrap_or(Value::Null),
        }
    })
    .await
    .expect("client thread")
}

/// The `v2=` signature of one delivery, as a sender computes it.
pub(crate) fn sign(secret: &str, timestamp: i64, event_id: &str, body: &str) -> String {
    let id = fenceline_intake::webhooks::EventId::parse(event_id).expect("event id");
    fenceline_intake::webhooks::sign(secret.as_bytes(), timestamp, &id, body.as_bytes())
}

/// An intake beside (or after) `earlier`, on its database and topics, with the
/// webhook sealing keys `keys`; the error if it refuses to start.
pub(crate) async fn restart_intake(earlier: &Intake, keys: Option<&str>) -> Result<Intake, fenceline_runtime::Error> {
    let mut config =
        intake_config(&earlier.url, &earlier.prefix, vec!["image.generate".into(), "ticket.triage".into()]);
    config.intake.webhook_sealing_keys = keys.map(|k| k.to_owned().into());
    launch(config).await
}
