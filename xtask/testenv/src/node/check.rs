//! What a working node must do, proven end to end: the steps behind `cargo xtask cluster --node
//! --check` and the node tests. Nothing here writes a status; kubelet and the controllers do.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{NODE_IP, TESTBOX_IMAGE};
use crate::{ControlPlane, TestingError};

/// One proven step and how long it took.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CheckStep {
    /// What was proven.
    pub what: String,
    /// How long it took.
    pub took: Duration,
}

/// A release image to run as a Job: its `docker load` tarball, its reference, and the program
/// to run with `--version`.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseImage<'a> {
    /// The tarball from `cargo xtask image`.
    pub tarball: &'a Path,
    /// Its reference, e.g. `ghcr.io/kube-netkit/steward-tcp-proxy:0.1.0`.
    pub reference: &'a str,
    /// The program inside it, e.g. `/steward-tcp-proxy`.
    pub program: &'a str,
}

const WAIT: Duration = Duration::from_secs(120);

/// Runs every step against `plane`'s node in a fresh namespace with Pod Security `restricted`
/// enforced, and returns each step with its time. Fails on the first step that does not hold.
pub async fn run(
    plane: &ControlPlane,
    release: ReleaseImage<'_>,
) -> Result<Vec<CheckStep>, TestingError> {
    if plane.nodes().is_empty() {
        return Err(TestingError::NodeUnavailable(
            "the control plane has no node".to_owned(),
        ));
    }
    let client = plane.client().await?;
    let ns = plane.create_namespace("node-check").await?;
    restrict_namespace(plane, &ns).await?;
    let mut steps = Vec::new();
    let mut record = |what: String, took: Duration| steps.push(CheckStep { what, took });

    let started = Instant::now();
    let node_names: Vec<String> = plane.nodes().iter().map(super::Node::name).collect();
    for name in &node_names {
        if !node_ready(plane, name).await? {
            return Err(failed(&format!("the Node {name} is not Ready")));
        }
    }
    record(
        format!("node {} Ready", node_names.join(", ")),
        started.elapsed(),
    );

    let started = Instant::now();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &from_json(testbox_deployment("echo", 2))?,
        )
        .await
        .map_err(kube_err("creating the echo Deployment"))?;
    let pods = wait_pods_ready(plane, &ns, "app=echo", 2).await?;
    record(
        format!(
            "Deployment rolled out: 2 Pods Running and Ready by their probes ({})",
            pods.iter()
                .map(|(name, ip)| format!("{name} {ip}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        started.elapsed(),
    );

    let started = Instant::now();
    for node in plane.nodes() {
        node.import_image(release.tarball)?;
    }
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    jobs.create(
        &PostParams::default(),
        &from_json(job(
            "version",
            release.reference,
            &[release.program, "--version"],
        ))?,
    )
    .await
    .map_err(kube_err("creating the version Job"))?;
    let version = wait_job_logs(plane, &ns, "version").await?;
    record(
        format!(
            "Job from {} Complete: {}",
            release.reference,
            version.trim()
        ),
        started.elapsed(),
    );

    let started = Instant::now();
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let cluster_ip = services
        .create(
            &PostParams::default(),
            &from_json(echo_service("echo", "ClusterIP"))?,
        )
        .await
        .map_err(kube_err("creating the ClusterIP Service"))?;
    let node_port = services
        .create(
            &PostParams::default(),
            &from_json(echo_service("echo-nodeport", "NodePort"))?,
        )
        .await
        .map_err(kube_err("creating the NodePort Service"))?;
    let ip = cluster_ip
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ip.clone())
        .ok_or_else(|| failed("the ClusterIP Service has no ClusterIP"))?;
    let port = node_port
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|p| p.first())
        .and_then(|p| p.node_port)
        .ok_or_else(|| failed("the NodePort Service has no nodePort"))?;
    let want: BTreeSet<String> = pods.iter().map(|(name, _)| name.clone()).collect();
    let cluster_addr: SocketAddr = format!("{ip}:80")
        .parse()
        .map_err(|e| failed(&format!("ClusterIP {ip}: {e}")))?;
    let seen = reach_all(cluster_addr, &want).await?;
    record(
        format!(
            "ClusterIP {cluster_addr} routed by kube-proxy to {}",
            join(&seen)
        ),
        started.elapsed(),
    );
    let started = Instant::now();
    let node_addr = SocketAddr::new(NODE_IP.into(), port.unsigned_abs().try_into().unwrap_or(0));
    let seen = reach_all(node_addr, &want).await?;
    record(
        format!(
            "NodePort {node_addr} routed by kube-proxy to {}",
            join(&seen)
        ),
        started.elapsed(),
    );

    let started = Instant::now();
    let names = [
        "kubernetes.default.svc.cluster.local".to_owned(),
        format!("echo.{ns}.svc.cluster.local"),
    ];
    let expected = [super::KUBERNETES_SERVICE_IP.to_string(), ip.clone()];
    for (i, (name, want_ip)) in names.iter().zip(&expected).enumerate() {
        let job_name = format!("resolve-{i}");
        jobs.create(
            &PostParams::default(),
            &from_json(job(
                &job_name,
                TESTBOX_IMAGE,
                &["/testbox", "resolve", name],
            ))?,
        )
        .await
        .map_err(kube_err("creating a resolve Job"))?;
        let logs = wait_job_logs(plane, &ns, &job_name).await?;
        if !logs.lines().any(|l| l.trim() == want_ip) {
            return Err(failed(&format!(
                "a Pod resolved {name} to {logs:?}, expected {want_ip}"
            )));
        }
    }
    record(
        format!("a Pod resolved {} through CoreDNS", names.join(" and ")),
        started.elapsed(),
    );

    if node_names.len() > 1 {
        for step in across_nodes(plane, &ns, &node_names).await? {
            record(step.what, step.took);
        }
    }

    let started = Instant::now();
    deployments
        .delete("echo", &DeleteParams::background())
        .await
        .map_err(kube_err("deleting the echo Deployment"))?;
    let pod_api: Api<Pod> = Api::namespaced(client, &ns);
    let deadline = Deadline::new("the garbage collector to delete the echo Pods".to_owned());
    while !pod_api
        .list(&ListParams::default().labels("app=echo"))
        .await
        .is_ok_and(|l| l.items.is_empty())
    {
        deadline.tick().await?;
    }
    record(
        "Deployment deleted: its ReplicaSet and Pods garbage-collected".to_owned(),
        started.elapsed(),
    );
    Ok(steps)
}

/// With several nodes: one echo Pod on each node (required anti-affinity), reached from the host
/// through a ClusterIP (kube-proxy on the first node, then the host's routes to the other node),
/// and a Pod on the last node resolving a name through CoreDNS on the first and fetching from
/// every echo Pod by its Pod IP (Pod to Pod across nodes).
async fn across_nodes(
    plane: &ControlPlane,
    ns: &str,
    names: &[String],
) -> Result<Vec<CheckStep>, TestingError> {
    let client = plane.client().await?;
    let mut steps = Vec::new();
    let started = Instant::now();
    let mut spread = testbox_deployment("spread", i32::try_from(names.len()).unwrap_or(2));
    spread["spec"]["template"]["spec"]["affinity"] = json!({ "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": { "matchLabels": { "app": "spread" } },
            "topologyKey": "kubernetes.io/hostname",
        }],
    }});
    Api::<Deployment>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &from_json(spread)?)
        .await
        .map_err(kube_err("creating the spread Deployment"))?;
    let pods = wait_pods_ready(plane, ns, "app=spread", names.len()).await?;
    let placed: BTreeSet<String> = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels("app=spread"))
        .await
        .map_err(kube_err("listing the spread Pods"))?
        .items
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    if placed.len() != names.len() {
        return Err(failed(&format!(
            "the spread Pods run on {placed:?}, not one on each of {names:?}"
        )));
    }
    steps.push(CheckStep {
        what: format!("one Pod on each node ({})", join(&placed)),
        took: started.elapsed(),
    });

    let started = Instant::now();
    let mut service = echo_service("spread", "ClusterIP");
    service["spec"]["selector"] = json!({ "app": "spread" });
    let created = Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &from_json(service)?)
        .await
        .map_err(kube_err("creating the spread Service"))?;
    let ip = created
        .spec
        .and_then(|s| s.cluster_ip)
        .ok_or_else(|| failed("the spread Service has no ClusterIP"))?;
    let addr: SocketAddr = format!("{ip}:80")
        .parse()
        .map_err(|e| failed(&format!("ClusterIP {ip}: {e}")))?;
    let want: BTreeSet<String> = pods.iter().map(|(name, _)| name.clone()).collect();
    let seen = reach_all(addr, &want).await?;
    steps.push(CheckStep {
        what: format!(
            "ClusterIP {addr} reaches the Pods of every node: {}",
            join(&seen)
        ),
        took: started.elapsed(),
    });

    let started = Instant::now();
    let last = names.last().cloned().unwrap_or_default();
    let name = format!("spread.{ns}.svc.cluster.local");
    let jobs: Api<Job> = Api::namespaced(client, ns);
    let on_last = |job_name: &str, command: &[&str]| {
        let mut spec = job(job_name, TESTBOX_IMAGE, command);
        spec["spec"]["template"]["spec"]["nodeSelector"] =
            json!({ "kubernetes.io/hostname": last });
        spec
    };
    jobs.create(
        &PostParams::default(),
        &from_json(on_last("across-resolve", &["/testbox", "resolve", &name]))?,
    )
    .await
    .map_err(kube_err("creating the across-resolve Job"))?;
    let logs = wait_job_logs(plane, ns, "across-resolve").await?;
    if !logs.lines().any(|l| l.trim() == ip) {
        return Err(failed(&format!(
            "a Pod on {last} resolved {name} to {logs:?}, expected {ip}"
        )));
    }
    for (i, (pod, pod_ip)) in pods.iter().enumerate() {
        let job_name = format!("across-get-{i}");
        let url = format!("http://{pod_ip}:8080/");
        jobs.create(
            &PostParams::default(),
            &from_json(on_last(&job_name, &["/testbox", "get", &url]))?,
        )
        .await
        .map_err(kube_err("creating an across-get Job"))?;
        let body = wait_job_logs(plane, ns, &job_name).await?;
        if !body.contains(pod.as_str()) {
            return Err(failed(&format!(
                "from {last}, GET {url} answered {body:?}, not by {pod}"
            )));
        }
    }
    steps.push(CheckStep {
        what: format!(
            "a Pod on {last} resolved {name} through CoreDNS and reached every echo Pod by its Pod IP"
        ),
        took: started.elapsed(),
    });
    Ok(steps)
}

/// Labels `ns` so that Pod Security admission enforces the `restricted` level.
pub async fn restrict_namespace(plane: &ControlPlane, ns: &str) -> Result<(), TestingError> {
    let api: Api<Namespace> = Api::all(plane.client().await?);
    let patch = json!({ "metadata": { "labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    api.patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube_err("labelling the namespace restricted"))?;
    Ok(())
}

/// The security context of every Pod here: what Pod Security `restricted` asks for.
pub fn restricted_pod_security() -> serde_json::Value {
    serde_json::to_value(k8s_reconcile::pod::restricted_pod_security_context()).unwrap_or_default()
}

/// The security context of every container here.
pub fn restricted_container_security() -> serde_json::Value {
    serde_json::to_value(k8s_reconcile::pod::restricted_security_context()).unwrap_or_default()
}

/// A Deployment of the testbox echo server (`serve`), `app=<name>`, ready by its HTTP probe.
pub fn testbox_deployment(name: &str, replicas: i32) -> serde_json::Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "securityContext": restricted_pod_security(),
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{
                        "name": "echo",
                        "image": TESTBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        "args": ["serve"],
                        "env": [
                            { "name": "POD_NAME", "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } },
                            { "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } },
                        ],
                        "ports": [
                            { "name": "http", "containerPort": 8080 },
                            { "name": "tcp-echo", "containerPort": 9000 },
                            { "name": "udp-echo", "containerPort": 9001, "protocol": "UDP" },
                        ],
                        "readinessProbe": { "httpGet": { "path": "/healthz", "port": 8080 }, "periodSeconds": 1 },
                        "securityContext": restricted_container_security(),
                    }],
                },
            },
        },
    })
}

fn echo_service(name: &str, kind: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name },
        "spec": {
            "type": kind,
            "selector": { "app": "echo" },
            "ports": [{ "name": "http", "port": 80, "targetPort": 8080 }],
        },
    })
}

/// A Job of one Pod running `command` in `image`, never retried.
pub fn job(name: &str, image: &str, command: &[&str]) -> serde_json::Value {
    json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": { "name": name },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": { "labels": { "job": name } },
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": restricted_pod_security(),
                    "containers": [{
                        "name": "main",
                        "image": image,
                        "imagePullPolicy": "IfNotPresent",
                        "command": command,
                        "securityContext": restricted_container_security(),
                    }],
                },
            },
        },
    })
}

/// Waits for `count` Pods matching `selector` to be Running and Ready; returns (name, IP) each.
pub async fn wait_pods_ready(
    plane: &ControlPlane,
    ns: &str,
    selector: &str,
    count: usize,
) -> Result<Vec<(String, String)>, TestingError> {
    let pods: Api<Pod> = Api::namespaced(plane.client().await?, ns);
    let deadline = Deadline::new(format!("{count} Pods {selector} Ready"));
    loop {
        if let Ok(list) = pods.list(&ListParams::default().labels(selector)).await {
            let ready: Vec<(String, String)> = list
                .items
                .iter()
                .filter(|p| is_ready(p))
                .map(|p| {
                    let ip = p.status.as_ref().and_then(|s| s.pod_ip.clone());
                    (
                        p.metadata.name.clone().unwrap_or_default(),
                        ip.unwrap_or_default(),
                    )
                })
                .collect();
            if ready.len() == count {
                return Ok(ready);
            }
        }
        deadline.tick().await?;
    }
}

/// Whether kubelet reports the Pod `Running` with condition `Ready`.
pub fn is_ready(pod: &Pod) -> bool {
    let Some(status) = pod.status.as_ref() else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Waits for Job `name` to complete and returns its Pod's log; a failed Job is an error with
/// the log.
pub async fn wait_job_logs(
    plane: &ControlPlane,
    ns: &str,
    name: &str,
) -> Result<String, TestingError> {
    let client = plane.client().await?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client, ns);
    let deadline = Deadline::new(format!("Job {name} to finish"));
    let outcome = loop {
        let status = jobs.get(name).await.ok().and_then(|j| j.status);
        let conditions = status.and_then(|s| s.conditions).unwrap_or_default();
        let finished = conditions
            .iter()
            .find(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True")
            .map(|c| c.type_.clone());
        if let Some(outcome) = finished {
            break outcome;
        }
        deadline.tick().await?;
    };
    let list = pods
        .list(&ListParams::default().labels(&format!("job={name}")))
        .await
        .map_err(kube_err("listing the Job's Pods"))?;
    let pod = list
        .items
        .first()
        .and_then(|p| p.metadata.name.clone())
        .ok_or_else(|| failed(&format!("Job {name} has no Pod")))?;
    let logs = pods
        .logs(&pod, &LogParams::default())
        .await
        .map_err(kube_err("reading the Job's log through the kubelet"))?;
    if outcome != "Complete" {
        return Err(failed(&format!("Job {name} failed; its log: {logs}")));
    }
    Ok(logs)
}

/// Sends HTTP GETs to `addr` until every Pod in `want` has answered (the testbox's `/` names
/// the Pod); returns the Pods seen.
pub async fn reach_all(
    addr: SocketAddr,
    want: &BTreeSet<String>,
) -> Result<BTreeSet<String>, TestingError> {
    let mut seen = BTreeSet::new();
    let mut last_error = String::new();
    let deadline = Deadline::new(format!("every Pod to answer through {addr}"));
    while !want.is_subset(&seen) {
        match http_get(addr, "/").await {
            Ok(body) => {
                let pod = serde_json::from_str::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("pod").and_then(|p| p.as_str()).map(str::to_owned));
                seen.extend(pod);
            }
            Err(err) => last_error = err,
        }
        deadline.tick().await.map_err(|e| {
            failed(&format!(
                "{e} (saw {}; last error: {last_error})",
                join(&seen)
            ))
        })?;
    }
    Ok(seen)
}

/// A one-shot HTTP/1.0 GET; returns the body of a 200 answer.
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        http_get_on(stream, addr, path).await
    };
    // Generous: a busy node answers late, and a late answer is still an answer.
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| "timed out after 10 s".to_owned())?
}

/// `GET path` (HTTP/1.0, `Host: addr`) on the connected `stream`: the body of a 200 answer.
pub async fn http_get_on(
    mut stream: tokio::net::TcpStream,
    addr: SocketAddr,
    path: &str,
) -> Result<String, String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(format!("answer: {head}"));
    }
    Ok(body.to_owned())
}

async fn node_ready(plane: &ControlPlane, name: &str) -> Result<bool, TestingError> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(plane.client().await?);
    let node = nodes
        .get(name)
        .await
        .map_err(kube_err("reading the Node"))?;
    Ok(node
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A wait of at most [`WAIT`], polled every 100 ms.
struct Deadline {
    at: Instant,
    what: String,
}

impl Deadline {
    fn new(what: String) -> Self {
        Self {
            at: Instant::now() + WAIT,
            what,
        }
    }

    /// Sleeps before the next poll; an error once the time is up.
    async fn tick(&self) -> Result<(), TestingError> {
        if Instant::now() >= self.at {
            return Err(TestingError::Timeout(WAIT, self.what.clone()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(())
    }
}

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, TestingError> {
    serde_json::from_value(value).map_err(|cause| TestingError::Decode {
        what: "a check object".to_owned(),
        cause,
    })
}

fn kube_err(context: &'static str) -> impl Fn(kube::Error) -> TestingError {
    move |source| TestingError::Kube {
        context: context.to_owned(),
        cause: source,
    }
}

fn failed(what: &str) -> TestingError {
    TestingError::Check(what.to_owned())
}

fn join(set: &BTreeSet<String>) -> String {
    set.iter().cloned().collect::<Vec<_>>().join(", ")
}
