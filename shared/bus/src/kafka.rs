//! librdkafka client configuration: the settings Fenceline relies on, applied the
//! same way for every service, the cluster's security settings, and whatever else a
//! deployment adds (`FENCELINE_KAFKA_PROPERTIES`). docs/broker.md gives the reason
//! for each setting.
//!
//! What Fenceline needs of a Kafka-protocol cluster, and nothing more: the
//! idempotent producer, consumer groups with the classic protocol and cooperative
//! rebalancing, and compacted topics (`fenceline.status`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
///
/// A relay hands its producer a whole batch and waits for every delivery before
/// it reads again; the 1 ms linger sends that batch in one request. The relay, not
/// the linger, paces itself when busy ([`crate::relay::after_round`]), so a lone
/// record is not held back (docs/decisions.md, entries 61 and 63).
pub fn producer_config(kafka: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut config = base(kafka, client_id);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", "1")
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

/// How long a client's error of one kind is held back after it was logged.
pub const ERROR_REPEAT_EVERY: Duration = Duration::from_secs(30);

/// Logs a long-running client's errors, each kind at most once per
/// [`ERROR_REPEAT_EVERY`], with how many like it were held back meanwhile:
/// librdkafka reports the same error on every retry, several a second per client
/// while every broker is down.
#[derive(Debug, Default)]
pub struct ErrorLog(Mutex<HashMap<String, (Instant, u64)>>);

impl ErrorLog {
    /// Logs `error` for `client` unless one of its kind was logged less than
    /// [`ERROR_REPEAT_EVERY`] ago.
    pub fn report(&self, client: &str, error: &KafkaError, reason: &str) {
        let kind = error.rdkafka_error_code().map_or_else(|| error.to_string(), |code| format!("{code:?}"));
        if let Some(held_back) = self.due(kind, Instant::now()) {
            tracing::error!(client, error = %error, reason, held_back, "kafka client error");
        }
    }

    /// Whether an error of `kind` seen at `now` is logged, and if so how many of
    /// its kind were held back since the last one logged.
    fn due(&self, kind: String, now: Instant) -> Option<u64> {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match seen.get_mut(&kind) {
            Some((logged_at, held)) if now.duration_since(*logged_at) < ERROR_REPEAT_EVERY => {
                *held += 1;
                None
            }
            Some((logged_at, held)) => {
                let held_back = std::mem::take(held);
                *logged_at = now;
                Some(held_back)
            }
            None => {
                seen.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

/// The relay's producer's context: its errors through an [`ErrorLog`].
#[derive(Debug)]
pub struct ProducerLog {
    client: String,
    errors: ErrorLog,
}

impl ProducerLog {
    pub fn new(client: impl Into<String>) -> Self {
        Self { client: client.into(), errors: ErrorLog::default() }
    }
}

impl ClientContext for ProducerLog {
    fn error(&self, error: KafkaError, reason: &str) {
        self.errors.report(&self.client, &error, reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_of_one_kind_is_logged_once_per_period_with_how_many_were_held_back() {
        let log = ErrorLog::default();
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(log.due("AllBrokersDown".into(), at(0)), Some(0), "the first is logged");
        assert_eq!(log.due("AllBrokersDown".into(), at(1)), None);
        assert_eq!(log.due("AllBrokersDown".into(), at(29)), None);
        assert_eq!(log.due("BrokerTransportFailure".into(), at(29)), Some(0), "another kind is its own");
        assert_eq!(log.due("AllBrokersDown".into(), at(30)), Some(2), "after the period, with the two held back");
        assert_eq!(log.due("AllBrokersDown".into(), at(31)), None);
        assert_eq!(log.due("AllBrokersDown".into(), at(61)), Some(1));
    }
}
