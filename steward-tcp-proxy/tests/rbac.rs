//! steward under the chart's RBAC and the original's narrower ClusterRole: what it may do, and
//! that a forbidden write is tried once, not in a loop.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Endpoints;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, Patch, PatchParams, PostParams};
use netkit_testenv::{Identity, eventually};

mod support;

use support::*;

#[tokio::test]
async fn runs_under_the_charts_rbac_alone() {
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-rbac").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();

    // Render the chart's RBAC exactly as a user would install it, and bind nothing else.
    let rendered = helm_template(&ns, &apiserver_addr(plane));
    let mut applied = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        let kind = value["kind"].as_str().unwrap_or_default().to_owned();
        let namespace = value["metadata"]["namespace"]
            .as_str()
            .unwrap_or(&ns)
            .to_owned();
        let params = PatchParams::apply("test").force();
        let name = value["metadata"]["name"].as_str().unwrap().to_owned();
        match kind.as_str() {
            "Role" => {
                let role: Role = serde_json::from_value(value).unwrap();
                Api::<Role>::namespaced(client.clone(), &namespace)
                    .patch(&name, &params, &Patch::Apply(&role))
                    .await
                    .unwrap();
            }
            "RoleBinding" => {
                let binding: RoleBinding = serde_json::from_value(value).unwrap();
                Api::<RoleBinding>::namespaced(client.clone(), &namespace)
                    .patch(&name, &params, &Patch::Apply(&binding))
                    .await
                    .unwrap();
            }
            "ServiceAccount" => {}
            other => panic!("unexpected {other} in the RBAC templates"),
        }
        applied += 1;
    }
    assert_eq!(applied, 5, "ServiceAccount, 2 Roles, 2 RoleBindings");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--leader-elect",
            "--identity=rbac-test",
            // No resync within the test: the repair below can only come from the watch.
            "--reconcile-interval=1h",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually(
        "slice written under the chart's RBAC",
        Duration::from_secs(30),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    // The Lease was taken, and a drift is still repaired (watch permissions work).
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns)
        .get("proxy")
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("rbac-test")
    );
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let before_edit = reconciles(&proxy).await;
    let edited = Instant::now();
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": ["10.0.0.77"]}]})),
        )
        .await
        .unwrap();
    eventually(
        "drift repaired under RBAC",
        Duration::from_secs(30),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    eprintln!("drift repaired {:?} after the edit", edited.elapsed());
    // Settled: the repair's reconcile and the one its own write triggers have ended (polled,
    // not a guessed sleep), so any request they made is in the audit log below.
    let settled = Instant::now();
    while reconciles(&proxy).await < before_edit + 2 {
        assert!(
            settled.elapsed() < Duration::from_secs(30),
            "fewer than two reconciles after the edit in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Counted where no refusal can hide: the API server's audit log for steward's user.
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let requests = plane.requests_by(&user).await.unwrap();
    let forbidden: Vec<_> = requests
        .iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(!requests.is_empty(), "no request by {user} audited");
    assert!(
        forbidden.is_empty(),
        "the chart's RBAC is missing something: {forbidden:?}\n{}",
        proxy.logs()
    );
}

fn helm_template(ns: &str, upstream: &str) -> String {
    let helm = netkit_testenv::helm().unwrap();
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("chart");
    netkit_testenv::fixtures::stdout_of(
        Command::new(helm)
            .args(["template", "steward-tcp-proxy"])
            .arg(&chart)
            .args(["--namespace", ns])
            .arg(format!("--set=upstreamAddr={upstream}"))
            .args(["--set=serviceName=proxy", "--set=endpointMode=cluster-ip"])
            .args(["--show-only", "templates/serviceaccount.yaml"])
            .args(["--show-only", "templates/rbac.yaml"]),
    )
    .unwrap()
}

/// The original's ClusterRole (Steward's `steward:tcp-proxy`): EndpointSlices, Services, Leases
/// and core Events, but no Endpoints and no `events.k8s.io`.
fn originals_cluster_role(name: &str) -> k8s_openapi::api::rbac::v1::ClusterRole {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["get", "list", "watch", "create", "update", "patch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }))
    .unwrap()
}

#[tokio::test]
async fn under_the_originals_narrower_cluster_role_the_slice_is_managed_without_403s() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-narrow").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
    let role_name = format!("steward-tcp-proxy-{ns}");
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &originals_cluster_role(&role_name))
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "steward-tcp-proxy", "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    // A stale slice of the kubernetes Service, which the full role would prune: the narrow one
    // has no delete, so it must be left alone, not tried.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let stale: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubernetes-stale", "labels": {
            "kubernetes.io/service-name": "kubernetes",
            "endpointslice.kubernetes.io/managed-by": "steward-tcp-proxy"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.0.0.99"]}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }))
    .unwrap();
    slices.create(&PostParams::default(), &stale).await.unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--reconcile-interval=1s",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually(
        "slice written under the narrow role",
        Duration::from_secs(30),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    // Drift is still repaired, several times over (and the 1 s resync reconciles all along).
    for n in 0..3 {
        slices
            .patch(
                "kubernetes",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": [format!("10.0.0.{}", 80 + n)]}]})),
            )
            .await
            .unwrap();
        eventually(
            "drift repaired under the narrow role",
            Duration::from_secs(30),
            || async { published(&client).await.as_ref() == Some(&expected) },
        )
        .await;
    }
    // A window of several reconciles, counted (bounded), not a guessed sleep.
    wait_reconciles(&proxy, 3).await;

    // Ready, and /readyz and the metric name what is missing.
    let (code, body) = proxy.readyz().await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains(r#"missing permission patch endpoints "kubernetes" in namespace "default""#),
        "{body}"
    );
    let metrics = proxy.metrics_text().await;
    for line in [
        r#"steward_missing_permission{verb="patch",resource="endpoints",namespace="default"} 1"#,
        r#"steward_missing_permission{verb="delete",resource="endpointslices.discovery.k8s.io",namespace="default"} 1"#,
        &format!(
            r#"steward_missing_permission{{verb="create",resource="events.events.k8s.io",namespace="{ns}"}} 1"#
        ),
    ] {
        assert!(metric_line(&metrics, line), "{line} not in\n{metrics}");
    }
    // One warning per missing permission, however many reconciles ran.
    let logs = proxy.logs();
    let warnings = logs
        .matches(r#"missing RBAC permission: patch endpoints "kubernetes""#)
        .count();
    assert_eq!(warnings, 1, "{logs}");
    // And the API server refused steward nothing: what is missing was asked, not tried.
    plane.writes_by(&user).await.unwrap(); // waits until the audit log has caught up
    let forbidden: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(forbidden.len() <= 1, "403s for steward: {forbidden:?}");
    eprintln!("forbidden requests by steward under the narrow role: {forbidden:?}");
    let deletes: Vec<_> = plane
        .requests_by(&user)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.verb == "delete")
        .map(|e| e.request_uri)
        .collect();
    assert!(deletes.is_empty(), "steward tried deletes: {deletes:?}");
    assert!(
        slices.get_opt("kubernetes-stale").await.unwrap().is_some(),
        "the stale slice went"
    );
    slices
        .delete("kubernetes-stale", &Default::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_forbidden_endpoints_write_closes_the_gate_after_one_403() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-403").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
    // The original's role plus get/patch/list/watch of the kubernetes Endpoints, but not create:
    // asking says the write is allowed, and with the object gone the write is a create, refused.
    let role_name = format!("steward-tcp-proxy-{ns}");
    let mut role = originals_cluster_role(&role_name);
    role.rules.get_or_insert_default().push(
        serde_json::from_value(serde_json::json!({
            "apiGroups": [""], "resources": ["endpoints"], "resourceNames": ["kubernetes"],
            "verbs": ["get", "patch", "list", "watch"],
        }))
        .unwrap(),
    );
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "steward-tcp-proxy", "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let _ = Api::<Endpoints>::namespaced(client.clone(), "default")
        .delete("kubernetes", &Default::default())
        .await;
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--reconcile-interval=1s",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually("slice written", Duration::from_secs(30), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;
    // Many reconciles (1 s resync, and a drift repair).
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": ["10.0.0.90"]}]})),
        )
        .await
        .unwrap();
    eventually("drift repaired", Duration::from_secs(30), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;
    wait_reconciles(&proxy, 4).await;
    let (code, body) = proxy.readyz().await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains(r#"missing permission create endpoints "kubernetes" in namespace "default""#),
        "{body}"
    );
    plane.writes_by(&user).await.unwrap();
    let forbidden: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert_eq!(
        forbidden.len(),
        1,
        "one refused write, then none: {forbidden:?}"
    );
    let logs = proxy.logs();
    assert_eq!(
        logs.matches("missing RBAC permission: create endpoints")
            .count(),
        1,
        "{logs}"
    );
}

/// steward's successful reconciles so far, from its metrics.
async fn reconciles(proxy: &Proxy) -> u64 {
    proxy
        .metrics_text()
        .await
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && l.starts_with("controller_runtime_reconcile_total{")
                && l.contains(r#"result="success""#)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits (at most 30 s) until steward has reconciled `n` more times: the window of a "however
/// many reconciles ran" check, counted instead of slept.
async fn wait_reconciles(proxy: &Proxy, n: u64) {
    let from = reconciles(proxy).await;
    let started = Instant::now();
    loop {
        let now = reconciles(proxy).await;
        if now >= from + n {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "only {} of {n} reconciles in 30 s (controller_runtime_reconcile_total {from} -> {now})",
            now - from
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
