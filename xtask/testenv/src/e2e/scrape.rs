//! Reading a binary's `/metrics` (plain or HTTPS with a ServiceAccount token), checking its metric names, and applying objects from YAML.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kube::api::Api;

use super::Env;
use super::report::ChartReport;
use crate::node::check;

/// What dashboards look for in every binary's `/metrics`: the process metrics (the build info
/// is the binary's own, `<binary>_build_info`).
const PROCESS_FAMILIES: [&str; 3] = [
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
];
/// Names the binaries used before they took controller-runtime's; they must never come back.
const RETIRED_FAMILIES: [&str; 3] = ["reconcile", "reconcile_duration_seconds", "leader"];

/// Scrapes `addr`'s `/metrics` (retrying for 30 s) and records a scenario: the exposition has
/// `<binary>_build_info`, the process metrics and every family of `required` (`# TYPE` names,
/// counters without `_total`), and none of the retired names.
pub(super) async fn record_metric_names(
    report: &mut ChartReport,
    name: &str,
    scrape: &Scrape,
    binary: &str,
    required: &[&str],
) {
    let addr = scrape.addr();
    let started = Instant::now();
    let build_info = format!("{}_build_info", binary.replace('-', "_"));
    let wanted: Vec<&str> = std::iter::once(build_info.as_str())
        .chain(PROCESS_FAMILIES)
        .chain(required.iter().copied())
        .collect();
    // A family shows once it has a sample, which may lag the traffic that makes it.
    let (metrics, families, missing) = loop {
        let metrics = scrape.metrics().await;
        let families: Vec<String> = metrics
            .as_ref()
            .map(|m| {
                m.lines()
                    .filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<&str> = (wanted.iter().copied())
            .filter(|family| !families.iter().any(|f| f == family))
            .collect();
        if (metrics.is_ok() && missing.is_empty()) || started.elapsed() > Duration::from_secs(30) {
            break (metrics, families, missing);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let retired: Vec<&str> = RETIRED_FAMILIES
        .into_iter()
        .filter(|family| families.iter().any(|f| f == family))
        .collect();
    let controller_runtime: Vec<&String> = (families.iter())
        .filter(|f| f.starts_with("controller_runtime_") || f.starts_with("leader_election_"))
        .collect();
    report.record(
        name,
        metrics.is_ok() && missing.is_empty() && retired.is_empty(),
        started,
        match &metrics {
            Ok(_) => format!(
                "{} metric families from {addr}; missing {missing:?}; retired names {retired:?}; \
                 controller-runtime's {controller_runtime:?}",
                families.len()
            ),
            Err(e) => format!("{addr}: {e}"),
        },
    );
}

/// How a scenario reads a binary's `/metrics`.
pub enum Scrape {
    /// Plain HTTP, as anyone (the chart's metrics are open).
    Open(SocketAddr),
    /// HTTPS with a ServiceAccount's token (the chart's secure default).
    Secure {
        /// The HTTPS address.
        addr: SocketAddr,
        /// The bearer token.
        token: String,
    },
}

impl Scrape {
    fn addr(&self) -> SocketAddr {
        match self {
            Scrape::Open(addr) | Scrape::Secure { addr, .. } => *addr,
        }
    }

    /// The exposition of a 200 answer, else why there is none.
    pub async fn metrics(&self) -> Result<String, String> {
        match self {
            Scrape::Open(addr) => check::http_get(*addr, "/metrics").await,
            Scrape::Secure { addr, token } => match https_get(*addr, "/metrics", Some(token)).await
            {
                Ok((200, body)) => Ok(body),
                Ok((status, body)) => Err(format!("answer {status}: {}", body.trim())),
                Err(e) => Err(format!("{e:#}")),
            },
        }
    }
}

/// One `GET path` over HTTPS with an optional bearer token: (status, body). Any server
/// certificate is accepted: a secure metrics server's is self-signed, made at each start (the
/// claim checked through this is who may read, not who serves).
pub async fn https_get(
    addr: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}\r\n");
    // rustls on a blocking socket (xtask has no tokio-rustls), each read and write bounded.
    let exchange = move || -> anyhow::Result<String> {
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(
                proxy_core::tls::AcceptAnyCert::new(provider),
            ))
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("metrics")?;
        let limit = Duration::from_secs(10);
        tls_exchange(addr, &request, limit, std::sync::Arc::new(config), name)
    };
    let text = tokio::task::spawn_blocking(exchange)
        .await
        .context("the TLS request's thread")??;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = (head.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// A token (valid an hour) of the ServiceAccount `ns/account`.
pub async fn token(env: &Env<'_>, ns: &str, account: &str) -> anyhow::Result<String> {
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(env.plane.client().await?, ns);
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": { "audiences": [], "expirationSeconds": 3600 },
        }))?;
    let answer = accounts
        .create_token_request(account, &kube::api::PostParams::default(), &request)
        .await?;
    answer.status.and_then(|s| s.token).context("no token")
}

/// A ServiceAccount `ns/account` bound (ClusterRoleBinding) to the chart's metrics-reader
/// ClusterRole `role`, as a user binds Prometheus's to read a secure `/metrics`.
pub async fn bind_metrics_reader(
    env: &Env<'_>,
    ns: &str,
    account: &str,
    role: &str,
) -> anyhow::Result<()> {
    apply_objects(
        env,
        [
            serde_json::json!({ "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": { "name": account, "namespace": ns } }),
            serde_json::json!({ "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": { "name": format!("e2e-{ns}-{account}") },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": role },
                "subjects": [{ "kind": "ServiceAccount", "name": account, "namespace": ns }] }),
        ],
    )
    .await
}

/// `request` over TLS (`config`, verifying the server as `name`) on a blocking socket whose
/// reads and writes each time out after `limit`; the whole answer.
pub fn tls_exchange(
    addr: SocketAddr,
    request: &str,
    limit: Duration,
    config: std::sync::Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
) -> anyhow::Result<String> {
    use std::io::{Read as _, Write as _};
    let tcp = std::net::TcpStream::connect_timeout(&addr, limit)?;
    tcp.set_read_timeout(Some(limit))?;
    tcp.set_write_timeout(Some(limit))?;
    let connection = rustls::ClientConnection::new(config, name)?;
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    stream
        .write_all(request.as_bytes())
        .context("TLS handshake or request")?;
    let mut response = Vec::new();
    match stream.read_to_end(&mut response) {
        Ok(_) => {}
        // HTTP/1.0: the server may close without close_notify once it answered.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {}
        Err(e) => return Err(e).context("reading the TLS answer"),
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// Server-side applies each object (as the e2e field manager), namespaced or cluster-wide as
/// its metadata says.
pub async fn apply_objects(
    env: &Env<'_>,
    objects: impl IntoIterator<Item = serde_json::Value>,
) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let params = kube::api::PatchParams::apply("e2e").force();
    for object in objects {
        let object: kube::api::DynamicObject = serde_json::from_value(object)?;
        let types = object.types.clone().context("no kind")?;
        let (group, version) = types
            .api_version
            .split_once('/')
            .unwrap_or(("", types.api_version.as_str()));
        let resource = kube::discovery::ApiResource {
            group: group.to_owned(),
            version: version.to_owned(),
            api_version: types.api_version.clone(),
            kind: types.kind.clone(),
            plural: format!("{}s", types.kind.to_ascii_lowercase()),
        };
        let name = object.metadata.name.clone().unwrap_or_default();
        let api: kube::Api<kube::api::DynamicObject> = match object.metadata.namespace.as_deref() {
            Some(ns) => kube::Api::namespaced_with(client.clone(), ns, &resource),
            None => kube::Api::all_with(client.clone(), &resource),
        };
        api.patch(&name, &params, &kube::api::Patch::Apply(&object))
            .await
            .with_context(|| format!("applying {} {name}", types.kind))?;
    }
    Ok(())
}
