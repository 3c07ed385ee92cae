//! TLS-termination mode: the original's optional mode, with its gaps closed.
//!
//! * The serving certificate is re-read when its files change (rotation without restart); a
//!   broken new pair is refused with an error log and the old one stays in use.
//! * The upstream is verified against `--upstream-ca-file` (or the system roots) unless
//!   `--upstream-insecure` is given explicitly.
//! * ALPN is mirrored: the upstream is offered exactly what the client offered, and the client gets
//!   what the upstream chose, so HTTP/2 survives the hop.
//! * The TLS handshake is bounded by the connect timeout.
//!
//! Client certificates cannot pass a TLS-terminating hop; use passthrough (the default) for that.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio_util::sync::CancellationToken;

/// Errors of the TLS set-up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable certificate or key.
    #[error("{path}: {problem}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The serving certificate, reloaded when its files change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<(Arc<CertifiedKey>, Option<SystemTime>)>,
}

impl ReloadingCert {
    /// Loads the pair now (an error here stops start-up).
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, TlsError> {
        let key = load_certified_key(cert_path, key_path)?;
        Ok(Self {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            current: RwLock::new((Arc::new(key), modified(cert_path, key_path))),
        })
    }

    /// Re-reads the files if they changed since the last load; keeps the old pair on error.
    pub fn reload_if_changed(&self) {
        let stamp = modified(&self.cert_path, &self.key_path);
        let unchanged = self.current.read().map(|c| c.1 == stamp).unwrap_or(true);
        if unchanged {
            return;
        }
        match load_certified_key(&self.cert_path, &self.key_path) {
            Ok(key) => {
                if let Ok(mut current) = self.current.write() {
                    *current = (Arc::new(key), stamp);
                }
                tracing::info!(cert = %self.cert_path.display(), "serving certificate reloaded");
            }
            Err(err) => {
                tracing::error!(error = %err, "new serving certificate refused; keeping the previous one")
            }
        }
    }

    /// Checks the files every `interval` until `stop`.
    pub fn watch(self: Arc<Self>, interval: Duration, stop: CancellationToken) {
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(interval) => self.reload_if_changed(),
                }
            }
        });
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| Arc::clone(&c.0))
    }
}

fn modified(cert: &Path, key: &Path) -> Option<SystemTime> {
    let a = fs::metadata(cert).and_then(|m| m.modified()).ok()?;
    let b = fs::metadata(key).and_then(|m| m.modified()).ok()?;
    Some(a.max(b))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Invalid {
            path: path.to_owned(),
            problem: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Invalid {
            path: path.to_owned(),
            problem: "no PEM certificate found".to_owned(),
        });
    }
    Ok(certs)
}

fn load_certified_key(cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let certs = load_certs(cert_path)?;
    let pem = read(key_path)?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| TlsError::Invalid {
            path: key_path.to_owned(),
            problem: e.to_string(),
        })?
        .ok_or_else(|| TlsError::Invalid {
            path: key_path.to_owned(),
            problem: "no PEM private key found".to_owned(),
        })?;
    let provider = rustls::crypto::ring::default_provider();
    let signing_key =
        provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| TlsError::Invalid {
                path: key_path.to_owned(),
                problem: e.to_string(),
            })?;
    let certified = CertifiedKey::new(certs, signing_key);
    // Refuse a key that does not belong to the certificate now, not at the first handshake.
    certified.keys_match().map_err(|e| TlsError::Invalid {
        path: key_path.to_owned(),
        problem: format!("key does not match the certificate: {e}"),
    })?;
    Ok(certified)
}

/// The client configuration of the upstream leg (ALPN is set per connection).
pub fn upstream_client_config(
    ca_file: Option<&Path>,
    insecure: bool,
) -> Result<rustls::ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    if insecure {
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(provider)))
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in load_certs(path)? {
                roots.add(cert).map_err(|e| TlsError::Invalid {
                    path: path.to_owned(),
                    problem: e.to_string(),
                })?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                // A broken system certificate should not stop the proxy; skip it.
                let _ = roots.add(cert);
            }
        }
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// The server configuration for one connection: our certificate, and the ALPN protocol the
/// upstream chose (if any).
pub fn server_config(
    cert: Arc<ReloadingCert>,
    alpn: Option<Vec<u8>>,
) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    config.alpn_protocols = alpn.into_iter().collect();
    Ok(config)
}

/// `--upstream-insecure`: accepts any certificate, still checks handshake signatures.
#[derive(Debug)]
struct AcceptAnyCert(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
