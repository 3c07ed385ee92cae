//! schemathesis, driven by /api/openapi.json, finds no server error. Installs its pinned
//! version into ~/.cache/kube-netkit/python/schemathesis when missing.

use std::path::PathBuf;
use std::process::Command;

use netkit_testenv::fixtures::{cache_dir, python_venv};

use crate::support::{Env, Proxier};

const SCHEMATHESIS_VERSION: &str = "4.32.5";

fn schemathesis() -> PathBuf {
    let venv = cache_dir("python/schemathesis");
    python_venv(&venv, &[("schemathesis", SCHEMATHESIS_VERSION)])
        .unwrap_or_else(|e| panic!("installing schemathesis into {}: {e}", venv.display()))
        .with_file_name("st")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error() {
    let st = schemathesis();
    let env = Env::new("fuzz", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "web", "127.0.0.71", "fuzz-pod")
        .await;
    env.pod(&ns, "pending", "", None).await;
    let px = Proxier::start(&env, &crate::support::v1_v2_flags(2)).await;
    let token = env.debugger(&ns).await;
    let schema = format!("http://{}/api/openapi.json", px.api);
    // schemathesis keeps a cache in its working directory: not in the source tree.
    let workdir = tempfile::tempdir().unwrap();
    let cwd = workdir.path().to_owned();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(st)
            .current_dir(cwd)
            .args([
                "run",
                &schema,
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--no-color",
            ])
            .args(["--header", &format!("Authorization: Bearer {token}")])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // One worker: CPython 3.11's ast module is not thread-safe under schemathesis' workers.
    let tail: String = report
        .chars()
        .rev()
        .take(6000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(
        output.status.success(),
        "schemathesis found problems:\n{tail}"
    );
    // "N generated, N passed": something was actually sent.
    let summary = report
        .lines()
        .find(|l| l.contains(" generated, "))
        .unwrap_or_default();
    let generated: u32 = summary
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(generated >= 50 && !summary.contains("failed"), "{tail}");
    px.assert_never_forbidden().await;
}
