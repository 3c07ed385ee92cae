//! Owned Deployments: a config hash that rolls the pods when inputs change, and availability as a
//! condition.

use k8s_openapi::api::apps::v1::Deployment;
use sha2::{Digest as _, Sha256};

use crate::conditions::{ConditionUpdate, Status};

/// Pod-template annotation carrying the hash of a Deployment's inputs.
pub const CONFIG_HASH_ANNOTATION: &str = "kube-netkit.io/config-hash";

/// A hex SHA-256 over `inputs` (each length-prefixed, so `["ab", "c"]` and `["a", "bc"]` differ).
pub fn config_hash<I, B>(inputs: I) -> String
where
    I: IntoIterator<Item = B>,
    B: AsRef<[u8]>,
{
    let mut hasher = Sha256::new();
    for input in inputs {
        let input = input.as_ref();
        hasher.update((input.len() as u64).to_be_bytes());
        hasher.update(input);
    }
    hex::encode(&hasher.finalize()[..16])
}

/// Sets [`CONFIG_HASH_ANNOTATION`] on the pod template, so the pods are replaced whenever the
/// hash changes (a rotated Secret, a new ConfigMap) even though the Deployment spec itself does not
/// reference their content.
pub fn set_config_hash(deployment: &mut Deployment, hash: &str) {
    deployment
        .spec
        .template
        .metadata
        .get_or_insert_with(Default::default)
        .annotations
        .get_or_insert_with(Default::default)
        .insert(CONFIG_HASH_ANNOTATION.to_owned(), hash.to_owned());
}

/// The hash on the pod template, if any.
pub fn config_hash_of(deployment: &Deployment) -> Option<&str> {
    deployment
        .spec
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(CONFIG_HASH_ANNOTATION)
        .map(String::as_str)
}

/// A condition of type `condition_type` from the Deployment's status: `True` (reason `Available`)
/// when its `Available` condition is true, the rollout has been observed, and every desired replica
/// is ready; `False` with reason `Progressing` (or the Deployment's own reason) otherwise.
pub fn availability_condition(deployment: &Deployment, condition_type: &str) -> ConditionUpdate {
    let desired = deployment.spec.replicas.unwrap_or(1);
    let status = deployment.status.clone().unwrap_or_default();
    let ready = status.ready_replicas.unwrap_or(0);
    let observed = status.observed_generation >= deployment.metadata.generation;
    let available = status
        .conditions
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|c| c.type_.as_deref() == Some("Available"));
    let name = deployment.metadata.name.as_deref().unwrap_or_default();
    match available {
        Some(c) if c.status.as_deref() == Some("True") && observed && ready >= desired => {
            ConditionUpdate::new(condition_type, Status::True, "Available").message(format!(
                "Deployment {name} has {ready}/{desired} ready replicas"
            ))
        }
        Some(c) if c.status.as_deref() == Some("False") => ConditionUpdate::new(
            condition_type,
            Status::False,
            c.reason.clone().unwrap_or_else(|| "Unavailable".to_owned()),
        )
        .message(format!(
            "Deployment {name}: {} ({ready}/{desired} ready)",
            c.message.clone().unwrap_or_default()
        )),
        _ => ConditionUpdate::new(condition_type, Status::False, "Progressing").message(format!(
            "Deployment {name} has {ready}/{desired} ready replicas"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{DeploymentCondition, DeploymentSpec, DeploymentStatus};

    fn deployment(available: Option<&str>, ready: i32) -> Deployment {
        Deployment {
            metadata: kube::api::ObjectMeta {
                name: Some("agent".into()),
                generation: Some(2),
                ..Default::default()
            },
            spec: DeploymentSpec {
                replicas: Some(1),
                ..Default::default()
            },
            status: Some(DeploymentStatus {
                observed_generation: Some(2),
                ready_replicas: Some(ready),
                conditions: available.map(|s| {
                    vec![DeploymentCondition {
                        type_: Some("Available".into()),
                        status: Some(s.into()),
                        reason: Some("MinimumReplicasUnavailable".into()),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn hash_depends_on_every_input_and_its_boundaries() {
        assert_eq!(config_hash(["a", "b"]), config_hash(["a", "b"]));
        assert_ne!(config_hash(["ab", "c"]), config_hash(["a", "bc"]));
        assert_ne!(config_hash(["token-1"]), config_hash(["token-2"]));
    }

    #[test]
    fn hash_is_set_on_the_pod_template() {
        let mut d = Deployment::default();
        assert_eq!(config_hash_of(&d), None);
        set_config_hash(&mut d, "abc");
        assert_eq!(config_hash_of(&d), Some("abc"));
    }

    #[test]
    fn availability_follows_the_deployment_status() {
        let c = availability_condition(&deployment(Some("True"), 1), "AgentReady");
        assert_eq!((c.status, c.reason.as_str()), (Status::True, "Available"));
        let c = availability_condition(&deployment(Some("False"), 0), "AgentReady");
        assert_eq!(
            (c.status, c.reason.as_str()),
            (Status::False, "MinimumReplicasUnavailable")
        );
        let c = availability_condition(&deployment(None, 0), "AgentReady");
        assert_eq!(
            (c.status, c.reason.as_str()),
            (Status::False, "Progressing")
        );
        // Available but not all replicas ready yet: still progressing.
        let c = availability_condition(&deployment(Some("True"), 0), "AgentReady");
        assert_eq!(c.status, Status::False);
    }
}
