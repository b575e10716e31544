//! librdkafka client configuration: the settings Fenceline relies on, applied the
//! same way for every service, the cluster's security settings, and whatever else a
//! deployment adds (`FENCELINE_KAFKA_PROPERTIES`). docs/broker.md gives the reason
//! for each setting.
//!
//! What Fenceline needs of a Kafka-protocol cluster, and nothing more: the
//! idempotent producer, consumer groups with the classic protocol and cooperative
//! rebalancing, and compacted topics (`fenceline.status`).

use std::sync::Mutex;
use std::time::Duration;

use fenceline_config::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

fn base(kafka: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &kafka.brokers).set("client.id", client_id);
    for (key, value) in kafka.security.client_settings() {
        config.set(key, value);
    }
    config
}

/// A deployment's own properties go last: they tune, they cannot undo what the
/// guarantees rest on (those keys are refused when the configuration is parsed).
fn with_properties(mut config: ClientConfig, kafka: &KafkaConfig) -> ClientConfig {
    for (key, value) in &kafka.properties.0 {
        config.set(key, value);
    }
    config
}

/// An idempotent producer: no duplicates or reordering from its own retries.
pub fn producer_config(kafka: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut config = base(kafka, client_id);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", "5")
        .set("message.timeout.ms", kafka.message_timeout_ms.to_string());
    with_properties(config, kafka)
}

/// A group consumer whose offsets are stored only after the database committed,
/// and whose start positions come from the database.
pub fn consumer_config(kafka: &KafkaConfig, client_id: &str, group: &str) -> ClientConfig {
    let mut config = base(kafka, client_id);
    config
        .set("group.id", group)
        .set("enable.auto.offset.store", "false")
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "1000")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
        .set("heartbeat.interval.ms", (kafka.session_timeout_ms / 3).max(100).to_string())
        .set("max.poll.interval.ms", kafka.max_poll_interval_ms.to_string())
        // Incremental rebalancing: partitions that stay with an instance are not
        // revoked and re-acquired on every membership change.
        .set("partition.assignment.strategy", "cooperative-sticky");
    with_properties(config, kafka)
}

/// Why the brokers could not be reached at start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The brokers refused the credentials or the TLS handshake: trying again
    /// cannot help, so the service stops.
    #[error("kafka refused this client at {brokers}: {reason}")]
    Refused { brokers: String, reason: String },
    #[error("no kafka broker at {brokers} answered a metadata request within {waited:?}: {reason}")]
    Unreachable { brokers: String, waited: Duration, reason: String },
    #[error("kafka client: {0}")]
    Client(#[from] KafkaError),
}

/// Keeps the client's first fatal-looking error instead of logging every retry.
#[derive(Default)]
struct FirstError(Mutex<Option<(RDKafkaErrorCode, String)>>);

impl ConsumerContext for FirstError {}

impl ClientContext for FirstError {
    // librdkafka retries forever and logs each try; the check reports once.
    fn log(&self, _level: RDKafkaLogLevel, _fac: &str, _log_message: &str) {}

    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail);
        let mut first = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let refusal = matches!(code, RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed);
        let reason = if reason.is_empty() { error.to_string() } else { reason.to_owned() };
        if first.is_none() || refusal {
            *first = Some((code, reason));
        }
    }
}

/// Asks the brokers for metadata until they answer or `timeout` passes. Refused
/// credentials or a failed TLS handshake end the wait at once with
/// [`ConnectError::Refused`], whose text names no secret.
pub async fn check_connection(kafka: &KafkaConfig, timeout: Duration) -> Result<(), ConnectError> {
    let config = base(kafka, "fenceline-connection-check");
    let brokers = kafka.brokers.clone();
    let security = &kafka.security;
    let who = match (security.sasl_mechanism, &security.sasl_username) {
        (Some(mechanism), Some(user)) => {
            format!(
                "authentication failed (SASL {} as user `{user}`): check the user name and password",
                mechanism.as_str()
            )
        }
        _ => "authentication failed".to_owned(),
    };
    tokio::task::spawn_blocking(move || {
        // A consumer that joins no group: the lightest client that can ask.
        let client: BaseConsumer<FirstError> = config.create_with_context(FirstError::default())?;
        let started = std::time::Instant::now();
        loop {
            let asked = client.fetch_metadata(None, Duration::from_millis(500));
            if asked.is_ok() {
                return Ok(());
            }
            // Errors reach the context only when the client's queue is served.
            if let Some(Err(error)) = client.poll(Duration::ZERO) {
                client.context().error(error, "");
            }
            let seen = client.context().0.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some((code, reason)) = &seen
                && let Some(refusal) = refusal(*code, reason, &who)
            {
                return Err(ConnectError::Refused { brokers, reason: refusal });
            }
            if started.elapsed() >= timeout {
                let reason = seen.map(|(_, r)| r).or_else(|| asked.err().map(|e| e.to_string())).unwrap_or_default();
                return Err(ConnectError::Unreachable { brokers, waited: timeout, reason });
            }
        }
    })
    .await
    .map_err(|e| ConnectError::Client(KafkaError::ClientCreation(e.to_string())))?
}

/// What a client error means when retrying cannot help; None for errors that may pass.
fn refusal(code: RDKafkaErrorCode, reason: &str, authentication: &str) -> Option<String> {
    if matches!(code, RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed) {
        Some(authentication.to_owned())
    } else if reason.contains("SSL handshake failed") || reason.contains("certificate verify failed") {
        Some(format!("TLS handshake failed: {reason}"))
    } else {
        None
    }
}
