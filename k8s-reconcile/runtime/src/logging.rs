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

/// `--log-format` and `--log-level`, the logging flags of every binary: flatten them into its
/// arguments with `#[command(flatten)]`, and name their environment variables in the binary
/// (`#[command(mut_arg("log_level", |a| a.env("MY_BINARY_LOG_LEVEL")))]`), since each binary
/// keeps its own prefix.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log level or filter (RUST_LOG wins when set).
    #[arg(long, default_value = "info", value_parser = parse_log_level)]
    pub log_level: String,
}

impl LogArgs {
    /// Installs the global subscriber these flags ask for ([`init_logging`]).
    pub fn init(&self) {
        init_logging(self.log_format, Some(&self.log_level));
    }
}

/// The value parser of every binary's `--log-level`: a level (`info`) or a whole filter
/// (`warn,pod_proxier=debug`). A value the filter parser refuses is a usage error, instead of a
/// silent fall-back to `info`.
pub fn parse_log_level(input: &str) -> Result<String, super::ValueError> {
    let refuse = |reason: String| super::ValueError::LogFilter {
        input: input.to_owned(),
        reason,
    };
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    for directive in input.split(',').map(str::trim) {
        // A bare word is a target to EnvFilter (`loud` would mean "everything of a crate named
        // loud"), which is never what a level flag means: only level names stand alone.
        let bare = !directive.contains(['=', '[']);
        if bare && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(directive)) {
            return Err(refuse(format!(
                "{directive:?} is not a level (trace, debug, info, warn, error, off); \
                 a filter is target=level"
            )));
        }
    }
    EnvFilter::try_new(input)
        .map(|_| input.to_owned())
        .map_err(|e| refuse(e.to_string()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels_and_filters_parse_and_nonsense_is_refused() {
        for good in [
            "info",
            "debug",
            "warn,my_crate=debug",
            "my_crate::module=trace",
        ] {
            assert_eq!(parse_log_level(good).as_deref(), Ok(good));
        }
        for bad in ["loud", "", "info,", "info,=x=y", "my_crate=verbose"] {
            assert!(parse_log_level(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
