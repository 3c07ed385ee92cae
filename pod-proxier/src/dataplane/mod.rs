//! The data plane: listeners on entry ports and where they forward.
//!
//! The rest of the program only computes the desired state (entry port -> route) from the
//! PortMapping objects and hands it to [`DataPlane::sync`], which makes the proxy match it:
//! idempotent, so it doubles as drift repair.

pub mod embedded;
pub mod haproxy;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::access::Cidr;

/// What one entry port should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRoute {
    /// The mapping's name (PortMapping name), or [`IDLE_ROUTE`].
    pub name: String,
    /// Where connections go; empty means they are refused.
    pub upstreams: Vec<SocketAddr>,
    /// Health-check the upstreams (V2 with checks on).
    pub health_checked: bool,
    /// Close established connections when this route takes over the port or ends.
    pub close_connections: bool,
    /// The source networks admitted, on an entry port whose access is checked (a V1 port with
    /// `--entry-access=requester`); `None`: every source.
    pub allowed_sources: Option<Vec<Cidr>>,
}

/// Name of the route of an entry port without a mapping.
pub const IDLE_ROUTE: &str = "idle";

impl PortRoute {
    /// The route of an entry port without a mapping: connections are refused.
    pub fn idle() -> Self {
        Self {
            name: IDLE_ROUTE.to_owned(),
            upstreams: Vec::new(),
            health_checked: false,
            close_connections: false,
            allowed_sources: None,
        }
    }

    /// Whether `next` admits other sources.
    pub fn access_differs(&self, next: &PortRoute) -> bool {
        self.allowed_sources != next.allowed_sources
    }

    /// Whether switching from `self` to `next` must close established connections.
    pub fn closes_on_switch_to(&self, next: &PortRoute) -> bool {
        self.forwarding_differs(next) && (self.close_connections || next.close_connections)
    }

    /// Whether new connections would go somewhere else.
    pub fn forwarding_differs(&self, next: &PortRoute) -> bool {
        self.name != next.name
            || self.upstreams != next.upstreams
            || self.health_checked != next.health_checked
    }
}

/// The desired state: every entry port that should listen, and its route.
pub type DesiredPorts = BTreeMap<u16, PortRoute>;

/// A port the data plane could not program.
#[derive(Debug, Clone)]
pub struct PortError {
    /// The entry port.
    pub port: u16,
    /// Why.
    pub message: String,
}

/// Either data plane.
pub enum DataPlane {
    /// proxy-core in process.
    Embedded(embedded::EmbeddedPlane),
    /// HAProxy through its Runtime API.
    Haproxy(haproxy::HaproxyPlane),
}

impl DataPlane {
    /// Makes the proxy match `desired`; returns the ports that could not be programmed (the
    /// others are programmed regardless).
    pub async fn sync(&self, desired: &DesiredPorts) -> Vec<PortError> {
        match self {
            DataPlane::Embedded(plane) => plane.sync(desired).await,
            DataPlane::Haproxy(plane) => plane.sync(desired).await,
        }
    }

    /// Stops listening, lets connections finish for up to `drain`.
    pub async fn shutdown(&self, drain: std::time::Duration) {
        match self {
            DataPlane::Embedded(plane) => plane.shutdown(drain).await,
            DataPlane::Haproxy(plane) => plane.shutdown().await,
        }
    }
}
