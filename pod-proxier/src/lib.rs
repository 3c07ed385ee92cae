//! pod-proxier: TTL-managed TCP port mappings to Kubernetes Pods (V1) and published Service
//! ports (V2), a compatible and fixed reimplementation of `cylonchau/pod-proxier`.
//!
//! * [`crd`]: the `PortMapping` custom resource, where every mapping lives.
//! * [`config`]: flags, environment variables and their validation into [`settings`], typed and
//!   split by who reads them.
//! * [`forwarding`]: on every replica, the cache of PortMappings and the loop that programs the
//!   data plane; [`ttl`]: their deadlines.
//! * [`dataplane`]: proxy-core in process ([`dataplane::embedded`]) or HAProxy through its
//!   Runtime API ([`dataplane::haproxy`]).
//! * [`pod_mappings`] (V1): one entry port to one Pod for a TTL; [`service_ports`] (V2): a port of
//!   the range for every Service port named `--port-name`.
//! * [`expiry`]: the Lease holder removes expired mappings (the leader wiring is in [`app`]).
//! * [`peers`]: every replica marks a peer lost with its node not Ready, so the Service stops
//!   routing to it within seconds.
//! * [`api`], [`error`], [`openapi`]: the HTTP API (callers are checked with
//!   [`k8s_reconcile::auth`]); [`access`]: whom a V1 entry port admits.
//! * [`connect`]: `pod-proxier connect`, a client forwarding a local port through a mapping.
//! * [`app`]: wiring, leader work and shutdown.

pub mod access;
pub mod api;
pub mod app;
pub mod config;
pub mod connect;
pub mod crd;
pub mod dataplane;
pub mod error;
pub mod expiry;
pub mod forwarding;
pub mod metrics;
pub mod names;
pub mod openapi;
pub mod peers;
pub mod pod_mappings;
pub mod service_ports;
pub mod settings;
pub mod ttl;
