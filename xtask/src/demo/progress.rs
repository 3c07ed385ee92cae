//! The step list on stderr: `[3/7] starting pod-proxier ... done in 1.2s`, with a spinner and the
//! elapsed time while a step runs when stderr is a terminal.

use std::future::Future;
use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};

const SPINNER: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

pub struct Progress {
    total: usize,
    current: usize,
    terminal: bool,
}

impl Progress {
    pub fn new(total: usize) -> Self {
        Self {
            total,
            current: 0,
            terminal: std::io::stderr().is_terminal(),
        }
    }

    /// Runs a blocking step (nothing else can run meanwhile, so no spinner).
    pub fn step_blocking<T>(
        &mut self,
        title: &str,
        work: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let started = self.begin(title);
        let result = work();
        self.finish(title, started, &result);
        result.with_context(|| format!("while {title}"))
    }

    /// Runs a step, failing with a message naming it when it errs or outlives `limit`.
    pub async fn step<T>(
        &mut self,
        title: &str,
        limit: Duration,
        work: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        let started = self.begin(title);
        let bounded = tokio::time::timeout(limit, work);
        tokio::pin!(bounded);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut frame = 0;
        let result = loop {
            tokio::select! {
                outcome = &mut bounded => {
                    break outcome.unwrap_or_else(|_| Err(anyhow!("timed out after {limit:?}")));
                }
                _ = tick.tick(), if self.terminal => {
                    frame += 1;
                    self.redraw(title, started, SPINNER[frame % SPINNER.len()]);
                }
            }
        };
        self.finish(title, started, &result);
        result.with_context(|| format!("while {title}"))
    }

    fn prefix(&self, title: &str) -> String {
        format!("[{}/{}] {title} ...", self.current, self.total)
    }

    fn begin(&mut self, title: &str) -> Instant {
        self.current += 1;
        eprint!("{} ", self.prefix(title));
        let _ = std::io::stderr().flush();
        Instant::now()
    }

    fn redraw(&self, title: &str, started: Instant, spinner: char) {
        let elapsed = started.elapsed().as_secs_f64();
        eprint!("\r{} {spinner} {elapsed:.1}s\x1b[K", self.prefix(title));
        let _ = std::io::stderr().flush();
    }

    fn finish<T>(&self, title: &str, started: Instant, result: &anyhow::Result<T>) {
        let elapsed = started.elapsed().as_secs_f64();
        let outcome = match result {
            Ok(_) => format!("done in {elapsed:.1}s"),
            Err(_) => format!("FAILED after {elapsed:.1}s"),
        };
        if self.terminal {
            eprintln!("\r{} {outcome}\x1b[K", self.prefix(title));
        } else {
            eprintln!("{outcome}");
        }
    }
}
