//! What an e2e run reports: each chart's scenarios, restarts and error, the markdown report and
//! the one-line failures `cargo xtask test` repeats in its summary.

use std::fmt::Write as _;
use std::time::Instant;

use serde::Serialize;

/// One scenario's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    pub name: String,
    pub ok: bool,
    pub took_ms: u128,
    pub detail: String,
}

/// A container's restart count at the end of its chart's run.
#[derive(Debug, Clone, Serialize)]
pub struct Restarts {
    /// The Pod.
    pub pod: String,
    /// The container.
    pub container: String,
    /// Its restart count.
    pub restarts: i32,
}

/// Everything measured for one chart.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ChartReport {
    /// The chart's name.
    pub chart: String,
    /// The namespace it was installed in.
    pub namespace: String,
    /// From `helm install` to every Pod Ready.
    pub install_to_ready_ms: Option<u128>,
    /// Each scenario with its result.
    pub scenarios: Vec<Scenario>,
    /// Every container's restart count at the end.
    pub restarts: Vec<Restarts>,
    /// Why the chart's run stopped before its scenarios, if it did.
    pub error: Option<String>,
}

impl ChartReport {
    pub(super) fn new(chart: &str) -> Self {
        Self {
            chart: chart.to_owned(),
            ..Self::default()
        }
    }

    /// Records a scenario; its detail is printed at once.
    pub(super) fn record(&mut self, name: &str, ok: bool, started: Instant, detail: String) {
        let took = started.elapsed();
        println!(
            "  {} {:>8.1?}  {name}: {detail}",
            if ok { "ok  " } else { "FAIL" },
            took
        );
        self.scenarios.push(Scenario {
            name: name.to_owned(),
            ok,
            took_ms: took.as_millis(),
            detail,
        });
    }

    /// Holds the run to the chart's list of scenarios: each expected scenario that did not run
    /// (the chart stopped before it) counts as failed, and so does one the list does not name
    /// (the list must say what the run checks). A run that executed fewer scenarios than the list
    /// can therefore never pass.
    pub fn expect(&mut self, expected: &[String]) {
        let unlisted: Vec<String> = (self.scenarios.iter())
            .filter(|s| !expected.contains(&s.name))
            .map(|s| s.name.clone())
            .collect();
        let missing: Vec<String> = (expected.iter())
            .filter(|name| !self.scenarios.iter().any(|s| &s.name == *name))
            .cloned()
            .collect();
        for name in missing {
            self.scenarios.push(Scenario {
                name,
                ok: false,
                took_ms: 0,
                detail: "did not run".to_owned(),
            });
        }
        for name in unlisted {
            self.scenarios.push(Scenario {
                name: format!("{name} (not in this chart's SCENARIOS list)"),
                ok: false,
                took_ms: 0,
                detail: "a scenario the e2e does not expect: add it to the chart's SCENARIOS"
                    .to_owned(),
            });
        }
    }

    /// Whether every scenario passed and the chart ended without an error.
    pub fn passed(&self) -> bool {
        self.error.is_none()
            && self.scenarios.iter().all(|s| s.ok)
            && self.restarts.iter().all(|r| r.restarts == 0)
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Report {
    pub(super) passed: bool,
    pub(super) wall_ms: u128,
    pub(super) cluster_start_ms: u128,
    pub(super) charts: Vec<ChartReport>,
}

/// The whole run, as `report.json` holds it.
/// How a line naming one failure starts; `cargo xtask test` repeats these lines in its summary.
pub const FAILURE_PREFIX: &str = "e2e FAIL ";

/// One line per failed scenario, chart error and restarted container, each cut to a length a
/// CI log keeps.
pub(super) fn failure_lines(report: &Report) -> Vec<String> {
    const KEEP: usize = 600;
    let cut = |text: &str| -> String {
        match text.char_indices().nth(KEEP) {
            Some((at, _)) => format!("{} [...]", &text[..at]),
            None => text.to_owned(),
        }
    };
    let mut lines = Vec::new();
    for chart in &report.charts {
        let name = &chart.chart;
        if let Some(error) = &chart.error {
            lines.push(format!("{FAILURE_PREFIX}{name}: stopped: {}", cut(error)));
        }
        for s in chart.scenarios.iter().filter(|s| !s.ok) {
            lines.push(format!(
                "{FAILURE_PREFIX}{name}: {}: {}",
                cut(&s.name),
                cut(&s.detail)
            ));
        }
        for r in chart.restarts.iter().filter(|r| r.restarts > 0) {
            lines.push(format!(
                "{FAILURE_PREFIX}{name}: {}/{} restarted {} times",
                r.pod, r.container, r.restarts
            ));
        }
    }
    lines
}

pub(super) fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# e2e: the charts on a real node\n");
    let _ = writeln!(
        md,
        "Result: **{}**; wall time {:.1} s (control plane and node start {:.1} s).\n",
        if report.passed { "passed" } else { "FAILED" },
        report.wall_ms as f64 / 1000.0,
        report.cluster_start_ms as f64 / 1000.0
    );
    for chart in &report.charts {
        let _ = writeln!(md, "## {} (namespace `{}`)\n", chart.chart, chart.namespace);
        match chart.install_to_ready_ms {
            Some(ms) => {
                let _ = writeln!(md, "Install to Ready: {:.1} s\n", ms as f64 / 1000.0);
            }
            None => {
                let _ = writeln!(md, "Install to Ready: not reached\n");
            }
        }
        if let Some(error) = &chart.error {
            let _ = writeln!(md, "Stopped by an error: `{error}`\n");
        }
        let _ = writeln!(
            md,
            "| Scenario | Result | Time | Detail |\n|---|---|---|---|"
        );
        for s in &chart.scenarios {
            let _ = writeln!(
                md,
                "| {} | {} | {:.2} s | {} |",
                s.name,
                if s.ok { "ok" } else { "FAILED" },
                s.took_ms as f64 / 1000.0,
                s.detail.replace('|', "\\|").replace('\n', " ")
            );
        }
        let _ = writeln!(md, "\n| Pod | Container | Restarts |\n|---|---|---|");
        for r in &chart.restarts {
            let _ = writeln!(md, "| {} | {} | {} |", r.pod, r.container, r.restarts);
        }
        let _ = writeln!(md);
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_missing_or_unlisted_scenario_fails_the_chart() {
        let started = Instant::now();
        let mut chart = ChartReport::new("steward-tcp-proxy");
        chart.record("a", true, started, String::new());
        chart.record("b", true, started, String::new());
        chart.expect(&names(&["a", "b"]));
        assert!(chart.passed());
        assert_eq!(chart.scenarios.len(), 2);

        // Stopped after "a": "b" did not run and counts as failed.
        let mut chart = ChartReport::new("steward-tcp-proxy");
        chart.record("a", true, started, String::new());
        chart.expect(&names(&["a", "b"]));
        assert!(!chart.passed());
        let failed: Vec<&str> = (chart.scenarios.iter())
            .filter(|s| !s.ok)
            .map(|s| s.name.as_str())
            .collect();
        assert_eq!(failed, ["b"]);

        // A scenario the list does not name fails too, so the list stays the truth.
        let mut chart = ChartReport::new("steward-tcp-proxy");
        chart.record("a", true, started, String::new());
        chart.record("c", true, started, String::new());
        chart.expect(&names(&["a"]));
        assert!(!chart.passed());
        assert_eq!(chart.scenarios.iter().filter(|s| !s.ok).count(), 1);
    }

    #[test]
    fn every_failure_is_one_line_and_passes_are_none() {
        let mut chart = ChartReport::new("pod-proxier");
        let started = Instant::now();
        chart.record("echo", true, started, "fine".to_owned());
        chart.record("expiry", false, started, "é".repeat(700));
        chart.restarts = vec![
            Restarts {
                pod: "p".to_owned(),
                container: "c".to_owned(),
                restarts: 2,
            },
            Restarts {
                pod: "q".to_owned(),
                container: "c".to_owned(),
                restarts: 0,
            },
        ];
        chart.error = Some("helm install: timed out".to_owned());
        let report = Report {
            passed: false,
            wall_ms: 0,
            cluster_start_ms: 0,
            charts: vec![chart],
        };
        let lines = failure_lines(&report);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(
            lines[0],
            "e2e FAIL pod-proxier: stopped: helm install: timed out"
        );
        assert!(lines[1].starts_with("e2e FAIL pod-proxier: expiry: éé"));
        assert!(lines[1].ends_with("é [...]"), "cut at 600 characters");
        assert_eq!(lines[1].chars().filter(|c| *c == 'é').count(), 600);
        assert_eq!(lines[2], "e2e FAIL pod-proxier: p/c restarted 2 times");
    }
}
