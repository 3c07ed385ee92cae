//! The Helm chart and the kustomize manifests: the same RBAC rules everywhere, the documented
//! values, and the cloud provider rule, rendered with the pinned Helm (`cargo xtask helm`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml_ng::Value;

fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("chart")
}

fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn rules_file() -> Value {
    serde_yaml_ng::from_str(
        &std::fs::read_to_string(chart_dir().join("files/rbac-rules.yaml")).unwrap(),
    )
    .unwrap()
}

fn rules_of(docs: &[Value], kind: &str, name_suffix: &str) -> Value {
    docs.iter()
        .find(|d| {
            d["kind"] == kind
                && d["metadata"]["name"]
                    .as_str()
                    .unwrap()
                    .ends_with(name_suffix)
        })
        .unwrap_or_else(|| panic!("no {kind} *{name_suffix}"))["rules"]
        .clone()
}

#[test]
fn kustomize_rbac_has_the_charts_rules() {
    let rules = rules_file();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rbac/rbac.yaml"),
    )
    .unwrap();
    let docs = documents(&text);
    assert_eq!(rules_of(&docs, "ClusterRole", "-auth"), rules["cluster"]);
    assert_eq!(rules_of(&docs, "Role", "pod-proxier"), rules["state"]);
    assert_eq!(rules_of(&docs, "ClusterRole", "-target"), rules["target"]);
}

#[test]
fn values_schema_restricts_the_cloud_provider() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chart_dir().join("values.schema.json")).unwrap(),
    )
    .unwrap();
    let provider = &schema["properties"]["service"]["properties"]["cloudProvider"]["enum"];
    assert_eq!(provider, &serde_json::json!(["", "aws", "gcp"]));
    assert_eq!(
        schema["properties"]["service"]["then"]["properties"]["cloudProvider"]["enum"],
        serde_json::json!(["aws", "gcp"])
    );
    let rbac = std::fs::read_to_string(chart_dir().join("templates/rbac.yaml")).unwrap();
    assert!(rbac.contains(".Files.Get \"files/rbac-rules.yaml\""));
}

fn helm() -> PathBuf {
    netkit_testenv::helm().unwrap()
}

fn template(helm: &Path, sets: &[&str]) -> Result<Vec<Value>, String> {
    let mut cmd = Command::new(helm);
    cmd.args(["template", "pp", "--namespace", "infra"])
        .arg(chart_dir());
    for set in sets {
        cmd.args(["--set", set]);
    }
    let out = cmd.output().unwrap();
    if out.status.success() {
        Ok(documents(&String::from_utf8(out.stdout).unwrap()))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn helm_renders_the_documented_values() {
    let helm = helm();
    let lint = Command::new(&helm)
        .arg("lint")
        .arg(chart_dir())
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );

    // Defaults: the chart's RBAC is the rules file, bound per allowed namespace.
    let docs = template(&helm, &[]).unwrap();
    let rules = rules_file();
    assert_eq!(rules_of(&docs, "ClusterRole", "-auth"), rules["cluster"]);
    assert_eq!(rules_of(&docs, "Role", "pod-proxier"), rules["state"]);
    assert_eq!(rules_of(&docs, "ClusterRole", "-target"), rules["target"]);
    let docs = template(
        &helm,
        &[
            "podProxier.allowedNamespaces={team-a,team-b}",
            "podProxier.enableV2=true",
        ],
    )
    .unwrap();
    let bound: Vec<&str> = docs
        .iter()
        .filter(|d| {
            d["kind"] == "RoleBinding"
                && d["metadata"]["name"].as_str().unwrap().ends_with("-target")
        })
        .map(|d| d["metadata"]["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(bound, ["team-a", "team-b"]);
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    for flag in [
        "--enable-v1",
        "--enable-v2",
        "--default-map-port=8849",
        "--jprofiler-port-name=jprofiler-port",
        "--port-name=debug",
        "--port-range-start=9000",
        "--port-range-end=9100",
        "--allowed-namespaces=team-a,team-b",
    ] {
        assert!(args.contains(&flag), "{flag} missing from {args:?}");
    }
    // Every flag the chart passes is accepted by the binary.
    let status = Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
        .arg("haproxy-config")
        .args(&args)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );

    // Cloud providers.
    let aws = template(
        &helm,
        &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=aws",
            "service.annotations.team=x",
        ],
    )
    .unwrap();
    let svc = aws.iter().find(|d| d["kind"] == "Service").unwrap();
    assert_eq!(
        svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-type"],
        "nlb"
    );
    assert_eq!(svc["metadata"]["annotations"]["team"], "x");
    let gcp = template(
        &helm,
        &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=gcp",
        ],
    )
    .unwrap();
    let svc = gcp.iter().find(|d| d["kind"] == "Service").unwrap();
    assert_eq!(
        svc["metadata"]["annotations"]["cloud.google.com/load-balancer-type"],
        "Internal"
    );
    for sets in [
        &["service.enabled=true", "service.type=LoadBalancer"][..],
        &[
            "service.enabled=true",
            "service.type=LoadBalancer",
            "service.cloudProvider=azure",
        ][..],
    ] {
        let err = template(&helm, sets).unwrap_err();
        assert!(err.contains("cloudProvider"), "{sets:?}: {err}");
    }
    let err = template(&helm, &["podProxier.enableV1=false"]).unwrap_err();
    assert!(err.contains("enable at least one"), "{err}");

    // TLS by default: a generated Secret with the CA, mounted whole, and the flags to read it.
    let docs = template(&helm, &[]).unwrap();
    let secret = docs
        .iter()
        .find(|d| d["kind"] == "Secret" && d["metadata"]["name"] == "pp-pod-proxier-tls")
        .expect("no TLS Secret by default");
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(
            secret["data"][key].as_str().is_some_and(|v| !v.is_empty()),
            "{key}"
        );
    }
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let args = serde_yaml_ng::to_string(&pod["containers"][0]["args"]).unwrap();
    assert!(
        args.contains("--tls-cert-file=/etc/pod-proxier/tls/tls.crt")
            && args.contains("--tls-key-file=/etc/pod-proxier/tls/tls.key")
            && !args.contains("--plain-http"),
        "{args}"
    );
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"],
        "pp-pod-proxier-tls"
    );
    // Probes stay plain HTTP on the health port; /metrics is HTTPS with a token on its own.
    assert_eq!(
        pod["containers"][0]["readinessProbe"]["httpGet"]["port"],
        "health"
    );
    assert!(
        args.contains("--health-addr=0.0.0.0:8081")
            && args.contains("--metrics-addr=0.0.0.0:8443")
            && args.contains("--metrics-secure=true"),
        "{args}"
    );
    assert!(
        docs.iter().any(|d| d["kind"] == "ClusterRole"
            && d["metadata"]["name"] == "pp-pod-proxier-metrics-reader"
            && d["rules"][0]["nonResourceURLs"][0] == "/metrics"),
        "no metrics-reader ClusterRole"
    );
    // Off: --plain-http and no Secret.
    let docs = template(&helm, &["tls.enabled=false"]).unwrap();
    assert!(!docs.iter().any(|d| d["kind"] == "Secret"));
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let args =
        serde_yaml_ng::to_string(&deployment["spec"]["template"]["spec"]["containers"][0]["args"])
            .unwrap();
    assert!(
        args.contains("--plain-http") && !args.contains("--tls-"),
        "{args}"
    );
    // cert-manager: a Certificate into the same Secret name, no generated Secret.
    let docs = template(&helm, &["tls.certManager.issuerRef.name=ca-issuer"]).unwrap();
    let cert = docs.iter().find(|d| d["kind"] == "Certificate").unwrap();
    assert_eq!(cert["spec"]["secretName"], "pp-pod-proxier-tls");
    assert_eq!(cert["spec"]["dnsNames"][2], "pp-pod-proxier.infra.svc");
    assert!(!docs.iter().any(|d| d["kind"] == "Secret"));
    // The user's own Secret: mounted, nothing generated.
    let docs = template(&helm, &["tls.secretName=mine"]).unwrap();
    assert!(
        !docs
            .iter()
            .any(|d| d["kind"] == "Secret" || d["kind"] == "Certificate")
    );

    // The HAProxy backend: the configuration is generated by the binary from the same flags.
    let docs = template(&helm, &["podProxier.backend=haproxy"]).unwrap();
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let init = &deployment["spec"]["template"]["spec"]["initContainers"][0]["args"];
    assert_eq!(init[0], "haproxy-config");
}
