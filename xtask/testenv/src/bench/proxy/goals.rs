//! `bench proxy`'s judgement and prose: the goals its figures are held to, the report's notes
//! (`proxy_notes.md` filled with this run's settings) and what each contender ran on.

use std::process::Command;

use super::profile::bounds;
use super::relays::Relays;
use super::{
    BULK, CLOSED_2T_PHASE, CLOSED_PHASE, CPU_PER_GIB, DIRECT, HAPROXY_AUTO, HAPROXY_AUTO_2T,
    HAPROXY_FORCED, HAPROXY_FORCED_2T, IDLE_FDS, IDLE_RSS, LATENCY_P99, PIPE_SIZE, PROFILE_DIR,
    PROXY_CORE, PROXY_CORE_2L, PROXY_CORE_2T, PROXY_CORE_EVENT_LOOP, SCALING, Workload, open_phase,
};
use crate::bench::Settings;
use crate::bench::report::{Bound, Figure, Goal, median_of_sorted, notes_from, verdict_of_rounds};
use crate::bench::system::{self, GENERATOR_CPU, RELAY_CPU};

/// The prose of the report, with `{placeholders}` filled by [`notes`].
const NOTES_TEMPLATE: &str = include_str!("proxy_notes.md");

/// What each contender ran on and with, for the report.
pub(super) fn configuration(relays: &Relays) -> Vec<String> {
    let haproxy_version = relays
        .haproxy
        .as_deref()
        .and_then(|haproxy| Command::new(haproxy).arg("-v").output().ok())
        .and_then(|output| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "HAProxy not available".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |text| text.trim().to_owned());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let pipe_budget = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .filter(|pages| *pages > 0)
        .map_or(16 << 20, |pages| pages * 4096 / 4);
    let pinning = if system::can_pin() {
        format!(
            "generator and sink: CPU {GENERATOR_CPU}; one-thread relays (proxy-core, both HAProxy): taskset -c {RELAY_CPU}; two-thread relays: unpinned (both CPUs, shared with the generator)"
        )
    } else {
        "nothing pinned (fewer than 2 usable CPUs)".to_owned()
    };
    vec![
        format!("Machine: {cpu}; kernel {kernel}; {haproxy_version}."),
        format!("Pinning: {pinning}."),
        format!(
            "{PROXY_CORE}: examples/tcp_relay, copy mode auto (buffered first bytes, then splice through a pooled {} KiB pipe once a read fills 16 KiB), pipe budget {} MiB (the default: a quarter of pipe-user-pages-soft), PrometheusObserver registered as in the binaries (registry not scraped), --no-keepalive (TCP keepalive off, as HAProxy without option tcpka; on by default it costs 4 setsockopt per upstream connection), --threads 1 (tokio's current-thread runtime: one event loop, no hand-offs between workers, as HAProxy nbthread 1; steward-tcp-proxy --threads 1 runs the same), RUST_LOG=warn; {PROXY_CORE_2T}: the same with --threads 2 (a multi-thread runtime with 2 workers sharing one listener); {PROXY_CORE_2L}: --threads 2 --listener-per-thread (2 current-thread runtimes on threads of their own, each accepting on its own SO_REUSEPORT socket).",
            PIPE_SIZE >> 10,
            pipe_budget >> 20
        ),
        format!(
            "{HAPROXY_AUTO}: nbthread 1, mode tcp, option splice-auto, tune.pipesize {PIPE_SIZE}, maxpipes = maxconn, no option tcpka (its default); {HAPROXY_FORCED}: the same with option splice-request + option splice-response instead; the nbthread 2 variants differ only in nbthread."
        ),
    ]
}

/// The proxy-core contenders measured in this run (the goals judge each).
fn ours(figures: &[Figure]) -> Vec<&'static str> {
    [PROXY_CORE, PROXY_CORE_EVENT_LOOP]
        .into_iter()
        .filter(|name| {
            figures
                .iter()
                .any(|f| f.series.iter().any(|s| s.contender == *name))
        })
        .collect()
}

pub(super) fn goals(figures: &[Figure]) -> Vec<Goal> {
    let find = |name: &str| figures.iter().find(|f| f.name == name);
    let ours = ours(figures);
    let mut goals = Vec::new();
    let open_phases = [2_000, 5_000].map(open_phase);
    for phase in std::iter::once(CLOSED_PHASE.to_owned()).chain(open_phases.iter().cloned()) {
        let name = format!("{phase}: relay CPU per 1000 connections");
        for ours in &ours {
            for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
                goals.push(ratio_goal(
                    find(&name),
                    &name,
                    ours,
                    haproxy,
                    Bound::AtMost(0.85),
                ));
            }
        }
    }
    let per_gib = find(CPU_PER_GIB.name);
    for ours in &ours {
        goals.push(ratio_goal(
            per_gib,
            CPU_PER_GIB.name,
            ours,
            HAPROXY_FORCED,
            Bound::AtMost(0.9),
        ));
        goals.push(ratio_goal(
            per_gib,
            CPU_PER_GIB.name,
            ours,
            HAPROXY_AUTO,
            Bound::Below(1.0),
        ));
    }
    for (streams, _, phase) in BULK {
        let figure = find(phase);
        for ours in &ours {
            if streams == 1 {
                goals.push(ratio_goal(figure, phase, ours, DIRECT, Bound::AtLeast(0.5)));
            }
            for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
                goals.push(ratio_goal(
                    figure,
                    phase,
                    ours,
                    haproxy,
                    Bound::AtLeast(1.0),
                ));
            }
        }
    }
    for (_, phase) in SCALING {
        for ours in [PROXY_CORE_2T, PROXY_CORE_2L] {
            for haproxy in [HAPROXY_FORCED_2T, HAPROXY_AUTO_2T] {
                goals.push(ratio_goal(
                    find(phase),
                    phase,
                    ours,
                    haproxy,
                    Bound::AtLeast(1.0),
                ));
            }
        }
    }
    for phase in &open_phases {
        let name = format!("{phase}: connect to first byte, p99");
        for ours in &ours {
            for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
                goals.push(ratio_goal(
                    find(&name),
                    &name,
                    ours,
                    haproxy,
                    Bound::AtMost(1.0),
                ));
            }
        }
    }
    if let Some(figure) = find(LATENCY_P99.name) {
        for ours in &ours {
            for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
                let added = |name: &str| Some(figure.median(name)? - figure.median(DIRECT)?);
                let (mine, theirs) = (added(ours), added(haproxy));
                // Direct's round cancels out of a paired comparison of added latency.
                let ratios = figure.paired_ratios(ours, haproxy);
                goals.push(Goal {
                    goal: format!("added p99 latency: {ours} <= {haproxy}'s"),
                    measured: format!(
                        "{ours} {} µs, {haproxy} {} µs over direct (medians); {}",
                        shown(mine),
                        shown(theirs),
                        spread(&ratios)
                    ),
                    met: verdict_of_rounds(&ratios, Bound::AtMost(1.0)),
                });
            }
        }
    }
    for ours in &ours {
        for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
            goals.push(ratio_goal(
                find(IDLE_RSS.name),
                IDLE_RSS.name,
                ours,
                haproxy,
                Bound::AtMost(1.0),
            ));
        }
        if let Some(figure) = find(IDLE_RSS.name) {
            let median = figure.median(ours);
            goals.push(Goal {
                goal: format!("<= 8 KiB RSS per idle relayed connection ({ours})"),
                measured: format!(
                    "{ours} {} KiB",
                    median.map_or_else(|| "?".to_owned(), |kib| format!("{kib:.1}"))
                ),
                met: median.map(|kib| kib <= 8.0).into(),
            });
        }
        if let Some(figure) = find(IDLE_FDS.name) {
            let median = figure.median(ours);
            goals.push(Goal {
                goal: format!(
                    "2 descriptors per idle relayed connection, no pipe before data ({ours})"
                ),
                measured: format!(
                    "{ours} {}",
                    median.map_or_else(|| "?".to_owned(), |fds| format!("{fds:.2}"))
                ),
                met: median.map(|fds| fds <= 2.05).into(),
            });
        }
    }
    goals
}

/// `ours` against `reference` in one figure, judged by `bound` on the per-round paired ratios
/// ([`verdict_of_rounds`]).
fn ratio_goal(
    figure: Option<&Figure>,
    name: &str,
    ours: &str,
    reference: &str,
    bound: Bound,
) -> Goal {
    let ratios = figure.map_or_else(Vec::new, |figure| figure.paired_ratios(ours, reference));
    Goal {
        goal: format!("{name}: {ours} {} {reference}", bound.relation()),
        measured: if ratios.is_empty() {
            "not measured".to_owned()
        } else {
            spread(&ratios)
        },
        met: verdict_of_rounds(&ratios, bound),
    }
}

/// `0.98x (rounds 0.93–1.04x)`: the median paired ratio and its extremes.
fn spread(ratios: &[f64]) -> String {
    let mut sorted = ratios.to_vec();
    sorted.sort_by(f64::total_cmp);
    match (sorted.first(), sorted.last()) {
        (Some(min), Some(max)) => format!(
            "{:.2}x (rounds {min:.2}–{max:.2}x, n={})",
            median_of_sorted(&sorted),
            sorted.len()
        ),
        _ => "no paired rounds".to_owned(),
    }
}

fn shown(value: Option<f64>) -> String {
    value.map_or_else(|| "?".to_owned(), |v| format!("{v:+.0}"))
}

/// The report's prose: `proxy_notes.md` with this run's settings filled in, one note per
/// paragraph; then what bounds the figures, from the `--profile` files, or nothing where there is
/// no profile to cite.
pub(super) fn notes(settings: &Settings, workload: &Workload, figures: &[Figure]) -> Vec<String> {
    let idle_limit = if workload.idle_connections < 10_000 && !settings.quick {
        format!(
            " Fewer than 10 000 because the open-file limit here is {} and cannot be raised further, and HAProxy refuses to start unless the limit covers 2.5 descriptors per maxconn (it runs this phase with maxconn = this count and maxpipes 0).",
            settings.fd_limit
        )
    } else {
        String::new()
    };
    let values = [
        ("warmup", format!("{:?}", workload.warmup)),
        ("measure", format!("{:?}", workload.measure)),
        ("generator_cpu", GENERATOR_CPU.to_string()),
        ("relay_cpu", RELAY_CPU.to_string()),
        ("latency_rate", workload.latency_rate.to_string()),
        (
            "latency_duration",
            format!("{:?}", workload.latency_duration),
        ),
        ("concurrency", workload.connection_concurrency.to_string()),
        (
            "open_rates",
            workload.open_rates.map(|r| r.to_string()).join(" and "),
        ),
        ("idle_connections", workload.idle_connections.to_string()),
        ("idle_limit", idle_limit),
        ("profile_dir", PROFILE_DIR.to_owned()),
    ];
    let mut notes = notes_from(NOTES_TEMPLATE, &values);
    notes.extend(listener_per_thread(figures));
    notes.extend(counts_note(figures));
    notes.extend(bounds(figures));
    notes
}

/// Segments, wake-ups and `epoll_wait` calls of each one-thread relay side by side (medians of
/// this run): whether a relay's extra kernel time per connection or per MiB (the `sendto` gap of
/// the profiles, say) comes with more segments on the wire or with more calls and sleeps.
fn counts_note(figures: &[Figure]) -> Option<String> {
    let median = |name: String, contender: &str| {
        figures
            .iter()
            .find(|f| f.name == name)
            .and_then(|f| f.median(contender))
    };
    let mut phases: Vec<(String, &str)> = vec![
        (CLOSED_PHASE.to_owned(), "connection"),
        (open_phase(2_000), "connection"),
    ];
    phases.extend(
        BULK.iter()
            .filter(|(streams, _, _)| *streams == 1)
            .map(|(_, _, phase)| ((*phase).to_owned(), "MiB")),
    );
    let contenders = [
        DIRECT,
        PROXY_CORE,
        PROXY_CORE_EVENT_LOOP,
        HAPROXY_FORCED,
        HAPROXY_AUTO,
    ];
    let mut parts = Vec::new();
    for (phase, per) in phases {
        let mut entries = Vec::new();
        for contender in contenders {
            let Some(segments) = median(format!("{phase}: TCP segments per {per}"), contender)
            else {
                continue;
            };
            let mut entry = format!("{contender} {segments:.2} segments");
            let wakeups = format!("{phase}: relay wake-ups per {per} (voluntary context switches)");
            if let Some(wakeups) = median(wakeups, contender) {
                entry.push_str(&format!(", {wakeups:.3} wake-ups"));
            }
            let calls =
                format!("{phase}: relay epoll_wait calls per {per} (perf stat, one extra window)");
            if let Some(calls) = median(calls, contender) {
                entry.push_str(&format!(", {calls:.3} epoll_wait calls"));
            }
            entries.push(entry);
        }
        if !entries.is_empty() {
            parts.push(format!("{phase}, per {per}: {}", entries.join("; ")));
        }
    }
    (!parts.is_empty()).then(|| {
        format!(
            "Segments and wake-ups (medians of this run; segments count every hop, so a relay's two hops against direct's one; wake-ups are the relay's voluntary context switches, epoll_wait calls come from the extra perf stat window): {}.",
            parts.join(". ")
        )
    })
}

/// The two-thread figures of a listener per thread against one shared listener, as ratios of
/// medians; `None` when neither was measured.
fn listener_per_thread(figures: &[Figure]) -> Option<String> {
    let closed_rate = format!("{CLOSED_2T_PHASE}: completed connections");
    let closed_cpu = format!("{CLOSED_2T_PHASE}: relay CPU per 1000 connections");
    let mut wanted = vec![
        (closed_rate, "the rate"),
        (closed_cpu, "the relay CPU per 1 000 connections"),
    ];
    for (_, phase) in SCALING {
        wanted.push((phase.to_owned(), "the throughput"));
        wanted.push((
            format!("{phase}: relay CPU per GiB"),
            "the relay CPU per GiB",
        ));
    }
    let parts: Vec<String> = wanted
        .iter()
        .filter_map(|(name, what)| {
            let figure = figures.iter().find(|f| &f.name == name)?;
            let ratio = figure.median(PROXY_CORE_2L)? / figure.median(PROXY_CORE_2T)?;
            Some(format!("{name}: {ratio:.2}x {what}"))
        })
        .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "Listener per thread ({PROXY_CORE_2L}) against one listener shared by a runtime's 2 workers ({PROXY_CORE_2T}), ratio of medians: {}.",
            parts.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::{Metric, Recorder, Verdict};

    #[test]
    fn the_listener_per_thread_note_compares_the_two_thread_runtimes() {
        let mut recorder = Recorder::default();
        let rate = Metric::higher(
            "connections, closed loop of 16, 2 relay threads: completed connections",
            "conn/s",
        );
        recorder.record(rate, PROXY_CORE_2T, 10_000.0);
        recorder.record(rate, PROXY_CORE_2L, 12_000.0);
        recorder.record(rate, HAPROXY_AUTO_2T, 99_000.0);
        let note = listener_per_thread(&recorder.finish(&[])).unwrap_or_default();
        assert!(
            note.contains("2 relay threads: completed connections: 1.20x the rate"),
            "{note}"
        );
        assert!(
            !note.contains("per GiB"),
            "unmeasured figures are left out: {note}"
        );
        assert_eq!(listener_per_thread(&[]), None);
    }

    #[test]
    fn the_counts_note_puts_relays_side_by_side() {
        let mut recorder = Recorder::default();
        let segments = Metric::lower(
            "connections, closed loop of 16: TCP segments per connection",
            "segments",
        );
        let wakeups = Metric::lower(
            "connections, closed loop of 16: relay wake-ups per connection (voluntary context switches)",
            "switches",
        );
        recorder.record(segments, DIRECT, 10.0);
        recorder.record(segments, PROXY_CORE, 21.0);
        recorder.record(wakeups, PROXY_CORE, 0.5);
        recorder.record(segments, HAPROXY_AUTO, 18.0);
        let note = counts_note(&recorder.finish(&[])).unwrap_or_default();
        assert!(
            note.contains("connections, closed loop of 16, per connection: direct 10.00 segments; proxy-core 21.00 segments, 0.500 wake-ups; haproxy splice-auto 18.00 segments."),
            "{note}"
        );
        assert_eq!(counts_note(&[]), None);
    }

    #[test]
    fn ratio_goals_judge_each_bound_round_by_round() {
        let mut recorder = Recorder::default();
        let metric = Metric::lower("cost", "CPU ms");
        for (round, (ours, theirs)) in [(90.0, 100.0), (80.0, 100.0), (84.0, 100.0)]
            .into_iter()
            .enumerate()
        {
            recorder.record_round(metric, PROXY_CORE, round, ours);
            recorder.record_round(metric, HAPROXY_FORCED, round, theirs);
        }
        let figures = recorder.finish(&[]);
        let goal = |bound| ratio_goal(figures.first(), "cost", PROXY_CORE, HAPROXY_FORCED, bound);
        assert_eq!(goal(Bound::AtMost(0.9)).met, Verdict::Met);
        assert_eq!(goal(Bound::AtMost(0.85)).met, Verdict::WithinNoise);
        assert_eq!(goal(Bound::AtMost(0.79)).met, Verdict::Missed);
        assert_eq!(goal(Bound::Below(0.9)).met, Verdict::WithinNoise);
        assert_eq!(goal(Bound::AtLeast(0.95)).met, Verdict::Missed);
        assert_eq!(
            goal(Bound::AtMost(0.85)).measured,
            "0.84x (rounds 0.80–0.90x, n=3)"
        );
        let missing = ratio_goal(None, "cost", PROXY_CORE, HAPROXY_AUTO, Bound::AtMost(1.0));
        assert_eq!(missing.met, Verdict::NotJudged);
        assert_eq!(missing.measured, "not measured");
    }

    /// Rounds pair by number, not position: a round one contender lacks is left out.
    #[test]
    fn rounds_pair_by_number() {
        let mut recorder = Recorder::default();
        let metric = Metric::lower("cost", "CPU ms");
        recorder.record_round(metric, PROXY_CORE, 0, 50.0);
        recorder.record_round(metric, PROXY_CORE, 2, 90.0);
        recorder.record_round(metric, HAPROXY_AUTO, 0, 100.0);
        recorder.record_round(metric, HAPROXY_AUTO, 1, 10.0);
        recorder.record_round(metric, HAPROXY_AUTO, 2, 100.0);
        let figures = recorder.finish(&[]);
        let ratios = figures
            .first()
            .map(|f| f.paired_ratios(PROXY_CORE, HAPROXY_AUTO))
            .unwrap_or_default();
        assert_eq!(ratios, vec![0.5, 0.9]);
    }
}
