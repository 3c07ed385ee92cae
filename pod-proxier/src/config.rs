//! Command-line flags (with environment variables) and their validation.
//!
//! The flag names and defaults of the original Go program are kept, so its deployments keep
//! working; the flags it accepted for the HAProxy Data Plane API (`--api-user`,
//! `--api-password`, `--max-batch-size`, `--hide-backend`) are still accepted and ignored with a
//! warning.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use k8s_reconcile::peers::PeerCheckConfig;
use netkit_runtime::SecondsOrDuration;
use proxy_core::server::{DataPath, PortRange};
use proxy_core::upstream::HealthCheck;

use crate::access::{Cidr, EntryAccess, SourcePolicy};
use crate::names;
use crate::settings::{
    ApiSettings, ApiTls, ClusterSettings, MappingPolicy, PeerSettings, PlaneSettings, Settings,
    V1Policy, V1Ports, V2Policy,
};
pub use crate::settings::{
    AuthMode, BackendKind, RuntimeApiAddr, V2Target, parse_runtime_api_addr,
};

use netkit_runtime::{ClientArgs, LogArgs, MetricsArgs};

/// pod-proxier: TTL-managed TCP mappings to Pods (V1) and published Service ports (V2).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pod-proxier",
    version,
    about,
    long_about = None,
    mut_arg("kubeconfig", |a| a.env("POD_PROXIER_KUBECONFIG").global(true)),
    mut_arg("log_format", |a| a.env("POD_PROXIER_LOG_FORMAT").global(true)),
    mut_arg("log_level", |a| a.env("POD_PROXIER_LOG_LEVEL").global(true)),
    mut_arg("metrics_secure", |a| a.env("POD_PROXIER_METRICS_SECURE").global(true)),
    mut_arg("metrics_cert_file", |a| a.env("POD_PROXIER_METRICS_CERT_FILE").global(true)),
    mut_arg("metrics_key_file", |a| a.env("POD_PROXIER_METRICS_KEY_FILE").global(true))
)]
pub struct Cli {
    /// `--kubeconfig`.
    #[command(flatten)]
    pub client: ClientArgs,

    /// Enable V1: map a pod to an entry port, for a TTL.
    #[arg(long, env = "POD_PROXIER_ENABLE_V1", global = true)]
    pub enable_v1: bool,

    /// Enable V2: publish every Service port named --port-name on a port of the range.
    #[arg(long, env = "POD_PROXIER_ENABLE_V2", global = true)]
    pub enable_v2: bool,

    /// Port of the HTTP API.
    #[arg(long, env = "POD_PROXIER_LISTEN_PORT", default_value_t = 3343, value_parser = clap::value_parser!(u16).range(1..), global = true)]
    pub listen_port: u16,

    /// Address the HTTP API binds to.
    #[arg(
        long,
        env = "POD_PROXIER_API_LISTEN_ADDR",
        default_value = "0.0.0.0",
        global = true
    )]
    pub api_listen_addr: IpAddr,

    /// PEM certificate (chain) the API serves over TLS; re-read when it changes, so a rotated
    /// Secret is picked up without a restart. Needs --tls-key-file.
    #[arg(long, env = "POD_PROXIER_TLS_CERT_FILE", global = true)]
    pub tls_cert_file: Option<PathBuf>,

    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "POD_PROXIER_TLS_KEY_FILE", global = true)]
    pub tls_key_file: Option<PathBuf>,

    /// Serve the API over plain HTTP, without TLS: bearer tokens cross the network in the
    /// clear. Only for local trials or behind a TLS-terminating proxy; logged as a warning.
    #[arg(long, env = "POD_PROXIER_PLAIN_HTTP", global = true)]
    pub plain_http: bool,

    /// Address the data ports (V1 entry port, V2 range) bind to.
    #[arg(
        long,
        env = "POD_PROXIER_LISTEN_ADDR",
        default_value = "0.0.0.0",
        global = true
    )]
    pub listen_addr: IpAddr,

    /// HAProxy Runtime API socket for --backend haproxy: unix:///path or host:port.
    #[arg(
        long,
        env = "POD_PROXIER_API_ADDR",
        default_value = "unix:///run/haproxy/admin.sock",
        global = true
    )]
    pub api_addr: String,

    /// The pod port used when no container port has the V1 port name; also the first V1 entry
    /// port by default, and the only one with --v1-shared-port.
    #[arg(long, env = "POD_PROXIER_DEFAULT_MAP_PORT", default_value_t = 8849, value_parser = clap::value_parser!(u16).range(1..), global = true)]
    pub default_map_port: u16,

    /// V1 entry ports, START-END (inclusive): each requester's mapping gets its own port, so
    /// nobody replaces another user's mapping. Default: 20 ports from --default-map-port.
    #[arg(long, env = "POD_PROXIER_V1_PORT_RANGE", global = true)]
    pub v1_port_range: Option<String>,

    /// V1 as the original: one entry port (--default-map-port) shared by everyone, where a new
    /// mapping replaces the current one whoever asked for it.
    #[arg(long, env = "POD_PROXIER_V1_SHARED_PORT", global = true)]
    pub v1_shared_port: bool,

    /// Who may connect to a V1 entry port: the requester's source addresses only, or anyone
    /// who can reach it (as the original).
    #[arg(
        long,
        env = "POD_PROXIER_ENTRY_ACCESS",
        value_enum,
        default_value = "requester",
        global = true
    )]
    pub entry_access: EntryAccess,

    /// Networks a V1 request may admit to its entry port besides the caller's own address
    /// (the request's `sources`), comma-separated CIDRs; `0.0.0.0/0,::/0` lets a request open
    /// its port to anyone.
    #[arg(
        long,
        env = "POD_PROXIER_ALLOWED_SOURCE_CIDRS",
        value_delimiter = ',',
        global = true
    )]
    pub allowed_source_cidrs: Vec<String>,

    /// First port of the V2 range (inclusive).
    #[arg(
        long,
        env = "POD_PROXIER_PORT_RANGE_START",
        default_value_t = 9000,
        global = true
    )]
    pub port_range_start: u16,

    /// Last port of the V2 range (inclusive).
    #[arg(
        long,
        env = "POD_PROXIER_PORT_RANGE_END",
        default_value_t = 9100,
        global = true
    )]
    pub port_range_end: u16,

    /// Namespaces whose Pods (V1) and Services (V2) may be mapped, comma-separated.
    #[arg(
        long,
        env = "POD_PROXIER_ALLOWED_NAMESPACES",
        value_delimiter = ',',
        default_value = "default",
        global = true
    )]
    pub allowed_namespaces: Vec<String>,

    /// Longest V1 mapping; longer requests are refused (Go duration; a bare number is seconds,
    /// deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_MAX_MAPPING_TIME",
        default_value = "3h",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub max_mapping_time: SecondsOrDuration,

    /// Health check connect timeout of V2 endpoints (Go duration; a bare number is seconds,
    /// deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_CHECK_TIMEOUT",
        default_value = "15s",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub check_timeout: SecondsOrDuration,

    /// Time between two health checks of a V2 endpoint (Go duration; a bare number is seconds,
    /// deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_CHECK_INTERVAL",
        default_value = "2s",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub check_interval: SecondsOrDuration,

    /// Disable V2 health checks: always forward to every ready endpoint.
    #[arg(long, env = "POD_PROXIER_OFF_CHECK", global = true)]
    pub off_check: bool,

    /// V1: name of the container port to map (the original's default `jprofiler_tcp` is not a
    /// valid port name, so it never matched).
    #[arg(
        long,
        env = "POD_PROXIER_JPROFILER_PORT_NAME",
        default_value = "jprofiler-port",
        global = true
    )]
    pub jprofiler_port_name: String,

    /// V2: name of the Service ports to publish.
    #[arg(
        long,
        env = "POD_PROXIER_PORT_NAME",
        default_value = "debug",
        global = true
    )]
    pub port_name: String,

    /// V2: send traffic to the Service's endpoints or to its ClusterIP.
    #[arg(
        long,
        env = "POD_PROXIER_V2_TARGET",
        value_enum,
        default_value = "endpoints",
        global = true
    )]
    pub v2_target: V2Target,

    /// Time between two full V2 reconciliations, the original's informer resync (Go duration; a
    /// bare number is seconds, deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_RESYNC_TIME",
        default_value = "10m",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub resync_time: SecondsOrDuration,

    /// Data plane: proxy-core in this process, or HAProxy through --api-addr.
    #[arg(
        long,
        env = "POD_PROXIER_BACKEND",
        value_enum,
        default_value = "embedded",
        global = true
    )]
    pub backend: BackendKind,

    /// With the embedded backend, what relays the entry ports' connections: `event-loop`
    /// (Linux: connection state machines on an epoll loop, the least CPU and memory), `tokio` (a
    /// task per connection, the fallback if the loop misbehaves on a node) or `auto` (the event
    /// loop on Linux).
    #[arg(
        long,
        env = "POD_PROXIER_DATA_PATH",
        default_value = "auto",
        value_parser = str::parse::<DataPath>,
        global = true
    )]
    pub data_path: DataPath,

    /// API authentication: Kubernetes tokens with RBAC, or none (explicit, logged as a warning).
    #[arg(
        long,
        env = "POD_PROXIER_AUTH",
        value_enum,
        default_value = "kubernetes",
        global = true
    )]
    pub auth: AuthMode,

    /// Address of /healthz and /readyz (open: the kubelet's probes carry no token).
    #[arg(
        long,
        env = "POD_PROXIER_HEALTH_ADDR",
        default_value = "0.0.0.0:8081",
        global = true
    )]
    pub health_addr: SocketAddr,

    /// Address of /metrics (HTTPS with a token unless --metrics-secure=false; with it off, it
    /// may be --health-addr).
    #[arg(
        long,
        env = "POD_PROXIER_METRICS_ADDR",
        default_value = "0.0.0.0:8443",
        global = true
    )]
    pub metrics_addr: SocketAddr,

    /// `--metrics-secure`, `--metrics-cert-file`, `--metrics-key-file`.
    #[command(flatten)]
    pub metrics: MetricsArgs,

    /// `--log-format` and `--log-level`.
    #[command(flatten)]
    pub log: LogArgs,

    /// Namespace holding the PortMapping objects and the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default", global = true)]
    pub state_namespace: String,

    /// This replica's identity in the leader election (the pod name in a cluster).
    #[arg(long, env = "POD_NAME", global = true)]
    pub identity: Option<String>,

    /// Name of the leader election Lease.
    #[arg(
        long,
        env = "POD_PROXIER_LEASE_NAME",
        default_value = "pod-proxier",
        global = true
    )]
    pub lease_name: String,

    /// Label selector of this pod-proxier's own Pods in --state-namespace (the chart sets it;
    /// empty: off). With it, every replica dials the others' health ports (the port of
    /// --health-addr) every --peer-check-interval and marks a peer's Pod not Ready after
    /// --peer-check-failures failures in a row, so its Service stops sending clients to a
    /// replica lost with its node long before the node controller would. A peer that never
    /// answered is never marked; the kubelet of a peer that is alive after all marks it Ready
    /// again.
    #[arg(
        long,
        env = "POD_PROXIER_PEER_SELECTOR",
        default_value = "",
        global = true
    )]
    pub peer_selector: String,

    /// Time between two peer checks, and the timeout of each (Go duration).
    #[arg(long, env = "POD_PROXIER_PEER_CHECK_INTERVAL", default_value = "1s", value_parser = netkit_runtime::parse_duration, global = true)]
    pub peer_check_interval: Duration,

    /// Failed peer checks in a row before a peer's Pod is marked not Ready (at least 1).
    #[arg(
        long,
        env = "POD_PROXIER_PEER_CHECK_FAILURES",
        default_value_t = 2,
        global = true
    )]
    pub peer_check_failures: u32,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "POD_PROXIER_MAX_BODY_BYTES", default_value_t = 16 * 1024, global = true)]
    pub max_body_bytes: usize,

    /// Longest time an API request may take (Go duration; a bare number is seconds,
    /// deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_REQUEST_TIMEOUT",
        default_value = "10s",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub request_timeout: SecondsOrDuration,

    /// Longest time a client may take to send a request's headers; slower or idle connections
    /// are closed (Go duration; a bare number is seconds, deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_HEADER_READ_TIMEOUT",
        default_value = "5s",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub header_read_timeout: SecondsOrDuration,

    /// Most API connections served at once; one more gets 503 and is closed at once.
    #[arg(long, env = "POD_PROXIER_MAX_API_CONNECTIONS", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..), global = true)]
    pub max_api_connections: u32,

    /// On SIGTERM, how long established connections may continue (Go duration; a bare number
    /// is seconds, deprecated).
    #[arg(
        long,
        env = "POD_PROXIER_DRAIN_TIMEOUT",
        default_value = "30s",
        value_parser = netkit_runtime::parse_seconds_or_duration,
        global = true
    )]
    pub drain_timeout: SecondsOrDuration,

    /// Accepted for compatibility with the original (Data Plane API user); ignored.
    #[arg(long, hide = true, global = true)]
    pub api_user: Option<String>,

    /// Accepted for compatibility with the original (Data Plane API password); ignored.
    #[arg(long, hide = true, global = true)]
    pub api_password: Option<String>,

    /// Accepted for compatibility with the original; ignored.
    #[arg(long, hide = true, global = true)]
    pub max_batch_size: Option<u32>,

    /// Accepted for compatibility with the original; ignored (backend details are never exposed).
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", global = true)]
    pub hide_backend: Option<bool>,

    /// What to do; without a subcommand, run the proxy.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Run the proxy (the default).
    Run,
    /// Print the HAProxy configuration for --backend haproxy, built from the same flags.
    HaproxyConfig {
        /// Write it to this file instead of standard output.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// Print the PortMapping CustomResourceDefinition as YAML.
    Crd,
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
    /// Forward a local port to a pod through pod-proxier, like `kubectl port-forward`: maps the
    /// pod, renews the mapping while running and deletes it on exit.
    Connect(crate::connect::ConnectArgs),
}

impl Cli {
    /// The API's certificate files, or none with --plain-http; running with neither is refused,
    /// so tokens never go over plain HTTP by accident. Subcommands that do not serve (`crd`,
    /// `haproxy-config`, ...) need neither.
    /// The peer check of `--peer-selector` and its flags; `None` when the selector is empty.
    fn peer_settings(&self) -> Result<Option<PeerSettings>, String> {
        if self.peer_selector.trim().is_empty() {
            return Ok(None);
        }
        let selector = parse_label_selector(&self.peer_selector)
            .map_err(|e| format!("--peer-selector {:?}: {e}", self.peer_selector))?;
        let check = PeerCheckConfig::new(
            Some(self.health_addr),
            self.peer_check_interval,
            self.peer_check_failures,
        )
        .map_err(|off| {
            format!(
                "--peer-selector is set but the peer check cannot run: {off} (--health-addr, \
                 --peer-check-interval, --peer-check-failures)"
            )
        })?
        .down_only_after_an_answer();
        Ok(Some(PeerSettings { selector, check }))
    }

    fn api_tls(&self, serving: bool) -> Result<Option<ApiTls>, String> {
        match (&self.tls_cert_file, &self.tls_key_file, self.plain_http) {
            (Some(_), _, true) | (_, Some(_), true) => Err(
                "--plain-http and --tls-cert-file/--tls-key-file exclude each other: choose TLS \
                 or plain HTTP"
                    .to_owned(),
            ),
            (Some(cert), Some(key), false) => Ok(Some(ApiTls {
                cert_file: cert.clone(),
                key_file: key.clone(),
            })),
            (Some(_), None, false) => {
                Err("--tls-cert-file needs --tls-key-file (the certificate's key)".to_owned())
            }
            (None, Some(_), false) => {
                Err("--tls-key-file needs --tls-cert-file (the key's certificate)".to_owned())
            }
            (None, None, true) => Ok(None),
            (None, None, false) if !serving => Ok(None),
            (None, None, false) => Err(
                "the API needs TLS: give --tls-cert-file and --tls-key-file (a PEM certificate \
                 and its key, e.g. a mounted kubernetes.io/tls Secret), or --plain-http to serve \
                 without TLS (tokens in the clear; local trials only)"
                    .to_owned(),
            ),
        }
    }
}

/// Ports in the default V1 range (from --default-map-port).
pub const DEFAULT_V1_PORTS: u16 = 20;

impl Cli {
    /// The V1 entry ports: the shared port, the range given, or the default range.
    fn v1_ports(&self) -> Result<V1Ports, String> {
        if self.v1_shared_port {
            if self.v1_port_range.is_some() {
                return Err(
                    "--v1-shared-port and --v1-port-range exclude each other: one shared port \
                     (--default-map-port) or a port per requester"
                        .to_owned(),
                );
            }
            return Ok(V1Ports::Shared(self.default_map_port));
        }
        let (first, last) = match &self.v1_port_range {
            None => (
                self.default_map_port,
                self.default_map_port.saturating_add(DEFAULT_V1_PORTS - 1),
            ),
            Some(text) => {
                let parse = |part: &str| part.trim().parse::<u16>().ok().filter(|p| *p > 0);
                match text.split_once('-').map(|(a, b)| (parse(a), parse(b))) {
                    Some((Some(first), Some(last))) => (first, last),
                    _ => {
                        return Err(format!(
                            "--v1-port-range {text:?}: expected START-END, e.g. 8849-8868"
                        ));
                    }
                }
            }
        };
        PortRange::new(first, last)
            .map(V1Ports::Range)
            .map_err(|e| format!("--v1-port-range {first}-{last}: {e}"))
    }

    /// Checks every flag and their combinations; the message says what to change.
    pub fn validate(&self, need_a_version: bool) -> Result<Settings, String> {
        if need_a_version && !self.enable_v1 && !self.enable_v2 {
            return Err(
                "nothing to do: enable at least one of --enable-v1 (map one pod to the \
                 entry port for a TTL) and --enable-v2 (publish Service ports named --port-name)"
                    .to_owned(),
            );
        }
        let (start, end) = (self.port_range_start, self.port_range_end);
        if self.enable_v2 || !need_a_version {
            if start < 1024 {
                return Err(format!("--port-range-start {start} must be at least 1024"));
            }
            if start >= end {
                return Err(format!(
                    "--port-range-start {start} must be lower than --port-range-end {end}"
                ));
            }
            names::validate_port_name(&self.port_name)
                .map_err(|e| format!("--port-name {:?}: {e}", self.port_name))?;
        }
        let in_range = |port: u16| self.enable_v2 && (start..=end).contains(&port);
        let v1_ports = self.v1_ports()?;
        let in_v1 = |port: u16| self.enable_v1 && v1_ports.contains(port);
        if self.enable_v1 || !need_a_version {
            names::validate_port_name(&self.jprofiler_port_name).map_err(|e| {
                format!("--jprofiler-port-name {:?}: {e}", self.jprofiler_port_name)
            })?;
            if let Some(port) = v1_ports.all().into_iter().find(|p| in_range(*p)) {
                return Err(format!(
                    "V1 entry port {port} (--v1-port-range or --default-map-port) is inside the \
                     V2 range {start}-{end}"
                ));
            }
        }
        if in_range(self.listen_port) {
            return Err(format!(
                "--listen-port {} (the API) is inside the V2 range {start}-{end}",
                self.listen_port
            ));
        }
        if in_v1(self.listen_port) {
            return Err(format!(
                "--listen-port {} is also a V1 entry port ({v1_ports}): the API and the V1 entry \
                 ports need different ports",
                self.listen_port
            ));
        }
        for (flag, addr) in [
            ("--health-addr", self.health_addr),
            ("--metrics-addr", self.metrics_addr),
        ] {
            let port = addr.port();
            if port == self.listen_port || in_v1(port) || in_range(port) {
                return Err(format!(
                    "{flag} {addr} collides with the API port, a V1 entry port or the V2 range"
                ));
            }
        }
        if self.metrics.metrics_secure && self.health_addr == self.metrics_addr {
            // The kubelet's plain-HTTP probes would meet the metrics server's TLS.
            return Err(format!(
                "--health-addr and --metrics-addr are both {}; with --metrics-secure they must \
                 differ (or pass --metrics-secure=false to serve both over plain HTTP)",
                self.metrics_addr
            ));
        }
        let mut allowed_sources = Vec::new();
        for text in self.allowed_source_cidrs.iter().map(|t| t.trim()) {
            if text.is_empty() {
                continue;
            }
            let cidr: Cidr = text
                .parse()
                .map_err(|e| format!("--allowed-source-cidrs: {e}"))?;
            if !allowed_sources.contains(&cidr) {
                allowed_sources.push(cidr);
            }
        }
        if self.entry_access == EntryAccess::Any && !allowed_sources.is_empty() {
            return Err(
                "--allowed-source-cidrs bounds what a request may admit to its entry port; with \
                 --entry-access=any every source is admitted, so leave one of them out"
                    .to_owned(),
            );
        }
        if self
            .allowed_namespaces
            .iter()
            .all(|ns| ns.trim().is_empty())
        {
            return Err("--allowed-namespaces is empty: name at least one namespace".to_owned());
        }
        let mut allowed = Vec::new();
        for ns in self.allowed_namespaces.iter().map(|ns| ns.trim()) {
            if ns.is_empty() {
                continue;
            }
            netkit_runtime::validate_dns_label(ns)
                .map_err(|e| format!("--allowed-namespaces: {ns:?}: {e}"))?;
            if !allowed.iter().any(|a| a == ns) {
                allowed.push(ns.to_owned());
            }
        }
        netkit_runtime::validate_dns_label(&self.state_namespace)
            .map_err(|e| format!("--state-namespace {:?}: {e}", self.state_namespace))?;
        let max_mapping = self.max_mapping_time.duration;
        if max_mapping < Duration::from_secs(1)
            || max_mapping > Duration::from_secs(365 * 24 * 3600)
        {
            return Err(format!(
                "--max-mapping-time {max_mapping:?} must be between 1s and 8760h (a year)"
            ));
        }
        for (flag, value) in [
            ("--check-timeout", self.check_timeout),
            ("--check-interval", self.check_interval),
            ("--resync-time", self.resync_time),
            ("--request-timeout", self.request_timeout),
            ("--header-read-timeout", self.header_read_timeout),
        ] {
            if value.duration.is_zero() {
                let hint = if flag.starts_with("--check") {
                    " (use --off-check to disable checks)"
                } else {
                    ""
                };
                return Err(format!("{flag} must be longer than zero{hint}"));
            }
        }
        if self.max_body_bytes < 64 {
            return Err(format!(
                "--max-body-bytes {} is too small for any request (at least 64)",
                self.max_body_bytes
            ));
        }
        let mut warnings: Vec<String> = [
            ("--max-mapping-time", self.max_mapping_time),
            ("--check-timeout", self.check_timeout),
            ("--check-interval", self.check_interval),
            ("--resync-time", self.resync_time),
            ("--request-timeout", self.request_timeout),
            ("--header-read-timeout", self.header_read_timeout),
            ("--drain-timeout", self.drain_timeout),
        ]
        .iter()
        .filter_map(|(flag, value)| value.deprecation(flag))
        .collect();
        if self.backend == BackendKind::Haproxy && self.data_path != DataPath::Auto {
            return Err(format!(
                "--data-path {} applies to --backend embedded; HAProxy relays for --backend haproxy",
                self.data_path
            ));
        }
        let runtime_api = match (self.backend, parse_runtime_api_addr(&self.api_addr)) {
            (_, Ok(addr)) => Some(addr),
            (BackendKind::Haproxy, Err(message)) => return Err(message),
            // Still read for `haproxy-config`, which may run without --backend haproxy; the
            // original's deployments set a Data Plane API URL here.
            (BackendKind::Embedded, Err(message)) => {
                warnings.push(format!(
                    "--api-addr {} is ignored with --backend embedded ({message})",
                    self.api_addr
                ));
                None
            }
        };
        if self.api_user.is_some() || self.api_password.is_some() {
            warnings.push(
                "--api-user/--api-password are ignored: the Data Plane API is not used".to_owned(),
            );
        }
        if self.max_batch_size.is_some() {
            warnings
                .push("--max-batch-size is ignored: each mapping is written on its own".to_owned());
        }
        if self.hide_backend.is_some() {
            warnings
                .push("--hide-backend is ignored: backend details are never exposed".to_owned());
        }
        let health_check = match self.off_check {
            true => None,
            // Rise 1: a new endpoint takes traffic at its first good check; fall 2.
            false => Some(
                HealthCheck::new(
                    self.check_interval.duration,
                    self.check_timeout.duration,
                    1,
                    2,
                )
                .map_err(|e| format!("--check-interval/--check-timeout: {e}"))?,
            ),
        };
        let v2 = match self.enable_v2 {
            false => None,
            true => Some(V2Policy {
                port_range: PortRange::new(start, end).map_err(|e| {
                    format!("--port-range-start {start} --port-range-end {end}: {e}")
                })?,
                port_name: self.port_name.clone(),
                target: self.v2_target,
                resync: self.resync_time.duration,
            }),
        };
        let peers = self.peer_settings()?;
        let tls = self.api_tls(need_a_version)?;
        let identity = netkit_runtime::leader_identity(self.identity.as_deref(), "pod-proxier");
        Ok(Settings {
            api: ApiSettings {
                addr: SocketAddr::new(self.api_listen_addr, self.listen_port),
                auth: self.auth,
                max_body_bytes: self.max_body_bytes,
                request_timeout: self.request_timeout.duration,
                header_read_timeout: self.header_read_timeout.duration,
                max_connections: self.max_api_connections as usize,
                tls,
            },
            plane: PlaneSettings {
                backend: self.backend,
                listen_ip: self.listen_addr,
                runtime_api,
                health_check,
                drain_timeout: self.drain_timeout.duration,
                data_path: self.data_path,
            },
            policy: MappingPolicy {
                v1: self.enable_v1.then(|| V1Policy {
                    entry_ports: v1_ports,
                    pod_port: self.default_map_port,
                    port_name: self.jprofiler_port_name.clone(),
                }),
                v2,
                allowed_namespaces: allowed,
                max_mapping_time: max_mapping,
                entry_access: self.entry_access,
                sources: SourcePolicy {
                    allowed: allowed_sources,
                },
            },
            cluster: ClusterSettings {
                kubeconfig: self.client.kubeconfig.clone(),
                state_namespace: self.state_namespace.clone(),
                identity,
                lease_name: self.lease_name.clone(),
                peers,
            },
            health_addr: self.health_addr,
            metrics_addr: self.metrics_addr,
            metrics: self.metrics.clone(),
            warnings,
        })
    }
}

/// An equality-based label selector (`key=value[,key=value...]`), checked as the API server
/// would check its keys and values, in its canonical form.
fn parse_label_selector(text: &str) -> Result<String, String> {
    let mut requirements = Vec::new();
    for requirement in text.split(',').map(str::trim) {
        let Some((key, value)) = requirement.split_once('=') else {
            return Err(format!(
                "{requirement:?} is not key=value (only equality-based selectors are taken)"
            ));
        };
        let value = value.strip_prefix('=').unwrap_or(value).trim();
        let key = key.trim();
        netkit_runtime::validate_qualified_name(key, false)
            .map_err(|e| format!("label key: {e}"))?;
        if !value.is_empty() && !netkit_runtime::is_qualified_name_part(value) {
            return Err(format!("{value:?} is not a label value"));
        }
        requirements.push(format!("{key}={value}"));
    }
    Ok(requirements.join(","))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        // The API's transport is tested on its own below.
        let mut all = vec!["pod-proxier", "--plain-http"];
        all.extend_from_slice(args);
        netkit_runtime::try_parse_args_from(all).unwrap()
    }

    #[test]
    fn boolean_flags_take_go_values() {
        let c = cli(&["--enable-v1=true", "--enable-v2=false", "--off-check"]);
        assert!(c.enable_v1 && !c.enable_v2 && c.off_check);
        let c = cli(&["--enable-v1=1", "--enable-v2=T", "--off-check=F"]);
        assert!(c.enable_v1 && c.enable_v2 && !c.off_check);
        let err =
            netkit_runtime::try_parse_args_from::<Cli, _, _>(["pod-proxier", "--enable-v1=maybe"])
                .err()
                .unwrap();
        assert!(err.to_string().contains("not a boolean"), "{err}");
    }

    #[test]
    fn durations_take_go_syntax_and_the_old_seconds_with_a_warning() {
        let c = cli(&[
            "--enable-v1",
            "--drain-timeout=1m30s",
            "--max-mapping-time=2h",
        ]);
        let settings = c.validate(true).unwrap();
        assert_eq!(settings.plane.drain_timeout, Duration::from_secs(90));
        assert_eq!(settings.policy.max_mapping_time, Duration::from_secs(7200));
        assert!(settings.warnings.is_empty(), "{:?}", settings.warnings);
        let c = cli(&["--enable-v2", "--drain-timeout=30", "--resync-time=600"]);
        let settings = c.validate(true).unwrap();
        assert_eq!(settings.plane.drain_timeout, Duration::from_secs(30));
        assert_eq!(settings.policy.v2.unwrap().resync, Duration::from_secs(600));
        assert_eq!(settings.warnings.len(), 2, "{:?}", settings.warnings);
        assert!(settings.warnings[1].contains("--drain-timeout 30"));
        let err = netkit_runtime::try_parse_args_from::<Cli, _, _>([
            "pod-proxier",
            "--drain-timeout=30x",
        ])
        .err()
        .unwrap();
        assert!(err.to_string().contains("unknown unit"), "{err}");
    }

    #[test]
    fn the_peer_check_takes_an_equality_selector_and_a_reachable_health_port() {
        let settings = cli(&["--enable-v2"]).validate(true).unwrap();
        assert!(settings.cluster.peers.is_none(), "off without a selector");
        let c = cli(&[
            "--enable-v2",
            "--peer-selector= app.kubernetes.io/name=pod-proxier , app.kubernetes.io/instance==px",
            "--peer-check-interval=500ms",
            "--peer-check-failures=3",
        ]);
        let peers = c.validate(true).unwrap().cluster.peers.unwrap();
        assert_eq!(
            peers.selector,
            "app.kubernetes.io/name=pod-proxier,app.kubernetes.io/instance=px"
        );
        assert_eq!(peers.check.port, 8081, "the health port");
        assert_eq!(peers.check.interval, Duration::from_millis(500));
        assert_eq!(peers.check.failures.get(), 3);
        assert!(peers.check.down_only_after_an_answer);
        for (flags, reason) in [
            (&["--peer-selector=app in (a,b)"][..], "only equality-based"),
            (
                &["--peer-selector=-app=x"],
                "label key: \"-app\" is not a qualified name",
            ),
            (&["--peer-selector=app=x y"], "not a label value"),
            (
                &["--peer-selector=Bad_/app=x"],
                "its prefix may contain only",
            ),
            (
                &["--peer-selector=app=x", "--peer-check-interval=0s"],
                "interval is 0",
            ),
            (
                &["--peer-selector=app=x", "--peer-check-failures=0"],
                "are 0",
            ),
            (
                &["--peer-selector=app=x", "--health-addr=127.0.0.1:8081"],
                "not reachable from the other replicas",
            ),
        ] {
            let mut args = vec!["--enable-v2"];
            args.extend_from_slice(flags);
            let err = cli(&args).validate(true).unwrap_err();
            assert!(err.contains(reason), "{flags:?}: {err}");
        }
    }

    #[test]
    fn defaults_match_the_original() {
        let c = cli(&["--enable-v1"]);
        assert_eq!(c.listen_port, 3343);
        assert_eq!(c.default_map_port, 8849);
        assert_eq!((c.port_range_start, c.port_range_end), (9000, 9100));
        assert_eq!(c.allowed_namespaces, vec!["default"]);
        assert_eq!(c.max_mapping_time.duration, Duration::from_secs(10800));
        assert_eq!(c.check_timeout.duration, Duration::from_secs(15));
        assert_eq!(c.port_name, "debug");
        // The original's `jprofiler_tcp` is not a valid port name; ours is.
        assert!(names::validate_port_name(&c.jprofiler_port_name).is_ok());
        assert!(names::validate_port_name("jprofiler_tcp").is_err());
        assert_eq!(c.data_path, DataPath::Auto);
        let settings = c.validate(true).unwrap();
        assert_eq!(settings.plane.data_path, DataPath::Auto);
        let c = cli(&["--enable-v1", "--data-path", "event-loop"]);
        assert_eq!(
            c.validate(true).unwrap().plane.data_path,
            DataPath::EventLoop
        );
        let unknown: Result<Cli, _> =
            netkit_runtime::try_parse_args_from(["pod-proxier", "--data-path", "epoll"]);
        let error = unknown.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            error.contains("expected auto, event-loop or tokio"),
            "{error}"
        );
    }

    #[test]
    fn invalid_combinations_are_rejected_with_a_reason() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "--enable-v1"),
            (
                &[
                    "--enable-v2",
                    "--port-range-start",
                    "9100",
                    "--port-range-end",
                    "9000",
                ],
                "lower than",
            ),
            (
                &["--enable-v2", "--port-range-start", "80"],
                "at least 1024",
            ),
            (
                &["--enable-v1", "--jprofiler-port-name", "jprofiler_tcp"],
                "--jprofiler-port-name",
            ),
            (&["--enable-v2", "--port-name", "Debug"], "--port-name"),
            (
                &["--enable-v1", "--enable-v2", "--default-map-port", "9050"],
                "inside the V2 range",
            ),
            (&["--enable-v1", "--allowed-namespaces", ""], "empty"),
            (
                &["--enable-v1", "--allowed-namespaces", "Bad_NS"],
                "allowed-namespaces",
            ),
            (
                &["--enable-v1", "--max-mapping-time", "0"],
                "max-mapping-time",
            ),
            (
                &[
                    "--enable-v1",
                    "--backend",
                    "haproxy",
                    "--api-addr",
                    "http://127.0.0.1:5555",
                ],
                "Runtime API",
            ),
            (&["--enable-v1", "--listen-port", "8849"], "different ports"),
            (
                &[
                    "--enable-v1",
                    "--backend",
                    "haproxy",
                    "--data-path",
                    "tokio",
                ],
                "--data-path tokio applies to --backend embedded",
            ),
            (
                &["--enable-v1", "--metrics-addr", "0.0.0.0:3343"],
                "--metrics-addr 0.0.0.0:3343 collides",
            ),
            (
                &["--enable-v1", "--health-addr", "0.0.0.0:8849"],
                "--health-addr 0.0.0.0:8849 collides",
            ),
            (
                &["--enable-v1", "--metrics-addr", "0.0.0.0:8081"],
                "with --metrics-secure they must differ",
            ),
        ];
        for (args, expected) in cases {
            let err = cli(args).validate(true).unwrap_err();
            assert!(err.contains(expected), "{args:?}: {err}");
        }
    }

    #[test]
    fn metrics_are_secure_by_default_and_may_share_the_health_port_only_when_open() {
        let settings = cli(&["--enable-v1"]).validate(true).unwrap();
        assert!(settings.metrics.metrics_secure);
        assert_ne!(settings.health_addr, settings.metrics_addr);
        let open = cli(&[
            "--enable-v1",
            "--metrics-secure=false",
            "--metrics-addr=0.0.0.0:8081",
        ])
        .validate(true)
        .unwrap();
        assert!(!open.metrics.metrics_secure);
        assert_eq!(open.health_addr, open.metrics_addr);
    }

    #[test]
    fn the_api_needs_tls_or_an_explicit_plain_http() {
        let parse = |args: &[&str]| {
            let mut all = vec!["pod-proxier", "--enable-v1"];
            all.extend_from_slice(args);
            netkit_runtime::try_parse_args_from::<Cli, _, _>(all).unwrap()
        };
        let err = parse(&[]).validate(true).unwrap_err();
        assert!(
            err.contains("--tls-cert-file and --tls-key-file") && err.contains("--plain-http"),
            "{err}"
        );
        // Subcommands that serve nothing need neither.
        assert!(parse(&[]).validate(false).unwrap().api.tls.is_none());
        let settings = parse(&["--tls-cert-file=c.pem", "--tls-key-file=k.pem"])
            .validate(true)
            .unwrap();
        assert_eq!(
            settings.api.tls,
            Some(ApiTls {
                cert_file: "c.pem".into(),
                key_file: "k.pem".into()
            })
        );
        assert!(
            parse(&["--plain-http"])
                .validate(true)
                .unwrap()
                .api
                .tls
                .is_none()
        );
        for (args, expected) in [
            (&["--tls-cert-file=c.pem"][..], "needs --tls-key-file"),
            (&["--tls-key-file=k.pem"][..], "needs --tls-cert-file"),
            (
                &["--plain-http", "--tls-cert-file=c", "--tls-key-file=k"][..],
                "exclude each other",
            ),
        ] {
            let err = parse(args).validate(true).unwrap_err();
            assert!(err.contains(expected), "{args:?}: {err}");
        }
    }

    #[test]
    fn legacy_flags_are_accepted_and_ignored() {
        let c = cli(&[
            "--enable-v1",
            "--api-user",
            "admin",
            "--api-password",
            "x",
            "--hide-backend",
        ]);
        let settings = c.validate(true).unwrap();
        assert_eq!(settings.warnings.len(), 2);
    }
}
