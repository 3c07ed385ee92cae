//! The validated settings of a run, typed and split by who reads them: the HTTP API, the data
//! plane, the mapping policy (V1, V2, namespaces, TTL bound) and the cluster side. Built once by
//! `Cli::validate` from the flags; nothing downstream parses a flag's text again.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use k8s_reconcile::peers::PeerCheckConfig;
use proxy_core::server::{DataPath, PortRange};
use proxy_core::upstream::HealthCheck;

use crate::access::{EntryAccess, SourcePolicy};
use clap::ValueEnum;

/// Where the V2 mappings send their connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum V2Target {
    /// The ready endpoints of the Service's EndpointSlices, each health-checked.
    Endpoints,
    /// The Service's ClusterIP and port (as the original did; kube-proxy picks the endpoint).
    ClusterIp,
}

/// Which data plane carries the traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// proxy-core inside this process: changes are live at once, nothing reloads.
    Embedded,
    /// A real HAProxy driven through its Runtime API socket (no reloads).
    Haproxy,
}

/// How API callers are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// Bearer token checked with TokenReview, access with SubjectAccessReview.
    Kubernetes,
    /// No check at all: anyone reaching the API port may map pods. Only for local trials.
    None,
}

/// Validated settings of a run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The HTTP API server.
    pub api: ApiSettings,
    /// The data plane.
    pub plane: PlaneSettings,
    /// What may be mapped, where and for how long.
    pub policy: MappingPolicy,
    /// The client, the state namespace and the leader election.
    pub cluster: ClusterSettings,
    /// Address of /healthz and /readyz.
    pub health_addr: SocketAddr,
    /// Address of /metrics.
    pub metrics_addr: SocketAddr,
    /// Who may read /metrics, and over what.
    pub metrics: netkit_runtime::MetricsArgs,
    /// Warnings to log once logging is up (ignored legacy flags, deprecated forms).
    pub warnings: Vec<String>,
}

/// What the HTTP API server reads.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Bind address.
    pub addr: SocketAddr,
    /// How callers are checked.
    pub auth: AuthMode,
    /// Request body limit, in bytes.
    pub max_body_bytes: usize,
    /// Longest time a request may take.
    pub request_timeout: Duration,
    /// Longest time a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// Concurrent API connections.
    pub max_connections: usize,
    /// The serving certificate; `None` with --plain-http.
    pub tls: Option<ApiTls>,
}

/// The API's serving certificate files (re-read when they change).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiTls {
    /// PEM certificate chain.
    pub cert_file: PathBuf,
    /// PEM private key.
    pub key_file: PathBuf,
}

/// What the data plane reads.
#[derive(Debug, Clone)]
pub struct PlaneSettings {
    /// proxy-core in process, or HAProxy.
    pub backend: BackendKind,
    /// The IP the entry ports bind to.
    pub listen_ip: IpAddr,
    /// HAProxy's Runtime API (always set with the haproxy backend).
    pub runtime_api: Option<RuntimeApiAddr>,
    /// Health checks of V2 upstreams; none with --off-check.
    pub health_check: Option<HealthCheck>,
    /// How long established connections may continue on shutdown.
    pub drain_timeout: Duration,
    /// What relays the embedded plane's connections.
    pub data_path: DataPath,
}

/// What may be mapped: read by forwarding, V1, V2 and the API's scope checks.
#[derive(Debug, Clone)]
pub struct MappingPolicy {
    /// V1, when enabled.
    pub v1: Option<V1Policy>,
    /// V2, when enabled.
    pub v2: Option<V2Policy>,
    /// Namespaces in scope (validated, without duplicates).
    pub allowed_namespaces: Vec<String>,
    /// Longest V1 TTL.
    pub max_mapping_time: Duration,
    /// Who may connect to a V1 entry port.
    pub entry_access: EntryAccess,
    /// What a request may ask to admit besides its own address.
    pub sources: SourcePolicy,
}

/// V1: an entry port forwards to one pod for a TTL.
#[derive(Debug, Clone)]
pub struct V1Policy {
    /// Where V1 mappings listen.
    pub entry_ports: V1Ports,
    /// The pod port when no container port has [`Self::port_name`] (--default-map-port).
    pub pod_port: u16,
    /// The container port name to map.
    pub port_name: String,
}

/// The V1 entry ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V1Ports {
    /// The original's single port: a new mapping replaces the current one, whoever asked.
    Shared(u16),
    /// One port of the range per requester; another requester's mapping is never replaced.
    Range(PortRange),
}

impl V1Ports {
    /// Every V1 entry port, lowest first.
    pub fn all(&self) -> Vec<u16> {
        match self {
            V1Ports::Shared(port) => vec![*port],
            V1Ports::Range(range) => (range.start()..=range.end()).collect(),
        }
    }

    /// Whether `port` is a V1 entry port.
    pub fn contains(&self, port: u16) -> bool {
        match self {
            V1Ports::Shared(shared) => *shared == port,
            V1Ports::Range(range) => range.contains(port),
        }
    }
}

impl std::fmt::Display for V1Ports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            V1Ports::Shared(port) => write!(f, "{port} (shared)"),
            V1Ports::Range(range) => write!(f, "{}-{}", range.start(), range.end()),
        }
    }
}

/// V2: Service ports named [`Self::port_name`] get a port of [`Self::port_range`].
#[derive(Debug, Clone)]
pub struct V2Policy {
    /// The entry ports to allocate from.
    pub port_range: PortRange,
    /// The Service port name to publish.
    pub port_name: String,
    /// Where the traffic goes.
    pub target: V2Target,
    /// Full resync period.
    pub resync: Duration,
}

impl MappingPolicy {
    /// Whether `namespace` is in --allowed-namespaces.
    pub fn namespace_allowed(&self, namespace: &str) -> bool {
        self.allowed_namespaces.iter().any(|ns| ns == namespace)
    }

    /// The entry ports of the enabled versions: the V1 entry ports and the V2 range.
    pub fn entry_ports(&self) -> Vec<u16> {
        let mut ports = Vec::new();
        if let Some(v1) = &self.v1 {
            ports.extend(v1.entry_ports.all());
        }
        if let Some(v2) = &self.v2 {
            ports.extend(v2.port_range.start()..=v2.port_range.end());
        }
        ports
    }
}

/// What the cluster side reads: the client, where the PortMappings live, the leader election.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// Explicit kubeconfig.
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the PortMappings and the Lease.
    pub state_namespace: String,
    /// Leader election identity.
    pub identity: String,
    /// Lease name.
    pub lease_name: String,
    /// The check of the other replicas (`--peer-selector`), when on.
    pub peers: Option<PeerSettings>,
}

/// Which Pods are this pod-proxier's replicas, and how they check each other.
#[derive(Debug, Clone)]
pub struct PeerSettings {
    /// Label selector of the replicas' Pods in the state namespace.
    pub selector: String,
    /// How often, on which port, after how many failures.
    pub check: PeerCheckConfig,
}

/// Where the HAProxy Runtime API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeApiAddr {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl std::fmt::Display for RuntimeApiAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuntimeApiAddr::Unix(path) => write!(f, "unix://{}", path.display()),
            RuntimeApiAddr::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

/// Parses `unix:///path`, `/path`, `tcp://host:port` or `host:port`.
pub fn parse_runtime_api_addr(input: &str) -> Result<RuntimeApiAddr, String> {
    if input.starts_with("http://") || input.starts_with("https://") {
        return Err(format!(
            "--api-addr {input} looks like the HAProxy Data Plane API of the original; \
             pod-proxier drives HAProxy through its Runtime API instead: give the stats socket, \
             e.g. unix:///run/haproxy/admin.sock or 127.0.0.1:9999"
        ));
    }
    if let Some(path) = input.strip_prefix("unix://") {
        return if path.starts_with('/') {
            Ok(RuntimeApiAddr::Unix(PathBuf::from(path)))
        } else {
            Err(format!(
                "--api-addr {input}: a unix socket needs an absolute path"
            ))
        };
    }
    if input.starts_with('/') {
        return Ok(RuntimeApiAddr::Unix(PathBuf::from(input)));
    }
    let tcp = input.strip_prefix("tcp://").unwrap_or(input);
    tcp.parse().map(RuntimeApiAddr::Tcp).map_err(|_| {
        format!(
            "--api-addr {input}: expected unix:///path/to/socket or ip:port, e.g. 127.0.0.1:9999"
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn runtime_api_addresses() {
        assert_eq!(
            parse_runtime_api_addr("unix:///run/haproxy/admin.sock").unwrap(),
            RuntimeApiAddr::Unix("/run/haproxy/admin.sock".into())
        );
        assert_eq!(
            parse_runtime_api_addr("127.0.0.1:9999").unwrap(),
            RuntimeApiAddr::Tcp("127.0.0.1:9999".parse().unwrap())
        );
        assert!(parse_runtime_api_addr("unix://relative").is_err());
        assert!(parse_runtime_api_addr("nonsense").is_err());
    }
}
