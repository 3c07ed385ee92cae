//! `cargo xtask crds`: the CRD YAML of the kustomize trees and charts, generated from the Rust
//! types; `--check` fails when a committed file differs (part of `cargo xtask test`).
//!
//! The charts hold their CRDs as templates (`chart/templates/crds/`), not in `chart/crds/`: Helm
//! installs `crds/` once and never upgrades it, so a release that adds a field would leave the
//! old schema behind. Each template is the generated YAML behind `crds.install` (default true),
//! with the chart's labels and, with `crds.keep` (default true), `helm.sh/resource-policy: keep`
//! so `helm uninstall` leaves the CRDs and every object in them, as cert-manager's chart does.
//! A `chart/crds/` folder is refused: its CRDs would shadow the templates on install and then
//! never follow an upgrade.

use std::path::PathBuf;

use anyhow::{Context as _, bail};

#[derive(clap::Args)]
pub struct Args {
    /// Do not write; fail if any file is stale.
    #[arg(long)]
    check: bool,
}

/// Every CRD file and the YAML it must hold.
fn expected() -> anyhow::Result<Vec<(PathBuf, String)>> {
    let root = netkit_testenv::workspace::root();
    let mut files = Vec::new();
    for (name, yaml) in
        rstream_operator::crd_files().context("serializing the rstream-operator CRDs")?
    {
        files.push((
            root.join("rstream-operator/chart/templates/crds")
                .join(&name),
            netkit_testenv::charts::chart_template(&yaml, "rstream-operator.labels")?,
        ));
        files.push((root.join("rstream-operator/config/crd").join(&name), yaml));
    }
    let yaml = pod_proxier::crd::crd_yaml().context("serializing the PortMapping CRD")?;
    files.push((
        root.join("pod-proxier/chart/templates/crds/portmappings.yaml"),
        netkit_testenv::charts::chart_template(&yaml, "pod-proxier.labels")?,
    ));
    files.push((root.join("pod-proxier/config/crd/portmappings.yaml"), yaml));
    Ok(files)
}

/// The chart folders that must not hold a `crds/` folder.
const CHARTS: [&str; 3] = [
    "steward-tcp-proxy/chart",
    "pod-proxier/chart",
    "rstream-operator/chart",
];

pub fn run(args: &Args) -> anyhow::Result<()> {
    let mut stale = Vec::new();
    for (path, yaml) in expected()? {
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current == yaml {
            continue;
        }
        if args.check {
            stale.push(path.display().to_string());
        } else {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    let root = netkit_testenv::workspace::root();
    for chart in CHARTS {
        let crds = root.join(chart).join("crds");
        if crds.exists() {
            bail!(
                "{} exists: Helm installs crds/ once and never upgrades it; the CRDs are templates \
                 in {chart}/templates/crds (remove the folder, then run `cargo xtask crds`)",
                crds.display()
            );
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale CRD YAML (run `cargo xtask crds`):\n  {}",
            stale.join("\n  ")
        );
    }
    if args.check {
        println!("CRD YAML is up to date");
    }
    Ok(())
}
