//! Configuration every service reads the same way: environment variables (or the
//! equivalent flags), each with a documented default, parsed into typed values at
//! start. `--help` on any service binary prints them all.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

pub mod catalog;
pub mod dialect;
mod kafka;
mod secrets;

pub use kafka::*;
pub use secrets::*;

/// A configuration that parsed but does not make sense as a whole.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct Error(pub String);

/// Where the service's own Postgres schema lives.
#[derive(Debug, Clone, Args)]
pub struct PostgresConfig {
    /// Postgres connection URL. The service keeps its tables in its own schema of
    /// this database. It may hold a password, so it is never printed. `sslmode`
    /// (`disable`, `prefer`, `require`, `verify-ca`, `verify-full`) and
    /// `sslrootcert` (a PEM file of CA certificates; the system's roots otherwise)
    /// set TLS.
    #[arg(
        long = "database-url",
        env = "FENCELINE_DATABASE_URL",
        hide_env_values = true,
        value_parser = parse_secret,
        required_unless_present = "database_url_file",
        conflicts_with = "database_url_file"
    )]
    pub database_url: Option<Secret>,

    /// A file holding the Postgres connection URL (its trailing newline is
    /// dropped), as a mounted Secret.
    #[arg(long = "database-url-file", env = "FENCELINE_DATABASE_URL_FILE", value_parser = read_secret_file)]
    pub database_url_file: Option<Secret>,

    /// Schema that holds this service's tables (default: the service's name).
    #[arg(long = "database-schema", env = "FENCELINE_DATABASE_SCHEMA")]
    pub schema: Option<String>,

    /// Largest number of pooled connections.
    #[arg(long = "database-max-connections", env = "FENCELINE_DATABASE_MAX_CONNECTIONS", default_value_t = 10)]
    pub max_connections: u32,
}

impl PostgresConfig {
    /// Settings for the database at `url`, with the other values at their defaults.
    pub fn at(url: &str, schema: Option<&str>, max_connections: u32) -> Self {
        Self {
            database_url: Some(Secret::from(url.to_owned())),
            database_url_file: None,
            schema: schema.map(str::to_owned),
            max_connections,
        }
    }

    /// The connection URL, from the variable or the file.
    pub fn database_url(&self) -> Result<&Secret, Error> {
        self.database_url
            .as_ref()
            .or(self.database_url_file.as_ref())
            .ok_or_else(|| Error("FENCELINE_DATABASE_URL or FENCELINE_DATABASE_URL_FILE is required".into()))
    }
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

    /// Longest wait for a batch to fill once its first record arrived, in milliseconds;
    /// a batch waits only when that record is already this old (the consumer is behind).
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
}

impl ConsumerConfig {
    pub fn batch_wait(&self) -> Duration {
        Duration::from_millis(self.batch_wait_ms)
    }

    /// How long an applied event id is remembered: the window in which a re-sent
    /// event is known for one already applied (an hour at least).
    pub fn dedup_window(&self) -> Duration {
        Duration::from_secs(u64::from(self.dedup_retention_hours.max(1)) * 3600)
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

    /// How long a published row stays in the outbox, in seconds, for an operator's
    /// look at what was sent. 0: the relay deletes each row once the broker
    /// confirmed it, in the statement that would otherwise mark it.
    #[arg(
        id = "outbox_keep_published_seconds",
        long = "outbox-keep-published-seconds",
        env = "FENCELINE_OUTBOX_KEEP_PUBLISHED_SECONDS",
        default_value_t = 0
    )]
    pub keep_published_seconds: u64,
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
        self.kafka.security.validate()?;
        require_nested(
            "shutdown grace (FENCELINE_SHUTDOWN_GRACE_MS)",
            self.http.shutdown_grace(),
            "Kafka session timeout (FENCELINE_KAFKA_SESSION_TIMEOUT_MS)",
            Duration::from_millis(self.kafka.session_timeout_ms),
        )
    }
}

#[cfg(test)]
mod tests;
