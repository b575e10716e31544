//! The two mechanisms every service stands on: the fenced consumer (docs/architecture.md,
//! "The fenced consumer") and the transactional outbox with its relay ("The outbox").

pub mod admin;
pub mod consumer;
pub mod faults;
pub mod gathered;
pub mod kafka;
pub mod outbox;
pub mod relay;
pub mod replay;

pub use consumer::{
    ConsumerHandle, ConsumerSpec, ConsumerStats, FencedConsumer, HandleError, Handler, Inbound, Rejected, dead_letter,
};
pub use fenceline_events::topics::named as topic_name;
pub use outbox::{OutboxRow, OutboxWriter};
pub use relay::{Relay, RelayStats};

/// The bus tables (consumer progress, processed events, outbox), migrated into the
/// service's schema before the service's own migrations.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("encoding an event: {0}")]
    Encode(#[from] fenceline_events::EncodeError),
    #[error("creating topic {topic}: {reason}")]
    CreateTopic { topic: String, reason: String },
    #[error("reading {topic}: {reason}")]
    Read { topic: String, reason: String },
    #[error(transparent)]
    Injected(#[from] faults::Injected),
}
