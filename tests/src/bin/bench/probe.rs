//! What the benchmark reads from the running system: each task's instants where they
//! are recorded (the reconciler's grants, the fake provider's call log for
//! calls, intake's read model for `succeeded`), Postgres commits and round trips,
//! Kafka records written and delivered, and the memory, CPU, context switches and
//! threads of every process.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Value, json};

/// Each task's first grant, in microseconds since the epoch: `granted_at` of the
/// grants the reconciler watches (it keeps each `AttemptGranted` whole; the
/// scheduler's outbox keeps none once they are published).
pub async fn grants(pool: &sqlx::PgPool) -> HashMap<String, i64> {
    let rows: Vec<sqlx::types::Json<fenceline_events::AttemptGranted>> =
        sqlx::query_scalar("SELECT granted FROM reconciler.grants").fetch_all(pool).await.unwrap_or_default();
    let mut first = HashMap::new();
    for sqlx::types::Json(grant) in rows {
        let at = first.entry(grant.task_id.to_string()).or_insert(i64::MAX);
        *at = (*at).min(grant.granted_at.0);
    }
    first
}

/// When each task reached `succeeded`, as intake's read model holds it (the
/// status's own time, the scheduler's decision), in microseconds since the epoch.
pub async fn succeeded(pool: &sqlx::PgPool) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT task_id::text, (extract(epoch FROM updated_at) * 1e6)::bigint FROM intake.task_view \
         WHERE state = 'succeeded'",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.into_iter().collect()
}

/// The calls a fake provider received for a run's tasks: the `bench` tag their
/// input carries (`input.task.bench`), with the arrival time, operation, outcome
/// and whether it was charged.
#[derive(Debug, Clone)]
pub struct Call {
    pub tag: String,
    pub operation: String,
    pub received_at_us: i64,
    pub outcome: String,
    pub charged: bool,
}

pub async fn calls(provider: &fenceline_tests::system::FakeProvider) -> Vec<Call> {
    provider
        .calls()
        .await
        .iter()
        .filter_map(|call| {
            Some(Call {
                tag: call["input"]["task"]["bench"].as_str()?.to_owned(),
                operation: call["operation"].as_str().unwrap_or_default().to_owned(),
                received_at_us: call["received_at_us"].as_i64()?,
                outcome: call["outcome"].as_str().unwrap_or_default().to_owned(),
                charged: call["charged"].as_bool().unwrap_or(false),
            })
        })
        .collect()
}

/// Transactions committed in database `name` so far (`pg_stat_database`), read
/// through `admin`, a connection to another database, so that reading it commits
/// nothing in `name`. Backends report their counts at most every second while busy.
pub async fn commits(admin: &sqlx::PgPool, name: &str) -> i64 {
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(name)
        .fetch_one(admin)
        .await
        .unwrap_or(0)
}

/// Rows written in `schema` so far (inserted, updated, deleted), and rows read by
/// sequential scans of its tables (`pg_stat_user_tables`). The second shows a plan
/// that reads a whole table where an index would do.
pub async fn row_counts(pool: &sqlx::PgPool, schema: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint, \
         coalesce(sum(seq_tup_read), 0)::bigint FROM pg_stat_user_tables WHERE schemaname = $1",
    )
    .bind(schema)
    .fetch_one(pool)
    .await
    .unwrap_or((0, 0))
}

/// Records on the topics under `prefix` so far, counted by the broker: written
/// (the sum of every partition's end offset) and delivered to the consumer groups
/// under `prefix` and applied by them (the sum of the offsets each group committed
/// on those partitions; a group stores an offset once its database committed, and
/// commits stored offsets every second). The producers are not transactional, so
/// offsets count records alone.
pub async fn kafka_records(brokers: String, prefix: String) -> KafkaRecords {
    tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_secs(10);
        let consumer: BaseConsumer = match rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create() {
            Ok(consumer) => consumer,
            Err(_) => return KafkaRecords::default(),
        };
        let Ok(metadata) = consumer.fetch_metadata(None, timeout) else { return KafkaRecords::default() };
        let mut written = 0;
        let mut partitions = TopicPartitionList::new();
        for topic in metadata.topics().iter().filter(|t| t.name().starts_with(&prefix)) {
            for partition in topic.partitions() {
                partitions.add_partition(topic.name(), partition.id());
                if let Ok((_, high)) = consumer.fetch_watermarks(topic.name(), partition.id(), timeout) {
                    written += high;
                }
            }
        }
        let mut delivered = 0;
        let groups = consumer.fetch_group_list(None, timeout);
        for group in groups.iter().flat_map(|list| list.groups()).filter(|g| g.name().starts_with(&prefix)) {
            let reader: Result<BaseConsumer, _> = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", group.name())
                .set("enable.auto.commit", "false")
                .create();
            let Ok(committed) = reader.and_then(|r| r.committed_offsets(partitions.clone(), timeout)) else { continue };
            delivered += committed
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(offset) => Some(offset),
                    _ => None,
                })
                .sum::<i64>();
        }
        KafkaRecords { written, delivered }
    })
    .await
    .unwrap_or_default()
}

/// Records written to a system's topics and delivered to its consumer groups.
#[derive(Debug, Clone, Copy, Default)]
pub struct KafkaRecords {
    pub written: i64,
    pub delivered: i64,
}

/// A process to watch, by name; `with_children` adds its children (Postgres's
/// backends, a Python peer's worker); `postgres_client` counts the round trips its
/// connections to the Postgres server make.
#[derive(Debug, Clone)]
pub struct Watched {
    pub name: String,
    pub pid: u32,
    pub with_children: bool,
    pub postgres_client: bool,
}

/// Linux's USER_HZ, the unit of `/proc`'s CPU times; `getconf CLK_TCK` is 100 on
/// every common kernel.
const TICKS_PER_S: f64 = 100.0;

/// Resident memory (kB) and CPU time (clock ticks) of a process now.
fn read_process(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at state (3).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((rss, utime + stime))
}

/// What this process has used so far: CPU seconds, and the voluntary context
/// switches of the threads it has now.
#[derive(Debug, Clone, Copy)]
pub struct OwnUsage {
    pub cpu_s: f64,
    pub voluntary_switches: u64,
}

/// This process's [`OwnUsage`] now.
pub fn own_usage() -> OwnUsage {
    let pid = std::process::id();
    let ticks = read_process(pid).map_or(0, |(_, ticks)| ticks);
    OwnUsage { cpu_s: ticks as f64 / TICKS_PER_S, voluntary_switches: thread_switches(pid).values().sum() }
}

/// Voluntary context switches of each thread of a process now, by thread id.
/// `/proc/<pid>/status` counts the main thread's alone, so every thread's own
/// status is read; a thread that ended is no longer there.
fn thread_switches(pid: u32) -> HashMap<u32, u64> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return HashMap::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
            let switches = status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse().ok())?;
            Some((tid, switches))
        })
        .collect()
}

/// The socket inodes a process holds open (`/proc/<pid>/fd`).
fn socket_inodes(pid: u32) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    entries
        .filter_map(|e| {
            let target = std::fs::read_link(e.ok()?.path()).ok()?;
            target.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// The port of the test stack's Postgres server.
pub fn postgres_port() -> Option<u16> {
    let url = std::env::var("FENCELINE_TEST_DATABASE_URL").ok()?;
    let host = url.split('@').nth(1)?.split('/').next()?;
    host.rsplit_once(':')?.1.parse().ok()
}

/// Requests each client connection to the server on `port` has sent so far, by the
/// socket's inode: the data segments it sent (`ss`, the kernel's `tcp_info`). A
/// client writes each request (a statement, or the `Sync` of a pool's ping) in one
/// segment and waits for the answer, so these are its round trips. None if `ss`
/// is not there.
fn client_segments(port: u16) -> Option<HashMap<u64, u64>> {
    let output = std::process::Command::new("ss")
        .args(["-tinHe", "state", "established", &format!("( dport = :{port} )")])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mut out = HashMap::new();
    let mut inode = None;
    for line in text.lines() {
        let field =
            |name: &str| line.split_whitespace().find_map(|f| f.strip_prefix(name)).and_then(|v| v.parse::<u64>().ok());
        if let Some(ino) = field("ino:") {
            inode = Some(ino);
        } else if let (Some(ino), Some(segments)) = (inode, field("data_segs_out:")) {
            out.insert(ino, segments);
            inode = None;
        }
    }
    Some(out)
}

fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).ok().is_some_and(|stat| {
                stat.rfind(')')
                    .and_then(|i| stat[i + 2..].split_whitespace().nth(1).map(str::to_owned))
                    .is_some_and(|ppid| ppid == pid.to_string())
            })
        })
        .collect()
}

/// What one sample saw of a watched process: RSS in kB, CPU ticks per pid,
/// voluntary context switches per thread, threads, and requests sent per
/// connection to Postgres (by socket inode, from `segments`, the server's client
/// connections).
#[derive(Default)]
struct Seen {
    rss: u64,
    ticks: HashMap<u32, u64>,
    switches: HashMap<u32, u64>,
    threads: u64,
    segments: HashMap<u64, u64>,
}

fn sample(watched: &Watched, segments: Option<&HashMap<u64, u64>>) -> Seen {
    let mut pids = vec![watched.pid];
    if watched.with_children {
        pids.extend(children_of(watched.pid));
    }
    let mut seen = Seen::default();
    for pid in pids {
        if let Some((kb, t)) = read_process(pid) {
            seen.rss += kb;
            seen.ticks.insert(pid, t);
            let switches = thread_switches(pid);
            seen.threads += switches.len() as u64;
            seen.switches.extend(switches);
            if watched.postgres_client
                && let Some(segments) = segments
            {
                for inode in socket_inodes(pid) {
                    if let Some(sent) = segments.get(&inode) {
                        seen.segments.insert(inode, *sent);
                    }
                }
            }
        }
    }
    seen
}

/// Peak RSS, CPU seconds, voluntary context switches, peak threads and Postgres
/// round trips of each watched process over a sampled period.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub peak_rss_mb: f64,
    pub cpu_s: f64,
    pub voluntary_switches: u64,
    pub peak_threads: u64,
    /// None where the process is not a Postgres client or `ss` is missing.
    pub postgres_round_trips: Option<u64>,
}

/// What a counter grew by between its first and last sample, by key. A key seen
/// first after the first sample (a thread, a backend or a connection that started
/// meanwhile) counts from zero; one that ended before the last sample keeps what
/// its last sample saw.
#[derive(Default)]
struct Growth<K> {
    first: HashMap<K, u64>,
    last: HashMap<K, u64>,
}

impl<K: std::hash::Hash + Eq + Copy> Growth<K> {
    fn add(&mut self, values: &HashMap<K, u64>, initial: bool) {
        for (key, value) in values {
            self.first.entry(*key).or_insert(if initial { *value } else { 0 });
            self.last.insert(*key, *value);
        }
    }

    fn total(&self) -> u64 {
        self.last.iter().map(|(key, value)| value.saturating_sub(self.first.get(key).copied().unwrap_or(0))).sum()
    }
}

/// Samples `watched` every 500 ms until `stop`; CPU counts what each pid used
/// between its first and last sample (a child that lived only between two samples
/// is missed); context switches and round trips count what each thread and
/// connection did between the first sample and its last (one that ended between
/// two samples loses what it did after the last). `postgres_port` is the server
/// whose clients' round trips are counted.
pub async fn sample_until(
    watched: Vec<Watched>,
    postgres_port: Option<u16>,
    stop: tokio_util::sync::CancellationToken,
) -> HashMap<String, Usage> {
    let counting_trips = postgres_port.is_some() && watched.iter().any(|w| w.postgres_client);
    let mut first: Vec<HashMap<u32, u64>> = Vec::new();
    let mut last: Vec<HashMap<u32, u64>> = Vec::new();
    let mut peak: Vec<u64> = vec![0; watched.len()];
    let mut threads: Vec<u64> = vec![0; watched.len()];
    let mut switches: Vec<Growth<u32>> = watched.iter().map(|_| Growth::default()).collect();
    let mut trips: Vec<Growth<u64>> = watched.iter().map(|_| Growth::default()).collect();
    let mut ss_worked = false;
    let mut initial = true;
    loop {
        let segments = if counting_trips { postgres_port.and_then(client_segments) } else { None };
        ss_worked |= segments.is_some();
        for (i, w) in watched.iter().enumerate() {
            let seen = sample(w, segments.as_ref());
            peak[i] = peak[i].max(seen.rss);
            threads[i] = threads[i].max(seen.threads);
            switches[i].add(&seen.switches, initial);
            trips[i].add(&seen.segments, initial);
            if first.len() <= i {
                first.push(seen.ticks.clone());
                last.push(seen.ticks);
            } else {
                for (pid, t) in seen.ticks {
                    first[i].entry(pid).or_insert(t);
                    last[i].insert(pid, t);
                }
            }
        }
        initial = false;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.cancelled() => break,
        }
    }
    watched
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let used: u64 = last
                .get(i)
                .map(|l| l.iter().map(|(pid, t)| t.saturating_sub(first[i].get(pid).copied().unwrap_or(*t))).sum())
                .unwrap_or(0);
            let usage = Usage {
                peak_rss_mb: peak[i] as f64 / 1024.0,
                cpu_s: used as f64 / TICKS_PER_S,
                voluntary_switches: switches[i].total(),
                peak_threads: threads[i],
                postgres_round_trips: (w.postgres_client && ss_worked).then(|| trips[i].total()),
            };
            (w.name.clone(), usage)
        })
        .collect()
}

/// The Postgres server's main process (`postmaster.pid` in its data folder) and the
/// broker's (`broker.pid`, deploy/local/broker), as the stack script started them.
pub fn infrastructure() -> Vec<Watched> {
    let mut out = Vec::new();
    let read_pid = |path: std::path::PathBuf| -> Option<u32> {
        std::fs::read_to_string(path).ok()?.lines().next()?.trim().parse().ok()
    };
    if let Ok(data) = std::env::var("FENCELINE_TEST_PG_DATA") {
        let data = std::path::PathBuf::from(data);
        if let Some(pid) = read_pid(data.join("postmaster.pid")) {
            out.push(Watched { name: "postgres".into(), pid, with_children: true, postgres_client: false });
        }
        // The broker's folder is the data folder's sibling's (deploy/local/stack).
        if let Some(pid) =
            data.parent().and_then(|pg| pg.parent()).and_then(|dir| read_pid(dir.join("kafka/broker.pid")))
        {
            out.push(Watched { name: "broker".into(), pid, with_children: true, postgres_client: false });
        }
    }
    out
}

pub fn usage_json(usage: &HashMap<String, Usage>, seconds: f64, tasks: u64) -> Value {
    let mut names: Vec<&String> = usage.keys().collect();
    names.sort();
    Value::Object(
        names
            .into_iter()
            .map(|name| {
                let u = &usage[name];
                let per_task = |count: u64| round(count as f64 / (tasks.max(1) as f64), 2);
                let mut figures = json!({
                    "peak_rss_mb": round(u.peak_rss_mb, 1),
                    "cpu_s": round(u.cpu_s, 2),
                    "cpu_percent_of_a_core": round(100.0 * u.cpu_s / seconds.max(1e-9), 1),
                    "cpu_ms_per_task": round(1e3 * u.cpu_s / (tasks.max(1) as f64), 3),
                    "voluntary_ctx_switches_per_task": per_task(u.voluntary_switches),
                    "peak_threads": u.peak_threads,
                });
                if let Some(trips) = u.postgres_round_trips {
                    figures["postgres_round_trips_per_task"] = json!(per_task(trips));
                }
                (name.clone(), figures)
            })
            .collect(),
    )
}

pub fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Starts counting statements afresh (`pg_stat_statements`, which the stack script
/// preloads for the benchmark); false where the extension is not there.
pub async fn reset_statements(admin: &sqlx::PgPool) -> bool {
    let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(admin).await;
    sqlx::query("SELECT pg_stat_statements_reset()").execute(admin).await.is_ok()
}

/// What database `name` ran since the reset: every statement's calls and time, and
/// the `limit` statements that took the most time (calls, milliseconds, text).
#[derive(Debug, Clone, Default)]
pub struct Statements {
    pub calls: i64,
    pub exec_ms: f64,
    pub top: Vec<(i64, f64, String)>,
}

pub async fn statements(admin: &sqlx::PgPool, name: &str, limit: i64) -> Statements {
    let (calls, exec_ms): (i64, f64) = sqlx::query_as(
        "SELECT coalesce(sum(s.calls), 0)::bigint, coalesce(sum(s.total_exec_time), 0)::float8 \
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
    )
    .bind(name)
    .fetch_one(admin)
    .await
    .unwrap_or_default();
    let top = sqlx::query_as(
        "SELECT s.calls::bigint, s.total_exec_time::float8, left(regexp_replace(s.query, '\\s+', ' ', 'g'), 140) \
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1 \
         ORDER BY s.total_exec_time DESC LIMIT $2",
    )
    .bind(name)
    .bind(limit)
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    Statements { calls, exec_ms, top }
}
