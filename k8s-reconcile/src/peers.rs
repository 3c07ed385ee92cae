//! The peer check: one replica dials its peers' health ports, so that a replica lost with its
//! node is known within seconds rather than after the node controller's grace period.
//!
//! When a node dies, its Pods stay "ready" until the node controller marks the node NotReady
//! (node-monitor-grace-period, 20–50 s), and meanwhile kube-proxy keeps sending clients to dead
//! addresses. A binary that runs several replicas [tracks](PeerCheck::track) its peers' addresses,
//! and [`PeerCheck::run`] opens a TCP connection to each of them every
//! [interval](PeerCheckConfig::interval): after [`failures`](PeerCheckConfig::failures) failures
//! in a row a peer is [down](PeerCheck::down), after one success it is up again. What to do
//! about a down peer is the binary's call (steward leaves it out of the endpoints it publishes,
//! pod-proxier marks its Pod not Ready).
//!
//! The port dialled is a health port (the same on every replica), not a data port: a
//! connection there costs the peer nothing and is never relayed anywhere.
//!
//! The check runs only while someone listens for its [changes](PeerCheck::changes); while no one
//! does, the tracked set is forgotten. A binary whose leader alone acts on the results thus
//! checks nothing on its followers.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

/// How the peer check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCheckConfig {
    /// The peers' health port.
    pub port: u16,
    /// Time between checks, and the timeout of each connection.
    pub interval: Duration,
    /// Failures in a row that make a peer down.
    pub failures: NonZeroU32,
    /// Whether a peer must have answered once before it can be down. With it, a peer this
    /// replica never reached (a NetworkPolicy closes the health port between replicas, say) is
    /// never reported down; without it, a new peer that never answers is down after
    /// `failures` checks.
    pub down_only_after_an_answer: bool,
}

/// Why a peer check cannot run with the settings given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerCheckOff {
    /// The interval is zero (the usual way to turn the check off).
    #[error("the check interval is 0")]
    NoInterval,
    /// No health server runs, so the peers have no port to dial.
    #[error("the health server is off: the peers have no health port to dial")]
    NoHealthServer,
    /// The health server listens where the other replicas cannot reach it.
    #[error("the health server ({0}) is not reachable from the other replicas")]
    HealthUnreachable(SocketAddr),
    /// Zero failures would make every peer down before its first check.
    #[error("the failures before a peer is down are 0")]
    NoFailures,
}

impl PeerCheckConfig {
    /// The check of the peers' `health` servers (each replica's own address: only its port is
    /// used), every `interval`, down after `failures` failures in a row; or why it cannot run.
    /// A peer may be down before it ever answered (see
    /// [`down_only_after_an_answer`](Self::down_only_after_an_answer)).
    pub fn new(
        health: Option<SocketAddr>,
        interval: Duration,
        failures: u32,
    ) -> Result<Self, PeerCheckOff> {
        if interval.is_zero() {
            return Err(PeerCheckOff::NoInterval);
        }
        let health = health.ok_or(PeerCheckOff::NoHealthServer)?;
        if health.port() == 0 || health.ip().is_loopback() {
            return Err(PeerCheckOff::HealthUnreachable(health));
        }
        let failures = NonZeroU32::new(failures).ok_or(PeerCheckOff::NoFailures)?;
        Ok(Self {
            port: health.port(),
            interval,
            failures,
            down_only_after_an_answer: false,
        })
    }

    /// The same check, but a peer that never answered is never down.
    pub fn down_only_after_an_answer(self) -> Self {
        Self {
            down_only_after_an_answer: true,
            ..self
        }
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
    answered: bool,
    down: bool,
}

/// The tracked peers and their states, without any I/O.
#[derive(Debug)]
pub struct Peers {
    failures_to_down: NonZeroU32,
    down_only_after_an_answer: bool,
    states: BTreeMap<IpAddr, PeerState>,
}

impl Peers {
    /// No peers yet; a peer is down after `failures_to_down` failed checks in a row.
    pub fn new(failures_to_down: NonZeroU32) -> Self {
        Self {
            failures_to_down,
            down_only_after_an_answer: false,
            states: BTreeMap::new(),
        }
    }

    /// No peers yet; as [`PeerCheckConfig`] says.
    pub fn with_config(config: &PeerCheckConfig) -> Self {
        Self {
            down_only_after_an_answer: config.down_only_after_an_answer,
            ..Self::new(config.failures)
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
            state.answered = true;
            let was_down = std::mem::replace(&mut state.down, false);
            return was_down.then_some(Change::Up);
        }
        state.failures_in_a_row = state.failures_in_a_row.saturating_add(1);
        let may_be_down = state.answered || !self.down_only_after_an_answer;
        if !state.down && may_be_down && state.failures_in_a_row >= self.failures_to_down.get() {
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
    /// Registers `peers_down` and `peer_check_failures_total` (give a sub-registry with the
    /// binary's prefix).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "peers_down",
            "Tracked replicas that failed their last peer checks",
            metrics.down.clone(),
        );
        registry.register(
            "peer_check_failures",
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
    /// Bumped on every change of state.
    changes: Arc<watch::Sender<u64>>,
    metrics: PeerMetrics,
}

impl PeerCheck {
    /// A check tracking nothing yet.
    pub fn new(config: PeerCheckConfig, metrics: PeerMetrics) -> Self {
        let (changes, _) = watch::channel(0);
        Self {
            config,
            peers: Arc::new(Mutex::new(Peers::with_config(&config))),
            changes: Arc::new(changes),
            metrics,
        }
    }

    /// How it runs.
    pub fn config(&self) -> &PeerCheckConfig {
        &self.config
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

    /// The tracked addresses.
    pub fn tracked(&self) -> Vec<IpAddr> {
        self.peers().tracked()
    }

    /// The tracked peers that are down.
    pub fn down(&self) -> BTreeSet<IpAddr> {
        self.peers().down()
    }

    /// A receiver that sees a new value whenever a peer changes state. While one is held, the
    /// check runs.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// A stream that yields `item` whenever a peer changes state; e.g. an object to reconcile,
    /// for [`ControllerBuilder::reconcile_on`](crate::ControllerBuilder::reconcile_on).
    pub fn triggers<T: Clone + Send + 'static>(
        &self,
        item: T,
    ) -> impl Stream<Item = T> + Send + use<T> {
        futures::stream::unfold(self.changes(), move |mut changes| {
            let item = item.clone();
            async move {
                changes.changed().await.ok()?;
                Some((item, changes))
            }
        })
    }

    /// Checks the tracked peers every interval until `stop`, while anyone listens for changes.
    pub async fn run(self, stop: CancellationToken) {
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            if self.changes.receiver_count() == 0 {
                // No one acts on the results here (a follower, say).
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
                    tracing::warn!(peer = %ip, port, %error, failures = self.config.failures.get(), "peer down");
                    changed = true;
                }
                (Some(Change::Up), _) => {
                    tracing::info!(peer = %ip, port, "peer up again");
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
    fn with_down_only_after_an_answer_a_peer_never_reached_is_never_down() {
        let health = SocketAddr::from(([0, 0, 0, 0], 8081));
        let config = PeerCheckConfig::new(Some(health), Duration::from_secs(1), 1)
            .unwrap()
            .down_only_after_an_answer();
        let mut peers = Peers::with_config(&config);
        peers.track([ip(1), ip(2)]);
        for _ in 0..5 {
            assert_eq!(peers.record(ip(1), false), None, "never answered");
        }
        assert_eq!(peers.record(ip(2), true), None);
        assert_eq!(peers.record(ip(2), false), Some(Change::Down));
        assert_eq!(peers.down(), BTreeSet::from([ip(2)]));
    }

    #[test]
    fn the_check_is_off_without_a_reachable_health_port_interval_or_failures() {
        let health = Some(SocketAddr::from(([0, 0, 0, 0], 8080)));
        let second = Duration::from_secs(1);
        let config = PeerCheckConfig::new(health, second, 2).unwrap();
        assert_eq!(config.port, 8080, "the health port");
        let local = SocketAddr::from(([127, 0, 0, 1], 8080));
        for (health, interval, failures, off) in [
            (None, second, 2, PeerCheckOff::NoHealthServer),
            (health, Duration::ZERO, 2, PeerCheckOff::NoInterval),
            (
                Some(local),
                second,
                2,
                PeerCheckOff::HealthUnreachable(local),
            ),
            (health, second, 0, PeerCheckOff::NoFailures),
        ] {
            assert_eq!(PeerCheckConfig::new(health, interval, failures), Err(off));
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
            down_only_after_an_answer: false,
        };
        let check = PeerCheck::new(config, PeerMetrics::default());
        let mut triggers = Box::pin(check.triggers("steward"));
        // The listener holds the port on 127.0.0.1 only: on 127.0.0.2 it is closed.
        let (up, down) = (
            IpAddr::from(Ipv4Addr::LOCALHOST),
            IpAddr::from(Ipv4Addr::new(127, 0, 0, 2)),
        );
        check.track([up, down]);
        let stop = CancellationToken::new();
        tokio::spawn(check.clone().run(stop.clone()));

        let trigger = tokio::time::timeout(Duration::from_secs(5), triggers.next()).await;
        assert_eq!(trigger.expect("no reconcile triggered"), Some("steward"));
        assert_eq!(check.down(), BTreeSet::from([down]));
        assert_eq!(check.metrics.down.get(), 1);
        assert!(check.metrics.failures.get() >= 2);

        // Once the listener is gone its port is closed on 127.0.0.1 too.
        drop(listener);
        let trigger = tokio::time::timeout(Duration::from_secs(5), triggers.next()).await;
        assert_eq!(trigger.expect("no reconcile triggered"), Some("steward"));
        assert_eq!(check.down(), BTreeSet::from([up, down]));
        stop.cancel();
    }

    #[tokio::test]
    async fn nothing_is_checked_while_no_one_listens() {
        let config = PeerCheckConfig {
            port: 1,
            interval: Duration::from_millis(20),
            failures: NonZeroU32::new(1).unwrap(),
            down_only_after_an_answer: false,
        };
        let check = PeerCheck::new(config, PeerMetrics::default());
        check.track([IpAddr::from(Ipv4Addr::new(127, 0, 0, 2))]);
        let stop = CancellationToken::new();
        tokio::spawn(check.clone().run(stop.clone()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        // A follower (no listener) forgets what it tracked instead of dialling it.
        assert!(check.tracked().is_empty());
        assert_eq!(check.metrics.failures.get(), 0);
        stop.cancel();
    }
}
