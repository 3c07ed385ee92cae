//! The peer check: the leader dials every replica it publishes, so that a dead one leaves
//! `default/kubernetes` within seconds.
//!
//! In pod-ip mode the published addresses are the ready addresses of the proxy Service. When a
//! node dies, its replica stays "ready" until the node controller marks the node NotReady
//! (node-monitor-grace-period, 20–50 s), and meanwhile kube-proxy keeps sending clients of the
//! `kubernetes` Service to a dead address. So the reconciler [tracks](PeerCheck::track) what it
//! would publish, and [`PeerCheck::run`] opens a TCP connection to each tracked address every
//! `--peer-check-interval`: after `--peer-check-failures` failures in a row the peer is down (left
//! out of the endpoints, and a reconcile is triggered at once), after one success it is up again.
//!
//! The port dialled is the peer's health port (the port of `--health-addr`, the same on every
//! replica), not the relay port: each connection to the relay makes the peer dial the API server,
//! and kube-apiserver would log a TLS handshake error for every check.
//!
//! Only a running controller (a leader, with leader election) tracks addresses and listens for
//! the triggers; while no one listens, the tracked set is forgotten, so followers and a replica
//! that lost the Lease check nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::Stream;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::ObjectRef;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::cli::EndpointMode;

/// How the peer check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCheckConfig {
    /// The peers' health port.
    pub port: u16,
    /// Time between checks, and the timeout of each connection.
    pub interval: Duration,
    /// Failures in a row that make a peer down.
    pub failures: NonZeroU32,
}

impl PeerCheckConfig {
    /// The peer check the flags ask for, or why it is off.
    pub fn from_flags(
        mode: EndpointMode,
        health_addr: Option<SocketAddr>,
        interval: Duration,
        failures: u32,
    ) -> Result<Self, &'static str> {
        if mode == EndpointMode::ClusterIp {
            return Err("--endpoint-mode cluster-ip publishes a ClusterIP, not the replicas");
        }
        if interval.is_zero() {
            return Err("--peer-check-interval is 0");
        }
        let Some(health) = health_addr else {
            return Err("--health-addr is off: the peers have no health port to dial");
        };
        if health.port() == 0 || health.ip().is_loopback() {
            return Err("--health-addr is not reachable from the other replicas");
        }
        let failures = NonZeroU32::new(failures).ok_or("--peer-check-failures is 0")?;
        Ok(Self {
            port: health.port(),
            interval,
            failures,
        })
    }
}

/// A change of one peer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// It failed its last checks.
    Down,
    /// It answered again.
    Up,
}

#[derive(Debug, Clone, Copy, Default)]
struct PeerState {
    failures_in_a_row: u32,
    down: bool,
}

/// The tracked peers and their states, without any I/O.
#[derive(Debug)]
pub struct Peers {
    failures_to_down: NonZeroU32,
    states: BTreeMap<IpAddr, PeerState>,
}

impl Peers {
    /// No peers yet; a peer is down after `failures_to_down` failed checks in a row.
    pub fn new(failures_to_down: NonZeroU32) -> Self {
        Self {
            failures_to_down,
            states: BTreeMap::new(),
        }
    }

    /// Tracks exactly `ips`: new addresses start up, the others keep their state, and addresses
    /// no longer given are forgotten.
    pub fn track(&mut self, ips: impl IntoIterator<Item = IpAddr>) {
        let mut states = BTreeMap::new();
        for ip in ips {
            let state = self.states.get(&ip).copied().unwrap_or_default();
            states.insert(ip, state);
        }
        self.states = states;
    }

    /// The tracked addresses.
    pub fn tracked(&self) -> Vec<IpAddr> {
        self.states.keys().copied().collect()
    }

    /// The tracked addresses that are down.
    pub fn down(&self) -> BTreeSet<IpAddr> {
        self.states
            .iter()
            .filter(|(_, state)| state.down)
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// Records one check of `ip`; returns its change of state, if any. A result for an address
    /// that is no longer tracked is dropped.
    pub fn record(&mut self, ip: IpAddr, reachable: bool) -> Option<Change> {
        let state = self.states.get_mut(&ip)?;
        if reachable {
            state.failures_in_a_row = 0;
            let was_down = std::mem::replace(&mut state.down, false);
            return was_down.then_some(Change::Up);
        }
        state.failures_in_a_row = state.failures_in_a_row.saturating_add(1);
        if !state.down && state.failures_in_a_row >= self.failures_to_down.get() {
            state.down = true;
            return Some(Change::Down);
        }
        None
    }
}

/// Metrics of the peer check.
#[derive(Debug, Clone, Default)]
pub struct PeerMetrics {
    down: Gauge,
    failures: Counter,
}

impl PeerMetrics {
    /// Registers `steward_peers_down` and `steward_peer_check_failures_total`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "steward_peers_down",
            "Published replicas that failed their last peer checks and are left out of the kubernetes endpoints",
            metrics.down.clone(),
        );
        registry.register(
            "steward_peer_check_failures",
            "Peer checks (TCP connections to a replica's health port) that failed",
            metrics.failures.clone(),
        );
        metrics
    }
}

/// The peer check; see the [module docs](self). Clones share their state.
#[derive(Debug, Clone)]
pub struct PeerCheck {
    config: PeerCheckConfig,
    peers: Arc<Mutex<Peers>>,
    /// Bumped on every change of state; each trigger stream sees it as a reconcile.
    changes: Arc<watch::Sender<u64>>,
    metrics: PeerMetrics,
}

impl PeerCheck {
    /// A check tracking nothing yet.
    pub fn new(config: PeerCheckConfig, metrics: PeerMetrics) -> Self {
        let (changes, _) = watch::channel(0);
        Self {
            config,
            peers: Arc::new(Mutex::new(Peers::new(config.failures))),
            changes: Arc::new(changes),
            metrics,
        }
    }

    /// A poisoned lock still holds valid states (each update is one assignment).
    fn peers(&self) -> MutexGuard<'_, Peers> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Checks exactly `ips` from now on (see [`Peers::track`]).
    pub fn track(&self, ips: impl IntoIterator<Item = IpAddr>) {
        let mut peers = self.peers();
        peers.track(ips);
        self.metrics.down.set(peers.down().len() as i64);
    }

    /// The tracked peers that are down.
    pub fn down(&self) -> BTreeSet<IpAddr> {
        self.peers().down()
    }

    /// A stream that yields `service` whenever a peer changes state; for
    /// [`k8s_reconcile::ControllerBuilder::reconcile_on`].
    pub fn triggers(
        &self,
        service: ObjectRef<Service>,
    ) -> impl Stream<Item = ObjectRef<Service>> + Send + use<> {
        futures::stream::unfold(self.changes.subscribe(), move |mut changes| {
            let service = service.clone();
            async move {
                changes.changed().await.ok()?;
                Some((service, changes))
            }
        })
    }

    /// Checks the tracked peers every interval until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            if self.changes.receiver_count() == 0 {
                // No controller runs here (a follower): nothing is published from here.
                self.track([]);
                continue;
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.check_all() => {}
            }
        }
    }

    /// One round: dials every tracked peer at once and records the results.
    async fn check_all(&self) {
        let tracked = self.peers().tracked();
        let (port, timeout) = (self.config.port, self.config.interval);
        let results = futures::future::join_all(tracked.into_iter().map(|ip| async move {
            let dialled = tokio::time::timeout(timeout, TcpStream::connect((ip, port))).await;
            let error = match dialled {
                Ok(Ok(_)) => None,
                Ok(Err(err)) => Some(err.to_string()),
                Err(_) => Some(format!("no connection within {timeout:?}")),
            };
            (ip, error)
        }))
        .await;
        let mut changed = false;
        let mut peers = self.peers();
        for (ip, error) in results {
            if error.is_some() {
                self.metrics.failures.inc();
            }
            match (peers.record(ip, error.is_none()), error) {
                (Some(Change::Down), Some(error)) => {
                    tracing::warn!(peer = %ip, port, %error, failures = self.config.failures.get(), "peer down: left out of the kubernetes endpoints");
                    changed = true;
                }
                (Some(Change::Up), _) => {
                    tracing::info!(peer = %ip, port, "peer up again: published in the kubernetes endpoints");
                    changed = true;
                }
                _ => {}
            }
        }
        self.metrics.down.set(peers.down().len() as i64);
        drop(peers);
        if changed {
            self.changes.send_modify(|generation| *generation += 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use futures::StreamExt as _;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    fn peers(failures: u32) -> Peers {
        Peers::new(NonZeroU32::new(failures).unwrap())
    }

    #[test]
    fn a_peer_is_down_after_n_failures_in_a_row_and_up_after_one_success() {
        let mut peers = peers(2);
        peers.track([ip(1), ip(2)]);
        assert_eq!(peers.record(ip(1), false), None);
        // A success in between starts the count again.
        assert_eq!(peers.record(ip(1), true), None);
        assert_eq!(peers.record(ip(1), false), None);
        assert_eq!(peers.record(ip(1), false), Some(Change::Down));
        assert_eq!(peers.down(), BTreeSet::from([ip(1)]));
        // Down is reported once, not at every further failure.
        assert_eq!(peers.record(ip(1), false), None);
        assert_eq!(peers.record(ip(2), true), None);
        assert_eq!(peers.record(ip(1), true), Some(Change::Up));
        assert!(peers.down().is_empty());
    }

    #[test]
    fn addresses_no_longer_tracked_are_forgotten() {
        let mut peers = peers(1);
        peers.track([ip(1), ip(2)]);
        assert_eq!(peers.record(ip(1), false), Some(Change::Down));
        assert_eq!(peers.record(ip(2), false), Some(Change::Down));
        // ip(2) stays down across a track that keeps it; ip(1) goes.
        peers.track([ip(2), ip(3)]);
        assert_eq!(peers.tracked(), vec![ip(2), ip(3)]);
        assert_eq!(peers.down(), BTreeSet::from([ip(2)]));
        // A late result for a forgotten address changes nothing.
        assert_eq!(peers.record(ip(1), true), None);
        // Tracked again, it starts up with no failures.
        peers.track([ip(1)]);
        assert!(peers.down().is_empty());
    }

    #[test]
    fn the_check_is_off_without_a_reachable_health_port_or_interval() {
        let health = Some(SocketAddr::from(([0, 0, 0, 0], 8080)));
        let second = Duration::from_secs(1);
        let config = PeerCheckConfig::from_flags(EndpointMode::PodIp, health, second, 2).unwrap();
        assert_eq!(config.port, 8080, "the health port, not the relay port");
        for (mode, health, interval) in [
            (EndpointMode::ClusterIp, health, second),
            (EndpointMode::PodIp, None, second),
            (EndpointMode::PodIp, health, Duration::ZERO),
            (
                EndpointMode::PodIp,
                Some(SocketAddr::from(([127, 0, 0, 1], 8080))),
                second,
            ),
        ] {
            assert!(PeerCheckConfig::from_flags(mode, health, interval, 2).is_err());
        }
    }

    #[tokio::test]
    async fn a_closed_port_is_reported_down_and_triggers_a_reconcile() {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let config = PeerCheckConfig {
            port,
            interval: Duration::from_millis(100),
            failures: NonZeroU32::new(2).unwrap(),
        };
        let check = PeerCheck::new(config, PeerMetrics::default());
        let service = ObjectRef::<Service>::new("steward").within("kube-system");
        let mut triggers = Box::pin(check.triggers(service.clone()));
        // The listener holds the port on 127.0.0.1 only: on 127.0.0.2 it is closed.
        let (up, down) = (
            IpAddr::from(Ipv4Addr::LOCALHOST),
            IpAddr::from(Ipv4Addr::new(127, 0, 0, 2)),
        );
        check.track([up, down]);
        let stop = CancellationToken::new();
        tokio::spawn(check.clone().run(stop.clone()));

        let trigger = tokio::time::timeout(Duration::from_secs(5), triggers.next()).await;
        assert_eq!(
            trigger.expect("no reconcile triggered"),
            Some(service.clone())
        );
        assert_eq!(check.down(), BTreeSet::from([down]));
        assert_eq!(check.metrics.down.get(), 1);
        assert!(check.metrics.failures.get() >= 2);

        // Once the listener is gone its port is closed on 127.0.0.1 too.
        drop(listener);
        let trigger = tokio::time::timeout(Duration::from_secs(5), triggers.next()).await;
        assert_eq!(trigger.expect("no reconcile triggered"), Some(service));
        assert_eq!(check.down(), BTreeSet::from([up, down]));
        stop.cancel();
    }

    #[tokio::test]
    async fn nothing_is_checked_while_no_controller_listens() {
        let config = PeerCheckConfig {
            port: 1,
            interval: Duration::from_millis(20),
            failures: NonZeroU32::new(1).unwrap(),
        };
        let check = PeerCheck::new(config, PeerMetrics::default());
        check.track([IpAddr::from(Ipv4Addr::new(127, 0, 0, 2))]);
        let stop = CancellationToken::new();
        tokio::spawn(check.clone().run(stop.clone()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A follower (no trigger stream) forgets what it tracked instead of dialling it.
        assert!(check.peers().tracked().is_empty());
        assert_eq!(check.metrics.failures.get(), 0);
        stop.cancel();
    }
}
