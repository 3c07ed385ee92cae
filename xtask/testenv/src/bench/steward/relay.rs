//! steward-tcp-proxy as a process of its own, its first publish, and LISTs through its relay.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use anyhow::{Context as _, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::bench::system::{self, RELAY_CPU};

use super::SERVICE_PORT;
use super::repairs::is_repaired;

/// The steward-tcp-proxy child process, pinned to the relay CPU.
pub(super) struct Steward {
    pub(super) process: system::Service,
    pub(super) listen: SocketAddr,
    metrics: SocketAddr,
}

impl Steward {
    pub(super) fn start(
        plane: &ControlPlane,
        binary: &Path,
        namespace: &str,
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        let mut steward = Self::spawn(plane, binary, namespace, log_dir, &[])?;
        steward
            .process
            .wait_listening(steward.listen, Duration::from_secs(30))?;
        Ok(steward)
    }

    /// Started with `extra` flags, not waited for.
    pub(super) fn spawn(
        plane: &ControlPlane,
        binary: &Path,
        namespace: &str,
        log_dir: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let address = || -> anyhow::Result<SocketAddr> {
            Ok(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                system::free_port()?,
            )))
        };
        let (listen, health, metrics) = (address()?, address()?, address()?);
        let upstream = plane.server_url().trim_start_matches("https://").to_owned();
        let mut cmd = system::pinned_command(RELAY_CPU, binary);
        cmd.arg(format!(
            "--kubeconfig={}",
            plane.kubeconfig_path().display()
        ))
        .arg(format!("--upstream-addr={upstream}"))
        .arg(format!("--listen-addr={listen}"))
        .arg(format!("--health-addr={health}"))
        .arg(format!("--metrics-addr={metrics}"))
        // Sampled as plain HTTP: the bench is about relaying, not who may scrape.
        .arg("--metrics-secure=false")
        .arg(format!("--service-namespace={namespace}"))
        .arg("--service-name=proxy")
        .arg("--endpoint-mode=cluster-ip")
        .arg(format!("--service-port={SERVICE_PORT}"))
        .args(extra)
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn");
        let process = system::Service::spawn("steward-tcp-proxy", cmd, log_dir)?;
        Ok(Self {
            process,
            listen,
            metrics,
        })
    }

    /// One sample of the metrics endpoint, as text ("?" if unavailable).
    pub(super) async fn metric(&self, name: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let fetch = async {
            let mut stream = tokio::net::TcpStream::connect(self.metrics).await.ok()?;
            let request = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut response = String::new();
            stream.read_to_string(&mut response).await.ok()?;
            response.lines().find_map(|line| {
                let (key, value) = line.split_once(' ')?;
                (key == name).then(|| value.to_owned())
            })
        };
        tokio::time::timeout(Duration::from_secs(5), fetch)
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| "?".to_owned())
    }
}

/// With the slice made wrong and no Lease, starts steward with `--leader-elect`; returns the time
/// from the first sight of the Lease naming it to the first sight of the slice right again
/// (both polled every 5 ms, so each is seen within a poll of happening).
pub(super) async fn first_publish(
    client: &kube::Client,
    plane: &ControlPlane,
    binary: &Path,
    namespace: &str,
    log_dir: &Path,
    expected: &[String],
) -> anyhow::Result<Duration> {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let wrong = serde_json::json!({"endpoints": [{"addresses": ["10.0.0.254"]}]});
    slices
        .patch("kubernetes", &PatchParams::default(), &Patch::Merge(&wrong))
        .await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let _ = leases.delete("proxy", &Default::default()).await;
    let flags = ["--leader-elect", "--identity=bench-leader"];
    let mut steward = Steward::spawn(plane, binary, namespace, log_dir, &flags)?;
    let (deadline, mut leading) = (Instant::now() + Duration::from_secs(30), None);
    loop {
        let now = Instant::now();
        let lease = leases
            .get_opt("proxy")
            .await?
            .and_then(|l| l.spec?.holder_identity);
        if leading.is_none() && lease.as_deref() == Some("bench-leader") {
            leading = Some(now);
        }
        if let Some(since) = leading
            && slices
                .get_opt("kubernetes")
                .await?
                .is_some_and(|s| is_repaired(&s, expected))
        {
            steward.process.terminate(Duration::from_secs(10))?;
            return Ok(Instant::now().duration_since(since));
        }
        steward.process.check_running()?;
        if now > deadline {
            bail!("steward did not lead and publish within 30 s (leading: {leading:?})");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The steward's own Service; its ClusterIP is what `default/kubernetes` must point at.
pub(super) async fn create_proxy_service(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<String> {
    let service: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "proxy", "namespace": namespace},
        "spec": {"ports": [{"name": "https", "port": SERVICE_PORT, "targetPort": 16443}]},
    }))?;
    let created = Api::<Service>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &service)
        .await?;
    created
        .spec
        .and_then(|spec| spec.cluster_ip)
        .context("the proxy Service got no ClusterIP")
}

pub(super) async fn create_config_maps(
    client: &kube::Client,
    namespace: &str,
    count: usize,
) -> anyhow::Result<()> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let blob = "x".repeat(100 * 1024);
    for i in 0..count {
        let config_map: ConfigMap = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": format!("blob-{i}")},
            "data": {"blob": blob},
        }))?;
        api.create(&PostParams::default(), &config_map).await?;
    }
    Ok(())
}

/// An admin client whose connections go to `relay` (same TLS identity; the serving certificate
/// names 127.0.0.1, so verification still passes).
pub(super) async fn client_via(
    plane: &ControlPlane,
    relay: SocketAddr,
) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(plane.kubeconfig_path())?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.cluster_url = format!("https://{relay}").parse()?;
    Ok(kube::Client::try_from(config)?)
}

/// One warm-up LIST, then `count` timed ones; returns (response bytes, elapsed).
pub(super) async fn timed_lists(
    client: &kube::Client,
    path: &str,
    count: usize,
) -> anyhow::Result<(u64, Duration)> {
    let list = || async {
        let request = http::Request::get(path).body(Vec::new())?;
        anyhow::Ok(client.request_text(request).await?.len() as u64)
    };
    list().await?;
    let started = Instant::now();
    let mut bytes = 0;
    for _ in 0..count {
        bytes += list().await?;
    }
    Ok((bytes, started.elapsed()))
}
