//! Timer benchmark: 10,000 tasks whose `not_before` falls due within one minute,
//! through a real scheduler process; lateness is the grant's time minus the due
//! time, read from the `AttemptGranted` events in the scheduler's outbox (the
//! grant's durable record; the broker's delivery afterwards is not the timer): at
//! the decision (`granted_at`) and at its publication to the broker, after the
//! round's commit (`published_at`). The baseline,
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

async fn scheduler_run(timers: usize, spread_s: u64, lead_s: u64) -> Lateness {
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
    let grants: Vec<(Vec<u8>, Option<i64>)> = sqlx::query_as(
        "SELECT payload, (extract(epoch FROM published_at) * 1e6)::bigint FROM scheduler.outbox \
         WHERE event_type = 'AttemptGranted'",
    )
    .fetch_all(&system.pool)
    .await
    .unwrap_or_default();
    let mut lateness = Lateness::default();
    for (payload, published_at) in &grants {
        if let Ok(Event::AttemptGranted(g)) = fenceline_events::decode(payload)
            && let Some(due) = due_of.get(&g.task_id)
        {
            lateness.granted.push((g.granted_at.0 - due) as f64 / 1000.0);
            if let Some(published) = published_at {
                lateness.published.push((published - due) as f64 / 1000.0);
            }
        }
    }
    lateness.baseline = base.await.unwrap_or_default();
    lateness
}

/// Lateness in milliseconds of one run: at the grant's decision (`granted_at`), at
/// its publication to the broker (after the commit), and of the tokio baseline.
#[derive(Debug, Default)]
struct Lateness {
    granted: Vec<f64>,
    published: Vec<f64>,
    baseline: Vec<f64>,
}

#[tokio::main]
async fn main() {
    let timers = setting("BENCH_TIMERS", 10_000) as usize;
    let spread = setting("BENCH_SPREAD_S", 60);
    let runs = setting("BENCH_RUNS", 3);
    let lead = setting("BENCH_LEAD_S", 300);
    println!("{timers} timers due within {spread} s, {runs} runs (lateness in ms: fired minus due)");
    let mut figures: [Vec<f64>; 6] = Default::default();
    for run in 1..=runs {
        let mut lateness = scheduler_run(timers, spread, lead).await;
        for values in [&mut lateness.granted, &mut lateness.published, &mut lateness.baseline] {
            values.sort_by(f64::total_cmp);
        }
        let run_figures = [
            percentile(&lateness.granted, 50.0),
            percentile(&lateness.granted, 99.0),
            percentile(&lateness.published, 50.0),
            percentile(&lateness.published, 99.0),
            percentile(&lateness.baseline, 50.0),
            percentile(&lateness.baseline, 99.0),
        ];
        println!(
            "run {run}: fired {}/{timers}; granted p50 {:>8.1} p99 {:>8.1}; published p50 {:>8.1} p99 {:>8.1}; \
             baseline (tokio timers) p50 {:>6.1} p99 {:>6.1}",
            lateness.granted.len(),
            run_figures[0],
            run_figures[1],
            run_figures[2],
            run_figures[3],
            run_figures[4],
            run_figures[5],
        );
        for (all, figure) in figures.iter_mut().zip(run_figures) {
            all.push(figure);
        }
    }
    let [g50, g99, p50, p99, b50, b99] = figures.map(median);
    println!(
        "median: granted p50 {g50:.1} ms, p99 {g99:.1} ms; published p50 {p50:.1} ms, p99 {p99:.1} ms; \
         baseline p50 {b50:.1} ms, p99 {b99:.1} ms"
    );
}
