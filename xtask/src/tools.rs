//! Helm v3.22.0, built from the Go module `helm.sh/helm/v3` into the cache (no binary download).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, bail};

pub use netkit_testenv::{HELM_ENV, HELM_VERSION};

/// Installs Helm if missing and returns its path.
pub fn ensure_helm() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os(HELM_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        bail!("{HELM_ENV}={} does not exist", path.display());
    }
    let helm =
        netkit_testenv::default_helm_path().context("cannot choose a cache directory: set HOME")?;
    let dir = helm
        .parent()
        .context("helm path has no directory")?
        .to_path_buf();
    if helm.is_file() {
        return Ok(helm);
    }
    eprintln!(
        "building helm {HELM_VERSION} from the Go module helm.sh/helm/v3 (a minute or two)..."
    );
    let status = Command::new("go")
        .args([
            "install",
            &format!("helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"),
        ])
        .env("GOBIN", &dir)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env_remove("GOFLAGS")
        .status()
        .context("running go install (Go >= 1.26 is needed to build helm)")?;
    if !status.success() || !helm.is_file() {
        bail!("go install of helm {HELM_VERSION} failed ({status})");
    }
    Ok(helm)
}
