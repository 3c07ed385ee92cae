//! `cargo xtask charts`: every chart and kustomize tree proven against the real API server.
//!
//! For each chart: `helm lint`, then `helm template` with the defaults and a matrix of meaningful
//! values, and every rendered object applied with a server-side dry run to a fresh control plane
//! (the API server validates it fully, CRDs and CEL included, and stores nothing). Wrong values
//! must fail rendering with the chart's own message. The kustomize trees (`kubectl kustomize`) go
//! through the same dry run.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_reconcile::testing::ControlPlane;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};

/// A chart rendered with some values.
struct Case {
    chart: &'static str,
    namespace: &'static str,
    what: &'static str,
    sets: &'static [&'static str],
}

const STEWARD_UPSTREAM: &str = "upstreamAddr=api.tenant.example:6443";

const CASES: &[Case] = &[
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "defaults",
        sets: &[STEWARD_UPSTREAM],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "cluster-ip mode, no leader election, one event loop",
        sets: &[
            STEWARD_UPSTREAM,
            "endpointMode=cluster-ip",
            "leaderElection.enabled=false",
            "replicaCount=1",
            "threads=1",
        ],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "TLS termination on host network",
        sets: &[
            STEWARD_UPSTREAM,
            "tls.enabled=true",
            "tls.secretName=apiserver-tls",
            "tls.upstreamCAConfigMap=kube-root-ca.crt",
            "hostNetwork=true",
        ],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "upstream through an HTTP proxy (URL from a Secret)",
        sets: &[STEWARD_UPSTREAM, "upstreamProxySecret=egress-proxy"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "defaults",
        sets: &[],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "V1 only",
        sets: &["podProxier.enableV1=true", "podProxier.enableV2=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "V2 only",
        sets: &[
            "podProxier.enableV1=false",
            "podProxier.enableV2=true",
            "podProxier.allowedNamespaces={default,team-a}",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "AWS load balancer",
        sets: &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=aws",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "GCP load balancer with extra annotations",
        sets: &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=gcp",
            "service.annotations.team=net",
        ],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "HAProxy backend",
        sets: &["podProxier.backend=haproxy"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "defaults",
        sets: &[],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "without CRDs",
        sets: &["--skip-crds"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "leader election off",
        sets: &["leaderElection.enabled=false"],
    },
];

/// Values that must not render, with the message the chart gives.
const WRONG: &[(&str, &[&str], &str)] = &[
    (
        "pod-proxier",
        &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=azure",
        ],
        "cloudProvider",
    ),
    (
        "pod-proxier",
        &[
            "podProxier.portRangeStart=9100",
            "podProxier.portRangeEnd=9000",
        ],
        "must be lower than",
    ),
    (
        "pod-proxier",
        &["podProxier.enableV1=false", "podProxier.enableV2=false"],
        "enable at least one",
    ),
    ("steward-tcp-proxy", &[], "upstreamAddr"),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "endpointMode=node-ip"],
        "endpointMode",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "tls.enabled=true"],
        "tls.secretName",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "threads=0"],
        "threads",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "threads=1025"],
        "threads",
    ),
    ("rstream-operator", &["logFormat=xml"], "logFormat"),
];

/// kustomize trees and the namespace their unnamespaced objects land in.
const KUSTOMIZE: &[(&str, &str)] = &[
    ("pod-proxier/config", "infra"),
    ("rstream-operator/config/default", "rstream-system"),
    ("steward-tcp-proxy/config", "kube-system"),
];

pub fn run() -> anyhow::Result<()> {
    let helm = crate::tools::ensure_helm()?;
    let root = crate::workspace_root();
    let mut rendered = Vec::new();
    for chart in ["steward-tcp-proxy", "pod-proxier", "rstream-operator"] {
        let dir = chart_dir(&root, chart);
        let out = Command::new(&helm)
            .arg("lint")
            .arg(&dir)
            .args(["--kube-version", k8s_reconcile::testing::KUBERNETES_VERSION])
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
    runtime.block_on(dry_run_all(&rendered))
}

fn chart_dir(root: &Path, chart: &str) -> PathBuf {
    root.join(chart).join("chart")
}

/// Values a chart needs just to lint.
fn lint_sets(chart: &str) -> Vec<String> {
    if chart == "steward-tcp-proxy" {
        vec!["--set".to_owned(), STEWARD_UPSTREAM.to_owned()]
    } else {
        Vec::new()
    }
}

fn template(
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
        .args(["--kube-version", k8s_reconcile::testing::KUBERNETES_VERSION]);
    if !sets.contains(&"--skip-crds") {
        cmd.arg("--include-crds");
    }
    for set in sets {
        // A flag is passed as it is; anything else is a value.
        if set.starts_with("--") {
            cmd.arg(set);
        } else {
            cmd.args(["--set", set]);
        }
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        String::from_utf8(out.stdout).map_err(|e| e.to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

async fn dry_run_all(rendered: &[(String, &str, String)]) -> anyhow::Result<()> {
    let plane = ControlPlane::builder().start().await?;
    let client = plane.client().await?;
    // CRDs are installed for real, so the custom resources of the charts and samples validate.
    let mut crds: Vec<CustomResourceDefinition> = rstream_operator::crds();
    crds.push(serde_yaml_ng::from_str(&pod_proxier::crd::crd_yaml()?)?);
    plane.install_crds(&crds).await?;
    let discovery = Discovery::new(client.clone()).run().await?;
    let params = PatchParams::apply("xtask-charts").force().dry_run();
    let mut total = 0;
    for (what, default_namespace, yaml) in rendered {
        let mut count = 0;
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            if value.is_null() {
                continue;
            }
            let object: DynamicObject = serde_json::from_value(value)
                .with_context(|| format!("{what}: an object that is not a Kubernetes object"))?;
            let types = object
                .types
                .clone()
                .context("object without apiVersion/kind")?;
            let gvk = GroupVersionKind::try_from(&types)?;
            let (resource, caps) = discovery
                .resolve_gvk(&gvk)
                .with_context(|| format!("{what}: the API server does not serve {gvk:?}"))?;
            let name = object
                .metadata
                .name
                .clone()
                .context("object without a name")?;
            let api: Api<DynamicObject> = match caps.scope {
                Scope::Cluster => Api::all_with(client.clone(), &resource),
                Scope::Namespaced => {
                    let ns = object
                        .metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| (*default_namespace).to_owned());
                    ensure_namespace(&client, &ns).await?;
                    Api::namespaced_with(client.clone(), &ns, &resource)
                }
            };
            api.patch(&name, &params, &Patch::Apply(&object))
                .await
                .with_context(|| format!("{what}: the API server refused {} {name}", types.kind))?;
            count += 1;
        }
        println!("ok   {what}: {count} objects accepted (server-side dry run)");
        total += count;
    }
    println!(
        "charts: {total} rendered objects accepted by kube-apiserver {}",
        k8s_reconcile::testing::KUBERNETES_VERSION
    );
    Ok(())
}

async fn ensure_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.to_owned());
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}
