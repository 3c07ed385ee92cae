//! `cargo xtask charts`: every chart and kustomize tree proven against the real API server.
//!
//! For each chart: `helm lint`, then `helm template` with the defaults and a matrix of meaningful
//! values, and every rendered object applied with a server-side dry run to a fresh control plane
//! (the API server validates it fully, CRDs and CEL included, and stores nothing). Wrong values
//! must fail rendering with the chart's own message. The kustomize trees (`kubectl kustomize`) go
//! through the same dry run. The CRD templates are checked against the Rust types, and each
//! chart's README values table against its values.yaml (`cargo xtask chart-readme --check`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod};
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
const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Namespaces labelled `pod-security.kubernetes.io/enforce=restricted` in the dry run: each
/// Deployment rendered into one is also dry-run as a Pod of its template, which Pod Security
/// admission judges (it only warns on a Deployment).
const RESTRICTED: [&str; 3] = [
    "steward-restricted",
    "infra-restricted",
    "rstream-restricted",
];

/// Values whose Pods Pod Security `restricted` must refuse, with a word of its message.
const REFUSED_BY_POD_SECURITY: &[(&str, &[&str], &str, &str)] = &[(
    "pod-proxier",
    &["hostNetwork=true"],
    "infra-restricted",
    "host namespaces",
)];

const CASES: &[Case] = &[
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "defaults",
        sets: &[STEWARD_UPSTREAM],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "steward-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[STEWARD_UPSTREAM],
    },
    Case {
        chart: "steward-tcp-proxy",
        namespace: "kube-system",
        what: "the common values: digest, pull secrets, priority class, scheduling, resources, longer drain",
        sets: &[
            STEWARD_UPSTREAM,
            "string:image.digest=DIGEST",
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=system-cluster-critical",
            "nodeSelector.disk=ssd",
            "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].key=zone",
            "affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].operator=Exists",
            "podAnnotations.team=net",
            "resources.limits.memory=256Mi",
            "shutdownDelay=1.5s,drainTimeout=2m",
        ],
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
        namespace: "infra-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "hostNetwork (Pod Security privileged), no Service",
        sets: &["hostNetwork=true", "service.enabled=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "the common values: digest, pull secrets, priority class, scheduling, NodePort",
        sets: &[
            "string:image.digest=DIGEST",
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=high",
            "nodeSelector.disk=ssd",
            "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
            "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
            "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.topologyKey=kubernetes.io/hostname",
            "podAnnotations.team=net",
            "service.type=NodePort",
        ],
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
        namespace: "rstream-restricted",
        what: "defaults under Pod Security restricted",
        sets: &[],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "moved ports, one watched namespace, pull secrets, digests, priority class",
        sets: &[
            "metrics.bindAddress=0.0.0.0:9000",
            "health.bindAddress=:9001",
            "watchNamespace=team-a",
            "imagePullSecrets[0].name=regcred",
            "string:image.digest=DIGEST",
            "agent.image.repository=registry.example/agent",
            "string:agent.image.digest=DIGEST",
            "priorityClassName=high",
        ],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "metrics endpoint off",
        sets: &["string:metrics.bindAddress=0"],
    },
    Case {
        chart: "rstream-operator",
        namespace: "rstream-system",
        what: "without CRDs",
        sets: &["crds.install=false"],
    },
    Case {
        chart: "pod-proxier",
        namespace: "infra",
        what: "without CRDs, or with CRDs that uninstall removes",
        sets: &["crds.install=false", "crds.keep=false"],
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
    // Unknown keys: a typo, and the values of before.
    (
        "rstream-operator",
        &["installCRDs=true"],
        "additional properties 'installCRDs' not allowed",
    ),
    (
        "pod-proxier",
        &["images.podProxier.tag=0.1.0"],
        "additional properties 'images' not allowed",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "image.digets=sha256:00"],
        "additional properties 'digets' not allowed",
    ),
    (
        "rstream-operator",
        &[
            "string:metrics.bindAddress=0",
            "serviceMonitor.enabled=true",
        ],
        "serviceMonitor.enabled needs the metrics endpoint",
    ),
    (
        "steward-tcp-proxy",
        &[
            STEWARD_UPSTREAM,
            "metricsPort=0",
            "serviceMonitor.enabled=true",
        ],
        "serviceMonitor.enabled needs the metrics endpoint",
    ),
    (
        "steward-tcp-proxy",
        &[STEWARD_UPSTREAM, "opsBindFailure=ignore"],
        "opsBindFailure",
    ),
];

/// kustomize trees and the namespace their unnamespaced objects land in.
const KUSTOMIZE: &[(&str, &str)] = &[
    ("pod-proxier/config", "infra"),
    ("rstream-operator/config/default", "rstream-system"),
    ("steward-tcp-proxy/config", "kube-system"),
];

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
        return crate::chart_repo::run(&helm);
    }
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
fn objects(yaml: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// The values checked against what they render, each claim with the figure it rendered.
fn check_values_mean_what_they_say(helm: &Path, root: &Path) -> anyhow::Result<()> {
    let render = |chart: &str, sets: &[&str]| -> anyhow::Result<Vec<serde_json::Value>> {
        let yaml = template(helm, root, chart, "default", sets)
            .map_err(|e| anyhow::anyhow!("{chart} with {sets:?}: {e}"))?;
        objects(&yaml)
    };
    let find = |objects: &[serde_json::Value], kind: &str| -> anyhow::Result<serde_json::Value> {
        objects
            .iter()
            .find(|o| o["kind"] == kind)
            .cloned()
            .with_context(|| format!("no {kind} rendered"))
    };
    let pod_spec = |objects: &[serde_json::Value]| -> anyhow::Result<serde_json::Value> {
        Ok(find(objects, "Deployment")?["spec"]["template"]["spec"].clone())
    };
    let mut claims: Vec<(String, bool)> = Vec::new();
    let mut claim = |what: String, holds: bool| claims.push((what, holds));

    // Every chart: the same image keys; the tag defaults to appVersion; a digest wins.
    for (chart, base) in [
        ("steward-tcp-proxy", vec![STEWARD_UPSTREAM]),
        ("pod-proxier", vec![]),
        ("rstream-operator", vec![]),
    ] {
        let image = |sets: &[&str]| -> anyhow::Result<String> {
            let mut all = base.clone();
            all.extend_from_slice(sets);
            let spec = pod_spec(&render(chart, &all)?)?;
            Ok(spec["containers"][0]["image"]
                .as_str()
                .unwrap_or_default()
                .to_owned())
        };
        let default = image(&[])?;
        claim(
            format!("{chart}: image.tag defaults to appVersion ({default})"),
            default.ends_with(":0.1.0"),
        );
        let digest = image(&["string:image.digest=DIGEST"])?;
        claim(
            format!("{chart}: image.digest pulls by digest ({digest})"),
            digest.ends_with(&format!("@{DIGEST}")),
        );
        let mut all = base.clone();
        all.extend_from_slice(&[
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=high",
            "nodeSelector.disk=ssd",
            "podAnnotations.team=net",
        ]);
        let spec = pod_spec(&render(chart, &all)?)?;
        claim(
            format!("{chart}: imagePullSecrets, priorityClassName, nodeSelector reach the Pod"),
            spec["imagePullSecrets"][0]["name"] == "regcred"
                && spec["priorityClassName"] == "high"
                && spec["nodeSelector"]["disk"] == "ssd",
        );
        let deployment = find(&render(chart, &all)?, "Deployment")?;
        claim(
            format!("{chart}: podAnnotations reach the Pod"),
            deployment["spec"]["template"]["metadata"]["annotations"]["team"] == "net",
        );
        let spec = pod_spec(&render(chart, &base)?)?;
        claim(
            format!("{chart}: no PriorityClass by default"),
            spec.get("priorityClassName").is_none(),
        );
    }

    // steward: the grace period follows the shutdown delay and the drain.
    let grace = |sets: &[&str]| -> anyhow::Result<serde_json::Value> {
        let mut all = vec![STEWARD_UPSTREAM];
        all.extend_from_slice(sets);
        Ok(pod_spec(&render("steward-tcp-proxy", &all)?)?["terminationGracePeriodSeconds"].clone())
    };
    let defaults = grace(&[])?;
    claim(
        format!("steward: grace period 5s + 30s + 5 s = {defaults}"),
        defaults == 40,
    );
    let longer = grace(&["shutdownDelay=1.5s", "drainTimeout=2m"])?;
    claim(
        format!("steward: grace period 1.5s + 2m + 5 s, rounded up = {longer}"),
        longer == 127,
    );

    // pod-proxier: no host network by default; the entry ports behind the Service.
    let objects = render("pod-proxier", &[])?;
    let spec = pod_spec(&objects)?;
    let service = find(&objects, "Service")?;
    let ports: Vec<&str> = service["spec"]["ports"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["name"].as_str()).collect())
        .unwrap_or_default();
    claim(
        format!("pod-proxier: hostNetwork off by default, Service ports {ports:?}"),
        spec["hostNetwork"] == false && ports.contains(&"api") && ports.contains(&"entry"),
    );

    // rstream-operator: ports, Service and probes follow the bind addresses.
    let objects = render(
        "rstream-operator",
        &[
            "metrics.bindAddress=0.0.0.0:9000",
            "health.bindAddress=:9001",
        ],
    )?;
    let container = pod_spec(&objects)?["containers"][0].clone();
    let port_of = |name: &str| {
        container["ports"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == name))
            .map(|p| p["containerPort"].clone())
    };
    let service = objects
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["annotations"]["helm.sh/hook"].is_null())
        .cloned()
        .context("no Service")?;
    let service_ports: Vec<(String, serde_json::Value)> = service["spec"]["ports"]
        .as_array()
        .map(|p| {
            p.iter()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap_or_default().to_owned(),
                        p["port"].clone(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let test_pod = objects
        .iter()
        .find(|o| o["kind"] == "Pod")
        .map(|p| p["spec"]["containers"][0]["command"].to_string())
        .unwrap_or_default();
    claim(
        format!(
            "rstream-operator: metrics :9000 and health :9001 move the container ports ({:?}, {:?}), the Service ({service_ports:?}), the probes (port {}) and helm test",
            port_of("metrics"),
            port_of("health"),
            container["readinessProbe"]["httpGet"]["port"]
        ),
        port_of("metrics") == Some(9000.into())
            && port_of("health") == Some(9001.into())
            && service_ports.contains(&("metrics".to_owned(), 9000.into()))
            && service_ports.contains(&("health".to_owned(), 9001.into()))
            && container["readinessProbe"]["httpGet"]["port"] == "health"
            && container["livenessProbe"]["httpGet"]["port"] == "health"
            && test_pod.contains(":9001/readyz"),
    );
    let objects = render("rstream-operator", &["string:metrics.bindAddress=0"])?;
    let container = pod_spec(&objects)?["containers"][0].clone();
    claim(
        "rstream-operator: metrics.bindAddress=\"0\" leaves no metrics port".to_owned(),
        !container["ports"].to_string().contains("metrics"),
    );
    let objects = render(
        "rstream-operator",
        &[
            "watchNamespace=team-a",
            "imagePullSecrets[0].name=regcred,imagePullSecrets[1].name=mirror",
        ],
    )?;
    let args = pod_spec(&objects)?["containers"][0]["args"].to_string();
    let cluster_wide = objects
        .iter()
        .any(|o| o["kind"] == "ClusterRole" || o["kind"] == "ClusterRoleBinding");
    let manager_role = objects.iter().any(|o| {
        o["kind"] == "Role"
            && o["metadata"]["namespace"] == "team-a"
            && o["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("manager-role"))
    });
    claim(
        format!(
            "rstream-operator: watchNamespace=team-a is a Role there (cluster-wide RBAC {cluster_wide}) and --namespace=team-a"
        ),
        !cluster_wide && manager_role && args.contains("--namespace=team-a"),
    );
    claim(
        "rstream-operator: imagePullSecrets reach the agents (--agent-image-pull-secrets=regcred,mirror)".to_owned(),
        args.contains("--agent-image-pull-secrets=regcred,mirror"),
    );

    let failed: Vec<&String> = claims
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(w, _)| w)
        .collect();
    for (what, ok) in &claims {
        println!("{} {what}", if *ok { "ok  " } else { "FAIL" });
    }
    if !failed.is_empty() {
        bail!("values that do not mean what they say: {failed:?}");
    }
    Ok(())
}

/// The CRDs in a rendered chart.
fn rendered_crds(yaml: &str) -> anyhow::Result<Vec<CustomResourceDefinition>> {
    let mut crds = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if value.get("kind").and_then(|k| k.as_str()) == Some("CustomResourceDefinition") {
            crds.push(serde_json::from_value(value)?);
        }
    }
    Ok(crds)
}

/// The charts' CRD templates against the Rust types: with the defaults each chart renders
/// exactly the generated CRDs of its group (the whole spec compared), labelled as the chart and
/// marked `helm.sh/resource-policy: keep`; `crds.keep=false` drops the mark and
/// `crds.install=false` renders none.
fn check_crd_templates(helm: &Path, root: &Path) -> anyhow::Result<()> {
    let mut generated = rstream_operator::crds();
    generated.push(serde_yaml_ng::from_str(&pod_proxier::crd::crd_yaml()?)?);
    for (chart, group) in [
        ("rstream-operator", "tunnels.rstream.io"),
        ("pod-proxier", "podproxier.kube-netkit.io"),
    ] {
        let render = |sets: &[&str]| -> anyhow::Result<Vec<CustomResourceDefinition>> {
            let yaml = template(helm, root, chart, "default", sets)
                .map_err(|e| anyhow::anyhow!("{chart} with {sets:?}: {e}"))?;
            rendered_crds(&yaml)
        };
        let expected: Vec<&CustomResourceDefinition> =
            generated.iter().filter(|c| c.spec.group == group).collect();
        let defaults = render(&[])?;
        if defaults.len() != expected.len() {
            bail!(
                "{chart} renders {} CRDs, the Rust types give {}",
                defaults.len(),
                expected.len()
            );
        }
        for want in &expected {
            let name = want.metadata.name.as_deref().unwrap_or_default();
            let got = defaults
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(name))
                .with_context(|| format!("{chart} does not render the CRD {name}"))?;
            if serde_json::to_value(&got.spec)? != serde_json::to_value(&want.spec)? {
                bail!("{chart}'s CRD {name} is not the generated one: run `cargo xtask crds`");
            }
            let meta = &got.metadata;
            let keep = meta
                .annotations
                .as_ref()
                .and_then(|a| a.get("helm.sh/resource-policy"));
            let labelled = meta
                .labels
                .as_ref()
                .and_then(|l| l.get("app.kubernetes.io/instance"))
                .is_some();
            if keep.map(String::as_str) != Some("keep") || !labelled {
                bail!("{chart}'s CRD {name}: keep annotation {keep:?}, chart labels {labelled}");
            }
        }
        let unkept = render(&["crds.keep=false"])?;
        if unkept.len() != expected.len()
            || unkept.iter().any(|c| {
                c.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key("helm.sh/resource-policy"))
            })
        {
            bail!("{chart} with crds.keep=false: every CRD, none kept on uninstall");
        }
        let none = render(&["crds.install=false"])?;
        if !none.is_empty() {
            bail!(
                "{chart} with crds.install=false still renders {} CRDs",
                none.len()
            );
        }
        println!(
            "ok   {chart}: its {} CRD templates are the generated CRDs (spec for spec), kept by default; crds.keep=false drops the mark, crds.install=false renders none",
            expected.len()
        );
    }
    Ok(())
}

/// A chart rendered with values Pod Security must refuse: (what, namespace, YAML, message).
type Refused<'a> = (String, &'a str, String, &'a str);

async fn dry_run_all(
    rendered: &[(String, &str, String)],
    refused: &[Refused<'_>],
) -> anyhow::Result<()> {
    let plane = ControlPlane::builder().start().await?;
    let client = plane.client().await?;
    // CRDs are installed for real, so the custom resources of the charts and samples validate.
    let mut crds: Vec<CustomResourceDefinition> = rstream_operator::crds();
    crds.push(serde_yaml_ng::from_str(&pod_proxier::crd::crd_yaml()?)?);
    plane.install_crds(&crds).await?;
    let discovery = Discovery::new(client.clone()).run().await?;
    let params = PatchParams::apply("xtask-charts").force().dry_run();
    for ns in RESTRICTED {
        ensure_namespace(&client, ns).await?;
        let api: Api<Namespace> = Api::all(client.clone());
        let label = serde_json::json!({ "metadata": { "labels": {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        }}});
        api.patch(ns, &PatchParams::default(), &Patch::Merge(&label))
            .await?;
    }
    let mut pods_checked = 0;
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
            let ns = object
                .metadata
                .namespace
                .as_deref()
                .unwrap_or(default_namespace);
            if types.kind == "Deployment" && RESTRICTED.contains(&ns) {
                pod_of_template(&client, ns, &object)
                    .await
                    .with_context(|| {
                        format!(
                            "{what}: Pod Security restricted refused the Pod of Deployment {name}"
                        )
                    })?;
                pods_checked += 1;
            }
        }
        println!("ok   {what}: {count} objects accepted (server-side dry run)");
        total += count;
    }
    for (what, ns, yaml, message) in refused {
        let mut seen = false;
        for doc in serde_yaml_ng::Deserializer::from_str(yaml) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            if value["kind"] != "Deployment" {
                continue;
            }
            let object: DynamicObject = serde_json::from_value(value)?;
            match pod_of_template(&client, ns, &object).await {
                Ok(()) => bail!("{what}: Pod Security restricted in {ns} accepted its Pod"),
                Err(err) if format!("{err:#}").contains(message) => {
                    println!("ok   {what}: Pod Security restricted refuses its Pod ({message})");
                    seen = true;
                }
                Err(err) => bail!("{what}: refused without naming {message:?}: {err:#}"),
            }
        }
        if !seen {
            bail!("{what}: no Deployment rendered");
        }
    }
    println!(
        "charts: {total} rendered objects accepted by kube-apiserver {}; {pods_checked} Pods of Deployments accepted under Pod Security restricted",
        k8s_reconcile::testing::KUBERNETES_VERSION
    );
    Ok(())
}

/// Dry-run creates a Pod of `deployment`'s template in `ns`: Pod Security admission judges Pods.
async fn pod_of_template(
    client: &kube::Client,
    ns: &str,
    deployment: &DynamicObject,
) -> anyhow::Result<()> {
    let name = deployment.metadata.name.clone().unwrap_or_default();
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": format!("{name}-pod-security"), "namespace": ns },
        "spec": deployment.data["spec"]["template"]["spec"],
    }))?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(
        &PostParams {
            dry_run: true,
            ..PostParams::default()
        },
        &pod,
    )
    .await?;
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
