//! Intake's admission control on the real stack (docs/intake.md, "Admission"): a
//! tenant's burst above its rate is refused with `429`, `Retry-After` and a problem,
//! never a `5xx`; another tenant is unaffected; what was admitted runs to the end;
//! a body over the limit is refused by its announced length before it is read; past
//! the in-flight cap a request is refused at once with `503`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fenceline_tests::system::{Caps, System};
use serde_json::{Value, json};

/// One answer: status, the headers looked at, the body.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    content_type: String,
    body: Value,
}

fn submit(agent: &ureq::Agent, intake: &str, token: &str, key: &str, body: String) -> Answer {
    let mut response = agent
        .post(&format!("{intake}/v1/tasks"))
        .header("Authorization", &format!("Bearer {token}"))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .send(body)
        .expect("intake answers");
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let (status, retry_after, content_type) =
        (response.status().as_u16(), header("retry-after"), header("content-type").unwrap_or_default());
    let text = response.body_mut().read_to_string().unwrap_or_default();
    Answer { status, retry_after, content_type, body: serde_json::from_str(&text).unwrap_or(Value::Null) }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .new_agent()
}

fn image(n: usize) -> String {
    json!({"kind": "image.generate", "input": {"prompt": format!("shoe {n}")}}).to_string()
}

/// `count` submissions of one tenant at once, each from a thread of its own.
async fn burst(intake: &str, token: &str, tag: &str, count: usize) -> Vec<Answer> {
    let threads: Vec<_> = (0..count)
        .map(|n| {
            let (intake, token, key) = (intake.to_owned(), token.to_owned(), format!("{tag}-{n}"));
            std::thread::spawn(move || submit(&agent(), &intake, &token, &key, image(n)))
        })
        .collect();
    tokio::task::spawn_blocking(move || threads.into_iter().map(|t| t.join().expect("client thread")).collect())
        .await
        .expect("clients")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_a_tenants_rate_is_refused_with_retry_after_and_what_was_admitted_runs() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let limits = [
        ("FENCELINE_INTAKE_TENANT_RATE_PER_SECOND", "2".to_owned()),
        ("FENCELINE_INTAKE_TENANT_BURST", "5".to_owned()),
        ("FENCELINE_INTAKE_BODY_LIMIT_BYTES", "2048".to_owned()),
    ];
    system.spawn("intake", "intake", &limits).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let intake = system.url_of("intake");
    let (acme, globex) = (system.token("acme").await, system.token("globex").await);

    let started = Instant::now();
    let answers = burst(&intake, &acme, "acme", 24).await;
    let took = started.elapsed().as_secs_f64();
    let admitted: Vec<&Answer> = answers.iter().filter(|a| a.status == 202).collect();
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(admitted.len() + refused.len(), answers.len(), "only 202 and 429, no 5xx: {answers:?}");
    // The bucket holds 5 and refills 2 a second while the burst lasts.
    let most = 5 + (2.0 * took).ceil() as usize;
    assert!((5..=most).contains(&admitted.len()), "{} admitted in {took:.2} s, expected 5..={most}", admitted.len());
    for answer in &refused {
        assert_eq!(answer.content_type, "application/problem+json", "{answer:?}");
        assert_eq!(answer.body["type"], "/problems/too-many-requests", "{answer:?}");
        assert_eq!(answer.body["status"], 429);
        let wait: u64 = answer.retry_after.as_deref().and_then(|v| v.parse().ok()).expect("Retry-After in seconds");
        assert!((1..=10).contains(&wait), "{answer:?}");
    }

    // Another tenant's bucket is its own.
    let others = burst(&intake, &globex, "globex", 4).await;
    assert!(others.iter().all(|a| a.status == 202), "globex is unaffected: {others:?}");

    // After the wait it was told, the tenant is admitted again.
    let wait = refused.iter().filter_map(|a| a.retry_after.as_deref()?.parse::<u64>().ok()).max().unwrap_or(1);
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let (intake_url, token) = (intake.clone(), acme.clone());
    let again = tokio::task::spawn_blocking(move || submit(&agent(), &intake_url, &token, "acme-again", image(99)))
        .await
        .expect("client");
    assert_eq!(again.status, 202, "{again:?}");

    // A body over the limit is refused as a problem.
    let (intake_url, token) = (intake.clone(), globex.clone());
    let big = json!({"kind": "image.generate", "input": {"prompt": "x".repeat(3000)}}).to_string();
    let too_large =
        tokio::task::spawn_blocking(move || submit(&agent(), &intake_url, &token, "big", big)).await.expect("client");
    assert_eq!((too_large.status, too_large.content_type.as_str()), (413, "application/problem+json"), "{too_large:?}");
    assert_eq!(too_large.body["type"], "/problems/payload-too-large");

    // Everything admitted runs to the end.
    for answer in admitted.iter().copied().chain(&others).chain([&again]) {
        let task = answer.body["task_id"].as_str().expect("task id").parse().expect("task id");
        system.wait_state(task, &["succeeded"], Duration::from_secs(60)).await;
    }
    let charges = system.provider("img").charges().await;
    assert_eq!(charges, admitted.len() + others.len() + 1, "one charge per admitted task, none for refused ones");
}

/// Writes `text` (and no more) on a fresh connection whose reads wait `within`.
fn raw_request(addr: &str, text: &str, within: Duration) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(within)).expect("timeout");
    stream.write_all(text.as_bytes()).expect("write");
    stream.flush().expect("flush");
    stream
}

/// The status line and headers of the answer on `stream`.
fn read_head(stream: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1024];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&byte[..n]),
            Err(e) => panic!("no answer: {e}; read so far: {}", String::from_utf8_lossy(&seen)),
        }
    }
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_cap_a_request_is_refused_at_once_and_a_huge_body_is_never_read() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_MAX_IN_FLIGHT", "1".to_owned())]).await;
    let intake = system.url_of("intake");
    let addr = intake.trim_start_matches("http://").to_owned();
    let token = system.token("acme").await;

    // A body announced far over the limit is answered before a byte of it is sent.
    let head = format!(
        "POST /v1/tasks HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nIdempotency-Key: huge\r\n\
         Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n"
    );
    let (addr_huge, head_huge) = (addr.clone(), head.clone());
    let answer = tokio::task::spawn_blocking(move || {
        let mut stream = raw_request(&addr_huge, &head_huge, Duration::from_secs(5));
        read_head(&mut stream)
    })
    .await
    .expect("client");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("content-type: application/problem+json"), "{answer}");

    // One request held in flight: its body is announced and sent only in part.
    let head = head.replace("1073741824", "200").replace("huge", "slow");
    let (addr_slow, head_slow) = (addr.clone(), head.clone());
    let slow = tokio::task::spawn_blocking(move || {
        raw_request(&addr_slow, &format!("{head_slow}{{\"kind\":"), Duration::from_secs(10))
    })
    .await
    .expect("client");
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (url, token_now) = (intake.clone(), token.clone());
    let refused = tokio::task::spawn_blocking(move || submit(&agent(), &url, &token_now, "second", image(1)))
        .await
        .expect("client");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.content_type, "application/problem+json");
    assert_eq!(refused.body["type"], "/problems/overloaded");
    assert_eq!(refused.retry_after.as_deref(), Some("1"));

    // Once the held request ends, the next is served.
    drop(slow);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (url, token_now) = (intake.clone(), token.clone());
        let next = tokio::task::spawn_blocking(move || submit(&agent(), &url, &token_now, "third", image(2)))
            .await
            .expect("client");
        if next.status == 202 {
            break;
        }
        assert_eq!(next.status, 503, "only the cap refuses it: {next:?}");
        assert!(Instant::now() < deadline, "the slot was never given back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
