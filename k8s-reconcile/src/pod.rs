//! Pod spec pieces that every controller creating Pods writes the same way: the security contexts
//! Pod Security `restricted` asks for, environment variables from Secrets and from the Pod's own
//! fields, Secret keys as files, and HTTP probes on a named port.
//!
//! ```
//! use k8s_openapi::api::core::v1::{Container, PodSpec};
//! use k8s_reconcile::pod;
//!
//! let spec = PodSpec {
//!     security_context: Some(pod::restricted_pod_security_context()),
//!     containers: vec![Container {
//!         name: "agent".to_owned(),
//!         security_context: Some(pod::restricted_security_context()),
//!         env: Some(vec![
//!             pod::secret_env("TOKEN", "agent-token", "token"),
//!             pod::field_env("POD_NAME", "metadata.name"),
//!         ]),
//!         readiness_probe: Some(pod::http_probe("/readyz", "health")),
//!         ..Container::default()
//!     }],
//!     ..PodSpec::default()
//! };
//! assert_eq!(spec.security_context.and_then(|s| s.run_as_user), Some(pod::NONROOT_UID));
//! ```

use k8s_openapi::api::core::v1::{
    Capabilities, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath, ObjectFieldSelector,
    PodSecurityContext, Probe, SeccompProfile, SecretKeySelector, SecretProjection,
    SecurityContext, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The user and group our images run as (distroless `nonroot`).
pub const NONROOT_UID: i64 = 65532;

fn runtime_default_seccomp() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".to_owned(),
        localhost_profile: None,
    }
}

/// A Pod's security context at the `restricted` level: non-root as [`NONROOT_UID`], the
/// runtime's default seccomp profile.
pub fn restricted_pod_security_context() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NONROOT_UID),
        run_as_group: Some(NONROOT_UID),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..PodSecurityContext::default()
    }
}

/// A container's security context at the `restricted` level, with a read-only root filesystem:
/// no privilege escalation, every capability dropped, non-root, default seccomp profile.
pub fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..SecurityContext::default()
    }
}

/// Environment variable `name` from key `key` of Secret `secret`.
pub fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_owned(),
                key: key.to_owned(),
                optional: None,
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// Environment variable `name` from the Pod's own field `field_path` (e.g. `metadata.name`).
pub fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_owned(),
                api_version: None,
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// Key `key` of Secret `secret` as file `path` of a projected volume.
pub fn secret_file(secret: &str, key: &str, path: &str) -> VolumeProjection {
    VolumeProjection {
        secret: Some(SecretProjection {
            name: secret.to_owned(),
            items: Some(vec![KeyToPath {
                key: key.to_owned(),
                path: path.to_owned(),
                ..KeyToPath::default()
            }]),
            optional: None,
        }),
        ..VolumeProjection::default()
    }
}

/// An HTTP GET probe of `path` on the container port named `port`.
pub fn http_probe(path: &str, port: &str) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String(port.to_owned()),
            ..HTTPGetAction::default()
        }),
        ..Probe::default()
    }
}
