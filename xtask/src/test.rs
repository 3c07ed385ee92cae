//! `cargo xtask test`: every check CI runs, in order, with a summary at the end.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::test_binaries::TestTotals;

#[derive(clap::Args)]
pub struct Args {
    /// Extra arguments passed to `cargo test` (e.g. a test name filter).
    #[arg(last = true)]
    test_args: Vec<String>,
}

/// Extra environment variables of one step.
type Env<'a> = Vec<(&'a str, &'a str)>;

struct Step {
    name: &'static str,
    duration: Duration,
    ok: bool,
}

/// What the checks run besides the node's packages: HAProxy (pod-proxier's backend, the
/// benchmark peer), umoci (image verification), tinyproxy (the real HTTP proxy of the CONNECT
/// tests).
const TEST_PACKAGES: [&str; 3] = ["haproxy", "umoci", "tinyproxy"];

pub fn run(args: &Args) -> anyhow::Result<()> {
    let root = netkit_testenv::workspace::root();
    let mut steps: Vec<Step> = Vec::new();

    let started = Instant::now();
    // Before anything slow: a machine that cannot get these stops here, naming them.
    let packages = netkit_testenv::debian::install_packages(&TEST_PACKAGES, "cargo xtask test");
    steps.push(Step {
        name: "Debian packages",
        duration: started.elapsed(),
        ok: packages.is_ok(),
    });
    packages?;

    let started = Instant::now();
    // The node tests need kubelet & co., containerd and the node images too.
    let assets = crate::envtest::ensure(&crate::envtest::Args {
        node: true,
        ..crate::envtest::Args::default()
    });
    steps.push(Step {
        name: "envtest and node binaries",
        duration: started.elapsed(),
        ok: assets.is_ok(),
    });
    let assets = assets?;

    let started = Instant::now();
    let helm = crate::tools::ensure_helm();
    steps.push(Step {
        name: "helm",
        duration: started.elapsed(),
        ok: helm.is_ok(),
    });
    let helm = helm?;

    // Built and run by `test_binaries` (two binaries at a time); shown as cargo would run it.
    let test_cmd = vec!["test", "--workspace", "--all-features"];
    let plan: Vec<(&'static str, Vec<&str>, Env<'_>)> = vec![
        (
            "cargo fmt --check",
            vec!["fmt", "--all", "--", "--check"],
            vec![],
        ),
        (
            "CRD YAML up to date",
            vec!["run", "--quiet", "-p", "xtask", "--", "crds", "--check"],
            vec![],
        ),
        (
            "cargo clippy -D warnings",
            vec![
                "clippy",
                "--workspace",
                "--all-targets",
                "--all-features",
                "--",
                "-D",
                "warnings",
            ],
            vec![],
        ),
        (
            "release images (the node tests run them)",
            vec![
                "run",
                "--quiet",
                "-p",
                "xtask",
                "--",
                "verify-images",
                "all",
            ],
            vec![],
        ),
        ("cargo test", test_cmd, vec![]),
        (
            "e2e: the charts on a real node",
            vec!["run", "--quiet", "-p", "xtask", "--", "e2e", "--skip-build"],
            vec![],
        ),
        (
            "cargo doc -D warnings",
            vec!["doc", "--workspace", "--no-deps", "--all-features"],
            vec![("RUSTDOCFLAGS", "-D warnings")],
        ),
        (
            "no import circles (every crate)",
            vec!["run", "--quiet", "-p", "xtask", "--", "modules"],
            vec![],
        ),
        (
            "one rule for errors (cause in source(), not in the message)",
            vec!["run", "--quiet", "-p", "xtask", "--", "errors"],
            vec![],
        ),
        (
            "outside crates on k8s 1.33, 1.35",
            vec!["run", "--quiet", "-p", "xtask", "--", "consumers"],
            vec![],
        ),
        (
            "cargo package (libraries)",
            // The publish rehearsal: each library packaged and built from its archive alone, in
            // dependency order (cargo packages workspace dependencies first and resolves them
            // from the archives it just made). Offline: the earlier steps fetched every
            // dependency; a registry hiccup must not fail a check about our own manifests. The
            // libraries name no Kubernetes version, so the verify build names one as a binary
            // would (k8s-openapi reads this variable).
            vec![
                "package",
                "--offline",
                "--allow-dirty",
                "-p",
                "proxy-core",
                "-p",
                "k8s-reconcile",
                "-p",
                "rstream-client",
            ],
            vec![("K8S_OPENAPI_ENABLED_VERSION", "1.37")],
        ),
        (
            "README flag tables",
            vec!["run", "--quiet", "-p", "xtask", "--", "readme-flags"],
            vec![],
        ),
        (
            "charts and kustomize trees",
            vec!["run", "--quiet", "-p", "xtask", "--", "charts"],
            vec![],
        ),
        (
            // On the node, with the release binaries the image step built.
            "demo (smoke run)",
            vec![
                "run",
                "--quiet",
                "-p",
                "xtask",
                "--",
                "demo",
                "--skip-build",
                "--exit-after-check",
            ],
            vec![],
        ),
    ];
    let images = crate::image::images_dir(&root);
    let mut failed = false;
    let mut totals = TestTotals::default();
    let mut e2e = Checks::default();
    let mut demo = Checks::default();
    for (name, cmd_args, envs) in plan {
        eprintln!("\n==> {name}");
        let started = Instant::now();
        let mut cmd = netkit_testenv::workspace::cargo();
        cmd.args(&cmd_args)
            .envs(envs)
            .env("KUBEBUILDER_ASSETS", &assets)
            .env("NETKIT_RELEASE_IMAGES", &images)
            .env(crate::tools::HELM_ENV, &helm);
        let ok = if cmd_args.first() == Some(&"test") {
            let env = [
                ("KUBEBUILDER_ASSETS", assets.as_os_str()),
                ("NETKIT_RELEASE_IMAGES", images.as_os_str()),
                (crate::tools::HELM_ENV, helm.as_os_str()),
            ];
            let ran = crate::test_binaries::run(&root, &args.test_args, &env, &mut totals)?;
            for name in totals.unexpected_ignored(&ALLOWED_IGNORED) {
                eprintln!(
                    "ignored test not in the allowlist (ALLOWED_IGNORED, xtask/src/test.rs): {name}"
                );
            }
            // A binary that printed no result (killed by a signal, or exited mid-run) and an
            // ignored test nobody allowed each fail the step, whatever cargo's status says.
            ran && totals.unexpected_ignored(&ALLOWED_IGNORED).is_empty()
                && totals.unfinished() == 0
        } else if cmd_args.contains(&"e2e") {
            let run = run_e2e(&mut cmd)?;
            let expected = netkit_testenv::e2e::expected_scenario_count();
            let counted = run.counts.map_or(0, |(passed, failed)| passed + failed);
            // The e2e already fails a chart that skipped a listed scenario; this also catches a
            // run that counted fewer than the lists hold (a chart left out, a closing line lost).
            let complete = counted >= expected;
            if !complete {
                e2e.failures.push(format!(
                    "{}the run counted {counted} scenarios, fewer than the {expected} the charts list",
                    netkit_testenv::e2e::FAILURE_PREFIX
                ));
            }
            e2e.add_e2e(run.status.success() && complete, run.counts);
            e2e.failures.extend(run.failures);
            run.status.success() && complete
        } else {
            let status = cmd.status()?;
            if cmd_args.contains(&"demo") {
                demo.add_run(status.success());
            }
            status.success()
        };
        steps.push(Step {
            name,
            duration: started.elapsed(),
            ok,
        });
        failed |= !ok;
    }

    eprintln!("\n==> summary");
    for step in &steps {
        eprintln!(
            "{:>4}  {:<28} {:>8.1?}",
            if step.ok { "ok" } else { "FAIL" },
            step.name,
            step.duration
        );
    }
    eprintln!(
        "cargo test: {} test binaries, {} passed, {} failed, {} ignored ({} allowed: {})",
        totals.binaries,
        totals.passed,
        totals.failed,
        totals.ignored,
        totals.ignored_names.len() - totals.unexpected_ignored(&ALLOWED_IGNORED).len(),
        ALLOWED_IGNORED
            .iter()
            .map(|(name, _)| *name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    for name in &totals.failed_names {
        eprintln!("cargo test: FAILED {name}");
    }
    for line in &totals.killed {
        eprintln!("cargo test: a test binary ended without a result: {line}");
    }
    if totals.unfinished() > 0 {
        eprintln!(
            "cargo test: {} test binaries started and printed no result; each counts as a failed test",
            totals.unfinished()
        );
    }
    eprintln!(
        "e2e: {} passed, {} failed; demo: {} passed, {} failed",
        e2e.passed, e2e.failed, demo.passed, demo.failed
    );
    // Repeated here because CI keeps the end of a long log: what failed, and why.
    for line in &e2e.failures {
        eprintln!("{line}");
    }
    // The closing line CI reads: every test of every test binary, every e2e scenario and the
    // demo's smoke run, summed.
    println!(
        "tests: {} passed, {} failed",
        totals.passed + e2e.passed + demo.passed,
        totals.failed_with_unfinished() + e2e.failed + demo.failed
    );
    if failed {
        bail!("some checks failed");
    }
    Ok(())
}

/// The only tests that may be ignored, by name, with why: `cargo xtask test` fails on any
/// other (the README promises none).
const ALLOWED_IGNORED: [(&str, &str); 1] = [(
    "client_from_env_child",
    "rstream-client/tests/engine_client.rs: run in a child process by client_from_env_reads_the_process_environment",
)];

/// Passed and failed checks of a step that is not `cargo test`.
#[derive(Default, Debug)]
struct Checks {
    passed: u64,
    failed: u64,
    /// The e2e's `e2e FAIL ...` lines.
    failures: Vec<String>,
}

impl Checks {
    /// The e2e's closing line `e2e: N passed, M failed` (its scenarios); without one, the run
    /// counts as one failure (it stopped before its report).
    fn add_e2e(&mut self, ok: bool, result: Option<(u64, u64)>) {
        match result {
            Some((passed, failed)) => {
                self.passed += passed;
                // A failed run whose scenarios all passed (a restart count, a chart error
                // without scenarios) still counts as a failure.
                self.failed += if ok { failed } else { failed.max(1) };
            }
            None => self.failed += 1,
        }
    }

    /// A run judged by its exit status alone (the demo's smoke run).
    fn add_run(&mut self, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }
}

/// `e2e: N passed, M failed` as (N, M).
fn parse_e2e_line(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("e2e: ")?;
    let (passed, failed) = rest.split_once(", ")?;
    Some((
        passed.strip_suffix(" passed")?.parse().ok()?,
        failed.strip_suffix(" failed")?.parse().ok()?,
    ))
}

/// What an e2e run printed that the summary needs.
struct E2eRun {
    status: std::process::ExitStatus,
    /// Its closing line's counts.
    counts: Option<(u64, u64)>,
    /// Its `e2e FAIL` lines (see `e2e::failure_lines`).
    failures: Vec<String>,
}

/// Runs the e2e, echoing its output.
fn run_e2e(cmd: &mut Command) -> anyhow::Result<E2eRun> {
    use std::io::{BufRead as _, BufReader};
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn()?;
    let mut result = None;
    let mut failures = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            println!("{line}");
            if let Some(counts) = parse_e2e_line(&line) {
                result = Some(counts);
            } else if line.starts_with(netkit_testenv::e2e::FAILURE_PREFIX) {
                failures.push(line);
            }
        }
    }
    Ok(E2eRun {
        status: child.wait()?,
        counts: result,
        failures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(stdout: &str, stderr: &str) -> TestTotals {
        let mut t = TestTotals::default();
        stdout.lines().for_each(|l| t.stdout_line(l));
        stderr.lines().for_each(|l| t.stderr_line(l));
        t
    }

    #[test]
    fn sums_results_and_names_ignored_tests() {
        let t = totals(
            "running 3 tests\n\
             test a ... ok\n\
             test client_from_env_child ... ignored, run by client_from_env_reads_the_process_environment\n\
             test forgotten ... ignored\n\
             test broken ... FAILED\n\
             test result: FAILED. 1 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
             test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s\n",
            "     Running unittests src/lib.rs (target/debug/deps/a-1)\n   Doc-tests a\n",
        );
        assert_eq!((t.binaries, t.passed, t.failed, t.ignored), (2, 5, 1, 2));
        assert_eq!(t.ignored_names, ["client_from_env_child", "forgotten"]);
        assert_eq!(t.failed_names, ["broken"]);
        // The allowed child-process test passes; any other ignored test is named.
        assert_eq!(t.unexpected_ignored(&ALLOWED_IGNORED), ["forgotten"]);
        assert_eq!(t.unfinished(), 0);
        assert_eq!(t.failed_with_unfinished(), 1);
    }

    #[test]
    fn a_binary_killed_by_a_signal_counts_as_failed() {
        let t = totals(
            "running 2 tests\ntest result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
             running 5 tests\ntest one ... ok\n",
            "     Running tests/a.rs (target/debug/deps/a-1)\n\
                  Running tests/b.rs (target/debug/deps/b-2)\n\
             error: test failed, to rerun pass `-p x --test b`\n\n\
             Caused by:\n  process didn't exit successfully: `/w/target/debug/deps/b-2` (signal: 9, SIGKILL: kill)\n",
        );
        assert_eq!((t.passed, t.failed), (2, 0));
        assert_eq!(t.killed.len(), 1);
        assert_eq!(t.unfinished(), 1);
        assert_eq!(t.failed_with_unfinished(), 1);
        // A binary that failed normally printed its result: nothing unfinished.
        let t = totals(
            "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s\n",
            "     Running tests/c.rs (target/debug/deps/c-3)\n\
             Caused by:\n  process didn't exit successfully: `/w/c-3` (exit status: 101)\n",
        );
        assert_eq!((t.unfinished(), t.failed_with_unfinished()), (0, 1));
    }

    #[test]
    fn e2e_and_demo_results_are_counted() {
        assert_eq!(parse_e2e_line("e2e: 17 passed, 2 failed"), Some((17, 2)));
        assert_eq!(parse_e2e_line("e2e failed; see report.md"), None);
        let mut e2e = Checks::default();
        e2e.add_e2e(false, Some((17, 2)));
        assert_eq!((e2e.passed, e2e.failed), (17, 2));
        // Stopped before its closing line: one failure.
        e2e.add_e2e(false, None);
        assert_eq!((e2e.passed, e2e.failed), (17, 3));
        // A failed run whose scenarios all passed (a container restarted) is not a pass.
        let mut e2e = Checks::default();
        e2e.add_e2e(false, Some((5, 0)));
        assert_eq!((e2e.passed, e2e.failed), (5, 1));
        let mut demo = Checks::default();
        demo.add_run(true);
        demo.add_run(false);
        assert_eq!((demo.passed, demo.failed), (1, 1));
    }
}
