//! rstream-operator: expose Kubernetes Services through rstream tunnels.
//!
//! * [`api`]: the `tunnels.rstream.io/v1alpha1` CRDs ([`crds`] gives their definitions).
//! * [`manager`]: the controllers of the `rstream-operator` binary.
//! * [`agent`]: the per-tunnel data plane of the `rstream-agent` binary.
//! * [`agent_config`]: the agent configuration file the manager renders.
//! * [`transport`]: the connection's transport options the agent cannot honour, and its HTTP proxy.
//! * [`names`]: names and labels of the objects created per tunnel.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod agent;
pub mod agent_config;
pub mod api;
pub mod manager;
pub mod names;
pub mod status;
pub mod transport;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt as _;

/// The CustomResourceDefinitions of this operator, in a stable order.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![api::RstreamConnection::crd(), api::RstreamTunnel::crd()]
}

/// The CRD files of `config/crd/` (the chart's `templates/crds/` wraps the same YAML, written
/// by `cargo xtask crds`): `(file name, YAML)`, the YAML being exactly
/// `serde_yaml_ng::to_string` of each CRD, the name `<group>_<plural>.yaml`.
pub fn crd_files() -> Result<Vec<(String, String)>, serde_yaml_ng::Error> {
    crds()
        .into_iter()
        .map(|crd| {
            let name = format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural);
            Ok((name, serde_yaml_ng::to_string(&crd)?))
        })
        .collect()
}

/// Directories (relative to the crate) that hold the CRD files.
pub const CRD_DIRS: [&str; 1] = ["config/crd"];
