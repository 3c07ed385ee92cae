//! The engine the agents dial: its view of tunnels and logins, run in this process or as a process of its own.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rstream_client::engine::{EngineIdentity, LocalEngine};

use crate::node;

pub(super) const TOKEN: &str = "e2e-token-1";
/// The token the rotation scenario moves the agents to.
pub(super) const TOKEN_2: &str = "e2e-token-2";

/// What the scenarios need of an engine: its address, its CA and a tunnel's ingress.
pub trait EngineView {
    /// The engine address agents dial.
    fn engine_address(&self) -> String;
    /// The CA certificate (PEM) agents trust.
    fn ca_pem(&self) -> String;
    /// The published TCP ingress of a tunnel.
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr>;
}

impl EngineView for LocalEngine {
    fn engine_address(&self) -> String {
        LocalEngine::engine_address(self)
    }
    fn ca_pem(&self) -> String {
        LocalEngine::ca_pem(self).to_owned()
    }
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        LocalEngine::ingress_addr(self, tunnel_id)
    }
}

/// A control-channel login the engine process reported.
#[derive(Clone, Debug)]
pub struct Login {
    /// The client id it logged in with.
    pub client_id: String,
    /// The token it presented.
    pub token: String,
    /// Whether the engine accepted it.
    pub accepted: bool,
    /// Whether the channel is still open.
    pub open: bool,
}

impl std::fmt::Display for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let outcome = if !self.accepted {
            "refused"
        } else if self.open {
            "open"
        } else {
            "closed"
        };
        write!(f, "{} {} ({outcome})", self.client_id, self.token)
    }
}

pub(super) fn logins_text(logins: &[Login]) -> String {
    if logins.is_empty() {
        return "none".to_owned();
    }
    logins
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Default)]
struct EngineEvents {
    logins: Vec<Login>,
    tunnels: std::collections::HashMap<String, SocketAddr>,
    auth_acks: u64,
}

/// LocalEngine as a process of its own (the `local_engine` example), so a scenario can SIGKILL
/// it: its events (logins with their token, tunnels with their ingress) read from its stdout,
/// its accepted tokens changed through its stdin.
pub struct EngineProcess {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    addr: SocketAddr,
    ca_pem: String,
    events: std::sync::Arc<std::sync::Mutex<EngineEvents>>,
}

/// How long the engine process may take to listen, or to acknowledge a command.
const ENGINE_PROCESS_LIMIT: Duration = Duration::from_secs(30);

impl EngineProcess {
    /// Starts `bin` listening on `listen` with the identity in `identity` (JSON), accepting
    /// exactly `tokens`.
    pub async fn start(
        bin: &std::path::Path,
        listen: SocketAddr,
        identity: &std::path::Path,
        ca_pem: &str,
        tokens: &[&str],
    ) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt as _;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--identity")
            .arg(identity)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        for token in tokens {
            cmd.args(["--token", token]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut lines =
            tokio::io::BufReader::new(child.stdout.take().context("no stdout")?).lines();
        let first = tokio::time::timeout(ENGINE_PROCESS_LIMIT, lines.next_line())
            .await
            .with_context(|| {
                format!("the engine process did not listen within {ENGINE_PROCESS_LIMIT:?}")
            })??
            .context("the engine process ended before listening")?;
        let addr: SocketAddr = first
            .strip_prefix("listening ")
            .with_context(|| format!("the engine process said {first:?}, not listening"))?
            .parse()?;
        let events = std::sync::Arc::new(std::sync::Mutex::new(EngineEvents::default()));
        let sink = events.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let words: Vec<&str> = line.split(' ').collect();
                let mut ev = sink.lock().unwrap_or_else(|p| p.into_inner());
                match words.as_slice() {
                    ["login", id, outcome, token] => ev.logins.push(Login {
                        client_id: (*id).to_owned(),
                        token: (*token).to_owned(),
                        accepted: *outcome == "accepted",
                        open: *outcome == "accepted",
                    }),
                    ["closed", id] => {
                        for l in ev.logins.iter_mut().filter(|l| l.client_id == *id) {
                            l.open = false;
                        }
                    }
                    ["tunnel", id, ingress] => {
                        if let Ok(ingress) = ingress.parse() {
                            ev.tunnels.insert((*id).to_owned(), ingress);
                        }
                    }
                    ["tunnel-closed", id] => {
                        ev.tunnels.remove(*id);
                    }
                    ["auth", ..] => ev.auth_acks += 1,
                    _ => {}
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            addr,
            ca_pem: ca_pem.to_owned(),
            events,
        })
    }

    fn events(&self) -> std::sync::MutexGuard<'_, EngineEvents> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every login so far, in order.
    pub fn logins(&self) -> Vec<Login> {
        self.events().logins.clone()
    }

    /// Accept exactly `tokens` from now on; the engine closes the channels of any other token.
    /// Returns once the engine acknowledged it.
    pub async fn set_tokens(&mut self, tokens: &[&str]) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        let acks = self.events().auth_acks;
        self.stdin
            .write_all(format!("tokens {}\n", tokens.join(" ")).as_bytes())
            .await?;
        self.stdin.flush().await?;
        let started = Instant::now();
        while self.events().auth_acks == acks {
            if started.elapsed() > ENGINE_PROCESS_LIMIT {
                bail!(
                    "the engine process did not acknowledge tokens {tokens:?} within {ENGINE_PROCESS_LIMIT:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGKILL: the process ends at once, every connection with it.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await?;
        Ok(())
    }

    /// Ends the process (`quit`, then SIGKILL after 10 s).
    pub async fn shutdown(mut self) {
        use tokio::io::AsyncWriteExt as _;
        let _ = self.stdin.write_all(b"quit\n").await;
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

impl EngineView for EngineProcess {
    fn engine_address(&self) -> String {
        self.addr.to_string()
    }
    fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }
    fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        self.events().tunnels.get(tunnel_id).copied()
    }
}

/// The ingress of `tunnel_id`, waiting up to 30 s for the engine to report it (a separate
/// engine process reports a new tunnel a moment after the agent sees it open).
pub(super) async fn wait_ingress(
    engine: &(impl EngineView + ?Sized),
    tunnel_id: &str,
) -> Option<SocketAddr> {
    let started = Instant::now();
    loop {
        if let Some(addr) = engine.ingress_addr(tunnel_id) {
            return Some(addr);
        }
        if started.elapsed() > Duration::from_secs(30) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Builds the `local_engine` example (a no-op when it is up to date); returns its path.
pub(super) async fn build_engine_process() -> anyhow::Result<std::path::PathBuf> {
    let root = crate::workspace::root();
    let mut cmd =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    cmd.current_dir(&root).args([
        "build",
        "--quiet",
        "-p",
        "examples",
        "--example",
        "local_engine",
    ]);
    crate::workspace::without_run_env(&mut cmd);
    let status = tokio::task::spawn_blocking(move || cmd.status())
        .await?
        .context("running cargo build -p examples --example local_engine")?;
    if !status.success() {
        bail!("building the local_engine example failed ({status})");
    }
    Ok(crate::workspace::target_dir(&root).join("debug/examples/local_engine"))
}

/// The engine Pods reach: LocalEngine on the host's end of the node link, its certificate naming
/// that address, as a self-hosted engine with a private CA.
pub async fn start_engine(identity: Option<EngineIdentity>) -> anyhow::Result<LocalEngine> {
    let identity = match identity {
        Some(identity) => identity,
        None => EngineIdentity::generate_for(&[&node::HOST_IP.to_string()])?,
    };
    Ok(LocalEngine::builder()
        .bind(SocketAddr::new(node::HOST_IP.into(), 0))
        .identity(identity)
        .start()
        .await?)
}
