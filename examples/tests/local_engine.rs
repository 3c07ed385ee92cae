//! The `local_engine` example as a process: its events, a token revoked on stdin, and a restart
//! on the same address with the same certificate after SIGKILL.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rstream_client::tls::TlsOptions;
use rstream_client::{Client, EngineErrorCode};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// `target/<profile>/examples/local_engine`, next to this test's own `deps/` directory.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/local_engine");
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

const LIMIT: Duration = Duration::from_secs(30);

/// Reads lines until one starts with `prefix` (within [`LIMIT`]); returns it.
async fn line(out: &mut Lines<BufReader<ChildStdout>>, prefix: &str) -> String {
    let started = Instant::now();
    loop {
        let next = tokio::time::timeout(LIMIT.saturating_sub(started.elapsed()), out.next_line())
            .await
            .unwrap_or_else(|_| panic!("no line {prefix:?} within {LIMIT:?}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the engine's stdout ended before a line {prefix:?}"));
        if next.starts_with(prefix) {
            return next;
        }
    }
}

fn start(
    listen: &str,
    identity: &std::path::Path,
    ca: &std::path::Path,
) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(example())
        .args(["--listen", listen, "--token", "old", "--identity"])
        .arg(identity)
        .arg("--ca-out")
        .arg(ca)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, out)
}

fn client(addr: &str, ca: &std::path::Path, token: &str) -> Client {
    Client::builder()
        .engine(addr)
        .token(token)
        .tls(TlsOptions::new().ca_file(ca).unwrap())
        .operation_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

#[tokio::test]
async fn events_token_revocation_and_a_restart_after_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let (identity, ca) = (dir.path().join("engine.json"), dir.path().join("ca.pem"));
    let (mut engine, mut out) = start("127.0.0.1:0", &identity, &ca);
    let addr = line(&mut out, "listening ").await["listening ".len()..].to_owned();

    let old = client(&addr, &ca, "old").connect().await.unwrap();
    let accepted = line(&mut out, "login ").await;
    assert_eq!(accepted, format!("login {} accepted old", old.client_id()));
    let err = client(&addr, &ca, "new").connect().await.unwrap_err();
    assert_eq!(
        err.engine_code(),
        Some(EngineErrorCode::Unauthorized),
        "{err}"
    );
    assert_eq!(line(&mut out, "login ").await, "login - refused new");

    // Rotation: accept both, log in with the new one, revoke the old one.
    let stdin = engine.stdin.as_mut().unwrap();
    stdin.write_all(b"tokens old new\n").await.unwrap();
    assert_eq!(line(&mut out, "auth ").await, "auth old new");
    let new = client(&addr, &ca, "new").connect().await.unwrap();
    assert_eq!(
        line(&mut out, "login ").await,
        format!("login {} accepted new", new.client_id())
    );
    stdin.write_all(b"tokens new\n").await.unwrap();
    assert_eq!(
        line(&mut out, "closed ").await,
        format!("closed {}", old.client_id())
    );
    tokio::time::timeout(LIMIT, old.wait_closed())
        .await
        .unwrap()
        .ok();
    assert!(!new.is_closed());

    // SIGKILL, then the same address and identity (the certificate the client trusts).
    engine.start_kill().unwrap();
    engine.wait().await.unwrap();
    tokio::time::timeout(LIMIT, new.wait_closed())
        .await
        .unwrap()
        .ok();
    let (_engine, mut out) = start(&addr, &identity, &ca);
    assert_eq!(
        line(&mut out, "listening ").await,
        format!("listening {addr}")
    );
    let again = client(&addr, &ca, "old").connect().await.unwrap();
    assert_eq!(
        line(&mut out, "login ").await,
        format!("login {} accepted old", again.client_id())
    );
    again.close().await.unwrap();
}
