//! TLS configuration (rustls, ring provider) for engine connections: ALPN `rstrm/1`, trust roots,
//! server-name override, an insecure mode for local engines, and the mTLS client identity.

use std::path::Path;
use std::sync::Arc;

use proxy_core::tls::AcceptAnyCert;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::error::{Error, Result};

/// The ALPN protocol of the rstream tunnel protocol.
pub const ALPN: &[u8] = b"rstrm/1";

/// A client certificate chain and private key, for mTLS authentication (the alternative to a token).
pub struct ClientIdentity {
    pub(crate) cert_chain: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivateKeyDer<'static>,
}

impl Clone for ClientIdentity {
    fn clone(&self) -> Self {
        Self {
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("certificates", &self.cert_chain.len())
            .finish_non_exhaustive()
    }
}

impl ClientIdentity {
    /// Parses a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem(cert_chain_pem: &[u8], key_pem: &[u8]) -> Result<Self> {
        let cert_chain = proxy_core::tls::certificates_from_pem(cert_chain_pem).map_err(|e| {
            Error::InvalidConfig(format!("the client certificate PEM: {}", chain(&e)))
        })?;
        let key = proxy_core::tls::private_key_from_pem(key_pem)
            .map_err(|e| Error::InvalidConfig(format!("the client key PEM: {}", chain(&e))))?;
        Ok(Self { cert_chain, key })
    }

    /// Reads [`ClientIdentity::from_pem`] input from files.
    pub fn from_files(cert_file: impl AsRef<Path>, key_file: impl AsRef<Path>) -> Result<Self> {
        let cert = read_file(cert_file.as_ref())?;
        let key = read_file(key_file.as_ref())?;
        Self::from_pem(&cert, &key)
    }

    /// Builds an identity from DER parts.
    pub fn from_der(cert_chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Self {
        Self { cert_chain, key }
    }
}

/// TLS options for engine connections.
#[derive(Clone, Debug, Default)]
pub struct TlsOptions {
    pub(crate) ca_pem: Option<Vec<u8>>,
    pub(crate) server_name: Option<String>,
    pub(crate) insecure_skip_verify: bool,
    pub(crate) client_identity: Option<ClientIdentity>,
}

impl TlsOptions {
    /// Default options: system trust roots, SNI = engine host, no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts the certificates of this PEM bundle instead of the system roots.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Reads a PEM CA bundle from a file (see [`TlsOptions::ca_pem`]).
    pub fn ca_file(self, path: impl AsRef<Path>) -> Result<Self> {
        let pem = read_file(path.as_ref())?;
        Ok(self.ca_pem(pem))
    }

    /// Overrides the SNI / verification name for the configured engine (not used for redirected
    /// `proxy_endpoint` dials).
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Disables certificate verification. Only for local test engines.
    pub fn insecure_skip_verify(mut self, insecure: bool) -> Self {
        self.insecure_skip_verify = insecure;
        self
    }

    /// Presents this client certificate (mTLS). Mutually exclusive with a token.
    pub fn client_identity(mut self, identity: ClientIdentity) -> Self {
        self.client_identity = Some(identity);
        self
    }

    /// Whether a client certificate is configured.
    pub fn has_client_identity(&self) -> bool {
        self.client_identity.is_some()
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::InvalidConfig(format!("cannot read {}: {e}", path.display())))
}

/// `error: cause: cause`, for messages that must stand alone in a `String`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds a rustls client configuration offering exactly `alpn`.
pub(crate) fn client_config_with_alpn(
    options: &TlsOptions,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>> {
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::InvalidConfig(format!("TLS: {e}")))?;
    let builder = if options.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert::new(provider)))
    } else {
        let roots = proxy_core::tls::trust_roots(options.ca_pem.as_deref())
            .map_err(|e| Error::InvalidConfig(format!("the CA bundle: {}", chain(&e))))?;
        builder.with_root_certificates(roots)
    };
    let mut config = match &options.client_identity {
        Some(id) => builder
            .with_client_auth_cert(id.cert_chain.clone(), id.key.clone_key())
            .map_err(|e| Error::InvalidConfig(format!("invalid client certificate: {e}")))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// Builds the rustls client configuration for the tunnel protocol (ALPN `rstrm/1`).
pub fn client_config(options: &TlsOptions) -> Result<Arc<rustls::ClientConfig>> {
    client_config_with_alpn(options, &[ALPN])
}

/// Converts a host (DNS name or IP literal, brackets allowed) into a rustls server name.
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(bare.to_owned()).map_err(|e| Error::InvalidEngine(format!("{host}: {e}")))
}
