//! Proves the test node: real Pods under kubelet and containerd, Services through kube-proxy,
//! CoreDNS, the controllers, ServiceAccount tokens and Pod Security. Needs root and
//! `cargo xtask envtest --node`; a missing piece fails with one line naming it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, DeleteParams, PostParams};
use netkit_testenv::ControlPlane;
use netkit_testenv::node::{self, check};
use serde_json::json;

async fn plane() -> &'static ControlPlane {
    match ControlPlane::shared_with_node().await {
        Ok(plane) => plane,
        Err(err) => panic!("{err}"),
    }
}

/// The steward release image from `cargo xtask image` (the directory `NETKIT_RELEASE_IMAGES`, else
/// `target/images` of the workspace).
fn release_image() -> (PathBuf, String) {
    let dir = std::env::var_os("NETKIT_RELEASE_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("target")
                .join("images")
        });
    let tarball = dir.join("steward-tcp-proxy.tar");
    let index = dir.join("steward-tcp-proxy").join("index.json");
    let Ok(text) = std::fs::read_to_string(&index) else {
        panic!(
            "the node tests run a release image: {} is missing (cargo xtask image steward-tcp-proxy)",
            index.display()
        );
    };
    let index: serde_json::Value = serde_json::from_str(&text).unwrap();
    let reference = index["manifests"][0]["annotations"]["io.containerd.image.name"]
        .as_str()
        .unwrap()
        .to_owned();
    (tarball, reference)
}

#[tokio::test]
async fn node_runs_workloads_services_dns_and_garbage_collection() {
    let plane = plane().await;
    for (step, took) in plane.node().unwrap().timings() {
        println!("node start {took:>8.1?}  {step}");
    }
    let (tarball, reference) = release_image();
    let steps = check::run(
        plane,
        check::ReleaseImage {
            tarball: &tarball,
            reference: &reference,
            program: "/steward-tcp-proxy",
        },
    )
    .await
    .unwrap_or_else(|err| {
        panic!(
            "{err}\n{}",
            plane.node().map(|n| n.log_tails(20)).unwrap_or_default()
        )
    });
    for step in &steps {
        println!("ok {:>8.1?}  {}", step.took, step.what);
    }
    // What each step proved, in order (a dropped or reordered step fails here, not only a
    // failing one inside the check).
    let whats: Vec<&str> = steps.iter().map(|s| s.what.as_str()).collect();
    let expected = [
        "node ",
        "Deployment rolled out: 2 Pods Running and Ready",
        "Job from ",
        "ClusterIP ",
        "NodePort ",
        "a Pod resolved kubernetes.default.svc.cluster.local and echo.",
        "Deployment deleted: its ReplicaSet and Pods garbage-collected",
    ];
    assert_eq!(whats.len(), expected.len(), "{whats:#?}");
    for (what, prefix) in whats.iter().zip(expected) {
        assert!(
            what.starts_with(prefix),
            "{what:?} should start with {prefix:?}"
        );
    }
    // The Job ran the release image of this workspace's steward, not a stale one.
    let version = format!(
        "Job from {reference} Complete: steward-tcp-proxy {}",
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(whats[2], version);
    // kube-proxy reached both Pods of the Deployment, by ClusterIP and by NodePort.
    let pods: Vec<&str> = whats[1]
        .split(['(', ')', ','])
        .filter_map(|part| part.split_whitespace().next())
        .filter(|name| name.starts_with("echo-"))
        .collect();
    assert_eq!(pods.len(), 2, "two echo Pods in {:?}", whats[1]);
    for routed in &whats[3..5] {
        for pod in &pods {
            assert!(routed.contains(pod), "{routed:?} does not name {pod}");
        }
    }
}

#[tokio::test]
async fn a_pods_service_account_token_authenticates_as_that_service_account() {
    let plane = plane().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("sa-token").await.unwrap();
    check::restrict_namespace(plane, &ns).await.unwrap();
    let role_name = format!("{ns}-list-namespaces");
    let roles: Api<ClusterRole> = Api::all(client.clone());
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": role_name },
                "rules": [{ "apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"] }],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": role_name },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name },
                "subjects": [{ "kind": "ServiceAccount", "name": "lister", "namespace": ns }],
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), &ns);
    sa.create(
        &PostParams::default(),
        &serde_json::from_value(json!({ "metadata": { "name": "lister" } })).unwrap(),
    )
    .await
    .unwrap();

    let mut job = check::job(
        "lister",
        node::TESTBOX_IMAGE,
        &["/testbox", "kube", "--list", "namespaces"],
    );
    job["spec"]["template"]["spec"]["serviceAccountName"] = json!("lister");
    let jobs: Api<k8s_openapi::api::batch::v1::Job> = Api::namespaced(client.clone(), &ns);
    jobs.create(
        &PostParams::default(),
        &serde_json::from_value(job).unwrap(),
    )
    .await
    .unwrap();
    let logs = check::wait_job_logs(plane, &ns, "lister").await.unwrap();
    assert!(
        logs.lines().any(|l| l.trim() == format!("namespace {ns}")),
        "the in-cluster client listed its own namespace: {logs}"
    );

    // The API server saw that list as the ServiceAccount, coming from a Pod address.
    let user = format!("system:serviceaccount:{ns}:lister");
    let events = plane.audit_events().unwrap();
    let lists: Vec<_> = events
        .iter()
        .filter(|e| e.user.username == user && e.verb == "list")
        .collect();
    assert!(!lists.is_empty(), "no list by {user} in the audit log");
    assert!(
        lists
            .iter()
            .all(|e| e.source_ips.iter().any(|ip| ip.starts_with("10.244."))),
        "the list came from a Pod IP: {lists:?}"
    );
    assert!(
        lists
            .iter()
            .all(|e| e.response_status.as_ref().is_some_and(|s| s.code == 200)),
        "{lists:?}"
    );
}

#[tokio::test]
async fn pod_security_restricted_refuses_a_privileged_pod_and_admits_the_workload() {
    let plane = plane().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("restricted").await.unwrap();
    check::restrict_namespace(plane, &ns).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let privileged: Pod = serde_json::from_value(json!({
        "metadata": { "name": "privileged" },
        "spec": { "containers": [{
            "name": "main", "image": node::TESTBOX_IMAGE, "imagePullPolicy": "Never",
            "args": ["serve"],
            "securityContext": { "privileged": true },
        }]},
    }))
    .unwrap();
    let refused = pods
        .create(&PostParams::default(), &privileged)
        .await
        .expect_err("a privileged Pod in a restricted namespace");
    match refused {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(
                status.message.contains("violates PodSecurity"),
                "{status:?}"
            );
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(pods.get_opt("privileged").await.unwrap().is_none());

    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client, &ns);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(check::testbox_deployment("workload", 1)).unwrap(),
        )
        .await
        .unwrap();
    let ready = check::wait_pods_ready(plane, &ns, "app=workload", 1)
        .await
        .unwrap();
    let ip = &ready[0].1;
    assert!(
        ip.starts_with("10.244.0."),
        "a Pod IP from the bridge: {ip}"
    );
    let body = check::http_get(format!("{ip}:8080").parse().unwrap(), "/")
        .await
        .unwrap();
    assert!(body.contains(&ready[0].0), "{body}");
    deployments
        .delete("workload", &DeleteParams::default())
        .await
        .unwrap();
}
