//! The benchmark's clients: submissions to intake's `POST /v1/tasks` on a schedule
//! (open loop) or holding a number of tasks between submit and `succeeded` (closed
//! loop), each submission's instants recorded for the latency figures.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How submissions are paced.
#[derive(Debug, Clone)]
pub enum Pace {
    /// Submission `i` is due at `i / rate` seconds, answered or not: latency counts
    /// from when it was due, so a stalled server is not hidden by a waiting client.
    Open { rate: f64 },
    /// At most `in_flight` tasks between submit and `succeeded` (`finished` counts
    /// the latter); a submission is due when there is room.
    Window { in_flight: u64, finished: Arc<AtomicU64> },
}

/// One submission as the client saw it.
#[derive(Debug, Clone)]
pub struct Submission {
    /// Its index in the run, which its task's input carries (`{"bench": "<tag>-<i>"}`).
    pub index: u64,
    pub task_id: Option<String>,
    /// When it was due and when intake answered, in microseconds since the epoch.
    pub due_us: i64,
    pub answered_us: i64,
    pub accepted: bool,
    /// The status intake answered; 0 when it did not answer.
    pub status: u16,
}

/// Where and as whom to submit.
#[derive(Debug, Clone)]
pub struct Target {
    pub base: String,
    pub token: String,
    pub kind: String,
    /// Tags this run's inputs and idempotency keys.
    pub tag: String,
}

pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn submit(agent: &ureq::Agent, target: &Target, index: u64) -> (u16, Option<String>) {
    let body = serde_json::json!({"kind": target.kind, "input": {"bench": format!("{}-{index}", target.tag)}});
    let answer = agent
        .post(format!("{}/v1/tasks", target.base))
        .header("Authorization", format!("Bearer {}", target.token))
        .header("Idempotency-Key", format!("{}-{index}", target.tag))
        .header("Content-Type", "application/json")
        .send(body.to_string());
    match answer {
        Ok(mut response) if response.status() == 202 => {
            let text = response.body_mut().read_to_string().unwrap_or_default();
            let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            (202, value["task_id"].as_str().map(str::to_owned))
        }
        Ok(mut response) => {
            let _ = response.body_mut().read_to_vec();
            (response.status().as_u16(), None)
        }
        Err(_) => (0, None),
    }
}

/// Where the ids of accepted tasks are told as soon as intake answers
/// ([`count_finished`] follows them).
pub type Accepted = tokio::sync::mpsc::UnboundedSender<uuid::Uuid>;

/// Submits for `seconds` (at most `limit` tasks) from `workers` threads, telling
/// `accepted` each accepted task's id; blocking.
pub fn drive(
    target: &Target,
    pace: &Pace,
    seconds: f64,
    limit: u64,
    workers: usize,
    accepted: Option<Accepted>,
) -> Vec<Submission> {
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now() + Duration::from_millis(50);
    let start_us = unix_us() + 50_000;
    let end = start + Duration::from_secs_f64(seconds);
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (next, stop, target, pace) = (next.clone(), stop.clone(), target.clone(), pace.clone());
            let told = accepted.clone();
            std::thread::spawn(move || {
                let agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .timeout_global(Some(Duration::from_secs(30)))
                    .build()
                    .new_agent();
                let mut out = Vec::new();
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return out;
                    }
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= limit {
                        return out;
                    }
                    let due_us = match &pace {
                        Pace::Open { rate } => {
                            let offset = Duration::from_secs_f64(index as f64 / rate);
                            let due = start + offset;
                            if due >= end {
                                return out;
                            }
                            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                            start_us + i64::try_from(offset.as_micros()).unwrap_or(i64::MAX)
                        }
                        Pace::Window { in_flight, finished } => {
                            while index >= finished.load(Ordering::Relaxed) + in_flight {
                                if Instant::now() >= end {
                                    stop.store(true, Ordering::Relaxed);
                                    return out;
                                }
                                // `finished` moves every 100 ms (`count_finished`): a
                                // shorter nap only takes cores from the measured stack.
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if Instant::now() >= end {
                                stop.store(true, Ordering::Relaxed);
                                return out;
                            }
                            unix_us()
                        }
                    };
                    let (status, task_id) = submit(&agent, &target, index);
                    let accepted = status == 202;
                    if let (Some(told), Some(id)) = (&told, task_id.as_deref().and_then(|id| id.parse().ok())) {
                        let _ = told.send(id);
                    }
                    out.push(Submission { index, task_id, due_us, answered_us: unix_us(), accepted, status });
                }
            })
        })
        .collect();
    let mut all: Vec<Submission> = handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect();
    all.sort_by_key(|s| s.index);
    all
}

/// Counts the run's tasks that reached `succeeded` in intake's read model into
/// `finished`, until `stop`; counts its queries into `queries` (they are commits of
/// the measured database, taken off its figures). Only the tasks told on `accepted`
/// and not yet seen finished are looked up, by id, so a look-up costs what is in
/// flight: counting every task finished since the run began, as it once did, cost
/// the measured database more the longer a run went (a tenth of its time by the
/// end of a minute at 200 tasks/s). It looks every 100 ms, or less often when a
/// look-up is slow, so that it queries at most a tenth of the time.
pub async fn count_finished(
    pool: sqlx::PgPool,
    mut accepted: tokio::sync::mpsc::UnboundedReceiver<uuid::Uuid>,
    finished: Arc<AtomicU64>,
    queries: Arc<AtomicU64>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut pending = std::collections::HashSet::new();
    while !stop.is_cancelled() {
        while let Ok(id) = accepted.try_recv() {
            pending.insert(id);
        }
        let started = Instant::now();
        if !pending.is_empty() {
            let ids: Vec<uuid::Uuid> = pending.iter().copied().collect();
            let done: Vec<uuid::Uuid> = sqlx::query_scalar(
                "SELECT task_id FROM intake.task_view WHERE task_id = ANY($1) AND state = 'succeeded'",
            )
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            queries.fetch_add(1, Ordering::Relaxed);
            for id in &done {
                pending.remove(id);
            }
            finished.fetch_add(done.len() as u64, Ordering::Relaxed);
        }
        let nap = (started.elapsed() * 9).max(Duration::from_millis(100));
        tokio::select! {
            _ = tokio::time::sleep(nap) => {}
            _ = stop.cancelled() => {}
        }
    }
}
