//! The set-up the manager's tests share: a namespace with the manager running in it, the
//! objects of a tunnel's children, and child processes killed on drop.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Client;
use kube::api::Api;
use netkit_testenv::fixtures::KillOnDrop;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::names;
use tokio_util::sync::CancellationToken;

use super::*;

/// How long a test waits for a state.
pub const WAIT: Duration = Duration::from_secs(60);

/// Objects of one tunnel's children, by kind.
pub struct Children {
    pub configmap: Option<ConfigMap>,
    pub service_account: Option<ServiceAccount>,
    pub role: Option<Role>,
    pub binding: Option<RoleBinding>,
    pub deployment: Option<Deployment>,
}

pub async fn children(client: &Client, ns: &str, base: &str) -> Children {
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

/// A namespace with the manager running in it as its ServiceAccount, and admin clients.
pub struct ManagerEnv {
    pub ns: String,
    pub admin: Client,
    pub tunnels: Api<RstreamTunnel>,
    pub conns: Api<RstreamConnection>,
    pub stop: CancellationToken,
}

pub async fn manager_env(prefix: &str) -> ManagerEnv {
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
    pub async fn finish_without_403(self) {
        self.stop.cancel();
        let forbidden = forbidden_requests(plane().await, &sa_user(&self.ns, MANAGER_SA)).await;
        assert!(
            forbidden.is_empty(),
            "the manager was denied: {forbidden:?}"
        );
    }

    pub async fn create_connection(&self) {
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

    pub async fn create_tunnel(&self) {
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
    pub async fn resolved_tunnel(&self) -> (RstreamTunnel, String) {
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

/// A child process killed on drop (a failing test leaves nothing running).
pub struct Child(pub KillOnDrop);

impl Child {
    pub fn spawn(cmd: &mut std::process::Command) -> Self {
        Self(KillOnDrop::spawn(cmd).unwrap())
    }

    /// SIGTERM, then waits for the exit; returns whether it exited successfully.
    pub async fn terminate(self) -> bool {
        self.0.terminate(Duration::from_secs(10)).await
    }
}
