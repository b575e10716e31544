//! How a service reaches Kafka: brokers, topics and timeouts, the security settings
//! (TLS, SASL), and the librdkafka properties an operator may add.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::{Error, ExposeSecret as _, Secret, parse_secret, read_secret_file};

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

pub(crate) fn parse_properties(raw: &str) -> Result<Properties, String> {
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
