//! The seed's Quick Start: the agent's Secrets, the connection and an HTTP tunnel to a workload.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::api::{Api, PostParams};
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use serde_json::json;

use crate::e2e::Env;
use crate::node::check;

use super::engine::{EngineView, TOKEN, wait_ingress};
use super::traffic::TRAFFIC_LIMIT;
use super::{wait_available, wait_condition};

/// The seed's Quick Start in `ns`: the testbox workload `web` behind Service `web` (`http` and
/// `tcp-echo`), Secret `rstream-credentials` with the token and `engine`'s CA, RstreamConnection
/// `default` pointing at `engine` with the CA by Secret reference, and one RstreamTunnel per
/// `(name, spec)`.
pub async fn quick_start(
    client: &kube::Client,
    ns: &str,
    engine: &(impl EngineView + ?Sized),
    tunnel_specs: &[(&str, serde_json::Value)],
) -> anyhow::Result<()> {
    quick_start_with_transport(client, ns, engine, None, tunnel_specs).await
}

/// [`quick_start`] with the connection's `spec.transport`.
pub async fn quick_start_with_transport(
    client: &kube::Client,
    ns: &str,
    engine: &(impl EngineView + ?Sized),
    transport: Option<serde_json::Value>,
    tunnel_specs: &[(&str, serde_json::Value)],
) -> anyhow::Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(check::testbox_deployment("web", 1))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "web" },
                "spec": { "selector": { "app": "web" }, "ports": [
                    { "name": "http", "port": 80, "targetPort": 8080 },
                    { "name": "tcp-echo", "port": 9000, "targetPort": 9000 },
                ]},
            }))?,
        )
        .await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "rstream-credentials" },
                "stringData": { "token": TOKEN, "ca.crt": engine.ca_pem() },
            }))?,
        )
        .await?;
    let mut connection = json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
        "metadata": { "name": "default" },
        "spec": {
            "engine": engine.engine_address(),
            "tokenSecretRef": { "name": "rstream-credentials", "key": "token" },
            "caSecretRef": { "name": "rstream-credentials", "key": "ca.crt" },
        },
    });
    if let Some(transport) = transport {
        connection["spec"]["transport"] = transport;
    }
    let connections: Api<RstreamConnection> = Api::namespaced(client.clone(), ns);
    connections
        .create(&PostParams::default(), &serde_json::from_value(connection)?)
        .await?;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    for (name, spec) in tunnel_specs {
        tunnels
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamTunnel",
                    "metadata": { "name": name }, "spec": spec,
                }))?,
            )
            .await?;
    }
    Ok(())
}

/// What the HTTP tunnel of the Quick Start showed.
pub struct HttpTunnel {
    /// The agent Deployment's name.
    pub agent_deployment: String,
    /// Whether that Deployment was Available.
    pub agent_available: bool,
    /// The tunnel id in the status.
    pub tunnel_id: String,
    /// The forwarding address in the status.
    pub forwarding_address: String,
    /// The ingress the request went to, if the engine has one for the tunnel.
    pub ingress: Option<SocketAddr>,
    /// How many requests it took to get an answer.
    pub attempts: u32,
    /// The body of the last answer through the engine, or why there was none.
    pub answer: Result<String, String>,
}

impl HttpTunnel {
    /// The agent is Available and the workload Pod answered through the engine.
    pub fn passed(&self) -> bool {
        self.agent_available && self.reached_pod()
    }

    /// The testbox names its Pod in its answer.
    pub fn reached_pod(&self) -> bool {
        self.answer
            .as_ref()
            .is_ok_and(|a| a.contains("\"pod\":\"web-"))
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        format!(
            "agent Deployment {} Available={}; forwarding address {}; GET / through the engine (attempt {}): {}",
            self.agent_deployment,
            self.agent_available,
            self.forwarding_address,
            self.attempts,
            match &self.answer {
                Ok(a) => a.lines().last().unwrap_or_default().to_owned(),
                Err(e) => e.clone(),
            }
        )
    }
}

/// Waits for HTTP tunnel `name` to be Ready and its agent Deployment Available by its probe, then
/// GETs `/` through the engine's ingress until the workload Pod answers (within
/// `TRAFFIC_LIMIT`).
pub async fn http_tunnel(
    env: &Env<'_>,
    engine: &(impl EngineView + ?Sized),
    ns: &str,
    name: &str,
) -> anyhow::Result<HttpTunnel> {
    let client = env.plane.client().await?;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client, ns);
    let tunnel = wait_condition(&tunnels, name, "Ready", "True", Duration::from_secs(120)).await?;
    let status = tunnel.status.unwrap_or_default();
    let agent = status.agent_deployment.unwrap_or_default();
    // The agent reports Ready itself; the Deployment controller sets Available after the
    // kubelet's probe and the ReplicaSet's count have caught up, a moment later.
    let available = wait_available(&deployments, &agent, Duration::from_secs(60)).await?;
    let tunnel_id = status.tunnel_id.unwrap_or_default();
    // The tunnel can be Ready before the workload is: its Pod must be Ready and its endpoint
    // routed by kube-proxy before the agent's dial to the Service lands.
    check::wait_pods_ready(env.plane, ns, "app=web", 1).await?;
    let ingress = wait_ingress(engine, &tunnel_id).await;
    let mut outcome = HttpTunnel {
        agent_deployment: agent,
        agent_available: available,
        tunnel_id,
        forwarding_address: status.forwarding_address.unwrap_or_default(),
        ingress,
        attempts: 0,
        answer: Err("not tried".to_owned()),
    };
    let asked = Instant::now();
    loop {
        outcome.attempts += 1;
        outcome.answer = match ingress {
            Some(ingress) => check::http_get(ingress, "/").await,
            None => Err(format!(
                "the engine has no ingress for {}",
                outcome.tunnel_id
            )),
        };
        if outcome.reached_pod() || asked.elapsed() > TRAFFIC_LIMIT {
            return Ok(outcome);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
