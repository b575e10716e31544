//! The phase writer against a schema of its own in the test Postgres: writes handed
//! over while a statement runs are committed together by the next, each fenced by
//! its own token and phase, with only the matching writes' parts and events.

use std::sync::Arc;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::{GrantId, TaskId};
use fenceline_domain::vocabulary::{AttemptOutcome, Phase, ReleaseReason};
use sqlx::PgPool;
use tokio::time::Instant;

use crate::ExecutorSettings;
use crate::lease::{Lease, Stop};
use crate::record::{Checkpoint, Recorder, Transition, released};

const LEASE_MS: u64 = 15_000;

/// How many writes queue behind the held one.
const QUEUED: usize = 18;

async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema("executor", &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

fn recorder(pool: PgPool) -> Recorder {
    let settings =
        ExecutorSettings { workers: 1, lease_ms: LEASE_MS, idle_poll_ms: 250, poll_ms: 250, task_retention_days: 30 };
    Recorder::new(pool, OutboxWriter::new("executor", "test.", 1), Arc::new(settings))
}

/// A running execution of a task of its own at `phase`, fencing token 1; its lease.
async fn running(pool: &PgPool, phase: Phase) -> Lease {
    let (grant_id, task_id) = (GrantId::from_uuid(uuid::Uuid::now_v7()), TaskId::from_uuid(uuid::Uuid::now_v7()));
    sqlx::query(
        "INSERT INTO executions (grant_id, task_id, tenant, attempt, generation, kind, input_json, provider, \
         lease_budget_ms, status, fencing_token, worker, lease_expires_at_us, phase, phase_at_us) \
         VALUES ($1, $2, 'acme', 1, 0, 'image.generate', '{}', 'imagegen', 60000, 'running', 1, 'w', \
         now_us() + 15000000, $3, 0)",
    )
    .bind(grant_id.as_uuid())
    .bind(task_id.as_uuid())
    .bind(phase.as_str())
    .execute(pool)
    .await
    .expect("insert an execution");
    let now = Instant::now();
    Lease::taken(
        grant_id,
        task_id,
        1,
        0,
        1,
        phase,
        now + Duration::from_millis(LEASE_MS),
        now + Duration::from_secs(10),
    )
}

/// The transaction that last wrote the execution of `lease`, and its phase.
async fn written_by(pool: &PgPool, lease: &Lease) -> (String, String) {
    sqlx::query_as("SELECT xmin::text, phase FROM executions WHERE grant_id = $1")
        .bind(lease.grant_id.as_uuid())
        .fetch_one(pool)
        .await
        .expect("read the execution")
}

/// What each queued write does, by its place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queued {
    /// Starts the step `render`, reading its call `seq`.
    Starts,
    /// Records the call intent of `render` under a key, renewing the lease.
    Intends,
    /// Checkpoints `render` and finishes the attempt.
    Finishes,
}

/// The write at place `i`, and whether its fencing token is stale (then nothing
/// of it happens): every shape current and stale.
fn queued(i: usize) -> (Queued, bool) {
    ([Queued::Starts, Queued::Intends, Queued::Finishes][i % 3], i % 6 >= 3)
}

#[tokio::test]
async fn writes_handed_over_while_a_statement_runs_commit_together_each_fenced_by_its_own_token() {
    let pool = fresh_schema().await;
    let recorder = recorder(pool.clone());

    // The first write waits on a row this test holds; the others queue behind it.
    let mut first = running(&pool, Phase::Claimed).await;
    let (holder, holder_pid) = hold(&pool, &first).await;
    let held = {
        let recorder = recorder.clone();
        let event = released(&first, ReleaseReason::Busy);
        tokio::spawn(async move {
            recorder
                .record(&mut first, Transition::to(Phase::StepStarted).step("render"), &[event])
                .await
                .map(|_| first)
        })
    };
    crate::waiting::until(|| crate::waiting::blocked_by(&pool, holder_pid)).await;

    let mut leases = Vec::new();
    for i in 0..QUEUED {
        let phase = match queued(i).0 {
            Queued::Starts => Phase::Claimed,
            Queued::Intends => Phase::StepStarted,
            Queued::Finishes => Phase::ProviderAccepted,
        };
        leases.push(running(&pool, phase).await);
    }
    // The intent's step was started earlier: its call sequence exists.
    for (i, lease) in leases.iter().enumerate() {
        if queued(i).0 == Queued::Intends {
            crate::record::sequence(&mut pool.acquire().await.expect("connect"), lease, "render").await.expect("seq");
        }
    }
    let mut handed = Vec::new();
    for (i, lease) in leases.iter().cloned().enumerate() {
        let recorder = recorder.clone();
        handed.push(tokio::spawn(async move {
            let mut lease = lease;
            if queued(i).1 {
                lease.token = 0;
            }
            let output = serde_json::json!({ "url": format!("s3://images/{i}.png") });
            let event = released(&lease, ReleaseReason::Busy);
            let transition = match queued(i).0 {
                Queued::Starts => Transition::to(Phase::StepStarted).step("render").sequence_of("render"),
                Queued::Intends => Transition::to(Phase::CallIntent).step("render").call("key-1", None).renewing(),
                Queued::Finishes => Transition {
                    checkpoint: Some(Checkpoint { step: "render", output: &output, sha256: "sha" }),
                    ..Transition::to(Phase::Finished).step("render").status(AttemptOutcome::Succeeded)
                },
            };
            recorder.record(&mut lease, transition, &[event]).await
        }));
    }
    crate::waiting::until(|| async { recorder.writers[0].waiting() == QUEUED }).await;
    holder.commit().await.expect("let the first write go");

    let first = held.await.expect("join").expect("the held write commits");
    let mut together = std::collections::BTreeSet::new();
    for (i, (write, lease)) in handed.into_iter().zip(&leases).enumerate() {
        let recorded = write.await.expect("join");
        let (xmin, phase) = written_by(&pool, lease).await;
        let (shape, stale) = queued(i);
        if stale {
            assert!(matches!(recorded, Err(Stop::Fenced)), "a stale token writes nothing: {recorded:?}");
            assert_eq!(phase, lease.phase.as_str());
            let (sequences, sent, checkpoints): (i64, i64, i64) = sqlx::query_as(
                "SELECT count(*), count(sent_key), (SELECT count(*) FROM checkpoints WHERE task_id = $1) \
                 FROM call_sequences WHERE task_id = $1",
            )
            .bind(lease.task_id.as_uuid())
            .fetch_one(&pool)
            .await
            .expect("read its parts");
            let sequence_made_before = i64::from(shape == Queued::Intends);
            assert_eq!((sequences, sent, checkpoints), (sequence_made_before, 0, 0), "{shape:?}: no part of it");
            continue;
        }
        match shape {
            Queued::Starts => {
                assert_eq!(recorded.expect("written").seq, Some(0), "the step's first call seq");
                assert_eq!(phase, "step_started");
            }
            Queued::Intends => {
                assert!(recorded.expect("written").renewed, "the intent renewed the lease");
                assert_eq!(phase, "call_intent");
            }
            Queued::Finishes => {
                recorded.expect("written");
                assert_eq!(phase, "finished");
            }
        }
        together.insert(xmin);
    }
    assert_eq!(together.len(), 1, "the {} writes that matched are one transaction: {together:?}", QUEUED / 2);
    let xmin = together.into_iter().next().expect("one");
    assert_ne!(written_by(&pool, &first).await.0, xmin, "the held write committed on its own");

    let (events, in_the_batch): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE xmin::text = $1) FROM outbox")
            .bind(&xmin)
            .fetch_one(&pool)
            .await
            .expect("count the outbox");
    assert_eq!((events, in_the_batch), (1 + 9, 9), "one event for each write that matched, none for the stale ones");
    let (checkpoints, sent): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM checkpoints WHERE xmin::text = $1), \
         (SELECT count(*) FROM call_sequences WHERE sent_key = 'key-1' AND xmin::text = $1)",
    )
    .bind(&xmin)
    .fetch_one(&pool)
    .await
    .expect("count the parts");
    assert_eq!((checkpoints, sent), (3, 3), "each checkpoint and each intent's key, in the same transaction");
}

#[test]
fn two_writes_of_one_task_are_not_written_together() {
    let (a, b) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    let waiting = [a, b, a, b, uuid::Uuid::nil()]
        .into_iter()
        .map(|task_id| super::Waiting { write: write_of(task_id), answer: tokio::sync::oneshot::channel().0 });
    let (batch, rest) = super::one_per_task(waiting);
    let tasks = |waiting: &[super::Waiting]| waiting.iter().map(|w| w.write.task_id).collect::<Vec<_>>();
    assert_eq!(tasks(&batch), [a, b, uuid::Uuid::nil()], "each task once, in the order handed");
    assert_eq!(tasks(&rest), [a, b], "the second writes wait for the next statement");
}

#[tokio::test]
async fn a_statement_that_fails_is_tried_write_by_write_and_fails_only_its_own() {
    let pool = fresh_schema().await;
    sqlx::query("ALTER TABLE checkpoints ADD CONSTRAINT no_poison CHECK (sha256 <> 'poison')")
        .execute(&pool)
        .await
        .expect("poison one checkpoint");
    let writer = super::PhaseWriter::start(pool.clone());
    let first = running(&pool, Phase::Claimed).await;
    let (holder, holder_pid) = hold(&pool, &first).await;
    let held = tokio::spawn({
        let writer = writer.clone();
        let write = write_to(&first, "step_started", None);
        async move { writer.write(write).await }
    });
    crate::waiting::until(|| crate::waiting::blocked_by(&pool, holder_pid)).await;

    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(running(&pool, Phase::ProviderAccepted).await);
    }
    // The last write's token is stale.
    leases[3].token = 0;
    let handed: Vec<_> = leases
        .iter()
        .enumerate()
        .map(|(i, lease)| {
            let writer = writer.clone();
            let write = write_to(lease, "result_recorded", Some(if i == 1 { "poison" } else { "sha" }));
            tokio::spawn(async move { writer.write(write).await })
        })
        .collect();
    crate::waiting::until(|| async { writer.waiting() == 4 }).await;
    holder.commit().await.expect("let the first write go");

    assert!(matches!(held.await.expect("join"), Ok(Some(_))));
    let mut transactions = std::collections::BTreeSet::new();
    for (i, (write, lease)) in handed.into_iter().zip(&leases).enumerate() {
        let written = write.await.expect("join");
        let (xmin, phase) = written_by(&pool, lease).await;
        if i == 1 {
            assert!(matches!(written, Err(Stop::Bus(_))), "the poisoned write fails: {written:?}");
            assert_eq!(phase, "provider_accepted", "and writes nothing");
        } else if i == 3 {
            // The server refused the statement, so it committed nothing: alone, the
            // stale write matches nothing, and that is "fenced".
            assert!(matches!(written, Ok(None)), "fenced: {written:?}");
            assert_eq!(phase, "provider_accepted");
        } else {
            assert!(matches!(written, Ok(Some(_))), "{written:?}");
            assert_eq!(phase, "result_recorded");
            transactions.insert(xmin);
        }
    }
    assert_eq!(transactions.len(), 2, "the others were written alone");
}

#[tokio::test]
async fn a_write_that_waits_for_a_lock_past_the_timeout_fails_and_lets_the_next_writes_go() {
    let pool = fresh_schema().await;
    let writer = super::PhaseWriter::start(pool.clone());
    let (stuck, free) = (running(&pool, Phase::Claimed).await, running(&pool, Phase::Claimed).await);
    let (holder, _) = hold(&pool, &stuck).await;

    let started = Instant::now();
    let waited = writer.write(write_to(&stuck, "step_started", None)).await;
    assert!(matches!(waited, Err(Stop::Bus(_))), "{waited:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "given up after the lock timeout: {:?}", started.elapsed());
    let next = writer.write(write_to(&free, "step_started", None)).await;
    assert!(matches!(next, Ok(Some(_))), "the writer goes on: {next:?}");
    holder.rollback().await.expect("let it go");
}

/// A write of `lease`'s execution to `phase`, with a checkpoint of `sha256` if given.
fn write_to(lease: &Lease, phase: &'static str, sha256: Option<&str>) -> super::FencedWrite {
    super::FencedWrite {
        grant_id: lease.grant_id.as_uuid(),
        token: lease.token,
        was: lease.phase.as_str(),
        phase,
        checkpoint: sha256.map(|sha| ("render".to_owned(), serde_json::json!({}), sha.to_owned())),
        shape: super::Shape { checkpoint: sha256.is_some(), ..super::Shape::default() },
        ..write_of(lease.task_id.as_uuid())
    }
}

fn write_of(task_id: uuid::Uuid) -> super::FencedWrite {
    super::FencedWrite {
        grant_id: uuid::Uuid::now_v7(),
        token: 1,
        was: "claimed",
        phase: "step_started",
        step: None,
        status: "running",
        key: None,
        request_id: None,
        renew: false,
        lease_us: 1,
        task_id,
        generation: 0,
        sequence_of: None,
        checkpoint: None,
        attempt: 1,
        shape: super::Shape::default(),
        rows: Vec::new(),
    }
}

/// A transaction holding `lease`'s execution row, and its backend's pid.
async fn hold(pool: &PgPool, lease: &Lease) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM executions WHERE grant_id = $1 FOR UPDATE")
        .bind(lease.grant_id.as_uuid())
        .execute(&mut *holder)
        .await
        .expect("hold the execution");
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *holder).await.expect("pid");
    (holder, pid)
}
