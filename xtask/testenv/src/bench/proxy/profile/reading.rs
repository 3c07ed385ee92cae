//! The profile files read back: perf's cost split and strace's syscall counts, as the bound notes quote them.

use std::process::Command;

use anyhow::Context as _;

use crate::bench::report::{self, Figure};

/// Starts the line of a profile file's header that gives the relay's CPU per unit of work in
/// its window (per connection, or per GiB).
pub(super) const UNIT_COST_PREFIX: &str = "# relay CPU per unit: ";
/// Starts each line of a perf file's cost views.
const COST_PREFIX: &str = "cost ";

/// Two more views of a perf recording, one line each entry, after the symbol report: the
/// relay's samples by object (its binary, libc, the kernel), and by syscall, inclusive of what
/// the kernel did inside it (for loopback TCP that includes delivering to the peer's socket).
/// Lines read `cost <object|syscall> <share>% <name>`.
pub(super) fn cost_views(data: &std::path::Path) -> anyhow::Result<String> {
    let view = |children: &str, sort: &str| -> anyhow::Result<String> {
        let output = Command::new("perf")
            .arg("report")
            .arg("-i")
            .arg(data)
            .args(["--stdio", children, "-g", "none", "--sort", sort])
            .output()
            .context("perf report")?;
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    let mut out = String::from(
        "# cost views: perf report --no-children --sort dso (by object); perf report --children --sort symbol, the __x64_sys_* entries (by syscall, inclusive)\n",
    );
    for line in view("--no-children", "dso")?.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let [share, object, ..] = fields[..]
            && share.ends_with('%')
        {
            out.push_str(&format!("{COST_PREFIX}object {share} {object}\n"));
        }
    }
    for line in view("--children", "symbol")?.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // children %, self %, [k], symbol
        if let [share, _, _, symbol, ..] = fields[..]
            && share.ends_with('%')
            && let Some(syscall) = symbol.strip_prefix("__x64_sys_")
        {
            out.push_str(&format!("{COST_PREFIX}syscall {share} {syscall}\n"));
        }
    }
    Ok(out)
}

/// The relay's cost in one profile, split: (unit, total per unit, [(where, cost per unit)]).
/// Objects other than the kernel are user space; the kernel's share is split by syscall, and
/// what no syscall covers (interrupts, softirqs run on their own) is "kernel, outside syscalls".
struct CostSplit {
    unit: String,
    total: f64,
    /// The kernel's part of `total`, in syscalls or not.
    kernel: f64,
    lines: Vec<(String, f64)>,
}

fn cost_split(text: &str) -> Option<CostSplit> {
    let (total, unit) = text.lines().find_map(|line| {
        let rest = line.strip_prefix(UNIT_COST_PREFIX)?;
        let (value, unit) = rest.split_once(' ')?;
        Some((value.parse::<f64>().ok()?, unit.to_owned()))
    })?;
    let mut kernel = 0.0;
    let mut syscalls = 0.0;
    let mut lines = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(COST_PREFIX) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let [kind, share, name] = fields[..] else {
            continue;
        };
        let Some(share) = share.strip_suffix('%').and_then(|s| s.parse::<f64>().ok()) else {
            continue;
        };
        let cost = total * share / 100.0;
        match kind {
            "object" if name.starts_with("[kernel") => kernel = cost,
            "object" => lines.push((format!("user: {name}"), cost)),
            "syscall" => {
                syscalls += cost;
                lines.push((format!("kernel: {name}"), cost));
            }
            _ => {}
        }
    }
    // A file without cost views (written before they existed) has nothing to split.
    if lines.is_empty() {
        return None;
    }
    lines.push((
        "kernel, outside syscalls".to_owned(),
        (kernel - syscalls).max(0.0),
    ));
    Some(CostSplit {
        unit,
        total,
        kernel,
        lines,
    })
}

/// Reads a contender's profile file of one kind: (its path, its text).
type ReadProfile<'a> = dyn Fn(&str, &str) -> Option<(String, String)> + 'a;

/// A Markdown table of where each contender's relay CPU goes, side by side, from the perf
/// files of `kind`: one row per object or syscall, the rows that cost least folded into one.
pub(super) fn cost_table(
    kind: &str,
    contenders: &[&str],
    read: &ReadProfile<'_>,
) -> Option<String> {
    let splits: Vec<(&str, String, CostSplit)> = contenders
        .iter()
        .filter_map(|contender| {
            let (path, text) = read(contender, kind)?;
            Some((*contender, path, cost_split(&text)?))
        })
        .collect();
    let unit = splits.first()?.2.unit.clone();
    // Rows in the order of the first contender's costs, then any only the others have.
    let mut rows: Vec<String> = Vec::new();
    for (_, _, split) in &splits {
        let mut own: Vec<&(String, f64)> = split.lines.iter().collect();
        own.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (name, _) in own {
            if !rows.contains(name) {
                rows.push(name.clone());
            }
        }
    }
    let cost = |split: &CostSplit, row: &str| {
        split
            .lines
            .iter()
            .filter(|(name, _)| name == row)
            .fold(0.0, |sum, (_, cost)| sum + cost)
    };
    let mut table = format!(
        "| relay {unit} | {} |\n|---|{}\n",
        splits
            .iter()
            .map(|(name, _, _)| *name)
            .collect::<Vec<_>>()
            .join(" | "),
        "---:|".repeat(splits.len())
    );
    let format = |value: f64| {
        if value >= 10.0 {
            format!("{value:.1}")
        } else {
            format!("{value:.3}")
        }
    };
    let total_row = splits
        .iter()
        .map(|(_, _, split)| format!("**{}**", format(split.total)))
        .collect::<Vec<_>>()
        .join(" | ");
    table.push_str(&format!("| **total** | {total_row} |\n"));
    // Rows under 1 % of every contender's total are summed into "the rest".
    let mut rest = vec![0.0; splits.len()];
    for row in &rows {
        let values: Vec<f64> = splits
            .iter()
            .map(|(_, _, split)| cost(split, row))
            .collect();
        let small = splits
            .iter()
            .zip(&values)
            .all(|((_, _, split), value)| *value < split.total / 100.0);
        if small {
            for (sum, value) in rest.iter_mut().zip(&values) {
                *sum += value;
            }
            continue;
        }
        let cells: Vec<String> = values.into_iter().map(format).collect();
        table.push_str(&format!("| {row} | {} |\n", cells.join(" | ")));
    }
    let cells: Vec<String> = rest.into_iter().map(format).collect();
    table.push_str(&format!(
        "| the rest (each under 1 %) | {} |\n",
        cells.join(" | ")
    ));
    let sources: Vec<String> = splits.iter().map(|(_, path, _)| path.clone()).collect();
    table.push_str(&format!("\nFrom {}.\n", sources.join(", ")));
    Some(table)
}

/// What each of `ours` would cost with no user-space work at all, the same kernel calls kept:
/// its kernel share, against each of `references`' whole cost, all from the perf files of
/// `kind` (their profiled windows). A ratio here is the lowest any user-space change can reach.
pub(super) fn kernel_floor(
    kind: &str,
    ours: &[&str],
    references: &[&str],
    read: &ReadProfile<'_>,
) -> Option<String> {
    let split = |contender: &str| {
        let (path, text) = read(contender, kind)?;
        Some((path, cost_split(&text)?))
    };
    let references: Vec<(&str, String, CostSplit)> = references
        .iter()
        .filter_map(|name| split(name).map(|(path, split)| (*name, path, split)))
        .collect();
    let mut parts = Vec::new();
    let mut sources = Vec::new();
    for name in ours {
        let Some((path, own)) = split(name) else {
            continue;
        };
        let against: Vec<String> = references
            .iter()
            .filter(|(_, _, reference)| reference.total > 0.0)
            .map(|(reference_name, _, reference)| {
                format!(
                    "{:.2}x {reference_name}'s {:.3}",
                    own.kernel / reference.total,
                    reference.total
                )
            })
            .collect();
        if against.is_empty() {
            continue;
        }
        parts.push(format!(
            "{name} {:.3} of its {:.3} {} in the kernel ({:.0} %): {}",
            own.kernel,
            own.total,
            own.unit,
            100.0 * own.kernel / own.total.max(f64::MIN_POSITIVE),
            against.join(", ")
        ));
        sources.push(path);
    }
    if parts.is_empty() {
        return None;
    }
    sources.extend(references.into_iter().map(|(_, path, _)| path));
    Some(format!(
        "the kernel's part of a relay's CPU (its syscalls with the loopback deliveries they do, and what runs outside them) against the whole CPU of the other relay, in the profiled windows; a relay that makes the same kernel calls cannot go below this ratio by spending less in user space. {}. From {}.",
        parts.join("; "),
        sources.join(", ")
    ))
}

/// Syscalls per MiB moved from a bulk `--profile` strace file, most frequent first; the bytes
/// are the generator's count for the window strace was attached over (its header).
pub(super) fn strace_per_mib(text: &str) -> Option<Vec<(String, f64)>> {
    let header = text.lines().next()?;
    let (before, _) = header.split_once(" GiB moved")?;
    let gib: f64 = before.rsplit(' ').next()?.parse().ok()?;
    let mib = gib * 1024.0;
    if mib <= 0.0 {
        return None;
    }
    let (mut calls, _) = strace_counts(text);
    for call in &mut calls {
        call.1 /= mib;
    }
    calls.sort_by(|a, b| b.1.total_cmp(&a.1));
    (!calls.is_empty()).then_some(calls)
}

/// The rows of an `strace -c` table: each syscall with its count, and the total row's count.
fn strace_counts(text: &str) -> (Vec<(String, f64)>, Option<f64>) {
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
    (calls, total)
}

/// Syscalls per connection from a `--profile` strace file: (total, the top calls with their
/// count per connection). Each relayed connection makes exactly one upstream `connect`, so the
/// `connect` count is the number of connections strace saw (strace attaches after the window
/// opens and slows the relay, so the generator's count would not match).
pub(super) fn strace_per_connection(text: &str) -> Option<(f64, Vec<(String, f64)>)> {
    let (mut calls, total) = strace_counts(text);
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

/// `ours` against `reference` in one figure of this run: the ratio of medians, and whether each
/// median falls inside the other's min-max (then the run cannot tell the two apart).
pub(super) fn versus(figures: &[Figure], name: &str, ours: &str, reference: &str) -> String {
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
    use crate::bench::proxy::{DIRECT, HAPROXY_AUTO, HAPROXY_FORCED, PROXY_CORE};
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
    fn cost_split_charges_each_object_and_syscall_its_share() {
        let text = "# header\n# relay CPU per unit: 80.0 CPU us per connection\n    10.00%  [kernel.kallsyms]  [k] x\ncost object 87.50% [kernel.kallsyms]\ncost object 10.00% tcp_relay\ncost object 2.50% libc.so.6\ncost syscall 50.00% connect\ncost syscall 25.00% close\n";
        let Some(split) = cost_split(text) else {
            panic!("no split parsed");
        };
        assert_eq!(split.unit, "CPU us per connection");
        assert_eq!(split.total, 80.0);
        let get = |name: &str| {
            split
                .lines
                .iter()
                .find(|(row, _)| row == name)
                .map(|(_, cost)| *cost)
        };
        assert_eq!(get("user: tcp_relay"), Some(8.0));
        assert_eq!(get("user: libc.so.6"), Some(2.0));
        assert_eq!(get("kernel: connect"), Some(40.0));
        assert_eq!(get("kernel: close"), Some(20.0));
        // 87.5 % kernel, 75 % of it in syscalls.
        assert_eq!(get("kernel, outside syscalls"), Some(10.0));
        assert!(
            cost_split("cost object 1.00% x\n").is_none(),
            "no unit line"
        );
        assert!(
            cost_split("# relay CPU per unit: 80.0 CPU us per connection\n    10.00%  [kernel.kallsyms]  [k] x\n").is_none(),
            "no cost views"
        );
    }

    #[test]
    fn cost_table_puts_contenders_side_by_side_and_folds_small_rows() {
        let ours = "# relay CPU per unit: 100.0 CPU us per connection\ncost object 90.00% [kernel.kallsyms]\ncost object 9.50% tcp_relay\ncost object 0.50% [vdso]\ncost syscall 60.00% connect\ncost syscall 30.00% close\n";
        let theirs = "# relay CPU per unit: 50.0 CPU us per connection\ncost object 100.00% [kernel.kallsyms]\ncost syscall 100.00% connect\n";
        let read = |contender: &str, _kind: &str| match contender {
            PROXY_CORE => Some(("ours.txt".to_owned(), ours.to_owned())),
            HAPROXY_FORCED => Some(("theirs.txt".to_owned(), theirs.to_owned())),
            _ => None,
        };
        let Some(table) = cost_table(
            "connections.perf",
            &[PROXY_CORE, HAPROXY_AUTO, HAPROXY_FORCED],
            &read,
        ) else {
            panic!("no table");
        };
        assert!(
            table.starts_with(
                "| relay CPU us per connection | proxy-core | haproxy forced splice |"
            ),
            "{table}"
        );
        assert!(
            table.contains("| **total** | **100.0** | **50.0** |"),
            "{table}"
        );
        assert!(
            table.contains("| kernel: connect | 60.0 | 50.0 |"),
            "{table}"
        );
        assert!(
            table.contains("| kernel: close | 30.0 | 0.000 |"),
            "{table}"
        );
        assert!(
            table.contains("| user: tcp_relay | 9.500 | 0.000 |"),
            "{table}"
        );
        // [vdso] is 0.5 % of ours and nothing of theirs: folded.
        assert!(!table.contains("vdso"), "{table}");
        assert!(
            table.contains("| the rest (each under 1 %) | 0.500 | 0.000 |"),
            "{table}"
        );
        assert!(table.contains("From ours.txt, theirs.txt."), "{table}");
        assert!(cost_table("connections.perf", &[HAPROXY_AUTO], &read).is_none());
    }

    #[test]
    fn the_kernel_floor_sets_each_relays_kernel_share_against_the_others_whole_cost() {
        let ours = "# relay CPU per unit: 100.0 CPU us per connection\ncost object 90.00% [kernel.kallsyms]\ncost object 10.00% tcp_relay\ncost syscall 60.00% connect\n";
        let theirs = "# relay CPU per unit: 120.0 CPU us per connection\ncost object 80.00% [kernel.kallsyms]\ncost object 20.00% haproxy\ncost syscall 70.00% connect\n";
        let read = |contender: &str, _kind: &str| match contender {
            PROXY_CORE => Some(("ours.txt".to_owned(), ours.to_owned())),
            HAPROXY_FORCED => Some(("theirs.txt".to_owned(), theirs.to_owned())),
            _ => None,
        };
        let Some(floor) = kernel_floor(
            "connections.perf",
            &[PROXY_CORE, DIRECT],
            &[HAPROXY_FORCED, HAPROXY_AUTO],
            &read,
        ) else {
            panic!("no floor");
        };
        // 90 of 100 in the kernel, against HAProxy's whole 120.
        assert!(
            floor.contains(
                "proxy-core 90.000 of its 100.000 CPU us per connection in the kernel (90 %): 0.75x haproxy forced splice's 120.000"
            ),
            "{floor}"
        );
        assert!(!floor.contains("splice-auto"), "{floor}");
        assert!(floor.ends_with("From ours.txt, theirs.txt."), "{floor}");
        assert!(
            kernel_floor("connections.perf", &[PROXY_CORE], &[HAPROXY_AUTO], &read).is_none(),
            "no reference measured"
        );
    }

    #[test]
    fn strace_counts_per_mib() {
        let text = "# haproxy under Bulk { download: false, streams: 1 }, 5.0 s window: 2.00 GiB moved in the window (3.44 Gbit/s); relay CPU 0.60 s\n% time     seconds  usecs/call     calls    errors syscall\n------ ----------- ----------- --------- --------- ----------------\n 90.00    0.9          68     4096       701 splice\n 10.00    0.1           5      2048           epoll_wait\n------ ----------- ----------- --------- --------- ----------------\n100.00    1.0          55     6144       701 total\n";
        let Some(calls) = strace_per_mib(text) else {
            panic!("no counts parsed");
        };
        assert_eq!(
            calls,
            vec![("splice".to_owned(), 2.0), ("epoll_wait".to_owned(), 1.0)]
        );
        assert!(strace_per_mib("# no amount\n").is_none());
    }
}
