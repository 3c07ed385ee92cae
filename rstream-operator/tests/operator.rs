//! The operator against a real kube-apiserver (one per test binary): schema and CEL validation, the
//! manager's reconcile under its least-privilege identity, the agent's RBAC, and end to end with
//! both binaries as processes and LocalEngine as the engine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use proxy_core::testing::KillOnDrop;
use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_reconcile::testing::Identity;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use kube::{Client, ResourceExt as _};
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::names;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

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

/// The CRDs' objects as dynamic objects, so invalid ones reach the API server unchanged.
struct CrdApis {
    conns: Api<DynamicObject>,
    tuns: Api<DynamicObject>,
}

async fn crd_apis(prefix: &str) -> CrdApis {
    let plane = plane().await;
    let ns = plane.create_namespace(prefix).await.unwrap();
    let client = plane.client().await.unwrap();
    CrdApis {
        conns: Api::namespaced_with(
            client.clone(),
            &ns,
            &ApiResource::erase::<RstreamConnection>(&()),
        ),
        tuns: Api::namespaced_with(client, &ns, &ApiResource::erase::<RstreamTunnel>(&())),
    }
}

fn object(kind: &str, name: &str, spec: serde_json::Value) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": kind,
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

/// Invalid specs, each with the kind and the part of the message that names its rule.
fn invalid_specs() -> Vec<(&'static str, serde_json::Value, &'static str)> {
    let token = serde_json::json!({"name": "creds", "key": "token"});
    let target = serde_json::json!({"service": {"name": "web", "port": "http"}});
    vec![
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
    ]
}

/// Creates every invalid spec of `kind` and checks the API server refuses it, naming the rule.
async fn assert_invalid_specs_rejected(kind: &str) {
    let apis = crd_apis("cel").await;
    let api = if kind == "RstreamConnection" {
        &apis.conns
    } else {
        &apis.tuns
    };
    let cases: Vec<_> = invalid_specs()
        .into_iter()
        .filter(|(k, _, _)| *k == kind)
        .collect();
    assert!(cases.len() >= 5, "{kind}: {} cases", cases.len());
    for (i, (kind, spec, expected)) in cases.into_iter().enumerate() {
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
}

#[tokio::test]
async fn invalid_connections_are_rejected_by_the_api_server_with_the_rule() {
    assert_invalid_specs_rejected("RstreamConnection").await;
}

#[tokio::test]
async fn invalid_tunnels_are_rejected_by_the_api_server_with_the_rule() {
    assert_invalid_specs_rejected("RstreamTunnel").await;
}

#[tokio::test]
async fn valid_objects_pass_with_the_schema_defaults() {
    let CrdApis { conns, tuns } = crd_apis("defaults").await;
    let token = serde_json::json!({"name": "creds", "key": "token"});
    let target = serde_json::json!({"service": {"name": "web", "port": "http"}});
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

/// A namespace with the manager running in it as its ServiceAccount, and admin clients.
struct ManagerEnv {
    ns: String,
    admin: Client,
    tunnels: Api<RstreamTunnel>,
    conns: Api<RstreamConnection>,
    stop: CancellationToken,
}

async fn manager_env(prefix: &str) -> ManagerEnv {
    let plane = plane().await;
    let ns = plane.create_namespace(prefix).await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    ManagerEnv {
        tunnels: Api::namespaced(admin.clone(), &ns),
        conns: Api::namespaced(admin.clone(), &ns),
        ns,
        admin,
        stop,
    }
}

impl ManagerEnv {
    /// Stops the manager and checks the API server never denied it anything.
    async fn finish_without_403(self) {
        self.stop.cancel();
        let forbidden = forbidden_requests(plane().await, &sa_user(&self.ns, MANAGER_SA)).await;
        assert!(
            forbidden.is_empty(),
            "the manager was denied: {forbidden:?}"
        );
    }

    async fn create_connection(&self) {
        create(
            &self.admin,
            &self.ns,
            &connection(
                "default",
                serde_json::json!({
            "engine": "127.0.0.1:7443", "tokenSecretRef": {"name": "creds", "key": "token"}}),
            ),
        )
        .await;
    }

    async fn create_tunnel(&self) {
        create(
            &self.admin,
            &self.ns,
            &tunnel(
                "web",
                serde_json::json!({
            "target": {"service": {"name": "web", "port": "http"}},
            "labels": {"app": "web"}, "http": {"auth": {"token": true}}}),
            ),
        )
        .await;
    }

    /// The `web` tunnel with its Secret, connection and Service in place, once it waits for its
    /// agent Deployment; returns it and the base name of its children.
    async fn resolved_tunnel(&self) -> (RstreamTunnel, String) {
        create(
            &self.admin,
            &self.ns,
            &secret("creds", &[("token", "token-1")]),
        )
        .await;
        self.create_connection().await;
        let ports = serde_json::json!([{"name": "http", "port": 8080}]);
        create(&self.admin, &self.ns, &service("web", ports)).await;
        self.create_tunnel().await;
        let t = wait_condition(
            &self.tunnels,
            "web",
            "Ready",
            "False",
            "WaitingForDeployment",
            WAIT,
        )
        .await;
        let base = names::base_name(&self.ns, "web", t.uid().as_deref());
        (t, base)
    }
}

#[tokio::test]
async fn tunnel_conditions_name_each_missing_piece_until_only_the_agent_is_missing() {
    let env = manager_env("resolve").await;
    let (admin, ns) = (env.admin.clone(), env.ns.clone());
    let (tunnels, conns) = (env.tunnels.clone(), env.conns.clone());

    // A connection whose Secret does not exist yet.
    env.create_connection().await;
    env.create_tunnel().await;
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

    env.finish_without_403().await;
}

#[tokio::test]
async fn children_are_owned_restricted_and_get_credentials_by_reference() {
    let env = manager_env("children").await;
    let (t, base) = env.resolved_tunnel().await;
    let status = t.status.clone().unwrap();
    assert_eq!(status.agent_deployment.as_deref(), Some(base.as_str()));
    let kids = children(&env.admin, &env.ns, &base).await;
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
    assert_eq!(config.target.host, format!("web.{}.svc", env.ns));
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
    assert_eq!(hash_of(&d).len(), 16);
    env.finish_without_403().await;
}

#[tokio::test]
async fn rotating_the_token_restarts_the_agent() {
    let env = manager_env("rotate").await;
    let (_, base) = env.resolved_tunnel().await;
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), &env.ns);
    let first_hash = hash_of(&deployments.get(&base).await.unwrap());
    Api::<Secret>::namespaced(env.admin.clone(), &env.ns)
        .replace(
            "creds",
            &PostParams::default(),
            &secret("creds", &[("token", "token-2")]),
        )
        .await
        .unwrap();
    wait_for("a new config hash", WAIT, || async {
        let d = deployments.get(&base).await.ok()?;
        let h = hash_of(&d);
        (h != first_hash && !h.is_empty()).then_some(())
    })
    .await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn an_available_agent_deployment_makes_the_agent_ready() {
    let env = manager_env("available").await;
    let (_, base) = env.resolved_tunnel().await;
    // No kubelet here: the test reports the Deployment available, as its controller would.
    Api::<Deployment>::namespaced(env.admin.clone(), &env.ns)
        .patch_status(
            &base,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
        )
        .await
        .unwrap();
    wait_condition(
        &env.tunnels,
        "web",
        "AgentReady",
        "True",
        "DeploymentAvailable",
        WAIT,
    )
    .await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn deleting_a_tunnel_deletes_its_children_before_the_finalizer_goes() {
    let env = manager_env("delete").await;
    let (_, base) = env.resolved_tunnel().await;
    let tunnels = &env.tunnels;
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
    let kids = children(&env.admin, &env.ns, &base).await;
    assert!(kids.configmap.is_none() && kids.service_account.is_none());
    assert!(kids.role.is_none() && kids.binding.is_none() && kids.deployment.is_none());

    env.finish_without_403().await;
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

/// Every transport option the agent cannot honour, with the field its refusal must name.
fn refused_transports() -> Vec<(serde_json::Value, &'static str)> {
    use serde_json::json;
    vec![
        (json!({"mode": "quic"}), "transport.mode"),
        (json!({"useQuic": true}), "transport.useQuic"),
        (
            json!({"bind": {"address": "eth0"}}),
            "transport.bind.address",
        ),
        (
            json!({"ipFamily": "ipv4", "bind": {"address": "fd00::1"}}),
            "transport.bind.address",
        ),
        (
            json!({"bind": {"mode": "interface", "interface": "eth0"}}),
            "transport.bind.interface",
        ),
        (
            json!({"dns": {"override": "10.0.0.53"}}),
            "transport.dns.override",
        ),
        (json!({"dns": {"tls": true}}), "transport.dns.tls"),
        (json!({"dns": {"dnssec": true}}), "transport.dns.dnssec"),
        (json!({"mptcp": true}), "transport.mptcp"),
        (json!({"proxy": {}}), "transport.proxy.http"),
        (
            json!({"proxy": {"http": "https://proxy.internal:3128"}}),
            "transport.proxy.http",
        ),
        (
            json!({"proxy": {"http": "http://proxy.internal:3128", "headers": {"Host": "x"}}}),
            "transport.proxy.headers",
        ),
    ]
}

#[tokio::test]
async fn transport_options_the_agent_cannot_honour_are_refused_by_name() {
    let env = manager_env("refused").await;
    create(
        &env.admin,
        &env.ns,
        &secret("creds", &[("token", "token-1")]),
    )
    .await;
    let ports = serde_json::json!([{"name": "http", "port": 8080}]);
    create(&env.admin, &env.ns, &service("web", ports)).await;
    let cases = refused_transports();
    for (i, (transport, _)) in cases.iter().enumerate() {
        create(
            &env.admin,
            &env.ns,
            &connection(
                &format!("c{i}"),
                serde_json::json!({"engine": "127.0.0.1:7443",
                    "tokenSecretRef": {"name": "creds", "key": "token"}, "transport": transport}),
            ),
        )
        .await;
        create(
            &env.admin,
            &env.ns,
            &tunnel(
                &format!("t{i}"),
                serde_json::json!({"connectionRef": {"name": format!("c{i}")},
                    "target": {"service": {"name": "web", "port": "http"}}}),
            ),
        )
        .await;
    }
    for (i, (transport, field)) in cases.iter().enumerate() {
        let t = wait_condition(
            &env.tunnels,
            &format!("t{i}"),
            "Accepted",
            "False",
            "InvalidSpec",
            WAIT,
        )
        .await;
        let (_, _, message) = condition(&t, "Accepted").unwrap();
        assert!(message.contains(field), "{transport}: {message}");
        let c = env.conns.get(&format!("c{i}")).await.unwrap();
        let ready = c
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidSpec")
        );
        assert!(
            ready.message.contains(field),
            "{transport}: {}",
            ready.message
        );
        // Nothing is deployed for a refused tunnel: no agent crash-loops on it.
        let base = names::base_name(&env.ns, &format!("t{i}"), t.uid().as_deref());
        assert!(
            children(&env.admin, &env.ns, &base)
                .await
                .deployment
                .is_none()
        );
    }

    // What the agent honours is accepted and reaches its configuration: the proxy (URL,
    // credentials by reference, headers), ipFamily, bind.address, mptcp off, dns.serverName.
    create(
        &env.admin,
        &env.ns,
        &secret("proxy", &[("user", "alice"), ("password", "s3cret")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "honoured",
            serde_json::json!({"engine": "127.0.0.1:7443",
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"mode": "tls", "ipFamily": "ipv6", "mptcp": false, "useQuic": false,
                    "bind": {"address": "fd00::7"},
                    "dns": {"serverName": "engine.example.io"},
                    "proxy": {"http": "http://proxy.internal:3128",
                        "usernameSecretRef": {"name": "proxy", "key": "user"},
                        "passwordSecretRef": {"name": "proxy", "key": "password"},
                        "headers": {"X-Team": "netkit"}}}}),
        ),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &tunnel(
            "honoured",
            serde_json::json!({"connectionRef": {"name": "honoured"},
                "target": {"service": {"name": "web", "port": "http"}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &env.tunnels,
        "honoured",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    assert_eq!(condition(&t, "Accepted").unwrap().0, "True");
    let base = names::base_name(&env.ns, "honoured", t.uid().as_deref());
    let cm = children(&env.admin, &env.ns, &base)
        .await
        .configmap
        .unwrap();
    let yaml = cm.data.unwrap()[names::CONFIG_KEY].clone();
    assert!(
        !yaml.contains("s3cret"),
        "the proxy password leaked: {yaml}"
    );
    let config = AgentConfig::from_yaml(&yaml).unwrap();
    let transport = config.connection.transport.unwrap();
    assert_eq!(transport.bind.unwrap().address.as_deref(), Some("fd00::7"));
    let proxy = transport.proxy.unwrap();
    assert_eq!(proxy.http.as_deref(), Some("http://proxy.internal:3128"));
    assert_eq!(
        proxy.username_env.as_deref(),
        Some(names::PROXY_USERNAME_ENV)
    );
    assert_eq!(proxy.headers.unwrap()["X-Team"], "netkit");
    env.finish_without_403().await;
}

#[tokio::test]
async fn the_agent_reaches_its_engine_through_the_connections_http_proxy() {
    use proxy_core::testing::{Tinyproxy, TinyproxyConfig};
    use rstream_client::engine::LocalEngine;

    let env = manager_env("agent-proxy").await;
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("proxy-token")
        .start()
        .await
        .unwrap();
    let ca = dir.path().join("engine-ca.pem");
    std::fs::write(&ca, engine.ca_pem()).unwrap();
    // The proxy wants credentials and may reach the engine only.
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("alice".into(), "s3cret".into())),
        connect_ports: vec![engine.addr().port()],
    })
    .await
    .unwrap();
    let backend = http_server("hello through the proxy").await;
    create(
        &env.admin,
        &env.ns,
        &secret("creds", &[("token", "proxy-token")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &secret("proxy", &[("user", "alice"), ("password", "s3cret")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "default",
            serde_json::json!({"engine": engine.engine_address(),
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"ipFamily": "ipv4", "bind": {"address": "127.0.0.1"},
                    "proxy": {"http": tiny.url(),
                    "usernameSecretRef": {"name": "proxy", "key": "user"},
                    "passwordSecretRef": {"name": "proxy", "key": "password"}}}}),
        ),
    )
    .await;
    let ports = serde_json::json!([{"name": "http", "port": 8080}]);
    create(&env.admin, &env.ns, &service("web", ports)).await;
    create(
        &env.admin,
        &env.ns,
        &tunnel(
            "web",
            serde_json::json!({"target": {"service": {"name": "web", "port": "http"}},
                "protocol": "http", "http": {"version": "http/1.1"}}),
        ),
    )
    .await;
    let t = wait_condition(
        &env.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = names::base_name(&env.ns, "web", t.uid().as_deref());
    let cm = children(&env.admin, &env.ns, &base)
        .await
        .configmap
        .unwrap();
    let config_path = dir.path().join("config.yaml");
    std::fs::write(&config_path, &cm.data.unwrap()[names::CONFIG_KEY]).unwrap();
    let kubeconfig = plane()
        .await
        .kubeconfig_as(&Identity::service_account(&env.ns, &base))
        .await
        .unwrap();
    // The agent binary, its credentials in the environment as the Deployment gives them.
    let agent = |password: &str| {
        Child::spawn(
            std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"))
                .env("KUBECONFIG", &kubeconfig)
                .env_remove("RUST_LOG")
                .env(names::TOKEN_ENV, "proxy-token")
                .env(names::PROXY_USERNAME_ENV, "alice")
                .env(names::PROXY_PASSWORD_ENV, password)
                .env(names::POD_NAME_ENV, "web-agent-0")
                .env(names::POD_NAMESPACE_ENV, &env.ns)
                .arg(format!("--config={}", config_path.display()))
                .arg(format!("--target-override={backend}"))
                .arg(format!("--ca-file={}", ca.display()))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null()),
        )
    };

    // Refused credentials: the tunnel's condition says so.
    let wrong = agent("wrong");
    let t = wait_condition(
        &env.tunnels,
        "web",
        "TunnelReady",
        "False",
        "TunnelDisconnected",
        WAIT,
    )
    .await;
    let message = condition(&t, "TunnelReady").unwrap().2;
    assert!(
        message.contains("requires credentials") && message.contains(&tiny.url()),
        "{message}"
    );
    assert!(wrong.terminate().await, "the agent did not exit cleanly");

    // The right ones: online, and a request goes through the tunnel.
    let right = agent("s3cret");
    let t = wait_condition(
        &env.tunnels,
        "web",
        "TunnelReady",
        "True",
        "TunnelOnline",
        WAIT,
    )
    .await;
    let tunnel_id = t.status.unwrap().tunnel_id.unwrap();
    let ingress = engine.ingress_addr(&tunnel_id).unwrap();
    let response = http_get(ingress).await.unwrap();
    assert!(response.ends_with("hello through the proxy"), "{response}");
    assert!(
        tiny.logs()
            .contains(&format!("CONNECT {}", engine.engine_address())),
        "{}",
        tiny.logs()
    );
    assert!(right.terminate().await, "the agent did not exit cleanly");
    engine.shutdown().await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn the_managers_control_plane_lookup_goes_through_the_proxy() {
    use proxy_core::testing::{Tinyproxy, TinyproxyConfig};
    use rstream_client::engine::LocalControlPlane;

    let env = manager_env("lookup-proxy").await;
    let project =
        serde_json::json!({"endpoint": "engine", "domain": "example.io", "enginePort": 8443});
    let cp = LocalControlPlane::builder()
        .token("lookup-token")
        .project("proj", project)
        .start()
        .await
        .unwrap();
    let cp_port: u16 = cp.url().rsplit(':').next().unwrap().parse().unwrap();
    // The proxy wants credentials and may reach the control plane only.
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("alice".into(), "s3cret".into())),
        connect_ports: vec![cp_port],
    })
    .await
    .unwrap();
    create(
        &env.admin,
        &env.ns,
        &secret("creds", &[("token", "lookup-token")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &secret("proxy", &[("user", "alice"), ("password", "s3cret")]),
    )
    .await;
    create(
        &env.admin,
        &env.ns,
        &connection(
            "default",
            serde_json::json!({"projectEndpoint": "proj", "apiURL": cp.url(),
                "tokenSecretRef": {"name": "creds", "key": "token"},
                "transport": {"proxy": {"http": tiny.url(),
                    "usernameSecretRef": {"name": "proxy", "key": "user"},
                    "passwordSecretRef": {"name": "proxy", "key": "password"}}}}),
        ),
    )
    .await;
    let engine = wait_for("the connection to resolve", WAIT, || async {
        env.conns
            .get("default")
            .await
            .ok()
            .and_then(|c| c.status)
            .and_then(|s| s.engine)
    })
    .await;
    assert_eq!(engine, "engine.example.io:8443");
    assert!(
        tiny.logs()
            .contains(&format!("CONNECT 127.0.0.1:{cp_port}")),
        "{}",
        tiny.logs()
    );
    env.finish_without_403().await;
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
struct Child(KillOnDrop);

impl Child {
    fn spawn(cmd: &mut std::process::Command) -> Self {
        Self(KillOnDrop::spawn(cmd).unwrap())
    }

    /// SIGTERM, then waits for the exit; returns whether it exited successfully.
    async fn terminate(self) -> bool {
        self.0.terminate(Duration::from_secs(10)).await
    }
}

/// Both binaries as processes against a local engine: the manager (with leader election) and the
/// agent, run as the manager's Deployment would run it, until the tunnel is online.
struct E2e {
    ns: String,
    admin: Client,
    tunnels: Api<RstreamTunnel>,
    base: String,
    engine: Option<rstream_client::engine::LocalEngine>,
    manager: Child,
    agent: Child,
    agent_health: String,
    agent_log: std::path::PathBuf,
    /// The tunnel once online.
    online: RstreamTunnel,
    _dir: tempfile::TempDir,
}

async fn e2e(prefix: &str) -> E2e {
    use rstream_client::engine::LocalEngine;

    let plane = plane().await;
    let ns = plane.create_namespace(prefix).await.unwrap();
    let admin = plane.client().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let engine = LocalEngine::builder()
        .token("e2e-token")
        .start()
        .await
        .unwrap();
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
            // As the manager runs it in a Pod: the log fields below are the JSON contract.
            .arg("--log-format=json")
            .stderr(std::fs::File::create(&agent_log).unwrap()),
    );
    let online = wait_condition(&tunnels, "web", "TunnelReady", "True", "TunnelOnline", WAIT).await;
    E2e {
        ns,
        admin,
        tunnels,
        base,
        engine: Some(engine),
        manager,
        agent,
        agent_health,
        agent_log,
        online,
        _dir: dir,
    }
}

impl E2e {
    fn engine(&self) -> &rstream_client::engine::LocalEngine {
        self.engine.as_ref().unwrap()
    }

    /// No kubelet: reports the agent Deployment available, as its readiness probe would.
    async fn report_deployment_available(&self) {
        Api::<Deployment>::namespaced(self.admin.clone(), &self.ns)
            .patch_status(
                &self.base,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({
                "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
            )
            .await
            .unwrap();
        wait_condition(&self.tunnels, "web", "Ready", "True", "Ready", WAIT).await;
    }

    /// SIGTERM to both processes (each must exit cleanly), checks neither identity was denied,
    /// and returns the agent's log.
    async fn stop(self) -> String {
        assert!(
            self.agent.terminate().await,
            "the agent did not exit cleanly"
        );
        assert!(
            self.manager.terminate().await,
            "the manager did not exit cleanly"
        );
        let plane = plane().await;
        for user in [sa_user(&self.ns, MANAGER_SA), sa_user(&self.ns, &self.base)] {
            let forbidden = forbidden_requests(plane, &user).await;
            assert!(forbidden.is_empty(), "{user} was denied: {forbidden:?}");
        }
        if let Some(engine) = self.engine {
            engine.shutdown().await;
        }
        std::fs::read_to_string(&self.agent_log).unwrap()
    }
}

#[tokio::test]
async fn both_binaries_bring_a_tunnel_online_and_forward_through_it() {
    let env = e2e("e2e-online").await;
    let t = &env.online;
    let status = t.status.clone().unwrap();
    let tunnel_id = status.tunnel_id.clone().unwrap();
    assert!(
        condition(t, "TunnelReady")
            .unwrap()
            .2
            .contains("web-agent-0")
    );
    let address = status.forwarding_address.clone().unwrap();
    assert!(address.starts_with("https://127.0.0.1:"), "{address}");
    assert_eq!(http_status(&env.agent_health, "/readyz").await, 200);
    env.report_deployment_available().await;

    let ingress = env.engine().ingress_addr(&tunnel_id).unwrap();
    assert!(
        address.ends_with(&format!(":{}", ingress.port())),
        "{address} vs {ingress}"
    );
    let response = http_get(ingress).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("hello through rstream"), "{response}");

    let log = env.stop().await;
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
}

#[tokio::test]
async fn the_agent_reports_an_engine_outage_and_reconnects() {
    use rstream_client::engine::LocalEngine;

    let mut env = e2e("e2e-outage").await;
    env.report_deployment_available().await;
    let engine = env.engine.take().unwrap();
    let (engine_addr, engine_identity) = (engine.addr(), engine.identity().clone());
    let tunnels = &env.tunnels;

    // The engine goes away: the agent reports the disconnection and stops being ready.
    engine.shutdown().await;
    let t = wait_condition(
        tunnels,
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
    assert_eq!(http_status(&env.agent_health, "/readyz").await, 503);

    // It comes back on the same address: the agent reconnects and the tunnel is Ready again.
    let engine = LocalEngine::builder()
        .bind(engine_addr)
        .identity(engine_identity)
        .token("e2e-token")
        .start()
        .await
        .unwrap();
    let t = wait_condition(
        tunnels,
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

    env.engine = Some(engine);
    let log = env.stop().await;
    assert!(log.contains("Tunnel disconnected"), "{log}");
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
