//! Per-process CPU time from cgroup v2: each measured process (a relay, a sink, the generator of
//! the moment) is moved into a leaf cgroup of its own under `netkit-bench-<pid>`, and its CPU is
//! that leaf's `cpu.stat` `usage_usec`, the scheduler's nanosecond runtime of every thread that
//! ever ran there, instead of `/proc/<pid>/stat`'s 10 ms ticks.
//!
//! The cgroups are this run's to remove: a leaf kills what is left in it and is removed when
//! dropped, the run's directory last; SIGINT and SIGTERM remove them all before the process
//! exits; and a later run removes directories left by a run that was killed outright.
//! Where cgroup v2 is not mounted or not writable (a container, a non-root user) the clocks fall
//! back to `/proc/<pid>/stat` and say so.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use super::system;

/// The prefix of this run's directory under the cgroup v2 hierarchy.
const PREFIX: &str = "netkit-bench-";

/// Every directory this process created and has not removed yet, leaves after their parent, so
/// that a signal can remove them in reverse order.
static CREATED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Where CPU time is read from.
pub struct CpuMeter {
    run: Option<Arc<RunDir>>,
    /// Leaves created so far (unique names).
    leaves: Mutex<usize>,
    /// Why the cgroup clocks are not used, if they are not.
    fallback: Option<String>,
}

impl CpuMeter {
    /// Cgroup v2 clocks when the hierarchy is writable, `/proc/<pid>/stat` otherwise (with a
    /// message on stderr saying why).
    pub fn new() -> Self {
        match RunDir::create() {
            Ok(run) => {
                eprintln!(
                    "bench: CPU time from cgroup v2 cpu.stat under {}",
                    run.dir.display()
                );
                Self {
                    run: Some(Arc::new(run)),
                    leaves: Mutex::new(0),
                    fallback: None,
                }
            }
            Err(error) => {
                let reason = format!("{error:#}");
                eprintln!(
                    "bench: cgroup v2 is not usable ({reason}); CPU time falls back to /proc/<pid>/stat (10 ms ticks): figures are coarser"
                );
                Self {
                    run: None,
                    leaves: Mutex::new(0),
                    fallback: Some(reason),
                }
            }
        }
    }

    /// Whether the clocks are cgroup v2's.
    pub fn uses_cgroups(&self) -> bool {
        self.run.is_some()
    }

    /// CPU time below which a figure is not resolved: a few ticks of `/proc`, or a millisecond
    /// of cgroup time (microsecond counters, but scheduler accounting lags a little).
    pub fn min_cpu_seconds(&self) -> f64 {
        if self.uses_cgroups() {
            0.001
        } else {
            system::MIN_CPU_SECONDS
        }
    }

    /// One sentence for the report: where CPU time came from.
    pub fn describe(&self) -> String {
        match &self.fallback {
            None => "CPU time: each process in a cgroup v2 leaf of its own, its cpu.stat usage_usec (the scheduler's runtime of all its threads, microseconds) read at both ends of the window".to_owned(),
            Some(reason) => format!(
                "CPU time: utime+stime of /proc/<pid>/stat (10 ms ticks), because cgroup v2 was not usable: {reason}"
            ),
        }
    }

    /// A clock of `pid`'s CPU time: a new leaf cgroup that `pid` is moved into, or its
    /// `/proc/<pid>/stat`.
    pub fn clock(&self, name: &str, pid: u32) -> anyhow::Result<CpuClock> {
        let Some(leaf) = self.leaf(name)? else {
            return Ok(CpuClock::Process(pid));
        };
        leaf.add(pid)?;
        Ok(CpuClock::Cgroup(leaf))
    }

    /// An empty leaf (processes join it with [`Leaf::add`]), or `None` without cgroups.
    pub fn leaf(&self, name: &str) -> anyhow::Result<Option<Leaf>> {
        let Some(run) = &self.run else {
            return Ok(None);
        };
        let index = {
            let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
            *leaves += 1;
            *leaves
        };
        let slug: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let dir = run.dir.join(format!("{index}-{slug}"));
        make_dir(&dir)?;
        Ok(Some(Leaf {
            dir,
            _run: run.clone(),
        }))
    }
}

/// Where one process's CPU time is read.
pub enum CpuClock {
    Cgroup(Leaf),
    Process(u32),
}

impl CpuClock {
    /// CPU seconds so far.
    pub fn seconds(&self) -> anyhow::Result<f64> {
        match self {
            Self::Cgroup(leaf) => Ok(leaf.usage_usec()? as f64 / 1e6),
            Self::Process(pid) => system::cpu_seconds(*pid),
        }
    }
}

/// This run's directory; removed when the last leaf is gone.
struct RunDir {
    dir: PathBuf,
}

impl RunDir {
    fn create() -> anyhow::Result<Self> {
        let mounts =
            std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
        let mount = cgroup2_mount(&mounts).context("no cgroup2 file system is mounted")?;
        let own =
            std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
        // Under this process's own cgroup (the delegation-friendly place), or the mount's root.
        let parent = own_cgroup(&own)
            .map(|path| mount.join(path.trim_start_matches('/')))
            .filter(|dir| dir.is_dir())
            .unwrap_or_else(|| mount.clone());
        remove_stale(&parent);
        let dir = parent.join(format!("{PREFIX}{}", std::process::id()));
        make_dir(&dir)?;
        // Dropped (and removed) if it turns out unusable.
        let run = Self { dir };
        if !run.dir.join("cpu.stat").is_file() {
            bail!(
                "{} has no cpu.stat (kernel older than 4.15?)",
                run.dir.display()
            );
        }
        run.probe()?;
        install_signal_cleanup();
        Ok(run)
    }

    /// Moves a short-lived child into a leaf: a cgroup that may be created can still refuse
    /// members (a container's root with controllers enabled: "no internal processes").
    fn probe(&self) -> anyhow::Result<()> {
        let leaf = self.dir.join("probe");
        make_dir(&leaf)?;
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .context("starting sleep to probe the cgroup")?;
        let moved = std::fs::write(leaf.join("cgroup.procs"), child.id().to_string());
        let _ = child.kill();
        let _ = child.wait();
        remove_dir(&leaf);
        moved.with_context(|| format!("moving a process into {}", leaf.display()))
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        remove_dir(&self.dir);
    }
}

/// A leaf cgroup: its members' CPU time; on drop its members are killed and it is removed.
pub struct Leaf {
    dir: PathBuf,
    _run: Arc<RunDir>,
}

impl Leaf {
    /// Moves `pid` (all its threads) into this leaf.
    pub fn add(&self, pid: u32) -> anyhow::Result<()> {
        let procs = self.dir.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string())
            .with_context(|| format!("moving {pid} into {}", procs.display()))
    }

    /// `usage_usec` of this leaf's `cpu.stat`.
    pub fn usage_usec(&self) -> anyhow::Result<u64> {
        let path = self.dir.join("cpu.stat");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        usage_usec(&text).with_context(|| format!("no usage_usec in {}", path.display()))
    }
}

impl Drop for Leaf {
    fn drop(&mut self) {
        remove_dir(&self.dir);
    }
}

/// `usage_usec` of a `cpu.stat` file.
pub fn usage_usec(cpu_stat: &str) -> Option<u64> {
    cpu_stat.lines().find_map(|line| {
        let value = line.strip_prefix("usage_usec ")?;
        value.trim().parse().ok()
    })
}

/// The mount point of the cgroup v2 file system, from `/proc/self/mounts`.
fn cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, point, "cgroup2", ..] => Some(PathBuf::from(point.replace("\\040", " "))),
            _ => None,
        }
    })
}

/// This process's cgroup v2 path (`0::<path>` of `/proc/self/cgroup`).
fn own_cgroup(cgroups: &str) -> Option<&str> {
    cgroups.lines().find_map(|line| line.strip_prefix("0::"))
}

fn make_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
    CREATED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(dir.to_owned());
    Ok(())
}

/// Kills what is left in `dir` (and below), removes it and forgets it. Best effort: errors are
/// printed, never returned, as this runs on drop and on signals.
fn remove_dir(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_dir(&entry.path());
            }
        }
    }
    kill_members(dir);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => break,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => break,
            // EBUSY while killed members are still exiting.
            Err(error) if Instant::now() > deadline => {
                eprintln!("bench: could not remove {}: {error}", dir.display());
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    CREATED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|created| created != dir);
}

/// SIGKILL to every process in `dir`: `cgroup.kill` (Linux 5.14), else one by one.
fn kill_members(dir: &Path) {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    if procs.trim().is_empty() || std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in procs
        .lines()
        .filter_map(|line| line.trim().parse::<i32>().ok())
    {
        if let Some(pid) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// Removes the directories of earlier runs whose process is gone (killed outright, SIGKILL).
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        if !Path::new("/proc").join(pid).exists() {
            eprintln!(
                "bench: removing {} left by an earlier run",
                entry.path().display()
            );
            remove_dir(&entry.path());
        }
    }
}

/// On SIGINT or SIGTERM: kill every measured process, remove every cgroup, exit 130.
fn install_signal_cleanup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(error) => {
                eprintln!("bench: no signal handler ({error}): Ctrl-C may leave cgroups behind");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("bench-signals".to_owned())
            .spawn(move || {
                runtime.block_on(async {
                    use tokio::signal::unix::{SignalKind, signal};
                    let (Ok(mut interrupt), Ok(mut terminate)) = (
                        signal(SignalKind::interrupt()),
                        signal(SignalKind::terminate()),
                    ) else {
                        eprintln!("bench: no signal handler: Ctrl-C may leave cgroups behind");
                        return;
                    };
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                    eprintln!(
                        "bench: interrupted: stopping the measured processes, removing the cgroups"
                    );
                    let created: Vec<PathBuf> =
                        CREATED.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    for dir in created.iter().rev() {
                        remove_dir(dir);
                    }
                    std::process::exit(130);
                });
            });
        if let Err(error) = spawned {
            eprintln!("bench: no signal handler ({error}): Ctrl-C may leave cgroups behind");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_usec_is_read_from_cpu_stat() {
        let text =
            "usage_usec 39288211035\nuser_usec 36234026025\nsystem_usec 3054185010\nnice_usec 0\n";
        assert_eq!(usage_usec(text), Some(39_288_211_035));
        assert_eq!(usage_usec("user_usec 5\n"), None);
        assert_eq!(usage_usec("usage_usec x\n"), None);
    }

    /// Where cgroup v2 is writable (root here): a leaf counts its member's CPU time, is removed
    /// when dropped (killing what is left in it), and the run's directory goes with the meter.
    #[test]
    fn leaves_count_cpu_and_are_removed() -> anyhow::Result<()> {
        let meter = CpuMeter::new();
        let Some(run) = meter.run.clone() else {
            eprintln!("cgroup v2 not writable here: nothing to check");
            return Ok(());
        };
        let mut busy = std::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 30",
            ])
            .spawn()?;
        let clock = meter.clock("busy shell", busy.id())?;
        let CpuClock::Cgroup(leaf) = &clock else {
            anyhow::bail!("no cgroup clock")
        };
        let dir = leaf.dir.clone();
        let deadline = Instant::now() + Duration::from_secs(30);
        while clock.seconds()? < 0.01 {
            anyhow::ensure!(Instant::now() < deadline, "no CPU time counted");
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(clock);
        anyhow::ensure!(!dir.exists(), "{} was not removed", dir.display());
        // The leaf killed the shell still sleeping in it.
        let status = busy.wait()?;
        anyhow::ensure!(!status.success(), "the shell was not killed: {status}");
        let run_dir = run.dir.clone();
        drop(run);
        drop(meter);
        anyhow::ensure!(!run_dir.exists(), "{} was not removed", run_dir.display());
        Ok(())
    }

    #[test]
    fn the_cgroup2_mount_and_own_cgroup_are_found() {
        let mounts = "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        assert_eq!(
            cgroup2_mount(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount("proc /proc proc rw 0 0\n"), None);
        assert_eq!(
            own_cgroup("4:memory:/x\n0::/user.slice/session-1.scope\n"),
            Some("/user.slice/session-1.scope")
        );
    }
}
