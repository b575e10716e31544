//! The reconciler's own loops against a schema of their own: a due case is claimed
//! by one asker at a time and a full provider's cases wait; what the cases learn
//! only moves toward "it happened" (a "never received" after an answer that showed
//! the call received is no answer, never a safe retry); a case is decided once,
//! with its evidence and one decision; and a grant nobody claimed in time is
//! re-issued with its wait doubled, while claimed, ended and not yet due ones are
//! left alone.

use std::io::{Read as _, Write as _};

use fenceline_domain::ids::GrantId;
use fenceline_events::Evidence;

use super::*;

/// A new schema holding the bus tables and the reconciler's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

const CLAIM_TIMEOUT_MS: u64 = 1_000;

fn settings() -> ReconcilerSettings {
    ReconcilerSettings {
        claim_timeout_ms: CLAIM_TIMEOUT_MS,
        ask_for_ms: 600_000,
        ask_base_ms: 1_000,
        ask_cap_ms: 60_000,
        no_progress_ms: 900_000,
        audit_every_ms: 60_000,
        retention_days: 30,
        audit_token: None,
        audit_token_file: None,
    }
}

/// `img` at `base_url`, which can be asked by operation key.
fn catalog(base_url: &str) -> Catalog {
    Catalog::parse(&format!(
        r#"{{
        "providers": {{"img": {{"base_url": "{base_url}", "call_timeout_ms": 2000, "concurrency": 2,
                               "rate_per_second": 5, "burst": 5,
                               "capabilities": {{"idempotency_keys": true, "lookup": true}}}}}},
        "kinds": {{"image.generate": {{"steps": [{{"name": "render", "provider": "img"}}], "attempt_budget_ms": 5000}}}}
    }}"#
    ))
    .expect("a valid catalogue")
}

/// A reconciler whose only provider, `img`, is at `base_url`.
fn reconciler(pool: PgPool, base_url: &str) -> Reconciler {
    let catalog = catalog(base_url);
    let img = HttpProvider::new("img", catalog.provider("img").expect("img")).expect("a provider");
    Reconciler {
        pool,
        outbox: OutboxWriter::new("reconciler", "test.", 1),
        catalog: Arc::new(catalog),
        providers: Arc::new(HashMap::from([("img".to_owned(), img)])),
        settings: Arc::new(settings()),
        wake: Arc::new(Notify::new()),
    }
}

/// A provider that answers every request `404` with its own problem body: it has
/// never received the operation. Serves until the test process ends.
fn provider_that_never_received() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("an address");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buffer[..n]),
                }
            }
            let body = r#"{"title":"no such operation"}"#;
            let _ = write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/problem+json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    format!("http://{address}")
}

/// A case about attempt 1 of a new task, asking `provider` under `operation_key`,
/// next asked `next_ask_in_us` from now and asked until `ask_for_us` from now.
async fn open_case(pool: &PgPool, provider: &str, received: bool, next_ask_in_us: i64, ask_for_us: i64) -> uuid::Uuid {
    let case_id = uuid::Uuid::now_v7();
    let earlier = vec![evidence("executor", "the worker was lost after its intent")];
    sqlx::query(
        "INSERT INTO cases (case_id, task_id, attempt, kind, step, provider, operation_key, last_phase, \
         last_phase_at_us, state, next_ask_at_us, ask_until_us, evidence, received) \
         VALUES ($1, $2, 1, 'image.generate', 'render', $3, 'op-' || $1::text, 'intent_recorded', 0, 'asking', \
         now_us() + $4, now_us() + $5, $6, $7)",
    )
    .bind(case_id)
    .bind(uuid::Uuid::now_v7())
    .bind(provider)
    .bind(next_ask_in_us)
    .bind(ask_for_us)
    .bind(sqlx::types::Json(&earlier))
    .bind(received)
    .execute(pool)
    .await
    .expect("open a case");
    case_id
}

/// (state, decision, asked, received, evidence) of a case.
async fn case(pool: &PgPool, case_id: uuid::Uuid) -> (String, Option<String>, i32, bool, Vec<Evidence>) {
    let (state, decision, asked, received, evidence): (
        String,
        Option<String>,
        i32,
        bool,
        sqlx::types::Json<Vec<Evidence>>,
    ) = sqlx::query_as("SELECT state, decision, asked, received, evidence FROM cases WHERE case_id = $1")
        .bind(case_id)
        .fetch_one(pool)
        .await
        .expect("read the case");
    (state, decision, asked, received, evidence.0)
}

/// The event types in the outbox, in the order written.
async fn outbox_events(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT event_type FROM outbox ORDER BY id").fetch_all(pool).await.expect("read the outbox")
}

fn sources(evidence: &[Evidence]) -> Vec<&str> {
    evidence.iter().map(|e| e.source.as_str()).collect()
}

#[tokio::test]
async fn a_due_case_is_claimed_by_one_asker_and_a_full_providers_case_waits() {
    let pool = fresh_schema().await;
    let r = reconciler(pool.clone(), "http://127.0.0.1:1");
    let at_full = open_case(&pool, "full", false, -5_000_000, 60_000_000).await;
    let due = open_case(&pool, "img", false, -2_000_000, 60_000_000).await;
    let later = open_case(&pool, "img", false, 60_000_000, 120_000_000).await;
    let decided = open_case(&pool, "img", false, -9_000_000, 60_000_000).await;
    sqlx::query("UPDATE cases SET state = 'decided' WHERE case_id = $1")
        .bind(decided)
        .execute(&pool)
        .await
        .expect("decide a case");

    let full = vec!["full".to_owned()];
    let claimed = r.claim_due(&full).await.expect("claim").expect("a due case");
    assert_eq!(claimed.case_id, due);
    assert_eq!((claimed.provider.as_deref(), claimed.received, claimed.asked), (Some("img"), false, 0));
    let next: i64 = sqlx::query_scalar("SELECT next_ask_at_us FROM cases WHERE case_id = $1")
        .bind(due)
        .fetch_one(&pool)
        .await
        .expect("read the next ask");
    assert_eq!(next, claimed.now_us + 30_000_000, "claimed for 30 s by the database's clock");
    assert!(r.claim_due(&full).await.expect("claim").is_none(), "claimed already; the next is not due");

    let freed = r.claim_due(&[]).await.expect("claim").expect("the full provider's case");
    assert_eq!(freed.case_id, at_full);
    assert!(r.claim_due(&[]).await.expect("claim").is_none(), "{later} is not due, {decided} is decided");
}

#[tokio::test]
async fn never_received_is_a_safe_retry_only_for_a_call_no_answer_showed_received() {
    let pool = fresh_schema().await;
    let r = reconciler(pool.clone(), &provider_that_never_received());
    let unreceived = open_case(&pool, "img", false, -2_000_000, 600_000_000).await;
    let received = open_case(&pool, "img", true, -1_000_000, 600_000_000).await;

    let first = r.claim_due(&[]).await.expect("claim").expect("a case");
    assert_eq!(first.case_id, unreceived);
    r.ask(first).await.expect("ask");
    let (state, decision, _, was_received, found) = case(&pool, unreceived).await;
    assert_eq!((state.as_str(), decision.as_deref(), was_received), ("decided", Some("retry_safe"), false));
    assert_eq!(sources(&found), ["executor", "provider img"], "the look-up's answer is added to what was known");
    assert_eq!(outbox_events(&pool).await, ["RecoveryDecided"]);

    let second = r.claim_due(&[]).await.expect("claim").expect("a case");
    assert_eq!(second.case_id, received);
    r.ask(second).await.expect("ask");
    let (state, decision, asked, still_received, found) = case(&pool, received).await;
    assert_eq!((state.as_str(), decision, asked, still_received), ("asking", None, 1, true));
    assert_eq!(sources(&found), ["executor", "provider img", "reconciler"]);
    assert!(found[2].finding.contains("cannot undo"), "{}", found[2].finding);
    assert_eq!(outbox_events(&pool).await, ["RecoveryDecided"], "no second decision");
}

#[tokio::test]
async fn a_case_out_of_time_is_decided_once() {
    let pool = fresh_schema().await;
    // No provider of that name: no look-up, no answer.
    let r = reconciler(pool.clone(), "http://127.0.0.1:1");
    let case_id = open_case(&pool, "gone", true, -1_000_000, -1).await;
    let claimed = r.claim_due(&[]).await.expect("claim").expect("a due case");
    // The same claim, as an asker whose claim lapsed would still hold it.
    let again = AskRow {
        case_id: claimed.case_id,
        task_id: claimed.task_id,
        attempt: claimed.attempt,
        kind: claimed.kind.clone(),
        step: claimed.step.clone(),
        provider: claimed.provider.clone(),
        operation_key: claimed.operation_key.clone(),
        provider_request_id: claimed.provider_request_id.clone(),
        received: claimed.received,
        asked: claimed.asked,
        ask_until_us: claimed.ask_until_us,
        never_received_counts_from_us: claimed.never_received_counts_from_us,
        now_us: claimed.now_us,
        traceparent: claimed.traceparent.clone(),
    };

    r.ask(claimed).await.expect("ask");
    let (state, decision, asked, received, found) = case(&pool, case_id).await;
    assert_eq!((state.as_str(), decision.as_deref(), asked, received), ("decided", Some("outcome_unknown"), 0, true));
    assert_eq!(sources(&found), ["executor", "reconciler", "reconciler"]);
    assert!(
        found[2].finding.contains("no answer from the provider before the task's deadline"),
        "{}",
        found[2].finding
    );
    assert_eq!(outbox_events(&pool).await, ["RecoveryDecided"]);

    // An asker that claimed it before (its claim lapsed) decides nothing more.
    r.ask(again).await.expect("ask again");
    assert_eq!(case(&pool, case_id).await.4.len(), 3, "the decided case keeps its evidence");
    assert_eq!(outbox_events(&pool).await, ["RecoveryDecided"], "one decision");
}

/// A grant of a new task whose claim deadline is `due_in_us` from now (host clock).
async fn grant(pool: &PgPool, claimed: bool, ended: bool, reissues: i32, due_in_us: i64) -> uuid::Uuid {
    let (grant_id, task_id) = (GrantId::from_uuid(uuid::Uuid::now_v7()), TaskId::from_uuid(uuid::Uuid::now_v7()));
    let granted = AttemptGranted {
        grant_id,
        task_id,
        tenant: "acme".into(),
        attempt: 1,
        generation: 0,
        kind: "image.generate".into(),
        input_json: "{}".into(),
        resume_after_step: None,
        provider: "img".into(),
        slot: "img/acme".into(),
        lease_budget_ms: 5_000,
        deadline: None,
        granted_at: Timestamp::now(),
    };
    sqlx::query(
        "INSERT INTO grants (grant_id, task_id, attempt, kind, provider, granted, claimed, ended, claim_deadline_us, \
         reissues) VALUES ($1, $2, 1, 'image.generate', 'img', $3, $4, $5, $6, $7)",
    )
    .bind(grant_id.as_uuid())
    .bind(task_id.as_uuid())
    .bind(sqlx::types::Json(&granted))
    .bind(claimed)
    .bind(ended)
    .bind(Timestamp::now().0 + due_in_us)
    .bind(reissues)
    .execute(pool)
    .await
    .expect("insert a grant");
    grant_id.as_uuid()
}

async fn grant_row(pool: &PgPool, grant_id: uuid::Uuid) -> (i32, i64) {
    sqlx::query_as("SELECT reissues, claim_deadline_us FROM grants WHERE grant_id = $1")
        .bind(grant_id)
        .fetch_one(pool)
        .await
        .expect("read the grant")
}

#[tokio::test]
async fn a_grant_nobody_claimed_in_time_is_reissued_with_its_wait_doubled() {
    let pool = fresh_schema().await;
    let r = reconciler(pool.clone(), "http://127.0.0.1:1");
    let first = grant(&pool, false, false, 0, -1_000_000).await;
    let third = grant(&pool, false, false, 2, -1_000_000).await;
    let mut untouched = Vec::new();
    for (claimed, ended, due_in_us) in
        [(true, false, -1_000_000), (false, true, -1_000_000), (false, false, 60_000_000)]
    {
        let grant_id = grant(&pool, claimed, ended, 0, due_in_us).await;
        untouched.push((grant_id, grant_row(&pool, grant_id).await));
    }

    let before = Timestamp::now().0;
    r.reissue_unclaimed().await.expect("re-issue");
    let after = Timestamp::now().0;
    let wait_us = i64::try_from(CLAIM_TIMEOUT_MS).expect("small") * 1_000;
    for (grant_id, reissues, wait) in [(first, 1, wait_us), (third, 3, 4 * wait_us)] {
        let (now_reissued, deadline) = grant_row(&pool, grant_id).await;
        assert_eq!(now_reissued, reissues);
        assert!((before + wait..=after + wait).contains(&deadline), "{deadline} is now + {wait} us");
    }
    for (grant_id, row) in untouched {
        assert_eq!(grant_row(&pool, grant_id).await, row, "claimed, ended or not yet due: left alone");
    }
    let mut events = outbox_events(&pool).await;
    events.sort();
    assert_eq!(events, ["AttemptGranted", "AttemptGranted", "RecoveryDecided", "RecoveryDecided"]);
}
