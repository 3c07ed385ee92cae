//! `cargo xtask crds`: the CRD YAML of the kustomize trees and charts, generated from the Rust
//! types; `--check` fails when a committed file differs (part of `cargo xtask test`).

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
    let root = crate::workspace_root();
    let mut files = Vec::new();
    for (name, yaml) in
        rstream_operator::crd_files().context("serializing the rstream-operator CRDs")?
    {
        for dir in ["rstream-operator/config/crd", "rstream-operator/chart/crds"] {
            files.push((root.join(dir).join(&name), yaml.clone()));
        }
    }
    let yaml = pod_proxier::crd::crd_yaml().context("serializing the PortMapping CRD")?;
    for dir in ["pod-proxier/config/crd", "pod-proxier/chart/crds"] {
        files.push((root.join(dir).join("portmappings.yaml"), yaml.clone()));
    }
    Ok(files)
}

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
            std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
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
