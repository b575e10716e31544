//! Replaying dead letters: each chosen record on `fenceline.deadletter` is produced
//! again to the topic it came from, with its original key, value and headers, so the
//! consumer that refused it applies it once the cause is fixed (a consumer never
//! keeps a dead-lettered event's id as applied).

use std::time::Duration;

use fenceline_config::KafkaConfig;
use fenceline_events::{DeadLetter, Event, topics};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use crate::Error;

/// Which dead letters to replay.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    /// `topic/partition/offset` of the original records (a dead letter's key, and
    /// what the consumer's "record rejected" line names); empty: every letter.
    pub originals: Vec<String>,
    /// Only letters of this consumer group.
    pub consumer: Option<String>,
}

impl Choice {
    fn takes(&self, key: &str, letter: &DeadLetter) -> bool {
        (self.originals.is_empty() || self.originals.iter().any(|o| o == key))
            && self.consumer.as_deref().is_none_or(|c| c == letter.consumer)
    }
}

/// What became of one chosen letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replayed {
    /// Produced again to its topic.
    Sent { original: String, reason: String },
    /// Not produced: the letter does not hold the whole original (it was cut to
    /// fit the broker's limit), so sending it would be a different record.
    Incomplete { original: String },
}

/// Reads every dead letter up to the topic's end and produces each chosen one
/// again to its original topic. Returns what was done with each, in order.
pub async fn replay_dead_letters(kafka: &KafkaConfig, choice: &Choice) -> Result<Vec<Replayed>, Error> {
    let topic = topics::named(&kafka.topic_prefix, topics::DEADLETTER);
    let letters = read_to_end(kafka, &topic)?;
    let producer: FutureProducer = crate::kafka::producer_config(kafka, "fenceline-admin-replay").create()?;
    let mut done = Vec::new();
    for (key, letter) in letters {
        if !choice.takes(&key, &letter) {
            continue;
        }
        if letter.reason.contains(crate::relay::CUT_MARK) {
            done.push(Replayed::Incomplete { original: key });
            continue;
        }
        let headers = letter.original_headers.iter().fold(OwnedHeaders::new(), |acc, h| {
            acc.insert(Header { key: h.name.as_str(), value: h.value.as_ref().map(|v| v.0.as_slice()) })
        });
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&letter.topic).headers(headers);
        if let Some(k) = &letter.original_key {
            record = record.key(k.0.as_slice());
        }
        if let Some(v) = &letter.original_value {
            record = record.payload(v.0.as_slice());
        }
        producer.send(record, Duration::from_secs(30)).await.map_err(|(e, _)| Error::Kafka(e))?;
        done.push(Replayed::Sent { original: key, reason: letter.reason.clone() });
    }
    Ok(done)
}

/// Every dead letter on `topic`, with its key, from the beginning of each partition
/// to the end it had when reading began.
fn read_to_end(kafka: &KafkaConfig, topic: &str) -> Result<Vec<(String, DeadLetter)>, Error> {
    let group = format!("fenceline-admin-replay-{}", uuid::Uuid::now_v7().simple());
    let mut config = crate::kafka::consumer_config(kafka, "fenceline-admin-replay", &group);
    config.set("enable.auto.commit", "false").set("isolation.level", "read_committed");
    let consumer: BaseConsumer = config.create()?;
    let timeout = kafka.connect_timeout();
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let partitions: Vec<i32> = metadata.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
    let mut ends = Vec::new();
    let mut assignment = TopicPartitionList::new();
    for partition in partitions {
        let (low, high) = consumer.fetch_watermarks(topic, partition, timeout)?;
        if high > low {
            ends.push((partition, high));
            assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
        }
    }
    consumer.assign(&assignment)?;
    let mut letters = Vec::new();
    let deadline = std::time::Instant::now() + timeout.max(Duration::from_secs(30));
    let mut next: std::collections::HashMap<i32, i64> = ends.iter().map(|(p, _)| (*p, 0)).collect();
    while ends.iter().any(|(p, end)| next.get(p).copied().unwrap_or(0) < *end) {
        if std::time::Instant::now() > deadline {
            return Err(Error::Read { topic: topic.to_owned(), reason: "not read to its end in time".to_owned() });
        }
        let Some(message) = consumer.poll(Duration::from_millis(500)) else { continue };
        let message = message?;
        next.insert(message.partition(), message.offset() + 1);
        let key = message.key().map(|k| String::from_utf8_lossy(k).into_owned()).unwrap_or_default();
        if let Some(Ok(Event::DeadLetter(letter))) = message.payload().map(fenceline_events::decode) {
            letters.push((key, letter));
        }
    }
    Ok(letters)
}
