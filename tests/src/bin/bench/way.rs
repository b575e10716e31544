//! A task's way to its paid call, hop by hop: the instants each service records on
//! a task's way, read after a run, and the time between each and the next.

use std::collections::HashMap;
use std::time::Duration;

use fenceline_events::header_names;
use fenceline_events::topics;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Value, json};

/// An instant read from a service's database: its name, the service, and the
/// query giving each task's (`task_id` text, microseconds since the epoch). Times
/// set with `now()` are the start of the transaction that wrote them.
type Read = (&'static str, &'static str, &'static str);

const INSERTED: Read = (
    "inserted",
    "executor",
    "SELECT task_id::text, (extract(epoch FROM created_at) * 1e6)::bigint FROM executor.executions",
);
const CLAIMED: Read = ("claimed", "executor", "SELECT task_id::text, first_claimed_at_us FROM executor.executions");
/// An attempt's last call intent: its first step's only in a kind of one step.
const INTENT: Read = ("intent", "reconciler", "SELECT task_id::text, intent_at_us FROM reconciler.calls");

/// A task's way to its paid call, after its submission was due: each instant's
/// name, in the order a task passes them, and what the hop ending there holds.
/// `accepted` and `accepted out` are intake's `TaskAccepted` record as written
/// (its `produced_at` header, in the submission's transaction) and as its relay
/// handed it to the producer (the record's timestamp); `grant out` is the
/// scheduler's `AttemptGranted` handed to the producer; `called` is the fake
/// provider's arrival time. `granted` is the start of the dispatch round that
/// granted and `inserted` that of the executor's consumer transaction: the hop
/// into either is short by that round's or transaction's time, and the hop out
/// of it longer by as much.
///
/// What each hop holds, by the instant it ends at: `accepted`, intake's
/// submission queue and statement; `accepted out`, its commit and its relay's wake
/// and read; `granted`, the producer's linger (and the relay's pace when it is
/// busy), the broker, the scheduler's consumer and commit, its notification;
/// `grant out`, the dispatch round and its commit, the scheduler's relay;
/// `inserted`, the linger and pace, the broker, the executor's
/// consumer; `claimed`, the consumer's commit, the hand-off to a worker, its
/// claim; `intent`, the claim's commit and the fenced call intent; `called`, the
/// intent's commit and the request on its way.
pub const HOPS: [&str; 8] =
    ["accepted", "accepted out", "granted", "grant out", "inserted", "claimed", "intent", "called"];

/// Each task's earliest instant of every kind in [`HOPS`] but `called`, by task
/// id, in microseconds since the epoch: `granted` as the caller read it, the
/// databases' through `pool` (each service's), the records' from the topics
/// under `prefix` at `brokers`.
pub async fn instants(
    granted: HashMap<String, i64>,
    pool: impl Fn(&str) -> sqlx::PgPool,
    brokers: String,
    prefix: String,
) -> HashMap<&'static str, HashMap<String, i64>> {
    let mut read = HashMap::from([("granted", granted)]);
    for (name, service, query) in [INSERTED, CLAIMED, INTENT] {
        let rows: Vec<(Option<String>, Option<i64>)> =
            sqlx::query_as(query).fetch_all(&pool(service)).await.unwrap_or_default();
        read.insert(name, earliest(rows.into_iter().filter_map(|(task, at)| Some((task?, at?)))));
    }
    let records = tokio::task::spawn_blocking(move || {
        let accepted = records(&brokers, &topics::named(&prefix, topics::TASKS), "TaskAccepted");
        let granted = records(&brokers, &topics::named(&prefix, topics::DISPATCH), "AttemptGranted");
        (accepted, granted)
    })
    .await
    .unwrap_or_default();
    let (accepted, granted) = records;
    read.insert("accepted", earliest(accepted.iter().map(|r| (r.0.clone(), r.1))));
    read.insert("accepted out", earliest(accepted.into_iter().map(|r| (r.0, r.2))));
    read.insert("grant out", earliest(granted.into_iter().map(|r| (r.0, r.2))));
    read
}

fn earliest(pairs: impl Iterator<Item = (String, i64)>) -> HashMap<String, i64> {
    let mut first: HashMap<String, i64> = HashMap::new();
    for (task, at) in pairs {
        let earliest = first.entry(task).or_insert(i64::MAX);
        *earliest = (*earliest).min(at);
    }
    first
}

/// Every record of `event_type` on `topic` so far: its key (the task), when it was
/// written (its `produced_at` header) and when its relay handed it to the producer
/// (the record's timestamp), both in microseconds since the epoch.
fn records(brokers: &str, topic: &str, event_type: &str) -> Vec<(String, i64, i64)> {
    let timeout = Duration::from_secs(10);
    let Ok(consumer) = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.auto.commit", "false")
        .set("group.id", "fenceline-bench-way")
        .create::<BaseConsumer>()
    else {
        return Vec::new();
    };
    let Ok(metadata) = consumer.fetch_metadata(Some(topic), timeout) else { return Vec::new() };
    let mut assigned = TopicPartitionList::new();
    let mut left = 0i64;
    for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
        if let Ok((low, high)) = consumer.fetch_watermarks(topic, partition.id(), timeout) {
            left += high - low;
            let _ = assigned.add_partition_offset(topic, partition.id(), Offset::Beginning);
        }
    }
    if consumer.assign(&assigned).is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut quiet = 0;
    while left > 0 && quiet < 20 {
        let Some(Ok(message)) = consumer.poll(Duration::from_millis(250)) else {
            quiet += 1;
            continue;
        };
        quiet = 0;
        left -= 1;
        let header =
            |name: &str| message.headers().and_then(|hs| hs.iter().find(|h| h.key == name).and_then(|h| h.value));
        if header(header_names::EVENT_TYPE) != Some(event_type.as_bytes()) {
            continue;
        }
        let produced = header(header_names::PRODUCED_AT)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.parse::<i64>().ok());
        let (Some(key), Some(produced), Some(handed)) =
            (message.key().and_then(|k| std::str::from_utf8(k).ok()), produced, message.timestamp().to_millis())
        else {
            continue;
        };
        out.push((key.to_owned(), produced, handed * 1000));
    }
    out
}

/// The hops of the tasks `submitted` (task id, due instant, first provider call),
/// as percentiles in milliseconds under each hop's name. A task missing an
/// instant gives no figure for the hops on either side of it.
pub fn hops(
    submitted: &[(String, i64, Option<i64>)],
    instants: &HashMap<&'static str, HashMap<String, i64>>,
    percentiles: impl Fn(Vec<f64>) -> Value,
) -> Value {
    let mut spans: Vec<Vec<f64>> = vec![Vec::new(); HOPS.len()];
    for (task, due, called) in submitted {
        let mut way: Vec<Option<i64>> = vec![Some(*due)];
        way.extend(HOPS[..HOPS.len() - 1].iter().map(|name| instants.get(name).and_then(|by| by.get(task)).copied()));
        way.push(*called);
        for (hop, ends) in way.windows(2).enumerate() {
            if let [Some(from), Some(to)] = ends {
                spans[hop].push((to - from) as f64 / 1e3);
            }
        }
    }
    let mut out = serde_json::Map::new();
    for (name, values) in HOPS.iter().zip(spans) {
        out.insert((*name).to_owned(), percentiles(values));
    }
    json!(out)
}

/// One line of the hops' p50 and p99, in milliseconds.
pub fn line(hops: &Value) -> String {
    HOPS.iter()
        .map(|name| {
            let at = |q: &str| hops[*name][q].as_f64().map_or("-".to_owned(), |v| format!("{v:.1}"));
            format!("{name} {} ({})", at("p50"), at("p99"))
        })
        .collect::<Vec<_>>()
        .join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p50(mut values: Vec<f64>) -> Value {
        values.sort_by(f64::total_cmp);
        json!({"p50": values.get(values.len().saturating_sub(1) / 2), "n": values.len()})
    }

    #[test]
    fn hops_are_the_time_between_successive_instants_and_a_gap_drops_both_sides() {
        let mut instants: HashMap<&'static str, HashMap<String, i64>> = HashMap::new();
        let at = |pairs: &[(&str, i64)]| pairs.iter().map(|(t, v)| ((*t).to_owned(), *v)).collect();
        instants.insert("accepted", at(&[("a", 10_000), ("b", 20_000)]));
        instants.insert("accepted out", at(&[("a", 11_000), ("b", 21_000)]));
        instants.insert("granted", at(&[("a", 12_000)]));
        instants.insert("grant out", at(&[("a", 14_000), ("b", 29_000)]));
        instants.insert("inserted", at(&[("a", 15_000), ("b", 30_000)]));
        instants.insert("claimed", at(&[("a", 15_500), ("b", 31_000)]));
        instants.insert("intent", at(&[("a", 16_000), ("b", 32_000)]));
        let submitted = vec![("a".to_owned(), 0, Some(17_000)), ("b".to_owned(), 0, None)];
        let hops = hops(&submitted, &instants, p50);
        assert_eq!(hops["accepted"]["n"], 2);
        assert_eq!(hops["granted"], json!({"p50": 1.0, "n": 1}), "b has no grant: no hop into it");
        assert_eq!(hops["grant out"], json!({"p50": 2.0, "n": 1}), "nor out of it");
        assert_eq!(hops["inserted"]["n"], 2);
        assert_eq!(hops["claimed"]["p50"], 0.5);
        assert_eq!(hops["called"], json!({"p50": 1.0, "n": 1}));
        assert!(line(&hops).starts_with("accepted 10.0 ("));
    }
}
