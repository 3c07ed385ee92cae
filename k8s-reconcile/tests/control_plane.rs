//! Proves the test control plane against the real kube-apiserver + etcd it starts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{CustomResource, CustomResourceExt as _, ResourceExt as _};
use netkit_testenv::{ControlPlane, Identity, KUBERNETES_VERSION};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[tokio::test]
async fn reports_the_built_kubernetes_version() {
    let plane = ControlPlane::shared().await.unwrap();
    let info = plane
        .client()
        .await
        .unwrap()
        .apiserver_version()
        .await
        .unwrap();
    assert_eq!(info.git_version, KUBERNETES_VERSION);
    assert_eq!(info.major, "1");
    assert_eq!(info.minor, "37");
}

#[tokio::test]
async fn configmap_create_get_list_watch_and_server_side_apply() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("configmaps").await.unwrap();
    let api: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);

    // Watch first, so the ADDED and MODIFIED events of what follows are seen.
    let list = api.list(&ListParams::default()).await.unwrap();
    assert!(list.items.is_empty(), "a fresh namespace has no ConfigMaps");
    let version = list.metadata.resource_version.unwrap();
    let mut events = api
        .watch(&WatchParams::default().timeout(20), &version)
        .await
        .unwrap()
        .boxed();

    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("settings".into());
    cm.data = Some([("mode".to_owned(), "a".to_owned())].into());
    api.create(&PostParams::default(), &cm).await.unwrap();
    let fetched = api.get("settings").await.unwrap();
    assert_eq!(fetched.data.unwrap()["mode"], "a");

    let listed = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);

    // Two field managers: each owns its own key, and neither removes the other's.
    let apply = |manager: &str, key: &str, value: &str| {
        let api = api.clone();
        let patch = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "settings" },
            "data": { key: value },
        });
        let params = PatchParams::apply(manager);
        async move { api.patch("settings", &params, &Patch::Apply(&patch)).await }
    };
    apply("first", "alpha", "1").await.unwrap();
    let applied = apply("second", "beta", "2").await.unwrap();
    let data = applied.data.unwrap();
    assert_eq!(data["alpha"], "1");
    assert_eq!(data["beta"], "2");
    let managers: Vec<String> = applied
        .metadata
        .managed_fields
        .unwrap()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    assert!(managers.contains(&"first".to_owned()), "{managers:?}");
    assert!(managers.contains(&"second".to_owned()), "{managers:?}");
    // A conflicting apply without force is refused by the server.
    let conflict = apply("second", "alpha", "other").await.unwrap_err();
    assert!(
        matches!(&conflict, kube::Error::Api(s) if s.code == 409),
        "{conflict}"
    );

    let mut seen = Vec::new();
    while seen.len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(30), events.try_next())
            .await
            .expect("watch events arrive")
            .unwrap()
            .expect("watch stream stays open");
        match event {
            WatchEvent::Added(cm) => seen.push(("added", cm.name_any())),
            WatchEvent::Modified(cm) => seen.push(("modified", cm.name_any())),
            other => panic!("unexpected watch event {other:?}"),
        }
    }
    assert_eq!(seen[0], ("added", "settings".to_owned()));
    assert_eq!(seen[1], ("modified", "settings".to_owned()));
}

/// A small custom resource with a status subresource.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq)]
#[kube(
    group = "testing.kube-netkit.io",
    version = "v1",
    kind = "Widget",
    namespaced,
    status = "WidgetStatus"
)]
struct WidgetSpec {
    size: u32,
}

#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema, PartialEq)]
struct WidgetStatus {
    ready: bool,
}

#[tokio::test]
async fn crd_with_status_subresource_round_trips() {
    let plane = ControlPlane::shared().await.unwrap();
    plane.install_crds(&[Widget::crd()]).await.unwrap();
    // Installing again is harmless (server-side apply).
    plane.install_crds(&[Widget::crd()]).await.unwrap();
    let ns = plane.create_namespace("widgets").await.unwrap();
    let api: Api<Widget> = Api::namespaced(plane.client().await.unwrap(), &ns);

    let mut widget = Widget::new("w", WidgetSpec { size: 3 });
    widget.status = Some(WidgetStatus { ready: true });
    let created = api.create(&PostParams::default(), &widget).await.unwrap();
    assert_eq!(created.spec.size, 3);
    // The status subresource ignores status on create...
    assert_eq!(created.status, None);

    // ...and the main resource ignores status on update; only /status writes it.
    let status = serde_json::json!({ "status": { "ready": true } });
    api.patch_status("w", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let fetched = api.get("w").await.unwrap();
    assert_eq!(fetched.status, Some(WidgetStatus { ready: true }));
    assert_eq!(fetched.spec, WidgetSpec { size: 3 });

    // Schema validation is the server's: a string where an integer belongs is rejected.
    let bad: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "testing.kube-netkit.io/v1", "kind": "Widget",
        "metadata": { "name": "bad" }, "spec": { "size": "large" },
    }))
    .unwrap();
    let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(
        plane.client().await.unwrap(),
        &ns,
        &kube::api::ApiResource::erase::<Widget>(&()),
    );
    let err = dynamic
        .create(&PostParams::default(), &bad)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains("spec.size")),
        "{err}"
    );
}

#[tokio::test]
async fn rbac_denies_an_unbound_user_until_bound() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("rbac").await.unwrap();
    let admin = plane.client().await.unwrap();
    let alice = plane.client_as(&Identity::user("alice")).await.unwrap();
    let as_alice: Api<ConfigMap> = Api::namespaced(alice, &ns);

    let err = as_alice.list(&ListParams::default()).await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err}"
    );

    let role = Role {
        metadata: named("read-configmaps"),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".into()]),
            verbs: vec!["list".into()],
            ..PolicyRule::default()
        }]),
    };
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: named("alice-reads"),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "read-configmaps".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "alice".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(admin, &ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();

    // The RBAC authorizer learns of new bindings through its informer: allow it a moment.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match as_alice.list(&ListParams::default()).await {
            Ok(list) => {
                assert!(list.items.is_empty());
                break;
            }
            Err(kube::Error::Api(s)) if s.code == 403 && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("still refused after binding: {err}"),
        }
    }
    // The binding granted list, nothing more.
    let err = as_alice.get("anything").await.unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403),
        "{err}"
    );
}

#[tokio::test]
async fn service_account_identity_uses_a_real_token() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("sa").await.unwrap();
    let identity = Identity::service_account(&ns, "robot");
    let client = plane.client_as(&identity).await.unwrap();
    let err = Api::<ConfigMap>::namespaced(client, &ns)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    // The server names the ServiceAccount user in its refusal: the token was accepted as it.
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 403);
            assert!(
                status
                    .message
                    .contains(&format!("system:serviceaccount:{ns}:robot")),
                "{}",
                status.message
            );
        }
        other => panic!("expected 403, got {other}"),
    }
    let kubeconfig = plane.kubeconfig_as(&identity).await.unwrap();
    let text = std::fs::read_to_string(kubeconfig).unwrap();
    assert!(text.contains("\"token\""));
}

#[tokio::test]
async fn kubernetes_service_and_its_endpointslice_exist() {
    let plane = ControlPlane::shared().await.unwrap();
    let client = plane.client().await.unwrap();
    let svc = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await
        .unwrap();
    assert_eq!(svc.spec.unwrap().cluster_ip.as_deref(), Some("10.0.0.1"));
    // The API server's own endpoint reconciler writes the slice shortly after start.
    let slices: Api<EndpointSlice> = Api::namespaced(client, "default");
    let deadline = Instant::now() + Duration::from_secs(30);
    let slice = loop {
        match slices.get_opt("kubernetes").await.unwrap() {
            Some(slice) => break slice,
            None if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            None => panic!("the kubernetes EndpointSlice never appeared"),
        }
    };
    let endpoints = slice.endpoints.unwrap_or_default();
    // The API server advertises the host's address (loopback is refused for that role).
    assert_eq!(endpoints.len(), 1);
    assert_eq!(endpoints[0].addresses.len(), 1);
    assert!(
        endpoints[0].addresses[0]
            .parse::<std::net::IpAddr>()
            .is_ok()
    );
    let port = plane
        .server_url()
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<i32>()
        .unwrap();
    assert_eq!(slice.ports.unwrap()[0].port, Some(port));
}

#[tokio::test]
async fn kubeconfig_file_works_for_kubectl_style_loading() {
    let plane = ControlPlane::shared().await.unwrap();
    let text = std::fs::read_to_string(plane.kubeconfig_path()).unwrap();
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let info = client.apiserver_version().await.unwrap();
    assert_eq!(info.git_version, KUBERNETES_VERSION);
}

/// Run as a child process by `no_process_outlives_the_test_binary`; as a normal test it checks that
/// the servers run while the shared control plane exists.
#[tokio::test]
async fn probe_child() {
    let plane = ControlPlane::shared().await.unwrap();
    let pids = plane.pids();
    assert_eq!(pids.len(), 2);
    for pid in &pids {
        assert!(process_alive(*pid), "server {pid} should be running");
    }
    println!(
        "PROBE pids={} dir={}",
        pids.iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        plane.dir().display()
    );
    if std::env::var("PROBE_PANIC").is_ok() {
        panic!("probe panics on purpose");
    }
}

#[tokio::test]
async fn no_process_outlives_the_test_binary() {
    for (mode, panics) in [("normal exit", false), ("panic", true)] {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "probe_child", "--nocapture"]);
        if panics {
            cmd.env("PROBE_PANIC", "1");
        }
        let output = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .unwrap()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.success(),
            !panics,
            "{mode}: {stdout}\nstderr:\n{stderr}"
        );
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("PROBE "))
            .unwrap_or_else(|| panic!("{mode}: no PROBE line in {stdout}"));
        let (pids, dir) = line.split_once(" dir=").unwrap();
        let pids: Vec<u32> = pids
            .trim_start_matches("pids=")
            .split(',')
            .map(|p| p.parse().unwrap())
            .collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while (pids.iter().any(|p| process_alive(*p)) || std::path::Path::new(dir).exists())
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for pid in &pids {
            assert!(
                !process_alive(*pid),
                "{mode}: server {pid} outlived its test binary"
            );
        }
        assert!(
            !std::path::Path::new(dir).exists(),
            "{mode}: {dir} was left behind"
        );
    }
}

fn process_alive(pid: u32) -> bool {
    // A zombie has exited; only its parent's wait is missing.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn named(name: &str) -> kube::api::ObjectMeta {
    kube::api::ObjectMeta {
        name: Some(name.to_owned()),
        ..Default::default()
    }
}
