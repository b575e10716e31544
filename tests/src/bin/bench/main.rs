//! The benchmark of the real stack (docs/performance.md): every service a process of
//! `fenceline-host` on the test stack's Postgres and broker, a fake provider that
//! answers at once, and clients submitting through intake's API. Prints each run
//! and the medians, writes every figure as JSON and an SVG chart into
//! `BENCH_OUT` (default `bench-results/<time>/`). Scenarios (`BENCH_SCENARIOS`,
//! comma-separated, default all): `throughput`, `loads`, `executors`, `peer`,
//! `tickets`, `backlog`, `admission`, `settings` (`BENCH_TRY` against the
//! defaults, alternating runs), `calls` (what one paid call costs the process that
//! makes it, not in the default set); `peer` runs pgqueuer and the durable engines DBOS and
//! Temporal (`BENCH_PEERS`), and a run with it ends with every system side by side.
//! Run through `deploy/local/stack bench`; the settings are listed in
//! docs/performance.md. `bench chart FILE.json` draws the chart of figures written
//! before.

#![allow(clippy::print_stdout)]

mod calls;
mod chart;
mod load;
mod probe;
mod scenarios;
mod way;

use serde_json::{Value, json};

/// A whole-number setting from the environment.
pub fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// A list setting from the environment (comma-separated numbers).
pub fn list_setting(name: &str, default: &[u64]) -> Vec<u64> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect::<Vec<u64>>())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

/// The median of each number across runs of the same shape (other values from the
/// first run): the figure reported for a scenario.
pub fn median_of(runs: &[Value]) -> Value {
    let Some(first) = runs.first() else { return Value::Null };
    match first {
        Value::Number(_) => {
            let mut numbers: Vec<f64> = runs.iter().filter_map(Value::as_f64).collect();
            if numbers.is_empty() {
                return Value::Null;
            }
            numbers.sort_by(f64::total_cmp);
            json!(probe::round(numbers[numbers.len() / 2], 3))
        }
        Value::Object(map) => Value::Object(
            map.keys()
                .map(|key| {
                    let column: Vec<Value> = runs.iter().map(|r| r.get(key).cloned().unwrap_or(Value::Null)).collect();
                    (key.clone(), median_of(&column))
                })
                .collect(),
        ),
        Value::Null => {
            runs.iter().find(|r| !r.is_null()).map(|r| median_of(std::slice::from_ref(r))).unwrap_or_default()
        }
        other => other.clone(),
    }
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu.lines().find_map(|l| l.strip_prefix("model name")).map(|m| m.trim_start_matches([' ', '\t', ':']));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let memory = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_owned()));
    json!({"cpu": model, "cores": cores, "memory": memory, "load_average": load_average()})
}

/// The 1, 5 and 15 minute load averages now (the machine may be shared).
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `bench chart FILE.json`: draws the chart of figures written before, on stdout.
    let args: Vec<String> = std::env::args().collect();
    if let [_, command, file] = args.as_slice()
        && command == "chart"
    {
        let report: Value = std::fs::read(file)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_else(|| panic!("{file} holds no figures"));
        print!("{}", chart::draw(&report));
        return;
    }
    let out = std::env::var("BENCH_OUT").map(std::path::PathBuf::from).unwrap_or_else(|_| {
        let now = time::OffsetDateTime::now_utc();
        std::path::PathBuf::from(format!(
            "bench-results/{:04}{:02}{:02}T{:02}{:02}{:02}Z",
            now.year(),
            u8::from(now.month()),
            now.day(),
            now.hour(),
            now.minute(),
            now.second()
        ))
    });
    std::fs::create_dir_all(&out).expect("the results folder");
    let wanted: Vec<String> = std::env::var("BENCH_SCENARIOS")
        .unwrap_or_else(|_| "throughput,loads,executors,peer,tickets,backlog,admission".into())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    let settings = scenarios::Settings::from_env();
    println!("benchmark of the real stack; results in {}", out.display());
    println!("machine: {}", machine());
    println!("settings: {}", settings.json());
    let started = std::time::Instant::now();
    let mut report = json!({
        "machine": machine(),
        "settings": settings.json(),
        "started_at_unix_s": load::unix_us() / 1_000_000,
    });
    if wanted.iter().any(|s| s != "peer" && s != "calls") {
        println!("\n== broker warm-up (load average {})", load_average());
        scenarios::warm_the_broker(&settings).await;
    }
    for scenario in &wanted {
        let begun = std::time::Instant::now();
        println!("\n== {scenario} (load average {})", load_average());
        let figures = match scenario.as_str() {
            "throughput" => scenarios::throughput(&settings).await,
            "loads" => scenarios::loads(&settings).await,
            "executors" => scenarios::executors(&settings).await,
            "peer" => scenarios::peer(&settings).await,
            "tickets" => scenarios::tickets(&settings).await,
            "backlog" => scenarios::backlog(&settings).await,
            "admission" => scenarios::admission(&settings).await,
            "settings" => scenarios::settings_tried(&settings).await,
            "calls" => calls::calls(&settings).await,
            other => {
                println!(
                    "unknown scenario {other}: expected throughput, loads, executors, peer, tickets, backlog, admission, settings, calls"
                );
                continue;
            }
        };
        println!("{scenario} took {:.0} s", begun.elapsed().as_secs_f64());
        report[scenario.as_str()] = figures;
        // Written after every scenario, so a long run that stops keeps what it measured.
        report["finished_load_average"] = json!(load_average());
        report["took_s"] = json!(probe::round(started.elapsed().as_secs_f64(), 0));
        std::fs::write(out.join("bench.json"), serde_json::to_vec_pretty(&report).expect("json")).expect("write");
        std::fs::write(out.join("bench.svg"), chart::draw(&report)).expect("write the chart");
    }
    if report["peer"].is_object() {
        scenarios::side_by_side(&report);
    }
    println!("\nall figures: {}/bench.json, chart: {}/bench.svg", out.display(), out.display());
}
