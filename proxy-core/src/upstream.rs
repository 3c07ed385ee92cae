//! Where connections go: one address, a custom connector, one address behind an HTTP proxy, or a
//! set of targets with round-robin, failover and active health checks.
//!
//! Health semantics: every target starts healthy (a new route serves at once). A target turns
//! unhealthy after `fall` failed checks in a row and healthy again after `rise` successful ones.
//! Failed connects from client traffic do not change health; they only fail over to the next
//! healthy target.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::error::{ConfigError, ConnectError};
use crate::http_connect::HttpProxy;
pub use crate::target::TargetAddr;

/// A custom way to open the upstream connection (service discovery, a SOCKS hop, a test
/// double). The connect timeout is applied around it.
pub trait Connector: Send + Sync + fmt::Debug {
    /// Opens a new connection to the upstream.
    fn connect(&self) -> BoxFuture<'_, io::Result<TcpStream>>;
}

/// Where a route sends its connections.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Upstream {
    /// One address.
    Target(TargetAddr),
    /// Several targets with round-robin, failover and health checks.
    Set(Arc<UpstreamSet>),
    /// A custom connector.
    Connector(Arc<dyn Connector>),
    /// One address reached through an HTTP proxy's `CONNECT` tunnel
    /// ([`http_connect`](crate::http_connect)).
    HttpConnect {
        /// The proxy.
        proxy: Arc<HttpProxy>,
        /// Where the proxy is asked to connect.
        target: TargetAddr,
    },
}

impl From<SocketAddr> for Upstream {
    fn from(addr: SocketAddr) -> Self {
        Upstream::Target(TargetAddr::Socket(addr))
    }
}

impl From<TargetAddr> for Upstream {
    fn from(addr: TargetAddr) -> Self {
        Upstream::Target(addr)
    }
}

impl From<Arc<UpstreamSet>> for Upstream {
    fn from(set: Arc<UpstreamSet>) -> Self {
        Upstream::Set(set)
    }
}

impl FromStr for Upstream {
    type Err = ConfigError;

    /// Parses one address, or a comma-separated list into an [`UpstreamSet`] without health
    /// checks.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let targets = input
            .split(',')
            .map(|part| part.trim().parse())
            .collect::<Result<Vec<TargetAddr>, _>>()?;
        match <[TargetAddr; 1]>::try_from(targets) {
            Ok([single]) => Ok(Upstream::Target(single)),
            Err(targets) => Ok(Upstream::Set(Arc::new(UpstreamSet::new(targets)?))),
        }
    }
}

/// The connector of [`Upstream::refuse`].
#[derive(Debug)]
struct Refuse(&'static str);

impl Connector for Refuse {
    fn connect(&self) -> BoxFuture<'_, io::Result<TcpStream>> {
        let reason = self.0;
        Box::pin(async move { Err(io::Error::new(io::ErrorKind::ConnectionRefused, reason)) })
    }
}

impl Upstream {
    /// An upstream that refuses every connection, saying `reason` in logs: the client's
    /// connection is closed at once (e.g. a port kept open while it has no target).
    pub fn refuse(reason: &'static str) -> Self {
        Upstream::Connector(Arc::new(Refuse(reason)))
    }

    /// Opens a connection to the upstream; `timeout` bounds each connect attempt.
    pub async fn connect(&self, timeout: Duration) -> Result<TcpStream, ConnectError> {
        match self {
            Upstream::Target(addr) => addr.connect(timeout).await,
            Upstream::Set(set) => set.connect(timeout).await.map(|(stream, _)| stream),
            Upstream::Connector(connector) => connect_with(connector.as_ref(), timeout).await,
            Upstream::HttpConnect { proxy, target } => proxy
                .connect(target, timeout)
                .await
                .map_err(|cause| ConnectError::HttpProxy {
                    cause: Box::new(cause),
                }),
        }
    }

    /// `self` reached through `proxy`: an [`Upstream::Target`] becomes
    /// [`Upstream::HttpConnect`]. Sets and connectors cannot be tunnelled this way.
    pub fn via_http_proxy(self, proxy: HttpProxy) -> Result<Self, ConfigError> {
        match self {
            Upstream::Target(target) => Ok(Upstream::HttpConnect {
                proxy: Arc::new(proxy),
                target,
            }),
            _ => Err(ConfigError::Inconsistent(
                "only a single upstream address can be reached through an HTTP proxy",
            )),
        }
    }

    /// A short description for logs.
    pub fn describe(&self) -> String {
        match self {
            Upstream::Target(addr) => addr.to_string(),
            Upstream::Set(set) => set
                .targets
                .iter()
                .map(|t| t.addr.to_string())
                .collect::<Vec<_>>()
                .join(","),
            Upstream::Connector(connector) => format!("{connector:?}"),
            Upstream::HttpConnect { proxy, target } => format!("{target} via {proxy}"),
        }
    }
}

async fn connect_with(
    connector: &dyn Connector,
    timeout: Duration,
) -> Result<TcpStream, ConnectError> {
    let target = || format!("{connector:?}");
    match tokio::time::timeout(timeout, connector.connect()).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(cause)) => Err(ConnectError::Io {
            target: target(),
            cause,
        }),
        Err(_) => Err(ConnectError::Timeout {
            target: target(),
            after: timeout,
        }),
    }
}

/// Active TCP health checking: a target is healthy when a TCP connect succeeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HealthCheck {
    /// Time between two rounds of checks.
    pub interval: Duration,
    /// Connect timeout of one check.
    pub timeout: Duration,
    /// Consecutive successes to turn healthy.
    pub rise: u32,
    /// Consecutive failures to turn unhealthy.
    pub fall: u32,
}

impl Default for HealthCheck {
    /// HAProxy's defaults: every 2 s, rise 2, fall 3; 1 s timeout.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            rise: 2,
            fall: 3,
        }
    }
}

impl HealthCheck {
    /// Builds a health check, rejecting zero values.
    pub fn new(
        interval: Duration,
        timeout: Duration,
        rise: u32,
        fall: u32,
    ) -> Result<Self, ConfigError> {
        let check = Self {
            interval,
            timeout,
            rise,
            fall,
        };
        check.validate()?;
        Ok(check)
    }

    /// Rejects zero interval, timeout, rise or fall.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let zero = |what| Err(ConfigError::Zero { what });
        if self.interval.is_zero() {
            return zero("health check interval");
        }
        if self.timeout.is_zero() {
            return zero("health check timeout");
        }
        if self.rise == 0 {
            return zero("health check rise");
        }
        if self.fall == 0 {
            return zero("health check fall");
        }
        Ok(())
    }
}

#[derive(Debug)]
struct TargetState {
    addr: TargetAddr,
    healthy: AtomicBool,
    /// Consecutive check results that disagree with `healthy`; only the checker writes it.
    streak: AtomicU32,
}

/// The health of one target, as reported by [`UpstreamSet::status`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TargetStatus {
    /// The target.
    pub addr: TargetAddr,
    /// Whether new connections may go there.
    pub healthy: bool,
}

/// Several targets behind one route.
#[derive(Debug)]
pub struct UpstreamSet {
    targets: Vec<TargetState>,
    next: AtomicUsize,
    health_check: Option<HealthCheck>,
}

impl UpstreamSet {
    /// A set of `targets`, all healthy, without health checks.
    pub fn new(targets: Vec<TargetAddr>) -> Result<Self, ConfigError> {
        if targets.is_empty() {
            return Err(ConfigError::NoTargets);
        }
        Ok(Self {
            targets: targets
                .into_iter()
                .map(|addr| TargetState {
                    addr,
                    healthy: AtomicBool::new(true),
                    streak: AtomicU32::new(0),
                })
                .collect(),
            next: AtomicUsize::new(0),
            health_check: None,
        })
    }

    /// Adds active health checks; run them with [`spawn_health_checks`](Self::spawn_health_checks).
    pub fn with_health_check(mut self, check: HealthCheck) -> Result<Self, ConfigError> {
        check.validate()?;
        self.health_check = Some(check);
        Ok(self)
    }

    /// The targets and their health.
    pub fn status(&self) -> Vec<TargetStatus> {
        self.targets
            .iter()
            .map(|t| TargetStatus {
                addr: t.addr.clone(),
                healthy: t.healthy.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Connects to the next healthy target in round-robin order, failing over to the following
    /// healthy targets when a connect fails. Returns the stream and the target used.
    pub async fn connect(
        &self,
        timeout: Duration,
    ) -> Result<(TcpStream, TargetAddr), ConnectError> {
        let count = self.targets.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut tried = 0;
        let mut last = None;
        for offset in 0..count {
            let target = &self.targets[(start + offset) % count];
            if !target.healthy.load(Ordering::Relaxed) {
                continue;
            }
            tried += 1;
            match target.addr.connect(timeout).await {
                Ok(stream) => return Ok((stream, target.addr.clone())),
                Err(error) => {
                    tracing::debug!(error = %crate::error::chain(&error), "upstream target failed, trying the next one");
                    last = Some(error);
                }
            }
        }
        match last {
            None => Err(ConnectError::NoHealthyTarget { targets: count }),
            Some(last) if tried == 1 => Err(last),
            Some(last) => Err(ConnectError::AllTargetsFailed {
                tried,
                last: Box::new(last),
            }),
        }
    }

    /// Runs one round of health checks on every target concurrently and updates their state.
    /// Does nothing when the set has no health check configured.
    pub async fn check_once(&self) {
        let Some(check) = self.health_check else {
            return;
        };
        let probes = self.targets.iter().map(|target| async move {
            let ok = target.addr.connect(check.timeout).await.is_ok();
            target.record_check(ok, check);
        });
        futures::future::join_all(probes).await;
    }

    /// Spawns the periodic health checks (the first round at once); they stop when `cancel`
    /// fires. Returns `None` when the set has no health check configured.
    ///
    /// # Panics
    ///
    /// When called outside a Tokio runtime.
    pub fn spawn_health_checks(
        self: &Arc<Self>,
        cancel: CancellationToken,
    ) -> Option<JoinHandle<()>> {
        let check = self.health_check?;
        let set = Arc::clone(self);
        Some(tokio::spawn(async move {
            // A round starts `interval` after the previous one ended, so slow checks never
            // pile up.
            loop {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = set.check_once() => {}
                }
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(check.interval) => {}
                }
            }
        }))
    }
}

impl TargetState {
    fn record_check(&self, ok: bool, check: HealthCheck) {
        let healthy = self.healthy.load(Ordering::Relaxed);
        if ok == healthy {
            self.streak.store(0, Ordering::Relaxed);
            return;
        }
        let streak = self.streak.fetch_add(1, Ordering::Relaxed) + 1;
        let threshold = if healthy { check.fall } else { check.rise };
        if streak >= threshold {
            self.healthy.store(ok, Ordering::Relaxed);
            self.streak.store(0, Ordering::Relaxed);
            tracing::info!(target_addr = %self.addr, healthy = ok, "upstream target health changed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets() {
        assert_eq!(
            "127.0.0.1:80".parse::<TargetAddr>().ok(),
            Some(TargetAddr::Socket(SocketAddr::from(([127, 0, 0, 1], 80))))
        );
        assert!(
            matches!("[::1]:443".parse::<TargetAddr>(), Ok(TargetAddr::Socket(a)) if a.is_ipv6())
        );
        assert!(matches!(
            "kubernetes.default.svc:443".parse::<TargetAddr>(),
            Ok(TargetAddr::Host { ref host, port: 443 }) if host == "kubernetes.default.svc"
        ));
        for bad in [
            "",
            "nohost",
            "host:",
            "host:99999",
            ":80",
            "bad host:80",
            "a..b:80",
            "x:0",
            "127.0.0.1:0",
            "[::1]:0",
        ] {
            assert!(
                matches!(
                    bad.parse::<TargetAddr>(),
                    Err(ConfigError::InvalidAddress { .. })
                ),
                "{bad:?} should be rejected"
            );
        }
    }

    #[test]
    fn parses_upstream_lists() {
        assert!(matches!(
            "127.0.0.1:1".parse::<Upstream>(),
            Ok(Upstream::Target(_))
        ));
        match "127.0.0.1:1, 127.0.0.1:2".parse::<Upstream>() {
            Ok(Upstream::Set(set)) => assert_eq!(set.status().len(), 2),
            other => panic!("expected a set, got {other:?}"),
        }
        assert!("127.0.0.1:1,".parse::<Upstream>().is_err());
    }

    #[test]
    fn rejects_empty_sets_and_zero_checks() {
        assert!(matches!(
            UpstreamSet::new(vec![]),
            Err(ConfigError::NoTargets)
        ));
        let secs = Duration::from_secs;
        assert!(HealthCheck::new(secs(0), secs(1), 1, 1).is_err());
        assert!(HealthCheck::new(secs(1), secs(0), 1, 1).is_err());
        assert!(HealthCheck::new(secs(1), secs(1), 0, 1).is_err());
        assert!(HealthCheck::new(secs(1), secs(1), 1, 0).is_err());
        assert!(HealthCheck::new(secs(1), secs(1), 1, 1).is_ok());
    }

    #[test]
    fn health_follows_rise_and_fall() {
        let check = HealthCheck::new(Duration::from_secs(1), Duration::from_secs(1), 2, 3).unwrap();
        let target = TargetState {
            addr: TargetAddr::Socket(SocketAddr::from(([127, 0, 0, 1], 1))),
            healthy: AtomicBool::new(true),
            streak: AtomicU32::new(0),
        };
        let healthy = || target.healthy.load(Ordering::Relaxed);
        target.record_check(false, check);
        target.record_check(false, check);
        target.record_check(true, check); // resets the streak
        target.record_check(false, check);
        target.record_check(false, check);
        assert!(healthy(), "two failures in a row are below fall = 3");
        target.record_check(false, check);
        assert!(!healthy(), "third failure in a row marks it down");
        target.record_check(true, check);
        assert!(!healthy());
        target.record_check(true, check);
        assert!(healthy(), "rise = 2 successes bring it back");
    }
}
