//! The tunnel agent: keeps one rstream tunnel up, forwards its streams to the target Service and
//! reports the tunnel state into its RstreamTunnel's status.
//!
//! Several agents may run for one tunnel: the one holding it is active, the others stand by on
//! open control channels (the `holder` module). Only the active agent writes the status, so a
//! standby never flaps it; a standby is ready (connected) and takes over when the holder lets go.
//! On SIGTERM the holder hands the tunnel over (the `HandOver` condition, see the `handover`
//! module), then drains the streams it still relays.

mod handover;
mod holder;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_reconcile::conditions::Conditions;
use k8s_reconcile::ops::Health;
use kube::api::Api;
use netkit_runtime::{App, ClientArgs, error_chain};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rstream_client::Client;
use rstream_client::forward::{Relayed, relay_and_log};
use rstream_client::supervisor::SupervisorConfig;
use rstream_client::tls::{ClientIdentity, TlsOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::handover::StatusHandOver;
use self::holder::{HolderHandle, HolderState, NoHandOver};
use crate::agent_config::{AgentConfig, ConfigError};
use crate::api::{RstreamTunnel, RstreamTunnelStatus};
use crate::names;
use crate::status::{self, messages, reasons, types};

/// Delay before a failed status report is tried again.
const REPORT_RETRY: Duration = Duration::from_secs(2);
/// How long a stopping agent waits for the streams it relays to finish before cutting them:
/// inside a Pod's default grace period (30 s) with the hand-over's few seconds.
const DRAIN: Duration = Duration::from_secs(20);

/// Why the agent cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The configuration file cannot be read.
    #[error("reading {path}")]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        cause: std::io::Error,
    },
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The credentials or TLS settings cannot be used.
    #[error("credentials: {0}")]
    Credentials(String),
    /// A transport option cannot be honoured (the manager refuses these before an agent runs).
    #[error("unsupported transport options: {0}")]
    Unsupported(String),
    /// The HTTP proxy settings cannot be used.
    #[error("{0}")]
    Proxy(String),
    /// The Kubernetes client cannot be built.
    #[error("building the Kubernetes client")]
    Kube(#[from] kube::Error),
    /// The health server cannot start, or the Kubernetes client cannot be configured.
    #[error(transparent)]
    Ops(#[from] netkit_runtime::Error),
}

impl AgentError {
    /// Whether the configuration (file or flags) is at fault, found before anything started: a
    /// usage error (exit code 2), as a bad flag is.
    pub fn is_configuration(&self) -> bool {
        matches!(
            self,
            Self::ReadConfig { .. }
                | Self::Config(_)
                | Self::Credentials(_)
                | Self::Unsupported(_)
                | Self::Proxy(_)
        )
    }
}

/// Runtime options (flags).
#[derive(Clone, Debug, Default)]
pub struct AgentOptions {
    /// The configuration file.
    pub config: PathBuf,
    /// Where `/healthz`, `/readyz` and `/metrics` are served (`None`: not served).
    pub health_bind_address: Option<SocketAddr>,
    /// Forward to this `host:port` instead of the configured Service (tests, debugging).
    pub target_override: Option<String>,
    /// Extra CA bundle (PEM) to trust for the engine (self-hosted engines with a private CA).
    pub ca_file: Option<PathBuf>,
    /// The client for status reports (`--kubeconfig` from outside a cluster).
    pub client: ClientArgs,
}

/// Where and as whom to report.
struct Reporter {
    api: Option<Api<RstreamTunnel>>,
    /// The tunnel has a hostname, which the engine keeps exclusive: other agents of the tunnel
    /// may be standing by, or holding it.
    standbys: bool,
    tunnel: String,
    pod: String,
    target: String,
}

impl Reporter {
    /// Writes what `state` means for the status, as far as this agent may: `held` is the tunnel
    /// this agent held last (its id), if any.
    async fn report(&self, state: &HolderState, held: Option<&str>) -> Result<(), kube::Error> {
        let Some(api) = &self.api else {
            return Ok(());
        };
        let pod = self.pod.clone();
        let target = self.target.clone();
        match state {
            // A lone agent says it is connecting (later attempts keep the Disconnected report and
            // its error visible); one that may stand by says nothing until it holds the tunnel.
            HolderState::Connecting { attempt } if *attempt <= 1 && !self.standbys => {
                status::update_status(api, &self.tunnel, |t, s: &mut RstreamTunnelStatus| {
                    let g = t.metadata.generation;
                    s.observed_generation = g;
                    s.last_error = None;
                    Conditions::of(&mut s.conditions, g)
                        .set(
                            types::TUNNEL_READY,
                            false,
                            reasons::TUNNEL_CONNECTING,
                            messages::CONNECTING,
                        )
                        .set(
                            types::READY,
                            false,
                            reasons::WAITING_FOR_TUNNEL,
                            messages::WAITING_FOR_TUNNEL,
                        );
                })
                .await?;
            }
            HolderState::Active {
                properties,
                forwarding_address,
            } => {
                status::update_status(api, &self.tunnel, |t, s: &mut RstreamTunnelStatus| {
                    let g = t.metadata.generation;
                    s.observed_generation = g;
                    s.last_error = None;
                    s.tunnel_id = properties.id.clone().filter(|v| !v.is_empty());
                    s.rstream_name = properties.name.clone().filter(|v| !v.is_empty());
                    s.hostname = properties
                        .hostname
                        .clone()
                        .filter(|v| !v.is_empty())
                        .or_else(|| properties.host.clone().filter(|v| !v.is_empty()));
                    s.forwarding_address = Some(forwarding_address.clone());
                    s.target = Some(target.clone());
                    let online = format!("Tunnel is online from agent pod {pod}.");
                    let handed_over = s
                        .conditions
                        .iter()
                        .flatten()
                        .any(|c| c.type_ == handover::HAND_OVER);
                    let mut c = Conditions::of(&mut s.conditions, g);
                    c.set(types::TUNNEL_READY, true, reasons::TUNNEL_ONLINE, online)
                        .set(types::READY, true, reasons::READY, messages::READY);
                    // A hand-over that brought the tunnel here is over (the standbys that were
                    // taking it over go back to their slow pace).
                    if handed_over {
                        c.set(
                            handover::HAND_OVER,
                            false,
                            handover::HANDED_OVER,
                            format!("Agent pod {pod} holds the tunnel."),
                        );
                    }
                })
                .await?;
            }
            HolderState::Disconnected { error, .. }
            | HolderState::Stopped { error: Some(error) } => {
                // The whole chain: the cause of a failed connect is only in source().
                let text = error_chain(error);
                let standbys = self.standbys;
                status::update_status(api, &self.tunnel, |t, s: &mut RstreamTunnelStatus| {
                    // Where agents stand by, another agent's online tunnel is left alone: only the
                    // agent that held the tunnel says it is down, or any agent while none is
                    // online (so that a bad token or an unreachable engine is still shown).
                    let ours = held.is_some() && s.tunnel_id.as_deref() == held;
                    let g = t.metadata.generation;
                    let online = Conditions::of(&mut s.conditions, g).is_true(types::TUNNEL_READY);
                    if standbys && online && !ours {
                        return;
                    }
                    s.observed_generation = g;
                    s.last_error = Some(text.clone());
                    Conditions::of(&mut s.conditions, g)
                        .set(
                            types::TUNNEL_READY,
                            false,
                            reasons::TUNNEL_DISCONNECTED,
                            text.clone(),
                        )
                        .set(
                            types::READY,
                            false,
                            reasons::WAITING_FOR_TUNNEL,
                            messages::RECONNECTING,
                        );
                })
                .await?;
            }
            // A standby must not touch the active agent's status.
            HolderState::Connecting { .. }
            | HolderState::Standby
            | HolderState::Released
            | HolderState::Stopped { error: None } => {}
        }
        Ok(())
    }
}

fn log_state(state: &HolderState, target: &str) {
    match state {
        HolderState::Connecting { attempt } => {
            tracing::info!(component = "runner", attempt, %target, "Connecting to rstream")
        }
        HolderState::Active {
            properties,
            forwarding_address,
        } => tracing::info!(
            component = "runner",
            tunnel_id = properties.id.as_deref().unwrap_or_default(),
            forwarding_address = %forwarding_address,
            %target,
            "Tunnel online"
        ),
        HolderState::Standby => tracing::info!(
            component = "runner",
            %target,
            "Standing by: another agent holds the tunnel's hostname"
        ),
        HolderState::Released => tracing::info!(
            component = "runner",
            "Tunnel handed over; finishing the streams in flight"
        ),
        HolderState::Disconnected { error, retry_in } => tracing::warn!(
            component = "runner",
            error = %error_chain(error),
            retry_in = ?retry_in,
            %target,
            "Tunnel disconnected; reconnecting"
        ),
        HolderState::Stopped { error } => tracing::info!(
            component = "runner",
            error = error.as_ref().map(ToString::to_string).unwrap_or_default(),
            "Tunnel stopped"
        ),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TunnelLabels {
    tunnel: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FlowLabels {
    tunnel: String,
    direction: &'static str,
}

/// The agent's metrics (`rstream_agent_*`), each labelled by the one tunnel it runs; the handles
/// are taken once, so a stream costs no label lookup.
#[derive(Clone, Debug)]
struct AgentMetrics {
    online: Gauge,
    holder: Gauge,
    streams: Counter,
    active: Gauge,
    failed: Counter,
    bytes: [Counter; 2],
    datagrams: [Counter; 2],
}

impl AgentMetrics {
    fn register(registry: &mut Registry, tunnel: &str) -> Self {
        let tunnel = TunnelLabels {
            tunnel: tunnel.to_owned(),
        };
        let flow = |direction| FlowLabels {
            tunnel: tunnel.tunnel.clone(),
            direction,
        };
        let family = |registry: &mut Registry, name: &str, help: &str| {
            let family = Family::<TunnelLabels, Counter>::default();
            registry.register(name, help, family.clone());
            family.get_or_create(&tunnel).clone()
        };
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let family = Family::<TunnelLabels, Gauge>::default();
            registry.register(name, help, family.clone());
            family.get_or_create(&tunnel).clone()
        };
        let flows = |registry: &mut Registry, name: &str, help: &str| {
            let family = Family::<FlowLabels, Counter>::default();
            registry.register(name, help, family.clone());
            ["to_target", "from_target"].map(|d| family.get_or_create(&flow(d)).clone())
        };
        Self {
            online: gauge(
                registry,
                "rstream_agent_tunnel_online",
                "1 while the tunnel is online: held by this agent, or (standby) by another",
            ),
            holder: gauge(
                registry,
                "rstream_agent_active",
                "1 while this agent holds the tunnel; 0 on standby or disconnected",
            ),
            streams: family(
                registry,
                "rstream_agent_streams",
                "Streams accepted on the tunnel",
            ),
            active: gauge(
                registry,
                "rstream_agent_streams_active",
                "Streams being relayed",
            ),
            failed: family(
                registry,
                "rstream_agent_stream_failures",
                "Streams whose target could not be reached",
            ),
            bytes: flows(
                registry,
                "rstream_agent_stream_bytes",
                "Bytes of finished TCP streams, by direction",
            ),
            datagrams: flows(
                registry,
                "rstream_agent_stream_datagrams",
                "Datagrams of finished UDP streams, by direction",
            ),
        }
    }

    fn record(&self, relayed: Relayed) {
        match relayed {
            Relayed::Bytes {
                to_target,
                from_target,
            } => {
                self.bytes[0].inc_by(to_target);
                self.bytes[1].inc_by(from_target);
            }
            Relayed::Datagrams {
                to_target,
                from_target,
            } => {
                self.datagrams[0].inc_by(to_target);
                self.datagrams[1].inc_by(from_target);
            }
            _ => {
                self.failed.inc();
            }
        }
    }
}

/// Follows the holder's state: readiness, gauges, logs and status reports (retried until they
/// land or a newer state replaces them).
async fn follow_state(
    mut states: watch::Receiver<HolderState>,
    reporter: Reporter,
    health: Health,
    metrics: AgentMetrics,
    shutdown: CancellationToken,
) {
    // The tunnel this agent held last: its own status may still name it.
    let mut held: Option<String> = None;
    loop {
        let state = states.borrow_and_update().clone();
        let active = matches!(state, HolderState::Active { .. });
        if let HolderState::Active { properties, .. } = &state {
            held.clone_from(&properties.id);
        }
        let connected = state.connected();
        metrics.online.set(i64::from(connected));
        metrics.holder.set(i64::from(active));
        let stopping =
            shutdown.is_cancelled() || matches!(state, HolderState::Stopped { error: None });
        // Ready while connected, active or standby: a standby is what a rollout waits for.
        let text = match &state {
            HolderState::Active { .. } => "online (active)",
            HolderState::Standby => "online (standby)",
            HolderState::Released => "handed over",
            _ => "not online",
        };
        health.set("tunnel", connected, text);
        log_state(&state, &reporter.target);
        // A shutdown is not a disconnection: nothing is reported.
        if !stopping && let Err(error) = reporter.report(&state, held.as_deref()).await {
            tracing::warn!(component = "runner", %error, "could not report the tunnel status");
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = states.changed() => {}
                () = tokio::time::sleep(REPORT_RETRY) => {}
            }
            continue;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = states.changed() => if changed.is_err() { return },
        }
    }
}

fn client_for(config: &AgentConfig, options: &AgentOptions) -> Result<Client, AgentError> {
    let token = std::env::var(names::TOKEN_ENV)
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty());
    client_with_token(config, options, token)
}

/// The engine client of `config`, authenticated with `token` (or the config's mTLS files).
fn client_with_token(
    config: &AgentConfig,
    options: &AgentOptions,
    token: Option<String>,
) -> Result<Client, AgentError> {
    let bad = |e: rstream_client::Error| AgentError::Credentials(error_chain(&e));
    let mut tls = TlsOptions::new();
    let mut proxy = None;
    let mut ip_family = None;
    let mut local_address = None;
    if let Some(transport) = &config.connection.transport {
        let refused = crate::transport::unsupported_transport(
            transport.mode,
            transport.use_quic,
            transport.bind.as_ref(),
            transport.ip_family,
            transport.dns.as_ref(),
            transport.mptcp,
        );
        if !refused.is_empty() {
            return Err(AgentError::Unsupported(refused.join("; ")));
        }
        // `dns.serverName` names a DNS-over-TLS resolver (`dns.tls`, refused above), never the
        // engine: its certificate is always checked against the engine address's host.
        ip_family = match transport.ip_family {
            Some(crate::api::IpFamily::Ipv4) => Some(rstream_client::IpFamily::V4),
            Some(crate::api::IpFamily::Ipv6) => Some(rstream_client::IpFamily::V6),
            Some(crate::api::IpFamily::Auto) | None => None,
        };
        if let Some(address) = transport
            .bind
            .as_ref()
            .and_then(|b| b.address.as_deref())
            .map(str::trim)
            .filter(|a| !a.is_empty())
        {
            let ip = address.parse().map_err(|_| {
                AgentError::Unsupported(format!(
                    "transport.bind.address: '{address}' is not an IP address"
                ))
            })?;
            local_address = Some(ip);
        }
        if let Some(p) = &transport.proxy {
            // The manager injects the credentials as environment variables named here.
            let from_env = |name: &Option<String>| {
                name.as_deref()
                    .and_then(|n| std::env::var(n).ok())
                    .map(|v| v.trim().to_owned())
                    .filter(|v| !v.is_empty())
            };
            let username = from_env(&p.username_env);
            let password = from_env(&p.password_env);
            let built = crate::transport::http_proxy(
                p.http.as_deref(),
                username.as_deref(),
                password.as_deref(),
                p.headers.as_ref(),
            )
            .map_err(AgentError::Proxy)?;
            proxy = Some(built);
        }
    }
    for ca in options
        .ca_file
        .iter()
        .chain(config.connection.ca_file.as_ref().map(PathBuf::from).iter())
    {
        tls = tls.ca_file(ca).map_err(bad)?;
    }
    let mut builder = Client::builder()
        .engine(config.connection.engine.trim())
        .agent("rstream-operator-agent", env!("CARGO_PKG_VERSION"));
    match (&token, &config.connection.mtls) {
        (Some(_), Some(_)) => {
            return Err(AgentError::Credentials(format!(
                "both {} and mTLS are configured; use one",
                names::TOKEN_ENV
            )));
        }
        (None, None) => {
            return Err(AgentError::Credentials(format!(
                "no credentials: set {} or connection.mtls",
                names::TOKEN_ENV
            )));
        }
        (Some(token), None) => builder = builder.token(token),
        (None, Some(m)) => {
            let identity = ClientIdentity::from_files(&m.cert_file, &m.key_file).map_err(bad)?;
            tls = tls.client_identity(identity);
            if let Some(ca) = &m.ca_file {
                tls = tls.ca_file(ca).map_err(bad)?;
            }
        }
    }
    if let Some(proxy) = proxy {
        builder = builder.proxy(proxy);
    }
    if let Some(family) = ip_family {
        builder = builder.ip_family(family);
    }
    if let Some(address) = local_address {
        builder = builder.local_address(address);
    }
    if let Some(seconds) = config
        .connection
        .transport
        .as_ref()
        .and_then(|t| t.heartbeat_interval_seconds)
    {
        builder = builder.heartbeat_interval(Some(Duration::from_secs(u64::from(seconds))));
    }
    builder.tls(tls).build().map_err(bad)
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(options: AgentOptions) -> Result<(), AgentError> {
    let text =
        std::fs::read_to_string(&options.config).map_err(|cause| AgentError::ReadConfig {
            path: options.config.clone(),
            cause,
        })?;
    // Decoded and validated once: the tunnel options, backoff and target kind come from here.
    let (config, validated) = AgentConfig::decode(&text)?;
    let (initial, max) = validated.retry;
    let kind = validated.target;
    let tunnel_options = validated.tunnel;
    let client = client_for(&config, &options)?;
    let target: Arc<str> = options
        .target_override
        .clone()
        .filter(|t| !t.trim().is_empty())
        .unwrap_or_else(|| config.target_address())
        .into();

    let mut builder = App::builder("rstream-agent", env!("CARGO_PKG_VERSION"));
    builder.health().set("tunnel", false, "not online");
    // Named as the RstreamTunnel when reporting to one, else as the rstream tunnel.
    let tunnel_label = (config.kubernetes.as_ref())
        .map(|k| k.tunnel_name.clone())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| config.tunnel.name.clone());
    let metrics = AgentMetrics::register(builder.registry(), &tunnel_label);
    let app = builder
        .serve_ops(options.health_bind_address)
        .start()
        .await?;
    let health = app.health().clone();
    let shutdown = app.shutdown().clone();

    let standbys = tunnel_options.hostname.is_some();
    let reporter = match config.kubernetes.as_ref().filter(|k| k.enabled) {
        Some(k) => {
            let namespace = k
                .pod_namespace_env
                .as_deref()
                .and_then(|e| std::env::var(e).ok())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| k.namespace.clone());
            let pod = k
                .pod_name_env
                .as_deref()
                .and_then(|e| std::env::var(e).ok())
                .unwrap_or_default();
            let kube = options.client.client().await?;
            Reporter {
                api: Some(Api::namespaced(kube, &namespace)),
                standbys,
                tunnel: k.tunnel_name.clone(),
                pod,
                target: format!("{}:{}", config.target.host, config.target.port),
            }
        }
        None => Reporter {
            api: None,
            standbys,
            tunnel: String::new(),
            pod: String::new(),
            target: target.to_string(),
        },
    };

    // The backoff and jitter of rstream-client's supervisor; every error is retried (the
    // manager checked the configuration, and a Secret may be fixed later).
    let backoff = SupervisorConfig::default().backoff(initial, max);
    // Where agents stand by and report to their tunnel, its status carries the hand-over.
    let mut handle = match (&reporter.api, standbys) {
        (Some(api), true) => {
            let channel = StatusHandOver {
                api: api.clone(),
                tunnel: reporter.tunnel.clone(),
                pod: reporter.pod.clone(),
            };
            HolderHandle::spawn(client, tunnel_options, backoff, Arc::new(channel))
        }
        _ => HolderHandle::spawn(client, tunnel_options, backoff, Arc::new(NoHandOver)),
    };
    let stop_reports = CancellationToken::new();
    let follower = tokio::spawn(follow_state(
        handle.watch(),
        reporter,
        health.clone(),
        metrics.clone(),
        stop_reports.clone(),
    ));

    let relays = TaskTracker::new();
    let relay_cancel = CancellationToken::new();
    let relay = |stream| {
        let metrics = metrics.clone();
        metrics.streams.inc();
        metrics.active.inc();
        let relay = relay_and_log(stream, Arc::clone(&target), kind, relay_cancel.clone());
        relays.spawn(async move {
            metrics.record(relay.await);
            metrics.active.dec();
        });
    };
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            next = handle.accept() => match next {
                Some(stream) => relay(stream),
                None => break,
            },
        }
    }
    tracing::info!(component = "runner", "shutting down");
    health.set("tunnel", false, "shutting down");
    // Hand the tunnel over (a standby takes it within milliseconds once it is ready), serving
    // every stream the engine sends until it has let go.
    handle.release();
    let mut states = handle.watch();
    loop {
        tokio::select! {
            biased;
            next = handle.accept() => match next {
                Some(stream) => relay(stream),
                None => break,
            },
            let_go = states.wait_for(HolderState::let_go) => if let_go.is_ok() { break },
        }
    }
    while let Some(stream) = handle.try_accept() {
        relay(stream);
    }
    // The streams in flight finish (the channel stays open meanwhile), within a bound.
    relays.close();
    if tokio::time::timeout(DRAIN, relays.wait()).await.is_err() {
        tracing::warn!(
            component = "runner",
            streams = metrics.active.get(),
            "streams still running after {DRAIN:?}; closing them"
        );
    }
    // Then the channel; the reports stop (a shutdown is not reported as a disconnection).
    handle.shutdown().await;
    stop_reports.cancel();
    let _ = follower.await;
    relay_cancel.cancel();
    relays.wait().await;
    app.finish().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::agent_config::{ConnectionConfig, TransportConfig};
    use crate::api::DnsSpec;

    /// Connects to a local engine (token `t`, its CA by file) as an agent whose connection has
    /// `transport`. The engine and the directory must outlive the channel.
    async fn connect_with(
        transport: TransportConfig,
    ) -> (
        rstream_client::engine::LocalEngine,
        tempfile::TempDir,
        Result<rstream_client::ControlChannel, rstream_client::Error>,
    ) {
        let engine = rstream_client::engine::LocalEngine::builder()
            .token("t")
            .start()
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("engine-ca.pem");
        std::fs::write(&ca, engine.ca_pem()).unwrap();
        let config = AgentConfig {
            connection: ConnectionConfig {
                engine: engine.engine_address(),
                ca_file: Some(ca.display().to_string()),
                transport: Some(transport),
                ..ConnectionConfig::default()
            },
            ..AgentConfig::default()
        };
        let client =
            client_with_token(&config, &AgentOptions::default(), Some("t".into())).unwrap();
        let connected = tokio::time::timeout(Duration::from_secs(30), client.connect())
            .await
            .expect("no answer from the engine in 30 s");
        (engine, dir, connected)
    }

    /// A connection setting only `transport.dns.serverName` (the DNS-over-TLS resolver's name in
    /// the original) still checks the engine's certificate against the engine's host: the agent
    /// connects to an engine whose certificate names `127.0.0.1`, not the resolver.
    #[tokio::test]
    async fn dns_server_name_does_not_change_the_engine_certificate_check() {
        let (_engine, _dir, connected) = connect_with(TransportConfig {
            dns: Some(DnsSpec {
                server_name: Some("dns-resolver.example.invalid".into()),
                ..DnsSpec::default()
            }),
            ..TransportConfig::default()
        })
        .await;
        match connected {
            Ok(channel) => channel.close().await.unwrap(),
            Err(e) => panic!("the engine's certificate was not accepted for its host: {e}"),
        }
    }

    /// `transport.heartbeatIntervalSeconds` is the interval the agent asks the engine for: the
    /// local engine answers with three intervals as the channel's liveness timeout (15 s with the
    /// client's default of 5 s).
    #[tokio::test]
    async fn the_heartbeat_interval_is_what_the_agent_negotiates() {
        let (_engine, _dir, connected) = connect_with(TransportConfig {
            heartbeat_interval_seconds: Some(2),
            ..TransportConfig::default()
        })
        .await;
        let channel = connected.unwrap();
        assert_eq!(channel.liveness_timeout(), Some(Duration::from_secs(6)));
        channel.close().await.unwrap();
    }

    #[test]
    fn the_agents_metrics_count_streams_and_what_they_carried() {
        let mut registry = netkit_runtime::metrics_registry("rstream-agent", "9.9.9");
        let metrics = AgentMetrics::register(&mut registry, "web");
        metrics.streams.inc();
        metrics.record(Relayed::Bytes {
            to_target: 100,
            from_target: 2_000,
        });
        metrics.record(Relayed::Datagrams {
            to_target: 3,
            from_target: 4,
        });
        metrics.record(Relayed::Failed);
        metrics.online.set(1);
        metrics.holder.set(1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            r#"rstream_agent_streams_total{tunnel="web"} 1"#,
            r#"rstream_agent_stream_bytes_total{tunnel="web",direction="to_target"} 100"#,
            r#"rstream_agent_stream_bytes_total{tunnel="web",direction="from_target"} 2000"#,
            r#"rstream_agent_stream_datagrams_total{tunnel="web",direction="from_target"} 4"#,
            r#"rstream_agent_stream_failures_total{tunnel="web"} 1"#,
            r#"rstream_agent_tunnel_online{tunnel="web"} 1"#,
            r#"rstream_agent_active{tunnel="web"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(
            text.contains("rstream_agent_build_info{version=\"9.9.9\""),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
    }
}
