//! Keeping a tunnel up: reconnect with exponential backoff and jitter, re-create the tunnel, reuse a
//! stable hostname, and report state changes.
//!
//! [`Supervisor::spawn`] runs the loop *connect → create tunnel → report online → hand out streams* in a
//! background task. On failure it reports [`SupervisorState::Disconnected`] with the error, sleeps
//! (1 s doubling up to 30 s by default, jittered to 75–100 %, reset once a connection stayed up for
//! [`SupervisorConfig::healthy_after`]) and starts over with a fresh control channel. Errors that are
//! not [retryable](crate::Error::retryable) stop it ([`SupervisorState::Stopped`]) unless
//! [`SupervisorConfig::retry_non_retryable`] is set. Streams accepted on any incarnation of the tunnel
//! come out of [`SupervisorHandle::accept`]; they survive reconnects.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::error::Error;
use crate::forward::StreamSource;
use crate::proto::TunnelProperties;
use crate::stream::RstreamStream;
use crate::tunnel::{TunnelOptions, TunnelProtocol, generate_stable_hostname};

/// Stable hostname policy for published tunnels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StableHostname {
    /// Never request one (the address may change on every reconnect).
    Off,
    /// Generate one from the engine host on the first connection and reuse it (nothing is generated for
    /// IP literals, single-label hosts, private or TCP tunnels, or when the options set a hostname).
    #[default]
    Auto,
    /// Always request this hostname.
    Fixed(String),
}

/// Supervisor settings.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SupervisorConfig {
    /// First retry delay (default 1 s).
    pub initial_backoff: Duration,
    /// Largest retry delay (default 30 s).
    pub max_backoff: Duration,
    /// A connection that stayed online this long resets the backoff (default 60 s).
    pub healthy_after: Duration,
    /// Randomise each delay to 75–100 % of its value (default on).
    pub jitter: bool,
    /// Stable hostname policy (default [`StableHostname::Auto`]).
    pub stable_hostname: StableHostname,
    /// Keep retrying errors that are not retryable (bad token, invalid options...). Default off.
    pub retry_non_retryable: bool,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            jitter: true,
            stable_hostname: StableHostname::Auto,
            retry_non_retryable: false,
        }
    }
}

impl SupervisorConfig {
    /// Sets the initial and maximum backoff.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }
    /// Sets the healthy period that resets the backoff.
    pub fn healthy_after(mut self, period: Duration) -> Self {
        self.healthy_after = period;
        self
    }
    /// Enables or disables jitter.
    pub fn jitter(mut self, on: bool) -> Self {
        self.jitter = on;
        self
    }
    /// Sets the stable hostname policy.
    pub fn stable_hostname(mut self, policy: StableHostname) -> Self {
        self.stable_hostname = policy;
        self
    }
    /// Retries non-retryable errors too.
    pub fn retry_non_retryable(mut self, on: bool) -> Self {
        self.retry_non_retryable = on;
        self
    }

    /// The delay before retry number `failures` (1-based): `initial * 2^(failures-1)`, capped, jittered.
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        let base = self
            .initial_backoff
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff);
        if self.jitter {
            base.mul_f64(rand::random_range(0.75..=1.0))
        } else {
            base
        }
    }
}

/// A state change reported by the supervisor.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum SupervisorState {
    /// Connecting (attempt number, 1-based).
    Connecting {
        /// Attempt number since start.
        attempt: u32,
    },
    /// The tunnel is up.
    Online {
        /// The engine's tunnel properties.
        properties: Box<TunnelProperties>,
        /// The display address.
        forwarding_address: String,
    },
    /// The connection failed; the next attempt starts after `retry_in`.
    Disconnected {
        /// Why.
        error: Error,
        /// Delay before the next attempt.
        retry_in: Duration,
    },
    /// The supervisor stopped: `None` after [`SupervisorHandle::shutdown`], or the non-retryable error.
    Stopped {
        /// The error that stopped it, if any.
        error: Option<Error>,
    },
}

/// Entry point of the supervisor.
#[derive(Debug)]
pub struct Supervisor;

impl Supervisor {
    /// Starts supervising a tunnel created with `options` on connections made by `client`.
    pub fn spawn(
        client: Client,
        options: TunnelOptions,
        config: SupervisorConfig,
    ) -> SupervisorHandle {
        let (events_tx, events) = mpsc::channel(256);
        let (state_tx, state) = watch::channel(SupervisorState::Connecting { attempt: 0 });
        let (streams_tx, streams) = mpsc::channel(64);
        let cancel = CancellationToken::new();
        let reporter = Reporter {
            events: events_tx,
            state: state_tx,
        };
        let task = tokio::spawn(run(
            client,
            options,
            config,
            reporter,
            streams_tx,
            cancel.clone(),
        ));
        SupervisorHandle {
            events,
            state,
            streams,
            cancel,
            task: Some(task),
        }
    }
}

/// Handle of a running supervisor.
#[derive(Debug)]
pub struct SupervisorHandle {
    events: mpsc::Receiver<SupervisorState>,
    state: watch::Receiver<SupervisorState>,
    streams: mpsc::Receiver<RstreamStream>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl SupervisorHandle {
    /// The next state change. Events are buffered (256); when nobody reads them the oldest changes are
    /// dropped, but [`SupervisorHandle::state`] always has the latest state.
    pub async fn next_event(&mut self) -> Option<SupervisorState> {
        self.events.recv().await
    }

    /// The current state.
    pub fn state(&self) -> SupervisorState {
        self.state.borrow().clone()
    }

    /// A watch receiver of the state.
    pub fn watch(&self) -> watch::Receiver<SupervisorState> {
        self.state.clone()
    }

    /// The next inbound stream of the supervised tunnel; `None` once the supervisor stopped.
    pub async fn accept(&mut self) -> Option<RstreamStream> {
        self.streams.recv().await
    }

    /// Stops the supervisor: closes the current control channel and waits for the task.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for SupervisorHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl StreamSource for SupervisorHandle {
    async fn next_stream(&mut self) -> Option<RstreamStream> {
        self.accept().await
    }
}

struct Reporter {
    events: mpsc::Sender<SupervisorState>,
    state: watch::Sender<SupervisorState>,
}

impl Reporter {
    fn emit(&self, state: SupervisorState) {
        match &state {
            SupervisorState::Disconnected { error, retry_in } => {
                tracing::warn!(error = %crate::error::chain(error), ?retry_in, "tunnel disconnected")
            }
            SupervisorState::Online {
                forwarding_address, ..
            } => tracing::info!(%forwarding_address, "tunnel online"),
            _ => {}
        }
        let _ = self.events.try_send(state.clone());
        self.state.send_replace(state);
    }
}

fn hostname_eligible(options: &TunnelOptions) -> bool {
    options.publish != Some(false)
        && options.protocol != Some(TunnelProtocol::Tcp)
        && options.hostname.is_none()
}

async fn run(
    client: Client,
    options: TunnelOptions,
    config: SupervisorConfig,
    reporter: Reporter,
    streams: mpsc::Sender<RstreamStream>,
    cancel: CancellationToken,
) {
    let mut hostname = match &config.stable_hostname {
        StableHostname::Fixed(h) if hostname_eligible(&options) => Some(h.clone()),
        _ => None,
    };
    let mut attempt = 0u32;
    let mut failures = 0u32;
    loop {
        attempt = attempt.saturating_add(1);
        reporter.emit(SupervisorState::Connecting { attempt });
        let mut online_at = None;
        let outcome = session(
            &client,
            &options,
            &config,
            &mut hostname,
            &reporter,
            &streams,
            &cancel,
            &mut online_at,
        )
        .await;
        let error = match outcome {
            None => {
                reporter.emit(SupervisorState::Stopped { error: None });
                return;
            }
            Some(e) => e,
        };
        if online_at.is_some_and(|t: Instant| t.elapsed() >= config.healthy_after) {
            failures = 0;
        }
        if !error.retryable() && !config.retry_non_retryable {
            reporter.emit(SupervisorState::Stopped { error: Some(error) });
            return;
        }
        failures = failures.saturating_add(1);
        let retry_in = config.delay(failures);
        reporter.emit(SupervisorState::Disconnected { error, retry_in });
        tokio::select! {
            _ = cancel.cancelled() => {
                reporter.emit(SupervisorState::Stopped { error: None });
                return;
            }
            _ = tokio::time::sleep(retry_in) => {}
        }
    }
}

/// One connection. Returns `None` when cancelled, otherwise the error that ended it.
#[allow(clippy::too_many_arguments)]
async fn session(
    client: &Client,
    options: &TunnelOptions,
    config: &SupervisorConfig,
    hostname: &mut Option<String>,
    reporter: &Reporter,
    streams: &mpsc::Sender<RstreamStream>,
    cancel: &CancellationToken,
    online_at: &mut Option<Instant>,
) -> Option<Error> {
    let control = tokio::select! {
        _ = cancel.cancelled() => return None,
        c = client.connect() => match c { Ok(c) => c, Err(e) => return Some(e) },
    };
    if hostname.is_none()
        && config.stable_hostname == StableHostname::Auto
        && hostname_eligible(options)
    {
        *hostname = generate_stable_hostname(control.engine().host());
    }
    let mut opts = options.clone();
    if opts.hostname.is_none() {
        opts.hostname.clone_from(hostname);
    }
    let created = tokio::select! {
        _ = cancel.cancelled() => {
            let _ = control.close().await;
            return None;
        }
        t = control.create_tunnel(opts) => t,
    };
    let mut tunnel = match created {
        Ok(t) => t,
        Err(e) => {
            let _ = control.close().await;
            return Some(e);
        }
    };
    let forwarding_address = tunnel
        .forwarding_address()
        .unwrap_or_else(|_| tunnel.id().to_owned());
    reporter.emit(SupervisorState::Online {
        properties: Box::new(tunnel.properties().clone()),
        forwarding_address,
    });
    *online_at = Some(Instant::now());
    loop {
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = control.close().await;
                return None;
            }
            next = tunnel.accept() => match next {
                Ok(stream) => {
                    // A slow consumer applies backpressure to this tunnel only.
                    if streams.send(stream).await.is_err() {
                        tracing::debug!("no stream consumer; dropping stream");
                    }
                }
                Err(e) => {
                    let _ = control.close().await;
                    return Some(e);
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_caps_and_jitters() {
        let cfg = SupervisorConfig::default().jitter(false);
        let secs: Vec<u64> = (1..=7).map(|n| cfg.delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(cfg.delay(u32::MAX), Duration::from_secs(30));
        let jittered = SupervisorConfig::default();
        for n in 1..10 {
            let d = jittered.delay(n);
            let base = cfg.delay(n);
            assert!(d <= base && d >= base.mul_f64(0.75), "{d:?} vs {base:?}");
        }
    }
}
