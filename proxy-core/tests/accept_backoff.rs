//! Running out of descriptors makes `accept` fail with EMFILE; the server must back off and
//! resume once descriptors are available again, without dropping the queued clients. In its
//! own test binary, since it lowers the descriptor limit of the whole process.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proxy_core::relay::Route;
use proxy_core::server::{ListenerConfig, ProxyServer};
use rustix::process::{Resource, getrlimit, setrlimit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

fn highest_fd() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .max()
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn accept_backs_off_on_emfile_and_recovers() {
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = ProxyServer::new(server_config(), observer.clone()).unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            Route::new("echo", echo.addr),
        ))
        .unwrap();
    let sockets: Vec<_> = (0..3).map(|_| TcpSocket::new_v4().unwrap()).collect();

    let original = getrlimit(Resource::Nofile);
    let mut exhausted = original;
    exhausted.current = Some(highest_fd() + 1);
    setrlimit(Resource::Nofile, exhausted).unwrap();
    // The limit caps descriptor numbers; fill the holes below it so none is left.
    let mut fillers = Vec::new();
    while let Ok(file) = std::fs::File::open("/dev/null") {
        fillers.push(file);
        assert!(fillers.len() < 100_000);
    }

    // The handshakes complete in the kernel; accept(2) cannot hand them out.
    let mut clients = Vec::new();
    for socket in sockets {
        clients.push(socket.connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        CountingObserver::get(&observer.opened),
        0,
        "nothing can be accepted at the limit"
    );

    setrlimit(Resource::Nofile, original).unwrap();
    drop(fillers);
    for client in &mut clients {
        client.write_all(b"back").await.unwrap();
        let mut reply = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(30), client.read_exact(&mut reply))
            .await
            .expect("served after the limit was restored")
            .unwrap();
        assert_eq!(&reply, b"back");
    }
    assert_eq!(CountingObserver::get(&observer.opened), 3);
}
