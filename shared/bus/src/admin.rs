//! Topic creation through the Kafka admin API (no broker-specific tool), used by
//! the local stack and by tests.

use std::time::Duration;

use fenceline_config::KafkaConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use crate::Error;

/// A topic to make sure of.
#[derive(Debug, Clone)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: i32,
    pub compacted: bool,
}

/// How long a compacted topic keeps a tombstone before compaction drops it too,
/// in milliseconds: 7 days, as long as the broker keeps the other topics and the
/// consumers remember applied events, so that a reader that keeps a view of
/// `fenceline.status` and is no further behind than that sees the tombstone and
/// drops the task (docs/wire.md, "Tombstones on fenceline.status").
pub const TOMBSTONE_RETENTION_MS: &str = "604800000";

/// Creates the topics that do not exist yet; existing ones are left as they are.
pub async fn ensure_topics(kafka: &KafkaConfig, topics: &[TopicSpec], replication: i32) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> = crate::kafka::producer_config(kafka, "fenceline-admin").create()?;
    let new_topics: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| {
            let topic = NewTopic::new(&t.name, t.partitions, TopicReplication::Fixed(replication));
            if t.compacted {
                topic.set("cleanup.policy", "compact").set("delete.retention.ms", TOMBSTONE_RETENTION_MS)
            } else {
                topic
            }
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&new_topics, &options).await? {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(Error::CreateTopic { topic, reason: code.to_string() }),
        }
    }
    Ok(())
}

/// Every Fenceline topic (docs/architecture.md, "Topics and events"), behind `prefix`.
pub fn fenceline_topics(prefix: &str, partitions: i32) -> Vec<TopicSpec> {
    fenceline_events::topics::ALL
        .iter()
        .map(|(name, compacted)| TopicSpec {
            name: fenceline_events::topics::named(prefix, name),
            partitions,
            compacted: *compacted,
        })
        .collect()
}
