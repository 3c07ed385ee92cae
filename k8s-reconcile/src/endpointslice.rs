//! EndpointSlices (and optionally core/v1 Endpoints) for a Service whose endpoints we choose.
//!
//! [`ServiceEndpoints`] describes the addresses and ports; [`desired_slices`] and
//! [`desired_endpoints`] turn it into objects (pure functions), and [`apply_service_endpoints`]
//! writes them through an [`Applier`]:
//!
//! * one slice per IP family: `addressType` is `IPv4` or `IPv6` from the addresses. The primary slice
//!   (IPv4 when there is any IPv4 address) is named after the Service, as kube-apiserver names the
//!   `kubernetes` slice; the secondary family's slice is `<service>-ipv6` (or `-ipv4`);
//! * labels `kubernetes.io/service-name` and `endpointslice.kubernetes.io/managed-by`;
//! * endpoint conditions `ready`, `serving`, `terminating`;
//! * `addressType` is immutable, so a slice whose family changed is deleted and re-created;
//! * optionally, every other slice of the Service is deleted (kube-proxy merges all of them);
//! * optionally, the matching `Endpoints` is written with `endpointslice.kubernetes.io/skip-mirror`,
//!   so Endpoints-only clients agree and the mirroring controller adds no slice of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{
    EndpointAddress, EndpointPort as CoreEndpointPort, EndpointSubset, Endpoints,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams};

use crate::Error;
use crate::apply::Applier;

/// Label naming the Service a slice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label naming the controller that manages a slice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Label that keeps the EndpointSlice mirroring controller away from an Endpoints object.
pub const SKIP_MIRROR_LABEL: &str = "endpointslice.kubernetes.io/skip-mirror";

/// One address of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEndpoint {
    /// The address.
    pub ip: IpAddr,
    /// Ready to receive traffic.
    pub ready: bool,
    /// Serving (may be true while terminating).
    pub serving: bool,
    /// Terminating.
    pub terminating: bool,
    /// The node, if known.
    pub node_name: Option<String>,
}

impl ServiceEndpoint {
    /// A ready, serving, non-terminating address.
    pub fn ready(ip: IpAddr) -> Self {
        Self {
            ip,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
        }
    }
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// The port name (must match the Service's port name).
    pub name: Option<String>,
    /// The port number.
    pub port: i32,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
}

impl ServicePort {
    /// A TCP port.
    pub fn tcp(name: impl Into<String>, port: i32) -> Self {
        Self {
            name: Some(name.into()),
            port,
            protocol: "TCP".to_owned(),
        }
    }
}

/// The endpoints of one Service, as we want them published.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceEndpoints {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub service_name: String,
    /// The value of `endpointslice.kubernetes.io/managed-by`.
    pub managed_by: String,
    /// The addresses.
    pub endpoints: Vec<ServiceEndpoint>,
    /// The ports.
    pub ports: Vec<ServicePort>,
    /// Owner references for the written objects.
    pub owner_references: Vec<OwnerReference>,
}

/// What [`apply_service_endpoints`] should do besides writing the slices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointsOptions {
    /// Delete every other slice labelled with the Service's name.
    pub delete_other_slices: bool,
    /// Also write the core/v1 Endpoints object, labelled skip-mirror.
    pub write_endpoints: bool,
}

/// What [`apply_service_endpoints`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointsOutcome {
    /// Objects created or patched (slices and Endpoints).
    pub written: usize,
    /// Of those, the ones written because someone else had changed them since our last write.
    pub repaired: usize,
    /// The other field managers seen on the repaired objects.
    pub drifted_by: BTreeSet<String>,
    /// Slices deleted (stale ones, and ones re-created for a new address family).
    pub deleted: usize,
}

impl EndpointsOutcome {
    fn count<K>(&mut self, applied: &crate::Applied<K>) {
        if applied.written() {
            self.written += 1;
        }
        if applied.repaired() {
            self.repaired += 1;
            self.drifted_by.extend(applied.drifted_by().iter().cloned());
        }
    }

    /// Whether nothing was written or deleted.
    pub fn unchanged(&self) -> bool {
        self.written == 0 && self.deleted == 0
    }
}

/// The slices for `spec`, primary family first.
pub fn desired_slices(spec: &ServiceEndpoints) -> Vec<EndpointSlice> {
    let (v4, v6): (Vec<&ServiceEndpoint>, Vec<&ServiceEndpoint>) =
        spec.endpoints.iter().partition(|e| e.ip.is_ipv4());
    let mut families = Vec::new();
    if !v4.is_empty() || v6.is_empty() {
        families.push(("IPv4", v4));
    }
    if !v6.is_empty() {
        families.push(("IPv6", v6));
    }
    families
        .into_iter()
        .enumerate()
        .map(|(index, (family, endpoints))| {
            let endpoints = endpoints.into_iter().map(slice_endpoint).collect();
            with_endpoints(
                EndpointSlice {
                    metadata: ObjectMeta {
                        name: Some(slice_name(&spec.service_name, family, index == 0)),
                        namespace: Some(spec.namespace.clone()),
                        labels: Some(BTreeMap::from([
                            (SERVICE_NAME_LABEL.to_owned(), spec.service_name.clone()),
                            (MANAGED_BY_LABEL.to_owned(), spec.managed_by.clone()),
                        ])),
                        owner_references: non_empty(spec.owner_references.clone()),
                        ..ObjectMeta::default()
                    },
                    address_type: family.to_owned(),
                    ports: Some(
                        spec.ports
                            .iter()
                            .map(|p| EndpointPort {
                                name: p.name.clone(),
                                port: Some(p.port),
                                protocol: Some(p.protocol.clone()),
                                app_protocol: None,
                            })
                            .collect(),
                    ),
                    ..EndpointSlice::default()
                },
                endpoints,
            )
        })
        .collect()
}

/// `slice` with `endpoints`: the field is a list up to Kubernetes 1.35's API types and optional
/// from 1.36 on; the final binary's k8s-openapi version decides which.
fn with_endpoints(mut slice: EndpointSlice, endpoints: Vec<Endpoint>) -> EndpointSlice {
    k8s_openapi::k8s_if_le_1_35! {
        slice.endpoints = endpoints;
    }
    k8s_openapi::k8s_if_ge_1_36! {
        slice.endpoints = Some(endpoints);
    }
    slice
}

/// The endpoints of `slice`, whichever shape the field has (see [`with_endpoints`]).
// Each branch returns, since only one of them is compiled.
#[allow(clippy::needless_return)]
fn endpoints_of(slice: &EndpointSlice) -> &[Endpoint] {
    k8s_openapi::k8s_if_le_1_35! {
        return &slice.endpoints;
    }
    k8s_openapi::k8s_if_ge_1_36! {
        return slice.endpoints.as_deref().unwrap_or_default();
    }
}

/// The core/v1 Endpoints for `spec`: ready addresses in `addresses`, the others in
/// `notReadyAddresses`, labelled skip-mirror.
pub fn desired_endpoints(spec: &ServiceEndpoints) -> Endpoints {
    let address = |e: &ServiceEndpoint| EndpointAddress {
        ip: e.ip.to_string(),
        node_name: e.node_name.clone(),
        ..EndpointAddress::default()
    };
    let ready: Vec<EndpointAddress> = spec
        .endpoints
        .iter()
        .filter(|e| e.ready)
        .map(address)
        .collect();
    let not_ready: Vec<EndpointAddress> = spec
        .endpoints
        .iter()
        .filter(|e| !e.ready)
        .map(address)
        .collect();
    let subsets = if spec.endpoints.is_empty() {
        None
    } else {
        Some(vec![EndpointSubset {
            addresses: non_empty(ready),
            not_ready_addresses: non_empty(not_ready),
            ports: Some(
                spec.ports
                    .iter()
                    .map(|p| CoreEndpointPort {
                        name: p.name.clone(),
                        port: p.port,
                        protocol: Some(p.protocol.clone()),
                        app_protocol: None,
                    })
                    .collect(),
            ),
        }])
    };
    Endpoints {
        metadata: ObjectMeta {
            name: Some(spec.service_name.clone()),
            namespace: Some(spec.namespace.clone()),
            labels: Some(BTreeMap::from([(
                SKIP_MIRROR_LABEL.to_owned(),
                "true".to_owned(),
            )])),
            owner_references: non_empty(spec.owner_references.clone()),
            ..ObjectMeta::default()
        },
        subsets,
    }
}

/// Writes the slices (and optionally Endpoints) of `spec`; a steady state makes no write call.
pub async fn apply_service_endpoints(
    applier: &Applier,
    spec: &ServiceEndpoints,
    options: EndpointsOptions,
) -> Result<EndpointsOutcome, Error> {
    let api: Api<EndpointSlice> = Api::namespaced(applier.client().clone(), &spec.namespace);
    let mut outcome = EndpointsOutcome::default();
    let slices = desired_slices(spec);
    let mut keep = BTreeSet::new();
    for slice in &slices {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let applied = match applier.apply(slice).await {
            // addressType is immutable: a family change needs a new slice.
            Err(Error::Kube(kube::Error::Api(status)))
                if status.code == 422 && status.message.contains("addressType") =>
            {
                delete_ignoring_missing(&api, &name).await?;
                outcome.deleted += 1;
                applier.apply(slice).await?
            }
            other => other?,
        };
        outcome.count(&applied);
        keep.insert(name);
    }
    if options.delete_other_slices {
        let selector = format!("{SERVICE_NAME_LABEL}={}", spec.service_name);
        outcome.deleted += applier
            .prune::<EndpointSlice>(&spec.namespace, &selector, &keep)
            .await?;
    }
    if options.write_endpoints {
        outcome.count(&applier.apply(&desired_endpoints(spec)).await?);
    }
    Ok(outcome)
}

async fn delete_ignoring_missing(api: &Api<EndpointSlice>, name: &str) -> Result<(), Error> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(Error::Kube(err)),
    }
}

fn slice_name(service: &str, family: &str, primary: bool) -> String {
    if primary {
        service.to_owned()
    } else {
        format!("{service}-{}", family.to_ascii_lowercase())
    }
}

fn slice_endpoint(e: &ServiceEndpoint) -> Endpoint {
    Endpoint {
        addresses: vec![e.ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(e.ready),
            serving: Some(e.serving),
            terminating: Some(e.terminating),
        }),
        node_name: e.node_name.clone(),
        ..Endpoint::default()
    }
}

fn non_empty<T>(items: Vec<T>) -> Option<Vec<T>> {
    if items.is_empty() { None } else { Some(items) }
}

/// One ready endpoint of a Service port, read from its EndpointSlices.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadyEndpoint {
    /// The endpoint's address (the first of its addresses, as kube-proxy uses).
    pub ip: IpAddr,
    /// The port of its slice.
    pub port: u16,
    /// The node it runs on, if the slice says.
    pub node_name: Option<String>,
}

/// The ready endpoints of the port named `port_name` (`None`: each slice's first port) in
/// `slices`, sorted and without duplicates. An endpoint without a `ready` condition counts as
/// ready, as the API defines; a slice without that port contributes nothing.
pub fn ready_endpoints<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    port_name: Option<&str>,
) -> Vec<ReadyEndpoint> {
    let mut ready = Vec::new();
    for slice in slices {
        let mut ports = slice.ports.iter().flatten();
        let port = match port_name {
            Some(name) => ports.find(|p| p.name.as_deref() == Some(name)),
            None => ports.next(),
        };
        let Some(port) = port
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for endpoint in endpoints_of(slice) {
            let is_ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            let Some(ip) = endpoint.addresses.first().and_then(|a| a.parse().ok()) else {
                continue;
            };
            if is_ready {
                ready.push(ReadyEndpoint {
                    ip,
                    port,
                    node_name: endpoint.node_name.clone(),
                });
            }
        }
    }
    ready.sort();
    ready.dedup_by(|a, b| a.ip == b.ip && a.port == b.port);
    ready
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(port: (&str, i32), endpoints: &[(&str, Option<bool>)]) -> EndpointSlice {
        EndpointSlice {
            ports: Some(vec![EndpointPort {
                name: Some(port.0.to_owned()),
                port: Some(port.1),
                ..EndpointPort::default()
            }]),
            endpoints: Some(
                endpoints
                    .iter()
                    .map(|(ip, ready)| Endpoint {
                        addresses: vec![(*ip).to_owned()],
                        conditions: Some(EndpointConditions {
                            ready: *ready,
                            ..EndpointConditions::default()
                        }),
                        ..Endpoint::default()
                    })
                    .collect(),
            ),
            ..EndpointSlice::default()
        }
    }

    #[test]
    fn ready_endpoints_of_a_named_port() {
        let slices = [
            slice(
                ("http", 8080),
                &[("10.0.0.2", Some(true)), ("10.0.0.1", None)],
            ),
            slice(
                ("http", 8080),
                &[("10.0.0.3", Some(false)), ("10.0.0.1", Some(true))],
            ),
            slice(("debug", 9000), &[("10.0.0.9", Some(true))]),
        ];
        let found: Vec<(String, u16)> = ready_endpoints(&slices, Some("http"))
            .into_iter()
            .map(|e| (e.ip.to_string(), e.port))
            .collect();
        assert_eq!(
            found,
            [("10.0.0.1".to_owned(), 8080), ("10.0.0.2".to_owned(), 8080)]
        );
        let first_ports = ready_endpoints(&slices, None);
        assert_eq!(first_ports.len(), 3, "{first_ports:?}");
    }

    fn spec(ips: &[&str]) -> ServiceEndpoints {
        ServiceEndpoints {
            namespace: "default".into(),
            service_name: "kubernetes".into(),
            managed_by: "steward-tcp-proxy".into(),
            endpoints: ips
                .iter()
                .filter_map(|ip| ip.parse().ok())
                .map(ServiceEndpoint::ready)
                .collect(),
            ports: vec![ServicePort::tcp("https", 6443)],
            owner_references: Vec::new(),
        }
    }

    #[test]
    fn single_stack_ipv4_is_one_slice_named_after_the_service() {
        let slices = desired_slices(&spec(&["10.0.0.7", "10.0.0.8"]));
        assert_eq!(slices.len(), 1);
        let s = &slices[0];
        assert_eq!(s.metadata.name.as_deref(), Some("kubernetes"));
        assert_eq!(s.address_type, "IPv4");
        let labels = s.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[SERVICE_NAME_LABEL], "kubernetes");
        assert_eq!(labels[MANAGED_BY_LABEL], "steward-tcp-proxy");
        let endpoints = s.endpoints.clone().unwrap_or_default();
        assert_eq!(endpoints.len(), 2);
        let conditions = endpoints[0].conditions.clone().unwrap_or_default();
        assert_eq!(conditions.ready, Some(true));
        assert_eq!(conditions.serving, Some(true));
        assert_eq!(conditions.terminating, Some(false));
        let ports = s.ports.clone().unwrap_or_default();
        assert_eq!(ports[0].name.as_deref(), Some("https"));
        assert_eq!(ports[0].port, Some(6443));
        assert_eq!(ports[0].protocol.as_deref(), Some("TCP"));
    }

    #[test]
    fn dual_stack_gets_a_slice_per_family() {
        let slices = desired_slices(&spec(&["fd00::1", "10.0.0.7"]));
        let names: Vec<_> = slices
            .iter()
            .map(|s| {
                (
                    s.metadata.name.clone().unwrap_or_default(),
                    s.address_type.clone(),
                )
            })
            .collect();
        assert_eq!(
            names,
            vec![
                ("kubernetes".to_owned(), "IPv4".to_owned()),
                ("kubernetes-ipv6".to_owned(), "IPv6".to_owned())
            ]
        );
    }

    #[test]
    fn ipv6_only_primary_slice_is_ipv6() {
        let slices = desired_slices(&spec(&["fd00::1"]));
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].address_type, "IPv6");
        assert_eq!(slices[0].metadata.name.as_deref(), Some("kubernetes"));
    }

    #[test]
    fn endpoints_split_ready_and_not_ready_and_skip_mirroring() {
        let mut s = spec(&["10.0.0.7", "10.0.0.8"]);
        s.endpoints[1].ready = false;
        let e = desired_endpoints(&s);
        let labels = e.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[SKIP_MIRROR_LABEL], "true");
        let subset = &e.subsets.unwrap_or_default()[0];
        assert_eq!(
            subset.addresses.clone().unwrap_or_default()[0].ip,
            "10.0.0.7"
        );
        assert_eq!(
            subset.not_ready_addresses.clone().unwrap_or_default()[0].ip,
            "10.0.0.8"
        );
    }
}
