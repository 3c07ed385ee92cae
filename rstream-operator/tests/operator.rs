//! The operator against a real kube-apiserver (one per test binary): schema and CEL validation, the
//! manager's reconcile under its least-privilege identity, the agent's RBAC, and end to end with
//! both binaries as processes and LocalEngine as the engine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use k8s_reconcile::testing::Identity;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt as _};
use prometheus_client::registry::Registry;
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::manager::{self, ManagerOptions};
use rstream_operator::names;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// Runs the manager in this process as its ServiceAccount, scoped to `ns`.
async fn start_manager(client: Client, ns: &str) -> CancellationToken {
    let shutdown = CancellationToken::new();
    let options = ManagerOptions {
        agent_image: "example.test/rstream-operator:dev".into(),
        leader_election: None,
        resync: Duration::from_secs(300),
        concurrency: 4,
        namespace: Some(ns.to_owned()),
    };
    let metrics = ControllerMetrics::register(&mut Registry::default());
    tokio::spawn(manager::run(
        client,
        options,
        Health::new(),
        metrics,
        shutdown.clone(),
    ));
    shutdown
}

#[test]
fn crd_files_are_what_crds_serializes_to() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let bless = std::env::var("RSTREAM_OPERATOR_BLESS").is_ok_and(|v| v == "1");
    let files = rstream_operator::crd_files().unwrap();
    assert_eq!(files.len(), 2);
    for sub in rstream_operator::CRD_DIRS {
        for (name, yaml) in &files {
            let path = dir.join(sub).join(name);
            if bless {
                std::fs::write(&path, yaml).unwrap();
            }
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                &on_disk == yaml,
                "{} is stale; regenerate it (RSTREAM_OPERATOR_BLESS=1 cargo test -p rstream-operator crd_files)",
                path.display()
            );
        }
    }
}

#[tokio::test]
async fn invalid_objects_are_rejected_by_the_api_server_with_the_rule() {
    let plane = plane().await;
    let ns = plane.create_namespace("cel").await.unwrap();
    let client = plane.client().await.unwrap();
    let conns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<RstreamConnection>(&()),
    );
    let tuns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<RstreamTunnel>(&()),
    );
    let object = |kind: &str, name: &str, spec: serde_json::Value| -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": kind,
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap()
    };
    let token = serde_json::json!({"name": "creds", "key": "token"});
    let target = serde_json::json!({"service": {"name": "web", "port": "http"}});
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443"}),
            "exactly one of tokenSecretRef or mtls",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "mtls": {"certSecretRef": token, "keySecretRef": token}}),
            "exactly one of tokenSecretRef or mtls",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"tokenSecretRef": token}),
            "exactly one of projectEndpoint, projectID or engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "projectEndpoint": "p", "tokenSecretRef": token}),
            "exactly one of projectEndpoint, projectID or engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"projectEndpoint": "p",
            "mtls": {"certSecretRef": token, "keySecretRef": token}}),
            "need tokenSecretRef",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "region": "eu", "tokenSecretRef": token}),
            "region cannot be combined with engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "controlPlaneHeaders": [{"name": "x-team", "valueSecretRef": token}]}),
            "controlPlaneHeaders cannot be combined with engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"projectEndpoint": "p", "region": "-bad-", "tokenSecretRef": token}),
            "spec.region",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "", "tokenSecretRef": token}),
            "spec.engine",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "tcpPort": 10042}),
            "tcpPort requires protocol tcp",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "publish": false}),
            "protocol tcp requires publish",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "type": "datagram"}),
            "protocol tcp requires type bytestream",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "hostname": "a.example.com"}),
            "protocol tcp forbids hostname",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "tls": {"mode": "terminated"}}),
            "forbids the http and tls blocks",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tls", "http": {"version": "h2c"}}),
            "the http block requires protocol http",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "ftp"}),
            "spec.protocol",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "tcpPort": 70000}),
            "spec.tcpPort",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": {"service": {"name": "", "port": 80}}}),
            "spec.target.service.name",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"protocol": "http"}),
            "spec.target",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "agent": {"replicas": 2}}),
            "spec.agent.replicas",
        ),
    ];
    assert!(cases.len() >= 10);
    for (i, (kind, spec, expected)) in cases.into_iter().enumerate() {
        let api = if kind == "RstreamConnection" {
            &conns
        } else {
            &tuns
        };
        let err = api
            .create(
                &PostParams::default(),
                &object(kind, &format!("bad-{i}"), spec.clone()),
            )
            .await
            .expect_err(&format!("case {i} ({kind} {spec}) was accepted"));
        let kube::Error::Api(status) = err else {
            panic!("case {i}: unexpected error {err}");
        };
        assert_eq!(status.code, 422, "case {i}: {status:?}");
        assert!(
            status.message.contains(expected),
            "case {i} ({spec}): message {:?} does not name {expected:?}",
            status.message
        );
    }
    // Valid objects pass, with the schema defaults applied.
    let ok = conns
        .create(
            &PostParams::default(),
            &object(
                "RstreamConnection",
                "ok",
                serde_json::json!({"projectEndpoint": "p", "tokenSecretRef": token}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["apiURL"], "https://rstream.io");
    let ok = tuns
        .create(
            &PostParams::default(),
            &object(
                "RstreamTunnel",
                "ok",
                serde_json::json!({"target": target, "protocol": "tcp", "tcpPort": 10042}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["publish"], true);
    let ok = tuns
        .create(
            &PostParams::default(),
            &object(
                "RstreamTunnel",
                "web",
                serde_json::json!({"target": target, "http": {}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["protocol"], "http");
    assert_eq!(ok.data["spec"]["http"]["version"], "http/1.1");
}

/// Objects of one tunnel's children, by kind.
struct Children {
    configmap: Option<ConfigMap>,
    service_account: Option<ServiceAccount>,
    role: Option<Role>,
    binding: Option<RoleBinding>,
    deployment: Option<Deployment>,
}

async fn children(client: &Client, ns: &str, base: &str) -> Children {
    Children {
        configmap: Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get_opt(&format!("{base}-config"))
            .await
            .unwrap(),
        service_account: Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .get_opt(base)
            .await
            .unwrap(),
        role: Api::<Role>::namespaced(client.clone(), ns)
            .get_opt(base)
            .await
            .unwrap(),
        binding: Api::<RoleBinding>::namespaced(client.clone(), ns)
            .get_opt(base)
            .await
            .unwrap(),
        deployment: Api::<Deployment>::namespaced(client.clone(), ns)
            .get_opt(base)
            .await
            .unwrap(),
    }
}

fn hash_of(d: &Deployment) -> String {
    d.spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(names::CONFIG_HASH_ANNOTATION))
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn manager_resolves_applies_children_rotates_and_cleans_up_without_403() {
    let plane = plane().await;
    let ns = plane.create_namespace("mgr").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    let conns: Api<RstreamConnection> = Api::namespaced(admin.clone(), &ns);

    // A connection whose Secret does not exist yet.
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
    create(
        &admin,
        &ns,
        &tunnel(
            "web",
            serde_json::json!({
        "target": {"service": {"name": "web", "port": "http"}},
        "labels": {"app": "web"}, "http": {"auth": {"token": true}}}),
        ),
    )
    .await;
    let t = wait_condition(&tunnels, "web", "Resolved", "False", "SecretMissing", WAIT).await;
    assert_eq!(condition(&t, "Accepted").unwrap().1, "ConnectionMissing");
    assert_eq!(condition(&t, "Ready").unwrap().1, "ConnectionMissing");
    assert!(t.status.unwrap().last_error.unwrap().contains("creds"));
    wait_for("connection SecretMissing", WAIT, || async {
        let c = conns.get("default").await.ok()?;
        let ready = c
            .status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "Ready")?;
        (ready.status == "False" && ready.reason == "SecretMissing").then_some(())
    })
    .await;

    // The Secret appears: the connection becomes Ready, the tunnel moves on to its Service.
    create(&admin, &ns, &secret("creds", &[("token", "token-1")])).await;
    let c = wait_for("connection Ready", WAIT, || async {
        let c = conns.get("default").await.ok()?;
        let s = c.status.clone()?;
        s.conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(c)
    })
    .await;
    assert_eq!(c.status.unwrap().engine.as_deref(), Some("127.0.0.1:7443"));
    let t = wait_condition(&tunnels, "web", "Resolved", "False", "ServiceMissing", WAIT).await;
    assert_eq!(condition(&t, "Accepted").unwrap().0, "True");
    assert_eq!(condition(&t, "Ready").unwrap().1, "ServiceMissing");

    // A Service without that port, then with it.
    create(
        &admin,
        &ns,
        &service(
            "web",
            serde_json::json!([{"name": "metrics", "port": 9090}]),
        ),
    )
    .await;
    wait_condition(
        &tunnels,
        "web",
        "Resolved",
        "False",
        "ServicePortMissing",
        WAIT,
    )
    .await;
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(admin.clone(), &ns)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "spec": {"ports": [{"name": "http", "port": 8080}]}})),
        )
        .await
        .unwrap();
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let status = t.status.clone().unwrap();
    assert_eq!(condition(&t, "Resolved").unwrap().0, "True");
    assert_eq!(condition(&t, "AgentReady").unwrap().1, "DeploymentPending");
    assert_eq!(condition(&t, "TunnelReady").unwrap().1, "TunnelConnecting");
    assert_eq!(
        status.target.as_deref(),
        Some(format!("web.{ns}.svc:8080").as_str())
    );
    assert_eq!(
        status.rstream_name.as_deref(),
        Some(format!("{ns}-web").as_str())
    );
    assert!(status.last_error.is_none());
    assert!(t.finalizers().iter().any(|f| f == names::FINALIZER));

    // Children: owned by the tunnel, restricted, credentials only by reference.
    let base = names::base_name(&ns, "web", t.uid().as_deref());
    assert_eq!(status.agent_deployment.as_deref(), Some(base.as_str()));
    let kids = children(&admin, &ns, &base).await;
    let uid = t.uid().unwrap();
    let cm = kids.configmap.unwrap();
    let owners = [
        cm.owner_references(),
        kids.service_account.as_ref().unwrap().owner_references(),
        kids.role.as_ref().unwrap().owner_references(),
        kids.binding.as_ref().unwrap().owner_references(),
        kids.deployment.as_ref().unwrap().owner_references(),
    ];
    for refs in owners {
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].uid, uid);
        assert_eq!(refs[0].controller, Some(true));
        assert_eq!(refs[0].kind, "RstreamTunnel");
    }
    let config_yaml = cm.data.unwrap()[names::CONFIG_KEY].clone();
    assert!(
        !config_yaml.contains("token-1"),
        "the token leaked into the ConfigMap"
    );
    let config = AgentConfig::from_yaml(&config_yaml).unwrap();
    assert_eq!(config.connection.engine, "127.0.0.1:7443");
    assert_eq!(config.target.host, format!("web.{ns}.svc"));
    assert_eq!(config.target.port, "8080");
    assert_eq!(config.tunnel.labels["app"], "web");
    assert_eq!(
        config.tunnel.labels["rstream.managed-by"],
        "kubernetes-operator"
    );
    assert_eq!(
        config
            .tunnel
            .http
            .as_ref()
            .unwrap()
            .auth
            .as_ref()
            .unwrap()
            .token,
        Some(true)
    );
    let role = kids.role.unwrap();
    for rule in role.rules.as_ref().unwrap() {
        assert_eq!(
            rule.resource_names.as_deref(),
            Some(&["web".to_owned()][..])
        );
    }
    let d = kids.deployment.unwrap();
    assert_eq!(d.spec.replicas, Some(1));
    assert_eq!(
        d.spec.strategy.as_ref().unwrap().type_.as_deref(),
        Some("Recreate")
    );
    let pod = d.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(base.as_str()));
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.image.as_deref(),
        Some("example.test/rstream-operator:dev")
    );
    assert_eq!(
        c.command.as_deref(),
        Some(&["/rstream-agent".to_owned()][..])
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );
    let token_env = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == names::TOKEN_ENV)
        .unwrap();
    assert!(token_env.value.is_none());
    let sel = token_env
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    assert_eq!((sel.name.as_str(), sel.key.as_str()), ("creds", "token"));
    let first_hash = hash_of(&d);
    assert_eq!(first_hash.len(), 16);

    // Rotating the token restarts the agent (new config hash).
    Api::<Secret>::namespaced(admin.clone(), &ns)
        .replace(
            "creds",
            &PostParams::default(),
            &secret("creds", &[("token", "token-2")]),
        )
        .await
        .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    wait_for("a new config hash", WAIT, || async {
        let d = deployments.get(&base).await.ok()?;
        let h = hash_of(&d);
        (h != first_hash && !h.is_empty()).then_some(())
    })
    .await;

    // The Deployment becomes available and the agent reports the tunnel online: Ready.
    deployments
        .patch_status(
            &base,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
        )
        .await
        .unwrap();
    wait_condition(
        &tunnels,
        "web",
        "AgentReady",
        "True",
        "DeploymentAvailable",
        WAIT,
    )
    .await;

    // Deleting the tunnel: the manager deletes every child itself (no garbage collector runs
    // here) and then removes its finalizer.
    tunnels
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the tunnel to be gone", WAIT, || async {
        tunnels
            .get_opt("web")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let kids = children(&admin, &ns, &base).await;
    assert!(kids.configmap.is_none() && kids.service_account.is_none());
    assert!(kids.role.is_none() && kids.binding.is_none() && kids.deployment.is_none());

    stop.cancel();
    let forbidden = forbidden_requests(plane, &sa_user(&ns, MANAGER_SA)).await;
    assert!(
        forbidden.is_empty(),
        "the manager was denied: {forbidden:?}"
    );
}

#[tokio::test]
async fn invalid_specs_and_missing_connections_are_reported() {
    let plane = plane().await;
    let ns = plane.create_namespace("blocked").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);

    // No connection named "other".
    create(
        &admin,
        &ns,
        &tunnel(
            "orphan",
            serde_json::json!({
        "connectionRef": {"name": "other"}, "target": {"service": {"name": "web", "port": 80}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &tunnels,
        "orphan",
        "Accepted",
        "False",
        "ConnectionMissing",
        WAIT,
    )
    .await;
    assert!(condition(&t, "Accepted").unwrap().2.contains("other"));

    // Rules only the client knows: a private tunnel takes no public option.
    create(
        &admin,
        &ns,
        &tunnel(
            "private",
            serde_json::json!({
        "publish": false, "geoip": ["FR"], "target": {"service": {"name": "web", "port": 80}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &tunnels,
        "private",
        "Accepted",
        "False",
        "InvalidSpec",
        WAIT,
    )
    .await;
    assert_eq!(condition(&t, "Ready").unwrap().1, "InvalidSpec");
    assert!(
        t.status
            .unwrap()
            .last_error
            .unwrap()
            .contains("invalid spec")
    );

    stop.cancel();
    let forbidden = forbidden_requests(plane, &sa_user(&ns, MANAGER_SA)).await;
    assert!(
        forbidden.is_empty(),
        "the manager was denied: {forbidden:?}"
    );
}

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

/// A child process killed on drop (a failing test leaves nothing running).
struct Child(std::process::Child);

impl Child {
    fn spawn(cmd: &mut std::process::Command) -> Self {
        Self(cmd.spawn().unwrap())
    }

    /// SIGTERM, then waits for the exit; returns whether it exited successfully.
    async fn terminate(mut self) -> bool {
        let pid = self.0.id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status();
        for _ in 0..100 {
            if let Ok(Some(status)) = self.0.try_wait() {
                return status.success();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn end_to_end_with_both_binaries_and_local_engine() {
    use rstream_client::engine::LocalEngine;

    let plane = plane().await;
    let ns = plane.create_namespace("e2e").await.unwrap();
    let admin = plane.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("e2e-token")
        .start()
        .await
        .unwrap();
    let engine_addr = engine.addr();
    let identity_of_engine = engine.identity().clone();
    let ca = dir.path().join("engine-ca.pem");
    std::fs::write(&ca, engine.ca_pem()).unwrap();
    let backend = http_server("hello through rstream").await;

    create(
        &admin,
        &ns,
        &secret("rstream-credentials", &[("token", "e2e-token")]),
    )
    .await;
    create(
        &admin,
        &ns,
        &service(
            "http-server",
            serde_json::json!([{"name": "http", "port": 8080}]),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &connection(
            "default",
            serde_json::json!({
        "engine": engine.engine_address(),
        "tokenSecretRef": {"name": "rstream-credentials", "key": "token"}}),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &tunnel(
            "web",
            serde_json::json!({
        "target": {"service": {"name": "http-server", "port": "http"}},
        "publish": true, "protocol": "http", "http": {"version": "http/1.1"}}),
        ),
    )
    .await;

    // The manager, as a process, under its own ServiceAccount, with leader election.
    let manager_identity = manager_identity(plane, &ns, true).await;
    let manager_kubeconfig = plane.kubeconfig_as(&manager_identity).await.unwrap();
    let health = format!("127.0.0.1:{}", free_port());
    let manager = Child::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-operator"))
            .env("KUBECONFIG", &manager_kubeconfig)
            .env_remove("RUST_LOG")
            .args([
                "--namespace",
                &ns,
                "--leader-elect",
                "--leader-election-namespace",
                &ns,
                "--metrics-bind-address",
                "0",
                "--health-probe-bind-address",
                &health,
                "--agent-image",
                "example.test/rstream-operator:e2e",
                "--log-format",
                "text",
            ])
            .stdout(std::process::Stdio::null()),
    );
    wait_for("the manager to be ready", WAIT, || async {
        (http_status(&health, "/readyz").await == 200).then_some(())
    })
    .await;

    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = names::base_name(&ns, "web", t.uid().as_deref());

    // Run the agent as the Deployment would: its config from the ConfigMap, its token from the
    // Secret, its identity the ServiceAccount the manager created. Service DNS does not resolve
    // here, so its target is mapped to the local HTTP server.
    let cm = Api::<ConfigMap>::namespaced(admin.clone(), &ns)
        .get(&format!("{base}-config"))
        .await
        .unwrap();
    let config_path = dir.path().join("config.yaml");
    std::fs::write(&config_path, &cm.data.unwrap()[names::CONFIG_KEY]).unwrap();
    let agent_kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, &base))
        .await
        .unwrap();
    let agent_health = format!("127.0.0.1:{}", free_port());
    let agent_log = dir.path().join("agent.log");
    let agent = Child::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"))
            .env("KUBECONFIG", &agent_kubeconfig)
            .env_remove("RUST_LOG")
            .env(names::TOKEN_ENV, "e2e-token")
            .env(names::POD_NAME_ENV, "web-agent-0")
            .env(names::POD_NAMESPACE_ENV, &ns)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--health-bind-address={agent_health}"))
            .arg(format!("--target-override={backend}"))
            .arg(format!("--ca-file={}", ca.display()))
            .stdout(std::fs::File::create(&agent_log).unwrap()),
    );
    let t = wait_condition(&tunnels, "web", "TunnelReady", "True", "TunnelOnline", WAIT).await;
    let status = t.status.clone().unwrap();
    let tunnel_id = status.tunnel_id.clone().unwrap();
    assert!(
        condition(&t, "TunnelReady")
            .unwrap()
            .2
            .contains("web-agent-0")
    );
    let address = status.forwarding_address.clone().unwrap();
    assert!(address.starts_with("https://127.0.0.1:"), "{address}");
    assert_eq!(http_status(&agent_health, "/readyz").await, 200);

    // No kubelet: the test reports the Deployment available, as the readiness probe would.
    Api::<Deployment>::namespaced(admin.clone(), &ns)
        .patch_status(
            &base,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
        )
        .await
        .unwrap();
    wait_condition(&tunnels, "web", "Ready", "True", "Ready", WAIT).await;

    let ingress = engine.ingress_addr(&tunnel_id).unwrap();
    assert!(
        address.ends_with(&format!(":{}", ingress.port())),
        "{address} vs {ingress}"
    );
    let response = http_get(ingress).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("hello through rstream"), "{response}");

    // The engine goes away: the agent reports the disconnection and stops being ready.
    engine.shutdown().await;
    let t = wait_condition(
        &tunnels,
        "web",
        "TunnelReady",
        "False",
        "TunnelDisconnected",
        WAIT,
    )
    .await;
    assert!(
        !t.status
            .as_ref()
            .unwrap()
            .last_error
            .clone()
            .unwrap_or_default()
            .is_empty()
    );
    assert_eq!(condition(&t, "Ready").unwrap().0, "False");
    assert_eq!(http_status(&agent_health, "/readyz").await, 503);

    // It comes back on the same address: the agent reconnects and the tunnel is Ready again.
    let engine = LocalEngine::builder()
        .bind(engine_addr)
        .identity(identity_of_engine)
        .token("e2e-token")
        .start()
        .await
        .unwrap();
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "True",
        "Ready",
        Duration::from_secs(45),
    )
    .await;
    let status = t.status.unwrap();
    assert!(status.last_error.is_none());
    let ingress = engine
        .ingress_addr(status.tunnel_id.as_deref().unwrap())
        .unwrap();
    let response = http_get(ingress).await.unwrap();
    assert!(response.ends_with("hello through rstream"), "{response}");

    // Graceful shutdown on SIGTERM, and neither identity was ever denied.
    assert!(agent.terminate().await, "the agent did not exit cleanly");
    assert!(
        manager.terminate().await,
        "the manager did not exit cleanly"
    );
    let log = std::fs::read_to_string(&agent_log).unwrap();
    let online = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "Tunnel online")
        .unwrap_or_else(|| panic!("no JSON 'Tunnel online' line in the agent log:\n{log}"));
    assert_eq!(online["tunnel_id"], tunnel_id.as_str());
    assert!(
        online["forwarding_address"]
            .as_str()
            .unwrap()
            .starts_with("https://")
    );
    assert!(log.contains("Tunnel disconnected"), "{log}");
    for user in [sa_user(&ns, MANAGER_SA), sa_user(&ns, &base)] {
        let forbidden = forbidden_requests(plane, &user).await;
        assert!(forbidden.is_empty(), "{user} was denied: {forbidden:?}");
    }
    engine.shutdown().await;
}

fn helm() -> std::path::PathBuf {
    k8s_reconcile::testing::helm().unwrap()
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

use serde::Deserialize as _;

#[test]
fn chart_renders_the_tested_rbac_and_flags_the_manager_accepts() {
    let docs = render_chart(&[]);
    let find = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let rules = |v: &serde_json::Value| v["rules"].clone();
    let tested = serde_json::to_value(manager_cluster_role()).unwrap();
    assert_eq!(rules(find("ClusterRole")), rules(&tested));
    assert_eq!(
        find("ClusterRole")["metadata"]["name"],
        "rel-rstream-operator-manager-role"
    );
    let binding = find("ClusterRoleBinding");
    assert_eq!(binding["subjects"][0]["name"], "rel-rstream-operator");
    let le = serde_json::to_value(leader_election_role()).unwrap();
    assert_eq!(rules(find("Role")), rules(&le));

    let deployment = find("Deployment");
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

#[tokio::test]
async fn samples_are_accepted_by_the_api_server() {
    let plane = plane().await;
    let ns = plane.create_namespace("samples").await.unwrap();
    let client = plane.client().await.unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/samples");
    let mut created = 0;
    for file in [
        "tunnels_v1alpha1_rstreamconnection.yaml",
        "tunnels_v1alpha1_rstreamtunnel_http.yaml",
        "tunnels_v1alpha1_rstreamtunnel_tcp.yaml",
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let mut obj: DynamicObject = serde_yaml_ng::from_str(&text).unwrap();
        obj.metadata.namespace = Some(ns.clone());
        let kind = obj.types.as_ref().unwrap().kind.clone();
        let resource = if kind == "RstreamConnection" {
            ApiResource::erase::<RstreamConnection>(&())
        } else {
            ApiResource::erase::<RstreamTunnel>(&())
        };
        Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &resource)
            .create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        created += 1;
    }
    assert_eq!(created, 3);
}
