//! The HTTP API: the original's V1 endpoints (same paths, fields and envelope), plus list,
//! delete, V2 introspection and an OpenAPI document. Every answer carries a correct HTTP status
//! and the `{"code","msg","data"}` envelope; bad input is refused before anything changes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, MatchedPath, RawQuery, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::HeaderMap;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

use crate::access::{Cidr, EntryAccess};
use crate::crd::MappingKind;
use crate::error::{self, ApiError};
use crate::forwarding::Mappings;
use crate::metrics::{Metrics, RequestLabels};
use crate::names;
use crate::pod_mappings::{DEFAULT_TTL_SECONDS, MappingView, Requester, V1};
use crate::settings::{MappingPolicy, Settings, V2Policy};
use k8s_reconcile::auth::{Authenticator, Caller, ResourceAccess};
use netkit_runtime::rest::{self, Fields};

/// Everything the handlers share.
pub struct AppState {
    /// Validated flags.
    pub settings: Arc<Settings>,
    /// Caller checks.
    pub auth: Authenticator,
    /// V1, when enabled.
    pub v1: Option<V1>,
    /// The cached mappings.
    pub mappings: Mappings,
    /// Metrics.
    pub metrics: Metrics,
}

type Shared = State<Arc<AppState>>;

/// The API router.
pub fn router(state: Arc<AppState>) -> Router {
    let timeout = state.settings.api.request_timeout;
    let limit = state.settings.api.max_body_bytes;
    Router::new()
        .route("/", get(banner))
        .route("/health", get(health))
        .route("/api/openapi.json", get(openapi))
        .route(
            "/api/v1/mapping",
            get(get_mapping).post(post_mapping).delete(delete_mapping),
        )
        .route("/api/v1/mappings", get(list_v1))
        .route("/api/v2/mappings", get(list_v2))
        .route("/api/v2/mapping", get(get_v2))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(
            (Arc::clone(&state), timeout),
            bounded,
        ))
        .with_state(state)
}

/// Bounds every request in time and counts the answers.
async fn bounded(
    State((state, timeout)): State<(Arc<AppState>, Duration)>,
    request: Request,
    next: Next,
) -> Response {
    let route = format!(
        "{} {}",
        request.method(),
        request
            .extensions()
            .get::<MatchedPath>()
            .map_or("unmatched", |p| p.as_str())
    );
    let response = match tokio::time::timeout(timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::Timeout(timeout.as_secs()).into_response(),
    };
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            route,
            status: response.status().as_u16(),
        })
        .inc();
    response
}

async fn banner() -> &'static str {
    "pod-proxier: see /api/openapi.json\n"
}

async fn health() -> Response {
    error::ok("pong")
}

async fn openapi(State(state): Shared) -> Response {
    axum::Json(crate::openapi::document(&state.settings)).into_response()
}

async fn no_route() -> ApiError {
    ApiError::NoRoute("no such endpoint; see /api/openapi.json".to_owned())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed(
        "method not allowed on this endpoint; see /api/openapi.json".to_owned(),
    )
}

/// A validated mapping request.
#[derive(Debug, PartialEq, Eq)]
pub struct MappingRequest {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// TTL, whole seconds between 1 and --max-mapping-time (the request gives seconds).
    pub ttl: Duration,
    /// Close established connections.
    pub close_connections: bool,
    /// The sources the entry port should admit; none given: the caller's own address.
    pub sources: Option<Vec<Cidr>>,
}

const POST_FIELDS: &[&str] = &["pod_name", "time", "close_connections", "sources"];

/// Parses `sources` entries (CIDRs or addresses).
fn parse_sources<'a>(texts: impl IntoIterator<Item = &'a str>) -> Result<Vec<Cidr>, ApiError> {
    texts
        .into_iter()
        .map(|text| {
            text.parse::<Cidr>()
                .map_err(|e| ApiError::BadRequest(format!("sources: {e}")))
        })
        .collect()
}

/// The TTL of `ttl` seconds, if it is within 1 second and `max`.
fn check_ttl(ttl: u64, max: Duration) -> Result<Duration, ApiError> {
    if ttl == 0 {
        return Err(ApiError::BadRequest(
            "time must be at least 1 second".to_owned(),
        ));
    }
    if ttl > max.as_secs() {
        return Err(ApiError::BadRequest(format!(
            "time {ttl} exceeds the longest mapping allowed, --max-mapping-time {} seconds",
            max.as_secs()
        )));
    }
    Ok(Duration::from_secs(ttl))
}

/// Parses a POST body (JSON or form) or, without a body, the query string.
pub fn parse_mapping_request(
    headers: &HeaderMap,
    query: Option<&str>,
    body: &[u8],
    max: Duration,
) -> Result<MappingRequest, ApiError> {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("invalid").to_ascii_lowercase());
    let media = content_type
        .as_deref()
        .map(|c| c.split(';').next().unwrap_or("").trim().to_owned());
    let body_is_blank = body.iter().all(u8::is_ascii_whitespace);
    let is_json = if body_is_blank {
        false
    } else {
        match media.as_deref() {
            Some("application/json") => true,
            Some(m) if m.ends_with("+json") => true,
            Some("application/x-www-form-urlencoded") => false,
            None | Some("") => true,
            Some(other) => {
                return Err(ApiError::UnsupportedMediaType(format!(
                    "unsupported Content-Type {other:?}: send application/json or application/x-www-form-urlencoded"
                )));
            }
        }
    };
    if is_json {
        if query.is_some_and(|q| !q.is_empty()) {
            return Err(ApiError::BadRequest(
                "give the fields either in the JSON body or in the query string, not both"
                    .to_owned(),
            ));
        }
        return parse_json_request(body, max);
    }
    let text = if body_is_blank {
        query.unwrap_or("").to_owned()
    } else {
        if query.is_some_and(|q| !q.is_empty()) {
            return Err(ApiError::BadRequest(
                "give the fields either in the form body or in the query string, not both"
                    .to_owned(),
            ));
        }
        String::from_utf8(body.to_vec())
            .map_err(|_| ApiError::BadRequest("form body is not valid UTF-8".to_owned()))?
    };
    let fields = Fields::parse(&text, POST_FIELDS, "form")?;
    let pod_name = fields.get("pod_name").ok_or_else(missing_pod_name)?;
    let (namespace, pod) = names::parse_pod_name(pod_name).map_err(ApiError::BadRequest)?;
    let ttl = match fields.get("time") {
        None => DEFAULT_TTL_SECONDS,
        Some(text) => parse_ttl_text(text)?,
    };
    let sources = fields
        .get("sources")
        .map(|text| parse_sources(text.split(',')))
        .transpose()?;
    Ok(MappingRequest {
        namespace,
        pod,
        ttl: check_ttl(ttl, max)?,
        close_connections: fields.flag("close_connections")?,
        sources,
    })
}

fn missing_pod_name() -> ApiError {
    ApiError::BadRequest("pod_name is required, as <namespace>/<pod>".to_owned())
}

fn parse_ttl_text(text: &str) -> Result<u64, ApiError> {
    let trimmed = text.trim();
    if let Some(rest) = trimmed.strip_prefix('-')
        && !rest.is_empty()
        && rest.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(ApiError::BadRequest(
            "time must be at least 1 second".to_owned(),
        ));
    }
    if trimmed.is_empty() || !trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::BadRequest(format!(
            "time must be a whole number of seconds, not {text:?}"
        )));
    }
    // All digits: only overflow can fail, and anything that large is over any maximum.
    Ok(trimmed.parse::<u64>().unwrap_or(u64::MAX))
}

fn parse_json_request(body: &[u8], max: Duration) -> Result<MappingRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    let Value::Object(object) = value else {
        return Err(ApiError::BadRequest(
            "request body must be a JSON object like {\"pod_name\":\"<namespace>/<pod>\",\"time\":60}"
                .to_owned(),
        ));
    };
    if let Some(unknown) = object.keys().find(|k| !POST_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::BadRequest(format!(
            "unknown field {unknown:?}; expected {}",
            POST_FIELDS.join(", ")
        )));
    }
    let pod_name = match object.get("pod_name") {
        None | Some(Value::Null) => return Err(missing_pod_name()),
        Some(Value::String(s)) => s,
        Some(_) => {
            return Err(ApiError::BadRequest(
                "pod_name must be a string <namespace>/<pod>".to_owned(),
            ));
        }
    };
    let (namespace, pod) = names::parse_pod_name(pod_name).map_err(ApiError::BadRequest)?;
    let ttl = match object.get("time") {
        None | Some(Value::Null) => DEFAULT_TTL_SECONDS,
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(v), _) => v,
            (None, Some(_)) => {
                return Err(ApiError::BadRequest(
                    "time must be at least 1 second".to_owned(),
                ));
            }
            (None, None) if n.as_f64().is_some_and(|f| f < 0.0) => {
                return Err(ApiError::BadRequest(
                    "time must be at least 1 second".to_owned(),
                ));
            }
            (None, None) if n.as_f64().is_some_and(|f| f.fract() == 0.0) => u64::MAX,
            (None, None) => {
                return Err(ApiError::BadRequest(format!(
                    "time must be a whole number of seconds, not {n}"
                )));
            }
        },
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "time must be a number of seconds, not {other}"
            )));
        }
    };
    let close_connections = match object.get("close_connections") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::BadRequest(
                "close_connections must be true or false".to_owned(),
            ));
        }
    };
    let sources = match object.get("sources") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let texts: Option<Vec<&str>> = items.iter().map(Value::as_str).collect();
            let texts = texts.ok_or_else(|| {
                ApiError::BadRequest(
                    "sources must be a list of addresses or CIDRs, e.g. [\"10.0.0.0/8\"]"
                        .to_owned(),
                )
            })?;
            Some(parse_sources(texts)?)
        }
        Some(_) => {
            return Err(ApiError::BadRequest(
                "sources must be a list of addresses or CIDRs, e.g. [\"10.0.0.0/8\"]".to_owned(),
            ));
        }
    };
    Ok(MappingRequest {
        namespace,
        pod,
        ttl: check_ttl(ttl, max)?,
        close_connections,
        sources,
    })
}

fn v1(state: &AppState) -> Result<&V1, ApiError> {
    state.v1.as_ref().ok_or_else(|| {
        ApiError::Disabled("V1 is disabled: start pod-proxier with --enable-v1".to_owned())
    })
}

/// Refuses a namespace outside --allowed-namespaces.
fn in_scope(policy: &MappingPolicy, namespace: &str) -> Result<(), ApiError> {
    if policy.namespace_allowed(namespace) {
        return Ok(());
    }
    Err(ApiError::OutOfScope(format!(
        "namespace {namespace:?} is not served by this pod-proxier (allowed: {})",
        policy.allowed_namespaces.join(", ")
    )))
}

fn portforward(namespace: &str, pod: &str) -> ResourceAccess {
    ResourceAccess::new("create", "pods", namespace)
        .subresource("portforward")
        .name(pod)
}

/// Whom the entry port of a mapping requested from `client` admits: `None` (everyone) with
/// `--entry-access=any`, else the client or the request's `sources` within
/// `--allowed-source-cidrs`.
fn admitted_sources(
    policy: &MappingPolicy,
    client: std::net::IpAddr,
    asked: Option<&[Cidr]>,
) -> Result<Option<Vec<Cidr>>, ApiError> {
    match policy.entry_access {
        EntryAccess::Any if asked.is_some() => Err(ApiError::BadRequest(
            "sources is not taken: this pod-proxier runs with --entry-access=any, so its entry \
             ports admit every source"
                .to_owned(),
        )),
        EntryAccess::Any => Ok(None),
        EntryAccess::Requester => policy
            .sources
            .resolve(client, asked)
            .map(Some)
            .map_err(ApiError::OutOfScope),
    }
}

async fn post_mapping(
    State(state): Shared,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let v1 = v1(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    let body = rest::read_body(body, state.settings.api.max_body_bytes)?;
    let request = parse_mapping_request(
        &headers,
        query.as_deref(),
        &body,
        state.settings.policy.max_mapping_time,
    )?;
    in_scope(&state.settings.policy, &request.namespace)?;
    let from = client.ip().to_canonical();
    let sources = admitted_sources(&state.settings.policy, from, request.sources.as_deref())?;
    state
        .auth
        .authorize(&caller, &portforward(&request.namespace, &request.pod))
        .await?;
    let requester = Requester {
        user: caller.username().to_owned(),
        from,
        sources,
    };
    let data = v1
        .map(
            &request.namespace,
            &request.pod,
            request.ttl,
            request.close_connections,
            &requester,
        )
        .await?;
    Ok(error::ok(data))
}

/// `(namespace, pod, all query fields)`.
type PodQuery = (String, String, Fields);

fn pod_from_query(query: Option<&str>, allowed: &[&str]) -> Result<PodQuery, ApiError> {
    let fields = Fields::parse(query.unwrap_or(""), allowed, "query")?;
    let pod_name = fields.get("pod_name").ok_or_else(missing_pod_name)?;
    let (namespace, pod) = names::parse_pod_name(pod_name).map_err(ApiError::BadRequest)?;
    Ok((namespace, pod, fields))
}

async fn get_mapping(
    State(state): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let v1 = v1(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    let (namespace, pod, _) = pod_from_query(query.as_deref(), &["pod_name"])?;
    in_scope(&state.settings.policy, &namespace)?;
    state
        .auth
        .authorize(&caller, &portforward(&namespace, &pod))
        .await?;
    Ok(error::ok(
        v1.query(&namespace, &pod, caller.username()).await?,
    ))
}

async fn delete_mapping(
    State(state): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let v1 = v1(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    let (namespace, pod, fields) =
        pod_from_query(query.as_deref(), &["pod_name", "close_connections"])?;
    let close = fields.flag("close_connections")?;
    in_scope(&state.settings.policy, &namespace)?;
    state
        .auth
        .authorize(&caller, &portforward(&namespace, &pod))
        .await?;
    Ok(error::ok(
        v1.unmap(&namespace, &pod, close, caller.username()).await?,
    ))
}

/// The unexpired mappings of `kind` the caller may see (`access` per namespace).
async fn visible(
    state: &AppState,
    caller: &Caller,
    kind: MappingKind,
    namespace: Option<&str>,
) -> Result<Vec<MappingView>, ApiError> {
    let now = Timestamp::now();
    let mut mappings: Vec<_> = state
        .mappings
        .all()
        .into_iter()
        .filter(|m| m.spec.kind == kind && !m.is_expired(now))
        .filter(|m| {
            state
                .settings
                .policy
                .namespace_allowed(&m.spec.target.namespace)
        })
        .filter(|m| namespace.is_none_or(|ns| m.spec.target.namespace == ns))
        .collect();
    mappings.sort_by_key(|m| m.spec.entry_port);
    let mut views = Vec::new();
    let mut decided: std::collections::HashMap<(String, String), bool> = Default::default();
    for mapping in mappings {
        let target = &mapping.spec.target;
        let access = match kind {
            MappingKind::Pod => portforward(&target.namespace, &target.name),
            MappingKind::Service => {
                ResourceAccess::new("get", "services", &target.namespace).name(&target.name)
            }
        };
        let key = (target.namespace.clone(), target.name.clone());
        let allowed = match decided.get(&key) {
            Some(allowed) => *allowed,
            None => {
                let allowed = state.auth.allowed(caller, &access).await?;
                decided.insert(key, allowed);
                allowed
            }
        };
        if allowed {
            views.push(MappingView::of(&mapping, now));
        }
    }
    Ok(views)
}

async fn list_v1(
    State(state): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    v1(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    Fields::parse(query.as_deref().unwrap_or(""), &[], "query")?;
    let views = visible(&state, &caller, MappingKind::Pod, None).await?;
    Ok(error::ok(views))
}

fn v2(state: &AppState) -> Result<&V2Policy, ApiError> {
    state.settings.policy.v2.as_ref().ok_or_else(|| {
        ApiError::Disabled("V2 is disabled: start pod-proxier with --enable-v2".to_owned())
    })
}

async fn list_v2(
    State(state): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    v2(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    let fields = Fields::parse(query.as_deref().unwrap_or(""), &["namespace"], "query")?;
    let namespace = fields.get("namespace");
    if let Some(ns) = namespace {
        netkit_runtime::validate_dns_label(ns)
            .map_err(|e| ApiError::BadRequest(format!("namespace {ns:?}: {e}")))?;
        in_scope(&state.settings.policy, ns)?;
    }
    let views = visible(&state, &caller, MappingKind::Service, namespace).await?;
    Ok(error::ok(views))
}

async fn get_v2(
    State(state): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let policy = v2(&state)?;
    let caller = state.auth.authenticate(&headers).await?;
    let fields = Fields::parse(query.as_deref().unwrap_or(""), &["service"], "query")?;
    let service = fields.get("service").ok_or_else(|| {
        ApiError::BadRequest("service is required, as <namespace>/<service>".to_owned())
    })?;
    let (namespace, name) = names::parse_service_name(service).map_err(ApiError::BadRequest)?;
    in_scope(&state.settings.policy, &namespace)?;
    state
        .auth
        .authorize(
            &caller,
            &ResourceAccess::new("get", "services", &namespace).name(&name),
        )
        .await?;
    let now = Timestamp::now();
    let views: Vec<MappingView> = state
        .mappings
        .all()
        .iter()
        .filter(|m| {
            m.spec.kind == MappingKind::Service
                && m.spec.target.namespace == namespace
                && m.spec.target.name == name
        })
        .map(|m| MappingView::of(m, now))
        .collect();
    match views.into_iter().next() {
        Some(view) => Ok(error::ok(view)),
        None => Err(ApiError::NotFound {
            msg: format!(
                "service {service} has no published port (no port named {:?}, or not reconciled yet)",
                policy.port_name
            ),
            code: error::CODE_NOT_FOUND,
            data: Some(service.to_owned()),
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn json_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        headers
    }

    const MAX: Duration = Duration::from_secs(10800);

    #[test]
    fn the_same_default_ttl_for_every_encoding() {
        let json =
            parse_mapping_request(&json_headers(), None, br#"{"pod_name":"a/b"}"#, MAX).unwrap();
        let query =
            parse_mapping_request(&HeaderMap::new(), Some("pod_name=a/b"), b"", MAX).unwrap();
        assert_eq!(json.ttl, Duration::from_secs(DEFAULT_TTL_SECONDS));
        assert_eq!(json, query);
    }

    #[test]
    fn bad_ttls_are_refused_with_a_reason() {
        for (body, expected) in [
            (r#"{"pod_name":"a/b","time":-5}"#, "at least 1"),
            (r#"{"pod_name":"a/b","time":0}"#, "at least 1"),
            (r#"{"pod_name":"a/b","time":1.5}"#, "whole number"),
            (r#"{"pod_name":"a/b","time":"60"}"#, "number of seconds"),
            (
                r#"{"pod_name":"a/b","time":99999999999999999999999}"#,
                "max-mapping-time",
            ),
            (r#"{"pod_name":"a/b","time":10801}"#, "max-mapping-time"),
        ] {
            let err =
                parse_mapping_request(&json_headers(), None, body.as_bytes(), MAX).unwrap_err();
            assert!(err.to_string().contains(expected), "{body}: {err}");
            assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
        }
    }
}
