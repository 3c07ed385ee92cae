//! `cargo xtask test`: every check CI runs, in order, with a summary at the end.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;

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
    let root = crate::workspace_root();
    let mut steps: Vec<Step> = Vec::new();

    let started = Instant::now();
    // Before anything slow: a machine that cannot get these stops here, naming them.
    let packages = crate::envtest::install_packages(&TEST_PACKAGES, "cargo xtask test");
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

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut test_cmd = vec!["test", "--workspace", "--all-features", "--no-fail-fast"];
    if !args.test_args.is_empty() {
        test_cmd.push("--");
        test_cmd.extend(args.test_args.iter().map(String::as_str));
    }
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
            "cargo package (libraries)",
            // Offline: the earlier steps fetched every dependency; a registry hiccup must not
            // fail a check about our own manifests.
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
            vec![],
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
    let mut failed = false;
    let mut totals = TestTotals::default();
    for (name, cmd_args, envs) in plan {
        eprintln!("\n==> {name}");
        let started = Instant::now();
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(&root)
            .args(&cmd_args)
            .envs(envs)
            .env("KUBEBUILDER_ASSETS", &assets)
            .env("NETKIT_RELEASE_IMAGES", crate::image::images_dir(&root))
            .env(crate::tools::HELM_ENV, &helm);
        let status = if cmd_args.first() == Some(&"test") {
            run_counting(&mut cmd, &mut totals)?
        } else {
            cmd.status()?
        };
        steps.push(Step {
            name,
            duration: started.elapsed(),
            ok: status.success(),
        });
        failed |= !status.success();
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
        "cargo test: {} test binaries, {} ignored",
        totals.binaries, totals.ignored
    );
    // The closing line CI reads: every test of every test binary, summed.
    println!("tests: {} passed, {} failed", totals.passed, totals.failed);
    if failed {
        bail!("some checks failed");
    }
    Ok(())
}

#[derive(Default)]
struct TestTotals {
    binaries: u64,
    passed: u64,
    failed: u64,
    ignored: u64,
}

/// Runs `cargo test`, echoing its output while summing its `test result:` lines.
fn run_counting(
    cmd: &mut Command,
    totals: &mut TestTotals,
) -> anyhow::Result<std::process::ExitStatus> {
    use std::io::{BufRead as _, BufReader};
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn()?;
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            println!("{line}");
            if let Some(result) = line.strip_prefix("test result: ") {
                totals.binaries += 1;
                for part in result.split(';') {
                    let mut words = part.split_whitespace().rev();
                    let (Some(label), Some(count)) = (words.next(), words.next()) else {
                        continue;
                    };
                    let Ok(count) = count.parse::<u64>() else {
                        continue;
                    };
                    match label {
                        "passed" => totals.passed += count,
                        "failed" => totals.failed += count,
                        "ignored" => totals.ignored += count,
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(child.wait()?)
}
