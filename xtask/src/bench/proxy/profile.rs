//! `bench proxy --profile`: perf and strace attached to each relay, their files under
//! [`PROFILE_DIR`], and the "Bound" notes read back from those files.

use std::process::Command;

use anyhow::Context as _;

use super::relays::Contender;
use super::{
    CLOSED_PHASE, CPU_PER_GIB, GIB, HAPROXY_AUTO, HAPROXY_FORCED, PROFILE_DIR, PROXY_CORE,
    PROXY_CORE_BASELINE, Workload,
};
use crate::bench::procs::{self, Work};
use crate::bench::report::{self, Figure};
use crate::bench::system::GENERATOR_CPU;

/// What bounds each figure, read from the committed `--profile` files (each note names its
/// file); a relay without a profile gets no note.
pub(super) fn bounds(figures: &[Figure]) -> Vec<String> {
    let root = crate::workspace_root();
    let read = |contender: &str, kind: &str| {
        let path = profile_file(contender, kind);
        std::fs::read_to_string(root.join(&path))
            .ok()
            .map(|text| (path, text))
    };
    let mut notes = Vec::new();
    let closed_cpu = format!("{CLOSED_PHASE}: relay CPU per 1000 connections");
    let mut syscalls = Vec::new();
    for contender in [
        PROXY_CORE,
        PROXY_CORE_BASELINE,
        HAPROXY_FORCED,
        HAPROXY_AUTO,
    ] {
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
            "Bound, CPU per connection (this run: proxy-core {} HAProxy forced splice, {} splice-auto): per connection the relays pay the kernel for their syscalls, each with its loopback delivery. {}.",
            versus(figures, &closed_cpu, PROXY_CORE, HAPROXY_FORCED),
            versus(figures, &closed_cpu, PROXY_CORE, HAPROXY_AUTO),
            syscalls.join("; ")
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
        let mut tops = Vec::new();
        for contender in [PROXY_CORE, HAPROXY_FORCED] {
            if let Some((path, text)) = read(contender, kind) {
                tops.push(format!(
                    "{contender}, from {path}: {}",
                    perf_top(&text, 8).join(", ")
                ));
            }
        }
        if !tops.is_empty() {
            notes.push(format!(
                "Bound, {what} (this run: proxy-core {} HAProxy forced splice): where the relay's cycles go, top entries of perf report: {}.",
                versus(figures, figure, PROXY_CORE, HAPROXY_FORCED),
                tops.join("; ")
            ));
        }
    }
    notes
}

/// The slug of a contender in profile file names.
fn slug(name: &str) -> String {
    name.replace(' ', "-")
}

/// Profile file `kind` (`connections.perf`, `bulk-upload.perf`, `connections.strace`) of
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
    crate::envtest::install_packages(&["linux-perf", "strace"], "bench --profile")?;
    let dir = crate::workspace_root().join(PROFILE_DIR);
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
        ];
        for (kind, work) in works {
            let data = scratch
                .path()
                .join(format!("{}-{kind}.data", slug(contender.name)));
            let output = crate::workspace_root().join(profile_file(contender.name, kind));
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
            let (measured, cpu) = procs::run_generator(
                contender.addr,
                Some(GENERATOR_CPU),
                work,
                workload.warmup,
                workload.measure,
                Some(pid),
                contender.sink_pid,
                &mut hook,
            )?;
            contender.check_running()?;
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
            let header = format!(
                "# {} under {work:?}, {:.1} s window: {amount}; relay CPU {:.2} s, generator {:.2} s, sink {:.2} s (with the profiler attached)\n",
                contender.name,
                measured.seconds,
                cpu.relay.unwrap_or(0.0),
                cpu.generator,
                cpu.sink,
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
                String::from_utf8_lossy(&report.stdout).into_owned()
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

/// Syscalls per connection from a `--profile` strace file: (total, the top calls with their
/// count per connection). Each relayed connection makes exactly one upstream `connect`, so the
/// `connect` count is the number of connections strace saw (strace attaches after the window
/// opens and slows the relay, so the generator's count would not match).
fn strace_per_connection(text: &str) -> Option<(f64, Vec<(String, f64)>)> {
    let mut calls = Vec::new();
    let mut total = None;
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // % time, seconds, usecs/call, calls, [errors], syscall
        if fields.len() < 5 || fields[0].parse::<f64>().is_err() {
            continue;
        }
        let Ok(count) = fields[3].parse::<f64>() else {
            continue;
        };
        let name = fields[fields.len() - 1].to_owned();
        if name == "total" {
            total = Some(count);
        } else {
            calls.push((name, count));
        }
    }
    let connections = calls
        .iter()
        .find(|(name, _)| name == "connect")
        .map(|(_, count)| *count)
        .filter(|count| *count > 0.0)?;
    for call in &mut calls {
        call.1 /= connections;
    }
    calls.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some((total? / connections, calls))
}

/// The top `count` entries of a `--profile` perf report: (share, where).
fn perf_top(text: &str, count: usize) -> Vec<String> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let share = fields.first()?.strip_suffix('%')?;
            share.parse::<f64>().ok()?;
            // share, dso, [k] or [.], symbol, then the IPC columns ("-" when not sampled)
            let dso = fields.get(1)?;
            let symbol = fields
                .get(3..)?
                .iter()
                .take_while(|field| **field != "-")
                .copied()
                .collect::<Vec<_>>()
                .join(" ");
            Some(format!("{share}% {symbol} ({dso})"))
        })
        .take(count)
        .collect()
}

/// `ours` against `reference` in one figure of this run: the ratio of medians, and whether each
/// median falls inside the other's min-max (then the run cannot tell the two apart).
fn versus(figures: &[Figure], name: &str, ours: &str, reference: &str) -> String {
    let Some(figure) = figures.iter().find(|f| f.name == name) else {
        return "not measured".to_owned();
    };
    let series = |name: &str| figure.series.iter().find(|s| s.contender == name);
    let (Some(a), Some(b)) = (series(ours), series(reference)) else {
        return "not measured".to_owned();
    };
    let (Some(a_median), Some(b_median)) = (a.median, b.median) else {
        return "not measured".to_owned();
    };
    let inside = |median: f64, other: &report::Series| {
        other.min.is_some_and(|min| min <= median) && other.max.is_some_and(|max| median <= max)
    };
    let overlap = if inside(a_median, b) && inside(b_median, a) {
        ", each median inside the other's min-max"
    } else {
        ""
    };
    format!("{:.2}x{overlap}", a_median / b_median)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::proxy::DIRECT;
    use crate::bench::report::{Metric, Recorder};

    #[test]
    fn versus_gives_the_ratio_and_says_when_the_ranges_overlap() {
        let up = Metric::higher("up", "Gbit/s");
        let down = Metric::higher("down", "Gbit/s");
        let mut recorder = Recorder::default();
        for (ours, theirs) in [(10.0, 9.0), (12.0, 11.0), (11.0, 12.5)] {
            recorder.record(up, PROXY_CORE, ours);
            recorder.record(up, HAPROXY_FORCED, theirs);
        }
        for (ours, theirs) in [(10.0, 20.0), (11.0, 21.0)] {
            recorder.record(down, PROXY_CORE, ours);
            recorder.record(down, HAPROXY_FORCED, theirs);
        }
        let figures = recorder.finish(&[DIRECT]);
        assert_eq!(
            versus(&figures, up.name, PROXY_CORE, HAPROXY_FORCED),
            "1.00x, each median inside the other's min-max"
        );
        assert_eq!(
            versus(&figures, down.name, PROXY_CORE, HAPROXY_FORCED),
            "0.51x"
        );
        assert_eq!(
            versus(&figures, "rate", PROXY_CORE, HAPROXY_FORCED),
            "not measured"
        );
    }

    #[test]
    fn strace_counts_per_connection() {
        let text = "# header\n# connections: 999\n% time     seconds  usecs/call     calls    errors syscall\n------ ----------- ----------- --------- --------- ----------------\n 40.00    0.004000          20       200           close\n 30.00    0.003000          15       400       100 recvfrom\n 30.00    0.003000          15       100       100 connect\n------ ----------- ----------- --------- --------- ----------------\n100.00    0.010000          14       700       200 total\n";
        let Some((total, calls)) = strace_per_connection(text) else {
            panic!("no counts parsed");
        };
        assert_eq!(total, 7.0);
        assert_eq!(calls[0], ("recvfrom".to_owned(), 4.0));
        assert_eq!(calls[1], ("close".to_owned(), 2.0));
        assert_eq!(calls[2], ("connect".to_owned(), 1.0));
        assert!(strace_per_connection("100.00 0.1 1 700 0 total\n").is_none());
    }

    #[test]
    fn perf_top_reads_shares_and_symbols() {
        let text = "# comment\n    12.50%  [kernel.kallsyms]  [k] tcp_sendmsg   -      -   \n     3.10%  tcp_relay          [.] proxy_core::copy::copy_tcp\n";
        assert_eq!(
            perf_top(text, 1),
            vec!["12.50% tcp_sendmsg ([kernel.kallsyms])".to_owned()]
        );
        assert_eq!(perf_top(text, 5).len(), 2);
    }
}
