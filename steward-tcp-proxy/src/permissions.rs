//! What steward may do, asked of the API server before doing it, so a narrower role than ours
//! (the original's ClusterRole has no Endpoints and no `events.k8s.io`) costs one warning, not a
//! 403 on every reconcile.
//!
//! [`Access::allowed`] asks with a `SelfSubjectAccessReview`, which every authenticated user may
//! create (`system:basic-user`). [`MissingPermissions`] reports what is missing: one warning log
//! per permission when it goes missing, the `steward_missing_permission` metric, and a sentence
//! for `/readyz`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// One verb on one resource in one namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Access {
    /// E.g. `patch`.
    pub verb: String,
    /// The API group, `""` for the core group.
    pub group: String,
    /// E.g. `endpoints`.
    pub resource: String,
    /// The namespace.
    pub namespace: String,
    /// The object's name, for rules limited by `resourceNames`.
    pub name: Option<String>,
}

impl fmt::Display for Access {
    /// E.g. `patch endpoints "kubernetes" in namespace default`,
    /// `create events.events.k8s.io in namespace x`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if let Some(name) = &self.name {
            write!(f, " {name:?}")?;
        }
        write!(f, " in namespace {}", self.namespace)
    }
}

impl Access {
    /// `verb` on `resource` of `group` in `namespace`.
    pub fn new(verb: &str, group: &str, resource: &str, namespace: &str) -> Self {
        Self {
            verb: verb.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            namespace: namespace.to_owned(),
            name: None,
        }
    }

    /// The object named `name` only.
    #[must_use]
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Whether steward's own identity may do this. `None` when the API server cannot be asked;
    /// callers then try and learn from the answer.
    pub async fn allowed(&self, client: &kube::Client) -> Option<bool> {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(self.namespace.clone()),
                    verb: Some(self.verb.clone()),
                    group: Some(self.group.clone()),
                    resource: Some(self.resource.clone()),
                    name: self.name.clone(),
                    ..ResourceAttributes::default()
                }),
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
                tracing::debug!(access = %self, %error, "cannot ask the API server for access");
                None
            }
        }
    }

    /// The first of `accesses` that is denied, asking in order.
    pub async fn first_denied(client: &kube::Client, accesses: &[Access]) -> Option<Access> {
        for access in accesses {
            if access.allowed(client).await == Some(false) {
                return Some(access.clone());
            }
        }
        None
    }

    /// The access a 403 answer names (`... cannot patch resource "endpoints" in API group "" in
    /// the namespace "default"`), else `fallback`.
    pub fn from_forbidden(message: &str, fallback: &Access) -> Access {
        let verb = message
            .split_once("cannot ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .filter(|v| v.bytes().all(|b| b.is_ascii_lowercase()));
        match verb {
            Some(verb) => Access {
                verb: verb.to_owned(),
                ..fallback.clone()
            },
            None => fallback.clone(),
        }
    }
}

/// Labels of `steward_missing_permission`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PermissionLabels {
    verb: String,
    resource: String,
    namespace: String,
}

/// The permissions found missing, with what each costs; shared by everything that checks.
#[derive(Debug, Clone)]
pub struct MissingPermissions {
    /// What is missing, and what it means for the user.
    missing: Arc<Mutex<BTreeMap<Access, String>>>,
    metric: Family<PermissionLabels, Gauge>,
}

impl MissingPermissions {
    /// Registers `steward_missing_permission{verb,resource,namespace}`.
    pub fn register(registry: &mut Registry) -> Self {
        let metric = Family::<PermissionLabels, Gauge>::default();
        registry.register(
            "steward_missing_permission",
            "1 for each permission steward lacks and works around (see the log and /readyz)",
            metric.clone(),
        );
        Self {
            missing: Arc::default(),
            metric,
        }
    }

    fn labels(access: &Access) -> PermissionLabels {
        PermissionLabels {
            verb: access.verb.clone(),
            resource: if access.group.is_empty() {
                access.resource.clone()
            } else {
                format!("{}.{}", access.resource, access.group)
            },
            namespace: access.namespace.clone(),
        }
    }

    /// Records that `access` is denied; `consequence` says what steward does without it. Warns
    /// once, when it goes missing.
    pub fn deny(&self, access: &Access, consequence: &str) {
        let new = self
            .missing
            .lock()
            .map(|mut m| m.insert(access.clone(), consequence.to_owned()).is_none())
            .unwrap_or(false);
        self.metric.get_or_create(&Self::labels(access)).set(1);
        if new {
            tracing::warn!(
                permission = %access,
                "missing RBAC permission: {access}; {consequence}"
            );
        }
    }

    /// Records that `access` is granted again.
    pub fn grant(&self, access: &Access) {
        let was_missing = self
            .missing
            .lock()
            .map(|mut m| m.remove(access).is_some())
            .unwrap_or(false);
        if was_missing {
            self.metric.get_or_create(&Self::labels(access)).set(0);
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
        let fallback = Access::new("patch", "", "endpoints", "default").named("kubernetes");
        let message = r#"endpoints "kubernetes" is forbidden: User "system:serviceaccount:x:y" cannot get resource "endpoints" in API group "" in the namespace "default""#;
        let access = Access::from_forbidden(message, &fallback);
        assert_eq!(
            access.to_string(),
            "get endpoints \"kubernetes\" in namespace default"
        );
        assert_eq!(Access::from_forbidden("nope", &fallback), fallback);
    }

    #[test]
    fn missing_permissions_are_reported_once_and_cleared() {
        let mut registry = Registry::default();
        let missing = MissingPermissions::register(&mut registry);
        let events = Access::new("create", "events.k8s.io", "events", "ns");
        missing.deny(&events, "no Events are recorded");
        missing.deny(&events, "no Events are recorded");
        assert_eq!(
            missing.summary(),
            "missing permission create events.events.k8s.io in namespace ns: no Events are recorded"
        );
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"steward_missing_permission{verb="create",resource="events.events.k8s.io",namespace="ns"} 1"#),
            "{text}"
        );
        missing.grant(&events);
        assert_eq!(missing.summary(), "");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"namespace="ns"} 0"#), "{text}");
    }
}
