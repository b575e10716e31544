//! The fenced consumer and the outbox relay against the real broker and Postgres.
//! Each test has its own database and topics.

use std::collections::HashSet;
use std::time::Duration;

use fenceline_bus::OutboxWriter;
use fenceline_domain::ids::TaskId;
use fenceline_events::{Event, topics};
use fenceline_store::Database;
use fenceline_tests::process::Proc;
use fenceline_tests::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

const PROBE: &str = env!("CARGO_BIN_EXE_bus-probe");

async fn schema(url: &str, name: &str) -> Database {
    fenceline_store::connect(&postgres(url, name), name, &[&fenceline_bus::MIGRATOR, &PROBE_MIGRATOR])
        .await
        .expect("schema")
}

/// A service-like publisher in its own schema: writer plus a running relay.
struct Upstream {
    db: Database,
    writer: OutboxWriter,
    shutdown: CancellationToken,
}

impl Upstream {
    async fn start(url: &str, prefix: &str) -> Self {
        let db = schema(url, "upstream").await;
        let writer = OutboxWriter::new("upstream", prefix, outbox_config().shards);
        let shutdown = CancellationToken::new();
        start_relay("upstream-relay", &db, &kafka(prefix), &writer, &shutdown);
        Self { db, writer, shutdown }
    }

    async fn publish(&self, events: &[Event]) {
        write_outbox(&self.db.pool, &self.writer, topics::STATUS, events, 500).await;
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn events(tasks: usize, per_task: i64) -> Vec<Event> {
    let ids: Vec<TaskId> = (0..tasks).map(|_| TaskId::new_v7()).collect();
    (1..=per_task).flat_map(|v| ids.iter().map(move |t| status_event(*t, v))).collect()
}

/// A consumer over the status topic into the probe projection, with the relay of
/// its schema's outbox (where dead letters go), as a service runs them.
fn spawn_consumer(
    db: &Database,
    prefix: &str,
    group: &str,
    instance: &str,
    shutdown: &CancellationToken,
) -> fenceline_bus::ConsumerHandle {
    let writer = OutboxWriter::new("consumer", prefix, outbox_config().shards);
    start_relay(&format!("{instance}-relay"), db, &kafka(prefix), &writer, shutdown);
    spawn_probe_consumer(db, prefix, group, instance, writer, shutdown).expect("consumer")
}

fn probe_env(url: &str, prefix: &str, group: &str, instance: &str) -> Vec<(&'static str, String)> {
    vec![
        ("PROBE_DATABASE_URL", url.to_owned()),
        ("PROBE_TOPIC_PREFIX", prefix.to_owned()),
        ("PROBE_GROUP", group.to_owned()),
        ("PROBE_INSTANCE", instance.to_owned()),
        ("FENCELINE_TEST_KAFKA_BROKERS", brokers()),
        ("RUST_LOG", "info".to_owned()),
    ]
}

/// Offsets the broker holds for `group` on the status topic, summed.
fn broker_committed(prefix: &str, group: &str) -> i64 {
    let consumer: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", brokers()).set("group.id", group).create().expect("reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(&topics::named(prefix, topics::STATUS), p);
    }
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(10)).expect("committed offsets");
    committed
        .elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => o,
            _ => 0,
        })
        .sum()
}

async fn database_progress(pool: &sqlx::PgPool, group: &str) -> (i64, i64) {
    sqlx::query_as("SELECT coalesce(sum(next_offset), 0)::bigint, coalesce(max(epoch), 0) FROM consumer_partitions WHERE consumer_group = $1")
        .bind(group)
        .fetch_one(pool)
        .await
        .expect("progress")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_database_commit_redelivers_and_the_projection_changes_once() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    upstream.publish(&events(10, 3)).await;
    let probe_db = schema(&url, "probe").await;

    let mut crashing = Proc::spawn(
        PROBE,
        &["consume"],
        &[
            probe_env(&url, &prefix, &group, "probe-a"),
            vec![("FAILPOINTS", "consumer.after_db_commit=return(crash)".to_owned())],
        ]
        .concat(),
    );
    let status = crashing.wait_exit(Duration::from_secs(60)).await.expect("the probe crashes at the fault point");
    assert!(!status.success(), "aborted, not a clean exit");
    assert_eq!(crashing.lines_with("consumer.after_db_commit").len(), 1, "{}", crashing.all_lines());

    // The batch is in the database, but the broker was never told: it would hand
    // those records out again.
    let (applied_before, _) = probe_counts(&probe_db.pool).await;
    let (db_offsets, _) = database_progress(&probe_db.pool, &group).await;
    assert!(applied_before > 0, "the crash came after a commit");
    assert!(broker_committed(&prefix, &group) < db_offsets, "the broker's offset lags the database's");

    let restarted = Proc::spawn(PROBE, &["consume"], &probe_env(&url, &prefix, &group, "probe-b"));
    // The restart takes every partition over with a new epoch and starts from the
    // database's offsets, whatever the broker holds.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (partitions, min_epoch): (i64, Option<i64>) =
            sqlx::query_as("SELECT count(*), min(epoch) FROM consumer_partitions WHERE consumer_group = $1")
                .bind(&group)
                .fetch_one(&probe_db.pool)
                .await
                .expect("epochs");
        if partitions == i64::from(PARTITIONS) && min_epoch.unwrap_or(0) >= 2 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the restart never took over: {}", restarted.all_lines());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (applied, _) = wait_applied(&probe_db.pool, 30, Duration::from_secs(60)).await;
    assert_eq!(applied, 30, "every event applied: {}", restarted.all_lines());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(probe_counts(&probe_db.pool).await, (30, 0), "and none of them twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_in_the_middle_of_10000_events_applies_each_exactly_once() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let consumer_db = schema(&url, "probe").await;
    let shutdown_a = CancellationToken::new();
    let shutdown_b = CancellationToken::new();
    let a = spawn_consumer(&consumer_db, &prefix, &group, "instance-a", &shutdown_a);

    let all = events(100, 100);
    upstream.publish(&all[..5_000]).await;
    wait_applied(&consumer_db.pool, 1_000, Duration::from_secs(60)).await;
    // A second instance joins: the group rebalances while the first half is still
    // being applied. The second half is published once the new instance holds
    // partitions, so that it takes part however fast the first one is.
    let b = spawn_consumer(&consumer_db, &prefix, &group, "instance-b", &shutdown_b);
    let (stats_a, stats_b) = (a.stats(), b.stats());
    let joined_by = tokio::time::Instant::now() + Duration::from_secs(60);
    while stats_b.assigned_partitions.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < joined_by, "the second instance got no partition within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    upstream.publish(&all[5_000..]).await;
    let (applied, duplicated) = wait_applied(&consumer_db.pool, 10_000, Duration::from_secs(120)).await;
    assert_eq!(applied, 10_000, "no event skipped");
    assert_eq!(duplicated, 0, "no event applied twice");
    // An instance counts a batch once its commit has returned, so the last batch's
    // rows can be visible before its count is: wait for the counts to catch up.
    let counted = || {
        let by_a = stats_a.applied.load(std::sync::atomic::Ordering::Relaxed);
        (by_a, stats_b.applied.load(std::sync::atomic::Ordering::Relaxed))
    };
    let settled_by = tokio::time::Instant::now() + Duration::from_secs(10);
    let (mut by_a, mut by_b) = counted();
    while by_a + by_b < 10_000 && tokio::time::Instant::now() < settled_by {
        tokio::time::sleep(Duration::from_millis(50)).await;
        (by_a, by_b) = counted();
    }
    eprintln!("applied by instance a: {by_a}, by instance b: {by_b}");
    assert!(by_b > 0, "the second instance took part");
    assert_eq!(by_a + by_b, 10_000, "the instances' counts add up: nothing applied twice in between");
    let (_, epoch) = database_progress(&consumer_db.pool, &group).await;
    assert!(epoch >= 2, "partitions changed hands");
    shutdown_a.cancel();
    shutdown_b.cancel();
    a.join().await;
    b.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_whose_epoch_was_bumped_has_its_write_rejected_and_says_so() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let probe_db = schema(&url, "probe").await;
    let zombie = Proc::spawn(PROBE, &["consume"], &probe_env(&url, &prefix, &group, "zombie"));
    upstream.publish(&events(9, 1)).await;
    assert_eq!(wait_applied(&probe_db.pool, 9, Duration::from_secs(60)).await, (9, 0));

    // Another instance takes every partition over, as after a rebalance the zombie
    // did not notice.
    sqlx::query("UPDATE consumer_partitions SET epoch = epoch + 1, owner = 'usurper' WHERE consumer_group = $1")
        .bind(&group)
        .execute(&probe_db.pool)
        .await
        .expect("bump epochs");
    upstream.publish(&events(9, 1)).await;

    assert!(
        zombie.wait_for_line("write rejected: partition fenced", Duration::from_secs(30)).await,
        "the zombie logs the rejection: {}",
        zombie.all_lines()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(probe_counts(&probe_db.pool).await, (9, 0), "nothing the zombie handled after the bump landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_record_is_dead_lettered_and_the_partition_moves_on() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let consumer_db = schema(&url, "probe").await;
    let shutdown = CancellationToken::new();
    let consumer = spawn_consumer(&consumer_db, &prefix, &group, "instance", &shutdown);

    // Garbage first, then valid events of the same key (so the same partition).
    let task = TaskId::new_v7();
    let status_topic = topics::named(&prefix, topics::STATUS);
    produce_raw(&brokers(), &status_topic, task.to_string().as_bytes(), b"not avro at all", &[("event_id", "x")]).await;
    upstream.publish(&(1..=5).map(|v| status_event(task, v)).collect::<Vec<_>>()).await;

    assert_eq!(wait_applied(&consumer_db.pool, 5, Duration::from_secs(60)).await, (5, 0), "the partition moved on");
    let letters = read_topic(&brokers(), &topics::named(&prefix, topics::DEADLETTER), 1, Duration::from_secs(30));
    assert_eq!(letters.len(), 1);
    let Event::DeadLetter(letter) = fenceline_events::decode(letters[0].payload().expect("value")).expect("decodes")
    else {
        panic!("not a dead letter");
    };
    assert_eq!(letter.original_value.expect("value kept").0, b"not avro at all");
    assert_eq!(letter.topic, status_topic);
    assert_eq!(letter.consumer, group);
    assert!(letter.reason.contains("header event_id is invalid"), "{}", letter.reason);
    assert_eq!(consumer.stats().dead_lettered.load(std::sync::atomic::Ordering::Relaxed), 1);
    shutdown.cancel();
    consumer.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_change_the_database_always_refuses_is_dead_lettered_and_the_consumer_moves_on() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let consumer_db = schema(&url, "probe").await;
    // The projection refuses versions this large: the same record fails the same way
    // on every try (a check violation, as a constraint or bad data would).
    sqlx::query("ALTER TABLE probe_applied ADD CONSTRAINT sane_version CHECK (version < 1000000)")
        .execute(&consumer_db.pool)
        .await
        .expect("constraint");
    let shutdown = CancellationToken::new();
    let consumer = spawn_consumer(&consumer_db, &prefix, &group, "instance", &shutdown);

    let (task, other) = (TaskId::new_v7(), TaskId::new_v7());
    let mut stream: Vec<Event> = (1..=3).map(|v| status_event(task, v)).collect();
    stream.push(status_event(task, 5_000_000));
    stream.extend((4..=6).map(|v| status_event(task, v)));
    stream.extend((1..=3).map(|v| status_event(other, v)));
    upstream.publish(&stream).await;

    assert_eq!(wait_applied(&consumer_db.pool, 9, Duration::from_secs(60)).await, (9, 0), "the consumer moved on");
    let letters = read_topic(&brokers(), &topics::named(&prefix, topics::DEADLETTER), 1, Duration::from_secs(30));
    assert_eq!(letters.len(), 1, "the refused record is a dead letter");
    let Event::DeadLetter(letter) = fenceline_events::decode(letters[0].payload().expect("value")).expect("decodes")
    else {
        panic!("not a dead letter");
    };
    assert!(letter.reason.contains("sane_version"), "the reason names what refused it: {}", letter.reason);
    let Event::TaskStatus(refused) =
        fenceline_events::decode(&letter.original_value.expect("kept").0).expect("decodes")
    else {
        panic!("the original is the status event");
    };
    assert_eq!(refused.version, 5_000_000);

    // Its cause fixed, the letter is replayed as the operations guide says, and the
    // consumer applies it: a dead-lettered event's id is not kept as applied.
    sqlx::query("ALTER TABLE probe_applied DROP CONSTRAINT sane_version")
        .execute(&consumer_db.pool)
        .await
        .expect("constraint");
    let original = String::from_utf8(letters[0].key().expect("key").to_vec()).expect("key");
    let choice = fenceline_bus::replay::Choice { originals: vec![original.clone()], consumer: None };
    let replayed = fenceline_bus::replay::replay_dead_letters(&kafka(&prefix), &choice).await.expect("replay");
    assert!(
        matches!(replayed.as_slice(), [fenceline_bus::replay::Replayed::Sent { original: o, .. }] if *o == original),
        "{replayed:?}"
    );
    assert_eq!(wait_applied(&consumer_db.pool, 10, Duration::from_secs(60)).await, (10, 0), "the replay applied");
    shutdown.cancel();
    consumer.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_the_broker_can_never_take_leaves_as_a_dead_letter_and_its_shard_moves_on() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let upstream = Upstream::start(&url, &prefix).await;
    let task = TaskId::new_v7();
    let Event::TaskStatus(mut huge) = status_event(task, 1) else { unreachable!() };
    huge.reason = Some("x".repeat(1_500_000)); // over the producer's 1 MB record limit
    let mut stream = vec![Event::TaskStatus(huge)];
    stream.extend((2..=4).map(|v| status_event(task, v)));
    upstream.publish(&stream).await;

    let status_topic = topics::named(&prefix, topics::STATUS);
    let (at, topic) = (brokers(), status_topic.clone());
    let on_topic =
        tokio::task::spawn_blocking(move || read_topic(&at, &topic, 3, Duration::from_secs(30))).await.expect("reader");
    assert_eq!(versions_by_task(&on_topic).get(&task), Some(&vec![2, 3, 4]), "the rows behind it were published");
    let letters = read_topic(&brokers(), &topics::named(&prefix, topics::DEADLETTER), 1, Duration::from_secs(30));
    assert_eq!(letters.len(), 1, "the refused row is announced");
    let Event::DeadLetter(letter) = fenceline_events::decode(letters[0].payload().expect("value")).expect("decodes")
    else {
        panic!("not a dead letter");
    };
    assert_eq!(letter.topic, status_topic);
    assert!(letter.reason.contains("refused"), "{}", letter.reason);
    assert!(letter.original_value.expect("a prefix of the value").0.len() <= 65_536, "bounded");
    let (refused, reason): (i64, Option<String>) = sqlx::query_as(
        "SELECT count(*), max(refused_reason) FROM outbox WHERE refused_at IS NOT NULL AND published_at IS NULL",
    )
    .fetch_one(&upstream.db.pool)
    .await
    .expect("refused rows");
    assert_eq!(refused, 1, "the row is kept, out of the relay's way, with its reason: {reason:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_progress_beyond_the_end_of_a_recreated_topic_stops_the_partition_instead_of_skipping() {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let consumer_db = schema(&url, "probe").await;
    let task = TaskId::new_v7(); // one key, one partition
    {
        let upstream = Upstream::start(&url, &prefix).await;
        let shutdown = CancellationToken::new();
        let consumer = spawn_consumer(&consumer_db, &prefix, &group, "first", &shutdown);
        upstream.publish(&(1..=20).map(|v| status_event(task, v)).collect::<Vec<_>>()).await;
        assert_eq!(wait_applied(&consumer_db.pool, 20, Duration::from_secs(60)).await, (20, 0));
        shutdown.cancel();
        consumer.join().await;
    }
    // The topic is deleted and made again: its log starts over at offset 0.
    let status_topic = topics::named(&prefix, topics::STATUS);
    let admin: AdminClient<_> = ClientConfig::new().set("bootstrap.servers", brokers()).create().expect("admin");
    admin.delete_topics(&[&status_topic], &AdminOptions::new()).await.expect("delete");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let specs: Vec<_> = fenceline_bus::admin::fenceline_topics(&prefix, PARTITIONS)
            .into_iter()
            .filter(|t| t.name == status_topic)
            .collect();
        let made = fenceline_bus::admin::ensure_topics(&kafka(&prefix), &specs, 1).await;
        let metadata = admin.inner().fetch_metadata(Some(&status_topic), Duration::from_secs(5)).expect("metadata");
        let ready = metadata.topics().first().is_some_and(|t| t.error().is_none() && !t.partitions().is_empty());
        if made.is_ok() && ready {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the topic could not be made again");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let upstream = Upstream::start(&url, &prefix).await;
    upstream.publish(&(21..=25).map(|v| status_event(task, v)).collect::<Vec<_>>()).await;
    let shutdown = CancellationToken::new();
    let consumer = spawn_consumer(&consumer_db, &prefix, &group, "second", &shutdown);
    let stats = consumer.stats();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stats.halted_partitions.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the partition beyond its log's end was not stopped");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stats.redelivered.load(std::sync::atomic::Ordering::Relaxed), 0, "nothing skipped as redelivered");
    assert_eq!(probe_counts(&consumer_db.pool).await, (20, 0), "the new records wait for an operator");
    shutdown.cancel();
    consumer.join().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_after_the_broker_acknowledged_resends_and_the_consumer_applies_once() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    // The probe's own outbox holds the events; its relay crashes before marking.
    let probe_db = schema(&url, "probe").await;
    let writer = OutboxWriter::new("bus-probe", prefix.clone(), outbox_config().shards);
    // One key, so one shard: the crashing relay publishes all of them in one round.
    let sent = events(1, 20);
    write_outbox(&probe_db.pool, &writer, topics::STATUS, &sent, 100).await;

    let mut crashing = Proc::spawn(
        PROBE,
        &["relay"],
        &[
            probe_env(&url, &prefix, "-", "relay-a"),
            vec![("FAILPOINTS", "outbox.after_publish_before_mark=return(crash)".to_owned())],
        ]
        .concat(),
    );
    crashing.wait_exit(Duration::from_secs(60)).await.expect("the relay crashes at the fault point");
    let unmarked: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        .fetch_one(&probe_db.pool)
        .await
        .expect("count");
    assert_eq!(unmarked, 20, "nothing was marked before the crash");

    let _relay = Proc::spawn(PROBE, &["relay"], &probe_env(&url, &prefix, "-", "relay-b"));
    let status_topic = topics::named(&prefix, topics::STATUS);
    let on_topic =
        tokio::task::spawn_blocking(move || read_topic(&brokers(), &status_topic, 40, Duration::from_secs(60)))
            .await
            .expect("reader");
    let ids: Vec<String> = on_topic.iter().filter_map(event_id_of).collect();
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), 20, "the same 20 event ids");
    assert!(ids.len() >= 40, "each was sent twice, with the same event id ({} records)", ids.len());

    let consumer_db = schema(&url, "consumer").await;
    let shutdown = CancellationToken::new();
    let consumer = spawn_consumer(&consumer_db, &prefix, &group, "instance", &shutdown);
    assert_eq!(wait_applied(&consumer_db.pool, 20, Duration::from_secs(60)).await, (20, 0));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(consumer.stats().duplicates.load(std::sync::atomic::Ordering::Relaxed) >= 20, "re-sends suppressed");
    assert_eq!(probe_counts(&consumer_db.pool).await, (20, 0));
    shutdown.cancel();
    consumer.join().await;
}

/// With the default settings each relay deletes the rows the broker confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_keep_the_events_of_one_key_in_the_order_they_were_written() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let db = schema(&url, "upstream").await;
    let writer = OutboxWriter::new("upstream", prefix.clone(), outbox_config().shards);
    let shutdown = CancellationToken::new();
    let mut stats = Vec::new();
    let deleting = fenceline_config::OutboxConfig { keep_published_seconds: 0, ..outbox_config() };
    for name in ["relay-1", "relay-2"] {
        stats.push(start_relay_with(name, &db, &kafka(&prefix), &writer, &shutdown, deleting.clone()));
    }
    // Written while both relays run, in many small transactions.
    let all = events(20, 100);
    write_outbox(&db.pool, &writer, topics::STATUS, &all, 7).await;

    let status_topic = topics::named(&prefix, topics::STATUS);
    let on_topic =
        tokio::task::spawn_blocking(move || read_topic(&brokers(), &status_topic, 2_000, Duration::from_secs(120)))
            .await
            .expect("reader");
    shutdown.cancel();
    assert_eq!(on_topic.len(), 2_000);
    for (task, versions) in versions_by_task(&on_topic) {
        assert_eq!(versions, (1..=100).collect::<Vec<i64>>(), "task {task}: in written order");
    }
    let published: Vec<u64> = stats.iter().map(|s| s.published.load(std::sync::atomic::Ordering::Relaxed)).collect();
    assert_eq!(published.iter().sum::<u64>(), 2_000);
    eprintln!("rows published per relay: {published:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox").fetch_one(&db.pool).await.expect("count");
    assert_eq!(left, 0, "every published row is deleted");
}

/// The outbox is the buffer while the broker is gone: rows written meanwhile wait,
/// deliveries that time out are sent again, and every event arrives at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_down_for_30_seconds_delays_events_but_loses_none() {
    let broker = fenceline_tests::process::OwnBroker::start().await;
    let url = fresh_database().await;
    let prefix = "down.".to_owned();
    let mut kafka = kafka(&prefix);
    kafka.brokers = broker.brokers();
    // Shorter than the outage: the deliveries queued meanwhile fail, and the relay
    // must send their rows again once the broker is back.
    kafka.message_timeout_ms = 10_000;
    fenceline_bus::admin::ensure_topics(&kafka, &fenceline_bus::admin::fenceline_topics(&prefix, PARTITIONS), 1)
        .await
        .expect("topics");
    let db = schema(&url, "upstream").await;
    let writer = OutboxWriter::new("upstream", prefix.clone(), outbox_config().shards);
    let shutdown = CancellationToken::new();
    let stats = start_relay("relay", &db, &kafka, &writer, &shutdown);

    write_outbox(&db.pool, &writer, topics::STATUS, &events(10, 10), 50).await;
    broker.kill();
    let down_at = tokio::time::Instant::now();
    write_outbox(&db.pool, &writer, topics::STATUS, &events(10, 10), 50).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    broker.restart().await;
    eprintln!("broker was down for {:?}", down_at.elapsed());

    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let unpublished = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            .fetch_one(&db.pool)
            .await
            .expect("count")
    };
    while unpublished().await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "outbox not drained after the broker came back");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    shutdown.cancel();
    let (brokers, topic) = (broker.brokers(), topics::named(&prefix, topics::STATUS));
    // A delivery that timed out while the broker came back may have been written
    // all the same: the relay sends it again (at least once), so the topic can
    // hold more than 200 records. Everything is read, and the ids counted.
    let on_topic = tokio::task::spawn_blocking(move || {
        read_until_quiet(&brokers, &topic, Duration::from_secs(5), Duration::from_secs(60))
    })
    .await
    .expect("reader");
    let distinct: HashSet<String> = on_topic.iter().filter_map(event_id_of).collect();
    assert_eq!(distinct.len(), 200, "every event arrived ({} records)", on_topic.len());
    let failed = stats.failed_deliveries.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "published {} rows, {failed} deliveries failed and were re-sent",
        stats.published.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(failed > 0, "the outage outlasted the message timeout, so deliveries failed");
}

/// Waits until `check` holds, or panics with `what` after `timeout`.
async fn eventually(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Readiness rests on `joined` (docs/operations.md): an instance the group left
/// without partitions, because others hold them all, is still a ready member. The
/// lag it reports comes from the client's statistics and the database's progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_left_without_partitions_has_joined_and_held_partitions_report_their_lag() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let published = events(30, 1);
    upstream.publish(&published).await;
    let probe_db = schema(&url, "probe").await;
    // Nothing is applied while this is armed: every batch fails before its commit.
    fenceline_bus::faults::__fail::cfg("consumer.before_db_commit", "return").expect("arm the fault point");
    let shutdown = CancellationToken::new();
    let consumers: Vec<_> = (0..=PARTITIONS)
        .map(|i| spawn_consumer(&probe_db, &prefix, &group, &format!("probe-{i}"), &shutdown))
        .collect();
    let stats: Vec<_> = consumers.iter().map(|c| c.stats()).collect();
    let assigned = |s: &fenceline_bus::ConsumerStats| s.assigned_partitions.load(std::sync::atomic::Ordering::Relaxed);
    let joined = |s: &fenceline_bus::ConsumerStats| s.joined.load(std::sync::atomic::Ordering::Acquire);
    eventually("every instance joined and the partitions are spread", Duration::from_secs(60), || {
        stats.iter().all(|s| joined(s)) && stats.iter().map(|s| assigned(s)).sum::<usize>() == PARTITIONS as usize
    })
    .await;
    assert!(stats.iter().any(|s| assigned(s) == 0), "one instance more than partitions holds none");
    let total_lag = |stats: &[std::sync::Arc<fenceline_bus::ConsumerStats>]| {
        stats.iter().flat_map(|s| s.lag()).map(|(_, lag)| lag).sum::<i64>()
    };
    eventually("the lag counts every record not applied", Duration::from_secs(30), || {
        total_lag(&stats) == published.len() as i64
    })
    .await;
    assert_eq!(probe_counts(&probe_db.pool).await.0, 0, "nothing was applied meanwhile");

    fenceline_bus::faults::__fail::remove("consumer.before_db_commit");
    wait_applied(&probe_db.pool, published.len() as i64, Duration::from_secs(60)).await;
    eventually("the lag falls to zero once everything is applied", Duration::from_secs(30), || {
        let lag: Vec<_> = stats.iter().flat_map(|s| s.lag()).collect();
        lag.len() == PARTITIONS as usize && total_lag(&stats) == 0
    })
    .await;
    shutdown.cancel();
    for consumer in consumers {
        consumer.join().await;
    }
}

/// Takes, on one connection of `db`'s pool (its schema first on the search path),
/// the session advisory locks of every outbox shard with the relay's own statement;
/// returns the connection, which holds them.
async fn hold_every_shard(db: &Database) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    let mut conn = db.pool.acquire().await.expect("connection");
    let shards: Vec<i32> = (0..outbox_config().shards as i32).collect();
    let held: Vec<i32> = sqlx::query_scalar(fenceline_bus::relay::SHARD_TRY_LOCK_ALL)
        .bind(&shards)
        .fetch_all(&mut *conn)
        .await
        .expect("shard locks");
    assert_eq!(held.len(), shards.len(), "every shard locked");
    conn
}

/// Shard locks are scoped to the service's schema: services share a database, and
/// a relay of one that holds its shards (paused in the middle of a round) keeps no
/// other service's relay from publishing. The same locks taken in the publisher's
/// own schema do hold it back, so the test takes the relay's very locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_holding_its_shards_holds_back_its_own_service_and_no_other() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let topic = topics::named(&prefix, topics::STATUS);
    let read = |expected: usize, timeout: Duration| {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || read_topic(&brokers(), &topic, expected, timeout).len())
    };
    let other = schema(&url, "other").await;
    let upstream = Upstream::start(&url, &prefix).await;

    let held_by_another_service = hold_every_shard(&other).await;
    upstream.publish(&events(10, 1)).await;
    assert_eq!(read(10, Duration::from_secs(30)).await.expect("reader"), 10, "published past the other's locks");

    let held_in_its_own_schema = hold_every_shard(&upstream.db).await;
    upstream.publish(&events(10, 1)).await;
    assert_eq!(read(20, Duration::from_secs(3)).await.expect("reader"), 10, "held back by its own shards' locks");
    drop(held_in_its_own_schema.detach());
    assert_eq!(read(20, Duration::from_secs(30)).await.expect("reader"), 20, "published once the locks went");
    drop(held_by_another_service);
}

/// A consumer of two topics started while the broker knows only one of them (the
/// other is created a moment later, as a deployment's topic job may finish after
/// a service started, or as a topic just created may not yet be in the broker's
/// metadata) reads both once the second exists. Joined with the first alone, the
/// group would be given the second only at the client's periodic metadata
/// refresh, five minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_started_before_one_of_its_topics_exists_reads_it_once_it_is_created() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let db = schema(&url, "consumer").await;
    let shutdown = CancellationToken::new();
    let writer = OutboxWriter::new("consumer", &prefix, outbox_config().shards);
    start_relay("consumer-relay", &db, &kafka(&prefix), &writer, &shutdown);
    let spec = consumer_spec(&prefix, &[topics::STATUS, topics::DISPATCH], &fresh_group(), "one");
    let _consumer = spawn_consumer_of(spec, &db, &prefix, writer, ProbeHandler, &shutdown).expect("consumer");
    // Long enough for a group to be joined and assigned the known topic alone.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let late = topics::named(&prefix, topics::DISPATCH);
    let spec: Vec<_> =
        fenceline_bus::admin::fenceline_topics(&prefix, PARTITIONS).into_iter().filter(|t| t.name == late).collect();
    fenceline_bus::admin::ensure_topics(&kafka(&prefix), &spec, 1).await.expect("create the late topic");

    let upstream = Upstream::start(&url, &prefix).await;
    upstream.publish(&events(10, 1)).await;
    write_outbox(&upstream.db.pool, &upstream.writer, topics::DISPATCH, &events(10, 1), 10).await;
    let (applied, twice) = wait_applied(&db.pool, 20, Duration::from_secs(30)).await;
    shutdown.cancel();
    assert_eq!(twice, 0, "an event applied twice");
    assert_eq!(applied, 20, "the records of the topic created after the consumer started were never read");
}

/// A relay keeps its shards across rounds only while each round publishes
/// something: once what was written is out, it lets them all go, so a relay paused
/// while idle (a long GC, a stopped VM) holds back no shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_lets_its_shards_go_once_it_has_nothing_to_publish() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let topic = topics::named(&prefix, topics::STATUS);
    let upstream = Upstream::start(&url, &prefix).await;
    upstream.publish(&events(200, 3)).await;
    let read = tokio::task::spawn_blocking(move || read_topic(&brokers(), &topic, 600, Duration::from_secs(30)).len());
    assert_eq!(read.await.expect("reader"), 600, "every row published");

    let shards: Vec<i32> = (0..outbox_config().shards as i32).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mut conn = upstream.db.pool.acquire().await.expect("connection");
        let taken: Vec<i32> = sqlx::query_scalar(fenceline_bus::relay::SHARD_TRY_LOCK_ALL)
            .bind(&shards)
            .fetch_all(&mut *conn)
            .await
            .expect("shard locks");
        // The connection leaves the pool: the locks it took go with it.
        drop(conn.detach());
        if taken.len() == shards.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "an idle relay still holds shards: only {taken:?} of {shards:?} could be taken"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A projection that gathers the newest version of each task over a batch and
/// writes it once when the batch ends (as the scheduler's statuses and intake's
/// change marks are written); it gathers an event before refusing it, so that
/// only `discard` keeps a refused event's version out. It notes the keys each batch
/// was prepared with.
#[derive(Debug, Default)]
struct Gathering(std::sync::Mutex<std::collections::BTreeMap<TaskId, i64>>, Prepared);

/// The keys of each batch a handler was prepared with, in order.
type Prepared = std::sync::Arc<std::sync::Mutex<Vec<Vec<Vec<u8>>>>>;

impl fenceline_bus::Handler for Gathering {
    async fn handle(
        &self,
        _tx: &mut sqlx::PgConnection,
        _outbox: &OutboxWriter,
        record: &fenceline_bus::Inbound,
    ) -> Result<(), fenceline_bus::HandleError> {
        let Event::TaskStatus(status) = &record.envelope.event else {
            return Err(fenceline_bus::HandleError::Poison("not a status".into()));
        };
        let mut gathered = self.0.lock().expect("gathered");
        let newest = gathered.entry(status.task_id).or_default();
        *newest = (*newest).max(status.version);
        if status.version >= 1_000_000 {
            return Err(fenceline_bus::HandleError::Poison("a version this large is refused".into()));
        }
        Ok(())
    }

    async fn flush(
        &self,
        tx: &mut sqlx::PgConnection,
        _outbox: &OutboxWriter,
    ) -> Result<(), fenceline_bus::HandleError> {
        let gathered = std::mem::take(&mut *self.0.lock().expect("gathered"));
        for (task, version) in gathered {
            sqlx::query("INSERT INTO gathered_flushes (task_id, version) VALUES ($1, $2)")
                .bind(task.as_uuid())
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
        Ok(())
    }

    fn discard(&self) {
        self.0.lock().expect("gathered").clear();
    }

    async fn prepare(&self, _tx: &mut sqlx::PgConnection, keys: &[&[u8]]) -> Result<(), fenceline_bus::HandleError> {
        self.1.lock().expect("prepared").push(keys.iter().map(|key| key.to_vec()).collect());
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_handler_gathers_is_written_once_per_batch_and_a_refused_event_leaves_nothing_gathered() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let group = fresh_group();
    let upstream = Upstream::start(&url, &prefix).await;
    let consumer_db = schema(&url, "gathering").await;
    sqlx::query("CREATE TABLE gathered_flushes (task_id uuid NOT NULL, version bigint NOT NULL)")
        .execute(&consumer_db.pool)
        .await
        .expect("table");
    // Every event is on the topic before the consumer starts, so that its first
    // batches hold several versions of each task.
    let tasks: Vec<TaskId> = (0..3).map(|_| TaskId::new_v7()).collect();
    let stream: Vec<Event> = (1..=6).flat_map(|v| tasks.iter().map(move |t| status_event(*t, v))).collect();
    upstream.publish(&stream).await;
    let published =
        read_topic(&brokers(), &topics::named(&prefix, topics::STATUS), stream.len(), Duration::from_secs(30));
    assert_eq!(published.len(), stream.len(), "every event is on the topic");

    let shutdown = CancellationToken::new();
    let writer = OutboxWriter::new("gathering", &prefix, outbox_config().shards);
    start_relay("gathering-relay", &consumer_db, &kafka(&prefix), &writer, &shutdown);
    let gathering = Gathering::default();
    let prepared = gathering.1.clone();
    let consumer = spawn_status_consumer(&consumer_db, &prefix, &group, "gathering", writer, gathering, &shutdown)
        .expect("consumer");

    // (newest version written, writes) of `task` once its newest is `expected`.
    let flushed = |task: TaskId, expected: i64| {
        let pool = consumer_db.pool.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                let row: (Option<i64>, i64) =
                    sqlx::query_as("SELECT max(version), count(*) FROM gathered_flushes WHERE task_id = $1")
                        .bind(task.as_uuid())
                        .fetch_one(&pool)
                        .await
                        .expect("flushes");
                if row.0 == Some(expected) || tokio::time::Instant::now() > deadline {
                    return row;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    for task in &tasks {
        let (version, writes) = flushed(*task, 6).await;
        assert_eq!(version, Some(6), "the newest version of each task is written");
        assert!(writes < 6, "several versions of a task in one batch are written once, not {writes} times");
    }
    // Each batch was prepared once, before its events, with the keys of its records.
    let prepared = prepared.lock().expect("prepared").clone();
    let keys: usize = prepared.iter().map(Vec::len).sum();
    assert!(prepared.len() < stream.len(), "prepared once a batch, not once a record: {} times", prepared.len());
    assert_eq!(keys, stream.len(), "every record's key, once, in the batch that applied it");
    for task in &tasks {
        let key = task.to_string().into_bytes();
        assert_eq!(prepared.iter().flatten().filter(|k| **k == key).count(), 6, "each of the task's six records");
    }

    // A refused event in the middle: its batch is applied again event by event, and
    // what the refused event gathered goes with its savepoint.
    let refused_task = TaskId::new_v7();
    upstream
        .publish(&[status_event(refused_task, 1), status_event(refused_task, 5_000_000), status_event(refused_task, 2)])
        .await;
    let (version, _) = flushed(refused_task, 2).await;
    assert_eq!(version, Some(2), "the refused event's version was discarded with its savepoint, the others written");
    let letters = read_topic(&brokers(), &topics::named(&prefix, topics::DEADLETTER), 1, Duration::from_secs(30));
    assert_eq!(letters.len(), 1, "the refused event is a dead letter");
    shutdown.cancel();
    consumer.join().await;
    drop(upstream);
}

/// Rows appended together ([`fenceline_bus::OutboxRow::insert_all`], as a batch's
/// gathered statuses and an executor phase with several events are) take their
/// keys' locks like single appends: they wait for an open transaction that wrote
/// one of their keys, draw their ids after it committed, and keep the order given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_appended_together_wait_for_an_open_writer_of_their_keys_and_keep_their_order() {
    let url = fresh_database().await;
    let db = schema(&url, "upstream").await;
    let writer = OutboxWriter::new("upstream", "unused", outbox_config().shards);
    let (x, y) = (TaskId::new_v7(), TaskId::new_v7());

    let mut open = db.pool.begin().await.expect("begin");
    writer.append(&mut open, topics::STATUS, None, &status_event(x, 1)).await.expect("append x v1");
    let together = {
        let (pool, writer) = (db.pool.clone(), writer.clone());
        tokio::spawn(async move {
            let rows = [status_event(x, 2), status_event(y, 1), status_event(x, 3)]
                .iter()
                .map(|event| writer.row(topics::STATUS, event))
                .collect::<Result<Vec<_>, _>>()
                .expect("rows");
            let mut tx = pool.begin().await.expect("begin");
            fenceline_bus::OutboxRow::insert_all(rows, &mut tx).await.expect("insert together");
            tx.commit().await.expect("commit");
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!together.is_finished(), "the rows appended together waited for the open writer of x");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox").fetch_one(&db.pool).await.expect("count");
    assert_eq!(written, 0, "nothing is visible before the open writer commits");
    open.commit().await.expect("commit the open writer");
    together.await.expect("appended together");

    let rows: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as("SELECT id, record_key, payload FROM outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .expect("rows");
    let order: Vec<(String, i64)> = rows
        .iter()
        .map(|(_, key, payload)| {
            let Ok(Event::TaskStatus(status)) = fenceline_events::decode(payload) else { panic!("a status") };
            (String::from_utf8(key.clone()).expect("key"), status.version)
        })
        .collect();
    let (x, y) = (x.to_string(), y.to_string());
    assert_eq!(
        order,
        vec![(x.clone(), 1), (x.clone(), 2), (y, 1), (x, 3)],
        "after the open writer, in the order given"
    );
}

/// Produces `event` as a relay would, stamped `age` in the past; returns its event id.
async fn produce_aged(prefix: &str, event: &Event, age: Duration) -> uuid::Uuid {
    let (payload, headers) = fenceline_events::encode_record(event, "aged-producer").expect("encode");
    let pairs = headers.to_pairs();
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let key = event.task_id().expect("a status names its task").to_string();
    let stamped = std::time::SystemTime::now() - age;
    let stamped_ms =
        i64::try_from(stamped.duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis()).expect("ms");
    let topic = topics::named(prefix, topics::STATUS);
    produce_stamped(&brokers(), &topic, key.as_bytes(), &payload, &pairs, Some(stamped_ms)).await;
    headers.event_id.as_uuid()
}

/// The transactions that applied `events` in the probe projection, once all are applied.
async fn applying_transactions(pool: &sqlx::PgPool, events: &[uuid::Uuid]) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rows: Vec<(uuid::Uuid, String)> =
            sqlx::query_as("SELECT event_id, xmin::text FROM probe_applied WHERE event_id = ANY($1)")
                .bind(events)
                .fetch_all(pool)
                .await
                .expect("applied");
        if rows.len() == events.len() {
            return events
                .iter()
                .map(|id| rows.iter().find(|(e, _)| e == id).map(|(_, xmin)| xmin.clone()).expect("applied"))
                .collect();
        }
        assert!(tokio::time::Instant::now() < deadline, "events applied: {} of {}", rows.len(), events.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The probe's projection on a task's way: its consumer applies fresh records at once.
struct OnATasksWay;

impl fenceline_bus::Handler for OnATasksWay {
    fn on_a_tasks_way(&self) -> bool {
        true
    }

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        outbox: &OutboxWriter,
        record: &fenceline_bus::Inbound,
    ) -> Result<(), fenceline_bus::HandleError> {
        fenceline_bus::Handler::handle(&ProbeHandler, tx, outbox, record).await
    }
}

/// A probe consumer over the status topic in its own group and schema, whose batches
/// wait up to 5 s: with records 2 s apart, which batch a record lands in depends on
/// the rule and not on the machine's speed.
async fn slow_batching_consumer<H: fenceline_bus::Handler>(
    url: &str,
    prefix: &str,
    name: &'static str,
    handler: H,
    shutdown: &CancellationToken,
) -> (Database, fenceline_bus::ConsumerHandle) {
    let db = schema(url, name).await;
    let writer = OutboxWriter::new(name, prefix, outbox_config().shards);
    start_relay(&format!("{name}-relay"), &db, &kafka(prefix), &writer, shutdown);
    let config = fenceline_config::ConsumerConfig { batch_wait_ms: 5_000, ..consumer_config() };
    let consumer = fenceline_bus::FencedConsumer::spawn(
        fenceline_bus::ConsumerSpec {
            group: fresh_group(),
            topics: vec![topics::named(prefix, topics::STATUS)],
            instance: name.into(),
            drain_grace: Duration::from_secs(5),
        },
        &kafka(prefix),
        &config,
        db.pool.clone(),
        writer,
        handler,
        shutdown.clone(),
    )
    .expect("consumer");
    (db, consumer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_on_a_tasks_way_waits_for_a_batch_to_fill_only_when_it_is_behind() {
    let (url, prefix) = (fresh_database().await, fresh_topics().await);
    let shutdown = CancellationToken::new();
    let (on_the_way, _a) = slow_batching_consumer(&url, &prefix, "on_the_way", OnATasksWay, &shutdown).await;
    let (off_the_way, _b) = slow_batching_consumer(&url, &prefix, "off_the_way", ProbeHandler, &shutdown).await;
    let fresh_status = || status_event(TaskId::new_v7(), 1);
    // Both consumers hold their partitions once a first record is applied.
    let first = produce_aged(&prefix, &fresh_status(), Duration::ZERO).await;
    applying_transactions(&on_the_way.pool, &[first]).await;
    applying_transactions(&off_the_way.pool, &[first]).await;

    // A fresh record and another two seconds behind it.
    let fresh = produce_aged(&prefix, &fresh_status(), Duration::ZERO).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let behind = produce_aged(&prefix, &fresh_status(), Duration::ZERO).await;
    let applied = applying_transactions(&on_the_way.pool, &[fresh, behind]).await;
    assert_ne!(
        applied[0], applied[1],
        "on a task's way, a fresh record waited for the next one: one transaction applied both"
    );
    let applied = applying_transactions(&off_the_way.pool, &[fresh, behind]).await;
    assert_eq!(applied[0], applied[1], "off a task's way, a batch did not wait to fill");

    // A record that has already waited longer than the batch wait (its consumer is
    // behind), and another two seconds behind it: it waits for company on either.
    let queued = produce_aged(&prefix, &fresh_status(), Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let company = produce_aged(&prefix, &fresh_status(), Duration::ZERO).await;
    for db in [&on_the_way, &off_the_way] {
        let applied = applying_transactions(&db.pool, &[queued, company]).await;
        assert_eq!(applied[0], applied[1], "a record that had waited was applied without waiting for the next one");
    }
    shutdown.cancel();
}
