//! `cargo xtask charts`: every chart and kustomize tree proven against the real API server.
//!
//! For each chart: `helm lint`, then `helm template` with the defaults and a matrix of meaningful
//! values, and every rendered object applied with a server-side dry run to a fresh control plane
//! (the API server validates it fully, CRDs and CEL included, and stores nothing). Wrong values
//! must fail rendering with the chart's own message. The kustomize trees (`kubectl kustomize`) go
//! through the same dry run. The CRD templates are checked against the Rust types, and each
//! chart's README values table against its values.yaml (`cargo xtask chart-readme --check`).
//!
//! This file holds the flags and the run's order; [`cases`] is the table of values each chart is
//! rendered with and those it must refuse, [`render`] runs `helm template`, [`checks`] holds each
//! value and CRD template to what it claims, [`dry_run`] applies everything to the API server.

mod cases;
mod checks;
mod dry_run;
mod render;

use std::process::Command;

use anyhow::{Context as _, bail};

use cases::{CASES, KUSTOMIZE, REFUSED_BY_POD_SECURITY, WRONG};
use checks::{check_crd_templates, check_values_mean_what_they_say};
use dry_run::dry_run_all;
use render::{chart_dir, lint_sets, template};

#[derive(clap::Args)]
pub struct Args {
    /// Write the chart repository instead: each chart checked against its crate, packaged, and
    /// indexed under `<target>/charts/` (see `chart_repo.rs`).
    #[arg(long)]
    package: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let helm = crate::tools::ensure_helm()?;
    if args.package {
        return netkit_testenv::charts::run(&helm);
    }
    let root = netkit_testenv::workspace::root();
    let mut rendered = Vec::new();
    for chart in ["steward-tcp-proxy", "pod-proxier", "rstream-operator"] {
        let dir = chart_dir(&root, chart);
        let out = Command::new(&helm)
            .arg("lint")
            .arg(&dir)
            .args(["--kube-version", netkit_testenv::KUBERNETES_VERSION])
            .args(lint_sets(chart))
            .output()?;
        if !out.status.success() {
            bail!(
                "helm lint {chart}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        println!("ok   helm lint {chart}");
    }
    for case in CASES {
        let yaml = template(&helm, &root, case.chart, case.namespace, case.sets)
            .map_err(|e| anyhow::anyhow!("{} ({}): {e}", case.chart, case.what))?;
        rendered.push((
            format!("chart {} ({})", case.chart, case.what),
            case.namespace,
            yaml,
        ));
    }
    check_crd_templates(&helm, &root)?;
    check_values_mean_what_they_say(&helm, &root)?;
    let mut refused = Vec::new();
    for (chart, sets, namespace, message) in REFUSED_BY_POD_SECURITY {
        let yaml = template(&helm, &root, chart, namespace, sets)
            .map_err(|e| anyhow::anyhow!("{chart} with {sets:?}: {e}"))?;
        refused.push((format!("{chart} with {sets:?}"), *namespace, yaml, *message));
    }
    crate::chart_readme::run(&crate::chart_readme::Args { check: true })?;
    for (chart, sets, message) in WRONG {
        match template(&helm, &root, chart, "default", sets) {
            Ok(_) => bail!("{chart} rendered with {sets:?}; it must refuse them"),
            Err(err) if err.contains(message) => {
                let line = err
                    .lines()
                    .find(|l| l.contains(message))
                    .unwrap_or_default();
                println!("ok   {chart} refuses {sets:?}: {}", line.trim());
            }
            Err(err) => bail!("{chart} refused {sets:?} without naming {message:?}: {err}"),
        }
    }
    for (tree, namespace) in KUSTOMIZE {
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(root.join(tree))
            .output()
            .context("running kubectl kustomize")?;
        if !out.status.success() {
            bail!(
                "kubectl kustomize {tree}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        rendered.push((
            format!("kustomize {tree}"),
            *namespace,
            String::from_utf8(out.stdout)?,
        ));
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(dry_run_all(&rendered, &refused))
}
