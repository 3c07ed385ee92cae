//! API authentication (TokenReview) and authorization (SubjectAccessReview), the way the API
//! server itself would judge `kubectl port-forward`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use sha2::{Digest as _, Sha256};

use crate::config::AuthMode;

/// Who called.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The user name, e.g. `system:serviceaccount:team:debugger`.
    pub username: String,
    uid: Option<String>,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
    /// True when authentication is off (`--auth=none`): every check passes.
    unchecked: bool,
}

/// What the caller wants to do, as RBAC sees it.
#[derive(Debug, Clone)]
pub struct Access<'a> {
    /// The namespace.
    pub namespace: &'a str,
    /// The verb, e.g. `create`.
    pub verb: &'a str,
    /// The resource, e.g. `pods`.
    pub resource: &'a str,
    /// The subresource, e.g. `portforward`.
    pub subresource: Option<&'a str>,
    /// The object's name, when there is one.
    pub name: Option<&'a str>,
}

impl Access<'_> {
    fn describe(&self) -> String {
        let resource = match self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.to_owned(),
        };
        match self.name {
            Some(name) => format!(
                "{} {resource} {name:?} in namespace {:?}",
                self.verb, self.namespace
            ),
            None => format!("{} {resource} in namespace {:?}", self.verb, self.namespace),
        }
    }
}

/// Why a caller is turned away.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error(
        "authentication required: send a Kubernetes token as `Authorization: Bearer <token>` (e.g. from `kubectl create token <serviceaccount>`)"
    )]
    MissingToken,
    /// The header is not a bearer token.
    #[error("the Authorization header must be `Bearer <token>`")]
    MalformedHeader,
    /// The API server did not accept the token.
    #[error("the token was not accepted by the Kubernetes API server{0}")]
    InvalidToken(String),
    /// RBAC says no.
    #[error("{user} may not {what}: pod-proxier allows what `kubectl port-forward` would need")]
    Forbidden {
        /// The user.
        user: String,
        /// The refused access.
        what: String,
    },
    /// The API server could not be asked.
    #[error("cannot check credentials with the Kubernetes API server: {0}")]
    Unavailable(String),
}

/// How long a successful TokenReview is reused.
const TOKEN_CACHE_TTL: Duration = Duration::from_secs(10);
/// Bound on cached tokens (the cache is cleared when full).
const TOKEN_CACHE_MAX: usize = 1024;

/// Checks callers against the API server.
pub struct Authenticator {
    mode: AuthMode,
    client: Client,
    tokens: Mutex<HashMap<[u8; 32], (Instant, Caller)>>,
}

impl Authenticator {
    /// An authenticator asking the API server through `client`.
    pub fn new(mode: AuthMode, client: Client) -> Self {
        Self {
            mode,
            client,
            tokens: Mutex::new(HashMap::new()),
        }
    }

    /// Finds out who sent `headers`.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, AuthError> {
        if self.mode == AuthMode::None {
            return Ok(Caller {
                username: "anonymous (--auth=none)".to_owned(),
                uid: None,
                groups: Vec::new(),
                extra: BTreeMap::new(),
                unchecked: true,
            });
        }
        let value = headers
            .get(http::header::AUTHORIZATION)
            .ok_or(AuthError::MissingToken)?;
        let value = value.to_str().map_err(|_| AuthError::MalformedHeader)?;
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::MalformedHeader)?;
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(caller) = self.cached(&key) {
            return Ok(caller);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            let detail = status
                .error
                .filter(|e| !e.is_empty())
                .map(|e| format!(": {e}"))
                .unwrap_or_default();
            return Err(AuthError::InvalidToken(detail));
        }
        let user = status.user.unwrap_or_default();
        let caller = Caller {
            username: user.username.unwrap_or_default(),
            uid: user.uid,
            groups: user.groups.unwrap_or_default(),
            extra: user.extra.unwrap_or_default(),
            unchecked: false,
        };
        if let Ok(mut tokens) = self.tokens.lock() {
            if tokens.len() >= TOKEN_CACHE_MAX {
                tokens.clear();
            }
            tokens.insert(key, (Instant::now() + TOKEN_CACHE_TTL, caller.clone()));
        }
        Ok(caller)
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Caller> {
        let tokens = self.tokens.lock().ok()?;
        let (until, caller) = tokens.get(key)?;
        (Instant::now() < *until).then(|| caller.clone())
    }

    /// Whether `caller` may do `access`.
    pub async fn allowed(&self, caller: &Caller, access: &Access<'_>) -> Result<bool, AuthError> {
        if caller.unchecked {
            return Ok(true);
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(caller.username.clone()),
                uid: caller.uid.clone(),
                groups: Some(caller.groups.clone()),
                extra: Some(caller.extra.clone()),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(access.namespace.to_owned()),
                    verb: Some(access.verb.to_owned()),
                    group: Some(String::new()),
                    resource: Some(access.resource.to_owned()),
                    subresource: access.subresource.map(str::to_owned),
                    name: access.name.map(str::to_owned),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| AuthError::Unavailable(e.to_string()))?;
        Ok(answer.status.is_some_and(|s| s.allowed))
    }

    /// Fails with [`AuthError::Forbidden`] unless `caller` may do `access`.
    pub async fn authorize(&self, caller: &Caller, access: &Access<'_>) -> Result<(), AuthError> {
        if self.allowed(caller, access).await? {
            Ok(())
        } else {
            Err(AuthError::Forbidden {
                user: caller.username.clone(),
                what: access.describe(),
            })
        }
    }
}
