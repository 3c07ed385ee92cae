//! What the benches need from the machine: CPU pinning, descriptor limits, `/proc` figures, child
//! processes that are always stopped, and release builds of the binaries under test.

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

/// The CPU of the load generator and sink.
pub const GENERATOR_CPU: usize = 0;
/// The CPU of the relay under test.
pub const RELAY_CPU: usize = 1;

/// Whether this machine lets us put the generator and the relay on different CPUs.
pub fn can_pin() -> bool {
    sched_getaffinity(None)
        .map(|set| set.is_set(GENERATOR_CPU) && set.is_set(RELAY_CPU))
        .unwrap_or(false)
}

/// A one-line description of the pinning in force, for reports.
pub fn pinning_note() -> String {
    if can_pin() {
        format!("generator and sink on CPU {GENERATOR_CPU}, relay on CPU {RELAY_CPU}")
    } else {
        "not pinned: fewer than 2 usable CPUs".to_owned()
    }
}

/// Pins the calling thread (and the threads it creates from now on) to one CPU.
pub fn pin_current_thread(cpu: usize) -> anyhow::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).with_context(|| format!("pinning to CPU {cpu}"))
}

/// Runs `body` with the calling thread pinned to `cpu` (if pinning is possible), then restores the
/// previous affinity so later work (e.g. a control plane) is not confined.
pub fn with_cpu<T>(cpu: usize, body: impl FnOnce() -> T) -> anyhow::Result<T> {
    if !can_pin() {
        return Ok(body());
    }
    let previous = sched_getaffinity(None).context("reading the CPU affinity")?;
    pin_current_thread(cpu)?;
    let result = body();
    sched_setaffinity(None, &previous).context("restoring the CPU affinity")?;
    Ok(result)
}

/// A command prefixed with `taskset -c <cpu>` when pinning is possible.
pub fn pinned_command(cpu: usize, program: &Path) -> Command {
    if can_pin() && which("taskset").is_some() {
        let mut cmd = Command::new("taskset");
        cmd.arg("-c").arg(cpu.to_string()).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

/// Raises the open-file limit as far as the kernel allows: 10 000 relayed connections need 20 000
/// descriptors in the generator and more in the relay (children inherit the limit).
pub fn raise_fd_limit() -> u64 {
    const WANTED: u64 = 262_144;
    let current = getrlimit(Resource::Nofile);
    let hard = current.maximum.unwrap_or(WANTED);
    // Root may raise the hard limit too; everyone else can at least reach the hard limit.
    for limit in [WANTED.max(hard), hard] {
        let wanted = Rlimit {
            current: Some(limit),
            maximum: Some(limit),
        };
        if setrlimit(Resource::Nofile, wanted).is_ok() {
            return limit;
        }
    }
    current.current.unwrap_or(0)
}

/// The 1, 5 and 15 minute load averages and the number of runnable tasks, as `/proc/loadavg` says.
pub fn loadavg() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let fields: Vec<&str> = text.split_whitespace().take(4).collect();
    match fields.as_slice() {
        [one, five, fifteen, tasks] => {
            format!("load {one} {five} {fifteen} (runnable/total tasks {tasks})")
        }
        _ => "load average unavailable".to_owned(),
    }
}

/// CPU seconds (user + system, all threads) a process has used, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields we want follow its closing parenthesis.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("malformed /proc/<pid>/stat")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime) of proc(5); index 0 here is field 3 (state).
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .context("short /proc/<pid>/stat")?
            .parse()
            .context("parsing /proc/<pid>/stat")
    };
    let per_second = rustix::param::clock_ticks_per_second() as f64;
    Ok((ticks(11)? + ticks(12)?) as f64 / per_second)
}

/// TCP counters of this network namespace (`Tcp:` of `/proc/net/snmp`), which the relays, the
/// generator and the sink share on loopback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpCounters {
    /// Connections this namespace opened (`connect`s that sent a SYN).
    pub active_opens: u64,
    /// Segments received and sent: on loopback every segment is counted once each way.
    pub in_segs: u64,
    pub out_segs: u64,
    pub retrans_segs: u64,
}

impl TcpCounters {
    /// `self - earlier`, counter by counter.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            active_opens: self.active_opens.saturating_sub(earlier.active_opens),
            in_segs: self.in_segs.saturating_sub(earlier.in_segs),
            out_segs: self.out_segs.saturating_sub(earlier.out_segs),
            retrans_segs: self.retrans_segs.saturating_sub(earlier.retrans_segs),
        }
    }
}

/// Reads [`TcpCounters`] of this process's network namespace.
pub fn tcp_counters() -> anyhow::Result<TcpCounters> {
    let text = std::fs::read_to_string("/proc/net/snmp").context("reading /proc/net/snmp")?;
    parse_tcp_counters(&text).context("no Tcp counters in /proc/net/snmp")
}

/// The `Tcp:` header line and value line of `/proc/net/snmp`, by name.
fn parse_tcp_counters(snmp: &str) -> Option<TcpCounters> {
    let mut lines = snmp.lines().filter(|line| line.starts_with("Tcp:"));
    let names: Vec<&str> = lines.next()?.split_whitespace().skip(1).collect();
    let values: Vec<&str> = lines.next()?.split_whitespace().skip(1).collect();
    let get = |name: &str| -> Option<u64> {
        let index = names.iter().position(|n| *n == name)?;
        values.get(index)?.parse().ok()
    };
    Some(TcpCounters {
        active_opens: get("ActiveOpens")?,
        in_segs: get("InSegs")?,
        out_segs: get("OutSegs")?,
        retrans_segs: get("RetransSegs")?,
    })
}

/// Voluntary and involuntary context switches of all of a process's threads (summed over
/// `/proc/<pid>/task/*/status`; `/proc/<pid>/status` has the main thread's only). A voluntary
/// switch is a thread going to sleep, mostly in `epoll_wait` for an event loop: each is a
/// wake-up later. Threads that have exited are not counted.
pub fn context_switches(pid: u32) -> anyhow::Result<(u64, u64)> {
    let dir = format!("/proc/{pid}/task");
    let mut total = (0, 0);
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let status = entry?.path().join("status");
        // A thread may exit between the listing and the read.
        if let Ok(text) = std::fs::read_to_string(&status) {
            let (voluntary, involuntary) = parse_context_switches(&text);
            total.0 += voluntary;
            total.1 += involuntary;
        }
    }
    Ok(total)
}

fn parse_context_switches(status: &str) -> (u64, u64) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        field("voluntary_ctxt_switches:"),
        field("nonvoluntary_ctxt_switches:"),
    )
}

/// CPU time below this is a handful of `/proc` clock ticks: too coarse to report.
pub const MIN_CPU_SECONDS: f64 = 0.05;

/// Resident memory of a process in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let file = File::open(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    for line in BufReader::new(file).lines() {
        let line = line?;
        if let Some(value) = line.strip_prefix("VmRSS:") {
            let kib = value.trim().trim_end_matches("kB").trim();
            return kib.parse().context("parsing VmRSS");
        }
    }
    bail!("no VmRSS in /proc/{pid}/status")
}

/// Open file descriptors of a process (`/proc/<pid>/fd`).
pub fn fd_count(pid: u32) -> anyhow::Result<usize> {
    let dir = format!("/proc/{pid}/fd");
    Ok(std::fs::read_dir(&dir)
        .with_context(|| format!("reading {dir}"))?
        .count())
}

/// A free TCP port on 127.0.0.1, from below the kernel's ephemeral range (see
/// [`crate::fixtures::free_port`]).
pub fn free_port() -> anyhow::Result<u16> {
    crate::fixtures::free_port().context("finding a free port")
}

/// A child process whose output goes to a log file; killed and reaped on drop, so every exit path
/// (errors, panics) stops it.
pub struct Service {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Service {
    /// Starts `cmd` with stdin closed and stdout/stderr in `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> anyhow::Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `addr` accepts connections, failing early if the process exits.
    pub fn wait_listening(&mut self, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited with {status}:\n{}", self.name, self.log_tail());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not listen on {addr} within {timeout:?}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asks the process to stop (SIGTERM) and waits up to `grace` for it to exit, so it can
    /// finish what it writes at exit; kills it after that.
    pub fn terminate(&mut self, grace: Duration) -> anyhow::Result<()> {
        let pid = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .context("the process id")?;
        if self.child.try_wait()?.is_none() {
            rustix::process::kill_process(pid, rustix::process::Signal::TERM)
                .with_context(|| format!("sending SIGTERM to {}", self.name))?;
        }
        let deadline = Instant::now() + grace;
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.child.kill()?;
                self.child.wait()?;
                bail!("{} did not exit within {grace:?} of SIGTERM", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Fails with the log tail if the process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited with {status}:\n{}", self.name, self.log_tail());
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // Errors mean it is already gone, which is what we want.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The path of `program` on `$PATH`, if any.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Builds one release binary with cargo and returns its path (read from cargo's JSON messages,
/// so any target directory works).
pub fn cargo_build_release(target_args: &[&str]) -> anyhow::Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("building (release): cargo build {}", target_args.join(" "));
    let output = Command::new(cargo)
        .current_dir(crate::workspace::root())
        .args([
            "build",
            "--release",
            "--message-format=json-render-diagnostics",
        ])
        .args(target_args)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo build")?;
    if !output.status.success() {
        bail!("cargo build {} failed", target_args.join(" "));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg["reason"] == "compiler-artifact")
        .filter_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .next_back()
        .with_context(|| {
            format!(
                "cargo build {} produced no executable",
                target_args.join(" ")
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_counters_are_read_by_name() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\nTcp: 1 200 120000 -1 452159 440704 7028 38270 0 16596127 17209698 107927 0 43272 0\nUdp: InDatagrams\nUdp: 5\n";
        let counters = parse_tcp_counters(snmp);
        assert_eq!(
            counters,
            Some(TcpCounters {
                active_opens: 452_159,
                in_segs: 16_596_127,
                out_segs: 17_209_698,
                retrans_segs: 107_927,
            })
        );
        let later = TcpCounters {
            out_segs: 17_209_708,
            ..counters.unwrap_or_default()
        };
        assert_eq!(later.since(counters.unwrap_or_default()).out_segs, 10);
        assert_eq!(parse_tcp_counters("Udp: InDatagrams\nUdp: 5\n"), None);
    }

    #[test]
    fn context_switches_are_read_from_status() {
        let status =
            "Name:\ttcp_relay\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(parse_context_switches(status), (120, 7));
        let own = context_switches(std::process::id());
        assert!(own.is_ok(), "{own:?}");
    }
}
