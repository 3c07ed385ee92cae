//! Command-line flags (the original's names and defaults, plus ours) and their validation.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::duration;

/// Flags. The first five are the original's, with its defaults and `UPSTREAM_ADDR`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "steward-tcp-proxy",
    version,
    about = "Points the tenant cluster's `kubernetes` EndpointSlice at this proxy and relays TCP to the real API server"
)]
pub struct Args {
    /// Address to accept relayed connections on (`:6443` means every IPv4 interface, `[::]:6443`
    /// every interface).
    #[arg(long, env = "STEWARD_LISTEN_ADDR", default_value = ":6443", value_parser = parse_listen_addr)]
    pub listen_addr: SocketAddr,

    /// The real API server, `host:port`.
    #[arg(long, env = "UPSTREAM_ADDR", value_parser = parse_upstream_addr)]
    pub upstream_addr: String,

    /// Name of this proxy's own Service.
    #[arg(
        long,
        env = "STEWARD_SERVICE_NAME",
        default_value = "steward-tcp-proxy"
    )]
    pub service_name: String,

    /// Port published in the EndpointSlice in cluster-ip mode (the proxy Service's port).
    #[arg(long, env = "STEWARD_SERVICE_PORT", default_value_t = 6443, value_parser = clap::value_parser!(u16).range(1..))]
    pub service_port: u16,

    /// Resync period of the EndpointSlice (Go duration); changes are watched, this is a safety net.
    #[arg(long, env = "STEWARD_RECONCILE_INTERVAL", default_value = "30s", value_parser = parse_positive_duration)]
    pub reconcile_interval: Duration,

    /// Namespace of this proxy's Service (and of its leader-election Lease).
    #[arg(long, env = "STEWARD_SERVICE_NAMESPACE", default_value = "kube-system")]
    pub service_namespace: String,

    /// What the `kubernetes` endpoints point at: the ready addresses of this proxy's Service
    /// (`pod-ip`), or its ClusterIP as the original did (`cluster-ip`; kube-proxy does not route to
    /// a ClusterIP used as an endpoint, so use it only with a dataplane that does).
    #[arg(long, env = "STEWARD_ENDPOINT_MODE", value_enum, default_value_t = EndpointMode::PodIp)]
    pub endpoint_mode: EndpointMode,

    /// kubeconfig for running outside the cluster (default: in-cluster, then $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Address of `/healthz` and `/readyz`.
    #[arg(long, env = "STEWARD_HEALTH_ADDR", default_value = ":8080", value_parser = parse_listen_addr)]
    pub health_addr: SocketAddr,

    /// Address of `/metrics`.
    #[arg(long, env = "STEWARD_METRICS_ADDR", default_value = ":9090", value_parser = parse_listen_addr)]
    pub metrics_addr: SocketAddr,

    /// Only the holder of a Lease in the service namespace writes the endpoints; every replica relays.
    #[arg(long, env = "STEWARD_LEADER_ELECT")]
    pub leader_elect: bool,

    /// This replica's leader-election identity (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// How long in-flight connections may finish after SIGTERM (Go duration).
    #[arg(long, env = "STEWARD_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Dial timeout towards the upstream (Go duration).
    #[arg(long, env = "STEWARD_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub connect_timeout: Duration,

    /// Close a connection idle for this long (Go duration; 0 = never, the default, as watches can
    /// be quiet for long).
    #[arg(long, env = "STEWARD_IDLE_TIMEOUT", default_value = "0", value_parser = parse_duration)]
    pub idle_timeout: Duration,

    /// Most concurrent relayed connections (0 = unlimited).
    #[arg(long, env = "STEWARD_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,

    /// Log format.
    #[arg(long, env = "STEWARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Certificate (PEM) to terminate TLS with; with --tls-key-file this turns on TLS-termination
    /// mode (reloaded when the files change). Without it, TLS passes through untouched.
    #[arg(long, env = "TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// Private key (PEM) of --tls-cert-file.
    #[arg(long, env = "TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,

    /// TLS-termination mode: server name for the upstream leg (default: the upstream host).
    #[arg(long, env = "STEWARD_UPSTREAM_SNI", requires = "tls_cert_file")]
    pub upstream_sni: Option<String>,

    /// TLS-termination mode: CA bundle (PEM) to verify the upstream with (default: system roots).
    #[arg(
        long,
        env = "STEWARD_UPSTREAM_CA_FILE",
        requires = "tls_cert_file",
        conflicts_with = "upstream_insecure"
    )]
    pub upstream_ca_file: Option<PathBuf>,

    /// TLS-termination mode: do not verify the upstream certificate (insecure).
    #[arg(long, env = "STEWARD_UPSTREAM_INSECURE", requires = "tls_cert_file")]
    pub upstream_insecure: bool,
}

/// What the `kubernetes` endpoints point at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndpointMode {
    /// The ready addresses of the proxy Service's own endpoints.
    PodIp,
    /// The proxy Service's ClusterIP (the original's behaviour).
    ClusterIp,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl Args {
    /// Checks what clap cannot: combinations and names.
    pub fn validate(&self) -> Result<(), String> {
        if !is_dns_label(&self.service_name) {
            return Err(format!(
                "--service-name {:?} is not a valid Service name (lowercase letters, digits and '-', at most 63)",
                self.service_name
            ));
        }
        if !is_dns_label(&self.service_namespace) {
            return Err(format!(
                "--service-namespace {:?} is not a valid namespace name",
                self.service_namespace
            ));
        }
        for (flag, addr) in [
            ("--health-addr", self.health_addr),
            ("--metrics-addr", self.metrics_addr),
        ] {
            if addr == self.listen_addr {
                return Err(format!("{flag} {addr} is the same as --listen-addr"));
            }
        }
        Ok(())
    }
}

fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// `host:port`, `:port` (every IPv4 interface; pass `[::]:port` for IPv6 too) or `[v6]:port`.
fn parse_listen_addr(value: &str) -> Result<SocketAddr, String> {
    if let Some(port) = value.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{value:?}: {port:?} is not a port number"))?;
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    }
    value
        .parse()
        .map_err(|_| format!("{value:?} is not an address like :6443, 0.0.0.0:6443 or [::]:6443"))
}

/// `host:port` with a non-empty host and a port in 1..=65535.
fn parse_upstream_addr(value: &str) -> Result<String, String> {
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| format!("{value:?} is not host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(['/', ' ', '@']) {
        return Err(format!("{value:?}: the host part is missing or invalid"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(value.to_owned()),
        _ => Err(format!("{value:?}: {port:?} is not a port number")),
    }
}

fn parse_duration(value: &str) -> Result<Duration, String> {
    duration::parse(value)
}

fn parse_positive_duration(value: &str) -> Result<Duration, String> {
    match duration::parse(value)? {
        d if d.is_zero() => Err(format!("{value:?} must be longer than zero")),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("steward-tcp-proxy").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_the_originals() {
        let args = parse(&["--upstream-addr", "api.example:6443"]).unwrap();
        assert_eq!(args.listen_addr.port(), 6443);
        assert!(args.listen_addr.ip().is_unspecified());
        assert_eq!(args.service_name, "steward-tcp-proxy");
        assert_eq!(args.service_port, 6443);
        assert_eq!(args.reconcile_interval, Duration::from_secs(30));
        assert_eq!(args.service_namespace, "kube-system");
        assert!(args.validate().is_ok());
    }

    #[test]
    fn bad_values_are_refused() {
        let cases: &[&[&str]] = &[
            &[],                                                       // upstream required
            &["--upstream-addr", "nohost"],                            // no port
            &["--upstream-addr", ":6443"],                             // no host
            &["--upstream-addr", "h:0"],                               // port zero
            &["--upstream-addr", "h:1", "--listen-addr", "x"],         // bad listen
            &["--upstream-addr", "h:1", "--reconcile-interval", "30"], // no unit
            &["--upstream-addr", "h:1", "--reconcile-interval", "0s"],
            &["--upstream-addr", "h:1", "--service-port", "0"],
            &["--upstream-addr", "h:1", "--endpoint-mode", "node-ip"],
            &["--upstream-addr", "h:1", "--tls-cert-file", "c.pem"], // key missing
            &["--upstream-addr", "h:1", "--upstream-insecure"],      // without TLS mode
        ];
        for case in cases {
            assert!(parse(case).is_err(), "{case:?} should be refused");
        }
        let args = parse(&["--upstream-addr", "h:1", "--service-name", "Bad_Name"]).unwrap();
        assert!(args.validate().is_err());
        let args = parse(&["--upstream-addr", "h:1", "--health-addr", ":6443"]).unwrap();
        assert!(args.validate().is_err());
    }
}
