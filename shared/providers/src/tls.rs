//! TLS towards providers: which roots a provider's certificate must chain to (the
//! system's, or the catalogue's `tls.ca_file`), the client certificate for mutual
//! TLS, and how a refused handshake is told apart from a request that left
//! (docs/catalog.md, "TLS").

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fenceline_config::catalog::ProviderTls;
use rustls::AlertDescription;
use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};

/// Why a provider's TLS settings or its credential could not be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("provider `{provider}`: reading {}: {source}", path.display())]
    Read { provider: String, path: PathBuf, source: std::io::Error },
    #[error("provider `{provider}`: {} is not PEM: {reason}", path.display())]
    NotPem { provider: String, path: PathBuf, reason: String },
    #[error("provider `{provider}`: {} holds no {what}", path.display())]
    Missing { provider: String, path: PathBuf, what: &'static str },
    #[error("provider `{provider}`: the client certificate and its key cannot be used together: {reason}")]
    ClientCertificate { provider: String, reason: String },
    #[error("provider `{provider}`: its credential (auth_header_env): {reason}")]
    Credential { provider: String, reason: String },
    #[error("provider `{provider}`: its dialect: {reason}")]
    Dialect { provider: String, reason: String },
}

/// The TLS settings of one provider, ready for its agents, and how to name its
/// roots in an error.
pub(crate) struct Settings {
    pub config: TlsConfig,
    pub roots: String,
}

/// Reads the files a provider's TLS settings name. A service refuses to start on
/// files that cannot be read or do not fit, rather than failing every call.
pub(crate) fn settings(provider: &str, tls: &ProviderTls) -> Result<Settings, Error> {
    let crypto = Arc::new(rustls::crypto::ring::default_provider());
    let (root_certs, roots) = match &tls.ca_file {
        Some(path) => {
            let certs = certificates(provider, path)?;
            (RootCerts::new_with_certs(&certs), format!("the CA certificates of {}", path.display()))
        }
        None => (RootCerts::PlatformVerifier, "the system's roots".to_owned()),
    };
    let client_cert = match (&tls.client_certificate_file, &tls.client_key_file) {
        (Some(cert_path), Some(key_path)) => {
            let chain = certificates(provider, cert_path)?;
            let key = private_key(provider, key_path)?;
            check_client_certificate(provider, &crypto, &chain, key_path)?;
            Some(ClientCert::new_with_certs(&chain, key))
        }
        _ => None,
    };
    let config = TlsConfig::builder()
        .root_certs(root_certs)
        .client_cert(client_cert)
        .unversioned_rustls_crypto_provider(crypto)
        .build();
    Ok(Settings { config, roots })
}

fn read(provider: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Read { provider: provider.to_owned(), path: path.to_owned(), source })
}

fn pem_items(provider: &str, path: &Path) -> Result<Vec<PemItem<'static>>, Error> {
    ureq::tls::parse_pem(&read(provider, path)?).collect::<Result<Vec<_>, _>>().map_err(|e| Error::NotPem {
        provider: provider.to_owned(),
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

fn certificates(provider: &str, path: &Path) -> Result<Vec<Certificate<'static>>, Error> {
    let certs: Vec<_> = pem_items(provider, path)?
        .into_iter()
        .filter_map(|item| match item {
            PemItem::Certificate(c) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(Error::Missing { provider: provider.to_owned(), path: path.to_owned(), what: "certificate" });
    }
    Ok(certs)
}

fn private_key(provider: &str, path: &Path) -> Result<PrivateKey<'static>, Error> {
    pem_items(provider, path)?
        .into_iter()
        .find_map(|item| match item {
            PemItem::PrivateKey(k) => Some(k),
            _ => None,
        })
        .ok_or_else(|| Error::Missing { provider: provider.to_owned(), path: path.to_owned(), what: "private key" })
}

/// The TLS client would panic on a key it cannot use; a key that is not the
/// certificate's would fail every handshake. Find out at start instead.
fn check_client_certificate(
    provider: &str,
    crypto: &Arc<rustls::crypto::CryptoProvider>,
    chain: &[Certificate<'static>],
    key_path: &Path,
) -> Result<(), Error> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let refused = |reason: String| Error::ClientCertificate { provider: provider.to_owned(), reason };
    let key = PrivateKeyDer::from_pem_slice(&read(provider, key_path)?).map_err(|e| refused(e.to_string()))?;
    let chain = chain.iter().map(|c| CertificateDer::from(c.der().to_vec())).collect();
    rustls::sign::CertifiedKey::from_der(chain, key, crypto).map(|_| ()).map_err(|e| refused(e.to_string()))
}

/// The TLS error behind a failed exchange, when the handshake was refused: by us
/// (the provider's certificate did not check out) or by the provider (it refused
/// ours). A refused handshake means the provider's HTTP layer never saw the request.
pub(crate) fn refused_handshake(e: &ureq::Error) -> Option<&rustls::Error> {
    let tls = match e {
        ureq::Error::Rustls(tls) => tls,
        ureq::Error::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>()?,
        _ => return None,
    };
    let refused = match tls {
        rustls::Error::InvalidCertificate(_)
        | rustls::Error::NoCertificatesPresented
        | rustls::Error::UnsupportedNameType
        | rustls::Error::PeerIncompatible(_) => true,
        rustls::Error::AlertReceived(alert) => matches!(
            alert,
            AlertDescription::HandshakeFailure
                | AlertDescription::BadCertificate
                | AlertDescription::UnsupportedCertificate
                | AlertDescription::CertificateRevoked
                | AlertDescription::CertificateExpired
                | AlertDescription::CertificateUnknown
                | AlertDescription::UnknownCA
                | AlertDescription::CertificateRequired
                | AlertDescription::ProtocolVersion
                | AlertDescription::InsufficientSecurity
        ),
        _ => false,
    };
    refused.then_some(tls)
}
