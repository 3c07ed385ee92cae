//! The engine's PKI: a fresh CA and a server certificate for the loopback names, kept across
//! restarts when a test wants the same identity.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::error::Result;
use crate::tls;
use crate::tls::{ClientIdentity, TlsOptions};

use super::other;

pub(super) fn ca_params() -> rcgen::CertificateParams {
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "rstream local engine CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// The engine's TLS identity: a CA and a server certificate it signed. Keep it to restart an engine
/// with the same certificate, and to issue mTLS client certificates.
#[derive(Clone)]
pub struct EngineIdentity {
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    ca_key_der: Vec<u8>,
    cert_chain: Vec<CertificateDer<'static>>,
    key_der: Vec<u8>,
}

impl std::fmt::Debug for EngineIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineIdentity").finish_non_exhaustive()
    }
}

impl EngineIdentity {
    /// Generates a CA and a server certificate for `localhost`, `127.0.0.1` and `::1`.
    pub fn generate() -> Result<Self> {
        Self::generate_for(&[])
    }

    /// Like [`EngineIdentity::generate`], with more names (DNS names or IP addresses) in the
    /// server certificate: an engine that Pods reach at the host's address, say.
    pub fn generate_for(extra_names: &[&str]) -> Result<Self> {
        let ca_key = rcgen::KeyPair::generate().map_err(other)?;
        let ca_key_der = ca_key.serialize_der();
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params(), ca_key).map_err(other)?;
        let mut names = vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ];
        names.extend(extra_names.iter().map(|n| (*n).to_owned()));
        let mut params = rcgen::CertificateParams::new(names).map_err(other)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "localhost");
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let cert = params.signed_by(&key, &ca).map_err(other)?;
        Ok(Self {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            ca_key_der,
            cert_chain: vec![cert.der().clone()],
            key_der: key.serialize_der(),
        })
    }

    /// The identity (CA certificate and key, server chain and key) as JSON, to restart the same
    /// engine in another process ([`EngineIdentity::from_json`]). It holds private keys: keep it
    /// in a file only the engine's user reads.
    pub fn to_json(&self) -> String {
        use base64::Engine as _;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        serde_json::json!({
            "caPem": self.ca_pem,
            "caDer": b64(&self.ca_der),
            "caKeyDer": b64(&self.ca_key_der),
            "certChainDer": self.cert_chain.iter().map(|c| b64(c)).collect::<Vec<_>>(),
            "keyDer": b64(&self.key_der),
        })
        .to_string()
    }

    /// Reads an identity written by [`EngineIdentity::to_json`].
    pub fn from_json(json: &str) -> Result<Self> {
        use base64::Engine as _;
        let v: serde_json::Value = serde_json::from_str(json).map_err(other)?;
        let bytes = |field: &serde_json::Value, name: &str| -> Result<Vec<u8>> {
            let text = field
                .as_str()
                .ok_or_else(|| other(format!("engine identity: {name} is not a string")))?;
            base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| other(format!("engine identity: {name}: {e}")))
        };
        let cert_chain = v["certChainDer"]
            .as_array()
            .ok_or_else(|| other("engine identity: certChainDer is not a list"))?
            .iter()
            .map(|c| bytes(c, "certChainDer").map(CertificateDer::from))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            ca_pem: v["caPem"]
                .as_str()
                .ok_or_else(|| other("engine identity: caPem is not a string"))?
                .to_owned(),
            ca_der: CertificateDer::from(bytes(&v["caDer"], "caDer")?),
            ca_key_der: bytes(&v["caKeyDer"], "caKeyDer")?,
            cert_chain,
            key_der: bytes(&v["keyDer"], "keyDer")?,
        })
    }

    /// The CA certificate (PEM) that clients must trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Client TLS options trusting this identity's CA.
    pub fn client_tls(&self) -> TlsOptions {
        TlsOptions::new().ca_pem(self.ca_pem.as_bytes().to_vec())
    }

    /// Issues a client certificate signed by the CA, for mTLS engines.
    pub fn issue_client_identity(&self, common_name: &str) -> Result<ClientIdentity> {
        let ca_key = rcgen::KeyPair::try_from(self.ca_key_der.as_slice()).map_err(other)?;
        let issuer = rcgen::Issuer::new(ca_params(), ca_key);
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(other)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.use_authority_key_identifier_extension = true;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let cert = params.signed_by(&key, &issuer).map_err(other)?;
        Ok(ClientIdentity::from_der(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        ))
    }

    pub(super) fn server_config(
        &self,
        require_client_cert: bool,
        alpn: &[Vec<u8>],
    ) -> Result<Arc<rustls::ServerConfig>> {
        let provider = tls::provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(other)?;
        let builder = if require_client_cert {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.ca_der.clone()).map_err(other)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(other)?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()));
        let mut config = builder
            .with_single_cert(self.cert_chain.clone(), key)
            .map_err(other)?;
        config.alpn_protocols = alpn.to_vec();
        Ok(Arc::new(config))
    }
}
