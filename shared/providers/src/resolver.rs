//! Where a provider's calls connect: an address written as an IP needs no lookup,
//! so none is made; a host name is looked up as the HTTP client does by default.
//!
//! The client's own resolver starts a thread for every lookup made under a timeout
//! (every call here has one), even for `127.0.0.1`: a thread created and ended per
//! paid call, about a third of what a call cost its process on loopback
//! (docs/decisions.md, entry 60). A name keeps that lookup.

use std::net::{IpAddr, SocketAddr};

use ureq::http::Uri;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::NextTimeout;

/// Literal addresses as they are; names by the client's default lookup.
#[derive(Debug, Default)]
pub(crate) struct LiteralOrLookup {
    names: DefaultResolver,
}

impl Resolver for LiteralOrLookup {
    fn resolve(
        &self,
        uri: &Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let Some(address) = literal(uri) else {
            return self.names.resolve(uri, config, timeout);
        };
        let mut found = self.empty();
        for wanted in config.ip_family().keep_wanted(std::iter::once(address)) {
            found.push(wanted);
        }
        if found.is_empty() { Err(ureq::Error::HostNotFound) } else { Ok(found) }
    }
}

/// The socket address of `uri` when its host is an IP literal (an IPv6 one in
/// brackets), with its port or its scheme's.
fn literal(uri: &Uri) -> Option<SocketAddr> {
    let authority = uri.authority()?;
    let host = authority.host();
    let ip: IpAddr = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host).parse().ok()?;
    let port = authority.port_u16().or_else(|| match uri.scheme_str()? {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    })?;
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(text: &str) -> Uri {
        text.parse().expect("a URI")
    }

    #[test]
    fn an_ip_literal_is_its_own_address_with_its_port_or_its_schemes() {
        assert_eq!(literal(&uri("http://127.0.0.1:8080/v1")), Some("127.0.0.1:8080".parse().expect("address")));
        assert_eq!(literal(&uri("https://10.0.0.7/v1")), Some("10.0.0.7:443".parse().expect("address")));
        assert_eq!(literal(&uri("http://[::1]:9000/x")), Some("[::1]:9000".parse().expect("address")));
        assert_eq!(literal(&uri("http://[2001:db8::5]/")), Some("[2001:db8::5]:80".parse().expect("address")));
    }

    #[test]
    fn a_name_is_no_literal() {
        assert_eq!(literal(&uri("https://api.openai.com/v1/images")), None);
        assert_eq!(literal(&uri("http://localhost:8080/")), None);
        // A dotted name that only looks numeric at its start.
        assert_eq!(literal(&uri("http://127.0.0.1.nip.io:80/")), None);
    }

    #[test]
    fn a_literal_of_a_family_the_client_refuses_is_not_found() {
        let config = ureq::config::Config::builder().ip_family(ureq::config::IpFamily::Ipv4Only).build();
        let resolver = LiteralOrLookup::default();
        let refused = resolver.resolve(&uri("http://[::1]:9000/"), &config, NextTimeout::default());
        assert!(matches!(refused, Err(ureq::Error::HostNotFound)), "{refused:?}");
        let kept = resolver.resolve(&uri("http://127.0.0.1:9000/"), &config, NextTimeout::default()).expect("kept");
        assert_eq!(kept.to_vec(), vec!["127.0.0.1:9000".parse::<SocketAddr>().expect("address")]);
    }
}
