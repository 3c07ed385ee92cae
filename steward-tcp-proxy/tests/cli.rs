//! steward's flags on the binary: usage errors, Go's boolean forms and `:port` on both families.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use kube::api::{Api, ListParams};
use netkit_testenv::eventually;

mod support;

use support::*;

#[test]
fn bad_flags_exit_with_status_2_and_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--upstream-addr=nohost"], "host:port"),
        (
            &["--upstream-addr=h:1", "--reconcile-interval=30"],
            "missing unit",
        ),
        (
            &["--upstream-addr=h:1", "--service-name=Bad_Name"],
            "not a valid Service name",
        ),
        (
            &["--upstream-addr=h:1", "--endpoint-mode=node-ip"],
            "node-ip",
        ),
        (
            &["--upstream-addr=h:1", "--tls-cert-file=/x.pem"],
            "--tls-key-file",
        ),
        (
            &["--upstream-addr=h:1", "--peer-check-failures=0"],
            "--peer-check-failures must be at least 1",
        ),
        (&[], "--upstream-addr"),
    ];
    for (args, message) in cases {
        let output = Command::new(BIN)
            .args(*args)
            .env_remove("UPSTREAM_ADDR")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert!(help.status.success());
}

/// Sends a plain HTTP request to `addr`, a relay in front of the (TLS) API server, and returns
/// the answer: the API server's "HTTP request to an HTTPS server" proves the bytes got there.
async fn plain_http_through(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn colon_port_listens_on_both_families_and_boolean_flags_take_gos_forms() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-dual").await.unwrap();
    let (listen, health, metrics) = (free_port(), free_port(), free_port());
    let texts = [
        format!(":{listen}"),
        format!(":{health}"),
        format!(":{metrics}"),
    ];
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            // Go's boolean forms, as the original's callers pass them.
            "--leader-elect=false",
            "--upstream-insecure=false",
        ],
        &[("STEWARD_LEADER_ELECT", "True")],
        Some([&texts[0], &texts[1], &texts[2]]),
    );
    let v6 = |port| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let v4 = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    eventually("listening", Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(v4(listen)).await.is_ok()
    })
    .await;
    // The relay, over IPv6 only and over IPv4, reaches the API server.
    for addr in [v6(listen), v4(listen)] {
        let answer = plain_http_through(addr).await;
        assert!(
            answer.contains("HTTP request to an HTTPS server"),
            "through {addr}: {answer}\n{}",
            proxy.logs()
        );
    }
    // The operations servers too.
    for (port, path) in [(health, "/healthz"), (metrics, "/metrics")] {
        for addr in [v6(port), v4(port)] {
            eventually(
                &format!("{path} on {addr}"),
                Duration::from_secs(30),
                || async {
                    proxy
                        .get(addr, path)
                        .await
                        .is_some_and(|(code, _)| code == 200)
                },
            )
            .await;
        }
    }
    // --leader-elect=false beat the environment's True: the controller runs without an election
    // (its readiness says so, a positive sign that it started, where a candidate would say
    // leader or follower after its first attempt at the Lease), and no Lease is taken.
    let started = std::time::Instant::now();
    eventually(
        "/readyz reports leader election disabled",
        Duration::from_secs(30),
        || async {
            proxy
                .get(v4(health), "/readyz")
                .await
                .is_some_and(|(_, body)| body.contains("[+] leadership: leader election disabled"))
        },
    )
    .await;
    eprintln!(
        "the controller ran without an election after {:?}",
        started.elapsed()
    );
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        plane.client().await.unwrap(),
        &ns,
    )
    .list(&ListParams::default())
    .await
    .unwrap();
    assert!(leases.items.is_empty(), "{:?}", leases.items);
}

#[test]
fn a_bad_boolean_is_a_usage_error_naming_the_value() {
    let out = Command::new(BIN)
        .args(["--upstream-addr=h:1", "--leader-elect=maybe"])
        .env_remove("STEWARD_LEADER_ELECT")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--leader-elect") && stderr.contains("\"maybe\" is not a boolean"),
        "{stderr}"
    );
    // The environment variable takes Go's spellings too: `T` is true, and asks for TLS mode.
    let out = Command::new(BIN)
        .arg("--upstream-addr=h:1")
        .env("STEWARD_UPSTREAM_INSECURE", "T")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--upstream-insecure needs TLS-termination mode"),
        "{stderr}"
    );
}

#[tokio::test]
async fn taken_ops_ports_are_logged_by_default_exit_stops_zero_turns_off() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-ops").await.unwrap();
    // Another program holds both operations ports, as Cockpit holds 9090 on some nodes.
    let taken_health = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let taken_metrics = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let taken_port = taken_health.local_addr().unwrap().port();
    let taken_metrics_port = taken_metrics.local_addr().unwrap().port();
    let common = [
        format!("--service-namespace={ns}"),
        "--service-name=absent".to_owned(),
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        common
            .iter()
            .cloned()
            .chain(extra.iter().map(|s| (*s).to_owned()))
            .collect()
    };
    let (listen, metrics) = (free_port(), free_port());
    let texts = |health: String| {
        [
            format!("127.0.0.1:{listen}"),
            health,
            format!("127.0.0.1:{metrics}"),
        ]
    };

    // By default both taken ports are logged and steward relays without its servers.
    let both = [
        format!("127.0.0.1:{listen}"),
        format!("127.0.0.1:{taken_port}"),
        format!("127.0.0.1:{taken_metrics_port}"),
    ];
    let args = with(&[]);
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        Some([&both[0], &both[1], &both[2]]),
    );
    let listen_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, listen));
    eventually(
        "relaying with both ops ports taken",
        Duration::from_secs(30),
        || async { tokio::net::TcpStream::connect(listen_addr).await.is_ok() },
    )
    .await;
    let answer = plain_http_through(listen_addr).await;
    assert!(
        answer.contains("HTTP request to an HTTPS server"),
        "relaying with both ops ports taken: {answer}\n{}",
        proxy.logs()
    );
    let logs = proxy.logs();
    assert_eq!(
        logs.matches("running without them").count(),
        2,
        "one warning per taken port: {logs}"
    );
    assert!(
        logs.contains(&format!("127.0.0.1:{taken_metrics_port}")),
        "{logs}"
    );
    drop(proxy);

    // With only the health port taken, /metrics counts the unbound server.
    let t = texts(format!("127.0.0.1:{taken_port}"));
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        Some([&t[0], &t[1], &t[2]]),
    );
    let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, metrics));
    eventually(
        "/metrics counts the taken health port",
        Duration::from_secs(30),
        || async {
            proxy
                .get(metrics_addr, "/metrics")
                .await
                .is_some_and(|(code, body)| {
                    code == 200 && body.contains("steward_tcp_proxy_ops_listeners_unbound 1\n")
                })
        },
    )
    .await;
    drop(proxy);

    // --ops-bind-failure=exit: the taken health port stops the start, naming the address.
    let args = with(&["--ops-bind-failure=exit"]);
    let mut proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        Some([&t[0], &t[1], &t[2]]),
    );
    let mut status = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        status = proxy.child.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = status.expect("steward still runs with its health port taken and exit asked");
    assert_eq!(status.code(), Some(1), "{}", proxy.logs());
    assert!(
        proxy.logs().contains(&format!("127.0.0.1:{taken_port}")),
        "{}",
        proxy.logs()
    );
    drop(proxy);
    drop(taken_metrics);

    // --health-addr=0 serves no health port at all, and the rest runs.
    let args = with(&[]);
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[],
        Some([&t[0], "0", &t[2]]),
    );
    eventually("/metrics served", Duration::from_secs(30), || async {
        proxy
            .get(metrics_addr, "/metrics")
            .await
            .is_some_and(|(code, _)| code == 200)
    })
    .await;
    let logs = proxy.logs();
    assert_eq!(logs.matches("serving /metrics").count(), 1, "{logs}");
    assert!(!logs.contains("serving /healthz"), "{logs}");
    drop(taken_health);
}
