//! RBAC against a real kube-apiserver (one per test binary): the agent's identity patches only its
//! own tunnel's status; the chart renders the RBAC the tests grant and flags the manager accepts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use netkit_testenv::Identity;
use rstream_operator::api::RstreamTunnel;
use rstream_operator::names;
use serde::Deserialize as _;

#[tokio::test]
async fn agent_identity_can_patch_only_its_own_tunnel_status() {
    let plane = plane().await;
    let ns = plane.create_namespace("agentrbac").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);

    create(&admin, &ns, &secret("creds", &[("token", "t")])).await;
    create(
        &admin,
        &ns,
        &service("web", serde_json::json!([{"name": "http", "port": 80}])),
    )
    .await;
    create(
        &admin,
        &ns,
        &connection(
            "default",
            serde_json::json!({
        "engine": "127.0.0.1:7443", "tokenSecretRef": {"name": "creds", "key": "token"}}),
        ),
    )
    .await;
    for name in ["a", "b"] {
        create(
            &admin,
            &ns,
            &tunnel(
                name,
                serde_json::json!({
            "target": {"service": {"name": "web", "port": "http"}}}),
            ),
        )
        .await;
    }
    let a = wait_condition(
        &tunnels,
        "a",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    wait_condition(
        &tunnels,
        "b",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base_a = names::base_name(&ns, "a", a.uid().as_deref());

    let agent = plane
        .client_as(&Identity::service_account(&ns, &base_a))
        .await
        .unwrap();
    let as_agent: Api<RstreamTunnel> = Api::namespaced(agent, &ns);
    let patch = Patch::Merge(serde_json::json!({"status": {"tunnelID": "tun_1"}}));
    as_agent.get("a").await.unwrap();
    as_agent
        .patch_status("a", &PatchParams::default(), &patch)
        .await
        .unwrap();
    assert_eq!(
        tunnels
            .get("a")
            .await
            .unwrap()
            .status
            .unwrap()
            .tunnel_id
            .as_deref(),
        Some("tun_1")
    );
    for denied in [
        as_agent
            .patch_status("b", &PatchParams::default(), &patch)
            .await
            .err(),
        as_agent.get("b").await.err(),
        as_agent
            .patch(
                "a",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"publish": false}})),
            )
            .await
            .err(),
        as_agent.list(&Default::default()).await.err(),
    ] {
        match denied {
            Some(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
            other => panic!("expected 403, got {other:?}"),
        }
    }
    stop.cancel();
}

fn helm() -> std::path::PathBuf {
    netkit_testenv::helm().unwrap()
}

fn render_chart(extra: &[&str]) -> Vec<serde_json::Value> {
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("chart");
    let out = std::process::Command::new(helm())
        .args(["template", "rel"])
        .arg(&chart)
        .args(["--namespace", "rstream-system", "--kube-version", "1.37.0"])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .filter_map(|doc| serde_json::Value::deserialize(doc).ok())
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn chart_renders_the_tested_rbac_and_flags_the_manager_accepts() {
    let docs = render_chart(&[]);
    // The manager's role and its binding, by name: the chart also ships the metrics roles.
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    let find_kind = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let rules = |v: &serde_json::Value| v["rules"].clone();
    let tested = serde_json::to_value(manager_cluster_role()).unwrap();
    let manager_role = "rel-rstream-operator-manager-role";
    assert_eq!(rules(find("ClusterRole", manager_role)), rules(&tested));
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRoleBinding" && d["roleRef"]["name"] == manager_role)
        .expect("no ClusterRoleBinding of the manager role");
    assert_eq!(binding["subjects"][0]["name"], "rel-rstream-operator");
    let le = serde_json::to_value(leader_election_role()).unwrap();
    assert_eq!(rules(find_kind("Role")), rules(&le));

    let deployment = find_kind("Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "rel-rstream-operator");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let container = &pod["containers"][0];
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        container["securityContext"]["capabilities"]["drop"][0],
        "ALL"
    );
    let args: Vec<String> = serde_json::from_value(container["args"].clone()).unwrap();
    assert!(args.contains(&"--leader-elect".to_owned()), "{args:?}");
    assert!(
        args.contains(&"--agent-image=ghcr.io/kube-netkit/rstream-operator:0.1.0".to_owned()),
        "{args:?}"
    );
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_rstream-operator"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for arg in &args {
        let flag = arg.split('=').next().unwrap();
        assert!(help.contains(flag), "the manager does not accept {flag}");
    }

    // Without leader election: no Role and no flag; a separate agent image.
    let docs = render_chart(&[
        "--set",
        "leaderElection.enabled=false",
        "--set",
        "agent.image.repository=example.test/agent",
        "--set",
        "agent.image.tag=v9",
    ]);
    assert!(!docs.iter().any(|d| d["kind"] == "Role"));
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let args: Vec<String> = serde_json::from_value(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"].clone(),
    )
    .unwrap();
    assert!(!args.contains(&"--leader-elect".to_owned()));
    assert!(
        args.contains(&"--agent-image=example.test/agent:v9".to_owned()),
        "{args:?}"
    );
}
