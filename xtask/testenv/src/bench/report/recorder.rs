//! [`Recorder`]: samples collected while a bench runs, turned into figures at its end.

use std::collections::BTreeMap;

use super::{Figure, Metric, Series, median_of_sorted};

/// Collects samples while a bench runs; [`Recorder::finish`] turns them into figures.
#[derive(Default)]
pub struct Recorder {
    figures: Vec<Figure>,
}

impl Recorder {
    /// Adds one round's value of `metric` for `contender`.
    pub fn record(&mut self, metric: Metric, contender: &str, value: f64) {
        self.series(metric, contender).samples.push(value);
    }

    /// [`Self::record`] with the round the value belongs to, so goals can pair rounds even
    /// when a contender has no value in some round.
    pub fn record_round(&mut self, metric: Metric, contender: &str, round: usize, value: f64) {
        let series = self.series(metric, contender);
        series.samples.push(value);
        series.rounds.push(round);
    }

    /// Says why `contender` has no value for `metric` (or how a non-measured value came about).
    pub fn note(&mut self, metric: Metric, contender: &str, note: impl Into<String>) {
        self.series(metric, contender).note = Some(note.into());
    }

    /// A value that was not measured but derived (e.g. from a configured period), with the note
    /// that says so; it has no samples.
    #[cfg_attr(
        not(test),
        expect(
            dead_code,
            reason = "no bench models a figure today; one that must goes through here, so every table marks it"
        )
    )]
    pub fn model(&mut self, metric: Metric, contender: &str, median: f64, note: impl Into<String>) {
        let series = self.series(metric, contender);
        series.median = Some(median);
        series.note = Some(note.into());
    }

    fn series(&mut self, metric: Metric, contender: &str) -> &mut Series {
        let index = match self.figures.iter().position(|f| f.name == metric.name) {
            Some(index) => index,
            None => {
                self.figures.push(Figure {
                    name: metric.name.to_owned(),
                    unit: metric.unit.to_owned(),
                    higher_is_better: metric.higher_is_better,
                    references: Vec::new(),
                    series: Vec::new(),
                });
                self.figures.len() - 1
            }
        };
        let figure = &mut self.figures[index];
        let index = match figure.series.iter().position(|s| s.contender == contender) {
            Some(index) => index,
            None => {
                figure.series.push(Series::new(contender));
                figure.series.len() - 1
            }
        };
        &mut figure.series[index]
    }

    /// Medians, extremes and ratios against `references` (e.g. `["direct", "haproxy"]`).
    pub fn finish(mut self, references: &[&str]) -> Vec<Figure> {
        for figure in &mut self.figures {
            figure.references = references.iter().map(|r| (*r).to_owned()).collect();
            for series in &mut figure.series {
                summarize(series);
            }
            let medians: BTreeMap<String, f64> = figure
                .series
                .iter()
                .filter_map(|s| Some((s.contender.clone(), s.median?)))
                .collect();
            for series in &mut figure.series {
                let Some(median) = series.median else {
                    continue;
                };
                for reference in references {
                    if let Some(base) = medians.get(*reference).filter(|b| **b != 0.0) {
                        series
                            .ratios
                            .insert(format!("vs {reference}"), median / base);
                    }
                }
            }
        }
        self.figures
    }
}

fn summarize(series: &mut Series) {
    if series.samples.is_empty() {
        return;
    }
    let mut sorted = series.samples.clone();
    sorted.sort_by(f64::total_cmp);
    series.median = Some(median_of_sorted(&sorted));
    series.min = sorted.first().copied();
    series.max = sorted.last().copied();
}
