//! Task requests on the upstream topic: each becomes a task once, and a bad one is
//! answered on the rejected topic with its bytes.

use std::time::Duration;

use fenceline_events::topics;
use fenceline_intake::auth::Tenant;
use fenceline_tests::*;

use crate::intake_fixture::*;

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
