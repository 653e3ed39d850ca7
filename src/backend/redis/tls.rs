//! TLS to Redis (feature `redis-tls`): `rediss://` URLs, through redis-rs's rustls support.
//!
//! The server is checked against the system's root certificates plus, when given, one more CA
//! ([`tls_ca_pem`](super::RedisBackendBuilder::tls_ca_pem)); a client certificate is sent when
//! given ([`tls_client_cert`](super::RedisBackendBuilder::tls_client_cert)). Without the
//! feature, a `rediss://` URL is a configuration error that names it.

use crate::ConfigError;

/// The TLS material of a connection, when it uses TLS.
#[cfg(feature = "redis-tls")]
pub(crate) type Tls = Option<redis::TlsCertificates>;
#[cfg(not(feature = "redis-tls"))]
pub(crate) type Tls = ();

fn wants_tls(urls: &[&str]) -> bool {
    urls.iter()
        .any(|u| u.trim_start().to_ascii_lowercase().starts_with("rediss://"))
}

/// The certificates for `urls`: `None` without TLS, or without a CA or client certificate to
/// add (redis-rs then trusts the system's roots).
#[cfg(feature = "redis-tls")]
pub(crate) fn certificates(
    urls: &[&str],
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
) -> Result<Tls, ConfigError> {
    if !wants_tls(urls) {
        if ca.is_some() || client.is_some() {
            let shown: Vec<String> = urls
                .iter()
                .map(|u| crate::backend::remote::redact::url(u))
                .collect();
            return Err(ConfigError::Invalid {
                option: "url",
                reason: format!(
                    "{}: a TLS certificate is configured, but the URL is not `rediss://`",
                    shown.join(", ")
                ),
            });
        }
        return Ok(None);
    }
    if ca.is_none() && client.is_none() {
        return Ok(None);
    }
    // A CA given to redis-rs replaces the system's roots: they are added to it, so that the CA
    // is trusted besides them.
    let root_cert = match ca {
        Some(mut pem) => {
            check_pem("tls_ca_pem", &pem)?;
            for cert in rustls_native_certs::load_native_certs().certs {
                pem.extend_from_slice(b"\n-----BEGIN CERTIFICATE-----\n");
                let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, cert);
                for line in b64.as_bytes().chunks(64) {
                    pem.extend_from_slice(line);
                    pem.push(b'\n');
                }
                pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
            }
            Some(pem)
        }
        None => None,
    };
    let client_tls = match client {
        Some((client_cert, client_key)) => {
            check_pem("tls_client_cert", &client_cert)?;
            check_pem("tls_client_cert", &client_key)?;
            Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            })
        }
        None => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

#[cfg(feature = "redis-tls")]
fn check_pem(option: &'static str, pem: &[u8]) -> Result<(), ConfigError> {
    if pem.windows(11).any(|w| w == b"-----BEGIN ") {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            option,
            reason: "not PEM (no `-----BEGIN` line)".to_owned(),
        })
    }
}

/// Without the feature: a `rediss://` URL is refused, naming the feature.
#[cfg(not(feature = "redis-tls"))]
pub(crate) fn certificates(
    urls: &[&str],
    ca: Option<Vec<u8>>,
    client: Option<(Vec<u8>, Vec<u8>)>,
) -> Result<Tls, ConfigError> {
    if wants_tls(urls) || ca.is_some() || client.is_some() {
        let shown: Vec<String> = urls
            .iter()
            .map(|u| crate::backend::remote::redact::url(u))
            .collect();
        return Err(ConfigError::Invalid {
            option: "url",
            reason: format!(
                "{}: TLS (`rediss://`, `tls_ca_pem`, `tls_client_cert`) needs tollgate's feature `redis-tls`",
                shown.join(", ")
            ),
        });
    }
    Ok(())
}

/// A client for one node.
#[cfg(feature = "redis-tls")]
pub(crate) fn client(url: &str, tls: Tls) -> redis::RedisResult<redis::Client> {
    match tls {
        Some(certs) => redis::Client::build_with_tls(url, certs),
        None => redis::Client::open(url),
    }
}

/// A client for one node.
#[cfg(not(feature = "redis-tls"))]
pub(crate) fn client(url: &str, _tls: Tls) -> redis::RedisResult<redis::Client> {
    redis::Client::open(url)
}

/// A cluster client's builder, with the certificates when there are some.
#[cfg(feature = "redis-tls")]
pub(crate) fn cluster(
    builder: redis::cluster::ClusterClientBuilder,
    tls: Tls,
) -> redis::cluster::ClusterClientBuilder {
    match tls {
        Some(certs) => builder.certs(certs),
        None => builder,
    }
}

/// A cluster client's builder.
#[cfg(not(feature = "redis-tls"))]
pub(crate) fn cluster(
    builder: redis::cluster::ClusterClientBuilder,
    _tls: Tls,
) -> redis::cluster::ClusterClientBuilder {
    builder
}
