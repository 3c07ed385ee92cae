//! Request authentication and authorization through the API server, the way kube-rbac-proxy does
//! it: a bearer token is judged by a `TokenReview`, an access by a `SubjectAccessReview`.
//!
//! A server in front of cluster resources uses [`Authenticator`] to answer "who sent this?" and
//! "may they do that?" exactly as the API server would for the same credentials, so RBAC is the
//! one place where access is granted.
//!
//! * [`Authenticator::authenticate`] reads `Authorization: Bearer <token>` and returns the
//!   [`Caller`]; accepted tokens are remembered (by their SHA-256) for ten seconds.
//! * [`Authenticator::allowed`] asks whether a caller may do a [`ResourceAccess`];
//!   [`Authenticator::authorize`] fails with [`AuthError::Forbidden`] when not.
//! * [`Authenticator::allowed_path`] asks the same of a non-resource URL such as `/metrics`
//!   (RBAC's `nonResourceURLs`), the way controller-runtime protects its metrics; its answers,
//!   yes or no, are remembered for ten seconds, so a busy scraper costs one review per window.
//! * [`Authenticator::allow_all`] turns checks off (every caller is one fixed, unchecked user),
//!   for local trials.
//!
//! The server's own ServiceAccount needs `create` on `tokenreviews.authentication.k8s.io` and
//! `subjectaccessreviews.authorization.k8s.io` (the `system:auth-delegator` ClusterRole).
//!
//! # Example
//!
//! ```no_run
//! use k8s_reconcile::auth::{Authenticator, AuthError, ResourceAccess};
//!
//! # async fn handle(client: kube::Client, headers: http::HeaderMap) -> Result<(), AuthError> {
//! let auth = Authenticator::new(client);
//! let caller = auth.authenticate(&headers).await?;
//! let access = ResourceAccess::new("create", "pods", "team-a")
//!     .subresource("portforward")
//!     .name("web-0");
//! auth.authorize(&caller, &access).await?;
//! println!("{} may port-forward to team-a/web-0", caller.username());
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use sha2::{Digest as _, Sha256};

/// Who sent a request, as the API server's `TokenReview` saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    username: String,
    uid: Option<String>,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
    unchecked: bool,
}

impl Caller {
    /// The user name, e.g. `system:serviceaccount:team:debugger`.
    pub fn username(&self) -> &str {
        &self.username
    }

    /// The user's groups, e.g. `system:serviceaccounts`.
    pub fn groups(&self) -> &[String] {
        &self.groups
    }

    /// True for the caller of an [`Authenticator::allow_all`]: every check passes.
    pub fn is_unchecked(&self) -> bool {
        self.unchecked
    }
}

/// What a caller wants to do, as RBAC sees it (a `SubjectAccessReview`'s resource attributes).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub struct ResourceAccess {
    /// The verb, e.g. `create`.
    pub verb: String,
    /// The API group, `""` for the core group.
    pub group: String,
    /// The resource, e.g. `pods`.
    pub resource: String,
    /// The subresource, e.g. `portforward`.
    pub subresource: Option<String>,
    /// The namespace.
    pub namespace: String,
    /// The object's name, when there is one.
    pub name: Option<String>,
}

impl ResourceAccess {
    /// `verb` on `resource` of the core group in `namespace`, any name.
    pub fn new(verb: &str, resource: &str, namespace: &str) -> Self {
        Self {
            verb: verb.to_owned(),
            group: String::new(),
            resource: resource.to_owned(),
            subresource: None,
            namespace: namespace.to_owned(),
            name: None,
        }
    }

    /// The API group (`""`, the core group, by default).
    #[must_use]
    pub fn group(mut self, group: &str) -> Self {
        group.clone_into(&mut self.group);
        self
    }

    /// A subresource, e.g. `portforward`.
    #[must_use]
    pub fn subresource(mut self, subresource: &str) -> Self {
        self.subresource = Some(subresource.to_owned());
        self
    }

    /// One object by name.
    #[must_use]
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// The same access with another verb.
    #[must_use]
    pub fn verb(mut self, verb: &str) -> Self {
        verb.clone_into(&mut self.verb);
        self
    }

    /// The resource attributes of an access review.
    pub(crate) fn attributes(&self) -> ResourceAttributes {
        ResourceAttributes {
            namespace: Some(self.namespace.clone()),
            verb: Some(self.verb.clone()),
            group: Some(self.group.clone()),
            resource: Some(self.resource.clone()),
            subresource: self.subresource.clone(),
            name: self.name.clone(),
            ..ResourceAttributes::default()
        }
    }
}

impl std::fmt::Display for ResourceAccess {
    /// E.g. `create pods/portforward "web-0" in namespace "team-a"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if let Some(sub) = &self.subresource {
            write!(f, "/{sub}")?;
        }
        if let Some(name) = &self.name {
            write!(f, " {name:?}")?;
        }
        write!(f, " in namespace {:?}", self.namespace)
    }
}

/// Why a caller is turned away.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// No `Authorization` header.
    #[error(
        "authentication required: send a Kubernetes token as `Authorization: Bearer <token>` (e.g. from `kubectl create token <serviceaccount>`)"
    )]
    MissingToken,
    /// The header is not a bearer token.
    #[error("the Authorization header must be `Bearer <token>`")]
    MalformedHeader,
    /// The API server did not accept the token; the field is its reason as `": reason"`, or empty.
    #[error("the token was not accepted by the Kubernetes API server{0}")]
    InvalidToken(String),
    /// RBAC says no.
    #[error("{user} may not {what}")]
    Forbidden {
        /// The user.
        user: String,
        /// The refused access, as [`ResourceAccess`] prints it.
        what: String,
    },
    /// The API server could not be asked: the TokenReview or SubjectAccessReview call failed
    /// (also the `source()`, so a caller can tell a timeout from a refusal).
    #[error("cannot check credentials with the Kubernetes API server")]
    Unavailable(#[source] kube::Error),
}

/// How long an accepted token is reused without a new TokenReview.
const TOKEN_CACHE_TTL: Duration = Duration::from_secs(10);
/// Bound on remembered tokens (the cache is cleared when full).
const TOKEN_CACHE_MAX: usize = 1024;
/// How long a non-resource access decision (allowed or not) is reused.
const PATH_CACHE_TTL: Duration = Duration::from_secs(10);
/// Bound on remembered non-resource decisions (the cache is cleared when full).
const PATH_CACHE_MAX: usize = 1024;

enum Mode {
    Check(Client),
    AllowAll(String),
}

/// Authenticates bearer tokens with `TokenReview` and authorizes with `SubjectAccessReview`.
pub struct Authenticator {
    mode: Mode,
    tokens: Mutex<HashMap<[u8; 32], (Instant, Caller)>>,
    /// Non-resource decisions by the SHA-256 of (caller, verb, path).
    paths: Mutex<HashMap<[u8; 32], (Instant, bool)>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match &self.mode {
            Mode::Check(_) => "check",
            Mode::AllowAll(_) => "allow-all",
        };
        f.debug_struct("Authenticator")
            .field("mode", &mode)
            .finish()
    }
}

impl Authenticator {
    /// Checks every request with the API server behind `client`.
    pub fn new(client: Client) -> Self {
        Self::with_mode(Mode::Check(client))
    }

    /// Checks nothing: every request comes from an unchecked caller named `username`, who may
    /// do anything. Only for local trials.
    pub fn allow_all(username: impl Into<String>) -> Self {
        Self::with_mode(Mode::AllowAll(username.into()))
    }

    fn with_mode(mode: Mode) -> Self {
        Self {
            mode,
            tokens: Mutex::new(HashMap::new()),
            paths: Mutex::new(HashMap::new()),
        }
    }

    /// Finds out who sent `headers` (their `Authorization: Bearer <token>`).
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, AuthError> {
        let client = match &self.mode {
            Mode::Check(client) => client,
            Mode::AllowAll(username) => {
                return Ok(Caller {
                    username: username.clone(),
                    uid: None,
                    groups: Vec::new(),
                    extra: BTreeMap::new(),
                    unchecked: true,
                });
            }
        };
        let token = bearer_token(headers)?;
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(caller) = self.cached(&key) {
            return Ok(caller);
        }
        // `token` is optional in Kubernetes 1.35's API types and before, required from 1.36 on;
        // the final binary's k8s-openapi version decides which, so it is set after `default()`.
        #[allow(clippy::field_reassign_with_default)]
        let spec = {
            let mut spec = TokenReviewSpec::default();
            k8s_openapi::k8s_if_le_1_35! {
                spec.token = Some(token.to_owned());
            }
            k8s_openapi::k8s_if_ge_1_36! {
                spec.token = token.to_owned();
            }
            spec
        };
        let review = TokenReview {
            spec,
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(AuthError::Unavailable)?;
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
    pub async fn allowed(
        &self,
        caller: &Caller,
        access: &ResourceAccess,
    ) -> Result<bool, AuthError> {
        self.review(caller, Some(access.attributes()), None).await
    }

    /// Whether `caller` may do `verb` on the non-resource URL `path` (e.g. `get` `/metrics`,
    /// granted by a ClusterRole rule `{nonResourceURLs: ["/metrics"], verbs: ["get"]}`). The
    /// answer is remembered for ten seconds, a refusal too: a change of RBAC shows within that.
    pub async fn allowed_path(
        &self,
        caller: &Caller,
        verb: &str,
        path: &str,
    ) -> Result<bool, AuthError> {
        if caller.unchecked || matches!(self.mode, Mode::AllowAll(_)) {
            return Ok(true);
        }
        let key = path_key(caller, verb, path);
        if let Ok(paths) = self.paths.lock()
            && let Some((until, allowed)) = paths.get(&key)
            && Instant::now() < *until
        {
            return Ok(*allowed);
        }
        let attributes = NonResourceAttributes {
            path: Some(path.to_owned()),
            verb: Some(verb.to_owned()),
        };
        let allowed = self.review(caller, None, Some(attributes)).await?;
        if let Ok(mut paths) = self.paths.lock() {
            if paths.len() >= PATH_CACHE_MAX {
                paths.clear();
            }
            paths.insert(key, (Instant::now() + PATH_CACHE_TTL, allowed));
        }
        Ok(allowed)
    }

    /// One SubjectAccessReview of `caller` for a resource or a non-resource access.
    async fn review(
        &self,
        caller: &Caller,
        resource_attributes: Option<ResourceAttributes>,
        non_resource_attributes: Option<NonResourceAttributes>,
    ) -> Result<bool, AuthError> {
        let client = match &self.mode {
            Mode::Check(client) if !caller.unchecked => client,
            _ => return Ok(true),
        };
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(caller.username.clone()),
                uid: caller.uid.clone(),
                groups: Some(caller.groups.clone()),
                extra: Some(caller.extra.clone()),
                resource_attributes,
                non_resource_attributes,
            },
            ..SubjectAccessReview::default()
        };
        let answer = Api::<SubjectAccessReview>::all(client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(AuthError::Unavailable)?;
        Ok(answer.status.is_some_and(|s| s.allowed))
    }

    /// Fails with [`AuthError::Forbidden`] unless `caller` may do `access`.
    pub async fn authorize(
        &self,
        caller: &Caller,
        access: &ResourceAccess,
    ) -> Result<(), AuthError> {
        if self.allowed(caller, access).await? {
            Ok(())
        } else {
            Err(AuthError::Forbidden {
                user: caller.username.clone(),
                what: access.to_string(),
            })
        }
    }
}

/// The cache key of a non-resource decision: everything the review was asked with, each part
/// length-prefixed so that no two different questions share a key.
fn path_key(caller: &Caller, verb: &str, path: &str) -> [u8; 32] {
    fn part(hash: &mut Sha256, text: &str) {
        hash.update((text.len() as u64).to_le_bytes());
        hash.update(text.as_bytes());
    }
    fn count(hash: &mut Sha256, n: usize) {
        hash.update((n as u64).to_le_bytes());
    }
    let mut hash = Sha256::new();
    for text in [verb, path, &caller.username] {
        part(&mut hash, text);
    }
    match &caller.uid {
        Some(uid) => {
            count(&mut hash, 1);
            part(&mut hash, uid);
        }
        None => count(&mut hash, 0),
    }
    count(&mut hash, caller.groups.len());
    for group in &caller.groups {
        part(&mut hash, group);
    }
    count(&mut hash, caller.extra.len());
    for (key, values) in &caller.extra {
        part(&mut hash, key);
        count(&mut hash, values.len());
        for value in values {
            part(&mut hash, value);
        }
    }
    hash.finalize().into()
}

/// The token of `Authorization: Bearer <token>` (the scheme in either case of its first letter).
pub fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .ok_or(AuthError::MissingToken)?;
    let value = value.to_str().map_err(|_| AuthError::MalformedHeader)?;
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(AuthError::MalformedHeader)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::AUTHORIZATION, value.parse().unwrap());
        headers
    }

    #[test]
    fn bearer_tokens_are_read_from_the_header() {
        assert_eq!(bearer_token(&headers("Bearer abc")).ok(), Some("abc"));
        assert_eq!(bearer_token(&headers("bearer  abc ")).ok(), Some("abc"));
        assert!(matches!(
            bearer_token(&HeaderMap::new()),
            Err(AuthError::MissingToken)
        ));
        for malformed in ["Basic abc", "Bearer "] {
            assert!(matches!(
                bearer_token(&headers(malformed)),
                Err(AuthError::MalformedHeader)
            ));
        }
    }

    #[test]
    fn accesses_print_as_rbac_reads_them() {
        let access = ResourceAccess::new("create", "pods", "team")
            .subresource("portforward")
            .name("web-0");
        assert_eq!(
            access.to_string(),
            r#"create pods/portforward "web-0" in namespace "team""#
        );
        let access = ResourceAccess::new("list", "deployments", "team").group("apps");
        assert_eq!(
            access.to_string(),
            r#"list deployments.apps in namespace "team""#
        );
    }

    #[tokio::test]
    async fn allow_all_lets_anyone_do_anything() {
        let auth = Authenticator::allow_all("anonymous");
        let caller = auth.authenticate(&HeaderMap::new()).await.unwrap();
        assert_eq!(caller.username(), "anonymous");
        assert!(caller.is_unchecked());
        let access = ResourceAccess::new("delete", "secrets", "kube-system");
        assert!(auth.authorize(&caller, &access).await.is_ok());
    }
}
