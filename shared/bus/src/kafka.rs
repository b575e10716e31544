//! librdkafka client configuration: the settings Fenceline relies on, applied the
//! same way for every service, plus whatever production needs on top
//! (`FENCELINE_KAFKA_PROPERTIES`).

use fenceline_config::KafkaConfig;
use rdkafka::ClientConfig;

fn base(kafka: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.brokers)
        .set("client.id", client_id)
        // IPv4 first: a broker advertised as 127.0.0.1 must not be tried on ::1.
        .set("broker.address.family", "v4");
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
    config
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
        .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
        .set("heartbeat.interval.ms", (kafka.session_timeout_ms / 4).max(100).to_string())
        .set("max.poll.interval.ms", kafka.max_poll_interval_ms.to_string())
        .set("partition.assignment.strategy", "range");
    config
}
