//! steward-tcp-proxy relaying to the local API server, publishing its Service's ClusterIP as the
//! endpoint of `default/kubernetes` (as in `steward-tcp-proxy/tests/steward.rs`).

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, PostParams};

use super::processes::Processes;
use super::{Cluster, NAMESPACE, Shown, net};

const SERVICE: &str = "steward-tcp-proxy";
const SERVICE_PORT: i32 = 443;

pub async fn start(cluster: &Cluster<'_>, processes: &mut Processes) -> anyhow::Result<Shown> {
    let listen = net::free_addr()?;
    let health = net::free_addr()?;
    let cluster_ip = create_service(cluster, listen).await?;
    let upstream = cluster.plane.server_url().trim_start_matches("https://");
    processes.spawn(
        "steward-tcp-proxy",
        Command::new(cluster.binaries.get("steward-tcp-proxy")?)
            .arg(format!(
                "--kubeconfig={}",
                cluster.plane.kubeconfig_path().display()
            ))
            .arg(format!("--upstream-addr={upstream}"))
            .arg(format!("--listen-addr={listen}"))
            .arg(format!("--health-addr={health}"))
            .arg(format!("--metrics-addr={}", net::free_addr()?))
            .arg(format!("--service-namespace={NAMESPACE}"))
            .arg(format!("--service-name={SERVICE}"))
            .arg(format!("--service-port={SERVICE_PORT}"))
            .arg("--endpoint-mode=cluster-ip")
            // Stopping the demo should not wait for idle kubectl connections.
            .arg("--drain-timeout=1s")
            .env_remove("KUBECONFIG")
            .env("RUST_LOG", "info"),
    )?;
    // Ready means: the upstream is dialable and the endpoints are written.
    processes
        .wait_for(
            "steward-tcp-proxy /readyz",
            Duration::from_secs(30),
            || async { Ok(net::answers_ok(health, "/readyz").await.then_some(())) },
        )
        .await?;
    let expected = (vec![cluster_ip.clone()], SERVICE_PORT);
    processes
        .wait_for(
            "default/kubernetes to point at the proxy's ClusterIP",
            Duration::from_secs(15),
            || async {
                let published = published_endpoints(&cluster.admin).await?;
                Ok((published.as_ref() == Some(&expected)).then_some(()))
            },
        )
        .await?;
    let (version, namespaces) = call_through(cluster, listen).await?;
    Ok(Shown {
        name: "steward-tcp-proxy",
        facts: vec![
            format!("relays {listen} -> kube-apiserver {upstream} (TLS passes through untouched)"),
            format!(
                "EndpointSlice default/kubernetes -> {cluster_ip}:{SERVICE_PORT}, the ClusterIP of Service {NAMESPACE}/{SERVICE}"
            ),
            format!(
                "a client with server https://{listen}: GET /version -> {version}, listed {namespaces} namespaces"
            ),
        ],
        try_these: vec![
            "kubectl get endpointslice kubernetes -o wide".to_owned(),
            format!("kubectl --server https://{listen} get namespaces   # through the relay"),
        ],
    })
}

/// The proxy's own Service; its ClusterIP is what `default/kubernetes` will point at.
async fn create_service(cluster: &Cluster<'_>, listen: SocketAddr) -> anyhow::Result<String> {
    let service: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {"ports": [{"name": "https", "port": SERVICE_PORT, "targetPort": listen.port()}]},
    }))?;
    let created = Api::<Service>::namespaced(cluster.admin.clone(), NAMESPACE)
        .create(&PostParams::default(), &service)
        .await
        .context("creating the proxy's Service")?;
    created
        .spec
        .and_then(|spec| spec.cluster_ip)
        .context("the proxy's Service got no ClusterIP")
}

/// The addresses and port `default/kubernetes` publishes.
async fn published_endpoints(client: &kube::Client) -> anyhow::Result<Option<(Vec<String>, i32)>> {
    let Some(slice) = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?
    else {
        return Ok(None);
    };
    let addresses = slice
        .endpoints
        .unwrap_or_default()
        .into_iter()
        .flat_map(|endpoint| endpoint.addresses)
        .collect();
    let port = slice
        .ports
        .unwrap_or_default()
        .first()
        .and_then(|port| port.port);
    Ok(port.map(|port| (addresses, port)))
}

/// `/version` and a namespace list through the relay, with the admin's certificates: the client
/// verifies the API server's own certificate, so this proves the bytes pass through unchanged.
async fn call_through(cluster: &Cluster<'_>, relay: SocketAddr) -> anyhow::Result<(String, usize)> {
    let text = std::fs::read_to_string(cluster.plane.kubeconfig_path())?;
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    config.cluster_url = format!("https://{relay}").parse()?;
    let client = kube::Client::try_from(config)?;
    let version = client
        .apiserver_version()
        .await
        .context("GET /version through the relay")?;
    let namespaces = Api::<Namespace>::all(client)
        .list(&ListParams::default())
        .await
        .context("listing namespaces through the relay")?;
    Ok((version.git_version, namespaces.items.len()))
}
