//! `cargo xtask charts`' helm runs: where each chart is, the values it needs to lint, `helm
//! template` with a case's values, and the rendered objects as JSON.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::cases::{DIGEST, STEWARD_UPSTREAM};

pub(super) fn chart_dir(root: &Path, chart: &str) -> PathBuf {
    root.join(chart).join("chart")
}

/// Values a chart needs just to lint.
pub(super) fn lint_sets(chart: &str) -> Vec<String> {
    if chart == "steward-tcp-proxy" {
        vec!["--set".to_owned(), STEWARD_UPSTREAM.to_owned()]
    } else {
        Vec::new()
    }
}

pub(super) fn template(
    helm: &Path,
    root: &Path,
    chart: &str,
    namespace: &str,
    sets: &[&str],
) -> Result<String, String> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", chart])
        .arg(chart_dir(root, chart))
        .args(["--namespace", namespace])
        // Helm built from source defaults to Kubernetes v1.20 (its version comes from ldflags).
        .args(["--kube-version", netkit_testenv::KUBERNETES_VERSION]);
    // The CRDs are templates; a `crds/` folder (refused by `cargo xtask crds`) would show here.
    cmd.arg("--include-crds");
    for set in sets {
        // A flag is passed as it is; `string:` marks a --set-string; anything else is a value.
        let set = set.replace("DIGEST", DIGEST);
        if set.starts_with("--") {
            cmd.arg(set);
        } else if let Some(value) = set.strip_prefix("string:") {
            cmd.args(["--set-string", value]);
        } else {
            cmd.args(["--set", &set]);
        }
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        String::from_utf8(out.stdout).map_err(|e| e.to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The rendered objects of a chart, as JSON.
pub(super) fn objects(yaml: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}
