//! Fenceline on Kafka as other parties see it: clients in another language that know
//! only the schemas and the documented headers, and a cluster that wants credentials.

use std::time::Duration;

use fenceline_tests::process::Proc;
use fenceline_tests::system::{Caps, System, host_binary};

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests through `deploy/local/stack test`"))
}

/// Runs `tests/python/system/test_independent_clients.py` (confluent-kafka and
/// fastavro, none of Fenceline's code) against a whole running system.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_in_another_language_submit_through_the_upstream_topic_and_follow_the_status_topic() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    system.spawn_all(None).await;
    let token = system.token("acme").await;
    // The Python producers' sources, configured for acme as an operator would.
    configure_upstream_sources(&system, &["python-upstream", "python-dashboard"], "acme").await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/system/test_independent_clients.py");
    let output = tokio::process::Command::new(env("FENCELINE_TEST_PYTHON"))
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", &script.display().to_string()])
        .env("FENCELINE_CLIENTS_BROKERS", &system.brokers)
        .env("FENCELINE_CLIENTS_TOPIC_PREFIX", &system.prefix)
        .env("FENCELINE_CLIENTS_INTAKE_URL", system.url_of("intake"))
        .env("FENCELINE_CLIENTS_TOKEN", token)
        .env("FENCELINE_CLIENTS_TENANT", "acme")
        .env("FENCELINE_CLIENTS_KIND", "image.generate")
        .output()
        .await
        .expect("run pytest");
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprintln!("{printed}");
    assert!(output.status.success(), "the independent clients failed:\n{printed}\n{}", system.logs());
    assert!(printed.contains("2 passed"), "both client tests ran:\n{printed}");
}

/// Lets each of `sources` submit for `tenant` through the upstream topic
/// (`fenceline-intake add-upstream-source`).
async fn configure_upstream_sources(system: &System, sources: &[&str], tenant: &str) {
    use std::str::FromStr as _;
    let options = sqlx::postgres::PgConnectOptions::from_str(&system.url)
        .expect("database URL")
        .options([("search_path", "intake")]);
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await.expect("intake");
    let tenant = fenceline_intake::auth::Tenant::parse(tenant).expect("tenant");
    for source in sources {
        fenceline_intake::upstream::add_source(&pool, source, &tenant).await.expect("source configured");
    }
}

/// Settings for the test broker's SASL_PLAINTEXT listener, as `user` with `password`.
fn sasl(user: &str, password: &str) -> Vec<(&'static str, String)> {
    vec![
        ("FENCELINE_KAFKA_BROKERS", env("FENCELINE_TEST_KAFKA_SASL_BROKERS")),
        ("FENCELINE_KAFKA_SECURITY_PROTOCOL", "sasl_plaintext".into()),
        ("FENCELINE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512".into()),
        ("FENCELINE_KAFKA_SASL_USERNAME", user.into()),
        ("FENCELINE_KAFKA_SASL_PASSWORD", password.into()),
        ("RUST_BACKTRACE", "0".into()),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_with_the_right_credentials_works_and_wrong_ones_stop_it_at_start_with_one_message() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let (user, password) = (env("FENCELINE_TEST_KAFKA_SCRAM_USER"), env("FENCELINE_TEST_KAFKA_SCRAM_PASSWORD"));

    // The right credentials: the whole path runs with the scheduler on the SASL listener.
    system.spawn("scheduler", "scheduler", &sasl(&user, &password)).await;
    system.spawn("executor", "executor", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    let task = system.submit("acme", "image.generate", serde_json::json!({"prompt": "shoe"})).await;
    system.wait_state(task, &["succeeded"], Duration::from_secs(60)).await;

    // Wrong ones: the process ends at start, says why once, and never prints the secret.
    let wrong = "not-the-password-0xC0FFEE";
    let mut env = system.env.clone();
    env.extend(sasl(&user, wrong));
    env.push(("FENCELINE_HTTP_ADDR", "127.0.0.1:0".into()));
    let mut refused = Proc::spawn(&host_binary(), &["executor"], &env);
    let exit = refused.wait_exit(Duration::from_secs(20)).await;
    let printed = refused.all_lines();
    assert!(exit.is_some_and(|status| !status.success()), "the service kept running:\n{printed}");
    let reason = "authentication failed (SASL SCRAM-SHA-512 as user";
    assert_eq!(printed.matches(reason).count(), 1, "one clear message, no retry loop:\n{printed}");
    assert!(!printed.contains(wrong), "the password was printed:\n{printed}");
    assert!(printed.lines().count() < 10, "a short story:\n{printed}");

    // No credentials where the listener wants them: refused just as clearly.
    let mut env = system.env.clone();
    env.push(("FENCELINE_KAFKA_BROKERS", std::env::var("FENCELINE_TEST_KAFKA_SASL_BROKERS").unwrap_or_default()));
    env.push(("FENCELINE_KAFKA_CONNECT_TIMEOUT_MS", "3000".into()));
    env.push(("FENCELINE_HTTP_ADDR", "127.0.0.1:0".into()));
    env.push(("RUST_BACKTRACE", "0".into()));
    let mut plain = Proc::spawn(&host_binary(), &["executor"], &env);
    let exit = plain.wait_exit(Duration::from_secs(20)).await;
    assert!(exit.is_some_and(|status| !status.success()), "a plaintext client on the SASL port kept running");
    assert!(plain.all_lines().contains("answered a metadata request"), "{}", plain.all_lines());
}
