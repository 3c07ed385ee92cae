//! HAProxy as the data plane, driven through its Runtime API (the stats socket): no reloads.
//!
//! `pod-proxier haproxy-config` prints a configuration with one frontend and one empty backend
//! per entry port (the V1 entry port and every port of the V2 range). pod-proxier then adds,
//! enables, disables and deletes servers in those backends at runtime (`add server`,
//! `enable server`, `disable server`, `del server`), so a mapping change is live at once and
//! established connections keep running unless the mapping asks to close them (`shutdown
//! sessions server`). An empty backend closes incoming connections, so an idle entry port
//! refuses. Every sync first reads HAProxy's actual servers (`show servers state`), which also
//! repairs drift, e.g. after HAProxy restarted with its empty configuration.
//!
//! With `--entry-access=requester` every V1 frontend rejects, at connection, a client whose
//! source its ACL (unique id = the port) does not hold: `tcp-request connection reject if
//! !admitted`. pod-proxier keeps the ACL equal to the mapping's admitted sources (`add acl`,
//! `del acl`), and counts HAProxy's denied connections (`dcon` of `show stat`) as refusals.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Mutex;

use super::{DesiredPorts, PortError, PortRoute};
use crate::access::{Cidr, EntryAccess};
use crate::metrics::EntryLabels;
use crate::settings::{MappingPolicy, RuntimeApiAddr, Settings};

/// Bound on one Runtime API command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(3);

/// Why HAProxy cannot be driven.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HaproxyError {
    /// No Runtime API address configured.
    #[error("--backend haproxy needs --api-addr (unix:///path or ip:port of the stats socket)")]
    NoAddress,
    /// The socket cannot be reached.
    #[error(
        "cannot reach the HAProxy Runtime API at {addr} (start HAProxy with the configuration \
         printed by `pod-proxier haproxy-config`, same flags)"
    )]
    Unreachable {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// A command did not answer in time.
    #[error("the HAProxy Runtime API at {0} did not answer within 3 seconds")]
    Timeout(String),
    /// HAProxy refused a command.
    #[error("HAProxy refused `{command}`: {answer}")]
    Refused {
        /// The command.
        command: String,
        /// HAProxy's answer.
        answer: String,
    },
    /// The configuration lacks a backend pod-proxier needs.
    #[error(
        "HAProxy has no backend {0}: its configuration does not match pod-proxier's flags; \
         regenerate it with `pod-proxier haproxy-config` and the same flags"
    )]
    MissingBackend(String),
}

/// The backend (and frontend) name of an entry port.
pub fn backend_name(port: u16) -> String {
    format!("entry_{port}")
}

/// The server name of an upstream (stable, so HAProxy's actual state can be compared).
pub fn server_name(addr: &SocketAddr) -> String {
    let text = addr.to_string().replace(['[', ']'], "");
    format!("u_{}", text.replace([':', '.'], "_"))
}

/// The entry ports the configuration declares for `policy`.
pub fn declared_ports(policy: &MappingPolicy) -> Vec<u16> {
    policy.entry_ports()
}

/// The entry ports whose clients' sources are checked: the V1 ports, with
/// `--entry-access=requester`.
pub fn gated_ports(policy: &MappingPolicy) -> BTreeSet<u16> {
    match (&policy.v1, policy.entry_access) {
        (Some(v1), EntryAccess::Requester) => v1.entry_ports.all().into_iter().collect(),
        _ => BTreeSet::new(),
    }
}

/// What a checked port's ACL holds for a route admitting every source (an idle port: its
/// empty backend closes the connection anyway).
fn everyone() -> Vec<Cidr> {
    ["0.0.0.0/0", "::/0"]
        .iter()
        .filter_map(|text| text.parse().ok())
        .collect()
}

/// HAProxy's connection limit, and its pipe limit (one pipe per connection at most).
const MAXCONN: usize = 4096;

/// The HAProxy configuration matching `settings` (printed by `pod-proxier haproxy-config`).
pub fn config_text(settings: &Settings) -> String {
    let pipe_size = proxy_core::relay::DEFAULT_PIPE_SIZE;
    let plane = &settings.plane;
    let socket = match plane.runtime_api.clone() {
        Some(RuntimeApiAddr::Unix(path)) => format!("{} mode 600 level admin", path.display()),
        Some(RuntimeApiAddr::Tcp(addr)) => match addr {
            SocketAddr::V4(v4) => format!("ipv4@{v4} level admin"),
            SocketAddr::V6(v6) => format!("ipv6@{v6} level admin"),
        },
        None => "/run/haproxy/admin.sock mode 600 level admin".to_owned(),
    };
    let check_timeout = plane
        .health_check
        .map(|check| check.timeout.as_secs().max(1))
        .unwrap_or(5);
    let bind_ip = match plane.listen_ip {
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        std::net::IpAddr::V4(ip) => ip.to_string(),
    };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Generated by `pod-proxier haproxy-config`; regenerate it when the flags change.\n\
         # pod-proxier adds and removes servers through the Runtime API: nothing reloads.\n\
         # Splicing as the embedded data plane does: buffered first, then through a pipe of\n\
         # proxy-core's size (splice-auto), with a pipe available for every connection.\n\
         global\n    \
             stats socket {socket}\n    \
             stats timeout 30s\n    \
             maxconn {MAXCONN}\n    \
             maxpipes {MAXCONN}\n    \
             tune.pipesize {pipe_size}\n\n\
         defaults\n    \
             mode tcp\n    \
             option splice-auto\n    \
             timeout connect 5s\n    \
             timeout client 1h\n    \
             timeout server 1h\n    \
             timeout client-fin 30s\n    \
             timeout server-fin 30s\n    \
             timeout check {check_timeout}s\n"
    );
    let gated = gated_ports(&settings.policy);
    for port in declared_ports(&settings.policy) {
        let name = backend_name(port);
        let _ = writeln!(text, "frontend {name}\n    bind {bind_ip}:{port}");
        if gated.contains(&port) {
            // Empty until pod-proxier adds the mapping's sources at runtime (ACL #port).
            let _ = writeln!(
                text,
                "    acl admitted src -u {port}\n    tcp-request connection reject if !admitted"
            );
        }
        let _ = writeln!(
            text,
            "    default_backend {name}\n\nbackend {name}\n    balance roundrobin\n"
        );
    }
    text
}

/// One server as HAProxy reports it.
#[derive(Debug, Clone)]
struct ActualServer {
    name: String,
    in_maintenance: bool,
}

/// HAProxy through its Runtime API.
pub struct HaproxyPlane {
    addr: RuntimeApiAddr,
    declared: BTreeSet<u16>,
    /// Health check interval of checked routes.
    check_interval: Option<Duration>,
    /// The route last applied per port, to decide about closing connections.
    applied: Mutex<HashMap<u16, PortRoute>>,
    /// The ports with a source ACL.
    gated: BTreeSet<u16>,
    /// Clients refused for their source, per entry port.
    refused: Family<EntryLabels, Counter>,
    /// HAProxy's last denied-connection count per port.
    denied: Mutex<HashMap<u16, u64>>,
}

impl HaproxyPlane {
    /// Connects to the Runtime API and checks that the configuration declares every port.
    pub async fn connect(settings: &Settings) -> Result<Self, HaproxyError> {
        let addr = settings
            .plane
            .runtime_api
            .clone()
            .ok_or(HaproxyError::NoAddress)?;
        let plane = Self {
            addr,
            declared: declared_ports(&settings.policy).into_iter().collect(),
            check_interval: settings.plane.health_check.map(|check| check.interval),
            applied: Mutex::new(HashMap::new()),
            gated: gated_ports(&settings.policy),
            refused: Family::default(),
            denied: Mutex::new(HashMap::new()),
        };
        plane.command("show info").await?;
        for port in &plane.declared {
            plane.servers(*port).await?;
        }
        Ok(plane)
    }

    /// [`connect`](Self::connect), retried every 250 ms for up to `wait` while the Runtime API
    /// cannot be reached: in a Pod, HAProxy is a sidecar started alongside pod-proxier and
    /// creates its socket a moment later; without the wait pod-proxier exits and the kubelet
    /// counts a restart on every Pod start. Any other error, or the socket still unreachable
    /// after `wait`, is returned at once.
    pub async fn connect_waiting(
        settings: &Settings,
        wait: Duration,
    ) -> Result<Self, HaproxyError> {
        let started = tokio::time::Instant::now();
        let mut logged = false;
        loop {
            match Self::connect(settings).await {
                Err(HaproxyError::Unreachable { addr, source }) if started.elapsed() < wait => {
                    if !logged {
                        tracing::info!(%addr, error = %source, ?wait, "waiting for the HAProxy Runtime API");
                        logged = true;
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                other => return other,
            }
        }
    }

    /// Counts the sources HAProxy refuses in `refused`, per entry port.
    pub fn with_source_metric(mut self, refused: Family<EntryLabels, Counter>) -> Self {
        self.refused = refused;
        self
    }

    async fn command(&self, command: &str) -> Result<String, HaproxyError> {
        let exchange = async {
            let mut answer = Vec::new();
            match &self.addr {
                RuntimeApiAddr::Unix(path) => {
                    let mut stream = tokio::net::UnixStream::connect(path).await?;
                    stream.write_all(format!("{command}\n").as_bytes()).await?;
                    stream.read_to_end(&mut answer).await?;
                }
                RuntimeApiAddr::Tcp(addr) => {
                    let mut stream = tokio::net::TcpStream::connect(addr).await?;
                    stream.write_all(format!("{command}\n").as_bytes()).await?;
                    stream.read_to_end(&mut answer).await?;
                }
            }
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&answer).into_owned())
        };
        match tokio::time::timeout(COMMAND_TIMEOUT, exchange).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(source)) => Err(HaproxyError::Unreachable {
                addr: self.addr.to_string(),
                source,
            }),
            Err(_) => Err(HaproxyError::Timeout(self.addr.to_string())),
        }
    }

    /// Runs `command`; fails unless the answer is empty or contains `success`.
    async fn expect(&self, command: &str, success: &str) -> Result<(), HaproxyError> {
        let answer = self.command(command).await?;
        let trimmed = answer.trim();
        if trimmed.is_empty() || (!success.is_empty() && trimmed.contains(success)) {
            Ok(())
        } else {
            Err(HaproxyError::Refused {
                command: command.to_owned(),
                answer: trimmed.to_owned(),
            })
        }
    }

    /// The servers of the backend of `port`.
    async fn servers(&self, port: u16) -> Result<Vec<ActualServer>, HaproxyError> {
        let backend = backend_name(port);
        let answer = self
            .command(&format!("show servers state {backend}"))
            .await?;
        if answer.contains("Can't find backend") {
            return Err(HaproxyError::MissingBackend(backend));
        }
        let mut header: Vec<&str> = Vec::new();
        let mut servers = Vec::new();
        for line in answer.lines() {
            if let Some(names) = line.strip_prefix('#') {
                header = names.split_whitespace().collect();
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            if header.is_empty() || fields.len() < header.len().min(7) {
                continue;
            }
            let field = |name: &str| {
                header
                    .iter()
                    .position(|h| *h == name)
                    .and_then(|i| fields.get(i).copied())
            };
            let (Some(name), Some(admin)) = (field("srv_name"), field("srv_admin_state")) else {
                continue;
            };
            // Bit 0x01: forced maintenance (`disable server`); dynamic servers start there.
            let in_maintenance = admin.parse::<u32>().is_ok_and(|s| s & 0x01 != 0);
            servers.push(ActualServer {
                name: name.to_owned(),
                in_maintenance,
            });
        }
        Ok(servers)
    }

    async fn sync_port(
        &self,
        port: u16,
        route: &PortRoute,
        previous: Option<&PortRoute>,
    ) -> Result<(), HaproxyError> {
        let backend = backend_name(port);
        let actual = self.servers(port).await?;
        let wanted: BTreeMap<String, SocketAddr> = route
            .upstreams
            .iter()
            .map(|addr| (server_name(addr), *addr))
            .collect();
        let close = previous.is_some_and(|p| p.closes_on_switch_to(route));
        // Sources no longer admitted go before the servers change, new ones after: a switch
        // never lets one mapping's sources reach another mapping's target.
        let admitted = match self.gated.contains(&port) {
            true => Some(self.admitted(port).await?),
            false => None,
        };
        let wanted_sources = route.allowed_sources.clone().unwrap_or_else(everyone);
        if let Some(admitted) = &admitted {
            for (cidr, text) in admitted.iter().filter(|(c, _)| !wanted_sources.contains(c)) {
                tracing::debug!(port, source = %cidr, "source no longer admitted");
                self.expect(&format!("del acl #{port} {text}"), "").await?;
            }
        }
        // Add and enable what is wanted first, so a switch never leaves a gap.
        for (name, addr) in &wanted {
            let current = actual.iter().find(|s| &s.name == name);
            if current.is_none() {
                let mut add = format!("add server {backend}/{name} {addr}");
                if let (true, Some(interval)) = (route.health_checked, self.check_interval) {
                    let _ = write!(add, " check inter {}ms rise 1 fall 2", interval.as_millis());
                }
                self.expect(&add, "New server registered").await?;
                if route.health_checked && self.check_interval.is_some() {
                    self.expect(&format!("enable health {backend}/{name}"), "")
                        .await?;
                }
            }
            if current.is_none_or(|s| s.in_maintenance) {
                self.expect(&format!("enable server {backend}/{name}"), "")
                    .await?;
            }
        }
        for server in actual.iter().filter(|s| !wanted.contains_key(&s.name)) {
            let target = format!("{backend}/{}", server.name);
            if !server.in_maintenance {
                self.expect(&format!("disable server {target}"), "").await?;
            }
            if close {
                self.expect(&format!("shutdown sessions server {target}"), "")
                    .await?;
            }
            // Fails while connections remain; retried on the next sync (at most 10 s later).
            let answer = self.command(&format!("del server {target}")).await?;
            if !answer.contains("Server deleted") {
                tracing::debug!(server = %target, answer = %answer.trim(), "server kept until its connections end");
            }
        }
        if let Some(admitted) = &admitted {
            for cidr in wanted_sources
                .iter()
                .filter(|c| !admitted.iter().any(|(a, _)| a == *c))
            {
                self.expect(&format!("add acl #{port} {cidr}"), "").await?;
            }
        }
        Ok(())
    }

    /// The sources the ACL of `port` admits now, with the text HAProxy holds for each.
    async fn admitted(&self, port: u16) -> Result<Vec<(Cidr, String)>, HaproxyError> {
        let command = format!("show acl #{port}");
        let answer = self.command(&command).await?;
        if answer.contains("Unknown ACL") {
            return Err(HaproxyError::Refused {
                command,
                answer: format!(
                    "{}: the configuration has no source ACL for this port; regenerate it with \
                     `pod-proxier haproxy-config` and the same flags",
                    answer.trim()
                ),
            });
        }
        let mut admitted = Vec::new();
        for line in answer.lines() {
            let Some(text) = line.split_whitespace().nth(1) else {
                continue;
            };
            match text.parse::<Cidr>() {
                Ok(cidr) => admitted.push((cidr, text.to_owned())),
                // Not ours: never admitted, so it goes (matched by a CIDR nobody wants).
                Err(_) => admitted.push((Cidr::host([0, 0, 0, 0].into()), text.to_owned())),
            }
        }
        Ok(admitted)
    }

    /// Adds HAProxy's new denied connections (`dcon`) of the checked ports to the refusals.
    async fn count_refusals(&self) -> Result<(), HaproxyError> {
        if self.gated.is_empty() {
            return Ok(());
        }
        let answer = self.command("show stat").await?;
        let mut lines = answer.lines();
        let header: Vec<&str> = lines
            .next()
            .and_then(|h| h.strip_prefix("# "))
            .map(|h| h.split(',').collect())
            .unwrap_or_default();
        let (Some(px), Some(sv), Some(dcon)) = (
            header.iter().position(|h| *h == "pxname"),
            header.iter().position(|h| *h == "svname"),
            header.iter().position(|h| *h == "dcon"),
        ) else {
            return Ok(());
        };
        let mut denied = self.denied.lock().await;
        for line in lines {
            let fields: Vec<&str> = line.split(',').collect();
            if fields.get(sv) != Some(&"FRONTEND") {
                continue;
            }
            let port = fields
                .get(px)
                .and_then(|name| name.strip_prefix("entry_"))
                .and_then(|p| p.parse::<u16>().ok())
                .filter(|p| self.gated.contains(p));
            let (Some(port), Some(count)) =
                (port, fields.get(dcon).and_then(|c| c.parse::<u64>().ok()))
            else {
                continue;
            };
            let last = denied.insert(port, count).unwrap_or(0);
            // A restarted HAProxy counts from zero again.
            let new = if count >= last { count - last } else { count };
            if new > 0 {
                self.refused
                    .get_or_create(&EntryLabels { entry_port: port })
                    .inc_by(new);
            }
        }
        Ok(())
    }

    /// Makes HAProxy's servers match `desired`; ports not declared in the configuration fail.
    pub async fn sync(&self, desired: &DesiredPorts) -> Vec<PortError> {
        let mut applied = self.applied.lock().await;
        let mut errors = Vec::new();
        for port in self.declared.iter().copied() {
            let idle = PortRoute::idle();
            let route = desired.get(&port).unwrap_or(&idle);
            match self.sync_port(port, route, applied.get(&port)).await {
                Ok(()) => {
                    applied.insert(port, route.clone());
                }
                Err(err) => errors.push(PortError {
                    port,
                    message: netkit_runtime::error_chain(&err),
                }),
            }
        }
        for port in desired.keys().filter(|p| !self.declared.contains(p)) {
            errors.push(PortError {
                port: *port,
                message: "the HAProxy configuration declares no frontend for this port".to_owned(),
            });
        }
        if let Err(err) = self.count_refusals().await {
            tracing::debug!(error = %err, "reading HAProxy's denied connections");
        }
        errors
    }

    /// HAProxy keeps forwarding on its own; a restarted pod-proxier reconciles it.
    pub async fn shutdown(&self) {}
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::Parser as _;

    #[test]
    fn a_start_failure_says_each_cause_once() {
        let unreachable = HaproxyError::Unreachable {
            addr: "unix:///run/haproxy/admin.sock".to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such socket"),
        };
        let error =
            crate::app::StartError::DataPlane(crate::app::DataPlaneError::Haproxy(unreachable));
        assert_eq!(
            netkit_runtime::error_chain(&error),
            "data plane: driving HAProxy: cannot reach the HAProxy Runtime API at \
             unix:///run/haproxy/admin.sock (start HAProxy with the configuration printed by \
             `pod-proxier haproxy-config`, same flags): no such socket"
        );
    }

    fn v1_haproxy_settings(socket: &std::path::Path) -> Settings {
        crate::config::Cli::try_parse_from([
            "pod-proxier",
            "--plain-http",
            "--enable-v1",
            "--backend",
            "haproxy",
            "--api-addr",
            &format!("unix://{}", socket.display()),
        ])
        .unwrap()
        .validate(true)
        .unwrap()
    }

    /// A Runtime API at `socket` that knows the V1 entry port's backend (no servers).
    async fn fake_runtime_api(socket: std::path::PathBuf) {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut command = Vec::new();
            let mut byte = [0u8; 1];
            while stream.read(&mut byte).await.unwrap() == 1 && byte[0] != b'\n' {
                command.push(byte[0]);
            }
            let answer = if command.starts_with(b"show servers state") {
                "1\n# be_id be_name srv_id srv_name srv_admin_state\n\n"
            } else {
                "Name: HAProxy\n"
            };
            stream.write_all(answer.as_bytes()).await.unwrap();
        }
    }

    #[tokio::test]
    async fn connect_waits_for_a_runtime_api_that_comes_up_late() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("admin.sock");
        let settings = v1_haproxy_settings(&socket);
        // Without the wait, a socket not there yet is an error at once.
        assert!(matches!(
            HaproxyPlane::connect(&settings).await,
            Err(HaproxyError::Unreachable { .. })
        ));
        let late = tokio::spawn({
            let socket = socket.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(600)).await;
                fake_runtime_api(socket).await;
            }
        });
        let started = std::time::Instant::now();
        let plane = HaproxyPlane::connect_waiting(&settings, Duration::from_secs(10)).await;
        assert!(plane.is_ok(), "{:?}", plane.err());
        assert!(started.elapsed() >= Duration::from_millis(500));
        late.abort();
    }

    #[tokio::test]
    async fn connect_gives_up_after_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let settings = v1_haproxy_settings(&dir.path().join("admin.sock"));
        let started = std::time::Instant::now();
        let plane = HaproxyPlane::connect_waiting(&settings, Duration::from_millis(600)).await;
        assert!(
            matches!(plane, Err(HaproxyError::Unreachable { .. })),
            "{:?}",
            plane.err()
        );
        // It gave up instead of waiting forever (a bound no busy machine reaches).
        assert!(started.elapsed() < Duration::from_secs(60));
    }

    #[test]
    fn config_declares_every_entry_port_and_the_socket() {
        let settings = crate::config::Cli::try_parse_from([
            "pod-proxier",
            "--plain-http",
            "--enable-v1",
            "--enable-v2",
            "--backend",
            "haproxy",
            "--api-addr",
            "127.0.0.1:9999",
            "--port-range-start",
            "9000",
            "--port-range-end",
            "9002",
        ])
        .unwrap()
        .validate(true)
        .unwrap();
        let text = config_text(&settings);
        assert!(text.contains("stats socket ipv4@127.0.0.1:9999 level admin"));
        // Splices like the embedded data plane, with its pipe size and a pipe per connection.
        assert!(text.contains("option splice-auto"), "{text}");
        assert!(text.contains("tune.pipesize 1048576"), "{text}");
        assert!(text.contains("maxpipes 4096"), "{text}");
        for port in [8849, 9000, 9001, 9002] {
            assert!(text.contains(&format!("bind 0.0.0.0:{port}")), "{port}");
            assert!(text.contains(&format!("backend entry_{port}")), "{port}");
        }
        assert_eq!(
            server_name(&"10.1.2.3:8080".parse().unwrap()),
            "u_10_1_2_3_8080"
        );
    }
}
