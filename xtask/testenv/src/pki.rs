//! Certificates for the test control plane, made with `rcgen` (ECDSA P-256, as envtest does).
//!
//! Three independent authorities: one signs the API server's serving certificate, one signs client
//! certificates (so a test can become any user), and one key pair signs ServiceAccount tokens.

use std::net::{IpAddr, Ipv4Addr};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};

use super::TestingError;

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub(crate) struct PemPair {
    pub(crate) cert: String,
    pub(crate) key: String,
}

/// The control plane's key material.
pub(crate) struct Pki {
    pub(crate) serving_ca: String,
    serving_issuer: Issuer<'static, KeyPair>,
    pub(crate) serving: PemPair,
    pub(crate) client_ca: String,
    client_issuer: Issuer<'static, KeyPair>,
    pub(crate) sa_public_key: String,
    pub(crate) sa_private_key: String,
}

impl Pki {
    /// Keys for a control plane whose API server is also reached at `extra_ips` (a node's view of
    /// it: its address on the node link and the `kubernetes` Service's ClusterIP).
    pub(crate) fn generate(extra_ips: &[IpAddr]) -> Result<Self, TestingError> {
        let (serving_ca, serving_issuer) = new_ca("kube-netkit serving CA")?;
        let mut names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::IpAddress("::1".parse().map_err(pki_err)?),
        ];
        // The names a Pod uses for the API server, as in every cluster.
        for dns in [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ] {
            names.push(SanType::DnsName(dns.try_into().map_err(pki_err)?));
        }
        names.extend(extra_ips.iter().copied().map(SanType::IpAddress));
        let serving = leaf(
            &serving_issuer,
            "localhost",
            None,
            names,
            ExtendedKeyUsagePurpose::ServerAuth,
        )?;
        let (client_ca, client_issuer) = new_ca("kube-netkit client CA")?;
        let sa_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(pki_err)?;
        Ok(Self {
            serving_ca,
            serving_issuer,
            serving,
            client_ca,
            client_issuer,
            sa_public_key: sa_key.public_key_pem(),
            sa_private_key: sa_key.serialize_pem(),
        })
    }

    /// A client certificate for `user`, optionally in `group`; the API server maps the CN to the
    /// user name and the O to a group (rcgen writes one O, hence one group).
    pub(crate) fn client_cert(
        &self,
        user: &str,
        group: Option<&str>,
    ) -> Result<PemPair, TestingError> {
        leaf(
            &self.client_issuer,
            user,
            group,
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }
}

impl Pki {
    /// A serving certificate signed by the serving CA, e.g. for a kubelet at `ip`.
    pub(crate) fn serving_cert(&self, name: &str, ip: IpAddr) -> Result<PemPair, TestingError> {
        leaf(
            &self.serving_issuer,
            name,
            None,
            vec![
                SanType::DnsName(name.try_into().map_err(pki_err)?),
                SanType::IpAddress(ip),
            ],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }
}

fn new_ca(common_name: &str) -> Result<(String, Issuer<'static, KeyPair>), TestingError> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(pki_err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(common_name, Some("kube-netkit"));
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).map_err(pki_err)?;
    Ok((cert.pem(), Issuer::new(params, key)))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    common_name: &str,
    organization: Option<&str>,
    subject_alt_names: Vec<SanType>,
    usage: ExtendedKeyUsagePurpose,
) -> Result<PemPair, TestingError> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(pki_err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = name(common_name, organization);
    params.subject_alt_names = subject_alt_names;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, issuer).map_err(pki_err)?;
    Ok(PemPair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

fn name(common_name: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    if let Some(org) = organization {
        dn.push(DnType::OrganizationName, org);
    }
    dn
}

fn pki_err(err: impl std::error::Error + Send + Sync + 'static) -> TestingError {
    TestingError::Pki(Box::new(err))
}
