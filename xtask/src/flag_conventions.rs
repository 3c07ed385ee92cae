//! One convention for the flags of every binary, checked on the binaries themselves: the same
//! logging flags with the same defaults, `--kubeconfig` wherever Kubernetes is talked to, Go
//! syntax for durations, and a usage error (exit 2, `error:` naming the flag) for a bad value of
//! any of them. A part of `cargo xtask readme-flags`.

use std::path::Path;
use std::process::Command;

/// A binary and what it needs to get as far as its flags' values (a required flag).
struct Binary {
    name: &'static str,
    required: &'static [&'static str],
    /// A duration flag, to be refused with a unit Go does not know.
    duration: Option<&'static str>,
    /// A listen-address flag.
    listen: &'static str,
    /// Bad configuration beyond single flags: (arguments, what the message must say).
    bad_config: &'static [(&'static [&'static str], &'static str)],
}

const BINARIES: &[Binary] = &[
    Binary {
        name: "steward-tcp-proxy",
        required: &["--upstream-addr=h:1"],
        duration: Some("--drain-timeout"),
        listen: "--metrics-addr",
        bad_config: &[(&["--service-name=Bad_Name"], "not a valid Service name")],
    },
    Binary {
        name: "pod-proxier",
        required: &["--enable-v1"],
        duration: Some("--drain-timeout"),
        listen: "--metrics-addr",
        bad_config: &[(
            &[
                "--enable-v2",
                "--port-range-start=9100",
                "--port-range-end=9000",
            ],
            "--port-range",
        )],
    },
    Binary {
        name: "rstream-operator",
        required: &[],
        duration: Some("--resync-period"),
        listen: "--metrics-bind-address",
        bad_config: &[],
    },
    Binary {
        name: "rstream-agent",
        required: &[],
        duration: None,
        listen: "--health-bind-address",
        bad_config: &[(
            &["--config=/nonexistent/agent.yaml"],
            "/nonexistent/agent.yaml",
        )],
    },
];

/// Flags every binary has, with the default each must show in `--help` (`None`: no default).
const COMMON: &[(&str, Option<&str>)] = &[
    ("--log-level", Some("info")),
    ("--log-format", Some("text")),
    ("--kubeconfig", None),
];

/// Runs the checks against the binaries in `bin_dir`; returns what is wrong, one line each.
pub fn check(bin_dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    for binary in BINARIES {
        let before = problems.len();
        let program = bin_dir.join(binary.name);
        let run = |args: &[&str]| -> anyhow::Result<(Option<i32>, String, String)> {
            let output = Command::new(&program)
                .args(binary.required)
                .args(args)
                // The values under test come from the flags alone.
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .output()?;
            Ok((
                output.status.code(),
                String::from_utf8_lossy(&output.stdout).into_owned(),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            ))
        };
        let (code, help, _) = run(&["--help"])?;
        if code != Some(0) {
            problems.push(format!("{} --help exited {code:?}", binary.name));
            continue;
        }
        for (flag, default) in COMMON {
            match flag_help(&help, flag) {
                None => problems.push(format!("{} has no {flag}", binary.name)),
                Some(text) => {
                    let shown = text
                        .split("[default: ")
                        .nth(1)
                        .and_then(|rest| rest.split(']').next());
                    if shown != *default {
                        problems.push(format!(
                            "{} {flag}: default {shown:?}, the convention is {default:?}",
                            binary.name
                        ));
                    }
                }
            }
        }

        let listen_arg = format!("{}=nope", binary.listen);
        let duration_arg = binary.duration.map(|flag| format!("{flag}=30x"));
        let mut bad: Vec<(Vec<&str>, &str)> = vec![
            (vec!["--log-level=loud"], "--log-level"),
            (vec!["--log-format=xml"], "--log-format"),
            (vec![&listen_arg], binary.listen),
        ];
        if let (Some(flag), Some(arg)) = (binary.duration, &duration_arg) {
            bad.push((vec![arg.as_str()], flag));
        }
        for (args, says) in binary.bad_config {
            bad.push((args.to_vec(), says));
        }
        let mut refused = 0;
        for (args, says) in &bad {
            let (code, _, stderr) = run(args)?;
            if code == Some(2) && stderr.contains("error:") && stderr.contains(says) {
                refused += 1;
            } else {
                let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
                problems.push(format!(
                    "{} {args:?}: exit {code:?} ({first}); the convention is exit 2 with an \
                     `error:` naming {says}",
                    binary.name
                ));
            }
        }
        // Drop-in for Go programs: klog's -v and Go's one-dash long flags do not stop a start.
        let (code, _, stderr) = run(&["-v=3", "-log-level=debug", "--help"])?;
        let go_forms = code == Some(0) && stderr.contains("ignoring klog's -v=3");
        if !go_forms {
            problems.push(format!(
                "{} -v=3 -log-level=debug --help: exit {code:?}, {stderr:?}; klog's -v is ignored \
                 with a notice and Go's one-dash long flags are taken",
                binary.name
            ));
        }
        if problems.len() == before {
            println!(
                "ok   {}: {} common flags with the shared defaults, {refused} bad values refused \
                 with exit 2, Go's -v and one-dash flags taken",
                binary.name,
                COMMON.len()
            );
        }
    }
    Ok(problems)
}

/// The help text of `flag` in clap's long help: from its line to the next flag's.
fn flag_help<'a>(help: &'a str, flag: &str) -> Option<&'a str> {
    let start = help
        .find(&format!("      {flag} "))
        .or_else(|| help.find(&format!("      {flag}\n")))?;
    let rest = &help[start + flag.len() + 6..];
    let end = rest.find("\n      -").unwrap_or(rest.len());
    Some(&rest[..end])
}
