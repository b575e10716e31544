//! No secret leaks: the whole stack runs with known secrets — an API token, a
//! webhook secret (stored sealed), a provider credential, the Kafka SASL password,
//! the database password, the audit token and the webhook sealing key — through the
//! paths that succeed and the ones that fail (a wrong token, a bad signature, a
//! provider refusing the credential, a database that cannot be reached, `--help`),
//! and everything the services printed or answered, every service's `/metrics` page
//! included, is searched for them.

use std::time::Duration;

use fenceline_tests::process::{Proc, free_port};
use fenceline_tests::system::{Caps, System, api_agent, host_binary, http, http_as, http_text, submit_over_api};
use serde_json::json;

const LONG: Duration = Duration::from_secs(90);
const PROVIDER_CREDENTIAL: &str = "Bearer sk-live-provider-credential-5a7e0c";
const AUDIT_TOKEN: &str = "audit-token-known-3f91d2b7";
const DATABASE_PASSWORD: &str = "db-password-known-8e21c4";
const SEALING_KEY: &str = "9d4c2b1a0f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a392817060f1e";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by deploy/local/stack test"))
}

/// The system's database URL with a password in it (the test cluster trusts
/// loopback, so any password is accepted; what matters is that none is printed).
fn with_password(url: &str) -> String {
    url.replacen("postgres://fenceline@", &format!("postgres://fenceline:{DATABASE_PASSWORD}@"), 1)
}

/// Everything a request answered: status, headers and body.
async fn answered(method: &str, url: String, token: Option<&str>) -> String {
    let (status, body) = match token {
        Some(token) => http_as(method, url.clone(), token, None).await,
        None => http(method, url.clone(), None).await,
    }
    .unwrap_or_else(|e| (0, json!(e)));
    format!("{method} {url} -> {status} {body}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_appears_in_any_log_answer_or_help_text() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    assert!(system.url.starts_with("postgres://fenceline@"), "the test URL has no password yet: {}", system.url);
    system.set_provider_field("img", "auth_header_env", json!("FENCELINE_TEST_IMG_AUTHORIZATION"));
    let (user, kafka_password) = (env("FENCELINE_TEST_KAFKA_SCRAM_USER"), env("FENCELINE_TEST_KAFKA_SCRAM_PASSWORD"));
    let secret_settings: Vec<(&'static str, String)> = vec![
        ("FENCELINE_DATABASE_URL", with_password(&system.url)),
        ("FENCELINE_KAFKA_BROKERS", env("FENCELINE_TEST_KAFKA_SASL_BROKERS")),
        ("FENCELINE_KAFKA_SECURITY_PROTOCOL", "sasl_plaintext".into()),
        ("FENCELINE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512".into()),
        ("FENCELINE_KAFKA_SASL_USERNAME", user),
        ("FENCELINE_KAFKA_SASL_PASSWORD", kafka_password.clone()),
        ("FENCELINE_TEST_IMG_AUTHORIZATION", PROVIDER_CREDENTIAL.into()),
        ("FENCELINE_RECONCILER_AUDIT_TOKEN", AUDIT_TOKEN.into()),
        ("FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS", SEALING_KEY.into()),
        ("FENCELINE_INTAKE_KINDS", "image.generate,ticket.triage".into()),
        // Debug logs of every crate: the most a misconfigured deployment would print.
        ("RUST_LOG", "debug".into()),
        ("RUST_BACKTRACE", "0".into()),
    ];
    for service in ["intake", "scheduler", "executor", "reconciler"] {
        system.spawn(service, service, &secret_settings).await;
    }
    let token = system.token("acme").await;
    let intake = system.url_of("intake");
    let mut seen = String::new();

    // A paid call that works, one the provider refuses (the credential itself is
    // refused), and one it fails.
    let submit = |input: serde_json::Value| {
        let (intake, token) = (intake.clone(), token.clone());
        async move {
            let body = json!({"kind": "image.generate", "input": input});
            let key = uuid::Uuid::new_v4().to_string();
            let answer =
                tokio::task::spawn_blocking(move || submit_over_api(&api_agent(), &intake, &token, &key, &body))
                    .await
                    .expect("submit")
                    .expect("answered");
            (answer.status, answer.body)
        }
    };
    let (status, ok) = submit(json!({"prompt": "fine"})).await;
    assert_eq!(status, 202, "{ok}");
    seen.push_str(&format!("{ok}\n"));
    let id = ok["task_id"].as_str().expect("task id").to_owned();
    let ok_task = id.parse().expect("task id");
    system.wait_state(ok_task, &["succeeded"], LONG).await;
    system.provider("img").rule(json!({"status": 401, "times": 1})).await;
    let (_, refused) = submit(json!({"prompt": "refused"})).await;
    let refused_task = refused["task_id"].as_str().expect("task id").parse().expect("task id");
    system.wait_state(refused_task, &["needs_human", "failed"], LONG).await;
    system.provider("img").rule(json!({"status": 500, "times": 1})).await;
    let (_, failing) = submit(json!({"prompt": "failing"})).await;
    let failing_task = failing["task_id"].as_str().expect("task id").parse().expect("task id");
    system.wait_state(failing_task, &["succeeded", "needs_human", "outcome_unknown", "failed"], LONG).await;

    // The API: right and wrong tokens, the task, its listing, the specification.
    for path in [format!("/v1/tasks/{id}"), "/v1/tasks".into(), "/openapi.json".into()] {
        seen.push_str(&answered("GET", format!("{intake}{path}"), Some(&token)).await);
    }
    let almost = format!("{}x", &token[..token.len() - 1]);
    seen.push_str(&answered("GET", format!("{intake}/v1/tasks/{id}"), Some(&almost)).await);
    seen.push_str(&answered("GET", format!("{intake}/v1/tasks/{id}"), None).await);

    // A signed webhook (its secret sealed with the intake's key), and one signed with a wrong secret.
    let webhook_secret = {
        use std::str::FromStr as _;
        let options = sqlx::postgres::PgConnectOptions::from_str(&system.url)
            .expect("database URL")
            .options([("search_path", "intake")]);
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.expect("pool");
        let tenant = fenceline_intake::auth::Tenant::parse("acme").expect("tenant");
        let keys = fenceline_intake::sealing::SealingKeys::parse(&SEALING_KEY.to_owned().into()).expect("key");
        fenceline_intake::webhooks::add_secret(&pool, "helpdesk", &tenant, "ticket.triage", Some(&keys))
            .await
            .expect("secret")
            .1
    };
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 7}).to_string();
    for (event, secret) in [("evt-ok", webhook_secret.as_str()), ("evt-bad", "whsec_wrong")] {
        let id = fenceline_intake::webhooks::EventId::parse(event).expect("event id");
        let signature = fenceline_intake::webhooks::sign(secret.as_bytes(), now, &id, body.as_bytes());
        let url = format!("{intake}/v1/webhooks/helpdesk");
        let expected = if event == "evt-ok" { "202 " } else { "401 " };
        let (body, event) = (body.clone(), event.to_owned());
        let answer = tokio::task::spawn_blocking(move || {
            let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
            let mut response = agent
                .post(&url)
                .header("Fenceline-Timestamp", now.to_string())
                .header("Fenceline-Event-Id", event)
                .header("Fenceline-Signature", signature)
                .header("Content-Type", "application/json")
                .send(body)
                .expect("delivery");
            format!("{} {}", response.status(), response.body_mut().read_to_string().unwrap_or_default())
        })
        .await
        .expect("delivery");
        assert!(answer.starts_with(expected), "{answer}");
        seen.push_str(&format!("webhook -> {answer}\n"));
    }

    // Every service's health and readiness, and its whole metrics page (text, not
    // JSON); the audit with and without its token.
    for service in ["intake", "scheduler", "executor", "reconciler"] {
        let base = system.url_of(service);
        for path in ["/healthz", "/readyz"] {
            seen.push_str(&answered("GET", format!("{base}{path}"), None).await);
        }
        let (status, page) = http_text(format!("{base}/metrics"), None).await.expect("metrics");
        assert_eq!(status, 200, "{service}'s /metrics: {page}");
        assert!(
            page.contains("fenceline_http_request_duration_seconds_count{") && page.ends_with("# EOF\n"),
            "{service} served a whole metrics page: {page}"
        );
        seen.push_str(&format!("GET {base}/metrics -> {status}\n{page}\n"));
    }
    let reconciler = system.url_of("reconciler");
    seen.push_str(&answered("GET", format!("{reconciler}/v1/audit"), Some("wrong")).await);
    seen.push_str(&answered("GET", format!("{reconciler}/v1/audit"), Some(AUDIT_TOKEN)).await);

    // Failures at start: a database that cannot be reached, and `--help` with every
    // secret set.
    let mut settings = system.env.clone();
    settings.extend(secret_settings.iter().cloned());
    let unreachable = format!("postgres://fenceline:{DATABASE_PASSWORD}@127.0.0.1:{}/fenceline", free_port());
    // All four at once: each waits for its connection attempts to fail.
    let mut failing_services: Vec<_> = ["intake", "scheduler", "executor", "reconciler"]
        .into_iter()
        .map(|service| {
            let mut failing = settings.clone();
            failing.push(("FENCELINE_DATABASE_URL", unreachable.clone()));
            failing.push(("FENCELINE_HTTP_ADDR", "127.0.0.1:0".into()));
            (service, Proc::spawn(&host_binary(), &[service], &failing))
        })
        .collect();
    for (service, proc) in &mut failing_services {
        let exit = proc.wait_exit(Duration::from_secs(60)).await;
        assert!(exit.is_some_and(|s| !s.success()), "{service} ran without its database:\n{}", proc.all_lines());
        seen.push_str(&proc.all_lines());
    }
    for service in ["intake", "scheduler", "executor", "reconciler"] {
        let help = std::process::Command::new(host_binary())
            .args([service, "--help"])
            .envs(settings.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .expect("--help");
        let text = format!("{}{}", String::from_utf8_lossy(&help.stdout), String::from_utf8_lossy(&help.stderr));
        assert!(text.contains("FENCELINE_"), "{service} --help names its variables:\n{text}");
        seen.push_str(&text);
    }

    // Everything the running services printed.
    for (id, proc) in system.services.iter().chain(system.retired.iter().map(|(id, p)| (id, p))) {
        seen.push_str(&format!("[{id}]\n{}\n", proc.all_lines()));
    }
    assert!(seen.len() > 10_000, "the services printed and answered something to search: {} bytes", seen.len());
    for (name, secret) in [
        ("the API token", token.as_str()),
        ("the webhook secret", webhook_secret.as_str()),
        ("the provider credential", PROVIDER_CREDENTIAL.trim_start_matches("Bearer ")),
        ("the Kafka password", kafka_password.as_str()),
        ("the database password", DATABASE_PASSWORD),
        ("the audit token", AUDIT_TOKEN),
        ("the webhook sealing key", SEALING_KEY),
    ] {
        if let Some(at) = seen.find(secret) {
            let from = seen[..at].rfind('\n').map_or(0, |n| n + 1);
            let line = seen[from..].lines().next().unwrap_or_default();
            panic!("{name} was printed or answered:\n{line}");
        }
    }
}
