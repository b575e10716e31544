//! Submitting a task to intake over real HTTP: accepted at once, idempotent by key,
//! and refused with a problem (never a 500) when the request, its body or its input is wrong.

use std::time::Duration;

use fenceline_events::topics;
use fenceline_tests::*;
use serde_json::{Value, json};

use crate::intake_fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_is_accepted_at_once_and_reads_as_queued() {
    let intake = start_intake().await;
    let answer = call(
        "POST",
        format!("{}/v1/tasks", intake.base),
        Some(intake.acme.clone()),
        Some("k1"),
        Some(image("red shoe")),
    )
    .await;
    assert_eq!(answer.status, 202, "{:?}", answer.body);
    let task_id = answer.body["task_id"].as_str().expect("task id").to_owned();
    assert_eq!(answer.location.as_deref(), Some(format!("/v1/tasks/{task_id}").as_str()));
    assert_eq!(answer.body["status_url"], format!("/v1/tasks/{task_id}"));
    assert!(!answer.replayed);

    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), Some(intake.acme.clone()), None, None).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body["state"], "queued", "accepted but not yet projected reads as queued");

    // The TaskAccepted event reached fenceline.tasks through the outbox.
    let (brokers, topic) = (brokers(), topics::named(&intake.prefix, topics::TASKS));
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, 1, Duration::from_secs(30)))
        .await
        .expect("reader");
    assert_eq!(records.len(), 1);
    let event =
        fenceline_events::decode(rdkafka::message::Message::payload(&records[0]).expect("value")).expect("decodes");
    let fenceline_events::Event::TaskAccepted(accepted) = event else { panic!("not TaskAccepted") };
    assert_eq!(accepted.task_id.to_string(), task_id);
    assert_eq!(accepted.tenant, "acme");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_replays_the_same_task_and_a_different_request_is_refused() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let first = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(image("red shoe"))).await;
    // Same request, spelled differently.
    let same = json!({"labels": {"shop": "42"}, "input": {"prompt": "red shoe"}, "kind": "image.generate", "priority": "normal"});
    let again = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(same.to_string())).await;
    assert_eq!((again.status, again.replayed), (202, true));
    assert_eq!(again.body["task_id"], first.body["task_id"]);

    let other = call("POST", url.clone(), Some(intake.acme.clone()), Some("order-7"), Some(image("blue shoe"))).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.content_type, "application/problem+json");
    assert_eq!(other.body["type"], "/problems/idempotency-key-reused");
    assert_eq!(task_rows(&intake.pool).await, 1, "no second task");

    // Keys are scoped per tenant: another tenant's same key is its own task.
    let globex = call("POST", url, Some(intake.globex.clone()), Some("order-7"), Some(image("blue shoe"))).await;
    assert_eq!((globex.status, globex.replayed), (202, false));
    assert_ne!(globex.body["task_id"], first.body["task_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_identical_submissions_in_parallel_make_one_task() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let calls: Vec<_> = (0..10)
        .map(|_| {
            tokio::spawn(call("POST", url.clone(), Some(intake.acme.clone()), Some("burst"), Some(image("burst"))))
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    let mut replayed = 0;
    for c in calls {
        let answer = c.await.expect("call");
        assert_eq!(answer.status, 202, "{:?}", answer.body);
        ids.insert(answer.body["task_id"].as_str().expect("id").to_owned());
        replayed += usize::from(answer.replayed);
    }
    assert_eq!(ids.len(), 1, "ten answers with one task id");
    assert_eq!(replayed, 9, "one created, nine replayed");
    assert_eq!(task_rows(&intake.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_problem_never_a_500() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let token = Some(intake.acme.clone());
    let cases = [
        (Some("k1"), "{not json".to_owned(), 400, "/problems/invalid-request"),
        (Some("k2"), json!({"kind": "image.generate"}).to_string(), 400, "/problems/invalid-request"),
        (Some("k3"), json!({"kind": "video.make", "input": {}}).to_string(), 422, "/problems/unknown-kind"),
        (None, image("x"), 400, "/problems/idempotency-key-missing"),
        (Some("k4"), image(&"x".repeat(5000)), 413, "/problems/payload-too-large"),
    ];
    for (key, body, status, problem) in cases {
        let answer = call("POST", url.clone(), token.clone(), key, Some(body.clone())).await;
        assert_eq!(answer.status, status, "{body:.60}: {:?}", answer.body);
        assert_eq!(answer.content_type, "application/problem+json", "{body:.60}");
        assert_eq!(answer.body["type"], problem, "{body:.60}");
    }
    let missing_field =
        call("POST", url.clone(), token.clone(), Some("k5"), Some(json!({"kind": "image.generate"}).to_string())).await;
    assert!(
        missing_field.body["detail"].as_str().unwrap_or_default().contains("input"),
        "names the field: {:?}",
        missing_field.body
    );
    let bad_id = call("GET", format!("{url}/not-a-uuid"), token, None, None).await;
    assert_eq!(bad_id.status, 404);
    assert_eq!(task_rows(&intake.pool).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_refused_as_unsupported() {
    let intake = start_intake().await;
    let (url, token) = (format!("{}/v1/tasks", intake.base), intake.acme.clone());
    let answer = tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let response = agent
            .post(&url)
            .header("Authorization", format!("Bearer {token}"))
            .header("Idempotency-Key", "k")
            .header("Content-Type", "text/plain")
            .send("kind=image.generate")
            .expect("answer");
        let status = response.status().as_u16();
        let text = response.into_body().read_to_string().unwrap_or_default();
        (status, serde_json::from_str::<Value>(&text).unwrap_or(Value::Null))
    })
    .await
    .expect("client");
    assert_eq!((answer.0, answer.1["type"].as_str()), (415, Some("/problems/unsupported-media-type")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_fails_its_kinds_schema_is_refused_naming_where() {
    let dir = std::env::temp_dir().join(format!("schemas-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let schema = json!({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string", "maxLength": 200}}});
    std::fs::write(dir.join("image.generate.json"), schema.to_string()).expect("schema");
    let intake = start_intake_with(&[], vec!["image.generate".into()], |c| c.intake.kind_schemas = Some(dir)).await;
    let (base, pool, token) = (intake.base.clone(), intake.pool.clone(), intake.acme.clone());

    let bad = json!({"kind": "image.generate", "input": {"prompt": 7}}).to_string();
    let answer = call("POST", format!("{base}/v1/tasks"), Some(token.clone()), Some("k1"), Some(bad)).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (422, Some("/problems/input-invalid")));
    assert!(answer.body["detail"].as_str().unwrap_or_default().contains("/prompt"), "{:?}", answer.body);
    let good = call("POST", format!("{base}/v1/tasks"), Some(token), Some("k2"), Some(image("fine"))).await;
    assert_eq!(good.status, 202);
    assert_eq!(task_rows(&pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_odd_methods_and_unstorable_text_get_problems() {
    let intake = start_intake().await;
    let url = format!("{}/v1/tasks", intake.base);
    let token = Some(intake.acme.clone());
    let long_key = "k".repeat(256);
    let answer = call("POST", url.clone(), token.clone(), Some(&long_key), Some(image("x"))).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (400, Some("/problems/idempotency-key-invalid")));

    let huge = "h".repeat(fenceline_intake::HEADER_VALUE_LIMIT + 1);
    let answer = call("POST", url.clone(), token.clone(), Some(&huge), Some(image("x"))).await;
    assert_eq!((answer.status, answer.content_type.as_str()), (431, "application/problem+json"));
    assert_eq!(answer.body["type"], "/problems/header-too-large");

    let answer = call("DELETE", url.clone(), token.clone(), None, None).await;
    assert_eq!((answer.status, answer.body["type"].as_str()), (405, Some("/problems/method-not-allowed")));

    for body in [
        json!({"kind": "image.generate", "input": {"prompt": "nul\u{0}"}}),
        json!({"kind": "image.generate", "input": {"a\u{0}": 1}}),
        json!({"kind": "image.generate", "input": {}, "labels": {"k": "v\u{0}"}}),
        json!({"kind": "image.generate", "input": "not an object"}),
    ] {
        let answer = call("POST", url.clone(), token.clone(), Some("nul"), Some(body.to_string())).await;
        assert_eq!((answer.status, answer.body["type"].as_str()), (400, Some("/problems/invalid-request")), "{body}");
    }
    assert_eq!(task_rows(&intake.pool).await, 0);
}

/// schemathesis (PyPI) generates requests for every operation of the served
/// document, valid and invalid, and checks each answer against it: no `5xx`, every
/// status, header, media type and body as documented, invalid input refused, other
/// methods answered `405` (a body or headers over the limits count as refused with
/// `413` and `431`: `tests/python/schemathesis.toml`). Left out:
/// `positive_data_acceptance`, which expects every schema-valid request to succeed;
/// a reused Idempotency-Key (`422`) and a deadline before `not_before` (`400`) are
/// valid JSON that the API must refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_keeps_to_its_openapi_document_under_schemathesis() {
    let schemathesis = std::env::var("FENCELINE_SCHEMATHESIS")
        .expect("FENCELINE_SCHEMATHESIS names the schemathesis command (deploy/local/stack test sets it)");
    let intake = start_intake().await;
    let document = call("GET", format!("{}/v1/openapi.json", intake.base), None, None, None).await;
    assert_eq!(document.status, 200);
    assert_eq!(document.body["openapi"], "3.1.0");
    let examples = std::env::var("FENCELINE_SCHEMATHESIS_EXAMPLES").unwrap_or_else(|_| "20".into());
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/schemathesis.toml");
    let output = tokio::process::Command::new(schemathesis)
        .arg("--config-file")
        .arg(&config)
        .args(["run", &format!("{}/v1/openapi.json", intake.base)])
        .args(["--header", &format!("Authorization: Bearer {}", intake.acme)])
        .args(["--checks", "all", "--exclude-checks", "positive_data_acceptance"])
        .args(["--max-examples", &examples, "--workers", "1", "--no-color"])
        .current_dir(std::env::temp_dir())
        .output()
        .await
        .expect("schemathesis runs");
    let report = String::from_utf8_lossy(&output.stdout);
    eprintln!("{report}");
    assert!(
        output.status.success(),
        "schemathesis found failures:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("passed"), "schemathesis tested something: {report}");
}
