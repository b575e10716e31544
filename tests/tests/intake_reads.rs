//! Reading tasks from intake over real HTTP: scoped to the caller's tenant, following
//! the status topic without going backwards, listed with filters and a cursor, with each attempt shown.

use std::time::Duration;

use fenceline_events::topics;
use fenceline_tests::*;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::intake_fixture::*;

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
