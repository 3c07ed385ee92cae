//! The "pods" mappings point at: loopback listeners that greet, registered as Pods.

use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::{BANNER_PODS, PORT_NAME};

/// Pods whose podIP:port is a local server that greets with the pod's tag and closes.
pub(super) struct BannerPods {
    namespace: String,
    servers: Vec<JoinHandle<()>>,
}

impl BannerPods {
    pub(super) async fn start(client: &kube::Client, namespace: &str) -> anyhow::Result<Self> {
        let mut pods = Self {
            namespace: namespace.to_owned(),
            servers: Vec::new(),
        };
        for i in 0..BANNER_PODS {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            let port = listener.local_addr()?.port();
            pods.servers
                .push(tokio::spawn(greet(listener, pods.tag(i))));
            create_pod(client, namespace, &format!("pod-{i}"), port).await?;
        }
        Ok(pods)
    }

    pub(super) fn pod_name(&self, i: usize) -> String {
        format!("{}/pod-{i}", self.namespace)
    }

    pub(super) fn tag(&self, i: usize) -> String {
        format!("banner-{i}")
    }

    pub(super) fn next_after(&self, current: Option<usize>) -> usize {
        current.map_or(0, |i| (i + 1) % BANNER_PODS)
    }
}

impl Drop for BannerPods {
    fn drop(&mut self) {
        for server in &self.servers {
            server.abort();
        }
    }
}

async fn greet(listener: TcpListener, tag: String) {
    let greeting = format!("{tag}\n");
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let greeting = greeting.clone();
        tokio::spawn(async move {
            // The client only needs the greeting; a failed write is its problem to report.
            let _ = conn.write_all(greeting.as_bytes()).await;
        });
    }
}

/// A Running pod with podIP 127.0.0.1 and the mapped container port at `port`.
pub(super) async fn create_pod(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    port: u16,
) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "example",
            "ports": [{"name": PORT_NAME, "containerPort": port}]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let status = serde_json::json!({"status": {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}
