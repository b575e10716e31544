//! Intake's task API over real HTTP, against the real Postgres and broker.

use std::time::Duration;

use fenceline_config::ExposeSecret;
use fenceline_events::topics;
use fenceline_intake::auth::{Tenant, create_token};
use fenceline_tests::*;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A running intake and two tenants' tokens.
struct Intake {
    base: String,
    /// The database it runs on, for another intake beside it.
    url: String,
    pool: sqlx::PgPool,
    prefix: String,
    acme: String,
    globex: String,
    shutdown: CancellationToken,
}

impl Drop for Intake {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn start_intake() -> Intake {
    start_intake_with(&[], vec!["image.generate".into(), "ticket.triage".into()], |_| {}).await
}

/// An intake with the tasks, status and dead-letter topics and `more_topics`, the
/// given kinds, and `customise` applied to its configuration.
async fn start_intake_with(
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
async fn launch(config: fenceline_intake::Config) -> Result<Intake, fenceline_runtime::Error> {
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
struct Answer {
    status: u16,
    content_type: String,
    location: Option<String>,
    replayed: bool,
    body: Value,
}

async fn call(method: &str, url: String, token: Option<String>, key: Option<&str>, body: Option<String>) -> Answer {
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

fn image(prompt: &str) -> String {
    json!({"kind": "image.generate", "input": {"prompt": prompt}, "labels": {"shop": "42"}}).to_string()
}

async fn task_rows(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tasks").fetch_one(pool).await.expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_is_accepted_at_once_and_reads_as_queued() {
    let intake = start_intake().await;
    let answer = call(
        "POST",
        format!("{}/v1/tasks", intake.base),
        Some(intake.acme.clone()),
        Some("k1"),
        Some(image("red shoe")),
    )
    .await;
    assert_eq!(answer.status, 202, "{:?}", answer.body);
    let task_id = answer.body["task_id"].as_str().expect("task id").to_owned();
    assert_eq!(answer.location.as_deref(), Some(format!("/v1/tasks/{task_id}").as_str()));
    assert_eq!(answer.body["status_url"], format!("/v1/tasks/{task_id}"));
    assert!(!answer.replayed);

    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), Some(intake.acme.clone()), None, None).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body["state"], "queued", "accepted but not yet projected reads as queued");

    // The TaskAccepted event reached fenceline.tasks through the outbox.
    let (brokers, topic) = (brokers(), topics::named(&intake.prefix, topics::TASKS));
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, 1, Duration::from_secs(30)))
        .await
        .expect("reader");
    assert_eq!(records.len(), 1);
    let event =
        fenceline_events::decode(rdkafka::message::Message::payload(&records[0]).expect("value")).expect("decodes");
    let fenceline_events::Event::TaskAccepted(accepted) = event else { panic!("not TaskAccepted") };
    assert_eq!(accepted.task_id.to_string(), task_id);
    assert_eq!(accepted.tenant, "acme");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_replays_the_same_task_and_a_different_request_is_refused() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let first = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(image("red shoe"))).await;
    // Same request, spelled differently.
    let same = json!({"labels": {"shop": "42"}, "input": {"prompt": "red shoe"}, "kind": "image.generate", "priority": "normal"});
    let again = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(same.to_string())).await;
    assert_eq!((again.status, again.replayed), (202, true));
    assert_eq!(again.body["task_id"], first.body["task_id"]);

    let other = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(image("blue shoe"))).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.content_type, "application/problem+json");
    assert_eq!(other.body["type"], "/problems/idempotency-key-reused");
    assert_eq!(task_rows(&intake.pool).await, 1, "no second task");

    // Keys are scoped per tenant: another tenant's same key is its own task.
    let globex = call("POST", url, Some(intake.globex.clone()), Some("order-7"), Some(image("blue shoe"))).await;
    assert_eq!((globex.status, globex.replayed), (202, false));
    assert_ne!(globex.body["task_id"], first.body["task_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_identical_submissions_in_parallel_make_one_task() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let calls: Vec<_> = (0..10)
        .map(|_| {
            tokio::spawn(call("POST", url.clone(), Some(intake.acme.clone()), Some("burst"), Some(image("burst"))))
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    let mut replayed = 0;
    for c in calls {
        let answer = c.await.expect("call");
        assert_eq!(answer.status, 202, "{:?}", answer.body);
        ids.insert(answer.body["task_id"].as_str().expect("id").to_owned());
        replayed += usize::from(answer.replayed);
    }
    assert_eq!(ids.len(), 1, "ten answers with one task id");
    assert_eq!(replayed, 9, "one created, nine replayed");
    assert_eq!(task_rows(&intake.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_scope_every_read_to_the_callers_tenant() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task_url = format!("{}/v1/tasks/{}", intake.base, created.body["task_id"].as_str().expect("id"));

    let missing = call("GET", task_url.clone(), None, None, None).await;
    assert_eq!((missing.status, missing.body["type"].as_str()), (401, Some("/problems/unauthorized")));
    let bad = call("GET", task_url.clone(), Some("fl_not-a-token".into()), None, None).await;
    assert_eq!(bad.status, 401);
    let foreign = call("GET", task_url, Some(intake.globex.clone()), None, None).await;
    let nowhere = call(
        "GET",
        format!("{}/v1/tasks/{}", intake.base, uuid::Uuid::now_v7()),
        Some(intake.globex.clone()),
        None,
        None,
    )
    .await;
    assert_eq!(foreign.status, 404, "another tenant's task is not found");
    assert_eq!(
        (foreign.body["type"].clone(), nowhere.status),
        (nowhere.body["type"].clone(), 404),
        "exactly like none"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_problem_never_a_500() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let token = Some(intake.acme.clone());
    let cases = [
        (Some("k1"), "{not json".to_owned(), 400, "/problems/invalid-request"),
        (Some("k2"), json!({"kind": "image.generate"}).to_string(), 400, "/problems/invalid-request"),
        (Some("k3"), json!({"kind": "video.make", "input": {}}).to_string(), 422, "/problems/unknown-kind"),
        (None, image("x"), 400, "/problems/idempotency-key-missing"),
        (Some("k4"), image(&"x".repeat(5000)), 413, "/problems/payload-too-large"),
    ];
    for (key, body, status, problem) in cases {
        let answer = call("POST", url.clone(), token.clone(), key, Some(body.clone())).await;
        assert_eq!(answer.status, status, "{body:.60}: {:?}", answer.body);
        assert_eq!(answer.content_type, "application/problem+json", "{body:.60}");
        assert_eq!(answer.body["type"], problem, "{body:.60}");
    }
    let missing_field =
        call("POST", url.clone(), token.clone(), Some("k5"), Some(json!({"kind": "image.generate"}).to_string())).await;
    assert!(
        missing_field.body["detail"].as_str().unwrap_or_default().contains("input"),
        "names the field: {:?}",
        missing_field.body
    );
    let bad_id = call("GET", format!("{url}/not-a-uuid"), token, None, None).await;
    assert_eq!(bad_id.status, 404);
    assert_eq!(task_rows(&intake.pool).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_follow_the_status_topic_and_never_go_backwards() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task_id: fenceline_domain::ids::TaskId = created.body["task_id"].as_str().expect("id").parse().expect("uuid");
    // A scheduler-like publisher of status snapshots, newest first then a stale one.
    let (db, writer, shutdown) = publisher(&intake).await;
    let mut running = status_event(task_id, 2);
    let mut stale = status_event(task_id, 1);
    if let (fenceline_events::Event::TaskStatus(r), fenceline_events::Event::TaskStatus(s)) = (&mut running, &mut stale)
    {
        r.tenant = "acme".into();
        r.kind = "image.generate".into();
        r.step = Some("render".into());
        s.tenant = "acme".into();
        s.state = fenceline_domain::vocabulary::TaskState::Queued;
    }
    write_outbox(&db.pool, &writer, topics::STATUS, &[running, stale], 10).await;

    let task_url = format!("{}/v1/tasks/{task_id}", intake.base);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let read = call("GET", task_url.clone(), Some(intake.acme.clone()), None, None).await;
        if read.body["version"] == 2 {
            assert_eq!(read.body["state"], "running");
            assert_eq!(read.body["step"], "render");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "status never projected: {:?}", read.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let read = call("GET", task_url, Some(intake.acme.clone()), None, None).await;
    assert_eq!(
        (read.body["version"].clone(), read.body["state"].clone()),
        (json!(2), json!("running")),
        "the stale snapshot did not win"
    );
    shutdown.cancel();
}

/// A publisher of events on intake's topics, as another service would be: its own
/// schema, outbox and relay (stopped by cancelling the token).
async fn publisher(intake: &Intake) -> (fenceline_store::Database, fenceline_bus::OutboxWriter, CancellationToken) {
    let db = fenceline_store::connect(
        &postgres(&database_url_of(&intake.pool).await, "publisher"),
        "publisher",
        &[&fenceline_bus::MIGRATOR],
    )
    .await
    .expect("publisher schema");
    let writer = fenceline_bus::OutboxWriter::new("publisher", intake.prefix.clone(), outbox_config().shards);
    let shutdown = CancellationToken::new();
    start_relay("publisher-relay", &db, &kafka(&intake.prefix), &writer, &shutdown);
    (db, writer, shutdown)
}

/// The URL of the database `pool` is connected to.
async fn database_url_of(pool: &sqlx::PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.expect("name");
    let admin = admin_database_url();
    let (base, _) = admin.rsplit_once('/').expect("path");
    format!("{base}/{name}")
}

/// Events intake wrote to fenceline.tasks, by type, read as the scheduler would.
async fn task_events(intake: &Intake, expected: usize) -> Vec<fenceline_events::Event> {
    let (brokers, topic) = (brokers(), topics::named(&intake.prefix, topics::TASKS));
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, expected, Duration::from_secs(30)))
        .await
        .expect("reader");
    records
        .iter()
        .filter_map(|r| rdkafka::message::Message::payload(r).and_then(|p| fenceline_events::decode(p).ok()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_signals_are_sent_once_however_often_they_are_asked() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task = format!("{}/v1/tasks/{}", intake.base, created.body["task_id"].as_str().expect("id"));
    let token = Some(intake.acme.clone());

    for repeated in [false, true] {
        let cancel = call("POST", format!("{task}/cancel"), token.clone(), None, None).await;
        assert_eq!((cancel.status, cancel.body["repeated"].as_bool()), (202, Some(repeated)));
        let approve = call(
            "POST",
            format!("{task}/signals/approve"),
            token.clone(),
            None,
            Some(json!({"approved": true}).to_string()),
        )
        .await;
        assert_eq!((approve.status, approve.body["repeated"].as_bool()), (202, Some(repeated)), "{:?}", approve.body);
    }
    let other =
        call("POST", format!("{task}/signals/approve"), token.clone(), Some("second-approval"), Some("{}".into()))
            .await;
    assert_eq!(other.body["repeated"], false, "a signal with its own key is a new signal");
    let bad = call("POST", format!("{task}/signals/approve"), token.clone(), None, Some("{oops".into())).await;
    assert_eq!((bad.status, bad.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let foreign = call("POST", format!("{task}/cancel"), Some(intake.globex.clone()), None, None).await;
    assert_eq!(foreign.status, 404);
    let foreign = call("POST", format!("{task}/signals/approve"), Some(intake.globex.clone()), None, None).await;
    assert_eq!(foreign.status, 404, "another tenant cannot signal the task");

    let events = task_events(&intake, 4).await;
    let count = |t: &str| events.iter().filter(|e| e.event_type() == t).count();
    assert_eq!((count("TaskAccepted"), count("CancelRequested"), count("SignalReceived")), (1, 1, 2));
}

/// Puts a task's projected status where the scheduler would have put it.
async fn project(intake: &Intake, task_id: &str, state: &str, case_id: &str, version: i64) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_names_the_case_it_decides_and_is_refused_once_the_case_changed_or_was_decided() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task_id = created.body["task_id"].as_str().expect("id").to_owned();
    let url = format!("{}/v1/tasks/{task_id}/resolution", intake.base);
    let token = Some(intake.acme.clone());
    let resolve = |token: Option<String>, body: Value| call("POST", url.clone(), token, None, Some(body.to_string()));
    let accept = |case: &str| json!({"case_id": case, "action": "accept_failed"});
    let retry = |case: &str| json!({"case_id": case, "action": "retry_as_new", "acknowledge_possible_charge": true});

    let early = resolve(token.clone(), accept("case-1")).await;
    assert_eq!((early.status, early.body["type"].as_str()), (409, Some("/problems/not-resolvable")));
    let foreign = resolve(Some(intake.globex.clone()), accept("case-1")).await;
    assert_eq!((foreign.status, foreign.body["type"].as_str()), (404, Some("/problems/task-not-found")));

    // The scheduler (simulated here) declared the outcome unknown.
    project(&intake, &task_id, "outcome_unknown", "case-1", 5).await;
    let foreign = resolve(Some(intake.globex.clone()), accept("case-1")).await;
    assert_eq!(foreign.status, 404, "another tenant's task is not found, whatever its state");
    let unacknowledged = resolve(token.clone(), json!({"case_id": "case-1", "action": "retry_as_new"})).await;
    assert_eq!(unacknowledged.status, 400);
    assert!(unacknowledged.body["detail"].as_str().unwrap_or_default().contains("acknowledge_possible_charge"));
    let no_result = resolve(token.clone(), json!({"case_id": "case-1", "action": "attach_result"})).await;
    assert_eq!(no_result.status, 400);
    let no_case = resolve(token.clone(), json!({"action": "accept_failed"})).await;
    assert_eq!((no_case.status, no_case.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let stale = resolve(token.clone(), accept("case-0")).await;
    assert_eq!((stale.status, stale.body["type"].as_str()), (409, Some("/problems/case-changed")), "{:?}", stale.body);

    // An approval, sent twice with the same payload, is one signal.
    let approve = || {
        call(
            "POST",
            format!("{}/v1/tasks/{task_id}/signals/approve", intake.base),
            token.clone(),
            None,
            Some("{}".into()),
        )
    };
    assert_eq!(approve().await.body["repeated"], false);
    assert_eq!(approve().await.body["repeated"], true);

    let first = resolve(token.clone(), retry("case-1")).await;
    assert_eq!((first.status, first.body["repeated"].as_bool()), (202, Some(false)), "{:?}", first.body);
    let second = resolve(token.clone(), retry("case-1")).await;
    assert_eq!((second.status, second.body["repeated"].as_bool()), (202, Some(true)), "carried out once per case");
    let other = resolve(token.clone(), accept("case-1")).await;
    assert_eq!((other.status, other.body["type"].as_str()), (409, Some("/problems/already-resolved")));
    assert!(other.body["detail"].as_str().unwrap_or_default().contains("retry_as_new"), "{:?}", other.body);

    // The new generation runs its approval step again: the same approval reaches it.
    assert_eq!(approve().await.body["repeated"], false, "a new generation takes the same approval anew");

    // Retries exhausted: the task needs a person, who can resolve it as well.
    project(&intake, &task_id, "needs_human", "needs_human-g1-a3", 9).await;
    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), token.clone(), None, None).await;
    assert_eq!(read.body["case"]["case_id"], "needs_human-g1-a3", "{:?}", read.body);
    assert!(read.body["case"]["evidence"][0]["finding"].as_str().unwrap_or_default().contains("exhausted"));
    let decided = resolve(token.clone(), accept("needs_human-g1-a3")).await;
    assert_eq!((decided.status, decided.body["repeated"].as_bool()), (202, Some(false)), "{:?}", decided.body);

    let events = task_events(&intake, 5).await;
    let resolutions: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            fenceline_events::Event::ResolutionDecided(r) => Some((r.case_id.as_str(), r.action.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(resolutions, vec![("case-1", "retry_as_new"), ("needs_human-g1-a3", "accept_failed")]);
    let signals = events.iter().filter(|e| e.event_type() == "SignalReceived").count();
    assert_eq!(signals, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_keeps_who_made_it_their_note_and_the_evidence_it_was_made_on() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("r"), Some(image("y"))).await;
    let task_id = created.body["task_id"].as_str().expect("id").to_owned();
    let token = Some(intake.acme.clone());
    // The scheduler and the reconciler (simulated here) declared the outcome unknown, with evidence.
    project(&intake, &task_id, "outcome_unknown", "case-7", 5).await;
    let evidence = json!([{"source": "executor", "observed_at": 1_767_225_617_000_000i64,
                           "finding": "the request left at 10:02:03; no answer within 30 s"}]);
    sqlx::query("INSERT INTO task_cases (task_id, case_id, evidence, decided_at) VALUES ($1, 'case-7', $2, now())")
        .bind(uuid::Uuid::parse_str(&task_id).expect("uuid"))
        .bind(&evidence)
        .execute(&intake.pool)
        .await
        .expect("case row");
    let url = format!("{}/v1/tasks/{task_id}/resolution", intake.base);
    let resolve = |body: Value| call("POST", url.clone(), token.clone(), None, Some(body.to_string()));
    let nameless = resolve(json!({"case_id": "case-7", "action": "accept_failed", "decided_by": " "})).await;
    assert_eq!((nameless.status, nameless.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let decided = resolve(json!({"case_id": "case-7", "action": "accept_failed", "decided_by": "Rui Costa",
                                 "note": "the gateway shows no message for this number"}))
    .await;
    assert_eq!(decided.status, 202, "{:?}", decided.body);

    // After the case closed (the task failed, the reconciler's case gone), the record stays.
    project(&intake, &task_id, "failed", "case-7", 6).await;
    sqlx::query("DELETE FROM task_cases WHERE task_id = $1")
        .bind(uuid::Uuid::parse_str(&task_id).expect("uuid"))
        .execute(&intake.pool)
        .await
        .expect("case gone");
    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), token.clone(), None, None).await;
    let record = &read.body["resolved_cases"][0];
    assert_eq!(
        (record["case_id"].as_str(), record["action"].as_str(), record["decided_by"].as_str()),
        (Some("case-7"), Some("accept_failed"), Some("Rui Costa")),
        "{:#}",
        read.body
    );
    assert_eq!(record["note"], "the gateway shows no message for this number");
    assert!(record["token_identity"].as_str().is_some_and(|t| !t.is_empty()), "{record}");
    assert!(record["decided_at"].is_string(), "{record}");
    assert_eq!(record["evidence"][0]["finding"], "the request left at 10:02:03; no answer within 30 s", "{record}");
    let events = task_events(&intake, 2).await;
    let by: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            fenceline_events::Event::ResolutionDecided(r) => Some(r.decided_by.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(by, ["Rui Costa"], "the event names the person");
}

/// A catalogue as the other services read it: `ticket.triage` waits for
/// `refund_approved` between its calls, `image.generate` for no signal.
fn catalogue_file() -> std::path::PathBuf {
    let catalogue = json!({
        "providers": {"img": {"base_url": "http://127.0.0.1:9", "call_timeout_ms": 1000, "concurrency": 1,
                              "rate_per_second": 1, "burst": 1}},
        "kinds": {
            "image.generate": {"steps": [{"name": "render", "provider": "img"}], "attempt_budget_ms": 5000},
            "ticket.triage": {"steps": [
                {"name": "classify", "provider": "img"},
                {"name": "approve", "approval_signal": "refund_approved"},
                {"name": "refund", "provider": "img"}
            ], "attempt_budget_ms": 5000}
        }
    });
    let path = std::env::temp_dir().join(format!("catalog-{}.json", uuid::Uuid::now_v7().simple()));
    std::fs::write(&path, catalogue.to_string()).expect("write the catalogue");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_no_step_of_the_tasks_kind_waits_for_is_refused_naming_those_it_takes() {
    let catalogue = catalogue_file();
    let kinds = vec!["image.generate".into(), "ticket.triage".into()];
    let intake = start_intake_with(&[], kinds, |config| config.intake.catalog.catalog = Some(catalogue)).await;
    let token = Some(intake.acme.clone());
    let submit = |key: &'static str, kind: &str| {
        let body = json!({"kind": kind, "input": {}}).to_string();
        call("POST", format!("{}/v1/tasks", intake.base), token.clone(), Some(key), Some(body))
    };
    let ticket = submit("ticket", "ticket.triage").await.body["task_id"].as_str().expect("id").to_owned();
    let image = submit("image", "image.generate").await.body["task_id"].as_str().expect("id").to_owned();
    let signal = |task: &str, name: &str| {
        call("POST", format!("{}/v1/tasks/{task}/signals/{name}", intake.base), token.clone(), None, Some("{}".into()))
    };

    let wrong = signal(&ticket, "approve").await;
    assert_eq!(
        (wrong.status, wrong.content_type.as_str(), wrong.body["type"].as_str()),
        (422, "application/problem+json", Some("/problems/unknown-signal")),
        "{:?}",
        wrong.body
    );
    let detail = wrong.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("`approve`") && detail.contains("it takes `refund_approved`"), "{detail}");
    let none = signal(&image, "refund_approved").await;
    assert_eq!((none.status, none.body["type"].as_str()), (422, Some("/problems/unknown-signal")));
    let detail = none.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("kind `image.generate` wait for no signal"), "{detail}");

    let right = signal(&ticket, "refund_approved").await;
    assert_eq!((right.status, right.body["repeated"].as_bool()), (202, Some(false)), "{:?}", right.body);
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT signal_name FROM signals").fetch_all(&intake.pool).await.expect("signals");
    assert_eq!(kept, ["refund_approved"], "only the signal a step waits for was sent on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_task_refuses_new_signals_cancels_and_resolutions_naming_its_state() {
    let intake = start_intake().await;
    let token = Some(intake.acme.clone());
    for state in ["succeeded", "failed", "cancelled"] {
        let created =
            call("POST", format!("{}/v1/tasks", intake.base), token.clone(), Some(state), Some(image(state))).await;
        let task_id = created.body["task_id"].as_str().expect("id").to_owned();
        let task = format!("{}/v1/tasks/{task_id}", intake.base);
        let signal =
            |key: &'static str| call("POST", format!("{task}/signals/approve"), token.clone(), Some(key), None);
        let cancel = || call("POST", format!("{task}/cancel"), token.clone(), None, None);
        // Asked while the task ran.
        assert_eq!(signal("early").await.status, 202);
        if state == "cancelled" {
            assert_eq!(cancel().await.status, 202);
        }
        project(&intake, &task_id, state, "case-1", 7).await;

        let refused = |answer: &Answer, what: &str| {
            assert_eq!(
                (answer.status, answer.content_type.as_str(), answer.body["type"].as_str()),
                (409, "application/problem+json", Some("/problems/task-finished")),
                "{what} of a {state} task: {:?}",
                answer.body
            );
            let expected = format!("task {task_id} is already {state}; nothing to {what}");
            assert_eq!(answer.body["detail"].as_str(), Some(expected.as_str()));
        };
        refused(&signal("late").await, "signal");
        let resolution = json!({"case_id": "case-1", "action": "accept_failed"}).to_string();
        refused(&call("POST", format!("{task}/resolution"), token.clone(), None, Some(resolution)).await, "resolve");
        // What was asked before it finished answers as before: it was carried out once.
        assert_eq!(signal("early").await.body["repeated"], true, "{state}");
        let cancelled = cancel().await;
        if state == "cancelled" {
            assert_eq!((cancelled.status, cancelled.body["repeated"].as_bool()), (202, Some(true)));
        } else {
            refused(&cancelled, "cancel");
        }
    }
    let count = |table: &str| {
        let pool = intake.pool.clone();
        let query = format!("SELECT count(*) FROM {table}");
        async move { sqlx::query_scalar::<_, i64>(&query).fetch_one(&pool).await.expect("count") }
    };
    assert_eq!(
        (count("signals").await, count("cancellations").await, count("resolutions").await),
        (3, 1, 0),
        "nothing refused was recorded"
    );
}

/// Produces a `TaskRequest` record to the upstream topic, as another system would.
async fn produce_request(intake: &Intake, request: fenceline_events::TaskRequest) -> Vec<u8> {
    let event = fenceline_events::Event::TaskRequest(request);
    let (bytes, fp) = fenceline_events::encode(&event).expect("encode");
    let headers = fenceline_events::Headers {
        event_id: fenceline_domain::ids::EventId::new_v7(),
        event_type: "TaskRequest".into(),
        schema_fingerprint: hex_of(&fp),
        producer: "helpdesk".into(),
        produced_at: fenceline_events::Timestamp::now(),
        traceparent: None,
    };
    let pairs = headers.to_pairs();
    let refs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    produce_raw(&brokers(), &topics::named(&intake.prefix, topics::INTAKE_REQUESTS), b"ticket", &bytes, &refs).await;
    bytes
}

/// Configures `source` to submit through the upstream topic for `tenant`.
async fn configure_upstream(intake: &Intake, source: &str, tenant: &str) {
    let tenant = Tenant::parse(tenant).expect("tenant");
    fenceline_intake::upstream::add_source(&intake.pool, source, &tenant).await.expect("source configured");
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn ticket(source_event_id: &str, tenant: &str, kind: &str, input_json: &str) -> fenceline_events::TaskRequest {
    fenceline_events::TaskRequest {
        source: "helpdesk".into(),
        source_event_id: source_event_id.into(),
        tenant: tenant.into(),
        kind: kind.into(),
        input_json: input_json.into(),
        priority: fenceline_domain::vocabulary::Priority::Normal,
        deadline: None,
        not_before: None,
        labels: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_requests_become_tasks_once_and_bad_ones_are_answered_with_their_bytes() {
    let intake =
        start_intake_with(&[topics::INTAKE_REQUESTS, topics::INTAKE_REJECTED], vec!["ticket.triage".into()], |_| {})
            .await;
    let (pool, prefix) = (intake.pool.clone(), intake.prefix.clone());
    configure_upstream(&intake, "helpdesk", "acme").await;

    produce_request(&intake, ticket("t-1", "acme", "ticket.triage", r#"{"ticket":1}"#)).await;
    produce_request(&intake, ticket("t-1", "acme", "ticket.triage", r#"{"ticket":1}"#)).await; // redelivered
    produce_request(&intake, ticket("t-2", "acme", "ticket.triage", r#"{"ticket":2}"#)).await;
    let bad_kind = produce_request(&intake, ticket("t-3", "acme", "video.make", "{}")).await;
    produce_request(&intake, ticket("t-4", "nobody", "ticket.triage", "{}")).await;
    produce_raw(&brokers(), &topics::named(&prefix, topics::INTAKE_REQUESTS), b"ticket", b"\x00garbage", &[]).await;
    produce_request(&intake, ticket("t-5", "acme", "ticket.triage", r#"{"ticket":5}"#)).await;
    // helpdesk is acme's source, not globex's: it cannot make globex's (billable) tasks.
    produce_request(&intake, ticket("t-6", "globex", "ticket.triage", r#"{"ticket":6}"#)).await;

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while task_rows(&pool).await < 3 {
        assert!(tokio::time::Instant::now() < deadline, "requests never became tasks");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (brokers, rejected_topic) = (brokers(), topics::named(&prefix, topics::INTAKE_REJECTED));
    let rejected =
        tokio::task::spawn_blocking(move || read_topic(&brokers, &rejected_topic, 4, Duration::from_secs(30)))
            .await
            .expect("reader");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(task_rows(&pool).await, 3, "t-1 once, t-2, t-5; the partition kept moving past the bad records");
    let answers: Vec<fenceline_events::RequestRejected> = rejected
        .iter()
        .filter_map(|r| match fenceline_events::decode(rdkafka::message::Message::payload(r).expect("value")) {
            Ok(fenceline_events::Event::RequestRejected(r)) => Some(r),
            _ => None,
        })
        .collect();
    let by_type =
        |t: &str| answers.iter().find(|a| a.problem_type == t).unwrap_or_else(|| panic!("no {t} answer: {answers:?}"));
    assert_eq!(by_type("unknown-kind").original.0, bad_kind, "the original bytes");
    assert_eq!(by_type("unknown-tenant").source_event_id.as_deref(), Some("t-4"));
    assert_eq!(by_type("invalid-record").original.0, b"\x00garbage");
    assert_eq!(by_type("unknown-source").source_event_id.as_deref(), Some("t-6"));
    assert_eq!(by_type("unknown-source").tenant.as_deref(), Some("globex"), "the tenant it named");
    assert_eq!(answers.len(), 4);
}

/// The `RequestRejected` answers on the rejected topic, `expected` of them.
async fn rejections(intake: &Intake, expected: usize) -> Vec<fenceline_events::RequestRejected> {
    let (brokers, topic) = (brokers(), topics::named(&intake.prefix, topics::INTAKE_REJECTED));
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, expected, Duration::from_secs(30)))
        .await
        .expect("reader");
    records
        .iter()
        .filter_map(|r| match fenceline_events::decode(rdkafka::message::Message::payload(r).expect("value")) {
            Ok(fenceline_events::Event::RequestRejected(r)) => Some(r),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_record_from_a_source_not_configured_for_its_tenant_is_refused() {
    let intake =
        start_intake_with(&[topics::INTAKE_REQUESTS, topics::INTAKE_REJECTED], vec!["ticket.triage".into()], |_| {})
            .await;
    let stranger =
        fenceline_events::TaskRequest { source: "stranger".into(), ..ticket("s-1", "acme", "ticket.triage", "{}") };
    let original = produce_request(&intake, stranger).await;
    let answers = rejections(&intake, 1).await;
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].problem_type, "unknown-source");
    assert_eq!(answers[0].source.as_deref(), Some("stranger"));
    assert_eq!(answers[0].original.0, original);
    assert_eq!(task_rows(&intake.pool).await, 0, "no task for acme from a source acme never configured");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_instants_out_of_range_are_refused_not_moved_to_1970() {
    let intake =
        start_intake_with(&[topics::INTAKE_REQUESTS, topics::INTAKE_REJECTED], vec!["ticket.triage".into()], |_| {})
            .await;
    configure_upstream(&intake, "helpdesk", "acme").await;
    let now_ns = time::OffsetDateTime::now_utc().unix_timestamp_nanos() as i64;
    let in_nanoseconds = fenceline_events::TaskRequest {
        deadline: Some(fenceline_events::Timestamp(now_ns + 3_600_000_000_000)),
        ..ticket("i-1", "acme", "ticket.triage", "{}")
    };
    let before_1970 = fenceline_events::TaskRequest {
        not_before: Some(fenceline_events::Timestamp(-1)),
        ..ticket("i-2", "acme", "ticket.triage", "{}")
    };
    produce_request(&intake, in_nanoseconds).await;
    produce_request(&intake, before_1970).await;
    let answers = rejections(&intake, 2).await;
    assert_eq!(answers.len(), 2, "{answers:?}");
    // The answers are keyed by source event id, so they may come from two partitions in either order.
    for answer in &answers {
        let field = if answer.source_event_id.as_deref() == Some("i-1") { "deadline" } else { "not_before" };
        assert_eq!(answer.problem_type, "invalid-request", "{answer:?}");
        assert!(answer.reason.contains(field) && answer.reason.contains("microseconds"), "{}", answer.reason);
    }
    assert_eq!(task_rows(&intake.pool).await, 0);
}

/// A webhook delivery with its signature headers.
async fn deliver(intake: &Intake, source: &str, event_id: &str, timestamp: i64, signature: &str, body: &str) -> Answer {
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
fn sign(secret: &str, timestamp: i64, event_id: &str, body: &str) -> String {
    let id = fenceline_intake::webhooks::EventId::parse(event_id).expect("event id");
    fenceline_intake::webhooks::sign(secret.as_bytes(), timestamp, &id, body.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_webhooks_become_tasks_once_and_bad_or_stale_signatures_are_refused() {
    use fenceline_intake::webhooks::add_secret;
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, old) = add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("secret");
    let (_, new) = add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("rotated");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 81723, "subject": "refund please"}).to_string();

    let first = deliver(&intake, "helpdesk", "evt-1", now, &sign(&old, now, "evt-1", &body), &body).await;
    assert_eq!(first.status, 202, "{:?}", first.body);
    // The sender retries after 5 seconds, now signing with the new secret.
    let resent = deliver(&intake, "helpdesk", "evt-1", now, &sign(&new, now, "evt-1", &body), &body).await;
    assert_eq!((resent.status, resent.replayed), (202, true));
    assert_eq!(resent.body["task_id"], first.body["task_id"], "deduplicated by the source's event id");

    let tampered = deliver(&intake, "helpdesk", "evt-2", now, &sign(&new, now, "evt-2", "{}"), &body).await;
    let stale = deliver(&intake, "helpdesk", "evt-3", now - 600, &sign(&new, now - 600, "evt-3", &body), &body).await;
    let unknown = deliver(&intake, "nobody", "evt-4", now, &sign(&new, now, "evt-4", &body), &body).await;
    for refused in [&tampered, &stale, &unknown] {
        assert_eq!((refused.status, refused.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    }
    // A third secret retires the oldest.
    add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("third");
    let retired = deliver(&intake, "helpdesk", "evt-5", now, &sign(&old, now, "evt-5", &body), &body).await;
    assert_eq!(retired.status, 401, "the oldest secret was retired");

    assert_eq!(task_rows(&intake.pool).await, 1);
    let kind: String = sqlx::query_scalar("SELECT kind FROM tasks").fetch_one(&intake.pool).await.expect("kind");
    assert_eq!(kind, "ticket.triage", "mapped to the source's kind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_spelled_like_a_webhooks_key_is_its_own_submission() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("secret");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 1}).to_string();
    let hook = deliver(&intake, "helpdesk", "evt-1", now, &sign(&secret, now, "evt-1", &body), &body).await;
    assert_eq!(hook.status, 202, "{:?}", hook.body);

    // The webhook's key is `webhook:helpdesk:evt-1` in acme; an API client picks the same text.
    let url = format!("{}/v1/tasks", intake.base);
    let key = Some("webhook:helpdesk:evt-1");
    let api = call("POST", url.clone(), Some(intake.acme.clone()), key, Some(image("red shoe"))).await;
    assert_eq!((api.status, api.replayed), (202, false), "neither a replay of the webhook's task nor a 422: {api:?}");
    assert_ne!(api.body["task_id"], hook.body["task_id"]);
    let again = call("POST", url, Some(intake.acme.clone()), key, Some(image("red shoe"))).await;
    assert_eq!((again.status, again.replayed, &again.body["task_id"]), (202, true, &api.body["task_id"]));
    let resent = deliver(&intake, "helpdesk", "evt-1", now, &sign(&secret, now, "evt-1", &body), &body).await;
    assert_eq!((resent.replayed, &resent.body["task_id"]), (true, &hook.body["task_id"]), "the webhook's own replay");
    assert_eq!(task_rows(&intake.pool).await, 2);
}

/// HMAC-SHA256 (RFC 2104) on Postgres's `sha256`, for signing the way old senders did.
async fn hmac_sha256(pool: &sqlx::PgPool, key: &[u8], message: String) -> Vec<u8> {
    async fn sha256(pool: &sqlx::PgPool, bytes: Vec<u8>) -> Vec<u8> {
        sqlx::query_scalar("SELECT sha256($1)").bind(bytes).fetch_one(pool).await.expect("sha256")
    }
    let mut block = if key.len() > 64 { sha256(pool, key.to_vec()).await } else { key.to_vec() };
    block.resize(64, 0);
    let pad = |byte: u8| block.iter().map(|k| k ^ byte).collect::<Vec<u8>>();
    let inner = sha256(pool, [pad(0x36), message.into_bytes()].concat()).await;
    sha256(pool, [pad(0x5c), inner].concat()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_delivery_replayed_under_a_new_event_id_or_signed_the_old_way_creates_no_task() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("s");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 81723, "subject": "refund please"}).to_string();
    let captured = sign(&secret, now, "evt-1", &body);
    let first = deliver(&intake, "helpdesk", "evt-1", now, &captured, &body).await;
    assert_eq!(first.status, 202, "{:?}", first.body);

    // Someone who saw that delivery sends it again inside the window, with a fresh id.
    let replayed = deliver(&intake, "helpdesk", "evt-1-again", now, &captured, &body).await;
    assert_eq!((replayed.status, replayed.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    // A sender still on the old scheme (HMAC of "timestamp.body", v1) is refused, saying why.
    let pinned = hmac_sha256(&intake.pool, b"secret", "1700000000.{}".into()).await;
    assert_eq!(
        hex::encode(pinned),
        "b8569b78799ff9e3cbff0fc2d63a33a2b57f3282abd07c37ae5e8e7d79a5f163",
        "the old formula"
    );
    let old =
        format!("v1={}", hex::encode(hmac_sha256(&intake.pool, secret.as_bytes(), format!("{now}.{body}")).await));
    let old_style = deliver(&intake, "helpdesk", "evt-2", now, &old, &body).await;
    assert_eq!((old_style.status, old_style.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    assert!(old_style.body["detail"].as_str().unwrap_or_default().contains("v1"), "{:?}", old_style.body);
    // An event id the signed text cannot carry unambiguously is refused too.
    let dotted = deliver(&intake, "helpdesk", "evt.3", now, &captured, &body).await;
    assert_eq!(dotted.status, 401);

    assert_eq!(task_rows(&intake.pool).await, 1, "only the original delivery became a task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_are_listed_newest_first_with_filters_and_a_stable_cursor() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let token = Some(intake.acme.clone());
    let mut ids = Vec::new();
    for i in 0..5 {
        let labels = if i % 2 == 0 { json!({"shop": "even"}) } else { json!({"shop": "odd"}) };
        let body = json!({"kind": "image.generate", "input": {"i": i}, "labels": labels}).to_string();
        let answer = call("POST", url.clone(), token.clone(), Some(&format!("list-{i}")), Some(body)).await;
        ids.push(answer.body["task_id"].as_str().expect("id").to_owned());
    }
    call("POST", url.clone(), Some(intake.globex.clone()), Some("other"), Some(image("other tenant"))).await;

    let first = call("GET", format!("{url}?limit=2"), token.clone(), None, None).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let page_ids = |a: &Answer| {
        a.body["tasks"]
            .as_array()
            .expect("tasks")
            .iter()
            .map(|t| t["task_id"].as_str().expect("id").to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(page_ids(&first), vec![ids[4].clone(), ids[3].clone()], "newest first");
    let cursor = first.body["next_cursor"].as_str().expect("more pages").to_owned();
    // A task arriving between pages does not shift the next page.
    call("POST", url.clone(), token.clone(), Some("late"), Some(image("late"))).await;
    let second = call("GET", format!("{url}?limit=2&cursor={cursor}"), token.clone(), None, None).await;
    assert_eq!(page_ids(&second), vec![ids[2].clone(), ids[1].clone()]);
    let third = call(
        "GET",
        format!("{url}?limit=2&cursor={}", second.body["next_cursor"].as_str().expect("c")),
        token.clone(),
        None,
        None,
    )
    .await;
    assert_eq!(page_ids(&third), vec![ids[0].clone()]);
    assert!(third.body["next_cursor"].is_null(), "last page");

    let odd =
        call("GET", format!("{url}?label=shop:odd&state=queued&kind=image.generate"), token.clone(), None, None).await;
    assert_eq!(page_ids(&odd), vec![ids[3].clone(), ids[1].clone()]);
    let none = call("GET", format!("{url}?state=succeeded"), token.clone(), None, None).await;
    assert_eq!(page_ids(&none), Vec::<String>::new());
    for bad in [
        "state=done",
        "limit=0",
        "cursor=xyz",
        "label=nocolon",
        "since=yesterday",
        "colour=red",
        "kind=%25P%40%00S%28",
        "label=a:b%00",
    ] {
        let answer = call("GET", format!("{url}?{bad}"), token.clone(), None, None).await;
        assert_eq!((answer.status, answer.body["type"].as_str()), (400, Some("/problems/invalid-request")), "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_accepted_long_ago_that_never_reached_the_scheduler_are_reported() {
    use fenceline_intake::tasks::unscheduled;
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let mut ids = Vec::new();
    for key in ["lost", "scheduled", "fresh"] {
        let answer = call("POST", url.clone(), Some(intake.acme.clone()), Some(key), Some(image(key))).await;
        ids.push(answer.body["task_id"].as_str().expect("task id").to_owned());
    }
    // The first two were accepted 20 minutes ago; only the second reached the scheduler.
    sqlx::query("UPDATE tasks SET accepted_at = now() - interval '20 minutes' WHERE task_id = ANY($1)")
        .bind(ids[..2].iter().map(|id| uuid::Uuid::parse_str(id).expect("uuid")).collect::<Vec<_>>())
        .execute(&intake.pool)
        .await
        .expect("age");
    project(&intake, &ids[1], "running", "", 1).await;

    let ten_minutes = Duration::from_secs(600);
    let (found, count) = unscheduled(&intake.pool, ten_minutes, 20).await.expect("unscheduled");
    let found: Vec<String> = found.iter().map(|t| t.task_id.to_string()).collect();
    assert_eq!((found, count), (vec![ids[0].clone()], 1), "only the old task the scheduler never saw");
    let (_, count) = unscheduled(&intake.pool, Duration::from_secs(1800), 20).await.expect("unscheduled");
    assert_eq!(count, 0, "20 minutes is within a 30-minute threshold");

    project(&intake, &ids[0], "queued", "", 1).await;
    assert_eq!(unscheduled(&intake.pool, ten_minutes, 20).await.expect("unscheduled").1, 0, "cleared once it arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_tasks_past_their_retention_are_purged_in_small_batches_and_open_ones_kept() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let mut ids = Vec::new();
    for key in ["old-1", "old-2", "old-3", "open", "recent"] {
        let answer = call("POST", url.clone(), Some(intake.acme.clone()), Some(key), Some(image(key))).await;
        ids.push(answer.body["task_id"].as_str().expect("task id").to_owned());
    }
    let cancel = call("POST", format!("{url}/{}/cancel", ids[0]), Some(intake.acme.clone()), None, None).await;
    assert_eq!(cancel.status, 202);
    for (id, state) in ids.iter().zip(["cancelled", "succeeded", "failed", "running", "succeeded"]) {
        project(&intake, id, state, "", 1).await;
    }
    sqlx::query("UPDATE task_view SET updated_at = now() - interval '31 days' WHERE task_id = ANY($1)")
        .bind(ids[..4].iter().map(|id| uuid::Uuid::parse_str(id).expect("uuid")).collect::<Vec<_>>())
        .execute(&intake.pool)
        .await
        .expect("age");
    let thirty_days = Duration::from_secs(30 * 86_400);
    let purged = fenceline_intake::tasks::purge_finished_tasks(&intake.pool, thirty_days, 2).await.expect("purge");
    assert_eq!(purged, 3, "the three finished 31 days ago, two at a time");
    let left: Vec<String> = sqlx::query_scalar("SELECT task_id::text FROM tasks ORDER BY task_id")
        .fetch_all(&intake.pool)
        .await
        .expect("left");
    assert_eq!(left, vec![ids[3].clone(), ids[4].clone()], "the running one and the recent one stay");
    let cancellations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM cancellations").fetch_one(&intake.pool).await.expect("count");
    assert_eq!(cancellations, 0, "with their rows");
    let read = call("GET", format!("{url}/{}", ids[1]), Some(intake.acme.clone()), None, None).await;
    assert_eq!(read.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_past_their_retention_are_purged_and_then_start_afresh() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let first = call("POST", url.clone(), Some(intake.acme.clone()), Some("old-key"), Some(image("x"))).await;
    // Age the key past the 24 h retention, as if a day had passed.
    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '25 hours'")
        .execute(&intake.pool)
        .await
        .expect("age");
    let purged = fenceline_intake::tasks::purge_idempotency_keys(&intake.pool, 24).await.expect("purge");
    assert_eq!(purged, 1);
    let again = call("POST", url, Some(intake.acme.clone()), Some("old-key"), Some(image("x"))).await;
    assert_eq!((again.status, again.replayed), (202, false), "a purged key is a new submission");
    assert_ne!(again.body["task_id"], first.body["task_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_refused_as_unsupported() {
    let intake = start_intake().await;
    let (url, token) = (format!("{}/v1/tasks", intake.base), intake.acme.clone());
    let answer = tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let response = agent
            .post(&url)
            .header("Authorization", format!("Bearer {token}"))
            .header("Idempotency-Key", "k")
            .header("Content-Type", "text/plain")
            .send("kind=image.generate")
            .expect("answer");
        let status = response.status().as_u16();
        let text = response.into_body().read_to_string().unwrap_or_default();
        (status, serde_json::from_str::<Value>(&text).unwrap_or(Value::Null))
    })
    .await
    .expect("client");
    assert_eq!((answer.0, answer.1["type"].as_str()), (415, Some("/problems/unsupported-media-type")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_fails_its_kinds_schema_is_refused_naming_where() {
    let dir = std::env::temp_dir().join(format!("schemas-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let schema = json!({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string", "maxLength": 200}}});
    std::fs::write(dir.join("image.generate.json"), schema.to_string()).expect("schema");
    let intake = start_intake_with(&[], vec!["image.generate".into()], |c| c.intake.kind_schemas = Some(dir)).await;
    let (base, pool, token) = (intake.base.clone(), intake.pool.clone(), intake.acme.clone());

    let bad = json!({"kind": "image.generate", "input": {"prompt": 7}}).to_string();
    let answer = call("POST", format!("{base}/v1/tasks"), Some(token.clone()), Some("k1"), Some(bad)).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (422, Some("/problems/input-invalid")));
    assert!(answer.body["detail"].as_str().unwrap_or_default().contains("/prompt"), "{:?}", answer.body);
    let good = call("POST", format!("{base}/v1/tasks"), Some(token), Some("k2"), Some(image("fine"))).await;
    assert_eq!(good.status, 202);
    assert_eq!(task_rows(&pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_shows_each_attempt_and_how_it_ended() {
    use fenceline_domain::ids::GrantId;
    use fenceline_domain::vocabulary::{ErrorClass, Phase, RecoveryDecision};
    use fenceline_events::{
        ArtifactRef, AttemptClaimed, AttemptFailed, AttemptLost, AttemptSucceeded, Event, RecoveryDecided, Timestamp,
    };
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task_id: fenceline_domain::ids::TaskId = created.body["task_id"].as_str().expect("id").parse().expect("uuid");
    let (db, writer, shutdown) = publisher(&intake).await;
    let now = Timestamp::now();
    let claimed = |attempt: i32, grant_id: GrantId| {
        Event::AttemptClaimed(AttemptClaimed {
            grant_id,
            task_id,
            attempt,
            fencing_token: i64::from(attempt),
            lease_expires_at: now,
            worker: "w".into(),
        })
    };
    let grants = [GrantId::new_v7(), GrantId::new_v7(), GrantId::new_v7()];
    // The executor's reports, as it would publish them, and the reconciler's decision.
    let attempts = [
        claimed(1, grants[0]),
        Event::AttemptFailed(AttemptFailed {
            task_id,
            attempt: 1,
            grant_id: grants[0],
            error_class: ErrorClass::Throttled,
            message: "429 from imagegen".into(),
            retry_after_ms: Some(1000),
            money_may_have_been_spent: false,
            failed_at: now,
        }),
        claimed(2, grants[1]),
        Event::AttemptLost(AttemptLost {
            task_id,
            attempt: 2,
            grant_id: grants[1],
            last_phase: Phase::CallIntent,
            last_phase_at: now,
            step: Some("render".into()),
            operation_key: Some("op".into()),
            provider_request_id: None,
            detected_at: now,
        }),
        claimed(3, grants[2]),
        Event::AttemptSucceeded(AttemptSucceeded {
            task_id,
            attempt: 3,
            grant_id: grants[2],
            result: ArtifactRef { uri: "mem://r".into(), sha256: "ab".repeat(32), size_bytes: 3 },
            finished_at: now,
        }),
    ];
    write_outbox(&db.pool, &writer, topics::ATTEMPTS, &attempts, 10).await;
    let decided = Event::RecoveryDecided(RecoveryDecided {
        task_id,
        attempt: 2,
        decision: RecoveryDecision::RetrySafe,
        case_id: None,
        result: None,
        evidence: vec![],
        decided_at: now,
    });
    write_outbox(&db.pool, &writer, topics::RECOVERY, &[decided], 10).await;

    let task_url = format!("{}/v1/tasks/{task_id}", intake.base);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let attempts = loop {
        let read = call("GET", task_url.clone(), Some(intake.acme.clone()), None, None).await;
        let attempts = read.body["attempts"].as_array().cloned().unwrap_or_default();
        let done = attempts.len() == 3
            && attempts[2]["outcome"] == "succeeded"
            && attempts[1]["recovery"] == "retry_safe"
            && attempts[1]["outcome"] == "lost";
        if done {
            break attempts;
        }
        assert!(tokio::time::Instant::now() < deadline, "attempts never projected: {:?}", read.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let numbers: Vec<_> = attempts.iter().map(|a| a["attempt"].clone()).collect();
    assert_eq!(numbers, [json!(1), json!(2), json!(3)], "oldest first");
    assert_eq!(
        (attempts[0]["outcome"].as_str(), attempts[0]["error_class"].as_str()),
        (Some("failed"), Some("throttled"))
    );
    assert_eq!(attempts[0]["money_may_have_been_spent"], false);
    assert!(attempts[1]["detail"].as_str().unwrap_or_default().contains("call_intent"), "{:?}", attempts[1]);
    assert!(attempts.iter().all(|a| a["started_at"].is_string()), "every attempt was claimed: {attempts:?}");
    // The list does not carry attempts; only the single read does.
    let page = call("GET", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), None, None).await;
    assert!(page.body["tasks"][0].get("attempts").is_none(), "{:?}", page.body);
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_odd_methods_and_unstorable_text_get_problems() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let token = Some(intake.acme.clone());
    let long_key = "k".repeat(256);
    let answer = call("POST", url.clone(), token.clone(), Some(&long_key), Some(image("x"))).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (400, Some("/problems/idempotency-key-invalid")));

    let huge = "h".repeat(fenceline_intake::HEADER_VALUE_LIMIT + 1);
    let answer = call("POST", url.clone(), token.clone(), Some(&huge), Some(image("x"))).await;
    assert_eq!((answer.status, answer.content_type.as_str()), (431, "application/problem+json"));
    assert_eq!(answer.body["type"], "/problems/header-too-large");

    let answer = call("DELETE", url.clone(), token.clone(), None, None).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (405, Some("/problems/method-not-allowed")));

    for body in [
        json!({"kind": "image.generate", "input": {"prompt": "nul\u{0}"}}),
        json!({"kind": "image.generate", "input": {"a\u{0}": 1}}),
        json!({"kind": "image.generate", "input": {}, "labels": {"k": "v\u{0}"}}),
        json!({"kind": "image.generate", "input": "not an object"}),
    ] {
        let answer = call("POST", url.clone(), token.clone(), Some("nul"), Some(body.to_string())).await;
        assert_eq!((answer.status, answer.body["type"].as_str()), (400, Some("/problems/invalid-request")), "{body}");
    }
    assert_eq!(task_rows(&intake.pool).await, 0);
}

/// schemathesis (PyPI) generates requests for every operation of the served
/// document, valid and invalid, and checks each answer against it: no `5xx`, every
/// status, header, media type and body as documented, invalid input refused, other
/// methods answered `405` (a body or headers over the limits count as refused with
/// `413` and `431`: `tests/python/schemathesis.toml`). Left out:
/// `positive_data_acceptance`, which expects every schema-valid request to succeed;
/// a reused Idempotency-Key (`422`) and a deadline before `not_before` (`400`) are
/// valid JSON that the API must refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_keeps_to_its_openapi_document_under_schemathesis() {
    let schemathesis = std::env::var("FENCELINE_SCHEMATHESIS")
        .expect("FENCELINE_SCHEMATHESIS names the schemathesis command (deploy/local/stack test sets it)");
    let intake = start_intake().await;
    let document = call("GET", format!("{}/v1/openapi.json", intake.base), None, None, None).await;
    assert_eq!(document.status, 200);
    assert_eq!(document.body["openapi"], "3.1.0");
    let examples = std::env::var("FENCELINE_SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| "20".into());
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/schemathesis.toml");
    let output = tokio::process::Command::new(schemathesis)
        .arg("--config-file")
        .arg(&config)
        .args(["run", &format!("{}/v1/openapi.json", intake.base)])
        .args(["--header", &format!("Authorization: Bearer {}", intake.acme)])
        .args(["--checks", "all", "--exclude-checks", "positive_data_acceptance"])
        .args(["--max-examples", &examples, "--workers", "1", "--no-color"])
        .current_dir(std::env::temp_dir())
        .output()
        .await
        .expect("schemathesis runs");
    let report = String::from_utf8_lossy(&output.stdout);
    eprintln!("{report}");
    assert!(
        output.status.success(),
        "schemathesis found failures:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("passed"), "schemathesis tested something: {report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dedupes_by_ticket_id_makes_one_task_however_many_event_ids_its_retries_carry() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("s");
    let set = fenceline_intake::webhooks::set_dedupe_field(&intake.pool, "helpdesk", Some("/ticket/id"));
    assert!(set.await.expect("dedupe field"), "the source exists");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body =
        |id: Value, note: &str| json!({"ticket": {"id": id, "subject": "refund please"}, "note": note}).to_string();

    // The helpdesk gives each delivery attempt its own event id, each signed.
    let first_body = body(json!(81723), "first try");
    let first =
        deliver(&intake, "helpdesk", "try-1", now, &sign(&secret, now, "try-1", &first_body), &first_body).await;
    assert_eq!((first.status, first.replayed), (202, false), "{:?}", first.body);
    let retry_body = body(json!(81723), "first try");
    let retry =
        deliver(&intake, "helpdesk", "try-2", now, &sign(&secret, now, "try-2", &retry_body), &retry_body).await;
    assert_eq!((retry.status, retry.replayed, &retry.body["task_id"]), (202, true, &first.body["task_id"]));
    // The same ticket with another body is the reuse of a key, not a new task.
    let changed = body(json!(81723), "edited");
    let reused = deliver(&intake, "helpdesk", "try-3", now, &sign(&secret, now, "try-3", &changed), &changed).await;
    assert_eq!(reused.status, 422, "{:?}", reused.body);
    // Another ticket is another task; a body without the field is refused, saying why.
    let other = body(json!("81724"), "first try");
    let second = deliver(&intake, "helpdesk", "try-4", now, &sign(&secret, now, "try-4", &other), &other).await;
    assert_eq!((second.status, second.replayed), (202, false), "{:?}", second.body);
    let bare = json!({"subject": "no ticket"}).to_string();
    let refused = deliver(&intake, "helpdesk", "try-5", now, &sign(&secret, now, "try-5", &bare), &bare).await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    assert!(refused.body["detail"].as_str().unwrap_or_default().contains("/ticket/id"), "{:?}", refused.body);
    assert_eq!(task_rows(&intake.pool).await, 2);
}

/// Two webhook sealing keys (64 hex digits each), and the text of each.
const SEALING_KEY_A: &str = "5e1f0c2a9d8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";
const SEALING_KEY_B: &str = "b7c1e2d3f4a5968778695a4b3c2d1e0ff0e1d2c3b4a5968778695a4b3c2d1e0f";

fn sealing_keys(text: &str) -> fenceline_intake::sealing::SealingKeys {
    fenceline_intake::sealing::SealingKeys::parse(&text.to_owned().into()).expect("sealing keys")
}

/// An intake beside (or after) `earlier`, on its database and topics, with the
/// webhook sealing keys `keys`; the error if it refuses to start.
async fn restart_intake(earlier: &Intake, keys: Option<&str>) -> Result<Intake, fenceline_runtime::Error> {
    let mut config =
        intake_config(&earlier.url, &earlier.prefix, vec!["image.generate".into(), "ticket.triage".into()]);
    config.intake.webhook_sealing_keys = keys.map(|k| k.to_owned().into());
    launch(config).await
}

async fn start_intake_sealing_with(keys: &str) -> Intake {
    start_intake_with(&[], vec!["image.generate".into(), "ticket.triage".into()], |config| {
        config.intake.webhook_sealing_keys = Some(keys.to_owned().into());
    })
    .await
}

/// Each row of `webhook_secrets`: (secret id, source, clear secret, sealed bytes, key id).
type SecretRow = (uuid::Uuid, String, Option<String>, Option<Vec<u8>>, Option<String>);

async fn secret_rows(pool: &sqlx::PgPool) -> Vec<SecretRow> {
    sqlx::query_as(
        "SELECT secret_id, source, secret, sealed_secret, sealing_key_id FROM webhook_secrets ORDER BY created_at, secret_id",
    )
    .fetch_all(pool)
    .await
    .expect("secret rows")
}

/// Asserts that no row holds `secret` in clear, neither in `secret` nor inside the
/// sealed bytes, and that each is sealed with `key_id`.
async fn assert_sealed_only(pool: &sqlx::PgPool, secret: &str, key_id: &str) {
    let rows = secret_rows(pool).await;
    assert!(!rows.is_empty());
    for (id, _, clear, sealed, sealed_with) in rows {
        assert_eq!(clear, None, "row {id} holds no clear secret");
        let sealed = sealed.expect("sealed");
        assert!(!sealed.windows(secret.len()).any(|w| w == secret.as_bytes()), "row {id} holds the secret's bytes");
        assert_eq!(sealed_with.as_deref(), Some(key_id), "row {id}");
    }
}

/// Delivers one signed body to `source`; its status.
async fn deliver_signed(intake: &Intake, source: &str, secret: &str, event_id: &str) -> u16 {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": event_id}).to_string();
    deliver(intake, source, event_id, now, &sign(secret, now, event_id, &body), &body).await.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sealing_keys_a_new_webhook_secret_is_stored_sealed_only_and_verifies() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let keys = sealing_keys(SEALING_KEY_A);
    let tenant = Tenant::parse("acme").expect("tenant");
    let add = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    let (_, secret) = add.await.expect("secret");
    assert_sealed_only(&intake.pool, &secret, keys.sealing_id()).await;
    assert_eq!(deliver_signed(&intake, "helpdesk", &secret, "evt-1").await, 202);
    assert_eq!(deliver_signed(&intake, "helpdesk", "whsec_guessed", "evt-2").await, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stored_in_clear_are_sealed_at_the_next_start_with_keys_and_still_verify() {
    let clear = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let mut secrets = Vec::new();
    for source in ["helpdesk", "helpdesk", "billing"] {
        let add = fenceline_intake::webhooks::add_secret(&clear.pool, source, &tenant, "ticket.triage", None);
        secrets.push((source, add.await.expect("secret").1));
    }
    assert!(secret_rows(&clear.pool).await.iter().all(|row| row.2.is_some()), "without keys, in clear");

    let sealed = restart_intake(&clear, Some(SEALING_KEY_A)).await.expect("starts with keys");
    drop(clear);
    for (_, secret) in &secrets {
        assert_sealed_only(&sealed.pool, secret, sealing_keys(SEALING_KEY_A).sealing_id()).await;
    }
    for (n, (source, secret)) in secrets.iter().enumerate() {
        assert_eq!(deliver_signed(&sealed, source, secret, &format!("evt-{n}")).await, 202, "{source}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_secret_copied_into_another_row_does_not_open() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let keys = sealing_keys(SEALING_KEY_A);
    let tenant = Tenant::parse("acme").expect("tenant");
    let webhooks = |source: &'static str| {
        fenceline_intake::webhooks::add_secret(&intake.pool, source, &tenant, "ticket.triage", Some(&keys))
    };
    let (helpdesk_id, helpdesk) = webhooks("helpdesk").await.expect("secret");
    let (_, billing) = webhooks("billing").await.expect("secret");
    // Someone with write access to the table puts helpdesk's sealed secret in billing's row.
    let moved = sqlx::query(
        "UPDATE webhook_secrets SET sealed_secret = (SELECT sealed_secret FROM webhook_secrets WHERE secret_id = $1) \
         WHERE source = 'billing'",
    )
    .bind(helpdesk_id)
    .execute(&intake.pool)
    .await
    .expect("moved");
    assert_eq!(moved.rows_affected(), 1);
    assert_eq!(deliver_signed(&intake, "billing", &helpdesk, "evt-1").await, 401, "the moved value does not open");
    assert_eq!(deliver_signed(&intake, "billing", &billing, "evt-2").await, 401, "billing's own secret is gone");
    assert_eq!(deliver_signed(&intake, "helpdesk", &helpdesk, "evt-3").await, 202, "in its own row it opens");
    assert_eq!(task_rows(&intake.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_with_sealed_secrets_and_no_key_or_another_key_is_refused_without_printing_a_key() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let keys = sealing_keys(SEALING_KEY_A);
    let add = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    add.await.expect("secret");

    let refusal = |started: Result<Intake, fenceline_runtime::Error>| match started {
        Ok(_) => panic!("intake started with sealed secrets it cannot open"),
        Err(e) => e.to_string(),
    };
    let without = refusal(restart_intake(&intake, None).await);
    assert!(without.contains("1 sealed webhook secrets but no sealing key is configured"), "{without}");
    let other = refusal(restart_intake(&intake, Some(SEALING_KEY_B)).await);
    assert!(other.contains(&format!("sealed with key ids {} that are not configured", keys.sealing_id())), "{other}");
    let malformed = refusal(restart_intake(&intake, Some(&SEALING_KEY_B[..63])).await);
    assert!(malformed.contains("sealing key 1 is 63 characters long"), "{malformed}");
    for message in [&without, &other, &malformed] {
        for key in [SEALING_KEY_A, SEALING_KEY_B] {
            assert!(!message.to_lowercase().contains(&key[..12]), "{message}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_sealed_with_the_old_key_opens_after_rotation_and_is_sealed_again_with_the_new_one() {
    let old = start_intake_sealing_with(SEALING_KEY_A).await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let keys = sealing_keys(SEALING_KEY_A);
    let add = fenceline_intake::webhooks::add_secret(&old.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    let (_, secret) = add.await.expect("secret");
    let before = secret_rows(&old.pool).await;

    // The new key first, the old one second: the row opens, and the start seals it again.
    let rotated = restart_intake(&old, Some(&format!("{SEALING_KEY_B},{SEALING_KEY_A}"))).await.expect("rotated");
    drop(old);
    let new_id = sealing_keys(SEALING_KEY_B).sealing_id().to_owned();
    assert_sealed_only(&rotated.pool, &secret, &new_id).await;
    assert_ne!(secret_rows(&rotated.pool).await[0].3, before[0].3, "sealed anew");
    assert_eq!(deliver_signed(&rotated, "helpdesk", &secret, "evt-1").await, 202);

    // Every row is sealed with the new key now: the old key may go.
    let only_new = restart_intake(&rotated, Some(SEALING_KEY_B)).await.expect("the old key is no longer needed");
    drop(rotated);
    assert_eq!(deliver_signed(&only_new, "helpdesk", &secret, "evt-2").await, 202);
}

/// One server-sent event a stream carried.
#[derive(Debug)]
struct Sent {
    event: String,
    data: String,
}

/// What an open event stream has carried so far, event by event.
type Stream = tokio::sync::mpsc::UnboundedReceiver<Sent>;

/// Opens `GET /v1/events` as the holder of `token` and passes on each event it
/// carries, until the stream ends or the receiver is dropped.
fn open_stream(intake: &Intake, token: &str) -> Stream {
    use std::io::BufRead;
    let (sent, received) = tokio::sync::mpsc::unbounded_channel();
    let (url, token) = (format!("{}/v1/events", intake.base), token.to_owned());
    std::thread::spawn(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let Ok(response) = agent.get(&url).header("Authorization", format!("Bearer {token}")).call() else { return };
        let (mut event, mut data) = (String::new(), String::new());
        for line in std::io::BufReader::new(response.into_body().into_reader()).lines() {
            let Ok(line) = line else { return };
            if let Some(name) = line.strip_prefix("event: ") {
                event = name.to_owned();
            } else if let Some(text) = line.strip_prefix("data: ") {
                data = text.to_owned();
            } else if line.is_empty() && !event.is_empty() {
                let one = Sent { event: std::mem::take(&mut event), data: std::mem::take(&mut data) };
                if sent.send(one).is_err() {
                    return;
                }
            }
        }
    });
    received
}

/// The task of the stream's next `task` event, if one comes before `until`; the
/// stream must not ask for a reload meanwhile.
async fn next_task(stream: &mut Stream, until: tokio::time::Instant) -> Option<String> {
    while let Ok(Some(sent)) = tokio::time::timeout_at(until, stream.recv()).await {
        assert_ne!(sent.event, "reset", "the stream asked for a reload");
        if sent.event == "task" {
            let view: Value = serde_json::from_str(&sent.data).expect("a task event carries the task");
            return Some(view["task_id"].as_str().expect("task id").to_owned());
        }
    }
    None
}

/// The tasks a stream sent `task` events for within `within`, in order.
async fn heard_within(stream: &mut Stream, within: Duration) -> Vec<String> {
    let until = tokio::time::Instant::now() + within;
    let mut tasks = Vec::new();
    while let Some(task) = next_task(stream, until).await {
        tasks.push(task);
    }
    tasks
}

/// Waits (up to 10 s) for a stream's `task` event about `task_id`.
async fn hears(stream: &mut Stream, task_id: &str) {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match next_task(stream, until).await {
            Some(task) if task == task_id => return,
            Some(_) => {}
            None => panic!("the stream did not hear of {task_id} within 10 s"),
        }
    }
}

/// Waits (up to 10 s) for the stream's first event, which must be `ready`.
async fn ready(stream: &mut Stream) {
    let first = tokio::time::timeout(Duration::from_secs(10), stream.recv()).await.expect("ready in time");
    assert_eq!(first.map(|s| s.event).as_deref(), Some("ready"));
}

/// Submits an image through `intake` as the holder of `token`; the new task's id.
async fn submitted(intake: &Intake, token: &str, key: &str) -> String {
    let answer =
        call("POST", format!("{}/v1/tasks", intake.base), Some(token.to_owned()), Some(key), Some(image(key))).await;
    assert_eq!(answer.status, 202, "{:?}", answer.body);
    answer.body["task_id"].as_str().expect("task id").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_hears_every_change_of_its_tenant_whichever_instance_made_it() {
    let first = start_intake().await;
    let second = restart_intake(&first, None).await.expect("a second intake starts");
    let mut acme = open_stream(&first, &first.acme);
    let mut globex = open_stream(&first, &first.globex);
    ready(&mut acme).await;
    ready(&mut globex).await;

    let task = submitted(&second, &second.acme, "through-the-other-instance").await;
    hears(&mut acme, &task).await;
    let cancel =
        call("POST", format!("{}/v1/tasks/{task}/cancel", second.base), Some(second.acme.clone()), None, None).await;
    assert_eq!(cancel.status, 202);
    hears(&mut acme, &task).await;
    let theirs = submitted(&second, &second.globex, "another-tenant").await;
    hears(&mut globex, &theirs).await;

    let heard_by_globex = heard_within(&mut globex, Duration::from_millis(500)).await;
    let heard_by_acme = heard_within(&mut acme, Duration::from_millis(500)).await;
    assert!(!heard_by_globex.contains(&task), "a stream never carries another tenant's task");
    assert!(!heard_by_acme.contains(&theirs), "a stream never carries another tenant's task");
}

/// A transaction marks its change before others commit theirs and commits after
/// the streams heard of those: a follower that only read forward from the newest
/// change it saw would never hear it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_committed_after_later_ones_were_heard_is_heard_too() {
    let intake = start_intake().await;
    let mut acme = open_stream(&intake, &intake.acme);
    ready(&mut acme).await;
    let early = submitted(&intake, &intake.acme, "marked-early").await;
    hears(&mut acme, &early).await;

    let mut held = intake.pool.begin().await.expect("begin");
    let early_id: fenceline_domain::ids::TaskId = early.parse().expect("task id");
    fenceline_intake::live::changed(&mut held, early_id, Some("acme")).await.expect("marked");
    let later = submitted(&intake, &intake.acme, "committed-first").await;
    hears(&mut acme, &later).await;
    let while_held = heard_within(&mut acme, fenceline_intake::live::POLL_EVERY * 5).await;
    assert!(!while_held.contains(&early), "a change is not heard before it commits");

    held.commit().await.expect("commit");
    hears(&mut acme, &early).await;
}
