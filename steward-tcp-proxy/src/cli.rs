//! Command-line flags (the original's names and defaults, plus ours) and their validation.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use k8s_reconcile::peers::PeerCheckConfig;
use netkit_runtime::{
    ClientArgs, LogArgs, MetricsArgs, OpsBindFailure, OptionalListenAddr, parse_duration,
    parse_listen_addr, parse_optional_listen_addr, parse_positive_duration, validate_dns_label,
};
use proxy_core::http_connect::HttpProxy;
use proxy_core::server::DataPath;
use proxy_core::upstream::Upstream;

/// Most runtime threads `--threads` accepts.
const MAX_THREADS: usize = 1024;

/// Flags. The first five are the original's, with its defaults and `UPSTREAM_ADDR`. Boolean flags
/// take Go's forms (`--flag`, `--flag=true`, `--flag=false`): parse with
/// [`netkit_runtime::parse_args`].
#[derive(Debug, Clone, Parser)]
#[command(
    name = "steward-tcp-proxy",
    version,
    about = "Points the tenant cluster's `kubernetes` EndpointSlice at this proxy and relays TCP to the real API server",
    mut_arg("log_format", |a| a.env("STEWARD_LOG_FORMAT")),
    mut_arg("log_level", |a| a.env("STEWARD_LOG_LEVEL")),
    mut_arg("metrics_secure", |a| a.env("STEWARD_METRICS_SECURE")),
    mut_arg("metrics_cert_file", |a| a.env("STEWARD_METRICS_CERT_FILE")),
    mut_arg("metrics_key_file", |a| a.env("STEWARD_METRICS_KEY_FILE"))
)]
pub struct Args {
    /// Address to accept relayed connections on. `:6443` means every interface of both families,
    /// as in Go (one dual-stack IPv6 socket, or IPv4 alone on a host without IPv6);
    /// `0.0.0.0:6443` means IPv4 only.
    #[arg(long, env = "STEWARD_LISTEN_ADDR", default_value = ":6443", value_parser = parse_listen_addr)]
    pub listen_addr: SocketAddr,

    /// The real API server, `host:port` (a comma-separated list: round-robin with failover).
    #[arg(long, env = "UPSTREAM_ADDR", value_parser = parse_upstream_addr)]
    pub upstream_addr: Upstream,

    /// Reach the upstream through this HTTP proxy (`http://[user:password@]host[:port]`, HTTP
    /// CONNECT). Unset: `HTTPS_PROXY`/`https_proxy`, unless `NO_PROXY`/`no_proxy` exempts the
    /// upstream (loopback always is, as in Go).
    #[arg(long, env = "STEWARD_UPSTREAM_PROXY", value_parser = parse_upstream_proxy)]
    pub upstream_proxy: Option<HttpProxy>,

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

    /// Pod-ip mode: the leader dials each published replica's health port (the port of
    /// --health-addr) this often, and leaves out of the endpoints a replica that does not answer
    /// within it, long before its node is marked NotReady (Go duration; 0 = off).
    #[arg(long, env = "STEWARD_PEER_CHECK_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub peer_check_interval: Duration,

    /// Failed peer checks in a row that leave a replica out of the endpoints (at least 1); one
    /// success brings it back.
    #[arg(long, env = "STEWARD_PEER_CHECK_FAILURES", default_value_t = 2)]
    pub peer_check_failures: u32,

    #[command(flatten)]
    pub client: ClientArgs,

    /// Address of `/healthz` and `/readyz`, open to anyone (the kubelet's probes); "0" turns it
    /// off.
    #[arg(long, env = "STEWARD_HEALTH_ADDR", default_value = ":8080", value_parser = parse_optional_listen_addr)]
    pub health_addr: OptionalListenAddr,

    /// Address of `/metrics` (HTTPS with a token unless --metrics-secure=false); "0" turns it
    /// off.
    #[arg(long, env = "STEWARD_METRICS_ADDR", default_value = ":9090", value_parser = parse_optional_listen_addr)]
    pub metrics_addr: OptionalListenAddr,

    #[command(flatten)]
    pub metrics: MetricsArgs,

    /// What a taken --health-addr or --metrics-addr port does: `log` (warn, count it in
    /// `steward_tcp_proxy_ops_listeners_unbound` and relay without that server: a hostNetwork Pod
    /// must not crash-loop because another program holds 8080 or 9090) or `exit` (stop the start).
    #[arg(long, env = "STEWARD_OPS_BIND_FAILURE", value_enum, default_value_t = OpsBindFailure::Log)]
    pub ops_bind_failure: OpsBindFailure,

    /// Only the holder of a Lease in the service namespace writes the endpoints; every replica relays.
    #[arg(long, env = "STEWARD_LEADER_ELECT")]
    pub leader_elect: bool,

    /// This replica's leader-election identity (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// After SIGTERM, keep accepting (while not ready) for this long before draining, so that the
    /// endpoints and kube-proxy drop this replica first (as kube-apiserver's
    /// --shutdown-delay-duration; Go duration).
    #[arg(long, env = "STEWARD_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
    pub shutdown_delay: Duration,

    /// How long in-flight connections may finish after SIGTERM (Go duration).
    #[arg(long, env = "STEWARD_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// During the drain, close a connection once its last bytes went to the client and it has
    /// been quiet this long, so its client reconnects to another replica between requests
    /// instead of being cut at --drain-timeout (Go duration; 0 = only at the deadline).
    #[arg(long, env = "STEWARD_DRAIN_IDLE", default_value = "20ms", value_parser = parse_duration)]
    pub drain_idle: Duration,

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

    /// Threads that relay and reconcile: 1 is one event loop (the lowest per-connection cost
    /// when one CPU suffices), more a pool of that many workers, at most 1024 [default: one per
    /// CPU].
    #[arg(long, env = "STEWARD_THREADS")]
    pub threads: Option<NonZeroUsize>,

    /// What relays plain connections: `event-loop` (Linux: connection state machines on an
    /// epoll loop, the least CPU and memory), `tokio` (a task per connection, the fallback if
    /// the loop misbehaves on a node) or `auto` (the event loop on Linux). TLS termination
    /// always uses tokio tasks.
    #[arg(long, env = "STEWARD_DATA_PATH", default_value = "auto", value_parser = str::parse::<DataPath>)]
    pub data_path: DataPath,

    #[command(flatten)]
    pub log: LogArgs,

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
    #[arg(long, env = "STEWARD_UPSTREAM_CA_FILE", requires = "tls_cert_file")]
    pub upstream_ca_file: Option<PathBuf>,

    /// TLS-termination mode: do not verify the upstream certificate (insecure).
    #[arg(long, env = "STEWARD_UPSTREAM_INSECURE")]
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

impl Args {
    /// Checks what clap cannot: combinations and names.
    pub fn validate(&self) -> Result<(), String> {
        // Here rather than clap's `requires`, so that `--upstream-insecure=false` is always fine.
        if self.upstream_insecure {
            if self.tls_cert_file.is_none() {
                return Err(
                    "--upstream-insecure needs TLS-termination mode (--tls-cert-file and --tls-key-file)"
                        .to_owned(),
                );
            }
            if self.upstream_ca_file.is_some() {
                return Err(
                    "--upstream-insecure and --upstream-ca-file contradict each other".to_owned(),
                );
            }
        }
        validate_dns_label(&self.service_name).map_err(|e| {
            format!(
                "--service-name {:?} is not a valid Service name: it {e}",
                self.service_name
            )
        })?;
        validate_dns_label(&self.service_namespace).map_err(|e| {
            format!(
                "--service-namespace {:?} is not a valid namespace name: it {e}",
                self.service_namespace
            )
        })?;
        if self.peer_check_failures == 0 {
            return Err(
                "--peer-check-failures must be at least 1 (failed checks in a row before a replica is left out)"
                    .to_owned(),
            );
        }
        // The runtime starts every worker up front; a typo must not try to spawn a million.
        if let Some(threads) = self.threads
            && threads.get() > MAX_THREADS
        {
            return Err(format!("--threads {threads} is more than {MAX_THREADS}"));
        }
        if self.metrics.metrics_secure
            && self.health_addr.is_some()
            && self.health_addr == self.metrics_addr
        {
            // The kubelet's plain-HTTP probes would meet the metrics server's TLS.
            return Err(
                "--health-addr and --metrics-addr are the same address; with --metrics-secure they must differ"
                    .to_owned(),
            );
        }
        for (flag, addr) in [
            ("--health-addr", self.health_addr),
            ("--metrics-addr", self.metrics_addr),
        ] {
            if addr == Some(self.listen_addr) {
                let addr = self.listen_addr;
                return Err(format!("{flag} {addr} is the same as --listen-addr"));
            }
        }
        Ok(())
    }
}

/// An `http://` proxy URL (the error never shows the password).
fn parse_upstream_proxy(value: &str) -> Result<HttpProxy, String> {
    value
        .parse()
        .map_err(|e: proxy_core::http_connect::HttpConnectError| e.to_string())
}

/// `host:port` (an IP literal, bracketed for IPv6, or a DNS name) with a port in 1..=65535, or
/// a comma-separated list of them: parsed once, here, into what the relay connects to.
fn parse_upstream_addr(value: &str) -> Result<Upstream, String> {
    value.parse().map_err(|e: proxy_core::ConfigError| {
        format!("{e} (expected host:port, or a comma-separated list of them)")
    })
}

impl Args {
    /// The peer check the flags ask for, or why it is off. A published replica that never
    /// answers is left out too (it is as unreachable for the check as for the clients).
    pub fn peer_check(&self) -> Result<PeerCheckConfig, String> {
        if self.endpoint_mode == EndpointMode::ClusterIp {
            return Err(
                "--endpoint-mode cluster-ip publishes a ClusterIP, not the replicas".into(),
            );
        }
        PeerCheckConfig::new(
            self.health_addr,
            self.peer_check_interval,
            self.peer_check_failures,
        )
        .map_err(|off| {
            format!("{off} (--health-addr, --peer-check-interval, --peer-check-failures)")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        netkit_runtime::try_parse_args_from(
            std::iter::once("steward-tcp-proxy").chain(args.iter().copied()),
        )
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
        assert_eq!(args.threads, None);
        assert_eq!(args.peer_check_interval, Duration::from_secs(1));
        assert_eq!(args.peer_check_failures, 2);
        assert!(args.metrics.metrics_secure, "metrics are secure by default");
        assert!(args.validate().is_ok());
        let args = parse(&["--upstream-addr", "h:1", "--threads", "1"]).unwrap();
        assert_eq!(args.threads.map(NonZeroUsize::get), Some(1));
        assert_eq!(args.data_path, DataPath::Auto);
        let args = parse(&["--upstream-addr", "h:1", "--data-path", "tokio"]).unwrap();
        assert_eq!(args.data_path, DataPath::Tokio);
    }

    #[test]
    fn the_go_originals_flag_spellings_are_taken() {
        // As manifests written for the Go steward pass them: one dash, klog's -v.
        let args = parse(&[
            "-upstream-addr=h:1",
            "-v=2",
            "-leader-elect=false",
            "-service-port",
            "7443",
        ])
        .unwrap();
        assert_eq!(args.upstream_addr.describe(), "h:1");
        assert_eq!(args.service_port, 7443);
        assert!(!args.leader_elect);
    }

    #[test]
    fn the_upstream_is_parsed_once_into_what_the_relay_dials() {
        let args = parse(&["--upstream-addr", "[::1]:6443"]).unwrap();
        assert!(matches!(
            args.upstream_addr,
            Upstream::Target(proxy_core::upstream::TargetAddr::Socket(a)) if a.port() == 6443
        ));
        let args = parse(&["--upstream-addr", "api.example:6443"]).unwrap();
        assert_eq!(args.upstream_addr.describe(), "api.example:6443");
        let args = parse(&["--upstream-addr", "a.example:1, b.example:2"]).unwrap();
        assert!(matches!(args.upstream_addr, Upstream::Set(_)));
    }

    #[test]
    fn bad_values_are_refused() {
        let cases: &[&[&str]] = &[
            &[],                                                       // upstream required
            &["--upstream-addr", "nohost"],                            // no port
            &["--upstream-addr", ":6443"],                             // no host
            &["--upstream-addr", "h:0"],                               // port zero
            &["--upstream-addr", "127.0.0.1:0"],                       // port zero
            &["--upstream-addr", "a:1,"],                              // empty list item
            &["--upstream-addr", "h:1", "--listen-addr", "x"],         // bad listen
            &["--upstream-addr", "h:1", "--reconcile-interval", "30"], // no unit
            &["--upstream-addr", "h:1", "--reconcile-interval", "0s"],
            &["--upstream-addr", "h:1", "--service-port", "0"],
            &["--upstream-addr", "h:1", "--endpoint-mode", "node-ip"],
            &["--upstream-addr", "h:1", "--threads", "0"],
            &["--upstream-addr", "h:1", "--data-path", "epoll"],
            &["--upstream-addr", "h:1", "--threads", "-1"],
            &["--upstream-addr", "h:1", "--tls-cert-file", "c.pem"], // key missing
            &["--upstream-addr", "h:1", "--leader-elect=maybe"],
            &["--upstream-addr", "h:1", "--log-level", "loud"],
            &["--upstream-addr", "h:1", "--leader-elect=yes"],
            &["--upstream-addr", "h:1", "--upstream-proxy", "socks5://p:1"],
            &[
                "--upstream-addr",
                "h:1",
                "--upstream-proxy",
                "http://p:1/path",
            ],
        ];
        for case in cases {
            assert!(parse(case).is_err(), "{case:?} should be refused");
        }
        let tls = ["--tls-cert-file=c", "--tls-key-file=k"];
        for case in [
            &["--upstream-insecure"][..],  // without TLS mode
            &["--upstream-insecure=true"], // without TLS mode
            &[
                tls[0],
                tls[1],
                "--upstream-insecure",
                "--upstream-ca-file=ca",
            ], // contradiction
        ] {
            let args = parse(&[&["--upstream-addr", "h:1"], case].concat()).unwrap();
            assert!(args.validate().is_err(), "{case:?} should be refused");
        }
        let args = parse(&["--upstream-addr", "h:1", "--service-name", "Bad_Name"]).unwrap();
        assert!(args.validate().is_err());
        let args = parse(&["--upstream-addr", "h:1", "--health-addr", ":6443"]).unwrap();
        assert!(args.validate().is_err());
        let args = parse(&["--upstream-addr", "h:1", "--threads", "1025"]).unwrap();
        assert_eq!(
            args.validate().unwrap_err(),
            "--threads 1025 is more than 1024"
        );
        let args = parse(&["--upstream-addr", "h:1", "--threads", "1024"]).unwrap();
        assert!(args.validate().is_ok());
        let same = ["--upstream-addr=h:1", "--health-addr=:9090"];
        assert!(parse(&same).unwrap().validate().is_err());
        let plain = parse(&[same[0], same[1], "--metrics-secure=false"]).unwrap();
        assert!(!plain.metrics.metrics_secure);
        assert!(plain.validate().is_ok());
    }

    #[test]
    fn peer_check_flags_are_checked() {
        let args = parse(&["--upstream-addr=h:1", "--peer-check-failures=0"]).unwrap();
        assert_eq!(
            args.validate().unwrap_err(),
            "--peer-check-failures must be at least 1 (failed checks in a row before a replica is left out)"
        );
        let args = parse(&[
            "--upstream-addr=h:1",
            "--peer-check-failures=1",
            "--peer-check-interval=0",
        ])
        .unwrap();
        assert!(args.validate().is_ok());
        assert!(args.peer_check_interval.is_zero(), "0 turns the check off");
        assert!(args.peer_check().is_err(), "0 turns the check off");
        let args = parse(&["--upstream-addr=h:1", "--peer-check-interval=250ms"]).unwrap();
        assert_eq!(args.peer_check_interval, Duration::from_millis(250));
        let check = args.peer_check().unwrap();
        assert_eq!(
            check.port,
            args.health_addr.unwrap().port(),
            "the health port"
        );
        assert!(!check.down_only_after_an_answer);
        for off in [
            &["--upstream-addr=h:1", "--endpoint-mode=cluster-ip"][..],
            &["--upstream-addr=h:1", "--health-addr=0"],
            &["--upstream-addr=h:1", "--health-addr=127.0.0.1:8081"],
        ] {
            assert!(parse(off).unwrap().peer_check().is_err(), "{off:?}");
        }
        for bad in ["--peer-check-interval=1", "--peer-check-failures=-1"] {
            assert!(parse(&["--upstream-addr=h:1", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn boolean_flags_take_gos_forms() {
        let tls = [
            "--upstream-addr=h:1",
            "--tls-cert-file=c",
            "--tls-key-file=k",
        ];
        // The original's TLS mode passes exactly `--upstream-insecure=true`.
        for (form, expected) in [
            ("--upstream-insecure=true", true),
            ("--upstream-insecure", true),
            ("--upstream-insecure=1", true),
            ("--upstream-insecure=T", true),
            ("--upstream-insecure=false", false),
            ("--upstream-insecure=0", false),
            ("--upstream-insecure=False", false),
        ] {
            let args = parse(&[&tls[..], &[form]].concat()).unwrap();
            assert_eq!(args.upstream_insecure, expected, "{form}");
            assert!(args.validate().is_ok(), "{form}");
        }
        for (form, expected) in [
            ("--leader-elect", true),
            ("--leader-elect=true", true),
            ("--leader-elect=false", false),
        ] {
            assert_eq!(parse(&[tls[0], form]).unwrap().leader_elect, expected);
        }
        // `=false` without TLS mode is no contradiction: it asks for nothing.
        let args = parse(&[tls[0], "--upstream-insecure=false"]).unwrap();
        assert!(!args.upstream_insecure && args.validate().is_ok());
        // Go's rule: only `=` gives a boolean a value, so `false` here is a stray argument.
        let err = parse(&[tls[0], "--leader-elect", "false"]).unwrap_err();
        assert!(err.to_string().contains("'false'"), "{err}");
        let err = parse(&[tls[0], "--leader-elect=maybe"]).unwrap_err();
        assert!(
            err.to_string().contains("\"maybe\" is not a boolean"),
            "{err}"
        );
    }
}
