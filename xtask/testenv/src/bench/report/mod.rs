//! Figures measured over rounds, their medians and ratios, and how they are printed (Markdown) and
//! stored (JSON).

use std::collections::BTreeMap;

use serde::Serialize;

mod recorder;
mod render;

pub use recorder::Recorder;
pub use render::{markdown, summary_markdown, write_json};

/// What one figure measures.
#[derive(Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub unit: &'static str,
    pub higher_is_better: bool,
}

impl Metric {
    pub const fn higher(name: &'static str, unit: &'static str) -> Self {
        Self {
            name,
            unit,
            higher_is_better: true,
        }
    }

    pub const fn lower(name: &'static str, unit: &'static str) -> Self {
        Self {
            name,
            unit,
            higher_is_better: false,
        }
    }
}

/// One contender's values of a figure: one sample per round.
#[derive(Serialize, Clone)]
pub struct Series {
    pub contender: String,
    pub samples: Vec<f64>,
    /// The round of each sample, when the bench says (pairs rounds across contenders).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<usize>,
    pub median: Option<f64>,
    pub min: Option<f64>,
    pub max: Option<f64>,
    /// `contender median / reference median` for each reference contender of the figure.
    pub ratios: BTreeMap<String, f64>,
    /// Why there is no number, or how the number came about when it was not measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Series {
    fn new(contender: &str) -> Self {
        Self {
            contender: contender.to_owned(),
            samples: Vec::new(),
            rounds: Vec::new(),
            median: None,
            min: None,
            max: None,
            ratios: BTreeMap::new(),
            note: None,
        }
    }
}

/// A figure: every contender's series, and the contenders the ratios are taken against.
#[derive(Serialize, Clone)]
pub struct Figure {
    pub name: String,
    pub unit: String,
    pub higher_is_better: bool,
    pub references: Vec<String>,
    pub series: Vec<Series>,
}

impl Figure {
    /// The median of one contender, if measured.
    pub fn median(&self, contender: &str) -> Option<f64> {
        self.series
            .iter()
            .find(|s| s.contender == contender)
            .and_then(|s| s.median)
    }

    /// `ours / theirs` round by round: samples of the same round, which ran back to back and
    /// shared that moment's load. Rounds are paired by their recorded number, or by position
    /// when neither series records rounds and both have as many samples; otherwise empty.
    pub fn paired_ratios(&self, ours: &str, theirs: &str) -> Vec<f64> {
        let series = |name: &str| self.series.iter().find(|s| s.contender == name);
        let (Some(ours), Some(theirs)) = (series(ours), series(theirs)) else {
            return Vec::new();
        };
        let numbered = |s: &Series| -> Vec<(usize, f64)> {
            if s.rounds.len() == s.samples.len() && !s.rounds.is_empty() {
                s.rounds
                    .iter()
                    .copied()
                    .zip(s.samples.iter().copied())
                    .collect()
            } else {
                s.samples.iter().copied().enumerate().collect()
            }
        };
        let by_round = !ours.rounds.is_empty() || !theirs.rounds.is_empty();
        if !by_round && ours.samples.len() != theirs.samples.len() {
            return Vec::new();
        }
        let theirs = numbered(theirs);
        numbered(ours)
            .into_iter()
            .filter_map(|(round, value)| {
                let (_, base) = theirs.iter().find(|(r, _)| *r == round)?;
                (*base != 0.0).then(|| value / base)
            })
            .collect()
    }
}

/// How a goal came out.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Holds in every round (or, for a goal on one figure, on its median).
    Met,
    /// Fails in every round.
    Missed,
    /// Holds in some rounds and fails in others: the difference is within the run's spread.
    WithinNoise,
    /// Nothing to judge (a figure was not measured).
    NotJudged,
}

impl From<Option<bool>> for Verdict {
    fn from(met: Option<bool>) -> Self {
        match met {
            Some(true) => Self::Met,
            Some(false) => Self::Missed,
            None => Self::NotJudged,
        }
    }
}

/// A bound on a ratio of one contender's figure to another's.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    AtLeast(f64),
    AtMost(f64),
    Below(f64),
}

impl Bound {
    pub fn holds(self, ratio: f64) -> bool {
        match self {
            Self::AtLeast(x) => ratio >= x,
            Self::AtMost(x) => ratio <= x,
            Self::Below(x) => ratio < x,
        }
    }

    /// `>= 0.50x` and the like.
    pub fn relation(self) -> String {
        match self {
            Self::AtLeast(x) => format!(">= {x:.2}x"),
            Self::AtMost(x) => format!("<= {x:.2}x"),
            Self::Below(x) => format!("< {x:.2}x"),
        }
    }
}

/// The verdict on per-round paired ratios: met when `bound` holds for every round's ratio (so
/// even at the unfavourable end of the spread), missed when it holds for none (not even at the
/// favourable end), within noise otherwise; not judged without a ratio.
pub fn verdict_of_rounds(ratios: &[f64], bound: Bound) -> Verdict {
    if ratios.is_empty() {
        return Verdict::NotJudged;
    }
    let holding = ratios.iter().filter(|ratio| bound.holds(**ratio)).count();
    if holding == ratios.len() {
        Verdict::Met
    } else if holding == 0 {
        Verdict::Missed
    } else {
        Verdict::WithinNoise
    }
}

/// How verdicts are reached, for the head of every report.
pub const VERDICT_RULE: &str = "Verdicts: a goal that compares two contenders is judged on the per-round paired ratios (round i of one over round i of the other; a round runs every contender back to back in a random order): met when the bound holds in every round, i.e. even at the unfavourable end of the spread; missed when it fails in every round, even at the favourable end; within noise when some rounds hold and others fail. The measured column gives the median paired ratio with its min–max over rounds (n: rounds paired). Were the true ratio exactly at the bound, all n rounds would fall on one side by chance with probability 2 x 2^-n (1 in 16 at 5 rounds, a sure thing at 1), so met and missed mean something from 5 rounds on; fewer rounds make a smoke run. A goal on one contender's own figure is met or missed on its median.";

/// A goal and how this run came out against it.
#[derive(Serialize, Clone)]
pub struct Goal {
    pub goal: String,
    pub measured: String,
    pub met: Verdict,
}

/// The machine as it was during a bench.
#[derive(Serialize, Clone)]
pub struct Machine {
    pub cpus: usize,
    pub load_at_start: String,
    pub load_at_end: String,
    pub pinning: String,
}

/// Everything one bench measured.
#[derive(Serialize, Clone)]
pub struct Report {
    pub bench: String,
    pub quick: bool,
    pub rounds: usize,
    pub machine: Machine,
    /// Each contender's configuration, by name (what the summary shows next to its figures).
    pub contenders: BTreeMap<String, String>,
    pub figures: Vec<Figure>,
    pub goals: Vec<Goal>,
    pub notes: Vec<String>,
}

impl Series {
    /// Whether the number was derived rather than measured ([`Recorder::model`]).
    pub fn is_model(&self) -> bool {
        self.samples.is_empty() && self.median.is_some()
    }
}

/// A bench's prose from its markdown template (a `*_notes.md` file next to the bench): every
/// `{key}` of `values` filled in, then one note per paragraph with its whitespace folded;
/// paragraphs that start with an HTML comment (the template's own explanation) are left out.
pub fn notes_from(template: &str, values: &[(&str, String)]) -> Vec<String> {
    let mut text = template.to_owned();
    for (key, value) in values {
        text = text.replace(&format!("{{{key}}}"), value);
    }
    text.split("\n\n")
        .filter(|paragraph| !paragraph.trim_start().starts_with("<!--"))
        .map(|paragraph| paragraph.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|paragraph| !paragraph.is_empty())
        .collect()
}

/// The median of ascending values (the mean of the middle two for an even count).
pub fn median_of_sorted(sorted: &[f64]) -> f64 {
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEED: Metric = Metric::higher("speed", "Gbit/s");

    /// The `{key}`s of a template (identifier characters between braces) outside its comments.
    fn placeholders(template: &str) -> Vec<&str> {
        let mut keys = Vec::new();
        let prose = template
            .split("\n\n")
            .filter(|paragraph| !paragraph.trim_start().starts_with("<!--"));
        for mut rest in prose {
            while let Some(open) = rest.find('{') {
                rest = &rest[open + 1..];
                let Some(close) = rest.find('}') else { break };
                let key = &rest[..close];
                if !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    keys.push(key);
                }
            }
        }
        keys
    }

    #[test]
    fn notes_fill_keys_split_paragraphs_and_drop_comments() {
        let template =
            "<!-- how to edit -->\n\nRuns {rounds}\nrounds of {size}.\n\n\nSecond {rounds}.\n";
        let values = [("rounds", "3".to_owned()), ("size", "1 MiB".to_owned())];
        assert_eq!(
            notes_from(template, &values),
            ["Runs 3 rounds of 1 MiB.", "Second 3."]
        );
    }

    /// Every placeholder of each bench's template is a key its bench fills (a `"key",` in
    /// its source), so no note goes out with a `{key}` in it.
    #[test]
    fn every_template_placeholder_is_filled_by_its_bench() {
        let benches = [
            (
                include_str!("../proxy/proxy_notes.md"),
                include_str!("../proxy/goals.rs"),
            ),
            (
                include_str!("../operator_notes.md"),
                include_str!("../operator/mod.rs"),
            ),
            (
                include_str!("../pod_proxier_notes.md"),
                include_str!("../pod_proxier/mod.rs"),
            ),
            (
                include_str!("../steward_notes.md"),
                include_str!("../steward/mod.rs"),
            ),
            (
                include_str!("../rstream/rstream_notes.md"),
                include_str!("../rstream/mod.rs"),
            ),
        ];
        for (template, source) in benches {
            let keys = placeholders(template);
            assert!(!keys.is_empty());
            for key in keys {
                assert!(
                    source.contains(&format!("\"{key}\",")),
                    "{{{key}}} is not filled by its bench"
                );
            }
        }
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median_of_sorted(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median_of_sorted(&[1.0, 2.0, 4.0, 9.0]), 3.0);
    }

    #[test]
    fn ratios_are_taken_against_each_reference_median() {
        let mut recorder = Recorder::default();
        for (direct, relay) in [(10.0, 4.0), (30.0, 6.0), (20.0, 5.0)] {
            recorder.record(SPEED, "direct", direct);
            recorder.record(SPEED, "relay", relay);
        }
        recorder.note(SPEED, "other", "not installed");
        let figures = recorder.finish(&["direct"]);
        let relay = &figures[0].series[1];
        assert_eq!(
            (relay.median, relay.min, relay.max),
            (Some(5.0), Some(4.0), Some(6.0))
        );
        assert_eq!(relay.ratios["vs direct"], 0.25);
        let other = &figures[0].series[2];
        assert!(other.median.is_none() && other.ratios.is_empty());
    }

    #[test]
    fn markdown_shows_notes_instead_of_numbers() {
        let mut recorder = Recorder::default();
        recorder.record(SPEED, "direct", 1.0);
        recorder.note(SPEED, "haproxy", "not installed");
        let report = Report {
            bench: "demo".to_owned(),
            quick: true,
            rounds: 1,
            machine: Machine {
                cpus: 2,
                load_at_start: "load 0".to_owned(),
                load_at_end: "load 0".to_owned(),
                pinning: "none".to_owned(),
            },
            contenders: BTreeMap::new(),
            figures: recorder.finish(&["direct"]),
            goals: Vec::new(),
            notes: Vec::new(),
        };
        let text = markdown(&report);
        assert!(
            text.contains(
                "| speed (Gbit/s, higher is better) | haproxy | — | — | — | — | not installed |"
            ),
            "{text}"
        );
    }

    #[test]
    fn summary_marks_models_and_shows_configurations() {
        let mut recorder = Recorder::default();
        recorder.record(SPEED, "direct", 2.0);
        recorder.record(SPEED, "relay", 1.0);
        recorder.model(SPEED, "seed", 0.5, "model: derived");
        let report = Report {
            bench: "demo".to_owned(),
            quick: false,
            rounds: 1,
            machine: Machine {
                cpus: 2,
                load_at_start: "load 0".to_owned(),
                load_at_end: "load 0".to_owned(),
                pinning: "none".to_owned(),
            },
            contenders: BTreeMap::from([("relay".to_owned(), "one thread".to_owned())]),
            figures: recorder.finish(&["direct"]),
            goals: vec![Goal {
                goal: "relay >= 1.00x direct".to_owned(),
                measured: "0.50x".to_owned(),
                met: Verdict::Missed,
            }],
            notes: vec!["Bound: the loopback path.".to_owned()],
        };
        let text = summary_markdown(&[report], &[]);
        assert!(
            text.contains("| demo | relay >= 1.00x direct | 0.50x | missed |"),
            "{text}"
        );
        assert!(text.contains("\n- Bound: the loopback path.\n"), "{text}");
        assert!(
            text.contains(
                "| demo | speed (Gbit/s) | relay | 1.00 (1.00–1.00) | direct 2.00 | 0.50x |"
            ),
            "{text}"
        );
        assert!(text.contains("| demo | relay | one thread |"), "{text}");
        assert!(text.contains("| seed | 0.500 (model) |"), "{text}");
    }
}
