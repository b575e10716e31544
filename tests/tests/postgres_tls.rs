//! TLS to Postgres: a cluster of the test's own with `ssl=on` and a server
//! certificate from a CA made here. A service whose URL says
//! `sslmode=verify-full&sslrootcert=<the CA>` starts, serves and writes over TLS;
//! without the CA (the system's roots know it not) it refuses to start, saying that
//! the server's certificate did not verify.

use std::time::Duration;

use fenceline_tests::process::{OwnPostgres, Proc};
use fenceline_tests::system::{Caps, System, api_agent, host_binary, submit_over_api};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use serde_json::json;

/// A CA certificate (PEM) and a server certificate and key (PEM) it signed for
/// `names`.
fn pki(names: &[&str]) -> (String, String, String) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "Fenceline test database CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().expect("key");
    let ca_pem = ca.self_signed(&ca_key).expect("CA").pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).expect("params");
    server.distinguished_name.push(DnType::CommonName, "postgres");
    let server_key = KeyPair::generate().expect("key");
    let server_pem = server.signed_by(&server_key, &issuer).expect("signed").pem();
    (ca_pem, server_pem, server_key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_verifies_the_database_server_against_sslrootcert_and_refuses_an_unknown_one() {
    let (ca, cert, key) = pki(&["localhost", "127.0.0.1"]);
    let postgres = OwnPostgres::start_tls(&cert, &key).await;
    let mut system = System::new(&[("img", Caps::default())]).await;
    let ca_file = system.dir.join("database-ca.pem");
    std::fs::write(&ca_file, &ca).expect("write the CA");
    let verified = format!("{}?sslmode=verify-full&sslrootcert={}", postgres.url(), ca_file.display());

    system.spawn("intake", "intake", &[("FENCELINE_DATABASE_URL", verified.clone())]).await;
    let token = {
        let options: sqlx::postgres::PgConnectOptions = verified.parse().expect("URL");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.options([("search_path", "intake")]))
            .await
            .expect("the test connects with the same URL");
        let tenant = fenceline_intake::auth::Tenant::parse("acme").expect("tenant");
        fenceline_intake::auth::create_token(&pool, &tenant, "test").await.expect("token").1
    };
    let intake = system.url_of("intake");
    let answer = tokio::task::spawn_blocking(move || {
        let body = json!({"kind": "image.generate", "input": {"prompt": "over TLS"}});
        submit_over_api(&api_agent(), &intake, &token, "tls-1", &body)
    })
    .await
    .expect("client")
    .expect("answered");
    assert_eq!(answer.status, 202, "{}", answer.body);

    // Every connection the service holds is encrypted.
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}?sslmode=disable", postgres.url()))
        .await
        .expect("admin");
    let (encrypted, plain): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) FROM pg_stat_ssl s \
         JOIN pg_stat_activity a USING (pid) WHERE a.datname = 'fenceline' AND a.pid <> pg_backend_pid() \
         AND a.backend_type = 'client backend'",
    )
    .fetch_one(&admin)
    .await
    .expect("pg_stat_ssl");
    assert!(encrypted >= 1 && plain == 0, "{encrypted} encrypted and {plain} plain connections");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM intake.tasks").fetch_one(&admin).await.expect("tasks");
    assert_eq!(stored, 1, "the task was written over TLS");

    // Without the CA the server's certificate does not verify: the service stops
    // at start, and says so.
    let unverified = format!("{}?sslmode=verify-full", postgres.url());
    let mut settings = system.env.clone();
    settings.push(("FENCELINE_DATABASE_URL", unverified));
    settings.push(("FENCELINE_HTTP_ADDR", "127.0.0.1:0".into()));
    let mut refused = Proc::spawn(&host_binary(), &["intake"], &settings);
    let exit = refused.wait_exit(Duration::from_secs(30)).await;
    let printed = refused.all_lines();
    assert!(exit.is_some_and(|s| !s.success()), "intake started with an unverified server:\n{printed}");
    assert!(printed.contains("TLS") && printed.contains("certificate"), "names the certificate problem:\n{printed}");
    assert!(printed.contains("sslrootcert"), "says what the certificate is checked against:\n{printed}");
}
