//! What one paid call costs the process that makes it (`calls`): the executor's
//! way, a blocking thread per call over a fresh connection (`HttpProvider::start`),
//! beside the two parts an asynchronous client would change: the hand-off to a
//! blocking thread alone, and the same request exchanged on a fresh connection from
//! the runtime itself, with no client at all (what any asynchronous client costs at
//! least). Measured in this process, against a fake provider process of its own.

use std::time::Instant;

use fenceline_config::catalog::Catalog;
use fenceline_providers::{CallAnswer, HttpProvider};
use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::probe;
use crate::scenarios::Settings;
use crate::{median_of, setting};

/// The provider the scenario calls.
const PROVIDER: &str = "gen";

/// A way of making the call.
#[derive(Debug, Clone, Copy)]
enum Way {
    /// The executor's: `HttpProvider::start` on a blocking thread.
    ExecutorBlockingThread,
    /// The hand-off to a blocking thread, with nothing to do there.
    HandOffAlone,
    /// The request on a fresh connection from the runtime, no client.
    BareAsyncExchange,
}

impl Way {
    /// Its name in the figures.
    fn name(self) -> &'static str {
        match self {
            Way::ExecutorBlockingThread => "executor_blocking_thread",
            Way::HandOffAlone => "hand_off_alone",
            Way::BareAsyncExchange => "bare_async_exchange",
        }
    }
}

/// The ways measured, in the order each run takes them.
const WAYS: [Way; 3] = [Way::ExecutorBlockingThread, Way::HandOffAlone, Way::BareAsyncExchange];

/// `BENCH_CALLS` calls (default 5,000) each way, `BENCH_CALLS_AT_ONCE` (default 8)
/// at once, `BENCH_RUNS` runs alternating the ways; CPU and voluntary context
/// switches of this process per call, and calls a second.
pub async fn calls(settings: &Settings) -> Value {
    let calls = setting("BENCH_CALLS", 5_000).max(1);
    let at_once = setting("BENCH_CALLS_AT_ONCE", 8).clamp(1, calls);
    let system = System::new(&[(PROVIDER, Caps::default())]).await;
    let catalog = Catalog::load(&system.catalog).expect("the system's catalogue");
    let spec = catalog.provider(PROVIDER).expect("the fake provider in the catalogue");
    let provider = HttpProvider::with_credential(PROVIDER, spec, None).expect("the provider's client");
    let address = spec.base_url.trim_start_matches("http://").to_owned();
    let mut runs: Vec<Value> = Vec::new();
    for run in 1..=settings.runs {
        let mut figures = serde_json::Map::new();
        for way in WAYS {
            let (provider, address) = (provider.clone(), address.clone());
            let measured = measure(calls, at_once, move |n| {
                let (provider, address) = (provider.clone(), address.clone());
                async move {
                    match way {
                        Way::ExecutorBlockingThread => {
                            let key = format!("calls-{run}-{n}");
                            let answer = provider.start("render", json!({"n": n}), &key).await;
                            assert!(
                                matches!(answer, CallAnswer::Done { .. } | CallAnswer::Accepted { .. }),
                                "the call was not taken: {answer:?}"
                            );
                        }
                        Way::HandOffAlone => tokio::task::spawn_blocking(|| ()).await.expect("the blocking pool"),
                        Way::BareAsyncExchange => bare_exchange(&address, &format!("bare-{run}-{n}")).await,
                    }
                }
            })
            .await;
            println!(
                "  run {run} {:26} {:7.1} µs of CPU a call {:5.2} voluntary context switches a call {:8.0} calls/s",
                way.name(),
                measured["cpu_us_per_call"].as_f64().unwrap_or(0.0),
                measured["voluntary_switches_per_call"].as_f64().unwrap_or(0.0),
                measured["calls_per_s"].as_f64().unwrap_or(0.0),
            );
            figures.insert(way.name().to_owned(), measured);
        }
        runs.push(Value::Object(figures));
    }
    let mut medians = serde_json::Map::new();
    for way in WAYS {
        let of_way: Vec<Value> = runs.iter().map(|r| r[way.name()].clone()).collect();
        let median = median_of(&of_way);
        println!(
            "  median {:26} {:7.1} µs of CPU a call {:5.2} voluntary context switches a call",
            way.name(),
            median["cpu_us_per_call"].as_f64().unwrap_or(0.0),
            median["voluntary_switches_per_call"].as_f64().unwrap_or(0.0),
        );
        medians.insert(way.name().to_owned(), median);
    }
    json!({"calls": calls, "at_once": at_once, "median": medians, "runs": runs})
}

/// Runs `calls` calls of `call` (given the call's number), `at_once` at a time, and
/// reads what they cost this process.
async fn measure<F, Fut>(calls: u64, at_once: u64, call: F) -> Value
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let before = probe::own_usage();
    let started = Instant::now();
    let mut lanes = Vec::new();
    for lane in 0..at_once {
        let call = call.clone();
        lanes.push(tokio::spawn(async move {
            let mut n = lane;
            while n < calls {
                call(n).await;
                n += at_once;
            }
        }));
    }
    for lane in lanes {
        lane.await.expect("a lane of calls");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = probe::own_usage();
    let per_call = |v: f64| probe::round(v / calls as f64, 2);
    json!({
        "cpu_us_per_call": per_call((after.cpu_s - before.cpu_s) * 1e6),
        "voluntary_switches_per_call": per_call((after.voluntary_switches - before.voluntary_switches) as f64),
        "calls_per_s": probe::round(calls as f64 / elapsed, 1),
    })
}

/// The protocol's `start` as raw HTTP/1.1 on a fresh connection from the runtime,
/// read to the provider's close: the floor under any asynchronous client.
async fn bare_exchange(address: &str, key: &str) {
    let body = json!({"operation": "render", "input": {"key": key}}).to_string();
    let request = format!(
        "POST /v1/operations HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Idempotency-Key: {key}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect to the fake provider");
    stream.set_nodelay(true).expect("no delay");
    stream.write_all(request.as_bytes()).await.expect("send the request");
    let mut answer = Vec::with_capacity(512);
    stream.read_to_end(&mut answer).await.expect("read the answer");
    assert!(answer.starts_with(b"HTTP/1.1 20"), "{}", String::from_utf8_lossy(&answer));
}
