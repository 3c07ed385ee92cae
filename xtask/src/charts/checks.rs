//! `cargo xtask charts`' checks of what a chart renders: each value means what it says, and the
//! CRD templates are the CRDs generated from the Rust types.

use std::path::Path;

use anyhow::{Context as _, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

use super::cases::{DIGEST, STEWARD_UPSTREAM};
use super::render::{objects, template};

/// The values checked against what they render, each claim with the figure it rendered.
pub(super) fn check_values_mean_what_they_say(helm: &Path, root: &Path) -> anyhow::Result<()> {
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
    // The metrics server's reviews (TokenReview, SubjectAccessReview) and the reader role have
    // no namespace; only the manager's own rules must be namespaced.
    let cluster_wide = objects.iter().any(|o| {
        (o["kind"] == "ClusterRole" || o["kind"] == "ClusterRoleBinding")
            && !o["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-metrics-auth") || n.ends_with("-metrics-reader"))
    });
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
pub(super) fn check_crd_templates(helm: &Path, root: &Path) -> anyhow::Result<()> {
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
