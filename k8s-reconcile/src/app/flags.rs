//! Go's flag syntax for boolean flags, so a binary replacing a Go program takes its arguments as
//! they are.
//!
//! clap's `bool` flags take no value: `--upstream-insecure=true`, as Go programs are often
//! called, exits with a usage error. [`go_bool_flags`] turns every such flag of a command into
//! Go's form:
//!
//! * `--flag` alone means true;
//! * `--flag=value` sets the value, spelled as [`parse_go_bool`] takes it (`true`, `false`, `1`,
//!   `0`, `t`, `f`, `TRUE`, ...);
//! * `--flag value` (with a space) is *not* a value: as in Go, `--flag` is true and `value` is
//!   the next argument, so a following flag or positional argument is never swallowed;
//! * the flag's environment variable, if any, takes the same spellings.
//!
//! A binary parses with [`parse_args`] instead of `Parser::parse`; the `Args` struct keeps its
//! plain `#[arg(long)] flag: bool` fields.

use clap::{ArgAction, Parser};

use super::values::parse_go_bool;

/// Rewrites every value-less `bool` flag (clap's `SetTrue`) of `command` to Go's syntax; see the
/// [module docs](self).
pub fn go_bool_flags(command: clap::Command) -> clap::Command {
    command.mut_args(|arg| {
        if !matches!(arg.get_action(), ArgAction::SetTrue) {
            return arg;
        }
        arg.action(ArgAction::Set)
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .default_value("false")
            .value_name("BOOL")
            .value_parser(|value: &str| parse_go_bool(value))
    })
}

/// [`Parser::try_parse_from`] with [`go_bool_flags`] applied.
pub fn try_parse_args_from<T, I, A>(args: I) -> Result<T, clap::Error>
where
    T: Parser,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let mut matches = go_bool_flags(T::command()).try_get_matches_from(args)?;
    T::from_arg_matches_mut(&mut matches)
}

/// [`Parser::parse`] with [`go_bool_flags`] applied: parses the process's arguments, and on an
/// error prints it (or the help) and exits as clap does.
pub fn parse_args<T: Parser>() -> T {
    try_parse_args_from(std::env::args_os()).unwrap_or_else(|err| err.exit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Parser)]
    struct Args {
        #[arg(long, env = "FLAGS_TEST_INSECURE")]
        insecure: bool,
        #[arg(long)]
        verbose: bool,
        #[arg(long, default_value = "x")]
        name: String,
        rest: Vec<String>,
    }

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        try_parse_args_from(std::iter::once("test").chain(args.iter().copied()))
    }

    #[test]
    fn every_go_form_is_taken() {
        let args = parse(&[]).unwrap();
        assert!(!args.insecure && !args.verbose);
        assert!(parse(&["--insecure"]).unwrap().insecure);
        for yes in ["true", "1", "t", "T", "TRUE", "True"] {
            assert!(
                parse(&[&format!("--insecure={yes}")]).unwrap().insecure,
                "{yes}"
            );
        }
        for no in ["false", "0", "f", "F", "FALSE", "False"] {
            assert!(
                !parse(&[&format!("--insecure={no}")]).unwrap().insecure,
                "{no}"
            );
        }
        let args = parse(&["--insecure=false", "--verbose", "--name", "n"]).unwrap();
        assert!(!args.insecure && args.verbose);
        assert_eq!(args.name, "n");
    }

    #[test]
    fn a_space_separated_word_is_not_the_flags_value() {
        // As in Go: `--insecure false` is `--insecure` (true) followed by the argument `false`.
        let args = parse(&["--insecure", "false"]).unwrap();
        assert!(args.insecure);
        assert_eq!(args.rest, ["false"]);
        // The next flag is never taken as the value.
        let args = parse(&["--insecure", "--verbose"]).unwrap();
        assert!(args.insecure && args.verbose);
    }

    #[test]
    fn a_bad_value_is_a_clear_error() {
        let err = parse(&["--insecure=maybe"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        let text = err.to_string();
        assert!(text.contains("--insecure"), "{text}");
        assert!(text.contains("\"maybe\" is not a boolean"), "{text}");
    }
}
