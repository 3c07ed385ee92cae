//! The API under slow and abusive clients: headers trickled a byte a second, more connections
//! than allowed, a body over the limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{self, Env, Proxier, backend, get_text};

const TRICKLERS: usize = 200;
const MAX_CONNECTIONS: usize = 220;
/// Long enough that a busy machine serves the other clients and counts the refusals while
/// every trickler still holds its connection.
const HEADER_TIMEOUT: Duration = Duration::from_secs(20);

/// Sends a request head one byte a second; returns how long after connecting the server closed.
async fn trickle(addr: std::net::SocketAddr, connected: Arc<AtomicUsize>) -> Option<Duration> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let start = Instant::now();
    connected.fetch_add(1, Ordering::Relaxed);
    let head =
        b"GET /health HTTP/1.1\r\nHost: pod-proxier\r\nUser-Agent: a-very-slow-client\r\n\r\n";
    let mut buf = [0u8; 512];
    for byte in head {
        if stream.write_all(&[*byte]).await.is_err() {
            return Some(start.elapsed());
        }
        // Whatever the server says (if anything), it ends with the connection closed.
        let read = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return Some(start.elapsed());
        }
    }
    None
}

/// Connects and waits for a whole answer without sending anything (for 5 s: well before the
/// header timeout would close a connection that was let in).
async fn idle_answer(addr: std::net::SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let mut text = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut text))
        .await
        .ok()?
        .ok()?;
    Some(String::from_utf8_lossy(&text).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickling_clients_neither_starve_others_nor_stay() {
    let env = Env::new("slow", 1).await;
    let px = Proxier::start(
        &env,
        &[
            "--enable-v1",
            "--header-read-timeout",
            &HEADER_TIMEOUT.as_secs().to_string(),
            "--max-api-connections",
            &MAX_CONNECTIONS.to_string(),
        ],
    )
    .await;
    let start = Instant::now();
    let connected = Arc::new(AtomicUsize::new(0));
    let tricklers: Vec<_> = (0..TRICKLERS)
        .map(|_| tokio::spawn(trickle(px.api, Arc::clone(&connected))))
        .collect();
    while connected.load(Ordering::Relaxed) < TRICKLERS {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "tricklers not connected within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // No wait for the server to accept them: the kernel queues finished handshakes in order and
    // the server accepts in that order, so every trickler holds its permit before any connection
    // made after this point is served or refused.

    // A normal client is answered while every trickler still holds its connection (checked
    // below): the slow clients do not make it wait for their header timeout. The latency
    // itself is a bench's figure, printed.
    let mut took = Vec::new();
    for _ in 0..10 {
        let asked = Instant::now();
        let (status, body) = get_text(px.api, "/health").await.unwrap();
        took.push(asked.elapsed());
        assert_eq!(status, 200, "{body}");
    }
    eprintln!("10 /health answers beside {TRICKLERS} tricklers, in {took:?}");

    // Over the cap, a connection is told so at once instead of waiting.
    let extra: Vec<_> = (0..40).map(|_| tokio::spawn(idle_answer(px.api))).collect();
    let mut busy = 0;
    for answer in extra {
        if let Some(text) = answer.await.unwrap() {
            assert!(text.starts_with("HTTP/1.1 503"), "{text}");
            let (_, body) = text.split_once("\r\n\r\n").unwrap();
            let body: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(body["code"], 50003, "{text}");
            busy += 1;
        }
    }
    let room = MAX_CONNECTIONS - TRICKLERS;
    assert!(
        (room - 5..=room).contains(&(40 - busy)),
        "{busy} of 40 connections over {TRICKLERS} refused with a cap of {MAX_CONNECTIONS}"
    );
    // Answered and counted while every trickler still held its connection.
    assert!(
        tricklers.iter().all(|t| !t.is_finished()),
        "a trickler finished before the other clients were served: the cap is not proven"
    );

    // The header-read timeout closes every trickler, not before it is due (and not never: a
    // generous bound, the head takes longer than that to trickle).
    let mut latest = Duration::ZERO;
    for trickler in tricklers {
        let closed = trickler
            .await
            .unwrap()
            .expect("a trickler outlived its head");
        assert!(
            closed >= HEADER_TIMEOUT - Duration::from_millis(500)
                && closed < HEADER_TIMEOUT + Duration::from_secs(30),
            "closed after {closed:?}"
        );
        latest = latest.max(closed);
    }
    eprintln!("every trickler closed by {latest:?} (header timeout {HEADER_TIMEOUT:?})");
    // Their connections are free again.
    let (status, _) = get_text(px.api, "/health").await.unwrap();
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413_and_creates_nothing() {
    let env = Env::new("big", 1).await;
    let ns = env.targets[0].clone();
    let pod = backend("127.0.0.23", "big-pod").await;
    env.pod(
        &ns,
        "web",
        "127.0.0.23",
        Some(("jprofiler-port", pod.port())),
    )
    .await;
    let px = Proxier::start(&env, &["--enable-v1", "--max-body-bytes", "1024"]).await;
    let token = env.debugger(&ns).await;
    let request = json!({"pod_name": format!("{ns}/web"), "time": 60}).to_string();
    // Valid JSON all the same: only its size is wrong. Then the same request within the limit
    // is served, so the 413 was only about the size.
    let padded = format!("{request}{}", " ".repeat(1024));
    for (body, expected, mappings) in [(padded, 413, 0), (request, 200, 1)] {
        let (status, answer) = support::request(
            px.api,
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some("application/json"),
            body.as_bytes(),
        )
        .await;
        assert_eq!(status, expected, "{answer}");
        if expected == 413 {
            assert_eq!(answer["code"], 10001);
            assert_eq!(answer["msg"], "request body is larger than 1024 bytes");
        }
        let list = env.mappings().list(&Default::default()).await.unwrap();
        assert_eq!(list.items.len(), mappings, "{:?}", list.items);
    }
    px.assert_never_forbidden().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_by_the_request_timeout() {
    let env = Env::new("slowbody", 1).await;
    let px = Proxier::start(&env, &["--enable-v1", "--request-timeout", "2s"]).await;
    let mut stream = TcpStream::connect(px.api).await.unwrap();
    let head = "POST /api/v1/mapping HTTP/1.1\r\nHost: pod-proxier\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 512];
    // One byte of the body a second, until the server answers (the body is 100 bytes).
    while started.elapsed() < Duration::from_secs(60) {
        if stream.write_all(b" ").await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
        if answer.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    // Not before the timeout; "after it" with a generous bound (the body alone would take
    // 100 s), the precision is a bench's figure.
    assert!(
        (Duration::from_millis(1500)..Duration::from_secs(30)).contains(&took),
        "answered after {took:?}"
    );
    eprintln!("a trickled body answered 503 after {took:?} (request timeout 2 s)");
}
