//! Clients through steward: an in-cluster client Job, and clients of this process through the Service.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::e2e::Env;
use crate::node::{KUBERNETES_SERVICE_IP, TESTBOX_IMAGE, check};

pub(super) async fn rbac_for_lister(env: &Env<'_>, ns: &str) -> anyhow::Result<()> {
    let objects = [
        json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "lister", "namespace": ns } }),
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": format!("e2e-{ns}-list-namespaces") },
            "rules": [{ "apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"] }] }),
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": format!("e2e-{ns}-list-namespaces") },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": format!("e2e-{ns}-list-namespaces") },
            "subjects": [{ "kind": "ServiceAccount", "name": "lister", "namespace": ns }] }),
    ];
    crate::e2e::apply_objects(env, objects).await
}

/// Runs `/testbox kube --list namespaces` in a Job with ServiceAccount `lister` and in-cluster
/// config only; returns its log, or an error saying how it failed.
pub(super) async fn in_cluster_client(
    env: &Env<'_>,
    ns: &str,
    name: &str,
    watch_seconds: u64,
    deadline: Duration,
) -> anyhow::Result<String> {
    let watch = watch_seconds.to_string();
    let mut job = check::job(
        name,
        TESTBOX_IMAGE,
        &[
            "/testbox",
            "kube",
            "--in-cluster",
            "--list",
            "namespaces",
            "--watch-seconds",
            &watch,
        ],
    );
    job["spec"]["activeDeadlineSeconds"] = json!(deadline.as_secs());
    job["spec"]["template"]["spec"]["serviceAccountName"] = json!("lister");
    let jobs: Api<Job> = Api::namespaced(env.plane.client().await?, ns);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
        .await?;
    let logs = check::wait_job_logs(env.plane, ns, name).await;
    let logs = match logs {
        Ok(logs) => Ok(logs),
        Err(err) => {
            // Why the Job failed (its Failed condition's reason, e.g. DeadlineExceeded: the
            // client was still waiting when the Job's deadline ended it).
            let reason = jobs
                .get(name)
                .await
                .ok()
                .and_then(|j| j.status?.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Failed" && c.status == "True")
                .and_then(|c| c.reason)
                .unwrap_or_else(|| "no Failed reason".to_owned());
            Err(anyhow::anyhow!("Job {name} failed ({reason}): {err}"))
        }
    };
    let _ = jobs.delete(name, &DeleteParams::background()).await;
    logs
}

pub(super) fn summary(outcome: &anyhow::Result<String>) -> String {
    match outcome {
        Ok(log) => log
            .lines()
            .filter(|l| l.starts_with("kube ") || l.starts_with("event "))
            .collect::<Vec<_>>()
            .join("; "),
        Err(err) => format!(
            "failed: {}",
            format!("{err:#}").chars().take(300).collect::<String>()
        ),
    }
}

pub(super) async fn tcp_connect(addr: SocketAddr) -> String {
    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => "connected".to_owned(),
        Ok(Err(e)) => format!("error {e}"),
        Err(_) => "timed out after 2 s".to_owned(),
    }
}

/// A client of `https://10.96.0.1:443` with the admin's credentials (the serving certificate
/// names that address).
pub async fn service_client(env: &Env<'_>) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(env.plane.kubeconfig_path())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.cluster_url = format!("https://{KUBERNETES_SERVICE_IP}:443").parse()?;
    config.read_timeout = Some(Duration::from_secs(300));
    config.connect_timeout = Some(Duration::from_secs(2));
    Ok(kube::Client::try_from(config)?)
}
