//! Every relay sending everything again, against the whole system: a relay that
//! dies between the broker's acknowledgement and marking its rows sends them again,
//! with the same event ids, at later offsets. Whatever a consumer applies a second
//! time on purpose (docs/bus.md, "Events applied twice on purpose") must leave its
//! tables as they were, and what it remembers must still be skipped: no projection
//! moves, no event is published anew, nothing is charged again.

use std::time::Duration;

use fenceline_events::{Event, SignalReceived, Timestamp, topics};
use fenceline_tests::system::{Caps, System};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);

/// The tables a re-sent event could change, each as its sorted rows in text.
/// `task_changes` is left out: a re-sent status marks its task again, which only
/// wakes the task's pages.
const PROJECTIONS: [&str; 14] = [
    "intake.task_view",
    "intake.task_timeline",
    "intake.task_attempts",
    "scheduler.tasks",
    "scheduler.slots",
    "executor.executions",
    "executor.task_states",
    "executor.checkpoints",
    "executor.call_sequences",
    "reconciler.task_states",
    "reconciler.grants",
    "reconciler.early_grant_facts",
    "reconciler.calls",
    "reconciler.cases",
];

const SERVICES: [&str; 4] = ["intake", "scheduler", "executor", "reconciler"];

async fn rows_of(system: &System, table: &str) -> String {
    sqlx::query_scalar(&format!("SELECT coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '') FROM {table} t"))
        .fetch_one(&system.pool)
        .await
        .unwrap_or_else(|e| panic!("{table}: {e}"))
}

/// Every projection, and how many events each service has published.
async fn everything(system: &System) -> Vec<(String, String)> {
    let mut seen = Vec::new();
    for table in PROJECTIONS {
        seen.push((table.to_owned(), rows_of(system, table).await));
    }
    for service in SERVICES {
        seen.push((format!("{service}.outbox rows"), published(system, service, &[]).await.to_string()));
    }
    seen
}

/// How many event ids the consumer group `<prefix><group>` remembers.
async fn remembered(system: &System, service: &str, group: &str) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {service}.processed_events WHERE consumer_group = $1"))
        .bind(format!("{}{group}", system.prefix))
        .fetch_one(&system.pool)
        .await
        .expect("processed_events")
}

/// How many events `service` published of the given types (of any type: `&[]`).
async fn published(system: &System, service: &str, types: &[&str]) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {service}.outbox WHERE cardinality($1::text[]) = 0 OR event_type = ANY($1)"
    ))
    .bind(types)
    .fetch_one(&system.pool)
    .await
    .expect("outbox")
}

/// Waits until every outbox row is marked published and every consumer group of
/// every service has applied its partitions up to the broker's end.
async fn wait_quiet(system: &System) {
    let reader: std::sync::Arc<BaseConsumer> = std::sync::Arc::new(
        ClientConfig::new().set("bootstrap.servers", &system.brokers).create().expect("a reader of log ends"),
    );
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        let mut behind = Vec::new();
        let mut progress: Vec<(String, String, i32, Option<i64>)> = Vec::new();
        for service in SERVICES {
            let unpublished: i64 =
                sqlx::query_scalar(&format!("SELECT count(*) FROM {service}.outbox WHERE published_at IS NULL"))
                    .fetch_one(&system.pool)
                    .await
                    .expect("outbox");
            if unpublished > 0 {
                behind.push(format!("{service}: {unpublished} rows unpublished"));
            }
            progress.extend(
                sqlx::query_as::<_, (String, String, i32, Option<i64>)>(&format!(
                    "SELECT consumer_group, topic, partition, next_offset FROM {service}.consumer_partitions"
                ))
                .fetch_all(&system.pool)
                .await
                .expect("progress"),
            );
        }
        let reader = reader.clone();
        let lagging = tokio::task::spawn_blocking(move || {
            progress
                .into_iter()
                .filter_map(|(group, topic, partition, next)| {
                    let (_, end) =
                        reader.fetch_watermarks(&topic, partition, Duration::from_secs(10)).expect("watermarks");
                    let next = next.unwrap_or(0);
                    (next < end).then(|| format!("{group} at {next} of {end} on {topic}[{partition}]"))
                })
                .collect::<Vec<_>>()
        })
        .await
        .expect("reader");
        behind.extend(lagging);
        if behind.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never caught up: {behind:?}\n{}", system.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Has every relay send again the rows of its outbox that match `condition` (in
/// which `OUTBOX` names that outbox), and waits until they are consumed; returns
/// how many.
async fn resend(system: &System, condition: &str) -> u64 {
    let mut total = 0;
    for service in SERVICES {
        let outbox = format!("{service}.outbox");
        let condition = condition.replace("OUTBOX", &outbox);
        total += sqlx::query(&format!("UPDATE {outbox} SET published_at = NULL WHERE {condition}"))
            .execute(&system.pool)
            .await
            .expect("unmark")
            .rows_affected();
    }
    wait_quiet(system).await;
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_sent_again_moves_no_projection_publishes_nothing_and_charges_nothing() {
    let dedupe = Caps { idempotency_keys: true, ..Caps::default() };
    let mut system = System::new(&[("gen", dedupe)]).await;
    system.spawn("intake", "intake", &[]).await;
    system.spawn_all(None).await;
    let images = system.submit_many("acme", "image.generate", 4).await;
    let ticket = system.submit("acme", "ticket.triage", json!({"ticket": "refund please"})).await;
    system.wait_state(ticket, &["awaiting_approval"], LONG).await;
    let approval = Event::SignalReceived(SignalReceived {
        task_id: ticket,
        tenant: "acme".into(),
        signal_name: "refund_approved".into(),
        signal_id: "approval-1".into(),
        payload_json: "{}".into(),
        received_at: Timestamp::now(),
        step: None,
        generation: None,
        decision: None,
    });
    system.publish(topics::TASKS, &approval).await;
    for task in images.iter().chain([&ticket]) {
        system.wait_state(*task, &["succeeded"], LONG).await;
    }
    wait_quiet(&system).await;
    let before = everything(&system).await;
    let charges = system.provider("gen").charges().await;
    assert_eq!(charges, 4 + 3, "each image once, and the ticket's three calls once each");
    assert!(before.iter().any(|(t, rows)| t == "intake.task_timeline" && rows.lines().count() > 30), "{before:?}");

    // What is remembered by its id: only what could do harm applied twice.
    let executor_partitions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM executor.consumer_partitions WHERE consumer_group = $1")
            .bind(format!("{}executor.from_scheduler", system.prefix))
            .fetch_one(&system.pool)
            .await
            .expect("consumer_partitions");
    assert!(executor_partitions > 0, "the executor's one group holds the dispatch and status partitions");
    assert_eq!(
        remembered(&system, "executor", "executor.from_scheduler").await,
        published(&system, "scheduler", &["CancelAttempt"]).await,
        "the executor remembers only cancellations: a grant is kept by its id in the execution it makes, which \
         outlives the dedupe window, and a final state writes only when newer"
    );
    assert!(published(&system, "scheduler", &["AttemptGranted"]).await >= 5, "every task was granted");
    let ends = ["AttemptSucceeded", "AttemptFailed", "AttemptReleased", "AttemptLost"];
    assert_eq!(
        remembered(&system, "intake", "intake.projections").await,
        published(&system, "executor", &ends).await + published(&system, "reconciler", &["RecoveryDecided"]).await,
        "intake remembers the attempts' ends and the recovery decisions, and no status snapshot or other report"
    );
    let calls = ["CallIntentRecorded", "ProviderAccepted"];
    assert_eq!(
        remembered(&system, "reconciler", "reconciler.watches").await,
        published(&system, "executor", &calls).await,
        "the reconciler remembers the calls' intents and acceptances and no fact"
    );
    // The scheduler hears the five tasks and the approval from the test, every
    // report of the executor and every decision of the reconciler, and remembers
    // all of them but the tasks' acceptances, the attempts' claims and ends, and
    // the calls' intents and acceptances.
    let heard = 6 + published(&system, "executor", &[]).await + published(&system, "reconciler", &[]).await;
    let attempts_ended = published(&system, "executor", &ends).await;
    assert!(attempts_ended >= 5, "every task's attempt ended ({attempts_ended})");
    let harmless = published(&system, "executor", &["AttemptClaimed", "CallIntentRecorded", "ProviderAccepted"]).await;
    assert!(harmless >= 5 + 5, "every attempt was claimed and called ({harmless})");
    assert_eq!(
        remembered(&system, "scheduler", "scheduler.lifecycle").await,
        heard - 5 - attempts_ended - harmless,
        "the lifecycle remembers every event but the acceptances, the claims, the calls and the attempts' ends"
    );

    // Every relay sends everything again, as after a crash before marking; then,
    // later than anything a relay would, the first event of each type of each task
    // alone, after every newer one was applied.
    let everything_again = resend(&system, "true").await;
    assert!(everything_again > 40, "the whole history is sent again ({everything_again} events)");
    let firsts = resend(&system, "id IN (SELECT min(id) FROM OUTBOX GROUP BY record_key, event_type)").await;
    assert!(firsts > 20, "the first of each type and task is sent again ({firsts} events)");

    let after = everything(&system).await;
    for ((table, was), (_, is)) in before.iter().zip(&after) {
        assert_eq!(was, is, "{table} changed when every event was sent again");
    }
    assert_eq!(system.provider("gen").charges().await, charges, "nothing was charged again");
    assert!(system.count_lines("duplicate event skipped") > 0, "the remembered events were skipped");
    // Grants are not remembered: each copy reached the executor and inserted nothing.
    let granted = published(&system, "scheduler", &["AttemptGranted"]).await;
    let copies = system.count_lines("grant already recorded; a re-issue runs nothing twice");
    assert!(copies as i64 >= granted, "every grant sent again found its execution ({copies} of {granted} grants)");
}
