//! `bench proxy`'s contenders: how each relay (proxy-core's `tcp_relay`, HAProxy) is started
//! towards the sinks, its configuration as the summary shows it, and HAProxy's installation.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use super::{
    BASELINE_ENV, DIRECT, HAPROXY_AUTO, HAPROXY_AUTO_2T, HAPROXY_FORCED, HAPROXY_FORCED_2T,
    PIPE_SIZE, PROXY_CORE, PROXY_CORE_2L, PROXY_CORE_2T, PROXY_CORE_BASELINE,
    PROXY_CORE_EVENT_LOOP, URING_PROBE, Workload,
};
use crate::bench::Settings;
use crate::bench::cgroup::{CpuClock, CpuMeter};
use crate::bench::procs::{self, Measured, SinkProcess, Watched, WindowCpu, Work};
use crate::bench::system::{self, GENERATOR_CPU, RELAY_CPU, Service};

/// Descriptors a relay may need per relayed connection: two sockets, and for HAProxy the
/// pipes (`maxpipes` = `maxconn`, two descriptors each). proxy-core's pipes come from a small
/// pool and none is held by an idle connection (see the "descriptors" figure).
const FDS_PER_CONNECTION: u64 = 4;
/// Descriptors kept free for everything else (listeners, epoll, logs, the runtime).
const FD_MARGIN: u64 = 256;

/// A relay (or none, for direct) that the generator sends its workloads through, and the sink
/// process behind it.
pub(super) struct Contender {
    pub(super) name: &'static str,
    pub(super) addr: SocketAddr,
    process: Option<Service>,
    /// The relay's CPU clock; declared after `process`, so the process is stopped before its
    /// cgroup is removed.
    clock: Option<CpuClock>,
    sink_clock: Arc<CpuClock>,
    meter: Arc<CpuMeter>,
}

impl Contender {
    /// What a generator's window measures through this contender.
    pub(super) fn watched(&self) -> Watched<'_> {
        Watched {
            meter: &self.meter,
            relay: self.pid().zip(self.clock.as_ref()),
            sink: &self.sink_clock,
        }
    }

    pub(super) fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Service::pid)
    }

    /// CPU time below which a window's figure is too coarse to report.
    pub(super) fn min_cpu_seconds(&self) -> f64 {
        self.meter.min_cpu_seconds()
    }

    pub(super) fn check_running(&mut self) -> anyhow::Result<()> {
        self.process.as_mut().map_or(Ok(()), Service::check_running)
    }

    /// One generator job through this contender, with every party's CPU in its window.
    pub(super) fn run(
        &mut self,
        work: Work,
        workload: &Workload,
    ) -> anyhow::Result<(Measured, WindowCpu)> {
        self.run_with(work, workload, &mut |_| Ok(()))
    }

    /// [`Self::run`] with `hook` called as the window opens (`true`) and closes.
    pub(super) fn run_with(
        &mut self,
        work: Work,
        workload: &Workload,
        hook: &mut dyn FnMut(bool) -> anyhow::Result<()>,
    ) -> anyhow::Result<(Measured, WindowCpu)> {
        let result = procs::run_generator(
            self.addr,
            Some(GENERATOR_CPU),
            work,
            (workload.warmup, workload.measure),
            &self.watched(),
            hook,
        )
        .with_context(|| format!("{work:?} through {}", self.name))?;
        self.check_running()?;
        Ok(result)
    }
}

/// The two sinks: one on the generator CPU behind the relays, one on the relay CPU for direct
/// (a baseline with a core on each end).
pub(super) struct Sinks {
    pub(super) relayed: SinkProcess,
    pub(super) direct: SinkProcess,
    relayed_clock: Arc<CpuClock>,
    direct_clock: Arc<CpuClock>,
}

impl Sinks {
    pub(super) fn start(meter: &CpuMeter, log_dir: &Path) -> anyhow::Result<Self> {
        let relayed = SinkProcess::start(Some(GENERATOR_CPU), log_dir, "sink-relayed")?;
        let direct = SinkProcess::start(Some(RELAY_CPU), log_dir, "sink-direct")?;
        Ok(Self {
            relayed_clock: Arc::new(relayed.clock(meter, "sink-relayed")?),
            direct_clock: Arc::new(direct.clock(meter, "sink-direct")?),
            relayed,
            direct,
        })
    }
}

/// How to start each relay.
pub(super) struct Relays {
    /// Whether `tcp_relay` has `--data-path` (tokio tasks or proxy-core's event loop): then
    /// [`PROXY_CORE`] names the tokio path and [`PROXY_CORE_EVENT_LOOP`] is measured too.
    pub(super) data_path: bool,
    /// Whether io_uring works here: then the connection phases measure [`URING_PROBE`] too.
    pub(super) probe: bool,
    pub(super) tcp_relay: PathBuf,
    pub(super) baseline: Option<PathBuf>,
    pub(super) haproxy: Option<PathBuf>,
    pub(super) dir: PathBuf,
    pub(super) fd_limit: u64,
    pub(super) meter: Arc<CpuMeter>,
}

/// How a contender relays.
#[derive(Clone, Copy)]
enum Kind {
    Direct,
    ProxyCore {
        threads: usize,
        baseline: bool,
        listener_per_thread: bool,
        event_loop: bool,
    },
    Haproxy {
        threads: usize,
        forced: bool,
    },
    UringProbe,
}

fn kind(name: &str) -> Kind {
    match name {
        PROXY_CORE_EVENT_LOOP => Kind::ProxyCore {
            threads: 1,
            baseline: false,
            listener_per_thread: false,
            event_loop: true,
        },
        PROXY_CORE => Kind::ProxyCore {
            threads: 1,
            baseline: false,
            listener_per_thread: false,
            event_loop: false,
        },
        PROXY_CORE_BASELINE => Kind::ProxyCore {
            threads: 1,
            baseline: true,
            listener_per_thread: false,
            event_loop: false,
        },
        PROXY_CORE_2T => Kind::ProxyCore {
            threads: 2,
            baseline: false,
            listener_per_thread: false,
            event_loop: false,
        },
        PROXY_CORE_2L => Kind::ProxyCore {
            threads: 2,
            baseline: false,
            listener_per_thread: true,
            event_loop: false,
        },
        HAPROXY_AUTO => Kind::Haproxy {
            threads: 1,
            forced: false,
        },
        HAPROXY_FORCED => Kind::Haproxy {
            threads: 1,
            forced: true,
        },
        HAPROXY_AUTO_2T => Kind::Haproxy {
            threads: 2,
            forced: false,
        },
        HAPROXY_FORCED_2T => Kind::Haproxy {
            threads: 2,
            forced: true,
        },
        URING_PROBE => Kind::UringProbe,
        _ => Kind::Direct,
    }
}

impl Relays {
    /// The contenders of the one-thread phases.
    pub(super) fn names(&self) -> Vec<&'static str> {
        let mut names = vec![DIRECT, PROXY_CORE];
        if self.data_path {
            names.push(PROXY_CORE_EVENT_LOOP);
        }
        if self.baseline.is_some() {
            names.push(PROXY_CORE_BASELINE);
        }
        if self.haproxy.is_some() {
            names.extend([HAPROXY_AUTO, HAPROXY_FORCED]);
        }
        names
    }

    /// The contenders of the scaling phase.
    pub(super) fn scaling_names(&self) -> Vec<&'static str> {
        let mut names = vec![DIRECT, PROXY_CORE_2T, PROXY_CORE_2L];
        if self.haproxy.is_some() {
            names.extend([HAPROXY_AUTO_2T, HAPROXY_FORCED_2T]);
        }
        names
    }

    /// A contender towards the sink processes.
    pub(super) fn start(&self, name: &'static str, sinks: &Sinks) -> anyhow::Result<Contender> {
        if matches!(kind(name), Kind::Direct) {
            return Ok(Contender {
                name,
                addr: sinks.direct.addr,
                process: None,
                clock: None,
                sink_clock: sinks.direct_clock.clone(),
                meter: self.meter.clone(),
            });
        }
        let (addr, process) = self.start_with(name, sinks.relayed.addr, false)?;
        let clock = process
            .as_ref()
            .map(|process| self.meter.clock(name, process.pid()))
            .transpose()?;
        Ok(Contender {
            name,
            addr,
            process,
            clock,
            sink_clock: sinks.relayed_clock.clone(),
            meter: self.meter.clone(),
        })
    }

    /// `idle_only`: HAProxy is configured for idle connections only (`maxconn` up to the
    /// open-file limit at two descriptors each, `maxpipes 0`), as no byte will move.
    pub(super) fn start_with(
        &self,
        name: &'static str,
        upstream: SocketAddr,
        idle_only: bool,
    ) -> anyhow::Result<(SocketAddr, Option<Service>)> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?));
        let mut service = match kind(name) {
            Kind::Direct => return Ok((upstream, None)),
            Kind::ProxyCore {
                threads,
                baseline,
                listener_per_thread,
                event_loop,
            } => {
                let program = match &self.baseline {
                    Some(program) if baseline => program,
                    _ => &self.tcp_relay,
                };
                // Without the flag (an older build, the baseline) the default path runs.
                let data_path = (self.data_path && !baseline).then_some(if event_loop {
                    "event-loop"
                } else {
                    "tokio"
                });
                self.start_proxy_core(
                    program,
                    addr,
                    upstream,
                    (threads, listener_per_thread),
                    data_path,
                )?
            }
            Kind::Haproxy { threads, forced } => {
                self.start_haproxy(addr, upstream, threads, forced, idle_only)?
            }
            Kind::UringProbe => {
                let this = std::env::current_exe().context("finding this executable")?;
                let mut cmd = system::pinned_command(RELAY_CPU, &this);
                cmd.args(std::env::args_os().skip(1))
                    .env(procs::ROLE_ENV, "uring-probe")
                    .env(procs::PROBE_ENV, format!("{addr} {upstream}"));
                Service::spawn("uring-probe", cmd, &self.dir)?
            }
        };
        service.wait_listening(addr, Duration::from_secs(10))?;
        Ok((addr, Some(service)))
    }

    /// One thread: pinned to the relay CPU. Two threads: unpinned (both CPUs, shared with the
    /// generator).
    fn command(&self, threads: usize, program: &Path) -> Command {
        if threads == 1 {
            system::pinned_command(RELAY_CPU, program)
        } else {
            Command::new(program)
        }
    }

    fn start_proxy_core(
        &self,
        program: &Path,
        listen: SocketAddr,
        upstream: SocketAddr,
        (threads, listener_per_thread): (usize, bool),
        data_path: Option<&str>,
    ) -> anyhow::Result<Service> {
        let mut cmd = self.command(threads, program);
        if listener_per_thread {
            cmd.arg("--listener-per-thread");
        }
        if let Some(data_path) = data_path {
            cmd.arg("--data-path").arg(data_path);
        }
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--upstream")
            .arg(upstream.to_string())
            .arg("--drain-secs")
            .arg("0")
            .arg("--pipe-size")
            .arg(PIPE_SIZE.to_string())
            // HAProxy runs without `option tcpka`: the same work per connection.
            .arg("--no-keepalive")
            // Threads like HAProxy's nbthread: 1 is one event loop (tokio's current-thread
            // runtime), as `nbthread 1` is; tokio's default would be a worker per CPU.
            .arg("--threads")
            .arg(threads.to_string())
            .env("RUST_LOG", "warn");
        Service::spawn("tcp_relay", cmd, &self.dir)
    }

    fn start_haproxy(
        &self,
        listen: SocketAddr,
        upstream: SocketAddr,
        threads: usize,
        forced: bool,
        idle_only: bool,
    ) -> anyhow::Result<Service> {
        let haproxy = self
            .haproxy
            .as_deref()
            .context("haproxy is not installed")?;
        let config = self.dir.join(format!("haproxy-{}.cfg", listen.port()));
        // Two sockets per connection, and up to one pipe (two descriptors) per connection.
        let usable = self.fd_limit.saturating_sub(FD_MARGIN);
        let (maxconn, maxpipes) = if idle_only {
            (idle_maxconn(self.fd_limit), 0)
        } else {
            let maxconn = usable / FDS_PER_CONNECTION;
            (maxconn, maxconn)
        };
        std::fs::write(
            &config,
            haproxy_config(listen, upstream, maxconn, maxpipes, threads, forced),
        )
        .with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = self.command(threads, haproxy);
        // -db: foreground, no daemon, no master process: one pid to measure.
        cmd.arg("-db").arg("-f").arg(&config);
        Service::spawn("haproxy", cmd, &self.dir)
    }
}

/// Whether this `tcp_relay` build chooses its data path (`--data-path tokio|event-loop` in its
/// `--help`).
pub(super) fn has_data_path_flag(tcp_relay: &Path) -> bool {
    let found = Command::new(tcp_relay)
        .arg("--help")
        .output()
        .is_ok_and(|output| {
            let help = String::from_utf8_lossy(&output.stdout);
            help.contains("--data-path") && help.contains("event-loop")
        });
    // For [`contenders`], which describes the run without the binary at hand.
    let _ = DATA_PATH_FLAG.set(found);
    found
}

/// Whether this run's `tcp_relay` has `--data-path` (set by [`has_data_path_flag`]).
static DATA_PATH_FLAG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// The most idle connections every contender can hold within `fd_limit`: HAProxy refuses to
/// start unless the limit covers about 2.5 descriptors per `maxconn` (two sockets and a share for
/// idle server connections), the relay and the generator need two each.
pub(super) fn idle_maxconn(fd_limit: u64) -> u64 {
    fd_limit.saturating_sub(FD_MARGIN) * 2 / 5
}

/// HAProxy's config: proxy-core's pipe size (`tune.pipesize`), a pipe for every connection
/// (`maxpipes` = `maxconn`, which must fit the open-file limit: HAProxy refuses to start when
/// it cannot raise it to about 2 x maxconn + 2 x maxpipes), and either `splice-auto` or forced
/// splicing both ways.
fn haproxy_config(
    listen: SocketAddr,
    upstream: SocketAddr,
    maxconn: u64,
    maxpipes: u64,
    threads: usize,
    forced: bool,
) -> String {
    let splice = if forced {
        "option splice-request\n    option splice-response"
    } else {
        "option splice-auto"
    };
    format!(
        "global
    nbthread {threads}
    maxconn {maxconn}
    maxpipes {maxpipes}
    tune.pipesize {PIPE_SIZE}

defaults
    mode tcp
    {splice}
    timeout connect 5s
    timeout client 10m
    timeout server 10m

frontend bench
    bind {listen}
    default_backend sink

backend sink
    server sink {upstream}
"
    )
}

/// Each contender's configuration, as the summary shows it.
pub fn contenders(_settings: &Settings) -> Vec<(&'static str, String)> {
    let haproxy = |splice: &str, threads: &str| {
        format!(
            "HAProxy mode tcp, {threads}, {splice}, tune.pipesize {PIPE_SIZE} (proxy-core's pipe), maxpipes = maxconn (a pipe per connection; the idle-memory phase uses maxpipes 0), no option tcpka"
        )
    };
    vec![
        (
            DIRECT,
            format!(
                "no relay: the generator process (CPU {GENERATOR_CPU}) to a sink process of its own on CPU {RELAY_CPU} (the relays' CPU, idle in this contender): one loopback hop, a core on each end"
            ),
        ),
        (
            PROXY_CORE,
            format!(
                "examples/tcp_relay, --threads 1 (current-thread runtime: one event loop, as nbthread 1) pinned to CPU {RELAY_CPU}, {}automatic copy mode, {PIPE_SIZE}-byte pipes, no TCP keepalive (as HAProxy), the binaries' Prometheus observer",
                if DATA_PATH_FLAG.get() == Some(&true) {
                    "--data-path tokio (a tokio task per connection), "
                } else {
                    ""
                }
            ),
        ),
        (
            PROXY_CORE_EVENT_LOOP,
            "examples/tcp_relay --data-path event-loop: proxy-core's connection state machines on its own edge-triggered epoll loop, otherwise as proxy-core (which then runs --data-path tokio); present only when tcp_relay has the flag".to_owned(),
        ),
        (
            URING_PROBE,
            format!(
                "not a product path: xtask's own io_uring relay (bench/uring_probe.rs) pinned to CPU {RELAY_CPU}, one ring: multishot accept, connect, recv and send through a 16 KiB buffer per direction, shutdown(2) for the half-close, close by the ring; no metrics, limits, timers or splice. Connection phases only, where io_uring works: what is left of a connection's CPU without user-space work and epoll"
            ),
        ),
        (
            PROXY_CORE_BASELINE,
            format!(
                "as proxy-core, but the tcp_relay binary named by {BASELINE_ENV} ({}); present only when that is set",
                std::env::var(BASELINE_ENV).unwrap_or_default()
            ),
        ),
        (
            HAPROXY_AUTO,
            haproxy(
                "option splice-auto",
                &format!("nbthread 1 pinned to CPU {RELAY_CPU}"),
            ),
        ),
        (
            HAPROXY_FORCED,
            haproxy(
                "option splice-request + option splice-response",
                &format!("nbthread 1 pinned to CPU {RELAY_CPU}"),
            ),
        ),
        (
            PROXY_CORE_2T,
            "examples/tcp_relay, --threads 2 (multi-thread runtime, 2 workers sharing one listener), unpinned, otherwise as proxy-core".to_owned(),
        ),
        (
            PROXY_CORE_2L,
            "examples/tcp_relay, --threads 2 --listener-per-thread (2 threads, each its own current-thread runtime and listening socket, SO_REUSEPORT: a connection stays on the thread that accepted it), unpinned, otherwise as proxy-core".to_owned(),
        ),
        (
            HAPROXY_AUTO_2T,
            haproxy("option splice-auto", "nbthread 2, unpinned"),
        ),
        (
            HAPROXY_FORCED_2T,
            haproxy(
                "option splice-request + option splice-response",
                "nbthread 2, unpinned",
            ),
        ),
    ]
}

/// Finds HAProxy, installing Debian's package if it is missing; `None` if that is impossible.
pub(super) fn ensure_haproxy(notes: &mut Vec<String>) -> Option<PathBuf> {
    if let Some(path) = system::which("haproxy") {
        return Some(path);
    }
    eprintln!("haproxy is missing: apt-get install -y haproxy");
    let installed = Command::new("apt-get")
        .args(["install", "-y", "haproxy"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success());
    let found = system::which("haproxy").filter(|_| installed);
    if found.is_none() {
        notes.push("HAProxy could not be installed: its column is not measured.".to_owned());
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_config_names_both_addresses() {
        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 1000));
        let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, 2000));
        let config = haproxy_config(listen, upstream, 1000, 1000, 1, false);
        assert!(config.contains("bind 127.0.0.1:1000"));
        assert!(config.contains("server sink 127.0.0.1:2000"));
        assert!(config.contains("option splice-auto"));
        assert!(config.contains("maxconn 1000"));
        assert!(config.contains("maxpipes 1000"));
        assert!(config.contains(&format!("tune.pipesize {PIPE_SIZE}")));
    }

    #[test]
    fn forced_splice_splices_both_ways() {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 1000));
        let config = haproxy_config(addr, addr, 1000, 1000, 2, true);
        assert!(config.contains("option splice-request\n    option splice-response\n"));
        assert!(!config.contains("splice-auto"));
        assert!(config.contains("nbthread 2"));
    }
}
