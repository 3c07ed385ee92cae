//! A Service of the operator's load balancer class: the manager gives it a tunnel, its status
//! shows the public address, a request to that address reaches the workload, and deleting the
//! Service lets Kubernetes' garbage collector delete the tunnel.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, DeleteParams, PostParams};
use rstream_operator::api::RstreamTunnel;
use rstream_operator::manager::service as service_lb;
use serde_json::json;

use super::traffic::{TRAFFIC_LIMIT, workload_answer};

/// The Service's name (and so its tunnel's).
const NAME: &str = "web-lb";
/// How long the manager, the agents and the engine may take to give the Service an address.
const ADDRESS_LIMIT: Duration = Duration::from_secs(180);

/// Creates Service `web-lb` (type LoadBalancer, the operator's class, `app=web`'s `http` port),
/// waits for the address in its status, GETs `/` there until the workload answers, then deletes
/// the Service and waits for its tunnel to go.
pub(super) async fn service_load_balancer(
    client: &kube::Client,
    ns: &str,
) -> anyhow::Result<String> {
    let services: Api<Service> = Api::namespaced(client.clone(), ns);
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {
                    "name": NAME,
                    "annotations": {service_lb::PORT_ANNOTATION: "http"},
                },
                "spec": {
                    "type": "LoadBalancer",
                    "loadBalancerClass": service_lb::LOAD_BALANCER_CLASS,
                    "selector": {"app": "web"},
                    "ports": [
                        {"name": "tcp-echo", "port": 9000, "targetPort": 9000},
                        {"name": "http", "port": 80, "targetPort": 8080},
                    ],
                },
            }))?,
        )
        .await?;
    let started = Instant::now();
    let (addr, condition) = loop {
        let svc = services.get(NAME).await?;
        let status = svc.status.unwrap_or_default();
        let condition = status
            .conditions
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == service_lb::CONDITION)
            .map(|c| format!("{}/{}: {}", c.status, c.reason, c.message));
        let ingress = status
            .load_balancer
            .and_then(|lb| lb.ingress)
            .unwrap_or_default();
        if let Some(first) = ingress.first() {
            let port = first
                .ports
                .as_ref()
                .and_then(|p| p.first())
                .map(|p| p.port)
                .context("the ingress has no port")?;
            let host = first
                .ip
                .clone()
                .or_else(|| first.hostname.clone())
                .context("the ingress has neither ip nor hostname")?;
            let ip: IpAddr = match host.as_str() {
                "localhost" => IpAddr::from([127, 0, 0, 1]),
                other => other
                    .parse()
                    .with_context(|| format!("ingress host {other:?} is not an address here"))?,
            };
            break (
                SocketAddr::new(ip, u16::try_from(port)?),
                condition.unwrap_or_default(),
            );
        }
        if started.elapsed() > ADDRESS_LIMIT {
            bail!(
                "no status.loadBalancer.ingress within {ADDRESS_LIMIT:?}; condition {}",
                condition.as_deref().unwrap_or("none")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let assigned = started.elapsed();
    let asked = Instant::now();
    let answer = loop {
        let last = match workload_answer(addr).await {
            Ok(answer) => break answer,
            Err(e) => e,
        };
        if asked.elapsed() > TRAFFIC_LIMIT {
            bail!(
                "GET / at the Service's ingress {addr} found no workload within {TRAFFIC_LIMIT:?}: {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let owned = tunnels
        .get(NAME)
        .await?
        .metadata
        .owner_references
        .unwrap_or_default()
        .iter()
        .any(|o| o.kind == "Service" && o.name == NAME && o.controller == Some(true));
    if !owned {
        bail!("tunnel {NAME} is not controlled by Service {NAME}");
    }
    services.delete(NAME, &DeleteParams::default()).await?;
    let deleted = Instant::now();
    while tunnels.get_opt(NAME).await?.is_some() {
        if deleted.elapsed() > ADDRESS_LIMIT {
            bail!("tunnel {NAME} outlived its Service by {ADDRESS_LIMIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(format!(
        "ingress {addr} after {assigned:.1?} ({condition}); GET / there: {answer}; Service deleted: its tunnel gone after {:.1?}",
        deleted.elapsed()
    ))
}
