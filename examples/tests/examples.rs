//! Every example, built by `cargo test` and run briefly as a user would run it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// `target/<profile>/examples/<name>`, next to this test's own `deps/` directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(path.is_file(), "{} was not built", path.display());
    path
}

use netkit_testenv::fixtures::KillOnDrop as Running;

async fn echo_server() -> SocketAddr {
    netkit_testenv::fixtures::echo_server().await.unwrap()
}

fn free_port() -> u16 {
    netkit_testenv::fixtures::free_port().unwrap()
}

/// Sends `payload`, half-closes, and returns everything echoed back.
async fn round_trip(addr: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stream = loop {
        match TcpStream::connect(addr).await {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(err) => panic!("{addr} never accepted: {err}"),
        }
    };
    stream.write_all(payload).await.unwrap();
    stream.shutdown().await.unwrap();
    let mut echoed = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut echoed))
        .await
        .unwrap()
        .unwrap();
    echoed
}

/// Reads lines until one contains `needle`; returns it.
fn wait_for_line(out: &mut BufReader<ChildStdout>, needle: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "exited before printing {needle:?}"
        );
        if line.contains(needle) {
            return line;
        }
    }
}

#[tokio::test]
async fn tcp_relay_relays_to_its_upstream() {
    let upstream = echo_server().await;
    let listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let _relay = Running(
        Command::new(example("tcp_relay"))
            .args([
                "--listen",
                &listen.to_string(),
                "--upstream",
                &upstream.to_string(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert_eq!(
        round_trip(listen, b"hello through tcp_relay").await,
        b"hello through tcp_relay"
    );
}

#[tokio::test]
async fn port_mapper_maps_unmaps_and_quits_on_stdin_commands() {
    let upstream = echo_server().await;
    let port = free_port();
    let mut child = Command::new(example("port_mapper"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut mapper = Running(child);
    writeln!(stdin, "map {port} {upstream}").unwrap();
    wait_for_line(&mut out, "mapped");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    assert_eq!(round_trip(addr, b"mapped bytes").await, b"mapped bytes");
    writeln!(stdin, "unmap {port}").unwrap();
    wait_for_line(&mut out, &format!("unmapped {port}"));
    // Checked while the mapper still runs: its exit would close the port anyway.
    assert!(mapper.0.try_wait().unwrap().is_none(), "exited on unmap");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "port still mapped after unmap"
    );
    writeln!(stdin, "list").unwrap();
    writeln!(stdin, "quit").unwrap();
    drop(stdin);
    let rest: Vec<String> = out.lines().map(Result::unwrap).collect();
    assert!(
        !rest
            .iter()
            .any(|line| line.contains(&format!(":{port} ->"))),
        "still listed after unmap: {rest:?}"
    );
    assert!(
        rest.iter().any(|line| line.starts_with("stopped:")),
        "{rest:?}"
    );
    let status = mapper.0.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn rstream_expose_publishes_a_local_port_through_an_engine() {
    let engine = rstream_client::engine::LocalEngine::builder()
        .token("example-token")
        .start()
        .await
        .unwrap();
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), engine.ca_pem()).unwrap();
    let target = echo_server().await;
    let child = Command::new(example("rstream_expose"))
        .args([
            "--engine",
            &engine.engine_address(),
            "--token",
            "example-token",
        ])
        .args(["--target", &target.to_string()])
        .arg("--ca-file")
        .arg(ca.path())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _expose = Running(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let ingress = loop {
        let published = engine
            .tunnels()
            .into_iter()
            .filter_map(|t| engine.ingress_addr(&t.id?))
            .next();
        match published {
            Some(addr) => break addr,
            None if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            None => panic!("no tunnel was published"),
        }
    };
    assert_eq!(
        round_trip(ingress, b"through the tunnel").await,
        b"through the tunnel"
    );
}
