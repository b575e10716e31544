//! Configuration every service reads the same way: environment variables (or the
//! equivalent flags), each with a documented default, parsed into typed values at
//! start. `--help` on any service binary prints them all.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

pub mod catalog;
pub mod dialect;

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

    #[command(flatten)]
    pub security: KafkaSecurity,

    /// Extra librdkafka properties as `key=value` pairs separated by commas, for
    /// example `socket.keepalive.enable=true,client.rack=eu-1a`. They are applied
    /// after Fenceline's own settings; the few that Fenceline's guarantees rest on
    /// (see [`RESERVED_PROPERTIES`]) and secrets (which have variables of their own)
    /// are refused.
    #[arg(long = "kafka-properties", env = "FENCELINE_KAFKA_PROPERTIES", default_value = "", value_parser = parse_properties)]
    pub properties: Properties,

    /// Consumer group session timeout, in milliseconds: how long the group waits for
    /// a silent instance before its partitions move to the others.
    #[arg(long = "kafka-session-timeout-ms", env = "FENCELINE_KAFKA_SESSION_TIMEOUT_MS", default_value_t = 10_000)]
    pub session_timeout_ms: u64,

    /// Longest time between two polls before the consumer leaves its group, in
    /// milliseconds. Handling never blocks polling; only the rebalance callbacks
    /// wait (for the database), so this bounds a database outage during a rebalance.
    #[arg(long = "kafka-max-poll-interval-ms", env = "FENCELINE_KAFKA_MAX_POLL_INTERVAL_MS", default_value_t = 60_000)]
    pub max_poll_interval_ms: u64,

    /// How long the producer keeps trying to deliver one record, in milliseconds.
    /// The outbox re-sends anything not confirmed, so this bounds only one try.
    #[arg(long = "kafka-message-timeout-ms", env = "FENCELINE_KAFKA_MESSAGE_TIMEOUT_MS", default_value_t = 60_000)]
    pub message_timeout_ms: u64,

    /// How long a service waits at start for the brokers to answer a metadata
    /// request, in milliseconds, before it gives up. Refused credentials stop it at
    /// once.
    #[arg(long = "kafka-connect-timeout-ms", env = "FENCELINE_KAFKA_CONNECT_TIMEOUT_MS", default_value_t = 30_000)]
    pub connect_timeout_ms: u64,
}

impl KafkaConfig {
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

/// How the clients authenticate to the brokers and protect their connections: the
/// standard settings of a production cluster. Anything rarer goes through
/// `FENCELINE_KAFKA_PROPERTIES`.
#[derive(Debug, Clone, Default, Args)]
pub struct KafkaSecurity {
    /// `plaintext`, `ssl`, `sasl_plaintext` or `sasl_ssl`.
    #[arg(long = "kafka-security-protocol", env = "FENCELINE_KAFKA_SECURITY_PROTOCOL", value_enum, default_value_t)]
    pub protocol: SecurityProtocol,

    /// SASL mechanism, with a `sasl_*` protocol: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    #[arg(long = "kafka-sasl-mechanism", env = "FENCELINE_KAFKA_SASL_MECHANISM", value_enum)]
    pub sasl_mechanism: Option<SaslMechanism>,

    /// SASL user name.
    #[arg(long = "kafka-sasl-username", env = "FENCELINE_KAFKA_SASL_USERNAME")]
    pub sasl_username: Option<String>,

    /// SASL password. Never printed; prefer the `_FILE` variable where secrets are
    /// mounted as files.
    #[arg(long = "kafka-sasl-password", env = "FENCELINE_KAFKA_SASL_PASSWORD", hide_env_values = true, value_parser = parse_secret, conflicts_with = "sasl_password_file")]
    pub sasl_password: Option<Secret>,

    /// A file holding the SASL password (its trailing newline is dropped).
    #[arg(long = "kafka-sasl-password-file", env = "FENCELINE_KAFKA_SASL_PASSWORD_FILE", value_parser = read_secret_file)]
    pub sasl_password_file: Option<Secret>,

    /// CA certificates (PEM) that the brokers' certificates must chain to; the
    /// system's store when unset.
    #[arg(long = "kafka-ssl-ca-location", env = "FENCELINE_KAFKA_SSL_CA_LOCATION")]
    pub ssl_ca_location: Option<PathBuf>,

    /// The client's certificate (PEM), where the brokers want mutual TLS.
    #[arg(long = "kafka-ssl-certificate-location", env = "FENCELINE_KAFKA_SSL_CERTIFICATE_LOCATION")]
    pub ssl_certificate_location: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(long = "kafka-ssl-key-location", env = "FENCELINE_KAFKA_SSL_KEY_LOCATION")]
    pub ssl_key_location: Option<PathBuf>,

    /// The private key's password, if it has one. Never printed.
    #[arg(long = "kafka-ssl-key-password", env = "FENCELINE_KAFKA_SSL_KEY_PASSWORD", hide_env_values = true, value_parser = parse_secret, conflicts_with = "ssl_key_password_file")]
    pub ssl_key_password: Option<Secret>,

    /// A file holding the private key's password (its trailing newline is dropped).
    #[arg(long = "kafka-ssl-key-password-file", env = "FENCELINE_KAFKA_SSL_KEY_PASSWORD_FILE", value_parser = read_secret_file)]
    pub ssl_key_password_file: Option<Secret>,
}

/// librdkafka's `security.protocol`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SecurityProtocol {
    #[default]
    #[value(name = "plaintext", alias = "PLAINTEXT")]
    Plaintext,
    #[value(name = "ssl", alias = "SSL")]
    Ssl,
    #[value(name = "sasl_plaintext", alias = "SASL_PLAINTEXT")]
    SaslPlaintext,
    #[value(name = "sasl_ssl", alias = "SASL_SSL")]
    SaslSsl,
}

impl SecurityProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Ssl => "ssl",
            Self::SaslPlaintext => "sasl_plaintext",
            Self::SaslSsl => "sasl_ssl",
        }
    }

    fn sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }

    fn tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }
}

/// librdkafka's `sasl.mechanism`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SaslMechanism {
    #[value(name = "PLAIN", alias = "plain")]
    Plain,
    #[value(name = "SCRAM-SHA-256", alias = "scram-sha-256")]
    ScramSha256,
    #[value(name = "SCRAM-SHA-512", alias = "scram-sha-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

impl KafkaSecurity {
    /// The SASL password, from the variable or the file.
    pub fn sasl_password(&self) -> Option<&Secret> {
        self.sasl_password.as_ref().or(self.sasl_password_file.as_ref())
    }

    /// The client key's password, from the variable or the file.
    pub fn ssl_key_password(&self) -> Option<&Secret> {
        self.ssl_key_password.as_ref().or(self.ssl_key_password_file.as_ref())
    }

    /// The librdkafka settings these stand for. Values of secrets are exposed here
    /// only, to be handed to the client.
    pub fn client_settings(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![("security.protocol", self.protocol.as_str().to_owned())];
        if let Some(mechanism) = self.sasl_mechanism {
            out.push(("sasl.mechanism", mechanism.as_str().to_owned()));
        }
        if let Some(username) = &self.sasl_username {
            out.push(("sasl.username", username.clone()));
        }
        if let Some(password) = self.sasl_password() {
            out.push(("sasl.password", password.expose_secret().to_owned()));
        }
        let paths = [
            ("ssl.ca.location", &self.ssl_ca_location),
            ("ssl.certificate.location", &self.ssl_certificate_location),
            ("ssl.key.location", &self.ssl_key_location),
        ];
        for (key, path) in paths {
            if let Some(path) = path {
                out.push((key, path.display().to_string()));
            }
        }
        if let Some(password) = self.ssl_key_password() {
            out.push(("ssl.key.password", password.expose_secret().to_owned()));
        }
        out
    }

    /// Checks what single values cannot: SASL needs a mechanism and credentials,
    /// and TLS files make sense only with a TLS protocol.
    pub fn validate(&self) -> Result<(), Error> {
        let protocol = self.protocol.as_str();
        if self.protocol.sasl() {
            if self.sasl_mechanism.is_none() {
                return Err(Error(format!(
                    "FENCELINE_KAFKA_SASL_MECHANISM is required with security protocol {protocol}"
                )));
            }
            if self.sasl_username.is_none() || self.sasl_password().is_none() {
                return Err(Error(format!(
                    "FENCELINE_KAFKA_SASL_USERNAME and FENCELINE_KAFKA_SASL_PASSWORD (or _FILE) are required with security protocol {protocol}"
                )));
            }
        } else if self.sasl_mechanism.is_some() || self.sasl_username.is_some() || self.sasl_password().is_some() {
            return Err(Error(format!("SASL settings are given but the security protocol is {protocol}")));
        }
        let tls_files = self.ssl_ca_location.is_some()
            || self.ssl_certificate_location.is_some()
            || self.ssl_key_location.is_some()
            || self.ssl_key_password().is_some();
        if tls_files && !self.protocol.tls() {
            return Err(Error(format!("TLS files are given but the security protocol is {protocol}")));
        }
        if self.ssl_certificate_location.is_some() != self.ssl_key_location.is_some() {
            return Err(Error(
                "a client certificate needs its key and a key its certificate (FENCELINE_KAFKA_SSL_CERTIFICATE_LOCATION, FENCELINE_KAFKA_SSL_KEY_LOCATION)".into(),
            ));
        }
        Ok(())
    }
}

/// A value that must never be printed: its `Debug` says `[redacted]`.
pub type Secret = secrecy::SecretString;
pub use secrecy::ExposeSecret;

/// A secret given as a value (a flag or a variable).
pub fn parse_secret(raw: &str) -> Result<Secret, String> {
    Ok(Secret::from(raw.to_owned()))
}

/// A secret read from the file at `path`, as Kubernetes mounts a Secret: the whole
/// file less its trailing newline. The error names the file, never its content.
pub fn read_secret_file(path: &str) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    Ok(Secret::from(text.trim_end_matches(['\n', '\r']).to_owned()))
}

/// The secret in the environment variable `name`, or in the file that `name`
/// followed by `_FILE` names; `Ok(None)` when neither is set. Both set is an error,
/// as is an unreadable file.
pub fn secret_from_env(name: &str) -> Result<Option<Secret>, Error> {
    secret_from(name, std::env::var(name).ok(), std::env::var(format!("{name}_FILE")).ok())
}

/// [`secret_from_env`] of the values the variable and its `_FILE` variant hold.
fn secret_from(name: &str, value: Option<String>, file: Option<String>) -> Result<Option<Secret>, Error> {
    let file_var = format!("{name}_FILE");
    match (value, file) {
        (Some(_), Some(_)) => Err(Error(format!("set {name} or {file_var}, not both"))),
        (Some(value), None) => Ok(Some(Secret::from(value))),
        (None, Some(path)) => read_secret_file(&path).map(Some).map_err(|e| Error(format!("{file_var}: {e}"))),
        (None, None) => Ok(None),
    }
}

/// librdkafka properties that `FENCELINE_KAFKA_PROPERTIES` may not set: Fenceline's
/// delivery guarantees rest on them (an idempotent producer acknowledged by every
/// replica, offsets stored only after the database committed, the group and the
/// brokers it is given), or they are secrets with variables of their own that are
/// never printed.
pub const RESERVED_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.idempotence",
    "acks",
    "enable.auto.offset.store",
    "isolation.level",
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.password",
    "ssl.key.password",
];

/// `key=value` librdkafka properties. Its `Debug` hides the values of keys that
/// look like secrets.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Properties(pub Vec<(String, String)>);

impl std::fmt::Debug for Properties {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut map = f.debug_map();
        for (key, value) in &self.0 {
            let secret = ["password", "secret", "token", "key.pem", "credentials"].iter().any(|s| key.contains(s));
            map.entry(key, if secret { &"[redacted]" } else { value });
        }
        map.finish()
    }
}

fn parse_properties(raw: &str) -> Result<Properties, String> {
    let mut pairs = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item.split_once('=').ok_or_else(|| format!("`{item}` is not of the form key=value"))?;
        let key = key.trim();
        if RESERVED_PROPERTIES.contains(&key) {
            return Err(format!(
                "`{key}` cannot be set here: Fenceline sets it itself or takes it from a variable of its own (FENCELINE_KAFKA_*)"
            ));
        }
        pairs.push((key.to_owned(), value.trim().to_owned()));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_parse_pairs_and_reject_garbage() {
        assert_eq!(parse_properties("").expect("empty"), Properties::default());
        let parsed = parse_properties("a=1, b = two ,").expect("two pairs");
        assert_eq!(parsed.0, vec![("a".into(), "1".into()), ("b".into(), "two".into())]);
        assert!(parse_properties("novalue").is_err());
        let refused = parse_properties("enable.auto.offset.store=true").expect_err("reserved");
        assert!(refused.contains("enable.auto.offset.store"), "{refused}");
        assert!(parse_properties("sasl.password=hunter2").is_err(), "secrets have variables of their own");
    }

    #[test]
    fn secrets_never_print() {
        use clap::Parser;
        let parsed = Service::try_parse_from([
            "svc",
            "--database-url",
            "postgres://x/y",
            "--kafka-security-protocol",
            "sasl_ssl",
            "--kafka-sasl-mechanism",
            "SCRAM-SHA-512",
            "--kafka-sasl-username",
            "fenceline",
            "--kafka-sasl-password",
            "hunter2",
            "--kafka-properties",
            "sasl.oauthbearer.client.secret=s3cret,client.rack=a",
        ])
        .expect("parses");
        assert!(parsed.service.validate().is_ok());
        let printed = format!("{parsed:?}");
        assert!(!printed.contains("hunter2") && !printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("client.rack"));
        let settings = parsed.service.kafka.security.client_settings();
        assert!(settings.contains(&("sasl.password", "hunter2".to_owned())));
        assert!(settings.contains(&("sasl.mechanism", "SCRAM-SHA-512".to_owned())));
    }

    /// A folder of one test's own, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("fenceline-config-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("scratch folder");
            Self(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_database_url_comes_from_the_variable_or_a_file_and_never_prints() {
        use clap::Parser;
        let url = "postgres://fenceline:db-pass-7f3a@db.example:5432/fenceline?sslmode=verify-full";
        let parsed = Service::try_parse_from(["svc", "--database-url", url]).expect("parses");
        assert_eq!(parsed.service.postgres.database_url().expect("url").expose_secret(), url);
        let printed = format!("{parsed:?}");
        assert!(!printed.contains("db-pass-7f3a") && !printed.contains("db.example"), "{printed}");

        let dir = Scratch::new("url");
        let file = dir.0.join("url");
        std::fs::write(&file, format!("{url}\n")).expect("write");
        let path = file.display().to_string();
        let parsed = Service::try_parse_from(["svc", "--database-url-file", &path]).expect("parses");
        assert_eq!(parsed.service.postgres.database_url().expect("url").expose_secret(), url, "newline dropped");
        assert!(!format!("{parsed:?}").contains("db-pass-7f3a"));
        assert!(Service::try_parse_from(["svc"]).is_err(), "one of the two is required");
        assert!(Service::try_parse_from(["svc", "--database-url", url, "--database-url-file", &path]).is_err());
        let missing = Service::try_parse_from(["svc", "--database-url-file", "/nonexistent/url"]).expect_err("no file");
        assert!(missing.to_string().contains("/nonexistent/url"), "{missing}");
    }

    #[test]
    fn a_named_secret_comes_from_its_variable_or_the_file_its_file_variant_names() {
        let dir = Scratch::new("named");
        let file = dir.0.join("credential");
        std::fs::write(&file, "Bearer sk-file-6b1e\n").expect("write");
        let path = file.display().to_string();
        let read = |value: Option<&str>, file: Option<&str>| {
            secret_from("FENCELINE_X", value.map(str::to_owned), file.map(str::to_owned))
                .map(|s| s.map(|s| s.expose_secret().to_owned()))
        };
        assert_eq!(read(Some("Bearer v"), None).expect("value").as_deref(), Some("Bearer v"));
        assert_eq!(read(None, Some(&path)).expect("file").as_deref(), Some("Bearer sk-file-6b1e"));
        assert_eq!(read(None, None).expect("neither"), None);
        let both = read(Some("Bearer v"), Some(&path)).expect_err("both");
        assert!(both.to_string().contains("FENCELINE_X_FILE") && !both.to_string().contains("Bearer"), "{both}");
        let missing = read(None, Some("/nonexistent/credential")).expect_err("no file");
        assert!(missing.to_string().contains("/nonexistent/credential"), "{missing}");
    }

    #[test]
    fn every_kafka_secret_may_come_from_a_file_and_none_prints() {
        use clap::Parser;
        let dir = Scratch::new("kafka");
        let (password, key_password) = (dir.0.join("sasl"), dir.0.join("key"));
        std::fs::write(&password, "sasl-pass-91c2\n").expect("write");
        std::fs::write(&key_password, "key-pass-44d0").expect("write");
        let parsed = Service::try_parse_from([
            "svc",
            "--database-url",
            "postgres://x/y",
            "--kafka-security-protocol",
            "sasl_ssl",
            "--kafka-sasl-mechanism",
            "PLAIN",
            "--kafka-sasl-username",
            "u",
            "--kafka-sasl-password-file",
            &password.display().to_string(),
            "--kafka-ssl-key-password-file",
            &key_password.display().to_string(),
        ])
        .expect("parses");
        assert!(parsed.service.validate().is_ok());
        let printed = format!("{parsed:?}");
        assert!(!printed.contains("sasl-pass-91c2") && !printed.contains("key-pass-44d0"), "{printed}");
        let settings = parsed.service.kafka.security.client_settings();
        assert!(settings.contains(&("sasl.password", "sasl-pass-91c2".to_owned())));
        assert!(settings.contains(&("ssl.key.password", "key-pass-44d0".to_owned())));
    }

    #[test]
    fn sasl_needs_a_mechanism_and_credentials() {
        use clap::Parser;
        let parse = |args: &[&str]| {
            let mut all = vec!["svc", "--database-url", "postgres://x/y"];
            all.extend_from_slice(args);
            Service::try_parse_from(all).expect("parses").service.validate()
        };
        assert!(parse(&["--kafka-security-protocol", "sasl_plaintext"]).is_err());
        assert!(parse(&["--kafka-sasl-username", "u"]).is_err(), "SASL settings without a SASL protocol");
        assert!(parse(&["--kafka-ssl-ca-location", "/ca.pem"]).is_err(), "TLS files without TLS");
        assert!(parse(&["--kafka-security-protocol", "ssl", "--kafka-ssl-ca-location", "/ca.pem"]).is_ok());
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
        self.kafka.security.validate()?;
        require_nested(
            "shutdown grace (FENCELINE_SHUTDOWN_GRACE_MS)",
            self.http.shutdown_grace(),
            "Kafka session timeout (FENCELINE_KAFKA_SESSION_TIMEOUT_MS)",
            Duration::from_millis(self.kafka.session_timeout_ms),
        )
    }
}
