//! The `cargo test` step of `cargo xtask test`: every test binary built once, then run two at a
//! time instead of one after another.
//!
//! Most test binaries spend their time waiting (a kube-apiserver starting, a lease expiring, a
//! TTL running out), so running two at once uses the second CPU that `cargo test` leaves idle.
//! Each binary runs as `cargo test` would run it (in its package's folder, with the arguments
//! after `--`), and its whole output is printed when it ends, so logs never interleave. The
//! binaries that need the machine's one test node run one after another in a single job (they
//! would only wait for each other's lock). The longest binaries of the last run start first
//! (`<target>/test-durations.json`), so the two workers end close together.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// How many test binaries run at once.
const WORKERS: usize = 2;

/// Test binaries that start the machine's one test node (`ControlPlane::builder().node()`).
const NODE_BINARIES: [&str; 2] = [
    "k8s-reconcile tests/node.rs",
    "k8s-reconcile tests/node_teardown.rs",
];

/// One program run of a job: a test binary, or the doc-tests.
struct Run {
    /// What the output header calls it, e.g. `steward-tcp-proxy tests/chaos.rs`.
    label: String,
    command: Command,
}

/// Builds every test binary of the workspace, then runs them and the doc-tests [`WORKERS`] at a
/// time, echoing each one's output when it ends and summing the results into `totals`. Returns
/// whether every build and run succeeded.
pub fn run(
    root: &Path,
    test_args: &[String],
    env: &[(&str, &std::ffi::OsStr)],
    totals: &mut TestTotals,
) -> anyhow::Result<bool> {
    let base = || {
        let mut cmd = netkit_testenv::workspace::cargo();
        cmd.args(["test", "--workspace", "--all-features"])
            .envs(env.iter().copied());
        cmd
    };
    let started = Instant::now();
    let mut build = base();
    build
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .stdout(Stdio::piped());
    let output = build
        .spawn()
        .context("running cargo test --no-run")?
        .wait_with_output()?;
    let binaries = test_binaries(&String::from_utf8_lossy(&output.stdout), root);
    eprintln!(
        "built {} test binaries in {:.1?}",
        binaries.len(),
        started.elapsed()
    );
    if !output.status.success() {
        eprintln!("cargo test --no-run failed ({})", output.status);
        return Ok(false);
    }

    let mut runs = Vec::new();
    for binary in binaries {
        let command = || {
            let mut command = Command::new(&binary.executable);
            command
                .current_dir(&binary.package_dir)
                .args(test_args)
                .envs(env.iter().copied())
                // As `cargo test` runs it.
                .env("CARGO_MANIFEST_DIR", &binary.package_dir)
                .env("CARGO_PKG_NAME", &binary.package);
            command
        };
        if let Some(path) = other_data_path(&binary) {
            // proxy-core's server tests run on the data path this variable names: both are
            // product paths, so both pass every test.
            let mut again = command();
            again.env(DATA_PATH_VAR, path);
            runs.push(Run {
                label: format!("{} ({DATA_PATH_VAR}={path})", binary.label),
                command: again,
            });
        }
        runs.push(Run {
            label: binary.label.clone(),
            command: command(),
        });
    }
    let mut doc = base();
    doc.args(["--doc", "--no-fail-fast"]);
    if !test_args.is_empty() {
        doc.arg("--").args(test_args);
    }
    runs.push(Run {
        label: "doc-tests".to_owned(),
        command: doc,
    });

    let durations_file = netkit_testenv::workspace::target_dir(root).join("test-durations.json");
    let last: BTreeMap<String, f64> = std::fs::read(&durations_file)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default();
    let jobs = plan(runs, &last);

    let queue = Mutex::new(jobs);
    let results = Mutex::new(Results::default());
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            scope.spawn(|| worker(&queue, &results));
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *totals = results.totals;
    // A filtered run says nothing about the durations of a whole one.
    if test_args.is_empty() {
        let _ = std::fs::write(
            &durations_file,
            serde_json::to_vec_pretty(&results.durations).unwrap_or_default(),
        );
    }
    Ok(results.failed_runs == 0)
}

/// Names the data path proxy-core's server tests run on (its `tests/common`).
const DATA_PATH_VAR: &str = "PROXY_CORE_TEST_DATA_PATH";

/// The data path a proxy-core integration test binary runs on a second time: the one that is
/// not the default. Not for `tests/event_loop.rs`, which always uses the event loop.
fn other_data_path(binary: &TestBinary) -> Option<&'static str> {
    let integration = binary.label.starts_with("proxy-core tests/")
        && !binary.label.ends_with("tests/event_loop.rs");
    let other = match proxy_core::server::DataPath::default() {
        proxy_core::server::DataPath::Tokio => "event-loop",
        _ => "tokio",
    };
    (integration && cfg!(target_os = "linux")).then_some(other)
}

/// A test binary as `cargo test --no-run` reported it.
struct TestBinary {
    label: String,
    package: String,
    package_dir: PathBuf,
    executable: PathBuf,
}

/// The test executables among cargo's JSON messages (`profile.test` artifacts with an
/// executable), in the order cargo reported them.
fn test_binaries(messages: &str, root: &Path) -> Vec<TestBinary> {
    let mut found = Vec::new();
    for line in messages.lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let (Some(executable), Some(manifest)) = (
            message["executable"].as_str(),
            message["manifest_path"].as_str(),
        ) else {
            continue;
        };
        let package_dir = Path::new(manifest).parent().unwrap_or(root).to_path_buf();
        let package = package_name(&message["package_id"]);
        let source = message["target"]["src_path"].as_str().unwrap_or_default();
        let source = Path::new(source)
            .strip_prefix(&package_dir)
            .map_or_else(|_| source.to_owned(), |p| p.display().to_string());
        found.push(TestBinary {
            label: format!("{package} {source}"),
            package,
            package_dir,
            executable: PathBuf::from(executable),
        });
    }
    found
}

/// The package name of a cargo package id (`path+file:///w/steward-tcp-proxy#0.1.0`,
/// `path+file:///w/xtask/testbox#netkit-testbox@0.1.0`).
fn package_name(id: &serde_json::Value) -> String {
    let id = id.as_str().unwrap_or_default();
    let (path, fragment) = id.rsplit_once('#').unwrap_or((id, ""));
    match fragment.split_once('@') {
        Some((name, _)) => name.to_owned(),
        None => path.rsplit('/').next().unwrap_or(path).to_owned(),
    }
}

/// The jobs in the order they start: the node binaries chained into one job, then longest
/// first by the last run's durations (a binary never timed counts as the longest).
fn plan(runs: Vec<Run>, last: &BTreeMap<String, f64>) -> VecDeque<Vec<Run>> {
    let (node, other): (Vec<Run>, Vec<Run>) = runs
        .into_iter()
        .partition(|run| NODE_BINARIES.contains(&run.label.as_str()));
    let mut jobs: Vec<Vec<Run>> = other.into_iter().map(|run| vec![run]).collect();
    if !node.is_empty() {
        jobs.push(node);
    }
    let expected = |job: &Vec<Run>| -> f64 {
        job.iter()
            .map(|run| last.get(&run.label).copied().unwrap_or(f64::INFINITY))
            .sum()
    };
    jobs.sort_by(|a, b| expected(b).total_cmp(&expected(a)));
    jobs.into()
}

#[derive(Default)]
struct Results {
    totals: TestTotals,
    durations: BTreeMap<String, f64>,
    /// Runs that could not start or did not exit 0.
    failed_runs: usize,
}

fn worker(queue: &Mutex<VecDeque<Vec<Run>>>, results: &Mutex<Results>) {
    loop {
        let job = queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop_front();
        let Some(job) = job else {
            return;
        };
        for mut run in job {
            eprintln!("     Running {}", run.label);
            let started = Instant::now();
            let output = run
                .command
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .output();
            let took = started.elapsed();
            let mut results = results
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            report(&mut results, &run.label, took, output);
        }
    }
}

/// Prints one run's output under a header and folds its results into `results`.
fn report(
    results: &mut Results,
    label: &str,
    took: Duration,
    output: std::io::Result<std::process::Output>,
) {
    let output = match output {
        Ok(output) => output,
        Err(err) => {
            eprintln!("==> {label}: could not run: {err}");
            results.totals.started += 1;
            results.failed_runs += 1;
            return;
        }
    };
    eprintln!(
        "==> {label} ended in {took:.1?} ({}), its output:",
        describe(output.status)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    for line in stdout.lines() {
        println!("{line}");
        results.totals.stdout_line(line);
    }
    for line in stderr.lines() {
        eprintln!("{line}");
    }
    if label == "doc-tests" {
        // cargo's own lines name each library whose doc-tests ran.
        stderr
            .lines()
            .for_each(|line| results.totals.stderr_line(line));
    } else {
        results.totals.started += 1;
        if let Some(signal) = signal(output.status) {
            results.totals.killed.push(format!(
                "process didn't exit successfully: {label} (signal: {signal})"
            ));
        }
    }
    results
        .durations
        .insert(label.to_owned(), took.as_secs_f64());
    if !output.status.success() {
        results.failed_runs += 1;
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), signal(status)) {
        (Some(0), _) => "ok".to_owned(),
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

fn signal(status: ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt as _;
    status.signal()
}

/// What the `cargo test` output said, summed over its test binaries.
#[derive(Default, Debug)]
pub(crate) struct TestTotals {
    /// Test binaries (and doc-test runs) cargo started.
    pub(crate) started: u64,
    /// `test result:` lines seen: test binaries that finished.
    pub(crate) binaries: u64,
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) ignored: u64,
    /// The names of the ignored tests.
    pub(crate) ignored_names: Vec<String>,
    /// The names of the failed tests.
    pub(crate) failed_names: Vec<String>,
    /// cargo's lines about a test binary killed by a signal.
    pub(crate) killed: Vec<String>,
}

impl TestTotals {
    /// One line of `cargo test`'s standard output (the test binaries' own).
    pub(crate) fn stdout_line(&mut self, line: &str) {
        if let Some(result) = line.strip_prefix("test result: ") {
            self.binaries += 1;
            for part in result.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(label), Some(count)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(count) = count.parse::<u64>() else {
                    continue;
                };
                match label {
                    "passed" => self.passed += count,
                    "failed" => self.failed += count,
                    "ignored" => self.ignored += count,
                    _ => {}
                }
            }
        } else if let Some(rest) = line.strip_prefix("test ")
            && let Some((name, outcome)) = rest.split_once(" ... ")
            && (outcome == "ignored" || outcome.starts_with("ignored,"))
        {
            self.ignored_names.push(name.to_owned());
        } else if let Some(rest) = line.strip_prefix("test ")
            && let Some(name) = rest.strip_suffix(" ... FAILED")
        {
            self.failed_names.push(name.to_owned());
        }
    }

    /// One line of `cargo test`'s standard error (cargo's own).
    pub(crate) fn stderr_line(&mut self, line: &str) {
        let trimmed = line.trim_start();
        if trimmed.starts_with("Running ") || trimmed.starts_with("Doc-tests ") {
            self.started += 1;
        } else if trimmed.starts_with("process didn't exit successfully")
            && trimmed.contains("(signal: ")
        {
            self.killed.push(trimmed.to_owned());
        }
    }

    /// Ignored tests whose names are not in `allowed` (name, why).
    pub(crate) fn unexpected_ignored(&self, allowed: &[(&str, &str)]) -> Vec<&str> {
        self.ignored_names
            .iter()
            .map(String::as_str)
            .filter(|name| !allowed.iter().any(|(allowed, _)| name == allowed))
            .collect()
    }

    /// Test binaries that ended without a `test result:` line (a signal, an exit mid-run); at
    /// least one per kill cargo reported.
    pub(crate) fn unfinished(&self) -> u64 {
        self.started
            .saturating_sub(self.binaries)
            .max(self.killed.len() as u64)
    }

    /// Failed tests, each unfinished binary counted as one more.
    pub(crate) fn failed_with_unfinished(&self) -> u64 {
        self.failed + self.unfinished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_test_executables_with_their_package() {
        let root = Path::new("/w");
        let messages = [
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/steward-tcp-proxy#0.1.0","manifest_path":"/w/steward-tcp-proxy/Cargo.toml","target":{"kind":["test"],"src_path":"/w/steward-tcp-proxy/tests/chaos.rs"},"profile":{"test":true},"executable":"/w/target/debug/deps/chaos-1"}"#,
            // A library built for the tests above, not a test: no executable, no test profile.
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/proxy-core#0.1.0","manifest_path":"/w/proxy-core/Cargo.toml","target":{"kind":["lib"],"src_path":"/w/proxy-core/src/lib.rs"},"profile":{"test":false},"executable":null}"#,
            r#"{"reason":"compiler-artifact","package_id":"path+file:///w/xtask/testbox#netkit-testbox@0.1.0","manifest_path":"/w/xtask/testbox/Cargo.toml","target":{"kind":["bin"],"src_path":"/w/xtask/testbox/src/main.rs"},"profile":{"test":true},"executable":"/w/target/debug/deps/netkit_testbox-2"}"#,
            r#"{"reason":"build-finished","success":true}"#,
            "not json",
        ]
        .join("\n");
        let found = test_binaries(&messages, root);
        let labels: Vec<&str> = found.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "steward-tcp-proxy tests/chaos.rs",
                "netkit-testbox src/main.rs"
            ]
        );
        assert_eq!(found[1].package_dir, Path::new("/w/xtask/testbox"));
        assert_eq!(
            found[0].executable,
            Path::new("/w/target/debug/deps/chaos-1")
        );
    }

    fn run(label: &str) -> Run {
        Run {
            label: label.to_owned(),
            command: Command::new("true"),
        }
    }

    #[test]
    fn proxy_core_server_tests_run_again_on_the_other_data_path() {
        let binary = |label: &str| TestBinary {
            label: label.to_owned(),
            package: label.split(' ').next().unwrap_or_default().to_owned(),
            package_dir: PathBuf::from("/w"),
            executable: PathBuf::from("/w/t"),
        };
        // The default is the event loops on Linux: the second pass is tokio's.
        assert_eq!(
            other_data_path(&binary("proxy-core tests/server.rs")),
            Some("tokio")
        );
        for label in [
            "proxy-core tests/event_loop.rs",
            "proxy-core src/lib.rs",
            "steward-tcp-proxy tests/cli.rs",
        ] {
            assert_eq!(other_data_path(&binary(label)), None, "{label}");
        }
    }

    #[test]
    fn node_binaries_share_one_job_and_the_longest_start_first() {
        let runs = vec![
            run("a tests/short.rs"),
            run(NODE_BINARIES[0]),
            run("b tests/long.rs"),
            run(NODE_BINARIES[1]),
            run("c tests/new.rs"),
        ];
        let last = BTreeMap::from([
            ("a tests/short.rs".to_owned(), 1.0),
            ("b tests/long.rs".to_owned(), 50.0),
            (NODE_BINARIES[0].to_owned(), 20.0),
            (NODE_BINARIES[1].to_owned(), 10.0),
        ]);
        let jobs: Vec<Vec<String>> = plan(runs, &last)
            .into_iter()
            .map(|job| job.into_iter().map(|r| r.label).collect())
            .collect();
        assert_eq!(
            jobs,
            [
                vec!["c tests/new.rs".to_owned()],
                vec!["b tests/long.rs".to_owned()],
                vec![NODE_BINARIES[0].to_owned(), NODE_BINARIES[1].to_owned()],
                vec!["a tests/short.rs".to_owned()],
            ]
        );
    }

    #[test]
    fn a_failed_or_killed_run_fails_the_step() {
        let mut results = Results::default();
        let ok = std::process::Command::new("true").output();
        report(&mut results, "a tests/a.rs", Duration::ZERO, ok);
        assert_eq!(results.failed_runs, 0);
        let failed = std::process::Command::new("false").output();
        report(&mut results, "b tests/b.rs", Duration::ZERO, failed);
        let ok = std::process::Command::new("true").output();
        report(&mut results, "c tests/c.rs", Duration::ZERO, ok);
        assert_eq!(
            results.failed_runs, 1,
            "a later success does not undo a failure"
        );

        let mut results = Results::default();
        let killed = std::process::Command::new("sh")
            .args(["-c", "kill -9 $$"])
            .output();
        report(&mut results, "d tests/d.rs", Duration::ZERO, killed);
        assert_eq!(results.failed_runs, 1);
        assert_eq!(results.totals.killed.len(), 1);
        assert_eq!(results.totals.unfinished(), 1);
    }
}
