//! pod-proxier mapping a demo Pod to its entry port (V1 API). No kubelet runs here, so the Pod's
//! status is written by hand with a loopback IP where a local server listens, as the e2e tests do
//! (`pod-proxier/tests/e2e/harness.rs`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::CustomResourceExt as _;
use kube::api::{Api, Patch, PatchParams, PostParams};
use pod_proxier::crd::PortMapping;

use super::processes::Processes;
use super::{Cluster, NAMESPACE, Shown, net};

const POD: &str = "web-0";
/// The Pod's IP: a loopback address of its own, so the proxied bytes visibly go somewhere else.
const POD_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 10);
/// The container port name pod-proxier maps by default (`--jprofiler-port-name`).
const PORT_NAME: &str = "jprofiler-port";
/// Long enough for a demo session; pod-proxier removes the mapping when it expires.
const MAPPING_SECONDS: u64 = 3600;

pub async fn start(cluster: &Cluster<'_>, processes: &mut Processes) -> anyhow::Result<Shown> {
    cluster
        .plane
        .install_crds(&[PortMapping::crd()])
        .await
        .context("installing the PortMapping CRD")?;
    let greeting = format!("hello from pod {NAMESPACE}/{POD}");
    let backend = net::http_server(IpAddr::V4(POD_IP), greeting.clone()).await?;
    create_running_pod(&cluster.admin, backend).await?;

    let api = net::free_addr()?;
    let entry = net::free_addr()?;
    let metrics = net::free_addr()?;
    processes.spawn(
        "pod-proxier",
        Command::new(cluster.binaries.get("pod-proxier")?)
            .arg(format!(
                "--kubeconfig={}",
                cluster.plane.kubeconfig_path().display()
            ))
            .arg(format!("--state-namespace={NAMESPACE}"))
            .arg(format!("--allowed-namespaces={NAMESPACE}"))
            .arg("--identity=pod-proxier-demo-0")
            .arg("--enable-v1")
            .arg("--auth=none")
            .arg("--listen-addr=127.0.0.1")
            .arg("--api-listen-addr=127.0.0.1")
            .arg(format!("--listen-port={}", api.port()))
            .arg(format!("--default-map-port={}", entry.port()))
            .arg(format!("--metrics-addr={metrics}"))
            .arg("--drain-timeout=1")
            .env_remove("KUBECONFIG"),
    )?;
    processes
        .wait_for("pod-proxier /readyz", Duration::from_secs(30), || async {
            Ok(net::answers_ok(metrics, "/readyz").await.then_some(()))
        })
        .await?;

    let mapping = map_pod(api).await?;
    let response = net::http(entry, "GET", "/", None)
        .await
        .context("sending a request to the entry port")?;
    ensure!(
        response.body == greeting,
        "the entry port answered {:?}, not the pod's greeting",
        response.body
    );
    let resource = format!("v1-entry-{}", entry.port());
    wait_until_active(cluster, processes, &resource).await?;
    Ok(Shown {
        name: "pod-proxier",
        facts: vec![
            format!("API http://{api} (--auth none), entry port {entry}"),
            format!(
                "POST /api/v1/mapping {{\"pod_name\":\"{NAMESPACE}/{POD}\",\"time\":{MAPPING_SECONDS}}} -> {entry} -> {} until {}",
                mapping.upstreams, mapping.expires_at
            ),
            format!(
                "PortMapping {NAMESPACE}/{resource} is Active; GET http://{entry}/ -> {} {:?}",
                response.status_line, response.body
            ),
        ],
        try_these: vec![
            "kubectl get portmappings -A".to_owned(),
            format!("curl http://{entry}/"),
            format!(
                "curl http://{api}/api/v1/mapping -H 'content-type: application/json' -d '{{\"pod_name\":\"{NAMESPACE}/{POD}\",\"time\":600}}'"
            ),
        ],
    })
}

/// A Pod named [`POD`], Running at [`POD_IP`] with a container port [`PORT_NAME`] where `backend`
/// listens.
async fn create_running_pod(admin: &kube::Client, backend: SocketAddr) -> anyhow::Result<()> {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": POD, "namespace": NAMESPACE, "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "example.test/web:demo",
                 "ports": [{"name": PORT_NAME, "containerPort": backend.port()}]}]},
    }))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    pods.create(&PostParams::default(), &pod)
        .await
        .context("creating the demo Pod")?;
    let ip = POD_IP.to_string();
    let status = serde_json::json!({
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    pods.patch_status(POD, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .context("setting the demo Pod's status")?;
    Ok(())
}

struct Mapping {
    upstreams: String,
    expires_at: String,
}

/// `POST /api/v1/mapping` for the demo Pod.
async fn map_pod(api: SocketAddr) -> anyhow::Result<Mapping> {
    let request =
        serde_json::json!({"pod_name": format!("{NAMESPACE}/{POD}"), "time": MAPPING_SECONDS});
    let response = net::http(api, "POST", "/api/v1/mapping", Some(&request)).await?;
    ensure!(
        response.status == 200,
        "POST /api/v1/mapping answered {}: {}",
        response.status_line,
        response.body
    );
    let body: serde_json::Value =
        serde_json::from_str(&response.body).context("the mapping response is not JSON")?;
    let data = &body["data"];
    let upstreams = data["upstreams"]
        .as_array()
        .map(|all| {
            all.iter()
                .filter_map(serde_json::Value::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    Ok(Mapping {
        upstreams,
        expires_at: data["expires_at"].as_str().unwrap_or("?").to_owned(),
    })
}

/// The leader reports the mapping's status on the PortMapping object.
async fn wait_until_active(
    cluster: &Cluster<'_>,
    processes: &mut Processes,
    name: &str,
) -> anyhow::Result<()> {
    let mappings: Api<PortMapping> = Api::namespaced(cluster.admin.clone(), NAMESPACE);
    processes
        .wait_for(
            &format!("PortMapping {name} to be Active"),
            Duration::from_secs(15),
            || async {
                let mapping = mappings.get_opt(name).await?;
                let phase = mapping.and_then(|m| m.status).and_then(|s| s.phase);
                Ok((phase.as_deref() == Some("Active")).then_some(()))
            },
        )
        .await
}
