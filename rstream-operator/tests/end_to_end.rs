//! Both binaries as processes against a real kube-apiserver (one per test binary) and LocalEngine as
//! the engine: a tunnel brought online and forwarding, and an engine outage reported and
//! recovered from.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt as _};
use netkit_testenv::Identity;
use rstream_operator::api::RstreamTunnel;
use rstream_operator::names;

/// Both binaries as processes against a local engine: the manager (with leader election) and the
/// agent, run as the manager's Deployment would run it, until the tunnel is online.
struct E2e {
    ns: String,
    admin: Client,
    tunnels: Api<RstreamTunnel>,
    base: String,
    engine: Option<rstream_client::engine::LocalEngine>,
    manager: Child,
    agent: Child,
    agent_health: String,
    agent_log: std::path::PathBuf,
    /// The tunnel once online.
    online: RstreamTunnel,
    _dir: tempfile::TempDir,
}

async fn e2e(prefix: &str) -> E2e {
    use rstream_client::engine::LocalEngine;

    let plane = plane().await;
    let ns = plane.create_namespace(prefix).await.unwrap();
    let admin = plane.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("e2e-token")
        .start()
        .await
        .unwrap();
    let ca = dir.path().join("engine-ca.pem");
    std::fs::write(&ca, engine.ca_pem()).unwrap();
    let backend = http_server("hello through rstream").await;

    create(
        &admin,
        &ns,
        &secret("rstream-credentials", &[("token", "e2e-token")]),
    )
    .await;
    create(
        &admin,
        &ns,
        &service(
            "http-server",
            serde_json::json!([{"name": "http", "port": 8080}]),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &connection(
            "default",
            serde_json::json!({
        "engine": engine.engine_address(),
        "tokenSecretRef": {"name": "rstream-credentials", "key": "token"}}),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &tunnel(
            "web",
            serde_json::json!({
        "target": {"service": {"name": "http-server", "port": "http"}},
        "publish": true, "protocol": "http", "http": {"version": "http/1.1"}}),
        ),
    )
    .await;

    // The manager, as a process, under its own ServiceAccount, with leader election.
    let manager_identity = manager_identity(plane, &ns, true).await;
    let manager_kubeconfig = plane.kubeconfig_as(&manager_identity).await.unwrap();
    let health = format!("127.0.0.1:{}", free_port());
    let manager = Child::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-operator"))
            .env("KUBECONFIG", &manager_kubeconfig)
            .env_remove("RUST_LOG")
            .args([
                "--namespace",
                &ns,
                "--leader-elect",
                "--leader-election-namespace",
                &ns,
                "--metrics-bind-address",
                "0",
                "--health-probe-bind-address",
                &health,
                "--agent-image",
                "example.test/rstream-operator:e2e",
                "--log-format",
                "text",
            ])
            .stdout(std::process::Stdio::null()),
    );
    wait_for("the manager to be ready", WAIT, || async {
        (http_status(&health, "/readyz").await == 200).then_some(())
    })
    .await;

    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = names::base_name(&ns, "web", t.uid().as_deref());

    // Run the agent as the Deployment would: its config from the ConfigMap, its token from the
    // Secret, its identity the ServiceAccount the manager created. Service DNS does not resolve
    // here, so its target is mapped to the local HTTP server.
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), &ns)
        .get(&format!("{base}-config"))
        .await
        .unwrap();
    let config_path = dir.path().join("config.yaml");
    std::fs::write(&config_path, &cm.data.unwrap()[names::CONFIG_KEY]).unwrap();
    let agent_kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, &base))
        .await
        .unwrap();
    let agent_health = format!("127.0.0.1:{}", free_port());
    let agent_log = dir.path().join("agent.log");
    let agent = Child::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"))
            .env("KUBECONFIG", &agent_kubeconfig)
            .env_remove("RUST_LOG")
            .env(names::TOKEN_ENV, "e2e-token")
            .env(names::POD_NAME_ENV, "web-agent-0")
            .env(names::POD_NAMESPACE_ENV, &ns)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--health-bind-address={agent_health}"))
            .arg(format!("--target-override={backend}"))
            .arg(format!("--ca-file={}", ca.display()))
            // As the manager runs it in a Pod: the log fields below are the JSON contract.
            .arg("--log-format=json")
            .stderr(std::fs::File::create(&agent_log).unwrap()),
    );
    let online = wait_condition(&tunnels, "web", "TunnelReady", "True", "TunnelOnline", WAIT).await;
    E2e {
        ns,
        admin,
        tunnels,
        base,
        engine: Some(engine),
        manager,
        agent,
        agent_health,
        agent_log,
        online,
        _dir: dir,
    }
}

impl E2e {
    fn engine(&self) -> &rstream_client::engine::LocalEngine {
        self.engine.as_ref().unwrap()
    }

    /// No kubelet: reports the agent Deployment available, as its readiness probe would.
    async fn report_deployment_available(&self) {
        Api::<Deployment>::namespaced(self.admin.clone(), &self.ns)
            .patch_status(
                &self.base,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({
                "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
            )
            .await
            .unwrap();
        wait_condition(&self.tunnels, "web", "Ready", "True", "Ready", WAIT).await;
    }

    /// SIGTERM to both processes (each must exit cleanly), checks neither identity was denied,
    /// and returns the agent's log.
    async fn stop(self) -> String {
        assert!(
            self.agent.terminate().await,
            "the agent did not exit cleanly"
        );
        assert!(
            self.manager.terminate().await,
            "the manager did not exit cleanly"
        );
        let plane = plane().await;
        for user in [sa_user(&self.ns, MANAGER_SA), sa_user(&self.ns, &self.base)] {
            let forbidden = forbidden_requests(plane, &user).await;
            assert!(forbidden.is_empty(), "{user} was denied: {forbidden:?}");
        }
        if let Some(engine) = self.engine {
            engine.shutdown().await;
        }
        std::fs::read_to_string(&self.agent_log).unwrap()
    }
}

#[tokio::test]
async fn both_binaries_bring_a_tunnel_online_and_forward_through_it() {
    let env = e2e("e2e-online").await;
    let t = &env.online;
    let status = t.status.clone().unwrap();
    let tunnel_id = status.tunnel_id.clone().unwrap();
    assert!(
        condition(t, "TunnelReady")
            .unwrap()
            .2
            .contains("web-agent-0")
    );
    let address = status.forwarding_address.clone().unwrap();
    assert!(address.starts_with("https://127.0.0.1:"), "{address}");
    assert_eq!(http_status(&env.agent_health, "/readyz").await, 200);
    env.report_deployment_available().await;

    let ingress = env.engine().ingress_addr(&tunnel_id).unwrap();
    assert!(
        address.ends_with(&format!(":{}", ingress.port())),
        "{address} vs {ingress}"
    );
    let response = http_get(ingress).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("hello through rstream"), "{response}");

    let log = env.stop().await;
    let online = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "Tunnel online")
        .unwrap_or_else(|| panic!("no JSON 'Tunnel online' line in the agent log:\n{log}"));
    assert_eq!(online["tunnel_id"], tunnel_id.as_str());
    assert!(
        online["forwarding_address"]
            .as_str()
            .unwrap()
            .starts_with("https://")
    );
}

#[tokio::test]
async fn the_agent_reports_an_engine_outage_and_reconnects() {
    use rstream_client::engine::LocalEngine;

    let mut env = e2e("e2e-outage").await;
    env.report_deployment_available().await;
    let engine = env.engine.take().unwrap();
    let (engine_addr, engine_identity) = (engine.addr(), engine.identity().clone());
    let tunnels = &env.tunnels;

    // The engine goes away: the agent reports the disconnection and stops being ready.
    engine.shutdown().await;
    let t = wait_condition(
        tunnels,
        "web",
        "TunnelReady",
        "False",
        "TunnelDisconnected",
        WAIT,
    )
    .await;
    assert!(
        !t.status
            .as_ref()
            .unwrap()
            .last_error
            .clone()
            .unwrap_or_default()
            .is_empty()
    );
    assert_eq!(condition(&t, "Ready").unwrap().0, "False");
    assert_eq!(http_status(&env.agent_health, "/readyz").await, 503);

    // It comes back on the same address: the agent reconnects and the tunnel is Ready again.
    let engine = LocalEngine::builder()
        .bind(engine_addr)
        .identity(engine_identity)
        .token("e2e-token")
        .start()
        .await
        .unwrap();
    let t = wait_condition(
        tunnels,
        "web",
        "Ready",
        "True",
        "Ready",
        Duration::from_secs(45),
    )
    .await;
    let status = t.status.unwrap();
    assert!(status.last_error.is_none());
    let ingress = engine
        .ingress_addr(status.tunnel_id.as_deref().unwrap())
        .unwrap();
    let response = http_get(ingress).await.unwrap();
    assert!(response.ends_with("hello through rstream"), "{response}");

    env.engine = Some(engine);
    let log = env.stop().await;
    assert!(log.contains("Tunnel disconnected"), "{log}");
}
