//! Every behaviour of the fake provider, over real HTTP: its call log and ledger
//! are what other tests count charges with, so they are tested first.

use std::time::Duration;

use fenceline_fake_provider::{App, Capabilities, Config};
use serde_json::{Value, json};

struct Provider {
    base: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(capabilities: Capabilities) -> Provider {
    let config = Config {
        http: fenceline_config::HttpConfig { addr: ([127, 0, 0, 1], 0).into(), shutdown_grace_ms: 1_000 },
        capabilities,
        async_delay_ms: 300,
        price_cents: 4,
    };
    let app = App::build(config).expect("starts");
    let base = format!("http://127.0.0.1:{}", app.port());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    Provider { base, _stop: stop }
}

/// (status, Retry-After, body) or the transport error's text.
async fn send(
    method: &str,
    url: String,
    key: Option<&str>,
    body: Option<Value>,
    timeout: Duration,
) -> Result<(u16, Option<String>, Value), String> {
    let (method, key) = (method.to_owned(), key.map(str::to_owned));
    tokio::task::spawn_blocking(move || {
        let agent =
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout)).build().new_agent();
        let mut request = ureq::http::Request::builder().method(method.as_str()).uri(&url);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = match body {
            Some(body) => agent.run(
                request.header("Content-Type", "application/json").body(body.to_string()).map_err(|e| e.to_string())?,
            ),
            None => agent.run(request.body(()).map_err(|e| e.to_string())?),
        }
        .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let text = response.into_body().read_to_string().map_err(|e| e.to_string())?;
        Ok((status, retry_after, serde_json::from_str(&text).unwrap_or(Value::Null)))
    })
    .await
    .expect("client thread")
}

const T: Duration = Duration::from_secs(5);

async fn operate(p: &Provider, key: &str) -> Result<(u16, Option<String>, Value), String> {
    send(
        "POST",
        format!("{}/v1/operations", p.base),
        Some(key),
        Some(json!({"operation": "render", "input": {"prompt": "shoe"}})),
        T,
    )
    .await
}

async fn ledger_total(p: &Provider) -> u64 {
    send("GET", format!("{}/admin/ledger", p.base), None, None, T).await.expect("ledger").2["total_cents"]
        .as_u64()
        .expect("total")
}

async fn calls(p: &Provider, key: &str) -> Vec<Value> {
    let (_, _, body) =
        send("GET", format!("{}/admin/calls?operation_key={key}", p.base), None, None, T).await.expect("calls");
    body.as_array().cloned().unwrap_or_default()
}

async fn rule(p: &Provider, rule: Value) {
    let (status, _, _) = send("POST", format!("{}/admin/rules", p.base), None, Some(rule), T).await.expect("rule");
    assert_eq!(status, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_without_idempotency_charges_every_call_and_one_with_it_charges_once() {
    let plain = start(Capabilities::default()).await;
    for _ in 0..2 {
        assert_eq!(operate(&plain, "op-1").await.expect("answer").0, 200);
    }
    assert_eq!(ledger_total(&plain).await, 8, "charged twice for the same key");
    assert_eq!(calls(&plain, "op-1").await.len(), 2);

    let deduping = start(Capabilities { idempotency_keys: true, ..Capabilities::default() }).await;
    let first = operate(&deduping, "op-1").await.expect("answer");
    let second = operate(&deduping, "op-1").await.expect("answer");
    assert_eq!(first.2["request_id"], second.2["request_id"]);
    assert_eq!(ledger_total(&deduping).await, 4, "charged once");
    let outcomes: Vec<Value> = calls(&deduping, "op-1").await.iter().map(|c| c["outcome"].clone()).collect();
    assert_eq!(outcomes, vec![json!("succeeded"), json!("replayed")]);

    // The result is verifiable: the artifact's bytes hash to the announced sha256.
    let result = &first.2["result"];
    let uri = result["uri"].as_str().expect("uri").to_owned();
    let bytes = tokio::task::spawn_blocking(move || {
        ureq::get(&uri).call().expect("artifact").into_body().read_to_vec().expect("bytes")
    })
    .await
    .expect("client");
    use sha2::Digest;
    assert_eq!(hex::encode(sha2::Sha256::digest(&bytes)), result["sha256"].as_str().expect("sha"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_finds_what_was_received_and_denies_what_was_not() {
    let without = start(Capabilities::default()).await;
    let (status, _, _) =
        send("GET", format!("{}/v1/operations?operation_key=x", without.base), None, None, T).await.expect("answer");
    assert_eq!(status, 501, "a provider without look-up says so");

    let p = start(Capabilities { lookup: true, ..Capabilities::default() }).await;
    let made = operate(&p, "op-9").await.expect("answer");
    let (found, _, body) =
        send("GET", format!("{}/v1/operations?operation_key=op-9", p.base), None, None, T).await.expect("found");
    assert_eq!((found, body["request_id"].clone()), (200, made.2["request_id"].clone()));
    let (missing, _, body) =
        send("GET", format!("{}/v1/operations?operation_key=never", p.base), None, None, T).await.expect("missing");
    assert_eq!((missing, body["status"].as_str()), (404, Some("unknown")), "definitely never received");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_throttling_failures_and_latency_are_not_charged() {
    let p = start(Capabilities::default()).await;
    rule(&p, json!({"operation_key": "busy", "status": 429, "retry_after_s": 7, "times": 1})).await;
    rule(&p, json!({"operation_key": "broken", "status": 503})).await;
    rule(&p, json!({"operation_key": "bad", "status": 422})).await;
    rule(&p, json!({"operation_key": "slow", "latency_ms": 400, "times": 1})).await;

    let throttled = operate(&p, "busy").await.expect("answer");
    assert_eq!((throttled.0, throttled.1.as_deref()), (429, Some("7")));
    assert_eq!(operate(&p, "busy").await.expect("answer").0, 200, "the rule applied once");
    assert_eq!(operate(&p, "broken").await.expect("answer").0, 503);
    assert_eq!(operate(&p, "bad").await.expect("answer").0, 422);
    let started = std::time::Instant::now();
    assert_eq!(operate(&p, "slow").await.expect("answer").0, 200);
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(ledger_total(&p).await, 8, "only the two calls that did work were charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_answer_leaves_a_charge_the_caller_never_saw_and_a_hang_times_out() {
    let p = start(Capabilities { lookup: true, ..Capabilities::default() }).await;
    rule(&p, json!({"operation_key": "lost", "drop_after_accept": true, "times": 1})).await;
    rule(&p, json!({"operation_key": "stuck", "hang": true, "times": 1})).await;

    let lost = operate(&p, "lost").await;
    assert!(lost.is_err(), "the caller gets no answer: {lost:?}");
    assert_eq!(ledger_total(&p).await, 4, "but the work was charged");
    let log = calls(&p, "lost").await;
    assert_eq!((log.len(), log[0]["outcome"].as_str(), log[0]["charged"].as_bool()), (1, Some("dropped"), Some(true)));
    let (found, _, _) =
        send("GET", format!("{}/v1/operations?operation_key=lost", p.base), None, None, T).await.expect("lookup");
    assert_eq!(found, 200, "a look-up recovers what the dropped answer carried");

    let stuck = send(
        "POST",
        format!("{}/v1/operations", p.base),
        Some("stuck"),
        Some(json!({"operation": "render"})),
        Duration::from_secs(1),
    )
    .await;
    assert!(stuck.is_err(), "a hang is a timeout for the caller");
    assert_eq!(calls(&p, "stuck").await[0]["outcome"], "hang");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_results_arrive_later_and_capabilities_switch_at_run_time() {
    let p = start(Capabilities::default()).await;
    let (status, _, _) = send(
        "PUT",
        format!("{}/admin/capabilities", p.base),
        None,
        Some(json!({"idempotency_keys": false, "lookup": false, "async_results": true})),
        T,
    )
    .await
    .expect("switch");
    assert_eq!(status, 204);
    let accepted = operate(&p, "later").await.expect("answer");
    assert_eq!((accepted.0, accepted.2["status"].as_str()), (202, Some("accepted")));
    let poll_url = format!("{}/v1/operations/{}", p.base, accepted.2["request_id"].as_str().expect("id"));
    let early = send("GET", poll_url.clone(), None, None, T).await.expect("poll");
    assert_eq!(early.2["status"], "running");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let done = send("GET", poll_url, None, None, T).await.expect("poll");
    assert_eq!(done.2["status"], "succeeded");
    assert!(done.2["result"]["sha256"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exit_rule_ends_the_process_mid_call() {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fenceline-fake-provider"))
        .env("FENCELINE_HTTP_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // The port is in the JSON log line "listening".
    let stderr = child.stderr.take().expect("stderr");
    // Keep reading stderr to the end, so the child never writes into a closed pipe.
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line)
                && v["message"] == "listening"
            {
                let _ = port_tx.send(v["port"].as_u64());
            }
        }
    });
    let port = tokio::task::spawn_blocking(move || port_rx.recv_timeout(Duration::from_secs(30)))
        .await
        .expect("reader")
        .expect("the provider logs its port")
        .expect("port");
    let p = Provider { base: format!("http://127.0.0.1:{port}"), _stop: tokio::sync::oneshot::channel().0 };
    rule(&p, json!({"operation_key": "die", "exit": true})).await;
    assert!(operate(&p, "die").await.is_err(), "no answer from a dead provider");
    let status = tokio::task::spawn_blocking(move || child.wait()).await.expect("wait").expect("status");
    assert!(!status.success());
}
