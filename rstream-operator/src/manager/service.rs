//! A Service as the way in: a Service of type `LoadBalancer` whose `spec.loadBalancerClass` is the
//! operator's ([`LOAD_BALANCER_CLASS`] by default) gets a tunnel, as a cloud's load balancer
//! controller gives such a Service a load balancer.
//!
//! The manager applies an RstreamTunnel of the Service's name, in its namespace, owned by the
//! Service (deleting the Service deletes the tunnel), and writes the tunnel's public address into
//! the Service's `status.loadBalancer.ingress`. A condition of type [`CONDITION`] on the Service
//! says how far it got, and why not when something is wrong: the manager has no right to write
//! events outside its own namespace. Annotations choose what the tunnel's defaults do not:
//! [`PORT_ANNOTATION`], [`PROTOCOL_ANNOTATION`] and [`CONNECTION_ANNOTATION`]. A bad annotation,
//! or a tunnel of that name the Service does not own, changes nothing but that condition.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{LoadBalancerIngress, PortStatus, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::apply::controller_owner_ref;
use k8s_reconcile::{Action, Context, Reconciler};
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::{ObjectRef, Store};

use super::ManagerError;
use crate::api::{ConnectionRef, RstreamTunnel, RstreamTunnelSpec, TunnelProtocol};

/// The `spec.loadBalancerClass` the manager serves by default (`--load-balancer-class`).
pub const LOAD_BALANCER_CLASS: &str = "tunnels.rstream.io/rstream";
/// Which Service port the tunnel forwards to, by name or number (default: the first).
pub const PORT_ANNOTATION: &str = "tunnels.rstream.io/port";
/// The tunnel's edge protocol (default: the tunnel's, `http`).
pub const PROTOCOL_ANNOTATION: &str = "tunnels.rstream.io/protocol";
/// The RstreamConnection to use (default: the tunnel's, `default`).
pub const CONNECTION_ANNOTATION: &str = "tunnels.rstream.io/connection";
/// Label of a tunnel made for a Service: the Service's name.
pub const SERVICE_LABEL: &str = "tunnels.rstream.io/service";
/// The condition the manager keeps on such a Service.
pub const CONDITION: &str = "tunnels.rstream.io/Tunnel";
/// Name of the Service controller (its metrics and logs).
pub const SERVICE_CONTROLLER: &str = "service";

/// Reasons of [`CONDITION`].
pub mod reasons {
    /// The tunnel has a public address, now in `status.loadBalancer.ingress`.
    pub const ADDRESS_ASSIGNED: &str = "AddressAssigned";
    /// The tunnel is applied and has no public address yet (see the RstreamTunnel's conditions).
    pub const WAITING_FOR_ADDRESS: &str = "WaitingForAddress";
    /// An annotation cannot be honoured; the message says which and why.
    pub const INVALID_ANNOTATION: &str = "InvalidAnnotation";
    /// An RstreamTunnel of the Service's name exists and belongs to someone else.
    pub const NAME_TAKEN: &str = "TunnelNameTaken";
    /// The API server refused the tunnel; the message gives its answer.
    pub const TUNNEL_REFUSED: &str = "TunnelRefused";
}

/// Reconciles the Services of one load balancer class.
#[derive(Clone)]
pub struct ServiceReconciler {
    /// The `spec.loadBalancerClass` served.
    pub class: String,
    /// The RstreamTunnels the manager watches (to find a Service's tunnel without a request).
    pub tunnels: Store<RstreamTunnel>,
}

impl std::fmt::Debug for ServiceReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceReconciler")
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl ServiceReconciler {
    /// Whether `svc` asks this manager for a tunnel.
    pub fn serves(&self, svc: &Service) -> bool {
        svc.spec.as_ref().is_some_and(|spec| {
            spec.type_.as_deref() == Some("LoadBalancer")
                && spec.load_balancer_class.as_deref() == Some(self.class.as_str())
        })
    }

    /// The tunnel of `svc`'s name in the cache, and whether `svc` controls it.
    fn existing(&self, svc: &Service) -> Option<(Arc<RstreamTunnel>, bool)> {
        let key = ObjectRef::new(&svc.name_any()).within(&svc.namespace().unwrap_or_default());
        let tunnel = self.tunnels.get(&key)?;
        let ours = controlled_by(&tunnel, svc);
        Some((tunnel, ours))
    }
}

fn controlled_by(tunnel: &RstreamTunnel, svc: &Service) -> bool {
    tunnel
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == svc.metadata.uid.as_ref())
}

/// The RstreamTunnel `svc` asks for, or why its annotations cannot be honoured.
pub fn desired_tunnel(svc: &Service) -> Result<RstreamTunnel, String> {
    let name = svc.name_any();
    let annotations = svc.annotations();
    let ports = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_deref())
        .unwrap_or_default();
    let port = chosen_port(ports, annotations.get(PORT_ANNOTATION).map(String::as_str))?;
    let protocol = match annotations.get(PROTOCOL_ANNOTATION) {
        Some(text) => Some(text.parse::<TunnelProtocol>().map_err(|_| {
            format!(
                "{PROTOCOL_ANNOTATION}: {text:?} is not a tunnel protocol (http, tls, tcp, dtls, quic)"
            )
        })?),
        None => None,
    };
    let connection_ref = match annotations.get(CONNECTION_ANNOTATION) {
        Some(connection) => {
            netkit_runtime::validate_dns_subdomain(connection).map_err(|e| {
                format!("{CONNECTION_ANNOTATION}: {connection:?} is not an object name: {e}")
            })?;
            Some(ConnectionRef {
                name: Some(connection.clone()),
            })
        }
        None => None,
    };
    // Through serde, so the tunnel's own defaults apply to everything not given here.
    let mut spec: RstreamTunnelSpec = serde_json::from_value(serde_json::json!({
        "target": {"service": {"name": name, "port": port.port}},
    }))
    .map_err(|e| format!("building the tunnel: {e}"))?;
    if protocol.is_some() {
        spec.protocol = protocol;
    }
    spec.connection_ref = connection_ref;
    let mut tunnel = RstreamTunnel::new(&name, spec);
    tunnel.metadata.namespace = svc.namespace();
    tunnel.metadata.labels = Some(BTreeMap::from([(SERVICE_LABEL.to_owned(), name.clone())]));
    tunnel.metadata.owner_references = controller_owner_ref(svc).map(|owner| vec![owner]);
    Ok(tunnel)
}

/// The Service port named or numbered by `wanted`, else the first.
fn chosen_port<'a>(
    ports: &'a [ServicePort],
    wanted: Option<&str>,
) -> Result<&'a ServicePort, String> {
    match wanted {
        None => ports
            .first()
            .ok_or_else(|| "the Service has no port to forward to".to_owned()),
        Some(wanted) => ports
            .iter()
            .find(|p| p.name.as_deref() == Some(wanted) || p.port.to_string() == wanted)
            .ok_or_else(|| {
                let known: Vec<String> = ports
                    .iter()
                    .map(|p| p.name.clone().unwrap_or_else(|| p.port.to_string()))
                    .collect();
                format!(
                    "{PORT_ANNOTATION}: the Service has no port {wanted:?} (it has {})",
                    known.join(", ")
                )
            }),
    }
}

/// The ingress a tunnel's public address makes: host (a name, or an IP) and port, read from its
/// forwarding address (`https://host[:port]`, `host:port (tls)`, `host:port (tcp)`). `None` while
/// it has none, or for an unpublished tunnel (`rstrm://...`).
pub fn ingress_of(tunnel: &RstreamTunnel) -> Option<LoadBalancerIngress> {
    let address = tunnel.status.as_ref()?.forwarding_address.as_deref()?;
    let (host, port) = parse_forwarding_address(address)?;
    let ports = Some(vec![PortStatus {
        port,
        protocol: "TCP".to_owned(),
        error: None,
    }]);
    Some(match host.parse::<IpAddr>() {
        Ok(ip) => LoadBalancerIngress {
            ip: Some(ip.to_string()),
            ports,
            ..LoadBalancerIngress::default()
        },
        Err(_) => LoadBalancerIngress {
            hostname: Some(host),
            ports,
            ..LoadBalancerIngress::default()
        },
    })
}

/// `(host, port)` of a forwarding address (protocol reference, section 10).
pub fn parse_forwarding_address(address: &str) -> Option<(String, i32)> {
    if address.starts_with("rstrm://") {
        return None;
    }
    let (rest, default_port) = match address.strip_prefix("https://") {
        Some(rest) => (rest, Some(443)),
        None => (address, None),
    };
    // `host:port (tls)`: the protocol in parentheses.
    let rest = rest.split_once(' ').map_or(rest, |(hostport, _)| hostport);
    let rest = rest.trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => {
            (host, port.parse::<i32>().ok()?)
        }
        _ => (rest, default_port?),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty() && (1..=65535).contains(&port)).then(|| (host.to_owned(), port))
}

impl Reconciler for ServiceReconciler {
    type Resource = Service;
    type Error = ManagerError;

    async fn reconcile(&self, svc: Arc<Service>, ctx: &Context) -> Result<Action, ManagerError> {
        let namespace = svc.namespace().unwrap_or_default();
        let services: Api<Service> = Api::namespaced(ctx.client().clone(), &namespace);
        let tunnels: Api<RstreamTunnel> = Api::namespaced(ctx.client().clone(), &namespace);
        let existing = self.existing(&svc);
        if !self.serves(&svc) {
            // Not (or no longer) ours: a tunnel made for it goes, and so does what we wrote.
            if let Some((tunnel, true)) = existing {
                let params = DeleteParams {
                    preconditions: Some(Preconditions {
                        uid: tunnel.metadata.uid.clone(),
                        resource_version: None,
                    }),
                    ..DeleteParams::background()
                };
                match tunnels.delete(&tunnel.name_any(), &params).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            clear_status(&services, &svc).await?;
            return Ok(Action::Done);
        }
        let desired = match desired_tunnel(&svc) {
            Ok(desired) => desired,
            Err(message) => {
                let kept = live_ingress(&svc);
                set_status(&services, &svc, kept, reasons::INVALID_ANNOTATION, &message).await?;
                return Ok(Action::Done);
            }
        };
        // The cache may not have a tunnel made a moment ago: before applying (which would take
        // it over), the API server has the final say.
        let foreign = match &existing {
            Some((_, ours)) => !ours,
            None => tunnels
                .get_opt(&svc.name_any())
                .await?
                .is_some_and(|t| !controlled_by(&t, &svc)),
        };
        if foreign {
            let message = format!(
                "RstreamTunnel {namespace}/{} exists and is not this Service's; rename one of them",
                svc.name_any()
            );
            let kept = live_ingress(&svc);
            set_status(&services, &svc, kept, reasons::NAME_TAKEN, &message).await?;
            return Ok(Action::Done);
        }
        let tunnel = match ctx.applier().apply(&desired).await {
            Ok(applied) => applied.into_inner(),
            Err(k8s_reconcile::Error::Kube(kube::Error::Api(s))) if s.code == 422 => {
                let message = format!("the API server refused the tunnel: {}", s.message);
                let kept = live_ingress(&svc);
                set_status(&services, &svc, kept, reasons::TUNNEL_REFUSED, &message).await?;
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        match ingress_of(&tunnel) {
            Some(ingress) => {
                let message = format!(
                    "RstreamTunnel {namespace}/{} is published at {}",
                    tunnel.name_any(),
                    tunnel
                        .status
                        .as_ref()
                        .and_then(|s| s.forwarding_address.clone())
                        .unwrap_or_default()
                );
                set_status(
                    &services,
                    &svc,
                    vec![ingress],
                    reasons::ADDRESS_ASSIGNED,
                    &message,
                )
                .await?;
            }
            None => {
                let message = format!(
                    "RstreamTunnel {namespace}/{} has no public address yet",
                    tunnel.name_any()
                );
                set_status(
                    &services,
                    &svc,
                    Vec::new(),
                    reasons::WAITING_FOR_ADDRESS,
                    &message,
                )
                .await?;
            }
        }
        Ok(Action::Done)
    }
}

/// The ingress `svc`'s status shows now: what a refusal keeps (it changes only the condition).
fn live_ingress(svc: &Service) -> Vec<LoadBalancerIngress> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.clone())
        .unwrap_or_default()
}

/// Writes `wanted_ingress` and [`CONDITION`], unless the Service already shows them.
async fn set_status(
    services: &Api<Service>,
    svc: &Service,
    wanted_ingress: Vec<LoadBalancerIngress>,
    reason: &str,
    message: &str,
) -> Result<(), ManagerError> {
    let status = svc.status.as_ref();
    let live_ingress = live_ingress(svc);
    let ready = if reason == reasons::ADDRESS_ASSIGNED {
        "True"
    } else {
        "False"
    };
    let live_condition = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == CONDITION));
    let condition_holds = live_condition.is_some_and(|c| {
        c.status == ready
            && c.reason == reason
            && c.message == message
            && c.observed_generation == svc.metadata.generation
    });
    if live_ingress == wanted_ingress && condition_holds {
        return Ok(());
    }
    let last_transition_time = match live_condition {
        Some(c) if c.status == ready => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    let condition = Condition {
        type_: CONDITION.to_owned(),
        status: ready.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: svc.metadata.generation,
        last_transition_time,
    };
    // Strategic merge: the condition list merges by type (other controllers' stay); the ingress
    // list is replaced whole.
    let patch = serde_json::json!({
        "status": {
            "loadBalancer": {"ingress": wanted_ingress},
            "conditions": [condition],
        }
    });
    services
        .patch_status(
            &svc.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await?;
    Ok(())
}

/// Removes the ingress and [`CONDITION`] this manager wrote, from a Service that carries that
/// condition (no other Service's status is ever touched).
async fn clear_status(services: &Api<Service>, svc: &Service) -> Result<(), ManagerError> {
    let ours = svc
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == CONDITION));
    if !ours {
        return Ok(());
    }
    let patch = serde_json::json!({
        "status": {
            "loadBalancer": {"ingress": []},
            "conditions": [{"type": CONDITION, "$patch": "delete"}],
        }
    });
    match services
        .patch_status(
            &svc.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::RstreamTunnelStatus;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    fn service(ports: serde_json::Value, annotations: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": "u-1", "annotations": annotations},
            "spec": {"type": "LoadBalancer", "loadBalancerClass": LOAD_BALANCER_CLASS, "ports": ports},
        }))
        .unwrap()
    }

    #[test]
    fn the_tunnel_forwards_to_the_chosen_port_and_is_owned_by_the_service() {
        let ports =
            serde_json::json!([{"name": "metrics", "port": 9090}, {"name": "http", "port": 80}]);
        let t = desired_tunnel(&service(ports.clone(), serde_json::json!({}))).unwrap();
        assert_eq!(t.spec.target.service.port, IntOrString::Int(9090));
        assert_eq!(t.spec.target.service.name, "web");
        assert_eq!(t.spec.protocol(), TunnelProtocol::Http);
        assert_eq!(t.metadata.namespace.as_deref(), Some("shop"));
        let owner = &t.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Service", "u-1")
        );
        assert_eq!(owner.controller, Some(true));
        for wanted in ["http", "80"] {
            let annotations = serde_json::json!({
                PORT_ANNOTATION: wanted, PROTOCOL_ANNOTATION: "tls", CONNECTION_ANNOTATION: "edge",
            });
            let t = desired_tunnel(&service(ports.clone(), annotations)).unwrap();
            assert_eq!(t.spec.target.service.port, IntOrString::Int(80));
            assert_eq!(t.spec.protocol(), TunnelProtocol::Tls);
            assert_eq!(t.spec.connection_name(), "edge");
        }
    }

    #[test]
    fn bad_annotations_are_refused_with_the_reason() {
        let ports = serde_json::json!([{"name": "http", "port": 80}]);
        let cases = [
            (
                serde_json::json!({PORT_ANNOTATION: "https"}),
                "no port \"https\" (it has http)",
            ),
            (
                serde_json::json!({PROTOCOL_ANNOTATION: "gopher"}),
                "not a tunnel protocol",
            ),
            (
                serde_json::json!({CONNECTION_ANNOTATION: "Edge_1"}),
                "not an object name",
            ),
        ];
        for (annotations, expected) in cases {
            let error = desired_tunnel(&service(ports.clone(), annotations)).unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
        let error =
            desired_tunnel(&service(serde_json::json!([]), serde_json::json!({}))).unwrap_err();
        assert!(error.contains("no port"), "{error}");
    }

    #[test]
    fn forwarding_addresses_give_host_and_port() {
        let cases = [
            ("https://web.example.test", Some(("web.example.test", 443))),
            ("https://localhost:41234", Some(("localhost", 41234))),
            (
                "web.example.test:443 (tls)",
                Some(("web.example.test", 443)),
            ),
            (
                "test.localhost:10042 (tcp)",
                Some(("test.localhost", 10042)),
            ),
            ("127.0.0.1:10042 (tcp)", Some(("127.0.0.1", 10042))),
            ("[::1]:8443 (tls)", Some(("::1", 8443))),
            ("rstrm://shop-web (unpublished)", None),
            ("web.example.test (tcp)", None),
            ("https://web:0", None),
            ("", None),
        ];
        for (address, expected) in cases {
            let got = parse_forwarding_address(address);
            let expected = expected.map(|(h, p)| (h.to_owned(), p));
            assert_eq!(got, expected, "{address}");
        }
    }

    #[test]
    fn an_ip_goes_to_the_ip_field_a_name_to_hostname() {
        let mut t = RstreamTunnel::new(
            "web",
            desired_tunnel(&service(
                serde_json::json!([{"port": 80}]),
                serde_json::json!({}),
            ))
            .unwrap()
            .spec,
        );
        assert!(ingress_of(&t).is_none(), "no address yet");
        t.status = Some(RstreamTunnelStatus {
            forwarding_address: Some("127.0.0.1:10042 (tcp)".into()),
            ..RstreamTunnelStatus::default()
        });
        let ingress = ingress_of(&t).unwrap();
        assert_eq!(ingress.ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(ingress.hostname, None);
        assert_eq!(ingress.ports.unwrap()[0].port, 10042);
        t.status = Some(RstreamTunnelStatus {
            forwarding_address: Some("https://web.example.test".into()),
            ..RstreamTunnelStatus::default()
        });
        let ingress = ingress_of(&t).unwrap();
        assert_eq!(ingress.hostname.as_deref(), Some("web.example.test"));
        assert_eq!(ingress.ip, None);
    }
}
