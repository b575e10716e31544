//! TLS on the way out: the provider adapter against the fake provider served over
//! TLS with certificates from a CA made here. A provider call (and the artifact
//! download from its other host) succeeds when the catalogue names that CA, and
//! fails before anything is sent, naming the certificate problem, when it does not.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fenceline_config::catalog::ProviderSpec;
use fenceline_domain::calls::CallOutcome;
use fenceline_fake_provider::{App, Capabilities, Config, TlsListener};
use fenceline_providers::{CallAnswer, HttpProvider, Lookup};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use serde_json::{Value, json};

/// A CA and the certificates it signed, as PEM files in a folder of their own.
struct Pki {
    dir: PathBuf,
    ca: Issuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("fenceline-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let ca = make_ca(&dir, "ca");
        Self { dir, ca }
    }

    /// Another CA, which signed nothing here.
    fn another_ca(&self, name: &str) -> PathBuf {
        make_ca(&self.dir, name);
        self.path(&format!("{name}.pem"))
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

/// Writes `{name}.pem`, a self-signed CA certificate, and returns the CA.
fn make_ca(dir: &Path, name: &str) -> Issuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, format!("Fenceline test {name}"));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("self-signed CA");
    std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("write CA");
    Issuer::new(params, key)
}

impl Pki {
    /// Writes `{name}.pem` and `{name}.key` for the names, signed by the CA.
    fn issue(&self, name: &str, names: &[&str], usage: ExtendedKeyUsagePurpose) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("signed");
        let (cert_path, key_path) = (self.path(&format!("{name}.pem")), self.path(&format!("{name}.key")));
        std::fs::write(&cert_path, cert.pem()).expect("write certificate");
        write_private(&key_path, &key.serialize_pem());
        (cert_path, key_path)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write_private(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write key");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("key mode");
}

struct Provider {
    base: String,
    ca: PathBuf,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// The fake provider over TLS; with `client_ca`, it wants client certificates.
async fn start_provider(pki: &Pki, client_ca: Option<PathBuf>) -> Provider {
    let (certificate, key) = pki.issue("provider", &["localhost", "127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth);
    let config = Config {
        http: fenceline_config::HttpConfig { addr: ([127, 0, 0, 1], 0).into(), shutdown_grace_ms: 1_000 },
        capabilities: Capabilities { lookup: true, ..Capabilities::default() },
        async_delay_ms: 100,
        price_cents: 4,
        tls: TlsListener { certificate_file: Some(certificate), key_file: Some(key), client_ca_file: client_ca },
    };
    let app = App::build(config).expect("the fake provider starts over TLS");
    let base = format!("https://localhost:{}", app.port());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    Provider { base, ca: pki.path("ca.pem"), _stop: stop }
}

fn spec(base: &str, tls: Value) -> ProviderSpec {
    serde_json::from_value(json!({
        "base_url": base,
        "capabilities": { "lookup": true },
        "call_timeout_ms": 5_000,
        "concurrency": 1,
        "rate_per_second": 10,
        "burst": 10,
        "tls": tls,
    }))
    .expect("provider spec")
}

/// The provider's own admin endpoints, reached with its CA and, if it wants one,
/// a client certificate.
async fn admin(
    provider: &Provider,
    client: Option<(PathBuf, PathBuf)>,
    method: &str,
    path: &str,
    body: Value,
) -> Value {
    let url = format!("{}{path}", provider.base);
    let (ca, method) = (provider.ca.clone(), method.to_owned());
    tokio::task::spawn_blocking(move || {
        use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig};
        let ca = Certificate::from_pem(&std::fs::read(ca).expect("CA")).expect("CA pem");
        let client = client.map(|(cert, key)| {
            let cert = Certificate::from_pem(&std::fs::read(cert).expect("cert")).expect("cert pem");
            let key = PrivateKey::from_pem(&std::fs::read(key).expect("key")).expect("key pem");
            ClientCert::new_with_certs(&[cert], key)
        });
        let tls = TlsConfig::builder()
            .root_certs(RootCerts::new_with_certs(&[ca]))
            .client_cert(client)
            .unversioned_rustls_crypto_provider(std::sync::Arc::new(rustls_ring()))
            .build();
        let agent = ureq::Agent::config_builder()
            .tls_config(tls)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .new_agent();
        let mut response = match method.as_str() {
            "GET" => agent.get(&url).call(),
            _ => agent.post(&url).send_json(&body),
        }
        .expect("admin call");
        let text = response.body_mut().read_to_string().unwrap_or_default();
        serde_json::from_str(&text).unwrap_or(Value::Null)
    })
    .await
    .expect("admin thread")
}

fn rustls_ring() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

async fn calls(provider: &Provider, client: Option<(PathBuf, PathBuf)>) -> usize {
    admin(provider, client, "GET", "/admin/calls", Value::Null).await.as_array().map_or(0, Vec::len)
}

fn not_sent_detail(answer: CallAnswer) -> String {
    match answer {
        CallAnswer::Outcome(CallOutcome::NotSent, Some(detail)) => detail,
        other => panic!("expected a call that was not sent, with the reason; got {other:?}"),
    }
}

#[tokio::test]
async fn a_provider_behind_tls_is_reached_with_its_ca_and_refused_without_it() {
    let pki = Pki::new();
    let provider = start_provider(&pki, None).await;
    // Artifacts come from the provider's other host, over TLS as well.
    admin(&provider, None, "POST", "/admin/rules", json!({ "on": "start", "serve_artifact": "other_host" })).await;

    let trusting = HttpProvider::new("tlsgen", &spec(&provider.base, json!({ "ca_file": provider.ca })))
        .expect("the adapter reads its CA");
    let answer = trusting.start("render", json!({ "prompt": "a lamp" }), "key-trusted").await;
    let CallAnswer::Done { result, .. } = answer else { panic!("a call with the provider's CA succeeds: {answer:?}") };
    assert!(result.uri.starts_with("https://localhost:") && !result.uri.starts_with(&provider.base), "{}", result.uri);
    trusting.verify(&result).await.expect("the artifact is fetched from the other host with the same CA");
    assert!(matches!(trusting.lookup("key-trusted").await, Lookup::Found { .. }));

    // The system's roots do not know the test CA: nothing leaves, and the error says why.
    let system_roots = HttpProvider::new("tlsgen", &spec(&provider.base, json!({}))).expect("adapter");
    let detail = not_sent_detail(system_roots.start("render", json!({}), "key-untrusted").await);
    assert!(detail.contains("UnknownIssuer") && detail.contains("the system's roots"), "{detail}");
    let Lookup::NoAnswer(why) = system_roots.lookup("key-trusted").await else { panic!("no look-up without trust") };
    assert!(why.contains("UnknownIssuer"), "{why}");
    let refused = system_roots.verify(&result).await.expect_err("no artifact without trust").to_string();
    assert!(refused.contains("UnknownIssuer"), "{refused}");

    // A CA that did not sign the provider's certificate is no better.
    let other_ca = pki.another_ca("other-ca");
    let wrong = HttpProvider::new("tlsgen", &spec(&provider.base, json!({ "ca_file": other_ca }))).expect("adapter");
    let detail = not_sent_detail(wrong.start("render", json!({}), "key-wrong-ca").await);
    assert!(detail.contains("invalid peer certificate") && detail.contains("other-ca.pem"), "{detail}");

    assert_eq!(calls(&provider, None).await, 1, "only the trusted call reached the provider");
}

#[tokio::test]
async fn a_provider_that_wants_a_client_certificate_gets_the_configured_one() {
    let pki = Pki::new();
    let provider = start_provider(&pki, Some(pki.path("ca.pem"))).await;
    let client = pki.issue("executor", &["executor.fenceline"], ExtendedKeyUsagePurpose::ClientAuth);

    let without = HttpProvider::new("mtls", &spec(&provider.base, json!({ "ca_file": provider.ca }))).expect("adapter");
    match without.start("render", json!({}), "key-anonymous").await {
        CallAnswer::Outcome(CallOutcome::NotSent, Some(detail)) => {
            assert!(detail.to_lowercase().contains("certificate"), "the refusal names the certificate: {detail}");
        }
        // In TLS 1.3 the client's certificate is judged after the client finished its
        // handshake and may have written the request: the refusal can arrive as a
        // closed connection, which only says the request may have left.
        CallAnswer::Outcome(CallOutcome::ResetMidResponse, Some(_)) => {}
        other => panic!("a call without the client certificate fails: {other:?}"),
    }

    let with = HttpProvider::new(
        "mtls",
        &spec(
            &provider.base,
            json!({ "ca_file": provider.ca, "client_certificate_file": client.0, "client_key_file": client.1 }),
        ),
    )
    .expect("adapter with a client certificate");
    let answer = with.start("render", json!({}), "key-known").await;
    let CallAnswer::Done { result, .. } = answer else {
        panic!("a call with the client certificate succeeds: {answer:?}")
    };
    with.verify(&result).await.expect("the artifact download presents the certificate too");
    assert_eq!(calls(&provider, Some(client.clone())).await, 1, "only the authenticated call was received");

    // A key that is not the certificate's stops the service at start, not at its first call.
    let (_, stranger_key) = pki.issue("stranger", &["stranger"], ExtendedKeyUsagePurpose::ClientAuth);
    let mismatched =
        json!({ "ca_file": provider.ca, "client_certificate_file": client.0, "client_key_file": stranger_key });
    let err = HttpProvider::new("mtls", &spec(&provider.base, mismatched)).expect_err("a foreign key").to_string();
    assert!(err.contains("provider `mtls`") && err.contains("client certificate"), "{err}");
    let missing = json!({ "ca_file": pki.path("absent.pem") });
    let err = HttpProvider::new("mtls", &spec(&provider.base, missing)).expect_err("a missing CA").to_string();
    assert!(err.contains("absent.pem"), "{err}");
}
