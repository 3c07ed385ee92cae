//! `/metrics` behind the API server's authentication and RBAC, the way controller-runtime's
//! `--metrics-secure` does it: HTTPS, a bearer token judged by a `TokenReview`, and a
//! `SubjectAccessReview` for `get` on the non-resource URL `/metrics`.
//!
//! A scraper's ServiceAccount then needs a ClusterRole rule
//! `{nonResourceURLs: ["/metrics"], verbs: ["get"]}`, and the binary's own ServiceAccount
//! `create` on `tokenreviews.authentication.k8s.io` and
//! `subjectaccessreviews.authorization.k8s.io` (what `system:auth-delegator` grants).
//!
//! ```no_run
//! use netkit_runtime::{App, MetricsArgs};
//!
//! async fn run(metrics_args: MetricsArgs, client: kube::Client) -> Result<(), netkit_runtime::Error> {
//!     let app = App::builder("my-binary", "0.1.0")
//!         .serve_health(["0.0.0.0:8081".parse().expect("an address")])
//!         .serve_metrics(["0.0.0.0:8443".parse().expect("an address")], metrics_args.access(&client)?)
//!         .start()
//!         .await?;
//!     app.shutdown().cancelled().await;
//!     app.finish().await;
//!     Ok(())
//! }
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use proxy_core::tls::ReloadingCert;

use super::values::parse_go_bool;
use crate::Error;
use k8s_reconcile::auth::Authenticator;

/// Who may read `/metrics` ([`AppBuilder::serve_metrics`](super::AppBuilder::serve_metrics)).
#[derive(Clone)]
pub struct MetricsAccess {
    secure: Option<Secure>,
}

/// What a secure metrics server needs.
#[derive(Clone)]
pub(crate) struct Secure {
    /// Judges the scraper's bearer token and access.
    pub(crate) auth: Arc<Authenticator>,
    /// The server's TLS configuration.
    pub(crate) tls: Arc<rustls::ServerConfig>,
    /// Certificate files to re-read while the server runs, if any.
    pub(crate) reload: Option<Arc<ReloadingCert>>,
}

impl MetricsAccess {
    /// Plain HTTP, to anyone who reaches the port.
    pub fn open() -> Self {
        Self { secure: None }
    }

    /// HTTPS with `tls`; a scrape needs a bearer token `auth` accepts whose user may `get` the
    /// non-resource URL `/metrics`.
    pub fn secure(auth: Arc<Authenticator>, tls: Arc<rustls::ServerConfig>) -> Self {
        Self {
            secure: Some(Secure {
                auth,
                tls,
                reload: None,
            }),
        }
    }

    /// Whether scrapes are checked (and served over TLS).
    pub fn is_secure(&self) -> bool {
        self.secure.is_some()
    }

    pub(crate) fn secure_parts(&self) -> Option<&Secure> {
        self.secure.as_ref()
    }
}

impl std::fmt::Debug for MetricsAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_secure() { "Secure" } else { "Open" })
    }
}

/// `--metrics-secure`, `--metrics-cert-file` and `--metrics-key-file`; flatten them into a
/// binary's arguments (`#[command(flatten)]`) and give each an environment variable with
/// `mut_arg`. The metrics address stays the binary's own flag.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct MetricsArgs {
    /// Serve /metrics over HTTPS, only to callers whose bearer token the API server accepts
    /// (TokenReview) and who may `get` the non-resource URL /metrics (SubjectAccessReview);
    /// `--metrics-secure=false` serves it over plain HTTP to anyone.
    #[arg(
        long,
        default_value = "true",
        action = clap::ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_name = "BOOL",
        value_parser = parse_go_bool
    )]
    pub metrics_secure: bool,
    /// Certificate (PEM) of the secure metrics server, re-read when it changes [default: a
    /// self-signed one made at start].
    #[arg(long, requires = "metrics_key_file")]
    pub metrics_cert_file: Option<PathBuf>,
    /// Private key (PEM) of --metrics-cert-file.
    #[arg(long, requires = "metrics_cert_file")]
    pub metrics_key_file: Option<PathBuf>,
}

impl Default for MetricsArgs {
    fn default() -> Self {
        Self {
            metrics_secure: true,
            metrics_cert_file: None,
            metrics_key_file: None,
        }
    }
}

impl MetricsArgs {
    /// The access these flags ask for. Secure: scrapes are checked through `client`, over TLS
    /// with the certificate files (re-read while the server runs) or a self-signed certificate
    /// made now. Open: a warning is logged, as anyone who reaches the port reads the metrics.
    pub fn access(&self, client: &kube::Client) -> Result<MetricsAccess, Error> {
        if !self.metrics_secure {
            tracing::warn!(
                "--metrics-secure=false: /metrics is served over plain HTTP to anyone who reaches its port"
            );
            return Ok(MetricsAccess::open());
        }
        let (tls, reload) = match (&self.metrics_cert_file, &self.metrics_key_file) {
            (Some(cert), Some(key)) => {
                let what = || "--metrics-cert-file, --metrics-key-file".to_owned();
                let loaded = ReloadingCert::load(cert, key).map_err(|cause| Error::MetricsTls {
                    what: what(),
                    cause: Box::new(cause),
                })?;
                let loaded = Arc::new(loaded);
                let tls =
                    ReloadingCert::server_config(&loaded).map_err(|cause| Error::MetricsTls {
                        what: what(),
                        cause: Box::new(cause),
                    })?;
                (tls, Some(loaded))
            }
            _ => (self_signed()?, None),
        };
        Ok(MetricsAccess {
            secure: Some(Secure {
                auth: Arc::new(Authenticator::new(client.clone())),
                tls: Arc::new(tls),
                reload,
            }),
        })
    }
}

/// A server configuration with a self-signed certificate made now, as controller-runtime does
/// without certificate files: a scraper skips verification, or is given files to trust.
fn self_signed() -> Result<rustls::ServerConfig, Error> {
    let failed = |cause: Box<dyn std::error::Error + Send + Sync>| Error::MetricsTls {
        what: "a self-signed certificate".to_owned(),
        cause,
    };
    let mut names = vec!["localhost".to_owned()];
    // The Pod's name, which is what a scraper addressing the Pod by name would check.
    if let Ok(host) = std::env::var("HOSTNAME")
        && !host.is_empty()
        && host != "localhost"
    {
        names.push(host);
    }
    let signed = rcgen::generate_simple_self_signed(names).map_err(|e| failed(Box::new(e)))?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(signed.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| {
            builder
                .with_no_client_auth()
                .with_single_cert(vec![signed.cert.der().clone()], key)
        })
        .map_err(|e| failed(Box::new(e)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Args {
        #[command(flatten)]
        metrics: MetricsArgs,
    }

    fn parse(args: &[&str]) -> Result<MetricsArgs, clap::Error> {
        crate::try_parse_args_from::<Args, _, _>(std::iter::once("t").chain(args.iter().copied()))
            .map(|a| a.metrics)
    }

    #[test]
    fn metrics_are_secure_unless_explicitly_not() {
        assert_eq!(parse(&[]).unwrap(), MetricsArgs::default());
        assert!(parse(&[]).unwrap().metrics_secure);
        assert!(parse(&["--metrics-secure"]).unwrap().metrics_secure);
        assert!(parse(&["--metrics-secure=true"]).unwrap().metrics_secure);
        assert!(!parse(&["--metrics-secure=false"]).unwrap().metrics_secure);
        assert!(parse(&["--metrics-secure=maybe"]).is_err());
        // A certificate needs its key, and the other way round.
        assert!(parse(&["--metrics-cert-file=c"]).is_err());
        assert!(parse(&["--metrics-key-file=k"]).is_err());
        let both = parse(&["--metrics-cert-file=c", "--metrics-key-file=k"]).unwrap();
        assert_eq!(both.metrics_cert_file, Some(PathBuf::from("c")));
    }

    #[test]
    fn a_self_signed_configuration_is_made() {
        assert!(self_signed().is_ok());
    }
}
