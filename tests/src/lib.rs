//! Test harness: a fresh database and fresh topics per test on the real Postgres
//! and broker that `deploy/local/stack test` starts, a probe projection for the
//! bus, and helpers to read and write topics as an outsider would.

use std::collections::HashMap;
use std::time::Duration;

use fenceline_bus::{HandleError, Handler, Inbound, OutboxWriter};
use fenceline_config::{ConsumerConfig, KafkaConfig, OutboxConfig, PostgresConfig, Properties};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::TaskState;
use fenceline_events::{Event, TaskStatus, Timestamp};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::{Connection, PgConnection};

pub mod process;
pub mod system;
pub mod vendors;

/// Partitions of every test topic.
pub const PARTITIONS: i32 = 3;

/// The probe's projection and the bus tables.
pub static PROBE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests through `deploy/local/stack test`"))
}

/// The Postgres server of the test stack.
pub fn admin_database_url() -> String {
    env("FENCELINE_TEST_DATABASE_URL")
}

/// The broker of the test stack.
pub fn brokers() -> String {
    env("FENCELINE_TEST_KAFKA_BROKERS")
}

/// Logs of the code under test go to the test's stderr (shown for failing tests).
pub(crate) fn init_telemetry() {
    static GUARD: std::sync::OnceLock<fenceline_telemetry::TelemetryGuard> = std::sync::OnceLock::new();
    GUARD.get_or_init(|| fenceline_telemetry::init("test"));
}

/// A database of its own for one test; returns its URL.
pub async fn fresh_database() -> String {
    init_telemetry();
    let admin = admin_database_url();
    let mut conn = PgConnection::connect(&admin).await.expect("connect to the test Postgres");
    let name = format!("t_{}", uuid::Uuid::now_v7().simple());
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.expect("create database");
    let (base, _) = admin.rsplit_once('/').expect("database URL has a path");
    format!("{base}/{name}")
}

/// Postgres settings for a service schema in `url`.
pub fn postgres(url: &str, schema: &str) -> PostgresConfig {
    PostgresConfig::at(url, Some(schema), 8)
}

/// Kafka settings for tests: a topic prefix of the test's own, short group timeouts
/// (the broker's smallest session timeout is 6 s).
pub fn kafka(prefix: &str) -> KafkaConfig {
    kafka_at(&brokers(), prefix)
}

/// As [`kafka`], for the brokers at `brokers`.
pub fn kafka_at(brokers: &str, prefix: &str) -> KafkaConfig {
    KafkaConfig {
        brokers: brokers.to_owned(),
        topic_prefix: prefix.to_owned(),
        security: Default::default(),
        properties: Properties::default(),
        session_timeout_ms: 6_000,
        max_poll_interval_ms: 60_000,
        message_timeout_ms: 60_000,
        connect_timeout_ms: 30_000,
    }
}

pub fn consumer_config() -> ConsumerConfig {
    ConsumerConfig { batch_max: 500, batch_wait_ms: 20, dedup_retention_hours: 168 }
}

/// The settings every service shares, for a service under test on port 0.
pub fn service_config(url: &str, prefix: &str, schema: &str) -> fenceline_config::ServiceConfig {
    fenceline_config::ServiceConfig {
        postgres: postgres(url, schema),
        kafka: kafka(prefix),
        consumer: consumer_config(),
        outbox: outbox_config(),
        http: fenceline_config::HttpConfig { addr: ([127, 0, 0, 1], 0).into(), shutdown_grace_ms: 5_000 },
    }
}

/// Intake on port 0 with the given kinds and the documented defaults otherwise.
pub fn intake_config(url: &str, prefix: &str, kinds: Vec<String>) -> fenceline_intake::Config {
    fenceline_intake::Config {
        service: service_config(url, prefix, "intake"),
        intake: fenceline_intake::IntakeConfig {
            kinds,
            kind_schemas: None,
            idempotency_retention_hours: 24,
            webhook_tolerance_seconds: 300,
            unscheduled_after_minutes: 10,
            task_retention_days: 30,
            body_limit_bytes: 4096,
            webhook_sealing_keys: None,
            webhook_sealing_keys_file: None,
            admission: fenceline_intake::admission::AdmissionConfig {
                tenant_rate_per_second: 1000.0,
                tenant_burst: 1000,
                max_in_flight: 256,
            },
            catalog: Default::default(),
        },
    }
}

/// The suites' relays: short polls, and published rows kept, so that a test can
/// read what was sent.
pub fn outbox_config() -> OutboxConfig {
    OutboxConfig { shards: 4, batch_max: 500, idle_poll_ms: 100, keep_published_seconds: 3600 }
}

/// A fresh topic prefix with the topics the bus tests use (status, dead letters)
/// created under it.
pub async fn fresh_topics() -> String {
    fresh_topics_with(&[fenceline_events::topics::STATUS, fenceline_events::topics::DEADLETTER]).await
}

/// A fresh topic prefix with the named contract topics created under it.
pub async fn fresh_topics_with(wanted: &[&str]) -> String {
    let prefix = format!("t{}.", uuid::Uuid::now_v7().simple());
    let kafka = kafka(&prefix);
    let topics: Vec<_> = fenceline_bus::admin::fenceline_topics(&prefix, PARTITIONS)
        .into_iter()
        .filter(|t| wanted.iter().any(|w| t.name.ends_with(*w)))
        .collect();
    fenceline_bus::admin::ensure_topics(&kafka, &topics, 1).await.expect("create test topics");
    prefix
}

/// A consumer group of its own for one test, so that no member of another test's
/// group takes part in its rebalances.
pub fn fresh_group() -> String {
    format!("g{}", uuid::Uuid::now_v7().simple())
}

/// The probe's projection: counts how often each event was applied.
#[derive(Debug, Clone, Default)]
pub struct ProbeHandler;

impl Handler for ProbeHandler {
    async fn handle(&self, tx: &mut PgConnection, _outbox: &OutboxWriter, record: &Inbound) -> Result<(), HandleError> {
        let Event::TaskStatus(status) = &record.envelope.event else {
            return Err(HandleError::Poison(format!(
                "the probe does not apply {}",
                record.envelope.event.event_type()
            )));
        };
        sqlx::query(
            "INSERT INTO probe_applied (event_id, task_id, version) VALUES ($1, $2, $3) \
             ON CONFLICT (event_id) DO UPDATE SET applications = probe_applied.applications + 1",
        )
        .bind(record.envelope.headers.event_id.as_uuid())
        .bind(status.task_id.as_uuid())
        .bind(status.version)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// A status event for `task` with `version`, the probe's unit of work.
pub fn status_event(task: TaskId, version: i64) -> Event {
    Event::TaskStatus(TaskStatus {
        task_id: task,
        tenant: "probe".into(),
        kind: "probe.kind".into(),
        state: TaskState::Running,
        reason: None,
        attempt: 1,
        step: None,
        phase: None,
        next_attempt_at: None,
        result: None,
        case_id: None,
        updated_at: Timestamp::now(),
        version,
    })
}

/// Starts a relay of `db`'s outbox until `shutdown`; returns its counters.
pub fn start_relay(
    name: &str,
    db: &fenceline_store::Database,
    kafka: &KafkaConfig,
    writer: &OutboxWriter,
    shutdown: &tokio_util::sync::CancellationToken,
) -> std::sync::Arc<fenceline_bus::RelayStats> {
    start_relay_with(name, db, kafka, writer, shutdown, outbox_config())
}

/// As [`start_relay`], with `config` instead of the suites' [`outbox_config`].
pub fn start_relay_with(
    name: &str,
    db: &fenceline_store::Database,
    kafka: &KafkaConfig,
    writer: &OutboxWriter,
    shutdown: &tokio_util::sync::CancellationToken,
    config: OutboxConfig,
) -> std::sync::Arc<fenceline_bus::RelayStats> {
    let relay =
        fenceline_bus::Relay::new(name, db.pool.clone(), db.options.clone(), kafka, config, writer).expect("relay");
    let stats = relay.stats();
    tokio::spawn(relay.run(shutdown.clone()));
    stats
}

/// The probe's consumer over the status topic of `prefix`, writing dead letters
/// through `writer`.
pub fn spawn_probe_consumer(
    db: &fenceline_store::Database,
    prefix: &str,
    group: &str,
    instance: &str,
    writer: OutboxWriter,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<fenceline_bus::ConsumerHandle, fenceline_bus::Error> {
    spawn_status_consumer(db, prefix, group, instance, writer, ProbeHandler, shutdown)
}

/// A consumer of the status topic of `prefix` with `handler`, writing dead letters
/// through `writer`.
pub fn spawn_status_consumer<H: Handler>(
    db: &fenceline_store::Database,
    prefix: &str,
    group: &str,
    instance: &str,
    writer: OutboxWriter,
    handler: H,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<fenceline_bus::ConsumerHandle, fenceline_bus::Error> {
    let spec = consumer_spec(prefix, &[fenceline_events::topics::STATUS], group, instance);
    spawn_consumer_of(spec, db, prefix, writer, handler, shutdown)
}

/// What a suite's consumer of the contract topics `wanted` under `prefix` consumes, as whom.
pub fn consumer_spec(prefix: &str, wanted: &[&str], group: &str, instance: &str) -> fenceline_bus::ConsumerSpec {
    fenceline_bus::ConsumerSpec {
        group: group.to_owned(),
        topics: wanted.iter().map(|topic| fenceline_events::topics::named(prefix, topic)).collect(),
        instance: instance.to_owned(),
        drain_grace: Duration::from_secs(5),
    }
}

/// A consumer as `spec` says with `handler`, writing dead letters through `writer`.
pub fn spawn_consumer_of<H: Handler>(
    spec: fenceline_bus::ConsumerSpec,
    db: &fenceline_store::Database,
    prefix: &str,
    writer: OutboxWriter,
    handler: H,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<fenceline_bus::ConsumerHandle, fenceline_bus::Error> {
    fenceline_bus::FencedConsumer::spawn(
        spec,
        &kafka(prefix),
        &consumer_config(),
        db.pool.clone(),
        writer,
        handler,
        shutdown.clone(),
    )
}

/// Writes `events` into the outbox of `pool`'s schema, one transaction each
/// `chunk` events, as a service would.
pub async fn write_outbox(pool: &sqlx::PgPool, writer: &OutboxWriter, topic: &str, events: &[Event], chunk: usize) {
    for part in events.chunks(chunk.max(1)) {
        let mut tx = pool.begin().await.expect("begin");
        for event in part {
            writer.append(&mut tx, topic, None, event).await.expect("append");
        }
        tx.commit().await.expect("commit");
    }
    writer.committed();
}

/// (applied events, events applied more than once) in the probe projection.
pub async fn probe_counts(pool: &sqlx::PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE applications > 1) FROM probe_applied")
        .fetch_one(pool)
        .await
        .expect("count probe rows")
}

/// Polls `probe_counts` until `expected` events are applied or `timeout` passes.
pub async fn wait_applied(pool: &sqlx::PgPool, expected: i64, timeout: Duration) -> (i64, i64) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let counts = probe_counts(pool).await;
        if counts.0 >= expected || tokio::time::Instant::now() > deadline {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads `topic` from the beginning of every partition until `expected` records
/// arrived or `timeout` passed, as an outside reader (no group) would.
pub fn read_topic(brokers: &str, topic: &str, expected: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let consumer = reader(brokers, topic);
    let deadline = std::time::Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < expected && std::time::Instant::now() < deadline {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            out.push(message.detach());
        }
    }
    out
}

/// A consumer of its own group, assigned every partition of `topic` from the beginning.
fn reader(brokers: &str, topic: &str) -> BaseConsumer {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("reader-{}", uuid::Uuid::now_v7().simple()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let mut tpl = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        tpl.add_partition_offset(topic, partition, Offset::Beginning).expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    consumer
}

/// Every record of `topic` from the beginning, read until none arrived for `quiet`
/// (or `limit` passed).
pub fn read_until_quiet(brokers: &str, topic: &str, quiet: Duration, limit: Duration) -> Vec<OwnedMessage> {
    let consumer = reader(brokers, topic);
    let (started, mut last) = (std::time::Instant::now(), std::time::Instant::now());
    let mut out = Vec::new();
    while last.elapsed() < quiet && started.elapsed() < limit {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            out.push(message.detach());
            last = std::time::Instant::now();
        }
    }
    out
}

/// Record headers from name/value pairs.
pub fn kafka_headers<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> rdkafka::message::OwnedHeaders {
    use rdkafka::message::{Header, OwnedHeaders};
    pairs.into_iter().fold(OwnedHeaders::new(), |acc, (k, v)| acc.insert(Header { key: k, value: Some(v.as_bytes()) }))
}

/// Produces raw bytes to a topic, as a misbehaving upstream would.
pub async fn produce_raw(brokers: &str, topic: &str, key: &[u8], value: &[u8], headers: &[(&str, &str)]) {
    produce_stamped(brokers, topic, key, value, headers, None).await;
}

/// As [`produce_raw`], with the record's timestamp (milliseconds since the epoch)
/// given instead of the producer's clock.
pub async fn produce_stamped(
    brokers: &str,
    topic: &str,
    key: &[u8],
    value: &[u8],
    headers: &[(&str, &str)],
    timestamp_ms: Option<i64>,
) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", brokers).create().expect("producer");
    let mut record = FutureRecord::to(topic).key(key).payload(value).headers(kafka_headers(headers.iter().copied()));
    if let Some(ms) = timestamp_ms {
        record = record.timestamp(ms);
    }
    producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("produce");
}

/// The `event_id` header of a record.
pub fn event_id_of(message: &OwnedMessage) -> Option<String> {
    use rdkafka::message::Headers;
    let headers = message.headers()?;
    headers.iter().find(|h| h.key == "event_id").and_then(|h| h.value.map(|v| String::from_utf8_lossy(v).into_owned()))
}

/// Records per key, in topic order, by a field of the decoded status event.
pub fn versions_by_task(messages: &[OwnedMessage]) -> HashMap<TaskId, Vec<i64>> {
    let mut out: HashMap<TaskId, Vec<i64>> = HashMap::new();
    let mut sorted: Vec<&OwnedMessage> = messages.iter().collect();
    sorted.sort_by_key(|m| (m.partition(), m.offset()));
    for message in sorted {
        if let Ok(Event::TaskStatus(status)) = fenceline_events::decode(message.payload().unwrap_or_default()) {
            out.entry(status.task_id).or_default().push(status.version);
        }
    }
    out
}
