//! `bench proxy --profile`: perf and strace attached to each relay, their files under
//! [`PROFILE_DIR`], and the "Bound" notes read back from those files.

use std::process::Command;

use anyhow::Context as _;

use super::relays::Contender;
use super::{
    CLOSED_PHASE, CPU_PER_GIB, GIB, HAPROXY_AUTO, HAPROXY_FORCED, PROFILE_DIR, PROXY_CORE,
    PROXY_CORE_BASELINE, PROXY_CORE_EVENT_LOOP, Workload,
};
use crate::bench::procs::Work;
use crate::bench::report::Figure;

mod reading;

use reading::{
    UNIT_COST_PREFIX, cost_table, cost_views, kernel_floor, strace_per_connection, strace_per_mib,
    versus,
};

/// The relays whose profile files the bound notes read, in the order they list them: the
/// event loop first, as it is proxy-core's data path on Linux.
const PROFILED: [&str; 5] = [
    PROXY_CORE_EVENT_LOOP,
    PROXY_CORE,
    PROXY_CORE_BASELINE,
    HAPROXY_FORCED,
    HAPROXY_AUTO,
];

/// What bounds each figure, read from the committed `--profile` files (each note names its
/// file); a relay without a profile gets no note.
pub(super) fn bounds(figures: &[Figure]) -> Vec<String> {
    let root = crate::workspace::root();
    // Only the relays of this run: a file left by an earlier run with other contenders (a
    // baseline build, say) says nothing about this one.
    let measured = |contender: &str| {
        figures.iter().any(|f| {
            f.series
                .iter()
                .any(|s| s.contender == contender && s.median.is_some())
        })
    };
    let read = |contender: &str, kind: &str| {
        if !measured(contender) {
            return None;
        }
        let path = profile_file(contender, kind);
        std::fs::read_to_string(root.join(&path))
            .ok()
            .map(|text| (path, text))
    };
    let mut notes = Vec::new();
    let closed_cpu = format!("{CLOSED_PHASE}: relay CPU per 1000 connections");
    // Both of proxy-core's data paths against both HAProxy configurations, in one figure.
    let this_run = |figure: &str| {
        [PROXY_CORE_EVENT_LOOP, PROXY_CORE]
            .iter()
            .map(|ours| {
                format!(
                    "{ours} {} HAProxy forced splice, {} splice-auto",
                    versus(figures, figure, ours, HAPROXY_FORCED),
                    versus(figures, figure, ours, HAPROXY_AUTO)
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let mut syscalls = Vec::new();
    for contender in PROFILED {
        if let Some((path, text)) = read(contender, "connections.strace")
            && let Some((total, calls)) = strace_per_connection(&text)
        {
            let top: Vec<String> = calls
                .iter()
                .take(12)
                .map(|(name, count)| format!("{name} {count:.2}"))
                .collect();
            syscalls.push(format!(
                "{contender} {total:.1} syscalls per connection ({}; from {path})",
                top.join(", ")
            ));
        }
    }
    if !syscalls.is_empty() {
        notes.push(format!(
            "Bound, CPU per connection (this run: {}): per connection the relays pay the kernel for their syscalls, each with its loopback delivery. {}.",
            this_run(&closed_cpu),
            syscalls.join("; ")
        ));
    }
    let mut wakeups = Vec::new();
    for contender in PROFILED {
        if let Some((path, text)) = read(contender, "bulk-upload.strace")
            && let Some(calls) = strace_per_mib(&text)
        {
            let listed: Vec<String> = calls
                .iter()
                .take(5)
                .map(|(name, count)| format!("{name} {count:.2}"))
                .collect();
            wakeups.push(format!("{contender}: {} (from {path})", listed.join(", ")));
        }
    }
    if !wakeups.is_empty() {
        notes.push(format!(
            "Bound, CPU per GiB, wake-ups: syscalls per MiB of a one-stream upload. Every `epoll_wait` is a wake-up of the relay; HAProxy and proxy-core's event loop drop a socket's read interest (`epoll_ctl`) while the other side cannot take more, tokio keeps every socket registered for both directions (edge-triggered), so each segment that arrives while the relay waits to write wakes it for nothing. {}.",
            wakeups.join("; ")
        ));
    }
    for (kind, what, figure) in [
        (
            "connections.perf",
            "CPU per connection",
            closed_cpu.as_str(),
        ),
        ("bulk-upload.perf", "CPU per GiB", CPU_PER_GIB.name),
    ] {
        if let Some(table) = cost_table(kind, &PROFILED, &read) {
            let indented: String = table.lines().map(|line| format!("\n  {line}")).collect();
            notes.push(format!(
                "Bound, {what}, line by line (this run: {}): each relay's CPU per unit in its profiled window, split by where perf found it (user-space objects; kernel time by syscall, inclusive of the loopback delivery it does):\n{indented}",
                this_run(figure),
            ));
        }
        if let Some(floor) = kernel_floor(
            kind,
            &[PROXY_CORE_EVENT_LOOP, PROXY_CORE],
            &[HAPROXY_FORCED, HAPROXY_AUTO],
            &read,
        ) {
            notes.push(format!("Bound, {what}, the kernel's floor: {floor}"));
        }
    }
    notes
}

/// The slug of a contender in profile file names.
fn slug(name: &str) -> String {
    name.replace(' ', "-")
}

/// Profile file `kind` (`connections.perf`, `bulk-upload.perf`, `connections.strace`,
/// `bulk-upload.strace`) of
/// `contender`, relative to the workspace root.
fn profile_file(contender: &str, kind: &str) -> String {
    format!("{PROFILE_DIR}/{}-{kind}.txt", slug(contender))
}

/// A profiler attached to a relay while a generator's window is open.
struct Attached {
    child: std::process::Child,
}

impl Attached {
    fn start(program: &str, args: &[String]) -> anyhow::Result<Self> {
        let child = Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        Ok(Self { child })
    }

    /// SIGINT (both perf and strace then write what they have) and wait.
    fn stop(mut self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .arg("-INT")
            .arg(self.child.id().to_string())
            .status()?;
        anyhow::ensure!(status.success(), "kill -INT failed");
        self.child.wait()?;
        Ok(())
    }
}

/// `cargo xtask bench proxy --profile`: for each relay, `perf record -g` over a closed-loop
/// connection window and a one-stream upload window, `perf report --stdio` of each, and
/// `strace -c -f` over an open-loop window at 1 000 connections/s; files under [`PROFILE_DIR`].
pub(super) fn profile(
    workload: &Workload,
    contenders: &mut [Contender],
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    crate::debian::install_packages(&["linux-perf", "strace"], "bench --profile")?;
    let dir = crate::workspace::root().join(PROFILE_DIR);
    std::fs::create_dir_all(&dir)?;
    let scratch = tempfile::tempdir()?;
    for contender in contenders.iter_mut() {
        let Some(pid) = contender.pid() else { continue };
        eprintln!("proxy: profiling {}", contender.name);
        let works = [
            (
                "connections.perf",
                Work::Closed {
                    concurrency: workload.connection_concurrency,
                },
            ),
            (
                "bulk-upload.perf",
                Work::Bulk {
                    download: false,
                    streams: 1,
                },
            ),
            ("connections.strace", Work::Open { rate: 1_000 }),
            (
                "bulk-upload.strace",
                Work::Bulk {
                    download: false,
                    streams: 1,
                },
            ),
        ];
        for (kind, work) in works {
            let data = scratch
                .path()
                .join(format!("{}-{kind}.data", slug(contender.name)));
            let output = crate::workspace::root().join(profile_file(contender.name, kind));
            let strace = kind.ends_with("strace");
            let mut attached = None;
            let mut hook = |opening: bool| -> anyhow::Result<()> {
                if opening {
                    let args: Vec<String> = if strace {
                        vec![
                            "-c".into(),
                            "-f".into(),
                            "-o".into(),
                            output.display().to_string(),
                            "-p".into(),
                            pid.to_string(),
                        ]
                    } else {
                        vec![
                            "record".into(),
                            "-g".into(),
                            "-q".into(),
                            "-o".into(),
                            data.display().to_string(),
                            "-p".into(),
                            pid.to_string(),
                        ]
                    };
                    attached = Some(Attached::start(
                        if strace { "strace" } else { "perf" },
                        &args,
                    )?);
                } else if let Some(attached) = attached.take() {
                    attached.stop()?;
                }
                Ok(())
            };
            let (measured, cpu) = contender.run_with(work, workload, &mut hook)?;
            let amount = match work {
                Work::Bulk { .. } => format!(
                    "{:.2} GiB moved in the window ({:.2} Gbit/s)",
                    measured.bytes as f64 / GIB,
                    measured.bytes as f64 * 8.0 / measured.seconds / 1e9
                ),
                _ => format!(
                    "{} connections completed in the window ({:.0}/s)",
                    measured.completed,
                    measured.completed as f64 / measured.seconds
                ),
            };
            let relay_cpu = cpu.relay.unwrap_or(0.0);
            let unit_cost = match work {
                Work::Bulk { .. } => format!(
                    "{UNIT_COST_PREFIX}{:.4} CPU s per GiB",
                    relay_cpu / (measured.bytes.max(1) as f64 / GIB)
                ),
                _ => format!(
                    "{UNIT_COST_PREFIX}{:.1} CPU us per connection",
                    relay_cpu * 1e6 / measured.completed.max(1) as f64
                ),
            };
            let header = format!(
                "# {} under {work:?}, {:.1} s window: {amount}; relay CPU {relay_cpu:.2} s, generator {:.2} s, sink {:.2} s (with the profiler attached)\n{unit_cost}\n",
                contender.name, measured.seconds, cpu.generator, cpu.sink,
            );
            let body = if strace {
                std::fs::read_to_string(&output).unwrap_or_default()
            } else {
                let report = Command::new("perf")
                    .arg("report")
                    .arg("-i")
                    .arg(&data)
                    .args([
                        "--stdio",
                        "--no-children",
                        "-g",
                        "none",
                        "--percent-limit",
                        "0.3",
                        "--sort",
                        "dso,symbol",
                    ])
                    .output()
                    .context("perf report")?;
                let mut body = String::from_utf8_lossy(&report.stdout).into_owned();
                body.push_str(&cost_views(&data)?);
                body
            };
            let body: String = body
                .lines()
                .filter(|line| !line.trim().is_empty())
                .map(|line| format!("{line}\n"))
                .collect();
            let command = if strace {
                "# strace -c -f -p <relay pid>, stopped with SIGINT when the window closed; per connection means per upstream connect (strace attaches after the window opens and slows the relay)\n".to_owned()
            } else {
                "# perf record -g -p <relay pid> over the window; perf report --stdio --no-children -g none --percent-limit 0.3 --sort dso,symbol\n".to_owned()
            };
            std::fs::write(&output, format!("{header}{command}{body}"))
                .with_context(|| format!("writing {}", output.display()))?;
        }
    }
    notes.push(format!(
        "--profile: perf and strace files of this run are under {PROFILE_DIR}/ (one set per relay)."
    ));
    Ok(())
}
