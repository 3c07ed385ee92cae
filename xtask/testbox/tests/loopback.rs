//! `serve` on loopback, exercised by the client commands and by raw sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const TESTBOX: &str = env!("CARGO_BIN_EXE_netkit-testbox");
const PAUSE: &str = env!("CARGO_BIN_EXE_netkit-pause");

/// Kills the child when a test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Server {
    process: Running,
    http: SocketAddr,
    tcp_echo: SocketAddr,
    udp_echo: SocketAddr,
}

/// Starts `serve` on free loopback ports and reads them from its `listening` line.
fn serve() -> Server {
    let mut child = Command::new(TESTBOX)
        .args(["serve", "--bind", "127.0.0.1", "--http-port", "0"])
        .args(["--tcp-echo-port", "0", "--udp-echo-port", "0"])
        .env("POD_NAME", "web-0")
        .env("POD_IP", "10.1.2.3")
        .env_remove("POD_NAMESPACE")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let stdout = child.stdout.take().expect("stdout");
    let process = Running(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the listening line");
    let address = |key: &str| -> SocketAddr {
        line.split_whitespace()
            .find_map(|field| field.strip_prefix(key))
            .unwrap_or_else(|| panic!("{key} in {line:?}"))
            .parse()
            .expect("address")
    };
    Server {
        http: address("http="),
        tcp_echo: address("tcp-echo="),
        udp_echo: address("udp-echo="),
        process,
    }
}

fn testbox(args: &[&str]) -> Output {
    Command::new(TESTBOX)
        .args(args)
        .output()
        .expect("run testbox")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn get_reports_the_pod_and_checks_the_status() {
    let server = serve();
    let output = testbox(&["get", &format!("http://{}/", server.http)]);
    assert!(output.status.success(), "{output:?}");
    let body: serde_json::Value = serde_json::from_str(&stdout(&output)).expect("JSON body");
    assert_eq!(body["pod"], "web-0");
    assert_eq!(body["ip"], "10.1.2.3");
    assert_eq!(body["namespace"], serde_json::Value::Null);
    let client: SocketAddr = body["client"]
        .as_str()
        .expect("client")
        .parse()
        .expect("address");
    assert_eq!(client.ip().to_string(), "127.0.0.1");

    let health = testbox(&["get", &format!("http://{}/healthz", server.http)]);
    assert!(health.status.success(), "{health:?}");
    assert_eq!(stdout(&health), "ok\n");

    let missing = format!("http://{}/missing", server.http);
    let output = testbox(&["get", &missing]);
    assert!(!output.status.success(), "a 404 must fail: {output:?}");
    let output = testbox(&["get", &missing, "--expect-status", "404"]);
    assert!(output.status.success(), "{output:?}");
    let output = testbox(&[
        "get",
        &format!("http://{}/", server.http),
        "--expect-status",
        "204",
    ]);
    assert!(
        !output.status.success(),
        "200 is not the expected 204: {output:?}"
    );
    drop(server.process);
}

#[test]
fn get_fails_when_nothing_listens() {
    // Bind then drop: a port that was just free is almost surely still free.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let output = testbox(&[
        "get",
        &format!("http://127.0.0.1:{port}/"),
        "--timeout-seconds",
        "5",
    ]);
    assert!(!output.status.success(), "{output:?}");
}

#[test]
fn tcp_check_round_trips_through_the_echo() {
    let server = serve();
    let target = server.tcp_echo.to_string();
    // More than the socket buffers hold, so writing and reading must overlap.
    let output = testbox(&["tcp-check", &target, "--bytes", "8000000", "--seed", "42"]);
    assert!(output.status.success(), "{output:?}");
    let line = stdout(&output);
    assert!(line.starts_with("tcp-check "), "{line}");
    assert!(line.contains(" bytes=8000000 "), "{line}");
    assert!(line.trim_end().ends_with(" result=ok"), "{line}");
    // A zero-byte check is just connect, half-close, EOF.
    let output = testbox(&["tcp-check", &target, "--bytes", "0"]);
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn tcp_check_fails_against_a_server_that_does_not_echo() {
    // Accepts, reads a little, answers with different bytes and closes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    let liar = std::thread::spawn(move || {
        use std::io::{Read as _, Write as _};
        let (mut stream, _) = listener.accept().expect("accept");
        let mut buffer = [0u8; 16];
        stream.read_exact(&mut buffer).expect("read");
        stream.write_all(&[0xAA; 16]).expect("write");
    });
    let output = testbox(&[
        "tcp-check",
        &address.to_string(),
        "--bytes",
        "16",
        "--seed",
        "1",
    ]);
    liar.join().expect("liar thread");
    assert!(!output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("result=mismatch"), "{output:?}");
}

#[test]
fn udp_echo_answers_raw_datagrams_and_udp_check() {
    let server = serve();
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    for payload in [&b"hello"[..], &[7u8; 1400][..]] {
        socket.send_to(payload, server.udp_echo).expect("send");
        let mut buffer = [0u8; 2048];
        let (n, from) = socket.recv_from(&mut buffer).expect("echo");
        assert_eq!(from, server.udp_echo);
        assert_eq!(&buffer[..n], payload);
    }
    let output = testbox(&["udp-check", &server.udp_echo.to_string(), "--count", "5"]);
    assert!(output.status.success(), "{output:?}");
    assert!(stdout(&output).contains("datagrams=5 "), "{output:?}");
}

#[test]
fn resolve_prints_addresses_and_fails_on_unknown_names() {
    let output = testbox(&["resolve", "localhost"]);
    assert!(output.status.success(), "{output:?}");
    let addresses: Vec<std::net::IpAddr> = stdout(&output)
        .lines()
        .map(|l| l.parse().expect("an IP per line"))
        .collect();
    assert!(addresses.iter().any(|a| a.is_loopback()), "{addresses:?}");
    let output = testbox(&["resolve", "no-such-host.invalid"]);
    assert!(!output.status.success(), "{output:?}");
}

#[test]
fn serve_exits_zero_on_sigterm() {
    let server = serve();
    let mut process = server.process;
    terminate(&process.0);
    let status = process.0.wait().expect("wait");
    assert!(status.success(), "{status:?}");
}

#[test]
fn pause_waits_for_sigterm_and_exits_zero() {
    let mut process = Running(Command::new(PAUSE).spawn().expect("spawn pause"));
    wait_for_sigterm_handler(&process.0);
    // Long enough to mean something: a pause that returned at once would be long gone.
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        process.0.try_wait().expect("try_wait").is_none(),
        "pause must keep running"
    );
    terminate(&process.0);
    let status = process.0.wait().expect("wait");
    assert!(status.success(), "{status:?}");
}

/// SIGTERM once the process has installed its handler.
fn terminate(child: &Child) {
    wait_for_sigterm_handler(child);
    let pid = rustix::process::Pid::from_raw(i32::try_from(child.id()).expect("pid")).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
}

/// Polls (bounded) until the kernel lists SIGTERM among the signals `child` catches (`SigCgt`
/// in /proc/PID/status), instead of sleeping and hoping it has.
fn wait_for_sigterm_handler(child: &Child) {
    const SIGTERM_BIT: u64 = 1 << (15 - 1);
    let path = format!("/proc/{}/status", child.id());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = std::fs::read_to_string(&path).unwrap_or_default();
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .unwrap_or(0);
        if caught & SIGTERM_BIT != 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {} did not install a SIGTERM handler within 30 s ({path}: {status})",
            child.id()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
