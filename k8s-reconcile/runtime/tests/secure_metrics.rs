//! `--metrics-secure` against the real kube-apiserver: `/metrics` over HTTPS answers 401 without
//! a token, 403 to a ServiceAccount RBAC does not let `get /metrics`, 200 to one it does; health
//! stays open on its own port.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, PostParams};
use netkit_runtime::{App, MetricsArgs};
use netkit_testenv::{ControlPlane, Identity, eventually};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// A free loopback port.
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// One `GET path` on `stream` with an optional bearer token: (status, body).
async fn get_on<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    path: &str,
    token: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {answer:?}")))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `GET path` over HTTPS (any server certificate: the server's is self-signed).
async fn https_get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(proxy_core::tls::AcceptAnyCert::new(provider)))
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    get_on(tls, path, token).await.unwrap()
}

/// `GET path` over plain HTTP.
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    get_on(tcp, path, None).await
}

/// A ServiceAccount `ns/name` (made by the test plane) and a token of it.
async fn service_account_token(plane: &ControlPlane, ns: &str, name: &str) -> String {
    plane
        .client_as(&Identity::service_account(ns, name))
        .await
        .unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    Api::<ServiceAccount>::namespaced(plane.client().await.unwrap(), ns)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// The chart's `<release>-metrics-reader` ClusterRole, bound to the ServiceAccount `ns/name`.
async fn grant_metrics_reader(plane: &ControlPlane, ns: &str, name: &str) {
    let admin = plane.client().await.unwrap();
    let role_name = format!("{ns}-metrics-reader");
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(role_name.clone()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            non_resource_urls: Some(vec!["/metrics".to_owned()]),
            verbs: vec!["get".to_owned()],
            ..Default::default()
        }]),
        ..Default::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(role_name.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "ClusterRole".to_owned(),
            name: role_name,
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: name.to_owned(),
            namespace: Some(ns.to_owned()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

#[tokio::test]
async fn metrics_need_a_token_rbac_lets_in_and_health_stays_open() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("secure-metrics").await.unwrap();
    let allowed = service_account_token(plane, &ns, "scraper").await;
    let denied = service_account_token(plane, &ns, "bystander").await;
    grant_metrics_reader(plane, &ns, "scraper").await;

    let client = plane.client().await.unwrap();
    let access = MetricsArgs::default().access(&client).unwrap();
    assert!(access.is_secure(), "secure by default");
    let (health_addr, metrics_addr) = (free_addr(), free_addr());
    let app = App::builder("secure-metrics-test", "0")
        .serve_health([health_addr])
        .serve_metrics([metrics_addr], access)
        .start()
        .await
        .unwrap();

    let (status, body) = https_get(metrics_addr, "/metrics", None).await;
    assert_eq!(status, 401, "no token: {body}");
    let (status, body) = https_get(metrics_addr, "/metrics", Some("not-a-token")).await;
    assert_eq!(
        status, 401,
        "a token the API server does not accept: {body}"
    );

    let (status, body) = https_get(metrics_addr, "/metrics", Some(&denied)).await;
    assert_eq!(
        status, 403,
        "a ServiceAccount without the reader role: {body}"
    );
    assert_eq!(
        body,
        format!("system:serviceaccount:{ns}:bystander may not get /metrics\n")
    );

    // RBAC's authorizer sees a new binding within moments; polled, bounded generously.
    eventually(
        "the reader's scrape is answered",
        Duration::from_secs(30),
        || async {
            let (status, body) = https_get(metrics_addr, "/metrics", Some(&allowed)).await;
            status == 200 && body.contains("secure_metrics_test_build_info")
        },
    )
    .await;

    // Health is open, over plain HTTP on its own port, and no longer serves /metrics.
    let (status, body) = http_get(health_addr, "/healthz").await.unwrap();
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, _) = http_get(health_addr, "/readyz").await.unwrap();
    assert_eq!(status, 200);
    let (status, _) = http_get(health_addr, "/metrics").await.unwrap();
    assert_eq!(status, 404, "/metrics is not on the health port");
    // The metrics port speaks only TLS: a plain request gets no HTTP answer.
    assert!(http_get(metrics_addr, "/metrics").await.is_err());

    app.finish().await;
}

#[tokio::test]
async fn metrics_secure_false_serves_plain_http_to_anyone() {
    let plane = ControlPlane::shared().await.unwrap();
    let client = plane.client().await.unwrap();
    let args = MetricsArgs {
        metrics_secure: false,
        ..MetricsArgs::default()
    };
    let access = args.access(&client).unwrap();
    assert!(!access.is_secure());
    let metrics_addr = free_addr();
    let app = App::builder("open-metrics-test", "0")
        .serve_metrics([metrics_addr], access)
        .start()
        .await
        .unwrap();
    let (status, body) = http_get(metrics_addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("open_metrics_test_build_info"), "{body}");
    let (status, _) = http_get(metrics_addr, "/healthz").await.unwrap();
    assert_eq!(status, 404, "health is not on the metrics port");
    app.finish().await;
}

#[tokio::test]
async fn missing_certificate_files_stop_the_start_naming_them() {
    let plane = ControlPlane::shared().await.unwrap();
    let client = plane.client().await.unwrap();
    let args = MetricsArgs {
        metrics_secure: true,
        metrics_cert_file: Some("/nonexistent/tls.crt".into()),
        metrics_key_file: Some("/nonexistent/tls.key".into()),
    };
    let error = args.access(&client).unwrap_err();
    // The file's name is in the cause (the certificate loader's error), printed by the chain.
    let text = netkit_runtime::error_chain(&error);
    assert!(
        text.contains("--metrics-cert-file") && text.contains("/nonexistent/tls.crt"),
        "{text}"
    );
}
