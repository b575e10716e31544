//! What an operator sees of a running system (docs/operations.md): each service's
//! `GET /metrics` read by Prometheus's own parser, and one trace per task across
//! the four services and the provider call, exported over OTLP/HTTP to a receiver
//! this test runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System, http_with};
use serde_json::{Value, json};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests through `deploy/local/stack test`"))
}

/// Submits one image task through intake's API (with `traceparent` when given)
/// and returns its id.
async fn submit(system: &System, token: &str, key: &str, traceparent: Option<&str>) -> TaskId {
    let auth = format!("Bearer {token}");
    let mut headers = vec![("Authorization", auth.as_str()), ("Idempotency-Key", key)];
    if let Some(traceparent) = traceparent {
        headers.push(("traceparent", traceparent));
    }
    let body = json!({"kind": "image.generate", "input": {"prompt": format!("shoe {key}")}});
    let (status, answer) =
        http_with("POST", format!("{}/v1/tasks", system.url_of("intake")), &headers, Some(body)).await.expect("submit");
    assert_eq!(status, 202, "{answer}");
    answer["task_id"].as_str().and_then(|id| id.parse().ok()).expect("a task id")
}

/// Runs `tests/python/system/test_metrics.py` (prometheus-client's text parser)
/// against every service of a system that ran a few tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_serves_metrics_a_prometheus_parser_reads_and_they_move_with_the_tasks() {
    const TASKS: usize = 3;
    let audit_token = "audit-token-kept-off-the-metrics";
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[("FENCELINE_RECONCILER_AUDIT_TOKEN", audit_token.into())]).await;
    system.spawn("executor", "executor", &[]).await;
    let tenant = "metrics-tenant-7q";
    let token = system.token(tenant).await;
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        tasks.push(submit(&system, &token, &format!("metrics-{n}"), None).await);
    }
    for task in &tasks {
        system.wait_state(*task, &["succeeded"], Duration::from_secs(60)).await;
    }
    let services: BTreeMap<&str, String> =
        ["intake", "scheduler", "executor", "reconciler"].into_iter().map(|id| (id, system.url_of(id))).collect();
    let mut must_not_show: Vec<String> = tasks.iter().map(ToString::to_string).collect();
    must_not_show.extend([tenant.to_owned(), token.clone(), audit_token.to_owned()]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/system/test_metrics.py");
    let output = tokio::process::Command::new(env("FENCELINE_TEST_PYTHON"))
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", &script.display().to_string()])
        .env("FENCELINE_METRICS_SERVICES", serde_json::to_string(&services).expect("json"))
        .env("FENCELINE_METRICS_TASKS", TASKS.to_string())
        .env("FENCELINE_METRICS_MUST_NOT_SHOW", serde_json::to_string(&must_not_show).expect("json"))
        .output()
        .await
        .expect("run pytest");
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprintln!("{printed}");
    assert!(output.status.success(), "the metrics did not read as expected:\n{printed}\n{}", system.logs());
    assert!(printed.contains("19 passed"), "every metrics test ran:\n{printed}");
}

/// Spans as the OTLP receiver got them: (service.name, trace id, span name).
type Received = Arc<Mutex<Vec<(String, String, String)>>>;

/// An OTLP/HTTP receiver of its own (protocol http/json): `POST /v1/traces`.
async fn otlp_receiver() -> (String, Received) {
    let received: Received = Arc::default();
    let sink = received.clone();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the receiver");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let server = actix_web::HttpServer::new(move || {
        let sink = sink.clone();
        actix_web::App::new().route(
            "/v1/traces",
            actix_web::web::post().to(move |body: actix_web::web::Bytes| {
                let sink = sink.clone();
                async move {
                    let Ok(export) = serde_json::from_slice::<Value>(&body) else {
                        return actix_web::HttpResponse::BadRequest().finish();
                    };
                    let mut spans = sink.lock().unwrap_or_else(|p| p.into_inner());
                    for resource in export["resourceSpans"].as_array().into_iter().flatten() {
                        let service = resource["resource"]["attributes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|a| a["key"] == "service.name")
                            .and_then(|a| a["value"]["stringValue"].as_str())
                            .unwrap_or_default()
                            .to_owned();
                        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                            for span in scope["spans"].as_array().into_iter().flatten() {
                                let trace = span["traceId"].as_str().unwrap_or_default().to_ascii_lowercase();
                                let name = span["name"].as_str().unwrap_or_default().to_owned();
                                spans.push((service.clone(), trace, name));
                            }
                        }
                    }
                    actix_web::HttpResponse::Ok().content_type("application/json").body("{}")
                }
            }),
        )
    })
    .workers(1)
    .disable_signals()
    .listen(listener)
    .expect("listen")
    .run();
    tokio::spawn(server);
    (url, received)
}

/// One task, one trace: the client's `traceparent` on the submission reaches every
/// service's spans (intake's request, every handled event, the grant, the
/// execution, the provider call), the provider's request, and the log lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_task_is_one_trace_across_the_four_services_and_the_provider_call() {
    let (receiver, received) = otlp_receiver().await;
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    system.env.extend([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200".into()),
        // The fenced consumer's line per handled event is at debug: the reconciler
        // writes nothing else about a task that simply succeeds.
        ("RUST_LOG", "info,sqlx=warn,rdkafka=warn,fenceline_bus::consumer=debug".into()),
    ]);
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    system.spawn_all(None).await;
    let token = system.token("acme").await;
    let (trace_id, traceparent) = new_trace();
    let task = submit(&system, &token, "traced", Some(&traceparent)).await;
    system.wait_state(task, &["succeeded"], Duration::from_secs(60)).await;

    let expected = [
        ("intake", "POST /v1/tasks"),
        ("scheduler", "handle"),
        ("scheduler", "grant"),
        ("executor", "handle"),
        ("executor", "execution"),
        ("executor", "start img"),
        ("reconciler", "handle"),
        ("intake", "handle"),
    ];
    let seen = wait_for_trace(&received, &trace_id, &expected, &system).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !received
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|(service, _, name)| service == "scheduler" && name == "dispatch round")
    {
        assert!(tokio::time::Instant::now() < deadline, "the scheduler exported no dispatch round");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("the task's trace {trace_id}: {seen:?}");

    // The provider was called with the same trace.
    let calls = system.provider("img").calls().await;
    let traced: Vec<&str> = calls.iter().filter_map(|c| c["traceparent"].as_str()).collect();
    assert!(!traced.is_empty(), "the provider got no traceparent: {calls:?}");
    assert!(traced.iter().all(|t| fenceline_telemetry::trace_id_of(t) == Some(trace_id.as_str())), "{traced:?}");

    // Every line any service wrote about the task names the trace, and the grant
    // and the execution name the attempt.
    for id in ["intake", "scheduler", "executor", "reconciler"] {
        let lines = system.services[id].lines_with(&task.to_string());
        assert!(!lines.is_empty(), "{id} wrote nothing about the task");
        let untraced: Vec<&String> = lines.iter().filter(|l| !l.contains(&trace_id)).collect();
        assert!(untraced.is_empty(), "{id}'s lines about the task lack its trace id {trace_id}: {untraced:?}");
    }
    for (id, message) in [("scheduler", "attempt granted"), ("executor", "attempt succeeded")] {
        let lines = system.services[id].lines_with(message);
        assert!(
            lines.iter().any(|l| l.contains(&task.to_string()) && l.contains("\"attempt\":1")),
            "{id} logged no `{message}` line naming the task and its attempt: {lines:?}"
        );
    }

    // A call answered 504 after the provider did the work: the reconciler opens a
    // case and asks the provider, and its look-up joins the task's trace.
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    let (recovered_trace, traceparent) = new_trace();
    let recovered = submit(&system, &token, "recovered", Some(&traceparent)).await;
    system.wait_state(recovered, &["succeeded"], Duration::from_secs(60)).await;
    let expected =
        [("executor", "start img"), ("reconciler", "handle"), ("reconciler", "ask"), ("reconciler", "lookup img")];
    let seen = wait_for_trace(&received, &recovered_trace, &expected, &system).await;
    eprintln!("the recovered task's trace {recovered_trace}: {seen:?}");
}

/// A new trace id and a `traceparent` that starts it, as a client would send.
fn new_trace() -> (String, String) {
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let traceparent = format!("00-{trace_id}-{}-01", &uuid::Uuid::new_v4().simple().to_string()[..16]);
    (trace_id, traceparent)
}

/// Waits until the receiver holds every (service, span name) of `expected` in the
/// trace `trace_id`; returns all of that trace's.
async fn wait_for_trace(
    received: &Received,
    trace_id: &str,
    expected: &[(&str, &str)],
    system: &System,
) -> BTreeSet<(String, String)> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let seen: BTreeSet<(String, String)> = received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, trace, _)| trace == trace_id)
            .map(|(service, _, name)| (service.clone(), name.clone()))
            .collect();
        if expected.iter().all(|(s, n)| seen.contains(&((*s).to_owned(), (*n).to_owned()))) {
            return seen;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "spans missing: the trace {trace_id} should hold {expected:?}; it holds {seen:?}\nevery span: {:?}\n{}",
            received.lock().unwrap_or_else(|p| p.into_inner()),
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
