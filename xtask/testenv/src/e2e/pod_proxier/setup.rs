//! The chart's install, its generated CA and the debugger ServiceAccounts the mappings are posted with.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::e2e::Env;
use crate::e2e::pod_proxier_api::{API_TLS, api_tls, exchange};

use super::{API_PORT, RELEASE, V2_END, V2_START};

/// `helm install` of the chart as the e2e runs it: the embedded backend, auth by the Kubernetes
/// API, V1 and V2 on, its Service as a NodePort, mappings allowed in `work` only; returns helm's
/// output.
pub async fn install(env: &Env<'_>, ns: &str, work: &str) -> anyhow::Result<String> {
    install_with(env, ns, work, &[]).await
}

/// [`install`] with more `--set` values (`extra`).
pub async fn install_with(
    env: &Env<'_>,
    ns: &str,
    work: &str,
    extra: &[String],
) -> anyhow::Result<String> {
    let (repository, tag) = env.image("pod-proxier")?;
    let mut values = vec![
        format!("image.repository={repository},image.tag={tag}"),
        // hostNetwork is off and the Service on by default; NodePort for the host's clients.
        "service.type=NodePort".to_owned(),
        "podProxier.enableV1=true,podProxier.enableV2=true".to_owned(),
        format!("podProxier.portRangeStart={V2_START},podProxier.portRangeEnd={V2_END}"),
        format!("podProxier.allowedNamespaces={{{work}}}"),
        // `helm test` over HTTPS with the chart's CA (mounted at /etc/pod-proxier/ca).
        "tests.caArgs={--ca-file,/etc/pod-proxier/ca/ca.crt}".to_owned(),
    ];
    values.extend_from_slice(extra);
    let output = env.install_chart(RELEASE, ns, &values).await?;
    let ca = chart_ca(env, ns).await?;
    let name = format!("{RELEASE}.{ns}.svc");
    let client = api_tls(&ca, &name)?;
    *API_TLS.write().unwrap_or_else(|p| p.into_inner()) = Some(client);
    Ok(output)
}

/// The `ca.crt` of the chart's generated TLS Secret (`<release>-tls`), waited for briefly.
pub async fn chart_ca(env: &Env<'_>, ns: &str) -> anyhow::Result<Vec<u8>> {
    let secrets: Api<Secret> = Api::namespaced(env.plane.client().await?, ns);
    let name = format!("{RELEASE}-tls");
    let secret = secrets
        .get(&name)
        .await
        .with_context(|| format!("the chart's TLS Secret {ns}/{name}"))?;
    let ca = (secret.data.as_ref())
        .and_then(|d| d.get("ca.crt"))
        .with_context(|| format!("{ns}/{name} has no ca.crt"))?;
    Ok(ca.0.clone())
}

/// The [`TLS_DEFAULT`] scenario: GET /health with the chart's CA is 200; with a CA of our own
/// the handshake fails (certificate unknown); plain HTTP gets no HTTP answer. Ok is the detail.
pub(super) async fn tls_default(api: SocketAddr, ns: &str) -> anyhow::Result<String> {
    let with_ca = API_TLS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .context("install() read no CA")?;
    let (status, _) = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        Some(with_ca),
    )
    .await
    .context("GET /health with the chart's CA")?;
    if status != 200 {
        bail!("GET /health with the chart's CA: status {status}");
    }
    let mut other = rcgen::CertificateParams::default();
    other.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other_ca = other.self_signed(&rcgen::KeyPair::generate()?)?.pem();
    let without = api_tls(other_ca.as_bytes(), &format!("{RELEASE}.{ns}.svc"))?;
    let refused = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        Some(without),
    )
    .await;
    let refusal = match refused {
        Ok((status, _)) => bail!("a client without the chart's CA got status {status}"),
        Err(e) => format!("{e:#}"),
    };
    if !refusal.contains("certificate") {
        bail!("a client without the chart's CA failed, but not on the certificate: {refusal}");
    }
    let plain = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        None,
    )
    .await;
    if let Ok((status, _)) = plain {
        bail!("plain HTTP to the TLS API got status {status}");
    }
    Ok(format!(
        "GET https://{RELEASE}.{ns}.svc:{API_PORT}/health (dialled {api}) with the chart's CA: 200; with another CA: {refusal}; plain HTTP: no answer"
    ))
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
