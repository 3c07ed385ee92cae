//! pod-proxier on the node: the chart (embedded backend, auth on, V1 and V2, its Service as a
//! NodePort), a V1 mapping posted with a ServiceAccount token that may only port-forward, V2
//! Service ports reaching every Pod, a restart that restores the mappings, and expiry.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Pod, Service, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{ChartReport, Env};
use k8s_reconcile::testing::node::{NODE_IP, check};

pub const RELEASE: &str = "pod-proxier";
pub const SELECTOR: &str = "app.kubernetes.io/name=pod-proxier";
pub const API_PORT: u16 = 3343;
pub const ENTRY_PORT: u16 = 8849;
const V2_START: u16 = 9000;
const V2_END: u16 = 9004;

pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new("pod-proxier");
    if let Err(err) = scenarios(env, &mut report).await {
        println!("  error: {err:#}");
        report.error = Some(format!("{err:#}"));
    }
    for ns in report
        .namespace
        .clone()
        .split(", ")
        .filter(|n| !n.is_empty())
    {
        if let Ok(r) = super::restarts(env.plane, ns).await {
            report.restarts.extend(r);
        }
    }
    report
}

async fn scenarios(env: &Env<'_>, report: &mut ChartReport) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("pod-proxier").await?;
    let work = env.restricted_namespace("debuggee").await?;
    report.namespace = format!("{ns}, {work}");
    let client = env.plane.client().await?;

    // The workloads first: the allowed namespace must exist before the chart binds in it.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &work);
    let mut profiled = check::testbox_deployment("profiled", 1);
    profiled["spec"]["template"]["spec"]["containers"][0]["ports"][1]["name"] =
        json!("jprofiler-port");
    deployments
        .create(&PostParams::default(), &serde_json::from_value(profiled)?)
        .await?;
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(check::testbox_deployment("web", 2))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &work);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": { "name": "web" },
                "spec": { "selector": { "app": "web" },
                          "ports": [{ "name": "debug", "port": 80, "targetPort": 8080 }] },
            }))?,
        )
        .await?;
    debugger_accounts(env, &work).await?;

    let started = Instant::now();
    let installed = install(env, &ns, &work).await?;
    check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
    report.install_to_ready_ms = Some(started.elapsed().as_millis());
    check::wait_pods_ready(env.plane, &work, "app=profiled", 1).await?;
    let web_pods = check::wait_pods_ready(env.plane, &work, "app=web", 2).await?;

    let svc: Service = Api::namespaced(client.clone(), &ns).get(RELEASE).await?;
    let spec = svc.spec.context("the pod-proxier Service has no spec")?;
    let cluster_ip = spec.cluster_ip.context("no ClusterIP")?;
    let node_port = |name: &str| {
        spec.ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| p.node_port)
            .and_then(|p| u16::try_from(p).ok())
    };
    let api: SocketAddr = format!("{cluster_ip}:{API_PORT}").parse()?;
    let entry: SocketAddr = format!("{cluster_ip}:{ENTRY_PORT}").parse()?;
    let entry_node = SocketAddr::new(
        NODE_IP.into(),
        node_port("entry").context("the entry port has no nodePort")?,
    );
    wait_routed(api).await?;
    let allowed = token(env, &work, "debugger").await?;
    let denied = token(env, &work, "bystander").await?;
    let profiled_pod = check::wait_pods_ready(env.plane, &work, "app=profiled", 1)
        .await?
        .remove(0);

    // V1 with auth: the port-forward-only account maps the Pod; bytes go through the Service.
    let started = Instant::now();
    let body = json!({ "pod_name": format!("{work}/{}", profiled_pod.0), "time": 120 }).to_string();
    let (status, answer) =
        http(api, "POST", "/api/v1/mapping", Some(&allowed), Some(&body)).await?;
    let entry_port = answer["data"]["entry_port"].as_i64().unwrap_or(0);
    let echoed = tcp_echo(entry, 64 * 1024).await;
    let (denied_status, denied_answer) =
        http(api, "POST", "/api/v1/mapping", Some(&denied), Some(&body)).await?;
    report.record(
        "V1: a ServiceAccount bound only to create pods/portforward maps a Pod's jprofiler-port; bytes through the Service's entry port reach the Pod and come back; a caller without the binding gets 403",
        status == 200
            && entry_port == i64::from(ENTRY_PORT)
            && echoed.is_ok()
            && denied_status == 403,
        started,
        format!(
            "POST {status} entry_port {entry_port} upstreams {}; 64 KiB echo through {entry}: {}; without the binding: {denied_status} {}",
            answer["data"]["upstreams"],
            echoed.as_ref().map(|d| format!("intact in {d:.1?}")).unwrap_or_else(|e| format!("{e:#}")),
            denied_answer["msg"]
        ),
    );

    // The chart's Service as a NodePort carries the same mapping.
    let started = Instant::now();
    let echoed = tcp_echo(entry_node, 4096).await;
    report.record(
        "chart Service as NodePort on this node carries a mapping",
        echoed.is_ok(),
        started,
        format!(
            "4 KiB echo through {entry_node}: {}",
            echoed
                .as_ref()
                .map(|d| format!("intact in {d:.1?}"))
                .unwrap_or_else(|e| format!("{e:#}"))
        ),
    );

    // V2: the Service's port named debug gets a stable entry port that reaches every Pod.
    let started = Instant::now();
    let v2_entry = v2_port(api, &allowed, &work).await?;
    let v2: SocketAddr = format!("{cluster_ip}:{v2_entry}").parse()?;
    let want: BTreeSet<String> = web_pods.iter().map(|(n, _)| n.clone()).collect();
    let seen = check::reach_all(v2, &want).await;
    report.record(
        "V2: a Service over a 2-replica Deployment gets a stable port; connections reach both Pods",
        seen.is_ok(),
        started,
        format!(
            "service {work}/web -> entry port {v2_entry}; reached {}",
            seen.as_ref()
                .map(|s| s.iter().cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_else(|e| e.to_string())
        ),
    );
    let started = Instant::now();
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(&json!({ "spec": { "replicas": 3 } })),
        )
        .await?;
    let web_pods = check::wait_pods_ready(env.plane, &work, "app=web", 3).await?;
    let want3: BTreeSet<String> = web_pods.iter().map(|(n, _)| n.clone()).collect();
    let seen = check::reach_all(v2, &want3).await;
    report.record(
        "V2: scaled to 3, the new Pod receives traffic",
        seen.is_ok(),
        started,
        format!(
            "reached {}",
            seen.as_ref()
                .map(|s| s.iter().cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_else(|e| e.to_string())
        ),
    );
    let started = Instant::now();
    let victim = web_pods[0].0.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &work);
    pods.delete(&victim, &DeleteParams::default()).await?;
    // Once the victim has left the Service's slice (it is Terminating), no answer may come from it.
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(client.clone(), &work);
    let left = Instant::now();
    loop {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?;
        let serving = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .any(|e| {
                e.target_ref.as_ref().and_then(|r| r.name.as_deref()) == Some(victim.as_str())
                    && e.conditions.as_ref().and_then(|c| c.ready) == Some(true)
            });
        if !serving || left.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut to_victim = 0;
    let mut answered = 0;
    for _ in 0..60 {
        if let Ok(body) = check::http_get(v2, "/").await {
            answered += 1;
            if body.contains(&victim) {
                to_victim += 1;
            }
        }
    }
    report.record(
        "V2: a deleted Pod gets no connection once its endpoint left the slice",
        to_victim == 0 && answered > 50,
        started,
        format!("after {victim} left the slice: {answered}/60 answered, {to_victim} by it"),
    );

    // A restart restores every mapping with its port and remaining TTL.
    let started = Instant::now();
    let before = mappings(api, &allowed).await?;
    let old_pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(SELECTOR))
        .await?;
    for pod in &old_pods {
        Api::<Pod>::namespaced(client.clone(), &ns)
            .delete(
                pod.metadata.name.as_deref().unwrap_or_default(),
                &DeleteParams::default(),
            )
            .await?;
    }
    let old: BTreeSet<String> = old_pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
        if ready.iter().all(|(n, _)| !old.contains(n)) {
            break;
        }
        if Instant::now() > deadline {
            bail!("no replacement pod-proxier Pod");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = mappings(api, &allowed).await?;
    let v2_after = v2_port(api, &allowed, &work).await?;
    let echoed = tcp_echo(entry, 4096).await;
    let same_ports = before
        .iter()
        .all(|(name, port, _)| after.iter().any(|(n, p, _)| n == name && p == port));
    let ttl_kept = before.iter().all(|(name, _, ttl)| {
        after.iter().any(|(n, _, t)| {
            n == name
                && *t <= *ttl
                && *t + i64::try_from(started.elapsed().as_secs()).unwrap_or(0) + 2 >= *ttl
        })
    });
    report.record(
        "pod-proxier Pod deleted: the replacement restores every mapping with the same ports and remaining TTL",
        same_ports && ttl_kept && v2_after == v2_entry && echoed.is_ok(),
        started,
        format!(
            "before {before:?}; after {after:?}; V2 port {v2_entry} -> {v2_after}; V1 echo after: {}",
            echoed.as_ref().map(|_| "ok".to_owned()).unwrap_or_else(|e| format!("{e:#}"))
        ),
    );

    // Expiry closes the entry port within 1 s.
    let started = Instant::now();
    let body = json!({ "pod_name": format!("{work}/{}", profiled_pod.0), "time": 3 }).to_string();
    let (status, answer) =
        http(api, "POST", "/api/v1/mapping", Some(&allowed), Some(&body)).await?;
    let remaining = answer["data"]["remaining_seconds"].as_f64().unwrap_or(3.0);
    let posted = Instant::now();
    let mut closed_at = None;
    while posted.elapsed() < Duration::from_secs(10) {
        let open = tokio::time::timeout(Duration::from_millis(500), tcp_echo(entry, 16))
            .await
            .is_ok_and(|r| r.is_ok());
        if !open {
            closed_at = Some(posted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let late = closed_at.map(|c| c.as_secs_f64() - remaining);
    report.record(
        "expiry closes the entry port within 1 s",
        status == 200 && late.is_some_and(|l| l <= 1.0),
        started,
        format!(
            "mapping of {remaining:.1} s; entry port refused after {}",
            closed_at
                .map(|c| format!(
                    "{:.2}s ({:+.2}s after the deadline)",
                    c.as_secs_f64(),
                    late.unwrap_or(0.0)
                ))
                .unwrap_or_else(|| "never (10 s)".to_owned())
        ),
    );

    // The chart as users meet it: NOTES.txt says what to check next; `helm test` passes.
    super::helm_test_scenario(env, report, RELEASE, &ns, &installed, "/health").await;
    Ok(())
}

/// `helm install` of the chart as the e2e runs it: the embedded backend, auth by the Kubernetes
/// API, V1 and V2 on, its Service as a NodePort, mappings allowed in `work` only; returns helm's
/// output.
pub async fn install(env: &Env<'_>, ns: &str, work: &str) -> anyhow::Result<String> {
    let (repository, tag) = env.image("pod-proxier")?;
    let values = [
        format!("images.podProxier.repository={repository},images.podProxier.tag={tag}"),
        "hostNetwork=false,service.enabled=true,service.type=NodePort".to_owned(),
        "podProxier.enableV1=true,podProxier.enableV2=true".to_owned(),
        format!("podProxier.portRangeStart={V2_START},podProxier.portRangeEnd={V2_END}"),
        format!("podProxier.allowedNamespaces={{{work}}}"),
    ];
    env.install_chart(RELEASE, ns, &values).await
}

/// Waits until `addr` (a new Service's port) accepts connections: kube-proxy applies a new
/// Service within a second or two.
pub async fn wait_routed(addr: SocketAddr) -> anyhow::Result<()> {
    let routable = Instant::now();
    while tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr))
        .await
        .map_or(true, |r| r.is_err())
    {
        if routable.elapsed() > Duration::from_secs(30) {
            bail!("the pod-proxier Service {addr} is not routed within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// `debugger` may only `create pods/portforward` (and `get services` for V2) in `ns`;
/// `bystander` may do nothing.
pub async fn debugger_accounts(env: &Env<'_>, ns: &str) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    for name in ["debugger", "bystander"] {
        accounts
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": name } }))?,
            )
            .await?;
    }
    let roles: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(client.clone(), ns);
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "port-forward" },
                "rules": [
                    { "apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"] },
                    { "apiGroups": [""], "resources": ["services"], "verbs": ["get"] },
                ],
            }))?,
        )
        .await?;
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(client, ns);
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "port-forward" },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "port-forward" },
                "subjects": [{ "kind": "ServiceAccount", "name": "debugger", "namespace": ns }],
            }))?,
        )
        .await?;
    Ok(())
}

pub async fn token(env: &Env<'_>, ns: &str, account: &str) -> anyhow::Result<String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(env.plane.client().await?, ns);
    let request: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": { "audiences": [], "expirationSeconds": 3600 },
    }))?;
    let answer = accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await?;
    answer.status.and_then(|s| s.token).context("no token")
}

/// A V2 entry port of `ns/web`, waited for (bounded).
async fn v2_port(api: SocketAddr, token: &str, ns: &str) -> anyhow::Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, answer) = http(
            api,
            "GET",
            &format!("/api/v2/mapping?service={ns}/web"),
            Some(token),
            None,
        )
        .await?;
        if status == 200
            && let Some(port) = answer["data"]["entry_port"].as_i64()
        {
            return Ok(port);
        }
        if Instant::now() > deadline {
            bail!("no V2 port for {ns}/web: {status} {answer}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// (name, entry port, remaining seconds) of every mapping the caller sees, V1 and V2.
async fn mappings(api: SocketAddr, token: &str) -> anyhow::Result<Vec<(String, i64, i64)>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for path in ["/api/v1/mappings", "/api/v2/mappings"] {
        let (status, answer) = loop {
            let got = http(api, "GET", path, Some(token), None).await;
            if let Ok((200, answer)) = got {
                break (200, answer);
            }
            if Instant::now() > deadline {
                bail!("GET {path}: {got:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let _ = status;
        for m in answer["data"].as_array().cloned().unwrap_or_default() {
            out.push((
                m["name"].as_str().unwrap_or_default().to_owned(),
                m["entry_port"].as_i64().unwrap_or(0),
                m["remaining_seconds"].as_i64().unwrap_or(-1),
            ));
        }
    }
    out.sort();
    Ok(out)
}

/// One HTTP/1.0 request; returns the status and the JSON body. Retries connection errors for a
/// few seconds (a Service whose only Pod is being replaced).
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(body) = body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(String::from_utf8_lossy(&response).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .context("timed out")??;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// Sends `len` bytes to a TCP echo server at `addr` and checks they come back intact.
async fn tcp_echo(addr: SocketAddr, len: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let exchange = async {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut read, mut write) = stream.into_split();
        let writer = tokio::spawn(async move {
            write.write_all(&data).await?;
            write.shutdown().await?;
            anyhow::Ok(data)
        });
        let mut back = Vec::new();
        read.read_to_end(&mut back).await?;
        let data = writer.await??;
        if back != data {
            bail!("{} bytes back of {len}, not identical", back.len());
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .context("timed out")??;
    Ok(started.elapsed())
}
