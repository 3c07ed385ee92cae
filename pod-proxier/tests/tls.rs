//! The API over TLS on a real kube-apiserver: a client that trusts the CA is answered, one that
//! trusts another CA is refused, and a new certificate and key written over the files (as a
//! rotated Secret is) are served without a restart. Without `--tls-*` or `--plain-http` the
//! binary refuses to start.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use support::{Env, Proxier, eventually};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// A CA and a serving pair for 127.0.0.1 it signed: (CA PEM, cert PEM, key PEM).
fn ca_and_pair(name: &str) -> (String, String, String) {
    let mut ca = rcgen::CertificateParams::default();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, name.to_owned());
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

/// Writes `content` to `path` the way a Secret volume changes: a new file renamed over it.
fn replace(path: &Path, content: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, content).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// `GET path` over TLS trusting only `ca_pem`: the answer's status line, or the error.
async fn get_tls(addr: SocketAddr, ca_pem: &str, path: &str) -> Result<String, String> {
    let roots = proxy_core::tls::trust_roots(Some(ca_pem.as_bytes())).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), tls.read_to_end(&mut answer))
        .await
        .map_err(|_| "no answer in 20 s".to_owned())?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    Ok(text.lines().next().unwrap_or("").to_owned())
}

#[tokio::test]
async fn tls_api_trusts_its_ca_refuses_others_and_picks_up_a_rotation() {
    let env = Env::new("tls", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let (first_ca, cert, key) = ca_and_pair("first");
    replace(&cert_path, &cert);
    replace(&key_path, &key);
    let px = Proxier::start(
        &env,
        &[
            "--enable-v1".to_owned(),
            format!("--tls-cert-file={}", cert_path.display()),
            format!("--tls-key-file={}", key_path.display()),
        ],
    )
    .await;

    // The CA's client is answered; a client of another CA is refused at the handshake.
    let answer = get_tls(px.api, &first_ca, "/api/openapi.json").await;
    assert_eq!(answer.as_deref(), Ok("HTTP/1.1 200 OK"), "{}", px.logs());
    let (second_ca, cert, key) = ca_and_pair("second");
    let refused = get_tls(px.api, &second_ca, "/api/openapi.json").await;
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("handshake")),
        "a client of another CA got {refused:?}"
    );
    // Plain HTTP on the TLS port gets no answer from the API.
    let plain = support::get_text(px.api, "/api/openapi.json").await;
    assert!(plain.is_err(), "plain HTTP answered: {plain:?}");

    // Rotation: a new pair of another CA is served without a restart.
    replace(&key_path, &key);
    replace(&cert_path, &cert);
    eventually(
        "the rotated certificate is served",
        Duration::from_secs(60),
        || async {
            get_tls(px.api, &second_ca, "/api/openapi.json")
                .await
                .is_ok()
        },
    )
    .await;
    assert!(
        get_tls(px.api, &first_ca, "/api/openapi.json")
            .await
            .is_err(),
        "the old certificate is still served"
    );
    assert!(
        px.logs().contains("serving certificate reloaded"),
        "{}",
        px.logs()
    );
}

#[test]
fn without_tls_files_or_plain_http_the_binary_refuses_to_start() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
        .arg("--enable-v1")
        .env_clear()
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    for says in ["--tls-cert-file", "--tls-key-file", "--plain-http"] {
        assert!(stderr.contains(says), "{says} missing: {stderr}");
    }
}

#[test]
fn an_unusable_certificate_stops_the_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, cert, _) = ca_and_pair("one");
    let (_, _, other_key) = ca_and_pair("two");
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, cert).unwrap();
    std::fs::write(&key_path, other_key).unwrap();
    for (cert, key, says) in [
        (&cert_path, &key_path, "does not match the certificate"),
        (&dir.path().join("absent.crt"), &key_path, "absent.crt"),
    ] {
        // No cluster is given: the certificate is checked before the cluster is looked for.
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
            .arg("--enable-v1")
            .arg(format!("--tls-cert-file={}", cert.display()))
            .arg(format!("--tls-key-file={}", key.display()))
            .arg("--kubeconfig=/nonexistent/kubeconfig")
            .env_clear()
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(says) && !stderr.contains("Kubernetes API server"),
            "{says}: {stderr}"
        );
    }
}
