//! Connection resolution: every referenced Secret key must exist, then the engine address is taken
//! from `spec.engine` or resolved through the control plane.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Secret;
use k8s_reconcile::cache::Caches;
use kube::api::Api;
use kube::{Client, ResourceExt as _};
use rstream_client::resolve::{
    ControlPlaneOptions, EngineAddress, resolve_engine, resolve_engine_by_project_id,
};
use rstream_client::tls::TlsOptions;

use crate::api::{DEFAULT_API_URL, RstreamConnection, SecretKeyRef};
use crate::transport::{http_proxy, unsupported_transport};

/// Why a connection cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The RstreamConnection does not exist.
    #[error("RstreamConnection {0} not found")]
    ConnectionNotFound(String),
    /// A Secret or key is missing (or empty).
    #[error("{0}")]
    SecretMissing(String),
    /// The settings cannot be resolved (bad engine, control-plane error, region...).
    #[error("{0}")]
    Invalid(String),
    /// The spec asks for something the agent cannot do (a transport option it does not
    /// implement, unusable proxy settings); the message names the field.
    #[error("{0}")]
    InvalidSpec(String),
    /// An API call failed (retried with backoff).
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

/// A usable connection.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The connection.
    pub connection: RstreamConnection,
    /// Engine `host:port`.
    pub engine: EngineAddress,
    /// Control-plane URL used (`None` with a direct engine).
    pub api_url: Option<String>,
    /// `auto` or the explicit region.
    pub region: Option<String>,
    /// `name:resourceVersion` of the Secrets the agent reads (token, mTLS, proxy), sorted.
    pub agent_secret_versions: Vec<String>,
}

/// The Secrets of a connection's namespace, each read from the API server by name when needed:
/// the manager keeps no Secret cache (a cache means listing and watching every Secret in reach,
/// far more than the few the connections name; see [`super::secrets`]).
struct Secrets {
    api: Api<Secret>,
}

impl Secrets {
    async fn get(&self, name: &str) -> Result<Option<Secret>, kube::Error> {
        self.api.get_opt(name).await
    }
}

/// Reads one Secret key; its value trimmed.
async fn read_key(
    secrets: &Secrets,
    r: &SecretKeyRef,
    what: &str,
    versions: Option<&mut BTreeSet<String>>,
) -> Result<String, ResolveError> {
    let secret = secrets.get(&r.name).await?.ok_or_else(|| {
        ResolveError::SecretMissing(format!("{what}: Secret {} not found", r.name))
    })?;
    let value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(&r.key))
        .map(|b| String::from_utf8_lossy(&b.0).trim().to_owned())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(&r.key))
                .map(|s| s.trim().to_owned())
        })
        .filter(|v| !v.is_empty())
        .ok_or_else(|| {
            ResolveError::SecretMissing(format!(
                "{what}: key {} missing or empty in Secret {}",
                r.key, r.name
            ))
        })?;
    if let Some(versions) = versions {
        versions.insert(format!(
            "{}:{}",
            secret.name_any(),
            secret.resource_version().unwrap_or_default()
        ));
    }
    Ok(value)
}

/// Loads connection `name` in `namespace` (from `connections` once synced) and resolves it (see
/// [`resolve`]).
pub async fn resolve_by_name(
    client: &Client,
    connections: &Caches,
    namespace: &str,
    name: &str,
) -> Result<Resolved, ResolveError> {
    let api: Api<RstreamConnection> = Api::namespaced(client.clone(), namespace);
    let connection = connections
        .get_or_read(&api, namespace, name)
        .await?
        .ok_or_else(|| ResolveError::ConnectionNotFound(name.to_owned()))?;
    resolve(client, connection).await
}

/// Resolves `connection`: Secrets first (each read by name from the API server), then the
/// engine.
pub async fn resolve(
    client: &Client,
    connection: RstreamConnection,
) -> Result<Resolved, ResolveError> {
    let namespace = connection.namespace().unwrap_or_default();
    let secrets = Secrets {
        api: Api::namespaced(client.clone(), &namespace),
    };
    let spec = &connection.spec;
    let mut versions = BTreeSet::new();
    // Refused before anything is read: an agent would have to ignore these, or crash-loop.
    if let Some(t) = &spec.transport {
        let refused = unsupported_transport(
            t.mode,
            t.use_quic,
            t.bind.as_ref(),
            t.ip_family,
            t.dns.as_ref(),
            t.mptcp,
        );
        if !refused.is_empty() {
            return Err(ResolveError::InvalidSpec(refused.join("; ")));
        }
    }

    let token = match &spec.token_secret_ref {
        Some(r) => Some(read_key(&secrets, r, "tokenSecretRef", Some(&mut versions)).await?),
        None => None,
    };
    if let Some(ca) = &spec.ca_secret_ref {
        read_key(&secrets, ca, "caSecretRef", Some(&mut versions)).await?;
    }
    if let Some(m) = &spec.mtls {
        read_key(
            &secrets,
            &m.cert_secret_ref,
            "mtls.certSecretRef",
            Some(&mut versions),
        )
        .await?;
        read_key(
            &secrets,
            &m.key_secret_ref,
            "mtls.keySecretRef",
            Some(&mut versions),
        )
        .await?;
        if let Some(ca) = &m.ca_secret_ref {
            read_key(&secrets, ca, "mtls.caSecretRef", Some(&mut versions)).await?;
        }
    }
    if token.is_none() && spec.mtls.is_none() {
        return Err(ResolveError::SecretMissing(
            "no credentials: set tokenSecretRef or mtls".to_owned(),
        ));
    }
    // The proxy carries the control-plane lookup here, and the agent's engine connections.
    let mut proxy = None;
    if let Some(p) = spec.transport.as_ref().and_then(|t| t.proxy.as_ref()) {
        let username = match &p.username_secret_ref {
            Some(r) => Some(
                read_key(
                    &secrets,
                    r,
                    "transport.proxy.usernameSecretRef",
                    Some(&mut versions),
                )
                .await?,
            ),
            None => None,
        };
        let password = match &p.password_secret_ref {
            Some(r) => Some(
                read_key(
                    &secrets,
                    r,
                    "transport.proxy.passwordSecretRef",
                    Some(&mut versions),
                )
                .await?,
            ),
            None => None,
        };
        proxy = Some(
            http_proxy(
                p.http.as_deref(),
                username.as_deref(),
                password.as_deref(),
                p.headers.as_ref(),
            )
            .map_err(ResolveError::InvalidSpec)?,
        );
    }
    // Header values go to the control plane only; they are not agent Secrets.
    let mut headers = Vec::new();
    for h in spec.control_plane_headers.iter().flatten() {
        let what = format!("controlPlaneHeaders[{}]", h.name);
        headers.push((
            h.name.clone(),
            read_key(&secrets, &h.value_secret_ref, &what, None).await?,
        ));
    }

    let invalid = |e: rstream_client::Error| ResolveError::Invalid(netkit_runtime::error_chain(&e));
    let engine_text = spec
        .engine
        .as_deref()
        .map(str::trim)
        .filter(|e| !e.is_empty());
    let region_text = spec
        .region
        .as_deref()
        .map(str::trim)
        .filter(|r| !r.is_empty());
    let (engine, api_url, region) = if let Some(engine) = engine_text {
        if region_text.is_some() {
            return Err(ResolveError::Invalid(
                "region cannot be combined with engine".into(),
            ));
        }
        if !headers.is_empty() {
            return Err(ResolveError::Invalid(
                "controlPlaneHeaders cannot be combined with engine".into(),
            ));
        }
        (EngineAddress::parse(engine).map_err(invalid)?, None, None)
    } else {
        let api_url = spec
            .api_url
            .as_deref()
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .unwrap_or(DEFAULT_API_URL)
            .trim_end_matches('/')
            .to_owned();
        let mut cp = ControlPlaneOptions::new(api_url.clone());
        if let Some(proxy) = proxy {
            cp = cp.proxy(proxy);
        }
        for (name, value) in headers {
            cp = cp.header(name, value).map_err(invalid)?;
        }
        let token = token.as_deref().ok_or_else(|| {
            ResolveError::Invalid(
                "projectEndpoint and projectID need tokenSecretRef for the control-plane lookup"
                    .into(),
            )
        })?;
        let normalized = rstream_client::resolve::normalize_region(region_text).map_err(invalid)?;
        let tls = TlsOptions::default();
        let engine = match (&spec.project_endpoint, &spec.project_id) {
            (Some(endpoint), _) if !endpoint.trim().is_empty() => {
                resolve_engine(&cp, endpoint, normalized.as_deref(), Some(token), &tls).await
            }
            (_, Some(id)) if !id.trim().is_empty() => {
                resolve_engine_by_project_id(&cp, id, normalized.as_deref(), Some(token), &tls)
                    .await
            }
            _ => {
                return Err(ResolveError::Invalid(
                    "one of projectEndpoint, projectID or engine is required".into(),
                ));
            }
        }
        .map_err(invalid)?;
        let region = Some(normalized.unwrap_or_else(|| "auto".to_owned()));
        (engine, Some(api_url), region)
    };
    Ok(Resolved {
        connection,
        engine,
        api_url,
        region,
        agent_secret_versions: versions.into_iter().collect(),
    })
}
