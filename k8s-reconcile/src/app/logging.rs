//! Logging set-up, decided once for every binary.
//!
//! Logs go to stderr: stdout stays free for what a command prints (`crd`, `openapi`, ...), and
//! container runtimes collect both. The filter is `RUST_LOG` when it is set and valid, else the
//! binary's level flag, else `info`, so an operator can always turn one module up without
//! touching the Deployment's flags.

use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, event fields at the top level.
    Json,
}

/// The filter: `RUST_LOG`, else `level`, else `info`.
pub fn filter(level: Option<&str>) -> EnvFilter {
    EnvFilter::try_from_default_env()
        .ok()
        .or_else(|| level.and_then(|level| EnvFilter::try_new(level).ok()))
        .unwrap_or_else(|| EnvFilter::new("info"))
}

/// Installs the global subscriber. A second call (tests that start a binary's `run` twice) keeps
/// the first subscriber.
pub fn init_logging(format: LogFormat, level: Option<&str>) {
    let stderr = std::io::stderr();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(level))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&stderr));
    let installed = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
    // Only a second installation fails; the first one stays in place.
    drop(installed);
}
