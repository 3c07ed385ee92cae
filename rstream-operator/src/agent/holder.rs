//! Holding the tunnel, or standing by for it.
//!
//! The engine keeps a published hostname exclusive ("Hostname is already in use."), so the agents
//! of one RstreamTunnel cannot all hold its tunnel: one does (active), the others keep their
//! control channel open and ask for the hostname again every retry period (standby), so that one
//! of them takes the tunnel over within about that period once the holder lets go. rstream-client's
//! supervisor would close the channel and back off up to its maximum (30 s) on that answer, which
//! is right for one agent and too slow for a hand-over.
//!
//! A planned hand-over (SIGTERM: a rollout, a drain) is made before it breaks: the holder says it
//! is leaving through a [`HandOver`] channel and keeps serving; a standby that reads it says it is
//! ready and asks for the hostname every few milliseconds, several requests in flight; only then
//! does the holder close its tunnel (streams still arriving until the engine confirms are served),
//! so the hostname is held again within about one request spacing. The engine's exclusivity leaves
//! that gap; nothing here hides it. A holder that dies is replaced at the standby's slow pace.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rstream_client::error::HOSTNAME_IN_USE;
use rstream_client::proto::TunnelProperties;
use rstream_client::supervisor::SupervisorConfig;
use rstream_client::tunnel::TunnelOptions;
use rstream_client::{Client, ControlChannel, EngineErrorCode, Error, RstreamStream, Tunnel};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a leaving holder waits for a standby to say it is ready: a standby reads the channel
/// about once per retry period (1 s), so this covers a slow read; with nobody standing by (one
/// replica) the holder lets go after it, as it always did.
pub(crate) const READY_WAIT: Duration = Duration::from_secs(3);
/// How often a leaving holder looks for a standby's answer.
const READY_POLL: Duration = Duration::from_millis(50);
/// A ready standby's request spacing: the gap a hand-over leaves is about this plus the engine's
/// own handling.
const TAKE_SPACING: Duration = Duration::from_millis(2);
/// Requests in flight at once while taking over, so a distant engine's round trip does not widen
/// the gap.
const TAKE_IN_FLIGHT: usize = 16;
/// How long a ready standby keeps asking fast: past [`READY_WAIT`], after which the holder has let
/// go whoever answered.
const TAKE_WINDOW: Duration = Duration::from_secs(5);
/// How often a standby taking over checks that the hand-over is still under way (another standby
/// may have won it).
const TAKE_CHECK: Duration = Duration::from_millis(250);

/// Where the agents of one tunnel tell each other about a hand-over. Errors are the
/// implementation's to log: a channel that fails reads as "nothing said", and the hand-over falls
/// back to the standby's slow retry.
pub(crate) trait HandOver: Send + Sync + 'static {
    /// Whether there is a channel at all (without one a holder lets go at once).
    fn enabled(&self) -> bool {
        true
    }
    /// Holder: says it is leaving.
    fn announce(&self) -> impl Future<Output = ()> + Send;
    /// Holder: whether a standby said it is ready to take the tunnel.
    fn taken_up(&self) -> impl Future<Output = bool> + Send;
    /// Standby: whether a holder said it is leaving, and the hand-over is not over.
    fn leaving(&self) -> impl Future<Output = bool> + Send;
    /// Standby: says it is ready to take the tunnel.
    fn take_up(&self) -> impl Future<Output = ()> + Send;
}

/// No channel (a tunnel without Kubernetes reporting): a holder lets go at once.
pub(crate) struct NoHandOver;

impl HandOver for NoHandOver {
    fn enabled(&self) -> bool {
        false
    }
    async fn announce(&self) {}
    async fn taken_up(&self) -> bool {
        false
    }
    async fn leaving(&self) -> bool {
        false
    }
    async fn take_up(&self) {}
}

/// Where the agent stands.
#[derive(Clone, Debug)]
pub(crate) enum HolderState {
    /// Connecting to the engine (attempt number since start, 1-based).
    Connecting { attempt: u32 },
    /// This agent holds the tunnel.
    Active {
        properties: Box<TunnelProperties>,
        forwarding_address: String,
    },
    /// Connected; another agent holds the hostname.
    Standby,
    /// Leaving: the tunnel is closed on the engine (handed over); the control channel stays open
    /// for the streams the engine sent before, until the shutdown.
    Released,
    /// The connection or the tunnel failed; the next attempt starts after `retry_in`.
    Disconnected { error: Error, retry_in: Duration },
    /// Stopped: `None` after a shutdown.
    Stopped { error: Option<Error> },
}

impl HolderState {
    /// Connected to the engine, holding the tunnel or ready to take it: what readiness means.
    pub(crate) fn connected(&self) -> bool {
        matches!(self, Self::Active { .. } | Self::Standby)
    }

    /// Whether the tunnel is let go of (after [`HolderHandle::release`]): no new stream comes.
    pub(crate) fn let_go(&self) -> bool {
        matches!(self, Self::Released | Self::Stopped { .. })
    }
}

/// Whether the engine refused the tunnel because another holder has its hostname.
pub(crate) fn hostname_in_use(error: &Error) -> bool {
    matches!(error, Error::Engine { code: EngineErrorCode::InvalidRequest, message }
        if message.trim() == HOSTNAME_IN_USE)
}

/// A running holder: its state, the streams of the tunnel while it is held, and its stop.
pub(crate) struct HolderHandle {
    state: watch::Receiver<HolderState>,
    streams: mpsc::Receiver<RstreamStream>,
    leave: CancellationToken,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

/// What the holder task works with.
struct Holder<H> {
    client: Client,
    options: TunnelOptions,
    backoff: SupervisorConfig,
    handover: Arc<H>,
    state: watch::Sender<HolderState>,
    streams: mpsc::Sender<RstreamStream>,
    /// Hand the tunnel over and take no new stream (the channel stays open).
    leave: CancellationToken,
    /// Close everything now.
    cancel: CancellationToken,
}

impl HolderHandle {
    /// Starts holding (or standing by for) the tunnel of `options`. `backoff` gives the reconnect
    /// delays; its first delay is also the standby's retry period. `handover` is where a planned
    /// hand-over is agreed.
    pub(crate) fn spawn<H: HandOver>(
        client: Client,
        options: TunnelOptions,
        backoff: SupervisorConfig,
        handover: Arc<H>,
    ) -> Self {
        let (state_tx, state) = watch::channel(HolderState::Connecting { attempt: 0 });
        let (streams_tx, streams) = mpsc::channel(64);
        let leave = CancellationToken::new();
        let cancel = CancellationToken::new();
        let holder = Holder {
            client,
            options,
            backoff,
            handover,
            state: state_tx,
            streams: streams_tx,
            leave: leave.clone(),
            cancel: cancel.clone(),
        };
        let task = tokio::spawn(holder.run());
        Self {
            state,
            streams,
            leave,
            cancel,
            task: Some(task),
        }
    }

    pub(crate) fn watch(&self) -> watch::Receiver<HolderState> {
        self.state.clone()
    }

    /// The next inbound stream; `None` once stopped.
    pub(crate) async fn accept(&mut self) -> Option<RstreamStream> {
        self.streams.recv().await
    }

    /// A stream already received, if any (what is left after the holder let go).
    pub(crate) fn try_accept(&mut self) -> Option<RstreamStream> {
        self.streams.try_recv().ok()
    }

    /// Starts a planned hand-over: a holder says it is leaving, waits (at most [`READY_WAIT`])
    /// for a standby to be ready, then closes its tunnel and keeps its channel open until
    /// [`shutdown`](Self::shutdown); anything else just stops. The state reaches
    /// [`HolderState::let_go`] when no new stream comes.
    pub(crate) fn release(&self) {
        self.leave.cancel();
    }

    /// Lets go at once: closes the tunnel on the engine first (a standby may take it at once),
    /// then the control channel; waits for both.
    pub(crate) async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for HolderHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// How one control channel ended.
enum Ended {
    /// Stopped on purpose (the channel is closed).
    Stopped,
    /// Failed (the channel is closed).
    Failed(Error),
}

impl<H: HandOver> Holder<H> {
    fn emit(&self, s: HolderState) {
        self.state.send_replace(s);
    }

    /// Cancelled, or asked to leave while not holding: either way, stop.
    async fn stopping(&self) {
        tokio::select! {
            () = self.cancel.cancelled() => {}
            () = self.leave.cancelled() => {}
        }
    }

    async fn run(self) {
        let mut attempt = 0u32;
        let mut failures = 0u32;
        loop {
            attempt = attempt.saturating_add(1);
            self.emit(HolderState::Connecting { attempt });
            let connected = tokio::select! {
                () = self.stopping() => None,
                c = self.client.connect() => Some(c),
            };
            let error = match connected {
                None => {
                    self.emit(HolderState::Stopped { error: None });
                    return;
                }
                Some(Err(error)) => error,
                Some(Ok(control)) => {
                    let since = Instant::now();
                    let ended = self.hold(&control).await;
                    // A channel that stayed up (active or standby) was healthy: start the backoff
                    // over.
                    if since.elapsed() >= self.backoff.healthy_after {
                        failures = 0;
                    }
                    match ended {
                        Ended::Failed(error) => error,
                        Ended::Stopped => {
                            self.emit(HolderState::Stopped { error: None });
                            return;
                        }
                    }
                }
            };
            failures = failures.saturating_add(1);
            let retry_in = self.backoff.delay(failures);
            self.emit(HolderState::Disconnected { error, retry_in });
            tokio::select! {
                () = self.stopping() => {
                    self.emit(HolderState::Stopped { error: None });
                    return;
                }
                () = tokio::time::sleep(retry_in) => {}
            }
        }
    }

    /// One control channel: holds the tunnel or stands by, until stopped or failed (the channel
    /// is closed either way).
    async fn hold(&self, control: &ControlChannel) -> Ended {
        // Said once per channel, not at every retry (each state change is logged).
        let mut standing_by = false;
        loop {
            let created = tokio::select! {
                () = self.stopping() => {
                    let _ = control.close().await;
                    return Ended::Stopped;
                }
                t = control.create_tunnel(self.options.clone()) => t,
            };
            let tunnel = match created {
                Ok(tunnel) => tunnel,
                Err(error) if hostname_in_use(&error) => {
                    if !standing_by {
                        standing_by = true;
                        self.emit(HolderState::Standby);
                    }
                    // Between two slow requests: is the holder leaving? Then take it up fast.
                    // The read takes at most the pause: an API server out of reach (a connection
                    // through a lost node hangs) must not stop the requests for the hostname.
                    let pause = self.backoff.delay(1);
                    let leaving = async {
                        let (_, read) = tokio::join!(
                            tokio::time::sleep(pause),
                            tokio::time::timeout(pause, self.handover.leaving())
                        );
                        read.unwrap_or(false)
                    };
                    let leaving = tokio::select! {
                        () = self.stopping() => {
                            let _ = control.close().await;
                            return Ended::Stopped;
                        }
                        closed = control.wait_closed() => {
                            return Ended::Failed(closed.err().unwrap_or(Error::ControlClosed));
                        }
                        leaving = leaving => leaving,
                    };
                    if !leaving {
                        continue;
                    }
                    tracing::info!(
                        component = "runner",
                        "The holder is leaving: taking the tunnel over"
                    );
                    // Said while already asking fast: the holder may let go as soon as it reads it.
                    let handover = Arc::clone(&self.handover);
                    tokio::spawn(async move { handover.take_up().await });
                    match self.take_over(control).await {
                        Ok(Some(tunnel)) => tunnel,
                        Ok(None) => continue,
                        Err(Ended::Stopped) => {
                            let _ = control.close().await;
                            return Ended::Stopped;
                        }
                        Err(ended) => {
                            let _ = control.close().await;
                            return ended;
                        }
                    }
                }
                Err(error) => {
                    let _ = control.close().await;
                    return Ended::Failed(error);
                }
            };
            return self.serve(control, tunnel).await;
        }
    }

    /// A ready standby asks for the hostname every [`TAKE_SPACING`], at most [`TAKE_IN_FLIGHT`]
    /// requests at once, until one is granted (`Some`), the hand-over is over or
    /// [`TAKE_WINDOW`] passed (`None`: back to standing by). Every request is answered before this
    /// returns, so a granted tunnel is never dropped unseen (one more granted than needed, which
    /// the engine's exclusivity rules out, is closed).
    async fn take_over(&self, control: &ControlChannel) -> Result<Option<Tunnel>, Ended> {
        let started = Instant::now();
        let mut asking = FuturesUnordered::new();
        let mut spacing = tokio::time::interval(TAKE_SPACING);
        spacing.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Checked alongside, so that a slow read never holds the requests back.
        let over = self.hand_over_ended();
        tokio::pin!(over);
        let mut granted: Option<Tunnel> = None;
        let mut failed: Option<Ended> = None;
        let mut asking_more = true;
        loop {
            if !asking_more && asking.is_empty() {
                break;
            }
            tokio::select! {
                biased;
                () = self.cancel.cancelled(), if failed.is_none() => {
                    // The channel's close answers what is in flight.
                    failed = Some(Ended::Stopped);
                    asking_more = false;
                    let _ = control.close().await;
                }
                Some(answer) = asking.next(), if !asking.is_empty() => match answer {
                    Ok(tunnel) => match &granted {
                        None => {
                            granted = Some(tunnel);
                            asking_more = false;
                        }
                        Some(_) => {
                            let _ = Tunnel::close(&tunnel).await;
                        }
                    },
                    Err(error) if hostname_in_use(&error) => {}
                    Err(error) => {
                        if failed.is_none() {
                            failed = Some(Ended::Failed(error));
                        }
                        asking_more = false;
                    }
                },
                _ = spacing.tick(), if asking_more && asking.len() < TAKE_IN_FLIGHT => {
                    if started.elapsed() >= TAKE_WINDOW {
                        asking_more = false;
                    } else {
                        let options = self.options.clone();
                        asking.push(async move { control.create_tunnel(options).await });
                    }
                }
                () = &mut over, if asking_more => asking_more = false,
            }
        }
        match (granted, failed) {
            (Some(tunnel), None) => Ok(Some(tunnel)),
            (Some(tunnel), Some(ended)) => {
                let _ = tunnel.close().await;
                Err(ended)
            }
            (None, Some(ended)) => Err(ended),
            (None, None) => Ok(None),
        }
    }

    /// Returns once the channel says the hand-over is over (another standby took the tunnel).
    async fn hand_over_ended(&self) {
        loop {
            tokio::time::sleep(TAKE_CHECK).await;
            if !self.handover.leaving().await {
                return;
            }
        }
    }

    /// Holds `tunnel`: hands its streams on until stopped, released or failed.
    async fn serve(&self, control: &ControlChannel, mut tunnel: Tunnel) -> Ended {
        let forwarding_address = tunnel
            .forwarding_address()
            .unwrap_or_else(|_| tunnel.id().to_owned());
        self.emit(HolderState::Active {
            properties: Box::new(tunnel.properties().clone()),
            forwarding_address,
        });
        loop {
            tokio::select! {
                () = self.cancel.cancelled() => {
                    // The hostname is free for a standby as soon as the engine has this.
                    let _ = tunnel.close().await;
                    let _ = control.close().await;
                    return Ended::Stopped;
                }
                () = self.leave.cancelled() => return self.hand_over(control, tunnel).await,
                next = tunnel.accept() => match next {
                    Ok(stream) => self.pass_on(stream).await,
                    Err(error) => {
                        let _ = control.close().await;
                        return Ended::Failed(error);
                    }
                },
            }
        }
    }

    async fn pass_on(&self, stream: RstreamStream) {
        if self.streams.send(stream).await.is_err() {
            tracing::debug!("no stream consumer; dropping stream");
        }
    }

    /// A planned hand-over: says it is leaving, serves on until a standby is ready (at most
    /// [`READY_WAIT`]), closes the tunnel while still taking the streams the engine sends before
    /// its answer, then keeps the channel open (streams being dialled) until cancelled.
    async fn hand_over(&self, control: &ControlChannel, mut tunnel: Tunnel) -> Ended {
        if self.handover.enabled() {
            let asked = Instant::now();
            self.handover.announce().await;
            let waited = async {
                while !self.handover.taken_up().await {
                    if asked.elapsed() >= READY_WAIT {
                        return false;
                    }
                    tokio::time::sleep(READY_POLL).await;
                }
                true
            };
            tokio::pin!(waited);
            let ready = loop {
                tokio::select! {
                    () = self.cancel.cancelled() => {
                        let _ = tunnel.close().await;
                        let _ = control.close().await;
                        return Ended::Stopped;
                    }
                    ready = &mut waited => break ready,
                    next = tunnel.accept() => match next {
                        Ok(stream) => self.pass_on(stream).await,
                        Err(error) => {
                            let _ = control.close().await;
                            return Ended::Failed(error);
                        }
                    },
                }
            };
            tracing::info!(
                component = "runner",
                standby_ready = ready,
                waited = ?asked.elapsed(),
                "Handing the tunnel over"
            );
        }
        let closing = control.clone();
        let id = tunnel.id().to_owned();
        let closed = closing.close_tunnel(&id);
        tokio::pin!(closed);
        let mut answered = false;
        loop {
            tokio::select! {
                biased;
                // Until the tunnel says it is closed: every stream the engine sent before.
                next = tunnel.accept() => match next {
                    Ok(stream) => self.pass_on(stream).await,
                    Err(_) => break,
                },
                _ = &mut closed, if !answered => {
                    answered = true;
                    // No answer (a timeout): the tunnel stays open here; stop waiting for it.
                    if !tunnel.is_closed() {
                        break;
                    }
                }
            }
        }
        self.emit(HolderState::Released);
        self.cancel.cancelled().await;
        let _ = control.close().await;
        Ended::Stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstream_client::engine::LocalEngine;
    use std::sync::Mutex;

    fn engine_client(engine: &LocalEngine) -> Client {
        Client::builder()
            .engine(engine.engine_address())
            .token("t")
            .tls(engine.client_tls())
            .build()
            .unwrap()
    }

    async fn wait_state(
        rx: &mut watch::Receiver<HolderState>,
        what: &str,
        f: impl Fn(&HolderState) -> bool,
    ) {
        let waited = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|s| f(s)))
            .await
            .is_ok_and(|r| r.is_ok());
        assert!(waited, "not {what} in 30 s: {:?}", *rx.borrow());
    }

    fn backoff() -> SupervisorConfig {
        SupervisorConfig::default().backoff(Duration::from_millis(200), Duration::from_secs(1))
    }

    /// Two holders of one hostname: one active, one standby on an open channel; the active one
    /// stops and the standby takes the tunnel over.
    #[tokio::test]
    async fn a_standby_keeps_its_channel_and_takes_the_hostname_over() {
        let engine = LocalEngine::builder().token("t").start().await.unwrap();
        let options = TunnelOptions::http().hostname("web.example.test");
        let none = Arc::new(NoHandOver);
        let first = HolderHandle::spawn(
            engine_client(&engine),
            options.clone(),
            backoff(),
            none.clone(),
        );
        let mut first_state = first.watch();
        wait_state(&mut first_state, "active", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        let public = engine.hostname_ingress_addr("web.example.test").unwrap();
        let second = HolderHandle::spawn(engine_client(&engine), options, backoff(), none);
        let mut second_state = second.watch();
        wait_state(&mut second_state, "standby", |s| {
            matches!(s, HolderState::Standby)
        })
        .await;
        // Several retries later: still standby, still one channel each, one tunnel.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(matches!(*second_state.borrow(), HolderState::Standby));
        assert_eq!(engine.control_channels(), 2);
        assert_eq!(engine.tunnels().len(), 1);
        let logins = engine.control_logins().len();
        assert_eq!(logins, 2, "the standby reconnected");

        let stopped = std::time::Instant::now();
        first.shutdown().await;
        wait_state(&mut second_state, "active after the hand-over", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        // A figure, not a bound: about one standby retry (here 150-200 ms).
        eprintln!("hand-over after shutdown: {:?}", stopped.elapsed());
        assert_eq!(engine.tunnels().len(), 1);
        // The hostname's address now reaches the new holder.
        let mut second = second;
        let mut downstream = tokio::net::TcpStream::connect(public).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut downstream, b"ping")
            .await
            .unwrap();
        let accepted = tokio::time::timeout(Duration::from_secs(30), second.accept()).await;
        assert!(
            matches!(accepted, Ok(Some(_))),
            "no stream through {public}"
        );
        second.shutdown().await;
        // Nobody holds the hostname now: a connection to its address is closed, and counted.
        assert_eq!(engine.hostname_misses(), 0);
        let mut late = tokio::net::TcpStream::connect(public).await.unwrap();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncReadExt::read_to_end(&mut late, &mut rest),
        )
        .await;
        assert!(read.is_ok(), "the connection stayed open with no holder");
        assert_eq!(engine.hostname_misses(), 1);
        engine.shutdown().await;
    }

    /// A hand-over channel whose reads never answer: an API server behind a dead connection.
    struct Unreachable;

    impl HandOver for Unreachable {
        async fn announce(&self) {}
        async fn taken_up(&self) -> bool {
            std::future::pending().await
        }
        async fn leaving(&self) -> bool {
            std::future::pending().await
        }
        async fn take_up(&self) {}
    }

    /// The holder's channel dies without a hand-over while the standby cannot read the
    /// hand-over channel: the standby keeps asking for the hostname and takes it.
    #[tokio::test]
    async fn a_standby_takes_the_hostname_when_the_hand_over_channel_hangs() {
        let engine = LocalEngine::builder().token("t").start().await.unwrap();
        let options = TunnelOptions::http().hostname("web.example.test");
        let first = HolderHandle::spawn(
            engine_client(&engine),
            options.clone(),
            backoff(),
            Arc::new(NoHandOver),
        );
        let mut first_state = first.watch();
        wait_state(&mut first_state, "active", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        let second = HolderHandle::spawn(
            engine_client(&engine),
            options,
            backoff(),
            Arc::new(Unreachable),
        );
        let mut second_state = second.watch();
        wait_state(&mut second_state, "standby", |s| {
            matches!(s, HolderState::Standby)
        })
        .await;
        // The holder goes without a hand-over (as a lost one does).
        first.shutdown().await;
        wait_state(&mut second_state, "active with the channel hanging", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        second.shutdown().await;
        engine.shutdown().await;
    }

    /// A hand-over channel in memory, recording when the standby said it was ready.
    #[derive(Default)]
    struct Memory {
        leaving: Mutex<bool>,
        ready_at: Mutex<Option<std::time::Instant>>,
    }

    impl HandOver for Memory {
        async fn announce(&self) {
            *self.leaving.lock().unwrap() = true;
        }
        async fn taken_up(&self) -> bool {
            self.ready_at.lock().unwrap().is_some()
        }
        async fn leaving(&self) -> bool {
            *self.leaving.lock().unwrap()
        }
        async fn take_up(&self) {
            self.ready_at
                .lock()
                .unwrap()
                .get_or_insert_with(std::time::Instant::now);
        }
    }

    /// A released holder closes its tunnel only once the standby said it is ready; the standby
    /// then holds the hostname, and the released holder's channel stays open until its shutdown.
    #[tokio::test]
    async fn a_released_holder_lets_go_only_once_a_standby_is_ready() {
        let engine = LocalEngine::builder().token("t").start().await.unwrap();
        let options = TunnelOptions::http().hostname("web.example.test");
        let channel = Arc::new(Memory::default());
        let first = HolderHandle::spawn(
            engine_client(&engine),
            options.clone(),
            backoff(),
            channel.clone(),
        );
        let mut first_state = first.watch();
        wait_state(&mut first_state, "active", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        let second =
            HolderHandle::spawn(engine_client(&engine), options, backoff(), channel.clone());
        let mut second_state = second.watch();
        wait_state(&mut second_state, "standby", |s| {
            matches!(s, HolderState::Standby)
        })
        .await;

        let asked = std::time::Instant::now();
        first.release();
        wait_state(&mut first_state, "released", HolderState::let_go).await;
        let released = std::time::Instant::now();
        let ready_at = *channel.ready_at.lock().unwrap();
        assert!(
            ready_at.is_some_and(|t| t <= released),
            "the holder let go before the standby was ready ({ready_at:?})"
        );
        assert!(matches!(*first_state.borrow(), HolderState::Released));
        wait_state(&mut second_state, "active after the hand-over", |s| {
            matches!(s, HolderState::Active { .. })
        })
        .await;
        // Figures, not bounds.
        eprintln!(
            "released {:?} after the ask; the standby active {:?} after the release",
            released - asked,
            released.elapsed()
        );
        // The released holder keeps its channel (streams in flight) until its shutdown.
        assert_eq!(engine.control_channels(), 2);
        assert_eq!(engine.tunnels().len(), 1);
        first.shutdown().await;
        second.shutdown().await;
        engine.shutdown().await;
    }
}
