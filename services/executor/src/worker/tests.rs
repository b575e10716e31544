//! The claim against a schema of its own in the test Postgres: a handed grant is
//! claimed by its id only while it is ready (its event carried by the first fenced
//! write), the idle walk takes the oldest ready
//! execution or an expired lease and never a live one, and a takeover after the
//! call intent claims nothing and reports the attempt lost.

use crate::record::Recorder;

use super::*;

/// A lease of 15 s.
const LEASE_MS: u64 = 15_000;

async fn workers() -> Workers {
    let pool = fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool;
    let settings = Arc::new(ExecutorSettings {
        workers: 1,
        lease_ms: LEASE_MS,
        idle_poll_ms: 250,
        poll_ms: 250,
        task_retention_days: 30,
    });
    let outbox = OutboxWriter::new("executor", "test.", 1);
    let catalog = Arc::new(catalog());
    let recorder = Recorder::new(pool.clone(), outbox.clone(), settings.clone());
    Workers {
        pool: pool.clone(),
        outbox,
        catalog: catalog.clone(),
        settings: settings.clone(),
        wake: Arc::default(),
        handed: Arc::default(),
        idle_looker: Arc::default(),
        name: "test".into(),
        claims: crate::claims::ClaimWriter::start(pool.clone(), settings.lease_us(), 1),
        calls: Calls { pool, catalog, providers: Arc::default(), settings, recorder },
    }
}

/// `image.generate`, one paid step; `image.approved`, an approval before its paid step.
fn catalog() -> Catalog {
    Catalog::parse(
        r#"{
        "providers": {"imagegen": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 2,
                                   "rate_per_second": 5, "burst": 5}},
        "kinds": {"image.generate": {"steps": [{"name": "draw", "provider": "imagegen"}],
                                     "attempt_budget_ms": 5000},
                  "image.approved": {"steps": [{"name": "ok", "approval_signal": "approve"},
                                               {"name": "draw", "provider": "imagegen"}],
                                     "attempt_budget_ms": 5000}}
    }"#,
    )
    .expect("a valid catalogue")
}

/// A grant handed for the `image.generate` execution `grant_id`, as its first attempt.
fn handed(grant_id: uuid::Uuid) -> HandedGrant {
    HandedGrant { grant_id, kind: "image.generate".into(), from_the_first_step: true }
}

/// How an execution stands when a test begins.
enum Standing {
    Ready,
    /// Running in `phase`, its lease ending `lease_from_now_s` from the database's now.
    Running {
        phase: &'static str,
        lease_from_now_s: i64,
    },
}

/// Inserts an execution created `age_s` seconds ago, fencing token 1 if running.
async fn execution(pool: &PgPool, age_s: i64, standing: Standing) -> uuid::Uuid {
    let grant_id = uuid::Uuid::now_v7();
    let (status, phase, lease_s, token) = match standing {
        Standing::Ready => ("ready", None, None, 0_i64),
        Standing::Running { phase, lease_from_now_s } => ("running", Some(phase), Some(lease_from_now_s), 1),
    };
    sqlx::query(
        "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, provider, \
         lease_budget_ms, status, fencing_token, lease_expires_at_us, phase, phase_at_us, created_at) \
         VALUES ($1, $2, 'acme', 1, 0, 'image.generate', '{}', 'imagegen', 60000, $3, $4, \
         now_us() + $5 * 1000000, $6, CASE WHEN $6 IS NULL THEN NULL ELSE 0 END, now() - $7 * interval '1 second')",
    )
    .bind(grant_id)
    .bind(uuid::Uuid::now_v7())
    .bind(status)
    .bind(token)
    .bind(lease_s)
    .bind(phase)
    .bind(age_s)
    .execute(pool)
    .await
    .expect("insert an execution");
    grant_id
}

/// (status, fencing token, phase, takeover) of the execution.
async fn standing(pool: &PgPool, grant_id: uuid::Uuid) -> (String, i64, Option<String>, bool) {
    sqlx::query_as("SELECT status, fencing_token, phase, takeover FROM executions WHERE grant_id = $1")
        .bind(grant_id)
        .fetch_one(pool)
        .await
        .expect("read the execution")
}

/// The event types in the outbox, in the order written.
async fn events(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT event_type FROM outbox ORDER BY id").fetch_all(pool).await.expect("read the outbox")
}

async fn claim(workers: &Workers, handed: Option<HandedGrant>) -> Option<uuid::Uuid> {
    workers.claim_next("w#0", handed).await.expect("claim").map(|claimed| claimed.claim.grant_id)
}

/// The call `seq` rows of the task of `grant_id`: (generation, step, seq).
async fn sequences(pool: &PgPool, grant_id: uuid::Uuid) -> Vec<(i32, String, i32)> {
    sqlx::query_as(
        "SELECT s.generation, s.step, s.seq FROM call_sequences s JOIN executions e USING (task_id) \
         WHERE e.grant_id = $1 ORDER BY 1, 2",
    )
    .bind(grant_id)
    .fetch_all(pool)
    .await
    .expect("read the call sequences")
}

#[tokio::test]
async fn a_handed_grant_is_claimed_by_its_id_and_only_while_it_is_ready() {
    let workers = workers().await;
    let pool = &workers.pool;
    let older = execution(pool, 60, Standing::Ready).await;
    let handed_id = execution(pool, 0, Standing::Ready).await;
    // Handed as a later attempt: its claim starts no step.
    let later = HandedGrant { from_the_first_step: false, ..handed(handed_id) };
    let handed = handed_id;

    let claimed = workers.claim_next("w#0", Some(later.clone())).await.expect("claim").expect("the handed grant");
    assert_eq!(claimed.claim.grant_id, handed, "the handed grant, not the oldest one");
    assert_eq!(claimed.claim.started_seq, None);
    assert_eq!(standing(pool, handed).await, ("running".into(), 1, Some("claimed".into()), false));
    // The claim committed on its own; its event waits for the first fenced write.
    assert!(events(pool).await.is_empty());
    assert!(matches!(&claimed.announce, Some(Event::AttemptClaimed(e)) if e.fencing_token == 1));

    assert_eq!(claim(&workers, Some(later)).await, None, "a handed grant already claimed is not claimed again");
    assert_eq!(standing(pool, handed).await.1, 1, "and its fencing token stays");
    assert_eq!(standing(pool, older).await, ("ready".into(), 0, None, false), "the other waits for its own claim");

    let now = Instant::now();
    let (grant_id, task_id) = (GrantId::from_uuid(handed), TaskId::from_uuid(claimed.claim.task_id));
    let until = now + Duration::from_secs(10);
    let mut lease = Lease::taken(grant_id, task_id, 1, 0, 1, Phase::Claimed, until, until);
    lease.unannounced.extend(claimed.announce);
    let released = released(&lease, ReleaseReason::Cancelled);
    let end = Transition::end(&lease, AttemptOutcome::Released);
    workers.calls.recorder.record(&mut lease, end, &[released]).await.expect("the first fenced write");
    assert_eq!(events(pool).await, ["AttemptClaimed", "AttemptReleased"], "the claim's event first, in the same write");
    assert!(lease.unannounced.is_empty());
}

#[tokio::test]
async fn a_first_attempt_is_claimed_with_its_first_paid_step_started_in_the_same_statement() {
    let workers = workers().await;
    let pool = &workers.pool;
    let first = execution(pool, 0, Standing::Ready).await;

    let claimed = workers.claim_next("w#0", Some(handed(first))).await.expect("claim").expect("the handed grant");
    assert_eq!(claimed.claim.started_seq, Some(0), "the step's first call `seq`, made by the claim");
    assert_eq!(claimed.claim.step.as_deref(), Some("draw"));
    assert_eq!(standing(pool, first).await, ("running".into(), 1, Some("step_started".into()), false));
    assert_eq!(sequences(pool, first).await, [(0, "draw".to_owned(), 0)]);
    assert!(events(pool).await.is_empty(), "no event yet: the claim rides on the call intent's write");

    // The next fenced write expects `step_started` under the claim's token.
    let now = Instant::now();
    let (grant_id, task_id) = (GrantId::from_uuid(first), TaskId::from_uuid(claimed.claim.task_id));
    let until = now + Duration::from_secs(10);
    let mut lease = Lease::taken(grant_id, task_id, 1, 0, 1, Phase::StepStarted, until, until);
    lease.unannounced.extend(claimed.announce);
    let released = released(&lease, ReleaseReason::Cancelled);
    let end = Transition::end(&lease, AttemptOutcome::Released);
    workers.calls.recorder.record(&mut lease, end, &[released]).await.expect("the first fenced write");
    assert_eq!(events(pool).await, ["AttemptClaimed", "AttemptReleased"]);

    // A kind that begins with an approval, or one this catalogue does not know,
    // is claimed at `claimed`; so is an execution that is no first attempt,
    // whatever its grant said.
    for (kind, attempt) in [("image.approved", 1), ("no.such.kind", 1), ("image.generate", 2)] {
        let grant_id = execution(pool, 0, Standing::Ready).await;
        sqlx::query("UPDATE executions SET kind = $2, attempt = $3 WHERE grant_id = $1")
            .bind(grant_id)
            .bind(kind)
            .bind(attempt)
            .execute(pool)
            .await
            .expect("set the kind");
        let grant = HandedGrant { kind: kind.into(), ..handed(grant_id) };
        let claimed = workers.claim_next("w#0", Some(grant)).await.expect("claim").expect("the handed grant");
        assert_eq!(claimed.claim.started_seq, None, "{kind}, attempt {attempt}");
        assert_eq!(standing(pool, grant_id).await.2.as_deref(), Some("claimed"), "{kind}, attempt {attempt}");
        assert!(sequences(pool, grant_id).await.is_empty(), "{kind}, attempt {attempt}");
    }
}

#[tokio::test]
async fn the_idle_walk_takes_the_oldest_ready_then_an_expired_lease_and_never_a_live_one() {
    let workers = workers().await;
    let pool = &workers.pool;
    // Inserted newest first, so that the table's own order is not the claim's.
    let live = execution(pool, 10, Standing::Running { phase: "step_started", lease_from_now_s: 15 }).await;
    let expired = execution(pool, 20, Standing::Running { phase: "step_started", lease_from_now_s: -1 }).await;
    let newer_ready = execution(pool, 30, Standing::Ready).await;
    let oldest_ready = execution(pool, 40, Standing::Ready).await;

    let order = [claim(&workers, None).await, claim(&workers, None).await, claim(&workers, None).await];
    assert_eq!(order, [Some(oldest_ready), Some(newer_ready), Some(expired)], "oldest first");
    assert_eq!(claim(&workers, None).await, None, "a live lease is never taken");

    assert_eq!(
        standing(pool, expired).await,
        ("running".into(), 2, Some("step_started".into()), true),
        "a takeover before the call intent claims with a larger token and keeps the phase"
    );
    assert_eq!(standing(pool, live).await, ("running".into(), 1, Some("step_started".into()), false));
}

#[tokio::test]
async fn a_takeover_after_the_call_intent_claims_nothing_and_reports_the_attempt_lost() {
    let workers = workers().await;
    let pool = &workers.pool;
    let in_doubt = execution(pool, 0, Standing::Running { phase: "call_intent", lease_from_now_s: -1 }).await;

    assert_eq!(claim(&workers, None).await, None, "nothing to run: whether the call left is for the reconciler");
    assert_eq!(standing(pool, in_doubt).await, ("lost".into(), 2, Some("call_intent".into()), true));
    assert_eq!(events(pool).await, ["AttemptLost"]);
    assert_eq!(claim(&workers, None).await, None, "a lost attempt is not claimed again");
}
