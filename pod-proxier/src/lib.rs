//! pod-proxier: TTL-managed TCP port mappings to Kubernetes Pods (V1) and published Service
//! ports (V2), a compatible and fixed reimplementation of `cylonchau/pod-proxier`.
//!
//! * [`crd`]: the `PortMapping` custom resource, where every mapping lives.
//! * [`config`]: flags, environment variables and their validation.
//! * [`mappings`]: the cache of PortMappings and the loop that programs the data plane.
//! * [`dataplane`]: proxy-core in process ([`dataplane::embedded`]) or HAProxy through its
//!   Runtime API ([`dataplane::haproxy`]).
//! * [`v1`], [`v2`]: the two features; [`leader`]: what only the Lease holder does.
//! * [`api`], [`auth`], [`error`], [`openapi`]: the HTTP API.
//! * [`app`]: wiring and shutdown; [`bench`](mod@bench): POST-to-first-byte measurement.
#![deny(missing_docs)]

pub mod api;
pub mod app;
pub mod auth;
pub mod bench;
pub mod config;
pub mod crd;
pub mod dataplane;
pub mod error;
pub mod leader;
pub mod mappings;
pub mod metrics;
pub mod names;
pub mod openapi;
pub mod v1;
pub mod v2;
