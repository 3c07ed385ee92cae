//! rustls helpers shared by the workspace's TLS users (steward's upstream leg and serving
//! certificate, the rstream client, pod-proxier's API), so the one insecure verifier, the one
//! reading of PEM input and the one reloading serving certificate are written and reviewed once.
//!
//! [`ReloadingCert`] serves a certificate and key read from files and re-reads them when their
//! content changes, as a mounted Kubernetes Secret rotates; a broken new pair is refused and the
//! previous one stays in use.
//!
//! PEM is parsed with `rustls-pki-types` (re-exported by rustls as `rustls::pki_types`), which
//! replaced the unmaintained `rustls-pemfile`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject as _};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio_util::sync::CancellationToken;

/// Why PEM input or a set of trust roots cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PemError {
    /// The text is not well-formed PEM.
    #[error("cannot parse PEM")]
    Parse(#[source] pem::Error),
    /// The PEM holds no `CERTIFICATE` section.
    #[error("no PEM certificate found")]
    NoCertificate,
    /// The PEM holds no private key (PKCS#8, PKCS#1 or SEC1).
    #[error("no PEM private key found")]
    NoPrivateKey,
    /// A CA certificate parsed as PEM but is not a usable trust anchor.
    #[error("invalid CA certificate")]
    InvalidCertificate(#[source] rustls::Error),
    /// No CA bundle was given and the system has no trust roots rustls can use.
    #[error("no system trust roots found; configure a CA bundle")]
    NoSystemRoots,
}

/// Every certificate of a PEM bundle, in order; at least one, or [`PemError::NoCertificate`].
pub fn certificates_from_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(PemError::Parse)?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate);
    }
    Ok(certs)
}

/// The first private key of a PEM text (PKCS#8, PKCS#1 or SEC1).
pub fn private_key_from_pem(pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => PemError::NoPrivateKey,
        other => PemError::Parse(other),
    })
}

/// The roots a client verifies servers against: every certificate of `ca_pem` when given (an
/// empty or unusable bundle is an error, never "trust nothing"), otherwise the system's roots
/// (the few rustls cannot parse are skipped; none at all is an error, found at start rather than
/// at the first handshake).
pub fn trust_roots(ca_pem: Option<&[u8]>) -> Result<RootCertStore, PemError> {
    let mut roots = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in certificates_from_pem(pem)? {
                roots.add(cert).map_err(PemError::InvalidCertificate)?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (_added, _unparsable) = roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err(PemError::NoSystemRoots);
            }
        }
    }
    Ok(roots)
}

/// Why a serving certificate and key cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// A file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no usable PEM certificate or key.
    #[error("{path}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        #[source]
        source: PemError,
    },
    /// The key is of a kind the crypto provider cannot sign with.
    #[error("{path}: unusable private key")]
    Key {
        /// The key file.
        path: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// The key does not belong to the certificate.
    #[error("{key} does not match the certificate in {cert}")]
    Mismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
}

/// A serving certificate read from a PEM certificate chain and a PEM private key, re-read when
/// the files' content changes (a rotated Kubernetes Secret, a renewed cert-manager
/// certificate), so a server picks up the new pair without a restart.
///
/// A new pair that cannot be used (unreadable, not PEM, a key of another certificate, or one
/// file written and the other not yet) is refused and the previous pair stays in use; it is
/// tried again once the files change again. Use it as rustls's certificate resolver, directly
/// or through [`ReloadingCert::server_config`], and call [`ReloadingCert::watch`] (or
/// [`ReloadingCert::reload_if_changed`] yourself) to pick up changes.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::path::Path;
/// use std::sync::Arc;
/// use std::time::Duration;
/// use proxy_core::tls::ReloadingCert;
///
/// let cert = Arc::new(ReloadingCert::load(Path::new("tls.crt"), Path::new("tls.key"))?);
/// let stop = tokio_util::sync::CancellationToken::new();
/// Arc::clone(&cert).watch(Duration::from_secs(5), stop.clone());
/// let config = ReloadingCert::server_config(&cert)?;
/// # let _ = config; Ok(()) }
/// ```
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    state: RwLock<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    /// What the resolver hands out: the last good pair.
    key: Arc<CertifiedKey>,
    /// The files' content when last read, good or not: a change of content is what triggers a
    /// reload (modification times can repeat within a clock tick, content cannot lie).
    seen: (Vec<u8>, Vec<u8>),
}

impl ReloadingCert {
    /// Reads and checks the pair now; an error here is for the caller to stop on.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, CertError> {
        let seen = (read(cert_path)?, read(key_path)?);
        let key = certified_key(cert_path, &seen.0, key_path, &seen.1)?;
        Ok(Self {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            state: RwLock::new(Loaded {
                key: Arc::new(key),
                seen,
            }),
        })
    }

    /// The certificate file.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// The key file.
    pub fn key_path(&self) -> &Path {
        &self.key_path
    }

    /// The pair served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        match self.state.read() {
            Ok(state) => Arc::clone(&state.key),
            // A panic while holding the lock cannot leave a half-written pair: each field is
            // replaced whole.
            Err(poisoned) => Arc::clone(&poisoned.into_inner().key),
        }
    }

    /// Re-reads the files; if their content changed since the last read, loads the new pair.
    /// `Ok(true)`: a new pair is served. `Ok(false)`: nothing changed (or the same broken
    /// content as last time). `Err`: the new content is refused and the previous pair stays.
    pub fn reload_if_changed(&self) -> Result<bool, CertError> {
        let seen = (read(&self.cert_path)?, read(&self.key_path)?);
        {
            let state = self.state.read().unwrap_or_else(|p| p.into_inner());
            if state.seen == seen {
                return Ok(false);
            }
        }
        let loaded = certified_key(&self.cert_path, &seen.0, &self.key_path, &seen.1);
        let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
        // Remember broken content too, so it is reported once, not at every check.
        state.seen = seen;
        state.key = Arc::new(loaded?);
        Ok(true)
    }

    /// Checks the files every `interval` on the current Tokio runtime until `stop`, logging each
    /// reload (info) and each refused pair (error, with its whole cause chain).
    pub fn watch(
        self: Arc<Self>,
        interval: Duration,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(interval) => {}
                }
                match self.reload_if_changed() {
                    Ok(false) => {}
                    Ok(true) => tracing::info!(
                        cert = %self.cert_path.display(),
                        "serving certificate reloaded"
                    ),
                    Err(err) => tracing::error!(
                        error = %crate::error::chain(&err),
                        "new serving certificate refused; keeping the previous one"
                    ),
                }
            }
        })
    }

    /// A server configuration (ring provider, TLS 1.2 and 1.3, no client certificates) that
    /// serves `cert`'s current pair at each handshake. Set ALPN and the like on the result.
    pub fn server_config(cert: &Arc<Self>) -> Result<rustls::ServerConfig, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(cert) as Arc<dyn ResolvesServerCert>))
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    std::fs::read(path).map_err(|source| CertError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certified_key(
    cert_path: &Path,
    cert_pem: &[u8],
    key_path: &Path,
    key_pem: &[u8],
) -> Result<CertifiedKey, CertError> {
    let certs = certificates_from_pem(cert_pem).map_err(|source| CertError::Pem {
        path: cert_path.to_owned(),
        source,
    })?;
    let key = private_key_from_pem(key_pem).map_err(|source| CertError::Pem {
        path: key_path.to_owned(),
        source,
    })?;
    let signing_key = rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|source| CertError::Key {
            path: key_path.to_owned(),
            source,
        })?;
    let certified = CertifiedKey::new(certs, signing_key);
    // Refuse a key of another certificate now, not at the first handshake.
    certified
        .keys_match()
        .map_err(|source| CertError::Mismatch {
            cert: cert_path.to_owned(),
            key: key_path.to_owned(),
            source,
        })?;
    Ok(certified)
}

/// Accepts any server certificate: for an explicit `--insecure`-style opt-in only. Handshake
/// signatures are still checked, so the peer must hold the key of the certificate it shows.
#[derive(Debug)]
pub struct AcceptAnyCert(Arc<CryptoProvider>);

impl AcceptAnyCert {
    /// A verifier checking signatures with `provider`'s algorithms.
    pub fn new(provider: Arc<CryptoProvider>) -> Self {
        Self(provider)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn test_ca() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["ca.test".to_owned()]).unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A serving pair for `127.0.0.1` signed by a fresh CA: (cert PEM, key PEM).
    fn serving_pair() -> (String, String) {
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let issuer = rcgen::Issuer::new(ca, rcgen::KeyPair::generate().unwrap());
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Replaces a file the way a Secret volume does: a new file renamed over the old one.
    fn replace(path: &Path, content: &str) {
        let next = path.with_extension("next");
        std::fs::write(&next, content).unwrap();
        std::fs::rename(&next, path).unwrap();
    }

    fn served(cert: &ReloadingCert) -> Vec<u8> {
        cert.current().cert[0].to_vec()
    }

    fn der(pem: &str) -> Vec<u8> {
        certificates_from_pem(pem.as_bytes()).unwrap()[0].to_vec()
    }

    #[test]
    fn a_new_pair_is_served_after_a_reload() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let (a_cert, a_key) = serving_pair();
        replace(&cert_path, &a_cert);
        replace(&key_path, &a_key);
        let cert = ReloadingCert::load(&cert_path, &key_path).unwrap();
        assert!(served(&cert) == der(&a_cert), "not serving a_cert");
        assert!(!cert.reload_if_changed().unwrap(), "nothing changed yet");

        let (b_cert, b_key) = serving_pair();
        replace(&cert_path, &b_cert);
        replace(&key_path, &b_key);
        assert!(cert.reload_if_changed().unwrap());
        assert!(served(&cert) == der(&b_cert), "not serving b_cert");
        ReloadingCert::server_config(&Arc::new(cert)).unwrap();
    }

    #[test]
    fn a_broken_new_pair_keeps_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let (a_cert, a_key) = serving_pair();
        replace(&cert_path, &a_cert);
        replace(&key_path, &a_key);
        let cert = ReloadingCert::load(&cert_path, &key_path).unwrap();

        // Half a rotation: the new certificate with the old key.
        let (b_cert, b_key) = serving_pair();
        replace(&cert_path, &b_cert);
        let err = cert.reload_if_changed().unwrap_err();
        assert!(matches!(err, CertError::Mismatch { .. }), "{err:?}");
        assert!(served(&cert) == der(&a_cert), "not serving a_cert");
        // The same broken content is not reported again.
        assert!(!cert.reload_if_changed().unwrap());

        // Not PEM at all.
        replace(&cert_path, "garbage\n");
        let err = cert.reload_if_changed().unwrap_err();
        assert!(
            matches!(
                err,
                CertError::Pem {
                    source: PemError::NoCertificate,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(served(&cert) == der(&a_cert), "not serving a_cert");

        // The rotation completes: the new pair is taken.
        replace(&cert_path, &b_cert);
        replace(&key_path, &b_key);
        assert!(cert.reload_if_changed().unwrap());
        assert!(served(&cert) == der(&b_cert), "not serving b_cert");

        // A missing file at start is an error naming it.
        let missing = dir.path().join("absent.crt");
        let err = ReloadingCert::load(&missing, &key_path).unwrap_err();
        assert!(err.to_string().contains("absent.crt"), "{err}");
    }

    #[test]
    fn certificates_and_keys_round_trip() {
        let (cert, key) = test_ca();
        let bundle = format!("{cert}{cert}");
        assert_eq!(certificates_from_pem(bundle.as_bytes()).unwrap().len(), 2);
        assert!(private_key_from_pem(key.as_bytes()).is_ok());
        assert_eq!(trust_roots(Some(cert.as_bytes())).unwrap().len(), 1);
    }

    #[test]
    fn empty_or_broken_input_is_an_error_not_an_empty_set() {
        let (cert, _) = test_ca();
        assert!(matches!(
            certificates_from_pem(b"not pem at all\n"),
            Err(PemError::NoCertificate)
        ));
        assert!(matches!(
            trust_roots(Some(b"")),
            Err(PemError::NoCertificate)
        ));
        assert!(matches!(
            private_key_from_pem(cert.as_bytes()),
            Err(PemError::NoPrivateKey)
        ));
        let truncated = &cert.as_bytes()[..cert.len() - 30];
        assert!(matches!(
            certificates_from_pem(truncated),
            Err(PemError::Parse(_))
        ));
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(matches!(
            trust_roots(Some(garbage.as_bytes())),
            Err(PemError::InvalidCertificate(_))
        ));
    }
}
