//! Traffic through steward: API calls and watches, TLS termination, and the upstream reached
//! through an HTTP proxy.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, PostParams, WatchParams};
use netkit_testenv::{ControlPlane, eventually};

mod support;

use support::*;

#[tokio::test]
async fn api_calls_and_watches_pass_through_the_relay() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-relay").await.unwrap();
    // Nothing here writes default/kubernetes (no proxy Service exists in this namespace).
    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            // One event loop relays, reconciles and serves metrics here.
            "--threads=1",
        ],
    );
    eventually("listening", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;
    let through = client_through(plane, proxy.listen).await;

    // TLS passes through: the client verifies the API server's own certificate (CA and SAN
    // 127.0.0.1) and authenticates with its client certificate, end to end.
    let info = through.apiserver_version().await.unwrap();
    assert_eq!(info.git_version, "v1.37.2");
    let namespaces = Api::<Namespace>::all(through.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));

    let configmaps: Api<ConfigMap> = Api::namespaced(through.clone(), &ns);
    let mut events = configmaps
        .watch(&WatchParams::default().timeout(30), "0")
        .await
        .unwrap()
        .boxed();
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("through-the-proxy".into());
    Api::<ConfigMap>::namespaced(plane.client().await.unwrap(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(
        next_added(&mut events, Duration::from_secs(30)).await,
        "through-the-proxy"
    );
    let metrics = proxy.metrics_text().await;
    assert!(metrics.contains("proxy_connections_total"), "{metrics}");
}

#[tokio::test]
async fn tls_termination_verifies_upstream_mirrors_alpn_and_reloads_certificates() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-tls").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (cert, key) = ca.leaf("first");
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, &cert).unwrap();
    std::fs::write(&key_path, &key).unwrap();
    let upstream_ca = dir.path().join("upstream-ca.crt");
    std::fs::write(&upstream_ca, plane.ca_pem()).unwrap();
    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            &format!("--tls-cert-file={}", cert_path.display()),
            &format!("--tls-key-file={}", key_path.display()),
            &format!("--upstream-ca-file={}", upstream_ca.display()),
        ],
    );
    eventually("listening", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;

    // ALPN: offered h2 and http/1.1, the API server picks h2, and so do we.
    let (alpn, served) = tls_probe(&ca, proxy.listen, &[b"h2", b"http/1.1"], None).await;
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    assert!(
        served.contains("first"),
        "the served certificate is not ours"
    );
    // HTTP/1.1 through both TLS legs reaches the API server (anonymous /version is allowed).
    let (alpn, body) = tls_probe(&ca, proxy.listen, &[b"http/1.1"], Some("/version")).await;
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert!(body.contains("v1.37.2"), "{body}");

    // Rotation: new files are served to new connections without a restart.
    let (cert, key) = ca.leaf("second");
    std::fs::write(&key_path, &key).unwrap();
    std::fs::write(&cert_path, &cert).unwrap();
    eventually(
        "rotated certificate served",
        Duration::from_secs(30),
        || async {
            tls_probe(&ca, proxy.listen, &[b"http/1.1"], None)
                .await
                .1
                .contains("second")
        },
    )
    .await;
    // A broken replacement is refused (waited for in the log, bounded); the last good
    // certificate stays.
    let log_from = proxy.logs().len();
    std::fs::write(&cert_path, "not a certificate").unwrap();
    eventually(
        "the broken certificate refused",
        Duration::from_secs(30),
        || async { proxy.logs()[log_from..].contains("refused") },
    )
    .await;
    // The log says why, not only which file.
    let refusal = proxy.logs()[log_from..].to_owned();
    assert!(
        refusal.contains("no PEM certificate found"),
        "the refusal does not say why: {refusal}"
    );
    assert!(
        tls_probe(&ca, proxy.listen, &[b"http/1.1"], None)
            .await
            .1
            .contains("second")
    );
}

/// Connects with TLS, offering `alpn`; returns the chosen protocol and either the served
/// certificate's subject (no path) or the HTTP response to `GET path`.
async fn tls_probe(
    ca: &Ca,
    addr: SocketAddr,
    alpn: &[&[u8]],
    path: Option<&str>,
) -> (Option<Vec<u8>>, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let roots = proxy_core::tls::trust_roots(Some(ca.pem.as_bytes())).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    let (_, session) = tls.get_ref();
    let chosen = session.alpn_protocol().map(<[u8]>::to_vec);
    let subject = session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| String::from_utf8_lossy(c.as_ref()).into_owned())
        .unwrap_or_default();
    let Some(path) = path else {
        return (chosen, subject);
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = tls.read_to_end(&mut response).await;
    (chosen, String::from_utf8_lossy(&response).into_owned())
}

fn apiserver_port(plane: &ControlPlane) -> u16 {
    apiserver_addr(plane)
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap()
}

#[tokio::test]
async fn the_upstream_is_reached_through_an_http_proxy() {
    use netkit_testenv::fixtures::{Tinyproxy, TinyproxyConfig};
    let plane = plane().await;
    let ns = plane.create_namespace("steward-egress").await.unwrap();
    let port = apiserver_port(plane);
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("steward".into(), "s3cret".into())),
        connect_ports: vec![port],
    })
    .await
    .unwrap();
    let args = [
        &format!("--service-namespace={ns}")[..],
        "--service-name=absent",
    ];
    // Credentials from the environment variable of --upstream-proxy (percent-encoding decoded).
    let url = format!("http://steward:s3c%72et@{}", tiny.addr());
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args,
        &[("STEWARD_UPSTREAM_PROXY", &url)],
        None,
    );
    eventually(
        "ready through the proxy",
        Duration::from_secs(30),
        || async {
            proxy.readyz().await.is_some_and(|(code, body)| {
                code == 200 && body.contains(&format!("via {}", tiny.url()))
            })
        },
    )
    .await;
    let through = client_through(plane, proxy.listen).await;
    let namespaces = Api::<Namespace>::all(through)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));
    let logs = tiny.logs();
    assert!(
        logs.contains(&format!("CONNECT 127.0.0.1:{port}")),
        "tinyproxy saw no tunnel:\n{logs}"
    );
    let logs = proxy.logs();
    assert!(logs.contains("through the HTTP proxy"), "{logs}");
    assert!(
        !logs.contains("s3cret") && !logs.contains("s3c%72et"),
        "{logs}"
    );
    drop(proxy);

    // Without the credentials, with wrong ones, and towards a port the proxy refuses: /readyz
    // names the problem, and no password reaches the logs.
    let refusing = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: None,
        connect_ports: vec![port.wrapping_add(1).max(1)],
    })
    .await
    .unwrap();
    for (url, expected) in [
        (tiny.url(), "requires credentials"),
        (
            format!("http://steward:wr0ng@{}", tiny.addr()),
            "refused the ones given",
        ),
        (refusing.url(), "refused CONNECT"),
    ] {
        let proxy = Proxy::start(
            plane.kubeconfig_path(),
            &apiserver_addr(plane),
            &[&args[..], &[&format!("--upstream-proxy={url}")]].concat(),
        );
        eventually(
            &format!("/readyz says {expected:?}"),
            Duration::from_secs(30),
            || async {
                proxy
                    .readyz()
                    .await
                    .is_some_and(|(code, body)| code == 503 && body.contains(expected))
            },
        )
        .await;
        let logs = proxy.logs();
        assert!(!logs.contains("wr0ng"), "{logs}");
    }
}

#[tokio::test]
async fn https_proxy_and_no_proxy_are_honoured_for_the_upstream() {
    use netkit_testenv::fixtures::{Tinyproxy, TinyproxyConfig};
    let plane = plane().await;
    let ns = plane.create_namespace("steward-env-proxy").await.unwrap();
    let port = apiserver_port(plane);
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("steward".into(), "s3cret".into())),
        connect_ports: vec![port],
    })
    .await
    .unwrap();
    // Loopback addresses and `localhost` never go through a proxy (Go's rule), so the upstream
    // is named `127.1`: a host name to these rules, which the proxy resolves to 127.0.0.1.
    let upstream = format!("127.1:{port}");
    let args = [
        &format!("--service-namespace={ns}")[..],
        "--service-name=absent",
    ];
    let url = format!("http://steward:s3cret@{}", tiny.addr());
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &upstream,
        &args,
        &[
            ("HTTPS_PROXY", &url),
            ("NO_PROXY", "example.com,10.0.0.0/8"),
        ],
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = proxy.readyz().await;
        if ready.as_ref().is_some_and(|(code, body)| {
            *code == 200 && body.contains(&format!("{upstream} via {}", tiny.url()))
        }) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready through HTTPS_PROXY: {ready:?}\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let namespaces = Api::<Namespace>::all(client_through(plane, proxy.listen).await)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));
    let logs = tiny.logs();
    assert!(
        logs.contains(&format!("CONNECT 127.1:{port}")),
        "tinyproxy saw no tunnel:\n{logs}"
    );
    drop(proxy);

    // NO_PROXY exempts the upstream: the (refusing) proxy is not used. The lowercase names work
    // as well.
    let refusing = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: None,
        connect_ports: vec![port.wrapping_add(1).max(1)],
    })
    .await
    .unwrap();
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &upstream,
        &args,
        // 127.0.0.1 for steward's own Kubernetes client, which honours them too.
        &[
            ("https_proxy", &refusing.url()),
            ("no_proxy", "127.1,127.0.0.1"),
        ],
        None,
    );
    eventually("ready directly", Duration::from_secs(30), || async {
        proxy.readyz().await.is_some_and(|(code, body)| {
            code == 200 && body.contains(&format!("{upstream} dialable"))
        })
    })
    .await;
    let (_, body) = proxy.readyz().await.unwrap();
    assert!(!body.contains(" via "), "{body}");
}
