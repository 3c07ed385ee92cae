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
//!
//! [`parse_args`] also takes the rest of Go's flag syntax, as manifests written for the Go
//! originals use it ([`go_arguments`]):
//!
//! * a long flag with one dash (`-upstream-addr=h:6443`, `-leader-elect`) is that long flag;
//! * klog's verbosity (`-v=4`, `--v 2`), which these binaries do not have, is dropped with a
//!   notice on stderr instead of failing the start; `RUST_LOG` sets the log level.

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

/// [`Parser::try_parse_from`] with [`go_bool_flags`] and [`go_arguments`] applied.
pub fn try_parse_args_from<T, I, A>(args: I) -> Result<T, clap::Error>
where
    T: Parser,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let command = go_bool_flags(T::command());
    let (args, notices) = go_arguments(&command, args.into_iter().map(Into::into));
    for notice in notices {
        eprintln!("{}: {notice}", command.get_name());
    }
    let mut matches = command.try_get_matches_from(args)?;
    T::from_arg_matches_mut(&mut matches)
}

/// Rewrites Go's single-dash long flags of `command` to clap's `--flag` and drops klog's `-v`
/// (unless `command` has a `v` flag of its own), returning the arguments and a notice per
/// dropped flag. The program name, arguments after `--`, short flags (`-h`) and unknown words
/// are left as they are, so clap still reports what it does not know.
pub fn go_arguments(
    command: &clap::Command,
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> (Vec<std::ffi::OsString>, Vec<String>) {
    let long = |name: &str| command.get_arguments().any(|a| a.get_long() == Some(name));
    let has_v = long("v");
    let mut out = Vec::new();
    let mut notices = Vec::new();
    let mut args = args.into_iter().peekable();
    out.extend(args.next()); // The program name.
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().map(str::to_owned) else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            out.push(arg);
            out.extend(args.by_ref());
            break;
        }
        let bare = text.trim_start_matches('-');
        let dashes = text.len() - bare.len();
        let (name, value) = match bare.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (bare, None),
        };
        if !has_v && (dashes == 1 || dashes == 2) && name == "v" {
            // `-v 4`: the level is the next word when it is a number.
            let mut dropped = text.clone();
            let level = args
                .peek()
                .and_then(|next| next.to_str())
                .filter(|next| next.parse::<u32>().is_ok())
                .map(str::to_owned);
            if let (None, Some(level)) = (value, level) {
                args.next();
                dropped = format!("{text} {level}");
            }
            notices.push(format!(
                "ignoring klog's {dropped}: this binary has no verbosity flag; set RUST_LOG instead"
            ));
            continue;
        }
        if dashes == 1 && name.len() > 1 && long(name) {
            out.push(format!("-{text}").into());
            continue;
        }
        out.push(arg);
    }
    (out, notices)
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
    fn gos_single_dash_long_flags_are_taken_and_klogs_v_is_dropped() {
        let args = parse(&["-insecure", "-name=go", "-verbose=false"]).unwrap();
        assert!(args.insecure && !args.verbose);
        assert_eq!(args.name, "go");
        let args = parse(&["-v=4", "--name", "n", "--v", "2", "-v", "x"]).unwrap();
        assert_eq!(args.name, "n");
        assert_eq!(
            args.rest,
            ["x"],
            "a word that is no level stays an argument"
        );
        let (_, notices) = go_arguments(
            &<Args as clap::CommandFactory>::command(),
            ["test", "-v=4", "--v", "2"].map(std::ffi::OsString::from),
        );
        assert_eq!(notices.len(), 2, "{notices:?}");
        assert!(notices[1].contains("--v 2"), "{notices:?}");
        // Unknown single-dash words still fail, and after `--` nothing is rewritten.
        assert!(parse(&["-nosuch=1"]).is_err());
        let args = parse(&["--", "-name=x"]).unwrap();
        assert_eq!(
            args.name, "x",
            "the default: the word after `--` is no flag"
        );
        assert_eq!(args.rest, ["-name=x"]);
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
