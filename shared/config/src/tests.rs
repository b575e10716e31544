use super::*;
use crate::kafka::parse_properties;
use crate::secrets::secret_from;

#[test]
fn properties_parse_pairs_and_reject_garbage() {
    assert_eq!(parse_properties("").expect("empty"), Properties::default());
    let parsed = parse_properties("a=1, b = two ,").expect("two pairs");
    assert_eq!(parsed.0, vec![("a".into(), "1".into()), ("b".into(), "two".into())]);
    assert!(parse_properties("novalue").is_err());
    let refused = parse_properties("enable.auto.offset.store=true").expect_err("reserved");
    assert!(refused.contains("enable.auto.offset.store"), "{refused}");
    assert!(parse_properties("sasl.password=hunter2").is_err(), "secrets have variables of their own");
}

#[test]
fn secrets_never_print() {
    use clap::Parser;
    let parsed = Service::try_parse_from([
        "svc",
        "--database-url",
        "postgres://x/y",
        "--kafka-security-protocol",
        "sasl_ssl",
        "--kafka-sasl-mechanism",
        "SCRAM-SHA-512",
        "--kafka-sasl-username",
        "fenceline",
        "--kafka-sasl-password",
        "hunter2",
        "--kafka-properties",
        "sasl.oauthbearer.client.secret=s3cret,client.rack=a",
    ])
    .expect("parses");
    assert!(parsed.service.validate().is_ok());
    let printed = format!("{parsed:?}");
    assert!(!printed.contains("hunter2") && !printed.contains("s3cret"), "{printed}");
    assert!(printed.contains("client.rack"));
    let settings = parsed.service.kafka.security.client_settings();
    assert!(settings.contains(&("sasl.password", "hunter2".to_owned())));
    assert!(settings.contains(&("sasl.mechanism", "SCRAM-SHA-512".to_owned())));
}

/// A folder of one test's own, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("fenceline-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch folder");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_database_url_comes_from_the_variable_or_a_file_and_never_prints() {
    use clap::Parser;
    let url = "postgres://fenceline:db-pass-7f3a@db.example:5432/fenceline?sslmode=verify-full";
    let parsed = Service::try_parse_from(["svc", "--database-url", url]).expect("parses");
    assert_eq!(parsed.service.postgres.database_url().expect("url").expose_secret(), url);
    let printed = format!("{parsed:?}");
    assert!(!printed.contains("db-pass-7f3a") && !printed.contains("db.example"), "{printed}");

    let dir = Scratch::new("url");
    let file = dir.0.join("url");
    std::fs::write(&file, format!("{url}\n")).expect("write");
    let path = file.display().to_string();
    let parsed = Service::try_parse_from(["svc", "--database-url-file", &path]).expect("parses");
    assert_eq!(parsed.service.postgres.database_url().expect("url").expose_secret(), url, "newline dropped");
    assert!(!format!("{parsed:?}").contains("db-pass-7f3a"));
    assert!(Service::try_parse_from(["svc"]).is_err(), "one of the two is required");
    assert!(Service::try_parse_from(["svc", "--database-url", url, "--database-url-file", &path]).is_err());
    let missing = Service::try_parse_from(["svc", "--database-url-file", "/nonexistent/url"]).expect_err("no file");
    assert!(missing.to_string().contains("/nonexistent/url"), "{missing}");
}

#[test]
fn a_named_secret_comes_from_its_variable_or_the_file_its_file_variant_names() {
    let dir = Scratch::new("named");
    let file = dir.0.join("credential");
    std::fs::write(&file, "Bearer sk-file-6b1e\n").expect("write");
    let path = file.display().to_string();
    let read = |value: Option<&str>, file: Option<&str>| {
        secret_from("FENCELINE_X", value.map(str::to_owned), file.map(str::to_owned))
            .map(|s| s.map(|s| s.expose_secret().to_owned()))
    };
    assert_eq!(read(Some("Bearer v"), None).expect("value").as_deref(), Some("Bearer v"));
    assert_eq!(read(None, Some(&path)).expect("file").as_deref(), Some("Bearer sk-file-6b1e"));
    assert_eq!(read(None, None).expect("neither"), None);
    let both = read(Some("Bearer v"), Some(&path)).expect_err("both");
    assert!(both.to_string().contains("FENCELINE_X_FILE") && !both.to_string().contains("Bearer"), "{both}");
    let missing = read(None, Some("/nonexistent/credential")).expect_err("no file");
    assert!(missing.to_string().contains("/nonexistent/credential"), "{missing}");
}

#[test]
fn every_kafka_secret_may_come_from_a_file_and_none_prints() {
    use clap::Parser;
    let dir = Scratch::new("kafka");
    let (password, key_password) = (dir.0.join("sasl"), dir.0.join("key"));
    std::fs::write(&password, "sasl-pass-91c2\n").expect("write");
    std::fs::write(&key_password, "key-pass-44d0").expect("write");
    let parsed = Service::try_parse_from([
        "svc",
        "--database-url",
        "postgres://x/y",
        "--kafka-security-protocol",
        "sasl_ssl",
        "--kafka-sasl-mechanism",
        "PLAIN",
        "--kafka-sasl-username",
        "u",
        "--kafka-sasl-password-file",
        &password.display().to_string(),
        "--kafka-ssl-key-password-file",
        &key_password.display().to_string(),
    ])
    .expect("parses");
    assert!(parsed.service.validate().is_ok());
    let printed = format!("{parsed:?}");
    assert!(!printed.contains("sasl-pass-91c2") && !printed.contains("key-pass-44d0"), "{printed}");
    let settings = parsed.service.kafka.security.client_settings();
    assert!(settings.contains(&("sasl.password", "sasl-pass-91c2".to_owned())));
    assert!(settings.contains(&("ssl.key.password", "key-pass-44d0".to_owned())));
}

#[test]
fn sasl_needs_a_mechanism_and_credentials() {
    use clap::Parser;
    let parse = |args: &[&str]| {
        let mut all = vec!["svc", "--database-url", "postgres://x/y"];
        all.extend_from_slice(args);
        Service::try_parse_from(all).expect("parses").service.validate()
    };
    assert!(parse(&["--kafka-security-protocol", "sasl_plaintext"]).is_err());
    assert!(parse(&["--kafka-sasl-username", "u"]).is_err(), "SASL settings without a SASL protocol");
    assert!(parse(&["--kafka-ssl-ca-location", "/ca.pem"]).is_err(), "TLS files without TLS");
    assert!(parse(&["--kafka-security-protocol", "ssl", "--kafka-ssl-ca-location", "/ca.pem"]).is_ok());
}

#[derive(Debug, clap::Parser)]
struct Service {
    #[command(flatten)]
    service: ServiceConfig,
}

#[test]
fn the_shared_options_form_one_valid_command_with_documented_defaults() {
    use clap::{CommandFactory, Parser};
    Service::command().debug_assert();
    let parsed = Service::try_parse_from(["svc", "--database-url", "postgres://x/y"]).expect("defaults suffice");
    assert_eq!(parsed.service.consumer.batch_max, 500);
    assert_eq!(parsed.service.outbox.batch_max, 500);
    assert!(parsed.service.validate().is_ok());
    let bad = Service::try_parse_from(["svc", "--database-url", "x", "--shutdown-grace-ms", "20000"]).expect("parses");
    assert!(bad.service.validate().is_err(), "grace longer than the session timeout");
}

#[test]
fn nested_timeouts_must_shrink_inwards() {
    let s = Duration::from_secs;
    assert!(require_nested("call", s(1), "step", s(2)).is_ok());
    let err = require_nested("call", s(2), "step", s(2)).expect_err("equal is not shorter");
    assert!(err.to_string().contains("call (2s) must be shorter than step (2s)"));
}
