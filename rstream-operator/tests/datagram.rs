//! Datagram tunnels end to end: the manager and the agent as processes against the real
//! kube-apiserver, LocalEngine as the engine, and a UDP echo as the target Service. Also the specs
//! that stay refused (QUIC, HTTP/3) and a Service port of the wrong protocol.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt as _;
use kube::api::Api;
use netkit_testenv::Identity;
use netkit_testenv::fixtures::{KillOnDrop, tagged_datagram, udp_echo_server};
use rstream_client::engine::LocalEngine;
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::api::{RstreamTunnel, TunnelType};
use rstream_operator::names;
use tokio::net::UdpSocket;

/// A namespace with the connection, a UDP echo Service and a TCP Service, the given tunnels and
/// the manager running as a process under its own ServiceAccount.
struct Setup {
    plane: &'static netkit_testenv::ControlPlane,
    ns: String,
    admin: kube::Client,
    dir: tempfile::TempDir,
    engine: LocalEngine,
    ca: std::path::PathBuf,
    echo: SocketAddr,
    tunnels: Api<RstreamTunnel>,
    manager: KillOnDrop,
}

fn udp_target() -> serde_json::Value {
    serde_json::json!({"service": {"name": "udp-echo", "port": "echo"}})
}

fn tcp_target() -> serde_json::Value {
    serde_json::json!({"service": {"name": "web", "port": "http"}})
}

async fn start(specs: Vec<(&str, serde_json::Value)>) -> Setup {
    let plane = plane().await;
    let ns = plane.create_namespace("datagram").await.unwrap();
    let admin = plane.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("dgram-token")
        .start()
        .await
        .unwrap();
    let ca = dir.path().join("engine-ca.pem");
    std::fs::write(&ca, engine.ca_pem()).unwrap();
    let echo = udp_echo_server().await.unwrap();

    create(&admin, &ns, &secret("creds", &[("token", "dgram-token")])).await;
    create(
        &admin,
        &ns,
        &service(
            "udp-echo",
            serde_json::json!([{"name": "echo", "port": 5353, "protocol": "UDP"}]),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &service("web", serde_json::json!([{"name": "http", "port": 8080}])),
    )
    .await;
    create(
        &admin,
        &ns,
        &connection(
            "default",
            serde_json::json!({"engine": engine.engine_address(),
                "tokenSecretRef": {"name": "creds", "key": "token"}}),
        ),
    )
    .await;
    for (name, spec) in specs {
        create(&admin, &ns, &tunnel(name, spec)).await;
    }

    // The manager, as a process, under its own ServiceAccount.
    let identity = manager_identity(plane, &ns, false).await;
    let kubeconfig = plane.kubeconfig_as(&identity).await.unwrap();
    let health = format!("127.0.0.1:{}", free_port());
    let manager = KillOnDrop::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-operator"))
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("RUST_LOG")
            .args(["--namespace", &ns, "--metrics-bind-address", "0"])
            .args(["--health-probe-bind-address", &health])
            .args(["--agent-image", "example.test/rstream-operator:dgram"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    )
    .unwrap();
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    Setup {
        plane,
        ns,
        admin,
        dir,
        engine,
        ca,
        echo,
        tunnels,
        manager,
    }
}

/// Stops the processes and checks that no request of `users` was denied.
async fn stop(setup: Setup, agent: Option<KillOnDrop>, users: &[String]) {
    if let Some(agent) = agent {
        assert!(agent.terminate(Duration::from_secs(10)).await, "agent exit");
    }
    assert!(
        setup.manager.terminate(Duration::from_secs(10)).await,
        "manager exit"
    );
    for user in users {
        let forbidden = forbidden_requests(setup.plane, user).await;
        assert!(forbidden.is_empty(), "{user} was denied: {forbidden:?}");
    }
    setup.engine.shutdown().await;
}

#[tokio::test]
async fn a_datagram_tunnel_carries_udp_to_its_service_intact_and_in_order() {
    let setup = start(vec![(
        "udp",
        serde_json::json!({"target": udp_target(), "protocol": "dtls",
            "datagramGuaranteedDelivery": true}),
    )])
    .await;
    let (plane, ns, admin) = (setup.plane, setup.ns.as_str(), &setup.admin);
    let (engine, tunnels, echo, ca) = (&setup.engine, &setup.tunnels, setup.echo, &setup.ca);
    let t = wait_condition(
        tunnels,
        "udp",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = names::base_name(ns, "udp", t.uid().as_deref());
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), ns)
        .get(&format!("{base}-config"))
        .await
        .unwrap();
    let yaml = cm.data.unwrap()[names::CONFIG_KEY].clone();
    let config = AgentConfig::from_yaml(&yaml).unwrap();
    assert_eq!(config.target.protocol, "UDP");
    assert_eq!(config.target.port, "5353");
    assert_eq!(config.tunnel.type_, TunnelType::Datagram);
    assert_eq!(config.tunnel.datagram_guaranteed_delivery, Some(true));

    // The agent as the Deployment would run it; Service DNS does not resolve here, so its target
    // is mapped to the local UDP echo.
    let config_path = setup.dir.path().join("config.yaml");
    std::fs::write(&config_path, &yaml).unwrap();
    let agent_kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(ns, &base))
        .await
        .unwrap();
    let agent = KillOnDrop::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"))
            .env("KUBECONFIG", &agent_kubeconfig)
            .env_remove("RUST_LOG")
            .env(names::TOKEN_ENV, "dgram-token")
            .env(names::POD_NAME_ENV, "udp-agent-0")
            .env(names::POD_NAMESPACE_ENV, ns)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--target-override={echo}"))
            .arg(format!("--ca-file={}", ca.display()))
            .stderr(std::process::Stdio::null()),
    )
    .unwrap();
    let online = wait_condition(tunnels, "udp", "TunnelReady", "True", "TunnelOnline", WAIT).await;
    let status = online.status.unwrap();
    let tunnel_id = status.tunnel_id.unwrap();
    let ingress = engine.udp_ingress_addr(&tunnel_id).unwrap();
    assert_eq!(
        status.forwarding_address.as_deref(),
        Some(format!("127.0.0.1:{} (dtls)", ingress.port()).as_str())
    );
    let request = engine
        .tunnel_requests()
        .into_iter()
        .find(|p| p.r#type.as_deref() == Some("datagram"))
        .unwrap();
    assert_eq!(request.protocol.as_deref(), Some("dtls"));
    assert_eq!(request.datagram_guaranteed_delivery, Some(true));

    // Datagrams through the engine's UDP ingress, the agent and the echo come back intact, in
    // order (a window of in-flight bytes keeps loopback socket buffers from overflowing).
    let peer = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    peer.connect(ingress).await.unwrap();
    const COUNT: usize = 1_000;
    let started = Instant::now();
    let mut in_flight: VecDeque<Vec<u8>> = VecDeque::new();
    let (mut bytes, mut next, mut received) = (0usize, 0usize, 0usize);
    let mut buf = vec![0u8; 65_536];
    while received < COUNT {
        let pending: usize = in_flight.iter().map(Vec::len).sum();
        let room = pending + tagged_datagram(next).len() <= 96 * 1024 && in_flight.len() < 32;
        if next < COUNT && (in_flight.is_empty() || room) {
            let d = tagged_datagram(next);
            peer.send(&d).await.unwrap();
            in_flight.push_back(d);
            next += 1;
            continue;
        }
        let n = tokio::time::timeout(Duration::from_secs(30), peer.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("datagram {received} did not come back"))
            .unwrap();
        let expected = in_flight.pop_front().unwrap();
        assert!(
            buf[..n] == expected[..],
            "datagram {received}: {} bytes sent, {n} different bytes back",
            expected.len()
        );
        bytes += n;
        received += 1;
    }
    eprintln!(
        "{COUNT} datagrams ({bytes} bytes) through the agent in {:?}",
        started.elapsed()
    );

    assert_eq!(engine.tunnel_requests().len(), 1);
    let users = [sa_user(ns, MANAGER_SA), sa_user(ns, &base)];
    stop(setup, Some(agent), &users).await;
}

#[tokio::test]
async fn datagram_specs_that_cannot_work_are_refused_by_name() {
    let setup = start(vec![
        (
            "dtls-to-tcp",
            serde_json::json!({"target": tcp_target(), "protocol": "dtls"}),
        ),
        (
            "tls-to-udp",
            serde_json::json!({"target": udp_target(), "protocol": "tls"}),
        ),
        (
            "quic",
            serde_json::json!({"target": udp_target(), "protocol": "quic"}),
        ),
        (
            "h3",
            serde_json::json!({"target": tcp_target(), "protocol": "http", "http": {"version": "h3"}}),
        ),
        (
            "http-datagram",
            serde_json::json!({"target": udp_target(), "type": "datagram"}),
        ),
    ])
    .await;
    let tunnels = &setup.tunnels;
    // The refused specs, each with a message naming why.
    for (name, status, reason, needle) in [
        (
            "dtls-to-tcp",
            "Resolved",
            "ServicePortMissing",
            "the tunnel needs UDP",
        ),
        (
            "tls-to-udp",
            "Resolved",
            "ServicePortMissing",
            "the tunnel needs TCP",
        ),
        ("quic", "Accepted", "InvalidSpec", "QUIC transport"),
        ("h3", "Accepted", "InvalidSpec", "HTTP/3"),
        ("http-datagram", "Accepted", "InvalidSpec", "dtls"),
    ] {
        let t = wait_condition(tunnels, name, status, "False", reason, WAIT).await;
        let message = condition(&t, status).unwrap().2;
        assert!(message.contains(needle), "{name}: {message}");
    }
    // None reached the engine.
    assert!(setup.engine.tunnel_requests().is_empty());
    let users = [sa_user(&setup.ns, MANAGER_SA)];
    stop(setup, None, &users).await;
}
