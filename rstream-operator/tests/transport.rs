//! A connection's transport options against a real kube-apiserver (one per test binary): those
//! the agent cannot honour are refused by name; the HTTP proxy carries the agent's engine
//! connections and the manager's control-plane lookup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kube::ResourceExt as _;
use netkit_testenv::Identity;
use netkit_testenv::fixtures::{Tinyproxy, TinyproxyConfig};
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::names;

/// Every transport option the agent cannot honour, with the field its refusal must name.
fn refused_transports() -> Vec<(serde_json::Value, &'static str)> {
    use serde_json::json;
    vec![
        (json!({"mode": "quic"}), "transport.mode"),
        (json!({"useQuic": true}), "transport.useQuic"),
        (
            json!({"bind": {"address": "eth0"}}),
            "transport.bind.address",
        ),
        (
            json!({"ipFamily": "ipv4", "bind": {"address": "fd00::1"}}),
            "transport.bind.address",
        ),
        (
            json!({"bind": {"mode": "interface", "interface": "eth0"}}),
            "transport.bind.interface",
        ),
        (
            json!({"dns": {"override": "10.0.0.53"}}),
            "transport.dns.override",
        ),
        (json!({"dns": {"tls": true}}), "transport.dns.tls"),
        (json!({"dns": {"dnssec": true}}), "transport.dns.dnssec"),
        (json!({"mptcp": true}), "transport.mptcp"),
        (json!({"proxy": {}}), "transport.proxy.http"),
        (
            json!({"proxy": {"http": "https://proxy.internal:3128"}}),
            "transport.proxy.http",
        ),
        (
            json!({"proxy": {"http": "http://proxy.internal:3128", "headers": {"Host": "x"}}}),
            "transport.proxy.headers",
        ),
    ]
}

#[tokio::test]
async fn transport_options_the_agent_cannot_honour_are_refused_by_name() {
    let env = manager_env("refused").await;
    create(
        &env.admin,
        &env.ns,
        &secret("creds", &[("token", "token-1")]),
    )
    .await;
    let ports = serde_json::json!([{"name": "http", "port": 8080}]);
    create(&env.admin, &env.ns, &service("web", ports)).await;
    let cases = refused_transports();
    for (i, (transport, _)) in cases.iter().enumerate() {
        create(
            &env.admin,
            &env.ns,
            &connection(
                &format!("c{i}"),
                serde_json::json!({"engine": "127.0.0.1:7443",
                    "tokenSecretRef": {"name": "creds", "key": "token"}, "transport": transport}),
            ),
        )
        .await;
        create(
            &env.admin,
            &env.ns,
            &tunnel(
                &format!("t{i}"),
                serde_json::json!({"connectionRef": {"name": format!("c{i}")},
                    "target": {"service": {"name": "web", "port": "http"}}}),
            ),
        )
        .await;
    }
    for (i, (transport, field)) in cases.iter().enumerate() {
        let t = wait_condition(
            &env.tunnels,
            &format!("t{i}"),
            "Accepted",
            "False",
            "InvalidSpec",
            WAIT,
        )
        .await;
        let (_, _, message) = condition(&t, "Accepted").unwrap();
        assert!(message.contains(field), "{transport}: {message}");
        let c = env.conns.get(&format!("c{i}")).await.unwrap();
        let ready = c
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidSpec")
        );
        assert!(
            ready.message.contains(field),
            "{transport}: {}",
            ready.message
        );
        // Nothing is deployed for a refused tunnel: no agent crash-loops on it.
        let base = names::base_name(&env.ns, &format!("t{i}"), t.uid().as_deref());
        assert!(
            children(&env.admin, &env.ns, &base)
                .await
                .deployment
                .is_none()
        );
    }

    // What the agent honours is accepted and reaches its configuration: the proxy (URL,
    // credentials by reference, headers), ipFamily, bind.address, mptcp off, dns.serverName, the
    // heartbeat interval.
    create(
        &env.admin,
        &env.ns,
        &secret("proxy", &[("user", "alice"), ("password", "s3cret")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "honoured",
            serde_json::json!({"engine": "127.0.0.1:7443",
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"mode": "tls", "ipFamily": "ipv6", "mptcp": false, "useQuic": false,
                    "heartbeatIntervalSeconds": 2,
                    "bind": {"address": "fd00::7"},
                    "dns": {"serverName": "engine.example.io"},
                    "proxy": {"http": "http://proxy.internal:3128",
                        "usernameSecretRef": {"name": "proxy", "key": "user"},
                        "passwordSecretRef": {"name": "proxy", "key": "password"},
                        "headers": {"X-Team": "netkit"}}}}),
        ),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &tunnel(
            "honoured",
            serde_json::json!({"connectionRef": {"name": "honoured"},
                "target": {"service": {"name": "web", "port": "http"}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &env.tunnels,
        "honoured",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    assert_eq!(condition(&t, "Accepted").unwrap().0, "True");
    let base = names::base_name(&env.ns, "honoured", t.uid().as_deref());
    let cm = children(&env.admin, &env.ns, &base)
        .await
        .configmap
        .unwrap();
    let yaml = cm.data.unwrap()[names::CONFIG_KEY].clone();
    assert!(
        !yaml.contains("s3cret"),
        "the proxy password leaked: {yaml}"
    );
    let config = AgentConfig::from_yaml(&yaml).unwrap();
    let transport = config.connection.transport.unwrap();
    assert_eq!(transport.heartbeat_interval_seconds, Some(2));
    assert_eq!(transport.bind.unwrap().address.as_deref(), Some("fd00::7"));
    let proxy = transport.proxy.unwrap();
    assert_eq!(proxy.http.as_deref(), Some("http://proxy.internal:3128"));
    assert_eq!(
        proxy.username_env.as_deref(),
        Some(names::PROXY_USERNAME_ENV)
    );
    assert_eq!(proxy.headers.unwrap()["X-Team"], "netkit");
    env.finish_without_403().await;
}

/// An HTTP proxy that wants alice's credentials and may reach `port` only, with the Secrets of
/// `env`'s connection: `creds` (its rstream `token`) and `proxy` (`user` and `password`).
async fn proxy_and_secrets(env: &ManagerEnv, port: u16, token: &str) -> Tinyproxy {
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("alice".into(), "s3cret".into())),
        connect_ports: vec![port],
    })
    .await
    .unwrap();
    create(&env.admin, &env.ns, &secret("creds", &[("token", token)])).await;
    create(
        &env.admin,
        &env.ns,
        &secret("proxy", &[("user", "alice"), ("password", "s3cret")]),
    )
    .await;
    tiny
}

#[tokio::test]
async fn the_agent_reaches_its_engine_through_the_connections_http_proxy() {
    use rstream_client::engine::LocalEngine;

    let env = manager_env("agent-proxy").await;
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("proxy-token")
        .start()
        .await
        .unwrap();
    let ca = dir.path().join("engine-ca.pem");
    std::fs::write(&ca, engine.ca_pem()).unwrap();
    let backend = http_server("hello through the proxy").await;
    // The proxy wants credentials and may reach the engine only.
    let tiny = proxy_and_secrets(&env, engine.addr().port(), "proxy-token").await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "default",
            serde_json::json!({"engine": engine.engine_address(),
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"ipFamily": "ipv4", "bind": {"address": "127.0.0.1"},
                    "proxy": {"http": tiny.url(),
                    "usernameSecretRef": {"name": "proxy", "key": "user"},
                    "passwordSecretRef": {"name": "proxy", "key": "password"}}}}),
        ),
    )
    .await;
    let ports = serde_json::json!([{"name": "http", "port": 8080}]);
    create(&env.admin, &env.ns, &service("web", ports)).await;
    create(
        &env.admin,
        &env.ns,
        &tunnel(
            "web",
            serde_json::json!({"target": {"service": {"name": "web", "port": "http"}},
                "protocol": "http", "http": {"version": "http/1.1"}}),
        ),
    )
    .await;
    let t = wait_condition(
        &env.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = names::base_name(&env.ns, "web", t.uid().as_deref());
    let cm = children(&env.admin, &env.ns, &base)
        .await
        .configmap
        .unwrap();
    let config_path = dir.path().join("config.yaml");
    std::fs::write(&config_path, &cm.data.unwrap()[names::CONFIG_KEY]).unwrap();
    let kubeconfig = plane()
        .await
        .kubeconfig_as(&Identity::service_account(&env.ns, &base))
        .await
        .unwrap();
    // The agent binary, its credentials in the environment as the Deployment gives them.
    let agent = |password: &str| {
        Child::spawn(
            std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"))
                .env("KUBECONFIG", &kubeconfig)
                .env_remove("RUST_LOG")
                .env(names::TOKEN_ENV, "proxy-token")
                .env(names::PROXY_USERNAME_ENV, "alice")
                .env(names::PROXY_PASSWORD_ENV, password)
                .env(names::POD_NAME_ENV, "web-agent-0")
                .env(names::POD_NAMESPACE_ENV, &env.ns)
                .arg(format!("--config={}", config_path.display()))
                .arg(format!("--target-override={backend}"))
                .arg(format!("--ca-file={}", ca.display()))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null()),
        )
    };

    // Refused credentials: the tunnel's condition says so.
    let wrong = agent("wrong");
    let t = wait_condition(
        &env.tunnels,
        "web",
        "TunnelReady",
        "False",
        "TunnelDisconnected",
        WAIT,
    )
    .await;
    let message = condition(&t, "TunnelReady").unwrap().2;
    assert!(
        message.contains("requires credentials") && message.contains(&tiny.url()),
        "{message}"
    );
    assert!(wrong.terminate().await, "the agent did not exit cleanly");

    // The right ones: online, and a request goes through the tunnel.
    let right = agent("s3cret");
    let t = wait_condition(
        &env.tunnels,
        "web",
        "TunnelReady",
        "True",
        "TunnelOnline",
        WAIT,
    )
    .await;
    let tunnel_id = t.status.unwrap().tunnel_id.unwrap();
    let ingress = engine.ingress_addr(&tunnel_id).unwrap();
    let response = http_get(ingress).await.unwrap();
    assert!(response.ends_with("hello through the proxy"), "{response}");
    assert!(
        tiny.logs()
            .contains(&format!("CONNECT {}", engine.engine_address())),
        "{}",
        tiny.logs()
    );
    assert!(right.terminate().await, "the agent did not exit cleanly");
    engine.shutdown().await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn the_managers_control_plane_lookup_goes_through_the_proxy() {
    use rstream_client::engine::LocalControlPlane;

    let env = manager_env("lookup-proxy").await;
    let project =
        serde_json::json!({"endpoint": "engine", "domain": "example.io", "enginePort": 8443});
    let cp = LocalControlPlane::builder()
        .token("lookup-token")
        .project("proj", project)
        .start()
        .await
        .unwrap();
    let cp_port: u16 = cp.url().rsplit(':').next().unwrap().parse().unwrap();
    // The proxy wants credentials and may reach the control plane only.
    let tiny = proxy_and_secrets(&env, cp_port, "lookup-token").await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "default",
            serde_json::json!({"projectEndpoint": "proj", "apiURL": cp.url(),
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"proxy": {"http": tiny.url(),
                    "usernameSecretRef": {"name": "proxy", "key": "user"},
                    "passwordSecretRef": {"name": "proxy", "key": "password"}}}}),
        ),
    )
    .await;
    let engine = wait_for("the connection to resolve", WAIT, || async {
        env.conns
            .get("default")
            .await
            .ok()
            .and_then(|c| c.status)
            .and_then(|s| s.engine)
    })
    .await;
    assert_eq!(engine, "engine.example.io:8443");
    assert!(
        tiny.logs()
            .contains(&format!("CONNECT 127.0.0.1:{cp_port}")),
        "{}",
        tiny.logs()
    );
    env.finish_without_403().await;
}
