//! What this process may do itself, asked of the API server before doing it, so that a role
//! narrower than the one its chart grants costs one warning and a metric, not a 403 on every
//! reconcile.
//!
//! * [`allowed`] asks with a `SelfSubjectAccessReview`, which every authenticated user may create
//!   (`system:basic-user`); [`first_denied`] asks for a list, in order.
//! * [`denied_access`] reads the access a 403 answer names.
//! * [`MissingPermissions`] reports what is missing: one warning log per permission when it goes
//!   missing, the `missing_permission{verb,resource,namespace}` gauge, and a sentence for
//!   `/readyz`.
//!
//! # Example
//!
//! ```no_run
//! use k8s_reconcile::auth::ResourceAccess;
//! use k8s_reconcile::permissions::{self, MissingPermissions};
//! use prometheus_client::registry::Registry;
//!
//! # async fn start(client: kube::Client) {
//! let mut registry = Registry::default();
//! let missing = MissingPermissions::register(registry.sub_registry_with_prefix("my_operator"));
//! let events = ResourceAccess::new("create", "events", "team-a").group("events.k8s.io");
//! if let Some(denied) = permissions::first_denied(&client, &[events]).await {
//!     // Warns once and sets `my_operator_missing_permission{...}` to 1.
//!     missing.deny(&denied, "no Events are recorded");
//! }
//! # }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::authorization::v1::{SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::auth::ResourceAccess;

/// Whether this process's own identity may do `access`. `None` when the API server cannot be
/// asked; callers then try and learn from the answer.
pub async fn allowed(client: &kube::Client, access: &ResourceAccess) -> Option<bool> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(access.attributes()),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    match Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
    {
        Ok(answer) => Some(answer.status.is_some_and(|s| s.allowed)),
        Err(error) => {
            tracing::debug!(%access, %error, "cannot ask the API server for access");
            None
        }
    }
}

/// The first of `accesses` that is denied, asking in order.
pub async fn first_denied(
    client: &kube::Client,
    accesses: &[ResourceAccess],
) -> Option<ResourceAccess> {
    for access in accesses {
        if allowed(client, access).await == Some(false) {
            return Some(access.clone());
        }
    }
    None
}

/// The access a 403 answer names (`... cannot patch resource "endpoints" in API group "" in the
/// namespace "default"`): `fallback` with the answer's verb, else `fallback` itself.
pub fn denied_access(message: &str, fallback: &ResourceAccess) -> ResourceAccess {
    message
        .split_once("cannot ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .filter(|v| v.bytes().all(|b| b.is_ascii_lowercase()))
        .map_or_else(|| fallback.clone(), |verb| fallback.clone().verb(verb))
}

/// Labels of `missing_permission`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PermissionLabels {
    verb: String,
    resource: String,
    namespace: String,
}

impl From<&ResourceAccess> for PermissionLabels {
    fn from(access: &ResourceAccess) -> Self {
        let mut resource = access.resource.clone();
        if !access.group.is_empty() {
            resource = format!("{resource}.{}", access.group);
        }
        if let Some(sub) = &access.subresource {
            resource = format!("{resource}/{sub}");
        }
        Self {
            verb: access.verb.clone(),
            resource,
            namespace: access.namespace.clone(),
        }
    }
}

/// The permissions found missing, with what each costs; cheap to clone and share between
/// everything that checks.
#[derive(Debug, Clone)]
pub struct MissingPermissions {
    /// What is missing, and what it means for the user.
    missing: Arc<Mutex<BTreeMap<ResourceAccess, String>>>,
    metric: Family<PermissionLabels, Gauge>,
}

impl MissingPermissions {
    /// Registers `missing_permission{verb,resource,namespace}` in `registry` (give it a
    /// sub-registry with the binary's prefix).
    pub fn register(registry: &mut Registry) -> Self {
        let metric = Family::<PermissionLabels, Gauge>::default();
        registry.register(
            "missing_permission",
            "1 for each RBAC permission this process lacks and works around (see the log and /readyz)",
            metric.clone(),
        );
        Self {
            missing: Arc::default(),
            metric,
        }
    }

    /// Records that `access` is denied; `consequence` says what the process does without it.
    /// Warns once, when it goes missing.
    pub fn deny(&self, access: &ResourceAccess, consequence: &str) {
        let new = self
            .missing
            .lock()
            .map(|mut m| m.insert(access.clone(), consequence.to_owned()).is_none())
            .unwrap_or(false);
        self.metric.get_or_create(&access.into()).set(1);
        if new {
            tracing::warn!(permission = %access, "missing RBAC permission: {access}; {consequence}");
        }
    }

    /// Records that `access` is granted again.
    pub fn grant(&self, access: &ResourceAccess) {
        let was_missing = self
            .missing
            .lock()
            .map(|mut m| m.remove(access).is_some())
            .unwrap_or(false);
        if was_missing {
            self.metric.get_or_create(&access.into()).set(0);
            tracing::info!(permission = %access, "RBAC permission granted now: {access}");
        }
    }

    /// A sentence for `/readyz`, empty when nothing is missing.
    pub fn summary(&self) -> String {
        let Ok(missing) = self.missing.lock() else {
            return String::new();
        };
        missing
            .iter()
            .map(|(access, consequence)| format!("missing permission {access}: {consequence}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forbidden_message_names_the_verb() {
        let fallback = ResourceAccess::new("patch", "endpoints", "default").name("kubernetes");
        let message = r#"endpoints "kubernetes" is forbidden: User "system:serviceaccount:x:y" cannot get resource "endpoints" in API group "" in the namespace "default""#;
        assert_eq!(
            denied_access(message, &fallback).to_string(),
            r#"get endpoints "kubernetes" in namespace "default""#
        );
        assert_eq!(denied_access("nope", &fallback), fallback);
    }

    #[test]
    fn missing_permissions_are_reported_once_and_cleared() {
        let mut registry = Registry::default();
        let missing = MissingPermissions::register(registry.sub_registry_with_prefix("x"));
        let events = ResourceAccess::new("create", "events", "ns").group("events.k8s.io");
        missing.deny(&events, "no Events are recorded");
        missing.deny(&events, "no Events are recorded");
        assert_eq!(
            missing.summary(),
            r#"missing permission create events.events.k8s.io in namespace "ns": no Events are recorded"#
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"x_missing_permission{verb="create",resource="events.events.k8s.io",namespace="ns"} 1"#),
            "{text}"
        );
        missing.grant(&events);
        assert_eq!(missing.summary(), "");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"namespace="ns"} 0"#), "{text}");
    }
}
