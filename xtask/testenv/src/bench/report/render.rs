//! How reports are printed (Markdown) and stored (JSON).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde::Serialize;

use super::{Report, Series, VERDICT_RULE, Verdict};

/// Compact number formatting: three significant digits for small values, no exponent.
pub fn format_value(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

/// A ratio with two decimals, or two significant digits when it is tiny.
fn format_ratio(ratio: f64) -> String {
    if ratio.abs() >= 0.1 || ratio == 0.0 {
        format!("{ratio:.2}x")
    } else {
        format!("{ratio:.1e}x")
    }
}

fn format_option(value: Option<f64>) -> String {
    value.map(format_value).unwrap_or_else(|| "—".to_owned())
}

/// The bench's Markdown: machine, figures table, goals, notes.
pub fn markdown(report: &Report) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let _ = writeln!(
        out,
        "## bench {}{}\n\n{} CPUs; {}; at start: {}; at end: {}; {} round(s).\n",
        report.bench,
        if report.quick { " (quick)" } else { "" },
        m.cpus,
        m.pinning,
        m.load_at_start,
        m.load_at_end,
        report.rounds
    );
    let mut references: Vec<String> = Vec::new();
    for reference in report.figures.iter().flat_map(|f| &f.references) {
        if !references.contains(reference) {
            references.push(reference.clone());
        }
    }
    let mut header = "| figure | contender | median | min | max |".to_owned();
    let mut rule = "|---|---|---:|---:|---:|".to_owned();
    for reference in &references {
        let _ = write!(header, " vs {reference} |");
        rule.push_str("---:|");
    }
    header.push_str(" note |");
    rule.push_str("---|");
    let _ = writeln!(out, "{header}\n{rule}");
    for figure in &report.figures {
        for series in &figure.series {
            let mut row = format!(
                "| {} ({}{}) | {} | {} | {} | {} |",
                figure.name,
                figure.unit,
                if figure.higher_is_better {
                    ", higher is better"
                } else {
                    ""
                },
                series.contender,
                shown_median(series),
                format_option(series.min),
                format_option(series.max)
            );
            for reference in &references {
                let ratio = series.ratios.get(&format!("vs {reference}")).copied();
                let shown = if series.contender == *reference {
                    "—".to_owned()
                } else {
                    ratio.map(format_ratio).unwrap_or_else(|| "—".to_owned())
                };
                let _ = write!(row, " {shown} |");
            }
            let _ = writeln!(row, " {} |", series.note.as_deref().unwrap_or(""));
            out.push_str(&row);
        }
    }
    if !report.contenders.is_empty() {
        let _ = writeln!(out, "\n| contender | configuration |\n|---|---|");
        for (contender, configuration) in &report.contenders {
            let _ = writeln!(out, "| {contender} | {configuration} |");
        }
    }
    goals_and_notes(report, &mut out);
    out
}

/// The goals table (met or not) and the notes: method, machine, and what bounds a missed goal.
fn goals_and_notes(report: &Report, out: &mut String) {
    if !report.goals.is_empty() {
        let _ = writeln!(
            out,
            "\n{VERDICT_RULE}\n\n| goal | measured | verdict |\n|---|---|---|"
        );
        for goal in &report.goals {
            let met = met_text(goal.met);
            let _ = writeln!(out, "| {} | {} | {met} |", goal.goal, goal.measured);
        }
    }
    if !report.notes.is_empty() {
        out.push('\n');
        for note in &report.notes {
            let _ = writeln!(out, "- {note}");
        }
    }
}

/// The median as shown in tables: a derived number says "model" next to it.
fn shown_median(series: &Series) -> String {
    let median = format_option(series.median);
    if series.is_model() {
        format!("{median} (model)")
    } else {
        median
    }
}

/// Every bench in one file: each goal with its status (computed from the figures, never typed),
/// then one table of every contender's figure with its baseline in the same run and the ratio,
/// each contender's configuration, and per bench how it ran and its notes. A figure that is a
/// model says so.
pub fn summary_markdown(reports: &[Report], failures: &[(String, String)]) -> String {
    let mut out = String::from("# cargo xtask bench\n\n");
    let _ = writeln!(
        out,
        "Medians of alternated rounds with min–max; ratios against the first baseline of the figure measured in the same run. A number marked (model) was derived, not measured. Each goal's status below is computed from the figures of this run.\n"
    );
    let _ = writeln!(
        out,
        "## Goals\n\n{VERDICT_RULE}\n\n| bench | goal | measured | verdict |\n|---|---|---|---|"
    );
    for report in reports {
        for goal in &report.goals {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                report.bench,
                goal.goal,
                goal.measured,
                met_text(goal.met)
            );
        }
    }
    let _ = writeln!(
        out,
        "\n## Figures\n\n| bench | figure | contender | median (min–max) | baseline | ratio |\n|---|---|---|---:|---|---:|"
    );
    for report in reports {
        for figure in &report.figures {
            for series in &figure.series {
                // The first reference with a number other than the contender itself.
                let baseline = figure
                    .references
                    .iter()
                    .find(|r| **r != series.contender && figure.median(r).is_some());
                let (baseline_text, ratio) = match baseline {
                    Some(baseline) => (
                        format!("{baseline} {}", format_option(figure.median(baseline))),
                        series
                            .ratios
                            .get(&format!("vs {baseline}"))
                            .map(|r| format_ratio(*r))
                            .unwrap_or_else(|| "—".to_owned()),
                    ),
                    None => ("—".to_owned(), "—".to_owned()),
                };
                let range = match (series.min, series.max) {
                    (Some(min), Some(max)) => {
                        format!(" ({}–{})", format_value(min), format_value(max))
                    }
                    _ => String::new(),
                };
                let mut value = format!("{}{range}", shown_median(series));
                if series.median.is_none()
                    && let Some(note) = &series.note
                {
                    value = note.clone();
                }
                let _ = writeln!(
                    out,
                    "| {} | {} ({}) | {} | {value} | {baseline_text} | {ratio} |",
                    report.bench, figure.name, figure.unit, series.contender,
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "\n## Contenders\n\n| bench | contender | configuration |\n|---|---|---|"
    );
    for report in reports {
        for (contender, configuration) in &report.contenders {
            let _ = writeln!(out, "| {} | {contender} | {configuration} |", report.bench);
        }
    }
    // Per bench: how it ran and the notes that say how each figure was taken and, where a
    // profile backs it, what bounds it.
    for report in reports {
        let _ = writeln!(
            out,
            "\n## {}{}\n\n{} round(s); {}; {} → {}",
            report.bench,
            if report.quick { " (quick)" } else { "" },
            report.rounds,
            report.machine.pinning,
            report.machine.load_at_start,
            report.machine.load_at_end
        );
        if !report.notes.is_empty() {
            out.push('\n');
            for note in &report.notes {
                let _ = writeln!(out, "- {note}");
            }
        }
    }
    for (bench, error) in failures {
        let _ = writeln!(out, "\n**{bench} failed:** {error}");
    }
    out
}

fn met_text(met: Verdict) -> &'static str {
    match met {
        Verdict::Met => "met",
        Verdict::Missed => "missed",
        Verdict::WithinNoise => "within noise",
        Verdict::NotJudged => "not judged",
    }
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
