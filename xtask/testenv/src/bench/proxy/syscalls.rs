//! `epoll_wait` calls of a relay, counted by `perf stat` on the syscall tracepoints in one extra
//! window per contender and phase, after the measured rounds: counting every call costs the
//! relay a little per call, so these windows stay out of the CPU figures.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::Context as _;

use super::Workload;
use super::relays::Contender;
use crate::bench::procs::{Measured, Work};

/// The tracepoints of the calls an event loop waits in (x86-64 has all three; arm64 has no
/// plain `epoll_wait`, its libc calls `epoll_pwait`).
const EVENTS: [&str; 3] = [
    "syscalls:sys_enter_epoll_wait",
    "syscalls:sys_enter_epoll_pwait",
    "syscalls:sys_enter_epoll_pwait2",
];

/// `perf stat` with the tracepoints this kernel has.
pub(super) struct EpollCounter {
    events: Vec<&'static str>,
}

impl EpollCounter {
    /// `None` (with a message) when perf or the tracepoints are not usable here.
    pub(super) fn probe() -> Option<Self> {
        let works = |event: &str| {
            Command::new("perf")
                .args(["stat", "-x,", "-e", event, "--", "true"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        };
        let events: Vec<&'static str> = EVENTS.into_iter().filter(|e| works(e)).collect();
        if events.is_empty() {
            eprintln!(
                "proxy: perf stat cannot count the epoll_wait tracepoints here (perf missing, or no tracefs): no epoll_wait counts"
            );
            return None;
        }
        Some(Self { events })
    }

    /// One window of `work` through `contender` with `perf stat` attached to the relay for the
    /// window: the relay's `epoll_wait` calls and what the window did; `None` for direct.
    pub(super) fn count(
        &self,
        contender: &mut Contender,
        work: Work,
        workload: &Workload,
    ) -> anyhow::Result<Option<(u64, Measured)>> {
        let Some(pid) = contender.pid() else {
            return Ok(None);
        };
        let output = tempfile::NamedTempFile::new()?;
        let mut perf: Option<Child> = None;
        let mut hook = |opening: bool| -> anyhow::Result<()> {
            if opening {
                perf = Some(self.attach(pid, output.path())?);
            } else if let Some(mut child) = perf.take() {
                stop(&mut child)?;
            }
            Ok(())
        };
        let (measured, _) = contender.run_with(work, workload, &mut hook)?;
        let text = std::fs::read_to_string(output.path())?;
        let calls = perf_stat_total(&text).with_context(|| {
            format!("perf stat counted nothing for {}:\n{text}", contender.name)
        })?;
        Ok(Some((calls, measured)))
    }

    fn attach(&self, pid: u32, output: &Path) -> anyhow::Result<Child> {
        Command::new("perf")
            .args(["stat", "-x,", "-e", &self.events.join(","), "-o"])
            .arg(output)
            .arg("-p")
            .arg(pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting perf stat")
    }
}

/// SIGINT (perf then writes its counts) and wait.
fn stop(child: &mut Child) -> anyhow::Result<()> {
    let pid = i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .context("perf's process id")?;
    rustix::process::kill_process(pid, rustix::process::Signal::INT)
        .context("stopping perf stat")?;
    child.wait()?;
    Ok(())
}

/// The sum of the counts of `perf stat -x,` output (`count,unit,event,...` lines); an event
/// `<not counted>` counts 0 (the relay never ran it in the window). `None` without any line.
fn perf_stat_total(text: &str) -> Option<u64> {
    let mut total = None;
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let fields: Vec<&str> = line.split(',').collect();
        let [count, _unit, event, ..] = fields.as_slice() else {
            continue;
        };
        if !event.starts_with("syscalls:") {
            continue;
        }
        let count = match count.trim() {
            "<not counted>" => 0,
            other => match other.parse::<u64>() {
                Ok(count) => count,
                Err(_) => continue,
            },
        };
        total = Some(total.unwrap_or(0) + count);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_stat_counts_are_summed() {
        let text = "# started on Sat Dec  5 21:08:40 2026\n\n885,,syscalls:sys_enter_epoll_wait,18059963,100.00,49.003,K/sec\n12,,syscalls:sys_enter_epoll_pwait,18059963,100.00,0.000,/sec\n<not counted>,,syscalls:sys_enter_epoll_pwait2,0,100.00,,\n";
        assert_eq!(perf_stat_total(text), Some(897));
        assert_eq!(perf_stat_total("# started\n\n"), None);
        assert_eq!(
            perf_stat_total("<not supported>,,syscalls:sys_enter_epoll_wait,0,100.00,,\n"),
            None
        );
    }
}
