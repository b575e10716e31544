//! Timer benchmark: 10,000 tasks whose `not_before` falls due within one minute,
//! through a real scheduler process; lateness is the grant's time minus the due
//! time, read from the `AttemptGranted` events in the scheduler's outbox (the
//! grant's durable record; the broker's delivery afterwards is not the timer). The baseline,
//! measured in the same run on the same machine, is the lateness of the same
//! schedule on in-process tokio timers: what the machine itself adds. Prints each
//! run and the medians. Settings: `BENCH_TIMERS` (default 10000), `BENCH_SPREAD_S`
//! (default 60), `BENCH_LEAD_S` (default 300: the first timer falls due this long
//! after publishing, so the broker has delivered every task to the scheduler before
//! the minute starts; the time it took is printed), `BENCH_RUNS` (default 3). Run
//! through `deploy/local/stack bench`.

#![allow(clippy::print_stdout)]

use std::time::Duration;

use fenceline_events::{Event, TaskAccepted, Timestamp};
use fenceline_tests::system::{Caps, System};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(&values, 50.0)
}

/// Lateness (ms) of in-process timers on the same schedule.
async fn baseline(dues: &[i64]) -> Vec<f64> {
    let mut handles = Vec::with_capacity(dues.len());
    for due in dues.iter().copied() {
        handles.push(tokio::spawn(async move {
            let wait = due - Timestamp::now().0;
            tokio::time::sleep(Duration::from_micros(u64::try_from(wait).unwrap_or(0))).await;
            (Timestamp::now().0 - due) as f64 / 1000.0
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.unwrap_or(f64::NAN));
    }
    out
}

/// Waits until the scheduler holds `timers` tasks; returns how long that took after
/// `since`, or None if the first timer fell due first.
async fn taken_in(system: &System, timers: usize, since: std::time::Instant, first_due: i64) -> Option<Duration> {
    loop {
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks").fetch_one(&system.pool).await.unwrap_or(0);
        if held as usize >= timers {
            return Some(since.elapsed());
        }
        if Timestamp::now().0 >= first_due {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn scheduler_run(timers: usize, spread_s: u64, lead_s: u64) -> (Vec<f64>, Vec<f64>) {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.set_provider_limits("img", 1_000_000, 1_000_000.0, 1_000_000.0);
    system.spawn("scheduler", "scheduler", &[("RUST_LOG", "warn".into())]).await;
    // Due from `lead_s` from now (time to publish and take in), spread over `spread_s`.
    let published = std::time::Instant::now();
    let first = Timestamp::now().0 + (lead_s * 1_000_000) as i64;
    let step = (spread_s * 1_000_000) as i64 / timers as i64;
    let dues: Vec<i64> = (0..timers as i64).map(|n| first + n * step).collect();
    let ids = system
        .submit_many_with("bench", "image.generate", timers, |n, accepted: &mut TaskAccepted| {
            accepted.not_before = Some(Timestamp(dues[n]));
        })
        .await;
    let due_of: std::collections::HashMap<_, _> = ids.iter().copied().zip(dues.iter().copied()).collect();
    match taken_in(&system, timers, published, first).await {
        Some(took) => {
            println!("  the scheduler held all {timers} tasks {:.1} s after publishing began", took.as_secs_f64())
        }
        None => println!("  the first timer fell due before the scheduler held every task: raise BENCH_LEAD_S"),
    }
    let base = tokio::spawn({
        let dues = dues.clone();
        async move { baseline(&dues).await }
    });
    // A timer fired when the scheduler committed the grant: read the grants from its
    // outbox (where they are durable), not back through the broker, whose delivery is
    // not the timer.
    let wait = Duration::from_micros(u64::try_from(dues[dues.len() - 1] - Timestamp::now().0).unwrap_or(0));
    tokio::time::sleep(wait + Duration::from_secs(10)).await;
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT payload FROM scheduler.outbox WHERE event_type = 'AttemptGranted'")
            .fetch_all(&system.pool)
            .await
            .unwrap_or_default();
    let mut late = Vec::with_capacity(timers);
    for payload in &payloads {
        if let Ok(Event::AttemptGranted(g)) = fenceline_events::decode(payload)
            && let Some(due) = due_of.get(&g.task_id)
        {
            late.push((g.granted_at.0 - due) as f64 / 1000.0);
        }
    }
    (late, base.await.unwrap_or_default())
}

#[tokio::main]
async fn main() {
    let timers = setting("BENCH_TIMERS", 10_000) as usize;
    let spread = setting("BENCH_SPREAD_S", 60);
    let runs = setting("BENCH_RUNS", 3);
    let lead = setting("BENCH_LEAD_S", 300);
    println!("{timers} timers due within {spread} s, {runs} runs (lateness in ms: fired minus due)");
    let (mut p50s, mut p99s, mut b50s, mut b99s) = (vec![], vec![], vec![], vec![]);
    for run in 1..=runs {
        let (mut late, mut base) = scheduler_run(timers, spread, lead).await;
        late.sort_by(f64::total_cmp);
        base.sort_by(f64::total_cmp);
        let fired = late.len();
        let (p50, p99, b50, b99) =
            (percentile(&late, 50.0), percentile(&late, 99.0), percentile(&base, 50.0), percentile(&base, 99.0));
        println!(
            "run {run}: scheduler fired {fired}/{timers}  p50 {p50:>8.1}  p99 {p99:>8.1}   baseline (tokio timers) p50 {b50:>6.1}  p99 {b99:>6.1}"
        );
        p50s.push(p50);
        p99s.push(p99);
        b50s.push(b50);
        b99s.push(b99);
    }
    println!(
        "median: scheduler p50 {:.1} ms, p99 {:.1} ms; baseline p50 {:.1} ms, p99 {:.1} ms",
        median(p50s),
        median(p99s),
        median(b50s),
        median(b99s)
    );
}
