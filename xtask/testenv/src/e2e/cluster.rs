//! The control plane the charts run on and the chart repository Helm installs them from.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::ControlPlane;
use crate::charts::{Packaged, REPO_NAME, Server};

/// The chart repository as users meet it: `cargo xtask charts --package`'s folder served over
/// HTTP on loopback and added with `helm repo add`, in a Helm home of its own (the user's Helm
/// configuration is neither read nor changed).
pub struct ChartRepo {
    /// Every chart, packaged.
    pub charts: Vec<Packaged>,
    /// The repository served on loopback.
    pub server: Server,
    home: tempfile::TempDir,
}

impl ChartRepo {
    /// Packages every chart, serves the repository and adds it to a fresh Helm home as
    /// [`REPO_NAME`].
    pub fn start(helm: &Path) -> anyhow::Result<Self> {
        let charts = crate::charts::package(helm)?;
        let server = Server::start(&crate::charts::repo_dir())?;
        let repo = Self {
            charts,
            server,
            home: tempfile::tempdir()?,
        };
        repo.add(helm, REPO_NAME, &repo.server.url())?;
        Ok(repo)
    }

    /// `helm repo add name url` in this repository's Helm home.
    pub fn add(&self, helm: &Path, name: &str, url: &str) -> anyhow::Result<()> {
        let mut cmd = std::process::Command::new(helm);
        self.helm_home(&mut cmd);
        let out = cmd
            .args(["repo", "add", name, url])
            .output()
            .context("running helm repo add")?;
        if !out.status.success() {
            bail!(
                "helm repo add {name} {url}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Points a helm command at this repository's Helm home.
    pub(super) fn helm_home<C: HelmEnv>(&self, cmd: &mut C) {
        let home = self.home.path();
        cmd.set("HELM_CONFIG_HOME", home.join("config"));
        cmd.set("HELM_CACHE_HOME", home.join("cache"));
        cmd.set("HELM_DATA_HOME", home.join("data"));
    }
}

/// Environment setting on both kinds of Command.
pub(super) trait HelmEnv {
    fn set(&mut self, key: &str, value: PathBuf);
}

impl HelmEnv for std::process::Command {
    fn set(&mut self, key: &str, value: PathBuf) {
        self.env(key, value);
    }
}

impl HelmEnv for tokio::process::Command {
    fn set(&mut self, key: &str, value: PathBuf) {
        self.env(key, value);
    }
}

/// How long the control plane and its node may take to start (a cold containerd and CoreDNS on a
/// busy small machine).
const CLUSTER_START_LIMIT: Duration = Duration::from_secs(240);

/// The control plane the charts run on, with its node: the API server without its endpoint
/// reconciler, as a hosted control plane runs it (the node points `default/kubernetes` at the
/// API server once; steward takes it over).
pub async fn start_cluster() -> anyhow::Result<ControlPlane> {
    start_cluster_of(1).await
}

/// [`start_cluster`] with `nodes` nodes (the node-loss scenarios run on two).
pub async fn start_cluster_of(nodes: usize) -> anyhow::Result<ControlPlane> {
    ControlPlane::builder()
        .apiserver_arg("--endpoint-reconciler-type=none")
        .nodes(nodes)
        // Each further node starts its own containerd, kubelet and kube-proxy.
        .start_timeout(CLUSTER_START_LIMIT * u32::try_from(nodes.max(1)).unwrap_or(1))
        .start()
        .await
        .with_context(|| format!("starting the control plane with {nodes} node(s)"))
}
