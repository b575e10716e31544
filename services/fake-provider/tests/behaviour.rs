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
        tls: Default::default(),
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

/// A GET as raw bytes: (status, content type, `Location`, body), following
/// redirects or not.
async fn fetch(url: String, follow: bool) -> Result<(u16, String, Option<String>, Vec<u8>), String> {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(if follow { 5 } else { 0 })
            .timeout_global(Some(T))
            .build()
            .new_agent();
        let mut response = agent.get(&url).call().map_err(|e| e.to_string())?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (content_type, location) = (header("content-type").unwrap_or_default(), header("location"));
        let body = response.body_mut().read_to_vec().map_err(|e| e.to_string())?;
        Ok((response.status().as_u16(), content_type, location, body))
    })
    .await
    .expect("client thread")
}

/// Starts an operation and returns the accepted request's poll URL.
async fn accepted(p: &Provider, key: &str) -> String {
    let (status, _, body) = operate(p, key).await.expect("answer");
    assert_eq!((status, body["status"].as_str()), (202, Some("accepted")), "{body}");
    format!("{}/v1/operations/{}", p.base, body["request_id"].as_str().expect("request id"))
}

fn sha(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_of_accepted_work_fail_as_scripted_and_then_answer_the_result() {
    let p = start(Capabilities { async_results: true, ..Capabilities::default() }).await;
    rule(&p, json!({"on": "poll", "operation_key": "flaky", "status": 503, "times": 2})).await;
    rule(&p, json!({"on": "poll", "operation_key": "flaky", "status": 429, "retry_after_s": 1, "times": 1})).await;
    rule(&p, json!({"on": "poll", "operation_key": "flaky", "status": 404, "times": 1})).await;
    rule(&p, json!({"on": "poll", "operation_key": "flaky", "reset": true, "times": 1})).await;
    let other = accepted(&p, "steady").await;
    let url = accepted(&p, "flaky").await;

    let status = |r: Result<(u16, Option<String>, Value), String>| r.map(|(s, after, _)| (s, after));
    assert_eq!(status(send("GET", url.clone(), None, None, T).await), Ok((503, None)));
    assert_eq!(status(send("GET", url.clone(), None, None, T).await), Ok((503, None)));
    assert_eq!(status(send("GET", url.clone(), None, None, T).await), Ok((429, Some("1".to_owned()))));
    assert_eq!(status(send("GET", url.clone(), None, None, T).await), Ok((404, None)), "as if the job expired");
    assert!(send("GET", url.clone(), None, None, T).await.is_err(), "the connection breaks without an answer");
    // Rules are per operation key: another operation's polls are answered.
    assert_eq!(send("GET", other, None, None, T).await.expect("poll").0, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, _, body) = send("GET", url, None, None, T).await.expect("poll");
    assert_eq!((status, body["status"].as_str()), (200, Some("succeeded")), "{body}");
    assert_eq!(ledger_total(&p).await, 8, "each accepted operation charged once, whatever its polls met");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_after_the_work_is_charged_and_a_gateways_comes_without_the_problem_body() {
    let p = start(Capabilities { idempotency_keys: true, lookup: true, ..Capabilities::default() }).await;
    rule(&p, json!({"operation_key": "own", "status_after_work": 500, "times": 1})).await;
    rule(&p, json!({"operation_key": "gateway", "status_after_work": 504, "bare": true, "times": 1})).await;
    rule(&p, json!({"operation_key": "before", "status": 502, "bare": true, "times": 1})).await;

    let own = operate(&p, "own").await.expect("answer");
    assert_eq!((own.0, own.2["type"].as_str()), (500, Some("/problems/provider-500")), "the provider's own body");
    let url = format!("{}/v1/operations", p.base);
    let gateway = send("POST", url, Some("gateway"), Some(json!({"operation": "render"})), T).await.expect("answer");
    assert_eq!((gateway.0, gateway.2.clone()), (504, Value::Null), "a gateway's page, not a problem document");
    assert_eq!(ledger_total(&p).await, 8, "both did the work and were charged");
    let log = calls(&p, "gateway").await;
    assert_eq!((log[0]["outcome"].as_str(), log[0]["charged"].as_bool()), (Some("status_after_work:504"), Some(true)));
    let (found, _, body) =
        send("GET", format!("{}/v1/operations?operation_key=gateway", p.base), None, None, T).await.expect("lookup");
    assert_eq!((found, body["status"].as_str()), (200, Some("succeeded")), "a look-up finds the work");

    // The same key again is the first call's result, not a second charge.
    let again = operate(&p, "own").await.expect("answer");
    assert_eq!((again.0, again.2["request_id"].clone()), (200, log_request_id(&p, "own").await));
    assert_eq!(ledger_total(&p).await, 8);

    // A bare status before the work is a gateway's answer too, and charges nothing.
    let (status, content_type) = {
        let url = format!("{}/v1/operations", p.base);
        let body = json!({"operation": "render"}).to_string();
        tokio::task::spawn_blocking(move || {
            let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
            let mut r = agent
                .post(&url)
                .header("Idempotency-Key", "before")
                .content_type("application/json")
                .send(body)
                .expect("answer");
            let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            let _ = r.body_mut().read_to_vec();
            (r.status().as_u16(), ct)
        })
        .await
        .expect("client")
    };
    assert_eq!((status, content_type.as_str()), (502, "text/html"));
    assert_eq!(ledger_total(&p).await, 8);
}

async fn log_request_id(p: &Provider, key: &str) -> Value {
    calls(p, key).await[0]["request_id"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_a_key_still_running_gets_409_and_the_same_key_later_gets_the_result() {
    let p = start(Capabilities { idempotency_keys: true, ..Capabilities::default() }).await;
    rule(&p, json!({"operation_key": "slow", "latency_ms": 1500, "times": 1})).await;
    rule(&p, json!({"conflict_while_running": true, "retry_after_s": 1})).await;

    let first = tokio::spawn({
        let base = p.base.clone();
        async move {
            let body = json!({"operation": "render", "input": {"prompt": "shoe"}});
            send("POST", format!("{base}/v1/operations"), Some("slow"), Some(body), T).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let conflict = operate(&p, "slow").await.expect("answer");
    assert_eq!((conflict.0, conflict.1.as_deref()), (409, Some("1")), "{:?}", conflict.2);
    // Nothing runs under another key: the rule does not apply there.
    assert_eq!(operate(&p, "fresh").await.expect("answer").0, 200);

    let first = first.await.expect("first").expect("answer");
    assert_eq!(first.0, 200);
    let later = operate(&p, "slow").await.expect("answer");
    assert_eq!((later.0, later.2["request_id"].clone()), (200, first.2["request_id"].clone()));
    let outcomes: Vec<Value> = calls(&p, "slow").await.iter().map(|c| c["outcome"].clone()).collect();
    assert_eq!(outcomes, vec![json!("succeeded"), json!("conflict"), json!("replayed")]);
    assert_eq!(ledger_total(&p).await, 8, "slow once, fresh once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_registered_late_is_never_received_for_a_look_up_while_its_request_is_in_flight() {
    let p = start(Capabilities { lookup: true, ..Capabilities::default() }).await;
    rule(&p, json!({"operation_key": "late", "register_after_ms": 1000, "times": 1})).await;
    let lookup = || send("GET", format!("{}/v1/operations?operation_key=late", p.base), None, None, T);

    let request = tokio::spawn({
        let base = p.base.clone();
        async move {
            send("POST", format!("{base}/v1/operations"), Some("late"), Some(json!({"operation": "render"})), T).await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lookup().await.expect("lookup").0, 404, "in flight, yet \"never received\"");
    assert_eq!(ledger_total(&p).await, 0);
    assert_eq!(request.await.expect("request").expect("answer").0, 200);
    assert_eq!(lookup().await.expect("lookup").0, 200, "registered once the delay passed");
    assert_eq!(ledger_total(&p).await, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_may_live_on_another_host_behind_a_redirect_or_fail_to_download_once() {
    let p = start(Capabilities::default()).await;
    rule(&p, json!({"operation_key": "elsewhere", "serve_artifact": "other_host", "times": 1})).await;
    rule(&p, json!({"operation_key": "moved", "serve_artifact": "redirect", "times": 1})).await;
    rule(&p, json!({"on": "artifact", "operation_key": "flaky", "status": 503, "times": 1})).await;
    let result = |answer: (u16, Option<String>, Value)| {
        let result = &answer.2["result"];
        (result["uri"].as_str().expect("uri").to_owned(), result["sha256"].as_str().expect("sha").to_owned())
    };

    let (uri, sum) = result(operate(&p, "elsewhere").await.expect("answer"));
    assert!(!uri.starts_with(&p.base), "{uri} is on another host than {}", p.base);
    let (status, _, _, bytes) = fetch(uri.clone(), false).await.expect("download");
    assert_eq!((status, sha(&bytes)), (200, sum));
    let here = uri.replace(uri.split("/artifacts").next().expect("base"), &p.base);
    assert_eq!(fetch(here, false).await.expect("answer").0, 404, "not served at the provider's own address");

    let (uri, sum) = result(operate(&p, "moved").await.expect("answer"));
    assert!(uri.starts_with(&p.base), "{uri}");
    let (status, _, location, _) = fetch(uri.clone(), false).await.expect("answer");
    assert_eq!(status, 307);
    assert!(location.as_deref().is_some_and(|l| !l.starts_with(&p.base)), "redirected elsewhere: {location:?}");
    let (status, _, _, bytes) = fetch(uri, true).await.expect("download");
    assert_eq!((status, sha(&bytes)), (200, sum));

    let (uri, sum) = result(operate(&p, "flaky").await.expect("answer"));
    assert_eq!(fetch(uri.clone(), false).await.expect("answer").0, 503, "the first download fails");
    let (status, _, _, bytes) = fetch(uri, false).await.expect("download");
    assert_eq!((status, sha(&bytes)), (200, sum), "the second one works");
    assert_eq!(ledger_total(&p).await, 12, "downloads are free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_answer_429_beyond_the_calls_running_at_once_and_per_second_and_calls_carry_their_time() {
    let p = start(Capabilities::default()).await;
    rule(&p, json!({"max_in_flight": 2, "retry_after_s": 1})).await;
    rule(&p, json!({"latency_ms": 600})).await;
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_micros();
    let racing: Vec<_> = (0..4)
        .map(|n| {
            let base = p.base.clone();
            tokio::spawn(async move {
                send(
                    "POST",
                    format!("{base}/v1/operations"),
                    Some(&format!("k{n}")),
                    Some(json!({"operation": "render", "input": {}})),
                    T,
                )
                .await
                .expect("answer")
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for answer in racing {
        let (status, retry_after, _) = answer.await.expect("client");
        if status == 429 {
            assert_eq!(retry_after.as_deref(), Some("1"));
        }
        statuses.push(status);
    }
    statuses.sort();
    assert_eq!(statuses, vec![200, 200, 429, 429], "two run at once, the others are refused");
    assert_eq!(ledger_total(&p).await, 8, "only the two that ran are charged");
    // Once they are answered there is room again.
    assert_eq!(operate(&p, "k9").await.expect("answer").0, 200);
    let logged = calls(&p, "k0").await;
    let at = logged[0]["received_at_us"].as_i64().expect("the call's time");
    assert!(at as u128 >= before && (at as u128) < before + 5_000_000, "received_at_us is the arrival: {at}");

    let q = start(Capabilities::default()).await;
    rule(&q, json!({"max_per_second": 3, "status": 429})).await;
    let mut answered = Vec::new();
    for n in 0..5 {
        answered.push(operate(&q, &format!("r{n}")).await.expect("answer").0);
    }
    assert_eq!(answered, vec![200, 200, 200, 429, 429], "three per second");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(operate(&q, "r9").await.expect("answer").0, 200, "a second later there is room");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_are_charged_like_operations_and_misbehave_by_the_same_rules() {
    let p = start(Capabilities::default()).await;
    let chat = || async {
        let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hello"}]});
        send("POST", format!("{}/v1/chat/completions", p.base), None, Some(body), T).await
    };
    let (status, _, body) = chat().await.expect("answer");
    assert_eq!(status, 200);
    assert!(body["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")), "{body}");
    assert_eq!(
        body["choices"][0]["message"],
        json!({"role": "assistant", "content": "You said: hello", "refusal": null})
    );
    assert_eq!(ledger_total(&p).await, 4);

    // A gateway's 504 after the work: charged, and the answer is a bare page.
    rule(&p, json!({"operation": "chat.completions", "status_after_work": 504, "bare": true, "times": 1})).await;
    let (status, _, body) = chat().await.expect("answer");
    assert_eq!((status, body), (504, Value::Null));
    assert_eq!(ledger_total(&p).await, 8, "the work behind the gateway was charged");

    // A throttle does nothing, in OpenAI's error shape.
    rule(&p, json!({"status": 429, "retry_after_s": 2, "times": 1})).await;
    let (status, retry_after, body) = chat().await.expect("answer");
    assert_eq!((status, retry_after.as_deref(), body["error"]["type"].as_str()), (429, Some("2"), Some("requests")));
    assert_eq!(ledger_total(&p).await, 8);

    let (status, _, body) =
        send("POST", format!("{}/v1/chat/completions", p.base), None, Some(json!({"model": "m"})), T).await.expect("a");
    assert_eq!((status, body["error"]["type"].as_str()), (400, Some("invalid_request_error")));
    let (_, _, all) = send("GET", format!("{}/admin/calls", p.base), None, None, T).await.expect("calls");
    let outcomes: Vec<&str> = all.as_array().expect("calls").iter().filter_map(|c| c["outcome"].as_str()).collect();
    assert_eq!(outcomes, ["succeeded", "status_after_work:504", "status:429"]);
}
