//! Configuration every service reads the same way: environment variables (or the
//! equivalent flags), each with a documented default, parsed into typed values at
//! start. `--help` on any service binary prints them all.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

pub mod catalog;

/// A configuration that parsed but does not make sense as a whole.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct Error(pub String);

/// Where the service's own Postgres schema lives.
#[derive(Debug, Clone, Args)]
pub struct PostgresConfig {
    /// Postgres connection URL. The service keeps its tables in its own schema of
    /// this database.
    #[arg(long = "database-url", env = "FENCELINE_DATABASE_URL")]
    pub database_url: String,

    /// Schema that holds this service's tables (default: the service's name).
    #[arg(long = "database-schema", env = "FENCELINE_DATABASE_SCHEMA")]
    pub schema: Option<String>,

    /// Largest number of pooled connections.
    #[arg(long = "database-max-connections", env = "FENCELINE_DATABASE_MAX_CONNECTIONS", default_value_t = 10)]
    pub max_connections: u32,
}

/// How to reach Kafka, and the names of the topics.
#[derive(Debug, Clone, Args)]
pub struct KafkaConfig {
    /// Bootstrap brokers, comma separated.
    #[arg(long = "kafka-brokers", env = "FENCELINE_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,

    /// Prefix put before every topic name (empty in production; tests isolate
    /// themselves with it).
    #[arg(long = "topic-prefix", env = "FENCELINE_TOPIC_PREFIX", default_value = "")]
    pub topic_prefix: String,

    /// Extra librdkafka properties as `key=value` pairs separated by commas, for
    /// example `security.protocol=SASL_SSL,sasl.mechanism=PLAIN`.
    #[arg(long = "kafka-properties", env = "FENCELINE_KAFKA_PROPERTIES", default_value = "", value_parser = parse_properties)]
    pub properties: Properties,

    /// Consumer group session timeout, in milliseconds.
    #[arg(long = "kafka-session-timeout-ms", env = "FENCELINE_KAFKA_SESSION_TIMEOUT_MS", default_value_t = 10_000)]
    pub session_timeout_ms: u64,

    /// Longest time between two polls before the consumer leaves its group, in
    /// milliseconds. Handling never blocks polling, so this only bounds a stall.
    #[arg(long = "kafka-max-poll-interval-ms", env = "FENCELINE_KAFKA_MAX_POLL_INTERVAL_MS", default_value_t = 20_000)]
    pub max_poll_interval_ms: u64,

    /// How long the producer keeps trying to deliver one record, in milliseconds.
    /// The outbox re-sends anything not confirmed, so this bounds only one try.
    #[arg(long = "kafka-message-timeout-ms", env = "FENCELINE_KAFKA_MESSAGE_TIMEOUT_MS", default_value_t = 60_000)]
    pub message_timeout_ms: u64,
}

/// `key=value` librdkafka properties.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties(pub Vec<(String, String)>);

fn parse_properties(raw: &str) -> Result<Properties, String> {
    let mut pairs = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item.split_once('=').ok_or_else(|| format!("`{item}` is not of the form key=value"))?;
        pairs.push((key.trim().to_owned(), value.trim().to_owned()));
    }
    Ok(Properties(pairs))
}

/// How the fenced consumer batches records.
#[derive(Debug, Clone, Args)]
pub struct ConsumerConfig {
    /// Most records handled in one database transaction.
    #[arg(
        id = "consumer_batch_max",
        long = "consumer-batch-max",
        env = "FENCELINE_CONSUMER_BATCH_MAX",
        default_value_t = 500
    )]
    pub batch_max: usize,

    /// Longest wait for a batch to fill once its first record arrived, in milliseconds.
    #[arg(
        id = "consumer_batch_wait_ms",
        long = "consumer-batch-wait-ms",
        env = "FENCELINE_CONSUMER_BATCH_WAIT_MS",
        default_value_t = 20
    )]
    pub batch_wait_ms: u64,

    /// How long applied event ids are remembered for deduplication, in hours. It
    /// must outlast any re-send: relays re-send within minutes of a failure.
    #[arg(
        id = "consumer_dedup_retention_hours",
        long = "consumer-dedup-retention-hours",
        env = "FENCELINE_CONSUMER_DEDUP_RETENTION_HOURS",
        default_value_t = 168
    )]
    pub dedup_retention_hours: u32,

    /// A partition of the group's topics that no instance advanced for this long
    /// while records wait on it makes the instance rejoin its group, so the
    /// coordinator assigns every partition again; 0 turns the watch off. Keep it
    /// well above the longest batch.
    #[arg(
        id = "consumer_stall_after_ms",
        long = "consumer-stall-after-ms",
        env = "FENCELINE_CONSUMER_STALL_AFTER_MS",
        default_value_t = 30_000
    )]
    pub stall_after_ms: u64,
}

impl ConsumerConfig {
    pub fn batch_wait(&self) -> Duration {
        Duration::from_millis(self.batch_wait_ms)
    }

    /// The stall watch's threshold; None when it is off.
    pub fn stall_after(&self) -> Option<Duration> {
        (self.stall_after_ms > 0).then(|| Duration::from_millis(self.stall_after_ms))
    }
}

/// How the outbox relay publishes.
#[derive(Debug, Clone, Args)]
pub struct OutboxConfig {
    /// Number of shards the outbox is split into by key hash. One relay instance
    /// holds a shard at a time. Changing it while rows are unpublished is safe
    /// only with every relay stopped.
    #[arg(id = "outbox_shards", long = "outbox-shards", env = "FENCELINE_OUTBOX_SHARDS", default_value_t = 8)]
    pub shards: u16,

    /// Most rows published per shard per round.
    #[arg(
        id = "outbox_batch_max",
        long = "outbox-batch-max",
        env = "FENCELINE_OUTBOX_BATCH_MAX",
        default_value_t = 500
    )]
    pub batch_max: u32,

    /// Longest sleep between rounds when nothing new was written, in milliseconds.
    /// Writers in the same process wake the relay at once.
    #[arg(
        id = "outbox_idle_poll_ms",
        long = "outbox-idle-poll-ms",
        env = "FENCELINE_OUTBOX_IDLE_POLL_MS",
        default_value_t = 500
    )]
    pub idle_poll_ms: u64,
}

/// The service's own HTTP listener (health, readiness, and any API).
#[derive(Debug, Clone, Args)]
pub struct HttpConfig {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long = "http-addr", env = "FENCELINE_HTTP_ADDR", default_value = "127.0.0.1:0")]
    pub addr: SocketAddr,

    /// Time allowed for in-flight work to finish on shutdown, in milliseconds. Must
    /// be shorter than the Kafka session timeout.
    #[arg(long = "shutdown-grace-ms", env = "FENCELINE_SHUTDOWN_GRACE_MS", default_value_t = 8_000)]
    pub shutdown_grace_ms: u64,
}

impl HttpConfig {
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }
}

/// Checks that an inner timeout is strictly shorter than the one that encloses it.
pub fn require_nested(inner_name: &str, inner: Duration, outer_name: &str, outer: Duration) -> Result<(), Error> {
    if inner < outer {
        Ok(())
    } else {
        Err(Error(format!("{inner_name} ({inner:?}) must be shorter than {outer_name} ({outer:?})")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_parse_pairs_and_reject_garbage() {
        assert_eq!(parse_properties("").expect("empty"), Properties::default());
        let parsed = parse_properties("a=1, b = two ,").expect("two pairs");
        assert_eq!(parsed.0, vec![("a".into(), "1".into()), ("b".into(), "two".into())]);
        assert!(parse_properties("novalue").is_err());
    }

    #[derive(Debug, clap::Parser)]
    struct Service {
        #[command(flatten)]
        service: ServiceConfig,
    }

    #[test]
    fn the_shared_options_form_one_valid_command_with_documented_defaults() {
        use clap::{CommandFactory, Parser};
        Service::command().debug_assert();
        let parsed = Service::try_parse_from(["svc", "--database-url", "postgres://x/y"]).expect("defaults suffice");
        assert_eq!(parsed.service.consumer.batch_max, 500);
        assert_eq!(parsed.service.outbox.batch_max, 500);
        assert!(parsed.service.validate().is_ok());
        let bad =
            Service::try_parse_from(["svc", "--database-url", "x", "--shutdown-grace-ms", "20000"]).expect("parses");
        assert!(bad.service.validate().is_err(), "grace longer than the session timeout");
    }

    #[test]
    fn nested_timeouts_must_shrink_inwards() {
        let s = Duration::from_secs;
        assert!(require_nested("call", s(1), "step", s(2)).is_ok());
        let err = require_nested("call", s(2), "step", s(2)).expect_err("equal is not shorter");
        assert!(err.to_string().contains("call (2s) must be shorter than step (2s)"));
    }
}

/// Everything a Kafka-and-Postgres service shares, to `#[command(flatten)]` into
/// its own configuration.
#[derive(Debug, Clone, Args)]
pub struct ServiceConfig {
    #[command(flatten)]
    pub postgres: PostgresConfig,
    #[command(flatten)]
    pub kafka: KafkaConfig,
    #[command(flatten)]
    pub consumer: ConsumerConfig,
    #[command(flatten)]
    pub outbox: OutboxConfig,
    #[command(flatten)]
    pub http: HttpConfig,
}

impl ServiceConfig {
    /// Checks what single values cannot: the shutdown grace must end before the
    /// consumer group gives the partitions away.
    pub fn validate(&self) -> Result<(), Error> {
        require_nested(
            "shutdown grace (FENCELINE_SHUTDOWN_GRACE_MS)",
            self.http.shutdown_grace(),
            "Kafka session timeout (FENCELINE_KAFKA_SESSION_TIMEOUT_MS)",
            Duration::from_millis(self.kafka.session_timeout_ms),
        )
    }
}
