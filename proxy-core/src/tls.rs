//! rustls helpers shared by the workspace's TLS users (steward's upstream leg, the rstream
//! client), so the one insecure verifier and the one reading of PEM input are written and
//! reviewed once.
//!
//! PEM is parsed with `rustls-pki-types` (re-exported by rustls as `rustls::pki_types`), which
//! replaced the unmaintained `rustls-pemfile`.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject as _};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

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
