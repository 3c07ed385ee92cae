//! pod-proxier as a process, embedded or driving HAProxy, and the token of its caller.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{ControlPlane, Identity};
use anyhow::{Context as _, bail};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, PostParams};

use crate::bench::system::{self, RELAY_CPU};

use super::{CALLER, TTL_SECONDS, http};

/// One pod-proxier process (V1 only) on loopback.
pub(super) struct Proxier {
    binary: PathBuf,
    /// With a token: `--auth kubernetes`, and requests carry it; without: `--auth none`.
    pub(super) token: Option<String>,
    args: Vec<String>,
    pub(super) api: SocketAddr,
    pub(super) entry: SocketAddr,
    metrics: SocketAddr,
    process: Option<system::Service>,
    /// The banner pod currently mapped.
    pub(super) mapped: Option<usize>,
}

impl Proxier {
    pub(super) fn prepare(
        plane: &ControlPlane,
        binary: &Path,
        state_ns: &str,
        pods_ns: &str,
        extra: &[&str],
        token: Option<&str>,
    ) -> anyhow::Result<Self> {
        let address = || -> anyhow::Result<SocketAddr> {
            Ok(SocketAddr::from((
                Ipv4Addr::LOCALHOST,
                system::free_port()?,
            )))
        };
        let (api, entry, metrics) = (address()?, address()?, address()?);
        let mut args: Vec<String> = [
            "--enable-v1",
            if token.is_some() {
                "--auth=kubernetes"
            } else {
                "--auth=none"
            },
            "--listen-addr=127.0.0.1",
            "--api-listen-addr=127.0.0.1",
            // Loopback only, and the same for every round: TLS would only add the handshake.
            "--plain-http",
            "--log-level=warn",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend([
            format!("--kubeconfig={}", plane.kubeconfig_path().display()),
            format!("--state-namespace={state_ns}"),
            format!("--identity=bench-{state_ns}"),
            format!("--listen-port={}", api.port()),
            format!("--default-map-port={}", entry.port()),
            // One plain-HTTP address for health and metrics: the bench reads both as anyone.
            format!("--health-addr={metrics}"),
            format!("--metrics-addr={metrics}"),
            "--metrics-secure=false".to_owned(),
            format!("--allowed-namespaces={pods_ns}"),
            format!("--max-mapping-time={TTL_SECONDS}"),
        ]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        Ok(Self {
            binary: binary.to_owned(),
            token: token.map(str::to_owned),
            args,
            api,
            entry,
            metrics,
            process: None,
            mapped: None,
        })
    }

    /// The HAProxy configuration `pod-proxier haproxy-config` prints for these flags.
    fn haproxy_config(&self) -> anyhow::Result<String> {
        let output = Command::new(&self.binary)
            .arg("haproxy-config")
            .args(&self.args)
            .output()
            .context("running pod-proxier haproxy-config")?;
        if !output.status.success() {
            bail!(
                "pod-proxier haproxy-config failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?)
    }

    pub(super) async fn spawn(&mut self, log_dir: &Path) -> anyhow::Result<()> {
        let mut cmd = system::pinned_command(RELAY_CPU, &self.binary);
        cmd.args(&self.args).env_remove("KUBECONFIG");
        let name = format!("pod-proxier-{}", self.entry.port());
        self.process = Some(system::Service::spawn(&name, cmd, log_dir)?);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.check_running()?;
            if let Ok((200, _)) = http(self.metrics, "GET", "/readyz", None, None).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("pod-proxier was not ready within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(super) fn check_running(&mut self) -> anyhow::Result<()> {
        match &mut self.process {
            Some(process) => process.check_running(),
            None => bail!("pod-proxier was not started"),
        }
    }

    pub(super) fn clone_addrs(&self) -> (SocketAddr, SocketAddr) {
        (self.api, self.entry)
    }
}

/// HAProxy with the configuration of `pod-proxier haproxy-config`, then pod-proxier driving it
/// through the Runtime API socket.
pub(super) async fn start_with_haproxy(
    plane: &ControlPlane,
    binary: &Path,
    haproxy: &Path,
    pods_ns: &str,
    dir: &Path,
    token: Option<&str>,
) -> anyhow::Result<(Proxier, system::Service)> {
    let state_ns = plane
        .create_namespace(if token.is_some() {
            "bench-haproxy-auth"
        } else {
            "bench-haproxy"
        })
        .await?;
    let socket = dir.join(format!("haproxy-admin-{state_ns}.sock"));
    let api_addr = format!("unix://{}", socket.display());
    let mut proxier = Proxier::prepare(
        plane,
        binary,
        &state_ns,
        pods_ns,
        &["--backend=haproxy", &format!("--api-addr={api_addr}")],
        token,
    )?;
    let config = dir.join(format!("haproxy-{state_ns}.cfg"));
    std::fs::write(&config, proxier.haproxy_config()?)?;
    let mut cmd = system::pinned_command(RELAY_CPU, haproxy);
    cmd.args(["-db", "-f"]).arg(&config);
    let mut haproxy = system::Service::spawn(&format!("haproxy-{state_ns}"), cmd, dir)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        haproxy.check_running()?;
        if Instant::now() > deadline {
            bail!("HAProxy's admin socket did not appear within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxier.spawn(dir).await?;
    Ok((proxier, haproxy))
}

/// A ServiceAccount token (from the TokenRequest API) allowed to map the pods of `pods_ns`.
pub(super) async fn caller_token(
    plane: &ControlPlane,
    client: &kube::Client,
    pods_ns: &str,
) -> anyhow::Result<String> {
    let role: Role = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "mapper"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
            {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]},
        ],
    }))?;
    Api::<Role>::namespaced(client.clone(), pods_ns)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "mapper"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "mapper"},
        "subjects": [{"kind": "ServiceAccount", "name": CALLER, "namespace": pods_ns}],
    }))?;
    Api::<RoleBinding>::namespaced(client.clone(), pods_ns)
        .create(&PostParams::default(), &binding)
        .await?;
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(pods_ns, CALLER))
        .await?;
    let text = std::fs::read_to_string(&kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let value: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text)?;
    value["users"][0]["user"]["token"]
        .as_str()
        .map(str::to_owned)
        .context("no token in the ServiceAccount's kubeconfig")
}
